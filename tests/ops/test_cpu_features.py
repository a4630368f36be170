"""The CPU's bf16 capability has one source, the extension (fasttrain._C.cpu_has_bf16): the nf4_linear
kernel and its fake kernel (torch.compile's shapes and dtypes) read the same answer, and it follows
ATen's own view of the host, ATEN_CPU_CAPABILITY included."""
import os
import subprocess
import sys

import pytest
import torch

import fasttrain.ops as F
from fasttrain._native import load


def _cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(l.split(":", 1)[1].split()) for l in f if l.startswith("flags")), set())
    except OSError:
        pytest.skip("no /proc/cpuinfo on this host")


def test_cpu_has_bf16_follows_the_hardware_flag_and_atens_capability():
    expected = "avx512_bf16" in _cpuinfo_flags() and torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert load().cpu_has_bf16() is expected


@pytest.mark.skipif("avx512_bf16" not in _cpuinfo_flags(), reason="needs a host with avx512_bf16")
def test_aten_cpu_capability_avx2_turns_bf16_compute_off():
    """On an AVX-512 bf16 host, ATEN_CPU_CAPABILITY=avx2 runs the path an AVX2 host runs."""
    code = "import fasttrain._native as n; print(n.load().cpu_has_bf16())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         check=True).stdout.strip()
    assert out == "False"


def test_fake_kernel_dtypes_equal_the_real_kernels_for_bf16():
    from torch._subclasses.fake_tensor import FakeTensorMode
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    q, st = F.nf4_quantize(w)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    a, b, m = torch.randn(4, 64), torch.randn(48, 4), torch.rand(48) + 1
    args = (q, st.absmax_fp32(), st.blocksize, 48, a, b, 0.5, m, None)
    real = torch.ops.fasttrain.nf4_linear(x, *args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.fasttrain.nf4_linear(mode.from_tensor(x), *args)
    assert [t.dtype for t in fake] == [t.dtype for t in real]
    # the saved x·Aᵀ is in the compute dtype: bf16 exactly when the extension says so
    assert real[1].dtype == (torch.bfloat16 if load().cpu_has_bf16() else torch.float32)
