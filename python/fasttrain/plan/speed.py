"""Time of one training step on paper, from first principles.

  prefill   2·(projection weights)·n·P FLOPs + attention 4·L·heads·head_dim·n·P² + the lm_head
            on the n last positions, at `mfu` of the device's dense bf16 peak; per prefill chunk
            at least one read of the weights
  decode    T steps, each at the larger of two floors: reading the NF4 weights (packed + absmax),
            the adapters, the lm_head and the KV cache of B rows once from memory at full
            bandwidth, or 2·(weights)·B FLOPs at `mfu` of the peak; in waves (rows decoded at
            once, fasttrain.plan.picks), each wave's T steps over its own rows
  verify    B answers at the environment's measured answers per second
  scores    no-grad forwards over the batch (reference with adapters off; the pre-update policy
            when the token mask needs entropies first), each micro-batch running each of its
            distinct prompts once (fasttrain.train.prefix_forward) and then every row's answer
  update    per pass: forward + backward for activations (2 + 2 FLOPs per weight per token), a
            re-forward under gradient checkpointing (+2), the LoRA products, and the fused
            log-prob head (forward 2·N·H·V, its gradient vector formed in the same pass 2·N·H·V),
            over the same tokens as the scores (the shared prefix runs with or without checkpointing)
A mixture of experts' routed experts count here as dense GEMMs over the k active experts' weights
(2 FLOPs a weight a token, their LoRA apart) at the same share of the peak, and a decode step reads
the experts its rows pick (fasttrain.plan.moe_speed.ASSUMPTION; fasttrain.plan.family_time says
which families take those terms).
The FLOP share `mfu` is an assumption printed with the result (no GPU run has measured it yet).
When the plan is for a device of this host whose rates were measured (fasttrain.plan.host_rates),
fasttrain.plan.host_speed times every phase from those rates instead (the routed experts from
fasttrain.ops.moe_experts' own measured rates: fasttrain.plan.moe_speed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fasttrain.plan.family_time import family_time
from fasttrain.plan.gpus import GPU
from fasttrain.plan.meta_model import ModelShape
from fasttrain.plan.run_shape import RunShape

__all__ = ["StepTime", "plan_time", "prompt_runs", "waves", "VERIFIER_ANSWERS_PER_S"]

# The built-in verifiers' measured throughput (bench/bench_env.py, warm cache, one core of a quiet
# 2-core AMD EPYC; bench/results/cpu-2c-AMD-EPYC-2026-11-30.md).
VERIFIER_ANSWERS_PER_S = {"signal-a": 242.0}


@dataclass
class StepTime:
    seconds: dict = field(default_factory=dict)      # phase -> s
    assumptions: list = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def dominant(self) -> str:
        return max(self.seconds, key=self.seconds.get)


def _lora_flops(m: ModelShape, tokens: int) -> float:
    """Forward x·Aᵀ and (xAᵀ)·Bᵀ per projection: 2·r·(in + out) per token (and per active expert)."""
    experts = family_time(m).experts
    return 2.0 * m.rank * sum(o + i for o, i in m.projections) * tokens + (
        experts.expert_lora_flops(m, tokens) if experts else 0.0)


def _matmul_params(m: ModelShape) -> int:
    """Weights one token multiplies: the projections' and a mixture of experts' k active experts'."""
    experts = family_time(m).experts
    return m.linear_params + (experts.active_params(m) if experts else 0)


def prompt_runs(s: RunShape) -> int:
    """Prompt forwards per pass over the batch: each micro-batch runs each distinct prompt among its
    rows once (rows of a group are contiguous)."""
    B, G = s.rows, s.group
    mb = max(1, min(s.micro_batch, B))
    return sum((min(k + mb, B) - 1) // G - k // G + 1 for k in range(0, B, mb))


def _forward_flops(m: ModelShape, tokens: int, keys_per_token: float) -> float:
    attn = 4.0 * m.kv_layers * m.heads * m.head_dim * keys_per_token * tokens
    return 2.0 * _matmul_params(m) * tokens + attn + m.state_flops * tokens + _lora_flops(m, tokens)


def waves(s: RunShape, probe: bool = False) -> list[tuple[int, int, int]]:
    """(prompts, prefill chunk, how many) of the rollout's waves (or the probe's): full waves and
    the last, smaller one."""
    n = s.probe_prompts if probe else s.prompts
    w = s.probe_wave_prompts if probe else s.wave_prompts
    c = s.probe_prefill_prompts if probe else s.prefill_prompts
    full, rest = divmod(n, w)
    return [(w, c, full)] + ([(rest, min(c, rest), 1)] if rest else [])


def _rollout_seconds(m: ModelShape, s: RunShape, n: int, chunk: int, flops: float, bw: float) -> float:
    """One wave of n prompts: the prefill, chunk prompts at a time (each chunk at the larger of
    its FLOPs and one read of the weights), then T decode steps of its n·G rows."""
    B, P, T = n * s.group, s.prompt_tokens, s.new_tokens
    H, V, w = m.hidden, m.vocab, m.w
    weights = m.resident["nf4_base"] + m.resident["adapter_masters"] + V * H * w
    experts = m.resident.get("moe_experts", 0) + m.resident.get("moe_adapter_masters", 0)
    full, rest = divmod(n, chunk)
    prefill = 0.0
    for c, k in ((chunk, full), (rest, 1 if rest else 0)):
        if k:
            prefill += k * max((_forward_flops(m, c * P, P) + 2.0 * H * V * c) / flops, (weights + experts) / bw)
    # step t (0-based) reads the weights, the B rows' KV of P + t + 1 columns and a hybrid's fixed
    # state (read and written): a + k·t seconds at the bandwidth floor, against c at the FLOP floor
    kv_row_col = m.kv_layers * 2 * m.kv_heads * m.head_dim * w
    routed = family_time(m).experts
    picked = routed.decode_expert_bytes(m, B) if routed else 0.0
    a = (weights + picked + B * kv_row_col * (P + 1) + 2 * B * m.state_bytes) / bw
    k = B * kv_row_col / bw
    c = (2.0 * (_matmul_params(m) + V * H) * B + _lora_flops(m, B) + m.state_flops * B) / flops
    return prefill + _sum_of_max(a, k, c, T)


def _sum_of_max(a: float, k: float, c: float, T: int) -> float:
    """sum over t = 0..T-1 of max(a + k·t, c), k >= 0, in closed form (the compute floor c holds
    until the bytes' line a + k·t reaches it)."""
    if T <= 0:
        return 0.0
    first = T if k == 0 and a < c else 0 if a >= c else min(T, int(-(-(c - a) // k)))   # first t with a + k·t >= c
    rest = T - first
    return c * first + rest * a + k * (first + T - 1) * rest / 2


def _verify(s: RunShape, env: str, rate: float | None, t: "StepTime") -> None:
    rate = rate or VERIFIER_ANSWERS_PER_S.get(env)
    if rate:
        t.seconds["verify"] = s.rows / rate
        t.assumptions.append(f"verifier: {rate:g} answers/s (measured by the environment's benchmark)")
    else:
        t.seconds["verify"] = 0.0
        t.assumptions.append(f"verifier time not counted: no measured rate for environment {env!r} "
                             "(pass --verifier-answers-per-s)")


def plan_time(m: ModelShape, s: RunShape, gpu: GPU, env: str = "", mfu: float = 0.4,
              verifier_answers_per_s: float | None = None, decode_share: float = 1.0,
              compute_dtype: str = "bfloat16", dense_rollout: bool = True, measure_shapes: bool = True) -> StepTime:
    """decode_share: the share of the bandwidth floor a measured decode reached (1.0 = the floor).
    With rates measured on the device (gpu.rates) every phase is timed from them
    (fasttrain.plan.host_speed: compute_dtype and dense_rollout say how the run computes) and
    mfu / decode_share are not used."""
    if not (0 < mfu <= 1) or not (0 < decode_share <= 1):
        raise ValueError(f"mfu and decode share must be in (0, 1], got {mfu} and {decode_share}")
    if gpu.rates is not None:
        from fasttrain.plan.host_speed import measured_step_time
        t = StepTime()
        phases, t.assumptions = measured_step_time(m, s, gpu.rates, compute_dtype, gpu.name == "cpu", dense_rollout,
                                                   measure_shapes)
        t.seconds["rollout"] = phases["rollout"] if len(waves(s)) == 1 and waves(s)[0][2] == 1 else sum(
            k * measured_step_time(m, s.with_(prompts=p, wave=0, prefill_chunk=c), gpu.rates, compute_dtype,
                                   gpu.name == "cpu", dense_rollout, measure_shapes)[0]["rollout"]
            for p, c, k in waves(s))
        _verify(s, env, verifier_answers_per_s, t)
        t.seconds["scores"], t.seconds["update"] = phases["scores"], phases["update"]
        return t
    flops = gpu.bf16_flops * mfu
    bw = gpu.bandwidth * decode_share
    n, B, P, T, S = s.prompts, s.rows, s.prompt_tokens, s.new_tokens, s.seq
    H, V, w = m.hidden, m.vocab, m.w
    t = StepTime()
    t.assumptions.append(f"matmul phases at {mfu:.0%} of {gpu.bf16_flops / 1e12:.0f} TFLOP/s bf16 dense "
                         f"(assumed: not measured on a GPU yet)")
    if decode_share == 1.0:
        t.assumptions.append(f"decode at the memory-bandwidth floor of {gpu.bandwidth / 1e12:.2f} TB/s "
                             f"(no GPU run has measured the share reached yet; --decode-share sets it)")
    else:
        t.assumptions.append(f"decode at {decode_share:.0%} of {gpu.bandwidth / 1e12:.2f} TB/s (given)")
    experts = family_time(m).experts
    if experts:
        t.assumptions.append(experts.ASSUMPTION)
    # rollout: per wave, the prefill of its prompts (chunk by chunk), then T decode steps
    t.seconds["rollout"] = sum(k * _rollout_seconds(m, s, p, c, flops, bw) for p, c, k in waves(s))
    _verify(s, env, verifier_answers_per_s, t)
    # no-grad scores over the whole batch, shared prefix
    head_fwd = 2.0 * B * T * H * V
    shared_tokens = prompt_runs(s) * P + B * T
    fwd = _forward_flops(m, shared_tokens, S / 2) + head_fwd
    t.seconds["scores"] = (int(s.need_ref) + int(s.need_old)) * fwd / flops
    # update: k passes of forward + backward (+ recompute)
    tokens = shared_tokens
    one = _forward_flops(m, tokens, S / 2)
    lin = 2.0 * _matmul_params(m) * tokens
    per_pass = one + lin + 2.0 * _lora_flops(m, tokens) + (one if s.gradient_checkpointing else 0.0)
    per_pass += 2.0 * head_fwd                      # forward with the gradient vector formed
    t.seconds["update"] = s.passes * per_pass / flops
    return t
