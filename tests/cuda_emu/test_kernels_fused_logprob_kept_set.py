"""fused_logprob's kept-set replay on the CUDA kernels (cuda/kernels/fused_logprob.cuh: the cut kernel's one
dot product per token, the stats kernel's mask with the target always kept, the finalize kernel's third
stats row, the weight backward's masked logit gradient) and their chunk loop on the emulator, against
the float64 reference and the CPU op.

Each token's kept set is cut halfway across the widest gap among its 20 largest tempered logits (a
top_k/top_p record), so no logit's rounding moves a token across the cut; the target is drawn inside the
set, one token keeps the whole vocabulary (+inf), one has its cut above its own logit (the target kept
alone with what lies above), one is ignored. Bounds: float64, 1e-10 (sums of at most V terms at 2^-53);
float32, the unmasked kernel test's derivation (tests/cuda_emu/test_kernels_fused_logprob.py) with the
masked sums, which have fewer terms.
"""
from __future__ import annotations

import math

import pytest
import torch

from cuda_emu.emulator import peer, U32, assert_within, emu, sum_bound

from fasttrain.ops.reference import fused_logprob as reference

pytestmark = pytest.mark.cuda_emu
V, N = 5_003, 6
# H = 16 keeps the case cheap; H = 520 (> kThreads = 256: three trips, 8 lanes in the last) runs the
# cut kernel's hidden-width loop (h < H, step kThreads) and the other kernels' H loops more than once
WIDTHS = (16, 520)
C = 1_024          # the vocabulary chunk the budget below gives (5 chunks, the last partial)
T = 0.7


def case(dtype, H, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, H, generator=g, dtype=torch.float64) * 2).to(dtype)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5).to(dtype)
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype)
    z = (h.double() @ w.double().T + b.double()) / T
    s, order = z.sort(-1, descending=True)
    j = (s[:, :-1] - s[:, 1:])[:, :20].argmax(1)
    cut = (s.gather(1, j[:, None]) + s.gather(1, j[:, None] + 1))[:, 0] / 2
    pick = (torch.rand(N, generator=g) * (j + 1)).long()
    t = order.gather(1, pick[:, None])[:, 0]
    delta = z.gather(1, t[:, None])[:, 0] - cut
    delta[1] = math.inf                 # the whole vocabulary
    delta[3] = -0.25                    # the cut above the target's own logit: the target still kept
    t[4] = -100
    return h, w, b, t, delta


def reference_grads(h, w, b, t, delta, g):
    hh, ww, bb = (x.double().clone().requires_grad_() for x in (h, w, b))
    logp, ent = reference(hh, ww, t, T, bias=bb, keep_delta=delta)
    (logp * g.double()).sum().backward()
    return logp.detach(), ent.detach(), hh.grad, ww.grad, bb.grad


@pytest.mark.parametrize("H", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kept_set_kernels_match_the_reference_and_the_cpu(dtype, H, schedule):
    h, w, b, t, delta = case(dtype, H)
    d = delta.to(dtype)
    budget = N * C * (4 + 4) * (2 if dtype == torch.float64 else 1)
    lp_e, ent_e, st_e, gv_e = emu().fused_logprob_forward(h, w, t, b, T, -100, True, budget, d)
    lp_c, ent_c, st_c, gv_c = peer().fused_logprob_forward(h, w, t, b, T, -100, True, 0, d)
    assert st_e.shape == (3, N)
    # token 1 (whole vocabulary) carries no upstream gradient: every other token's set bounds dW's rows
    g = torch.tensor([0.5, 0.0, 0.75, 1.5, 2.0, -0.25], dtype=dtype)
    lp_r, ent_r, _, dw_r, db_r = reference_grads(h, w, b, t, delta, g)
    gv_r = reference_grads(h, w, b, t, delta, torch.ones(N))[2]       # d logp_n / d h_n, row by row
    keep = t != -100
    dw_e, db_e = emu().fused_logprob_backward_weight(g, h, w, t, b, st_e, T, -100, budget)
    dw_c, db_c = peer().fused_logprob_backward_weight(g, h, w, t, b, st_c, T, -100, 0)
    if dtype == torch.float64:
        for name, got, want in (("logp", lp_e, lp_r), ("entropy", ent_e, ent_r), ("grad_vec", gv_e, gv_r),
                                ("grad_weight", dw_e, dw_r), ("grad_bias", db_e, db_r), ("logp vs cpu", lp_e, lp_c),
                                ("grad_weight vs cpu", dw_e, dw_c)):
            assert_within(name, got, want, 1e-10)
        return
    z = (h.double() @ w.double().T + b.double()) / T
    e_z = float(sum_bound(H, U32, h.double().abs() @ w.double().abs().T).max()) / T + 2 * U32 * float(z.abs().max())
    g_s = sum_bound(C // 256 + 13 + 3 * 5, U32, 1.0)
    lse = (lp_r - z.gather(1, t.clamp(min=0)[:, None])[:, 0]).abs()
    bound_lp = 2 * e_z + g_s + U32 * (z.abs().max(1).values + lse)
    assert_within("logp", lp_e[keep], lp_r[keep], bound_lp[keep])
    assert torch.equal(lp_e[~keep], torch.zeros(1))
    bound_ent = 2 * bound_lp + g_s * z.abs().max(1).values
    assert_within("entropy", ent_e[keep], ent_r[keep], bound_ent[keep])
    wmax = float(w.double().abs().max())
    bound_gv = (sum_bound(C, U32, 1.0) + 2 * e_z + g_s) * 2 * wmax / T + 2 * U32 * gv_r.abs()
    assert_within("grad_vec", gv_e[keep], gv_r[keep], bound_gv[keep])
    mag = float(g.double().abs().sum()) * 2 * float(h.double().abs().max()) / T
    u_d = U32 + sum_bound(N, U32, 1.0) + 2 * e_z + g_s
    assert_within("grad_weight", dw_e, dw_r, u_d * mag + U32 * dw_r.abs())
    assert_within("grad_bias", db_e, db_r, u_d * float(g.double().abs().sum()) * 2 / T)
    assert_within("logp vs cpu", lp_e, lp_c, 2 * bound_lp)
    # outside every token's kept set, no weight row moves (CPU and emulator alike)
    outside = torch.ones(V, dtype=torch.bool)
    zt = z.gather(1, t.clamp(min=0)[:, None])
    for n in range(N):
        if keep[n] and g[n] != 0:
            inside = (z[n] >= (zt[n] - delta[n])) if math.isfinite(delta[n]) else torch.ones(V, dtype=torch.bool)
            inside[t[n]] = True
            outside &= ~inside
    assert outside.any() and bool((dw_e[outside] == 0).all()) and bool((dw_c[outside] == 0).all())
