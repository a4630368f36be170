"""Real-shape cases for the kernels whose other emulator tests leave a block-stride loop at one trip:
the fused log-prob's hidden-width loops and the policy loss's per-row loops of its finalize kernel.
Each shape is the smallest that runs every such loop at least twice, with a partial last trip (idle
lanes), checked against the float64 reference: outputs, gradients and the statistics the finalize
kernels write. The grid-stride loops of every kernel run twice through the emulator's grid cap
(emulator.GRID_CAP blocks, set when the module loads). Kept apart from test_kernels_*.py so that
those files' calls stay as their ops' schemas grow.

Which shape covers which loop (kThreads = 256 in both files; the other kernels' loops: docs/building.md):

  kernel (fused_logprob.cuh)        loop                           shape that runs it >= 2 times
  logprob_stats_kernel              j < cs, step kThreads          C = 512 (chunks 512, 512, 76: the last
                                                                   one below a block: idle lanes)
  logprob_stats_kernel (ignored t)  j < cs, step kThreads          the same, token 1 (ignore_index)
  logprob_stats_kernel (rescale)    h < H, step kThreads           H = 520 (3 trips, 8 in the last), the
                                                                   largest logit in the last chunk, so
                                                                   the reference moves there (alpha != 1)
  logprob_finalize_kernel           h < H, step blockDim.x         H = 520
  first_bad_target_kernel           n < N, grid stride             N = 600 tokens > GRID_CAP x 256
  (launch sequence)                 token blocks of Nb             budget giving C = 256, Nb = 2 of N = 5

  kernel (policy_loss.cuh)          loop                           shape
  policy_finalize_kernel            b < B, step kThreads (x2)      B = 300 rows (2 trips, 44 in the last)
  policy_chunk_kernel               t < end, step kThreads         T = 2,500 in test_kernels_policy_loss
  policy_backward_kernel            i < n, grid stride             B x T = 1,500 > GRID_CAP x 256

Bounds are those of test_kernels_fused_logprob.py and test_kernels_policy_loss.py (derived there),
with this file's H, C and chunk counts.
"""
from __future__ import annotations

import pytest
import torch

from fasttrain.ops import reference as R

from cuda_emu.emulator import GRID_CAP, U, U32, assert_within, emu, module, peer, sum_bound
from support.policy_batches import (CAP, EPS_HIGH, EPS_LOW, LOSS, ZETA, batch, expected_rowscale,
                                    token_magnitude)

pytestmark = pytest.mark.cuda_emu
THREADS = 256  # kThreads of both kernels' files

# ---- fused log-prob ------------------------------------------------------------------------------
FN, FH, FV = 5, 520, 1100
U_OP = {torch.float32: U32, torch.float16: U32, torch.bfloat16: U[torch.bfloat16]}
TINY = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}


def per_elem(dtype):
    """Scratch bytes per logit with the gradient: the fp32 logit and p~ (or D) in the GEMM's type."""
    return 4 + (2 if dtype == torch.bfloat16 else 4)


# budget name -> (bytes for the dtype, C, Nb) as pick_blocks (fused_logprob.cuh) derives them
BUDGETS = {
    "chunk512": (lambda dt: FN * 512 * per_elem(dt), 512, FN),
    "chunk256-tokens2": (lambda dt: 2 * 256 * per_elem(dt), 256, 2),
}


def logprob_case(dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(FN, FH, generator=g, dtype=torch.float64) * 2 / FH**0.25).to(dtype)
    w = (torch.randn(FV, FH, generator=g, dtype=torch.float64) / FH**0.5).to(dtype)
    b = torch.randn(FV, generator=g, dtype=torch.float64).to(dtype)
    b[5] = -float("inf")   # a banned token
    b[1050] = 9.0          # the largest logit of every token in the last chunk: its reference moves there
    t = torch.tensor([FV - 7, -100, 700, 3, 1099])
    return h, w, b, t


def logprob_reference(h, w, b, t, T, g):
    V = w.shape[0]
    z = (h.double() @ w.double().T + b.double()) / T
    ls = torch.log_softmax(z, -1)
    keep = t != -100
    tc = t.clamp(min=0)
    p = ls.exp()
    zero = torch.zeros((), dtype=torch.float64)
    logp = torch.where(keep, ls.gather(1, tc[:, None]).squeeze(1), zero)
    zf = torch.where(torch.isfinite(z), z, zero)
    ent = torch.where(keep, -(torch.where(p > 0, p * ls, zero)).sum(1), zero)
    onehot = torch.nn.functional.one_hot(tc, V).double()
    gv = torch.where(keep[:, None], (w.double()[tc] - p @ w.double()) / T, zero)
    dlogit = torch.where(keep[:, None], g[:, None] * (onehot - p) / T, zero)
    return dict(zf=zf, p=p, keep=keep, onehot=onehot, logp=logp, ent=ent, gv=gv, dw=dlogit.T @ h.double(),
                db=dlogit.sum(0), lse=torch.logsumexp(z, -1))


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_logprob_at_a_hidden_width_of_two_blocks_and_three_chunks(dtype, budget, schedule):
    T = 0.8
    nbytes, C, Nb = BUDGETS[budget]
    nbytes = nbytes(dtype)
    h, w, b, t = logprob_case(dtype)
    lp_e, ent_e, st_e, gv_e = emu().fused_logprob_forward(h, w, t, b, T, -100, True, nbytes)
    g = torch.tensor([0.5, 0.75, -1.25, 2.0, -0.3])
    r = logprob_reference(h, w, b, t, T, g.double())
    chunks = -(-FV // C)
    e_z = (float(sum_bound(FH, U32, h.double().abs() @ w.double().abs().T).max()) / T
           + 2 * U32 * float(r["zf"].abs().max()))
    n_s = -(-C // THREADS) + 13 + 3 * chunks
    g_s = sum_bound(n_s, U32, 1.0)
    keep = r["keep"]
    bound_lp = 2 * e_z + g_s + U32 * r["lse"].abs()
    assert_within("logp", lp_e[keep], r["logp"][keep], bound_lp[keep])
    assert torch.equal(lp_e[~keep], torch.zeros(1)) and torch.equal(ent_e[~keep], torch.zeros(1))
    bound_ent = 2 * bound_lp + g_s * (r["p"] * r["zf"].abs()).sum(1)
    assert_within("entropy", ent_e[keep], r["ent"][keep], bound_ent[keep])
    # the statistics the finalize kernel writes: the reference (a finite value no logit exceeds by
    # more than the rebasing allows) and log s, whose sum is the log-sum-exp; 0, 0 for an ignored token
    assert torch.equal(st_e[:, ~keep], torch.zeros(2, 1))
    assert bool(torch.isfinite(st_e[:, keep]).all())
    assert_within("ref + log s", (st_e[0] + st_e[1])[keep], r["lse"][keep],
                  (e_z + g_s + 2 * U32 * r["lse"].abs())[keep])
    pw = r["p"] @ w.double().abs()
    bound_gv = (U_OP[dtype] + sum_bound(C, U32, 1.0) + 2 * e_z + g_s) * pw / T + 2 * U32 * r["gv"].abs()
    assert_within("grad_vec", gv_e[keep], r["gv"][keep], bound_gv[keep])
    assert torch.equal(gv_e[~keep], torch.zeros(1, FH))
    # the weight and bias gradients, chunked the same way
    dw_e, db_e = emu().fused_logprob_backward_weight(g, h, w, t, b, st_e, T, -100, nbytes)
    mag = ((r["onehot"] + r["p"]) * (g.double().abs() * keep)[:, None]).T / T
    u_d = U_OP[dtype] + sum_bound(FN, U32, 1.0) + 2 * e_z + g_s
    bound_dw = u_d * (mag @ h.double().abs()) + U[dtype] * r["dw"].abs() + TINY[dtype] / 2
    assert_within("grad_weight", dw_e, r["dw"], bound_dw)
    assert_within("grad_bias", db_e, r["db"], u_d * mag.sum(1))


def test_the_first_bad_target_is_found_past_the_first_grid_stride():
    """600 targets over GRID_CAP blocks of 256 threads: positions 512.. are reached by the second trip."""
    assert module().grid_cap() == GRID_CAP and 600 > GRID_CAP * THREADS
    h, w, b, _ = logprob_case(torch.float32)
    n = 600
    hh = h[torch.arange(n) % FN]
    t = torch.arange(n) % FV
    t[590], t[597] = FV + 4, -3  # the first bad position lies in the grid stride's second trip
    with pytest.raises(RuntimeError, match=rf"holds {FV + 4} at position 590, outside \[0, {FV}\)"):
        emu().fused_logprob_forward(hh, w, t, b, 1.0, -100, False, 0)


# ---- policy loss ---------------------------------------------------------------------------------
@pytest.mark.parametrize("loss", ["grpo", "dapo"])
def test_policy_loss_finalize_over_more_rows_than_threads(loss, schedule):
    B, T = 300, 5
    logp, old, adv, mask, ref = batch(B, T, 11, False)
    mask[7] = False  # a second empty row, in the finalize loop's first trip (the last one is in the second)
    beta = 0.04
    args = (adv.float(), mask, ref.float(), None, LOSS[loss], beta, EPS_LOW, EPS_HIGH, CAP, ZETA, 0.0)
    l_e, s_e, c_e, r_e = emu().policy_loss(logp.float(), old.float(), *args)  # kl_type left at the schema default: k3
    lp64 = logp.clone().requires_grad_()
    out64, st64 = R.policy_loss(lp64, old, adv, mask, loss=loss, ref_logp=ref, beta=beta, kl="k3", eps_low=EPS_LOW,
                                eps_high=EPS_HIGH, cispo_cap=CAP, zeta=ZETA)
    out64.backward()
    m_t = token_magnitude(logp, old, adv, ref, beta) * mask
    rowscale = expected_rowscale(mask, loss)
    # every row's scale is written (a row the finalize loop skipped would keep the scratch's poison)
    assert_within("rowscale", r_e, rowscale, U32 * rowscale)
    if loss == "grpo":
        assert torch.equal(r_e[[7, B - 1]], torch.zeros(2))
    grad_bound = 16 * U32 * m_t * rowscale[:, None] + 3 * U32 * lp64.grad.abs()
    g_e = emu().policy_loss_backward(torch.ones(()), c_e, r_e, torch.float32)
    assert_within("grad", g_e, lp64.grad, grad_bound)
    loss_bound = float(((sum_bound(21, U32, m_t) + 16 * U32 * m_t) * rowscale[:, None]).sum()) + U32 * abs(out64.item())
    assert_within("loss", l_e, out64, loss_bound)
    # the finalize kernel's means over B x nc chunk partials (B x nc = 300 > 256 threads)
    X = 4.0
    for i, name in enumerate(R.POLICY_LOSS_STATS):
        want = st64[name].item()
        bound = 0.0 if name == "active_tokens" else (sum_bound(21, U32, X) + 17 * U32 * X)
        assert abs(s_e[i].item() - want) <= bound, (name, s_e[i].item(), want, bound)
    l_c, s_c, c_c, r_c = peer().policy_loss(logp.float(), old.float(), *args)
    assert_within("loss vs peer", l_e, l_c, 2 * loss_bound)
