"""Soak: a tiny-model run killed with SIGKILL at random points and resumed after each kill ends
with the adapters, metrics.jsonl (timings aside) and samples.jsonl of an uninterrupted run; and
the uninterrupted run's resident memory does not grow between an early and the last step.

    python bench/soak.py                         # 300 steps, a checkpoint every 5, 6 kills (minutes)
    python bench/soak.py --steps 40 --kills 3    # the short version make test runs (tests/train)

Each killed segment is `fasttrain run` (or `--resume`) in its own process (`--launcher cli`; the
short test forks instead, which skips the interpreter's start-up). The runs, the kills and the
comparison are tests/support/soak.py, shared with that test; this script runs them long, checks
the resident memory and writes bench/results/<machine>-<date>-soak.md with what it ran and found.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS)]                     # support.soak, support.tiny_world

from support.soak import compare, killed_run, recipe, uninterrupted  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0, help="where the kills land")
    ap.add_argument("--launcher", choices=("cli", "fork"), default="cli")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--no-record", action="store_true", help="do not write bench/results")
    a = ap.parse_args(argv)
    import tempfile
    work = a.workdir or Path(tempfile.mkdtemp(prefix="fasttrain-soak-"))
    rng = random.Random(a.seed)
    t0 = time.time()
    early = max(1, a.steps // 10)
    ref, rss = uninterrupted(recipe(work / "full", a.steps, a.every), rss_at=(early, a.steps))
    t_ref = time.time() - t0
    t0 = time.time()
    run, events = killed_run(recipe(work / "killed", a.steps, a.every), work, a.kills, rng, a.launcher)
    t_killed = time.time() - t0
    verdict = compare(ref, run, a.steps)
    growth = rss[a.steps] / rss[early] - 1
    ok = all(verdict.values()) and growth <= 0.05
    lines = [f"# Soak: {a.steps} steps, checkpoint every {a.every}, {a.kills} SIGKILLs ({a.launcher} launcher)", "",
             f"- result: {'PASS' if ok else 'FAIL'}",
             *[f"- {k}: {v}" for k, v in verdict.items()],
             f"- resident memory of the uninterrupted run: {rss[early]:.1f} MB after step {early}, "
             f"{rss[a.steps]:.1f} MB after step {a.steps} ({growth:+.1%}; the bound is +5%)",
             f"- wall time: uninterrupted {t_ref:.0f} s, killed and resumed {t_killed:.0f} s", "",
             "| kill | killed after step | resumed from checkpoint | steps redone |", "|---|---|---|---|",
             *[f"| {i + 1} | {e['killed_after_step']} | {e['resumed_from']} | {e['steps_lost']} |"
               for i, e in enumerate(events)]]
    text = "\n".join(lines) + "\n"
    print(text)
    if not a.no_record:
        sys.path.insert(0, str(Path(__file__).parent))
        import datetime as dt

        from harness import RESULTS, machine_name, versions
        f = RESULTS / f"{machine_name()}-{dt.date.today().isoformat()}-soak.md"
        v = ", ".join(f"{k} {x}" for k, x in versions().items())
        f.write_text(text + f"\nMachine: {machine_name()} (2 cores shared with other jobs); kill seed {a.seed}; {v}\n")
        print(f"wrote {f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
