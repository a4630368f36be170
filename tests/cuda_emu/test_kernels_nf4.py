"""The NF4 and 8-bit blockwise CUDA kernels (cuda/kernels/nf4.cuh) on the emulator: codes and absmax
bit for bit against the table-driven reference (fasttrain.ops.reference) and the CPU op, under two
schedules; lengths leave a partial quantization block, a partial warp group of blocks (CTAs of
8 blocks) and an odd final nibble."""
from __future__ import annotations

import pytest
import torch

from fasttrain.ops import reference as R

from cuda_emu.emulator import peer, emu

pytestmark = pytest.mark.cuda_emu
OP = torch.ops.fasttrain  # the CPU ops (their own checks); peer(): what the emulator is compared with
# (n, blocksize): 37 blocks = 4 full CTAs + 5 blocks; a partial block and an odd length; bs 256;
# one 5120-wide row of a Qwen3.5-27B projection
SHAPES = [(64 * 37, 64), (1000 + 13, 64), (4096 + 3, 256), (5120, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,bs", SHAPES)
def test_nf4_codes_and_absmax_equal_the_reference_and_the_cpu_op(dtype, n, bs, schedule):
    w = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.05).to(dtype)
    w[7] = 0.0  # an exact zero, and a block's maximum at its last element
    w[bs - 1] = 0.5
    packed, absmax = emu().nf4_quantize(w, bs)
    p_ref, a_ref = R.nf4_quantize_blocks(w, bs)
    p_cpu, a_cpu = peer().nf4_quantize(w, bs)
    assert torch.equal(packed, p_ref) and torch.equal(absmax, a_ref)
    assert torch.equal(packed, p_cpu) and torch.equal(absmax, a_cpu)
    out = emu().nf4_dequantize(packed, absmax, bs, n, dtype)
    assert torch.equal(out, R.nf4_dequantize_blocks(p_ref, a_ref, bs, n, dtype))
    assert torch.equal(out, peer().nf4_dequantize(p_cpu, a_cpu, bs, n, dtype))


@pytest.mark.parametrize("n,bs", [(5000, 256), (64 * 9 + 1, 64)])
def test_blockwise8_codes_equal_the_reference_and_the_cpu_op(n, bs, schedule):
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    code = torch.sort(torch.randn(256, generator=torch.Generator().manual_seed(4)).clamp(-1, 1)).values
    q, absmax = emu().blockwise8_quantize(x, code, bs)
    q_ref, a_ref = R.blockwise8_quantize(x, code, bs)
    q_cpu, a_cpu = peer().blockwise8_quantize(x, code, bs)
    assert torch.equal(q, q_ref) and torch.equal(absmax, a_ref)
    assert torch.equal(q, q_cpu) and torch.equal(absmax, a_cpu)
    back = emu().blockwise8_dequantize(q, absmax, code, bs)
    assert torch.equal(back, R.blockwise8_dequantize(q_ref, a_ref, code, bs))
    assert torch.equal(back, peer().blockwise8_dequantize(q_cpu, a_cpu, code, bs))
