"""The update's shared-prefix forward for Qwen3.5 hybrids: each distinct prompt runs once per
micro-batch, and its answers continue from what the prompt left, per layer kind:
  full attention: the prompt's keys and values (gathered by row, as for the Llama family);
  Gated DeltaNet: the prompt's conv state (its last K-1 pre-conv inputs) and its final recurrent
    state, gathered by row and used as the initial states of the answers' conv and chunked delta
    rule (fasttrain.ops.gated_delta_rule from an initial state: its backward carries each answer's
    gradient into the prompt's state, and the gather's backward sums a group's into its one prompt).
Projections, norms and the MLP run over the U·P prompt tokens and the B·(T-1) answer tokens
together, one matmul each. Under gradient checkpointing each decoder layer is one checkpointed
function of (prompt hidden states, answer hidden states), with the model's own checkpoint function.

The layer pieces are the family view's (fasttrain.models.family_view.HybridView), which the
rollout's hybrid decoder runs too, so the rollout and the update are one implementation of the
model apart from how the sequence is cut. Padded prompt positions are zeroed before the Gated DeltaNet projections (so the state stays 0)
and masked in attention.

Packed answers (`hybrid_packed_hidden`, reached through prefix_forward.shared_prefix_selected; its
`packed=False` forces the padded layout): the answers' token rows are the N real answer inputs of
all rows, flattened [N, H] (fasttrain.train.answer_packing), so the embedding, the norms, every
projection (NF4, 16-bit, LoRA/DoRA as they are), the gated output norms, the MLP, the final norm
and the log-prob head run on real tokens only. The pieces that mix a row's tokens run per length
bucket (rows of similar length padded to the bucket's longest, at most 1/8 of its tokens): the
gated attention (each row's queries over its prompt's keys and its own answers), the causal conv
(from the row's prompt's conv state) and the chunked delta rule (from its prompt's recurrent
state); fasttrain.ops' conv and delta rule take a padded batch with one initial state per row,
not cumulative offsets, so those pieces still pay for the bucket's bounded padding. Only rows
whose real answer tokens come first are packed (a real token after a pad falls back to the padded
layout, whose zeroed positions the conv and the state do see).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from fasttrain.ops.attention import masked_attention
from fasttrain.ops.gated_delta import causal_conv1d, gated_delta_rule
from fasttrain.models.family_view import HybridView
from fasttrain.train.answer_packing import AnswerPacking, bucket_masks
from fasttrain.train.prefix_common import per_row, prefix_masks, prompt_groups, run_layers, trains_with_dropout

__all__ = ["shared_prefix_hidden_hybrid", "hybrid_packed_hidden"]


def shared_prefix_hidden_hybrid(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                                prompt_len: int, T: int, prompt_index: Tensor | None = None, wrap=None,
                                routing=None) -> Tensor | None:
    """As fasttrain.train.prefix_forward.shared_prefix_hidden: final-norm hidden states [B, T, H]
    predicting each row's answer tokens, every distinct prompt run once (`routing`: unused here;
    `wrap(i, run)` runs layer i)."""
    dec = HybridView(model)
    if trains_with_dropout(dec):
        return None
    P, A = prompt_len, T - 1
    B = input_ids.shape[0]
    inverse, first = prompt_groups(input_ids, attention_mask, P, prompt_index)
    prompt_mask, answer_mask = prefix_masks(attention_mask, first, P, A)
    valid_p = attention_mask[first, :P].bool()
    valid_a = attention_mask[:, P:P + A].bool()
    cos_p, sin_p = dec.rotary_table(position_ids[first, :P])
    x_p = dec.embed(input_ids[first, :P])
    cos_a, sin_a = dec.rotary_table(position_ids[:, P:P + A])
    x_a = dec.embed(input_ids[:, P:P + A])
    ctx = _Context(dec, inverse, cos_p[:, None], sin_p[:, None], cos_a[:, None], sin_a[:, None], prompt_mask,
                   answer_mask, valid_p, valid_a)
    runs = [functools.partial(_layer, ctx, i, layer) for i, layer in enumerate(dec.layers)]
    x_p, x_a = run_layers(dec, runs if wrap is None else [wrap(i, run) for i, run in enumerate(runs)], x_p, x_a)
    return dec.norm(torch.cat([x_p[inverse, P - 1:P], x_a], dim=1))


class _Context:
    """What every layer of one forward reads (positions, masks, groups)."""

    def __init__(self, dec, inverse, cos_p, sin_p, cos_a, sin_a, prompt_mask, answer_mask, valid_p, valid_a):
        self.dec, self.inverse = dec, inverse
        self.cos_p, self.sin_p, self.cos_a, self.sin_a = cos_p, sin_p, cos_a, sin_a
        self.prompt_mask, self.answer_mask = prompt_mask, answer_mask
        self.valid_p, self.valid_a = valid_p, valid_a


def _layer(c: _Context, i: int, layer, x_p: Tensor, x_a: Tensor) -> tuple[Tensor, Tensor]:
    """Decoder layer i over the U prompts x_p [U, P, H] and the B answers x_a [B, A, H]."""
    x_p, x_a_flat = _mixer_and_mlp(c, i, layer, x_p, x_a, _attention, _delta)
    return x_p, x_a_flat.view(x_a.shape)


def _mixer_and_mlp(c, i: int, layer, x_p: Tensor, x_a: Tensor, attention, delta) -> tuple[Tensor, Tensor]:
    """Layer i's token mixer (`attention` for a full-attention layer, else `delta`) with its residual,
    then the MLP with its residual over the prompts and answers as one batch of rows: returns the
    prompts [U, P, H] and the answers flattened to [rows, H]."""
    U, P, H = x_p.shape
    h_p, h_a = layer.input_layernorm(x_p), layer.input_layernorm(x_a)
    if c.dec.kinds[i] == "full_attention":
        y_p, y_a = attention(c, layer.self_attn, h_p, h_a)
    else:
        y_p, y_a = delta(c, layer.linear_attn, h_p, h_a)
    x = torch.cat([(x_p + y_p).reshape(U * P, H), (x_a + y_a).reshape(-1, H)])
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x[:U * P].view(U, P, H), x[U * P:]


def _stack(t_p: Tensor, t_a: Tensor) -> Tensor:
    """[U, P, ...] and [B, A, ...] -> one [1, U·P + B·A, ...] batch (one matmul per projection)."""
    return torch.cat([t_p.flatten(0, 1), t_a.flatten(0, 1)])[None]


def _unstack(t: Tensor, U: int, P: int, B: int, A: int) -> tuple[Tensor, Tensor]:
    return t[0, :U * P].unflatten(0, (U, P)), t[0, U * P:].unflatten(0, (B, A))


def _attention(c: _Context, attn, h_p: Tensor, h_a: Tensor) -> tuple[Tensor, Tensor]:
    dec = c.dec
    U, P = h_p.shape[:2]
    B, A = h_a.shape[:2]
    qg, k, v = dec.project(_stack(h_p, h_a), (attn.q_proj, attn.k_proj, attn.v_proj))
    (qg_p, qg_a), (k_p, k_a), (v_p, v_a) = (_unstack(t, U, P, B, A) for t in (qg, k, v))
    q_p, k_p, v_p, gate_p = dec.heads(attn, qg_p, k_p, v_p, c.cos_p, c.sin_p)
    o_p = _attend(dec, q_p, k_p, v_p, c.prompt_mask) * torch.sigmoid(gate_p)
    if A > 0:
        q_a, k_a, v_a, gate_a = dec.heads(attn, qg_a, k_a, v_a, c.cos_a, c.sin_a)
        keys = torch.cat([per_row(k_p, c.inverse), k_a], dim=2)                  # [B, kv, P+A, D]
        values = torch.cat([per_row(v_p, c.inverse), v_a], dim=2)
        o_a = _attend(dec, q_a, keys, values, c.answer_mask) * torch.sigmoid(gate_a)
    else:
        o_a = o_p.new_empty(B, 0, o_p.shape[-1])
    return _unstack(dec.project(_stack(o_p, o_a), (attn.o_proj,))[0], U, P, B, A)


def _attend(dec: HybridView, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """q [n, nh, s, D] over keys/values [n, kv, L, D] -> [n, s, nh·D] (grouped-query: K/V repeated)."""
    G = dec.group
    if G > 1:
        keys, values = keys.repeat_interleave(G, dim=1), values.repeat_interleave(G, dim=1)
    o = masked_attention(q, keys, values, mask, dec.scaling)
    n, nh, s_, D = o.shape
    return o.transpose(1, 2).reshape(n, s_, nh * D)


def _delta(c: _Context, la, h_p: Tensor, h_a: Tensor) -> tuple[Tensor, Tensor]:
    dec = c.dec
    U, P = h_p.shape[:2]
    B, A = h_a.shape[:2]
    qkv, z, beta, g = dec.delta_inputs(la, _stack(h_p, h_a), _stack(c.valid_p, c.valid_a))
    (qkv_p, qkv_a), (beta_p, beta_a), (g_p, g_a) = (_unstack(t, U, P, B, A) for t in (qkv, beta, g))
    w = la.conv1d.weight[:, 0]
    y_p, conv_p = causal_conv1d(qkv_p, w)                               # prompts from zero state
    q, k, v = dec.split_qkv(y_p)
    o_p, S_p = gated_delta_rule(q, k, v, g_p.to(dec.state_dtype), beta_p)
    if A > 0:
        y_a, _ = causal_conv1d(qkv_a, w, conv_p[c.inverse])            # answers continue each prompt
        q, k, v = dec.split_qkv(y_a)
        o_a, _ = gated_delta_rule(q, k, v, g_a.to(dec.state_dtype), beta_a, initial_state=S_p[c.inverse])
    else:
        o_a = o_p.new_empty(B, 0, *o_p.shape[2:])
    return _unstack(dec.delta_output(la, _stack(o_p, o_a), z), U, P, B, A)


# ---- packed answers ---------------------------------------------------------------------------------
def hybrid_packed_hidden(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int,
                         inverse: Tensor, first: Tensor, pk: AnswerPacking) -> Tensor | None:
    """shared_prefix_hidden_hybrid with the answers packed as `pk` says (its rows' real tokens
    first: pack_answers(contiguous=True)): the hidden states [n, H] of pk's wanted positions."""
    dec = HybridView(model)
    if trains_with_dropout(dec):
        return None
    P = prompt_len
    A = pk.keep.shape[1]
    prompt_mask, _ = prefix_masks(attention_mask, first, P, 0)
    valid_p = attention_mask[first, :P].bool()
    cos_p, sin_p = dec.rotary_table(position_ids[first, :P])
    x_p = dec.embed(input_ids[first, :P])
    cos_a, sin_a = dec.rotary_table(pk.tokens(position_ids[:, P:P + A])[None])     # [1, N, rd]
    x_a = dec.embed(pk.tokens(input_ids[:, P:P + A]))                              # [N, H]
    valid = torch.cat([valid_p.reshape(-1), valid_p.new_ones(pk.n)])[None]        # [1, U·P + N]
    ctx = _Packed(dec, inverse, cos_p[:, None], sin_p[:, None], cos_a[:, None], sin_a[:, None], prompt_mask,
                  bucket_masks(pk, attention_mask[:, :P]), valid, pk)
    runs = [functools.partial(_packed_layer, ctx, i, layer) for i, layer in enumerate(dec.layers)]
    x_p, x_a = run_layers(dec, runs, x_p, x_a)
    return dec.norm(torch.cat([x_p[:, P - 1], x_a])[pk.source])


class _Packed:
    """What every layer of one packed forward reads."""

    def __init__(self, dec, inverse, cos_p, sin_p, cos_a, sin_a, prompt_mask, masks, valid, pk):
        self.dec, self.inverse = dec, inverse
        self.cos_p, self.sin_p, self.cos_a, self.sin_a = cos_p, sin_p, cos_a, sin_a
        self.prompt_mask, self.masks, self.valid, self.pk = prompt_mask, masks, valid, pk


def _packed_layer(c: _Packed, i: int, layer, x_p: Tensor, x_a: Tensor) -> tuple[Tensor, Tensor]:
    """Decoder layer i over the U prompts x_p [U, P, H] and the N packed answer tokens x_a [N, H]."""
    return _mixer_and_mlp(c, i, layer, x_p, x_a, _attention_packed, _delta_packed)


def _stack_packed(t_p: Tensor, t_a: Tensor) -> Tensor:
    """[U, P, ...] and packed [N, ...] -> one [1, U·P + N, ...] batch (one matmul per projection)."""
    return torch.cat([t_p.flatten(0, 1), t_a])[None]


def _unstack_packed(t: Tensor, U: int, P: int) -> tuple[Tensor, Tensor]:
    return t[0, :U * P].unflatten(0, (U, P)), t[0, U * P:]


def _attention_packed(c: _Packed, attn, h_p: Tensor, h_a: Tensor) -> tuple[Tensor, Tensor]:
    dec, pk = c.dec, c.pk
    U, P = h_p.shape[:2]
    qg, k, v = dec.project(_stack_packed(h_p, h_a), (attn.q_proj, attn.k_proj, attn.v_proj))
    (qg_p, qg_a), (k_p, k_a), (v_p, v_a) = (_unstack_packed(t, U, P) for t in (qg, k, v))
    q_p, k_p, v_p, gate_p = dec.heads(attn, qg_p, k_p, v_p, c.cos_p, c.sin_p)
    o_p = _attend(dec, q_p, k_p, v_p, c.prompt_mask) * torch.sigmoid(gate_p)
    # the packed answers as one row of N tokens for the norms and the rotation, then [N, heads, D]
    q_a, k_a, v_a, gate_a = dec.heads(attn, qg_a[None], k_a[None], v_a[None], c.cos_a, c.sin_a)
    q_a, k_a, v_a = q_a[0].transpose(0, 1), k_a[0].transpose(0, 1), v_a[0].transpose(0, 1)
    per_bucket = []
    for bucket, mask in zip(pk.buckets, c.masks):
        group = c.inverse[bucket.rows]
        keys = torch.cat([per_row(k_p, group), pk.pad(k_a, bucket).transpose(1, 2)], dim=2)    # [n, kv, P+M, D]
        values = torch.cat([per_row(v_p, group), pk.pad(v_a, bucket).transpose(1, 2)], dim=2)
        per_bucket.append(_attend(dec, pk.pad(q_a, bucket).transpose(1, 2), keys, values, mask))
    o_a = pk.unpad(per_bucket) if per_bucket else gate_a.new_empty(0, gate_a.shape[-1])
    o_a = o_a * torch.sigmoid(gate_a[0])
    return _unstack_packed(dec.project(_stack_packed(o_p, o_a), (attn.o_proj,))[0], U, P)


def _delta_packed(c: _Packed, la, h_p: Tensor, h_a: Tensor) -> tuple[Tensor, Tensor]:
    dec, pk = c.dec, c.pk
    U, P = h_p.shape[:2]
    qkv, z, beta, g = dec.delta_inputs(la, _stack_packed(h_p, h_a), c.valid)
    (qkv_p, qkv_a), (beta_p, beta_a), (g_p, g_a) = (_unstack_packed(t, U, P) for t in (qkv, beta, g))
    w = la.conv1d.weight[:, 0]
    y_p, conv_p = causal_conv1d(qkv_p, w)                               # prompts from zero state
    q, k, v = dec.split_qkv(y_p)
    o_p, S_p = gated_delta_rule(q, k, v, g_p.to(dec.state_dtype), beta_p)
    per_bucket = []
    for bucket in pk.buckets:                                           # answers continue each prompt
        group = c.inverse[bucket.rows]
        y_a, _ = causal_conv1d(pk.pad(qkv_a, bucket), w, conv_p[group])
        q, k, v = dec.split_qkv(y_a)
        o_b, _ = gated_delta_rule(q, k, v, pk.pad(g_a, bucket).to(dec.state_dtype), pk.pad(beta_a, bucket),
                                  initial_state=S_p[group])
        per_bucket.append(o_b)                                          # [n, M, Hv, Dv]
    o_a = pk.unpad(per_bucket) if per_bucket else o_p.new_empty(0, *o_p.shape[2:])
    return _unstack_packed(dec.delta_output(la, _stack_packed(o_p, o_a), z), U, P)
