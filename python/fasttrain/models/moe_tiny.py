"""tiny_qwen3_moe, tiny_qwen3_5_moe: random, seeded, few-layer mixture-of-experts models of both MoE
families for fast tests (transformers' own classes, eval mode, on the CPU)."""
from __future__ import annotations

import torch

from .tiny import spread_logits

__all__ = ["tiny_qwen3_moe", "tiny_qwen3_5_moe"]


def _spread_router(model, hidden: int, std: float) -> None:
    """transformers initialises routers to (near) zero, so every expert ties; router weights of
    std `std`/sqrt(hidden) separate the top-k (logits of std ~`std` for unit-RMS inputs)."""
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            p.normal_(0.0, std / hidden ** 0.5)


def tiny_qwen3_moe(vocab_size: int = 49152, hidden: int = 64, layers: int = 3, heads: int = 4, kv_heads: int = 2,
                   experts: int = 8, top_k: int = 2, moe_intermediate: int = 32, decoder_sparse_step: int = 1,
                   mlp_only_layers: tuple[int, ...] = (1,), norm_topk_prob: bool = True, router_std: float = 2.0,
                   seed: int = 0, dtype: torch.dtype = torch.float32):
    """Random Qwen3MoeForCausalLM: layer i is sparse when i is not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0, else a dense MLP of width 2·hidden. EOS id 2, pad id 0."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=decoder_sparse_step, mlp_only_layers=list(mlp_only_layers),
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _build(Qwen3MoeForCausalLM, config, hidden, router_std, seed, dtype)


def tiny_qwen3_5_moe(vocab_size: int = 49152, hidden: int = 64, layers: int = 4, interval: int = 4, heads: int = 4,
                     kv_heads: int = 2, head_dim: int = 16, linear_k_heads: int = 2, value_heads_per_key: int = 2,
                     linear_head_dim: int = 16, experts: int = 8, top_k: int = 2, moe_intermediate: int = 32,
                     shared_intermediate: int = 48, router_std: float = 2.0, seed: int = 0,
                     dtype: torch.dtype = torch.float32):
    """Random Qwen3_5MoeForCausalLM (the text tower of Qwen3.5-MoE): Gated DeltaNet layers with gated
    full attention every `interval`-th, each followed by routed experts plus the gated shared expert.
    Norm weights get small random offsets, as tiny_qwen3_5. EOS id 2, pad id 0."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, full_attention_interval=interval,
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_num_key_heads=linear_k_heads, linear_num_value_heads=linear_k_heads * value_heads_per_key,
        linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim, linear_conv_kernel_dim=4,
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate,
        shared_expert_intermediate_size=shared_intermediate,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = _build(Qwen3_5MoeForCausalLM, config, hidden, router_std, seed, dtype)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed + 2)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _build(cls, config, hidden: int, router_std: float, seed: int, dtype: torch.dtype):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(config)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        spread_logits(model, hidden)
        _spread_router(model, hidden, router_std)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()
