"""One RL step of fasttrain against one step of TRL's GRPOTrainer on the same work, and the
rollout loop alone against transformers `generate`.

What it compares (same run, each side in its own fresh subprocess, one after the other):
  fasttrain  Trainer._train_step, the trainer's real code path: rollout (fasttrain.rollout on the
             NF4 + LoRA policy) -> verifier -> GDPO + floor guard -> score_batch (old/ref log-probs
             via fused_logprob) -> micro-batched CISPO update + AdamW. The trainer records seconds
             per phase; generation = its `rollout` phase, update = everything else of the step.
  TRL        GRPOTrainer (trl, a benchmark-only dependency) with loss_type="cispo",
             epsilon_high = the CISPO cap, PEFT LoRA of the same rank/alpha/targets, the same
             prompts in the same order, group size (num_generations), token limit
             (max_completion_length), beta, learning rate, grad clip, micro-batch
             (per_device_train_batch_size, gradient_accumulation_steps = batch / micro-batch, so one
             generation batch per optimizer step), gradient checkpointing as each side's default
             (on for both; --checkpointing on|auto|off / --trl-checkpointing on|off set them),
             and a reward function that calls the same environment scorer (sum of
             channels weighted by priorities). Generation = time inside GRPOTrainer._generate
             (tokenize + transformers generate + decode); update = the rest of the optimizer step
             (on_step_begin -> on_step_end: rewards, reference log-probs, loss, backward, AdamW).
  rollout    fasttrain.rollout.sample against model.generate on the same plain model and batch
             (n prompts x G rows, T new tokens, no early stop on either side), new tokens per second;
             a MoE: sample on the same weights with fasttrain's MoE blocks (16-bit experts), which its
             decoder routes through.

Numbers: medians over the measured steps after warm-up steps. Peak memory is the peak resident
set growth of the worker process over its RSS after imports (VmHWM is reset by writing 5 to
/proc/self/clear_refs after the warm-up, so the loading transient does not count): model +
adapters + optimizer state + the step's activations. On CUDA also torch's peak allocated bytes.
Both sides sample (temperature 1, no top-k/top-p) and stop at EOS, so their completion lengths
can differ: the mean completion length per side is printed next to the times.
What it is not: a tuned TRL (no vLLM, no Liger); TRL runs in the precision chosen by
--trl-precision (default bf16 weights + bf16=True, its fastest on this CPU; see the output).

Default shape: the study's, 4 prompts x 12 answers, <= 64 new tokens, micro-batch 12, gradient
checkpointing at each side's default (printed), 1 warm-up + 3 measured steps (median); `--quick` is a smoke run
(1 x 4, 8 new tokens, 1 + 1 steps). Precision: each side at the host's faster one, detected once
and printed (bench/harness.host_precision: the native extension's report, else a bf16 vs fp32
matmul measured here); --fasttrain-dtype / --trl-precision override it.

Distance to the machine's limit (fasttrain side, printed after the table):
  update     model FLOPs of the update per step (reference forward + policy forward + backward of
             the frozen-base network, as run: each distinct prompt once per micro-batch; checkpoint
             recompute not counted; attention backward counted as its forward) over the update's
             time, as a share of the rate of a 2048^3 matmul in the same precision measured in the
             same process right after the steps.
  decode     one decode step of the trainer's rollout (weights as the trainer decodes them) against
             the floor of reading those weights and the mean KV cache once at the read bandwidth
             measured in the same process (a sum over 512 MiB), and against the compute floor: the
             step's matmul FLOPs (every row's token through the projections and the head, attention
             over the mean context) at the 2048^3 rate above. With many rows on a host with slow
             GEMMs (fp32 on AVX2) the compute floor is the larger one: the step cannot reach a
             multiple of the read floor below it.

Models (--model): the bundled SmolLM2-135M-Instruct (default), or one of the pinned random benchmark
models of fasttrain.models.bench_model (SmolLM2's tokenizer), which TRL runs through transformers'
own code with LoRA on what fasttrain adapts:
  qwen3.5-bench-100m    Qwen3.5-shaped hybrid: 16 layers in the 27B's 3:1 Gated DeltaNet / gated
                        attention layout, hidden 512, 109 M parameters; TRL on transformers' torch
                        fallbacks where flash-linear-attention and causal-conv1d are not installed,
                        LoRA on the same twelve projections.
  qwen3-moe-bench-100m  Qwen3-30B-A3B-shaped mixture of experts: 5 layers, hidden 512, 32 experts
                        top-4 of width 192, 103.5 M parameters. fasttrain: NF4 experts with LoRA per
                        expert (its default targets: q/k/v/o and both expert stacks), routing replay.
                        TRL: PEFT LoRA on q/k/v/o (target_modules) and on both expert stacks
                        (target_parameters mlp.experts.gate_up_proj / down_proj: r per expert, the
                        stack rebuilt as W + dW on every forward), router_aux_loss_coef = 0 on both
                        sides, transformers' experts implementation --trl-experts ("auto": the
                        fastest of those the host runs, timed on one expert layer before the workers
                        start; eager loops over the experts hit, grouped_mm sorts the tokens by
                        expert into one grouped GEMM per stack, batched_mm gathers one weight copy
                        per token and expert). Both sides' adapted modules are printed and recorded.

Results: --csv appends the rows (columns model, experts and the host's name among them); --save also
writes bench/results/<host>-<date>-step-<model>[-<experts>][-quick].md (the printed summary under
the command line) and the .csv beside it.

Run: python bench/bench_step.py [--quick] [--device cpu|cuda] [--model smollm2-135m|qwen3.5-bench-100m|qwen3-moe-bench-100m]
     [--trl-experts auto|eager|grouped_mm|batched_mm] [--csv PATH] [--save]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

# --model: the bundled SmolLM2 (loaded by fasttrain.models) or a benchmark model's factory
BENCH_FACTORIES = {"qwen3.5-bench-100m": "fasttrain.models.bench_model:qwen3_5_bench",
                   "qwen3-moe-bench-100m": "fasttrain.models.bench_model:qwen3_moe_bench"}
MODELS = ("smollm2-135m", *BENCH_FACTORIES)
MOE_MODELS = ("qwen3-moe-bench-100m",)
MODEL_NAMES = {"smollm2-135m": "SmolLM2-135M-Instruct",
               "qwen3.5-bench-100m": "the random 109 M Qwen3.5-shaped hybrid (qwen3.5-bench-100m)",
               "qwen3-moe-bench-100m": "the random 103.5 M Qwen3-30B-A3B-shaped MoE (qwen3-moe-bench-100m, "
                                       "32 experts top-4)"}
# the experts' fused stacks PEFT's target_parameters adapt (transformers' Qwen3-MoE parameter names)
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def load_model(a, dtype):
    """(model, tokenizer) of --model in `dtype`; a MoE in transformers' experts implementation
    --trl-experts (what the TRL and rollout workers run; fasttrain replaces the experts anyway)."""
    if a.model in BENCH_FACTORIES:
        import importlib
        mod, _, fn = BENCH_FACTORIES[a.model].partition(":")
        model, tok = getattr(importlib.import_module(mod), fn)(dtype)
        if a.model in MOE_MODELS:
            set_experts(model, a.trl_experts)
        return model, tok
    from fasttrain.models import load_policy
    return load_policy(None, dtype=dtype)


def set_experts(model, impl: str) -> None:
    """Switch `model` to transformers' experts implementation `impl`, or fail saying what it runs."""
    model.set_experts_implementation(impl)
    got = model.config._experts_implementation
    if got != impl:
        raise RuntimeError(f"--trl-experts {impl}: transformers runs {got!r} instead")


def lora_targets(a, model) -> list[str]:
    """TRL's target_modules: the family's projections that are nn.Linear modules of `model` (for a
    MoE whose layers are all sparse: the attention's four)."""
    from torch import nn

    from fasttrain.models.families import adapter_targets
    names = {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return [t for t in adapter_targets(model) if t in names]


def trl_lora_config(a, model):
    """PEFT's LoraConfig for the TRL side: rank/alpha as fasttrain's, on the same projections and
    (a MoE) both expert stacks through target_parameters."""
    from peft import LoraConfig
    extra = {"target_parameters": list(EXPERT_PARAMETERS)} if a.model in MOE_MODELS else {}
    return LoraConfig(r=a.rank, lora_alpha=a.alpha, target_modules=lora_targets(a, model), lora_dropout=0.0,
                      task_type="CAUSAL_LM", **extra)


def adapted_summary(model) -> str:
    """What carries LoRA in `model` (fasttrain's adapted layers or a PEFT model), as
    "q_proj x5, ..., experts.gate_up_proj x5 (r per expert)": one name per module kind, counted."""
    from collections import Counter
    counts: Counter = Counter()
    try:
        from peft.tuners.lora import LoraLayer, ParamWrapper
    except ImportError:                      # fasttrain's side needs no PEFT
        LoraLayer = ParamWrapper = ()
    from fasttrain.nn import adapted_layers
    from fasttrain.nn.moe_experts import moe_expert_layers
    for name, m in adapted_layers(model):
        if m.adapter:
            counts[name.rpartition(".")[2]] += 1
    for _, m in moe_expert_layers(model):
        if m.adapter:
            counts["experts.gate_up"] += 1
            counts["experts.down"] += 1
    for name, m in model.named_modules():
        if isinstance(m, ParamWrapper):
            counts[f"experts.{m.parameter_name}"] += 1
        elif isinstance(m, LoraLayer) and not name.endswith(".base_layer"):
            counts[name.rpartition(".")[2]] += 1
    return ", ".join(f"{k} x{v}" + (" (r per expert)" if k.startswith("experts.") else "")
                     for k, v in counts.items()) or "nothing"


# ---- memory ---------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def reset_peak(device: str) -> None:
    import torch
    reset_peak_rss()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peaks(device: str, baseline_kib: int) -> dict:
    import torch
    out = {"peak_rss_growth_mib": (_status_kib("VmHWM") - baseline_kib) / 1024,
           "peak_rss_mib": _status_kib("VmHWM") / 1024}
    if device == "cuda":
        out["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


# ---- the shared configuration ---------------------------------------------------------------
def fasttrain_config(a, out_dir: str, selection: str):
    from fasttrain.train.config import load_config
    return load_config({
        "run": {"name": "bench_step", "seed": a.seed, "steps": a.warmup + a.steps, "out": out_dir,
                "device": a.device},
        "policy": {"dtype": "float32" if a.fasttrain_dtype == "fp32" else "bfloat16", "rank": a.rank,
                   "alpha": float(a.alpha), "quantize": a.quantize,
                   "gradient_checkpointing": {"auto": "auto", "on": True, "off": False}[a.checkpointing],
                   **({"model": BENCH_FACTORIES[a.model]} if a.model in BENCH_FACTORIES else {})},
        "env": {"name": "signal-a", "prompts": selection},
        "rollout": {"prompts_per_step": a.prompts, "group_size": a.group, "max_new_tokens": a.new,
                    "temperature": 1.0},
        "loss": {"kind": "cispo", "cispo_cap": a.cap, "beta": a.beta, "token_mask": "all", "passes": 1},
        "optim": {"lr": a.lr, "micro_batch": a.micro_batch, "grad_clip": 1.0},
        "probe": {"every": 0},
        # a MoE: no load-balancing loss (TRL's router_aux_loss_coef is 0 too), routing replayed from the rollout
        **({"moe": {"router_aux_loss_coef": 0.0, "routing_replay": "rollout"}} if a.model in MOE_MODELS else {}),
    })


def step_prompts(a):
    """The prompts of steps 1..warmup+steps, in fasttrain's order: first K*n train prompts,
    written as a prompt selection so both sides see exactly these, step by step."""
    from fasttrain.tasks import load_env
    env = load_env("signal-a")
    k = (a.warmup + a.steps) * a.prompts
    return env, env.prompts("train")[:k]


# ---- workers ----------------------------------------------------------------------------------
def worker_fasttrain(a) -> dict:
    import torch
    from fasttrain.train.policy import checkpointing_on
    from fasttrain.train.trainer import Trainer
    base = _status_kib("VmRSS")
    env, prompts = step_prompts(a)
    with tempfile.TemporaryDirectory() as tmp:
        sel = Path(tmp) / "selection.json"
        sel.write_text(json.dumps({"prompt_ids": [p.id for p in prompts]}))
        tr = Trainer(fasttrain_config(a, tmp, str(sel)), Path(tmp) / "run", progress=False)
        tr._setup()
        order = [p.id for s in range(1, a.warmup + a.steps + 1) for p in tr._prompts_for_step(s)]
        shapes = capture_rollout_shapes()
        steps = []
        for s in range(1, a.warmup + a.steps + 1):
            if s == a.warmup + 1:
                reset_peak(a.device)
            t0 = time.perf_counter()
            row, _ = tr._train_step(s)
            if a.device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            steps.append({"step": wall, "generation": row["seconds_rollout"],
                          "update": wall - row["seconds_rollout"], "tokens": row["tokens"],
                          "phases": {k[8:]: v for k, v in row.items() if k.startswith("seconds_")},
                          "update_flops": update_flops(tr.model, shapes[-1], a)})
            print(f"fasttrain step {s}: {wall:.1f} s (gen {row['seconds_rollout']:.1f} s), "
                  f"{row['tokens']} tokens", file=sys.stderr, flush=True)
        mem = peaks(a.device, base)
        limits = machine_limits(a, tr, prompts[:a.prompts], shapes[-1])
    R = tr.cfg.rollout
    return {"steps": steps[a.warmup:], "memory": mem, "prompt_order": order, "limits": limits,
            "setting": f"{a.fasttrain_dtype} base " + ("quantized to NF4" if a.quantize == "nf4" else "kept 16-bit")
                       + " + fp32 LoRA masters, rollout from "
                       f"{'dense merged weights' if tr.rollout_weights is not None else 'the adapted layers'}"
                       f" (rollout.base_weights={R.base_weights}), compile={R.compile}, gradient checkpointing "
                       f"{'on' if checkpointing_on(tr.model) else 'off'} (policy.gradient_checkpointing="
                       f"{tr.cfg.policy.gradient_checkpointing})"
                       + (f", {'NF4' if a.quantize == 'nf4' else '16-bit'} experts, routing replay"
                          if a.model in MOE_MODELS else ""),
            "adapts": adapted_summary(tr.model)}


def capture_rollout_shapes() -> list[dict]:
    """Record (B, P, T, completion tokens) of every rollout the trainer samples (a wrapper around
    the trainer's sample_answers; the update's work follows from these)."""
    import fasttrain.train.trainer as trainer_mod
    seen: list[dict] = []
    original = trainer_mod.sample_answers

    def recording(*args, **kw):
        roll, texts = original(*args, **kw)
        seen.append({"B": roll.completion_ids.shape[0], "P": roll.prompt_len, "T": roll.completion_ids.shape[1],
                     "G": roll.group_size, "answer_tokens": int(roll.completion_mask.sum())})
        return roll, texts
    trainer_mod.sample_answers = recording
    return seen


def _dims(model) -> dict:
    """Sizes the FLOP and bandwidth counts need. proj: the weights a token runs through in the
    adapted projections (the family's, as built) and, in a MoE, its k experts' two stacks and the
    router; L: the layers with attention over the context (a hybrid's full-attention ones; its Gated
    DeltaNet state math is not counted: a few % of the projections at this shape)."""
    from fasttrain.models.families import adapter_targets
    from fasttrain.nn.moe_experts import moe_blocks
    c = model.config
    nh = c.num_attention_heads
    D = getattr(c, "head_dim", None) or c.hidden_size // nh
    nkv = getattr(c, "num_key_value_heads", None) or nh
    H = c.hidden_size
    kinds = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    names = set(adapter_targets(model))
    proj = sum(m.in_features * m.out_features for n, m in model.named_modules()
               if n.rpartition(".")[2] in names and hasattr(m, "in_features"))
    for _, b in moe_blocks(model):
        ex = b.experts
        proj += b.top_k * 3 * ex.intermediate * ex.hidden + b.num_experts * ex.hidden   # gate_up + down, router
    return {"H": H, "L": sum(k == "full_attention" for k in kinds), "nh": nh, "nkv": nkv, "D": D,
            "V": c.vocab_size, "proj": proj}


def _forward_flops(d: dict, tokens: float, ctx: float, logits: float) -> float:
    """Matmul FLOPs of one forward: `tokens` tokens through the projections, `ctx` (query, key)
    pairs of attention (QKᵀ and PV), `logits` tokens through the output head; d from _dims."""
    return 2 * d["proj"] * tokens + 4 * d["L"] * d["nh"] * d["D"] * ctx + 2 * d["H"] * d["V"] * logits


def update_flops(model, shape: dict, a) -> float:
    """Model FLOPs of one step's update (see the header): per micro-batch, each distinct prompt's
    P tokens once plus every row's answer tokens through the projections, causal attention over
    the context, and the answer tokens' logits; x3 (reference forward, forward, backward) or x2
    without the reference (beta 0)."""
    d = _dims(model)
    P, T, B, G = shape["P"], shape["T"], shape["B"], shape["G"]
    mb = a.micro_batch
    total = 0.0
    for start in range(0, B, mb):
        rows = min(mb, B - start)
        U = len({(start + i) // G for i in range(rows)})          # distinct prompts in the micro-batch
        tokens = U * P + rows * (T - 1)
        ctx = U * P * (P + 1) / 2 + rows * sum(P + t for t in range(1, T))
        answer = shape["answer_tokens"] * rows / B
        total += _forward_flops(d, tokens, ctx, answer)
    return total * (3 if a.beta > 0 else 2)


def machine_limits(a, tr, prompts, shape: dict) -> dict:
    """The matmul rate and read bandwidth of this host now, and one decode step of the trainer's
    rollout with the floor of reading its weights and KV cache once."""
    import statistics

    import torch
    from harness import matmul_gflops, memory_gbps

    dt = torch.bfloat16 if a.fasttrain_dtype == "bf16" else torch.float32
    gflops = statistics.median(matmul_gflops(dt, n=2048, reps=3) for _ in range(2))
    gbps = memory_gbps()
    T = a.new
    w = tr.rollout_weights
    ids, run = rollout_timer(tr, prompts, a.group)
    with torch.inference_mode():
        run(2)
        full, one = statistics.median(run(T) for _ in range(2)), statistics.median(run(1) for _ in range(2))
    decode_s = (full - one) / max(T - 1, 1)
    d = _dims(tr.model)
    esz = 2 if dt == torch.bfloat16 else 4
    if w is not None:
        weight_bytes = w.nbytes(head=False)                                 # the head once, below
    else:
        from fasttrain.nn import resident_bytes
        weight_bytes = resident_bytes(tr.model)["total"]["base"]            # NF4 codes + scales, or 16-bit
    weight_bytes += d["H"] * d["V"] * esz                                   # lm_head
    B, P = a.prompts * a.group, max(map(len, ids))
    weight_bytes += expert_read_bytes(tr.model, B)
    kv_bytes = d["L"] * 2 * B * d["nkv"] * d["D"] * (P + T / 2) * esz      # the mean context's cache
    from fasttrain.plan.meta_model import hybrid_state
    kv_bytes += 2 * B * hybrid_state(tr.model.config, dt).get("state_bytes", 0)   # a hybrid's state: read + written
    floor = (weight_bytes + kv_bytes) / (gbps * 1e9)
    # the compute floor: one decode step's matmul FLOPs (B tokens through the projections and the head,
    # attention over the mean context) at the 2048^3 rate above; where it exceeds the read floor
    # (many rows, a host with slow GEMMs) the step is bound by compute, not by reading the weights
    decode_flops = _forward_flops(d, B, B * (P + T / 2), B)
    compute_floor = decode_flops / (gflops * 1e9)
    return {"matmul_gflops": gflops, "read_gbps": gbps, "decode_step_s": decode_s, "decode_floor_s": floor,
            "decode_gflop": decode_flops / 1e9, "decode_compute_floor_s": compute_floor,
            "decode_weight_mib": weight_bytes / 2**20, "decode_kv_mib": kv_bytes / 2**20,
            "precision": a.fasttrain_dtype}


def rollout_timer(tr, prompts, group: int):
    """(prompt ids, run) for the trainer `tr`'s rollout of `prompts` x `group` answers: run(n) samples
    n new tokens (no EOS) with the trainer's rollout weights (refreshed here) and settings, and returns
    its wall seconds."""
    import time

    from fasttrain.rollout import sample
    from fasttrain.train.answers import prompt_token_ids
    R = tr.cfg.rollout
    ids = prompt_token_ids(tr.tokenizer, tr.env, prompts, R.answer_prefix)
    w = tr.rollout_weights
    if w is not None:
        w.refresh()

    def run(n):
        t0 = time.perf_counter()
        # one generator per prompt, as the trainer seeds its groups
        sample(tr.model, ids, group_size=group, max_new_tokens=n, temperature=1.0, eos_token_ids=[],
               seed=list(range(len(ids))), weights=w, compile=R.compile)
        return time.perf_counter() - t0
    return ids, run


def expert_read_bytes(model, rows: int) -> float:
    """Bytes a decode step of `rows` tokens reads from a MoE's experts: each layer's stacks (NF4 codes
    + scales, or 16-bit) and expert LoRA factors, times the expected share of its experts that at
    least one of the rows' top-k reaches, 1 - (1 - k/E)^rows (uniform routing); 0 for a dense model."""
    from fasttrain.nn.moe_experts import moe_blocks
    total = 0.0
    for _, b in moe_blocks(model):
        held = sum(t.numel() * t.element_size() for t in b.experts.buffers(recurse=False))
        held += sum(p.numel() * p.element_size() for p in b.experts.adapter_parameters())
        total += held * (1 - (1 - b.top_k / b.num_experts) ** rows)
    return total


def worker_trl(a) -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from fasttrain.models import chat_prompt_ids, extract_answer
    from fasttrain.train.trainer import Trainer
    base = _status_kib("VmRSS")
    env, prompts = step_prompts(a)
    with tempfile.TemporaryDirectory() as tmp:
        sel = Path(tmp) / "selection.json"
        sel.write_text(json.dumps({"prompt_ids": [p.id for p in prompts]}))
        ft = Trainer(fasttrain_config(a, tmp, str(sel)), Path(tmp) / "run", progress=False)  # no model loaded
        ordered = [p for s in range(1, a.warmup + a.steps + 1) for p in ft._prompts_for_step(s)]
    by_id = {p.id: p for p in ordered}
    weights_dtype = torch.float32 if a.trl_precision in ("fp32", "bf16-autocast") else torch.bfloat16
    model, tok = load_model(a, weights_dtype)
    tok.padding_side = "left"
    texts = [tok.decode(chat_prompt_ids(tok, p.spec, env.answer_format)) for p in ordered]
    data = Dataset.from_dict({"prompt": texts, "prompt_id": [p.id for p in ordered]})
    takes_record = "record" in env.score_many.__code__.co_varnames

    def signal_reward(prompts, completions, prompt_id, **kw):
        ps = [by_id[i] for i in prompt_id]
        answers = [extract_answer(c) for c in completions]
        kwargs = {"record": True} if takes_record else {}
        scores = env.score_many(ps, answers, "train", **kwargs)
        return [s.total(env.channels) for s in scores]

    cfg = GRPOConfig(
        output_dir=str(Path(tempfile.gettempdir()) / "bench_step_trl"), use_cpu=a.device == "cpu",
        bf16=a.trl_precision != "fp32", loss_type="cispo", epsilon_high=a.cap, beta=a.beta,
        num_generations=a.group, max_completion_length=a.new, temperature=1.0, top_p=1.0, top_k=0,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=a.prompts * a.group // a.micro_batch,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=a.warmup + a.steps, shuffle_dataset=False, seed=a.seed,
        logging_steps=10_000, save_strategy="no", report_to="none", disable_tqdm=True,
        gradient_checkpointing=a.trl_checkpointing == "on", dataloader_num_workers=0,
        **({"router_aux_loss_coef": 0.0} if a.model in MOE_MODELS else {}))   # fasttrain's default: no aux loss
    trainer = GRPOTrainer(model=model, reward_funcs=signal_reward, args=cfg, train_dataset=data,
                          processing_class=tok, peft_config=trl_lora_config(a, model))
    if a.model in MOE_MODELS and (trainer.aux_loss_enabled or model.config._experts_implementation != a.trl_experts):
        raise RuntimeError(f"TRL: aux loss {trainer.aux_loss_enabled}, experts "
                           f"{model.config._experts_implementation!r}; the benchmark asks for none and {a.trl_experts!r}")

    gen_times: list[float] = []
    original_generate = trainer._generate

    def timed_generate(*args, **kw):
        if a.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = original_generate(*args, **kw)
        if a.device == "cuda":
            torch.cuda.synchronize()
        gen_times.append(time.perf_counter() - t0)
        return out

    trainer._generate = timed_generate
    steps: list[dict] = []

    class StepClock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == a.warmup:
                reset_peak(a.device)
            self.gens = len(gen_times)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if a.device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.t0
            gen = sum(gen_times[self.gens:])
            steps.append({"step": wall, "generation": gen, "update": wall - gen})
            print(f"trl step {state.global_step}: {wall:.1f} s (gen {gen:.1f} s)", file=sys.stderr, flush=True)

    trainer.add_callback(StepClock())
    trainer.train()
    mem = peaks(a.device, base)
    lengths = trainer._metrics["train"].get("completions/mean_length", [])
    for s, n in zip(steps, lengths):
        s["tokens"] = n * a.prompts * a.group
    setting = {"bf16": "bf16 weights, bf16=True", "bf16-autocast": "fp32 weights, bf16=True (autocast)",
               "fp32": "fp32 weights, bf16=False"}[a.trl_precision]
    if a.model in MOE_MODELS:
        setting += f", transformers experts_implementation={a.trl_experts}, router_aux_loss_coef=0"
    return {"steps": steps[a.warmup:], "memory": mem, "prompt_order": [p.id for p in ordered],
            "setting": setting + f", gradient checkpointing {a.trl_checkpointing}, PEFT LoRA", "adapts": adapted_summary(trainer.model)}


def worker_rollout(a) -> dict:
    import torch
    from fasttrain.tasks import load_env
    from fasttrain.models import chat_prompt_ids
    from fasttrain.rollout import sample
    dtype = torch.bfloat16 if a.rollout_dtype == "bf16" else torch.float32
    model, tok = load_model(a, dtype)
    model.to(a.device)
    ours_model = model
    if a.model in MOE_MODELS:         # fasttrain's decoder drives its own MoE blocks: the same weights, 16-bit experts
        import copy

        from fasttrain.models.moe import moe_surgery
        ours_model = moe_surgery(copy.deepcopy(model), nf4=False)
    env = load_env("signal-a")
    prompts = [chat_prompt_ids(tok, p.spec, env.answer_format) for p in env.prompts("train")[:a.prompts]]
    n, G, T = len(prompts), a.group, a.new
    P = max(map(len, prompts))
    pad = tok.pad_token_id
    enc = torch.full((n, P), pad, dtype=torch.long)
    am = torch.zeros((n, P), dtype=torch.long)
    for i, p in enumerate(prompts):
        enc[i, P - len(p):] = torch.tensor(p)
        am[i, P - len(p):] = 1
    enc, am = enc.to(a.device), am.to(a.device)

    def ours():
        r = sample(ours_model, prompts, group_size=G, max_new_tokens=T, temperature=1.0, eos_token_ids=[],
                   seed=0, pad_token_id=pad)
        assert r.completion_ids.shape == (n * G, T)

    def theirs():
        out = model.generate(enc, attention_mask=am, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             num_return_sequences=G, max_new_tokens=T, min_new_tokens=T, pad_token_id=pad,
                             eos_token_id=tok.eos_token_id)
        assert out.shape == (n * G, P + T)

    times = {"sample": [], "generate": []}
    with torch.inference_mode():
        for rep in range(a.rollout_reps + 1):          # rep 0 is the warm-up; sides alternate
            for name, fn in (("sample", ours), ("generate", theirs)):
                if a.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                if a.device == "cuda":
                    torch.cuda.synchronize()
                if rep:
                    times[name].append(time.perf_counter() - t0)
                print(f"rollout rep {rep} {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return {"times": times, "tokens": n * G * T, "prompt_len": P, "dtype": a.rollout_dtype}


# ---- transformers' experts implementation (--trl-experts auto) -----------------------------------
def pick_experts(a) -> tuple[str, str]:
    """(implementation, why) for --trl-experts auto: one step's expert work on one layer of the
    benchmark MoE, in TRL's weight dtype, per implementation: forward + backward at a micro-batch's
    answer tokens (the weights taking gradients, as PEFT's W + dW does) times the micro-batches of
    a step, plus a forward at the batch's rows (a decode step) times the new tokens; the fastest
    that runs wins. batched_mm enters only when the weights it gathers per (token, expert) at the
    update's token count stay under 1 GiB."""
    import torch
    from harness import time_it
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from fasttrain.models.bench_model import MOE_BENCH_CONFIG, bench_config
    cfg = bench_config(MOE_BENCH_CONFIG)
    dtype = torch.float32 if a.trl_precision in ("fp32", "bf16-autocast") else torch.bfloat16
    E, k, H, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    rows, tokens = a.prompts * a.group, a.micro_batch * a.new
    g = torch.Generator().manual_seed(0)

    def routed(n):
        w, idx = torch.randn(n, E, generator=g).softmax(-1).topk(k, dim=-1)
        x, w = torch.randn(n, H, generator=g).to(dtype), (w / w.sum(-1, keepdim=True)).to(dtype)
        return x.to(a.device), idx.to(a.device), w.to(a.device)
    upd, dec = routed(tokens), routed(rows)
    times, why = {}, []
    for impl in EXPERTS_IMPLEMENTATIONS:
        gathered = tokens * k * 3 * I * H * torch.empty((), dtype=dtype).element_size()
        if impl == "batched_mm" and gathered > 2**30:
            why.append(f"batched_mm skipped (would gather {gathered / 2**30:.1f} GiB of weights)")
            continue
        cfg._experts_implementation = impl
        torch.manual_seed(0)
        ex = Qwen3MoeExperts(cfg).to(a.device, dtype)
        for prm in ex.parameters():
            prm.data.normal_(0.0, 0.02)

        def fb():
            ex(upd[0].detach().requires_grad_(), upd[1], upd[2]).float().square().mean().backward()
            ex.zero_grad(set_to_none=True)

        def fwd():
            with torch.no_grad():
                ex(*dec)
        try:
            times[impl] = (rows // a.micro_batch * time_it(fb, reps=3, device=a.device)
                           + a.new * time_it(fwd, reps=3, device=a.device))
        except Exception as e:  # noqa: BLE001  (an implementation this host cannot run is left out)
            why.append(f"{impl} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    if not times:
        raise RuntimeError("--trl-experts auto: no experts implementation of transformers ran here: " + "; ".join(why))
    best = min(times, key=times.get)
    why.insert(0, ", ".join(f"{name} {t:.2f} s" for name, t in times.items()))
    return best, "one layer's expert work per step, " + "; ".join(why)


# ---- orchestration ----------------------------------------------------------------------------
def run_worker(name: str, argv: list[str], timeout: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", name, "--worker-out", out]
    t0 = time.time()
    proc = subprocess.run(cmd, timeout=timeout, stdout=subprocess.PIPE, stderr=None, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} worker failed (rc {proc.returncode}); its stderr is above")
    res = json.loads(Path(out).read_text())
    os.unlink(out)
    print(f"{name} worker result: {json.dumps({k: v for k, v in res.items() if k != 'prompt_order'})}",
          file=sys.stderr, flush=True)   # kept in the log even if the summary fails later
    res["worker_wall_s"] = time.time() - t0
    return res


SUMMARY: list[str] = []            # what main printed, for --save


def say(text: str = "") -> None:
    print(text, flush=True)
    SUMMARY.append(text)


def med(steps: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model", choices=MODELS, default="smollm2-135m",
                    help="the bundled SmolLM2-135M, or a pinned random benchmark model (the Qwen3.5-shaped hybrid, "
                         "the Qwen3-30B-A3B-shaped MoE)")
    ap.add_argument("--trl-experts", choices=["auto", *EXPERTS_IMPLEMENTATIONS], default="auto",
                    help="a MoE's experts implementation in transformers (the TRL and rollout workers); auto: the "
                         "fastest here of those that run, timed on one expert layer first")
    ap.add_argument("--quick", action="store_true",
                    help="smoke config (gpu_check): 1 prompt x 4 answers, 8 new tokens, 1 warm-up + 1 measured step")
    # Defaults: the study's shape. On a shared 2-core box each TRL step of it takes minutes.
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=12, help="answers per prompt (num_generations)")
    ap.add_argument("--new", type=int, default=64, help="max new tokens (max_completion_length)")
    ap.add_argument("--micro-batch", type=int, default=12, help="answers per forward/backward, both sides")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per side")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up steps per side")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--alpha", type=int, default=64)
    ap.add_argument("--beta", type=float, default=0.08, help="KL weight (reference = base, adapters off)")
    ap.add_argument("--cap", type=float, default=1.2, help="CISPO cap (TRL: epsilon_high)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-precision", choices=["auto", "bf16", "bf16-autocast", "fp32"], default="auto",
                    help="auto: bf16 where the host computes bf16 faster, else fp32")
    ap.add_argument("--rollout-dtype", choices=["auto", "bf16", "fp32"], default="auto")
    ap.add_argument("--fasttrain-dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="fasttrain's base dtype before NF4 (non-quantized layers compute in it); auto: the "
                         "host's faster precision (fp32 on CPUs without bf16 instructions)")
    ap.add_argument("--quantize", choices=["nf4", "none"], default="nf4",
                    help="fasttrain's frozen base: NF4, or the 16-bit weights (TRL's PEFT LoRA is 16-bit)")
    ap.add_argument("--checkpointing", choices=["auto", "on", "off"], default="on",
                    help="fasttrain's policy.gradient_checkpointing (on: its default; auto: off where the "
                         "plan fits the update without it)")
    ap.add_argument("--trl-checkpointing", choices=["on", "off"], default="on",
                    help="TRL's gradient_checkpointing (on: GRPOConfig's default)")
    ap.add_argument("--rollout-reps", type=int, default=3)
    ap.add_argument("--only", default="fasttrain,trl,rollout", help="comma-separated: fasttrain,trl,rollout")
    ap.add_argument("--timeout", type=int, default=1500, help="seconds per worker")
    ap.add_argument("--csv", default="", help="append long-format rows here (bench/run_all.py passes it)")
    ap.add_argument("--save", action="store_true",
                    help="also write bench/results/<host>-<date>-step-<model>[-<experts>][-quick].md and .csv")
    ap.add_argument("--worker", choices=["fasttrain", "trl", "rollout"], help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.prompts, a.group, a.new, a.steps, a.warmup, a.micro_batch, a.rollout_reps = 1, 4, 8, 1, 1, 4, 1
    if (a.prompts * a.group) % a.micro_batch:
        ap.error(f"--micro-batch {a.micro_batch} must divide prompts x group = {a.prompts * a.group}")

    if a.worker:
        res = {"fasttrain": worker_fasttrain, "trl": worker_trl, "rollout": worker_rollout}[a.worker](a)
        Path(a.worker_out).write_text(json.dumps(res))
        return 0

    import torch
    from harness import host_precision, machine_name, row, versions, write_csv
    argv = _strip_csv(sys.argv[1:])
    if "auto" in (a.fasttrain_dtype, a.trl_precision, a.rollout_dtype):
        fast, why = host_precision() if a.device == "cpu" else ("bf16", "CUDA")
        a.fasttrain_dtype = fast if a.fasttrain_dtype == "auto" else a.fasttrain_dtype
        a.rollout_dtype = fast if a.rollout_dtype == "auto" else a.rollout_dtype
        a.trl_precision = fast if a.trl_precision == "auto" else a.trl_precision
        say(f"precision: {fast} is the faster on this host ({why}); fasttrain {a.fasttrain_dtype}, "
            f"TRL {a.trl_precision}, rollout bench {a.rollout_dtype}")
        argv += ["--fasttrain-dtype", a.fasttrain_dtype, "--trl-precision", a.trl_precision,
                 "--rollout-dtype", a.rollout_dtype]
    moe = a.model in MOE_MODELS
    if moe and a.trl_experts == "auto":
        a.trl_experts, why = pick_experts(a)
        say(f"experts: transformers' {a.trl_experts} is the fastest here ({why})")
        argv += ["--trl-experts", a.trl_experts]
    only = {s.strip() for s in a.only.split(",") if s.strip()}
    B = a.prompts * a.group
    load = os.getloadavg()[0]
    experts = f", TRL on transformers' {a.trl_experts} experts" if moe else ""
    say(f"bench_step: {MODEL_NAMES[a.model]}{experts}, signal-a, {a.prompts} prompts x {a.group} answers = {B} rows, "
        f"<= {a.new} new tokens, micro-batch {a.micro_batch}, LoRA r={a.rank} alpha={a.alpha} (what each side "
        f"adapts is listed below), CISPO cap {a.cap}, beta {a.beta}, lr {a.lr}; {a.warmup} warm-up + {a.steps} measured "
        f"steps per side, medians; device {a.device}, {torch.get_num_threads()} threads, {machine_name()}; "
        f"load average {load:.1f} at start (the machine is shared: ratios side by side are what count)")
    say("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    res: dict[str, dict] = {}
    for name in ("trl", "fasttrain", "rollout"):
        if name in only:
            res[name] = run_worker(name, argv, a.timeout)
    rows = []
    case = f"{a.prompts}x{a.group}x{a.new}"
    extra = {"device": a.device, "load_avg": f"{load:.1f}", "model": a.model,
             "experts": a.trl_experts if moe else ""}
    if "fasttrain" in res and "trl" in res:
        f, t = res["fasttrain"], res["trl"]
        if f["prompt_order"] != t["prompt_order"]:
            raise RuntimeError("the two sides trained on different prompts")
        say(f"\nfasttrain: {f['setting']}\nTRL:       {t['setting']}")
        say(f"fasttrain adapts: {f['adapts']}\nTRL adapts:       {t['adapts']}")
        say(f"{'':24s}{'fasttrain':>12s}{'TRL':>12s}{'ratio':>9s}   (ratio = fasttrain / TRL; target)")
        # targets: the step at <= 0.35x TRL's time (a MoE: 0.3x), generation <= 0.5x, peak memory <= 0.35x
        for key, label, target in (("step", "step s", 0.3 if moe else 0.35), ("generation", "  generation s", 0.5),
                                   ("update", "  update s", None)):
            fv, tv = med(f["steps"], key), med(t["steps"], key)
            say(f"{label:24s}{fv:12.2f}{tv:12.2f}{fv / tv:9.2f}" + (f"   (<= {target})" if target else ""))
            rows += [row("step", case, "fasttrain", f"{key}_s", fv, "s", **extra),
                     row("step", case, "trl", f"{key}_s", tv, "s", **extra),
                     row("step", case, "fasttrain/trl", f"{key}_ratio", fv / tv, "x", **extra)]
        fm, tm = f["memory"]["peak_rss_growth_mib"], t["memory"]["peak_rss_growth_mib"]
        say(f"{'peak RSS growth MiB':24s}{fm:12.0f}{tm:12.0f}{fm / tm:9.2f}   (<= 0.35)")
        rows += [row("step", case, "fasttrain", "peak_rss_growth_mib", fm, "MiB", **extra),
                 row("step", case, "trl", "peak_rss_growth_mib", tm, "MiB", **extra),
                 row("step", case, "fasttrain/trl", "peak_rss_growth_ratio", fm / tm, "x", **extra)]
        if a.device == "cuda":
            fc, tc = f["memory"]["peak_cuda_mib"], t["memory"]["peak_cuda_mib"]
            say(f"{'peak CUDA alloc MiB':24s}{fc:12.0f}{tc:12.0f}{fc / tc:9.2f}")
            rows += [row("step", case, "fasttrain", "peak_cuda_mib", fc, "MiB", **extra),
                     row("step", case, "trl", "peak_cuda_mib", tc, "MiB", **extra)]
        ftok = statistics.mean(s["tokens"] for s in f["steps"]) / B
        ttok = statistics.mean(s.get("tokens", float("nan")) for s in t["steps"]) / B
        say(f"{'mean completion tokens':24s}{ftok:12.1f}{ttok:12.1f}   (each side samples its own answers)")
        say(f"{'absolute peak RSS MiB':24s}{f['memory']['peak_rss_mib']:12.0f}{t['memory']['peak_rss_mib']:12.0f}"
            "   (includes each side's imports)")
        ph = {k: statistics.median(s["phases"][k] for s in f["steps"]) for k in f["steps"][0]["phases"]}
        say("fasttrain phases (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()))
    if "fasttrain" in res:
        rows += print_limits(res["fasttrain"], case, extra)
    if "rollout" in res:
        r = res["rollout"]
        s, g = statistics.median(r["times"]["sample"]), statistics.median(r["times"]["generate"])
        tok = r["tokens"]
        plain = "plain model; fasttrain's MoE blocks, 16-bit experts" if moe else "plain model"
        say(f"\nrollout alone ({r['dtype']}, {plain}, {a.prompts}x{a.group} rows, prompt ~{r['prompt_len']} "
            f"tokens, {a.new} new tokens, no early stop, median of {len(r['times']['sample'])}):")
        say(f"  transformers generate     {g:8.2f} s {tok / g:9.1f} tok/s")
        say(f"  fasttrain.rollout.sample  {s:8.2f} s {tok / s:9.1f} tok/s   ratio {g / s:.2f}x  (>= 1.3)")
        rc = f"{a.prompts}x{a.group}x{a.new}-{r['dtype']}"
        rows += [row("step_rollout", rc, "generate", "tok_per_s", tok / g, "tok/s", **extra),
                 row("step_rollout", rc, "fasttrain", "tok_per_s", tok / s, "tok/s", **extra),
                 row("step_rollout", rc, "fasttrain/generate", "speedup", g / s, "x", **extra)]
    say(f"load average at end {os.getloadavg()[0]:.1f}")
    if a.csv:
        write_csv(rows, Path(a.csv))
    if a.save:
        save_results(a, rows)
    return 0


def save_results(a, rows: list[dict]) -> None:
    """bench/results/<host>-<date>-step-<model>[-<experts>][-quick].md (the summary printed above,
    under the command that made it) and .csv (the rows)."""
    import datetime as dt

    from harness import RESULTS, machine_name, write_csv
    moe = a.model in MOE_MODELS
    stem = (f"{machine_name()}-{dt.date.today().isoformat()}-step-{a.model}" + (f"-{a.trl_experts}" if moe else "")
            + ("-quick" if a.quick else ""))
    md, csv_path = RESULTS / f"{stem}.md", RESULTS / f"{stem}.csv"
    csv_path.unlink(missing_ok=True)
    write_csv(rows, csv_path)
    cmd = " ".join(["python bench/bench_step.py", *_strip_csv(sys.argv[1:])])
    head = [f"# bench_step on {MODEL_NAMES[a.model]}, fasttrain vs TRL, {machine_name()}, {dt.date.today().isoformat()}",
            "", f"Host: {machine_name()}; device {a.device}."
            + (f" TRL's experts: transformers' {a.trl_experts}." if moe else ""),
            f"Command: `{cmd}`", ""]
    if a.quick:
        head += ["A --quick run is a smoke test (1 prompt x 4 answers, 8 new tokens): it shows both sides run end "
                 "to end, not how fast either is.", ""]
    md.write_text("\n".join(head + ["```", *SUMMARY, "```", "", f"Raw numbers: `{csv_path.name}`.", ""]))
    print(f"wrote {md} and {csv_path}")


def print_limits(f: dict, case: str, extra: dict) -> list[dict]:
    from harness import row
    lim = f["limits"]
    flops = med(f["steps"], "update_flops")
    upd = med(f["steps"], "update")
    achieved = flops / upd / 1e9
    share = achieved / lim["matmul_gflops"]
    ratio = lim["decode_step_s"] / lim["decode_floor_s"]
    say(f"\ndistance to this machine's limit (fasttrain, {lim['precision']}):")
    say(f"  update   {flops / 1e12:.2f} TFLOP in {upd:.1f} s = {achieved:.0f} GFLOP/s; a {lim['precision']} "
        f"2048^3 matmul here runs {lim['matmul_gflops']:.0f} GFLOP/s: {100 * share:.0f}% of it (target >= 50%)")
    say(f"  decode   {lim['decode_step_s'] * 1e3:.0f} ms/step; floor {lim['decode_floor_s'] * 1e3:.1f} ms = "
        f"{lim['decode_weight_mib']:.0f} MiB weights + {lim['decode_kv_mib']:.0f} MiB KV cache at "
        f"{lim['read_gbps']:.1f} GB/s read: {ratio:.1f}x the floor")
    cf = lim["decode_compute_floor_s"]
    roof = max(cf, lim["decode_floor_s"])
    say(f"           compute floor {cf * 1e3:.1f} ms = {lim['decode_gflop']:.1f} GFLOP at the matmul rate above; "
        f"{lim['decode_step_s'] / roof:.1f}x the larger of the two floors "
        f"({'compute' if cf > lim['decode_floor_s'] else 'read'}-bound)")
    return [row("step", case, "fasttrain", "decode_compute_floor_ms", cf * 1e3, "ms", **extra),
            row("step", case, "fasttrain", "decode_over_roofline", lim["decode_step_s"] / roof, "x", **extra),
            row("step", case, "fasttrain", "update_gflops", achieved, "GFLOP/s", **extra),
            row("step", case, "fasttrain", "update_share_of_matmul", share, "x", **extra),
            row("step", case, "fasttrain", "decode_ms_per_step", lim["decode_step_s"] * 1e3, "ms", **extra),
            row("step", case, "fasttrain", "decode_over_floor", ratio, "x", **extra)]


def _strip_csv(argv: list[str]) -> list[str]:
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        if x == "--csv":
            skip = True
            continue
        if x.startswith("--csv="):
            continue
        out.append(x)
    return out


if __name__ == "__main__":
    sys.exit(main())
