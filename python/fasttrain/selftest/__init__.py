"""`fasttrain selftest`: every compiled kernel against the float64 reference, on this device.

    fasttrain selftest [--device cpu|cuda] [--quick] [--json PATH]

Each op runs on a fixed set of cases (odd sizes, several vocabulary chunks and token blocks,
bf16/fp16/fp32, ignore_index, bool and weighted masks, M in {1, 7, 64, 65, 300}), forward and
backward, through its face in fasttrain.ops with the compiled kernels forced on; the same inputs
(already rounded to the case's dtype) go to fasttrain.ops.reference in float64. One row per op and
case: pass/fail, the worst error against its derived tolerance, kernel and reference time. The exit
status is 1 on any failure. The verdict is also kept in a small cache (see `verdict_path`), which
`fasttrain info` and the trainer read; the trainer runs `--quick` on a CUDA device before step 1.

The package: `bounds` (the unit roundoffs and the derived bounds, which the tests use too),
`harness` (the faces under test, the comparison, a row), `cases/` (one module per op family),
`runner` (the run), `device` (what a bug report needs), `cache` (the verdicts), `command` (the
Typer command behind `fasttrain selftest` and `python -m fasttrain.selftest`). The names below are
loaded on first use, so `fasttrain --help` does not import torch.
"""
from __future__ import annotations

__all__ = ["Row", "run_selftest", "main", "verdict_path", "read_verdict", "record_verdict", "verdict_line",
           "device_info", "KERNELS", "kernel", "implementations", "CASES", "cache_dir", "build_id",
           "attention_grad_bounds", "format_row"]


def __getattr__(name: str):
    """The public names, each from the module that defines it (imported on first use)."""
    if name in ("Row", "KERNELS", "kernel"):
        from fasttrain.selftest import harness
        return getattr(harness, name)
    if name in ("run_selftest", "implementations", "CASES"):
        from fasttrain.selftest import runner
        return getattr(runner, name)
    if name in ("verdict_path", "read_verdict", "record_verdict", "verdict_line", "cache_dir", "build_id"):
        from fasttrain.selftest import cache
        return getattr(cache, name)
    if name == "device_info":
        from fasttrain.selftest.device import device_info
        return device_info
    if name == "attention_grad_bounds":
        from fasttrain.selftest.bounds import attention_grad_bounds
        return attention_grad_bounds
    if name in ("main", "format_row"):
        from fasttrain.selftest import command
        return getattr(command, name)
    raise AttributeError(f"module 'fasttrain.selftest' has no attribute {name!r}")
