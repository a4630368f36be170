"""Loads the native extension once, with an error that says how to build or install it.

Two modules: fasttrain._C (the op schemas and the CPU kernels, one variant per x86-64 level, the
one that runs picked when it loads) and fasttrain._C_cuda (the CUDA kernels), which is loaded
only with a CUDA build of torch, so a CPU-only torch imports fasttrain and runs on the CPU. An
extension loads only with the torch it was compiled against: the wheel pins that torch, and a
mismatch found here is one line that names both versions.
"""
from __future__ import annotations

import importlib
import importlib.util

_C = None
_C_CUDA = None


class NativeExtensionError(ImportError):
    """The native extension is missing, or was built for another torch; the message says what to do."""


def _torch_release() -> str:
    import torch

    return torch.__version__.split("+")[0]


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if importlib.util.find_spec(name) is None:
            raise NativeExtensionError(
                f"fasttrain's native extension {name} is not built: build it with `make build` (or "
                "`pip install --no-build-isolation -e .`), or install a fasttrain wheel") from None
        raise NativeExtensionError(
            f"fasttrain's native extension {name} does not load with torch {_torch_release()} ({e}); it "
            "was built for another torch or CUDA: install the torch it was built for (`pip show fasttrain` "
            "lists it) or rebuild it (`make build`)") from None


def _check_torch(mod) -> None:
    built = str(mod.build_info()["torch_version"]).split("+")[0]
    if built != _torch_release():
        raise NativeExtensionError(
            f"fasttrain's native extension was built for torch {built}, and this is torch {_torch_release()}: "
            f"`pip install torch=={built}`, or rebuild fasttrain against this torch (`make build`)")


def load():
    """Import fasttrain._C (which registers torch.ops.fasttrain.* and the CPU kernels) and, with a
    CUDA torch, fasttrain._C_cuda (the CUDA kernels); return fasttrain._C."""
    global _C, _C_CUDA
    if _C is None:
        import torch  # (libtorch must be loaded before the extension)

        mod = _import("fasttrain._C")
        _check_torch(mod)
        if torch.version.cuda is not None and importlib.util.find_spec("fasttrain._C_cuda") is not None:
            _C_CUDA = _import("fasttrain._C_cuda")
            _check_torch(_C_CUDA)
        _C = mod
    return _C


def library_files() -> list:
    """The files of the loaded compiled modules (fasttrain._C, then fasttrain._C_cuda when loaded), as
    pathlib.Path; empty before load()."""
    from pathlib import Path

    return [Path(mod.__file__) for mod in (_C, _C_CUDA) if mod is not None]


def build_info() -> dict:
    """The extension's build: version, torch_version, the CPU variants it holds and the one that
    runs (cpu_variant), the compiled backends, CUDA archs and PTX ("" without the CUDA module)."""
    mod = load()
    info = dict(mod.build_info())
    info["cpu_variant"] = mod.cpu_variant()
    info["backends"] = ["CPU"] + (["CUDA"] if _C_CUDA is not None else [])
    cuda = dict(_C_CUDA.build_info()) if _C_CUDA is not None else {}
    info["cuda_archs"] = cuda.get("cuda_archs", "")
    info["cuda_ptx"] = cuda.get("cuda_ptx", "")
    return info
