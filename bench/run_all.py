"""Run every benchmark (bench/bench_*.py) and write bench/results/<machine>-<date>.md and .csv.

Each benchmark prints its own comparison (ours vs the peer, same input, same run) and writes its
rows (its own columns) to a CSV via --csv; this script folds them into one long-format CSV,
one line per value: bench, row, column, value. The markdown collects each printed table.
Usage: python bench/run_all.py [--only nf4,logprob] [--quick]
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import tempfile
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import RESULTS, machine_name, versions  # noqa: E402


def fold_csv(bench: str, src: Path, dst: Path) -> int:
    """Append `src` (a benchmark's own CSV, any columns) to `dst` as bench,row,column,value."""
    if not src.exists():
        return 0
    with src.open(newline="") as f:
        rows = list(csv.DictReader(f))
    new = not dst.exists()
    with dst.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["bench", "row", "column", "value"])
        for i, r in enumerate(rows):
            for k, v in r.items():
                w.writerow([bench, i, k, v])
    return len(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", default="", help="comma-separated names, e.g. nf4,logprob")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per benchmark")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    stem = f"{machine_name()}-{dt.date.today().isoformat()}"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out / f"{stem}.csv", out / f"{stem}.md"
    csv_path.unlink(missing_ok=True)
    only = {s.strip() for s in a.only.split(",") if s.strip()}
    scripts = sorted(p for p in HERE.glob("bench_*.py") if not only or p.stem.removeprefix("bench_") in only)
    md = [f"# fasttrain benchmarks: {machine_name()}, {dt.date.today().isoformat()}", "",
          "Versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()), "",
          "Each section compares fasttrain with a peer on the same input in the same run.", ""]
    failed = 0
    for script in scripts:
        t0 = time.time()
        print(f"== {script.name}", flush=True)
        own_csv = Path(tempfile.mkdtemp()) / f"{script.stem}.csv"
        try:
            proc = subprocess.run([sys.executable, str(script), "--csv", str(own_csv)], capture_output=True,
                                  text=True, timeout=a.timeout, cwd=HERE)
            text, rc = proc.stdout + (proc.stderr[-3000:] if proc.returncode else ""), proc.returncode
        except subprocess.TimeoutExpired:
            text, rc = f"timed out after {a.timeout} s", 124
        print(text, flush=True)
        fold_csv(script.stem.removeprefix("bench_"), own_csv, csv_path)
        failed += rc != 0
        md += [f"## {script.stem}  ({time.time() - t0:.0f} s{'' if rc == 0 else f', FAILED rc={rc}'})", "",
               "```", text.strip(), "```", ""]
    md_path.write_text("\n".join(md))
    print(f"wrote {md_path} and {csv_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
