"""tiny_llama: a random, seeded, few-layer LlamaForCausalLM for fast tests across the project."""

from __future__ import annotations

import torch


def tiny_llama(vocab_size: int = 49152, hidden: int = 64, layers: int = 2, heads: int = 4,
               kv_heads: int | None = None, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Random LlamaForCausalLM (eval mode, on CPU). `kv_heads` defaults to heads // 2 (so
    grouped-query attention is exercised, as in SmolLM2: 9 query heads, 3 KV heads). EOS id 2,
    pad id 0 (SmolLM2's <|im_end|> is 2 too, so the SmolLM2 tokenizer pairs with vocab 49152)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden % heads:
        raise ValueError(f"tiny_llama: hidden={hidden} must be divisible by heads={heads}")
    kv = kv_heads if kv_heads is not None else max(1, heads // 2)
    if heads % kv:
        raise ValueError(f"tiny_llama: heads={heads} must be divisible by kv_heads={kv}")
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        spread_logits(model, hidden)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()


def tiny_qwen3_5(vocab_size: int = 49152, hidden: int = 64, layers: int = 4, interval: int = 4, heads: int = 4,
                 kv_heads: int = 2, head_dim: int = 16, linear_k_heads: int = 2, value_heads_per_key: int = 2,
                 linear_head_dim: int = 16, intermediate: int | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32):
    """Random Qwen3_5ForCausalLM (the text tower of the qwen3_5 hybrid; eval mode, on CPU): layer i
    is full attention when (i + 1) % interval == 0, Gated DeltaNet otherwise; linear_k_heads q/k
    heads each serving `value_heads_per_key` value heads. EOS id 2, pad id 0, as tiny_llama. Norm
    weights get small random offsets (transformers initialises the zero-centred ones to 0), so a
    decoder that dropped the 1 + w would be caught."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=layers, full_attention_interval=interval,
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_num_key_heads=linear_k_heads, linear_num_value_heads=linear_k_heads * value_heads_per_key,
        linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim, linear_conv_kernel_dim=4,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(config)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        spread_logits(model, hidden)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()


def spread_logits(model, hidden: int) -> None:
    """HF's init (std 0.02) makes a tiny model's logits nearly flat (greedy ties decided by
    rounding, sampling close to uniform); unit-scale embeddings and an untied lm_head of std
    2/sqrt(hidden) give logits of std ~1, so runs differ by prompt and argmax is separated. Draws
    from the caller's generator (it seeds and forks it)."""
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.normal_(0.0, 2.0 / hidden ** 0.5)
