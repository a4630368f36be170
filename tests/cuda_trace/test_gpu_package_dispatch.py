"""Which delta-rule implementation runs on CUDA, with and without flash-linear-attention, and
that what fasttrain passes it is what its source accepts (gpu_stubs.py stands in for the package,
asserting what flash-linear-attention 0.3 asserts): sequences (a prefill, the update) run a chunked
form with the state in float32, one token per row runs fasttrain's kernel, and the selftest
compares whichever runs at Qwen3.5-27B's heads."""
from __future__ import annotations

import pytest
import torch

from support import gpu_stubs
from support.fake_cuda import backward, fake_cuda

BF16 = torch.bfloat16


def test_sequences_on_cuda_run_a_chunked_form_and_single_tokens_the_kernel(monkeypatch):
    from fasttrain.ops.gated_delta import gated_delta_backend
    assert gated_delta_backend("cuda", BF16, head_dim=128) == "torch"          # no fla: the chunked torch form
    assert gated_delta_backend("cuda", BF16, step=True) == "fused"
    gpu_stubs.install(monkeypatch)
    assert gated_delta_backend("cuda", BF16, head_dim=128) == "fla"
    assert gated_delta_backend("cuda", torch.float16, head_dim=128) == "fla"
    assert gated_delta_backend("cuda", torch.float32, head_dim=128) == "torch"  # fla takes 16-bit values only
    assert gated_delta_backend("cuda", BF16, head_dim=512) == "torch"          # fla's kernels: K <= 256
    assert gated_delta_backend("cuda", BF16, step=True) == "fused"             # decode keeps the kernel
    assert gated_delta_backend("cpu", BF16, head_dim=128) == "fused"                 # CPU, no gradient: the kernel
    assert gated_delta_backend("cpu", BF16, head_dim=128, grad=True) == "torch"      # the CPU update: the chunked form


def _callers_inputs(T: int, state: bool = True):
    """Qwen3.5-27B's Gated DeltaNet heads as the hybrid decoder and the update pass them: q, k
    L2-normalised in float32, g float32, v and beta in the model's bf16, the state float32."""
    B, Hk, Hv, D = 1, 16, 48, 128
    q = torch.nn.functional.normalize(torch.randn(B, T, Hk, D, device="cuda"), dim=-1).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, D, device="cuda"), dim=-1).requires_grad_()
    v = torch.randn(B, T, Hv, D, device="cuda", dtype=BF16, requires_grad=True)
    g = (-torch.rand(B, T, Hv, device="cuda")).requires_grad_()
    beta = torch.rand(B, T, Hv, device="cuda", dtype=BF16, requires_grad=True)
    s0 = torch.zeros(B, Hv, D, D, device="cuda", requires_grad=True) if state else None
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("packages", ["gpu extra", "none"])
def test_the_callers_dtypes_reach_a_chunked_form_on_cuda(packages, monkeypatch):
    """A prefill or update call (forward and backward) on fake CUDA tensors: with fla it gets
    bf16 q, k, v and a float32 state; without it the chunked torch form runs; the token kernel
    (gated_delta_forward) never runs for a sequence, and the decoder's one-token step does."""
    from fasttrain.ops import gated_delta_rule, gated_delta_step_
    calls = gpu_stubs.install(monkeypatch, ("fla",)) if packages == "gpu extra" else []
    with fake_cuda([]) as replay:
        q, k, v, g, beta, s0 = _callers_inputs(9)
        o, S = gated_delta_rule(q, k, v, g, beta, initial_state=s0)
        assert o.dtype == BF16 and o.device.type == "cuda" and S.dtype == torch.float32
        backward([o.float().sum() + S.sum()])
        assert q.grad.dtype == torch.float32 and v.grad.dtype == BF16 and s0.grad.dtype == torch.float32
        sequence_ops = [op for op, _ in replay.ops]
        state = torch.zeros(3, 48, 128, 128, device="cuda")
        with torch.no_grad():
            o1 = gated_delta_step_(state, q[:, 0].detach().expand(3, -1, -1), k[:, 0].detach().expand(3, -1, -1),
                                   v[:, 0].detach().expand(3, -1, -1), g[:, 0].detach().expand(3, -1),
                                   beta[:, 0].detach().expand(3, -1), active=torch.ones(3, dtype=torch.bool,
                                                                                        device="cuda"))
        assert o1.shape == (3, 48, 128) and o1.dtype == BF16
    assert not any("gated_delta_forward" in op or "gated_delta_backward" in op for op in sequence_ops), sequence_ops
    assert any("gated_delta_decode_" in op for op, _ in replay.ops[len(sequence_ops):])
    assert not replay.host, replay.host
    if packages == "gpu extra":
        assert calls and all(c["q"] == c["k"] == c["v"] == BF16 and c["state"] == torch.float32 for c in calls)


def _fla_selftest(monkeypatch, tmp_path):
    from fasttrain import selftest
    from fasttrain.selftest import harness
    from fasttrain.ops.gated_delta import set_gated_delta_backend
    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(harness, "KERNELS", dict(harness.kernel_faces()))
    prev = set_gated_delta_backend("fla")            # here the stand-in computes, in float32
    try:
        return selftest.run_selftest("cpu", quick=True, ops=["gated_delta_rule"])
    finally:
        set_gated_delta_backend(prev)


def test_the_selftest_compares_fla_at_the_27b_heads(monkeypatch, tmp_path):
    calls = gpu_stubs.install(monkeypatch, ("fla",))
    rep = _fla_selftest(monkeypatch, tmp_path)
    fla = [r for r in rep["rows"] if r["impl"] == "gated_delta_rule:fla"]
    assert rep["passed"], rep["failing"]
    assert any("Hk=16 Hv=48 Dk=128 Dv=128" in r["case"] and "q/k/g fp32" in r["case"] for r in fla), fla
    assert calls and all(c["q"] == c["v"] == BF16 and c["state"] in (None, torch.float32) for c in calls)


def test_a_wrong_fla_fails_the_selftest(monkeypatch, tmp_path):
    """A stand-in that drops the initial state: the rows that start from one must fail."""
    gpu_stubs.install(monkeypatch, ("fla",))
    import sys
    right = gpu_stubs.chunk_gated_delta_rule
    monkeypatch.setattr(sys.modules["fla.ops.gated_delta_rule"], "chunk_gated_delta_rule",
                        lambda *a, initial_state=None, **kw: right(*a, initial_state=None, **kw))
    rep = _fla_selftest(monkeypatch, tmp_path)
    assert not rep["passed"] and all(r["impl"] == "gated_delta_rule:fla" for r in rep["failing"])
