"""The CUDA emulator from Python: loads fasttrain._C_emu and gives every fasttrain op that has CUDA
kernels a twin under torch.ops.fasttrain_emu, with the fasttrain op's own schema, so that a test
calls the CUDA kernels and their launch sequences on CPU tensors exactly as the CUDA op is called.

    from cuda_emu.emulator import emu, use_schedule
    emu().nf4_quantize(w, 64)          # the CUDA kernels, on the CPU

FASTTRAIN_EMU_LIB=path loads another build of the module (`make test-emu-asan` points it at the
sanitized one). The tests compare the emulator with a peer: the CPU ops, or with
FASTTRAIN_EMU_PEER=cuda the CUDA ops on a GPU, given the same inputs (tools/gpu_check.sh). Bounds
shared by the tests (unit roundoffs, the sum of roundings) come from fasttrain.selftest.bounds.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import pytest
import torch

from fasttrain.selftest.bounds import U, sum_bound  # noqa: F401  (the tests take them from here)

# Ops whose CUDA kernels the emulator runs under the same schema (the NF4 linear's decode path and
# DoRA norm kernel have their own entry points, defined by the module itself).
MIRRORED = ("nf4_quantize", "nf4_dequantize", "blockwise8_quantize", "blockwise8_dequantize",
            "fused_logprob_forward", "fused_logprob_backward_weight", "policy_loss", "policy_loss_backward",
            "gated_delta_forward", "gated_delta_backward", "gated_delta_decode_", "moe_experts",
            "moe_experts_backward")
# (name, order, seed): order 0 runs threads and blocks in order, 1 in reverse, 2 shuffled from the seed.
SCHEDULES = {"forward": (0, 1), "reverse": (1, 1), "seeded": (2, 20261201)}
TWO_SCHEDULES = ("forward", "seeded")
# The block cap of every grid-stride launch in these tests (8 x 65,535 on a GPU): with 2 blocks, a
# kernel over more than 2 x its block size of items runs its grid-stride loop at least twice.
GRID_CAP = 2
U32, U64 = U[torch.float32], U[torch.float64]

_state: dict = {}


def module():
    """fasttrain._C_emu, loaded once (skips the test when this build has none: wheel builds)."""
    if "module" in _state:
        return _state["module"]
    import fasttrain.ops  # noqa: F401  (registers torch.ops.fasttrain, whose schemas are copied)
    path = os.environ.get("FASTTRAIN_EMU_LIB")
    try:
        if path:
            spec = importlib.util.spec_from_file_location("fasttrain._C_emu", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            sys.modules["fasttrain._C_emu"] = mod
        else:
            mod = importlib.import_module("fasttrain._C_emu")
    except ImportError as e:
        pytest.skip(f"the CUDA emulator is not built ({e}); `make build` builds it")
    mod.set_grid_cap(GRID_CAP)
    lib = torch.library.Library("fasttrain_emu", "FRAGMENT")
    for name in MIRRORED:
        schema = str(getattr(torch.ops.fasttrain, name).default._schema)
        lib.define(schema.split("::", 1)[1])
    _state.update(module=mod, library=lib)
    return mod


def emu():
    module()
    return torch.ops.fasttrain_emu


class _Peer:
    """torch.ops.fasttrain on the peer device: tensor arguments are copied there, results back, and
    an argument the op writes in place (the decode step's state) is copied back into the caller's."""

    def __init__(self, device: str):
        self.device = device

    def __getattr__(self, name):
        op = getattr(torch.ops.fasttrain, name)
        if self.device == "cpu":
            return op

        def call(*args):
            moved = [a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args]
            out = op(*moved)
            for a, m in zip(args, moved):
                if isinstance(a, torch.Tensor) and name.endswith("_"):
                    a.copy_(m.cpu())
            return tuple(o.cpu() for o in out) if isinstance(out, (tuple, list)) else out.cpu()
        return call


def peer() -> _Peer:
    """The ops the emulator is compared with (FASTTRAIN_EMU_PEER: cpu, the default, or cuda)."""
    device = os.environ.get("FASTTRAIN_EMU_PEER", "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.fail("FASTTRAIN_EMU_PEER=cuda but torch sees no CUDA device")
    return _Peer(device)


@contextlib.contextmanager
def use_schedule(name: str):
    order, seed = SCHEDULES[name]
    m = module()
    m.set_schedule(order, seed)
    try:
        yield
    finally:
        m.set_schedule(0, 1)


def assert_within(name: str, got: torch.Tensor, want: torch.Tensor, tol):
    """|got - want| <= tol elementwise (tol a tensor or a number), naming the worst element."""
    err = (got.double() - want.double()).abs()
    tol = torch.as_tensor(tol, dtype=torch.float64).expand_as(err)
    bad = ~(err <= tol)
    if bool(bad.any()):
        i = int(torch.argmax((err - tol).masked_fill(~bad, -float("inf")).flatten()))
        raise AssertionError(f"{name}: {int(bad.sum())} of {err.numel()} elements outside the bound; worst at "
                             f"flat index {i}: got {got.flatten()[i].item()!r}, want {want.flatten()[i].item()!r}, "
                             f"error {err.flatten()[i].item():.3g} > bound {tol.flatten()[i].item():.3g}")
