"""Stand-ins for the GPU packages fasttrain calls on CUDA and that cannot run here (no GPU; their
Triton and CUDA kernels do not run on a CPU): flash-linear-attention's `chunk_gated_delta_rule` and
causal-conv1d's `causal_conv1d_fn`.

Each stand-in refuses what its package's source refuses, at the lowest version the `gpu` extra of
pyproject.toml admits (flash-linear-attention>=0.3, causal-conv1d>=1.5), read from their sources:
  flash-linear-attention 0.3.0, fla/ops/gated_delta_rule/chunk.py and common/chunk_delta_h.py:
    q, k, v of one dtype, not float32 (asserted); beta [B, T, H] (asserted); q, k [B, T, H, K] and
    v [B, T, H, V] with the same H (0.3 has no grouped value heads); K <= 256 (asserted); the final
    state it returns is float32, o is in q's dtype.
  causal-conv1d 1.5.0, csrc/causal_conv1d.cpp and causal_conv1d_interface.py: x [B, dim, L] and
    weight [dim, width] in float32/float16/bfloat16 on CUDA; activation None, "silu" or "swish";
    x with stride 1 over time or over channels; channels-last (stride 1 over channels) needs dim and
    x's batch and time strides multiples of 8; width 2 to 4; initial_states only channels-last, in
    x's dtype, [B, dim, width-1] with stride 1 over channels; the output is empty_like(x).
Then each computes the op with fasttrain's plain-PyTorch definition (fasttrain.ops.reference) in
float32 on the inputs it was given, so its results are real numbers where the inputs are (the
selftest compares them) and fake tensors of the right shapes and dtypes under FakeTensorMode. Every
call is recorded in `CALLS` (package, dtypes, shapes).

What this is not: a check of the packages' numerics or of their kernels' own limits beyond the
asserts above; only a GPU run of `fasttrain selftest --device cuda` is that.
"""
from __future__ import annotations

import importlib.machinery
import sys
import types

import torch

CALLS: list[dict] = []
FLA_VERSION, CONV_VERSION = "0.3.0", "1.5.0"
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, head_first=False):
    from fasttrain.ops import reference as R
    assert q.dtype == k.dtype == v.dtype
    assert q.dtype != torch.float32, "ChunkGatedDeltaRuleFunction does not support float32. Please use bfloat16."
    assert len(beta.shape) == 3, "beta must be of shape [B, T, H] if head_first=False, or [B, H, T] otherwise."
    assert q.dim() == 4 and k.shape == q.shape and v.dim() == 4 and v.shape[:3] == q.shape[:3], \
        f"fla {FLA_VERSION}: q, k [B, T, H, K] and v [B, T, H, V] with one H; got {q.shape}, {k.shape}, {v.shape}"
    assert tuple(g.shape) == tuple(beta.shape) == tuple(q.shape[:3])
    assert q.shape[-1] <= 256, "current kernel does not support head dimension larger than 256."
    assert cu_seqlens is None and not head_first and not use_qk_l2norm_in_kernel
    CALLS.append({"package": "fla", "q": q.dtype, "k": k.dtype, "v": v.dtype, "g": g.dtype, "beta": beta.dtype,
                  "state": None if initial_state is None else initial_state.dtype, "device": q.device.type,
                  "shape": (tuple(q.shape), tuple(v.shape))})
    s0 = None if initial_state is None else initial_state.float()
    o, S = R.gated_delta_rule(q.float(), k.float(), v.float(), g.float(), beta.float(), scale=scale,
                              initial_state=s0)
    return o.to(q.dtype), (S.float() if output_final_state else None)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    from fasttrain.ops import reference as R
    if activation not in [None, "silu", "swish"]:
        raise NotImplementedError("activation must be None, silu, or swish")
    if x.stride(2) != 1 and x.stride(1) != 1:
        x = x.contiguous()
    assert x.dtype in _FLOATS and weight.dtype in _FLOATS
    assert x.is_cuda and weight.is_cuda
    B, dim, L = x.shape
    width = weight.shape[-1]
    assert tuple(weight.shape) == (dim, width), "weight must have shape (dim, width)"
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if channel_last:
        assert dim % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now"
        assert x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, \
            "causal_conv1d with channel last layout requires strides (x.stride(0) and x.stride(2)) to be multiples of 8"
    assert 2 <= width <= 4, "causal_conv1d only supports width between 2 and 4"
    assert bias is None and seq_idx is None and not return_final_states
    if initial_states is not None:
        assert channel_last, "initial_states is only supported for channel last layout"
        assert initial_states.dtype == x.dtype and initial_states.is_cuda
        assert tuple(initial_states.shape) == (B, dim, width - 1) and initial_states.stride(1) == 1
    CALLS.append({"package": "causal_conv1d", "x": x.dtype, "weight": weight.dtype, "device": x.device.type,
                  "channels_last": channel_last, "shape": tuple(x.shape)})
    s0 = None if initial_states is None else initial_states.transpose(1, 2).float()
    y, _ = R.causal_conv1d(x.transpose(1, 2).float(), weight.float(), s0, activation is not None)
    out = torch.empty_like(x)
    return out.copy_(y.transpose(1, 2).to(x.dtype))


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)      # importlib.util.find_spec finds it
    mod.__dict__.update(attrs)
    return mod


def install(monkeypatch, packages=("fla", "causal_conv1d")) -> list[dict]:
    """Put the stand-ins where `import fla...` / `import causal_conv1d` find them (for the test's
    duration) and return the call log, emptied."""
    CALLS.clear()
    if "fla" in packages:
        for name in ("fla", "fla.ops"):
            monkeypatch.setitem(sys.modules, name, _module(name, __version__=FLA_VERSION))
        monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule",
                            _module("fla.ops.gated_delta_rule", chunk_gated_delta_rule=chunk_gated_delta_rule))
    if "causal_conv1d" in packages:
        monkeypatch.setitem(sys.modules, "causal_conv1d",
                            _module("causal_conv1d", __version__=CONV_VERSION, causal_conv1d_fn=causal_conv1d_fn))
    return CALLS
