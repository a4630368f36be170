"""fasttrain.ops.decode_fused (a decode step's norm, rotary + cache write, SwiGLU) against float64
definitions and the modules' own rounding.

The ops round where HF's eager modules round, so the oracles are of two kinds:
- where every step is a correctly rounded IEEE product or sum (the rotary embedding, the residual
  add), the composition of those steps in the input dtype (fasttrain.ops.reference, which runs the
  same steps one op at a time) is one exact value on every host: the kernel must give its bits;
- where a sum or an exp comes in (RMSNorm's mean of squares, SiLU's exp), the float64 value of the
  formula from the same inputs, with a bound derived per element (u = 2^-24 float32 unit roundoff,
  u_d the input dtype's):
  RMSNorm y = rnd(w·rnd(x·r)): the sum of H squares in float32 is off by at most H·u relative (all
  terms positive), the mean, the +eps, the sqrt and the reciprocal add 4u (sqrt halves what it is
  given), x·r one more u, then two roundings to the dtype: |y - y64| <= ((1 + u_d)^2 (1 + (H + 5)u) - 1)|y64|.
  SwiGLU a = rnd(rnd(silu(g))·u): exp within 2u (Sleef's 1 ulp, or libm's), 1 + e^-g and the
  quotient 2u more, so silu within 4u relative, then two roundings: ((1 + u_d)^2 (1 + 4u) - 1)|a64|.
  (The product w·n and rnd(silu)·up of two bf16 values is exact in float32 before its rounding.)
  A rounding into the dtype's subnormal range is off by half its smallest step (eta) instead of
  u_d relative: each of the two roundings adds eta, the first one scaled by the factor after it.
"""
import pytest
import torch

from fasttrain.ops import add_rms_norm_, decode_fused_backend, reference, rms_norm, rotary_cache_write_, silu_mul
from fasttrain.ops.kernels import use_kernels
from fasttrain.selftest.bounds import U

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TINY = 2.0 ** -126 * 8      # an absolute floor at float32's normal range (values here are O(1))
ETA = {dt: torch.finfo(dt).smallest_normal * torch.finfo(dt).eps / 2 for dt in DTYPES}   # half a subnormal step


def _within(y: torch.Tensor, ref64: torch.Tensor, rel: float, floor=0.0) -> None:
    err = (y.double() - ref64).abs()
    bound = rel * ref64.abs() + floor + TINY
    assert (err <= bound).all(), float((err - bound).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,H", [(48, 576), (5, 64), (3, 100), (1, 37)])
def test_rms_norm_is_the_float64_norm_rounded_as_the_module_rounds(dtype, N, H):
    g = torch.Generator().manual_seed(N * H)
    x = (torch.randn(N, H, generator=g) * 3).to(dtype)
    w = (torch.rand(H, generator=g) + 0.5).to(dtype)
    eps = 1e-5
    y = rms_norm(x, w, eps)
    assert decode_fused_backend(x) == "kernel" and y.dtype == dtype and y.shape == (N, H)
    x64 = x.double()
    ref = w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    u, ud = U[torch.float32], U[dtype]
    _within(y, ref, (1 + ud) ** 2 * (1 + (H + 5) * u) - 1, ETA[dtype] * (w.double().abs() + 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_adds_in_place_with_the_dtypes_rounding_then_norms(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(48, 576, generator=g).to(dtype)
    d = torch.randn(48, 576, generator=g).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    want_x = x + d                                   # one correctly rounded sum in the dtype
    xk = x.clone()
    y = add_rms_norm_(xk, d, w, 1e-6)
    assert torch.equal(xk, want_x)
    # the norm of the updated x is rms_norm's (same kernel, same sums)
    assert torch.equal(y, rms_norm(want_x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,heads,kv,D", [(48, 9, 3, 64), (5, 4, 2, 16), (3, 6, 2, 40), (2, 2, 1, 6)])
def test_rotary_cache_write_gives_the_modules_bits_and_touches_one_column(dtype, B, heads, kv, D):
    g = torch.Generator().manual_seed(B * D)
    qkv = torch.randn(B, (heads + 2 * kv) * D, generator=g).to(dtype)
    pos = torch.randint(0, 500, (B, 1), generator=g).double()
    inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.cat([pos * inv, pos * inv], dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    S, col = 11, 6
    cache = torch.randn(3, 2, B, kv, S, D, generator=g).to(dtype)     # layer 1 of a [L, 2, B, kv, S, D] cache
    mine, theirs = cache.clone(), cache.clone()
    q = rotary_cache_write_(qkv, cos, sin, mine[1][0], mine[1][1], col, heads)
    q_ref = reference.rotary_cache_write_(qkv, cos, sin, theirs[1][0], theirs[1][1], col, heads)
    assert q.shape == (B, kv, heads // kv, D) and q.is_contiguous()
    assert torch.equal(q, q_ref)
    assert torch.equal(mine, theirs)                                 # column `col` of layer 1, nothing else
    before = cache.clone()
    before[1, :, :, :, col] = mine[1, :, :, :, col]
    assert torch.equal(mine, before)
    # and the exact products and sums are what the rotation means: within rounding of float64
    q64 = qkv.double().view(B, -1, D)[:, :heads]
    half = D // 2
    rot = torch.cat([-q64[..., half:], q64[..., :half]], dim=-1)
    ref64 = q64 * cos.double()[:, None] + rot * sin.double()[:, None]
    ud = U[dtype]
    scale = q64.abs() * cos.double().abs()[:, None] + rot.abs() * sin.double().abs()[:, None]
    err = (q.double().view(B, heads, D) - ref64).abs()
    assert (err <= 3 * ud * scale + TINY).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,heads,kv,D", [(48, 16, 8, 128), (3, 6, 2, 40), (2, 2, 1, 6)])
def test_rotary_cache_write_with_qk_norms_is_the_norm_then_the_rotation(dtype, B, heads, kv, D):
    """Qwen3's per-head q/k RMSNorm before the rotation: the fused op equals rms_norm (itself checked
    against float64 above) of each q and k head followed by the exact rotation, bit for bit."""
    g = torch.Generator().manual_seed(B + D)
    qkv = (torch.randn(B, (heads + 2 * kv) * D, generator=g) * 2).to(dtype)
    cos, sin = (torch.rand(2, B, D, generator=g) * 2 - 1).to(dtype)
    qn, kn = (torch.rand(2, D, generator=g) + 0.5).to(dtype)
    cache = torch.randn(2, B, kv, 5, D, generator=g).to(dtype)
    mine, theirs = cache.clone(), cache.clone()
    q = rotary_cache_write_(qkv, cos, sin, mine[0], mine[1], 2, heads, qn, kn, 1e-6)
    x = qkv.view(B, -1, D)
    normed = torch.cat([rms_norm(x[:, :heads].reshape(-1, D), qn, 1e-6).view(B, heads, D),
                        rms_norm(x[:, heads:heads + kv].reshape(-1, D), kn, 1e-6).view(B, kv, D),
                        x[:, heads + kv:]], dim=1).reshape(B, -1)
    want = reference.rotary_cache_write_(normed, cos, sin, theirs[0], theirs[1], 2, heads)
    assert torch.equal(q, want) and torch.equal(mine, theirs)
    with pytest.raises(RuntimeError, match="q_norm"):
        torch.ops.fasttrain.rotary_cache_write_(qkv, cos, sin, mine[0], mine[1], 2, heads, qn[:-1], kn, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,I", [(48, 1536), (3, 40), (1, 7)])
def test_silu_mul_is_the_float64_swiglu_rounded_as_the_modules_round(dtype, N, I):
    g = torch.Generator().manual_seed(N + I)
    gu = (torch.randn(N, 2 * I, generator=g) * 3).to(dtype)
    a = silu_mul(gu)
    assert a.shape == (N, I) and a.dtype == dtype
    g64, u64 = gu.double()[:, :I], gu.double()[:, I:]
    ref = g64 / (1 + torch.exp(-g64)) * u64
    u, ud = U[torch.float32], U[dtype]
    _within(a, ref, (1 + ud) ** 2 * (1 + 4 * u) - 1, ETA[dtype] * (u64.abs() + 1))


def test_threads_give_the_same_bits():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 576, generator=g).bfloat16()
    w = (torch.rand(576, generator=g) + 0.5).bfloat16()
    gu = torch.randn(64, 3072, generator=g).bfloat16()
    qkv = torch.randn(64, 15 * 64, generator=g).bfloat16()
    cs = torch.randn(64, 64, generator=g).bfloat16()
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            cache = torch.zeros(2, 64, 3, 9, 64, dtype=torch.bfloat16)
            outs.append((rms_norm(x, w, 1e-5), silu_mul(gu), rotary_cache_write_(qkv, cs, cs, cache[0], cache[1], 4, 9),
                         cache))
    finally:
        torch.set_num_threads(threads)
    for o in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], o))


def test_the_reference_face_and_bad_inputs_are_named():
    x = torch.randn(4, 32)
    w = torch.rand(32) + 0.5
    with use_kernels("reference"):
        assert decode_fused_backend(x) == "reference"
        torch.testing.assert_close(rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), rtol=0, atol=0)
    assert decode_fused_backend(x.double()) == "reference"       # float64: the reference formulas
    assert decode_fused_backend(x.requires_grad_()) == "reference"
    x = x.detach()
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.fasttrain.rms_norm(x, torch.ones(31), 1e-5)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.fasttrain.rms_norm(x, torch.ones(32, dtype=torch.bfloat16), 1e-5)
    cache = torch.zeros(2, 4, 2, 5, 8)
    with pytest.raises(RuntimeError, match="qkv"):
        torch.ops.fasttrain.rotary_cache_write_(torch.zeros(4, 8 * 7), torch.zeros(4, 8), torch.zeros(4, 8),
                                                cache[0], cache[1], 0, 4)
    with pytest.raises(RuntimeError, match="column"):
        torch.ops.fasttrain.rotary_cache_write_(torch.zeros(4, 8 * 8), torch.zeros(4, 8), torch.zeros(4, 8),
                                                cache[0], cache[1], 5, 4)
    with pytest.raises(RuntimeError, match="gate_up"):
        torch.ops.fasttrain.silu_mul(torch.zeros(3, 5))
