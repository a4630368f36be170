"""Build driver: setup.py runs CMake (CMakeLists.txt is the one build truth, as in vLLM).

Two modules: fasttrain._C (op schemas and the CPU kernels, one variant per x86-64 level, picked at
run time) and, when CUDA is compiled, fasttrain._C_cuda (the CUDA kernels), loaded apart so that a
CPU-only torch imports fasttrain. FASTTRAIN_CUDA=auto|0|1 decides whether CUDA kernels are
compiled. "auto" compiles them when an nvcc toolkit and a CUDA build of torch are both present; it
never asks torch.cuda.is_available(), because build machines have no GPU. FASTTRAIN_NATIVE_ARCH=1
builds one CPU variant with -march=native instead (faster here, runs only on CPUs like this one).
The build folder (build/cmake) is kept, so a rebuild after one edit recompiles only that file.

The wheel pins the torch it was built with (torch==X.Y.Z): an extension loads only with the torch
whose C++ ABI it was compiled against.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
VERSION = "0.1.0"
# The core dependencies besides torch (pyproject.toml declares `dependencies` dynamic so that the
# torch pin can be the build's own); the extras stay in pyproject.toml.
BASE_REQUIREMENTS = ["numpy>=1.26", "typer>=0.12", "rich>=13", "safetensors>=0.4"]


def find_cuda_home() -> Path | None:
    """The CUDA toolkit folder itself (not a wrapper's folder: torch guesses wrong on such hosts)."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    candidates += [Path(p) for p in sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    for c in candidates:
        if (c / "bin" / "nvcc").exists() and (c / "include" / "cuda_runtime.h").exists():
            return c
    return None


def want_cuda() -> tuple[bool, Path | None]:
    mode = os.environ.get("FASTTRAIN_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"FASTTRAIN_CUDA must be auto, 0 or 1, got {mode!r}")
    if mode == "0":
        return False, None
    import torch

    cuda_home = find_cuda_home()
    have = cuda_home is not None and torch.version.cuda is not None
    if mode == "1" and not have:
        raise SystemExit(
            "FASTTRAIN_CUDA=1 but "
            + ("no CUDA toolkit (nvcc + include/cuda_runtime.h) was found; set CUDA_HOME"
               if cuda_home is None else f"torch {torch.__version__} is a CPU build")
        )
    return have, cuda_home


# What a wheel carries: SASS for the A100 and H100 generations and compute_80 PTX that newer GPUs JIT.
WHEEL_CUDA_ARCHS, WHEEL_CUDA_PTX = "80;90a", "80"


def cuda_targets(inplace: bool) -> tuple[str, str]:
    """(SASS archs, PTX archs) for nvcc. FASTTRAIN_CUDA_ARCHS / FASTTRAIN_CUDA_PTX win when set. A
    wheel gets WHEEL_CUDA_*. An in-place build (make build, pip install -e) runs only here: it gets
    this machine's GPU, or, where there is none (a build or CI host, which can only check that the
    CUDA code compiles and links), sm_90a alone: one device pass instead of three, since each pass
    parses torch's headers again."""
    archs = os.environ.get("FASTTRAIN_CUDA_ARCHS")
    ptx = os.environ.get("FASTTRAIN_CUDA_PTX")
    if not inplace:
        return archs or WHEEL_CUDA_ARCHS, WHEEL_CUDA_PTX if ptx is None else ptx
    if archs is None:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            archs = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
        else:
            archs = "90a"
    return archs, "" if ptx is None else ptx


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """One CMake configure + build makes every module; the first extension runs it."""

    def run(self) -> None:
        # setuptools clears `inplace` while it builds (and copies the modules after): remember it.
        self.asked_inplace = bool(self.inplace)
        super().run()

    def build_extension(self, ext: Extension) -> None:
        if getattr(self, "_cmake_done", False):
            return
        self._cmake_done = True
        import torch
        import torch.utils.cpp_extension as cpp

        with_cuda, cuda_home = want_cuda()
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("FASTTRAIN_BUILD_DIR", ROOT / "build" / "cmake"))
        build_dir.mkdir(parents=True, exist_ok=True)

        includes = cpp.include_paths(device_type="cuda" if with_cuda else "cpu")
        libdirs = cpp.library_paths(device_type="cuda" if with_cuda else "cpu")
        env = dict(os.environ)
        if with_cuda:
            includes = [p for p in includes if not p.startswith("/usr/local/include")]
            includes.append(str(cuda_home / "include"))
            # torch's CUDA headers include cusparse.h etc., shipped by the nvidia cu13 wheels.
            for mod in ("nvidia/cu13/include", "nvidia/cusparse/include", "nvidia/cublas/include"):
                for sp in sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]:
                    p = Path(sp) / mod
                    if p.is_dir() and str(p) not in includes:
                        includes.append(str(p))
            libdirs = [str(cuda_home / "lib64")] + [p for p in libdirs if p != "/usr/local/lib"]
            env["CUDA_HOME"] = str(cuda_home)
            env["CUDACXX"] = str(cuda_home / "bin" / "nvcc")

        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        cfg = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), *generator,
            f"-DFASTTRAIN_WITH_CUDA={'ON' if with_cuda else 'OFF'}",
            f"-DTORCH_INCLUDE_DIRS={';'.join(includes)}",
            f"-DTORCH_LIBRARY_DIRS={';'.join(libdirs)}",
            f"-DPYTHON_INCLUDE_DIR={sysconfig.get_paths()['include']}",
            f"-DFASTTRAIN_EXT_SUFFIX={sysconfig.get_config_var('EXT_SUFFIX')}",
            f"-DFASTTRAIN_OUTPUT_DIR={out_dir}",
            f"-DFASTTRAIN_GLIBCXX_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DFASTTRAIN_VERSION={VERSION}",
        ]
        if with_cuda:
            cfg.append(f"-DCMAKE_CUDA_COMPILER={cuda_home / 'bin' / 'nvcc'}")
        if with_cuda:
            archs, ptx = cuda_targets(getattr(self, "asked_inplace", False))
            cfg += [f"-DFASTTRAIN_CUDA_ARCHS={archs}", f"-DFASTTRAIN_CUDA_PTX={ptx}"]
        if os.environ.get("FASTTRAIN_UNITY"):
            cfg.append(f"-DFASTTRAIN_UNITY={'ON' if os.environ['FASTTRAIN_UNITY'] == '1' else 'OFF'}")
        if os.environ.get("FASTTRAIN_PTXAS_VERBOSE"):
            cfg.append(f"-DFASTTRAIN_PTXAS_VERBOSE={'ON' if os.environ['FASTTRAIN_PTXAS_VERBOSE'] == '1' else 'OFF'}")
        cfg.append(f"-DFASTTRAIN_NATIVE_ARCH={'ON' if os.environ.get('FASTTRAIN_NATIVE_ARCH') == '1' else 'OFF'}")
        if not with_cuda:        # a CUDA module left by an earlier build would not match this _C
            stale = [*out_dir.glob("_C_cuda*.so")]
            if "--inplace" in sys.argv or "-i" in sys.argv:
                stale += (ROOT / "python" / "fasttrain").glob("_C_cuda*.so")
            for path in stale:
                path.unlink()
        # The CUDA emulator (fasttrain._C_emu, a test artefact): built by in-place builds only (into
        # the source tree), so no wheel carries it. FASTTRAIN_EMU=0 skips it, =1 builds it anyway;
        # FASTTRAIN_EMU_SANITIZE=1 builds it with ASan + UBSan into FASTTRAIN_EMU_OUTPUT_DIR and
        # FASTTRAIN_BUILD_TARGET builds one target (both for make test-emu-asan).
        emu_mode = os.environ.get("FASTTRAIN_EMU", "auto")
        with_emu = emu_mode == "1" or (emu_mode != "0" and getattr(self, "asked_inplace", False))
        cfg.append(f"-DFASTTRAIN_WITH_EMU={'ON' if with_emu else 'OFF'}")
        cfg.append(f"-DFASTTRAIN_EMU_SANITIZE={'ON' if os.environ.get('FASTTRAIN_EMU_SANITIZE') == '1' else 'OFF'}")
        if os.environ.get("FASTTRAIN_EMU_OUTPUT_DIR"):
            cfg.append(f"-DFASTTRAIN_EMU_OUTPUT_DIR={Path(os.environ['FASTTRAIN_EMU_OUTPUT_DIR']).resolve()}")
        target = ["--target", os.environ["FASTTRAIN_BUILD_TARGET"]] if os.environ.get("FASTTRAIN_BUILD_TARGET") else []
        print("fasttrain build:", "CPU + CUDA" if with_cuda else "CPU only", f"({build_dir})", flush=True)
        subprocess.run(cfg, check=True, env=env, stdout=subprocess.DEVNULL if not self.verbose else None)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs, *target], check=True, env=env)
        # CMake wrote the module where setuptools expects it; `--inplace` then copies it into
        # python/fasttrain.


def torch_pin() -> list[str]:
    """torch==<the version this build compiles against> (without a local label such as +cu130, so
    the CPU and the CUDA wheels of that release both satisfy it)."""
    try:
        import torch
    except ImportError:          # metadata only (e.g. an sdist): pyproject's own range stands
        return []
    return [f"torch=={torch.__version__.split('+')[0]}"]


def extensions() -> list[Extension]:
    try:
        with_cuda = want_cuda()[0]
    except ImportError:          # no torch yet (metadata only): the CPU module
        with_cuda = False
    return [CMakeExtension("fasttrain._C")] + ([CMakeExtension("fasttrain._C_cuda")] if with_cuda else [])


setup(
    version=VERSION,
    install_requires=[*torch_pin(), *BASE_REQUIREMENTS],
    ext_modules=extensions(),
    cmdclass={"build_ext": CMakeBuild},
)
