"""The NF4 linear's forward on the emulator (cuda/kernels/nf4_linear.cuh): the LoRA factor x·Aᵀ, the
decode path's split-K tile kernel in both row widths and its epilogue with the LoRA term and DoRA's
scale, the prefill path's decode of W into scratch, its GEMMs through the device seam (at::mm here)
and its epilogue; and the DoRA norm kernel. Against float64 and the CPU op, under two schedules,
with the SM count of an H200 (132) so that the launch sequence picks the split-K a GPU would: a
5120-wide input (Qwen3.5-27B's hidden size) gives 16 splits of 5 tiles for 256 outputs.

Bounds: W is decoded to x's dtype as the kernel does (exact in float32, one rounding in bf16: the
reference decodes the same way), so the error is the float32 sum of K products plus the splits'
sum (gamma_{K + splits}·Σ|x||W|), the LoRA term's r + 2 float32 operations (gamma_{r+2}·s·Σ|xa||B|),
DoRA's product and the output's rounding (u_out·|y|).
"""
from __future__ import annotations

import pytest
import torch

from cuda_emu.emulator import peer, U, U32, assert_within, emu, module, sum_bound

pytestmark = pytest.mark.cuda_emu
OP = torch.ops.fasttrain  # the CPU ops (their own checks); peer(): what the emulator is compared with
BS = 64


@pytest.fixture(autouse=True)
def _h200_sms():
    module().set_multiprocessors(132)
    yield


def splits_for(N, K, sms=132):
    """The launch sequence's split-K, restated: about two waves of SMs, whole 64-column tiles."""
    blocks_n, ktiles = -(-N // 64), -(-K // 64)
    splits = max(1, min(-(-2 * sms // blocks_n), ktiles, 16))
    per = -(-ktiles // splits)
    return -(-ktiles // per)


def operands(M, N, K, adapter, dtype, r=8):
    """x, the NF4 weight, LoRA's A [r, K] and B [N, r] (None without adapters), DoRA's m [N] (or None)
    and its scale g = m / ‖W + s·B·A‖ in float64, rounded to float32 as the CUDA op passes it."""
    gen = torch.Generator().manual_seed(M * N + K)
    w = torch.randn(N, K, generator=gen) * 0.05
    packed, absmax = OP.nf4_quantize(w, BS)
    x = torch.randn(M, K, generator=gen).to(dtype)
    A = torch.randn(r, K, generator=gen) * 0.1 if adapter != "none" else None
    B = torch.randn(N, r, generator=gen) * 0.1 if adapter != "none" else None
    m = torch.rand(N, generator=gen) + 0.5 if adapter == "dora" else None
    g = None
    if m is not None:
        norm = (OP.nf4_dequantize(packed, absmax, BS, N * K, torch.float32).double().view(N, K)
                + S * B.double() @ A.double()).norm(dim=1)
        g = (m.double() / norm).float()
    return x, packed, absmax, A, B, m, g


def check_output(y, z, x, packed, absmax, N, K, xa, B, g, sum_terms):
    """y (and z) against float64 with the bound of the module docstring; W decoded to x's dtype as the
    kernels decode it; the LoRA term from the xa the kernels used. sum_terms: the float32 additions
    behind each base output (K products, plus the decode path's splits)."""
    dtype = x.dtype
    W = OP.nf4_dequantize(packed, absmax, BS, N * K, dtype).double().view(N, K)
    y64 = x.double() @ W.t()
    bound = sum_bound(sum_terms, U32, x.double().abs() @ W.abs().t())
    if xa is not None:
        y64 = y64 + S * (xa.double() @ B.double().t())
        bound = bound + sum_bound(xa.shape[1] + 2, U32, S * (xa.double().abs() @ B.double().abs().t()))
    if g is not None:
        assert_within("z", z, y64, bound + U[dtype] * y64.abs())
        y64, bound = y64 * g.double(), (bound + U32 * y64.abs()) * g.double()
    bound = bound + U[dtype] * y64.abs()
    assert_within("y", y, y64, bound)
    return y64, bound


S = 0.5  # the adapters' scale s
# (M, N, K, adapter): the 5120-wide decode (16 splits) plain and with DoRA (which holds the LoRA term
# too); 40 rows (the kernel's two-half variant) over a partial 64-row tile with LoRA and with DoRA
CASES = [(3, 256, 5120, "none"), (3, 256, 5120, "dora"), (40, 96, 256, "lora"), (40, 96, 256, "dora")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K,adapter", CASES)
def test_the_decode_path_matches_float64_and_the_cpu_op(dtype, M, N, K, adapter, schedule):
    x, packed, absmax, A, B, m, g = operands(M, N, K, adapter, dtype)
    xa = x.float() @ A.t() if A is not None else None  # what the CUDA op computes before the kernel
    y, z = emu().nf4_linear_decode(x, packed, absmax, BS, N, xa, B, S, g, g is not None)
    y64, bound = check_output(y, z, x, packed, absmax, N, K, xa, B, g, K + splits_for(N, K))
    if dtype == torch.float32:  # the CPU op in float32 sums the same K products in its own order
        y_c = peer().nf4_linear(x, packed, absmax, BS, N, A, B, S, m, None)[0]
        assert_within("y vs peer", y, y_c, 2 * bound + 4 * U32 * y64.abs())


# The whole forward launch sequence (xa = x·Aᵀ, then a path): 80 rows take the prefill path (W
# decoded into scratch, the GEMMs through the device seam, the epilogue over one split), plain, with
# LoRA (the second GEMM, alpha = s) and DoRA; 5 rows with LoRA take the decode path after xa.
FORWARD_CASES = [(80, 96, 128, "none"), (80, 96, 128, "lora"), (80, 96, 128, "dora"), (5, 96, 128, "lora")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K,adapter", FORWARD_CASES)
def test_the_forward_of_both_paths_matches_float64_and_the_peer(dtype, M, N, K, adapter, schedule):
    x, packed, absmax, A, B, m, g = operands(M, N, K, adapter, dtype)
    y, xa, z = emu().nf4_linear_forward(x, packed, absmax, BS, N, A, B, S, g, g is not None)
    if A is None:
        assert xa.numel() == 0
        xa = None
    else:  # x·Aᵀ in float32: K products
        x64 = x.double() @ A.double().t()
        assert_within("xa", xa, x64, sum_bound(K, U32, x.double().abs() @ A.double().abs().t()))
    sum_terms = K if M > 64 else K + splits_for(N, K)
    y64, bound = check_output(y, z, x, packed, absmax, N, K, xa, B, g, sum_terms)
    # The peer sums in its own order and forms its own xa and g; the CPU op computes bf16 in bf16
    # where the CPU can, so it is a peer in float32 only (the CUDA op on a GPU is one in both).
    p = peer()
    if dtype == torch.float32 or p.device == "cuda":
        y_c = p.nf4_linear(x, packed, absmax, BS, N, A, B, S, m, None)[0]
        assert_within("y vs peer", y, y_c, 2 * bound + 4 * (U32 + U[dtype]) * y64.abs())


def test_the_dora_norm_kernel_matches_its_formula(schedule):
    gen = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.float64):
        wsq = torch.rand(1000, generator=gen, dtype=dt) * 4
        cross = torch.randn(1000, generator=gen, dtype=dt)
        bab = torch.rand(1000, generator=gen, dtype=dt)
        out = emu().dora_norm_kernel(wsq, cross, bab, 0.3)
        sq = wsq.double() + 2 * 0.3 * cross.double() + 0.09 * bab.double()
        want = sq.clamp(min=0).sqrt()
        # five operations before the square root (which halves their relative error) and its rounding
        mag = wsq.double() + 0.6 * cross.double().abs() + 0.09 * bab.double()
        bound = 3 * U[dt] * mag / want.clamp(min=1e-30) + U[dt] * want
        assert_within(f"norm {dt}", out, want, bound)
