"""`module:factory` hooks returning tiny models of kinds fasttrain drives or refuses, each with
the bundled-free byte tokenizer of tests/support/qwen3_style.py (offline)."""
from __future__ import annotations

import torch

from support.qwen3_style import qwen3_style_tokenizer


def _pair(model):
    tok = qwen3_style_tokenizer()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.eval(), tok


def _small(**kw):
    return dict(vocab_size=len(qwen3_style_tokenizer()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, **kw)


def mixtral(dtype: str = "float32"):
    """Another mixture of experts (Mixtral): refused."""
    from transformers import MixtralConfig, MixtralForCausalLM
    return _pair(MixtralForCausalLM(MixtralConfig(**_small(num_local_experts=4, num_experts_per_tok=2))))


def qwen2_moe(dtype: str = "float32"):
    """Another mixture of experts (Qwen2-MoE, a shared expert as Qwen3.5-MoE's): refused."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return _pair(Qwen2MoeForCausalLM(Qwen2MoeConfig(**_small(num_experts=4, num_experts_per_tok=2,
                                                             moe_intermediate_size=16,
                                                             shared_expert_intermediate_size=16))))


def gemma3(dtype: str = "float32"):
    """Llama-shaped layers with a layer kind no decoder of fasttrain runs (sliding-window attention)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    return _pair(Gemma3ForCausalLM(Gemma3TextConfig(**_small(sliding_window=8))))


def qwen3_moe(dtype: str = "float32"):
    """A Qwen3-MoE (driven)."""
    from fasttrain.models.moe_tiny import tiny_qwen3_moe
    return _pair(tiny_qwen3_moe(vocab_size=len(qwen3_style_tokenizer()), hidden=32, layers=2, heads=2, kv_heads=1,
                                experts=4, top_k=2, moe_intermediate=16, dtype=getattr(torch, dtype)))


def qwen3_5_moe(dtype: str = "float32"):
    """A Qwen3.5-MoE text tower (driven)."""
    from fasttrain.models.moe_tiny import tiny_qwen3_5_moe
    return _pair(tiny_qwen3_5_moe(vocab_size=len(qwen3_style_tokenizer()), hidden=32, layers=2, interval=2, heads=2,
                                  kv_heads=1, experts=4, top_k=2, moe_intermediate=16, shared_intermediate=16,
                                  dtype=getattr(torch, dtype)))
