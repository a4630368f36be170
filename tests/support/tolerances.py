"""The tolerances the tests derive from rounding, written once.

U64 and U32 are the unit roundoffs of float64 and float32 (half the gap between 1 and the next
float; round to nearest): one correctly rounded operation is off by at most u times its result.

`forward_tol`: two float64 forwards of one model (fasttrain's and the float64 oracle, or a packed and
an unpacked batch) that compute the same sums in different orders. A sum of n terms computed in
two orders differs by at most about n·u·Σ|terms| (first order; Higham, "Accuracy and Stability of
Numerical Algorithms", §4.2). Per layer the longest sums have H terms (a projection over the hidden
size), S·D for the attention scores and S·D again for the attention-weighted values (S positions,
head dimension D), and I for an MLP's down projection where a caller's comparison runs through one
in a way the H term does not cover (`mlp=True`). Layers add their errors: layers·(H [+ I] + 2·S·D)·u.

MAGNITUDE (the factor 1e3 that every copy of this bound carried) is the bound on Σ|terms| relative
to the compared value: the tiny models' activations are of unit scale and |logit| < 10, and an
RMSNorm multiplies by 1/rms, which stays below 1e2 in these models; 10 · 1e2 = 1e3. For the tiny
models' sizes the bound is about 1e-9; several tests that use it also assert that two paths which
should differ (an adapter on or off, routing replayed or not) differ by more than 1e3 times it.
"""
from __future__ import annotations

import math

U64 = 2.0 ** -53
U32 = 2.0 ** -24
MAGNITUDE = 1e3

__all__ = ["U64", "U32", "MAGNITUDE", "attention_head_dim", "forward_tol", "fp32_logsoftmax_tol"]


def attention_head_dim(config) -> int:
    """The longest per-head dimension a layer sums over: the attention head's, or a Gated DeltaNet
    layer's key head's where the model has them."""
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return max(d, getattr(config, "linear_key_head_dim", 0) or 0)


def forward_tol(config, S: int, *, head_dim: int | None = None, mlp: bool = False) -> float:
    """layers·(H [+ I] + 2·S·D)·U64·MAGNITUDE for a float64 forward over S positions (module docstring)."""
    D = attention_head_dim(config) if head_dim is None else head_dim
    terms = config.hidden_size + (config.intermediate_size if mlp else 0) + 2 * S * D
    return config.num_hidden_layers * terms * U64 * MAGNITUDE


def fp32_logsoftmax_tol(logprobs) -> float:
    """8·U32·(max|z| + log V): a log-softmax taken in float32 (as a run's rollout does) against float64
    log-probs `logprobs` [..., V]; |z - max z| = -log p bounds the logits' spread."""
    return 8 * U32 * (float(logprobs.abs().max()) + math.log(logprobs.shape[-1]))
