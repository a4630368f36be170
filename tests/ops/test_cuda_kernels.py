"""CUDA kernels against float64 references, with bounds derived from each path's roundings.

Every test here needs a GPU (skipped without one). The CPU-side twins of the shared logic are in
test_shared_math.py. Notation: u_op is the unit roundoff of the operand a kernel rounds to before a
product (2^-8 bf16, 2^-11 fp16, 2^-24 fp32), u32 = 2^-24 the float32 accumulators'; "magnitude"
tensors are the same formula evaluated on absolute values in float64, the scale a rounding error is
a fraction of.
"""
from __future__ import annotations

import math

import pytest
import torch

import fasttrain.ops as fo
from fasttrain.ops import logprob as lp_mod
from fasttrain.ops.nf4_linear import nf4_dora_norm, nf4_linear, nf4_weight_sq_norm

pytestmark = pytest.mark.cuda
OP = torch.ops.fasttrain
U32 = 2.0**-24
U_OP = {torch.float32: 2.0**-24, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-8}  # p~ and D operands
U_OUT = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # dh, dW in the inputs' dtype
TINY = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}  # subnormal spacing


class chunk_budget:
    def __init__(self, nbytes):
        self.nbytes = nbytes

    def __enter__(self):
        lp_mod.set_chunk_bytes(self.nbytes)

    def __exit__(self, *exc):
        lp_mod.set_chunk_bytes(0)


def logprob_case(N, H, V, dtype, scale=3.0, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, H, generator=g, dtype=torch.float64) * scale).to(dtype)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5).to(dtype)
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype) if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    return h, w, t, b


def float64_reference(h, w, t, b, T, up, ignore_index=-100):
    """Values, gradients and the magnitudes of the sums behind them, from the full logits in float64."""
    h, w = h.double().requires_grad_(), w.double().requires_grad_()
    b = b.double().requires_grad_() if b is not None else None
    z = h @ w.T + (b if b is not None else 0)
    ls = torch.log_softmax(z / T, dim=-1)
    keep = t != ignore_index
    logp = torch.where(keep, ls.gather(1, t.clamp(min=0)[:, None]).squeeze(1), torch.zeros((), dtype=ls.dtype))
    p = ls.exp()
    ent = torch.where(keep, torch.where(p > 0, -p * ls, torch.zeros_like(p)).sum(1), torch.zeros((), dtype=ls.dtype))
    (logp * up).sum().backward()
    with torch.no_grad():
        onehot = torch.nn.functional.one_hot(t.clamp(min=0), w.shape[0]).double()
        D = (up * keep)[:, None] * (onehot - p) / T  # d loss / d logits (before T)
        mag = dict(
            z=(h.abs() @ w.abs().T + (b.abs() if b is not None else 0)) / T,
            dh=(up.abs() * keep)[:, None] * (p @ w.abs() + w.abs()[t.clamp(min=0)]) / T,
            dw=D.abs().T @ h.abs(),
        )
    return dict(logp=logp.detach(), ent=ent.detach(), dh=h.grad, dw=w.grad,
                db=None if b is None else b.grad), mag


def check_logprob(ours, ref, mag, dtype, H, V):
    u_op, u_out = U_OP[dtype], U_OUT[dtype]
    zmax = mag["z"].max().item()
    # log p and entropy: float32 logits (H-term sums) then V-term sums of exp: relative to max|z| + 1
    tol_lp = 4 * (H + V) * U32 * (zmax + 1)
    assert (ours["logp"] - ref["logp"]).abs().max().item() <= tol_lp
    assert (ours["ent"] - ref["ent"]).abs().max().item() <= tol_lp
    # dh: p~ rounded to the operand type, V-term float32 sums; the output is float32 then cast
    tol_dh = (2 * u_op + 4 * (V + H) * U32 * (zmax + 1)) * mag["dh"] + u_out * ref["dh"].abs() + TINY[dtype]
    assert ((ours["dh"] - ref["dh"]).abs() <= tol_dh).all()
    # dW: D rounded to the operand type, N-term float32 sums, one rounding to the weight's dtype
    N = ref["logp"].numel()
    tol_dw = (2 * u_op + 4 * (N + H) * U32 * (zmax + 1)) * mag["dw"] + u_out * ref["dw"].abs() + TINY[dtype]
    assert ((ours["dw"] - ref["dw"]).abs() <= tol_dw).all()


def run_cuda(h, w, t, b, T, up):
    hc, wc = h.cuda().requires_grad_(), w.cuda().requires_grad_()
    bc = b.cuda().requires_grad_() if b is not None else None
    logp, ent = fo.fused_logprob(hc, wc, t.cuda(), temperature=T, bias=bc)
    (logp.double() * up.cuda()).sum().backward()
    return dict(logp=logp.detach().cpu().double(), ent=ent.cpu().double(), dh=hc.grad.cpu().double(),
                dw=wc.grad.cpu().double(), db=None if bc is None else bc.grad.cpu().double())


# ---- fused_logprob ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logprob_several_token_blocks_and_chunks(dtype):
    """64 KiB of scratch with N = 300: the chunk would fall under 256 rows, so the kernel keeps
    C = 256 and cuts tokens into blocks of 65536 / (256 (4 + operand bytes)) = 32 or 42 rows:
    8-10 token blocks (the n0 > 0 path) x 20 vocabulary chunks."""
    N, H, V = 300, 96, 5003
    h, w, t, b = logprob_case(N, H, V, dtype)
    t[7] = -100
    up = torch.randn(N, dtype=torch.float64)
    with chunk_budget(1 << 16):
        ours = run_cuda(h, w, t, b, 0.9, up)
    ref, mag = float64_reference(h, w, t, b, 0.9, up)
    check_logprob(ours, ref, mag, dtype, H, V)
    assert ours["logp"][7] == 0 and (ours["dh"][7] == 0).all()
    # one token block with the default budget gives the same values to float32 rounding
    ours1 = run_cuda(h, w, t, b, 0.9, up)
    check_logprob(ours1, ref, mag, dtype, H, V)


def test_logprob_fp16_weight_gradient_keeps_tiny_dlogits():
    """Per-token gradients of 1e-4 times probabilities near 1/V give dlogits near 2e-8, below fp16's
    smallest subnormal half-way point (3e-8): stored in fp16 they vanish and every non-target row of
    dW comes out 0. Kept in float32, dW matches the float64 reference and the CPU op."""
    N, H, V = 512, 64, 4099
    g = torch.Generator().manual_seed(3)
    h = (torch.randn(N, H, generator=g, dtype=torch.float64) + 4).half()  # one sign: the sums add up
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) / H).half()
    t = torch.randint(0, V // 2, (N,), generator=g)  # rows >= V/2 are never a target
    up = torch.full((N,), 1e-4, dtype=torch.float64)
    ours = run_cuda(h, w, t, None, 1.0, up)
    ref, mag = float64_reference(h, w, t, None, 1.0, up)
    check_logprob(ours, ref, mag, torch.float16, H, V)
    assert (ours["dw"][V // 2:] != 0).float().mean() > 0.99
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, _ = fo.fused_logprob(hc, wc, t)
    (logp.double() * up).sum().backward()
    cpu_dw = wc.grad.double()
    tol = 2 * ((2 * U32 + 4 * (N + H) * U32) * mag["dw"] + 2.0**-11 * ref["dw"].abs() + TINY[torch.float16])
    assert ((ours["dw"] - cpu_dw).abs() <= tol).all()


def test_logprob_out_of_range_targets_raise_like_the_cpu():
    h, w, _, _ = logprob_case(6, 8, 11, torch.float32)
    for bad, pos in ((11, 2), (-1, 4)):
        t = torch.tensor([0, 1, 2, 3, 4, 5])
        t[pos] = bad
        with pytest.raises(RuntimeError) as cpu_err:
            fo.fused_logprob(h, w, t)
        with pytest.raises(RuntimeError) as cuda_err:
            fo.fused_logprob(h.cuda(), w.cuda(), t.cuda())
        msg = f"'targets' holds {bad} at position {pos}, outside [0, 11) and not ignore_index (-100)"
        assert msg in str(cpu_err.value) and msg in str(cuda_err.value)
    t = torch.tensor([0, 1, -100, 3, 4, 5]).cuda()
    logp, _ = fo.fused_logprob(h.cuda(), w.cuda(), t)  # ignore_index is not out of range
    assert torch.isfinite(logp).all() and logp[2] == 0
    _, _, stats, _ = OP.fused_logprob_forward(h.cuda(), w.cuda(), t, None, 1.0, -100, False, 0)
    with pytest.raises(RuntimeError, match="fused_logprob_backward_weight: argument 'targets' holds 99 at position 0"):
        OP.fused_logprob_backward_weight(torch.ones(6).cuda(), h.cuda(), w.cuda(),
                                         torch.tensor([99, 1, 2, 3, 4, 5]).cuda(), None, stats, 1.0, -100, 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_logprob_chunk_of_minus_inf_gives_no_nan(dtype):
    """Bias -inf over the first 256 vocabulary rows (the first CUDA chunk at a 16 KiB budget) and on
    single rows later: finite values equal to the float64 reference (CPU twin in test_shared_math)."""
    N, H, V = 9, 12, 700
    h, w, t, b = logprob_case(N, H, V, torch.float64)
    b[:256] = -math.inf
    b[[300, 512, 699]] = -math.inf
    t = torch.randint(256, 699, (N,))
    t[t == 300] = 301
    t[t == 512] = 513
    h, w, b = h.to(dtype), w.to(dtype), b.to(dtype)
    up = torch.linspace(-1, 1, N, dtype=torch.float64)
    with chunk_budget(1 << 14):
        ours = run_cuda(h, w, t, b, 0.8, up)
    ref, _ = float64_reference(h, w, t, b, 0.8, up)
    tol = 4 * (V + H) * (2.0**-53 if dtype == torch.float64 else U32)
    for k in ("logp", "ent", "dh", "dw", "db"):
        assert torch.isfinite(ours[k]).all(), k
        assert (ours[k] - ref[k]).abs().max().item() <= tol * max(1.0, ref[k].abs().max().item()), k


def test_logprob_hidden_size_zero_like_the_cpu():
    N, V = 5, 7
    t = torch.tensor([0, 6, 3, -100, 3])
    b = torch.randn(V, dtype=torch.float64)
    for bias in (None, b):
        outs = []
        for dev in ("cpu", "cuda"):
            h = torch.zeros(N, 0, dtype=torch.float64, device=dev, requires_grad=True)
            w = torch.zeros(V, 0, dtype=torch.float64, device=dev, requires_grad=True)
            bb = None if bias is None else bias.to(dev).requires_grad_()
            logp, ent = fo.fused_logprob(h, w, t.to(dev), bias=bb)
            logp.sum().backward()
            outs.append((logp.cpu(), ent.cpu(), h.grad.shape, w.grad.shape, None if bb is None else bb.grad.cpu()))
        (lc, ec, hs, ws, bc), (lg, eg, hs2, ws2, bg) = outs
        assert torch.allclose(lc, lg, atol=1e-14, rtol=0) and torch.allclose(ec, eg, atol=1e-14, rtol=0)
        assert hs == hs2 == (N, 0) and ws == ws2 == (V, 0)
        if bias is None:
            assert torch.allclose(lg[t != -100], torch.full((4,), -math.log(V), dtype=torch.float64), atol=1e-15)
        else:
            assert torch.allclose(bc, bg, atol=1e-14, rtol=0)


def test_logprob_no_grad_pass_needs_no_probability_buffer():
    """compute_grad=False gives the same log p and entropy as the gradient pass (p~ is not written)."""
    h, w, t, b = logprob_case(64, 32, 1000, torch.bfloat16)
    hc, wc, bc, tc = h.cuda(), w.cuda(), b.cuda(), t.cuda()
    a = OP.fused_logprob_forward(hc, wc, tc, bc, 1.0, -100, False, 1 << 16)
    g = OP.fused_logprob_forward(hc, wc, tc, bc, 1.0, -100, True, 1 << 16)
    assert a[3].shape == (0, 32) and g[3].shape == (64, 32)
    assert torch.equal(a[0], g[0]) and torch.equal(a[1], g[1])


# ---- nf4_linear ---------------------------------------------------------------------------------------
def nf4_case(N, K, r, seed=0, dora=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    q, st = fo.nf4_quantize(w)
    a = torch.randn(r, K, generator=g) / 20
    b = torch.randn(N, r, generator=g) / 20
    m = torch.rand(N, generator=g) + 0.5 if dora else None
    return q, st, a, b, m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [7, 65])
def test_nf4_linear_backward_matches_float64(M, dtype):
    """dx, dA, dB and dm (DoRA) against float64 autograd of y = g ⊙ (x Wᵀ + s x Aᵀ Bᵀ), g detached.
    CUDA rounds dz = dy ⊙ g and W to x's dtype before the dx product, and dx itself: 4 u_op of the
    magnitudes plus K- or M-term float32 sums."""
    N, K, r, s = 200, 136, 8, 1.5
    q, st, a, b, m = nf4_case(N, K, r)
    x = torch.randn(M, K).to(dtype)
    dy = torch.randn(M, N).to(dtype)
    W = fo.nf4_dequantize(q, st, torch.float32).double()
    x64, a64, b64, m64 = (v.double().requires_grad_() for v in (x, a, b, m))
    norm = (W + s * b64.detach() @ a64.detach()).norm(dim=1)
    z64 = x64 @ W.T + s * (x64 @ a64.T) @ b64.T
    ((m64 / norm) * z64 * dy.double()).sum().backward()
    xc = x.cuda().requires_grad_()
    ac, bc, mc = (v.cuda().requires_grad_() for v in (a, b, m))
    y = nf4_linear(xc, q.cuda(), st.to("cuda"), ac, bc, s, mc)
    y.backward(dy.cuda())
    u = 2.0**-8 if dtype == torch.bfloat16 else U32
    with torch.no_grad():
        ga = (m64 / norm).abs()
        dza = dy.double().abs() * ga
        mags = dict(dx=dza @ (W.abs() + s * b64.abs() @ a64.abs()),
                    dA=s * (dza @ b64.abs()).T @ x64.abs(),
                    dB=s * dza.T @ (x64.abs() @ a64.abs().T),
                    dm=(dy.double().abs() * (x64.abs() @ W.abs().T + s * (x64.abs() @ a64.abs().T) @ b64.abs().T)).sum(0) / norm)
    for name, ours, ref in (("dx", xc.grad, x64.grad), ("dA", ac.grad, a64.grad), ("dB", bc.grad, b64.grad),
                            ("dm", mc.grad, m64.grad)):
        tol = (4 * u + 4 * (K + M + r) * U32) * mags[name] + 1e-30
        err = (ours.double().cpu() - ref).abs()
        assert (err <= tol).all(), f"{name}: {(err / tol).max().item():.3g} x the bound"


def test_nf4_linear_backward_outputs_do_not_alias_and_dm_dtype():
    q, st, a, b, m = nf4_case(64, 64, 4)
    x = torch.randn(3, 64).cuda()
    args = [x, q.cuda(), st.to("cuda").absmax_fp32(), 64, 64, a.cuda(), b.cuda(), 1.0, m.double().cuda()]
    _, xa, rn, z = OP.nf4_linear(*args, None)
    dy = torch.randn(3, 64).cuda()
    for mask in ([False] * 4, [True, False, False, False], [False, True, True, True]):
        full = (dy, x) + tuple(args[1:]) + (xa, rn, z, mask)
        outs = OP.nf4_linear_backward(*full)
        assert len({id(o) for o in outs}) == 4
        assert outs[3].dtype == torch.float64
        torch.library.opcheck(OP.nf4_linear_backward, full)


def test_nf4_linear_rank_zero_like_the_cpu():
    q, st, _, _, _ = nf4_case(64, 64, 0, dora=False)
    a, b = torch.zeros(0, 64), torch.zeros(64, 0)
    x = torch.randn(5, 64)
    cpu = OP.nf4_linear(x, q, st.absmax, 64, 64, a, b, 1.0, None, None)
    gpu = OP.nf4_linear(x.cuda(), q.cuda(), st.absmax.cuda(), 64, 64, a.cuda(), b.cuda(), 1.0, None, None)
    assert [t.shape for t in cpu] == [t.shape for t in gpu]
    torch.library.opcheck(OP.nf4_linear, (x.cuda(), q.cuda(), st.absmax.cuda(), 64, 64, a.cuda().requires_grad_(),
                                          b.cuda().requires_grad_(), 1.0, None, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dora", [False, True])
def test_nf4_linear_rows_do_not_depend_on_batch_size(dtype, dora):
    """The decode path (M <= 64) and the GEMM path (M > 64) round at the same points, so a row's output
    differs between M in {1, 7, 64} and M in {65, 300} by at most one unit in the last place of x's
    dtype plus two float32 sums' error (K + r terms)."""
    N, K, r, s = 300, 520, 8, 2.0
    q, st, a, b, m = nf4_case(N, K, r, dora=dora)
    qc, stc, ac, bc = q.cuda(), st.to("cuda"), a.cuda(), b.cuda()
    mc = m.cuda() if dora else None
    x = torch.randn(300, K).to(dtype).cuda()
    big = nf4_linear(x, qc, stc, ac, bc, s, mc)
    W = fo.nf4_dequantize(q, st, torch.float32).to(dtype).double().cuda()  # rounded as the kernels use it
    g = (m.double().cuda() / (fo.nf4_dequantize(q, st, torch.float32).double().cuda()
                              + s * bc.double() @ ac.double()).norm(dim=1)) if dora else torch.ones(N).double().cuda()
    mag = g.abs() * (x.double().abs() @ W.abs().T + s * (x.double().abs() @ ac.double().abs().T) @ bc.double().abs().T)
    ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    for M in (1, 7, 64, 65):
        small = nf4_linear(x[:M].contiguous(), qc, stc, ac, bc, s, mc)
        ref = big[:M].double()
        tol = ulp * ref.abs() + 2 * 4 * (K + r) * U32 * mag[:M] + 2.0**-24
        assert ((small.double() - ref).abs() <= tol).all(), M


def test_dora_norm_float64_and_float32():
    q, st, a, b, _ = nf4_case(300, 136, 8)
    W = fo.nf4_dequantize(q, st, torch.float32).double()
    exact = (W + 0.7 * b.double() @ a.double()).norm(dim=1)
    n64 = nf4_dora_norm(q.cuda(), st.to("cuda"), a.double().cuda(), b.double().cuda(), 0.7)
    assert n64.dtype == torch.float64
    assert torch.allclose(n64.cpu(), exact, atol=0, rtol=1e-12)
    n32 = nf4_dora_norm(q.cuda(), st.to("cuda"), a.cuda(), b.cuda(), 0.7)
    assert n32.dtype == torch.float32
    # float32 factorised form: K-term and r-term sums of terms up to ‖W_n‖² + ...: relative to the norm²
    mag2 = (W.abs() + 0.7 * b.double().abs() @ a.double().abs()).pow(2).sum(1)
    assert ((n32.cpu().double() ** 2 - exact**2).abs() <= 4 * (136 + 8 * 8) * U32 * mag2).all()


def test_dora_norm_rows_past_the_old_grid_cap_are_written():
    """N = 2^24 + 1000 rows: more than 65,535 blocks x 256 threads (16,776,960)."""
    N, K, r = (1 << 24) + 1000, 2, 1
    w = torch.randn(N, K, device="cuda") * 0.1
    q, st = fo.nf4_quantize(w)
    a = torch.randn(r, K, device="cuda")
    b = torch.randn(N, r, device="cuda") * 0.1
    norm = nf4_dora_norm(q, st, a, b, 1.0)
    tail = slice(65535 * 256 - 10, N)
    W = fo.nf4_dequantize(q, st, torch.float32)[tail].double()
    exact2 = (W + b[tail].double() @ a.double()).pow(2).sum(1)
    mag2 = (W.abs() + b[tail].double().abs() @ a.double().abs()).pow(2).sum(1)
    assert torch.isfinite(norm).all()
    assert ((norm[tail].double() ** 2 - exact2).abs() <= 4 * (K + r * r + 2) * U32 * mag2).all()


def test_weight_sq_norm_matches_float64():
    q, st, _, _, _ = nf4_case(300, 136, 1)
    W = fo.nf4_dequantize(q, st, torch.float32).double()
    exact = W.pow(2).sum(1)
    ours = nf4_weight_sq_norm(q.cuda(), st.to("cuda")).cpu().double()
    # squares of float32 values are exact in float64; a 136-term float64 sum, then one float32 rounding
    assert ((ours - exact).abs() <= (U32 + 136 * 2.0**-53) * exact).all()
