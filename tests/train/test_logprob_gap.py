"""rollout_logprob_gap: the rollout's behaviour log-probs of the sampled tokens against the update's
forward on the same (pre-update) policy, for both families.

float32: the two paths compute one function with different operation orders, so their gap is
bounded by the first-order rounding of the longest sums: layers·(H + 2·S·D)·u32·M (S the sequence,
D the head dim, u32 = 2^-24) with M = 1 for unit-scale activations (RMS-normed inputs, weights of
std <= 1/sqrt(H)), plus the float32 log-softmax's 8·u32·(|log p| + log V).
bf16: the hybrid's gap (Gated DeltaNet state in float32 in both: the one-token step in the rollout, the sequence form in the update) is
at most twice the gap of a plain transformer of the same size measured the same way."""
import math

import pytest
import torch

from fasttrain.models import tiny_llama, tiny_qwen3_5
from fasttrain.rl.logprob_gap import logprob_gap_parts
from fasttrain.rollout import sample
from fasttrain.train.policy_update import answer_logprobs

pytestmark = pytest.mark.one_thread         # tiny models (tests/conftest.py)

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10]]


def test_gap_parts_by_hand():
    b = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]])
    u = torch.tensor([[-1.5, -2.0, -9.0], [-0.5, -1.25, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert logprob_gap_parts(b, u, m) == (1.5, 1.0, 4)
    assert logprob_gap_parts(b, u, torch.zeros_like(m)) == (0.0, 0.0, 0)
    with pytest.raises(ValueError, match="shapes"):
        logprob_gap_parts(b, u[:1], m)


def gap(model, T=24):
    r = sample(model, PROMPTS, group_size=4, max_new_tokens=T, temperature=1.0, eos_token_ids=[], seed=3)
    with torch.no_grad():
        lp, _ = answer_logprobs(model, r.input_ids, r.attention_mask, r.prompt_len, r.completion_ids,
                                r.completion_mask, 1.0, position_ids=r.position_ids, prompt_index=r.prompt_index)
    total, top, n = logprob_gap_parts(r.logprobs, lp, r.completion_mask)
    return total / n, top, float(lp[r.completion_mask].abs().max())


@pytest.mark.parametrize("family", ["hybrid", "llama"])
def test_float32_gap_within_the_rounding_bound(family):
    make = tiny_qwen3_5 if family == "hybrid" else tiny_llama
    model = make(vocab_size=97, layers=4, hidden=64, seed=0, dtype=torch.float32)
    mean, top, lp_max = gap(model)
    S = max(map(len, PROMPTS)) + 24
    u = 2.0 ** -24
    bound = 4 * (64 + 2 * S * 16) * u + 8 * u * (lp_max + math.log(97))
    assert 0 < top <= bound and mean <= top


def test_bf16_hybrid_gap_at_most_twice_a_plain_transformers():
    h = [gap(tiny_qwen3_5(vocab_size=97, layers=4, hidden=64, seed=s, dtype=torch.bfloat16)) for s in (0, 1)]
    p = [gap(tiny_llama(vocab_size=97, layers=4, hidden=64, seed=s, dtype=torch.bfloat16)) for s in (0, 1)]
    h_mean, p_mean = sum(x[0] for x in h) / 2, sum(x[0] for x in p) / 2
    h_max, p_max = max(x[1] for x in h), max(x[1] for x in p)
    assert h_mean <= 2 * p_mean and h_max <= 2 * p_max, (h_mean, p_mean, h_max, p_max)

