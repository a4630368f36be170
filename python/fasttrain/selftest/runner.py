"""The selftest run: every op family's cases (CASES, in report order) with the compiled kernels
forced on, one Row each."""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Callable

import torch

from fasttrain.selftest import harness
from fasttrain.selftest.cases.attention import attention_cases, decode_attention_cases
from fasttrain.selftest.cases.decode_fused import decode_fused_cases
from fasttrain.selftest.cases.fused_logprob import logprob_cases
from fasttrain.selftest.cases.gated_delta import conv_cases, gated_delta_cases
from fasttrain.selftest.cases.gpu_packages import package_cases
from fasttrain.selftest.cases.moe import moe_cases
from fasttrain.selftest.cases.nf4 import nf4_cases
from fasttrain.selftest.cases.nf4_linear import dense_cases, linear_cases, norm_cases
from fasttrain.selftest.cases.policy_loss import policy_cases
from fasttrain.selftest.device import device_info
from fasttrain.selftest.harness import Check, Row, kernel_faces

__all__ = ["CASES", "FAMILY_CASES", "run_selftest", "implementations", "case_impl", "run_cases"]

CASES = {"fused_logprob": logprob_cases, "policy_loss": policy_cases, "nf4_quantize": nf4_cases,
         "nf4_linear": linear_cases, "nf4_dora_norm": norm_cases, "dense_linear": dense_cases,
         "gated_delta_rule": gated_delta_cases, "causal_conv1d": conv_cases, "moe_experts": moe_cases,
         "decode_attention": decode_attention_cases, "decode_fused": decode_fused_cases,
         "masked_attention": attention_cases, "gpu_packages": package_cases}

# The ops of CASES each model family trains and decodes through, by family name: the ops every
# family runs (the log-prob head, the policy loss, the NF4 and 16-bit adapted projections, the
# update's attention and the decode attention), and each family's own: the Llama family's fused
# decode step (its dense MLP layers only) and the GPU packages (their check runs a tiny Llama;
# Liger-Kernel patches the Llama family's model types), a hybrid's Gated DeltaNet rule and causal
# conv, a mixture of experts' routed experts. `fasttrain selftest` runs
# them all; a new family names the ops its layers run here (tests/test_families.py checks each is a
# case).
_EVERY_FAMILY = ("fused_logprob", "policy_loss", "nf4_quantize", "nf4_linear", "nf4_dora_norm", "dense_linear",
                 "masked_attention", "decode_attention")
_LLAMA_OWN = ("decode_fused", "gpu_packages")
_HYBRID_OWN = ("gated_delta_rule", "causal_conv1d")
FAMILY_CASES: dict[str, tuple[str, ...]] = {
    "llama": _EVERY_FAMILY + _LLAMA_OWN,
    "qwen3_5": _EVERY_FAMILY + _HYBRID_OWN,
    "qwen3_moe": _EVERY_FAMILY + ("moe_experts",),
    "qwen3_5_moe": _EVERY_FAMILY + _HYBRID_OWN + ("moe_experts",),
}


def run_selftest(device: str | torch.device = "cpu", quick: bool = False, ops: list[str] | None = None,
                 progress: Callable[[Row], None] | None = None) -> dict[str, Any]:
    """Run the cases; returns the report (device info, rows, failing rows, passed)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("selftest --device cuda: no CUDA device is visible to torch")
    if not harness.KERNELS:
        harness.KERNELS.update(kernel_faces())
    t0 = time.perf_counter()
    rows: list[Row] = []
    # fp32 GEMMs in full fp32 while checking (TF32, a user's speed choice, would be judged as an error)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        run_cases(dev, quick, ops, rows, progress)
    finally:
        torch.set_float32_matmul_precision(precision)
    failing = [asdict(r) for r in rows if not r.passed]
    return {"passed": not failing, "quick": quick, "device": device_info(dev),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - (time.perf_counter() - t0))),
            "seconds": round(time.perf_counter() - t0, 3), "cases": len(rows), "failed": len(failing),
            "failing": failing, "rows": [asdict(r) for r in rows]}


def case_impl(op: str, case: tuple) -> str:
    """A case is (name, run) or (name, run, "face:implementation"); the plain ones run op's kernel."""
    return case[2] if len(case) > 2 else f"{op}:kernel"


def implementations(device: str | torch.device, quick: bool = False) -> set[str]:
    """The "face:implementation" pairs the selftest's rows check on `device` with the packages
    installed now (building the cases runs nothing). The fake-CUDA trace of a training step asserts
    that every implementation the step dispatches to is among them."""
    dev = torch.device(device)
    return {case_impl(op, c) for op, cases in CASES.items() for c in cases(dev, quick)}


def run_cases(dev, quick, ops, rows, progress) -> None:
    from fasttrain.ops.kernels import fused_only
    with fused_only():
        for op, cases in CASES.items():
            if ops and op not in ops:
                continue
            for case in cases(dev, quick):
                name, run, impl = case[0], case[1], case_impl(op, case)
                check = Check()
                try:
                    tk, tr = run(check)
                    row = check.row(op, name, tk, tr, impl)
                except Exception as e:  # a kernel that raises fails its case; the others still run
                    row = Row(op, name, False, detail=f"{type(e).__name__}: {e}"[:500], impl=impl)
                rows.append(row)
                if progress:
                    progress(row)

