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
    flags: set[str] = set()
    try:
        info = dict(line.split(":", 1) for line in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
                    if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        cpu, flags = info.get("model name", cpu), set(info.get("flags", "").split())
    except OSError:
        pass
    # the vendor's marks and filler out ("Intel(R) Xeon(R) Processor" -> "Intel-Xeon", "AMD EPYC 9V74
    # 80-Core Processor" -> "AMD-EPYC-9V74-80-Core")
    import re
    cpu = re.sub(r"\((R|TM|tm|r)\)|\bCPU\b|\bProcessor\b|@.*$", " ", cpu)
    name = "-".join("".join(c if c.isalnum() else " " for c in cpu).split())
    # The CPU's model string alone does not tell hosts apart ("AMD EPYC" covers one host with AVX2
    # only and one with AVX-512 bf16), and their numbers differ by ISA: the widest matmul ISA is
    # part of the name.
    isa = ("amx" if "amx_bf16" in flags else "avx512bf16" if "avx512_bf16" in flags
           else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "")
    return f"cpu-{os.cpu_count()}c-" + name[:40].strip("-") + (f"-{isa}" if isa else "")


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


# ---- the host's limits (measured by the package: fasttrain.plan.host_rates, which `fasttrain plan` uses) ----
def matmul_gflops(dtype: torch.dtype, n: int = 1024, reps: int = 5) -> float:
    """GFLOP/s of an n x n x n matmul in `dtype` on the CPU, current thread count, median of reps."""
    from fasttrain.plan.host_rates import matmul_gflops as measure
    return measure(dtype, n=n, reps=reps)


def host_precision() -> tuple[str, str]:
    """("bf16" | "fp32", why): the faster compute precision for this host's CPU.

    The native extension says whether its kernels compute in bf16 on this CPU (`_C.cpu_has_bf16`:
    avx512_bf16 and ATen's kernels at AVX512); without the extension the faster of a bf16 and an
    fp32 1024-cube matmul here decides (a CPU without bf16 instructions runs bf16 GEMMs far slower)."""
    try:
        from fasttrain.host import cpu_bf16_compute
        native = cpu_bf16_compute()
    except Exception:  # noqa: BLE001  (no extension: the measurement decides)
        native = None
    if native is not None:
        return ("bf16" if native else "fp32"), f"native extension: cpu_has_bf16={native}"
    bf, fp = matmul_gflops(torch.bfloat16), matmul_gflops(torch.float32)
    return ("bf16" if bf > fp else "fp32"), f"measured 1024^3 matmul: bf16 {bf:.0f} vs fp32 {fp:.0f} GFLOP/s"


def memory_gbps(mib: int = 512, reps: int = 5) -> float:
    """Read bandwidth in GB/s: a sum over a `mib` MiB fp32 tensor (larger than any cache)."""
    from fasttrain.plan.host_rates import memory_gbps as measure
    return measure(mib=mib, reps=reps)
