"""Property tests: every op's fused path against fasttrain.ops.reference (float64) on random shapes,
dtypes and options drawn by hypothesis, with the selftest's derived tolerances (fasttrain/selftest/bounds.py
states them). On the CPU here; on CUDA where a GPU is present. The example count is kept small for CI
time; a failure prints the drawn case (and hypothesis' reproduction blob)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fasttrain.selftest import harness
from fasttrain.selftest.cases import fused_logprob, nf4, nf4_linear, policy_loss
from fasttrain.ops.kernels import fused_only

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
LOW = [torch.float32, torch.bfloat16, torch.float16]
SETTINGS = settings(max_examples=12, deadline=None, print_blob=True)


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    monkeypatch.setattr(harness, "KERNELS", dict(harness.kernel_faces()))


def check(device, make_case):
    name, run = make_case(torch.device(device))
    chk = harness.Check()
    with fused_only():
        run(chk)
    row = chk.row("op", name, 0.0, 0.0)
    assert row.passed, f"{name}: {row.output} error {row.max_err:.3g} > tolerance {row.tol:.3g} {row.detail}"


def dtypes(device):
    return st.sampled_from(LOW + ([torch.float64] if device == "cpu" else []))


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(data=st.data())
def test_fused_logprob(device, data):
    N, H, V = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 24)), data.draw(st.integers(1, 300))
    dt = data.draw(dtypes(device))
    T = data.draw(st.sampled_from([0.5, 0.9, 1.0, 1.7]))
    bias = data.draw(st.booleans())
    chunk = data.draw(st.sampled_from([0, 1024, 4096]))
    seed = data.draw(st.integers(0, 2**20))
    check(device, lambda d: fused_logprob.logprob_case(d, N, H, V, dt, T=T, bias=bias, chunk=chunk, seed=seed))


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(data=st.data())
def test_policy_loss(device, data):
    B, T = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 50))
    loss = data.draw(st.sampled_from(["cispo", "dapo", "grpo"]))
    dt = data.draw(st.sampled_from(LOW))
    kw = dict(per_token_adv=data.draw(st.booleans()), float_mask=data.draw(st.booleans()),
              beta=data.draw(st.sampled_from([0.0, 0.04, 0.5])), zeta=data.draw(st.sampled_from([0.0, 0.03, 1.0])),
              normalizer=data.draw(st.booleans()), seed=data.draw(st.integers(0, 2**20)))
    check(device, lambda d: policy_loss.policy_case(d, B, T, loss, dt, **kw))


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(n=st.integers(1, 3000), dt=st.sampled_from(LOW), dq=st.booleans(), bs=st.sampled_from([32, 64, 128]),
       seed=st.integers(0, 2**20))
def test_nf4_quantize_dequantize(device, n, dt, dq, bs, seed):
    check(device, lambda d: nf4.nf4_case(d, n, dt, dq, blocksize=bs, seed=seed))


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(data=st.data())
def test_nf4_linear(device, data):
    N, K, r, M = (data.draw(st.integers(1, 50)), data.draw(st.integers(1, 80)), data.draw(st.integers(1, 8)),
                  data.draw(st.integers(1, 70)))
    dt = data.draw(dtypes(device))
    adapter = data.draw(st.sampled_from(["base", "lora", "dora"]))
    seed = data.draw(st.integers(0, 2**20))
    check(device, lambda d: nf4_linear.linear_case(d, N, K, r, M, dt, adapter, seed=seed))


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(N=st.integers(1, 50), K=st.integers(1, 80), r=st.integers(1, 8), seed=st.integers(0, 2**20),
       dt=st.sampled_from([torch.float32, torch.float64]))
def test_nf4_dora_norm(device, N, K, r, dt, seed):
    check(device, lambda d: nf4_linear.norm_case(d, N, K, r, dt, seed=seed))
