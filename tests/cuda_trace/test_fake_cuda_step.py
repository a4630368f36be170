"""A training step of each family (Llama, the Qwen3.5 hybrid) on fake CUDA tensors: the CUDA host
path, run before any GPU. The step (tests/support/trace_step.py: build_policy, the rollout's prefill and one
decode step, score_batch, one update_policy pass) runs for real on the CPU first, to record its
data-dependent answers, then on fake CUDA tensors with those answers (fake_cuda.py says how).

It fails when
  * a tensor of the traced step is on the CPU, outside HOST_ALLOWED (each entry says why);
  * a recurrent state (the delta rule's, the decoder's cache) or an adapter master or its AdamW
    moments is not float32 on CUDA;
  * the step dispatches to an implementation the selftest has no row for on CUDA with the same
    packages (`fasttrain.selftest.implementations`);
  * a GPU package is called with dtypes, shapes or layouts its source refuses (gpu_stubs.py).
Both package setups run: the `gpu` extra installed (flash-linear-attention and causal-conv1d as
stand-ins that assert what their sources assert) and not.
"""
from __future__ import annotations

import pytest
import torch

from support import gpu_stubs
from support import trace_step
from support.fake_cuda import Recorder, fake_cuda, own_backward

# (caller, why): tensors the traced step may make on the host, and why that is right
HOST_ALLOWED = {
    "fasttrain/train/policy_update.py:update_policy":
        "the pass's loss total for the log line, a float64 scalar summed on the host",
    "torch/optim/adamw.py:_init_group": "AdamW's step counters: torch.optim keeps `step` a host scalar "
                                        "unless capturable or fused (the trainer uses neither)",
    "torch/optim/adam.py:_init_group": "as above (AdamW shares Adam's code)",
    "torch/optim/adam.py:_single_tensor_adam": "the step counters' increments (host scalars, see above)",
    "fasttrain/rollout/sampling.py:left_padded": "the prompt batch, assembled from Python lists on the host "
                                                 "and copied to the device once",
    "fasttrain/train/distributed.py:sum_values": "the batch's counts, Python floats already; in one process "
                                                 "nothing is reduced, so they never go to the device",
}
# ops whose host output is right wherever they run: torch.tensor(data, device=...) lifts its data
# on the host and copies it (lift_fresh), as it does on a real GPU
HOST_OPS = {"aten.lift_fresh.default"}

class _TorchWithHostGenerators:
    """torch as rollout/sampling.py sees it in the fake run: its seeded per-group generators on the
    host (a CUDA generator needs a GPU). Stand-in 1 of 2 for the sampler's randomness."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def Generator(device="cpu"):
        return torch.Generator("cpu")


def _unseeded_uniforms(gens, rows, device):
    """Stand-in 2 of 2: the sampler's U[0, 1) draws without a generator (FakeTensorMode takes none);
    the same shape, dtype and device as the seeded draws."""
    return torch.rand(len(gens) * rows, dtype=torch.float64, device=device)


# fasttrain's registered ops -> the face the selftest checks them through
_OP_FACE = {"fused_logprob_forward": "fused_logprob", "fused_logprob_backward_weight": "fused_logprob",
            "policy_loss": "policy_loss", "policy_loss_backward": "policy_loss", "nf4_linear": "nf4_linear",
            "nf4_linear_backward": "nf4_linear", "nf4_quantize": "nf4_quantize", "nf4_dora_norm": "nf4_dora_norm",
            "nf4_weight_sq_norm": "nf4_dora_norm"}


def _record_implementations(monkeypatch, seen: set, states: list):
    """Wrap the delta rule's, the conv's and the 16-bit linear's implementations so the trace
    records which ran (and the recurrent states' dtypes)."""
    from fasttrain.nn import dense_linear as dl
    from fasttrain.ops import gated_delta as gd
    from fasttrain.rollout import hybrid_decoder as hd

    def wrap(mod, name, impl, state_args=()):
        fn = getattr(mod, name)

        def inner(*args, **kw):
            seen.add(impl)
            for i in state_args:
                if len(args) > i and args[i] is not None:
                    states.append((impl + " initial state", args[i].dtype, args[i].device.type))
            out = fn(*args, **kw)
            if impl.startswith("gated_delta_rule"):
                states.append((impl + " final state", out[1].dtype, out[1].device.type))
            return out
        monkeypatch.setattr(mod, name, inner)

    wrap(gd, "_fla", "gated_delta_rule:fla", (6,))
    wrap(gd, "chunked_rule", "gated_delta_rule:torch", (6,))
    wrap(gd, "_fused", "gated_delta_rule:fused", (6,))
    wrap(gd, "_conv_package", "causal_conv1d:causal_conv1d")
    wrap(gd, "_conv_torch", "causal_conv1d:torch")
    wrap(hd, "causal_conv1d_step", "causal_conv1d_step:torch")
    wrap(hd, "gated_delta_step_", f"gated_delta_step_:{gd.gated_delta_backend('cuda', step=True)}", (0,))
    wrap(dl, "dense_linear", "dense_linear:kernel")


_RECORDED: dict[str, list] = {}


def _cpu_answers(family: str) -> list:
    """The data-dependent answers of the step run for real on the CPU (once per family: the CPU
    run never uses the GPU packages)."""
    if family not in _RECORDED:
        torch.manual_seed(0)
        rec = Recorder()
        with rec, own_backward():
            trace_step.step(family, "cpu")
        _RECORDED[family] = rec.answers
    return list(_RECORDED[family])


def _trace(family: str, monkeypatch):
    """(fake-CUDA run, replay, implementations seen, states seen)."""
    answers = _cpu_answers(family)
    seen, states = set(), []
    _record_implementations(monkeypatch, seen, states)
    from fasttrain.rollout import sampling
    monkeypatch.setattr(sampling, "torch", _TorchWithHostGenerators())
    monkeypatch.setattr(sampling, "_uniforms", _unseeded_uniforms)
    torch.manual_seed(0)
    with fake_cuda(answers) as replay:
        fake = trace_step.step(family, "cuda")
    assert not replay.answers, f"the fake run asked {len(replay.answers)} fewer data-dependent questions"
    for op, _ in replay.ops:
        name = op.split(".")[1]
        if name in _OP_FACE:
            seen.add(f"{_OP_FACE[name]}:kernel")
    return fake, replay, seen, states


def _check_step(fake, replay, seen, states, family):
    from fasttrain import selftest
    host = sorted({(c, op) for c, op, _ in replay.host if c not in HOST_ALLOWED and op not in HOST_OPS})
    assert not host, f"tensors of the traced step on the CPU: {host}"
    for name, p in fake["params"].items():
        assert p.device.type == "cuda" and p.dtype == torch.float32, (name, p.device, p.dtype)
        st = fake["optimizer"].state[p]           # AdamW keeps moments only for a parameter that got a gradient
        assert st, f"{name} got no gradient"
        for key in ("exp_avg", "exp_avg_sq"):
            assert st[key].dtype == torch.float32 and st[key].device.type == "cuda", (name, key)
    if family == "qwen3_5":
        assert states, "no recurrent state passed through the delta rule"
    bad = [s for s in states if s[1] not in (torch.float32, torch.float64) or s[2] != "cuda"]
    assert not bad, f"recurrent states not float32 on CUDA: {bad}"
    missing = seen - selftest.implementations("cuda")
    assert not missing, f"the step runs implementations the selftest has no row for on CUDA: {sorted(missing)}"
    roll = fake["roll"]
    assert roll.completion_ids.device.type == "cuda" and roll.logprobs.dtype == torch.float32
    res = fake["result"]
    assert res.old_logp.device.type == "cuda" and res.old_logp.dtype == torch.float32 and len(res.passes) == 1


@pytest.mark.parametrize("family,packages", [("llama", "none"), ("qwen3_5", "gpu extra"), ("qwen3_5", "none")])
def test_a_training_step_runs_on_fake_cuda(family, packages, monkeypatch):
    """(The Llama family calls no GPU package: one run.)"""
    calls = gpu_stubs.install(monkeypatch) if packages == "gpu extra" else []
    fake, replay, seen, states = _trace(family, monkeypatch)
    _check_step(fake, replay, seen, states, family)
    expected = {"fused_logprob:kernel", "policy_loss:kernel", "nf4_linear:kernel", "nf4_dora_norm:kernel"} \
        if family == "llama" else {"fused_logprob:kernel", "policy_loss:kernel", "nf4_linear:kernel",
                                   "dense_linear:kernel", "gated_delta_step_:fused", "causal_conv1d_step:torch"}
    assert expected <= seen, sorted(expected - seen)
    if family == "qwen3_5":
        chunked = {"gated_delta_rule:fla"} if packages == "gpu extra" else {"gated_delta_rule:torch"}
        assert chunked <= seen and "gated_delta_rule:fused" not in seen, sorted(seen)
        conv = "causal_conv1d:causal_conv1d" if packages == "gpu extra" else "causal_conv1d:torch"
        assert conv in seen, sorted(seen)
    if packages == "gpu extra" and family == "qwen3_5":
        fla = [c for c in calls if c["package"] == "fla"]
        assert fla and all(c["q"] == c["v"] == torch.bfloat16 and c["state"] in (None, torch.float32) and
                           c["device"] == "cuda" for c in fla), fla
        assert any(c["package"] == "causal_conv1d" and c["channels_last"] for c in calls), calls
