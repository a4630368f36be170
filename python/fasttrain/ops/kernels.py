"""Which implementation the op faces of fasttrain.ops run: "fused" (the compiled kernels) or
"reference" (fasttrain.ops.reference, plain PyTorch).

    FASTTRAIN_KERNELS=reference python train.py      # any trainer that calls fasttrain.ops
    with fasttrain.ops.kernels.use_kernels("reference"): ...
    recipe: [run] kernels = "reference"             # fasttrain's own trainer

The reference is chosen when the environment variable or the code (set_kernels / use_kernels)
asks for it; either one is enough, so a user who set FASTTRAIN_KERNELS=reference after a failed
`fasttrain selftest` is never put back on the kernels by a default elsewhere. The variable is read
at every call (a dictionary lookup), so it can be set after import.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

__all__ = ["KERNELS", "ENV_VAR", "kernels", "set_kernels", "use_kernels", "use_reference"]

KERNELS = ("fused", "reference")
ENV_VAR = "FASTTRAIN_KERNELS"
_chosen = "fused"
_force_fused = 0  # > 0 inside fused_only(): the kernels under test, whatever was chosen


def _check(kind: str, where: str) -> str:
    if kind not in KERNELS:
        raise ValueError(f"{where}: {kind!r} is not a kernel choice; allowed: " + ", ".join(repr(k) for k in KERNELS))
    return kind


def use_reference() -> bool:
    """True when the op faces must run fasttrain.ops.reference."""
    if _force_fused:
        return False
    if _chosen == "reference":
        return True
    env = os.environ.get(ENV_VAR)
    if not env or env == "fused":  # unset or empty: the compiled kernels
        return False
    return _check(env.strip().lower(), ENV_VAR) == "reference"


def kernels() -> str:
    """The implementation in use now: "fused" or "reference"."""
    return "reference" if use_reference() else "fused"


def set_kernels(kind: str) -> str:
    """Choose "fused" or "reference" for this process (FASTTRAIN_KERNELS=reference still wins);
    returns the previous choice."""
    global _chosen
    prev, _chosen = _chosen, _check(kind, "set_kernels")
    return prev


@contextmanager
def use_kernels(kind: str):
    """set_kernels(kind) inside the block, the previous choice after it."""
    prev = set_kernels(kind)
    try:
        yield
    finally:
        set_kernels(prev)


@contextmanager
def fused_only():
    """The compiled kernels inside the block whatever was chosen (what the selftest checks)."""
    global _force_fused
    _force_fused += 1
    try:
        yield
    finally:
        _force_fused -= 1
