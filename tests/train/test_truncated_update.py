"""Truncated rollouts (top_p 0.8, top_k 20, min_p 0.1) through the update's scoring, for the four families
(dense Llama, the Qwen3.5 hybrid, Qwen3-MoE, Qwen3.5-MoE) and a multi-turn (tool) rollout.

With the kept sets replayed (Rollout.keep_delta into answer_logprobs), exp(update log-prob - rollout
log-prob), what rollout_logprob_gap measures, is 1 within the float32 rounding bound of
tests/train/test_logprob_gap.py: layers·(H + 2·S·D)·u32 for the two paths' longest sums, plus the
log-softmax's 8·u32·(|log p| + log V). Without the replay the update scores the whole vocabulary and the
same quantity is the kept probability mass Z_K <= 1 (TRL's ratio at top_p < 1): checked against the
mass computed from the update's own full log-prob and kept-set log-prob, and far outside the bound.
"""
from __future__ import annotations

import math

import pytest
import torch

from fasttrain.models import tiny_llama, tiny_qwen3_5
from fasttrain.models.moe import moe_surgery
from fasttrain.models.moe_tiny import tiny_qwen3_5_moe, tiny_qwen3_moe
from fasttrain.rollout import Truncation, sample
from fasttrain.rollout.moe_routing import ReplayRouting
from fasttrain.rollout.multi_turn import sample_turns
from fasttrain.train.policy_update import answer_logprobs

pytestmark = pytest.mark.one_thread         # tiny models (tests/conftest.py)

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10]]
TRUNC = Truncation(top_k=20, top_p=0.8, min_p=0.1)
V, HID, D, NEW = 97, 64, 16, 16
U = 2.0**-24

FAMILIES = {
    "llama": lambda: tiny_llama(vocab_size=V, layers=4, hidden=HID, seed=0, dtype=torch.float32),
    "qwen3_5": lambda: tiny_qwen3_5(vocab_size=V, layers=4, hidden=HID, seed=0, dtype=torch.float32),
    "qwen3_moe": lambda: moe_surgery(tiny_qwen3_moe(vocab_size=V, layers=3, hidden=HID, seed=0), nf4=False),
    "qwen3_5_moe": lambda: moe_surgery(tiny_qwen3_5_moe(vocab_size=V, layers=4, hidden=HID, seed=0), nf4=False),
}


def scores(model, r, replay: bool):
    routing = ReplayRouting(r.routing, replay=True) if r.routing is not None else None
    with torch.no_grad():
        lp, ent = answer_logprobs(model, r.input_ids, r.attention_mask, r.prompt_len, r.completion_ids,
                                  r.completion_mask, 1.0, position_ids=r.position_ids, prompt_index=r.prompt_index,
                                  routing=routing, keep_delta=r.keep_delta if replay else None)
    return lp, ent


def bound(model, r, lp):
    S = r.input_ids.shape[1]
    L = model.config.num_hidden_layers
    return L * (HID + 2 * S * D) * U + 8 * U * (float(lp.abs().max()) + math.log(V))


def check_gap(model, r, mask):
    lp, ent = scores(model, r, replay=True)
    tol = bound(model, r, lp)
    gap = (lp - r.logprobs)[mask]
    assert float(gap.abs().max()) <= tol, (float(gap.abs().max()), tol)
    # without the replay: the whole vocabulary's log-prob; the ratio is the kept mass Z_K = q/p ... < 1
    full, ent_full = scores(model, r, replay=False)
    mass = torch.exp(full - lp)[mask]                                  # p(t) / q(t) = Z_K, from the update
    ratio = torch.exp(full - r.logprobs)[mask]                         # what the gap measures without replay
    assert torch.allclose(ratio, mass, rtol=2 * tol, atol=0)
    assert float(mass.max()) <= 1 + tol and float(mass.mean()) < 1 - 100 * tol
    # the entropy that drives the token mask and the thermostat is the kept set's (a long tail cut off: lower)
    assert float((ent_full - ent)[mask].mean()) > 100 * tol
    return float(mass.mean())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replayed_kept_sets_close_the_gap_and_without_replay_it_is_the_kept_mass(family):
    model = FAMILIES[family]()
    r = sample(model, PROMPTS, group_size=4, max_new_tokens=NEW, temperature=1.0, eos_token_ids=[], seed=3,
               truncation=TRUNC)
    assert r.keep_delta is not None and r.keep_delta.shape == r.logprobs.shape
    mask = r.completion_mask.bool()
    assert bool((r.keep_delta[mask] >= 0).all()) and bool(torch.isfinite(r.keep_delta[mask]).any())
    check_gap(model, r, mask)


def test_tool_rollout_records_kept_sets_only_on_sampled_tokens():
    model = FAMILIES["llama"]()
    tool = [13, 6, 12, 8]

    def end_of_turn(rows, spans, room):
        return [list(tool) if len(tool) < left else None for left in room]

    r = sample_turns(model, PROMPTS, group_size=2, max_new_tokens=24, temperature=1.0, eos_token_ids=[2, 40, 41],
                     seed=5, end_of_turn=end_of_turn, truncation=TRUNC)
    act = r.action_mask.bool()
    context = r.completion_mask.bool() & ~act
    assert context.any(), "no tool result was fed: the case does not test a multi-turn answer"
    assert bool(torch.isinf(r.keep_delta[context]).all())              # context tokens: not drawn
    assert bool(torch.isfinite(r.keep_delta[act]).any())
    check_gap(model, r, act)


@pytest.mark.parametrize("replay", [True, False])
def test_trainer_steps_with_the_knobs_and_logs_the_gap(tiny, tiny_recipe, replay):
    """The trainer samples with rollout.top_p / top_k / min_p and its logged rollout_logprob_gap is the
    rounding of the two forwards with the replay (the tiny world's float32 bound, as the hybrid's e2e
    test uses), and the kept mass's -log Z_K without it (rollout.replay_kept_set = false)."""
    import json

    from fasttrain.train import Trainer, load_config
    cfg = load_config(tiny_recipe(tiny / "runs", **{"run.steps": 2, "probe.every": 0, "probe.prompts": 1,
                                                    "rollout.top_p": 0.8, "rollout.top_k": 20, "rollout.min_p": 0.1, "probe.top_p": 0.9,
                                                    "rollout.replay_kept_set": replay}))
    tr = Trainer(cfg, progress=False)
    tr.train()
    rows = [json.loads(line) for line in (tr.dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        if replay:
            assert 0 <= r["rollout_logprob_gap"] <= r["rollout_logprob_gap_max"] < 1e-4, r
        else:
            assert r["rollout_logprob_gap"] > 1e-2, r

