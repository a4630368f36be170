"""Rollout: G sampled completions per prompt on a static KV cache (token ids, masks, lengths,
behaviour log-probs)."""

from .decoder import LlamaFamilyDecoder
from .sampling import Rollout, Truncation, sample

__all__ = ["LlamaFamilyDecoder", "Rollout", "Truncation", "sample"]
