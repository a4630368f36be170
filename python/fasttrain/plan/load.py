"""Memory of loading the policy, the phase before the first step (fasttrain.models.stream_load).

Peak = the loaded model (NF4 base + unquantised parts) + the largest transient of one tensor:
  a projection   its weight in the model dtype, and then the packed codes + absmax that
                 nf4_quantize returns before they are copied into the layer (the layer's own are
                 in the base), or before that, while the checkpoint's dtype differs from the
                 model's, the read buffer (READ_CHUNK_BYTES at most) the weight is cast from
  another tensor (embedding, lm_head, norms) the read buffer while it is cast; nothing when the
                 dtypes agree (the tensor read is the tensor kept)
  a block-FP8    projection: beside its weight in the model dtype, the decode's buffer
                 (fasttrain.models.block_fp8.dequantize_buffer_bytes: the scales, one read of FP8
                 rows and their float32 products), then the NF4 codes; with a 16-bit base the
                 decoded weight is the resident one and the buffer is the transient
The checkpoint's dtype is config.json's `dtype` (or `torch_dtype`); the model's when it has none;
a block-FP8 checkpoint's projections are FP8 (every adapted projection is counted as FP8, the
largest decides). A 16-bit model without NF4 layers loads through from_pretrained: the NF4 figure
is its floor.
Not modelled: a projection's weight waiting for its bias in another shard, a tied tensor stored
twice (read to be compared), Python objects, the build's placeholder of each parameter (one at a
time, before any is loaded).
"""
from __future__ import annotations

from fasttrain.models.block_fp8 import dequantize_buffer_bytes
from fasttrain.models.stream_load import READ_CHUNK_BYTES
from fasttrain.plan.meta_model import ModelShape
from fasttrain.plan.moe_memory import load_parts

__all__ = ["load_phase", "NF4_BLOCKSIZE"]

NF4_BLOCKSIZE = 64          # fasttrain.nn.quantize_model's and the loader's


def _nf4_bytes(n: int) -> int:
    """Packed 4-bit codes + one fp32 absmax per block of a projection of n weights."""
    return (n + 1) // 2 + -(-n // NF4_BLOCKSIZE) * 4


def load_phase(m: ModelShape) -> dict:
    """{part: bytes} at the load's peak: the model's resident base parts and `load_transient`."""
    w, sw = m.w, m.stored_w or m.w
    cast = sw != w

    def buffer(n: int) -> int:                # the read buffer of a tensor of n elements being cast
        return min(n * sw, READ_CHUNK_BYTES // sw * sw) if cast else 0
    projection = 0
    fp8 = m.fp8_block
    if fp8 and m.quantize == "none":          # each weight decoded into its resident place
        projection = max((dequantize_buffer_bytes(o, i, fp8) for o, i in m.projections), default=0)
    elif m.resident.get("nf4_base", 0):
        for o, i in m.projections:
            n = o * i
            read = dequantize_buffer_bytes(o, i, fp8) if fp8 else buffer(n)
            projection = max(projection, n * w + max(_nf4_bytes(n), read))
    other = buffer(m.vocab * m.hidden)                       # the largest unquantised tensor: the embedding
    moe, experts = load_parts(m)                             # a mixture of experts' stacks (fasttrain.plan.moe_memory)
    return {"nf4_base": m.resident.get("nf4_base", 0), "dense_parts": m.resident.get("dense_parts", 0), **moe,
            "load_transient": max(projection, other, experts)}
