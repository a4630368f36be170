"""A minimal Llama-family decoder forward over a static KV cache, driving the model's own modules.

It calls the model's modules (embed_tokens, input/post_attention_layernorm, q/k/v/o_proj, mlp,
norm, lm_head, rotary_emb), so NF4Linear projections or LoRA wrappers swapped in later are used
as they are; it never reads a projection's `.weight`. What it replaces is Hugging Face's per-call
machinery (cache objects, mask builders, output dataclasses, generate's logits processors),
which costs more than the layer math at small model sizes on a CPU.

Families: Llama, Mistral (no sliding window beyond the sequence), Qwen2 (q/k/v bias lives in the
projection modules), Qwen3 (per-head q_norm/k_norm before the rotary embedding).

Cache layout: kv [layers, 2, B, kv_heads, S_max, head_dim], allocated once per rollout; column j
of the cache is column j of the left-padded sequence, for every row. `step_rows` (the multi-turn
rollout) writes each row at its own column instead, so rows at different turns share the cache
with a per-row hold: a held row writes nothing its keys will ever show and keeps its position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fasttrain.models.family_view import LlamaView, gemm, rotate_half
from fasttrain.nn.dense_linear import rollout_head
from fasttrain.ops import decode_fused as _fused
from fasttrain.ops.decode_attention import decode_attention, decode_attention_backend

__all__ = ["LlamaFamilyDecoder", "rotate_half"]


class LlamaFamilyDecoder(LlamaView):
    """Forward passes of `model` (a *ForCausalLM of a Llama-family architecture) on a static cache.
    The model's modules and shape, the projections and the MLP are the family view's
    (fasttrain.models.family_view.LlamaView); `weights`: the rollout's dense weights (or None)."""

    def __init__(self, model, weights=None):
        super().__init__(model, weights)
        self.lm_head = weights.head(self.model.lm_head) if hasattr(weights, "head") else rollout_head(self.model.lm_head)
        self._fusable = weights is not None and _fusable_layers(self)

    def new_cache(self, batch: int, seq: int) -> Tensor:
        # kv: [layers, 2, B, kv_heads, S_max, head_dim], zeros: step_rows attends over every column under
        # a mask, and a masked column of uninitialised memory holding NaN would still give 0·NaN = NaN
        return torch.zeros(len(self.layers), 2, batch, self.n_kv, seq, self.head_dim,
                           dtype=self.dtype, device=self.device)

    def copy_prompts(self, small: Tensor, cache: Tensor, group: int, prompt_len: int) -> None:
        """Give each of the n prompts' cache columns [0, P) (small) to its `group` consecutive rows."""
        cache[:, :, :, :, :prompt_len].unflatten(2, (-1, group)).copy_(small.unsqueeze(3))

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
               column: int, active: Tensor | None = None) -> Tensor:
        """One new token per row, `tokens` [B], written at cache `column`; key_valid bool
        [B, column + 1]; cos/sin [B, D]. Returns the final-norm hidden state [B, H]. `active` [B]:
        nothing to do here for a held row (its key, masked invalid by the caller, is its only trace)."""
        if self._fusable and isinstance(column, int):
            units = self._fused_units(tokens)
            if units is not None:
                return self._decode_fused(tokens, key_valid, cos, sin, cache, column, units)
        x = self.embed(tokens[:, None])  # [B, 1, H]
        x = self._layers(x, cos[:, None, None], sin[:, None, None], cache, column,
                         key_valid[:, None, None, :], decode=True)
        return self.norm(x[:, 0])

    def _fused_units(self, tokens: Tensor) -> list | None:
        """Per layer (qkv, o, gate_up, down) rollout weights for the fused decode step, or None where
        that step does not apply to this call (a GPU, the reference kernels, a layer without them)."""
        if (tokens.device.type != "cpu" or _fused.decode_fused_backend(self.embed.weight) != "kernel"
                or decode_attention_backend(self.device, grad=False) != "kernel"):
            return None
        w, units = self.weights, []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            u = (w.fused((a.q_proj, a.k_proj, a.v_proj)), w.linear(a.o_proj),
                 w.fused((m.gate_proj, m.up_proj)), w.linear(m.down_proj))
            if any(t is None for t in u):
                return None
            units.append(u)
        return units

    def _decode_fused(self, tokens: Tensor, key_valid: Tensor, cos: Tensor, sin: Tensor, cache: Tensor,
                      column: int, units: list) -> Tensor:
        """`decode` through fasttrain.ops.decode_fused: per layer the norm, one GEMM for q/k/v, the
        rotary embedding (after Qwen3's q/k norms) and the cache write in one op, the attention, o_proj, the residual add and
        the next norm in one op, one GEMM for gate/up, the SwiGLU, down_proj, and the residual add with
        the next layer's norm (the last layer's with the final norm). The same values the modules
        compute (the ops round where they round)."""
        x = self.embed(tokens)                                          # [B, H], a fresh tensor
        B = x.shape[0]
        cos, sin = cos.contiguous(), sin.contiguous()
        norms = [layer.input_layernorm for layer in self.layers] + [self.norm]
        h = _fused.rms_norm(x, norms[0].weight, norms[0].variance_epsilon)
        end = column + 1
        for i, (layer, (w_qkv, w_o, w_gu, w_down)) in enumerate(zip(self.layers, units)):
            keys, values = cache[i][0], cache[i][1]
            attn = layer.self_attn
            qk = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon) if self.qk_norm else ()
            q = _fused.rotary_cache_write_(gemm(h, w_qkv), cos, sin, keys, values, column, self.n_heads, *qk)
            o = decode_attention(q, keys[:, :, :end], values[:, :, :end], key_valid, self.scaling)
            post = layer.post_attention_layernorm
            h = _fused.add_rms_norm_(x, gemm(o.view(B, -1), w_o), post.weight, post.variance_epsilon)
            a = _fused.silu_mul(gemm(h, w_gu))
            nxt = norms[i + 1]
            h = _fused.add_rms_norm_(x, gemm(a, w_down), nxt.weight, nxt.variance_epsilon)
        return h

    def decode_static(self, tokens: Tensor, key_valid: Tensor, cos: Tensor, sin: Tensor, cache: Tensor,
                      column: Tensor) -> Tensor:
        """`decode` with shapes that do not change from step to step (for torch.compile): the new
        keys/values go to cache column `column` (a one-element long tensor) and the query attends
        over all S_max columns, key_valid bool [B, S_max] masking the ones not written yet.
        `cache` here is per layer: cache[i] = (keys, values), each its own [B, kv, S_max, D]
        tensor, so a compiled step writes one column in place (a write into a view of one big
        cache tensor makes the compiled graph copy the whole tensor)."""
        x = self.embed(tokens[:, None])  # [B, 1, H]
        x = self._layers(x, cos[:, None, None], sin[:, None, None], cache, column,
                         key_valid[:, None, None, :], decode=True)
        return self.norm(x[:, 0])

    def step_rows(self, tokens: Tensor, valid: Tensor, columns: Tensor, key_valid: Tensor, cos: Tensor,
                  sin: Tensor, cache: Tensor) -> Tensor:
        """k new tokens per row with a per-row hold (the multi-turn rollout: rows at different
        turns share one batch). tokens [B, k] go to per-row cache `columns` [B, k]; valid bool
        [B, k] says which exist. A token that is not valid must have its column pointed at a scratch
        column no row ever marks valid (the caller's last column): it writes there and nothing reads
        it, and its row's position does not move (the caller gives cos/sin [B, k, D] from its own
        per-row positions). key_valid bool [B, S_max]: the columns each row has written before this
        call. Token j of row b attends the row's earlier columns and its own valid tokens j' <= j.
        Returns the final-norm hidden states [B, k, H]; rows' invalid tokens give unused values."""
        B, k = tokens.shape
        S = cache.shape[4]
        causal = torch.ones(k, k, dtype=torch.bool, device=self.device).tril_()
        new = torch.zeros(B, k, S, dtype=torch.bool, device=self.device).scatter_(
            2, columns[:, None, :].expand(B, k, k), causal[None] & valid[:, None, :])   # [B, k, S]
        mask = key_valid[:, None, :] | new
        x = self.embed(tokens)
        x = self._layers(x, cos[:, None], sin[:, None], cache, columns, mask[:, None], decode=False)
        return self.norm(x)

    def _layers(self, x: Tensor, cos: Tensor, sin: Tensor, cache: Tensor, start: int | Tensor, mask: Tensor,
                decode: bool) -> Tensor:
        B, S, _ = x.shape
        static = isinstance(start, Tensor)  # decode_static: write at a tensor column, read every column
        per_row = static and start.dim() == 2   # step_rows: columns [B, S], one per row and token
        rows = torch.arange(B, device=x.device)[:, None] if per_row else None
        end = cache[0][0].shape[2] if static else start + S
        D, G = self.head_dim, self.group
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = self.project(h, (attn.q_proj, attn.k_proj, attn.v_proj))
            q = q.view(B, S, self.n_heads, D)
            k = k.view(B, S, self.n_kv, D)
            v = v.view(B, S, self.n_kv, D).transpose(1, 2)
            if self.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, S, D]
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if per_row:
                cache[i][0].transpose(1, 2)[rows, start] = k.transpose(1, 2)   # [B, S, kv, D] at (b, col)
                cache[i][1].transpose(1, 2)[rows, start] = v.transpose(1, 2)
            elif static:
                cache[i][0].index_copy_(2, start, k)
                cache[i][1].index_copy_(2, start, v)
            else:
                cache[i][0][:, :, start:end] = k
                cache[i][1][:, :, start:end] = v
            keys, values = cache[i][0][:, :, :end], cache[i][1][:, :, :end]  # [B, kv, end, D]
            if decode:
                # One query per row: the G query heads sharing a KV head become G query rows of
                # that head, so grouped-query attention needs no repeat of K/V (HF's repeat_kv
                # maps query head h to KV head h // G, the same grouping).
                if static:     # the compiled step: torch's SDPA, which inductor traces
                    o = F.scaled_dot_product_attention(
                        q.reshape(B, self.n_kv, G, D), keys, values, attn_mask=mask, scale=self.scaling)
                else:          # fasttrain's decode attention (its CPU kernel; SDPA elsewhere)
                    o = decode_attention(q.reshape(B, self.n_kv, G, D), keys, values, mask[:, 0, 0],
                                         self.scaling)
                o = o.reshape(B, 1, self.n_heads * D)
            else:
                if G > 1:
                    keys = keys.repeat_interleave(G, dim=1)
                    values = values.repeat_interleave(G, dim=1)
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                   scale=self.scaling)
                o = o.transpose(1, 2).reshape(B, S, self.n_heads * D)
            x = x + self.project(o, (attn.o_proj,))[0]
            x = x + self.mlp(layer.mlp, layer.post_attention_layernorm(x))
        return x


# The RMSNorm classes whose forward is HF's LlamaRMSNorm (weight · rnd(x / sqrt(mean(x²) + eps))),
# which fasttrain.ops.decode_fused.rms_norm computes; another norm keeps the module path.
_LLAMA_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def _fusable_layers(dec: "LlamaFamilyDecoder") -> bool:
    """Whether every layer's decode step fits fasttrain.ops.decode_fused: HF's Llama RMSNorm (of the
    activations' dtype; Qwen3's per-head q/k norms too), no projection bias, a SiLU MLP with
    gate/up/down, and the rotary embedding over the whole head."""
    if dec.head_dim % 2:
        return False
    rotary_dim = getattr(dec.model.config, "partial_rotary_factor", 1.0)
    if rotary_dim not in (None, 1, 1.0):
        return False

    def norm_ok(n) -> bool:
        return (type(n).__name__ in _LLAMA_RMS_NORMS and hasattr(n, "variance_epsilon")
                and getattr(n, "weight", None) is not None and n.weight.dtype == dec.dtype)
    if not norm_ok(dec.norm):
        return False
    for layer in dec.layers:
        a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if a is None or m is None:
            return False
        projections = [getattr(a, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projections += [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(p is None or getattr(p, "bias", None) is not None for p in projections):
            return False
        if type(getattr(m, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
            return False
        if not (norm_ok(layer.input_layernorm) and norm_ok(layer.post_attention_layernorm)):
            return False
        if dec.qk_norm and not all(norm_ok(n) and n.weight.shape == (dec.head_dim,) and
                                   n.variance_epsilon == a.q_norm.variance_epsilon for n in (a.q_norm, a.k_norm)):
            return False
    return True
