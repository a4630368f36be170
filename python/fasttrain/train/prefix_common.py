"""The pieces every family's shared-prefix forward uses (fasttrain.train.prefix_forward says what
that forward is): the groups of rows that share a prompt, the prompt and answer masks, a prompt's
slice gathered to its rows, and the layers run under the model's gradient checkpointing.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["prompt_groups", "prefix_masks", "per_row", "run_layers", "trains_with_dropout"]


def trains_with_dropout(view) -> bool:
    """Whether the model of a family view trains with attention dropout (the shared-prefix forward
    does not drop attention: the caller runs the model's own forward)."""
    return view.model.training and float(getattr(view.model.config, "attention_dropout", 0.0) or 0.0) > 0


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
