"""The update's forward with each distinct prompt run once per micro-batch, with or without
gradient checkpointing.

The rows of a GRPO group hold the same P prompt tokens; the plain forward runs them G times.
Here, layer by layer, the U distinct prompts [U, P] and the answer tokens of all B rows [B, T-1]
go through the projections and the MLP together (one matmul per projection over U·P + B·(T-1)
tokens), the prompts attend among themselves, and every answer row attends to its own prompt's
keys and values (gathered by index: the gather's backward adds a group's gradients into its one
prompt) followed by its own answer tokens. The cost of a pass scales with U·P + B·T tokens instead
of B·(P+T).

Under gradient checkpointing each decoder layer is one checkpointed function of (prompt hidden
states, answer hidden states): the layer's prompt keys and values are recomputed from the prompt's
U rows in the backward, not from B copies, and only the layer inputs are kept (as Hugging Face's
checkpointing keeps them). The layers whose `gradient_checkpointing` flag is set (by
`gradient_checkpointing_enable` / `activation_checkpointing_enable`) are checkpointed, with the
model's own checkpoint function (its use_reentrant and offload settings).

What it is not: a general attention implementation. It drives the modules of a Llama-family
model (the families `fasttrain.rollout.decoder` knows), so NF4 and adapter layers run as they
are; anything else (attention dropout in training, a sliding window shorter than the sequence)
returns None and the caller runs the model's own forward.

Packed answers (`shared_prefix_selected`, what the update calls; `packed=False` forces the padded
layout): the answers' token rows are the real answer inputs of all rows, N of them, flattened
[N, H] with cumulative offsets (fasttrain.train.answer_packing), not [B, T-1]: the embedding, every
norm, every projection (NF4, LoRA and DoRA layers as they are, one matmul over the U·P prompt
tokens and the N answer tokens), the MLP, the final norm and the log-prob head run on real tokens
only. Attention runs per length bucket (rows of similar length padded to the bucket's longest,
at most 1/8 of its tokens), each row's queries over its prompt's keys and its own answers; so
attention alone still pays for that bounded padding (torch's scaled_dot_product_attention takes a
padded batch, not cumulative offsets, and one call per row would cost a call per row and layer;
buckets bound both), and the U prompts for their left padding (P columns each, as before). A micro-batch with nothing to drop (every row as long as the longest)
runs the padded layout, which is then the same work. Under gradient checkpointing a layer is
the same checkpointed function of (prompt hidden states [U, P, H], packed answers [N, H]).
The MoE families (train/prefix_forward_moe.py) keep the padded layout: their routing record is laid
out in its token order.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from fasttrain.ops.attention import masked_attention
from fasttrain.rollout.decoder import LlamaFamilyDecoder, rotate_half
from fasttrain.train.answer_packing import AnswerPacking, bucket_masks, pack_answers

__all__ = ["shared_prefix_hidden", "shared_prefix_selected", "llama_prefix_hidden", "llama_packed_hidden",
           "prompt_groups", "prefix_masks"]


def _family(model) -> LlamaFamilyDecoder | None:
    try:
        dec = LlamaFamilyDecoder(model)
    except (ValueError, AttributeError):
        return None
    cfg = dec.model.config
    if dec.model.training and float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0:
        return None
    return dec


def _family_piece(model):
    """The shared-prefix forward of a family other than Llama's (train/prefix_forward_hybrid.py for
    Qwen3.5 hybrids, train/prefix_forward_moe.py for the mixtures of experts), or None for the
    Llama family run below."""
    from fasttrain.models.families import family_of
    try:
        family = family_of(model)
    except ValueError:
        return None
    if family.moe:
        from fasttrain.train.prefix_forward_moe import shared_prefix_hidden_moe
        return shared_prefix_hidden_moe
    if family.name == "qwen3_5":
        from fasttrain.train.prefix_forward_hybrid import shared_prefix_hidden_hybrid
        return shared_prefix_hidden_hybrid
    return None


def prompt_groups(input_ids: Tensor, attention_mask: Tensor, P: int,
                  prompt_index: Tensor | None) -> tuple[Tensor, Tensor]:
    """(inverse [B]: each row's distinct prompt in 0..U-1, first [U]: one row of each distinct prompt).
    Groups are the rollout's `prompt_index`, or else rows with equal prompt tokens and mask."""
    B, device = input_ids.shape[0], input_ids.device
    if prompt_index is not None:
        _, inverse = torch.unique(prompt_index, return_inverse=True)
    else:
        key = torch.cat([input_ids[:, :P], attention_mask[:, :P].to(input_ids.dtype)], dim=1)
        _, inverse = torch.unique(key, dim=0, return_inverse=True)
    U = int(inverse.max()) + 1
    # one row per distinct prompt (any row of its group: their prompt tokens are equal)
    first = torch.zeros(U, dtype=torch.long, device=device).scatter_(0, inverse, torch.arange(B, device=device))
    return inverse, first


def prefix_masks(attention_mask: Tensor, first: Tensor, P: int, A: int) -> tuple[Tensor, Tensor | None]:
    """Attention masks (True = may attend) of the U distinct prompts among themselves [U, 1, P, P]
    and of the B rows' A answer inputs over their prompt's P keys then their own answers
    [B, 1, A, P+A] (None when A = 0)."""
    device = attention_mask.device
    prompt_valid = attention_mask[first, :P].bool()                     # [U, P]
    causal = torch.ones(P, P, dtype=torch.bool, device=device).tril_()
    eye = torch.eye(P, dtype=torch.bool, device=device)
    # A pad query of the prompt sees itself only (no NaN); no real token reads its output.
    prompt_mask = ((causal & prompt_valid[:, None, :]) | eye)[:, None]
    if A == 0:
        return prompt_mask, None
    B = attention_mask.shape[0]
    ans_valid = attention_mask[:, P:P + A].bool()                       # [B, A]
    keys_of_prompt = attention_mask[:, :P].bool()[:, None, :].expand(B, A, P)
    ans_causal = torch.ones(A, A, dtype=torch.bool, device=device).tril_() & ans_valid[:, None, :]
    # every answer query sees its prompt's real tokens, so no query row is all-masked
    return prompt_mask, torch.cat([keys_of_prompt, ans_causal], dim=2)[:, None]


def shared_prefix_hidden(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                         prompt_len: int, T: int, prompt_index: Tensor | None = None, routing=None,
                         wrap=None) -> Tensor | None:
    """Final-norm hidden states [B, T, H] whose row b, column t predicts answer token t of row b
    (the full forward's hidden[:, P-1 : P-1+T]), with each distinct prompt run once.

    input_ids/attention_mask/position_ids [B, P+T]: left-padded prompts then answers.
    `prompt_index` [B]: the rollout's group of each row (rows of one group share their prompt);
    without it, rows whose prompt tokens and mask are equal are grouped. `routing`: a mixture of
    experts' rollout record for these rows (fasttrain.rollout.moe_routing.ReplayRouting), ignored by
    other families. `wrap(i, run)`: what runs decoder layer i in place of `run` (the MoE piece sets
    each layer's routing there, so a checkpoint recompute sees it too). Returns None when the
    model is not one this forward drives (the caller runs the model's own forward)."""
    piece = _family_piece(model)
    if piece is not None:
        return piece(model, input_ids, attention_mask, position_ids, prompt_len, T, prompt_index, routing=routing,
                     wrap=wrap)
    return llama_prefix_hidden(model, input_ids, attention_mask, position_ids, prompt_len, T, prompt_index, wrap)


def shared_prefix_selected(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                           prompt_len: int, T: int, select: Tensor, prompt_index: Tensor | None = None,
                           routing=None, packed: bool = True) -> Tensor | None:
    """The final-norm hidden states [n, H] of the wanted positions `select` [B, T] (bool; row-major,
    as shared_prefix_hidden(...)[select]), each distinct prompt run once. `packed`: the answers run
    packed (the module doc) where the family has that form (Llama, the Qwen3.5 hybrid) and packing
    drops something; False forces the padded layout. Other arguments and None as
    shared_prefix_hidden."""
    if packed:
        kind = _family_kind(model)
        if kind in ("llama", "qwen3_5"):
            P = prompt_len
            inverse, first = prompt_groups(input_ids, attention_mask, P, prompt_index)
            pk = pack_answers(attention_mask, select, P, inverse, first.shape[0], contiguous=kind == "qwen3_5")
            if pk is not None:
                if kind == "qwen3_5":
                    from fasttrain.train.prefix_forward_hybrid import hybrid_packed_hidden
                    h = hybrid_packed_hidden(model, input_ids, attention_mask, position_ids, P, inverse, first, pk)
                else:
                    h = llama_packed_hidden(model, input_ids, attention_mask, position_ids, P, T, inverse, first, pk)
                if h is not None:
                    return h
    h = shared_prefix_hidden(model, input_ids, attention_mask, position_ids, prompt_len, T, prompt_index,
                             routing=routing)
    return None if h is None else h[select.bool()]


def _family_kind(model) -> str:
    """"moe", "qwen3_5" (the hybrid) or "llama" (the Llama family, and a model outside the families,
    which LlamaFamilyDecoder then drives or refuses)."""
    from fasttrain.models.families import family_of
    try:
        family = family_of(model)
    except ValueError:
        return "llama"
    if family.moe:
        return "moe"
    return "qwen3_5" if family.name == "qwen3_5" else "llama"


def _prefix_decoder(model, P: int, T: int) -> LlamaFamilyDecoder | None:
    """The model's Llama-family decoder view, or None where the shared-prefix forward does not apply
    (not that family, or a sliding window shorter than prompt + answer)."""
    dec = _family(model)
    if dec is None or (dec.sliding_window is not None and P + T > dec.sliding_window):
        return None
    return dec


def llama_prefix_hidden(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int,
                        T: int, prompt_index: Tensor | None = None, wrap=None) -> Tensor | None:
    """shared_prefix_hidden of the Llama family's layers (the attention of every layer is full)."""
    dec = _prefix_decoder(model, prompt_len, T)
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
    dec = _prefix_decoder(model, prompt_len, T)
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


def _layer(dec: LlamaFamilyDecoder, layer, inverse: Tensor, cos_p: Tensor, sin_p: Tensor, prompt_mask: Tensor,
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


def _packed_layer(dec: LlamaFamilyDecoder, layer, inverse: Tensor, cos_p: Tensor, sin_p: Tensor, prompt_mask: Tensor,
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


def per_row(t: Tensor, index: Tensor) -> Tensor:
    """t[index]: each row's prompt's slice of t [U, ...]. With one prompt (a micro-batch of one
    group, the study's shape) an expand instead, whose backward is a sum over the rows; the gather's
    backward is an accumulating index_put (0.2 s of SmolLM2's update step on the 2-core AMX Xeon)."""
    if t.shape[0] == 1:
        return t.expand(index.shape[0], *t.shape[1:])
    return t[index]


def run_layers(dec, runs, x_p, x_a):
    """x_p, x_a through each decoder layer's `run(x_p, x_a)` in order; a layer whose model trains
    with gradient checkpointing on keeps only its inputs (transformers' checkpoint function, or
    torch's non-reentrant one)."""
    checkpointing = dec.model.training and torch.is_grad_enabled()
    for layer, run in zip(dec.layers, runs):
        if checkpointing and getattr(layer, "gradient_checkpointing", False):
            ckpt = getattr(layer, "_gradient_checkpointing_func", None) or functools.partial(
                torch.utils.checkpoint.checkpoint, use_reentrant=False)
            x_p, x_a = ckpt(run, x_p, x_a)
        else:
            x_p, x_a = run(x_p, x_a)
    return x_p, x_a
