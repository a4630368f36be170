"""Both MoE families against the float64 oracle (support.moe_oracle: transformers' own model
with its routers in float64, the hybrid's delta rule and conv by fasttrain.ops.reference).

The rollout's log-probs of the tokens it sampled equal the oracle's full forward; its routing record
holds the oracle's own top-k sets; the update's shared-prefix forward equals the oracle. Routing
replay with a moved router (a perturbed router, the same in both models): with replay the update's
log-probs equal the oracle forced to the rollout's experts, without it the oracle routing by
itself; the logged disagreement equals the oracle's count of differing top-k sets; a trained
router gets a gradient through the replayed weights; checkpointing changes nothing.

Tolerance (as tests/rollout/test_hybrid_decoder.py): float64 throughout, so paths differ only in
rounding order: layers·(H + 2·S·D)·u·1e3 (u = 2^-53, 1e3 bounding the magnitudes summed; derived in
support/tolerances.py), plus 8·u32·(max|z| + log V) for the rollout's float32 log-softmax."""

import pytest
import torch

from fasttrain.nn.moe_experts import moe_blocks
from fasttrain.rollout import sample
from fasttrain.rollout.moe_routing import ReplayRouting

from support.moe_pairs import (FAMILIES, PROMPTS, forwarded, move_router, oracle_forward, oracle_tol, pair,
                               sets_differ, update_logprobs)
from support.tolerances import fp32_logsoftmax_tol


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rollout_record_and_update_equal_the_oracle(family):
    hf, model = pair(family)
    roll = sample(model, PROMPTS, group_size=2, max_new_tokens=6, temperature=1.0, eos_token_ids=[2], seed=0)
    S = roll.input_ids.shape[1]
    lp, rec = oracle_forward(hf, roll)
    want = lp.gather(2, roll.completion_ids[..., None])[..., 0]
    m = roll.completion_mask
    fp32 = fp32_logsoftmax_tol(lp)
    assert (roll.logprobs.double() - want)[m].abs().max() <= oracle_tol(hf, S) + fp32
    assert (update_logprobs(model, roll) - want)[m].abs().max() <= oracle_tol(hf, S)
    fwd = forwarded(roll)
    assert roll.routing.shape == (*roll.input_ids.shape, len(moe_blocks(model)), hf.config.num_experts_per_tok)
    for i, own in enumerate(rec.chosen):
        assert not sets_differ(own.view(*fwd.shape, -1)[fwd], roll.routing[:, :, i][fwd]).any(), i


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replay_on_a_moved_router_equals_the_oracle_with_the_rollouts_routing(family):
    hf, model = pair(family)
    roll = sample(model, PROMPTS, group_size=2, max_new_tokens=6, temperature=1.0, eos_token_ids=[2], seed=0)
    B, S = roll.input_ids.shape
    move_router(hf, model)                                # the router moves between rollout and update
    forced = [roll.routing[:, :, i].long().reshape(B * S, -1) for i in range(roll.routing.shape[2])]
    lp_forced, _ = oracle_forward(hf, roll, forced)
    lp_own, own = oracle_forward(hf, roll)
    m = roll.completion_mask
    tol = oracle_tol(hf, S)
    got = {}
    for replay in (True, False):
        r = ReplayRouting(roll.routing, replay=replay)
        got[replay] = update_logprobs(model, roll, r)
        want = (lp_forced if replay else lp_own).gather(2, roll.completion_ids[..., None])[..., 0]
        assert (got[replay] - want)[m].abs().max() <= tol, replay
        differ, pairs, load = r.counts(hf.config.num_experts)
        fwd = forwarded(roll)
        oracle = sum(int(sets_differ(c.view(B, S, -1)[fwd], roll.routing[:, :, i][fwd]).sum())
                     for i, c in enumerate(own.chosen))
        assert (differ, pairs) == (oracle, int(fwd.sum()) * len(own.chosen)) and differ > 0
        assert int(load.sum()) == pairs * hf.config.num_experts_per_tok
    assert (got[True] - got[False])[m].abs().max() > 1e3 * tol         # the two modes are told apart


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_trained_router_gets_a_gradient_through_replay_and_checkpointing_changes_nothing(family):
    from fasttrain.models.moe import train_router
    from fasttrain.nn import attach_adapters
    _, model = pair(family)
    roll = sample(model, PROMPTS, group_size=2, max_new_tokens=5, temperature=1.0, eos_token_ids=[2], seed=0)
    torch.manual_seed(0)
    params = attach_adapters(model, r=2, alpha=4.0, targets=["experts", "q_proj"])
    for p in params:
        if p.dim() == 3:
            torch.nn.init.normal_(p, std=0.1)                   # B != 0: the expert LoRA acts
    params += train_router(model, True)
    model.train()
    grads = []
    for ckpt in (False, True):
        if ckpt:
            model.activation_checkpointing_enable({"use_reentrant": False})
        for p in params:
            p.grad = None
        lp = update_logprobs(model, roll, ReplayRouting(roll.routing))
        (lp * roll.completion_mask).sum().backward()
        grads.append([p.grad.clone() for p in params])
    router = [g for g, p in zip(grads[0], params) if p.dim() == 2 and p.shape[0] == 8]
    assert router and all(float(g.abs().sum()) > 0 for g in router)
    for a, b in zip(*grads):
        assert torch.equal(a, b)                          # the recompute repeats the same operations
