"""moe.router_aux_loss_coef: the load-balancing loss fasttrain adds is transformers' own.

On both families in float64, the aux loss of fasttrain's shared-prefix update forward (each distinct
prompt once, weighted by its answers; the rollout's experts replayed) equals transformers'
`aux_loss` (load_balancing_loss_func over its router logits) of its full forward over the same rows
and tokens with the same experts forced. transformers sums the router probabilities in float32:
|Δ| <= (n + 2)·u32·aux for n = layers x tokens summed (each term a probability <= 1, rounded once to
float32, then summed; the counts are exact). Through update_policy, the coefficient adds exactly
coef x that loss to the pass's loss and changes the trained router's gradient, which gradient
checkpointing leaves bit for bit the same."""
import copy
from contextlib import ExitStack

import pytest
import torch

from fasttrain.models.moe import moe_surgery, train_router
from fasttrain.models.moe_tiny import tiny_qwen3_5_moe, tiny_qwen3_moe
from fasttrain.rollout import sample
from fasttrain.rollout.moe_routing import ReplayRouting
from fasttrain.train.config import LossSection
from fasttrain.train.policy_update import BatchScores, answer_logprobs, update_policy

from support.hf_oracle import hf_float64_oracle
from support.moe_oracle import hf_routing

pytestmark = pytest.mark.one_thread      # the one-thread default (tests/conftest.py)

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
FAMILIES = {"qwen3_moe": tiny_qwen3_moe, "qwen3_5_moe": tiny_qwen3_5_moe}


def _setup(family):
    hf = FAMILIES[family](vocab_size=97, dtype=torch.float64)
    model = moe_surgery(copy.deepcopy(hf), nf4=False)
    roll = sample(model, PROMPTS, group_size=2, max_new_tokens=5, temperature=1.0, eos_token_ids=[2], seed=0)
    return hf, model, roll


def _transformers_aux(hf, roll):
    """transformers' aux_loss over the columns the update forwards (all but the last), experts forced."""
    S = roll.input_ids.shape[1] - 1
    forced = [roll.routing[:, :S, i].long().reshape(-1, roll.routing.shape[-1]) for i in range(roll.routing.shape[2])]
    with ExitStack() as st, torch.no_grad():
        if hf.config.model_type.startswith("qwen3_5"):
            st.enter_context(hf_float64_oracle("qwen3_5_moe"))
        st.enter_context(hf_routing(hf, forced))
        out = hf(roll.input_ids[:, :S], attention_mask=roll.attention_mask[:, :S],
                 position_ids=roll.position_ids[:, :S], output_router_logits=True)
    tokens = int(roll.attention_mask[:, :S].sum()) * len(forced)
    return out.aux_loss, (tokens + 2) * 2.0 ** -24


class _Unweighted(ReplayRouting):
    """Each forwarded prompt token counted once, not once per answer."""

    def token_order(self, first, P, A, valid, weight=None):
        super().token_order(first, P, A, valid)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_update_forwards_aux_loss_equals_transformers(family):
    hf, model, roll = _setup(family)
    rec = ReplayRouting(roll.routing, replay=True, aux=True)
    with torch.no_grad():
        answer_logprobs(model, roll.input_ids, roll.attention_mask, roll.prompt_len, roll.completion_ids,
                        roll.completion_mask, 1.0, position_ids=roll.position_ids, prompt_index=roll.prompt_index,
                        routing=rec)
    got = rec.aux_loss(hf.config.num_experts, hf.config.num_experts_per_tok)
    want, rel = _transformers_aux(hf, roll)
    assert got.dtype == torch.float64 and abs(float(got) - float(want)) <= rel * float(want)
    flat = _Unweighted(roll.routing, replay=True, aux=True)
    with torch.no_grad():
        answer_logprobs(model, roll.input_ids, roll.attention_mask, roll.prompt_len, roll.completion_ids,
                        roll.completion_mask, 1.0, position_ids=roll.position_ids, prompt_index=roll.prompt_index,
                        routing=flat)
    assert abs(float(flat.aux_loss(hf.config.num_experts, hf.config.num_experts_per_tok)) - float(want)) \
        > rel * float(want)                                                # the row weights are needed


def test_the_coefficient_adds_coef_times_the_aux_loss_and_moves_the_router_gradient(monkeypatch):
    monkeypatch.setenv("FASTTRAIN_KERNELS", "reference")                  # the policy loss in float64 too
    hf, model, roll = _setup("qwen3_moe")
    params = train_router(model, True)
    opt = torch.optim.SGD(params, lr=0.0)
    B = roll.completion_ids.shape[0]
    adv = torch.linspace(-1, 1, B, dtype=torch.float64)
    loss_cfg = LossSection(beta=0.0, token_mask="all")
    out, grads = {}, {}
    for coef, ckpt in ((0.0, False), (0.5, False), (0.5, True)):
        if ckpt:                                       # the checkpoint recompute keeps the aux loss's graph
            model.activation_checkpointing_enable({"use_reentrant": False})
        key = (coef, ckpt)
        grads[key] = []
        hook = [p.register_hook(lambda g, c=key: grads[c].append(g.clone())) for p in params]
        out[key] = update_policy(model, params, opt, roll, BatchScores(None, None, None), adv,
                                 roll.action_mask.bool(), loss_cfg, 0.0, B, 0.0, 1.0,
                                 router_aux_loss_coef=coef).passes[0]
        for h in hook:
            h.remove()
    aux = out[(0.5, False)]["moe_router_aux_loss"]
    want, rel = _transformers_aux(hf, roll)
    assert abs(aux - float(want)) <= rel * float(want) and "moe_router_aux_loss" not in out[(0.0, False)]
    base = out[(0.0, False)]["loss"]
    assert abs(out[(0.5, False)]["loss"] - base - 0.5 * aux) <= 1e-12 * (1 + abs(base))
    assert all(float((a - b).abs().max()) > 0 for a, b in zip(grads[(0.5, False)], grads[(0.0, False)]))
    assert all(torch.equal(a, b) for a, b in zip(grads[(0.5, True)], grads[(0.5, False)]))
