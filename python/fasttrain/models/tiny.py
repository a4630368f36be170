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
    # HF's init (std 0.02) makes a tiny model's logits nearly flat (greedy ties decided by
    # rounding, sampling close to uniform); unit-scale embeddings and an untied lm_head of
    # std 1/sqrt(hidden) give logits of std ~1, so runs differ by prompt and argmax is separated.
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.normal_(0.0, 2.0 / hidden ** 0.5)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()
