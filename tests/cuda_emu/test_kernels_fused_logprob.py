"""fused_logprob's CUDA kernels (cuda/kernels/fused_logprob.cuh: the target check with its
atomicMin, the init, stats and finalize kernels of the forward, the weight backward's logit
gradient with the bias's float atomicAdd) and their chunk loop on the emulator, the GEMMs by at::mm,
over Qwen3.5's 248,320-token vocabulary in four chunks (the last one partial), against the float64
reference and the CPU op, under two schedules.

Bounds, with z the logits: each logit is a GEMM sum of H products accumulated in float32, then the
bias added and 1/T applied, error e_z <= gamma_H·Σ_k|h_k||w_vk| / T + 2u·max|z|. The log-sum-exp adds, per token, at most n_s = C/256 terms per
thread, 13 tree steps and 3 updates per chunk in float32, so log s has at most gamma_{n_s} relative
error, and log p = z_t − lse at most 2·e_z + gamma_{n_s} + u·|lse|; the entropy, lse − Σ p z, twice
that plus gamma_{n_s}·Σ p|z|. The hidden gradient (W[t] − Σ p W) / T takes p~ rounded to the GEMM's
operand type (u_op) and a GEMM sum over a chunk (gamma_C): (u_op + gamma_C + 2·e_z + gamma_{n_s})·
Σ_v p_v|W_v| / T, plus the difference's and the scaling's roundings. The weight gradient D^T h over N tokens: (u_op + gamma_N + 2·e_z + gamma_{n_s})·
Σ_n |g_n|(1[v = t_n] + p_nv)|h_n| / T, then one rounding to the weight's dtype (relative, or half
the subnormal spacing where fp16 underflows).
"""
from __future__ import annotations

import pytest
import torch

from cuda_emu.emulator import peer, U, U32, assert_within, emu, sum_bound

pytestmark = pytest.mark.cuda_emu
OP = torch.ops.fasttrain  # the CPU ops (their own checks); peer(): what the emulator is compared with
V = 248_320  # Qwen3.5's vocabulary
N, H = 3, 16
C = 65_536   # the vocabulary chunk the byte budget below gives (4 chunks; the last 51,712 rows)
U_OP = {torch.float32: U32, torch.float16: U32, torch.bfloat16: U[torch.bfloat16]}  # p~ and D operands
TINY = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}  # subnormal spacing


def chunk_budget(dtype, grad: bool):
    """Bytes for Nb = N tokens x C columns: the fp32 logits, plus p~ in the GEMM's type when grad."""
    op_bytes = 4 if dtype != torch.bfloat16 else 2
    return N * C * (4 + (op_bytes if grad else 0))


def case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, H, generator=g, dtype=torch.float64) * 2).to(dtype)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5).to(dtype)
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype)
    b[5] = -float("inf")  # a banned token
    t = torch.tensor([V - 7, -100, 12345])  # a target in the partial last chunk, an ignored token
    return h, w, b, t


def reference(h, w, b, t, T, g):
    z = (h.double() @ w.double().T + b.double()) / T
    ls = torch.log_softmax(z, -1)
    keep = t != -100
    tc = t.clamp(min=0)
    p = ls.exp()
    logp = torch.where(keep, ls.gather(1, tc[:, None]).squeeze(1), torch.zeros(()).double())
    zf = torch.where(torch.isfinite(z), z, torch.zeros(()).double())
    ent = torch.where(keep, -(torch.where(p > 0, p * ls, torch.zeros(()).double())).sum(1), torch.zeros(()).double())
    onehot = torch.nn.functional.one_hot(tc, V).double()
    gv = torch.where(keep[:, None], (w.double()[tc] - p @ w.double()) / T, torch.zeros(()).double())
    dlogit = torch.where(keep[:, None], g[:, None] * (onehot - p) / T, torch.zeros(()).double())
    return dict(z=z, zf=zf, p=p, keep=keep, onehot=onehot, logp=logp, ent=ent, gv=gv, dw=dlogit.T @ h.double(),
                db=dlogit.sum(0), lse=torch.logsumexp(z, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_logprob_kernels_over_a_248k_vocabulary(dtype, schedule):
    T = 0.7
    h, w, b, t = case(dtype)
    lp_e, ent_e, st_e, gv_e = emu().fused_logprob_forward(h, w, t, b, T, -100, True, chunk_budget(dtype, True))
    lp_c, ent_c, st_c, gv_c = peer().fused_logprob_forward(h, w, t, b, T, -100, True, 0)
    g = torch.tensor([0.5, 0.0, -1.25])
    r = reference(h, w, b, t, T, g.double())
    # the GEMM's sum, then the bias's addition and the scaling by 1/T
    e_z = (float(sum_bound(H, U32, h.double().abs() @ w.double().abs().T).max()) / T
           + 2 * U32 * float(r["zf"].abs().max()))
    n_s = C // 256 + 13 + 3 * 4
    g_s = sum_bound(n_s, U32, 1.0)
    keep = r["keep"]
    bound_lp = 2 * e_z + g_s + U32 * r["lse"].abs()
    assert_within("logp", lp_e[keep], r["logp"][keep], bound_lp[keep])
    assert torch.equal(lp_e[~keep], torch.zeros(1)) and torch.equal(ent_e[~keep], torch.zeros(1))
    bound_ent = 2 * bound_lp + g_s * (r["p"] * r["zf"].abs()).sum(1)
    assert_within("entropy", ent_e[keep], r["ent"][keep], bound_ent[keep])
    pw = r["p"] @ w.double().abs()  # Σ_v p_v |W_v| per token and column
    bound_gv = (U_OP[dtype] + sum_bound(C, U32, 1.0) + 2 * e_z + g_s) * pw / T + 2 * U32 * r["gv"].abs()
    assert_within("grad_vec", gv_e[keep], r["gv"][keep], bound_gv[keep])
    assert_within("logp vs peer", lp_e, lp_c, 2 * bound_lp)
    assert_within("grad_vec vs peer", gv_e, gv_c, 2 * bound_gv + 2 * U[dtype] * r["gv"].abs())
    # the weight gradient (and the bias's, through the kernel's float atomicAdd)
    dw_e, db_e = emu().fused_logprob_backward_weight(g, h, w, t, b, st_e, T, -100, chunk_budget(dtype, True))
    mag = ((r["onehot"] + r["p"]) * (g.double().abs() * keep)[:, None]).T / T  # [V, N]
    u_d = U_OP[dtype] + sum_bound(N, U32, 1.0) + 2 * e_z + g_s
    bound_dw = u_d * (mag @ h.double().abs()) + U[dtype] * r["dw"].abs() + TINY[dtype] / 2
    assert_within("grad_weight", dw_e, r["dw"], bound_dw)
    assert_within("grad_bias", db_e, r["db"], u_d * mag.sum(1))
    dw_c, db_c = peer().fused_logprob_backward_weight(g, h, w, t, b, st_c, T, -100, 0)
    assert_within("grad_weight vs peer", dw_e, dw_c, 2 * bound_dw)


def test_an_out_of_range_target_raises_the_cpu_error_at_its_first_position(schedule):
    h, w, b, _ = case(torch.float32)
    t = torch.tensor([3, V + 2, -5])  # two bad targets: the first position is the one named
    for ops in (emu(), peer()):
        with pytest.raises(RuntimeError, match=rf"holds {V + 2} at position 1, outside \[0, {V}\)"):
            ops.fused_logprob_forward(h, w, t, b, 1.0, -100, False, 0)
