"""Every fasttrain op written plainly in PyTorch: the oracle and the fallback.

    from fasttrain.ops import reference as R
    logp, entropy = R.fused_logprob(hidden, weight, targets, temperature=0.9)   # float64 in: the oracle

Each function has the signature of the op's face in `fasttrain.ops` and returns the same outputs
(values, dtypes and gradients, within the op tests' tolerances): it is written once, from the
definitions in the ops' docstrings, with torch's autograd doing every backward. Three uses:
  - the float64 oracle of tests/ops and of `fasttrain selftest` (pass float64 tensors);
  - the run-time fallback: `run.kernels = "reference"` in a recipe, or FASTTRAIN_KERNELS=reference
    for the ops called inside other trainers, sends every op face here (fasttrain.ops.kernels);
  - a readable statement of what each fused kernel computes.
No native kernel is called here, so it stays a check on the kernels rather than a second copy of
them: the module imports torch and fasttrain.ops.formats only (the ops' plain data and shared
argument checks: NF4State, the dynamic-map table, the absmax decode, the MoE argument errors),
never an op face.

Precision, as the fused ops promise: log-softmax, losses and their sums in float32 for
bf16/fp16/fp32 inputs (float64 for float64), NF4 decoded exactly (a float32 level times a float32
absmax), nf4_linear in float32 (float64 for float64 x), outputs in the dtypes the fused ops return.
Cost is that of the plain formula: fused_logprob holds the [N, V] logits and their log-softmax,
nf4_linear decodes W on every call and autograd keeps it for the backward; DoRA forms W + s·B·A.
"""
from __future__ import annotations

import math

import torch

# the ops' formats: plain data and shared argument checks (a leaf module, no op face)
from fasttrain.ops.formats import (ABSMAX_BLOCKSIZE, NF4State, blockwise8_dequantize, check_moe_args, dynamic_map,
                                   nf4_state_absmax)

__all__ = ["NF4_LEVELS", "fused_logprob", "policy_loss", "nf4_quantize", "nf4_dequantize", "nf4_linear",
           "nf4_dora_norm", "nf4_weight_sq_norm", "nf4_quantize_blocks", "nf4_dequantize_blocks",
           "blockwise8_quantize", "blockwise8_dequantize", "nf4_state_absmax", "nf4_decode_weight",
           "policy_loss_terms", "gated_delta_rule", "gated_delta_step", "causal_conv1d", "causal_conv1d_step",
           "moe_experts", "decode_attention"]

# The 16 NF4 levels of QLoRA (Dettmers et al. 2023) as bitsandbytes stores them (float32 values).
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
POLICY_LOSSES = ("cispo", "dapo", "grpo")
POLICY_KLS = ("k3", "k3_ratio")
POLICY_LOSS_STATS = ("ratio_mean", "clip_low_frac", "clip_high_frac", "cap_frac", "kl_mean",
                     "repo_r_factor_mean", "active_tokens")


def _acc(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


# ---- NF4 ---------------------------------------------------------------------------------------
def _levels(device) -> torch.Tensor:
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)


def _nearest_code(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of a sorted float32 table: the number of float32 midpoints
    (t[i] + t[i+1]) / 2 strictly below x, so a value on a midpoint takes the lower entry."""
    mids = (table[:-1] + table[1:]) / 2
    return torch.bucketize(x, mids, right=False)


def _scaled_blocks(x: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' blockwise scaling of a flat float32 vector: full blocks multiply by the float32
    reciprocal of their absmax (floored at 1e-38; the unfloored absmax is stored), a trailing partial
    block divides by its floored absmax (which is stored); the result is clamped to [-1, 1].
    Returns (scaled [n_blocks, blocksize] zero-padded, stored absmax [n_blocks])."""
    n = x.numel()
    nb = (n + blocksize - 1) // blocksize
    xp = torch.cat([x, x.new_zeros(nb * blocksize - n)]).view(nb, blocksize)
    m = xp.abs().amax(dim=1)
    a = m.clamp(min=1e-38)
    scaled = xp * (1.0 / a)[:, None]
    stored = m.clone()
    if n % blocksize:
        scaled[-1] = xp[-1] / a[-1]
        stored[-1] = a[-1]
    return scaled.clamp(-1.0, 1.0), stored


def nf4_quantize_blocks(w: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The `nf4_quantize` op: (packed uint8 [ceil(n/2)], absmax float32 [ceil(n/blocksize)]).
    Element 2j goes to the high nibble; an odd length pads the last low nibble with the code of 0."""
    x = w.detach().reshape(-1).to(torch.float32)
    n = x.numel()
    scaled, absmax = _scaled_blocks(x, blocksize)
    codes = _nearest_code(scaled.reshape(-1), _levels(x.device))[: 2 * ((n + 1) // 2)].to(torch.uint8)
    return (codes[0::2] << 4) | codes[1::2], absmax


def nf4_dequantize_blocks(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int, numel: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """The `nf4_dequantize` op: level(code) * absmax in float32 (one rounding), then cast to dtype."""
    codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:numel].long()
    scale = absmax.to(torch.float32).repeat_interleave(blocksize)[:numel]
    return (_levels(packed.device)[codes] * scale).to(dtype)


def blockwise8_quantize(x: torch.Tensor, code: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `blockwise8_quantize` op: the nearest entry of the sorted 256-entry `code` per value."""
    scaled, absmax = _scaled_blocks(x.reshape(-1).to(torch.float32), blocksize)
    q = _nearest_code(scaled.reshape(-1)[: x.numel()], code.to(torch.float32))
    return q.to(torch.uint8), absmax


def nf4_decode_weight(packed: torch.Tensor, state, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The NF4 weight as stored, shape state.shape, in dtype (float64: exactly the float32 values)."""
    numel = math.prod(state.shape)
    w = nf4_dequantize_blocks(packed, nf4_state_absmax(state), state.blocksize, numel,
                              torch.float32 if dtype == torch.float64 else dtype)
    return w.to(dtype).view(tuple(state.shape))


def check_nf4_quantize_input(w) -> None:
    """The argument errors of nf4_quantize (the fused face raises the same ones through this)."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"nf4_quantize: w must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"nf4_quantize: w must be float32, float16 or bfloat16, got {w.dtype}")
    if w.numel() == 0:
        raise ValueError("nf4_quantize: w is empty")


def absmax_offset(absmax: torch.Tensor) -> torch.Tensor:
    """The offset double quantization subtracts: the mean of the block scales, summed in float64 in
    index order and rounded once to float32, on the CPU whatever absmax's device (CPU cumsum is one
    sequential loop). The same weight therefore gets the same offset on every device, CPU and thread
    count; float32 absmax.mean() (bitsandbytes' rule) does not: CUDA and the CPU sum in different
    orders, and the CPU's order changes with the number of threads. The two agree to within the
    rounding error of that float32 sum. Returns a 0-d float32 tensor on absmax's device."""
    a = absmax.detach().to("cpu").to(torch.float64)
    return (a.cumsum(0)[-1] / a.numel()).to(torch.float32).to(absmax.device)


def nf4_quantize(w: torch.Tensor, blocksize: int = 64, double_quant: bool = False):
    """Quantize `w` (fp32/fp16/bf16) to NF4: (packed uint8 [ceil(n/2)], fasttrain.ops.NF4State).
    Double quantization subtracts the absmax vector's mean and stores the rest in 8 bits (256 per
    block) against the signed dynamic map, as bitsandbytes."""
    check_nf4_quantize_input(w)
    packed, absmax = nf4_quantize_blocks(w, blocksize)
    state = NF4State(shape=w.shape, dtype=w.dtype, blocksize=blocksize)
    if double_quant:
        code = dynamic_map().to(w.device)
        offset = absmax_offset(absmax)
        state.qabsmax, state.absmax2 = blockwise8_quantize(absmax - offset, code, ABSMAX_BLOCKSIZE)
        state.code, state.offset = code, offset
    else:
        state.absmax = absmax
    return packed, state


def nf4_dequantize(packed: torch.Tensor, state, dtype: torch.dtype | None = None) -> torch.Tensor:
    return nf4_dequantize_blocks(packed, nf4_state_absmax(state), state.blocksize, math.prod(state.shape),
                                 dtype or state.dtype).view(tuple(state.shape))


# ---- fused_logprob -----------------------------------------------------------------------------
def fused_logprob(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  ignore_index: int = -100, bias: torch.Tensor | None = None,
                  keep_delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and entropy of softmax((hidden·weightᵀ + bias) / temperature) from the full logits.

    Returns (logp, entropy) in float32 (float64 for float64 hidden), entropy detached; tokens whose
    target is ignore_index give 0 and no gradient. Leading dims of hidden/targets are kept.
    keep_delta (targets' shape): the softmax restricted to each token's kept set
    {v : z_v >= z_target - delta} plus the target, renormalised (+inf: the whole vocabulary)."""
    if hidden.dim() < 2:
        raise ValueError(f"fused_logprob: hidden must be [N, H] (or [..., H]), got shape {tuple(hidden.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"fused_logprob: targets must have shape {tuple(hidden.shape[:-1])} (hidden's leading "
                         f"dims), got {tuple(targets.shape)}")
    if not temperature > 0:
        raise RuntimeError(f"fused_logprob: 'temperature' must be > 0, got {temperature}")
    V = weight.shape[0]
    lead = hidden.shape[:-1]
    acc = _acc(hidden.dtype)
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    keep = t != ignore_index
    bad = keep & ((t < 0) | (t >= V))
    if bool(bad.any()):
        raise RuntimeError(f"fused_logprob: 'targets' holds {int(t[bad][0])}, outside [0, {V}) "
                           f"and not ignore_index ({ignore_index})")
    z = h.to(acc) @ weight.to(acc).T
    if bias is not None:
        z = z + bias.to(acc)
    z = z / temperature
    if keep_delta is not None:
        d = keep_delta.reshape(-1).to(acc)
        zt = z.gather(1, torch.where(keep, t, 0)[:, None])[:, 0]
        cut = torch.where(torch.isinf(d) & (d > 0), torch.full_like(zt, -float("inf")), zt - d)
        onehot = torch.zeros_like(z, dtype=torch.bool).scatter_(1, torch.where(keep, t, 0)[:, None], True)
        z = torch.where((z >= cut.detach()[:, None]) | onehot, z, torch.full_like(z, -float("inf")))
    ls = torch.log_softmax(z, dim=-1)
    zero = torch.zeros((), dtype=acc, device=h.device)
    logp = torch.where(keep, ls.gather(1, torch.where(keep, t, 0)[:, None]).squeeze(1), zero)
    with torch.no_grad():
        p = ls.exp()
        ent = torch.where(keep, -torch.where(p > 0, p * ls, zero).sum(-1), zero)
    return logp.view(lead), ent.view(lead)


# ---- policy_loss -------------------------------------------------------------------------------
def policy_loss_terms(logp, old_logp, advantages, mask, *, loss="cispo", ref_logp=None, beta=0.0, eps_low=0.2,
                      eps_high=0.28, cispo_cap=1.2, zeta=0.0, kl="k3_ratio") -> dict[str, torch.Tensor]:
    """Per-token parts of the policy loss [B, T] in the compute dtype: `loss` (mask-weighted, 0 on
    inactive tokens, differentiable in logp), and detached `ratio`, `kl` (the KL term without beta:
    r * k3 for kl="k3_ratio", k3 for "k3"), `factor`, `clip_low`, `clip_high`, `capped`, `weight`
    (the mask as numbers), `nonzero_adv`. The KL's gradient is autograd's, through r and k3."""
    if loss not in POLICY_LOSSES:
        raise ValueError(f"policy_loss: loss must be one of {sorted(POLICY_LOSSES)}, got {loss!r}")
    if kl not in POLICY_KLS:
        raise ValueError(f"policy_loss: kl must be one of {sorted(POLICY_KLS)}, got {kl!r}")
    ct = _acc(logp.dtype, old_logp.dtype, *(() if ref_logp is None else (ref_logp.dtype,)))
    lp = logp.to(ct)
    w = mask.detach().to(ct)
    on = w != 0
    adv = advantages.detach().to(ct)
    if adv.dim() == 2 and adv.shape[1] == 1 and logp.shape[1] != 1:
        adv = adv.reshape(-1)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(lp)
    zero = torch.zeros((), dtype=ct, device=lp.device)
    # Inactive tokens may hold anything (padding, NaN): replace them before they enter a formula.
    adv = torch.where(on, adv, zero)
    old = torch.where(on, old_logp.detach().to(ct), lp.detach())
    lp_d = lp.detach().clamp(min=-20.0)
    sign = (adv < 0).to(ct) - (adv > 0).to(ct)
    factor = (1 + sign * zeta * lp_d).clamp(min=0.0)             # REPO-R: never flips A's sign
    a = adv * factor
    r = torch.exp(lp - old)
    rd = r.detach()
    no = torch.zeros_like(rd)
    if loss == "cispo":
        per = -torch.clamp(rd, max=cispo_cap) * a * lp
        clip_low, clip_high, capped = no, no, (rd > cispo_cap).to(ct)
    else:
        hi = 1 + (eps_low if loss == "grpo" else eps_high)
        per = -torch.minimum(r * a, torch.clamp(r, 1 - eps_low, hi) * a)
        clip_low, clip_high, capped = ((a < 0) & (rd < 1 - eps_low)).to(ct), ((a > 0) & (rd > hi)).to(ct), no
    kl_term = no
    if ref_logp is not None and beta != 0.0:
        d = torch.where(on, ref_logp.detach().to(ct), lp.detach()) - lp
        kl_t = torch.exp(d) - d - 1
        if kl == "k3_ratio":
            kl_t = r * kl_t                                      # r in the graph: the gradient -r d
        per = per + beta * kl_t
        kl_term = kl_t.detach()
    per = torch.where(on, per * w, zero)
    return {"loss": per, "ratio": rd, "kl": kl_term, "factor": factor, "clip_low": clip_low, "clip_high": clip_high,
            "capped": capped, "weight": torch.where(on, w, zero), "nonzero_adv": (on & (adv != 0)).to(ct)}


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                loss: str = "cispo", ref_logp: torch.Tensor | None = None, beta: float = 0.0,
                eps_low: float = 0.2, eps_high: float = 0.28, cispo_cap: float = 1.2, zeta: float = 0.0,
                token_normalizer: float | torch.Tensor | None = None,
                kl: str = "k3_ratio") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO / DAPO / GRPO loss with a KL (k3_ratio or k3) and REPO-R, as fasttrain.ops.policy_loss: (loss [], stats).

    Loss and stats in float32 (float64 when an input is float64); the gradient reaches logp only."""
    if logp.dim() != 2:
        raise ValueError(f"policy_loss: logp must be [B, T], got shape {tuple(logp.shape)}")
    if not isinstance(mask, torch.Tensor) or mask.shape != logp.shape:
        raise ValueError(f"policy_loss: mask must be a tensor of logp's shape {tuple(logp.shape)}, "
                         f"got {getattr(mask, 'shape', type(mask).__name__)}")
    if zeta < 0:
        raise ValueError(f"policy_loss: zeta must be >= 0, got {zeta}")
    if token_normalizer is not None and not isinstance(token_normalizer, torch.Tensor) and not token_normalizer > 0:
        raise ValueError(f"policy_loss: token_normalizer must be > 0, got {token_normalizer}")
    p = policy_loss_terms(logp, old_logp, advantages, mask, loss=loss, ref_logp=ref_logp, beta=beta,
                          eps_low=eps_low, eps_high=eps_high, cispo_cap=cispo_cap, zeta=zeta, kl=kl)
    per, w = p["loss"], p["weight"]
    ct = per.dtype
    norm = None
    if isinstance(token_normalizer, torch.Tensor):
        norm = token_normalizer.detach().reshape(()).to(device=per.device, dtype=ct)
    elif token_normalizer is not None:
        norm = torch.tensor(float(token_normalizer), dtype=ct, device=per.device)
    total_w = w.sum()
    zero = torch.zeros((), dtype=ct, device=per.device)
    if loss == "grpo":
        row_w = w.sum(-1)
        n_seq = norm if norm is not None else (row_w > 0).sum().to(ct)
        row = torch.where(row_w > 0, per.sum(-1) / row_w.clamp(min=torch.finfo(ct).tiny), zero)
        out = torch.where(n_seq > 0, row.sum() / n_seq, zero)
    else:
        n = norm if norm is not None else total_w
        out = torch.where(n > 0, per.sum() / n, zero)

    def mean(x, weight=w, empty=0.0):
        s = weight.sum()
        return torch.where(s > 0, (x * weight).sum() / torch.where(s > 0, s, 1), torch.full_like(s, empty))

    stats = {"ratio_mean": mean(p["ratio"], empty=1.0), "clip_low_frac": mean(p["clip_low"]),
             "clip_high_frac": mean(p["clip_high"]), "cap_frac": mean(p["capped"]), "kl_mean": mean(p["kl"]),
             "repo_r_factor_mean": mean(p["factor"], w * p["nonzero_adv"], empty=1.0), "active_tokens": total_w}
    return out, {k: v.detach() for k, v in stats.items()}


# ---- nf4_linear --------------------------------------------------------------------------------
def check_nf4_linear_args(x, state, lora_a, lora_b, dora_m) -> None:
    """The argument errors of nf4_linear (the fused face raises the same ones through this)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"nf4_linear: x must be a torch.Tensor, got {type(x).__name__}")
    if len(getattr(state, "shape", ())) != 2:
        raise ValueError("nf4_linear: state must be the NF4State of a 2-D weight [out_features, in_features]")
    in_features = state.shape[1]
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(f"nf4_linear: x must have shape [..., {in_features}], got {tuple(x.shape)}")
    if (lora_a is None) != (lora_b is None):
        raise ValueError("nf4_linear: lora_a and lora_b must be given together")
    if dora_m is not None and lora_a is None:
        raise ValueError("nf4_linear: dora_m needs lora_a and lora_b")


def nf4_linear(x: torch.Tensor, qweight: torch.Tensor, state, lora_a: torch.Tensor | None = None,
               lora_b: torch.Tensor | None = None, scale: float = 1.0, dora_m: torch.Tensor | None = None,
               weight_sq_norm: torch.Tensor | None = None) -> torch.Tensor:
    """y = g ⊙ (x·Wᵀ + scale·(x·Aᵀ)·Bᵀ), g = dora_m / ‖W + scale·B·A‖_row (detached) or 1; in x.dtype.
    Computed in float32 (float64 for float64 x); `weight_sq_norm` is accepted and not needed."""
    check_nf4_linear_args(x, state, lora_a, lora_b, dora_m)
    ct = _acc(x.dtype)
    out_features, in_features = state.shape
    w = nf4_decode_weight(qweight, state, ct)
    xc = x.reshape(-1, in_features).to(ct)
    z = xc @ w.T
    if lora_a is not None:
        a, b = lora_a.to(ct), lora_b.to(ct)
        z = z + scale * ((xc @ a.T) @ b.T)
        if dora_m is not None:
            with torch.no_grad():
                norm = (w + scale * (b @ a)).norm(dim=1)
            z = z * (dora_m.to(ct) / norm)
    return z.to(x.dtype).view(*x.shape[:-1], out_features)


def nf4_dora_norm(qweight: torch.Tensor, state, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                  weight_sq_norm: torch.Tensor | None = None) -> torch.Tensor:
    """‖W + scale·B·A‖ per output row, formed explicitly (float64 when lora_a is float64, else float32)."""
    ct = _acc(lora_a.dtype)
    with torch.no_grad():
        w = nf4_decode_weight(qweight, state, ct)
        return (w + scale * (lora_b.to(ct) @ lora_a.to(ct))).norm(dim=1)


def nf4_weight_sq_norm(qweight: torch.Tensor, state) -> torch.Tensor:
    """‖W‖² per output row, summed in float64, returned in float32."""
    return nf4_decode_weight(qweight, state, torch.float64).square().sum(1).to(torch.float32)


# ---- gated delta rule and causal conv (the linear-attention layers of hybrid models) ------------
def _delta_inputs(q, k, v, g, beta, scale):
    """Expand q/k heads to the value heads (each q/k head serves Hv/Hk consecutive value heads) and
    cast everything to the accumulation dtype."""
    Hk, Hv = q.shape[2], v.shape[2]
    if Hv % Hk:
        raise ValueError(f"gated_delta_rule: value heads ({Hv}) must be a multiple of query/key heads ({Hk})")
    acc = _acc(q.dtype, k.dtype, v.dtype)
    if Hv != Hk:
        q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return (q.to(acc) * scale, k.to(acc), v.to(acc), g.to(acc), beta.to(acc), acc)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                     scale: float | None = None, initial_state: torch.Tensor | None = None,
                     chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one token at a time (its definition).

    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g (log decay, <= 0) and beta (write strength) [B, T, Hv];
    initial_state [B, Hv, Dk, Dv] or None (zeros). Per value head, with q scaled by `scale`
    (default Dk^-1/2):  S ← exp(g_t)·S;  S ← S + k_t ⊗ β_t(v_t − Sᵀk_t);  o_t = Sᵀq_t.
    Returns (o [B, T, Hv, Dv] in v's dtype, final state [B, Hv, Dk, Dv] in float32, float64 for
    float64 inputs). chunk_size is accepted for the face's signature and not used."""
    q, k, v, g, beta, acc = _delta_inputs(q, k, v, g, beta, scale)
    B, T, H, Dk = k.shape
    S = (torch.zeros(B, H, Dk, v.shape[-1], dtype=acc, device=v.device) if initial_state is None
         else initial_state.to(acc))
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        kt = k[:, t]                                                          # [B, H, Dk]
        delta = beta[:, t, :, None] * (v[:, t] - (S * kt[..., None]).sum(-2))  # [B, H, Dv]
        S = S + kt[..., None] * delta[..., None, :]
        outs.append((S * q[:, t, :, :, None]).sum(-2))
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape, dtype=acc)
    return o.to(v.dtype), S


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, *, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q, k [B, Hk, Dk], v [B, Hv, Dv], g/beta [B, Hv], state [B, Hv, Dk, Dv] ->
    (o [B, Hv, Dv], new state in the state's dtype)."""
    o, S = gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=scale,
                            initial_state=state)
    return o[:, 0], S.to(state.dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                  activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over time: x [B, T, C], weight [C, K], state [B, K-1, C] (the
    K-1 inputs before x; zeros when None). y_t = Σ_j weight[:, j]·x̃_{t+j} with x̃ = state ++ x, then
    SiLU when `activation`. Returns (y [B, T, C] in x's dtype, the new state [B, K-1, C]: the last
    K-1 rows of x̃). Computed in float32 (float64 for float64 x)."""
    B, T, C = x.shape
    K = weight.shape[1]
    if state is None:
        state = x.new_zeros(B, K - 1, C)
    acc = _acc(x.dtype, weight.dtype)
    xt = torch.cat([state.to(x.dtype), x], 1)                                  # [B, K-1+T, C]
    w = weight.to(acc)
    y = sum(xt[:, j:j + T].to(acc) * w[:, j] for j in range(K))
    if activation:
        y = torch.nn.functional.silu(y)
    return y.to(x.dtype), xt[:, T:]


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                       activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: x [B, C], state [B, K-1, C] -> (y [B, C], new state [B, K-1, C])."""
    y, s = causal_conv1d(x[:, None], weight, state, activation)
    return y[:, 0], s


# ---- moe_experts -------------------------------------------------------------------------------
def _expert_weights(stack, dtype: torch.dtype) -> torch.Tensor:
    """The whole stack [E, out, in] in dtype (each NF4 expert decoded from its own blocks)."""
    if stack.weight is not None:
        return stack.weight.to(dtype)
    return torch.stack([nf4_decode_weight(stack.qweight[e], stack.expert_state(e), dtype) for e in range(stack.E)])


expert_weights = _expert_weights   # the public name (the selftest's bound reads it)


def moe_experts(x: torch.Tensor, expert_index: torch.Tensor, routing_weights: torch.Tensor, gate_up, down,
                gate_up_lora=None, down_lora=None, scale: float = 1.0) -> torch.Tensor:
    """y_n = Σ_j w_nj · D_e(silu(G_e x_n) ⊙ U_e x_n), e = expert_index[n, j], each projection plus
    scale·B_e·A_e·(its input): every (token, slot) pair with its own gathered weights, in float32
    (float64 for float64 x), returned in x.dtype."""
    check_moe_args(x, expert_index, routing_weights, gate_up, down, gate_up_lora, down_lora)
    ct = _acc(x.dtype)
    idx = expert_index.long()
    xc = x.to(ct)

    def project(stack, lora, inp):              # inp [N, k, in] or [N, in] -> [N, k, out]
        w = _expert_weights(stack, ct)[idx]            # [N, k, out, in]
        y = torch.einsum("nkoi,nki->nko", w, inp) if inp.dim() == 3 else torch.einsum("nkoi,ni->nko", w, inp)
        if lora is not None:
            a, b = lora[0].to(ct)[idx], lora[1].to(ct)[idx]      # [N, k, r, in], [N, k, out, r]
            xa = torch.einsum("nkri,nki->nkr", a, inp) if inp.dim() == 3 else torch.einsum("nkri,ni->nkr", a, inp)
            y = y + scale * torch.einsum("nkor,nkr->nko", b, xa)
        return y

    g, u = project(gate_up, gate_up_lora, xc).chunk(2, dim=-1)
    o = project(down, down_lora, torch.nn.functional.silu(g) * u)   # [N, k, H]
    return (o * routing_weights.to(ct)[..., None]).sum(1).to(x.dtype)


# ---- decode attention ----------------------------------------------------------------------------

def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per row: q [B, kv, G, D] (the G query heads of each KV head), k, v [B, kv, S, D],
    key_valid [B, S] bool -> softmax(scale·q·kᵀ over the valid keys)·v [B, kv, G, D] in q's dtype,
    computed in float32 (float64 for float64); zeros for a row with no valid key."""
    acc = _acc(q.dtype)
    s = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale                        # [B, kv, G, S]
    mask = key_valid[:, None, None, :]
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ v.to(acc)).to(q.dtype)


# ---- decode_fused: a Llama-family decode step's elementwise work ---------------------------------
# The modules' own eager formulas (HF's LlamaRMSNorm, apply_rotary_pos_emb, SiLU and the product),
# rounded where they round; float64 inputs give the float64 values (the tests' oracle).
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, H], weight [H] -> weight · rnd(x / sqrt(mean(x²) + eps)), the mean in float32 (float64)."""
    acc = _acc(x.dtype)
    xf = x.to(acc)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x <- x + delta (in place), then rms_norm(x, weight, eps)."""
    x.add_(delta)
    return rms_norm(x, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_cache_write_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, column: int, n_heads: int, q_norm: torch.Tensor | None = None,
                        k_norm: torch.Tensor | None = None, norm_eps: float = 0.0) -> torch.Tensor:
    """qkv [B, (n_heads + 2 kv)·D], cos, sin [B, D]: the rotated k and v go to cache column `column` of
    k_cache, v_cache [B, kv, S, D]; returns the rotated q [B, kv, n_heads / kv, D]. q_norm, k_norm [D]:
    each q and k head through rms_norm with that weight first (Qwen3's per-head norms)."""
    B, kv, _, D = k_cache.shape
    q, k, v = qkv.view(B, -1, D).split([n_heads, kv, kv], dim=1)
    if q_norm is not None:
        q = rms_norm(q.reshape(-1, D), q_norm, norm_eps).view(B, n_heads, D)
        k = rms_norm(k.reshape(-1, D), k_norm, norm_eps).view(B, kv, D)
    c, s = cos[:, None], sin[:, None]
    k_cache[:, :, column] = k * c + _rotate_half(k) * s
    v_cache[:, :, column] = v
    return (q * c + _rotate_half(q) * s).reshape(B, kv, n_heads // kv, D)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate, then up) -> silu(gate) · up [N, I]."""
    g, u = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u
