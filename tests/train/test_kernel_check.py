"""The trainer's kernel check and `run.kernels`: a failing selftest on the run's device stops the run
before the model is built, with the failing op and the way around it; the reference choice reaches
every op face; FASTTRAIN_KERNELS does the same for other trainers."""
import json

import pytest
import torch

import fasttrain.ops as F
from fasttrain.ops import kernels as K
from fasttrain.ops import reference as R
from fasttrain.train import ConfigError, Trainer, TrainingStopped, load_config
from fasttrain.train import kernel_check


def _report(passed: bool) -> dict:
    row = {"op": "nf4_linear", "case": "N=129 K=96 r=8 M=65 bf16 dora", "passed": passed, "output": "dx",
           "max_err": 0.5, "tol": 0.01, "kernel_ms": 1.0, "ref_ms": 2.0, "detail": ""}
    return {"passed": passed, "quick": True, "device": {"device": "cuda", "name": "Test GPU", "compute_capability": "9.0"},
            "started": "2026-01-01T00:00:00Z", "seconds": 1.0, "cases": 12, "failed": 0 if passed else 1,
            "failing": [] if passed else [row], "rows": [row]}


@pytest.fixture
def checked_cpu(monkeypatch, tmp_path):
    """Treat the CPU as a device the trainer checks, with a selftest whose verdict the test sets."""
    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_check, "SELFTEST_DEVICES", ("cpu", "cuda"))
    calls = []

    def set_verdict(passed):
        def fake(device):
            calls.append(device)
            return _report(passed)
        monkeypatch.setattr(kernel_check, "run_quick_selftest", fake)
        return calls
    return set_verdict


def test_failing_kernels_stop_the_run_before_step_one(tiny, tiny_recipe, checked_cpu):
    calls = checked_cpu(False)
    tr = Trainer(load_config(tiny_recipe(tiny / "runs")), progress=False)
    with pytest.raises(TrainingStopped) as e:
        tr.train()
    msg = str(e.value)
    assert "nf4_linear" in msg and 'run.kernels = "reference"' in msg and "selftest.json" in msg
    assert calls == [torch.device("cpu")]
    assert not tr._setup_done, "the model must not be built when the kernels failed"
    rep = json.loads((tr.dir / "selftest.json").read_text())
    assert rep["passed"] is False and rep["failing"][0]["op"] == "nf4_linear"
    assert not (tr.dir / "metrics.jsonl").exists()


def test_passing_kernels_are_recorded(tmp_path, checked_cpu):
    checked_cpu(True)
    assert kernel_check.check_kernels("cpu", tmp_path / "run") is None
    assert json.loads((tmp_path / "run" / "selftest.json").read_text())["passed"] is True


def test_other_ranks_check_their_device_but_write_nothing(tmp_path, checked_cpu):
    calls = checked_cpu(False)
    msg = kernel_check.check_kernels("cpu", tmp_path / "run", write=False)
    assert calls == [torch.device("cpu")] and "nf4_linear" in msg
    assert not (tmp_path / "run").exists(), "only rank 0 writes the run folder"


def test_a_failing_gpu_package_names_the_packages_to_uninstall(tmp_path, monkeypatch, checked_cpu):
    checked_cpu(False)
    bad = _report(False)
    bad["failing"][0]["op"] = "gpu_packages"
    monkeypatch.setattr(kernel_check, "run_quick_selftest", lambda device: bad)
    msg = kernel_check.check_kernels("cpu", tmp_path / "run")
    assert "gpu_packages" in msg and "pip uninstall flash-attn liger-kernel" in msg


def test_reference_choice_skips_the_check(tmp_path, checked_cpu):
    calls = checked_cpu(False)
    with K.use_kernels("reference"):
        assert kernel_check.check_kernels("cpu", tmp_path / "run") is None
    assert calls == [] and "skipped" in json.loads((tmp_path / "run" / "selftest.json").read_text())


def test_cpu_runs_are_not_checked_by_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_check, "run_quick_selftest", lambda d: pytest.fail("no selftest on the CPU"))
    assert kernel_check.check_kernels("cpu", tmp_path / "run") is None
    assert not (tmp_path / "run" / "selftest.json").exists()


def test_config_key():
    assert load_config("demo").run.kernels == "fused"
    assert load_config("demo", ["run.kernels=reference"]).run.kernels == "reference"
    with pytest.raises(ConfigError, match="run.kernels.*'fused', 'reference'"):
        load_config("demo", ["run.kernels=triton"])


def test_switch_reaches_every_op_face(monkeypatch):
    seen = []
    for name in ("fused_logprob", "policy_loss", "nf4_quantize", "nf4_dequantize", "nf4_linear", "nf4_dora_norm",
                 "nf4_weight_sq_norm", "nf4_state_absmax"):
        real = getattr(R, name)
        monkeypatch.setattr(R, name, lambda *a, _n=name, _f=real, **k: (seen.append(_n), _f(*a, **k))[1])

    def call_all():
        w = torch.randn(8, 70)
        q, st = F.nf4_quantize(w, double_quant=True)
        F.nf4_dequantize(q, st)
        st.absmax_fp32()
        a, b = torch.randn(3, 70), torch.randn(8, 3)
        F.nf4_linear(torch.randn(2, 70), q, st, a, b, 0.5)
        F.nf4_dora_norm(q, st, a, b, 0.5)
        F.nf4_weight_sq_norm(q, st)
        F.fused_logprob(torch.randn(4, 5), torch.randn(7, 5), torch.tensor([0, 1, 2, 3]))
        F.policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3, dtype=torch.bool))

    call_all()
    assert seen == [], "the fused kernels run by default"
    monkeypatch.setenv("FASTTRAIN_KERNELS", "reference")
    call_all()
    assert {"fused_logprob", "policy_loss", "nf4_quantize", "nf4_dequantize", "nf4_linear", "nf4_dora_norm",
            "nf4_weight_sq_norm"} <= set(seen)
    seen.clear()
    monkeypatch.delenv("FASTTRAIN_KERNELS")
    with K.use_kernels("reference"):
        call_all()
    assert "fused_logprob" in seen and K.kernels() == "fused"
    monkeypatch.setenv("FASTTRAIN_KERNELS", "triton")
    with pytest.raises(ValueError, match="FASTTRAIN_KERNELS"):
        F.nf4_weight_sq_norm(*F.nf4_quantize(torch.randn(4, 4)))
