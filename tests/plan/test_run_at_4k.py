"""A training run at 4,096 new tokens on the CPU stays within its plan: every answer decoded to
full length (no end token), each phase's measured peak of allocated bytes (tests/support/measured_step.py)
at most the plan's with the 5% allocator margin its fit check adds, and within 15% of it.

Lean: SmolLM2's layout at small widths (tests/support/padded_world.py: smollm2_shape_as_loaded, 2
layers), one prompt of two answers, one micro-batch. It is also the 4,096-token row of SmolLM2's
layout in tests/plan/test_long_answer_peaks.py, measured here on answers decoded in full. The trainer's own step (Trainer._train_step after _setup, as `fasttrain
run` runs it, the plan's picks applied) runs twice: step 1 warms up (it makes the AdamW moments and
the kernels' scratch that the plan counts as resident) on answers that end within a few tokens, so
only step 2, the measured one, decodes 2 x 4,096 tokens.
"""
import pytest

NEW_TOKENS = 4096
MARGIN = 0.05          # fasttrain.plan.memory.fits: the allocator margin on top of the planned peak
TOL = 0.15


def test_a_run_at_4096_new_tokens_stays_within_its_plan(tmp_path, monkeypatch):
    import fasttrain.rollout as rollout
    from support.recipes import tiny_recipe
    from support.measured_step import planned_and_measured
    from fasttrain.train import Trainer, load_config

    r = tiny_recipe(tmp_path, 1, 2, NEW_TOKENS, 2)
    r["policy"]["model"] = "support.padded_world:smollm2_shape_as_loaded"
    r["probe"]["every"] = 100                    # no probe in the two steps
    trainer = Trainer(load_config(r), progress=False)
    real, lengths = rollout.sample, []

    def sample(*a, eos_token_ids, **k):
        warm_up = not lengths                    # step 1: every odd id ends a row
        out = real(*a, eos_token_ids=list(range(3, 259, 2)) if warm_up else eos_token_ids, **k)
        lengths.append(out.lengths.tolist())
        return out
    monkeypatch.setattr(rollout, "sample", sample)
    got = planned_and_measured(trainer, monkeypatch)       # it turns the end tokens off (eos_ids: [])
    assert lengths[1] == [NEW_TOKENS, NEW_TOKENS]          # the measured step decoded every answer in full
    for phase in ("rollout", "scores", "update"):
        planned, measured = got[phase]
        assert measured <= planned * (1 + MARGIN), (phase, planned, measured)
        assert abs(planned - measured) <= TOL * measured, (phase, planned, measured)
