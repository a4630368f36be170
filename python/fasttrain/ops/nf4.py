"""NF4 quantization in the exact bitsandbytes format.

Layout (bitsandbytes `quantize_4bit(quant_type="nf4")`): the weight is flattened row-major and cut
into blocks of `blocksize` (default 64) values; each block stores its float32 absmax, and each
value the 4-bit index of the nearest NF4 level of value/absmax, two per byte with element 2j in the
high nibble. Double quantization (QLoRA) stores the absmax vector itself in 8 bits: its mean is
subtracted and the rest is quantized blockwise (256 per block) against the signed dynamic map.
"""
from __future__ import annotations

import torch

from fasttrain._native import load as _load
from fasttrain.ops import reference as _reference
from fasttrain.ops.formats import ABSMAX_BLOCKSIZE, NF4State, dynamic_map  # noqa: F401  (re-exported)
from fasttrain.ops.kernels import use_reference as _use_reference

_load()
_ops = torch.ops.fasttrain

_DYNAMIC_MAP: dict[torch.device, torch.Tensor] = {}


def _dynamic_map_on(device: torch.device) -> torch.Tensor:
    if device not in _DYNAMIC_MAP:
        _DYNAMIC_MAP[device] = dynamic_map().to(device)
    return _DYNAMIC_MAP[device]


absmax_offset = _reference.absmax_offset  # double quantization's offset (one rule for both paths)


def nf4_quantize(w: torch.Tensor, blocksize: int = 64, double_quant: bool = False) -> tuple[torch.Tensor, NF4State]:
    """Quantize `w` (fp32/fp16/bf16, any shape) to NF4. Returns (packed uint8 [ceil(n/2)], state)."""
    _reference.check_nf4_quantize_input(w)
    if _use_reference():
        return _reference.nf4_quantize(w, blocksize, double_quant)
    packed, absmax = _ops.nf4_quantize(w.detach(), blocksize)
    state = NF4State(shape=w.shape, dtype=w.dtype, blocksize=blocksize)
    if double_quant:
        offset = absmax_offset(absmax)
        q, a2 = _ops.blockwise8_quantize(absmax - offset, _dynamic_map_on(w.device), ABSMAX_BLOCKSIZE)
        state.qabsmax, state.absmax2, state.code, state.offset = q, a2, _dynamic_map_on(w.device), offset
    else:
        state.absmax = absmax
    return packed, state


def nf4_dequantize(packed: torch.Tensor, state: NF4State, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Decode to a tensor of `state.shape` in `dtype` (default: the quantized weight's dtype)."""
    if _use_reference():
        return _reference.nf4_dequantize(packed, state, dtype)
    out = _ops.nf4_dequantize(packed, state.absmax_fp32(), state.blocksize, state.numel, dtype or state.dtype)
    return out.view(state.shape)


@torch.library.register_fake("fasttrain::nf4_quantize")
def _(w, blocksize):
    n = w.numel()
    return w.new_empty(((n + 1) // 2,), dtype=torch.uint8), w.new_empty(((n + blocksize - 1) // blocksize,),
                                                                         dtype=torch.float32)


@torch.library.register_fake("fasttrain::nf4_dequantize")
def _(packed, absmax, blocksize, numel, dtype):
    return packed.new_empty((numel,), dtype=dtype)


@torch.library.register_fake("fasttrain::blockwise8_quantize")
def _(x, code, blocksize):
    n = x.numel()
    return x.new_empty((n,), dtype=torch.uint8), x.new_empty(((n + blocksize - 1) // blocksize,))


@torch.library.register_fake("fasttrain::blockwise8_dequantize")
def _(q, absmax, code, blocksize):
    return absmax.new_empty((q.numel(),))
