"""Every training consumer reads the action mask: the same answer with and without a tool turn
gives the same loss, KL, REPO-R statistics, top-entropy tokens, token counts and mean entropy over
the model's tokens. The tool tokens carry extreme values, so any consumer that read them would
move. One test per consumer, each against the answer without the tool turn."""
import pytest
import torch

from fasttrain.ops import policy_loss
from fasttrain.rl.masks import token_stats, top_entropy_mask
from fasttrain.train import distributed

pytestmark = pytest.mark.one_thread      # the one-thread default (tests/conftest.py)

B, T_MODEL, TOOL_AT, TOOL_LEN = 4, 7, 3, 5
# The op computes in fp32: sums over the 26 model tokens may group differently around the tool
# tokens' exact zeros, so values agree to n * unit roundoff (n = 26 < 32) of the sum's scale.
REL = 32 * 2.0 ** -24


def _model_tokens(seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T_MODEL, generator=g, dtype=torch.float32) * 3
    old = logp + 0.2 * (torch.rand(B, T_MODEL, generator=g, dtype=torch.float32) - 0.5)
    ref = logp + 0.3 * (torch.rand(B, T_MODEL, generator=g, dtype=torch.float32) - 0.5)
    ent = torch.rand(B, T_MODEL, generator=g, dtype=torch.float32) * 4
    adv = torch.randn(B, generator=g, dtype=torch.float32)
    mask = torch.ones(B, T_MODEL, dtype=torch.bool)
    mask[1, 5:] = False                                  # a shorter answer
    return logp, old, ref, ent, adv, mask


def _with_tool_turn(x, fill):
    """x [B, T_MODEL] with TOOL_LEN tool tokens of value `fill` inserted at TOOL_AT."""
    tool = torch.full((x.shape[0], TOOL_LEN), fill, dtype=x.dtype)
    return torch.cat([x[:, :TOOL_AT], tool, x[:, TOOL_AT:]], 1)


def _both():
    logp, old, ref, ent, adv, mask = _model_tokens()
    plain = dict(logp=logp, old=old, ref=ref, ent=ent, action=mask, exists=mask)
    tooled = dict(logp=_with_tool_turn(logp, -40.0), old=_with_tool_turn(old, 0.0), ref=_with_tool_turn(ref, 9.0),
                  ent=_with_tool_turn(ent, 50.0), action=_with_tool_turn(mask, False),
                  exists=_with_tool_turn(mask, True))
    return plain, tooled, adv


@pytest.mark.parametrize("kind", ["cispo", "dapo", "grpo"])
def test_policy_loss_kl_and_repo_r_read_only_the_models_tokens(kind):
    plain, tooled, adv = _both()
    out = []
    for d in (plain, tooled):
        n = d["action"].sum() if kind != "grpo" else d["action"].any(1).sum()
        loss, stats = policy_loss(d["logp"], d["old"], adv, d["action"], loss=kind, ref_logp=d["ref"], beta=0.04,
                                  zeta=0.01, token_normalizer=n.to(torch.float64))
        out.append((float(loss), {k: float(v) for k, v in stats.items()}))
    (l0, s0), (l1, s1) = out
    assert l1 == pytest.approx(l0, rel=REL, abs=REL)
    for k in s0:                                         # KL mean, REPO-R factor, clip fractions, counts
        assert s1[k] == pytest.approx(s0[k], rel=REL, abs=REL), k


def test_policy_loss_gradient_is_zero_on_tool_tokens_and_equal_on_the_models():
    plain, tooled, adv = _both()
    grads = []
    for d in (plain, tooled):
        lp = d["logp"].clone().requires_grad_(True)
        loss, _ = policy_loss(lp, d["old"], adv, d["action"], loss="cispo", ref_logp=d["ref"], beta=0.04,
                              token_normalizer=d["action"].sum().to(torch.float64))
        loss.backward()
        grads.append(lp.grad)
    g0, g1 = grads
    assert torch.all(g1[:, TOOL_AT:TOOL_AT + TOOL_LEN] == 0)
    keep = torch.ones(g1.shape[1], dtype=torch.bool)
    keep[TOOL_AT:TOOL_AT + TOOL_LEN] = False
    assert torch.allclose(g1[:, keep], g0, rtol=REL, atol=0)


def test_the_top_entropy_tokens_are_the_same_model_tokens():
    plain, tooled, _ = _both()
    m0 = top_entropy_mask(plain["ent"], plain["action"], rho=0.3)
    m1 = distributed.top_entropy_mask(tooled["ent"], tooled["action"], 0.3)   # what the trainer calls
    assert not m1[:, TOOL_AT:TOOL_AT + TOOL_LEN].any()
    keep = torch.ones(m1.shape[1], dtype=torch.bool)
    keep[TOOL_AT:TOOL_AT + TOOL_LEN] = False
    assert torch.equal(m1[:, keep], m0) and int(m0.sum()) == 8      # ceil(0.3 * 26) of the 26 model tokens


def test_token_counts_mean_length_and_the_thermostats_entropy_count_model_tokens():
    plain, tooled, _ = _both()
    s0 = token_stats(plain["ent"], plain["action"], plain["action"])
    s1 = token_stats(tooled["ent"], tooled["action"], tooled["action"])
    assert s0[:2] == s1[:2] == [26.0, 26.0]
    assert s1[2] == pytest.approx(s0[2], rel=REL)
    assert float(tooled["exists"].sum()) == 26 + B * TOOL_LEN           # the tokens exist all the same
