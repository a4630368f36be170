"""The ops' formats: plain data and the checks every implementation of an op shares, below both the
op faces (fasttrain.ops.nf4, nf4_linear, moe_experts) and the float64 reference
(fasttrain.ops.reference), so the reference imports no op face and no face is imported back.

  NF4State             what decodes a packed NF4 weight (shape, dtype, blocksize, the scales), and
                       dynamic_map(), the 8-bit table double quantization stores the absmax against
  nf4_state_absmax     the per-block float32 absmax of a state in plain PyTorch (decoded from 8
                       bits when double-quantized: blockwise8_dequantize, plus the offset)
  check_moe_args       the argument errors of moe_experts (the fused face and the reference raise
                       the same ones)

It imports torch, the kernel choice (fasttrain.ops.kernels) and, for NF4State.absmax_fp32 on the
fused path, the native loader; nothing else of fasttrain.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from fasttrain._native import load as _load
from fasttrain.ops.kernels import use_reference

__all__ = ["ABSMAX_BLOCKSIZE", "NF4State", "dynamic_map", "blockwise8_dequantize", "nf4_state_absmax",
           "check_moe_args"]

ABSMAX_BLOCKSIZE = 256  # blocksize of the double-quantized absmax, as bitsandbytes


def dynamic_map() -> torch.Tensor:
    """The signed 8-bit dynamic code of Dettmers (2015, arXiv:1511.04561), sorted, 256 float32.

    One sign bit; for exponent level e = 0..6 the fraction levels are the midpoints of 2**e + 1
    evenly spaced points on [0.1, 1], scaled by 10**(e - 6), mirrored for negatives; plus 0 and 1.
    That is 2 * 127 + 2 = 256 codes.
    """
    values: list[float] = [0.0, 1.0]
    for e in range(7):
        edges = torch.linspace(0.1, 1.0, 2**e + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scale = 10.0 ** (e - 6)  # products taken in float32, as the format's reference does
        values += (scale * mids).tolist() + ((-scale) * mids).tolist()
    assert len(values) == 256
    return torch.tensor(sorted(values), dtype=torch.float32)


def blockwise8_dequantize(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int) -> torch.Tensor:
    """The `blockwise8_dequantize` op in plain PyTorch: code[q] times each block's absmax."""
    return code.to(torch.float32)[q.long()] * absmax.repeat_interleave(blocksize)[: q.numel()]


def nf4_state_absmax(state) -> torch.Tensor:
    """The per-block float32 absmax of an NF4State (decoded from 8 bits when double-quantized)."""
    if getattr(state, "qabsmax", None) is None:
        return state.absmax
    return blockwise8_dequantize(state.qabsmax, state.absmax2, state.code, ABSMAX_BLOCKSIZE) + state.offset


@dataclass
class NF4State:
    """What is needed to decode a packed NF4 weight: shape, dtype, blocksize and the scales.

    Plain: `absmax` float32 [n_blocks]. Double-quantized: `qabsmax` uint8 [n_blocks], its float32
    scales `absmax2` [ceil(n_blocks/256)], the 256-entry `code` and the subtracted `offset`.
    """

    shape: torch.Size
    dtype: torch.dtype
    blocksize: int
    absmax: torch.Tensor | None = None
    qabsmax: torch.Tensor | None = None
    absmax2: torch.Tensor | None = None
    code: torch.Tensor | None = None
    offset: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def double_quant(self) -> bool:
        return self.qabsmax is not None

    def absmax_fp32(self) -> torch.Tensor:
        """The per-block float32 absmax (decoded from 8 bits when double-quantized)."""
        if not self.double_quant:
            return self.absmax
        if use_reference():
            return nf4_state_absmax(self)
        _load()                 # the op's schema and kernels (loaded already wherever a face ran)
        return torch.ops.fasttrain.blockwise8_dequantize(self.qabsmax, self.absmax2, self.code,
                                                         ABSMAX_BLOCKSIZE) + self.offset

    def to(self, device) -> "NF4State":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return NF4State(self.shape, self.dtype, self.blocksize, mv(self.absmax), mv(self.qabsmax),
                        mv(self.absmax2), mv(self.code), mv(self.offset))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.absmax, self.qabsmax, self.absmax2, self.code, self.offset) if t is not None)


def check_moe_args(x, expert_index, routing_weights, gate_up, down, gate_up_lora, down_lora) -> None:
    """The argument errors of moe_experts (the fused face and the reference raise the same ones
    through this); gate_up and down are fasttrain.ops.moe_experts.ExpertStack."""
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
