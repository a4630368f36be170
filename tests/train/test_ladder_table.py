"""The ladder's table: each rung's shipped holdout as mean and t-interval over seeds, changes as
paired differences over the same seeds (hand-computed), * where the interval excludes 0; and the
configs it runs (paired seeds, at least 5 probes)."""
import math

from fasttrain.train.config import load_config
from fasttrain.train.ladder import MIN_PROBES, ladder_configs, probes_per_run
from fasttrain.train.report import ladder_table

T2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)        # t(0.975, 2 df), closed form


def _export(name: str, seed: int, start: float, shipped: float) -> dict:
    cfg = load_config({"run": {"name": name, "seed": seed}}).to_dict()
    return {"run_id": f"{name}-{seed}", "config": cfg, "shipped": {"step": 4, "holdout_core": shipped},
            "start_probe": {"step": 0, "holdout_core": start}}


def test_table_gives_means_intervals_and_paired_changes():
    a = [_export("a", s, 0.0, v) for s, v in zip((1, 2, 3), (1.0, 2.0, 3.0))]
    b = [_export("b", s, 0.0, v) for s, v in zip((1, 2, 3), (2.0, 4.0, 5.0))]
    rows = ladder_table([a, b]).splitlines()
    # rung a: mean 2, s 1 -> 2 -+ T2/sqrt(3) = [-0.484, +4.484], includes 0; change vs start the same
    assert rows[2].split("|")[4:6] == [" +2.000 [-0.484, +4.484] ", " +2.000 [-0.484, +4.484] "]
    # rung b vs a: d = 1, 2, 2 -> 5/3 -+ T2/3 = [+0.232, +3.101], excludes 0: marked
    lo, hi = 5 / 3 - T2 / 3, 5 / 3 + T2 / 3
    assert rows[3].split("|")[6].strip() == f"+1.667 [{lo:+.3f}, {hi:+.3f}] *"
    assert rows[2].split("|")[6].strip() == "-"              # the first rung has no previous one


def test_a_run_without_holdout_shows_no_interval():
    a = [_export("a", 1, 0.0, float("nan")), _export("a", 2, 0.0, 0.5)]
    assert "| - | - | - |" in ladder_table([a])


def test_ladder_configs_pair_seeds_and_probe_at_least_five_times():
    rungs = ladder_configs(["dapo", "cispo"], ["run.steps=12", "probe.every=0", "run.seed=10"], seeds=3)
    assert [[c.run.seed for c in r] for r in rungs] == [[10, 11, 12]] * 2
    assert all(c.probe.every == 2 and probes_per_run(c) >= MIN_PROBES for r in rungs for c in r)
    kept = ladder_configs(["dapo"], ["run.steps=12", "probe.every=2"], seeds=1)[0][0]
    assert kept.probe.every == 2                             # 6 probes already: left as it is
