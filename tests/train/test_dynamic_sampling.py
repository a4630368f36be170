"""Dynamic sampling (rollout.dynamic_sampling): dead groups decided per group before GDPO's batch
standardisation, the final batch standardised over the kept live groups alone, the prompt stream
(no prompt twice in a step, wrapping to the next epoch), the per-step log, resume exactness in
every metric, and equal groups per rank under torchrun."""
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fasttrain.envs import Prompt, Score
from fasttrain.rl import floor_guard, gdpo_advantages, guarded_answers
from fasttrain.train import Trainer, load_config
from fasttrain.train.dynamic_sampling import draw_prompts, kept_advantages, live_groups
from fasttrain.train.run_files import read_jsonl

HERE = Path(__file__).parent
G = 4


def _s(core: float, valid: bool = True, fmt: float = 0.0) -> Score:
    return Score({"core": core, "format": fmt}, valid, core, core > 0, None)


A_CFG = SimpleNamespace(guard="projection", floor=0.0, guard_invalid=True, batch_normalize=True)
W = torch.tensor([3.0, 1.0], dtype=torch.float64)


def test_dead_groups_are_decided_per_group_after_the_guard():
    groups = [
        [_s(1.0), _s(1.0), _s(1.0), _s(1.0)],                   # constant: dead
        [_s(0.0), _s(0.0, fmt=1.0), _s(0.0), _s(0.0)],          # format differs but all guarded (core <= 0): dead
        [_s(-1.0, False), _s(-1.0, False), _s(-1.0, False), _s(-1.0, False)],   # all invalid: dead
        [_s(1.0), _s(0.0), _s(0.0), _s(0.0)],                   # live
        [_s(0.5, fmt=1.0), _s(0.5), _s(0.5), _s(0.5)],          # core constant, a free answer's format differs: live
    ]
    scores = [s for g in groups for s in g]
    assert live_groups(scores, ["core", "format"], W, G, A_CFG) == [False, False, False, True, True]


def test_kept_batch_is_standardised_over_its_live_groups_only():
    groups = [[_s(1.0), _s(0.0), _s(0.0), _s(0.5)], [_s(1.0)] * 4,
              [_s(0.2), _s(0.9, fmt=1.0), _s(0.0), _s(0.0)]]
    scores = [s for g in groups for s in g]
    live = live_groups(scores, ["core", "format"], W, G, A_CFG)
    assert live == [True, False, True]
    tr = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(group_size=G), advantages=A_CFG))

    def advantages(sc):           # the trainer's own order: GDPO with batch standardisation, then the guard
        r = torch.tensor([[s.channels["core"], s.channels["format"]] for s in sc], dtype=torch.float64)
        core = torch.tensor([s.core for s in sc], dtype=torch.float64)
        valid = torch.tensor([s.valid for s in sc])
        a = floor_guard(gdpo_advantages(r, G, W, True).double(), guarded_answers(core, valid, 0.0, True), G)
        return a.float(), {"nonzero_adv_share": 0.0, "guarded_share": 0.0, "adv_abs_mean": 0.0}
    tr.batch_advantages = advantages
    adv, info = kept_advantages(tr, scores, live)
    assert torch.equal(adv[4:8], torch.zeros(4))                   # the dead group: exactly zero
    want = advantages(groups[0] + groups[2])[0]                    # the live groups alone
    assert torch.equal(adv[:4], want[:4]) and torch.equal(adv[8:], want[4:])
    # with the dead group in the batch, its advantages would not be zero (the batch mean shifts them)
    with_dead = advantages(scores)[0]
    assert not torch.equal(with_dead[:4], want[:4])
    assert info["nonzero_adv_share"] == float((adv.abs() > 1e-6).double().mean())


def test_prompt_stream_never_repeats_a_prompt_in_a_step_and_wraps_epochs():
    prompts = [Prompt(f"p{i}", f"q{i}") for i in range(5)]
    orders = [np.random.default_rng([3, e]).permutation(5) for e in range(3)]
    stream = [prompts[o[j]].id for o in orders for j in range(5)]
    used: set[str] = set()
    a, cur = draw_prompts(prompts, 3, 3, 4, used)      # positions 3.. cross into epoch 1
    ids = [p.id for p in a]
    assert len(set(ids)) == 4 and cur >= 7
    assert ids == [x for i, x in enumerate(stream[3:cur]) if x not in stream[3:3 + i]][:4]
    b, cur2 = draw_prompts(prompts, 3, cur, 4, used)   # only one prompt left unused in this step
    assert len(b) == 1 and b[0].id not in ids
    c, cur3 = draw_prompts(prompts, 3, cur2, 4, used)
    assert c == [] and cur3 == cur2
    again, _ = draw_prompts(prompts, 3, 3, 4, set())
    assert [p.id for p in again] == ids                   # a pure function of (seed, cursor, used)


def _recipe(out, **over):
    from support.recipes import make_tiny_recipe
    base = {"env.name": "support.signal_world:make_env", "rollout.dynamic_sampling": True, "rollout.prompts_per_step": 4,
            "rollout.dynamic_max_rounds": 2, "advantages.priorities": {}, "advantages.floor": -1e9,
            "probe.every": 0}
    return make_tiny_recipe(out, **{**base, **over})


def _rows(run):
    return read_jsonl(run / "metrics.jsonl")


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in rows]


def test_steps_train_on_live_groups_and_log_it(tiny):
    tr = Trainer(load_config(_recipe(tiny, **{"run.steps": 3})), progress=False)
    tr.train()
    env = tr.env
    samples = read_jsonl(tr.dir / "samples.jsonl")
    rows = _rows(tr.dir)
    by_id = {p.id: p for p in env.prompts("train")}
    saw_extra = False
    for row, s in zip(rows, samples):
        ids = s["prompt_ids"]
        assert len(set(ids)) == len(ids)                                   # never twice in a step
        scores = [Score({"core": c}, v, c, c > 0, None) for c, v in zip(s["core"], s["valid"])]
        live = live_groups(scores, ["core"], torch.ones(1, dtype=torch.float64), G,
                           SimpleNamespace(guard="projection", floor=-1e9, guard_invalid=True))
        kept = s["kept"]
        assert all(live[g] for g in range(len(ids)) if kept[g]) or sum(live) == 0
        n_kept = sum(kept)
        assert row["dynamic_groups"] == len(ids) and row["dynamic_groups_kept"] == n_kept
        assert row["dynamic_groups_dropped"] == len(ids) - n_kept
        assert row["dynamic_dead_groups"] == len(live) - sum(live)
        assert row["dynamic_extra_answers"] == (len(ids) - 4) * G
        assert n_kept == min(4, sum(live)) or (sum(live) == 0 and n_kept == 4)
        assert row["dynamic_cap_reached"] == (sum(live) < 4)
        assert row["nonzero_adv_share_before"] <= row["nonzero_adv_share"] or sum(live) == 0
        assert 0.0 <= row["seconds_share_dropped"] <= 1.0
        assert row["dynamic_rounds"] <= 2
        saw_extra |= row["dynamic_rounds"] > 0
        # the prompts of the multiples of 3 are always dead: never kept while a live group was there
        assert not any(kept[g] and by_id[ids[g]].fields["i"] % 3 == 0 for g in range(len(ids))) or sum(live) == 0
    assert saw_extra
    # the cursor moved past every prompt drawn (12 prompts: the stream wrapped into epoch 1 by step 3)
    assert tr.prompt_cursor >= sum(len(s["prompt_ids"]) for s in samples) > 12


def test_resume_is_exact_in_every_metric(tiny):
    full = Trainer(load_config(_recipe(tiny / "a", **{"run.steps": 4})), progress=False)
    full.train()
    part = Trainer(load_config(_recipe(tiny / "b", **{"run.steps": 2})), progress=False)
    part.train()
    Trainer.resume(part.dir, ["run.steps=4"], progress=False).train()
    a, b = _rows(full.dir), _rows(part.dir)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert _strip(a) == _strip(b)
    assert any(r["dynamic_rounds"] > 0 for r in a[2:])                # the resumed steps resampled
    sa = (full.dir / "samples.jsonl").read_text()
    assert sa == (part.dir / "samples.jsonl").read_text()


def test_two_ranks_keep_the_same_number_of_groups(tiny, tmp_path):
    import os
    import subprocess
    from safetensors.torch import load_file

    from support import dist_driver
    rec = tmp_path / "recipe.json"
    rec.write_text(json.dumps(_recipe(tmp_path / "two", **{"run.steps": 3, "loss.token_mask": "top_entropy", "loss.rho": 0.3})))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "python"), str(HERE.parent)])}     # fasttrain, support
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        dist_driver.__file__, str(rec), str(tmp_path / "rec")], env=env,
                       capture_output=True, text=True, timeout=1200, cwd=HERE)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ranks = [load_file(str(tmp_path / "rec" / f"rank{r}.safetensors")) for r in (0, 1)]
    (run,) = list((tmp_path / "two").iterdir())
    rows = _rows(run)
    for s, row in enumerate(rows, 1):
        n0, n1 = ranks[0][f"{s}/adv"].numel(), ranks[1][f"{s}/adv"].numel()
        assert n0 == n1 == row["dynamic_groups_kept"] // 2 * G                  # the same groups per rank
        assert row["dynamic_groups_kept"] % 2 == 0
    assert any(r["dynamic_rounds"] > 0 for r in rows)
