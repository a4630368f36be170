"""Both MoE families against the float64 oracle (fasttrain.models.moe_oracle: transformers' own model
with its routers in float64, the hybrid's delta rule and conv by fasttrain.ops.reference).

The rollout's log-probs of the tokens it sampled equal the oracle's full forward; its routing record
holds the oracle's own top-k sets; the update's shared-prefix forward equals the oracle. Routing
replay with a moved router (a perturbed router, the same in both models): with replay the update's
log-probs equal the oracle forced to the rollout's experts, without it the oracle routing by
itself; the logged disagreement equals the oracle's count of differing top-k sets; a trained
router gets a gradient through the replayed weights; checkpointing changes nothing.

Tolerance (as tests/rollout/test_hybrid_decoder.py): float64 throughout, so paths differ only in
rounding order: layers·(H + 2·S·D)·u·1e3 (u = 2^-53, 1e3 bounding the magnitudes summed), plus
8·u32·(max|z| + log V) for the rollout's float32 log-softmax."""
import copy
import math
from contextlib import ExitStack

import pytest
import torch

from fasttrain.models.hf_oracle import hf_float64_oracle
from fasttrain.models.moe import moe_surgery
from fasttrain.models.moe_oracle import hf_routing
from fasttrain.models.moe_tiny import tiny_qwen3_5_moe, tiny_qwen3_moe
from fasttrain.nn.moe_experts import moe_blocks
from fasttrain.rollout import sample
from fasttrain.rollout.moe_routing import ReplayRouting
from fasttrain.train.policy_update import answer_logprobs

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
FAMILIES = {"qwen3_moe": tiny_qwen3_moe, "qwen3_5_moe": tiny_qwen3_5_moe}


def _pair(family):
    hf = FAMILIES[family](vocab_size=97, dtype=torch.float64)
    return hf, moe_surgery(copy.deepcopy(hf), nf4=False)


def _tol(model, S):
    c = model.config
    D = max(getattr(c, "head_dim", 16), getattr(c, "linear_key_head_dim", 0))
    return c.num_hidden_layers * (c.hidden_size + 2 * S * D) * 2.0**-53 * 1e3


def _oracle(hf, roll, forced=None):
    P, T = roll.prompt_len, roll.completion_ids.shape[1]
    with ExitStack() as st, torch.no_grad():
        if hf.config.model_type.startswith("qwen3_5"):
            st.enter_context(hf_float64_oracle("qwen3_5_moe"))
        rec = st.enter_context(hf_routing(hf, forced))
        lp = hf(roll.input_ids, attention_mask=roll.attention_mask, position_ids=roll.position_ids).logits.log_softmax(-1)
    return lp[:, P - 1:P - 1 + T], rec


def _move_router(hf, model, scale: float = 0.1, seed: int = 1) -> None:
    """The same random step on every MoE layer's router of the oracle and of fasttrain's model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
                model.get_parameter(name).copy_(p)


def _update(model, roll, routing=None):
    return answer_logprobs(model, roll.input_ids, roll.attention_mask, roll.prompt_len, roll.completion_ids,
                           roll.completion_mask, 1.0, position_ids=roll.position_ids, prompt_index=roll.prompt_index,
                           routing=routing)[0]


def _forwarded(roll):
    """[B, S] the tokens the update forwards (each distinct prompt once, the answers' inputs), real only."""
    B, S = roll.input_ids.shape
    P = roll.prompt_len
    m = torch.zeros(B, S, dtype=torch.bool)
    first = torch.unique(roll.prompt_index, return_inverse=False)
    rows = torch.tensor([int((roll.prompt_index == g).nonzero()[0]) for g in first])
    m[rows, :P] = True
    m[:, P:S - 1] = True
    return m & roll.attention_mask.bool()


def _sets_differ(a, b):
    return (a.long().sort(-1)[0] != b.long().sort(-1)[0]).any(-1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rollout_record_and_update_equal_the_oracle(family):
    hf, model = _pair(family)
    roll = sample(model, PROMPTS, group_size=2, max_new_tokens=6, temperature=1.0, eos_token_ids=[2], seed=0)
    S = roll.input_ids.shape[1]
    lp, rec = _oracle(hf, roll)
    want = lp.gather(2, roll.completion_ids[..., None])[..., 0]
    m = roll.completion_mask
    fp32 = 8 * 2.0**-24 * (float(lp.abs().max()) + math.log(lp.shape[-1]))
    assert (roll.logprobs.double() - want)[m].abs().max() <= _tol(hf, S) + fp32
    assert (_update(model, roll) - want)[m].abs().max() <= _tol(hf, S)
    fwd = _forwarded(roll)
    assert roll.routing.shape == (*roll.input_ids.shape, len(moe_blocks(model)), hf.config.num_experts_per_tok)
    for i, own in enumerate(rec.chosen):
        assert not _sets_differ(own.view(*fwd.shape, -1)[fwd], roll.routing[:, :, i][fwd]).any(), i


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replay_on_a_moved_router_equals_the_oracle_with_the_rollouts_routing(family):
    hf, model = _pair(family)
    roll = sample(model, PROMPTS, group_size=2, max_new_tokens=6, temperature=1.0, eos_token_ids=[2], seed=0)
    B, S = roll.input_ids.shape
    _move_router(hf, model)                                # the router moves between rollout and update
    forced = [roll.routing[:, :, i].long().reshape(B * S, -1) for i in range(roll.routing.shape[2])]
    lp_forced, _ = _oracle(hf, roll, forced)
    lp_own, own = _oracle(hf, roll)
    m = roll.completion_mask
    tol = _tol(hf, S)
    got = {}
    for replay in (True, False):
        r = ReplayRouting(roll.routing, replay=replay)
        got[replay] = _update(model, roll, r)
        want = (lp_forced if replay else lp_own).gather(2, roll.completion_ids[..., None])[..., 0]
        assert (got[replay] - want)[m].abs().max() <= tol, replay
        differ, pairs, load = r.counts(hf.config.num_experts)
        fwd = _forwarded(roll)
        oracle = sum(int(_sets_differ(c.view(B, S, -1)[fwd], roll.routing[:, :, i][fwd]).sum())
                     for i, c in enumerate(own.chosen))
        assert (differ, pairs) == (oracle, int(fwd.sum()) * len(own.chosen)) and differ > 0
        assert int(load.sum()) == pairs * hf.config.num_experts_per_tok
    assert (got[True] - got[False])[m].abs().max() > 1e3 * tol         # the two modes are told apart


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_trained_router_gets_a_gradient_through_replay_and_checkpointing_changes_nothing(family):
    from fasttrain.models.moe import train_router
    from fasttrain.nn import attach_adapters
    _, model = _pair(family)
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
        lp = _update(model, roll, ReplayRouting(roll.routing))
        (lp * roll.completion_mask).sum().backward()
        grads.append([p.grad.clone() for p in params])
    router = [g for g, p in zip(grads[0], params) if p.dim() == 2 and p.shape[0] == 8]
    assert router and all(float(g.abs().sum()) > 0 for g in router)
    for a, b in zip(*grads):
        assert torch.equal(a, b)                          # the recompute repeats the same operations
