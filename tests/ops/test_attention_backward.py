"""fasttrain.ops.masked_attention's CPU backward (csrc/cpu/attention_backward.cpp's softmax step
between batched GEMMs) against float64 definitions, with bounds derived from unit roundoff and the
sizes of the sums; the path is shown to be taken, and torch's SDPA backward where it does not apply.

Bounds (u = 2^-24 for float32, u_b = 2^-8 for bfloat16; γ_n = n·u/(1 − n·u)):
  the softmax step on float32 inputs s, dp: z = fl(scale·s) errs by |z|·u; e = exp(z − max) by
  (|z| + |max|)·u + 2u relative (the shift, Sleef's exp at 1 ulp); the sum of L terms by γ_L, the
  reciprocal and the product by 2u: so P_j errs by at most ρ·P_j, ρ = (2·max|z| + L + 8)·u.
  Σ P·dP errs by (ρ + γ_L)·Σ P|dP|; dS_j = scale·P_j·(dp_j − Σ P·dP) by
  scale·P_j·((ρ + 3u)·|dp_j − Σ P·dP| + (ρ + γ_L)·Σ P|dP|); each written value then by one rounding
  to the output dtype (u_out·|value|).
  The autograd test takes the gradients' bounds from fasttrain.selftest.attention_grad_bounds (the
  selftest checks the same op on the device at hand): what feeds the step, S = q·kᵀ and dP = dO·vᵀ
  as float32 sums of D exact products, the step's bound above, and the GEMMs after it, dV = P̃ᵀ·dO,
  dQ = dS̃·k, dK = dS̃ᵀ·q with P̃, dS̃ rounded to q's dtype, float32 sums and the rounded result.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import fasttrain.ops as ops
import fasttrain.ops.attention as A
from fasttrain.selftest import bounds
from fasttrain.selftest.bounds import attention_grad_bounds

U32 = bounds.U[torch.float32]
UB = bounds.U[torch.bfloat16]


def gamma(n: int, u: float = U32) -> float:
    return bounds.gamma(n, u)


def _mask(n, M, L, seed, shape="full"):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(n, 1, M, L, generator=g) < 0.6
    m[..., 0] = True                                  # every query row may attend somewhere
    if shape == "shared":
        m = m[:1]
    return m


def _ref_softmax(s, dp, mask, scale):
    """float64 P, Σ P·dP, dS of the step's definition."""
    z = (s.double() * scale)
    if mask is not None:
        z = z.masked_fill(~mask.expand_as(z), float("-inf"))
    p = torch.softmax(z, -1)
    p = torch.nan_to_num(p, nan=0.0)                  # a row with no allowed key: zeros
    dot = (p * dp.double()).sum(-1, keepdim=True)
    return p, dot, scale * p * (dp.double() - dot), z


def _step_bounds(dp, p, dot, z, scale, L):
    zf = torch.where(torch.isfinite(z), z, torch.zeros_like(z)).abs()
    zmax = zf.amax(-1, keepdim=True)
    rho = (2 * zmax + L + 8) * U32
    spd = (p * dp.double().abs()).sum(-1, keepdim=True)
    bp = rho * p
    bds = scale * p * ((rho + 3 * U32) * (dp.double() - dot).abs() + (rho + gamma(L)) * spd)
    return bp, bds


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["full", "shared", "none"])
def test_softmax_step_matches_the_float64_definition(out_dtype, mask_kind):
    torch.manual_seed(0)
    n, h, M, L = 3, 2, 17, 41
    s = torch.randn(n, h, M, L) * 4
    dp = torch.randn(n, h, M, L)
    mask = None if mask_kind == "none" else _mask(n, M, L, 1, mask_kind)
    scale = 0.3
    p, ds = torch.ops.fasttrain.attention_softmax_grad(s, dp, mask, scale, out_dtype)
    assert p.dtype == out_dtype and ds.dtype == out_dtype
    rp, dot, rds, z = _ref_softmax(s, dp, mask, scale)
    bp, bds = _step_bounds(dp, rp, dot, z, scale, L)
    u_out = UB if out_dtype == torch.bfloat16 else U32
    for got, ref, b in ((p, rp, bp), (ds, rds, bds)):
        bound = b * (1 + u_out) + u_out * ref.abs() + 1e-300
        err = (got.double() - ref).abs()
        assert (err <= bound).all(), (err - bound).max()
    if mask is not None:
        assert (p.double()[~mask.expand_as(p)] == 0).all()


def test_rows_without_keys_give_zeros_threads_give_the_same_bits_and_bad_inputs_are_named():
    torch.manual_seed(1)
    s, dp = torch.randn(2, 3, 40, 70), torch.randn(2, 3, 40, 70)
    mask = torch.rand(2, 1, 40, 70) < 0.5
    mask[0, 0, 5] = False                             # row 5 of batch 0: no allowed key
    op = torch.ops.fasttrain.attention_softmax_grad
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(s, dp, mask, 0.2, torch.bfloat16)
        torch.set_num_threads(2)
        two = op(s, dp, mask, 0.2, torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    assert (one[0][0, :, 5] == 0).all() and (one[1][0, :, 5] == 0).all()
    with pytest.raises(RuntimeError, match="argument 'dp'"):
        op(s, dp[..., :10].contiguous(), mask, 0.2, torch.bfloat16)
    with pytest.raises(RuntimeError, match="argument 's'"):
        op(s.double(), dp, mask, 0.2, torch.bfloat16)
    with pytest.raises(RuntimeError, match="argument 'mask'"):
        op(s, dp, mask.float(), 0.2, torch.bfloat16)
    with pytest.raises(RuntimeError, match="argument 'mask'"):
        op(s, dp, mask[..., :7], 0.2, torch.bfloat16)
    with pytest.raises(RuntimeError, match="out_dtype"):
        op(s, dp, mask, 0.2, torch.float64)


@pytest.fixture
def forced():
    """fasttrain's backward wherever it can run (on hosts without native bf16 "auto" keeps torch's)."""
    old = ops.set_attention_backward("fasttrain")
    yield
    ops.set_attention_backward(old)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mask_kind,chunked", [("full", False), ("shared", True), ("none", False), ("full", True)])
def test_gradients_match_float64_within_derived_bounds(dtype, mask_kind, chunked, monkeypatch, forced):
    torch.manual_seed(2)
    n, h, M, L, D = 4, 3, 19, 45, 16
    q, k, v = (torch.randn(n, h, r, D).to(dtype).requires_grad_() for r in (M, L, L))
    do = torch.randn(n, h, M, D).to(dtype)
    mask = None if mask_kind == "none" else _mask(n, M, L, 3, mask_kind)
    if chunked:                                          # one row a chunk: the loop over chunks
        monkeypatch.setattr(A, "SCORE_BYTES", h * M * L * 4)
    scale = D ** -0.5
    assert ops.attention_backward_kind(q, k) == "fasttrain"
    o = ops.masked_attention(q, k, v, mask, scale)
    assert type(o.grad_fn).__name__ == "_MaskedAttentionBackward"
    o.backward(do)
    for got, (ref, bound) in zip((q.grad, k.grad, v.grad), attention_grad_bounds(q, k, v, do, mask, scale)):
        err = (got.double() - ref).abs()
        assert (err <= bound).all(), (err - bound).max()


def test_where_it_applies_and_where_the_call_is_sdpa():
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    k = torch.randn(1, 2, 7, 8, requires_grad=True)
    qb, kb = q.detach().bfloat16(), k.detach().bfloat16()
    native = A._native_bf16()
    if not os.environ.get("FASTTRAIN_ATTENTION_BACKWARD"):                # the default: "auto"
        assert ops.attention_backward_kind(qb, kb) == ("fasttrain" if native else "sdpa")
    old = ops.set_attention_backward("auto")
    try:
        assert ops.attention_backward_kind(q, k) == "sdpa"                  # "auto", float32: ATen's was faster
        assert ops.attention_backward_kind(qb, kb) == ("fasttrain" if native else "sdpa")
        wide = torch.empty(1, 2, 5, A.AUTO_MAX_HEAD_DIM * 2, dtype=torch.bfloat16)
        assert ops.attention_backward_kind(wide, wide) == "sdpa"            # "auto": wider heads keep torch's
        ops.set_attention_backward("fasttrain")
        assert ops.attention_backward_kind(q, k) == "fasttrain"
        assert ops.attention_backward_kind(qb, kb) == "fasttrain"
        assert ops.attention_backward_kind(q.double(), k.double()) == "sdpa"
        assert ops.attention_backward_kind(qb, kb[:, :1]) == "sdpa"          # grouped heads not folded
        assert ops.attention_backward_kind(torch.empty(1, 2, 2048, 8), torch.empty(1, 2, 2048, 8)) == "sdpa"
        o = ops.masked_attention(qb.requires_grad_(), kb, kb, None, 0.3)
        assert type(o.grad_fn).__name__ == "_MaskedAttentionBackward"
        ops.set_attention_backward("flash")
        assert ops.attention_backward_kind(qb, kb) == "sdpa"
        assert type(ops.masked_attention(qb, kb, kb, None, 0.3).grad_fn).__name__ != "_MaskedAttentionBackward"
    finally:
        ops.set_attention_backward(old)
    with torch.no_grad():                                                    # no gradient: plain SDPA
        assert torch.equal(ops.masked_attention(qb, kb, kb, None, 0.3),
                           F.scaled_dot_product_attention(qb, kb, kb, scale=0.3))
    old = ops.set_attention_backward("fasttrain")
    try:                                       # calls not of its form are SDPA's as given
        float_mask = torch.zeros(1, 1, 5, 7, dtype=torch.bfloat16)
        o = ops.masked_attention(qb, kb, kb, float_mask, 0.3)
        assert type(o.grad_fn).__name__ != "_MaskedAttentionBackward"
        vb = torch.randn(1, 2, 7, 4).bfloat16()                              # values narrower than keys
        o = ops.masked_attention(qb, kb, vb, None, 0.3)
        assert o.shape == (1, 2, 5, 4) and type(o.grad_fn).__name__ != "_MaskedAttentionBackward"
    finally:
        ops.set_attention_backward(old)
    with pytest.raises(ValueError, match="kind must be"):
        ops.set_attention_backward("fast")


@pytest.mark.parametrize("n,h,M,L,D,dtype,chunk_rows", [
    (4, 3, 19, 45, 16, torch.bfloat16, None), (4, 3, 19, 45, 16, torch.float32, None),
    (5, 2, 64, 96, 32, torch.bfloat16, 2), (2, 2, 8, 300, 64, torch.bfloat16, None)])
def test_backward_workspace_is_what_the_backward_allocates(n, h, M, L, D, dtype, chunk_rows, monkeypatch):
    """backward_workspace (what fasttrain.plan counts at a layer's attention backward) against the
    peak of the bytes the backward allocates, read from the allocator's events: within 5%, and the
    dq, dk, dv on top."""
    from torch.profiler import ProfilerActivity, profile
    if chunk_rows:
        monkeypatch.setattr(A, "SCORE_BYTES", chunk_rows * h * M * L * 4)
    torch.manual_seed(0)
    q, k, v = (torch.randn(n, h, r, D).to(dtype) for r in (M, L, L))
    do = torch.randn(n, h, M, D).to(dtype)
    mask = _mask(n, M, L, 3, "full")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        A._backward(do, q, k, v, mask, 0.25)
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    outs = n * h * (M + 2 * L) * D * dtype.itemsize
    want = outs + A.backward_workspace(n, h, M, L, D, dtype.itemsize)
    assert abs(peak - want) <= 0.05 * want, (peak, want)
