"""NF4 quantize/dequantize: bytes and scales bit-for-bit equal to bitsandbytes', on the CPU (and CUDA when
present); decoded weights equal to fasttrain.ops.reference's table decode (bitsandbytes' own dequantize is
never ground truth: its CPU kernel is wrong for some shapes on some AVX-512 hosts)."""
import math

import pytest
import torch

import fasttrain.ops as ops
from fasttrain.ops import reference as R
from fasttrain.ops.nf4 import NF4State


def _bnb():
    """bitsandbytes, imported by the tests that compare with it (the others run where it is absent)."""
    return pytest.importorskip("bitsandbytes.functional")


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = ["cpu"]  # the CUDA kernels are checked against these CPU kernels in test_nf4_cuda.py
NF4_LEVELS = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0]


def bnb_ref(w, blocksize=64, double_quant=False):
    packed, st = _bnb().quantize_4bit(w, blocksize=blocksize, quant_type="nf4", compress_statistics=double_quant)
    return packed.reshape(-1), st


def assert_same_as_bnb(w, blocksize=64, device="cpu"):
    packed_ref, st_ref = bnb_ref(w, blocksize)
    packed, st = ops.nf4_quantize(w.to(device), blocksize=blocksize)
    assert torch.equal(packed.cpu(), packed_ref), "packed NF4 bytes differ from bitsandbytes"
    assert torch.equal(st.absmax.cpu(), st_ref.absmax), "absmax differs from bitsandbytes"
    deq = ops.nf4_dequantize(packed, st)
    assert deq.dtype == w.dtype and deq.shape == w.shape
    assert torch.equal(deq.cpu(), R.nf4_dequantize(packed_ref, st).cpu())  # the table decode of bnb's bytes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 64), (37, 19), (1, 1), (3,), (5, 7, 11), (128, 130), (1000,), (4096 + 3,)])
def test_random_weights_bit_exact(shape, dtype, device):
    w = (torch.randn(shape) * 0.05).to(dtype)
    assert_same_as_bnb(w, device=device)


@pytest.mark.parametrize("blocksize", [32, 64, 128, 256, 4096])
def test_blocksizes(blocksize):
    w = torch.randn(3 * blocksize + 5)
    assert_same_as_bnb(w, blocksize)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_exactly_on_midpoints(dtype, device):
    # A block whose absmax is 1 (so scaling is exact) filled with every float32 midpoint, the
    # levels themselves and one ulp either side of each midpoint: the tie rule must match.
    lv = torch.tensor(NF4_LEVELS)
    mids = (lv[:-1] + lv[1:]) / 2
    vals = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 2.0)),
                      torch.nextafter(mids, torch.full_like(mids, -2.0)), lv])
    blocks = []
    for i in range(0, vals.numel(), 63):
        chunk = vals[i:i + 63]
        blocks.append(torch.cat([torch.ones(1), chunk, torch.zeros(63 - chunk.numel())]))
    w = torch.cat(blocks).to(dtype)
    assert_same_as_bnb(w, device=device)
    # and the rule itself: a value exactly on a midpoint takes the lower level
    packed, st = ops.nf4_quantize(torch.tensor([1.0, float(mids[10])]))
    assert packed.item() == (15 << 4) | 10


@pytest.mark.parametrize("device", DEVICES)
def test_zero_blocks_and_outlier(device):
    w = torch.zeros(64 * 3 + 10)
    w[64:128] = torch.randn(64) * 1e-3
    w[100] = 1e4  # one huge outlier: its block collapses to codes 7 and 15
    assert_same_as_bnb(w, device=device)
    packed, st = ops.nf4_quantize(w.to(device))
    assert st.absmax[0].item() == 0.0 and st.absmax[1].item() == 1e4
    # the trailing all-zero partial block stores bitsandbytes' 1e-38 floor
    assert st.absmax[-1].item() == pytest.approx(1e-38, rel=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64 * 300, 64 * 257 + 13])
def test_double_quant(n, dtype, device):
    w = (torch.randn(n) * torch.rand(n) * 0.1).to(dtype)
    packed_ref, st_ref = bnb_ref(w, 64, double_quant=True)
    packed, st = ops.nf4_quantize(w.to(device), double_quant=True)
    assert torch.equal(packed.cpu(), packed_ref)
    # Our offset is the float64-summed mean, bitsandbytes' a float32 mean (test_shared_math.py bounds
    # the difference); given our offset, its blockwise step gives our absmax2 bit for bit.
    absmax = ops.nf4_quantize(w, double_quant=False)[1].absmax
    assert torch.equal(st.absmax2.cpu(), _bnb().quantize_blockwise(absmax - st.offset.cpu(), blocksize=256)[1].absmax)
    # The 8-bit codes follow bitsandbytes' reference rule (exact nearest, ties down) bit for bit.
    centred = absmax - st.offset.cpu()
    q_rule, _ = R.blockwise8_quantize(centred, ops.dynamic_map(), 256)
    assert torch.equal(st.qabsmax.cpu(), q_rule)
    # bitsandbytes' native CPU kernel uses an approximate search that may pick the other
    # neighbour when a value lies within ~1e-5 of a midpoint: allow exactly that, nothing more.
    diff = (st.qabsmax.cpu().int() - st_ref.absmax.int())
    assert diff.abs().max() <= 1 and (diff != 0).float().mean() < 0.02
    deq = ops.nf4_dequantize(packed, st).cpu().float()
    assert torch.equal(deq, R.nf4_dequantize(packed.cpu(), st.to("cpu")).float())
    # bnb's bytes decoded by table with its own (possibly neighbouring) 8-bit absmax codes: equal to ours
    # wherever those codes agree.
    st_bnb = NF4State(w.shape, w.dtype, 64, qabsmax=st_ref.absmax, absmax2=st_ref.state2.absmax,
                      code=st_ref.state2.code, offset=st_ref.offset)
    same_block = (diff == 0).repeat_interleave(64)[:n]
    if torch.equal(st.offset.cpu(), st_ref.offset):  # the same offset: the same decoded weights
        deq_bnb = R.nf4_dequantize(packed_ref, st_bnb).float()
        assert torch.equal(deq.reshape(-1)[same_block], deq_bnb.reshape(-1)[same_block])


def test_dynamic_map_equals_bitsandbytes():
    assert torch.equal(ops.dynamic_map(), _bnb().create_dynamic_map(signed=True))


def test_gaussian_roundtrip_error():
    # NF4 is information-theoretically tuned for N(0,1) blocks: relative RMS error ~ 0.1
    # (QLoRA). A broken codebook or packing order gives ~1.
    w = torch.randn(1024, 1024, dtype=torch.float64).float()
    packed, st = ops.nf4_quantize(w)
    err = (ops.nf4_dequantize(packed, st) - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()
    assert 0.07 < err.item() < 0.12
    assert packed.numel() == w.numel() // 2
    bits = (packed.numel() + st.absmax.numel() * 4) * 8 / w.numel()
    assert bits == pytest.approx(4.5)  # 4 bits + one fp32 per 64 values
    packed_dq, st_dq = ops.nf4_quantize(w, double_quant=True)
    bits_dq = (packed_dq.numel() + st_dq.nbytes()) * 8 / w.numel()
    assert bits_dq < 4.14


def test_errors_are_clear():
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        ops.nf4_quantize(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="empty"):
        ops.nf4_quantize(torch.ones(0))
    with pytest.raises(RuntimeError, match="blocksize"):
        ops.nf4_quantize(torch.ones(8), blocksize=3)
    packed, st = ops.nf4_quantize(torch.ones(128))
    with pytest.raises(RuntimeError, match="'absmax'"):
        torch.ops.fasttrain.nf4_dequantize(packed, st.absmax[:1], 64, 128, torch.float32)
    with pytest.raises(RuntimeError, match="'packed'.*uint8|dtype Byte"):
        torch.ops.fasttrain.nf4_dequantize(packed.float(), st.absmax, 64, 128, torch.float32)


def test_opcheck():
    w = torch.randn(130, 3)
    torch.library.opcheck(torch.ops.fasttrain.nf4_quantize.default, (w, 64))
    packed, st = ops.nf4_quantize(w)
    torch.library.opcheck(torch.ops.fasttrain.nf4_dequantize.default, (packed, st.absmax, 64, w.numel(), torch.bfloat16))
    x = torch.randn(300)
    torch.library.opcheck(torch.ops.fasttrain.blockwise8_quantize.default, (x, ops.dynamic_map(), 256))


def test_compile_fullgraph():
    w = torch.randn(64, 33)
    packed, st = ops.nf4_quantize(w)

    @torch.compile(fullgraph=True, backend="eager")
    def deq(p, a):
        return torch.ops.fasttrain.nf4_dequantize(p, a, 64, w.numel(), torch.float32) * 2

    assert torch.equal(deq(packed, st.absmax), ops.nf4_dequantize(packed, st).reshape(-1) * 2)
