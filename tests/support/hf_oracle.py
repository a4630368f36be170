"""transformers' own Qwen3.5 model as a float64 oracle: its delta-rule and conv functions replaced
by fasttrain.ops.reference's definitions for the duration of a `with` block.

    with hf_float64_oracle():
        logits = model.double()(input_ids, attention_mask=mask, position_ids=pos).logits

Why: transformers' torch fallbacks (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)
cast to float32 inside whatever the input dtype, so a float64 Qwen3_5ForCausalLM is accurate to
~1e-7 only, too coarse to test a float64 decoder against. Everything else in the model (projections,
norms, gated attention, the partial rotary embedding, padding masks) is transformers' code as it
ships. What this is not: a fast path or something a run uses; tests and the NF4 measurement do.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from fasttrain.ops import reference as R

__all__ = ["hf_float64_oracle"]


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)     # transformers' l2norm, in x's dtype


def _delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **_):
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    o, S = R.gated_delta_rule(query, key, value, g, beta, initial_state=initial_state)
    return o.to(query.dtype), (S if output_final_state else None)


def _conv_fn(hidden_states, weight, bias=None, activation=None, **_):
    y, _ = R.causal_conv1d(hidden_states.transpose(1, 2), weight, None, activation == "silu")
    return y.transpose(1, 2)


def _conv_update(hidden_states, conv_state, weight, bias=None, activation=None):
    K = weight.shape[-1]
    state = conv_state[:, :, -(K - 1):].transpose(1, 2)
    y, _ = R.causal_conv1d(hidden_states.transpose(1, 2), weight, state, activation == "silu")
    conv_state.copy_(torch.cat([conv_state, hidden_states.to(conv_state.dtype)], -1)[:, :, -conv_state.shape[-1]:])
    return y.transpose(1, 2)


@contextmanager
def hf_float64_oracle(family: str = "qwen3_5"):
    """Inside the block transformers' qwen3_5 modeling (or `family`'s: "qwen3_5_moe") computes its
    delta rule and conv with fasttrain.ops.reference (float64 for float64 inputs)."""
    import importlib
    M = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    names = {"torch_chunk_gated_delta_rule": _delta_rule, "torch_recurrent_gated_delta_rule": _delta_rule,
             "causal_conv1d_fn": _conv_fn, "causal_conv1d_update": _conv_update}
    saved = {n: getattr(M, n) for n in names}
    try:
        for n, f in names.items():
            setattr(M, n, f)
        yield
    finally:
        for n, f in saved.items():
            setattr(M, n, f)
