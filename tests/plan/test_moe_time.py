"""The routed experts' time in a plan timed from measured rates (fasttrain.plan.moe_speed) and their
memory on CUDA (fasttrain.plan.moe_memory's CUDA kernel terms).

Time: the experts' seconds of every phase from given rates (a HostRates with chosen numbers), against
the FLOPs and bytes counted by hand here from the shapes; the work grows with k and with the
experts' width as counted; the measured path names what timed the experts (and no longer says they
are not timed) and gets its rates at the model's shapes by running fasttrain.ops.moe_experts; an
old host_rates.json entry without the MoE rates is measured again. No wall-clock assertion: how well
the plan predicts a real MoE step is bench/bench_planned_time.py --moe.

Memory: the CUDA kernel's launch code runs on the CPU in the CUDA emulator (fasttrain._C_emu), whose
allocations go through torch's CPU allocator, so the bytes it allocates (outputs and scratch, all
held until the op returns) are measured from the profiler's allocator events and compared with the
count (cuda_forward_bytes, cuda_backward_bytes), exactly; the GPU plan uses those terms, and the torch
form's under FASTTRAIN_MOE_CUDA=torch.
"""
import json
import math
from dataclasses import asdict, replace

import pytest
import torch

from fasttrain.plan import moe_memory, moe_speed
from fasttrain.plan.host_speed import measured_step_time
from fasttrain.plan.run_shape import RunShape

R = 4
S = RunShape(prompts=2, group=4, prompt_tokens=16, new_tokens=6, micro_batch=4, passes=2, dtype="float32",
             rank=R, alpha=8.0)


def _rates(**kw):
    from support.rates import fake_rates
    return fake_rates(**{"clock": "given", **kw})     # "given": not a clock, so nothing is measured


_MODELS: dict = {}


def _model(name="qwen3-30b-a3b", quantize="nf4", **kw):
    """The ModelShape of the bundled `name` at small width (moe_scaled), built once."""
    key = (name, quantize, tuple(sorted(kw.items())))
    if key not in _MODELS:
        from support.moe_scaled import scaled_moe

        from fasttrain.plan import meta_policy
        _MODELS[key] = meta_policy(scaled_moe(name, **kw).config, name=name, dtype="float32", rank=R, alpha=8.0,
                                   quantize=quantize)
    return _MODELS[key]


def _experts_seconds(m, s, nf4=True):
    """{phase: the experts' seconds} at the rates _rates gives: the phases at those rates less the
    phases with the experts' three rates doubled are half the experts' seconds."""
    tag = "nf4" if nf4 else "16"
    base = _rates()
    fast = replace(base, **{f"moe_{p}_{tag}": 2 * getattr(base, f"moe_{p}_{tag}") for p in ("fwd", "fb", "decode")})
    slow, _ = measured_step_time(m, s, base, "float32", True, False, measure_shapes=False)
    quick, _ = measured_step_time(m, s, fast, "float32", True, False, measure_shapes=False)
    return {p: 2 * (slow[p] - quick[p]) for p in slow}


def _by_hand(m, s, nf4=True):
    """The experts' seconds of each phase counted here from the shapes: per (token, expert) pair
    forward 6·I·H (gate_up, down) + 4·I (SwiGLU) + 2·H (weighted sum) + 2r(2H + 3I) (LoRA), forward
    + backward that + 6·I·H + 12·I + 3·H + 4r(2H + 3I); a decode step reads the experts its rows
    touch, E·(1 - (1 - k/E)^B) of each layer's E, every one's NF4 codes + absmax per 64 weights (or
    16-bit weights) and fp32 LoRA."""
    E, k, I, n = m.moe.experts, m.moe.active, m.moe.width, m.moe.layers
    H, r, B, P, T = m.hidden, R, s.rows, s.prompt_tokens, s.new_tokens
    rates = _rates()
    f, b, d = (rates.moe_fwd_nf4, rates.moe_fb_nf4, rates.moe_decode_nf4) if nf4 else \
        (rates.moe_fwd_16, rates.moe_fb_16, rates.moe_decode_16)
    fwd = 6 * I * H + 4 * I + 2 * H + 2 * r * (2 * H + 3 * I)
    fb = fwd + 6 * I * H + 12 * I + 3 * H + 4 * r * (2 * H + 3 * I)
    weights = (2 * I * H // 2 + 2 * I * H // 64 * 4 + H * I // 2 + H * I // 64 * 4) if nf4 else 3 * I * H * m.w
    one = weights + r * (H + 2 * I + I + H) * 4
    assert m.resident["moe_experts"] + m.resident["moe_adapter_masters"] == n * E * one
    # micro-batches of 4 rows, one prompt each: 16 prompt tokens + 4 answers x 5 input tokens
    mbs = [1 * P + 4 * (T - 1)] * 2
    prefill = s.prompts * P * n * k * fwd / f
    decode = (T - 1) * n * E * one * (1 - (1 - k / E) ** B) / d
    scores = sum(t * n * k * fwd / f for t in mbs)
    update = s.passes * sum(t * n * k * (fb / b + fwd / f) for t in mbs)     # + the recomputed forward
    return {"rollout": prefill + decode, "scores": scores, "update": update}


@pytest.mark.parametrize("variant", [{}, {"top_k": 4}, {"width": 2.0}, {"quantize": "none"}],
                         ids=["k8", "k4", "wide", "16bit"])
def test_experts_seconds_are_the_counted_work_over_the_given_rates(variant):
    m = _model(**variant)
    nf4 = variant.get("quantize", "nf4") == "nf4"
    got, want = _experts_seconds(m, S, nf4), _by_hand(m, S, nf4)
    for phase in want:
        assert math.isclose(got[phase], want[phase], rel_tol=1e-9), (phase, got[phase], want[phase])


def test_a_moe_plans_time_grows_with_k_and_the_experts_width_as_counted():
    """Half k: half the pairs (the same work a pair); twice the experts' width: a pair's work as counted."""
    base, k4, wide = _model(), _model(top_k=4), _model(width=2.0)
    assert (base.moe.active, k4.moe.active, 2 * base.moe.width) == (8, 4, wide.moe.width)
    t = {name: measured_step_time(mm, S, _rates(), "float32", True, False, measure_shapes=False)[0]
         for name, mm in (("base", base), ("k4", k4), ("wide", wide))}
    e = {name: _experts_seconds(mm, S) for name, mm in (("base", base), ("k4", k4), ("wide", wide))}
    assert math.isclose(e["base"]["update"], 2 * e["k4"]["update"], rel_tol=1e-9)
    H, I, r, rates = base.hidden, base.moe.width, R, _rates()

    def pair(i):    # an update's pair: forward + backward, and the forward recomputed under checkpointing
        fwd = 6 * i * H + 4 * i + 2 * H + 2 * r * (2 * H + 3 * i)
        fb = 2 * (6 * i * H) + 16 * i + 5 * H + 6 * r * (2 * H + 3 * i)
        return fb / rates.moe_fb_nf4 + fwd / rates.moe_fwd_nf4
    assert math.isclose(e["wide"]["update"] / e["base"]["update"], pair(2 * I) / pair(I), rel_tol=1e-9)
    for phase in ("rollout", "scores", "update"):
        assert t["k4"][phase] < t["base"][phase] < t["wide"][phase], phase


def test_the_measured_path_says_what_timed_the_experts():
    """No more "not timed": the note names fasttrain.ops.moe_experts' rates and where they come from;
    the paper path (a datasheet GPU) says it is on paper and what it assumes."""
    from fasttrain.plan import gpu_spec
    from fasttrain.plan.speed import plan_time

    m = _model("qwen3.5-35b-a3b")
    t = plan_time(m, S, replace(gpu_spec("cpu"), rates=_rates()), compute_dtype="float32")
    text = " ".join(t.assumptions)
    assert "not timed" not in text and min(t.seconds["rollout"], t.seconds["scores"], t.seconds["update"]) > 0
    assert "routed experts timed from fasttrain.ops.moe_experts' own rates, the host's reference MoE layer" in text
    paper = plan_time(m, S, gpu_spec("h100-sxm-80gb"))
    assert moe_speed.ASSUMPTION in paper.assumptions and "timed on paper" in moe_speed.ASSUMPTION


def test_the_rates_at_the_models_shapes_come_from_running_the_op(monkeypatch):
    """With a known clock the plan measures moe_experts at this model's shapes: the op runs (no grad
    and with backward, at the counted pairs per expert; a decode call), and its rates time the experts."""
    import importlib
    face = importlib.import_module("fasttrain.ops.moe_experts")   # the module (fasttrain.ops.moe_experts is the op)

    calls = []
    op = face.moe_experts

    def counted(x, idx, w, gu, dn, *rest):
        calls.append((tuple(x.shape), idx.shape[1], gu.E, gu.in_features, dn.in_features, torch.is_grad_enabled()))
        return op(x, idx, w, gu, dn, *rest)
    monkeypatch.setattr(face, "moe_experts", counted)
    moe_speed._measured.cache_clear()
    m = _model()
    E, k, I = m.moe.experts, m.moe.active, m.moe.width
    _, notes = measured_step_time(m, S, _rates(clock="process_time"), "float32", True, False, measure_shapes=True)
    assert "this model's experts (NF4 128 x 48, LoRA r 4, float32 tokens) measured now" in notes[-1], notes[-1]
    # the update micro-batch's 36 tokens x 8 / 16 experts = 18 pairs per expert -> 16 (a power of two):
    # 16 experts x 16 pairs / 8 slots = 32 tokens, without grad and with
    assert ((32, 128), k, E, 128, I, False) in calls and ((32, 128), k, E, 128, I, True) in calls
    # decode: 8 rows touch 16 (1 - (1/2)^8) = 15.9 -> 16 experts at 8 x 8 / 15.9 -> 4 pairs each: 8 tokens
    assert ((8, 128), k, E, 128, I, False) in calls
    moe_speed._measured.cache_clear()


def test_an_old_cache_entry_without_the_moe_rates_is_measured_again(tmp_path, monkeypatch):
    import fasttrain.plan.host_rates as hr
    import fasttrain.train.calibrate as cal
    from support.rates import fake_rates as _fake_rates

    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path))
    old = {k: v for k, v in asdict(_fake_rates()).items() if not k.startswith("moe_")}
    hr.cache_path().parent.mkdir(parents=True, exist_ok=True)
    hr.cache_path().write_text(json.dumps({hr._key(torch.device("cpu")): old}))
    assert hr.cached_rates("cpu") is None
    monkeypatch.setattr(cal, "measure", lambda device, clock=None: _fake_rates())
    assert cal.calibrate("cpu").moe_fb_nf4 == _fake_rates().moe_fb_nf4
    assert json.loads(hr.cache_path().read_text())[hr._key(torch.device("cpu"))]["moe_decode_16"] > 0


# ---- memory: the CUDA kernel's allocations --------------------------------------------------------------
def _allocations(fn):
    """(fn's result, peak bytes allocated above the start, bytes still allocated at its end) from the
    profiler's CPU allocator events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        prof.toggle_collection_dynamic(False, [ProfilerActivity.CPU])   # allocator events only
        out = fn()
    live = peak = 0
    for _, nb in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]"):
        live += nb
        peak = max(peak, live)
    return out, peak, live


@pytest.mark.cuda_emu
@pytest.mark.parametrize("dtype,r", [(torch.bfloat16, 2), (torch.float32, 0)], ids=["bf16-lora", "fp32-plain"])
def test_the_cuda_kernels_allocations_are_the_planned_bytes(monkeypatch, dtype, r):
    """The launch code on the emulator: forward (saving for the backward, and not) and backward,
    every byte it allocates against cuda_forward_bytes / cuda_backward_bytes (bf16 tokens add their
    float32 copies, LoRA its products)."""
    from cuda_emu.emulator import emu

    from fasttrain.selftest.cases.moe import moe_inputs
    N, H, I, E, k = 5, 64, 32, 4, 2
    x, idx, w, gu, dn, gul, dnl, dy = moe_inputs(N, H, I, E, k, r, dtype, True, seed=3)
    rest = (gu.qweight, gu.absmax_fp32().contiguous(), dn.qweight, dn.absmax_fp32().contiguous(), 64, I,
            *(gul or (None, None)), *(dnl or (None, None)), 2.0)
    wb, P = x.element_size(), N * k
    op = emu()
    for save in (False, True):
        outs, peak, kept = _allocations(lambda: op.moe_experts(x, idx, w, *rest, save))
        assert peak == moe_memory.cuda_forward_bytes(N, H, I, E, k, r, r, wb, save), save
        assert kept == N * H * wb + 8 * P + 8 * (E + 1) + (P * (2 * I + H) * 4 if save else 0), save
    _, order, offsets, h, out = outs
    dy = dy.to(dtype)                          # autograd hands the backward dy in y's dtype
    grads, peak, kept = _allocations(lambda: op.moe_experts_backward(dy, x, idx, w, *rest, order, offsets,
                                                                       h, out, [True, True, True]))
    assert peak == moe_memory.cuda_backward_bytes(N, H, I, E, k, r, r, wb, lora_grads=True)
    assert kept == sum(g.numel() * g.element_size() for g in grads)


def test_a_gpu_plan_counts_the_cuda_kernel_and_the_torch_form_when_told(monkeypatch):
    from fasttrain.plan import plan_memory
    from fasttrain.plan.memory import Device, _layers_of

    m = _model()
    monkeypatch.delenv("FASTTRAIN_MOE_CUDA", raising=False)
    assert _layers_of(m, Device("cuda")).live is moe_memory.cuda_kernel_live
    assert _layers_of(m, Device("cpu")).live is moe_memory.kernel_live
    assert _layers_of(replace(m, dtype=torch.float64), Device("cuda")).live is moe_memory.routed_live
    s = S.with_(prompts=4, group=8, prompt_tokens=64, new_tokens=32, micro_batch=8)
    kernel = plan_memory(m, s, Device("cuda")).phases["update"]["moe_activations"]
    monkeypatch.setenv("FASTTRAIN_MOE_CUDA", "torch")
    assert _layers_of(m, Device("cuda")).grads is moe_memory.routed_grads
    torch_form = plan_memory(m, s, Device("cuda")).phases["update"]["moe_activations"]
    assert 0 < kernel < torch_form
