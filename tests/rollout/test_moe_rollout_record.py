"""The routing record of the compiled decode step (rollout.compile) and of multi-turn tool rollouts
(sample_turns, the tool rollout's sampler): every token the rollout forwards, prompt, sampled and
tool-result tokens, gets its top-k per MoE layer, equal to transformers' own model in float64
routing those tokens by itself; and the update replays it: with the router moved after the rollout,
the update's log-probs equal the oracle forced to the recorded experts. Both families, float64;
tolerances and helpers as tests/models/test_moe_models.py. The compiled step runs under the
"aot_eager" backend (the traced graph without code generation), as tests/rollout does; its record
equals the eager decode's with the prompts prefilled one chunk at a time."""
import pytest
import torch

from fasttrain.rollout import sample
from fasttrain.rollout.moe_routing import ReplayRouting
from fasttrain.rollout.multi_turn import sample_turns

from support.moe_pairs import (FAMILIES, PROMPTS, forwarded, move_router, oracle_forward, oracle_tol, pair,
                               sets_differ, update_logprobs)

TOOL = [20, 21, 22, 23]           # a tool turn's tokens, fed after each row's first model turn


def _tool_turns():
    given = set()

    def end_of_turn(rows, spans, room):
        out = []
        for r, left in zip(rows, room):
            out.append(TOOL[:left] if r not in given and left > 0 else None)
            given.add(r)
        return out
    return end_of_turn


def _rollout(model, kind):
    if kind == "compiled":
        return sample(model, PROMPTS, group_size=2, max_new_tokens=5, temperature=1.0, eos_token_ids=[2], seed=0,
                      compile="aot_eager")
    return sample_turns(model, PROMPTS, group_size=2, max_new_tokens=12, temperature=1.0, eos_token_ids=list(range(2, 40)),
                        seed=0, end_of_turn=_tool_turns())


def _check_record_and_replay(hf, model, roll):
    B, S = roll.input_ids.shape
    fwd = forwarded(roll)
    _, own = oracle_forward(hf, roll)
    assert roll.routing is not None and roll.routing.shape[:2] == (B, S)
    for i, c in enumerate(own.chosen):                       # the record: the oracle's own top-k sets
        assert not sets_differ(c.view(B, S, -1)[fwd], roll.routing[:, :, i][fwd]).any(), i
    move_router(hf, model)                                   # the router moves between rollout and update
    forced = [roll.routing[:, :, i].long().reshape(B * S, -1) for i in range(roll.routing.shape[2])]
    lp_forced, _ = oracle_forward(hf, roll, forced)
    rec = ReplayRouting(roll.routing, replay=True)
    got = update_logprobs(model, roll, rec)
    want = lp_forced.gather(2, roll.completion_ids[..., None])[..., 0]
    m = roll.completion_mask
    assert (got - want)[m].abs().max() <= oracle_tol(hf, S)
    differ, pairs, _ = rec.counts(hf.config.num_experts)
    assert differ > 0 and pairs == int(fwd.sum()) * len(forced)      # the moved router does disagree


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_compiled_decodes_record_is_the_oracles_routing_and_replays(family):
    hf, model = pair(family)
    roll = _rollout(model, "compiled")
    eager = sample(model, PROMPTS, group_size=2, max_new_tokens=5, temperature=1.0, eos_token_ids=[2], seed=0,
                   prefill_chunk=1)                            # the prompts prefilled one at a time, recorded whole
    assert torch.equal(roll.completion_ids, eager.completion_ids)
    fwd = forwarded(roll)
    assert torch.equal(roll.routing[fwd], eager.routing[fwd])
    _check_record_and_replay(hf, model, roll)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_tool_rollouts_record_covers_tool_tokens_and_replays(family):
    hf, model = pair(family)
    roll = _rollout(model, "turns")
    context = roll.completion_mask & ~roll.action_mask
    assert bool(context.any())                                # tool-result tokens were forwarded
    _check_record_and_replay(hf, model, roll)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rollout_of_unswapped_model_says_what_to_do(family):
    """transformers' own sparse blocks record no routing: sampling such a model stops with an error
    that names the step that swaps fasttrain's expert blocks in, not a failure deep in the decoder."""
    hf = FAMILIES[family](vocab_size=97, dtype=torch.float32)
    with pytest.raises(ValueError, match="moe_surgery"):
        sample(hf, PROMPTS, group_size=2, max_new_tokens=2, temperature=1.0, eos_token_ids=[2], seed=0)
