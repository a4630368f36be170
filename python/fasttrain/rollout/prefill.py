"""The rollout's prefill in chunks of prompts: each chunk's own small cache, its logits only at the
last prompt position (the one the first answer token is sampled from), then its cache columns
given to its rows of the batch's cache.

Why chunks: the prefill's activations grow with the prompts run at once (a layer's locals over
n·P token rows, and each prompt's own cache until it is copied), and with many prompts (the probe's
50) they, not the decode, can set the rollout's peak. A chunk of c prompts holds c·P rows; the
batch's cache is the same. `fasttrain.plan.picks` sizes the chunk.

The three cache layouts it writes into (a chunk's rows are a view of each):
  LlamaFamilyDecoder.new_cache       one tensor [layers, 2, B, kv, S, D]
  CompiledDecode.cache (Llama)       per layer (keys, values), each [B, kv, S, D]
  HybridCache                        per layer kind, tensors with the rows first
"""
from __future__ import annotations

import torch
from torch import Tensor

from .hybrid_decoder import HybridCache

__all__ = ["prefill_in_chunks", "cache_rows"]


def cache_rows(cache, a: int, b: int):
    """Rows [a, b) of a batch cache, as a view in the same layout (writes reach the cache)."""
    if isinstance(cache, HybridCache):
        return HybridCache([None if kv is None else (kv[0][a:b], kv[1][a:b]) for kv in cache.kv],
                           [None if c is None else c[a:b] for c in cache.conv],
                           [None if r is None else r[a:b] for r in cache.rec])
    if isinstance(cache, Tensor):
        return cache[:, :, a:b]
    return [(k[a:b], v[a:b]) for k, v in cache]


def prefill_in_chunks(dec, step, ids: Tensor, valid: Tensor, cos: Tensor, sin: Tensor, cache, group: int,
                      chunk: int) -> tuple[Tensor, int]:
    """Prefill the n prompts `ids` [n, P] (valid [n, P], cos/sin [n, >= P, rot]) `chunk` at a time
    (0: all at once) and give each prompt's cache columns [0, P) to its `group` rows of `cache`
    (through `step.fill` for the compiled decode's buffers). Returns the last position's
    final-norm hidden states [n, H] and the cache width."""
    n, P = ids.shape
    chunk = n if chunk <= 0 else min(chunk, n)
    hidden, width = [], None
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        small = dec.new_cache(b - a, P)
        hidden.append(dec.prefill(ids[a:b], valid[a:b], cos[a:b, :P], sin[a:b, :P], small))
        rows = cache if (a, b) == (0, n) else cache_rows(cache, a * group, b * group)
        if step is not None:
            width = step.fill(small, rows, group, P)
        else:
            dec.copy_prompts(small, rows, group, P)
        del small
    return (hidden[0] if len(hidden) == 1 else torch.cat(hidden)), width
