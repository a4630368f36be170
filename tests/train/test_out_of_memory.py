"""Out of memory in the rollout, the scores or the update (torch.OutOfMemoryError, injected on the
CPU): the phase's batch is halved, the phase runs again, the halving is logged and kept; the step
equals, bit for bit, a run that used the smaller batch for that phase from that step on. With
one row left, the run stops with a clear message."""
import json

import pytest
import torch

from fasttrain.train import Trainer, TrainingStopped, load_config

# each phase's function, in the module whose code calls it
PHASE_FN = {"rollout": ("fasttrain.train.answers", "sample_answers"),
            "scores": ("fasttrain.train.trainer", "score_batch"),
            "update": ("fasttrain.train.trainer", "update_policy")}


def _rows(run):
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


def _same(a, b):
    skip = ("seconds", "oom_retries")
    return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in a] == \
        [{k: v for k, v in r.items() if not k.startswith(skip)} for r in b]


def _oom_once(monkeypatch, where: tuple[str, str], at_call: int, after_real: bool = False):
    import importlib
    module, fn_name = importlib.import_module(where[0]), where[1]
    real, calls = getattr(module, fn_name), [0]

    def f(*a, **kw):
        calls[0] += 1
        if calls[0] == at_call:
            if after_real:                     # the update ran (adapters and moments changed), then failed
                real(*a, **kw)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real(*a, **kw)
    monkeypatch.setattr(module, fn_name, f)


def _run(tiny, tiny_recipe, name, sizes_from_step2=None):
    tr = Trainer(load_config(tiny_recipe(tiny / name, **{"run.steps": 3, "probe.every": 0})), progress=False)
    if sizes_from_step2:
        real = tr._train_step

        def step(s):
            if s == 2:
                tr.sizes.update(sizes_from_step2)
            return real(s)
        tr._train_step = step
    tr.train()
    return tr


@pytest.mark.parametrize("phase,halved", [("rollout", 1), ("scores", 1), ("update", 1)])
def test_oom_halves_the_phase_and_the_step_equals_the_smaller_batch_run(phase, halved, tiny, tiny_recipe,
                                                                         monkeypatch):
    # the tiny recipe: 2 prompts per step (rollout chunk 2 -> 1), optim.micro_batch = 3 (-> 1); each
    # phase's function is called once per step, so call 2 is step 2
    _oom_once(monkeypatch, PHASE_FN[phase], at_call=2, after_real=phase == "update")
    hit = _run(tiny, tiny_recipe, "hit")
    monkeypatch.undo()
    ref = _run(tiny, tiny_recipe, "ref", sizes_from_step2={phase: halved})
    a, b = _rows(hit.dir), _rows(ref.dir)
    assert [r["oom_retries"] for r in a] == [0, 1, 0]
    key = {"rollout": "rollout_chunk_prompts", "scores": "scores_micro_batch", "update": "update_micro_batch"}[phase]
    assert [r[key] for r in a] == [2 if phase == "rollout" else 3, halved, halved]
    assert _same(a, b)
    assert all(x.equal(y) for x, y in zip(hit.params, ref.params))
    (w,) = [w for w in hit.warnings if "out of memory" in w["message"]]
    assert w["step"] == 2 and f"retrying with {halved} (kept for the rest of the run)" in w["message"]


def test_a_rollout_in_chunks_draws_the_answers_of_one_batch(tiny, tiny_recipe):
    whole = _run(tiny, tiny_recipe, "whole")
    chunked = _run(tiny, tiny_recipe, "chunked", sizes_from_step2={"rollout": 1})
    samples = [[json.loads(l)["answers"] for l in (t.dir / "samples.jsonl").read_text().splitlines()]
               for t in (whole, chunked)]
    assert samples[0] == samples[1]


def test_out_of_memory_with_one_row_stops_the_run(tiny, tiny_recipe, monkeypatch):
    import fasttrain.train.trainer as trainer_mod

    def always(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")
    monkeypatch.setattr(trainer_mod, "score_batch", always)
    tr = Trainer(load_config(tiny_recipe(tiny, **{"run.steps": 2, "probe.every": 0})), progress=False)
    with pytest.raises(TrainingStopped, match=r"step 1: out of memory with one row \(scores: CUDA out of memory"):
        tr.train()
    assert [w["message"].split(":")[0] for w in tr.warnings] == ["out of memory in the scores of step 1 with 3 "
                                                                  "answers per scoring micro-batch"]
