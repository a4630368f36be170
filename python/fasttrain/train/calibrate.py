"""The calibration step: this host's rates for `fasttrain plan`, measured and stored in the cache.

    calibrate("cpu")                  # the cached rates of this host's CPU, measured first when none are
    calibrate("cuda", refresh=True)   # measured again

The plan reads rates and runs no trainer or rollout code (fasttrain.plan.host_rates: the rates, the
cache and the kernels' own measurements). What a step costs apart from its arithmetic is measured
here, with the code that costs it: the rollout's sampling step (fasttrain.rollout.sampling) and, on
micro Llamas of 1 and 3 layers, fasttrain's own decode step (fasttrain.rollout.sample), no-grad
log-probs and update micro-batch (fasttrain.train.policy_update.answer_logprobs, the policy loss,
backward, clipping, AdamW; with and without gradient checkpointing).

Where `fasttrain plan` gets measured rates on a host that never ran this: `fasttrain plan --gpu
cpu|cuda` (with --rates measured, the default) calls calibrate on demand, so the first such plan
measures (seconds on a CPU) and stores, and later plans read the cache; --remeasure measures again.
Other readers of the plan (the trainer's pre-load plan, fasttrain.plan.report) take the cached
rates when there are some and the table's constants when there are none: they never measure.
"""
from __future__ import annotations

import datetime as dt
import time

import torch

from fasttrain.plan.host_rates import (CLOCKS, Clock, HostRates, cached_rates, clock_for, host_name, kernel_rates,
                                      median_time, store_rates, sync_for)

__all__ = ["calibrate", "measure"]

PROMPT = 128                      # tokens of the micro model's prompts (framework costs grow with P: masks)


def _sampling_rate(dev: torch.device, clock: Clock, reps: int) -> float:
    from fasttrain.rollout.sampling import draw_tokens
    logits = torch.randn(16, 32768, device=dev)
    gens = [torch.Generator(device=dev).manual_seed(0)]
    return logits.numel() / median_time(lambda: draw_tokens(logits, 1.0, gens, 16), reps, clock, sync_for(dev))


def _sorted_sampling_rate(dev: torch.device, clock: Clock, reps: int) -> float:
    """The same draw with top_p 0.9 (Truncation): each row sorted for its kept set."""
    from fasttrain.rollout.sampling import Truncation, draw_tokens
    logits = torch.randn(16, 32768, device=dev)
    gens = [torch.Generator(device=dev).manual_seed(0)]
    trunc = Truncation(top_p=0.9)
    return logits.numel() / median_time(lambda: draw_tokens(logits, 1.0, gens, 16, truncation=trunc), reps, clock,
                                         sync_for(dev))


def _micro_policy(layers: int, dev: torch.device):
    """A micro Llama in NF4 + LoRA as the trainer builds its policy (hidden 32, vocab 64)."""
    from fasttrain.models.tiny import tiny_llama
    from fasttrain.nn import attach_adapters, quantize_model

    model = tiny_llama(vocab_size=64, hidden=32, layers=layers, heads=2, kv_heads=1, seed=0).to(dev)
    quantize_model(model)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(0)
        params = attach_adapters(model, r=4, alpha=8)
    return model, params


def _layer_costs(dev: torch.device, clock: Clock, reps: int) -> dict:
    """Per-layer and per-call seconds of fasttrain's decode step, no-grad log-probs and update
    micro-batch (forward, loss, backward, clip, AdamW step) on micro models of 1 and 3 layers."""
    from fasttrain.nn.rollout_weights import RolloutWeights
    from fasttrain.ops import policy_loss
    from fasttrain.rollout import sample
    from fasttrain.train.policy_update import answer_logprobs   # the code measured, not the trainer

    sync = sync_for(dev)
    prompts = [[1 + (i * 7 + j) % 60 for j in range(PROMPT)] for i in range(2)]
    out = {}
    for L in (1, 3):
        model, params = _micro_policy(L, dev)
        weights = RolloutWeights(model)

        def run(T):
            return sample(model, prompts, group_size=2, max_new_tokens=T, temperature=1.0, eos_token_ids=[],
                          seed=[0, 1], weights=weights)
        steps = 8
        decode = (median_time(lambda: run(steps + 1), reps, clock, sync)
                  - median_time(lambda: run(1), reps, clock, sync)) / steps
        roll = run(9)
        args = (roll.input_ids, roll.attention_mask, roll.prompt_len, roll.completion_ids, roll.completion_mask, 1.0)
        kw = dict(position_ids=roll.position_ids, prompt_index=roll.prompt_index)
        model.eval()
        with torch.no_grad():
            fwd = median_time(lambda: answer_logprobs(model, *args, **kw), reps, clock, sync)
        model.train()
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
        adv = torch.ones(roll.completion_ids.shape[0], device=dev)

        def train():
            logp, _ = answer_logprobs(model, *args, **kw)
            loss, _ = policy_loss(logp, logp.detach(), adv, roll.completion_mask, loss="cispo")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        fb = median_time(train, reps, clock, sync)
        _checkpointing_on(model)
        fb_ckpt = median_time(train, reps, clock, sync)
        out[L] = (decode, fwd, fb, fb_ckpt)
    slope = [max(0.0, (out[3][i] - out[1][i]) / 2) for i in range(4)]
    call = [max(0.0, out[1][i] - slope[i]) for i in range(4)]
    return {"decode_layer": slope[0], "decode_call": call[0], "forward_layer": slope[1],
            "forward_call": call[1], "train_layer": slope[2], "train_call": call[2],
            "train_ckpt_layer": slope[3], "train_ckpt_call": call[3]}


def _checkpointing_on(model) -> None:
    """Gradient checkpointing as the trainer turns it on (fasttrain.train.policy.build_policy)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def measure(device="cpu", clock: Clock = time.perf_counter, reps: int = 3) -> HostRates:
    """Measure this host's rates now on `device` (fasttrain.plan.host_rates' header); a few seconds
    on a CPU: the kernels' rates, then the sampling step and the per-layer framework costs."""
    dev = torch.device(device)
    kernels = kernel_rates(dev, clock, reps)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        layers = _layer_costs(dev, clock, reps)
    return HostRates(
        device=host_name(dev), threads=torch.get_num_threads(), **kernels,
        sampling=_sampling_rate(dev, clock, reps), sampling_sorted=_sorted_sampling_rate(dev, clock, reps),
        **layers,
        measured_at=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        clock=next((k for k, v in CLOCKS.items() if v is clock), "given"), device_kind=dev.type)


def calibrate(device="cpu", refresh: bool = False) -> HostRates:
    """This host's rates on `device`: from the cache when measured before under the same key,
    else measured now (measure, on the clock_for the device) and stored. A cache that cannot be
    read or written is skipped."""
    dev = torch.device(device)
    rates = None if refresh else cached_rates(dev)
    if rates is not None:
        return rates
    rates = measure(dev, clock=clock_for(dev))
    store_rates(rates, dev)
    return rates
