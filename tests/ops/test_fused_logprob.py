"""fused_logprob against fasttrain.ops.reference (the full logits) in float64.

Tolerances: float64 runs must agree to ~1e-10; fp32/bf16/fp16 runs must be within 2x of the error
that PyTorch's own eager computation in that dtype makes against the same float64 reference
(flash-attention's rule), plus a floor of a few ulps of the value's scale for cases where eager
happens to be exact.
"""
from __future__ import annotations

import pytest
import torch

import fasttrain.ops as fo
from fasttrain.ops import logprob as lp_mod
from fasttrain.ops.reference import fused_logprob as reference

OP = torch.ops.fasttrain


def eager(hidden, weight, targets, temperature=1.0, ignore_index=-100, bias=None):
    """PyTorch's own computation in the inputs' dtype (logits and log-softmax in bf16 for bf16): the
    yardstick of the 2x rule, not an oracle. The oracle is fasttrain.ops.reference in float64."""
    z = hidden @ weight.T
    if bias is not None:
        z = z + bias
    ls = torch.log_softmax(z / temperature, dim=-1)
    keep = targets != ignore_index
    logp = ls.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros((), dtype=ls.dtype)
    return torch.where(keep, logp, zero), torch.where(keep, -(ls.exp() * ls).sum(-1), zero).detach()


def make(N, H, V, dtype=torch.float32, scale=1.0, ignore=(), bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=torch.float64) * scale
    w = torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    for i in ignore:
        t[i] = -100
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return cast(h), cast(w), t, cast(b)


def run_both(h, w, t, b, T, upstream, need_w=True):
    """Our op and the reference on copies of the same (possibly low-precision) leaves; returns
    values and grads of ours, of the float64 reference, and of eager in the inputs' dtype."""
    out = {}
    for name, dt in (("ours", None), ("ref", torch.float64), ("eager", None)):
        hh = (h if dt is None else h.to(dt)).detach().clone().requires_grad_()
        ww = (w if dt is None else w.to(dt)).detach().clone().requires_grad_(need_w)
        bb = None if b is None else (b if dt is None else b.to(dt)).detach().clone().requires_grad_(need_w)
        if name == "ours":
            logp, ent = fo.fused_logprob(hh, ww, t, temperature=T, bias=bb)
        elif name == "ref":
            logp, ent = reference(hh, ww, t, T, bias=bb)
        else:
            logp, ent = eager(hh, ww, t, T, bias=bb)
        (logp.double() * upstream).sum().backward()
        out[name] = dict(logp=logp.detach().double(), ent=ent.detach().double(), dh=hh.grad.double(),
                         dw=None if ww.grad is None else ww.grad.double(),
                         db=None if bb is None or bb.grad is None else bb.grad.double())
    return out


def err(a, b):
    return (a - b).abs().max().item() if a.numel() else 0.0


def assert_2x(out, key, ulp):
    ours, ref, eager = out["ours"][key], out["ref"][key], out["eager"][key]
    e_ours, e_eager = err(ours, ref), err(eager, ref)
    floor = ulp * max(1.0, ref.abs().max().item() if ref.numel() else 1.0)
    assert e_ours <= 2 * e_eager + floor, f"{key}: ours {e_ours:.3g} vs eager {e_eager:.3g} (floor {floor:.3g})"


SHAPES = [  # (N, H, V): odd shapes, N=1, V=1, not multiples of 8/64
    (1, 7, 5),
    (5, 3, 1),
    (37, 19, 53),
    (130, 65, 1001),
]


@pytest.fixture
def small_chunks():
    """A tiny scratch budget so N*V spans many vocabulary chunks and token blocks."""
    lp_mod.set_chunk_bytes(4096)
    yield
    lp_mod.set_chunk_bytes(0)


@pytest.mark.parametrize("N,H,V", SHAPES)
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_float64_matches_full_logits(N, H, V, T, small_chunks):
    h, w, t, b = make(N, H, V, torch.float64, ignore=(0,) if N > 2 else (), bias=True)
    up = torch.randn(N, dtype=torch.float64)
    out = run_both(h, w, t, b, T, up)
    for key in ("logp", "ent", "dh", "dw", "db"):
        assert err(out["ours"][key], out["ref"][key]) < 1e-10, key


@pytest.mark.parametrize("N,H,V", SHAPES)
@pytest.mark.parametrize("chunks", ["default", "small"])
def test_float32_within_2x_of_eager(N, H, V, chunks):
    if chunks == "small":
        lp_mod.set_chunk_bytes(4096)
    try:
        h, w, t, b = make(N, H, V, torch.float32, scale=3.0, ignore=(1,) if N > 2 else ())
        out = run_both(h, w, t, b, 1.3, torch.randn(N, dtype=torch.float64))
    finally:
        lp_mod.set_chunk_bytes(0)
    for key in ("logp", "ent", "dh", "dw"):
        assert_2x(out, key, ulp=4 * 2.0**-23)


@pytest.mark.parametrize("dtype,ulp", [(torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)])
@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize("brgemm", ["1", "0"])
@pytest.mark.parametrize("dot", ["1", "0"])
def test_low_precision_within_2x_of_eager(dtype, ulp, tiles, brgemm, dot, monkeypatch):
    """"small": many vocabulary chunks (the last one partial) widened into each thread's one
    buffer, and several groups of 16-token blocks per thread, so a buffer is refilled often.
    brgemm "1": bf16 logits through ATen's brgemm where the CPU packs bf16 (W in 64-row blocks, the
    last of V = 777 partial; the token threshold lowered so these 96 tokens take it); "0": the
    widened float32 GEMM everywhere. dot "1": bf16 logits by the avx512_bf16 dot-product
    instruction where it runs instead (fused_logprob.bf16_dot_available; H = 72 is not a multiple
    of its 64-column tile, so the accumulator stays widened); "0": off."""
    monkeypatch.setenv("FASTTRAIN_LOGPROB_BRGEMM", brgemm)
    monkeypatch.setenv("FASTTRAIN_LOGPROB_BF16DOT", dot)
    monkeypatch.setenv("FASTTRAIN_LOGPROB_BRGEMM_MIN_TOKENS", "1")
    if tiles == "small":
        monkeypatch.setenv("FASTTRAIN_LOGPROB_BLOCK", "16")
        lp_mod.set_chunk_bytes(16384)
    try:
        h, w, t, b = make(96, 72, 777, dtype, scale=4.0, ignore=(5,))
        out = run_both(h, w, t, b, 1.0, torch.randn(96, dtype=torch.float64))
    finally:
        lp_mod.set_chunk_bytes(0)
    for key in ("logp", "ent", "dh", "dw"):
        assert_2x(out, key, ulp=ulp)


def _gamma(k: int, u: float) -> float:
    return k * u / (1 - k * u)


@pytest.mark.parametrize("pw", ["1", "0"])
@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize("dot,N,H", [("1", 96, 128), ("1", 37, 192), ("0", 96, 128)])
def test_bf16_grad_vector_within_derived_bound(pw, tiles, dot, N, H, monkeypatch):
    """The op's float32 hidden-gradient vector g = (W[t] - softmax(z)·W) / T for bf16 h and W against
    float64 on the same values, within a bound derived from the roundings (u = 2^-24, first order):
    the logits' float32 sums of exact products, |dz_v| <= gamma_H sum_i |h_i W_vi| / T, plus u|z_v|
    for the scale and u|z_v - ref| for the shift; exp within 4u; so each p~_v is within
    d_v = |dz_v| + u|z_v| + u|z_v - ref| + 4u of its relative value and the normalized softmax
    within 2 max_v d_v + gamma_V. The accumulator's float32 sums add gamma_V sum_v p_v |W_vh|, the
    bf16 split of p~ (pw "1": the p·W accumulator by brgemm, p~ = p_hi + p_lo) 2^-18 sum_v p_v |W_vh|,
    the per-chunk rescales and the final (W[t] - acc / s) / T a few u of each term.
    H = 128 (whole 64-column blocks, so the brgemm accumulator runs), V = 777 (a partial last
    512-row block); "small": two vocabulary chunks and 16-token blocks, so the rescale between
    chunks and several token blocks per thread run. dot "1": both products by the avx512_bf16
    dot-product instruction where it runs (its p·W also on p_hi + p_lo, so the same bound), with
    N = 37 a partial 4-token tile and H = 192 three 64-column tiles; "0": off."""
    monkeypatch.setenv("FASTTRAIN_LOGPROB_BRGEMM_PW", pw)
    monkeypatch.setenv("FASTTRAIN_LOGPROB_BF16DOT", dot)
    monkeypatch.setenv("FASTTRAIN_LOGPROB_BRGEMM_MIN_TOKENS", "1")
    if tiles == "small":
        monkeypatch.setenv("FASTTRAIN_LOGPROB_BLOCK", "16")
        lp_mod.set_chunk_bytes(16384)
    V, T = 777, 0.8
    try:
        h, w, t, _ = make(N, H, V, torch.bfloat16, scale=4.0, ignore=(5,))
        _, _, stats, gv = OP.fused_logprob_forward(h, w, t, None, T, -100, True, 0)
    finally:
        lp_mod.set_chunk_bytes(0)
    u = 2.0**-24
    h64, w64 = h.double(), w.double()
    z = h64 @ w64.T / T                                                   # [N, V]
    p = torch.softmax(z, dim=-1)
    ref = w64[t.clamp(min=0)] / T - p @ w64 / T                          # [N, H]
    dz = _gamma(H, u) * (h64.abs() @ w64.abs().T) / T
    shift = stats[0].double()[:, None]                                     # the kernel's running ref
    d = (dz + u * z.abs() + u * (z - shift).abs() + 4 * u).amax(dim=-1, keepdim=True)
    spread = p @ w64.abs() / T                                            # sum_v p_v |W_vh| / T
    bound = (2 * d + 2 * _gamma(V, u) + 2.0**-18 + 8 * u) * spread + 4 * u * w64[t.clamp(min=0)].abs() / T
    keep = t != -100
    e = (gv.double() - ref).abs()
    assert torch.all(e[keep] <= bound[keep]), f"worst excess {(e - bound)[keep].max().item():.3g}"
    assert torch.all(gv[~keep] == 0)
    assert e[keep].max() > 0                                              # a float32 result, not float64


def test_bf16_brgemm_accumulator_is_taken(monkeypatch):
    """Where H is a multiple of 64 the p·W accumulator runs on brgemm (other bits than the widened
    float32 addmm); FASTTRAIN_LOGPROB_BRGEMM_PW=0 turns it off. Skipped where oneDNN does not pack bf16."""
    if not fo.brgemm_bf16_available():
        pytest.skip("this CPU's oneDNN ukernel does not pack bf16 (no AVX-512 bf16 / AMX)")
    monkeypatch.setenv("FASTTRAIN_LOGPROB_BRGEMM_MIN_TOKENS", "1")
    h, w, t, _ = make(64, 128, 448, torch.bfloat16, scale=4.0)      # one 448-row chunk either way
    out = {}
    for pw in ("1", "0"):
        monkeypatch.setenv("FASTTRAIN_LOGPROB_BRGEMM_PW", pw)
        out[pw] = OP.fused_logprob_forward(h, w, t, None, 1.0, -100, True, 0)
    assert torch.equal(out["1"][0], out["0"][0])                         # the same logits and chunks
    assert not torch.equal(out["1"][3], out["0"][3])


def test_bf16_dot_is_taken(monkeypatch):
    """Where bf16_dot_available, bf16 logits and (H a multiple of 64) the p·W accumulator run on the
    dot-product instruction: other bits than the widened float32 GEMMs (the same sums in another
    order; their bounds are the tests above); FASTTRAIN_LOGPROB_BF16DOT=0 turns it off. Skipped
    elsewhere."""
    if not fo.bf16_dot_available():
        pytest.skip("this CPU has no avx512_bf16 (or ATen below AVX512), or oneDNN packs bf16 (AMX)")
    h, w, t, _ = make(64, 128, 448, torch.bfloat16, scale=4.0)
    out = {}
    for dot in ("1", "0"):
        monkeypatch.setenv("FASTTRAIN_LOGPROB_BF16DOT", dot)
        out[dot] = OP.fused_logprob_forward(h, w, t, None, 1.0, -100, True, 0)
    assert not torch.equal(out["1"][0], out["0"][0])                     # the logits
    assert not torch.equal(out["1"][3], out["0"][3])                     # the p·W accumulator


def test_pack_cache_scope_keeps_results_and_follows_writes(monkeypatch):
    """Inside logprob_pack_cache W's packed copies are kept across calls (one entry per W, dropped when
    the scope closes) and the results are the bits of an unscoped call; an in-place write to W, a
    second W, and a freed W replaced by another of its shape all give their own fresh results.
    Packed copies are brgemm's (AMX) or the bf16 dot-product path's layouts."""
    if not (fo.brgemm_bf16_available() or fo.bf16_dot_available()):
        pytest.skip("this CPU packs no bf16 copy of W (neither oneDNN's ukernel nor avx512_bf16)")
    from fasttrain._native import load
    lib = load()
    monkeypatch.setenv("FASTTRAIN_LOGPROB_BRGEMM_MIN_TOKENS", "1")
    h, w, t, _ = make(40, 128, 300, torch.bfloat16, scale=3.0, seed=1)
    _, w2, _, _ = make(40, 128, 300, torch.bfloat16, scale=3.0, seed=2)

    def call(weight, grad=True):
        return OP.fused_logprob_forward(h, weight, t, None, 1.0, -100, grad, 0)

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    plain, plain2, plain_nograd = call(w), call(w2), call(w, grad=False)
    assert lib.logprob_pack_entries() == 0
    with fo.logprob_pack_cache():
        assert same(call(w, grad=False), plain_nograd) and lib.logprob_pack_entries() == 1
        assert same(call(w), plain) and same(call(w), plain)            # the accumulator's copy added
        assert same(call(w2), plain2) and lib.logprob_pack_entries() == 2
        w.mul_(0.5)                                                      # bumps w's version
        fresh = call(w)
        w.mul_(2.0)                                                      # back to the same values (exact)
        assert same(call(w), plain) and not same(fresh, plain)
        tmp = w2.clone()
        assert same(call(tmp), plain2)
        del tmp                                                          # freed: its entry goes
        other = w.clone()
        assert same(call(other), plain)
    assert lib.logprob_pack_entries() == 0


def test_hand_computed_case():
    # h = [1, 0], W rows e1, e2, 0: logits [1, 0, 0] -> p = [e, 1, 1] / (e + 2)
    h = torch.tensor([[1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    t = torch.tensor([0])
    logp, ent = fo.fused_logprob(h, w, t)
    e = torch.e
    Z = e + 2
    p = torch.tensor([e, 1.0, 1.0], dtype=torch.float64) / Z
    assert abs(logp.item() - (1 - torch.log(torch.tensor(Z, dtype=torch.float64)).item())) < 1e-14
    assert abs(ent.item() - (-(p * p.log()).sum()).item()) < 1e-14
    logp.sum().backward()
    # d logp / d h = W[0] - p . W = [1 - e/Z, -1/Z]
    assert torch.allclose(h.grad, torch.tensor([[1 - e / Z, -1 / Z]], dtype=torch.float64), atol=1e-14)


def test_huge_logits_no_overflow():
    # logits of magnitude ~1e4 (eager fp32 is still exact enough to be the judge, via float64)
    h, w, t, _ = make(64, 32, 300, torch.float32, scale=1.0)
    h = h * (1e4 / (h @ w.T).abs().max())
    out = run_both(h, w, t, None, 1.0, torch.ones(64, dtype=torch.float64))
    for key in ("logp", "ent", "dh", "dw"):
        assert torch.isfinite(out["ours"][key]).all(), key
        assert_2x(out, key, ulp=4 * 2.0**-23)
    assert (out["ours"]["ent"] >= 0).all()


def test_ignore_index_gives_zero_and_no_gradient():
    h, w, t, _ = make(10, 8, 20, torch.float64)
    t[[2, 7]] = -1
    h.requires_grad_()
    logp, ent = fo.fused_logprob(h, w, t, ignore_index=-1)
    assert logp[2] == 0 and logp[7] == 0 and ent[2] == 0 and ent[7] == 0
    assert (logp[[0, 1, 3]] < 0).all()
    logp.sum().backward()
    assert (h.grad[[2, 7]] == 0).all() and (h.grad[[0, 1]] != 0).all()


def test_entropy_is_detached_and_logp_float32():
    h, w, t, _ = make(4, 8, 16, torch.bfloat16)
    h.requires_grad_()
    logp, ent = fo.fused_logprob(h, w, t)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    assert logp.requires_grad and not ent.requires_grad


def test_batched_leading_dims():
    h, w, t, _ = make(12, 8, 16, torch.float64)
    logp, ent = fo.fused_logprob(h.view(3, 4, 8), w, t.view(3, 4))
    rl, re = reference(h, w, t)
    assert logp.shape == (3, 4) and torch.allclose(logp.view(-1), rl, atol=1e-12)
    assert torch.allclose(ent.view(-1), re, atol=1e-12)


def test_frozen_weight_computes_no_weight_gradient():
    h, w, t, _ = make(16, 8, 40, torch.float32)
    h.requires_grad_()
    logp, _ = fo.fused_logprob(h, w, t)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logp.sum().backward()
    names = {e.name for e in prof.events()}
    assert not any("fused_logprob_backward_weight" in n for n in names)
    assert w.grad is None and h.grad is not None


def test_weight_only_gradient():
    h, w, t, _ = make(16, 8, 40, torch.float64)
    w.requires_grad_()
    logp, _ = fo.fused_logprob(h, w, t)
    logp.sum().backward()
    w2 = w.detach().clone().requires_grad_()
    reference(h, w2, t)[0].sum().backward()
    assert torch.allclose(w.grad, w2.grad, atol=1e-12)


def test_no_grad_skips_gradient_vector():
    h, w, t, _ = make(16, 8, 40, torch.float32)
    _, _, _, gv = OP.fused_logprob_forward(h, w, t, None, 1.0, -100, False, 0)
    assert gv.shape == (0, 8)
    h.requires_grad_()
    with torch.no_grad():
        logp, _ = fo.fused_logprob(h, w, t)
    assert not logp.requires_grad
    _, _, _, gv = OP.fused_logprob_forward(h.detach(), w, t, None, 1.0, -100, True, 0)
    assert gv.shape == (16, 8)


def test_gradcheck_float64():
    h, w, t, b = make(6, 5, 11, torch.float64, ignore=(2,), bias=True)
    for x in (h, w, b):
        x.requires_grad_()
    f = lambda h, w, b: fo.fused_logprob(h, w, t, temperature=0.8, bias=b)[0]  # noqa: E731
    assert torch.autograd.gradcheck(f, (h, w, b))


def test_opcheck():
    samples = []
    for dt in (torch.float32, torch.float64, torch.bfloat16):
        h, w, t, b = make(9, 6, 13, dt, ignore=(3,), bias=True)
        samples.append(((h, w, t, b, 0.9, -100, True, 0), dt != torch.bfloat16))
        samples.append(((h, w, t, None, 1.0, -100, False, 4096), False))
    for args, grad in samples:
        h, w, t, b = args[:4]
        if grad:
            h = h.clone().requires_grad_()
            w = w.clone().requires_grad_()
        torch.library.opcheck(OP.fused_logprob_forward, (h, w, t) + args[3:])
    h, w, t, b = make(9, 6, 13, torch.float32, bias=True)
    _, _, stats, _ = OP.fused_logprob_forward(h, w, t, b, 0.9, -100, False, 0)
    torch.library.opcheck(OP.fused_logprob_backward_weight, (torch.randn(9), h, w, t, b, stats, 0.9, -100, 0))


def test_torch_compile_fullgraph_aot_eager():
    h, w, t, _ = make(20, 8, 30, torch.float32)

    def step(h, w, t):
        logp, ent = fo.fused_logprob(h, w, t, temperature=0.9)
        return (logp * 2).sum() + ent.mean()

    hc = h.clone().requires_grad_()
    wc = w.clone().requires_grad_()
    loss_c = torch.compile(step, fullgraph=True, backend="aot_eager")(hc, wc, t)
    loss_c.backward()
    he = h.clone().requires_grad_()
    we = w.clone().requires_grad_()
    step(he, we, t).backward()
    assert torch.allclose(loss_c, step(h, w, t), atol=1e-5)
    assert torch.allclose(hc.grad, he.grad, atol=1e-6) and torch.allclose(wc.grad, we.grad, atol=1e-6)


@pytest.mark.slow
def test_torch_compile_fullgraph_inductor():
    h, w, t, _ = make(20, 8, 30, torch.float32)
    hc = h.clone().requires_grad_()
    f = torch.compile(lambda h: fo.fused_logprob(h, w, t)[0].sum(), fullgraph=True)
    f(hc).backward()
    he = h.clone().requires_grad_()
    fo.fused_logprob(he, w, t)[0].sum().backward()
    assert torch.allclose(hc.grad, he.grad, atol=1e-6)


def test_bad_arguments_name_the_argument():
    h, w, t, _ = make(4, 8, 16, torch.float32)
    with pytest.raises(RuntimeError, match="'weight'"):
        fo.fused_logprob(h, w.double(), t)
    with pytest.raises(RuntimeError, match="'weight'"):
        fo.fused_logprob(h, w[:, :5], t)
    with pytest.raises(RuntimeError, match="'targets'"):
        fo.fused_logprob(h, w, t.int())
    with pytest.raises(RuntimeError, match="'targets' holds 16"):
        fo.fused_logprob(h, w, torch.tensor([0, 1, 16, 2]))
    with pytest.raises(RuntimeError, match="'temperature'"):
        fo.fused_logprob(h, w, t, temperature=0.0)
    with pytest.raises(RuntimeError, match="'bias'"):
        fo.fused_logprob(h, w, t, bias=torch.zeros(15))
    with pytest.raises(ValueError, match="targets"):
        fo.fused_logprob(h, w, t[:3])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_reference(dtype):
    h, w, t, b = make(300, 96, 5003, dtype, scale=3.0, ignore=(7,), bias=True)
    lp_mod.set_chunk_bytes(1 << 16)  # CUDA: 20 chunks of 256 rows, 8-10 token blocks
    try:
        hc, wc, bc = (x.cuda().requires_grad_() for x in (h, w, b))
        logp, ent = fo.fused_logprob(hc, wc, t.cuda(), temperature=0.9, bias=bc)
        up = torch.randn(300, dtype=torch.float64)
        (logp.double() * up.cuda()).sum().backward()
    finally:
        lp_mod.set_chunk_bytes(0)
    out = run_both(h, w, t, b, 0.9, up)
    out["ours"] = dict(logp=logp.detach().cpu().double(), ent=ent.cpu().double(), dh=hc.grad.cpu().double(),
                       dw=wc.grad.cpu().double(), db=bc.grad.cpu().double())
    ulp = {torch.float32: 4 * 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    for key in ("logp", "ent", "dh", "dw", "db"):
        assert_2x(out, key, ulp)


@pytest.mark.cuda
def test_cuda_float64_and_frozen_weight():
    h, w, t, _ = make(50, 17, 333, torch.float64, ignore=(0,))
    hc = h.cuda().requires_grad_()
    logp, ent = fo.fused_logprob(hc, w.cuda(), t.cuda(), temperature=1.3)
    logp.sum().backward()
    h2 = h.clone().requires_grad_()
    rl, re = reference(h2, w, t, 1.3)
    rl.sum().backward()
    assert torch.allclose(logp.cpu(), rl, atol=1e-10) and torch.allclose(ent.cpu(), re, atol=1e-10)
    assert torch.allclose(hc.grad.cpu(), h2.grad, atol=1e-10)
