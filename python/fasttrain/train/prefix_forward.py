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

What it is not: a general attention implementation. It drives the modules of a model of one of
fasttrain's families through the family view (fasttrain.models.family_view), so NF4 and adapter
layers run as they are; anything else (attention dropout in training, a sliding window shorter
than the sequence) returns None and the caller runs the model's own forward.

Each family's piece is one entry of PREFIX_FORWARDS, keyed by the family's name: its padded
forward (train/prefix_forward_llama.py, train/prefix_forward_hybrid.py; the mixtures of experts
run their base family's with routing replay, train/prefix_forward_moe.py) and, where it has one,
its packed form. A model outside the families gets the Llama family's piece, which drives it or
returns None.

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

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from fasttrain.models.families import family_of
from fasttrain.train.answer_packing import AnswerPacking, pack_answers
from fasttrain.train.prefix_common import per_row, prefix_masks, prompt_groups, run_layers
from fasttrain.train.prefix_forward_hybrid import hybrid_packed_hidden, shared_prefix_hidden_hybrid
from fasttrain.train.prefix_forward_llama import llama_packed_hidden, llama_prefix_hidden
from fasttrain.train.prefix_forward_moe import with_routing_replay

__all__ = ["shared_prefix_hidden", "shared_prefix_selected", "llama_prefix_hidden", "llama_packed_hidden",
           "prompt_groups", "prefix_masks", "per_row", "run_layers", "PrefixForward", "PREFIX_FORWARDS",
           "prefix_forward_of"]


@dataclass(frozen=True)
class PrefixForward:
    """A family's shared-prefix forward. `hidden(model, input_ids, attention_mask, position_ids,
    prompt_len, T, prompt_index=None, wrap=None, routing=None)`: shared_prefix_hidden's result or
    None. `packed(model, input_ids, attention_mask, position_ids, prompt_len, T, inverse, first, pk)`:
    the hidden states of pk's wanted positions or None; None where the family keeps the padded
    layout. `contiguous`: its packing wants each row's real answer tokens first
    (fasttrain.train.answer_packing.pack_answers)."""

    hidden: Callable[..., Tensor | None]
    packed: Callable[..., Tensor | None] | None = None
    contiguous: bool = False


def _hybrid_packed(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int, T: int,
                   inverse: Tensor, first: Tensor, pk: AnswerPacking) -> Tensor | None:
    return hybrid_packed_hidden(model, input_ids, attention_mask, position_ids, prompt_len, inverse, first, pk)


# The MoE families keep the padded layout: their routing record is laid out in its token order.
PREFIX_FORWARDS: dict[str, PrefixForward] = {
    "llama": PrefixForward(llama_prefix_hidden, llama_packed_hidden),
    "qwen3_5": PrefixForward(shared_prefix_hidden_hybrid, _hybrid_packed, contiguous=True),
    "qwen3_moe": PrefixForward(with_routing_replay(llama_prefix_hidden)),
    "qwen3_5_moe": PrefixForward(with_routing_replay(shared_prefix_hidden_hybrid)),
}


def prefix_forward_of(model) -> PrefixForward:
    """The piece of `model`'s family; a model outside the families (a user factory's Llama-like
    model, which the Llama view then drives or refuses) gets the Llama family's."""
    try:
        name = family_of(model).name
    except ValueError:
        name = "llama"
    return PREFIX_FORWARDS[name]


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
    return prefix_forward_of(model).hidden(model, input_ids, attention_mask, position_ids, prompt_len, T,
                                           prompt_index, wrap=wrap, routing=routing)


def shared_prefix_selected(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                           prompt_len: int, T: int, select: Tensor, prompt_index: Tensor | None = None,
                           routing=None, packed: bool = True) -> Tensor | None:
    """The final-norm hidden states [n, H] of the wanted positions `select` [B, T] (bool; row-major,
    as shared_prefix_hidden(...)[select]), each distinct prompt run once. `packed`: the answers run
    packed (the module doc) where the family has that form (Llama, the Qwen3.5 hybrid) and packing
    drops something; False forces the padded layout. Other arguments and None as
    shared_prefix_hidden."""
    piece = prefix_forward_of(model)
    if packed and piece.packed is not None:
        P = prompt_len
        inverse, first = prompt_groups(input_ids, attention_mask, P, prompt_index)
        pk = pack_answers(attention_mask, select, P, inverse, first.shape[0], contiguous=piece.contiguous)
        if pk is not None:
            h = piece.packed(model, input_ids, attention_mask, position_ids, P, T, inverse, first, pk)
            if h is not None:
                return h
    h = piece.hidden(model, input_ids, attention_mask, position_ids, prompt_len, T, prompt_index, routing=routing)
    return None if h is None else h[select.bool()]
