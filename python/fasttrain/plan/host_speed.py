"""Time of one training step from the rates measured on the device the run will use
(fasttrain.plan.host_rates): each kind of work at the rate measured for that kind, summed.

  GEMMs       projections (NF4 base: the CPU kernels dequantise each weight and run one GEMM in the
              compute dtype), LoRA products, lm_head: FLOPs at the measured matmul rate of the
              compute dtype (a decode step's B rows at the measured rate of that many rows); the
              fused log-prob head in fp32 on a CPU (its GEMMs widen bf16: exact)
  attention   every key of the masked rectangle (fasttrain's forwards pass boolean masks):
              prefill n·P x P, shared-prefix forward U·P x P + B·(T-1) x (P+T-1), at the measured
              masked-attention rate, forward or forward + backward (3.5x the forward's FLOPs); a
              decode step's B x (P+t) at the measured one-query-per-row rate
  bytes       decode reads its dense (or NF4) weights, the lm_head and the KV cache once per step;
              each NF4 projection use dequantises its weight (packed + absmax in, the compute
              dtype out): at the measured read bandwidth
  sampling    one draw over [B, V] fp32 logits per new token, at the measured sampling rate
  experts     a mixture of experts' routed experts (fasttrain.plan.moe_speed): fasttrain.ops.moe_experts'
              FLOPs and a decode step's expert bytes at the rates measured by running that op, forward,
              forward + backward and decode; its routers' products with the projections, their
              weights read at every decode step, their softmax and top-k with the elementwise work
  framework   per decoder layer and per call (decode step, no-grad forward, forward + backward
              with or without gradient checkpointing),
              as measured through fasttrain's own decoder and shared-prefix forward on a micro model
A decode step costs the larger of its GEMM FLOPs and its weight reads (a skinny GEMM is either).
What it leaves out: the optimizer step and the loss op (a few ms), allocator page faults, the
compiled decode (rollout.compile), and a MoE layer's Python around its op (the router's calls):
the per-layer framework costs are measured on a dense micro model.
"""
from __future__ import annotations

from fasttrain.plan.host_rates import HostRates
from fasttrain.plan.family_time import family_time
from fasttrain.plan.meta_model import ModelShape
from fasttrain.plan.run_shape import RunShape

__all__ = ["measured_step_time"]


def _micro_batches(s: RunShape) -> list[tuple[int, int]]:
    """(rows, distinct prompts) of each micro-batch of the step's B rows (groups are contiguous)."""
    B, G = s.rows, s.group
    mb = max(1, min(s.micro_batch, B))
    return [(min(k + mb, B) - k, (min(k + mb, B) - 1) // G - k // G + 1) for k in range(0, B, mb)]


def _lora(m: ModelShape) -> float:
    """LoRA FLOPs per token (x·Aᵀ, then ·Bᵀ) over every adapted projection."""
    return 2.0 * m.rank * sum(o + i for o, i in m.projections)


def _mlp_width(m: ModelShape) -> float:
    """The dense MLP's width, averaged over the layers: a MoE layer's is its shared expert's (0
    without one; its routed experts are fasttrain.plan.moe_speed's)."""
    experts = family_time(m).experts
    return m.intermediate if experts is None else experts.dense_mlp_width(m)


def _elementwise(m: ModelShape, lora: bool = True) -> float:
    """Elements one decoder layer's forward touches per token outside its GEMMs and attention, as
    the Llama-family code runs it: two RMSNorms (fp32 upcast, square, mean, scale, downcast,
    weight: about 6 per element), two residual adds and the layer input's concatenation (16·H);
    rotary embedding (5 per q and k element) and the attention output's reshapes (7·qd + 5·kd);
    act(gate)·up (2·I); with adapters, each projection output scaled and added (2 per element);
    a MoE layer's router (its logits' float copy, softmax and top-k: about 4·E) and shared-expert
    gate (sigmoid, product, sum: 3·H), averaged over the layers."""
    qd, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    out = sum(o for o, _ in m.projections) / m.layers
    experts = family_time(m).experts
    moe = experts.router_elementwise(m) if experts else 0.0
    return 16.0 * m.hidden + 7.0 * qd + 5.0 * kd + 2.0 * _mlp_width(m) + (2.0 * out if lora else 0.0) + moe


def _decode_rates(m: ModelShape, r: HostRates, rows: int, keys: int, compute_dtype: str) -> tuple[float, float]:
    """The decode step's GEMM and attention rates, measured now at this model's shapes (the host's
    clock and device); the host's reference rates where that cannot run (a clock not known)."""
    import torch

    from fasttrain.plan.host_rates import CLOCKS, model_decode_rates
    qd, kd, H, I = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.hidden, round(_mlp_width(m))
    if r.clock not in CLOCKS:
        return r.rows_matmul(compute_dtype, rows), r.decode_attention(compute_dtype)
    mlp = [(2 * I, H), (H, I)] if I else []
    return model_decode_rates([(qd + 2 * kd, H), (H, qd), *mlp], m.kv_heads,
                              m.heads // m.kv_heads, m.head_dim, rows, keys, getattr(torch, compute_dtype),
                              device="cpu" if r.device_kind == "cpu" else "cuda", clock=CLOCKS[r.clock])


def _attn(m: ModelShape, query_keys: float) -> float:
    return 4.0 * m.layers * m.heads * m.head_dim * query_keys


def measured_step_time(m: ModelShape, s: RunShape, r: HostRates, compute_dtype: str, cpu: bool,
                       dense_rollout: bool, measure_shapes: bool = True) -> tuple[dict, list]:
    """({phase: seconds}, assumptions) for one step of `s` (verify excluded: the caller adds it).

    compute_dtype: what the projections compute in ("bfloat16" or "float32"); cpu: the fused
    log-prob head runs its GEMMs in fp32; dense_rollout: the rollout decodes from dense weights
    in the compute dtype instead of the NF4 layers; measure_shapes: measure the decode step's skinny
    work and a mixture of experts' routed experts at this model's shapes now (else the host's
    reference rates: the trainer's summary line, which must not allocate on a device that holds
    the model)."""
    n, B, P, T = s.prompts, s.rows, s.prompt_tokens, s.new_tokens
    L, H, V = m.layers, m.hidden, m.vocab
    cb = 2 if compute_dtype == "bfloat16" else 4
    mm, bw = r.matmul(compute_dtype), r.bandwidth
    head_rate = r.matmul("float32") if cpu else mm
    experts = family_time(m).experts       # the routed experts' terms (fasttrain.plan.moe_speed), or None
    moe = experts is not None
    router = 2.0 * experts.router_params(m) if moe else 0.0
    proj = 2.0 * m.linear_params + _lora(m) + router        # GEMM FLOPs per token
    nf4_bytes = m.resident["nf4_base"]
    dequant = (nf4_bytes + m.linear_params * cb) / bw       # one dequantisation of every projection
    # rollout: refresh the dense weights (dequantise + merge), prefill the n prompts, T decode steps
    rollout = 0.0
    if dense_rollout:
        rollout += dequant + 2.0 * m.rank * m.linear_params / mm
    ew = r.elementwise(compute_dtype)
    kd = m.kv_heads * m.head_dim
    rep = 2.0 * m.heads * m.head_dim if m.heads != m.kv_heads else 0.0   # the prefill repeats K/V per head
    if moe:     # the routed experts' rates, at the update's largest call and this decode's rows
        er = experts.expert_rates(m, r, max(U * P + rows * max(T - 1, 0) for rows, U in _micro_batches(s)), B,
                                    measure_shapes)
    rollout += n * P * proj / mm + _attn(m, n * P * P) / r.attention(compute_dtype, False)
    rollout += experts.forward_seconds(m, n * P, er) if moe else 0.0
    rollout += L * n * P * (_elementwise(m, not dense_rollout) + rep) / ew
    chunks = -(-n // s.prefill_prompts)                     # prefill chunks: each pays the per-call costs
    rollout += chunks * ((0 if dense_rollout else dequant) + L * r.forward_layer + r.forward_call)
    draw = r.sampling_sorted if s.sort_draw and r.sampling_sorted > 0 else r.sampling   # top_p's sort
    rollout += 2.0 * n * H * V / r.rows_matmul(compute_dtype, n) + n * V / draw
    weights = (m.linear_params * cb if dense_rollout else nf4_bytes) + V * H * m.w + m.resident.get("moe_router", 0)
    kv_col = L * 2 * m.kv_heads * m.head_dim * m.w            # bytes of one cache column of one row
    if measure_shapes:
        rows_mm, decode_attn = _decode_rates(m, r, B, P + T // 2, compute_dtype)
    else:
        rows_mm, decode_attn = r.rows_matmul(compute_dtype, B), r.decode_attention(compute_dtype)
    for t in range(1, T):
        keys = P + t
        arith = ((proj if not dense_rollout else 2.0 * m.linear_params + router) + 2.0 * H * V) * B / rows_mm
        reads = (weights + B * kv_col * keys) / bw
        attn = _attn(m, B * keys) / decode_attn
        rollout += max(arith, reads) + attn + (0 if dense_rollout else dequant)
        rollout += experts.decode_seconds(m, B, er) if moe else 0.0
        rollout += B * V / draw + L * r.decode_layer + r.decode_call
        rollout += L * B * (_elementwise(m, not dense_rollout) + 2.0 * kd) / ew
    # one shared-prefix pass over the batch: each micro-batch runs its distinct prompts once
    fwd_arith = fwd_ew = fwd_attn = fwd_moe = train_moe = 0.0
    calls = len(_micro_batches(s))
    A = max(T - 1, 0)
    head = 0.0
    for rows, U in _micro_batches(s):
        tokens = U * P + rows * A
        fwd_arith += tokens * proj / mm
        if moe:
            fwd_moe += experts.forward_seconds(m, tokens, er)
            train_moe += experts.train_seconds(m, tokens, er)
        fwd_attn += _attn(m, U * P * P + rows * A * (P + A))
        # elementwise work; each answer row gathers its prompt's keys and values ([P] each) and
        # concatenates them with its own
        fwd_ew += L * (tokens * _elementwise(m) + (2.0 * rows * (2 * P + A) * kd if A else 0.0)) / ew
        head += 2.0 * rows * T * H * V / head_rate
    attn_fwd = fwd_attn / r.attention(compute_dtype, False)
    attn_fb = 3.5 * fwd_attn / r.attention(compute_dtype, True)
    forward = fwd_arith + fwd_moe + fwd_ew + attn_fwd + head + calls * (dequant + L * r.forward_layer + r.forward_call)
    scores = (int(s.need_ref) + int(s.need_old)) * forward
    # update, per pass: forward + backward (input gradients through the frozen base: the GEMMs
    # once more, LoRA's twice; elementwise work twice more), the head's forward with its gradient
    # vector (2x its forward), a recomputed forward under checkpointing
    one = (2.0 * fwd_arith + 3.0 * fwd_ew + sum((U * P + rows * A) * _lora(m) for rows, U in _micro_batches(s)) / mm
           + attn_fb + 2.0 * head + 2 * calls * dequant + train_moe)
    if s.gradient_checkpointing:
        one += fwd_arith + fwd_moe + fwd_ew + attn_fwd + calls * (dequant + L * r.train_ckpt_layer + r.train_ckpt_call)
    else:
        one += calls * (L * r.train_layer + r.train_call)
    update = s.passes * one
    notes = [f"rates measured on {r.device} with {r.threads} thread(s) at {r.measured_at} ({r.clock} clock): "
             f"matmul {r.matmul(compute_dtype) / 1e9:.0f} GFLOP/s {compute_dtype}, "
             f"{r.matmul('float32') / 1e9:.0f} fp32; read {bw / 1e9:.1f} GB/s; masked attention "
             f"{r.attention(compute_dtype, False) / 1e9:.0f} GFLOP/s forward, "
             f"{r.attention(compute_dtype, True) / 1e9:.0f} with backward; sampling "
             f"{r.sampling / 1e6:.0f} M logits/s; per layer {r.decode_layer * 1e3:.2f} ms a decode step, "
             f"{r.forward_layer * 1e3:.2f} ms a forward, {r.train_layer * 1e3:.2f} ms forward + backward"]
    if moe:
        notes.append(experts.note(m, er))
    return {"rollout": rollout, "scores": scores, "update": update}, notes
