"""Data-parallel training with torchrun on CPU (gloo, one thread per rank) equals one process.

The tiny recipe runs 3 steps in this process and as 2 torchrun ranks (tests/support/dist_driver.py
records each rank's advantages, answer-token entropies, top-entropy mask, gradients and adapters
per step). Then a 2-rank run through the command line loses rank 1 to SIGKILL in step 2 and is
resumed; the first comparison runs again on a 16-bit base with DoRA. A 2-rank run whose tracker
cannot start on rank 0 stops on both ranks. Five torchrun launches in all: the file costs about
60-70 s on a quiet 2-core machine.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fasttrain.train.run_files import read_jsonl

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
U = 2.0 ** -24                       # fp32 unit roundoff
STEPS = 3
# A torchrun launch's own wall-clock limit: 10-15 s of work on a quiet 2-core host, several times
# that at a load of 10; the limit only catches a hang (each rank's collectives wait run.dist_timeout).
HANG_S = 1200

# the tiny world's sizes (tests/support/tiny_world.py): what the longest fp32 sums run over
LAYERS, HIDDEN, INTERMEDIATE, VOCAB = 2, 64, 128, 259


def _recipe(out: Path, **over) -> dict:
    from support.recipes import make_tiny_recipe
    base = {"run.steps": STEPS, "probe.every": 0, "probe.prompts": 2, "rollout.prompts_per_step": 4,
            "loss.token_mask": "top_entropy", "loss.rho": 0.3}
    return make_tiny_recipe(out, **{**base, **over})


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT / "tests")])}     # fasttrain, support


def _torchrun(*args, timeout=HANG_S, **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=HERE, **kw)


def _metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rows]


def _record_runs(tmp_path_factory, **over):
    """(one-process records, [rank 0, rank 1] records, one-process run dir, 2-rank run dir)."""
    from safetensors.torch import load_file

    from support import dist_driver

    tmp = tmp_path_factory.mktemp("dist")
    n = torch.get_num_threads()
    try:
        one = dist_driver.run(_recipe(tmp / "one", **over), tmp / "rec1")
    finally:
        torch.set_num_threads(n)
    recipe = tmp / "recipe.json"
    recipe.write_text(json.dumps(_recipe(tmp / "two", **over)))
    p = _torchrun(dist_driver.__file__, str(recipe), str(tmp / "rec2"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ranks = [load_file(str(tmp / "rec2" / f"rank{r}.safetensors")) for r in (0, 1)]
    (one_dir,), (two_dir,) = list((tmp / "one").iterdir()), list((tmp / "two").iterdir())
    return one, ranks, one_dir, two_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _record_runs(tmp_path_factory)


def _chain(seq_len: int) -> int:
    """Length of the longest chain of fp32 accumulations behind one answer token's log-prob and
    entropy: per layer the hidden, MLP and attention (sequence) contractions, then the vocabulary."""
    return LAYERS * (HIDDEN + INTERMEDIATE + seq_len) + HIDDEN + VOCAB


def _gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u): a sum of n terms in another order moves by at most
    gamma_n * (sum of their magnitudes) (Higham, Accuracy and Stability of Numerical Algorithms,
    sec. 4.2). The tests below scale it by the compared quantity's largest magnitude (the terms'
    magnitudes are not recorded): a first-order bound with no allowance for cancellation, which the
    measured differences stay 20x to 1000x under (gloo, 2 ranks, this tiny world)."""
    return n * U / (1 - n * U)


def test_two_ranks_equal_one_process(runs):
    _two_ranks_equal_one_process(runs)


def test_two_ranks_equal_one_process_on_a_16bit_base(tmp_path_factory):
    """policy.quantize = "none" with DoRA: the same equalities (the adapters' gradients are one flat
    all-reduce whatever layer holds them)."""
    _two_ranks_equal_one_process(_record_runs(tmp_path_factory, **{"policy.quantize": "none",
                                                                   "policy.adapter": "dora"}))


def _two_ranks_equal_one_process(runs):
    one, (r0, r1), one_dir, two_dir = runs
    cfg = _recipe(Path("."))
    B = cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["group_size"]
    T = cfg["rollout"]["max_new_tokens"]
    seq = int(max(one[f"{s}/seq_len"] for s in range(1, STEPS + 1)))      # prompt + answer tokens
    n_ent = _chain(seq)
    # a gradient entry sums over every answer token of the batch, on top of its token's chain
    n_grad = B * T + n_ent
    rows1, rows2 = _metrics(one_dir), _metrics(two_dir)
    assert [r["step"] for r in rows2] == [1, 2, 3]          # written once, by rank 0
    assert len(list(two_dir.parent.iterdir())) == 1          # one run folder, not one per rank
    loss_scale = max(abs(v) for r in rows1 for v in r["pass_losses"])
    for s in range(1, STEPS + 1):
        # whole groups per rank and the whole batch's scores: the advantages are bit-equal
        adv2 = torch.cat([r0[f"{s}/adv"], r1[f"{s}/adv"]])
        assert adv2.shape == (B,) and torch.equal(adv2, one[f"{s}/adv"]), s
        assert (one[f"{s}/adv"] != 0).any()
        # the same answer tokens (row-major, rank after rank), their entropies to reduction order
        ent1, ent2 = one[f"{s}/entropy"], torch.cat([r0[f"{s}/entropy"], r1[f"{s}/entropy"]])
        assert ent1.shape == ent2.shape, s
        tol_ent = _gamma(n_ent) * float(ent1.abs().max())
        assert float((ent1 - ent2).abs().max()) <= tol_ent, s
        # the top-rho mask is the whole batch's: ceil(rho n) tokens, the same threshold, and the same
        # set except (only possibly) tokens within tol of the threshold
        keep1, keep2 = one[f"{s}/keep"].bool(), torch.cat([r0[f"{s}/keep"], r1[f"{s}/keep"]]).bool()
        k = math.ceil(cfg["loss"]["rho"] * ent1.numel() - 1e-9)
        assert int(keep1.sum()) == int(keep2.sum()) == k
        thr1, thr2 = float(ent1[keep1].min()), float(ent2[keep2].min())
        assert abs(thr1 - thr2) <= tol_ent, s
        near = (ent1 - thr1).abs() <= 2 * tol_ent
        assert torch.equal(keep1[~near], keep2[~near]), s
        # loss of every pass
        p1, p2 = rows1[s - 1]["pass_losses"], rows2[s - 1]["pass_losses"]
        assert len(p1) == len(p2) == 2
        for a, b in zip(p1, p2):
            assert abs(a - b) <= _gamma(n_grad) * loss_scale, (s, a, b)
        # gradients AdamW stepped with (summed over ranks, clipped): identical on both ranks, and the
        # one-process gradient to reduction order. First-order bound relative to the largest entry;
        # steps 2-3 also carry the earlier steps' rounding through the adapters, and stay well under it.
        for k_pass in range(2):
            g1, g2a, g2b = one[f"{s}/grad{k_pass}"], r0[f"{s}/grad{k_pass}"], r1[f"{s}/grad{k_pass}"]
            assert torch.equal(g2a, g2b), (s, k_pass)
            tol = _gamma(n_grad) * float(g1.abs().max())
            assert float((g1 - g2a).abs().max()) <= tol, (s, k_pass, float((g1 - g2a).abs().max()), tol)
        # adapters after the step: identical on every rank
        assert torch.equal(r0[f"{s}/params"], r1[f"{s}/params"]), s
    _check_adapters(one, r0, cfg)
    # every other logged value: equal to reduction order (the counts exactly)
    for a, b in zip(_strip(rows1), _strip(rows2)):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], (bool, int, str)) or key.startswith("reward") or key in (
                    "core", "success", "valid", "cost", "nonzero_adv_share", "guarded_share", "adv_abs_mean"):
                assert a[key] == b[key], key
            elif isinstance(a[key], float):
                assert abs(a[key] - b[key]) <= _gamma(n_grad) * max(1.0, abs(a[key])), key


def _check_adapters(one, two, cfg):
    """The adapters differ by what AdamW makes of the gradient differences checked above: replay
    AdamW in float64 on each run's recorded gradients from the common start; the fp32 adapters
    must match that difference up to fp32 rounding of the updates."""
    o = cfg["optim"]
    lr, b1, b2, eps = o["lr"], 0.9, 0.999, 1e-8
    theta0 = one["0/params"].double()
    assert torch.equal(one["0/params"], two["0/params"])      # every rank starts from rank 0's init

    def replay(rec):
        th, m, v, t, upd_mass = theta0.clone(), torch.zeros_like(theta0), torch.zeros_like(theta0), 0, 0.0
        out = {}
        for s in range(1, STEPS + 1):
            for k in range(2):
                g = rec[f"{s}/grad{k}"].double()
                t += 1
                m = b1 * m + (1 - b1) * g
                v = b2 * v + (1 - b2) * g * g
                upd = lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
                th = th - upd
                upd_mass = upd_mass + upd.abs()
            out[s] = (th, upd_mass)
        return out

    a, b = replay(one), replay(two)
    for s in range(1, STEPS + 1):
        (th1, mass1), (th2, mass2) = a[s], b[s]
        # each fp32 update is off by a few roundings of itself, each parameter write by u |theta|
        n_upd = 2 * s
        rounding = 8 * U * (mass1 + mass2) + 2 * n_upd * U * torch.maximum(th1.abs(), th2.abs())
        tol = (th1 - th2).abs() + rounding
        diff = (one[f"{s}/params"].double() - two[f"{s}/params"].double()).abs()
        assert bool((diff <= tol).all()), (s, float((diff - tol).max()))
        assert float((one[f"{s}/params"].double() - th1).abs().max()) <= float(rounding.max())


def test_killed_rank_stops_the_others_and_resume_continues(runs, tmp_path):
    """SIGKILL rank 1 in step 2 of a 2-rank `fasttrain run --nproc 2`: rank 0 stops too, torchrun
    names rank 1, the step-1 checkpoint is complete, and --resume finishes the run with the metrics
    of the uninterrupted 2-rank run, bit for bit."""
    from fasttrain.train.checkpoint import latest_checkpoint
    from fasttrain.train.config import config_to_toml, load_config

    _, _, _, two_dir = runs
    # run.dist_timeout far beyond the test's own timeout: rank 0 does not wait for it
    cfg = load_config(_recipe(tmp_path / "runs", **{"run.checkpoint_every": 1, "run.dist_timeout": 3600,
                                                    "env.name": "support.dist_driver:make_dying_env"}))
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(config_to_toml(cfg))
    env = {**_env(), "DIE_AT_CALL": "3"}             # rank 1's scoring calls: probe 0, step 1, step 2
    p = subprocess.run([sys.executable, "-m", "fasttrain", "run", str(recipe), "--nproc", "2", "--no-progress"],
                       env=env, capture_output=True, text=True, timeout=HANG_S, cwd=HERE)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    # torchrun's failure summary names rank 1 and its SIGKILL (as a failure or the root cause: which of
    # two failures seen in one monitor poll it calls "first" is its choice), rank 0 says its collective
    # lost a rank and leaves with fasttrain's error code, not an abort in the broken process group
    assert re.search(r"Failures:.*?rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*-9.*?SIGKILL", out, re.S), \
        out[-3000:]
    # rank 0 stops too, never by an abort in the broken process group: either its collective reports the
    # lost rank first, or torchrun's monitor sees rank 1 dead first and ends rank 0 with SIGTERM (a race
    # between gloo's failure detection and the monitor's poll; both orders were seen on one 2-core host)
    stopped = "failed while waiting" in out or re.search(r"rank\s*:\s*0 \(local_rank: 0\)\s*\n\s*exitcode\s*:\s*-15",
                                                          out) is not None
    assert stopped and "SIGABRT" not in out, out[-3000:]
    (run_dir,) = list((tmp_path / "runs").iterdir())
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None and ckpt.name == "step_000001"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 1
    from safetensors.torch import load_file
    assert any(k.startswith("optim/exp_avg/") for k in load_file(str(ckpt / "trainer_state.safetensors")))
    assert [r["step"] for r in _metrics(run_dir)] == [1]      # step 2 needed rank 1's scores

    p = _torchrun("-m", "fasttrain", "run", "--resume", str(run_dir), "--no-progress")   # no DIE_AT_CALL now
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert _strip(_metrics(run_dir)) == _strip(_metrics(two_dir))


def _signalled_run(tmp_path, how: str, **over) -> tuple[subprocess.CompletedProcess, Path]:
    """A 2-rank run whose rank 1 sends SIGTERM to torchrun's agent while it scores step 2."""
    from fasttrain.train.config import config_to_toml, load_config
    cfg = load_config(_recipe(tmp_path / "runs", **{"run.dist_timeout": 3600,
                                                    "env.name": "support.dist_driver:make_dying_env", **over}))
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(config_to_toml(cfg))
    env = {**_env(), "DIE_AT_CALL": "3", "DIE_HOW": how}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--shutdown-timeout", "10", "-m", "fasttrain", "run", str(recipe), "--no-progress"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S, cwd=HERE)
    (run_dir,) = list((tmp_path / "runs").iterdir())
    return p, run_dir


def test_sigterm_under_torchrun_stops_every_rank_after_the_same_step_and_resume_is_exact(runs, tmp_path):
    """torchrun's agent forwards SIGTERM to both ranks: they finish step 2, agree to stop, write its
    checkpoint and exit with status 75; a resumed 2-rank run equals the uninterrupted one."""
    from fasttrain.train.checkpoint import pick_checkpoint
    _, _, _, two_dir = runs
    p, run_dir = _signalled_run(tmp_path, "term_agent", **{"run.checkpoint_every": 100})
    out = p.stdout + p.stderr
    for r in (0, 1):
        assert f"[rank {r}] stopped by SIGTERM after step 2" in out, out[-3000:]
    assert re.search(r"exitcode\s*:\s*75", out) or "exitcode" not in out, out[-3000:]
    assert pick_checkpoint(run_dir / "checkpoints") == (run_dir / "checkpoints" / "step_000002", [])
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2]
    p = _torchrun("-m", "fasttrain", "run", "--resume", str(run_dir), "--no-progress")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert _strip(_metrics(run_dir)) == _strip(_metrics(two_dir))


def test_a_rank_that_cannot_reach_a_safe_point_leaves_after_stop_timeout(tmp_path):
    """Rank 1 hangs (signals ignored) after SIGTERM reached the agent: rank 0, waiting for it in a
    collective, leaves after run.stop_timeout, not run.dist_timeout (an hour here), with status 75
    and the step-1 checkpoint whole; the agent kills rank 1 after its --shutdown-timeout."""
    from fasttrain.train.checkpoint import pick_checkpoint
    p, run_dir = _signalled_run(tmp_path, "hang", **{"run.checkpoint_every": 1, "run.stop_timeout": 2.0})
    out = p.stdout + p.stderr
    assert "[rank 0] no safe point within run.stop_timeout = 2 s of SIGTERM" in out, out[-3000:]
    assert "the last complete checkpoint stands (exit status 75)" in out, out[-3000:]
    assert pick_checkpoint(run_dir / "checkpoints") == (run_dir / "checkpoints" / "step_000001", [])


def test_prompts_per_step_must_divide_by_the_ranks():
    from fasttrain.train import ConfigError
    from fasttrain.train.distributed import check_prompts_per_step

    check_prompts_per_step(6, 3)
    with pytest.raises(ConfigError, match=r"prompts_per_step=4 does not divide by the 3 ranks.*"
                                          r"multiple of 3 \(3, 6, 9, 12, 15, 18.*divides 4 \(1, 2, 4\)"):
        check_prompts_per_step(4, 3)


def test_a_group_samples_the_same_answers_whatever_shares_its_batch(tiny):
    """Per-prompt generators: a prompt's answers depend on its seed, not on the other prompts of the
    batch (nor their padding), which is what lets ranks split a step."""
    from fasttrain.rollout import sample
    from fasttrain.train.answers import group_seeds
    from support.tiny_world import tiny_policy

    model, tok = tiny_policy()
    prompts = [tok.encode(f"Say a word number {i}." + " pad" * i) for i in range(4)]
    seeds = group_seeds([7, 3], 0, 4)
    kw = dict(group_size=3, max_new_tokens=6, temperature=1.0, eos_token_ids=[2])
    whole = sample(model, prompts, seed=seeds, **kw)
    tail = sample(model, prompts[2:], seed=seeds[2:], **kw)
    T = tail.completion_ids.shape[1]
    assert torch.equal(whole.completion_ids[6:, :T], tail.completion_ids)
    assert torch.equal(whole.completion_mask[6:].sum(1), tail.completion_mask.sum(1))
    # a different seed for that prompt draws different answers
    other = sample(model, prompts[2:], seed=[seeds[2] + 1, seeds[3]], **kw)
    assert not torch.equal(other.completion_ids[:3], tail.completion_ids[:3])


def test_a_tracker_that_cannot_start_on_rank_0_stops_every_rank(tmp_path, monkeypatch):
    """Rank 0 alone starts the trackers; when one cannot start, rank 1 stops with the reason too,
    not killed by torchrun's agent without one (or, under a launcher that does not stop the group,
    left waiting in its first collective until run.dist_timeout)."""
    from fasttrain.train.config import config_to_toml, load_config

    cfg = load_config(_recipe(tmp_path / "runs", **{"run.report_to": ["mlflow"]}))
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(config_to_toml(cfg))
    env = {**_env(), "MLFLOW_TRACKING_URI": "nosuchscheme://nowhere"}
    p = subprocess.run([sys.executable, "-m", "fasttrain", "run", str(recipe), "--nproc", "2", "--no-progress"],
                       env=env, capture_output=True, text=True, timeout=HANG_S, cwd=HERE)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert "run.report_to: 'mlflow' failed to start" in out, out[-3000:]
    assert "rank 0 could not start its trackers" in out, out[-3000:]      # rank 1's own error
    assert "RankLost" not in out and "failed while waiting" not in out, out[-3000:]
