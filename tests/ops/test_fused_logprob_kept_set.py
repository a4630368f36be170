"""fused_logprob's kept-set replay (keep_delta): log q(target), the entropy of q and the gradients of log q,
with q the softmax restricted to {v : z_v >= z_target - delta} (and the target), renormalised.

Oracles: fasttrain.ops.reference in float64 (the masked log-softmax through autograd), and for the policy
gradient and the entropy an exact enumeration over a small vocabulary in float64. Tolerances: float64 runs
agree to 1e-10 (as the unmasked op's tests: sums of at most V terms of size <= max|z| at 2^-53 each);
float32 runs within 2x of PyTorch's eager float32 error against the float64 reference (flash-attention's
rule), with the cuts placed halfway between two logits so that no rounding of either moves a token across.
"""
from __future__ import annotations

import math

import pytest
import torch

import fasttrain.ops as fo
from fasttrain.ops import logprob as lp_mod
from fasttrain.ops.reference import fused_logprob as reference

OP = torch.ops.fasttrain
INF = math.inf


def make(N, H, V, dtype=torch.float64, ignore=(), seed=0, T=1.0):
    """Inputs and a kept set per token: the k largest tempered logits (k random), the cut halfway between
    the k-th and the (k+1)-th, the target drawn inside the set; every third token keeps everything."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=torch.float64) * 2
    w = torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5
    b = torch.randn(V, generator=g, dtype=torch.float64)
    z = (h @ w.T + b) / T
    s = z.sort(-1, descending=True).values
    t = torch.empty(N, dtype=torch.long)
    delta = torch.empty(N, dtype=torch.float64)
    for n in range(N):
        k = int(torch.randint(1, V + 1, (1,), generator=g))
        cut = -INF if k == V or n % 3 == 2 else float(s[n, k - 1] + s[n, k]) / 2
        kept = (z[n] >= cut).nonzero()[:, 0]
        t[n] = kept[int(torch.randint(0, kept.numel(), (1,), generator=g))]
        delta[n] = INF if cut == -INF else float(z[n, t[n]]) - cut
    for i in ignore:
        t[i] = -100
    cast = lambda x: x.to(dtype)  # noqa: E731
    return cast(h), cast(w), t, cast(b), delta


def run(fn, h, w, t, b, T, delta, up):
    hh, ww, bb = (x.detach().clone().requires_grad_() for x in (h, w, b))
    logp, ent = fn(hh, ww, t, T, bb, delta)
    (logp.double() * up).sum().backward()
    return dict(logp=logp.detach().double(), ent=ent.detach().double(), dh=hh.grad.double(), dw=ww.grad.double(),
                db=bb.grad.double())


def ours(h, w, t, T, b, delta):
    return fo.fused_logprob(h, w, t, temperature=T, bias=b, keep_delta=None if delta is None else delta.to(h.dtype))


def oracle(h, w, t, T, b, delta):
    return reference(h.double(), w.double(), t, T, bias=b.double(), keep_delta=delta)


@pytest.fixture
def small_chunks():
    lp_mod.set_chunk_bytes(4096)
    yield
    lp_mod.set_chunk_bytes(0)


@pytest.mark.parametrize("N,H,V", [(1, 7, 5), (37, 19, 53), (130, 65, 1001)])
@pytest.mark.parametrize("T", [1.0, 0.7])
@pytest.mark.parametrize("chunks", ["default", "small"])
def test_float64_kept_set_matches_the_reference(N, H, V, T, chunks, request):
    if chunks == "small":
        request.getfixturevalue("small_chunks")
    h, w, t, b, delta = make(N, H, V, ignore=(0,) if N > 2 else (), T=T)
    up = torch.randn(N, dtype=torch.float64)
    a, r = run(ours, h, w, t, b, T, delta, up), run(oracle, h, w, t, b, T, delta, up)
    for key in a:
        assert (a[key] - r[key]).abs().max() < 1e-10, key
    full = run(oracle, h, w, t, b, T, None, up)                   # the replay changes what is computed
    assert (full["logp"] - r["logp"]).abs().max() > 1e-3 if N > 2 else True


def test_float32_within_2x_of_eager():
    N, H, V, T = 64, 32, 257, 0.8
    h, w, t, b, delta = make(N, H, V, torch.float32, T=T)
    up = torch.randn(N, dtype=torch.float64)

    def eager(h, w, t, T, b, delta):                                # float32 throughout: the yardstick
        z = (h @ w.T + b) / T
        zt = z.gather(1, t[:, None])
        cut = torch.where(torch.isinf(delta[:, None]), torch.full_like(zt, -INF), zt - delta[:, None].float())
        ls = torch.log_softmax(torch.where(z >= cut, z, torch.full_like(z, -INF)), -1)
        p = ls.exp()
        return ls.gather(1, t[:, None])[:, 0], -torch.where(p > 0, p * ls, torch.zeros_like(p)).sum(-1)

    a, r, e = (run(f, h, w, t, b, T, delta, up) for f in (ours, oracle, eager))
    for key in a:
        e_ours, e_eager = (a[key] - r[key]).abs().max().item(), (e[key] - r[key]).abs().max().item()
        floor = 4 * 2.0**-24 * max(1.0, r[key].abs().max().item())
        assert e_ours <= 2 * e_eager + floor, (key, e_ours, e_eager)


def test_whole_vocabulary_sentinel_is_the_unmasked_op_bitwise():
    h, w, t, b, _ = make(40, 16, 300, torch.float32)
    for grad in (False, True):
        args = (h.clone().requires_grad_(grad), w, t, b, 0.9, -100, grad, 0)
        plain = OP.fused_logprob_forward(*args)
        kept = OP.fused_logprob_forward(*args, torch.full((40,), INF))
        for x, y in zip(plain[:2] + plain[3:], kept[:2] + kept[3:]):
            assert torch.equal(x, y)
        assert torch.equal(plain[2], kept[2][:2]) and bool((kept[2][2] == -INF).all())


def test_the_target_is_kept_even_above_its_own_cut():
    """A negative delta (the cut above the target's own logit, as another forward's rounding could make
    it) keeps the target and what lies above the cut: log q(t) stays finite and matches the reference."""
    h, w, t, b, _ = make(12, 8, 40)
    delta = torch.full((12,), -0.5, dtype=torch.float64)
    up = torch.ones(12, dtype=torch.float64)
    a, r = run(ours, h, w, t, b, 1.0, delta, up), run(oracle, h, w, t, b, 1.0, delta, up)
    assert bool(torch.isfinite(a["logp"]).all())
    for key in a:
        assert (a[key] - r[key]).abs().max() < 1e-10, key


def test_policy_gradient_and_entropy_on_the_kept_set_by_exact_enumeration():
    """One context, V = 9, kept set K = the 5 largest tempered logits. For every target t in K (each call
    scores t on K: delta_t = z_t - cut): log q(t) and H(q) equal the enumeration; the expected policy
    gradient sum_t q(t) A(t) grad log q(t) equals grad sum_t q(t) A(t) (the objective's exact gradient),
    for the hidden state, the weight and the bias; and no weight row outside K gets a gradient."""
    H, V, T = 6, 9, 0.7
    g = torch.Generator().manual_seed(4)
    h = torch.randn(1, H, generator=g, dtype=torch.float64) * 2
    w = torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5
    b = torch.randn(V, generator=g, dtype=torch.float64)
    A = torch.randn(V, generator=g, dtype=torch.float64)
    z = ((h @ w.T + b) / T)[0]
    s = z.sort(descending=True).values
    cut = float(s[4] + s[5]) / 2
    K = (z >= cut).nonzero()[:, 0]
    assert K.numel() == 5
    q = torch.zeros(V, dtype=torch.float64)
    q[K] = torch.softmax(z[K], 0)

    # the op, one row per target in K: logp, entropy, and the score-function gradient
    n = K.numel()
    hh, ww, bb = (x.clone().requires_grad_() for x in (h.expand(n, H).contiguous(), w, b))
    delta = z[K] - cut
    logp, ent = fo.fused_logprob(hh, ww, K, temperature=T, bias=bb, keep_delta=delta)
    assert torch.allclose(logp, q[K].log(), atol=1e-12, rtol=0)
    assert torch.allclose(ent, torch.full((n,), float(-(q[K] * q[K].log()).sum()), dtype=torch.float64),
                          atol=1e-12, rtol=0)
    (logp * (q[K] * A[K]).detach()).sum().backward()

    # the objective J = sum_{t in K} q(t) A(t) with K held, differentiated by autograd
    h2, w2, b2 = (x.clone().requires_grad_() for x in (h, w, b))
    z2 = ((h2 @ w2.T + b2) / T)[0]
    J = (torch.softmax(z2[K], 0) * A[K]).sum()
    J.backward()
    assert torch.allclose(hh.grad.sum(0), h2.grad[0], atol=1e-12, rtol=0)
    assert torch.allclose(ww.grad, w2.grad, atol=1e-12, rtol=0)
    assert torch.allclose(bb.grad, b2.grad, atol=1e-12, rtol=0)
    out = torch.ones(V, dtype=torch.bool)
    out[K] = False
    assert bool((ww.grad[out] == 0).all()) and bool((bb.grad[out] == 0).all())
    # and the full-vocabulary score (no replay) has another expectation: its mean score is not zero on K
    hf = h.expand(n, H).contiguous().clone().requires_grad_()
    lf, _ = fo.fused_logprob(hf, w, K, temperature=T, bias=b)
    (lf * q[K]).sum().backward()
    assert hf.grad.sum(0).abs().max() > 1e-3


def test_gradcheck_and_opcheck_with_a_kept_set():
    h, w, t, b, delta = make(6, 5, 11)
    for x in (h, w, b):
        x.requires_grad_()
    f = lambda h, w, b: fo.fused_logprob(h, w, t, temperature=0.8, bias=b, keep_delta=delta)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, (h, w, b))
    for dt in (torch.float32, torch.float64):
        h, w, t, b, delta = make(9, 6, 13, dt)
        d = delta.to(dt)
        torch.library.opcheck(OP.fused_logprob_forward, (h.requires_grad_(), w.requires_grad_(), t, b, 0.9, -100,
                                                         True, 0, d))
        _, _, stats, _ = OP.fused_logprob_forward(h.detach(), w.detach(), t, b, 0.9, -100, False, 0, d)
        assert stats.shape == (3, 9)
        torch.library.opcheck(OP.fused_logprob_backward_weight,
                              (torch.randn(9, dtype=dt), h.detach(), w.detach(), t, b, stats, 0.9, -100, 0))


def test_bad_keep_delta_names_the_argument():
    h, w, t, b, _ = make(4, 3, 7, torch.float32)
    with pytest.raises(RuntimeError, match="keep_delta"):
        OP.fused_logprob_forward(h, w, t, b, 1.0, -100, False, 0, torch.zeros(3))
    with pytest.raises(ValueError, match="keep_delta"):
        fo.fused_logprob(h, w, t, bias=b, keep_delta=torch.zeros(5))
