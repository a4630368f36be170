"""The gated delta rule's chunked form in PyTorch, its backward written out: what
fasttrain.ops.gated_delta_rule runs for a sequence on CUDA without flash-linear-attention and on the
CPU when a gradient is wanted ("torch" in fasttrain.ops.gated_delta_backend). Shapes and the
definition as in fasttrain.ops.gated_delta; this module is called through that face.

The chunked form (the WY representation of DeltaNet, Yang et al. 2024, as flash-linear-attention
computes it). Within a chunk of C tokens let Γ_t = Σ_{s<=t} g_s (so e^{Γ_t − Γ_s} <= 1 for s <= t)
and write the state after token t as S_t = e^{Γ_t} S_0 + Σ_{s<=t} e^{Γ_t − Γ_s} k_s w_sᵀ. Putting
the recurrence in gives the lower-triangular system (I + L) W = βV − (β e^Γ K) S_0 with
L_{sr} = β_s e^{Γ_s − Γ_r} k_sᵀk_r (r < s), so W = U − Wk·S_0 with U = (I + L)⁻¹βV and
Wk = (I + L)⁻¹(β e^Γ K), both independent of S_0 (one batched triangular solve for all chunks).
Then O = (e^Γ Q) S_0 + (QKᵀ ⊙ e^{Γ_t − Γ_s})_{s<=t} W and S_C = e^{Γ_C} S_0 + (K ⊙ e^{Γ_C − Γ})ᵀ W:
the only sequential part is a loop over chunks carrying S. Every exponent is <= 0 (masked before
the exp), so nothing overflows. The sequence is padded to a multiple of C with g = β = 0 (the state
passes through unchanged). Computed in float32 for bf16/fp16/fp32 inputs, float64 for float64.
"""
from __future__ import annotations

import math

import torch

__all__ = ["chunked_rule", "accumulation_dtype", "decay_floor"]


def accumulation_dtype(*ts: torch.Tensor | None) -> torch.dtype:
    """float64 when any of the tensors is float64, else float32: the dtype the forms compute in."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def chunked_rule(q, k, v, g, beta, scale, initial_state, C: int):
    """The chunked form (this module's header): o in v's dtype and the final state in the accumulation
    dtype, its backward _ChunkedRule's (hand-written, not autograd's)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    acc = accumulation_dtype(q, k, v)
    scale = Dk ** -0.5 if scale is None else float(scale)
    if T == 0:                                                # nothing to run: the state passes through
        S0 = (torch.zeros(B, Hv, Dk, Dv, dtype=acc, device=q.device) if initial_state is None
              else initial_state.to(acc))
        return v.new_zeros(B, 0, Hv, Dv), S0
    return _ChunkedRule.apply(q, k, v, g, beta, initial_state, scale, int(C))


def _heads(x: torch.Tensor, Hv: int, C: int, acc: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, H(, D)] -> a new [B, Hv, N, C(, D)] in acc (into `out` when given): each of the H heads
    repeated for the Hv/H value heads it serves, time zero-padded to N·C. One tensor, no temporaries."""
    B, T, H = x.shape[:3]
    tail = tuple(x.shape[3:])
    N = -(-T // C)
    if out is None:
        out = x.new_empty((B, Hv, N, C) + tail, dtype=acc)
    flat = out.view((B, H, Hv // H, N * C) + tail)
    flat[:, :, :, :T].copy_(x.transpose(1, 2).unsqueeze(2))
    if N * C > T:
        flat[:, :, :, T:].zero_()
    return out


def _unheads(d: torch.Tensor, H: int, T: int, dtype: torch.dtype) -> torch.Tensor:
    """_heads' adjoint: [B, Hv, N, C(, D)] -> [B, T, H(, D)] contiguous in dtype, the value heads a
    q/k head served summed, the padding dropped."""
    Hv = d.shape[1]
    d = d.flatten(2, 3)[:, :, :T]
    if H != Hv:
        d = d.unflatten(1, (H, Hv // H)).sum(2)
    return d.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)


def _floor(dtype: torch.dtype) -> float:
    """The smallest exponent the chunked form takes e^x of: (ln(smallest normal) + 27) / 2 (-30.1 in
    float32, -340.7 in float64), so that a product of two such factors with one more factor down
    to e^-27 (~2e-12) stays a normal number. Subnormal operands slowed the form 2-4x on an x86 CPU
    in a hybrid's update (strong decays: Γ_t − Γ_s of a few hundred). An e^x below e^floor is
    replaced by e^floor: a change of at most e^floor (9e-14 in float32, 1e-148 in float64) times the
    magnitudes the tolerance derivation bounds, under a thousandth of one rounding of them (u =
    6e-8, 1.1e-16)."""
    return (math.log(torch.finfo(dtype).tiny) + 27.0) / 2


decay_floor = _floor   # the public name (the selftest's bound reads it)


def _exp(x: torch.Tensor) -> torch.Tensor:
    """e^x in place, x clamped below at _floor (x <= 0 here: the decays)."""
    return x.clamp_(min=_floor(x.dtype)).exp_()


def _decay(gam: torch.Tensor) -> torch.Tensor:
    """D [.., C, C]: e^{Γ_t − Γ_s} for s <= t (exponent clamped at _floor), 0 above the diagonal
    (masked before the exp)."""
    C = gam.shape[-1]
    upper = torch.ones(C, C, dtype=torch.bool, device=gam.device).triu_(1)
    return (gam[..., :, None] - gam[..., None, :]).clamp_(min=_floor(gam.dtype)).masked_fill_(
        upper, float("-inf")).exp_()


def _solved(K, D, Bt, eg, v, C: int, acc) -> tuple[torch.Tensor, torch.Tensor]:
    """(I + L) X = [βV | βe^Γ K] with L_ts = β_t e^{Γ_t − Γ_s} k_t·k_s (s < t): returns (X = [U | Wk]
    [.., C, Dv + Dk], the system). The system is (K Kᵀ ⊙ D) with row t scaled by β_t, its diagonal
    and upper part ignored (unitriangular, lower); X is solved in place of the right-hand side."""
    Hv, Dv = v.shape[2:]
    system = torch.matmul(K, K.mT).mul_(D).mul_(Bt[..., None])
    X = K.new_empty(K.shape[:-1] + (Dv + K.shape[-1],))
    _heads(v, Hv, C, acc, out=X[..., :Dv]).mul_(Bt[..., None])
    torch.mul(K, (Bt * eg)[..., None], out=X[..., Dv:])
    torch.linalg.solve_triangular(system, X, upper=False, unitriangular=True, out=X)
    return X, system


class _ChunkedRule(torch.autograd.Function):
    """The chunked form with its backward written out. What it keeps for the backward: q, k, g,
    beta as given, v contiguous in its own dtype and the state at the start of every chunk
    [B, Hv, N, Dk, Dv] in acc (the kernel's checkpoints at C tokens); the chunk-local tensors are
    computed again in the backward (bitwise as in the forward), the loop over chunks is run
    backwards from the kept states. Memory, per call of B rows and T tokens padded to N·C, in
    acc-sized elements with X_k = B·Hv·N·C·Dk, X_v = B·Hv·N·C·Dv, X_c = B·Hv·N·C·C, X_1 = B·Hv·N·C,
    s = B·Hv·Dk·Dv, c_v = X_v/N, c_k = X_k/N, c_c = X_c/N (fasttrain.plan.hybrid_memory counts these):
      forward: largest of (a) at the intra-chunk scores: K, Q, X, D, attn, Γ, e^Γ
        = 3·X_k + X_v + 2·X_c + 2·X_1; (b) in the loop: e^Γ·Q, e^{Γ_C−Γ}·K, X, attn, e^Γ, o [B, T,
        Hv, Dv], the kept states (with a gradient) and the chunk's W, o_n and a product, or W, S and
        two state-sized products = 3·X_k + X_v + X_c + X_1 + o + N·s + s_old + max(3·c_v, c_v + 2·s)
        (s_old: the running state, the caller's own in the first chunk when it passes one);
      kept for the backward: N·s (plus v's contiguous copy when v is a strided view);
      backward: largest of (a) in the loop: e^Γ·Q, e^{Γ_C−Γ}·K, X, D, the system, attn, e^Γ,
        e^{Γ_C−Γ}, β, and the gradients of X, attn, e^Γ·Q, e^{Γ_C−Γ}·K, with the chunk's W, dO, dW
        and one product, or those and three state-sized ones = 6·X_k + 2·X_v + 4·X_c + 3·X_1 + s +
        3·c_v + max(c_v, c_c, c_k, 2·s); (b) at the scores' gradient: dQ, dK, Q, K, X, dX, D, the
        system, d attn, Q Kᵀ and dD = 6·X_k + 2·X_v + 5·X_c + 3·X_1; the kept states throughout."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, s0, scale, C):
        save = any(ctx.needs_input_grad[:6])
        acc = accumulation_dtype(q, k, v)
        o, S, ckpt = _chunked_forward(q, k, v, g, beta, s0, scale, C, acc, save)
        if save:
            ctx.save_for_backward(q, k, v.contiguous(), g, beta, ckpt)
            ctx.meta = (scale, C, acc, None if s0 is None else s0.dtype)
        return o, S

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dS):
        q, k, v, g, beta, ckpt = ctx.saved_tensors
        scale, C, acc, s0_dtype = ctx.meta
        dq, dk, dv, dg, db, ds0 = _chunked_backward(do, dS, q, k, v, g, beta, ckpt, scale, C, acc)
        return dq, dk, dv, dg, db, (None if s0_dtype is None else ds0.to(s0_dtype)), None, None


def _chunked_forward(q, k, v, g, beta, s0, scale: float, C: int, acc, save: bool):
    """(o in v's dtype, the final state, the state at the start of every chunk when `save`)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    N = -(-T // C)
    K = _heads(k, Hv, C, acc)                                 # [B, Hv, N, C, Dk]
    gam = _heads(g, Hv, C, acc).cumsum_(-1)                   # Γ within each chunk
    D = _decay(gam)
    eg = _exp(gam.clone())
    Bt = _heads(beta, Hv, C, acc)
    X, system = _solved(K, D, Bt, eg, v, C, acc)
    del system, Bt
    Q = _heads(q, Hv, C, acc).mul_(scale)
    attn = torch.matmul(Q, K.mT).mul_(D)                      # (Q Kᵀ ⊙ D): s <= t
    del D
    Qd = Q.mul_(eg[..., None])                                # e^Γ Q (Q itself, scaled in place)
    Kd = K.mul_(_exp(gam[..., -1:] - gam)[..., None])         # e^{Γ_C − Γ} K
    del Q, K, gam
    U, Wk = X[..., :Dv], X[..., Dv:]
    S = q.new_zeros(B, Hv, Dk, Dv, dtype=acc) if s0 is None else s0.to(acc)
    ckpt = q.new_empty(B, Hv, N, Dk, Dv, dtype=acc) if save else None
    o = q.new_empty(B, T, Hv, Dv, dtype=acc)
    for n in range(N):
        if ckpt is not None:
            ckpt[:, :, n] = S
        W = torch.matmul(Wk[:, :, n], S).neg_().add_(U[:, :, n])             # U − Wk S  [B, Hv, C, Dv]
        on = torch.matmul(Qd[:, :, n], S).add_(torch.matmul(attn[:, :, n], W))
        t0, t1 = n * C, min(T, n * C + C)
        o[:, t0:t1] = on[:, :, :t1 - t0].transpose(1, 2)
        del on
        S = torch.matmul(Kd[:, :, n].mT, W).add_(S * eg[:, :, n, -1, None, None])
    del X, U, Wk, attn, Qd, Kd, eg, W
    return o.to(v.dtype), S, ckpt


def _chunked_backward(do, dS, q, k, v, g, beta, ckpt, scale: float, C: int, acc):
    """The gradients of q, k, v, g, beta (in their dtypes) and of the initial state (acc) from those
    of o and of the final state. Derivation (per chunk; Q scaled, Γ = cumsum g, D_ts = e^{Γt−Γs}):
      loop, last chunk first, S = S_n kept, W = U − Wk S, S' = e^{Γ_C} S + Kdᵀ W, o = Qd S + attn W:
        dW = attnᵀ dO + Kd dS'; d attn = dO Wᵀ; dQd = dO Sᵀ; dKd = W dS'ᵀ; d e^{Γ_C} = ⟨dS', S⟩;
        dU = dW; dWk = −dW Sᵀ; dS = e^{Γ_C} dS' + Qdᵀ dO − Wkᵀ dW;
      within chunks: Qd = Q e^Γ: dQ = dQd e^Γ, dΓ += Σ_d dQd·Qd; Kd = K e^{Γ_C−Γ}: dK = dKd e^{Γ_C−Γ},
        c = Σ_d dKd·Kd, dΓ −= c, dΓ_C += Σ_t c (and += d e^{Γ_C}·e^{Γ_C});
        attn = QKᵀ ⊙ D: dQK = d attn ⊙ D, dD += d attn ⊙ QKᵀ, dQ += dQK K, dK += dQKᵀ Q;
        X = (I + L)⁻¹ R: dR = (I + L)⁻ᵀ dX, dL = −strictly_lower(dR Xᵀ);
        L = β_row ⊙ KKᵀ ⊙ D: dβ_t += Σ_s dL_ts (KKᵀ ⊙ D)_ts, dKK = β_row dL ⊙ D,
        dD += β_row dL ⊙ KKᵀ, dK += (dKK + dKKᵀ) K; R = [βV | βe^Γ K]: dV = β dR_v,
        dβ += Σ_d dR_v·V, dK += βe^Γ dR_k, with b = Σ_d dR_k·K: dβ += b e^Γ, dΓ += b β e^Γ;
        D = e^{Γt−Γs}: with E = dD ⊙ D, dΓ += Σ_s E_ts − Σ_t E_st; dΓ_{C} to the chunk's last place;
        Γ = cumsum g: dg = the reverse cumulative sum of dΓ (padding: g = β = q = k = v = 0 there)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    N = ckpt.shape[2]
    K = _heads(k, Hv, C, acc)
    gam = _heads(g, Hv, C, acc).cumsum_(-1)
    D = _decay(gam)
    eg = _exp(gam.clone())
    e2 = _exp(gam[..., -1:] - gam)
    del gam
    Bt = _heads(beta, Hv, C, acc)
    X, system = _solved(K, D, Bt, eg, v, C, acc)
    Q = _heads(q, Hv, C, acc).mul_(scale)
    attn = torch.matmul(Q, K.mT).mul_(D)
    Qd, Kd = Q.mul_(eg[..., None]), K.mul_(e2[..., None])
    del Q, K
    U, Wk = X[..., :Dv], X[..., Dv:]
    dX = torch.empty_like(X)
    dU, dWk = dX[..., :Dv], dX[..., Dv:]
    dattn, dQd, dKd = torch.empty_like(attn), torch.empty_like(Qd), torch.empty_like(Kd)
    dlast = eg.new_empty(B, Hv, N)
    dS = dS.to(acc)
    for n in reversed(range(N)):
        S = ckpt[:, :, n]
        W = torch.matmul(Wk[:, :, n], S).neg_().add_(U[:, :, n])
        t0, t1 = n * C, min(T, n * C + C)
        dO = eg.new_zeros(B, Hv, C, Dv)
        dO[:, :, :t1 - t0] = do[:, t0:t1].transpose(1, 2)
        dW = torch.matmul(attn[:, :, n].mT, dO).add_(torch.matmul(Kd[:, :, n], dS))
        dattn[:, :, n] = torch.matmul(dO, W.mT)
        dQd[:, :, n] = torch.matmul(dO, S.mT)
        dKd[:, :, n] = torch.matmul(W, dS.mT)
        dlast[:, :, n] = (dS * S).sum((-2, -1))
        dU[:, :, n] = dW
        dWk[:, :, n] = torch.matmul(dW, S.mT).neg_()
        dS = torch.matmul(Qd[:, :, n].mT, dO).sub_(torch.matmul(Wk[:, :, n].mT, dW)).add_(
            dS * eg[:, :, n, -1, None, None])
        del W, dO, dW
    del attn, S
    dgam = (dQd * Qd).sum(-1)
    dQ = dQd.mul_(eg[..., None])
    del dQd, Qd
    c = (dKd * Kd).sum(-1)
    dK = dKd.mul_(e2[..., None])
    del dKd, Kd, e2
    dgam.sub_(c)
    dgamC = c.sum(-1).add_(dlast * eg[..., -1])
    del c, dlast
    Q = _heads(q, Hv, C, acc).mul_(scale)
    K = _heads(k, Hv, C, acc)
    QK = torch.matmul(Q, K.mT)
    dD = dattn * QK
    del QK
    dQK = dattn.mul_(D)
    del dattn
    dQ.add_(torch.matmul(dQK, K))
    dK.add_(torch.matmul(dQK.mT, Q))
    del dQK, Q
    torch.linalg.solve_triangular(system.mT, dX, upper=True, unitriangular=True, out=dX)   # dR, in place
    dL = torch.matmul(dX, X.mT).neg_().tril_(-1)
    del system, X, U, Wk, dU, dWk
    KK = torch.matmul(K, K.mT)
    dBt = (dL * KK).mul_(D).sum(-1)
    dKD = dL.mul_(Bt[..., None])
    del dL
    dD.add_(dKD * KK)
    dKK = dKD.mul_(D)
    del dKD
    dK.add_(torch.matmul(dKK, K)).add_(torch.matmul(dKK.mT, K))
    del dKK, KK
    dRv, dRk = dX[..., :Dv], dX[..., Dv:]
    V = _heads(v, Hv, C, acc)
    dBt.add_((dRv * V).sum(-1))
    del V
    be = Bt * eg
    b = (dRk * K).sum(-1)
    dK.add_(dRk * be[..., None])
    del K
    dBt.add_(b * eg)
    dgam.add_(b.mul_(be))
    del b, be, dRk
    dV = dRv.mul_(Bt[..., None])
    E = dD.mul_(D)
    del dD, D
    dgam.add_(E.sum(-1)).sub_(E.sum(-2))
    del E
    dgam[..., -1].add_(dgamC)
    dG = dgam.flip(-1).cumsum(-1).flip(-1)
    del dgam
    return (_unheads(dQ.mul_(scale), Hk, T, q.dtype), _unheads(dK, Hk, T, k.dtype), _unheads(dV, Hv, T, v.dtype),
            _unheads(dG, Hv, T, g.dtype), _unheads(dBt, Hv, T, beta.dtype), dS)
