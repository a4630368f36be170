"""Tiny mixture-of-experts policies of both families over tiny_world's byte tokenizer (259 ids), for
`fasttrain run` with hybrid_world's lowercase environment (tests/train)."""
from __future__ import annotations

import torch

from support.tiny_world import ByteTokenizer


def tiny_qwen3_moe_policy(dtype: str = "float32"):
    """(model, tokenizer): 3 layers, the middle one dense (mlp_only_layers), 8 experts, top-2."""
    from fasttrain.models.moe_tiny import tiny_qwen3_moe
    return tiny_qwen3_moe(vocab_size=259, hidden=64, layers=3, experts=8, top_k=2, moe_intermediate=32,
                          mlp_only_layers=(1,), dtype=getattr(torch, dtype)), ByteTokenizer()


def tiny_qwen3_5_moe_policy(dtype: str = "float32"):
    """(model, tokenizer): 4 layers (3 Gated DeltaNet + 1 gated attention), 8 experts + a shared one."""
    from fasttrain.models.moe_tiny import tiny_qwen3_5_moe
    return tiny_qwen3_5_moe(vocab_size=259, hidden=64, layers=4, interval=4, experts=8, top_k=2,
                            moe_intermediate=32, shared_intermediate=48, dtype=getattr(torch, dtype)), ByteTokenizer()
