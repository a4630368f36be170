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

This is the first implementation, in torch: the N·k (token, expert) pairs are sorted by expert,
and each expert that received tokens runs its two projections over its rows, through
fasttrain.ops.nf4_linear for an NF4 stack (whose backward decodes the expert again instead of
keeping it) or F.linear for a 16-bit one; the outputs are weighted and added back per token in
float32. Autograd reaches x, routing_weights and the LoRA factors. One host sync per call (the
tokens per expert) and one pair of projections per active expert: the fused CPU and CUDA kernels
that group the GEMMs come later behind this same face. Under torch.compile (the compiled decode
step) it runs eagerly, a graph break per MoE layer: traced, its loop over the experts that got
tokens would recompile the step for every new pattern of active experts. fasttrain.ops.reference.moe_experts is the
float64 oracle (every (token, expert) pair computed on its own).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fasttrain.ops import reference as _reference
from fasttrain.ops.kernels import use_reference as _use_reference
from fasttrain.ops.nf4 import NF4State, nf4_quantize
from fasttrain.ops.nf4_linear import nf4_linear

__all__ = ["ExpertStack", "moe_experts"]


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


def check_moe_args(x, expert_index, routing_weights, gate_up: ExpertStack, down: ExpertStack,
                   gate_up_lora, down_lora) -> None:
    """The argument errors of moe_experts (the reference raises the same ones through this)."""
    if x.dim() != 2 or x.shape[1] != gate_up.in_features:
        raise ValueError(f"moe_experts: x must be [N, {gate_up.in_features}], got {tuple(x.shape)}")
    if expert_index.shape != routing_weights.shape or expert_index.dim() != 2 or expert_index.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts: expert_index and routing_weights must both be [N={x.shape[0]}, k], got "
                         f"{tuple(expert_index.shape)} and {tuple(routing_weights.shape)}")
    if gate_up.out_features != 2 * down.in_features or down.out_features != gate_up.in_features \
            or gate_up.E != down.E:
        raise ValueError(f"moe_experts: gate_up [E, 2I, H] and down [E, H, I] disagree: gate_up is "
                         f"[{gate_up.E}, {gate_up.out_features}, {gate_up.in_features}], down is "
                         f"[{down.E}, {down.out_features}, {down.in_features}]")
    for name, lora, st in (("gate_up_lora", gate_up_lora, gate_up), ("down_lora", down_lora, down)):
        if lora is None:
            continue
        a, b = lora
        if a.dim() != 3 or b.dim() != 3 or a.shape[0] != st.E or b.shape[0] != st.E or a.shape[2] != st.in_features \
                or b.shape[1] != st.out_features or a.shape[1] != b.shape[2]:
            raise ValueError(f"moe_experts: {name} must be (A [E, r, {st.in_features}], B [E, {st.out_features}, r]),"
                             f" got {tuple(a.shape)} and {tuple(b.shape)}")


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
