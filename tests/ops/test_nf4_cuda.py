"""CUDA NF4 kernels equal the CPU kernels bit for bit (the CPU kernels are checked against
bitsandbytes in test_nf4.py; the GPU image has no bitsandbytes)."""
import pytest
import torch

import fasttrain.ops as ops

pytestmark = pytest.mark.cuda


def levels_and_midpoints():
    lv = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])
    mids = (lv[:-1] + lv[1:]) / 2
    return torch.cat([lv, mids, torch.nextafter(mids, torch.ones_like(mids) * 2)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 4096 * 3 + 7, 1 << 20])
@pytest.mark.parametrize("double_quant", [False, True])
def test_cuda_equals_cpu(n, dtype, double_quant):
    w = torch.randn(n) * 0.05
    if n > 100:
        w[:47] = levels_and_midpoints()[:47]
        w[64:64 + 47] = levels_and_midpoints()[:47] * 3.0
        w[200:264] = 0.0
    w = w.to(dtype)
    p_cpu, s_cpu = ops.nf4_quantize(w, double_quant=double_quant)
    p_gpu, s_gpu = ops.nf4_quantize(w.cuda(), double_quant=double_quant)
    assert torch.equal(p_gpu.cpu(), p_cpu)
    assert torch.equal(s_gpu.absmax_fp32().cpu(), s_cpu.absmax_fp32())
    for out_dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(ops.nf4_dequantize(p_gpu, s_gpu, out_dtype).cpu(), ops.nf4_dequantize(p_cpu, s_cpu, out_dtype))


def test_cuda_graph_capture_dequantize():
    w = torch.randn(4096, 512, device="cuda")
    packed, st = ops.nf4_quantize(w)
    out = ops.nf4_dequantize(packed, st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out2 = ops.nf4_dequantize(packed, st)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, out2)


def test_blockwise8_dequantize_rejects_tables_on_another_device():
    x = torch.randn(512, device="cuda")
    q, absmax = torch.ops.fasttrain.blockwise8_quantize(x, ops.dynamic_map().cuda(), 256)
    with pytest.raises(RuntimeError, match="absmax"):
        torch.ops.fasttrain.blockwise8_dequantize(q, absmax.cpu(), ops.dynamic_map().cuda(), 256)
    with pytest.raises(RuntimeError, match="code"):
        torch.ops.fasttrain.blockwise8_dequantize(q, absmax, ops.dynamic_map(), 256)
