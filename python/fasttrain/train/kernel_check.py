"""The kernel check before step 1: on a CUDA device, `fasttrain selftest --quick` on that device.

The trainer calls `check_kernels` inside its `run.kernels` choice. With the compiled kernels on a
CUDA device it runs the quick selftest (a few seconds), writes the report to the run folder
(selftest.json: device, driver, versions, every case), records the verdict for `fasttrain info`,
and returns a message naming each failing op when one fails: the run must not train on a wrong
kernel. With `run.kernels = "reference"` it writes why it did not check. On the CPU it does
nothing: the CPU kernels are the ones `make test` checks (it runs `fasttrain selftest` on the CPU).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fasttrain.train.run_files import write_json

__all__ = ["check_kernels", "run_quick_selftest", "SELFTEST_DEVICES"]

SELFTEST_DEVICES = ("cuda",)


def run_quick_selftest(device: torch.device) -> dict[str, Any]:
    from fasttrain.selftest.runner import run_selftest
    return run_selftest(device, quick=True)


def check_kernels(device: torch.device | str, run_dir: Path, console=None, write: bool = True) -> str | None:
    """None when training may start; otherwise the message that stops it. Every rank of a
    distributed run checks its own device; only the one with `write` (rank 0) writes selftest.json."""
    from fasttrain.ops.kernels import kernels
    device = torch.device(device)
    if device.type not in SELFTEST_DEVICES:
        return None
    run_dir = Path(run_dir)
    if write:
        run_dir.mkdir(parents=True, exist_ok=True)
    if kernels() == "reference":
        if write:
            write_json(run_dir / "selftest.json", {"skipped": "the plain-PyTorch reference ops run (run.kernels = "
                                                              "\"reference\" or FASTTRAIN_KERNELS=reference)"})
        return None
    if console is not None:
        console.print(f"checking the compiled kernels on {device} (fasttrain selftest --quick) ...")
    report = run_quick_selftest(device)
    if write:
        write_json(run_dir / "selftest.json", report)
    from fasttrain.selftest.cache import record_verdict
    record_verdict(report)
    if report["passed"]:
        if console is not None:
            console.print(f"kernels verified on {report['device'].get('name')}: {report['cases']} cases in "
                          f"{report['seconds']:.1f} s")
        return None
    failing = report["failing"]
    ops = sorted({r["op"] for r in failing})
    cases = "; ".join(f"{r['op']} [{r['case']}] " + (f"{r['output']} error {r['max_err']:.3g} > tolerance {r['tol']:.3g}"
                                                      if r["output"] else r["detail"]) for r in failing[:3])
    return (f"the compiled kernels failed `fasttrain selftest --quick` on {report['device'].get('name')} "
            f"({len(failing)} of {report['cases']} cases; failing op{'s' if len(ops) > 1 else ''}: {', '.join(ops)}): "
            f"{cases}{' ...' if len(failing) > 3 else ''}. Training did not start, so nothing trains on a wrong kernel. "
            f"Train with the plain-PyTorch ops instead: set run.kernels = \"reference\" in the recipe "
            f"(or --set run.kernels=reference)."
            + (" A failing gpu_packages case is flash-attn or Liger-Kernel giving wrong logits on this device "
               "(the check runs for each one installed): uninstall that package (pip uninstall flash-attn "
               "liger-kernel)." if "gpu_packages" in ops else "")
            + f" The full report is {run_dir / 'selftest.json'}.")
