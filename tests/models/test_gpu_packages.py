"""The optional GPU packages (flash-attn 2, Liger-Kernel): where they may be used, the errors where
they may not, and, on CUDA with the package installed, logits equal to the plain model's."""
import pytest
import torch

import fasttrain.models.gpu_packages as gp
from fasttrain.models.tiny import tiny_llama

CPU, CUDA = torch.device("cpu"), torch.device("cuda")   # a device object needs no GPU


def test_auto_keeps_the_loaded_attention_on_cpu_and_in_fp32():
    assert gp.attention_implementation("auto", CPU, torch.bfloat16) is None
    assert gp.attention_implementation("auto", CUDA, torch.float32) is None


def test_auto_picks_flash_attention_on_cuda_half_only_when_installed(monkeypatch):
    monkeypatch.setattr(gp, "installed", lambda name: False)
    assert gp.attention_implementation("auto", CUDA, torch.bfloat16) is None
    monkeypatch.setattr(gp, "installed", lambda name: name == "flash_attn")
    assert gp.attention_implementation("auto", CUDA, torch.bfloat16) == "flash_attention_2"
    assert gp.attention_implementation("auto", CUDA, torch.float16) == "flash_attention_2"


def test_flash_attention_where_it_cannot_run_is_an_error_that_names_the_way_out(monkeypatch):
    with pytest.raises(gp.GpuPackageError, match="needs a CUDA device.*'sdpa'"):
        gp.attention_implementation("flash_attention_2", CPU, torch.bfloat16)
    monkeypatch.setattr(gp, "installed", lambda name: False)
    with pytest.raises(gp.GpuPackageError, match=r"not installed.*fasttrain\[gpu\]"):
        gp.attention_implementation("flash_attention_2", CUDA, torch.bfloat16)
    with pytest.raises(gp.GpuPackageError, match="allowed"):
        gp.attention_implementation("flash", CPU, torch.bfloat16)


def test_liger_on_cpu_not_installed_or_unknown_family_is_an_error(monkeypatch):
    model = tiny_llama(vocab_size=64, hidden=16, layers=1, heads=2)
    with pytest.raises(gp.GpuPackageError, match="needs a CUDA device"):
        gp.apply_liger(model, CPU)
    monkeypatch.setattr(gp, "installed", lambda name: False)
    with pytest.raises(gp.GpuPackageError, match="not installed"):
        gp.apply_liger(model, CUDA)
    monkeypatch.setattr(gp, "installed", lambda name: True)
    model.config.model_type = "gpt2"
    with pytest.raises(gp.GpuPackageError, match="'gpt2' is not supported"):
        gp.apply_liger(model, CUDA)


def test_policy_settings_reach_the_model_and_bad_ones_are_config_errors():
    from types import SimpleNamespace

    from fasttrain.train.config import ConfigError
    from fasttrain.train.policy import _use_gpu_packages

    model = tiny_llama(vocab_size=64, hidden=16, layers=1, heads=2)
    loaded = model.config._attn_implementation
    _use_gpu_packages(model, SimpleNamespace(attention="auto", dtype="bfloat16", liger=False), CPU)
    assert model.config._attn_implementation == loaded
    _use_gpu_packages(model, SimpleNamespace(attention="eager", dtype="bfloat16", liger=False), CPU)
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ConfigError, match="policy.liger"):
        _use_gpu_packages(model, SimpleNamespace(attention="auto", dtype="bfloat16", liger=True), CPU)


def test_selftest_checks_the_packages_only_on_cuda():
    from fasttrain.selftest import CASES
    assert CASES["gpu_packages"](CPU, True) == []


@pytest.mark.cuda
@pytest.mark.parametrize("package", ["flash_attn", "liger_kernel"])
def test_package_logits_match_the_plain_model_on_cuda(package):
    if not gp.installed(package):
        pytest.skip(f"{package} is not installed (pip install 'fasttrain[gpu]')")
    res = gp.check_against_plain(package, CUDA)
    assert res["passed"], res


def test_the_logits_check_passes_the_plain_path_and_fails_a_perturbed_one(monkeypatch):
    """The check's own logic, on CPU: a 'package' that changes nothing passes; one that scales the
    last RMSNorm's weight by 1.03 (logits off by 3%) fails."""
    monkeypatch.setattr(gp, "apply_liger", lambda model, device: None)
    same = gp.check_against_plain("liger_kernel", CPU)
    assert same["passed"] and same["max_err"] == same["plain_err"] > 0

    def perturb(model, device):
        with torch.no_grad():
            model.model.norm.weight.mul_(1.03)
    monkeypatch.setattr(gp, "apply_liger", perturb)
    off = gp.check_against_plain("liger_kernel", CPU)
    assert not off["passed"], off
