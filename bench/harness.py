"""Shared plumbing for fasttrain benchmarks: timing, machine naming, long-format CSV rows.

Every benchmark compares fasttrain against a peer on the same input in the same run and reports the
ratio; rows are appended to bench/results/<machine>-<date>.csv by bench/run_all.py.
"""
from __future__ import annotations

import csv
import datetime as dt
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "-")
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu-{os.cpu_count()}c-" + "".join(c if c.isalnum() else "-" for c in cpu)[:40].strip("-")


def versions() -> dict:
    import fasttrain

    v = {"torch": torch.__version__, "fasttrain": fasttrain.__version__, "python": platform.python_version()}
    for mod in ("bitsandbytes", "transformers", "trl", "peft"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:
            pass
    return v


def sync(device: str | torch.device = "cpu") -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_it(fn, *, warmup: int = 1, reps: int = 5, device="cpu") -> float:
    """Median wall time of fn() in seconds, after warm-up calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def row(bench: str, case: str, impl: str, metric: str, value: float, unit: str, **extra) -> dict:
    return {"date": dt.date.today().isoformat(), "machine": machine_name(), "bench": bench, "case": case,
            "impl": impl, "metric": metric, "value": value, "unit": unit, **extra}


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = ["date", "machine", "bench", "case", "impl", "metric", "value", "unit"]
    keys += sorted({k for r in rows for k in r} - set(keys))
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)
