"""top_entropy_mask: keeps exactly ceil(rho * n) of the batch's active tokens, the highest-entropy ones."""
import math

import pytest
import torch

from fasttrain.rl.masks import top_entropy_mask


def test_hand_case_over_the_whole_batch():
    ent = torch.tensor([[0.1, 5.0, 0.3, 9.0, 2.0],
                        [4.0, 0.2, 7.0, 8.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0, 1],    # 9.0 is padding: never kept
                         [1, 1, 1, 1, 0]], dtype=torch.bool)
    keep = top_entropy_mask(ent, mask, rho=0.3)  # 8 active tokens -> ceil(2.4) = 3: 8.0, 7.0, 5.0
    want = torch.zeros_like(mask)
    want[1, 3] = want[1, 2] = want[0, 1] = True
    assert torch.equal(keep, want)
    assert torch.equal(top_entropy_mask(ent, mask, rho=1.0), mask)


@pytest.mark.parametrize("rho", [0.05, 0.2, 0.5, 0.99])
def test_count_and_threshold_invariants(rho):
    ent = torch.rand(16, 40).pow(3) * 4
    mask = torch.rand(16, 40) < 0.7
    keep = top_entropy_mask(ent, mask.float(), rho=rho)
    n = int(mask.sum())
    assert int(keep.sum()) == math.ceil(rho * n)
    assert not (keep & ~mask).any()
    # Every kept token's entropy >= every dropped active token's entropy.
    assert ent[keep].min() >= ent[mask & ~keep].max()


def test_ties_keep_exactly_k_by_position_and_rho_times_n_integer():
    ent = torch.ones(2, 5)
    keep = top_entropy_mask(ent, torch.ones(2, 5), rho=0.2)  # 0.2 * 10 = 2 exactly (no float round-up to 3)
    assert int(keep.sum()) == 2 and keep[0, 0] and keep[0, 1]


def test_no_active_tokens_and_bad_args():
    assert not top_entropy_mask(torch.rand(3, 4), torch.zeros(3, 4)).any()
    with pytest.raises(ValueError, match="rho"):
        top_entropy_mask(torch.rand(3, 4), torch.ones(3, 4), rho=0.0)
    with pytest.raises(ValueError, match="mask"):
        top_entropy_mask(torch.rand(3, 4), torch.ones(3, 5))
