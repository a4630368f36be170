"""CPU-side checks of the logic the CPU and CUDA kernels share (core/math.h, the shared argument
checks, the fake kernels, the double-quantization offset). Their CUDA twins are in
test_cuda_kernels.py; these run everywhere."""
from __future__ import annotations

import math

import pytest
import torch

import fasttrain.ops as fo
from fasttrain.ops import logprob as lp_mod
from fasttrain.ops import nf4 as nf4_mod
from fasttrain.ops.nf4_linear import nf4_linear

OP = torch.ops.fasttrain


# ---- fused_logprob: logits of -inf -------------------------------------------------------------------
def reference_logprob(h, w, t, b, T):
    """float64 log p(target), entropy and gradients from the full logits; entropy terms of
    zero-probability entries count 0 (p log p -> 0), as the entropy's definition says."""
    h = h.double().detach().requires_grad_()
    w = w.double().detach().requires_grad_()
    b = b.double().detach().requires_grad_()
    ls = torch.log_softmax((h @ w.T + b) / T, dim=-1)
    logp = ls.gather(1, t[:, None]).squeeze(1)
    p = ls.exp()
    ent = torch.where(p > 0, -p * ls, torch.zeros_like(p)).sum(1)
    return logp, ent.detach(), (h, w, b)


def neg_inf_case(dtype, V=70, H=12, N=9):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(N, H, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5).to(dtype)
    b = torch.randn(V, generator=g, dtype=torch.float64)
    b[:16] = -math.inf            # the whole first vocabulary chunk (16 rows at a 4 KiB budget)
    b[[20, 33, 34, 69]] = -math.inf  # and single banned tokens in later chunks
    t = torch.randint(16, V, (N,), generator=g)
    t[t == 20] = 21
    t[(t == 33) | (t == 34)] = 35
    t[t == 69] = 68
    return h, w, t, b.to(dtype)


# Tolerance: a few roundings per term of sums over the V = 70 logits or H = 12 products, relative to
# the largest value: 4 (V + H) u (u = 2^-53 for float64, 2^-24 for float32).
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 4 * 82 * 2.0**-53), (torch.float32, 4 * 82 * 2.0**-24)])
def test_logits_of_minus_inf_give_no_nan(dtype, tol):
    """A vocabulary chunk whose logits are all -inf (before any finite one) and single -inf logits
    after it: the entries have probability 0 and add 0 to every sum. Before the floor in
    fm::lse_delta the first gave NaN p~ (so a NaN hidden gradient) and the second a NaN entropy
    sum (returned as 0 by the entropy's clamp)."""
    h, w, t, b = neg_inf_case(dtype)
    lp_mod.set_chunk_bytes(4096)  # CPU chunks of 16 vocabulary rows: chunk 0 is all -inf
    try:
        hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
        logp, ent = fo.fused_logprob(hh, ww, t, temperature=0.8, bias=bb)
        up = torch.linspace(-1, 1, len(t), dtype=torch.float64)
        (logp.double() * up).sum().backward()
    finally:
        lp_mod.set_chunk_bytes(0)
    rl, re, (rh, rw, rb) = reference_logprob(h, w, t, b, 0.8)
    (rl * up).sum().backward()
    for name, ours, ref in (("logp", logp, rl), ("entropy", ent, re), ("dh", hh.grad, rh.grad),
                            ("dw", ww.grad, rw.grad), ("db", bb.grad, rb.grad)):
        assert torch.isfinite(ours).all(), name
        scale = max(1.0, ref.abs().max().item())
        assert (ours.double() - ref).abs().max().item() <= tol * scale, name
    assert (ent > 0.5).all()  # not the clamp's 0
    assert (bb.grad[:16] == 0).all() and (bb.grad[[20, 33, 34, 69]] == 0).all()


def test_hidden_size_zero_gives_uniform_distribution():
    """H = 0: every logit is bias / T, so without a bias log p = -log V and entropy = log V; the
    gradients are empty (hidden, weight) or the bias's (onehot - 1/V) sums."""
    N, V = 5, 7
    h = torch.zeros(N, 0, dtype=torch.float64, requires_grad=True)
    w = torch.zeros(V, 0, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 6, 3, -100, 3])
    logp, ent = fo.fused_logprob(h, w, t)
    keep = t != -100
    assert torch.allclose(logp[keep], torch.full((4,), -math.log(V), dtype=torch.float64), atol=1e-15, rtol=0)
    assert torch.allclose(ent[keep], torch.full((4,), math.log(V), dtype=torch.float64), atol=1e-15, rtol=0)
    assert logp[3] == 0 and ent[3] == 0
    logp.sum().backward()
    assert h.grad.shape == (N, 0) and w.grad.shape == (V, 0)
    b = torch.zeros(V, dtype=torch.float64, requires_grad=True)
    logp, _ = fo.fused_logprob(h.detach(), w.detach(), t, bias=b)
    logp.sum().backward()
    expect = torch.bincount(t[keep], minlength=V).double() - keep.sum().item() / V
    assert torch.allclose(b.grad, expect, atol=1e-14, rtol=0)


def test_out_of_range_target_message_names_position_and_value():
    h = torch.randn(4, 3)
    w = torch.randn(5, 3)
    for bad, pos in ((5, 1), (-3, 2)):
        t = torch.tensor([0, 1, 2, 3])
        t[pos] = bad
        with pytest.raises(RuntimeError, match=rf"'targets' holds {bad} at position {pos}, outside \[0, 5\)"):
            fo.fused_logprob(h, w, t)
    t = torch.tensor([0, 7, 2, 3])
    _, _, stats, _ = OP.fused_logprob_forward(h, w, torch.tensor([0, 1, 2, 3]), None, 1.0, -100, False, 0)
    with pytest.raises(RuntimeError, match="fused_logprob_backward_weight: argument 'targets' holds 7 at position 1"):
        OP.fused_logprob_backward_weight(torch.ones(4), h, w, t, None, stats, 1.0, -100, 0)


def test_bias_gradient_is_zero_without_a_bias():
    """grad_bias of the weight backward is zeros when there is no bias (CUDA skips those atomics)."""
    h, w = torch.randn(6, 4), torch.randn(9, 4)
    t = torch.tensor([0, 1, 2, 3, 4, 5])
    _, _, stats, _ = OP.fused_logprob_forward(h, w, t, None, 1.0, -100, False, 0)
    gw, gb = OP.fused_logprob_backward_weight(torch.ones(6), h, w, t, None, stats, 1.0, -100, 0)
    assert gb.shape == (9,) and (gb == 0).all() and gw.abs().sum() > 0


# ---- nf4_linear: rank 0, empty outputs, fake kernels ------------------------------------------------
def nf4_case(N=24, K=40, r=3, dtype=torch.float32, dora=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    q, st = fo.nf4_quantize(w)
    a = (torch.randn(r, K, generator=g) * 0.1).to(dtype)
    b = (torch.randn(N, r, generator=g) * 0.1).to(dtype)
    m = (torch.rand(N, generator=g) + 0.5).to(dtype) if dora else None
    return q, st, a, b, m


def test_rank_zero_adapters_shapes_and_gradients():
    """lora_a [0, K], lora_b [N, 0]: y = x·Wᵀ; xa is [M, 0] and the factors' gradients have their
    (empty) shapes on the CPU, on CUDA and in the fake kernel alike."""
    q, st, a, b, _ = nf4_case(r=0)
    x = torch.randn(5, 40, dtype=torch.float64, requires_grad=True)
    a.requires_grad_()
    b.requires_grad_()
    y = nf4_linear(x, q, st, a, b, 2.0)
    w = fo.nf4_dequantize(q, st, torch.float32).double()
    assert torch.allclose(y, x @ w.T, atol=1e-12, rtol=0)
    y.sum().backward()
    assert a.grad.shape == (0, 40) and b.grad.shape == (24, 0)
    assert torch.allclose(x.grad, torch.ones(5, 24, dtype=torch.float64) @ w, atol=1e-12, rtol=0)
    _, xa, _, _ = OP.nf4_linear(x.detach(), q, st.absmax, 64, 24, a.detach(), b.detach(), 2.0, None, None)
    assert xa.shape == (5, 0)


@pytest.mark.parametrize("r", [0, 2])
def test_opcheck_rank_and_masks(r):
    q, st, a, b, _ = nf4_case(r=r)
    x = torch.randn(3, 40)
    torch.library.opcheck(OP.nf4_linear, (x, q, st.absmax, 64, 24, a, b, 1.5, None, None))
    xr = x.clone().requires_grad_()
    torch.library.opcheck(OP.nf4_linear, (xr, q, st.absmax, 64, 24, a.clone().requires_grad_(),
                                          b.clone().requires_grad_(), 1.5, None, None))
    _, xa, rn, z = OP.nf4_linear(x, q, st.absmax, 64, 24, a, b, 1.5, None, None)
    dy = torch.randn(3, 24)
    for mask in ([True, True, True, False], [False, False, False, False], [False, True, False, False],
                 [True, False, True, False]):
        torch.library.opcheck(OP.nf4_linear_backward, (dy, x, q, st.absmax, 64, 24, a, b, 1.5, None, xa, rn, z, mask))


@pytest.mark.parametrize("m_dtype", [torch.float32, torch.float64])
def test_dora_backward_empty_outputs_dtype_and_no_aliasing(m_dtype):
    """Outputs whose mask bit is off are fresh [0] tensors (never one shared tensor); dm's dtype is
    dora_m's whether or not it is computed (the fake kernel says so too: opcheck)."""
    q, st, a, b, m = nf4_case(dora=True)
    m = m.to(m_dtype)
    x = torch.randn(3, 40)
    _, xa, rn, z = OP.nf4_linear(x, q, st.absmax, 64, 24, a, b, 1.5, m, None)
    dy = torch.randn(3, 24)
    for mask in ([False, False, False, False], [True, False, False, False], [False, True, True, True]):
        args = (dy, x, q, st.absmax, 64, 24, a, b, 1.5, m, xa, rn, z, mask)
        outs = OP.nf4_linear_backward(*args)
        assert len({id(o) for o in outs}) == 4
        assert outs[3].dtype == m_dtype and outs[3].shape == ((24,) if mask[3] else (0,))
        torch.library.opcheck(OP.nf4_linear_backward, args)


def test_dora_norm_float64_in_float64_out():
    q, st, a, b, _ = nf4_case()
    n64 = OP.nf4_dora_norm(q, st.absmax, 64, 24, a.double(), b.double(), 0.7, None)
    assert n64.dtype == torch.float64
    w = fo.nf4_dequantize(q, st, torch.float32).double()
    assert torch.allclose(n64, (w + 0.7 * b.double() @ a.double()).norm(dim=1), atol=1e-13, rtol=0)
    torch.library.opcheck(OP.nf4_dora_norm, (q, st.absmax, 64, 24, a.double(), b.double(), 0.7, None))


# ---- double quantization's offset ---------------------------------------------------------------------
SIZES = [64 * 300, 64 * 257 + 13, 64 * 5000 + 1, 64 * 40000]


@pytest.mark.parametrize("n", SIZES)
def test_offset_is_the_rounded_exact_mean(n):
    """The offset is float32(mean) with the mean summed in float64 (rounding error <= n 2^-53 of the
    sum, far below float32's half-ulp except at a near-tie): it equals the correctly rounded mean from
    math.fsum for these fixed cases, on any host, device and thread count."""
    w = torch.randn(n) * torch.rand(n) * 0.1
    _, absmax = OP.nf4_quantize(w, 64)
    exact = math.fsum(absmax.double().tolist()) / absmax.numel()
    _, st = fo.nf4_quantize(w, double_quant=True)
    assert st.offset.dtype == torch.float32 and st.offset.dim() == 0
    assert st.offset.item() == torch.tensor(exact).float().item()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(nf4_mod.absmax_offset(absmax), st.offset)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n", SIZES[:2])
def test_double_quant_against_bitsandbytes(n):
    """Bytes and absmax equal bitsandbytes' bit for bit; its offset (a float32 mean) is within that
    sum's rounding error of ours, and given our offset, its blockwise step gives our absmax2 bit for
    bit. (The 8-bit codes follow the exact nearest-code rule: test_nf4.py.)"""
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(n) * torch.rand(n) * 0.1
    packed_ref, st_ref = bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    packed, st = fo.nf4_quantize(w, double_quant=True)
    assert torch.equal(packed, packed_ref.reshape(-1))
    _, absmax = OP.nf4_quantize(w, 64)
    nb = absmax.numel()
    # float32 summation of nb positive values: error <= (ceil(log2 nb) + 1) u sum for a pairwise or
    # cascade order, then one rounding for the division and one for ours.
    u = 2.0**-24
    bound = ((math.ceil(math.log2(nb)) + 1) * u + 2 * u) * absmax.double().mean().item()
    assert abs(st_ref.offset.item() - st.offset.item()) <= bound
    _, state2 = bnb_f.quantize_blockwise(absmax - st.offset, blocksize=256)
    assert torch.equal(st.absmax2, state2.absmax)
