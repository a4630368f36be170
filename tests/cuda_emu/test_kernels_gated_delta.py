"""The gated delta rule's CUDA kernels (cuda/kernels/gated_delta.cuh: forward, backward, the decode
step with held rows) on the emulator against the float64 reference recurrence and the CPU op, under
two schedules, at the head shapes real models use: Qwen3.5-27B's (Dk = Dv = 128, 48 value heads
over 16 key heads: four warps per CTA), unequal head dims (128/64, 64/128), a head dim of 96 (three
warps), one of 40 (a partial second warp: idle threads), and head dims of 1,056 beside 32 (blocks
of 1,024 threads: the row and column loops run a second, partial trip). Five tokens with checkpoint_every = 4
leave a partial span in the backward.

Bounds (the selftest's derivation, fasttrain/selftest/cases/gated_delta.py): the recurrence is
non-expansive, so an error made anywhere is carried without growth and the kernel's error is at most
the sum of its roundings, L = T(Dk + 4) + Dk of them, each at most u of S_max (the largest state
column norm the inputs allow) or O_max = scale·‖q‖·S_max for the outputs: tol = 2·e_plain + 4·L·u·M,
with e_plain the error of the plain recurrence run in the kernel's precision; gradients take the
largest reference gradient of each input as M.
"""
from __future__ import annotations

import pytest
import torch

from fasttrain.ops import reference as R

from cuda_emu.emulator import peer, U, assert_within, emu, module

pytestmark = pytest.mark.cuda_emu
OP = torch.ops.fasttrain  # the CPU ops (their own checks); peer(): what the emulator is compared with
C = 4
# (B, T, Hk, Hv, Dk, Dv)
SHAPES = {
    "qwen3.5-27b": (1, 5, 16, 48, 128, 128),
    "dk128-dv64": (2, 5, 2, 4, 128, 64),
    "dk64-dv128": (1, 5, 2, 4, 64, 128),
    "d96": (1, 5, 1, 2, 96, 96),
    "d40": (2, 5, 1, 1, 40, 40),
    # Above 1,024 a block has 1,024 threads (threads_for), so the row loops (i < Dk) and the column
    # loops (j < Dv) run twice, the second trip with 32 of 1,024 threads; at every head dim up to
    # 1,024 they run once. Not a model's head, the one shape that runs those loops again.
    "dk1056-dv32": (1, 5, 1, 1, 1056, 32),
    "dk32-dv1056": (1, 5, 1, 1, 32, 1056),
}


def inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, Dk, generator=g, dtype=torch.float64).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, Dk, generator=g, dtype=torch.float64), dim=-1).to(dtype)
    v = torch.randn(B, T, Hv, Dv, generator=g, dtype=torch.float64).to(dtype)
    gl = (-torch.rand(B, T, Hv, generator=g, dtype=torch.float64) * 1.5).to(dtype)
    beta = torch.rand(B, T, Hv, generator=g, dtype=torch.float64).to(dtype)
    s0 = torch.randn(B, Hv, Dk, Dv, generator=g, dtype=torch.float64).to(dtype)
    do = torch.randn(B, T, Hv, Dv, generator=g, dtype=torch.float64).to(dtype)
    dS = torch.randn(B, Hv, Dk, Dv, generator=g, dtype=torch.float64).to(dtype)
    return [q, k, v, gl, beta, s0], do, dS


def magnitudes(q, k, v, beta, s0, scale):
    """(S_max, O_max): the largest state column norm the inputs allow and the output's bound."""
    col = (beta.double()[..., None] * v.double().abs()).sum(1) + s0.double().norm(dim=2)
    s_max = float(col.max())
    return s_max, float(scale * q.double().norm(dim=-1).max() * s_max)


def reference(ins, do, dS, scale, dtype):
    """(o, S, grads) of the plain recurrence on these inputs in `dtype` (float64: the oracle)."""
    xs = [t.detach().to(dtype).requires_grad_() for t in ins]
    o, S = R.gated_delta_rule(*xs[:5], scale=scale, initial_state=xs[5])
    ((o * do.to(dtype)).sum() + (S * dS.to(dtype)).sum()).backward()
    return o.detach(), S.detach(), [x.grad for x in xs]


def kernel_pass(ops, ins, do, dS, scale):
    q, k, v, gl, beta, s0 = ins
    o, S, ck = ops.gated_delta_forward(q, k, v, gl, beta, s0, scale, C, True)
    dq, dk, dv, dg, db, ds0 = ops.gated_delta_backward(do, dS, q, k, v, gl, beta, ck, scale, C)
    B, T, Hk, Dk = q.shape
    rep = v.shape[2] // Hk
    dq, dk = dq.view(B, T, Hk, rep, Dk).sum(3), dk.view(B, T, Hk, rep, Dk).sum(3)
    return o, S, [dq, dk, dv, dg, db, ds0]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gated_delta_forward_and_backward_match_the_reference_and_the_cpu_op(shape, schedule):
    B, T, Hk, Hv, Dk, Dv = SHAPES[shape]
    dtype = torch.float64 if shape == "d40" else torch.float32
    ins, do, dS = inputs(B, T, Hk, Hv, Dk, Dv, dtype)
    scale = Dk**-0.5
    o_e, S_e, g_e = kernel_pass(emu(), ins, do, dS, scale)
    o_c, S_c, g_c = kernel_pass(peer(), ins, do, dS, scale)
    o_r, S_r, g_r = reference(ins, do, dS, scale, torch.float64)
    o_p, S_p, g_p = reference(ins, do, dS, scale, dtype)
    f = 4 * (T * (Dk + 4) + Dk) * U[dtype]
    s_max, o_max = magnitudes(ins[0], ins[1], ins[2], ins[4], ins[5], scale)

    def tol(plain, ref, m):
        return 2 * float((plain.double() - ref.double()).abs().max()) + f * m

    for name, e, c, r, p, m in [("o", o_e, o_c, o_r, o_p, o_max), ("state", S_e, S_c, S_r, S_p, s_max)]:
        t = tol(p, r, m)
        assert_within(name, e, r, t)
        assert_within(name + " vs peer", e, c, 2 * t)
    for name, e, c, r, p in zip(["dq", "dk", "dv", "dg", "dbeta", "dstate"], g_e, g_c, g_r, g_p):
        t = tol(p, r, float(r.abs().max()))
        assert_within(name, e, r, t)
        assert_within(name + " vs peer", e, c, 2 * t)


@pytest.mark.parametrize("shape", ["qwen3.5-27b", "dk128-dv64", "d96", "dk1056-dv32", "dk32-dv1056"])
def test_the_decode_step_advances_active_rows_and_holds_the_others(shape, schedule):
    _, _, Hk, Hv, Dk, Dv = SHAPES[shape]
    B = 3
    ins, _, _ = inputs(B, 1, Hk, Hv, Dk, Dv, torch.float32, seed=2)
    q, k, v, gl, beta, s0 = ins
    active = torch.tensor([True, False, True])
    scale = Dk**-0.5
    state_e, state_c = s0.clone(), s0.clone()
    o_e = emu().gated_delta_decode_(state_e, q, k, v, gl, beta, active, scale)
    o_c = peer().gated_delta_decode_(state_c, q, k, v, gl, beta, active, scale)
    o_r, S_r = R.gated_delta_step(*[t[:, 0].double() for t in (q, k, v, gl, beta)], s0.double(), scale=scale)
    assert torch.equal(state_e[1], s0[1]) and torch.equal(o_e[1], torch.zeros_like(o_e[1]))  # held bit for bit
    s_max, o_max = magnitudes(q, k, v, beta, s0, scale)
    f = 4 * (2 * Dk + 4) * U[torch.float32]
    on = active
    assert_within("o", o_e[on, 0], o_r[on], f * o_max)
    assert_within("state", state_e[on], S_r[on], f * s_max)
    assert_within("o vs peer", o_e, o_c, 2 * f * o_max)
    assert_within("state vs peer", state_e, state_c, 2 * f * s_max)


def test_the_backward_scratch_holds_one_span_of_at_most_the_sequence():
    B, T, Hk, Hv, Dk, Dv = 1, 5, 1, 2, 32, 16
    ins, do, dS = inputs(B, T, Hk, Hv, Dk, Dv, torch.float32)
    q, k, v, gl, beta, s0 = ins
    every = 64  # a checkpoint interval longer than the sequence
    _, _, ck = emu().gated_delta_forward(q, k, v, gl, beta, s0, 0.5, every, True)
    emu().gated_delta_backward(do, dS, q, k, v, gl, beta, ck, 0.5, every)
    span = min(every, T)
    want = B * Hv * ((span + 1) * Dk * Dv + 2 * span * Dv) * 4
    assert module().last_scratch_bytes() == want


def test_cuda_refuses_a_checkpoint_interval_above_its_cap():
    ins, do, dS = inputs(1, 3, 1, 1, 8, 8, torch.float32)
    q, k, v, gl, beta, s0 = ins
    with pytest.raises(RuntimeError, match="at most 256 on CUDA"):
        emu().gated_delta_forward(q, k, v, gl, beta, s0, 0.5, 257, True)
    ck = torch.zeros(1, 1, 1, 8, 8)
    with pytest.raises(RuntimeError, match="at most 256 on CUDA"):
        emu().gated_delta_backward(do, dS, q, k, v, gl, beta, ck, 0.5, 257)


@pytest.mark.parametrize("dk,dv", [(0, 8), (8, 0)])
@pytest.mark.parametrize("backend", ["cpu", "emulator"])
def test_a_zero_head_dim_is_refused_with_a_message(dk, dv, backend):
    ops = OP if backend == "cpu" else emu()
    q = torch.zeros(1, 3, 1, dk)
    v = torch.zeros(1, 3, 2, dv)
    g, beta = torch.zeros(1, 3, 2), torch.zeros(1, 3, 2)
    with pytest.raises(RuntimeError, match="head dims of at least 1"):
        ops.gated_delta_forward(q, q, v, g, beta, None, 0.5, 2, True)
    ck = torch.zeros(1, 2, 2, dk, dv)
    with pytest.raises(RuntimeError, match="head dims of at least 1"):
        ops.gated_delta_backward(torch.zeros_like(v), None, q, q, v, g, beta, ck, 0.5, 2)
