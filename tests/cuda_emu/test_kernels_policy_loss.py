"""The policy loss's CUDA kernels (cuda/kernels/policy_loss.cuh: the chunk kernel in each of its
template variants, the finalize kernel, the backward) on the emulator, against the float64
reference on the same float32-rounded inputs and against the CPU op, under two schedules. Rows of
2,500 tokens give each row two chunks of 2,048, the second with 452 tokens for 256 threads.

Bounds: a token's loss and gradient pass through at most 16 float32 roundings (the ratio's
difference and exp, the REPO-R factor, the clip or cap, the products, the k3 KL's exp, differences and
weight, k3_ratio's products by r), each at most u32 of the largest intermediate, which M_t bounds:
|A|·(1 + 20ζ)·max(r, c)·(1 + |log p|) + β·(e^d + |d| + 1) with d = ref − log p, the KL part times
max(r, 1) for k3_ratio (its r·k3 and r·d). The sums add at most 8 tokens per thread, 5 warp
steps and 8 warps in float32 (21 additions; the chunks are added in float64), so a sum's error is at
most gamma_21·Σ|terms| plus the terms' own; the normaliser is exact (0/1 weights below 2^24).
"""
from __future__ import annotations

import math

import pytest
import torch

from fasttrain.ops import reference as R

from cuda_emu.emulator import peer, U, U32, assert_within, emu, sum_bound
from support.policy_batches import (CAP, EPS_HIGH, EPS_LOW, KL, LOSS, ZETA, batch, expected_rowscale,
                                    token_magnitude)

pytestmark = pytest.mark.cuda_emu
OP = torch.ops.fasttrain  # the CPU ops (their own checks); peer(): what the emulator is compared with


@pytest.mark.parametrize("loss", ["cispo", "dapo", "grpo"])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("beta,kl", [(0.0, "k3"), (0.04, "k3"), (0.04, "k3_ratio")])
def test_policy_loss_kernels_match_the_float64_reference_and_the_cpu_op(loss, per_token, beta, kl, schedule):
    B, T = 3, 2500
    logp, old, adv, mask, ref = batch(B, T, 0, per_token)
    args = (adv.float(), mask, ref.float(), None, LOSS[loss], beta, EPS_LOW, EPS_HIGH, CAP, ZETA, 0.0, KL[kl])
    l_e, s_e, c_e, r_e = emu().policy_loss(logp.float(), old.float(), *args)
    l_c, s_c, c_c, r_c = peer().policy_loss(logp.float(), old.float(), *args)
    lp64 = logp.clone().requires_grad_()
    out64, st64 = R.policy_loss(lp64, old, adv, mask, loss=loss, ref_logp=ref, beta=beta, eps_low=EPS_LOW,
                                eps_high=EPS_HIGH, cispo_cap=CAP, zeta=ZETA, kl=kl)
    out64.backward()
    m_t = token_magnitude(logp, old, adv, ref, beta, KL[kl]) * mask
    rowscale = expected_rowscale(mask, loss)
    # gradient = coef · rowscale: the token's roundings plus rowscale's and the product's
    grad_bound = 16 * U32 * m_t * rowscale[:, None] + 3 * U32 * lp64.grad.abs()
    g_e = emu().policy_loss_backward(torch.ones(()), c_e, r_e, torch.float32)
    assert_within("grad", g_e, lp64.grad, grad_bound)
    assert_within("grad vs peer", g_e, peer().policy_loss_backward(torch.ones(()), c_c, r_c, torch.float32),
                  2 * grad_bound)
    assert_within("rowscale", r_e, rowscale, U32 * rowscale)
    loss_bound = float(((sum_bound(21, U32, m_t) + 16 * U32 * m_t) * rowscale[:, None]).sum()) + U32 * abs(out64.item())
    assert_within("loss", l_e, out64, loss_bound)
    assert_within("loss vs peer", l_e, l_c, 2 * loss_bound)
    # the means: Σ w·x_t / Σ w with every x_t below X = 4 here (r <= e^0.7, k3 <= e^0.5 - 1.5 for
    # |d| <= 0.5 and r·k3 <= e^0.7·k3 < 0.31, the factor <= 1 + 20ζ, flags 0/1), each with its 16
    # roundings; the count of active tokens is exact
    X = 4.0
    for i, name in enumerate(R.POLICY_LOSS_STATS):
        want = st64[name].item()
        bound = 0.0 if name == "active_tokens" else (sum_bound(21, U32, X) + 17 * U32 * X)
        assert abs(s_e[i].item() - want) <= bound, (name, s_e[i].item(), want, bound)
        assert abs(s_e[i].item() - s_c[i].item()) <= 2 * bound, (name, s_e[i].item(), s_c[i].item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_policy_loss_backward_rounds_once_to_16_bits(dtype, schedule):
    logp, old, adv, mask, ref = batch(2, 700, 1, False)
    a = [t.to(dtype) for t in (logp, old, ref)]
    args = (adv.float(), mask, a[2], None, 1, 0.04, EPS_LOW, EPS_HIGH, CAP, 0.0, 0.0)
    l_e, s_e, c_e, r_e = emu().policy_loss(a[0], a[1], *args)
    l_c, s_c, c_c, r_c = peer().policy_loss(a[0], a[1], *args)
    m_t = token_magnitude(a[0].double(), a[1].double(), adv, a[2].double(), 0.04) * mask
    assert_within("coef vs peer", c_e, c_c, 2 * 16 * U32 * m_t)
    g_e = emu().policy_loss_backward(torch.ones(()), c_e, r_e, dtype)
    g_c = peer().policy_loss_backward(torch.ones(()), c_c, r_c, dtype)
    # each side: the float32 gradient (its bound) then one rounding to the 16-bit dtype
    g32 = (c_c * r_c[:, None]).double()
    bound = 2 * (16 * U32 * m_t * r_c[:, None].double() + 3 * U32 * g32.abs()) + 2 * U[dtype] * g32.abs()
    assert_within("grad vs peer", g_e, g_c, bound)
    assert not math.isnan(l_e.item())
