"""Fused policy loss: CISPO, DAPO or GRPO with a KL term, REPO-R advantage rescaling and a token mask.

Per token (the recipe in docs/design.md), with r = exp(logp - old_logp):
  A'    = A * (1 - zeta * log p) if A > 0, A * (1 + zeta * log p) if A < 0   (REPO-R; log p detached,
          clamped at -20; the factor never goes below 0, so A' never changes sign)
  CISPO   -sg(min(r, cispo_cap)) * A' * logp                       (MiniMax-M1, 2025)
  DAPO    -min(r A', clip(r, 1 - eps_low, 1 + eps_high) A')         (Yu et al. 2025, clip-higher)
  GRPO    as DAPO with eps_high = eps_low, per-sequence mean, then mean over sequences
  KL      kl = "k3_ratio" (the default): beta * r * k3, r differentiable   (DeepSeek-V3.2 §3.1)
          kl = "k3":                     beta * k3, k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman 2020)
          The first's gradient, beta * r * (logp - ref), is the unbiased estimate of the gradient of
          KL(pi || pi_ref) over tokens sampled from pi_old; the second's is the forward KL's on-policy and
          neither KL's off-policy (docs/recipes.md derives both). Neither is clamped.
Aggregation (CISPO, DAPO): sum over active tokens of mask * loss / normalizer, normalizer = the
active tokens of this batch, or `token_normalizer` (the whole batch's count, so micro-batches
accumulate to the big batch's gradient). GRPO: `token_normalizer` replaces the number of sequences.

One registered op computes the loss, the stats and each token's gradient coefficient in one pass;
a second registered op (backward) scales the saved coefficients; the autograd formula joining them is
registered in C++ (csrc/core/policy_loss_autograd.h). Nothing syncs with the host.
"""
from __future__ import annotations

import torch

from fasttrain._native import load as _load
from fasttrain.ops import reference as _reference
from fasttrain.ops.kernels import use_reference as _use_reference

_load()
_ops = torch.ops.fasttrain

__all__ = ["policy_loss", "POLICY_LOSS_STATS", "POLICY_LOSSES", "POLICY_KLS"]

POLICY_LOSSES = {"cispo": 0, "dapo": 1, "grpo": 2}
# The op's kl_type (core/math.h PolicyKlKind). The op's own schema defaults to 0 (k3), what it
# computed before the choice existed; this function defaults to "k3_ratio".
POLICY_KLS = {"k3": 0, "k3_ratio": 1}
# Order of the op's stats vector (core/math.h PolicyStat).
POLICY_LOSS_STATS = ("ratio_mean", "clip_low_frac", "clip_high_frac", "cap_frac", "kl_mean",
                     "repo_r_factor_mean", "active_tokens")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                loss: str = "cispo", ref_logp: torch.Tensor | None = None, beta: float = 0.0,
                eps_low: float = 0.2, eps_high: float = 0.28, cispo_cap: float = 1.2, zeta: float = 0.0,
                token_normalizer: float | torch.Tensor | None = None,
                kl: str = "k3_ratio") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy-gradient loss of a batch and its statistics.

    logp [B, T] (requires grad), old_logp [B, T], ref_logp [B, T] or None, mask [B, T] bool or float
    (float values weight the tokens), advantages [B], [B, 1] or [B, T]. Returns (loss fp32 [],
    stats: dict of fp32 [] tensors named in POLICY_LOSS_STATS); stats are over this batch's active tokens
    (kl_mean: the KL term the loss holds, without beta: r * k3 for "k3_ratio", k3 for "k3"; the REPO-R
    factor over tokens with A != 0) and carry no gradient. `kl`: the estimator, used when ref_logp is
    given and beta != 0. The KL is charged on the tokens of `mask`, the same as the policy term.
    """
    # This wrapper's cost is the op's fixed cost at small batches (15k tokens: the kernel is tens of
    # microseconds): it converts only what does not already fit, and the gradient is the op's C++
    # autograd (csrc/core/policy_loss_autograd.h), which treats every input but logp as data.
    if _use_reference():
        return _reference.policy_loss(logp, old_logp, advantages, mask, loss=loss, ref_logp=ref_logp, beta=beta,
                                      eps_low=eps_low, eps_high=eps_high, cispo_cap=cispo_cap, zeta=zeta,
                                      token_normalizer=token_normalizer, kl=kl)
    loss_type = POLICY_LOSSES.get(loss)
    if loss_type is None:
        raise ValueError(f"policy_loss: loss must be one of {sorted(POLICY_LOSSES)}, got {loss!r}")
    kl_type = POLICY_KLS.get(kl)
    if kl_type is None:
        raise ValueError(f"policy_loss: kl must be one of {sorted(POLICY_KLS)}, got {kl!r}")
    for name, t in (("logp", logp), ("old_logp", old_logp), ("ref_logp", ref_logp)):
        if t is None and name == "ref_logp":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"policy_loss: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"policy_loss: {name} must be float32, float16 or bfloat16, got {t.dtype}")
    if logp.dim() != 2:
        raise ValueError(f"policy_loss: logp must be [B, T], got shape {tuple(logp.shape)}")
    if not isinstance(mask, torch.Tensor) or mask.shape != logp.shape:
        raise ValueError(f"policy_loss: mask must be a tensor of logp's shape {tuple(logp.shape)}, "
                         f"got {getattr(mask, 'shape', type(mask).__name__)}")
    if not isinstance(advantages, torch.Tensor):
        raise TypeError(f"policy_loss: advantages must be a torch.Tensor, got {type(advantages).__name__}")
    if advantages.dim() == 2 and advantages.shape[1] == 1 and logp.shape[1] != 1:
        advantages = advantages.reshape(-1)
    if eps_low < 0 or eps_high < 0 or cispo_cap <= 0:
        raise ValueError(f"policy_loss: eps_low, eps_high must be >= 0 and cispo_cap > 0, got "
                         f"{eps_low}, {eps_high}, {cispo_cap}")
    if zeta < 0:
        raise ValueError(f"policy_loss: zeta must be >= 0, got {zeta}")
    # One dtype for the log-probs: the widest of the three (a bf16 old_logp against an fp32 logp
    # would otherwise round the fp32 side).
    dtype = logp.dtype
    if old_logp.dtype != dtype or (ref_logp is not None and ref_logp.dtype != dtype):
        if ref_logp is not None:
            dtype = torch.promote_types(dtype, ref_logp.dtype)
        dtype = torch.promote_types(dtype, old_logp.dtype)
        logp, old_logp = logp.to(dtype), old_logp.to(dtype)
        ref_logp = None if ref_logp is None else ref_logp.to(dtype)
    if advantages.dtype != torch.float32:
        advantages = advantages.float()
    if mask.dtype != torch.bool and mask.dtype != torch.float32:  # the kernels read bool and float32
        mask = mask.float()
    norm_tensor, norm_value = None, 0.0
    if isinstance(token_normalizer, torch.Tensor):
        norm_tensor = token_normalizer.detach().reshape(()).to(device=logp.device, dtype=torch.float32)
    elif token_normalizer is not None:
        if not token_normalizer > 0:
            raise ValueError(f"policy_loss: token_normalizer must be > 0, got {token_normalizer}")
        norm_value = float(token_normalizer)
    out, stats, _, _ = _policy_loss(logp, old_logp, advantages, mask, ref_logp, norm_tensor, loss_type, float(beta),
                                    float(eps_low), float(eps_high), float(cispo_cap), float(zeta), norm_value,
                                    kl_type)
    return out, dict(zip(POLICY_LOSS_STATS, stats.unbind()))  # views: one op, no copies; stats has no grad


_policy_loss = _ops.policy_loss.default


@torch.library.register_fake("fasttrain::policy_loss")
def _(logp, old_logp, advantages, mask, ref_logp, token_normalizer, loss_type, beta, eps_low, eps_high, cispo_cap,
      zeta, token_normalizer_value, kl_type=0):
    B = logp.shape[0]
    f32 = dict(dtype=torch.float32)
    return (logp.new_empty((), **f32), logp.new_empty((len(POLICY_LOSS_STATS),), **f32),
            logp.new_empty(logp.shape, **f32), logp.new_empty((B,), **f32))


@torch.library.register_fake("fasttrain::policy_loss_backward")
def _(grad_loss, coef, rowscale, dtype):
    return coef.new_empty(coef.shape, dtype=dtype)
