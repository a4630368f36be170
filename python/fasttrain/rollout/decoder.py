"""A minimal Llama-family decoder forward over a static KV cache, driving the model's own modules.

It calls the model's modules (embed_tokens, input/post_attention_layernorm, q/k/v/o_proj, mlp,
norm, lm_head, rotary_emb), so NF4Linear projections or LoRA wrappers swapped in later are used
as they are; it never reads a projection's `.weight`. What it replaces is Hugging Face's per-call
machinery (cache objects, mask builders, output dataclasses, generate's logits processors),
which costs more than the layer math at small model sizes on a CPU.

Families: Llama, Mistral (no sliding window beyond the sequence), Qwen2 (q/k/v bias lives in the
projection modules), Qwen3 (per-head q_norm/k_norm before the rotary embedding).

Cache layout: kv [layers, 2, B, kv_heads, S_max, head_dim], allocated once per rollout; column j
of the cache is column j of the left-padded sequence, for every row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaFamilyDecoder:
    """Forward passes of `model` (a *ForCausalLM of a Llama-family architecture) on a static cache."""

    def __init__(self, model):
        if hasattr(model, "get_base_model"):  # a PEFT wrapper: its adapters live in the modules
            model = model.get_base_model()
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
            raise ValueError(f"sample: model {type(model).__name__} is not a Llama-family causal LM "
                             "(expected .model.layers and .lm_head)")
        cfg = model.config
        self.model = model
        self.embed, self.layers, self.norm = base.embed_tokens, base.layers, base.norm
        self.rotary, self.lm_head = base.rotary_emb, model.lm_head
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.group = self.n_heads // self.n_kv
        attn0 = self.layers[0].self_attn
        self.scaling = getattr(attn0, "scaling", self.head_dim ** -0.5)
        self.qk_norm = hasattr(attn0, "q_norm")
        self.sliding_window = getattr(cfg, "sliding_window", None) if getattr(
            cfg, "use_sliding_window", True) else None
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device

    def new_cache(self, batch: int, seq: int) -> Tensor:
        # kv: [layers, 2, B, kv_heads, S_max, head_dim]; uninitialised, every read column is written first
        return torch.empty(len(self.layers), 2, batch, self.n_kv, seq, self.head_dim,
                           dtype=self.dtype, device=self.device)

    def rotary_table(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [B, S, head_dim] for integer `positions` [B, S]."""
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        return self.rotary(probe, positions)

    def prefill(self, input_ids: Tensor, key_valid: Tensor, cos: Tensor, sin: Tensor,
                cache: Tensor) -> Tensor:
        """Run the left-padded prompts `input_ids` [n, P] (key_valid bool [n, P], cos/sin
        [n, P, D]) and write cache columns [0, P). Returns the final-norm hidden state of the
        last column [n, H]."""
        n, P = input_ids.shape
        causal = torch.ones(P, P, dtype=torch.bool, device=self.device).tril_()
        # A pad query row would see no key at all (NaN softmax); let it see itself. Its output
        # is never read by a real token.
        eye = torch.eye(P, dtype=torch.bool, device=self.device)
        mask = (causal & key_valid[:, None, :]) | eye  # [n, P, P]
        x = self.embed(input_ids)
        x = self._layers(x, cos[:, None], sin[:, None], cache, 0, mask[:, None], decode=False)
        return self.norm(x[:, -1])

    def decode(self, tokens: Tensor, key_valid: Tensor, cos: Tensor, sin: Tensor, cache: Tensor,
               column: int) -> Tensor:
        """One new token per row, `tokens` [B], written at cache `column`; key_valid bool
        [B, column + 1]; cos/sin [B, D]. Returns the final-norm hidden state [B, H]."""
        x = self.embed(tokens[:, None])  # [B, 1, H]
        x = self._layers(x, cos[:, None, None], sin[:, None, None], cache, column,
                         key_valid[:, None, None, :], decode=True)
        return self.norm(x[:, 0])

    def _layers(self, x: Tensor, cos: Tensor, sin: Tensor, cache: Tensor, start: int, mask: Tensor,
                decode: bool) -> Tensor:
        B, S, _ = x.shape
        end = start + S
        D, G = self.head_dim, self.group
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, S, self.n_heads, D)
            k = attn.k_proj(h).view(B, S, self.n_kv, D)
            v = attn.v_proj(h).view(B, S, self.n_kv, D).transpose(1, 2)
            if self.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, S, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            cache[i, 0, :, :, start:end] = k
            cache[i, 1, :, :, start:end] = v
            keys, values = cache[i, 0, :, :, :end], cache[i, 1, :, :, :end]  # [B, kv, end, D]
            if decode:
                # One query per row: the G query heads sharing a KV head become G query rows of
                # that head, so grouped-query attention needs no repeat of K/V (HF's repeat_kv
                # maps query head h to KV head h // G, the same grouping).
                o = F.scaled_dot_product_attention(
                    q.reshape(B, self.n_kv, G, D), keys, values, attn_mask=mask, scale=self.scaling)
                o = o.reshape(B, 1, self.n_heads * D)
            else:
                if G > 1:
                    keys = keys.repeat_interleave(G, dim=1)
                    values = values.repeat_interleave(G, dim=1)
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                   scale=self.scaling)
                o = o.transpose(1, 2).reshape(B, S, self.n_heads * D)
            x = x + attn.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x
