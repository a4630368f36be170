"""The decode step compiled by inductor (the code `rollout.compile` runs on a CPU, generated C++)
samples the eager decoder's tokens in float32, with the same seeds, on a tiny model of each family:
Llama, the Qwen3.5 hybrid (Gated DeltaNet + gated attention, rows held after EOS), Qwen3-MoE (the
routing record too). The aot_eager tests next to each decoder check the traced graph without code
generation; these check what inductor generates from it.

Tolerance on the behaviour log-probs (float32 on both sides, so the two differ by rounding order
only: inductor fuses the elementwise work and may reorder the sums). Each logit is reached through
`layers` blocks whose sums have at most H + 2·S·D terms (the projections, attention over S keys of
D dims); one side's first-order error is layers·(H + 2·S·D)·u·M with u = 2^-24 and M = 1e3 a bound on
the magnitudes summed (unit-scale activations, |logit| < 10, 1/rms < 1e2), the same form as the
float64 tests with float32's u; the log-softmax adds 8·u·(max|z| + log V) per side. Two sides: twice
the sum. The tokens must be equal: a token could differ only where two candidates' Gumbel scores
tie within that bound, which these seeds do not hit (a failure here names the first differing step).

Compile time: the first call per batch shape generates and builds C++ (about 10-40 s per model on
a 2-core CPU; inductor's on-disk cache makes a rerun faster). On a host where inductor cannot build
C++ (no compiler found) the tests are skipped with that reason: they are not passed.
"""
from __future__ import annotations

import math
import shutil
import time

import pytest
import torch

from fasttrain.models import tiny_llama, tiny_qwen3_5
from fasttrain.models.moe import moe_surgery
from fasttrain.models.moe_tiny import tiny_qwen3_moe
from fasttrain.rollout import sample
from fasttrain.rollout.compiled_decode import compiled_decode

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10]]
NEW = 8

FAMILIES = {
    "llama": lambda: tiny_llama(vocab_size=128, seed=1, dtype=torch.float32),
    "hybrid": lambda: tiny_qwen3_5(vocab_size=97, seed=7, dtype=torch.float32, layers=4, interval=4),
    "moe": lambda: moe_surgery(tiny_qwen3_moe(vocab_size=128, seed=2, dtype=torch.float32), nf4=False),
}


def _inductor_or_skip() -> None:
    """Skip (saying why) where inductor has no C++ compiler; any other compile error is a failure."""
    from torch._inductor import config
    names = [c for c in (config.cpp.cxx if isinstance(config.cpp.cxx, tuple) else (config.cpp.cxx,)) if c]
    names += ["g++", "c++", "clang++"]
    if not any(shutil.which(n) for n in names):
        pytest.skip(f"inductor cannot compile on this host: no C++ compiler found ({', '.join(names)} not on "
                    "PATH); the compiled decode step is untested here")


def _tol(model, S: int, logp: torch.Tensor) -> float:
    c = model.config
    D = max(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            getattr(c, "linear_key_head_dim", 0) or 0)
    u = 2.0 ** -24
    side = c.num_hidden_layers * (c.hidden_size + 2 * S * D) * u * 1e3
    side += 8 * u * (float(logp.abs().max()) + math.log(c.vocab_size))
    return 2 * side


@pytest.mark.parametrize("family", list(FAMILIES))
def test_inductor_compiled_decode_samples_the_eager_tokens_in_float32(family):
    import torch._dynamo
    _inductor_or_skip()
    torch._dynamo.reset()
    model = FAMILIES[family]()
    kw = dict(group_size=2, max_new_tokens=NEW, temperature=1.0, eos_token_ids=[2, 3], seed=[3, 4, 5],
              pad_token_id=0)
    ref = sample(model, PROMPTS, **kw)
    t0 = time.perf_counter()
    got = sample(model, PROMPTS, compile=True, **kw)
    first = time.perf_counter() - t0
    step = compiled_decode(model, None)
    print(f"{family}: compile + first rollout {first:.1f} s (compile_seconds {step.compile_seconds:.1f})")
    assert step.compile_seconds > 0                       # the compiled step ran (it was not eager)
    for again in range(2):                                # the kept cache and graph, a second time
        if again:
            got = sample(model, PROMPTS, compile=True, **kw)
        differ = (got.completion_ids != ref.completion_ids).any(0).nonzero()
        assert not differ.numel(), f"{family}: compiled tokens differ from eager's from step {int(differ[0])}"
        assert torch.equal(got.completion_mask, ref.completion_mask)
        S = ref.input_ids.shape[1]
        tol = _tol(model, S, ref.logprobs)
        torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=0, atol=tol)
        if ref.routing is not None:
            assert torch.equal(got.routing, ref.routing)
    if family == "hybrid":
        assert not ref.completion_mask.all()                 # rows finished and were held


def test_compile_setting_auto_picks_by_device():
    """rollout.compile = "auto": compiled on CUDA, eager on a CPU (measured no faster there, see
    fasttrain.rollout.compiled_decode.auto_compile); True/False and backend names pass through."""
    from fasttrain.rollout.compiled_decode import resolve_compile
    assert resolve_compile("auto", torch.device("cpu")) is False
    assert resolve_compile("auto", torch.device("cuda")) == "inductor"
    assert resolve_compile(True, torch.device("cpu")) == "inductor"
    assert resolve_compile(False, torch.device("cuda")) is False
    assert resolve_compile("aot_eager", torch.device("cpu")) == "aot_eager"


def test_rollout_compile_setting_takes_auto_true_and_false():
    from fasttrain.train.config import ConfigError, RolloutSection, load_config
    assert RolloutSection().compile == "auto"
    for v in ("auto", True, False):
        got = load_config({"rollout": {"compile": v}}).rollout.compile
        assert got == v and type(got) is type(v)
    for bad in (1, 0, "yes", "inductor"):          # 1 == True in Python: the type must match too
        with pytest.raises(ConfigError, match=r"rollout.compile: .* is not allowed; allowed values: 'auto', "
                                              r"true, false"):
            load_config({"rollout": {"compile": bad}})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_asking_for_the_end_every_few_steps_returns_the_per_step_rollout(family, monkeypatch):
    """On CUDA the sampler asks whether every row has ended every few steps (each ask is a host
    sync), so some held steps may run past the last row's end; the rollout it returns is the one a
    check at every step returns: the same tokens, log-probs, masks, T and routing. Checked on the
    CPU with an interval of 3, with rollouts that end early (many EOS ids) at T not a multiple of 3,
    and one that runs to max_new_tokens."""
    import fasttrain.rollout.sampling as S
    model = FAMILIES[family]()
    cases = [dict(eos_token_ids=list(range(2, 40)), seed=s, max_new_tokens=24) for s in range(6)]
    cases.append(dict(eos_token_ids=[], seed=1, max_new_tokens=7))
    refs = []
    for c in cases:
        refs.append(sample(model, PROMPTS, group_size=3, temperature=1.0, pad_token_id=0, **c))
    ends = [r.completion_ids.shape[1] for r in refs]
    assert ends[-1] == 7 and any(T < 24 and T % 3 for T in ends[:-1])
    monkeypatch.setitem(S._DONE_CHECK_EVERY, "cpu", 3)
    for c, ref in zip(cases, refs):
        got = sample(model, PROMPTS, group_size=3, temperature=1.0, pad_token_id=0, **c)
        for name in ("input_ids", "attention_mask", "position_ids", "completion_ids", "completion_mask",
                     "lengths", "logprobs", "finished"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), (family, c, name)
        assert (got.routing is None) == (ref.routing is None)
        if ref.routing is not None:
            assert torch.equal(got.routing, ref.routing)
