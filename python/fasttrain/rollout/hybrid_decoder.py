"""The decode path of Qwen3.5 hybrids (Gated DeltaNet + gated full attention) on a static cache,
driving the model's own modules (projections, norms, rotary embedding), one step per layer kind.

Per layer kind, what the cache holds for each row:
  linear_attention (Gated DeltaNet): the conv state, the last K-1 pre-conv inputs [B, K-1, C] in the
    model's dtype (the inputs are in it already, so nothing is rounded), and the recurrent state
    [B, Hv, Dk, Dv] in float32 whatever the model's dtype (float64 for a float64 model): a bf16
    state drifts from the training forward's over long answers.
  full_attention: keys and values [B, kv_heads, S_max, head_dim] as the Llama-family decoder.
The shapes are fixed when the cache is made, and a step writes in place.

The same computation as transformers' Qwen3_5ForCausalLM: in a Gated DeltaNet layer, in_proj_qkv →
causal depthwise conv (K taps, SiLU) → q, k (L2-normalised in float32), v; beta = sigmoid(b);
g = −exp(A_log)·softplus(a + dt_bias); the gated delta rule (fasttrain.ops); the gated RMSNorm with
silu(z); out_proj. In a full-attention layer, q_proj gives the query and an output gate interleaved
per head, q_norm/k_norm per head, the rotary embedding on the first partial_rotary_factor·head_dim
dims, grouped-query attention, o_proj(attn · sigmoid(gate)). The zero-centred RMSNorms are the
model's modules.

Left padding: a padded position's normed input is zeroed before the projections (as transformers
does), so its q, k, v, z are 0: the recurrent state stays exactly 0 and the conv window sees the
zeros a causal conv pads with; the keys are masked in full attention. A left-padded row therefore
computes what the unpadded prompt computes.

Holding a row: `decode(..., active=...)` with active[b] False leaves row b's conv and recurrent
states as they were (its new key/value column is written, and the caller masks it invalid for the
row, as for the Llama family); its output is not meaningful. A row may be held any number of steps
and resumes where it was (its position is the caller's: the rotary tables are per row).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from fasttrain.models.family_view import HybridView, rotate_partial
from fasttrain.nn.dense_linear import rollout_head
from fasttrain.ops.decode_attention import decode_attention
from fasttrain.ops.gated_delta import causal_conv1d, causal_conv1d_step, gated_delta_rule, gated_delta_step_

from .decoder import LlamaFamilyDecoder

__all__ = ["HybridCache", "HybridDecoder", "rotate_partial"]


@dataclass
class HybridCache:
    """Per-layer state of a batch of rows (None in the slots of the other layer kind)."""

    kv: list[tuple[Tensor, Tensor] | None]   # full attention: (keys, values) [B, kv, S_max, D]
    conv: list[Tensor | None]                # Gated DeltaNet: [B, K-1, C] model dtype
    rec: list[Tensor | None]                 # Gated DeltaNet: [B, Hv, Dk, Dv] float32 (float64 model: float64)


class HybridDecoder(HybridView, LlamaFamilyDecoder):
    """Forward passes of a Qwen3_5ForCausalLM (or a PEFT wrapper of one) on a HybridCache. The
    model's modules and shape and the layer pieces (projections, attention inputs, the Gated
    DeltaNet inputs and output) are the family view's (fasttrain.models.family_view.HybridView)."""

    def __init__(self, model, weights=None):
        HybridView.__init__(self, model, weights)
        self.lm_head = weights.head(self.model.lm_head) if hasattr(weights, "head") else rollout_head(self.model.lm_head)

    # ---- the cache ---------------------------------------------------------------------------
    def new_cache(self, batch: int, seq: int) -> HybridCache:
        kv, conv, rec = [], [], []
        for kind in self.kinds:
            full = kind == "full_attention"
            kv.append(tuple(torch.zeros(batch, self.n_kv, seq, self.head_dim, dtype=self.dtype, device=self.device)
                            for _ in range(2)) if full else None)
            conv.append(None if full else torch.zeros(batch, self.conv_k - 1, self.conv_dim, dtype=self.dtype,
                                                      device=self.device))
            rec.append(None if full else torch.zeros(batch, self.Hv, self.Dk, self.Dv, dtype=self.state_dtype,
                                                     device=self.device))
        return HybridCache(kv, conv, rec)

    def static_cache(self, batch: int, seq: int) -> HybridCache:
        """new_cache for the compiled decode step: on CUDA every buffer is marked static (the step
        writes them in place, so captured graphs keep their addresses)."""
        cache = self.new_cache(batch, seq)
        if self.device.type == "cuda":
            for t in [x for kv in cache.kv if kv is not None for x in kv] + \
                     [x for x in cache.conv + cache.rec if x is not None]:
                torch._dynamo.mark_static_address(t)
        return cache

    @staticmethod
    def cache_width(cache: HybridCache) -> int:
        """Columns of the full-attention layers' keys and values."""
        return next(kv for kv in cache.kv if kv is not None)[0].shape[2]

    def copy_prompts(self, small: HybridCache, cache: HybridCache, group: int, prompt_len: int) -> None:
        """Give each of the n prompts' cache (small, n rows) to its `group` consecutive rows of cache."""
        for i in range(len(self.kinds)):
            if small.kv[i] is not None:
                for src, dst in zip(small.kv[i], cache.kv[i]):
                    dst[:, :, :prompt_len].unflatten(0, (-1, group)).copy_(src[:, :, :prompt_len].unsqueeze(1))
            else:
                cache.conv[i].unflatten(0, (-1, group)).copy_(small.conv[i].unsqueeze(1))
                cache.rec[i].unflatten(0, (-1, group)).copy_(small.rec[i].unsqueeze(1))

    # ---- forward -----------------------------------------------------------------------------
    def prefill(self, input_ids: Tensor, key_valid: Tensor, cos: Tensor, sin: Tensor, cache: HybridCache) -> Tensor:
        """Left-padded prompts [n, P] (key_valid bool [n, P]; cos/sin [n, P, rotary dims]) from empty
        states; fills cache columns [0, P) and the states. Returns the last column's final-norm hidden [n, H]."""
        n, P = input_ids.shape
        causal = torch.ones(P, P, dtype=torch.bool, device=self.device).tril_()
        eye = torch.eye(P, dtype=torch.bool, device=self.device)
        mask = ((causal & key_valid[:, None, :]) | eye)[:, None]   # a pad query sees itself (no NaN)
        x = self.embed(input_ids)
        x = self._run(x, cos[:, None], sin[:, None], cache, 0, mask, key_valid, None)
        return self.norm(x[:, -1])

    def decode(self, tokens: Tensor, key_valid: Tensor, cos: Tensor, sin: Tensor, cache: HybridCache,
               column: int | Tensor, active: Tensor | None = None) -> Tensor:
        """One token per row `tokens` [B] at cache `column` (an int: key_valid [B, column + 1]; a
        one-element tensor: key_valid [B, S_max], fixed shapes for torch.compile); cos/sin [B, rotary
        dims]; active bool [B] or None (all). Returns the final-norm hidden state [B, H]."""
        x = self.embed(tokens[:, None])
        x = self._run(x, cos[:, None, None], sin[:, None, None], cache, column, key_valid[:, None, None, :],
                      None, active)
        return self.norm(x[:, 0])

    decode_static = decode

    def step_rows(self, tokens: Tensor, valid: Tensor, columns: Tensor, key_valid: Tensor, cos: Tensor,
                  sin: Tensor, cache: HybridCache) -> Tensor:
        """k new tokens per row with a per-token hold (the multi-turn rollout's step; the Llama
        decoder's contract): tokens [B, k] at per-row cache `columns` [B, k] (an invalid token's column
        is a scratch column no row marks valid); valid bool [B, k]; key_valid bool [B, S_max] the
        columns each row wrote before; cos/sin [B, k, rotary dims] from each row's own positions.
        An invalid token changes nothing: in full attention its key is never valid; in a Gated
        DeltaNet layer a row's valid tokens run in order (moved to the front of the row), the
        invalid ones after them with g = β = 0 (the state passes through), and the conv window ends
        at the row's last valid input. Returns the final-norm hidden states [B, k, H] (invalid
        tokens: unused values)."""
        B, k = tokens.shape
        S = self.cache_width(cache)
        causal = torch.ones(k, k, dtype=torch.bool, device=self.device).tril_()
        new = torch.zeros(B, k, S, dtype=torch.bool, device=self.device).scatter_(
            2, columns[:, None, :].expand(B, k, k), causal[None] & valid[:, None, :])   # [B, k, S]
        mask = (key_valid[:, None, :] | new)[:, None]                                 # [B, 1, k, S]
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices       # valid tokens first
        back = torch.argsort(order, dim=1)
        n_valid = valid.sum(1)
        rows = torch.arange(B, device=self.device)[:, None]
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            if self.kinds[i] == "full_attention":
                attn = layer.self_attn
                q, kk, v, gate = self.attention_inputs(attn, h, cos[:, None], sin[:, None])
                kv = cache.kv[i]
                kv[0].transpose(1, 2)[rows, columns] = kk.transpose(1, 2)
                kv[1].transpose(1, 2)[rows, columns] = v.transpose(1, 2)
                keys, values = kv
                if self.group > 1:
                    keys, values = keys.repeat_interleave(self.group, 1), values.repeat_interleave(self.group, 1)
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
                o = o.transpose(1, 2).reshape(B, k, -1) * torch.sigmoid(gate)
                x = x + self.project(o, (attn.o_proj,))[0]
            else:
                y = self._delta_rows(layer.linear_attn, h.gather(1, order[..., None].expand_as(h)),
                                     valid.gather(1, order), n_valid, cache, i)
                x = x + y.gather(1, back[..., None].expand_as(y))
            x = x + self.mlp(layer.mlp, layer.post_attention_layernorm(x))
        return self.norm(x)

    def _delta_rows(self, la, h: Tensor, valid: Tensor, n_valid: Tensor, cache: HybridCache, i: int) -> Tensor:
        """A Gated DeltaNet layer over k tokens per row whose valid ones come first (valid [B, k],
        n_valid [B]); updates the row's conv and recurrent states in place."""
        B, k, _ = h.shape
        qkv, z, beta, g = self.delta_inputs(la, h, None)
        window = torch.cat([cache.conv[i], qkv], 1)                       # [B, K-1+k, C]
        y, _ = causal_conv1d(qkv, la.conv1d.weight[:, 0], cache.conv[i])
        q, kk, v = self.split_qkv(y)
        g = torch.where(valid[..., None], g, torch.zeros_like(g)).to(cache.rec[i].dtype)
        beta = torch.where(valid[..., None], beta, torch.zeros_like(beta))
        o, rec = gated_delta_rule(q, kk, v, g, beta, initial_state=cache.rec[i])
        last = n_valid[:, None] + torch.arange(self.conv_k - 1, device=self.device)[None]   # [B, K-1]
        cache.conv[i].copy_(window.gather(1, last[..., None].expand(B, self.conv_k - 1, window.shape[2])))
        cache.rec[i].copy_(rec)
        return self.delta_output(la, o, z)

    def _run(self, x: Tensor, cos: Tensor, sin: Tensor, cache: HybridCache, start, mask: Tensor,
             valid: Tensor | None, active: Tensor | None) -> Tensor:
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            if self.kinds[i] == "full_attention":
                x = x + self._attention(layer.self_attn, h, cos, sin, cache.kv[i], start, mask)
            else:
                y, conv, rec = self._delta(layer.linear_attn, h, cache.conv[i], cache.rec[i], valid, active)
                cache.conv[i].copy_(conv)           # in place: the buffers keep their address and strides
                if rec is not cache.rec[i]:         # the decode step wrote the state in place already
                    cache.rec[i].copy_(rec)
                x = x + y
            x = x + self.mlp(layer.mlp, layer.post_attention_layernorm(x))
        return x

    def _attention(self, attn, h: Tensor, cos: Tensor, sin: Tensor, kv, start, mask: Tensor) -> Tensor:
        B, S, _ = h.shape
        D, G = self.head_dim, self.group
        q, k, v, gate = self.attention_inputs(attn, h, cos, sin)
        static = isinstance(start, Tensor)
        end = kv[0].shape[2] if static else start + S
        if static:
            kv[0].index_copy_(2, start, k)
            kv[1].index_copy_(2, start, v)
        else:
            kv[0][:, :, start:end] = k
            kv[1][:, :, start:end] = v
        keys, values = kv[0][:, :, :end], kv[1][:, :, :end]
        if S == 1 and not static:   # fasttrain's decode attention (the G query heads of a KV head as
            # G query rows of it, no repeat of K/V; its CPU kernel, SDPA elsewhere)
            o = decode_attention(q.reshape(B, self.n_kv, G, D), keys, values, mask[:, 0, 0],
                                 self.scaling).reshape(B, 1, self.n_heads * D)
        elif S == 1:   # the compiled step: torch's SDPA, which inductor traces
            o = F.scaled_dot_product_attention(q.reshape(B, self.n_kv, G, D), keys, values, attn_mask=mask,
                                               scale=self.scaling).reshape(B, 1, self.n_heads * D)
        else:
            if G > 1:
                keys, values = keys.repeat_interleave(G, dim=1), values.repeat_interleave(G, dim=1)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
            o = o.transpose(1, 2).reshape(B, S, self.n_heads * D)
        o = o * torch.sigmoid(gate)
        return self.project(o, (attn.o_proj,))[0]

    def _delta(self, la, h: Tensor, conv: Tensor, rec: Tensor, valid: Tensor | None,
               active: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        B, S, _ = h.shape
        qkv, z, beta, g = self.delta_inputs(la, h, valid)
        w = la.conv1d.weight[:, 0]                                           # [C, K]
        if S == 1 and valid is None:
            y, conv_new = causal_conv1d_step(qkv[:, 0], w, conv)
            q, k, v = self.split_qkv(y[:, None])
            # the state advances in place; a held row's is left as it was
            o = gated_delta_step_(rec, q[:, 0], k[:, 0], v[:, 0], g[:, 0].to(rec.dtype), beta[:, 0],
                                  active=active)[:, None]
            rec_new = rec
            if active is not None:
                conv_new = torch.where(active.view(B, 1, 1), conv_new, conv)
        else:
            y, conv_new = causal_conv1d(qkv, w, conv)
            q, k, v = self.split_qkv(y)
            o, rec_new = gated_delta_rule(q, k, v, g.to(rec.dtype), beta, initial_state=rec)
            rec_new = rec_new.to(rec.dtype)
        return self.delta_output(la, o, z), conv_new, rec_new
