"""Loads the native extension once, with an error that says how to build it."""
from __future__ import annotations

import importlib

_C = None


def load():
    """Import fasttrain._C (which registers torch.ops.fasttrain.*) and return it."""
    global _C
    if _C is None:
        import torch  # noqa: F401  (libtorch must be loaded before the extension)

        try:
            _C = importlib.import_module("fasttrain._C")
        except ImportError as e:
            raise ImportError(
                "fasttrain's native extension is not built or does not match this torch "
                f"({e}). Build it with `make build` (or `pip install --no-build-isolation -e .`)."
            ) from e
    return _C


def build_info() -> dict:
    return dict(load().build_info())
