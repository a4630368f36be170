"""The update's shared-prefix forward of the Llama family (fasttrain.train.prefix_forward says what
it is): the padded layout (`llama_prefix_hidden`) and the packed answers (`llama_packed_hidden`).
It drives the modules of a Llama-family model through its family view
(fasttrain.models.family_view.LlamaView), so NF4 and adapter layers run as they are; anything else
(attention dropout in training, a sliding window shorter than the sequence) returns None and the
caller runs the model's own forward.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from fasttrain.models.family_view import LlamaView, rotate_half
from fasttrain.ops.attention import masked_attention
from fasttrain.train.answer_packing import AnswerPacking, bucket_masks
from fasttrain.train.prefix_common import per_row, prefix_masks, prompt_groups, run_layers, trains_with_dropout

__all__ = ["llama_prefix_hidden", "llama_packed_hidden"]


def _view(model) -> LlamaView | None:
    try:
        view = LlamaView(model)
    except (ValueError, AttributeError):
        return None
    return None if trains_with_dropout(view) else view


def _prefix_view(model, P: int, T: int) -> LlamaView | None:
    """The model's Llama-family view, or None where the shared-prefix forward does not apply
    (not that family, or a sliding window shorter than prompt + answer)."""
    dec = _view(model)
    if dec is None or (dec.sliding_window is not None and P + T > dec.sliding_window):
        return None
    return dec


def llama_prefix_hidden(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int,
                        T: int, prompt_index: Tensor | None = None, wrap=None, routing=None) -> Tensor | None:
    """shared_prefix_hidden of the Llama family's layers (the attention of every layer is full;
    `routing`: unused here)."""
    dec = _prefix_view(model, prompt_len, T)
    if dec is None:
        return None
    P = prompt_len
    B = input_ids.shape[0]
    device = input_ids.device
    inverse, first = prompt_groups(input_ids, attention_mask, P, prompt_index)
    U = first.shape[0]

    A = T - 1                                                           # answer tokens that are inputs
    prompt_mask, answer_mask = prefix_masks(attention_mask, first, P, A)
    cos_p, sin_p = dec.rotary_table(position_ids[first, :P])           # [U, P, D]
    x_p = dec.embed(input_ids[first, :P])                              # [U, P, H]
    if A > 0:
        cos_a, sin_a = dec.rotary_table(position_ids[:, P:P + A])      # [B, A, D]
        x_a = dec.embed(input_ids[:, P:P + A])                         # [B, A, H]
    else:
        cos_a = sin_a = None
        x_a = x_p.new_empty(B, 0, x_p.shape[-1])

    G = dec.group
    if G > 1:
        # grouped-query attention without repeating K/V: the G query heads that share a KV head
        # attend as G·(query rows) of that head (head h reads KV head h // G, as repeat_kv maps it),
        # so each mask row is repeated G times, once here for all layers
        prompt_mask = prompt_mask.unsqueeze(2).expand(U, 1, G, P, P).reshape(U, 1, G * P, P)
        if answer_mask is not None:
            answer_mask = answer_mask.unsqueeze(2).expand(B, 1, G, A, P + A).reshape(B, 1, G * A, P + A)
    runs = [functools.partial(_layer, dec, layer, inverse, cos_p[:, None], sin_p[:, None], prompt_mask,
                              None if cos_a is None else cos_a[:, None], None if sin_a is None else sin_a[:, None],
                              answer_mask) for layer in dec.layers]
    if wrap is not None:
        runs = [wrap(i, run) for i, run in enumerate(runs)]
    x_p, x_a = run_layers(dec, runs, x_p, x_a)
    h = torch.cat([x_p[inverse, P - 1:P], x_a], dim=1)                 # [B, T, H]
    return dec.norm(h)


def llama_packed_hidden(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int,
                        T: int, inverse: Tensor, first: Tensor, pk: AnswerPacking) -> Tensor | None:
    """llama_prefix_hidden with the answers packed as `pk` says: the hidden states [n, H] of pk's
    wanted positions (pk.source), or None where llama_prefix_hidden would return None."""
    dec = _prefix_view(model, prompt_len, T)
    if dec is None:
        return None
    P = prompt_len
    U = first.shape[0]
    prompt_mask, _ = prefix_masks(attention_mask, first, P, 0)
    cos_p, sin_p = dec.rotary_table(position_ids[first, :P])           # [U, P, D]
    x_p = dec.embed(input_ids[first, :P])                              # [U, P, H]
    A = T - 1
    ids_a = pk.tokens(input_ids[:, P:P + A])                           # [N] the packed answer inputs
    cos_a, sin_a = dec.rotary_table(pk.tokens(position_ids[:, P:P + A])[None])   # [1, N, D]
    x_a = dec.embed(ids_a)                                             # [N, H]
    G = dec.group
    if G > 1:
        prompt_mask = prompt_mask.unsqueeze(2).expand(U, 1, G, P, P).reshape(U, 1, G * P, P)
    masks = bucket_masks(pk, attention_mask[:, :P], G)
    runs = [functools.partial(_packed_layer, dec, layer, inverse, cos_p[:, None], sin_p[:, None], prompt_mask,
                              cos_a[0, :, None], sin_a[0, :, None], pk, masks) for layer in dec.layers]
    x_p, x_a = run_layers(dec, runs, x_p, x_a)
    return dec.norm(torch.cat([x_p[:, P - 1], x_a])[pk.source])


def _layer(dec: LlamaView, layer, inverse: Tensor, cos_p: Tensor, sin_p: Tensor, prompt_mask: Tensor,
           cos_a: Tensor | None, sin_a: Tensor | None, answer_mask: Tensor | None,
           x_p: Tensor, x_a: Tensor) -> tuple[Tensor, Tensor]:
    """One decoder layer over the U prompts x_p [U, P, H] and the B answers x_a [B, A, H]."""
    U, P, H = x_p.shape
    B, A, _ = x_a.shape
    D, G, nh, nkv = dec.head_dim, dec.group, dec.n_heads, dec.n_kv
    attn = layer.self_attn
    n_p = U * P
    x = torch.cat([x_p.reshape(n_p, H), x_a.reshape(B * A, H)])        # [U·P + B·A, H]
    h = layer.input_layernorm(x)
    q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    if dec.qk_norm:
        q = attn.q_norm(q.view(-1, nh, D)).view(q.shape)
        k = attn.k_norm(k.view(-1, nkv, D)).view(k.shape)

    def heads(t: Tensor, n: int, rows: int, cols: int, lo: int, hi: int) -> Tensor:
        return t[lo:hi].view(rows, cols, n, D).transpose(1, 2)        # [rows, n, cols, D]

    def attend(q_: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """q_ [n, nh, s, D] over keys/values [n, nkv, L, D] -> [n·s, nh·D]; the G query heads of a KV
        head run as G·s query rows of it (the masks come repeated G times)."""
        n, _, s_, _ = q_.shape
        o = masked_attention(q_.reshape(n, nkv, G * s_, D), keys, values, mask, dec.scaling)
        return o.view(n, nh, s_, D).transpose(1, 2).reshape(n * s_, nh * D)

    q_p, k_p, v_p = heads(q, nh, U, P, 0, n_p), heads(k, nkv, U, P, 0, n_p), heads(v, nkv, U, P, 0, n_p)
    q_p = q_p * cos_p + rotate_half(q_p) * sin_p
    k_p = k_p * cos_p + rotate_half(k_p) * sin_p
    outs = [attend(q_p, k_p, v_p, prompt_mask)]
    if A > 0:
        q_a, k_a, v_a = (heads(q, nh, B, A, n_p, None), heads(k, nkv, B, A, n_p, None),
                         heads(v, nkv, B, A, n_p, None))
        q_a = q_a * cos_a + rotate_half(q_a) * sin_a
        k_a = k_a * cos_a + rotate_half(k_a) * sin_a
        keys = torch.cat([per_row(k_p, inverse), k_a], dim=2)          # [B, kv, P+A, D]
        values = torch.cat([per_row(v_p, inverse), v_a], dim=2)
        outs.append(attend(q_a, keys, values, answer_mask))
    x = x + attn.o_proj(torch.cat(outs))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x[:n_p].view(U, P, H), x[n_p:].view(B, A, H)


def _packed_layer(dec: LlamaView, layer, inverse: Tensor, cos_p: Tensor, sin_p: Tensor, prompt_mask: Tensor,
                  cos_a: Tensor, sin_a: Tensor, pk: AnswerPacking, masks: list[Tensor],
                  x_p: Tensor, x_a: Tensor) -> tuple[Tensor, Tensor]:
    """One decoder layer over the U prompts x_p [U, P, H] and the N packed answer tokens x_a [N, H]
    (cos_a/sin_a [N, 1, D]); attention per bucket of pk with its mask of `masks`."""
    U, P, H = x_p.shape
    N = x_a.shape[0]
    D, G, nh, nkv = dec.head_dim, dec.group, dec.n_heads, dec.n_kv
    attn = layer.self_attn
    n_p = U * P
    x = torch.cat([x_p.reshape(n_p, H), x_a])                          # [U·P + N, H]
    h = layer.input_layernorm(x)
    q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    if dec.qk_norm:
        q = attn.q_norm(q.view(-1, nh, D)).view(q.shape)
        k = attn.k_norm(k.view(-1, nkv, D)).view(k.shape)

    def attend(q_: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """q_ [n, nh, s, D] over keys/values [n, nkv, L, D] -> [n, s, nh·D] (the G query heads of a
        KV head as G·s query rows of it; the masks come repeated G times)."""
        n, _, s_, _ = q_.shape
        o = masked_attention(q_.reshape(n, nkv, G * s_, D), keys, values, mask, dec.scaling)
        return o.view(n, nh, s_, D).transpose(1, 2).reshape(n, s_, nh * D)

    q_p = q[:n_p].view(U, P, nh, D).transpose(1, 2)
    k_p = k[:n_p].view(U, P, nkv, D).transpose(1, 2)
    v_p = v[:n_p].view(U, P, nkv, D).transpose(1, 2)
    q_p = q_p * cos_p + rotate_half(q_p) * sin_p
    k_p = k_p * cos_p + rotate_half(k_p) * sin_p
    outs = [attend(q_p, k_p, v_p, prompt_mask).reshape(n_p, nh * D)]
    q_a, k_a, v_a = q[n_p:].view(N, nh, D), k[n_p:].view(N, nkv, D), v[n_p:].view(N, nkv, D)
    q_a = q_a * cos_a + rotate_half(q_a) * sin_a
    k_a = k_a * cos_a + rotate_half(k_a) * sin_a
    per_bucket = []
    for bucket, mask in zip(pk.buckets, masks):
        group = inverse[bucket.rows]
        keys = torch.cat([per_row(k_p, group), pk.pad(k_a, bucket).transpose(1, 2)], dim=2)    # [n, kv, P+M, D]
        values = torch.cat([per_row(v_p, group), pk.pad(v_a, bucket).transpose(1, 2)], dim=2)
        per_bucket.append(attend(pk.pad(q_a, bucket).transpose(1, 2), keys, values, mask))
    if per_bucket:
        outs.append(pk.unpad(per_bucket))
    x = x + attn.o_proj(torch.cat(outs))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x[:n_p].view(U, P, H), x[n_p:]
