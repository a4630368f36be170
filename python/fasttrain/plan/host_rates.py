"""The host's measured speed: what `fasttrain plan` turns FLOPs and bytes into seconds with.

Measured once per (device, thread count, torch and fasttrain version) by the calibration step
(fasttrain.train.calibrate, which `fasttrain plan --gpu cpu|cuda` runs on demand when this host has
no entry yet, and again with --remeasure) and kept in fasttrain's cache folder (host_rates.json),
so a plan costs a few seconds only the first time. This module holds the rates, the cache and the
kernel measurements (kernel_rates: torch's and fasttrain's ops, no trainer or rollout code); the
plan only reads the cache (cached_rates). The calibration adds what runs the rollout's and the
update's own code (the sampling and per-layer rows below) and stores the whole (store_rates):
  matmul      GFLOP/s of a 1024 x 1024 x 1024 product (F.linear) in bf16 and in fp32
  bandwidth   GB/s read: a sum over a 256 MiB fp32 tensor (larger than any cache)
  attention   GFLOP/s of scaled-dot-product attention with a boolean mask (as fasttrain's forwards
              run it: every key of the rectangle is computed, masked or not), forward and
              forward + backward, in the compute dtype, 8 heads of 64, 512 queries x 512 keys
  decode      GFLOP/s of 16-row and 64-row projections (1024 -> 3072) and of one-query-per-row
              attention over strided cache views, each streaming a working set larger than any
              cache from memory, as a decode step does (a plan measures its own model's shapes
              again with model_decode_rates: these skinny rates depend on the shapes)
  elementwise elements/s of an out-of-place product of two 1024 x 1024 tensors, bf16 and fp32
  sampling    elements/s of one sampling step over fp32 logits [16, 32768] (the rollout's per-token
              work over V: fasttrain.rollout.sampling.draw_tokens at temperature 1)
              and with top_p 0.9 (sampling_sorted: random-normal logits are flat, so every row is
              sorted whole for its kept set: top_p's worst case)
  experts     fasttrain.ops.moe_experts itself (the routed experts of a mixture-of-experts layer) at a
              reference layer (hidden 1024, expert width 512, 8 experts, top-2, LoRA r 8 on both
              stacks, bf16 tokens), NF4 experts and 16-bit ones: FLOP/s (expert_pair_flops) of a
              no-grad call and of forward + backward at 64 (token, expert) pairs per expert, and bytes/s
              of a decode step's call (4 tokens, each expert one pair) over the experts' weights and
              LoRA, repeated layers streaming at least 128 MiB (a plan measures its own model's
              shapes again with model_moe_rates)
  per layer   seconds the framework spends per decoder layer and per call, apart from arithmetic:
              fasttrain's own decode step (sample), no-grad log-probs (answer_logprobs) and update
              micro-batch (log-probs, the policy loss, backward, gradient clipping, AdamW; with
              and without gradient checkpointing) on a
              micro Llama (hidden 32, vocab 64, NF4 + LoRA, 1 and 3 layers: the slope is the cost
              per layer, the intercept the cost per call): what a tiny model's step is made of
Each figure is the median of a few repetitions after a warm-up. The clock: with one CPU thread the
process's CPU time (the time the work takes on an idle core, however busy the machine is), else
the wall clock; tests that compare the plan with a step pass it and time the step the same way.
What it is not: a peak (a tuned kernel can beat these numbers) or a GPU datasheet.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from fasttrain.host import cache_root, cpu_name

__all__ = ["HostRates", "cached_rates", "store_rates", "kernel_rates", "matmul_gflops", "memory_gbps", "cache_path",
           "host_name", "model_decode_rates", "model_moe_rates", "expert_pair_flops", "MOE_REFERENCE", "CLOCKS",
           "clock_for", "median_time", "sync_for"]

Clock = Callable[[], float]


@dataclass(frozen=True)
class HostRates:
    device: str                     # "cpu" or the CUDA card's name
    threads: int
    matmul_bf16: float              # FLOP/s
    matmul_fp32: float
    bandwidth: float                # bytes/s read
    attention_fwd_bf16: float       # FLOP/s (4·q·k·d per head, every key of the rectangle)
    attention_fb_bf16: float        # forward + backward, counted as 3.5x the forward's FLOPs
    attention_fwd_fp32: float
    attention_fb_fp32: float
    decode_rows16_bf16: float       # FLOP/s of a 16-row projection (a decode step's GEMM)
    decode_rows64_bf16: float
    decode_attention_bf16: float    # FLOP/s of one-query-per-row attention over a cache view
    decode_rows16_fp32: float
    decode_rows64_fp32: float
    decode_attention_fp32: float
    elementwise_bf16: float         # elements/s of one out-of-place elementwise product
    elementwise_fp32: float
    sampling: float                 # elements/s of one sampling step over [B, V]
    decode_layer: float             # s per decoder layer per decode step (fasttrain's decoder)
    decode_call: float              # s per decode step apart from its layers (embedding, head, sampling ops)
    forward_layer: float            # s per layer of a no-grad forward (shared-prefix forward)
    forward_call: float
    train_layer: float              # s per layer of a forward + backward
    train_call: float
    train_ckpt_layer: float         # the same under gradient checkpointing (the forward recomputed)
    train_ckpt_call: float
    moe_fwd_nf4: float              # FLOP/s (expert_pair_flops) of moe_experts, NF4 experts + LoRA, no grad
    moe_fb_nf4: float               # forward + backward
    moe_decode_nf4: float           # bytes/s of the experts' weights and LoRA a decode step's call reads
    moe_fwd_16: float               # the same with 16-bit expert stacks (policy.quantize "none")
    moe_fb_16: float
    moe_decode_16: float
    measured_at: str                # ISO time (UTC) of the measurement
    clock: str = "wall"             # "wall" or "process_time" (CLOCKS)
    device_kind: str = "cpu"        # "cpu" | "cuda"
    sampling_sorted: float = 0.0    # elements/s of a top_p draw (its sort); 0: not measured (entries made by hand)

    def matmul(self, dtype: str) -> float:
        return self.matmul_bf16 if dtype == "bfloat16" else self.matmul_fp32

    def rows_matmul(self, dtype: str, rows: int) -> float:
        """FLOP/s of a projection of `rows` rows: the 16- and 64-row rates, linear between them and
        up to the square product's rate at 1024 rows, proportional to the rows below 16."""
        bf = dtype == "bfloat16"
        r16 = self.decode_rows16_bf16 if bf else self.decode_rows16_fp32
        r64 = self.decode_rows64_bf16 if bf else self.decode_rows64_fp32
        big = self.matmul(dtype)
        if rows <= 16:
            return r16 * max(rows, 1) / 16
        if rows <= 64:
            return r16 + (r64 - r16) * (rows - 16) / 48
        return min(big, r64 + (big - r64) * (rows - 64) / 960) if big > r64 else r64

    def elementwise(self, dtype: str) -> float:
        return self.elementwise_bf16 if dtype == "bfloat16" else self.elementwise_fp32

    def decode_attention(self, dtype: str) -> float:
        return self.decode_attention_bf16 if dtype == "bfloat16" else self.decode_attention_fp32

    def attention(self, dtype: str, backward: bool) -> float:
        if dtype == "bfloat16":
            return self.attention_fb_bf16 if backward else self.attention_fwd_bf16
        return self.attention_fb_fp32 if backward else self.attention_fwd_fp32

    def moe(self, nf4: bool) -> tuple[float, float, float]:
        """(forward FLOP/s, forward + backward FLOP/s, decode bytes/s) of the reference MoE layer."""
        if nf4:
            return self.moe_fwd_nf4, self.moe_fb_nf4, self.moe_decode_nf4
        return self.moe_fwd_16, self.moe_fb_16, self.moe_decode_16


def median_time(fn, reps: int, clock: Clock, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        sync()
        times.append(clock() - t0)
    return max(statistics.median(times), 1e-9)


def sync_for(device: torch.device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def matmul_gflops(dtype: torch.dtype, n: int = 1024, reps: int = 5, device="cpu",
                  clock: Clock = time.perf_counter) -> float:
    """GFLOP/s of an n x n x n product (F.linear) in `dtype` at the current thread count."""
    dev = torch.device(device)
    x = torch.randn(n, n, device=dev).to(dtype)
    w = torch.randn(n, n, device=dev).to(dtype)
    return 2 * n ** 3 / median_time(lambda: F.linear(x, w), reps, clock, sync_for(dev)) / 1e9


def memory_gbps(mib: int = 256, reps: int = 5, device="cpu", clock: Clock = time.perf_counter) -> float:
    """Read bandwidth in GB/s: a sum over a `mib` MiB fp32 tensor (larger than any cache)."""
    dev = torch.device(device)
    x = torch.ones(mib * 2**20 // 4, device=dev)
    return x.numel() * 4 / median_time(lambda: x.sum(), reps, clock, sync_for(dev)) / 1e9


def _attention_rates(dtype: torch.dtype, dev: torch.device, clock: Clock, reps: int) -> tuple[float, float]:
    heads, s, d = 8, 512, 64
    q, k, v = (torch.randn(1, heads, s, d, device=dev).to(dtype) for _ in range(3))
    mask = torch.ones(s, s, dtype=torch.bool, device=dev).tril_()
    flops = 4.0 * heads * s * s * d
    sync = sync_for(dev)
    fwd = median_time(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), reps, clock, sync)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def both():
        F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask).sum().backward()
    fb = median_time(both, reps, clock, sync)
    return flops / fwd, 3.5 * flops / fb


def model_decode_rates(layer_weights: list[tuple[int, int]], kv_heads: int, group: int, head_dim: int, rows: int,
                       keys: int, dtype: torch.dtype, device="cpu", clock: Clock = time.perf_counter,
                       reps: int = 3) -> tuple[float, float]:
    """(GEMM FLOP/s, attention FLOP/s) of one decode step of a given model at `rows` rows: its
    layer's weight shapes [(out, in), ...] (as the rollout runs them: q/k/v and gate/up fused) and
    one-query-per-row attention over `keys` cached keys, each over a working set of at least
    128 MiB (repeated layers), as a decode step streams them from memory. Skinny products run
    far from the square product's rate, and how far depends on the shapes: measured per plan."""
    dev = torch.device(device)
    sync = sync_for(dev)
    esz = torch.empty((), dtype=dtype).element_size()
    per_layer = sum(o * i for o, i in layer_weights) * esz
    copies = max(1, -(-(128 << 20) // per_layer))
    ws = [torch.randn(o, i, device=dev).to(dtype) for _ in range(copies) for o, i in layer_weights]
    xs = {i: torch.randn(rows, 1, i, device=dev).to(dtype) for _, i in layer_weights}

    def project():
        for w in ws:
            F.linear(xs[w.shape[1]], w)
    gemm = 2.0 * rows * per_layer / esz * copies / median_time(project, reps, clock, sync)
    del ws
    per_cache = 2 * rows * kv_heads * (keys + 1) * head_dim * esz
    caches = [torch.randn(2, rows, kv_heads, keys + 1, head_dim, device=dev).to(dtype)
              for _ in range(max(1, -(-(128 << 20) // per_cache)))]
    q = torch.randn(rows, kv_heads, group, head_dim, device=dev).to(dtype)
    mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool, device=dev)

    def attend():
        for c in caches:
            F.scaled_dot_product_attention(q, c[0, :, :, :keys], c[1, :, :, :keys], attn_mask=mask)
    attn = 4.0 * rows * kv_heads * group * keys * head_dim * len(caches) / median_time(attend, reps, clock, sync)
    return gemm, attn


CLOCKS = {"wall": time.perf_counter, "process_time": time.process_time}

# ---- the routed experts: fasttrain.ops.moe_experts itself --------------------------------------------
MOE_REFERENCE = {"hidden": 1024, "intermediate": 512, "experts": 8, "top_k": 2, "rank": 8}
MOE_WORKING_SET = 128 << 20          # bytes a decode measurement streams (repeated layers), as model_decode_rates


def expert_pair_flops(hidden: int, intermediate: int, rank: int, backward: bool = False) -> float:
    """FLOPs of one (token, expert) pair through moe_experts: the count its rates are stated in.
    Forward: gate_up 2·2I·H, the SwiGLU 4·I (exp, add, divide, product), down 2·H·I, the weighted sum
    2·H, and the LoRA products x·Aᵀ, ·Bᵀ of both stacks, 2·r·(H + 2I) + 2·r·(I + H). With backward,
    forward + backward: the input gradient through the frozen stacks (6·I·H again), SwiGLU's
    derivative with act recomputed (12·I), the routing weight's gradient and the weighted dy (3·H),
    and LoRA twice its forward (the input's gradient and the factors')."""
    H, I, r = hidden, intermediate, rank
    lora = 2.0 * r * (2 * H + 3 * I)
    forward = 6.0 * I * H + 4.0 * I + 2.0 * H + lora
    return forward + (6.0 * I * H + 12.0 * I + 3.0 * H + 2.0 * lora if backward else 0.0)


def _expert_layer(H: int, I: int, E: int, r: int, nf4: bool, dtype: torch.dtype, dev: torch.device):
    """One layer's experts as a run holds them: (gate_up, down, gate_up LoRA, down LoRA, bytes).
    NF4 per expert (packed codes and an fp32 absmax per 64 weights, constant values: the kernels'
    time does not depend on them) or a 16-bit stack of `dtype`; fp32 LoRA factors on both stacks
    (none for r = 0), leaves that take gradients."""
    from fasttrain.ops.moe_experts import ExpertStack

    def stack(out: int, inp: int) -> ExpertStack:
        if nf4:
            n = out * inp
            return ExpertStack(E, out, inp, dtype, qweight=torch.full((E, (n + 1) // 2), 0x5A, dtype=torch.uint8,
                                                                      device=dev),
                               absmax=torch.full((E, -(-n // 64)), 0.05, device=dev))
        return ExpertStack(E, out, inp, dtype, weight=torch.full((E, out, inp), 0.01, dtype=dtype, device=dev))

    def lora(out: int, inp: int):
        if not r:
            return None
        return (torch.full((E, r, inp), 0.01, device=dev, requires_grad=True),
                torch.full((E, out, r), 0.01, device=dev, requires_grad=True))
    gu, dn, gl, dl = stack(2 * I, H), stack(H, I), lora(2 * I, H), lora(H, I)
    size = sum(t.numel() * t.element_size() for st in (gu, dn) for t in st.tensors().values())
    size += sum(t.numel() * 4 for lo in (gl, dl) if lo for t in lo)
    return gu, dn, gl, dl, size


def _time_moe(layers: list, N: int, k: int, E: int, H: int, dtype: torch.dtype, dev: torch.device, clock: Clock,
              reps: int, backward: bool) -> float:
    """Median seconds of one moe_experts call on each of `layers` for N tokens, token n's slot j
    routed to expert (n·k + j) mod E (k distinct experts a token, the pairs spread evenly); with
    backward, forward + backward to the tokens, the routing weights and the LoRA factors."""
    from fasttrain.ops.moe_experts import moe_experts

    idx = (torch.arange(N * k, device=dev) % E).view(N, k)
    w = torch.full((N, k), 1.0 / k, device=dev, requires_grad=backward)
    x = torch.randn(N, H, device=dev).to(dtype).requires_grad_(backward)
    dy = torch.randn(N, H, device=dev).to(dtype)

    def run():
        for gu, dn, gl, dl, _ in layers:
            y = moe_experts(x, idx, w, gu, dn, gl, dl, 2.0)
            if backward:
                torch.autograd.grad(y, [x, w, *(gl or ()), *(dl or ())], dy)
    with torch.set_grad_enabled(backward):
        return median_time(run, reps, clock, sync_for(dev))


def model_moe_rates(hidden: int, intermediate: int, experts: int, top_k: int, rank: int, nf4: bool,
                    pairs_per_expert: int, decode_experts: int, decode_pairs_per_expert: int, dtype: torch.dtype,
                    device="cpu", clock: Clock = time.perf_counter, reps: int = 3,
                    decode_layers: int | None = None) -> tuple[float, float, float]:
    """(forward FLOP/s, forward + backward FLOP/s, decode bytes/s) of fasttrain.ops.moe_experts at a
    model's expert shapes, NF4 or 16-bit experts with LoRA of `rank`: FLOPs by expert_pair_flops
    over `experts` experts of `pairs_per_expert` pairs each (an update's or a prefill's call), and
    the bytes of the experts' weights and LoRA over a decode step's call (`decode_experts` experts
    of `decode_pairs_per_expert` pairs), repeated layers over at least MOE_WORKING_SET bytes, as a
    decode step streams its experts from memory, but at most `decode_layers` of them (the model's
    MoE layers: a model whose experts fit in a cache decodes from it). Each token's top_k slots go
    to distinct experts."""
    dev = torch.device(device)
    H, I, k = hidden, intermediate, top_k
    E = max(experts, k)
    N = -(-E * max(1, pairs_per_expert) // k)
    layer = [_expert_layer(H, I, E, rank, nf4, dtype, dev)]
    fwd = N * k * expert_pair_flops(H, I, rank) / _time_moe(layer, N, k, E, H, dtype, dev, clock, reps, False)
    fb = N * k * expert_pair_flops(H, I, rank, True) / _time_moe(layer, N, k, E, H, dtype, dev, clock, reps, True)
    del layer
    E = max(decode_experts, k)
    layers = [_expert_layer(H, I, E, rank, nf4, dtype, dev)]
    copies = -(-MOE_WORKING_SET // layers[0][4])
    layers += [_expert_layer(H, I, E, rank, nf4, dtype, dev) for _ in range(min(copies, decode_layers or copies) - 1)]
    N = -(-E * max(1, decode_pairs_per_expert) // k)
    decode = sum(l[4] for l in layers) / _time_moe(layers, N, k, E, H, dtype, dev, clock, reps, False)
    return fwd, fb, decode


def _moe_rates(dev: torch.device, clock: Clock, reps: int) -> dict:
    """The reference MoE rates (MOE_REFERENCE, bf16 tokens): 64 pairs per expert for the forward
    and forward + backward, a decode call of one pair per expert; NF4 experts, then 16-bit ones."""
    ref, out = MOE_REFERENCE, {}
    for nf4, tag in ((True, "nf4"), (False, "16")):
        fwd, fb, dec = model_moe_rates(ref["hidden"], ref["intermediate"], ref["experts"], ref["top_k"], ref["rank"],
                                       nf4, 64, ref["experts"], 1, torch.bfloat16, dev, clock, reps)
        out.update({f"moe_fwd_{tag}": fwd, f"moe_fb_{tag}": fb, f"moe_decode_{tag}": dec})
    return out


def _elementwise_rate(dtype: torch.dtype, dev: torch.device, clock: Clock, reps: int) -> float:
    a, b = (torch.randn(1024, 1024, device=dev).to(dtype) for _ in range(2))
    return a.numel() / median_time(lambda: a * b, 5 * reps, clock, sync_for(dev))


def _decode_rates(dtype: torch.dtype, dev: torch.device, clock: Clock, reps: int) -> dict:
    """The reference decode rates: model_decode_rates for 1024 -> 3072 projections at 16 and 64
    rows, attention for 16 rows of 4 KV heads (3 query rows each) over 512 keys."""
    r16, attention = model_decode_rates([(3072, 1024)], 4, 3, 64, 16, 512, dtype, dev, clock, reps)
    r64, _ = model_decode_rates([(3072, 1024)], 4, 3, 64, 64, 512, dtype, dev, clock, reps)
    return {"rows16": r16, "rows64": r64, "attention": attention}


def host_name(device=None) -> str:
    """The device in words: the CUDA card's name, or the CPU's model name and core count."""
    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{cpu_name()} ({os.cpu_count()} cores)"


def cache_path() -> Path:
    """host_rates.json in fasttrain's cache folder (fasttrain.host.cache_root)."""
    return cache_root() / "host_rates.json"


# Bumped when a rate's measurement changes (2: sampling by the inverse CDF, not Gumbel-max; 3: the
# top_p draw's rate), so an entry measured the old way is measured again rather than read.
RATES_VERSION = 3


def _key(dev: torch.device) -> str:
    import fasttrain
    return (f"{host_name(dev)}|threads={torch.get_num_threads()}|torch={torch.__version__}"
            f"|fasttrain={fasttrain.__version__}|rates={RATES_VERSION}")


def _cached() -> dict:
    try:
        path = cache_path()
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}


def cached_rates(device="cpu") -> HostRates | None:
    """The rates cached for `device` at this thread count and these versions, or None. An entry
    written by another version of this file (a field missing, such as an entry from before the MoE
    rates, or one this version does not know) is None: the calibration measures again and replaces it."""
    entry = _cached().get(_key(torch.device(device)))
    try:
        return HostRates(**entry) if entry else None
    except TypeError:
        return None


def clock_for(dev: torch.device) -> Clock:
    """The process's CPU time for one CPU thread (the time on an idle core, whatever else runs on
    the machine), else the wall clock (several threads, or a GPU)."""
    return time.process_time if dev.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


def store_rates(rates: HostRates, device="cpu") -> None:
    """Keep `rates` in the cache under `device`'s key (this thread count, these versions), beside
    the other entries. A cache that cannot be written is skipped."""
    data, path = _cached(), cache_path()
    data[_key(torch.device(device))] = asdict(rates)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError:
        pass


def kernel_rates(device="cpu", clock: Clock = time.perf_counter, reps: int = 3) -> dict:
    """The rates of torch's and fasttrain's kernels on `device` (the header's matmul, bandwidth,
    attention, decode, elementwise and experts rows), as HostRates' fields: the part of the
    calibration that runs no trainer or rollout code."""
    dev = torch.device(device)
    ab, abf = _attention_rates(torch.bfloat16, dev, clock, reps)
    af, aff = _attention_rates(torch.float32, dev, clock, reps)
    db, df = _decode_rates(torch.bfloat16, dev, clock, reps), _decode_rates(torch.float32, dev, clock, reps)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        moe = _moe_rates(dev, clock, reps)
    return dict(
        matmul_bf16=matmul_gflops(torch.bfloat16, reps=reps, device=dev, clock=clock) * 1e9,
        matmul_fp32=matmul_gflops(torch.float32, reps=reps, device=dev, clock=clock) * 1e9,
        bandwidth=memory_gbps(reps=reps, device=dev, clock=clock) * 1e9,
        attention_fwd_bf16=ab, attention_fb_bf16=abf, attention_fwd_fp32=af, attention_fb_fp32=aff,
        decode_rows16_bf16=db["rows16"], decode_rows64_bf16=db["rows64"], decode_attention_bf16=db["attention"],
        decode_rows16_fp32=df["rows16"], decode_rows64_fp32=df["rows64"], decode_attention_fp32=df["attention"],
        elementwise_bf16=_elementwise_rate(torch.bfloat16, dev, clock, reps),
        elementwise_fp32=_elementwise_rate(torch.float32, dev, clock, reps), **moe)
