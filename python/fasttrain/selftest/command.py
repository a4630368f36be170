"""The `fasttrain selftest` command (Typer), shared by `fasttrain selftest` (fasttrain.cli) and
`python -m fasttrain.selftest`: the rows as they run, a summary line, the report as JSON on request,
the verdict kept; exit status 0 when every case passed, 1 on any failure, 2 on a bad argument."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

__all__ = ["selftest", "app", "main", "run", "format_row"]


def format_row(r) -> str:
    """One printed line for a Row (fasttrain.selftest.harness.Row)."""
    status = "pass" if r.passed else "FAIL"
    err = f"{r.output} err {r.max_err:.3g} <= tol {r.tol:.3g}" if r.passed else \
        (f"{r.output} err {r.max_err:.3g} > tol {r.tol:.3g}" if r.output else "")
    extra = f"  {r.detail}" if r.detail else ""
    return f"{status}  {r.op:<14} {r.case:<58} {err:<48} kernel {r.kernel_ms:8.2f} ms  ref {r.ref_ms:8.2f} ms{extra}"


def run(device: str | None = None, quick: bool = False, json_path: Path | None = None,
        ops: list[str] | None = None) -> int:
    """Run the selftest as the command does; returns the exit status."""
    import torch

    from fasttrain.safe_json import json_safe
    from fasttrain.selftest.cache import record_verdict
    from fasttrain.selftest.runner import CASES, run_selftest

    unknown = sorted(set(ops or ()) - set(CASES))
    if unknown:
        print(f"selftest: unknown --op {', '.join(unknown)} (choose from {', '.join(sorted(CASES))})", file=sys.stderr)
        return 2
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        print(f"selftest: --device must be cpu or cuda, got {device!r}", file=sys.stderr)
        return 2
    try:
        report = run_selftest(device, quick, ops or None, progress=lambda r: print(format_row(r), flush=True))
    except RuntimeError as e:
        print(f"selftest: {e}", file=sys.stderr)
        return 2
    d = report["device"]
    print(f"{report['cases'] - report['failed']}/{report['cases']} cases passed on {d['name']} "
          f"({d['device']}, torch {d['torch']}, CUDA {d['cuda_runtime'] or '-'}"
          f"{', sm ' + d['compute_capability'] if d['compute_capability'] else ''}) in {report['seconds']:.1f} s")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(json_safe(report), indent=1))   # standard JSON: an infinite error as "inf"
        print(f"report: {json_path}")
    record_verdict(report)
    if not report["passed"]:
        failed = sorted({r["op"] for r in report["failing"]})
        print(f"FAILED: {', '.join(failed)}. Train with the plain-PyTorch ops meanwhile: run.kernels = \"reference\" "
              f"in the recipe (--set run.kernels=reference), or FASTTRAIN_KERNELS=reference for other trainers.")
        return 1
    return 0


def selftest(device: Optional[str] = typer.Option(None, "--device",
                                                  help="cpu or cuda (default: cuda when visible, else cpu)"),
             quick: bool = typer.Option(False, "--quick", help="a few cases per op (seconds)"),
             json_out: Optional[Path] = typer.Option(None, "--json",
                                                     help="write the report (device, versions, every row) here"),
             op: list[str] = typer.Option([], "--op", help="only this op (repeatable)")) -> None:
    """Check every compiled kernel against the float64 reference on this device; exit 1 on any failure."""
    raise typer.Exit(run(device, quick, json_out, op))


app = typer.Typer(add_completion=False)
app.command()(selftest)


def main(argv: list[str] | None = None) -> int:
    """The command on `argv` (default: sys.argv[1:]); returns the exit status instead of exiting."""
    import click

    command = typer.main.get_command(app)
    try:
        return command.main(args=argv, prog_name="fasttrain selftest", standalone_mode=False) or 0
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Abort:
        return 1
