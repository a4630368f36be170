"""What every selftest case runs in: the op faces under test (KERNELS, a test swaps one for a wrong
kernel), the comparison that keeps the worst error against its tolerance (Check), the row it becomes
(Row), timing, fresh leaves and seeded generators."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Row", "Check", "KERNELS", "kernel", "kernel_faces", "timed", "leaf", "gen"]


def kernel_faces() -> dict[str, Callable]:
    """The op faces whose compiled kernels are checked (a test swaps one for a wrong kernel)."""
    import fasttrain.ops as F
    from fasttrain.nn.dense_linear import dense_linear
    return {"fused_logprob": F.fused_logprob, "policy_loss": F.policy_loss, "nf4_quantize": F.nf4_quantize,
            "nf4_dequantize": F.nf4_dequantize, "nf4_linear": F.nf4_linear, "nf4_dora_norm": F.nf4_dora_norm,
            "nf4_weight_sq_norm": F.nf4_weight_sq_norm, "dense_linear": dense_linear,
            "gated_delta_rule": F.gated_delta_rule, "gated_delta_step": F.gated_delta_step,
            "gated_delta_step_": F.gated_delta_step_, "causal_conv1d": F.causal_conv1d, "causal_conv1d_step": F.causal_conv1d_step,
            "moe_experts": F.moe_experts, "decode_attention": F.decode_attention, "rms_norm": F.rms_norm,
            "rotary_cache_write_": F.rotary_cache_write_, "silu_mul": F.silu_mul,
            "masked_attention": F.masked_attention}


KERNELS: dict[str, Callable] = {}


def kernel(name: str) -> Callable:
    """The face under test for op `name` (KERNELS, filled with the real faces when empty, so a case
    run on its own, outside run_selftest, checks the real kernels)."""
    if not KERNELS:
        KERNELS.update(kernel_faces())
    return KERNELS[name]


@dataclass
class Row:
    op: str
    case: str
    passed: bool
    output: str = ""          # the output with the worst error/tolerance ratio
    max_err: float = 0.0      # its error ...
    tol: float = 0.0          # ... and the derived tolerance at that element
    kernel_ms: float = 0.0
    ref_ms: float = 0.0
    detail: str = ""          # what failed beyond a value (dtype, shape, exception)
    impl: str = ""            # "face:implementation" the case ran (e.g. gated_delta_rule:fla)


# ---- comparison -------------------------------------------------------------------------------
class Check:
    """Collects (output, kernel value, float64 reference, elementwise tolerance) and keeps the worst."""

    def __init__(self):
        self.worst = ("", 0.0, 0.0, -1.0)   # output, err, tol, ratio
        self.problems: list[str] = []

    def close(self, name: str, got: torch.Tensor, want: torch.Tensor, tol, dtype: torch.dtype | None = None):
        if dtype is not None and got.dtype != dtype:
            self.problems.append(f"{name}: dtype {got.dtype}, expected {dtype}")
        if tuple(got.shape) != tuple(want.shape):
            self.problems.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            return
        if got.numel() == 0:
            return
        g = got.detach().to("cpu", torch.float64)
        w = want.detach().to("cpu", torch.float64)
        t = torch.as_tensor(tol, dtype=torch.float64).to("cpu").expand_as(w)
        err = (g - w).abs()
        err = torch.where(torch.isnan(err) | (torch.isfinite(w) & ~torch.isfinite(g)), torch.full_like(err, math.inf), err)
        ratio = err / t.clamp(min=1e-300)
        ratio = torch.where((err == 0), torch.zeros_like(ratio), ratio)
        i = int(ratio.reshape(-1).argmax())
        r = float(ratio.reshape(-1)[i])
        if r > self.worst[3]:
            self.worst = (name, float(err.reshape(-1)[i]), float(t.reshape(-1)[i]), r)

    def exact(self, name: str, got: torch.Tensor, want: torch.Tensor):
        """Bit-for-bit: the error is the number of differing entries, the tolerance 0."""
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            self.problems.append(f"{name}: {got.dtype}{tuple(got.shape)}, expected {want.dtype}{tuple(want.shape)}")
            return
        g, w = got.detach().cpu(), want.detach().cpu()
        diff = int((g != w).sum()) if not g.is_floating_point() else int(((g != w) & ~(g.isnan() & w.isnan())).sum())
        r = math.inf if diff else 0.0
        if r > self.worst[3]:
            self.worst = (name, float(diff), 0.0, r)

    def row(self, op, case, t_kernel, t_ref, impl: str = "") -> Row:
        name, err, tol, ratio = self.worst
        ok = ratio <= 1.0 and not self.problems
        return Row(op, case, ok, name, err, tol, 1e3 * t_kernel, 1e3 * t_ref, "; ".join(self.problems),
                   impl or f"{op}:kernel")


def timed(fn: Callable, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t


def rounding(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The most that rounding x to dtype can change it: u·|x|, and half the subnormal spacing
    (u·tiny) below the smallest normal number."""
    return U[dtype] * x.abs().clamp(min=torch.finfo(dtype).tiny)


def leaf(x: torch.Tensor | None, device, dtype=None) -> torch.Tensor | None:
    """A fresh leaf that requires grad (never the input itself)."""
    if x is None:
        return None
    return x.detach().to(device=device, dtype=dtype or x.dtype).clone().requires_grad_()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)

