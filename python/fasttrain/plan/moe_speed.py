"""The routed experts' time terms: on paper from the datasheet's dense rates (fasttrain.plan.speed:
active_params, expert_lora_flops, decode_expert_bytes and the ASSUMPTION it prints), and the seconds
in a plan timed from measured rates (fasttrain.plan.host_speed): the
work of fasttrain.ops.moe_experts in each phase, at rates measured by running that op on the device
the run uses (fasttrain.plan.host_rates: a reference layer in the cache, and this model's own expert
shapes measured again when the plan may measure, as the decode step's GEMMs are).

  work      per MoE layer and call, N tokens make N·k (token, expert) pairs of
            host_rates.expert_pair_flops(H, I, r) FLOPs each (gate_up, SwiGLU, down, the weighted
            sum, LoRA on both stacks; r the run's rank where the experts take LoRA, else 0), or
            expert_pair_flops(..., backward=True) for forward + backward
  prefill   a chunk's c·P tokens, forward, at the forward rate
  scores    each micro-batch's U·P + rows·(T-1) tokens, forward, at the forward rate
  update    per pass the same tokens at the forward + backward rate, and once more forward under
            gradient checkpointing (the recomputed layer)
  decode    one call per MoE layer and step: the bytes of the experts the B rows' B·k picks touch,
            E·(1 - (1 - k/E)^B) of E when the picks spread evenly (each one's NF4 or 16-bit stacks
            and its fp32 LoRA, as resident), at the decode rate (bytes/s of such a call)
The rates at this model's shapes (the plan may measure and the rates' clock is known): H, I and r,
NF4 or 16-bit stacks as the run holds them, tokens in the model's dtype; forward and forward +
backward at the update micro-batch's pairs per expert (N·k/E) over as many of the E experts as a
quarter second at the host's fp32 matmul rate covers (at least k: the same work per expert, less
of it); the decode over the experts one step touches (at most 256 MiB of them) at its pairs per
expert, repeated to stream 128 MiB (at most as many layers as the model has: a model whose experts
fit in a cache decodes from it). Pairs per expert and experts go to the nearest power of two, so
the many shapes one plan times (its picks, its waves) share a few measurements, each made once per
process. Otherwise the host's reference rates (host_rates.MOE_REFERENCE). The router's product
(2·E·H FLOPs a token, its weights read at every decode step) and its elementwise work run with the
projections (host_speed).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from fasttrain.plan.host_rates import CLOCKS, MOE_REFERENCE, HostRates, expert_pair_flops, model_moe_rates
from fasttrain.plan import moe_memory
from fasttrain.plan.meta_model import ModelShape

__all__ = ["ExpertRates", "expert_rates", "pair_flops", "forward_seconds", "train_seconds",
           "decode_seconds", "router_params", "note", "active_params", "expert_lora_flops", "decode_expert_bytes",
           "ASSUMPTION", "dense_mlp_width", "router_elementwise"]

MEASURE_SECONDS = 0.25                # of the host's fp32 matmul rate: the work one measured call may take
DECODE_EXPERTS_BYTES = 256 << 20      # at most this many bytes of experts in the decode measurement


@dataclass(frozen=True)
class ExpertRates:
    forward: float      # FLOP/s (expert_pair_flops) of a no-grad call
    train: float        # FLOP/s of forward + backward
    decode: float       # bytes/s of the experts' weights and LoRA a decode step's call reads
    where: str          # what they were measured at, in words


# ---- time on paper: an estimate from the datasheet's dense rates (measured: below) ----------------------
def active_params(m) -> int:
    """Expert weights one token's forward multiplies (k experts of each MoE layer)."""
    return m.moe_active_params


def dense_mlp_width(m) -> float:
    """The dense MLP's width averaged over the layers: a MoE layer's is its shared expert's (0 without
    one), a dense layer's the model's intermediate width."""
    n = m.moe.layers
    return ((m.layers - n) * m.intermediate + n * m.moe.shared) / m.layers


def router_elementwise(m) -> float:
    """Elements a MoE layer's router touches per token outside its GEMM (its logits' float copy,
    softmax and top-k: about 4·E) and its shared-expert gate (sigmoid, product, sum: 3·H), averaged
    over the layers."""
    return m.moe.layers * (4.0 * m.moe.experts + (3.0 * m.hidden if m.moe.shared else 0.0)) / m.layers


def expert_lora_flops(m, tokens: int) -> float:
    """The experts' LoRA products, forward, per token: x·Aᵀ and (x·Aᵀ)·Bᵀ for its k experts' two stacks."""
    if not m.rank:
        return 0.0
    k, I, n = m.moe.active, m.moe.width, m.moe.layers
    H = m.hidden
    return 2.0 * m.rank * n * k * ((H + 2 * I) + (I + H)) * tokens


def decode_expert_bytes(m, B: int) -> float:
    """Expert bytes one decode step of B rows reads: per layer the experts its B·k picks touch,
    E·(1 - (1 - k/E)^B) of E when the picks are spread evenly (an estimate)."""
    E, k = m.moe.experts, m.moe.active
    touched = 1.0 - (1.0 - k / E) ** B
    return (m.resident.get("moe_experts", 0) + m.resident.get("moe_adapter_masters", 0)) * touched


ASSUMPTION = ("MoE: the routed experts timed on paper, as dense GEMMs over the k active experts' weights "
              "(2 FLOPs a weight a token, their LoRA apart) at the same share of the datasheet's bf16 peak, not from "
              "fasttrain.ops.moe_experts' rates (none measured on this device: `fasttrain plan --gpu cuda` on the card "
              "measures them); a decode step reads the experts its rows pick, spread evenly, at the bandwidth floor")


# ---- time from measured rates ----------------------------------------------------------------------
def pair_flops(m: ModelShape, backward: bool = False) -> float:
    return expert_pair_flops(m.hidden, m.moe.width, moe_memory.expert_rank(m), backward)


def router_params(m: ModelShape) -> int:
    """Weights of the routers (and Qwen3.5-MoE's shared-expert gates [1, H]) a token multiplies."""
    E, n, shared = m.moe.experts, m.moe.layers, m.moe.shared
    return n * (E + (1 if shared else 0)) * m.hidden


def _touched(m: ModelShape, B: int) -> float:
    E, k = m.moe.experts, m.moe.active
    return E * (1.0 - (1.0 - k / E) ** B)


def _power_of_two(x: float) -> int:
    """The power of two nearest x (at least 1): the measured shapes, so that the many shapes one plan
    times (its picks, its waves) share a few measurements; the rates move slowly with them."""
    import math
    return 1 << max(0, round(math.log2(max(x, 1.0))))


def _dtype_name(m: ModelShape) -> str:
    return str(m.dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=64)
def _measured(H: int, I: int, E: int, k: int, r: int, nf4: bool, per: int, dec_E: int, dec_per: int, layers: int,
              dtype: str, device: str, clock: str, threads: int) -> tuple[float, float, float]:
    """model_moe_rates, once per process and shape (threads: part of the key, as in the cache)."""
    import torch
    with torch.random.fork_rng(devices=[] if device == "cpu" else [torch.device(device)]):
        return model_moe_rates(H, I, E, k, r, nf4, per, dec_E, dec_per, getattr(torch, dtype), device, CLOCKS[clock],
                               decode_layers=layers)


def expert_rates(m: ModelShape, r: HostRates, tokens: int, rows: int, measure_shapes: bool) -> ExpertRates:
    """The experts' rates for `m`: measured at its shapes now (the update's largest call of `tokens`
    tokens, a decode step of `rows` rows) when measure_shapes and the rates' clock is known, else
    the host's reference rates."""
    nf4 = m.quantize == "nf4"
    E, k, I = m.moe.experts, m.moe.active, m.moe.width
    H, rank = m.hidden, moe_memory.expert_rank(m)
    kind = "NF4" if nf4 else "16-bit"
    if not measure_shapes or r.clock not in CLOCKS:
        ref = MOE_REFERENCE
        return ExpertRates(*r.moe(nf4), where=(
            f"the host's reference MoE layer ({ref['experts']} {kind} experts of {ref['hidden']} x "
            f"{ref['intermediate']}, top-{ref['top_k']}, LoRA r {ref['rank']}; not this model's shapes)"))
    import torch
    per = _power_of_two(tokens * k / E)
    budget = MEASURE_SECONDS * r.matmul_fp32 / expert_pair_flops(H, I, rank, True)     # pairs
    experts = min(E, max(k, int(budget // per)))
    touched = _touched(m, rows)
    one = (m.resident.get("moe_experts", 0) + m.resident.get("moe_adapter_masters", 0)) / (m.moe.layers * E)
    dec_E = max(k, min(E, _power_of_two(touched), int(DECODE_EXPERTS_BYTES // max(one, 1))))
    dec_per = _power_of_two(rows * k / touched)
    device = "cpu" if r.device_kind == "cpu" else "cuda"
    fwd, fb, dec = _measured(H, I, experts, k, rank, nf4, per, dec_E, dec_per, m.moe.layers, _dtype_name(m), device,
                             r.clock, torch.get_num_threads())
    return ExpertRates(fwd, fb, dec, where=(
        f"this model's experts ({kind} {H} x {I}, LoRA r {rank}, {_dtype_name(m)} tokens) measured now: "
        f"{per} pairs per expert over {experts} experts; a decode call of {dec_per} pair(s) per expert over {dec_E}"))


def forward_seconds(m: ModelShape, tokens: float, er: ExpertRates) -> float:
    """A no-grad forward of `tokens` tokens through every MoE layer's routed experts."""
    return m.moe.layers * tokens * m.moe.active * pair_flops(m) / er.forward


def train_seconds(m: ModelShape, tokens: float, er: ExpertRates) -> float:
    """Forward + backward of `tokens` tokens through every MoE layer's routed experts."""
    return m.moe.layers * tokens * m.moe.active * pair_flops(m, backward=True) / er.train


def decode_seconds(m: ModelShape, rows: int, er: ExpertRates) -> float:
    """One decode step of `rows` rows: every MoE layer reads the experts its rows pick."""
    return decode_expert_bytes(m, rows) / er.decode


def note(m: ModelShape, er: ExpertRates) -> str:
    """The assumption line of a measured MoE plan."""
    return (f"MoE: the routed experts timed from fasttrain.ops.moe_experts' own rates, {er.where}: forward "
            f"{er.forward / 1e9:.1f} GFLOP/s, forward + backward {er.train / 1e9:.1f} GFLOP/s "
            f"({pair_flops(m) / 1e6:.2f} and {pair_flops(m, True) / 1e6:.2f} MFLOP a (token, expert) pair, from "
            f"the shapes), decode {er.decode / 1e9:.2f} GB/s of the experts a step's rows pick (spread evenly)")
