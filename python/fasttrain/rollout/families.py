"""The rollout's piece of each model family: which decoder drives it on the static cache.

    dec = decoder_for(model, weights)   # LlamaFamilyDecoder, HybridDecoder or their MoE pieces

Both decoders take the same calls from the sampling loop (new_cache, rotary_table, prefill,
copy_prompts, decode with a per-row `active` mask, lm_head); what their caches hold differs by
layer kind (fasttrain.rollout.hybrid_decoder says what a hybrid's holds).
"""
from __future__ import annotations

from fasttrain.models.families import family_of

from .decoder import LlamaFamilyDecoder
from .hybrid_decoder import HybridDecoder
from .moe_decoder import MoEDecoder, MoEHybridDecoder

__all__ = ["DECODERS", "decoder_for"]

DECODERS = {"llama": LlamaFamilyDecoder, "qwen3_5": HybridDecoder, "qwen3_moe": MoEDecoder,
            "qwen3_5_moe": MoEHybridDecoder}


def decoder_for(model, weights=None):
    """The decoder of `model`'s family (a ValueError naming the supported model types otherwise)."""
    try:
        family = family_of(model, "sample")
    except ValueError:
        family = None
    if family is None:          # a Llama-like model from a user factory: the Llama decoder checks it
        return LlamaFamilyDecoder(model, weights)
    return DECODERS[family.name](model, weights)
