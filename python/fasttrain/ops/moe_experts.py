"""moe_experts: the routed experts of a mixture-of-experts layer as one op.

    y = moe_experts(x, expert_index, routing_weights, gate_up, down, gate_up_lora, down_lora, scale)

For tokens x [N, H], each routed to k experts (expert_index [N, k], routing_weights [N, k]):
    y_n = Σ_j w_nj · D_e(silu(G_e(x_n)) ⊙ U_e(x_n)),   e = expert_index[n, j]
with [G_e; U_e] = gate_up[e] [2I, H] (gate half first, transformers 5.x's fused layout) and
D_e = down[e] [H, I], each plus its LoRA term: (x·A_eᵀ)·B_eᵀ·scale with A_e [r, in], B_e [out, r].

Each stack is an `ExpertStack`: 16-bit (the model's [E, out, in] tensor) or NF4 with every expert
quantized on its own (its own blocks and scales, bitsandbytes' layout per expert), so one expert's
slice is an NF4 weight in itself and the stack is never dequantised whole. The LoRA factor
products run factorised: ΔW = B·A is never formed.

On the CPU the op is fasttrain's kernel (csrc/cpu/moe_experts.cpp): the (token, slot) pairs
grouped by expert by a counting sort inside the op, each expert's weight decoded a tile of rows at
a time inside the matmul (never a dequantised expert), the SwiGLU taken on each gate/up tile, the
routing weights and the k-slot sum applied per token at the end; its backward (to x, the routing
weights and the LoRA factors) decodes the weights again. Its GEMMs run in bfloat16 for bfloat16 x
where the CPU has native bf16 GEMMs (avx512_bf16 / AMX), else in the compute dtype (float32,
float64 for float64); sums across tiles, the SwiGLU, the k-slot sum and the gradients' accumulation
are in the compute dtype. On CUDA tensors it is fasttrain's CUDA
kernel (csrc/cuda/kernels/moe_experts.cuh): the same op with the grouping, the NF4 decode inside the
grouped projections, the fused SwiGLU and the factorised LoRA on the device, no host sync, computing
in float32 (x float32/float16/bfloat16, stacks NF4 or float32/float16/bfloat16). The torch form is
the fallback: the N·k pairs sorted by expert, and each expert that received tokens runs its two
projections over its rows, through fasttrain.ops.nf4_linear for an NF4 stack or F.linear for a
16-bit one, the outputs weighted and added back per token in float32; one host sync per call (the
tokens per expert). It runs on any other device, on CUDA when fasttrain._C_cuda is missing or was
built without this kernel, for float64 or a float64 stack on CUDA, for stacks of different NF4
blocksizes, and whenever FASTTRAIN_MOE_CUDA=torch is set (read at every call; "kernel", the
default, or "torch"). Under torch.compile (the compiled decode step) it runs eagerly, a graph
break per MoE layer: traced, the torch form's loop over the experts that got tokens would
recompile the step for every new pattern of active experts. fasttrain.ops.reference.moe_experts is
the float64 oracle (every (token, expert) pair computed on its own).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fasttrain._native import load as _load
from fasttrain.ops import reference as _reference
from fasttrain.ops.formats import check_moe_args
from fasttrain.ops.kernels import use_reference as _use_reference
from fasttrain.ops.nf4 import NF4State, nf4_quantize
from fasttrain.ops.nf4_linear import nf4_linear

_load()
_ops = torch.ops.fasttrain

__all__ = ["ExpertStack", "moe_experts", "CUDA_FORM_VAR"]
CUDA_FORM_VAR = "FASTTRAIN_MOE_CUDA"  # "kernel" (the default) or "torch": what CUDA tensors run
_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class ExpertStack:
    """A fused stack of E expert weights [E, out, in]: `weight` (16-bit) or NF4 per expert
    (`qweight` uint8 [E, ceil(out·in/2)], `absmax` fp32 [E, blocks]; with double quantisation
    `qabsmax` uint8 [E, blocks], `absmax2` fp32 [E, ceil(blocks/256)], `offset` fp32 [E] and the
    one shared 256-entry `code`)."""

    E: int
    out_features: int
    in_features: int
    dtype: torch.dtype
    weight: torch.Tensor | None = None
    blocksize: int = 64
    qweight: torch.Tensor | None = None
    absmax: torch.Tensor | None = None
    qabsmax: torch.Tensor | None = None
    absmax2: torch.Tensor | None = None
    code: torch.Tensor | None = None
    offset: torch.Tensor | None = None

    @property
    def nf4(self) -> bool:
        return self.qweight is not None

    def expert_state(self, e: int) -> NF4State:
        """The NF4State of expert e's [out, in] weight (views of the stack's rows)."""
        shape = torch.Size((self.out_features, self.in_features))
        if self.qabsmax is not None:
            return NF4State(shape, self.dtype, self.blocksize, qabsmax=self.qabsmax[e], absmax2=self.absmax2[e],
                            code=self.code, offset=self.offset[e])
        return NF4State(shape, self.dtype, self.blocksize, absmax=self.absmax[e])

    def absmax_fp32(self) -> torch.Tensor:
        """The float32 block absmax of every expert [E, blocks] (decoded from 8 bits when
        double-quantized: in one call when each expert's blocks fill whole 256-block groups)."""
        if self.qabsmax is None:
            return self.absmax
        blocks = self.qabsmax.shape[1]
        if blocks % 256 == 0 and self.absmax2.shape[1] == blocks // 256 and not _use_reference():
            flat = _ops.blockwise8_dequantize(self.qabsmax.reshape(-1), self.absmax2.reshape(-1), self.code, 256)
            return flat.view(self.E, blocks) + self.offset.view(-1, 1)
        return torch.stack([self.expert_state(e).absmax_fp32() for e in range(self.E)])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stack's stored tensors by field name (what a module registers as buffers)."""
        names = ("weight", "qweight", "absmax", "qabsmax", "absmax2", "code", "offset")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @classmethod
    def quantize(cls, experts, blocksize: int = 64, double_quant: bool = False) -> "ExpertStack":
        """NF4 of each expert weight [out, in] of `experts` (a [E, out, in] tensor or a sequence of
        E tensors), one expert at a time (the 16-bit stack need not exist whole). On the meta device
        (fasttrain plan) one expert's quantization gives every expert's shapes."""
        if experts[0].device.type == "meta":
            one = nf4_quantize(experts[0].float() if experts[0].dtype == torch.float64 else experts[0],
                               blocksize=blocksize, double_quant=double_quant)
            return cls.from_quantized([one] * len(experts), experts[0].dtype)
        return cls.from_quantized([nf4_quantize((w.float() if w.dtype == torch.float64 else w).contiguous(),
                                                blocksize=blocksize, double_quant=double_quant) for w in experts],
                                  experts[0].dtype)

    @classmethod
    def from_quantized(cls, quantized, dtype: torch.dtype) -> "ExpertStack":
        """The stack of E experts each already quantized: [(packed, NF4State)] in expert order."""
        packed, states = [p for p, _ in quantized], [s for _, s in quantized]
        s0 = states[0]
        blocksize, double_quant = s0.blocksize, s0.double_quant
        out_f, in_f = s0.shape
        stack = cls(len(packed), out_f, in_f, dtype, blocksize=blocksize, qweight=torch.stack(packed))
        if double_quant:
            stack.qabsmax = torch.stack([s.qabsmax for s in states])
            stack.absmax2 = torch.stack([s.absmax2 for s in states])
            stack.offset = torch.stack([s.offset for s in states])
            stack.code = s0.code
        else:
            stack.absmax = torch.stack([s.absmax for s in states])
        return stack


def _project(stack: ExpertStack, e: int, x: torch.Tensor, lora, scale: float) -> torch.Tensor:
    """Expert e's projection of x [n, in] -> [n, out] in x.dtype, plus its LoRA term."""
    a, b = (None, None) if lora is None else (lora[0][e], lora[1][e])
    if stack.nf4:
        return nf4_linear(x, stack.qweight[e], stack.expert_state(e), a, b, scale)
    y = F.linear(x, stack.weight[e])
    if a is None:
        return y
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (y.to(ct) + F.linear(F.linear(x.to(ct), a.to(ct)), b.to(ct)) * scale).to(x.dtype)


@torch.compiler.disable
def moe_experts(x: torch.Tensor, expert_index: torch.Tensor, routing_weights: torch.Tensor, gate_up: ExpertStack,
                down: ExpertStack, gate_up_lora: tuple[torch.Tensor, torch.Tensor] | None = None,
                down_lora: tuple[torch.Tensor, torch.Tensor] | None = None, scale: float = 1.0) -> torch.Tensor:
    """x [N, H] -> [N, H] in x.dtype (see the module header). expert_index long [N, k] in [0, E);
    routing_weights [N, k] (any float dtype; the weighted sum is float32, float64 for float64 x);
    gate_up_lora = (A [E, r, H], B [E, 2I, r]), down_lora = (A [E, r, I], B [E, H, r]), fp32 masters.
    Autograd: x, routing_weights and the LoRA factors."""
    check_moe_args(x, expert_index, routing_weights, gate_up, down, gate_up_lora, down_lora)
    if _use_reference():
        return _reference.moe_experts(x, expert_index, routing_weights, gate_up, down, gate_up_lora, down_lora,
                                      scale)
    if x.device.type == "cpu" or (x.device.type == "cuda" and _cuda_kernel_runs(x, gate_up, down)):
        return _moe_experts_kernel(x, expert_index, routing_weights, gate_up, down, gate_up_lora, down_lora, scale)
    return moe_experts_torch(x, expert_index, routing_weights, gate_up, down, gate_up_lora, down_lora, scale)


def _cuda_kernel_runs(x: torch.Tensor, gate_up: ExpertStack, down: ExpertStack) -> bool:
    """Whether CUDA tensors go to fasttrain's CUDA kernel (the module header says when they do not)."""
    form = os.environ.get(CUDA_FORM_VAR, "kernel").strip().lower() or "kernel"
    if form not in ("kernel", "torch"):
        raise ValueError(f"{CUDA_FORM_VAR}={form!r}: allowed values are 'kernel' (fasttrain's CUDA kernel, the "
                         f"default) and 'torch' (the torch form)")
    if form == "torch" or not torch._C._dispatch_has_kernel_for_dispatch_key("fasttrain::moe_experts", "CUDA"):
        return False
    return x.dtype in _CUDA_DTYPES and all(s.nf4 or s.weight.dtype in _CUDA_DTYPES for s in (gate_up, down))


def moe_experts_torch(x: torch.Tensor, expert_index: torch.Tensor, routing_weights: torch.Tensor,
                      gate_up: ExpertStack, down: ExpertStack, gate_up_lora=None, down_lora=None,
                      scale: float = 1.0) -> torch.Tensor:
    """The torch form of moe_experts (see the module header): the fallback where no kernel runs, and
    the tests' second implementation."""
    N, k = expert_index.shape
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    flat = expert_index.reshape(-1)
    order = torch.argsort(flat, stable=True)                          # (token, slot) pairs grouped by expert
    token = order // k
    counts = torch.bincount(flat, minlength=gate_up.E).tolist()       # the one host sync
    xs = x[token]
    outs, start = [], 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        h = _project(gate_up, e, xs[start:start + c], gate_up_lora, scale)
        g, u = h.chunk(2, dim=-1)
        outs.append(_project(down, e, F.silu(g) * u, down_lora, scale))
        start += c
    ys = torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])
    w = routing_weights.reshape(-1)[order].to(acc)
    y = torch.zeros(N, x.shape[1], dtype=acc, device=x.device).index_add(0, token, ys.to(acc) * w[:, None])
    return y.to(x.dtype)


# ---- the kernel: fasttrain::moe_experts, its fake and its autograd ----------------------------------
def _stack_args(stack: ExpertStack):
    """(weight or packed bytes, fp32 absmax or None) of a stack, as the op takes them."""
    return (stack.qweight, stack.absmax_fp32().contiguous()) if stack.nf4 else (stack.weight, None)


def _moe_experts_kernel(x, expert_index, routing_weights, gate_up: ExpertStack, down: ExpertStack, gate_up_lora,
                        down_lora, scale):
    if gate_up.nf4 and down.nf4 and gate_up.blocksize != down.blocksize:
        return moe_experts_torch(x, expert_index, routing_weights, gate_up, down, gate_up_lora, down_lora, scale)
    gu, gu_am = _stack_args(gate_up)
    dn, dn_am = _stack_args(down)
    ga, gb = gate_up_lora if gate_up_lora is not None else (None, None)
    da, db = down_lora if down_lora is not None else (None, None)
    grads = [t for t in (x, routing_weights, ga, gb, da, db) if t is not None]
    save = torch.is_grad_enabled() and any(t.requires_grad for t in grads)
    y, *_ = _ops.moe_experts(x, expert_index.long(), routing_weights, gu, gu_am, dn, dn_am,
                             gate_up.blocksize if gate_up.nf4 else down.blocksize, down.in_features, ga, gb, da,
                             db, float(scale), save)
    return y


def _ct(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _cpu_gemm_dtype(x):
    """The CPU kernel's GEMM dtype (h's): bfloat16 for bfloat16 x where the CPU has native bf16
    GEMMs (the extension's own answer, as nf4_linear's), else the compute dtype."""
    if x.dtype == torch.bfloat16:
        from fasttrain.host import cpu_bf16_compute
        if cpu_bf16_compute():
            return torch.bfloat16
    return _ct(x)


@torch.library.register_fake("fasttrain::moe_experts")
def _(x, expert_index, routing_weights, gate_up, gate_up_absmax, down, down_absmax, blocksize, intermediate,
      gate_up_a, gate_up_b, down_a, down_b, scale, save):
    N, H = x.shape
    P = N * expert_index.shape[1]
    ct = _ct(x)
    if x.device.type == "cpu":          # the CPU kernel: h in its GEMM dtype, no outputs kept
        gt = _cpu_gemm_dtype(x)
        h = x.new_empty((P, 2 * intermediate) if save else (0,), dtype=gt)
        out = x.new_empty((0,), dtype=gt)
    else:
        h = x.new_empty((P, 2 * intermediate) if save else (0,), dtype=ct)
        out = x.new_empty((P, H) if save else (0,), dtype=ct)
    return (x.new_empty((N, H)), expert_index.new_empty((P,)), expert_index.new_empty((gate_up.shape[0] + 1,)), h,
            out)


@torch.library.register_fake("fasttrain::moe_experts_backward")
def _(dy, x, expert_index, routing_weights, gate_up, gate_up_absmax, down, down_absmax, blocksize, intermediate,
      gate_up_a, gate_up_b, down_a, down_b, scale, order, offsets, h, out, output_mask):
    ct = _ct(x)
    e = lambda: x.new_empty((0,), dtype=ct)  # noqa: E731  (a fresh tensor per output: outputs never alias)
    lora = lambda t: t.new_empty(t.shape, dtype=ct) if (t is not None and output_mask[2]) else e()  # noqa: E731
    return (x.new_empty(x.shape) if output_mask[0] else e(),
            routing_weights.new_empty(routing_weights.shape) if output_mask[1] else e(),
            lora(gate_up_a), lora(gate_up_b), lora(down_a), lora(down_b))


def _setup_context(ctx, inputs, output):
    (x, expert_index, routing_weights, gate_up, gate_up_absmax, down, down_absmax, blocksize, intermediate,
     ga, gb, da, db, scale, _save) = inputs
    _, order, offsets, h, out = output
    ctx.save_for_backward(x, expert_index, routing_weights, gate_up, gate_up_absmax, down, down_absmax, ga, gb, da,
                          db, order, offsets, h, out)
    ctx.blocksize, ctx.intermediate, ctx.scale = blocksize, intermediate, scale


def _backward(ctx, dy, *_unused):
    (x, expert_index, routing_weights, gate_up, gate_up_absmax, down, down_absmax, ga, gb, da, db, order, offsets,
     h, out) = ctx.saved_tensors
    need = ctx.needs_input_grad
    mask = [bool(need[0]), bool(need[2]), any(bool(need[i]) for i in (9, 10, 11, 12))]
    none = [None] * 15
    if dy is None or not any(mask):
        return tuple(none)
    dx, dw, dga, dgb, dda, ddb = _ops.moe_experts_backward(
        dy.contiguous(), x, expert_index, routing_weights, gate_up, gate_up_absmax, down, down_absmax, ctx.blocksize,
        ctx.intermediate, ga, gb, da, db, ctx.scale, order, offsets, h, out, mask)
    grads = none
    grads[0] = dx if mask[0] else None
    grads[2] = dw if mask[1] else None
    for i, t, g in ((9, ga, dga), (10, gb, dgb), (11, da, dda), (12, db, ddb)):
        grads[i] = g.to(t.dtype) if (t is not None and need[i]) else None
    return tuple(grads)


torch.library.register_autograd("fasttrain::moe_experts", _backward, setup_context=_setup_context)
