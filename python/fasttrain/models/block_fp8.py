"""Block-FP8 checkpoints: the layout of the "fine-grained FP8" releases (config.json's
`quantization_config.quant_method = "fp8"` with a `weight_block_size`), read back to 16 bits.

Layout (transformers' fine-grained FP8 integration, DeepSeek-V3 and the Qwen FP8 releases): a
converted linear layer stores `<module>.weight` as float8_e4m3fn [N, K] and beside it
`<module>.weight_scale_inv`, float32 [ceil(N / bm), ceil(K / bn)] for the block size (bm, bn)
(128 x 128 in every release): element (i, j) decodes as

    W[i, j] = float32(q[i, j]) * scale_inv[i // bm, j // bn]

one product in float32 (float8_e4m3fn -> float32 is exact), then cast to the model's dtype as
from_pretrained casts. The last block row and column are partial when N or K is not a multiple of
the block; they use their block's scale like the others. Modules named in `modules_to_not_convert`
(lm_head, norms, a vision tower, Qwen3.5's in_proj_a/b) are stored in 16 bits and load as usual:
what decides is each tensor's stored dtype, and an FP8 tensor without its scale is an error.

Decoded a block row at a time (`ROWS_PER_READ`): the FP8 rows as read, their float32 products and
the rows' scales are the only transient beyond the weight itself, so a 27B model's largest
projection never exists in float32 (`dequantize_buffer_bytes` is the plan's figure for it).

Refused, each with one paragraph: another quant_method (GPTQ, AWQ, compressed-tensors, ...), FP8
without weight_block_size (one scale per tensor or per channel), another FP8 format than e4m3,
static activation scales, a scale that is not float32 or whose shape does not fit the weight.
What this is not: an FP8 compute path; the weights are used in 16 bits (or as NF4) after the load.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BlockFP8", "block_fp8_format", "SCALE_SUFFIX", "dequantize_rows", "rows_per_read",
           "dequantize_buffer_bytes"]

SCALE_SUFFIX = "_scale_inv"          # <module>.weight -> <module>.weight_scale_inv
READ_BYTES = 8 << 20                 # FP8 rows + their float32 products decoded at once, at most (a block row at least)


@dataclass(frozen=True)
class BlockFP8:
    """The checkpoint's block-FP8 layout: the scale block (rows, cols) and the modules left in 16 bits."""
    block: tuple[int, int]
    not_converted: tuple[str, ...] = ()


def _refuse(where: str, what: str) -> ValueError:
    return ValueError(
        f"{where}: {what}. fasttrain reads block-FP8 checkpoints (quantization_config quant_method \"fp8\" "
        "with weight_block_size, float8_e4m3fn weights and a float32 weight_scale_inv per block, dynamic "
        "activation scales: the fine-grained FP8 layout of transformers) and 16-bit safetensors; load "
        "the model's 16-bit (BF16) release instead, or convert this one to 16-bit safetensors first.")


def block_fp8_format(config: dict | object, where: str = "model") -> BlockFP8 | None:
    """The block-FP8 layout config.json declares (a dict or a transformers config), None when the
    checkpoint declares no quantization; ValueError for every other quantization."""
    qc = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = qc.get("quant_method")
    if method != "fp8":
        raise _refuse(where, f"its config.json declares quantization_config.quant_method {method!r}")
    block = qc.get("weight_block_size")
    if block is None:
        raise _refuse(where, "its FP8 quantization_config has no weight_block_size (one scale per tensor or "
                             "per channel, not per block)")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise _refuse(where, f"its weight_block_size {block!r} is not two positive integers")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(where, f"its FP8 format is {fmt!r}")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise _refuse(where, f"its activation_scheme is {scheme!r} (static activation scales)")
    scale_fmt = qc.get("scale_fmt", "float")
    if scale_fmt != "float":
        raise _refuse(where, f"its scales are stored as {scale_fmt!r}, not float32")
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise _refuse(where, f"its experts are stored as {qc.get('expert_dtype')!r}")
    skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    return BlockFP8(block=(int(block[0]), int(block[1])), not_converted=tuple(str(s) for s in skip))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The weight_scale_inv shape of a weight [N, K]: one scale per (partial) block."""
    n, k = shape
    return -(-n // block[0]), -(-k // block[1])


def rows_per_read(n: int, k: int, block: tuple[int, int]) -> int:
    """Rows decoded at once: whole block rows, as many as fit READ_BYTES of FP8 + float32 (one at least)."""
    rows = max(1, READ_BYTES // (5 * k * block[0])) * block[0]
    return min(n, rows)


def dequantize_buffer_bytes(n: int, k: int, block: tuple[int, int]) -> int:
    """Bytes the decode of one weight [N, K] holds beside the weight it fills: its scales, one read
    of FP8 rows and their float32 products (the plan's load transient)."""
    rb, cb = scale_shape((n, k), block)
    return 4 * rb * cb + rows_per_read(n, k, block) * k * (1 + 4)


def dequantize_rows(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], row0: int,
                    out: torch.Tensor) -> None:
    """Decode FP8 rows q [r, K] (rows row0 .. row0 + r of the weight, row0 a multiple of the block's
    rows) with the weight's scale_inv [ceil(N/bm), ceil(K/bn)] into `out` [r, K] (any float dtype):
    float32(q) * scale in float32, then one cast to out's dtype. Allocates the float32 rows only."""
    bm, bn = block
    r, k = q.shape
    full = k // bn                                          # whole column blocks; a partial one may follow
    x = q.to(torch.float32)
    for i in range(0, r, bm):                               # one block row (the last may be partial)
        rows, s = x[i:i + bm], scale_inv[(row0 + i) // bm]  # s: [ceil(K/bn)]
        if full:
            rows[:, :full * bn].view(rows.shape[0], full, bn).mul_(s[None, :full, None])
        if k % bn:
            rows[:, full * bn:].mul_(s[full])
    out.copy_(x)
