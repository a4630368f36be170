"""What the pip path relies on, checked on the built modules in seconds (tools/test_wheel.sh builds
and installs the wheel itself): fasttrain._C links no CUDA library, so a CPU-only torch loads it;
the CUDA module, where built, holds the code its build asked for (a wheel: sm_80 and sm_90a code and
compute_80 PTX; an in-place build: this machine's GPU, or sm_90a alone without one); the wheel pins the
torch it is built with and a mismatch at import is one line; a command that needs an extra says
which in one line; `fasttrain info` names the CPU variant that runs."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fasttrain import _native

ROOT = Path(__file__).resolve().parents[2]


def _needed(so: str) -> list[str]:
    if shutil.which("readelf") is None:
        pytest.skip("needs readelf (binutils)")
    out = subprocess.run(["readelf", "-d", so], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.*?)\]", out)


def test_the_cpu_module_links_no_cuda_library():
    needed = _needed(_native.load().__file__)
    assert "libtorch_cpu.so" in needed, needed            # the check reads the list
    assert not [n for n in needed if "cuda" in n.lower() or "nvrtc" in n], needed


def _setup_definitions() -> dict:
    text = (ROOT / "setup.py").read_text()
    ns: dict = {"__file__": str(ROOT / "setup.py")}
    exec(compile(text.split("\nsetup(")[0], str(ROOT / "setup.py"), "exec"), ns)   # its definitions, no build
    return ns


def test_cuda_targets_a_wheel_carries_and_an_inplace_build_compiles(monkeypatch):
    targets = _setup_definitions()["cuda_targets"]
    for var in ("FASTTRAIN_CUDA_ARCHS", "FASTTRAIN_CUDA_PTX"):
        monkeypatch.delenv(var, raising=False)
    assert targets(False) == ("80;90a", "80")                  # a wheel: A100 + H100 SASS, PTX for newer
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert targets(True) == ("90a", "")                        # no GPU here: compile and link, one pass
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    assert targets(True) == ("80", "")                         # this machine's GPU
    monkeypatch.setenv("FASTTRAIN_CUDA_ARCHS", "90a;100")
    assert targets(True) == ("90a;100", "") and targets(False) == ("90a;100", "80")


def test_the_cuda_module_holds_the_code_its_build_asked_for():
    spec = importlib.util.find_spec("fasttrain._C_cuda")
    if spec is None or torch.version.cuda is None:
        pytest.skip("no CUDA module in this build (FASTTRAIN_CUDA=0 or a CPU-only torch)")
    info = _native.build_info()
    archs = [a for a in info["cuda_archs"].split(",") if a]
    ptxs = [a for a in info["cuda_ptx"].split(",") if a]
    assert "CUDA" in info["backends"] and archs, info
    cuobjdump = shutil.which("cuobjdump") or (shutil.which("nvcc") and str(Path(shutil.which("nvcc")).with_name("cuobjdump")))
    if not cuobjdump or not Path(cuobjdump).exists():
        pytest.skip("needs cuobjdump (CUDA toolkit)")
    listing = subprocess.run([cuobjdump, "--list-elf", "--list-ptx", spec.origin], capture_output=True, text=True,
                             check=True).stdout
    elf = set(re.findall(r"\.(sm_\d+a?)\.cubin", listing))
    ptx = set(re.findall(r"\.(sm_\d+a?)\.ptx", listing))
    assert elf == {f"sm_{a}" for a in archs} and ptx == {f"sm_{a}" for a in ptxs}, (info, listing[:2000])
    assert "libtorch_cuda.so" in _needed(spec.origin)


def test_the_wheel_pins_the_torch_it_is_built_with():
    """setup.py's requirement list starts with torch==<this torch's release> (no local label, so
    both the CPU and the CUDA builds of that release satisfy it)."""
    text = (ROOT / "setup.py").read_text()
    ns = _setup_definitions()
    assert ns["torch_pin"]() == [f"torch=={torch.__version__.split('+')[0]}"]
    assert "install_requires=[*torch_pin(), *BASE_REQUIREMENTS]" in text


def test_an_extension_built_for_another_torch_is_one_line(monkeypatch):
    monkeypatch.setattr(_native, "_torch_release", lambda: "9.9.9")
    with pytest.raises(_native.NativeExtensionError) as e:
        _native._check_torch(_native.load())
    msg = str(e.value)
    assert "\n" not in msg and "this is torch 9.9.9" in msg and f"pip install torch=={torch.__version__.split('+')[0]}" in msg


def _main_with(monkeypatch, capsys, error: BaseException) -> tuple[int, str]:
    import fasttrain.cli as cli

    def command():
        raise error
    monkeypatch.setattr(cli, "app", command)
    with pytest.raises(SystemExit) as e:
        cli.main()
    return e.value.code, capsys.readouterr().err


def test_a_missing_extra_is_one_line_that_names_it(monkeypatch, capsys):
    code, err = _main_with(monkeypatch, capsys, ModuleNotFoundError("No module named 'transformers'", name="transformers"))
    assert code == 2 and err.strip().count("\n") == 0, err
    assert "pip install 'fasttrain[models]'" in err and "'transformers'" in err
    code, err = _main_with(monkeypatch, capsys, ModuleNotFoundError("No module named 'trl.trainer'", name="trl.trainer"))
    assert "fasttrain[trl]" in err
    # `fasttrain run` asks before it makes a run folder: the same line, nothing written
    from fasttrain.extras import require
    with pytest.raises(ModuleNotFoundError) as e:
        require("json", "transformers_not_installed_here")
    assert e.value.name == "transformers_not_installed_here"
    # a module no extra brings is a bug, not an install step: it is raised as it is
    import fasttrain.cli as cli
    monkeypatch.setattr(cli, "app", lambda: (_ for _ in ()).throw(ModuleNotFoundError("x", name="no_such_mod")))
    with pytest.raises(ModuleNotFoundError):
        cli.main()


def test_info_names_the_cpu_variant():
    from typer.testing import CliRunner

    from fasttrain.cli import app
    res = CliRunner().invoke(app, ["info"])
    variant = _native.build_info()["cpu_variant"]
    assert res.exit_code == 0 and f"CPU kernels: {variant} variant" in res.output, res.output
    assert variant in _native.build_info()["cpu_variants"].split(",")
