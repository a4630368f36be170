"""Memory of one training step on paper: every buffer the trainer allocates, by part and phase.

Phases (what is live at each one's peak):
  load     the model being read and quantized tensor by tensor (fasttrain.plan.load)
  rollout  one wave (fasttrain.plan.picks: the rollout's B rows decoded s.wave_prompts prompts at a
           time, the earlier waves' outputs kept): resident + KV cache [L, 2, B_wave, kv_heads,
           P+T, head_dim] (a hybrid's recurrent state and conv windows per row, apart) + a prefill
           chunk of s.prefill_prompts prompts (their own cache, the masks, one layer's
           activations) or a decode step's
           sampling buffers ([B, V] fp32 logits and the draw's float64 running sum), whichever
           is larger; with dense rollout weights (rollout.base_weights) the projections run as one
           GEMM per group (q/k/v, gate/up) whose output stays whole while a part of it is used
  probe    the same rollout with the probe's prompts x samples
  scores   no-grad log-probs of one micro-batch (reference with adapters off, and the pre-update
           policy when the token mask needs entropies first) through fasttrain.train.prefix_forward:
           per layer the U distinct prompts [U, P] and the answers [mb, T-1] run together (N = U·P +
           mb·(T-1) token rows through every projection), each answer row attending to its prompt's
           gathered keys and values; a layer's locals all stay referenced until it returns
  update   one micro-batch forward + backward through the same forward: with gradient checkpointing
           each layer's input [N, H] is kept and the last layer is recomputed with all its
           activations; without, every layer keeps its activations; plus the fused log-prob head's
           [mb·T, H] buffers, the adapters' gradients and the AdamW moments
Resident in every phase: the projections' base (NF4: packed 4-bit + absmax; policy.quantize
"none": the model's own 16-bit weights, so the resident bytes are the model's), the unquantised parts (embeddings,
lm_head, norms), the fp32 adapter masters, DoRA's row norms, the dense rollout weights when the
run keeps them (rollout.base_weights: "dequantized", or "auto" when they take at most
fasttrain.nn.rollout_weights.AUTO_SHARE of the memory left after the model), the AdamW moments (from step 2 on),
the step's batch tensors (ids, masks, log-probs) after the rollout, and workspace: on the CPU the
NF4 kernels' reusable dequantisation scratch (the largest projection, in the compute dtype); on
CUDA the dequantised weight of one projection, a temporary of every call with more than 64 rows;
a 16-bit base has none (DoRA's row-norm blocks are a transient at the first forward after a step).

A mixture of experts (Qwen3-MoE, Qwen3.5-MoE) adds its own parts to every phase (the experts'
stacks, the 16-bit router, the experts' LoRA and its AdamW moments, the routing record, what the
routed experts add to the activations), from fasttrain.plan.moe_memory, which also gives its layers'
terms around the base family's.

A hybrid (Qwen3.5: Gated DeltaNet and gated attention layers) has the same phases: its KV cache
lives in its full-attention layers only, each row carries the fixed Gated DeltaNet state (conv window
+ recurrent state; the n prompts' own during the prefill), and the layers' terms (prefill, decode
locals, prefix_forward's live and saved bytes, the backward's temporaries) come per layer kind from
fasttrain.plan.hybrid_memory.

Activation sizes follow the code paths: Hugging Face's Llama-family layer (RMSNorm upcasts to fp32,
SDPA with grouped K/V repeated when a padding mask is present), fasttrain.ops.nf4_linear (saves its
input and x·Aᵀ, never the dequantised weight) and fasttrain.ops.fused_logprob (an [N, H] fp32
gradient vector instead of [N, V] logits), fasttrain.ops.masked_attention (in the update on a CPU
with native bf16, bf16 heads of at most 64: fasttrain's backward, which saves no output, log-sum-exp
or float mask and holds a chunk of float32 scores at each attention backward; torch's SDPA
elsewhere). A 16-bit base (DenseLinear) runs its adapter in fp32: per projection it saves an fp32
copy of its input (bf16 models) and x·Aᵀ, and DoRA two fp32 outputs (tests/plan measures these
steps on the tiny model too).
What is not modelled: allocator fragmentation and the
CUDA context (added by the fit check), Python objects, and the tokenizer; the compiled decode
(rollout.compile: its cache rounded up to 64 columns, inductor's buffers); a model whose forward
prefix_forward does not drive (attention dropout in training, a sliding window shorter than the
sequence) and so runs its own full forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from fasttrain.models.families import family_of_type
from fasttrain.nn.rollout_weights import use_dense
from fasttrain.plan import hybrid_memory, moe_memory
from fasttrain.plan.load import load_phase
from fasttrain.plan.meta_model import ModelShape, fasttrain_attention_call
from fasttrain.plan.run_shape import RunShape

__all__ = ["Device", "MemoryPlan", "PARTS", "plan_memory", "probe_phase", "resident_base", "rollout_phase",
           "scores_phase", "update_phase", "update_tokens"]

# Table rows, in order, with the words the table prints.
PARTS = {
    "nf4_base": "frozen base (NF4: 4-bit + absmax; none: 16-bit)",
    "dense_parts": "unquantised parts (embeddings, lm_head, norms)",
    "adapter_masters": "adapters: fp32 masters",
    "dora_norms": "adapters: DoRA row norms",
    "adam_moments": "adapters: AdamW moments",
    "rollout_weights": "dense rollout weights (merged, model dtype; packed: with the head's copy)",
    "adapter_grads": "adapters: gradients",
    "workspace": "workspace (dequantised NF4 projection)",
    "batch": "step batch (ids, masks, log-probs)",
    "kv_cache": "KV cache (full-attention layers)",
    "recurrent_state": "recurrent state (Gated DeltaNet, fp32)",
    "conv_state": "conv windows (Gated DeltaNet)",
    "activations": "activations",
    "logprob_head": "log-prob head (fused: N x H buffers)",
    "undo_copy": "host copy of adapters + AdamW (out-of-memory retry, k > 1 passes)",
    "sampling": "sampling buffers ([B, V] logits)",
    "load_transient": "loading: one tensor as read, cast and quantized",
    **moe_memory.PARTS,
}

CPU_DECODE_TILE = 512 * 1024          # csrc/cpu/nf4_linear.cpp: decode tiles of W, per thread
CPU_LOGPROB_BUDGET = 8 << 20          # csrc/cpu/fused_logprob.cpp: scratch across threads
CPU_LOGPROB_BLOCK = 128
CUDA_LOGPROB_BUDGET = 256 << 20       # csrc/cuda/fused_logprob.cu: zbuf + pbuf


@dataclass(frozen=True)
class Device:
    kind: str = "cuda"                # "cuda" | "cpu"
    cpu_bf16: bool = False            # the CPU has avx512_bf16 (NF4 GEMMs then run in bf16)
    threads: int = 1
    free: int = 0                     # bytes free before the model is built ("auto" rollout weights)


@dataclass
class MemoryPlan:
    phases: dict = field(default_factory=dict)    # phase -> {part: bytes}
    notes: dict = field(default_factory=dict)     # extra facts: unfused logits, no-checkpointing activations

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase)


def _compute_bytes(m: ModelShape, dev: Device) -> int:
    """Bytes per element of nf4_linear's internal products (GEMM output z, x·Aᵀ); a 16-bit base's
    adapter products are fp32 (fp64 for an fp64 model)."""
    w = m.w
    if m.quantize == "none":
        return 8 if w == 8 else 4
    if dev.kind == "cuda":
        return w
    if w == 8:
        return 8
    return 2 if (w == 2 and dev.cpu_bf16) else 4


def fp32_sums(m: ModelShape, dev: Device) -> bool:
    """A bf16 model on a CPU without native bf16 GEMMs: its 16-bit products (DenseLinear's base, the
    dense rollout copy, the rollout's head) sum in fp32 from upcast bf16 values (fasttrain.nn.dense_linear)."""
    return dev.kind == "cpu" and m.w == 2 and not dev.cpu_bf16


def _upcast(m: ModelShape, dev: Device, rows: int, dense: bool, head: bool = False) -> int:
    """The transient of one such fp32-sums product over `rows` token rows: the weight upcast to fp32,
    the rows' fp32 copy and the fp32 output (the dense copy's fused q/k/v and gate/up weights, else
    each 16-bit projection; NF4 layers run their own kernel); `head`: the rollout's head in slices
    of UPCAST_ROWS weight rows into fp32 logits. 0 where the products run natively."""
    if not fp32_sums(m, dev):
        return 0
    from fasttrain.nn.dense_linear import UPCAST_ROWS
    H, I = m.hidden, m.intermediate
    qd, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    groups = [(qd + 2 * kd, H), (2 * I, H), (H, I), (H, qd)] if dense else \
        (m.projections if m.quantize == "none" else [])
    proj = max((o * i * 4 + rows * (i + o) * 4 for o, i in groups), default=0)
    chunk = min(m.vocab, UPCAST_ROWS)
    return max(proj, chunk * H * 4 + rows * (chunk + H) * 4 if head else 0)


def _live_output_bytes(m: ModelShape, dev: Device) -> int:
    """Bytes per element of a projection's output while a layer's other locals are live: the NF4
    kernel's compute dtype. A 16-bit base's fp32 adapter temporaries live only inside one projection
    call; measured on the tiny model's scoring steps (tests/plan) they never raised the no-grad peak,
    which attention's locals set, so for it the model's dtype."""
    return m.w if m.quantize == "none" else _compute_bytes(m, dev)


def _distinct_prompts_per_micro_batch(s: RunShape, rows: int) -> int:
    """Most distinct prompts in one micro-batch of `rows` rows (rows of a group are contiguous)."""
    if rows <= 1:
        return rows
    return min(rows, s.prompts, (rows - 2) // s.group + 2)


def update_tokens(s: RunShape) -> int:
    """Answer tokens of one update micro-batch (N of the log-prob head)."""
    return min(s.micro_batch, s.rows) * s.new_tokens


def _decoder_layer_peak(m: ModelShape, tokens: int, keys: int, rows: int, c: int, dense: bool = False) -> int:
    """No-grad peak of one layer of fasttrain.rollout's prefill loop, whose attention locals (norm
    output, q, k, v, repeated K/V, output) stay referenced until the next layer reassigns them, so
    they are still live while the MLP runs. `dense`: the projections read the dense rollout weights,
    one GEMM for q/k/v and one for gate/up; v (a part of the q/k/v output) keeps that whole output
    alive after q and k are rotated into new tensors, and the gate/up output lives through the MLP."""
    w, H, I = m.w, m.hidden, m.intermediate
    qd, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    rep = 2 * rows * keys * qd * w if m.heads != m.kv_heads else 0
    attn_locals = tokens * (H * w + 2 * qd * w + 2 * kd * w) + rep
    if dense:
        attn_locals += tokens * (qd + kd) * w
        mlp = tokens * (H * w + 4 * I * w)
    else:
        mlp = tokens * (H * w + 3 * I * w + (I * c if c != w else 0))
    return attn_locals + max(mlp, tokens * (qd + kd) * w)


def _prefix_tokens(U: int, P: int, B: int, A: int) -> int:
    """Token rows of one prefix_forward layer: the U prompts' P tokens and the B answers' A inputs."""
    return U * P + B * A


def _prefix_inputs(m: ModelShape, U: int, P: int, B: int, A: int) -> int:
    """What prefix_forward builds before its layers and keeps through them: the prompts' mask
    [U, P, P] (and the causal/identity [P, P] it is made from), the answers' mask [B, A, P+A], bool,
    each repeated for the query heads that share a KV head (grouped-query attention runs them as
    rows of that head); the rotary tables. The answers' causal part [B, A, A] is prefix_masks' local,
    gone before the layers run (counting it over-planned 4,096-token answers by 5%)."""
    g = m.heads // m.kv_heads           # the masks are repeated per query head of a KV head
    masks = g * U * P * P + 2 * P * P + (g * B * A * (P + A) if A else 0)
    return masks + 2 * _prefix_tokens(U, P, B, A) * m.head_dim * m.w


def _prefix_layer_live(m: ModelShape, U: int, P: int, B: int, A: int, c: int) -> int:
    """No-grad peak of one prefix_forward layer, at its MLP product: every local of the layer stays
    referenced until it returns. Live then: the layer input and its normalised copy, q/k/v, the
    rotated prompt and answer queries and keys, the answers' gathered keys and values (one copy per
    KV head: the query heads of a head attend as its rows), both attention outputs (reshaped), the
    new residual, the MLP's norm output, act(gate), up and their product (plus the NF4 kernel's
    output in its compute dtype when that is not the model's)."""
    w, H, I = m.w, m.hidden, m.intermediate
    qd, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    N = _prefix_tokens(U, P, B, A)
    lin = N * (4 * H + qd + 2 * kd) * w
    prompts = U * P * (2 * qd + kd) * w
    answers = B * A * (2 * qd + kd) * w + 2 * B * (P + A) * kd * w if A else 0
    mlp = N * (3 * I * w + (I * c if c != w else 0))
    # or in the answers' attention, before the MLP exists: the layer input, its norm, q/k/v, the rotated
    # prompt queries/keys and the prompts' output, the rotated answer queries/keys, their gathered keys
    # and values, the queries' copy as rows of their KV head, the float mask SDPA makes of the
    # (repeated) bool one, and the output; at long answers the mask, answers x (prompt + answer), sets it
    g = m.heads // m.kv_heads
    attention = N * (2 * H + qd + 2 * kd) * w + U * P * (2 * qd + kd) * w + \
        (B * A * (3 * qd + kd) * w + 2 * B * (P + A) * kd * w + g * B * A * (P + A) * w if A else 0)
    return max(lin + prompts + answers + mlp, attention)


def _prefix_layer_saved(m: ModelShape, U: int, P: int, B: int, A: int, c_xa: int) -> int:
    """Bytes one prefix_forward layer saves for its backward (recomputed under checkpointing): per
    token row the concatenated input (or its fp32 copy) and its normalised copy, each projection's
    x·Aᵀ, o_proj's input, the residual and the MLP's norm output, gate/act/up/product; per
    attention the queries (as rows of their KV head), the keys and values it read, its output and
    log-sum-exp, and the float mask SDPA makes of the (repeated) bool one."""
    w, H, I, r = m.w, m.hidden, m.intermediate, m.rank
    qd, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    g = m.heads // m.kv_heads
    N = _prefix_tokens(U, P, B, A)
    per_row = (4 * H + H * w) + 3 * r * c_xa + (qd * w + r * c_xa) + (4 * H + H * w) + (4 * I * w + 3 * r * c_xa)
    if m.quantize == "none":
        per_row += _dense_adapter_saved_per_row(m)
    prompts = U * P * ((2 * qd + 2 * kd) * w + m.heads * 4) + g * U * P * P * w
    answers = B * A * (2 * qd * w + m.heads * 4) + 2 * B * (P + A) * kd * w + g * B * A * (P + A) * w if A else 0
    # fasttrain's backward (fasttrain.ops.attention) saves q, k, v and the shared bool mask only: no
    # output, log-sum-exp or float mask
    (_, h, M, L), *rest = attention_calls(m, U, P, B, A)
    if fasttrain_attention_call(m, h, M, L):
        prompts -= U * P * (qd * w + m.heads * 4) + g * U * P * P * w
    if rest and fasttrain_attention_call(m, *rest[0][1:]):
        answers -= B * A * (qd * w + m.heads * 4) + g * B * A * (P + A) * w
    return N * per_row + prompts + answers


def attention_calls(m: ModelShape, U: int, P: int, B: int, A: int) -> list[tuple[int, int, int, int]]:
    """prefix_forward's two attention calls of a layer as (rows, heads, query rows, keys): the
    prompts' and the answers', the query heads of a KV head as query rows of it."""
    g = m.heads // m.kv_heads
    return [(U, m.kv_heads, g * P, P)] + ([(B, m.kv_heads, g * A, P + A)] if A else [])


def _attention_backward_extra(m: ModelShape, U: int, P: int, B: int, A: int, c_xa: int) -> tuple[int, int]:
    """(the layer's saved bytes, what its fasttrain attention backward holds beyond them) at the
    costlier of its two calls; (0, 0) where neither takes it. By then the MLP's and o_proj's backward
    have run: of the saved bytes the pre-attention part (the input's fp32 copy and norm output, the
    q/k/v adapters' x·Aᵀ) and the attentions' inputs are left. Held with them: the residual's gradient
    [N, H] and o_proj's input gradient [N, qd], the call's dq, dk, dv and its workspace
    (fasttrain.ops.attention.backward_workspace); in the prompts' call (the later) also the answers'
    q/k/v gradients as full-size slices [N, qd + 2·kd] and the prompts' key/value gradients gathered
    back from the answers [U·P, 2·kd]."""
    from fasttrain.ops.attention import backward_workspace
    calls = attention_calls(m, U, P, B, A)
    if not any(fasttrain_attention_call(m, *c[1:]) for c in calls):
        return 0, 0
    w, H, r, D = m.w, m.hidden, m.rank, m.head_dim
    qd, kd = m.heads * D, m.kv_heads * D
    N = _prefix_tokens(U, P, B, A)
    saved = _prefix_layer_saved(m, U, P, B, A, c_xa)
    pre = N * ((4 * H + H * w) + 3 * r * c_xa + kd * w)
    if m.quantize == "none":
        acc = 8 if w == 8 else 4
        pre += N * ((3 * acc * H if w != acc else 0) + (2 * acc * (qd + 2 * kd) if m.adapter_kind == "dora" else 0))
    prompts_in = U * P * (qd + kd) * w
    answers_in = B * A * qd * w + 2 * B * (P + A) * kd * w if A else 0
    held = N * (H + qd) * w
    best = 0
    for i, (n, h, M, L) in enumerate(calls):
        if not fasttrain_attention_call(m, h, M, L):
            continue
        outs = n * h * (M + 2 * L) * D * w
        work = backward_workspace(n, h, M, L, D, w)
        if i == 0:      # the prompts' call, after the answers'
            live = pre + prompts_in + held + (N * (qd + 2 * kd) * w + 2 * U * P * kd * w if A else 0)
        else:
            live = pre + prompts_in + answers_in + held
        best = max(best, live + outs + work)
    return saved, max(0, best - saved)


def _dense_adapter_saved_per_row(m: ModelShape) -> int:
    """What DenseLinear's fp32 adapter path saves per token row beyond the NF4 op's: the fp32 copy of
    each projection's input (none for an fp32 model: the copy is the input), and for DoRA the two
    fp32 [out] terms its magnitude's gradient reads (the base without bias and s·x·Aᵀ·Bᵀ)."""
    H, I, w = m.hidden, m.intermediate, m.w
    qd, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    acc = 8 if w == 8 else 4
    copies = acc * (3 * H + qd + 2 * H + I) if w != acc else 0
    dora = 2 * acc * (qd + 2 * kd + H + 2 * I + H) if m.adapter_kind == "dora" else 0
    return copies + dora


class _PlainLayers:
    """The layer terms of a plain (Llama-family) transformer, every layer alike: the formulas above.
    fasttrain.plan.hybrid_memory gives the same terms for a hybrid's two layer kinds."""

    prefix_inputs = staticmethod(_prefix_inputs)
    @staticmethod
    def prefix_layer_live(m: ModelShape, U: int, P: int, B: int, A: int, c: int, mlp_extra: int = 0, *,
                          grad: bool = False) -> int:
        """Every local of the layer stays referenced until it returns: a MoE layer's routed experts
        (`mlp_extra`, fasttrain.plan.moe_memory) add to its peak. (`grad`, the update's forward
        under checkpointing, runs the same code as the scores' forward here.)"""
        return _prefix_layer_live(m, U, P, B, A, c) + mlp_extra

    @staticmethod
    def prefix_saved(m: ModelShape, U: int, P: int, B: int, A: int, c_xa: int) -> int:
        return m.layers * _prefix_layer_saved(m, U, P, B, A, c_xa)

    @staticmethod
    def backward_temps(m: ModelShape, U: int, P: int, B: int, A: int, c_xa: int = 0) -> int:
        N = _prefix_tokens(U, P, B, A)
        return N * m.hidden * m.w + 2 * N * m.intermediate * m.w

    attention_backward_extra = staticmethod(_attention_backward_extra)

    @staticmethod
    def backward_peak(m: ModelShape, U: int, P: int, B: int, A: int, c_xa: int) -> int:
        """A checkpointed layer in its backward: its saved bytes and its backward's temporaries."""
        return _prefix_layer_saved(m, U, P, B, A, c_xa) + _PlainLayers.backward_temps(m, U, P, B, A)

    @staticmethod
    def prefill_layer_peak(m: ModelShape, n: int, P: int, c: int, dense: bool, mlp_extra: int = 0) -> int:
        return _decoder_layer_peak(m, n * P, P, n, c, dense) + mlp_extra

    @staticmethod
    def decode_locals(m: ModelShape, B: int) -> int:
        return 0

    @staticmethod
    def decode_mlp(m: ModelShape, B: int) -> int:
        return B * 3 * m.intermediate * m.w


@dataclass(frozen=True)
class FamilyMemory:
    """A family's memory terms: `layers`, the terms of its layer kinds (_PlainLayers, or
    fasttrain.plan.hybrid_memory for a hybrid's two kinds); `experts`, its routed experts' terms
    (fasttrain.plan.moe_memory: their resident parts, their activations around `layers`' as the
    device runs them, the routing record), None for a dense family."""

    layers: object
    experts: object | None = None


MEMORY_TERMS: dict[str, FamilyMemory] = {
    "llama": FamilyMemory(_PlainLayers),
    "qwen3_5": FamilyMemory(hybrid_memory),
    "qwen3_moe": FamilyMemory(_PlainLayers, experts=moe_memory),
    "qwen3_5_moe": FamilyMemory(hybrid_memory, experts=moe_memory),
}


def family_memory(m: ModelShape) -> FamilyMemory:
    """The memory terms of m's family (m.model_type names it)."""
    return MEMORY_TERMS[family_of_type(m.model_type, m.name).name]


def _layers_of(m: ModelShape, dev: Device):
    """The piece that knows m's layers: its family's layer terms; for a mixture of experts
    fasttrain.plan.moe_memory's around them (its experts as the device runs them,
    moe_memory.form_for: fasttrain's CPU kernel, its CUDA kernel, or the torch form)."""
    f = family_memory(m)
    return f.layers if f.experts is None else f.experts.MoELayers(f.layers, f.experts.form_for(dev.kind, m))


def _logprob_scratch(m: ModelShape, dev: Device, n_tok: int, grad: bool = False) -> int:
    H, V = m.hidden, m.vocab
    if n_tok == 0:
        return 0
    if dev.kind == "cuda":
        per = 4 + m.w
        nb = min(n_tok, 16384)
        ch = CUDA_LOGPROB_BUDGET // (nb * per)
        if ch < 256:
            ch = min(256, V)
            nb = max(1, min(n_tok, CUDA_LOGPROB_BUDGET // (ch * per)))
        ch = min(ch // 128 * 128 if ch >= 128 else ch, V)
        return nb * ch * per + 4 * n_tok * 4
    acc = 8 if m.w == 8 else 4
    ch = CPU_LOGPROB_BUDGET // (acc * (dev.threads * CPU_LOGPROB_BLOCK + H))
    ch = min(max(16, min(8192, ch // 16 * 16)), V)
    widen = ch * H * acc * dev.threads if m.w != acc else 0
    if _logprob_packed(m, dev, n_tok, grad) > -(-V // 64) * 64 * H * 2:
        # the p·W accumulator by brgemm: p~ as two bf16 rows per thread ([block, chunk] each), in
        # place of the widened W chunks
        ch = max(512, ch // 512 * 512)
        return dev.threads * CPU_LOGPROB_BLOCK * ch * (acc + 4)
    return dev.threads * CPU_LOGPROB_BLOCK * ch * acc + widen


def _logprob_packed(m: ModelShape, dev: Device, n_tok: int, grad: bool) -> int:
    """W's packed bf16 copies (csrc/cpu/fused_logprob.cpp), kept over the scoring and the update (the
    trainer's pack scope) where the CPU has bf16 GEMMs: for the logits, W in 64-row blocks (brgemm
    on AMX for calls of at least 256 tokens; the avx512_bf16 dot-product tiles for any call without
    AMX); with grad and H a multiple of 64, also W for the p·W accumulator (brgemm's 512-row blocks,
    the larger of the two layouts; fp16 counted alike: a bound)."""
    H, V = m.hidden, m.vocab
    if dev.kind == "cuda" or m.w != 2 or not dev.cpu_bf16 or n_tok == 0:
        return 0
    return -(-V // 64) * 64 * H * 2 + (-(-V // 512) * 512 * H * 2 if grad and H % 64 == 0 else 0)


def _logprob_head(m: ModelShape, dev: Device, n_tok: int, grad: bool) -> int:
    """fused_logprob's own buffers for n_tok tokens: the selected hidden rows [N, H] (dtype), the
    fp32 copy the CPU kernel makes of bf16 rows, the [N, H] fp32 gradient vector (with grad), the
    per-token outputs and the chunk scratch."""
    H, w = m.hidden, m.w
    acc = 8 if w == 8 else 4
    b = n_tok * H * w + n_tok * 4 * acc
    if dev.kind == "cpu" and w != acc:
        b += n_tok * H * acc
    if grad:
        b += n_tok * H * acc
    return b + _logprob_scratch(m, dev, n_tok, grad)


def _rollout(m: ModelShape, dev: Device, n_all: int, n: int, c: int, G: int, P: int, T: int, dense: bool,
             sort: bool = False, truncated: bool = False) -> dict:
    """One wave of a rollout of n_all prompts: n prompts' G answers decoded at once, prefilled c
    prompts at a time, the earlier waves' outputs kept (the trainer joins the waves at the end)."""
    w, L, H, V, D = m.w, m.layers, m.hidden, m.vocab, m.head_dim
    lay = _layers_of(m, dev)
    B, S = n * G, P + T
    L = m.kv_layers                   # a hybrid's KV lives in its full-attention layers only
    caches = {"kv_cache": L * 2 * B * m.kv_heads * S * D * w,       # + a hybrid's fixed per-row states
              "recurrent_state": B * m.recurrent_bytes, "conv_state": B * m.conv_bytes}
    held = n * S * 8 + 2 * n * P + (n_all - n) * G * (S * 24 + T * 13)   # positions; the earlier waves' rollouts
    book = held + B * S + B * T * (8 + 4 + 1)      # + this wave's key mask and token buffers (made after the prefill)
    rot = m.rotary_dim or D           # the rotary tables [., S, rot] (a hybrid turns part of head_dim)
    rope_b = 2 * B * S * rot * w
    # prefill of c prompts: their own cache (and a hybrid's states for them), masks [c, P, P] and
    # [P, P], the residual, one layer; the wave's rotary tables and the earlier chunks' hidden rows
    small = L * 2 * c * m.kv_heads * P * D * w + c * m.state_bytes
    masks = 2 * P * P + 2 * c * P * P
    prefill = small + masks + c * P * H * w + 2 * n * S * rot * w + n * H * w + \
        lay.prefill_layer_peak(m, c, P, _live_output_bytes(m, dev), dense) + c * V * (w + 4) + \
        _upcast(m, dev, c, dense, head=True)
    sampling, step = _decode_step(m, dev, B, S, dense, sort, truncated)
    decode = rope_b + sampling + step
    # the re-merge of the dense copy before sampling: one projection's merged weight in fp32 (fp64);
    # packed (fasttrain.nn.rollout_weights.packable), also its group's plain scratch and the new
    # packed copy while the old one still exists
    merge = max(o * i for o, i in m.projections) * (8 if w == 8 else 4) if dense else 0
    if dense and _packed_rollout(m, dev):
        merge += 2 * max(_group_sizes(m)) * w
    prefill = max(prefill, merge)
    # between the prefill and the first step: the rows' rotary tables are made while the prompts' still
    # exist, with the first logits repeated per row; after the last step: the returned ids, mask and
    # positions (and the cumsum the positions come from) while the cache, tables and buffers still exist,
    # with the last step's logits (in dtype) and the draw's float64 buffer
    handover = rope_b + 2 * n * S * rot * w + B * V * w + n * H * w + held
    finish = rope_b + book + B * S * 32 + B * V * (8 + w)
    at_step = rope_b + step + book + sampling
    # a mixture of experts' routing record at each of these points, and once decoded, its assembly
    rec_prefill, rec_decode, rec_end = moe_memory.record_rollout(m, n_all, n, G, P, T)
    points = [(at_step, rec_decode), (handover, rec_prefill), (finish, rec_end), (prefill + book, rec_prefill)]
    top, record = max(points, key=lambda p: p[0] + p[1])
    if (top, record) == points[0]:
        return {**caches, "activations": rope_b + step + book, "sampling": sampling, "moe_routing": record}
    return {**caches, "activations": top, "sampling": 0, "moe_routing": record}


def _rollout_weight_bytes(m: ModelShape, dev: Device, dense: bool) -> int:
    """The dense rollout weights; packed, with the packed copy of the output head they keep
    (RolloutWeights.head: V x H in the model's dtype)."""
    if not dense:
        return 0
    return m.linear_params * m.w + (m.vocab * m.hidden * m.w if _packed_rollout(m, dev) else 0)


def _packed_rollout(m: ModelShape, dev: Device) -> bool:
    """Whether the dense rollout weights are kept packed (fasttrain.nn.rollout_weights.packable):
    bf16 on a CPU with native bf16 GEMMs."""
    return dev.kind == "cpu" and dev.cpu_bf16 and m.dtype == torch.bfloat16


def _group_sizes(m: ModelShape) -> list[int]:
    """Elements of each weight the rollout stacks or keeps alone (q/k/v, gate/up, o, down)."""
    qd, kd, H, I = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.hidden, m.intermediate
    return [(qd + 2 * kd) * H, 2 * I * H, H * qd, H * I]


def _decode_step(m: ModelShape, dev: Device, B: int, S: int, dense: bool, sort: bool = False,
                 truncated: bool = False) -> tuple[int, int]:
    """(sampling buffers, a layer's locals) of one decode step of B rows over S cache columns."""
    w = m.w
    c = _compute_bytes(m, dev)
    lay = _layers_of(m, dev)
    V, H = m.vocab, m.hidden
    # the draw (fasttrain.rollout.sampling.draw_tokens): the rollout's float64 [B, V] buffer (the
    # tempered logits, then their exps' running sum, in place) beside the logits in dtype; at the
    # next step's head, the last logits and the new ones
    sampling = B * V * (8 + 2 * w)
    # top_p's sort (fasttrain.rollout.sampling.kept_cut): the sorted float64 row, its exps' running
    # sum and one more exp beside the draw's buffer; the sort's int64 indices before that; the mask
    # of dropped tokens (one byte each). Any truncation after the cut: that mask and a float64
    # temporary (the largest dropped logit), 9 bytes a logit, under the sort's 25
    sampling += B * V * (24 + 1) if sort else (B * V * 9 if truncated else 0)
    # a layer's locals: attention's fp32 scores [B, heads, S], or a hybrid's Gated DeltaNet step
    step = B * 4 * H * w + lay.decode_mlp(m, B) + max(B * m.heads * S * 4, lay.decode_locals(m, B))
    qd, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    if dense:    # the q/k/v and gate/up outputs stay whole; no NF4 decode
        step += B * (qd + kd + m.intermediate) * w
    elif m.quantize == "none":   # the largest projection's fp32 input copy and adapter outputs
        step += B * max(i + 3 * o for o, i in m.projections) * c
    elif dev.kind == "cpu":
        tile = max(min(o, max(8, CPU_DECODE_TILE // (i * c))) * i * c for o, i in m.projections)
        step += dev.threads * tile + 2 * B * max(o for o, _ in m.projections) * c
    # an fp32-sums product's transient: inside a projection while the layer's locals live, or in
    # the head after the layers, when only the step's hidden rows are left
    up = _upcast(m, dev, B, dense)
    return sampling, max(step + up, B * H * w + _upcast(m, dev, B, dense, head=True))


def _prefix_shape(s: RunShape) -> tuple[int, int, int, int]:
    """(U, P, B, A) of one micro-batch through prefix_forward: the most distinct prompts it can
    hold, their tokens, its rows, and the answer tokens that are inputs (the last one is not)."""
    mb = min(s.micro_batch, s.rows)
    return _distinct_prompts_per_micro_batch(s, mb), s.prompt_tokens, mb, s.new_tokens - 1


def _scores(m: ModelShape, dev: Device, s: RunShape) -> dict:
    w, H = m.w, m.hidden
    c = _compute_bytes(m, dev)
    T, S = s.new_tokens, s.seq
    U, P, mb, A = _prefix_shape(s)
    N = _prefix_tokens(U, P, mb, A)
    lay = _layers_of(m, dev)
    inputs = lay.prefix_inputs(m, U, P, mb, A)
    # the layers: the previous layer's output is the input of the one running
    layers = inputs + lay.prefix_layer_live(m, U, P, mb, A, _live_output_bytes(m, dev))
    # after them: the last layer's output, the hidden rows that predict the answers and their norm
    final = inputs + N * H * w + 2 * mb * T * H * w
    act = max(layers, final) + mb * S * 16                              # the micro-batch's ids and positions
    outputs = s.rows * T * 4 * (int(s.need_ref) + 2 * int(s.need_old))   # ref, old log-probs, entropy
    routing = moe_memory.record_micro_batch(m, mb, S, N)
    act += routing
    head = mb * T * H * w + _logprob_head(m, dev, mb * T, grad=False)    # after the forward's buffers are gone
    packed = _logprob_packed(m, dev, mb * T, grad=False)                 # kept across the phase's calls
    if head > act:
        return {"kv_cache": 0, "activations": outputs, "logprob_head": head + packed}
    return {"kv_cache": 0, "activations": act + outputs, "logprob_head": packed}


def _update(m: ModelShape, dev: Device, s: RunShape, checkpointing: bool) -> dict:
    """One micro-batch's forward + backward through prefix_forward."""
    w, L, H = m.w, m.layers, m.hidden
    c = _compute_bytes(m, dev)
    c_xa = 4 if dev.kind == "cuda" else c
    T, S = s.new_tokens, s.seq
    U, P, mb, A = _prefix_shape(s)
    N = _prefix_tokens(U, P, mb, A)
    n_tok = mb * T
    if dev.kind == "cpu":
        from fasttrain.ops.attention import takes_fasttrain_backward
        m = replace(m, fasttrain_attention=takes_fasttrain_backward(w, m.head_dim, 1, dev.cpu_bf16))
    lay = _layers_of(m, dev)
    shared = mb * S * (24 + 1) + lay.prefix_inputs(m, U, P, mb, A)      # ids, masks, positions; rotary, masks
    head_in = n_tok * H * (w + 4 + w)                                     # hidden rows, the norm's fp32 input and output
    # a layer's saved bytes and what its attention backward adds (fasttrain's backward: its workspace)
    attn_saved, attn_extra = lay.attention_backward_extra(m, U, P, mb, A, c_xa)
    if checkpointing:
        kept = L * N * H * w
        fwd = max(kept + lay.prefix_layer_live(m, U, P, mb, A, _live_output_bytes(m, dev), grad=True), kept + head_in)
        bwd = kept + max(lay.backward_peak(m, U, P, mb, A, c_xa), attn_saved + attn_extra)
    else:
        kept = lay.prefix_saved(m, U, P, mb, A, c_xa) + L * N * H * w
        fwd = kept + head_in
        bwd = kept + max(lay.backward_temps(m, U, P, mb, A, c_xa), attn_extra)
    head = _logprob_head(m, dev, n_tok, grad=True)
    packed = _logprob_packed(m, dev, n_tok, grad=True)                  # kept across the phase's calls
    if fwd + head >= bwd:
        act, head_part = fwd, head + packed
    else:
        act, head_part = bwd, packed
    return {"activations": act + shared + s.rows * T * 4 * 3 + moe_memory.record_micro_batch(m, mb, S, N),
            "logprob_head": head_part}


def resident_base(m: ModelShape, s: RunShape, dev: Device) -> dict:
    """{part: bytes} live in every phase of a step: the model, the adapters and their AdamW
    moments, the dense rollout weights when the run keeps them, the kernels' workspace."""
    res = dict(m.resident)
    c = _compute_bytes(m, dev)
    # CPU: the NF4 kernels' reusable dequantisation scratch (thread-local, kept). CUDA: the dequantised
    # weight of one projection, a temporary of every prefill/training call (M > 64), counted in every phase
    # (an expert's under the torch form; the CUDA kernel decodes its experts inside its projections).
    routed = family_memory(m).experts
    experts = routed.expert_shapes(m) if routed and routed.form_for(dev.kind, m) != "cuda" else []
    largest = max(o * i for o, i in m.projections + experts)
    workspace = largest * m.w if dev.kind == "cuda" else 0
    if dev.kind == "cpu":
        workspace = largest * c
        if m.adapter_kind == "dora":
            workspace += max(o * i for o, i in m.projections) * 8   # the fp64 ‖W‖² pass at attach time
    if m.quantize == "none":
        # no dequantisation. DoRA's norm forms W + s·B·A in blocks of at most 2 x 16 MiB, once after
        # each optimizer step, at the first forward (no activations live yet), then cached: not a peak
        workspace = 0
    moe = moe_memory.resident_parts(m)
    resident = res["nf4_base"] + res["dense_parts"] + res["adapter_masters"] + res.get("dora_norms", 0) + \
        moe["moe_experts"] + moe["moe_router"] + moe["moe_adapter_masters"]
    dense = use_dense(s.rollout_weights, m.linear_params * m.w, dev.free - resident)
    return {"nf4_base": res["nf4_base"], "dense_parts": res["dense_parts"],
            "adapter_masters": res["adapter_masters"], "dora_norms": res.get("dora_norms", 0),
            "rollout_weights": _rollout_weight_bytes(m, dev, dense), "adam_moments": 2 * res["adapter_masters"],
            "adapter_grads": 0, "workspace": workspace, "batch": 0, "kv_cache": 0, "recurrent_state": 0,
            "conv_state": 0, "activations": 0, "logprob_head": 0, "sampling": 0, **moe,
            "moe_routing": 0, "moe_activations": 0}


def rollout_phase(m: ModelShape, s: RunShape, dev: Device = Device()) -> dict:
    """{part: bytes} at the rollout's peak: one wave of s.wave_prompts prompts, prefilled
    s.prefill_prompts at a time."""
    base = resident_base(m, s, dev)
    return {**base, **_rollout(m, dev, s.prompts, s.wave_prompts, s.prefill_prompts, s.group, s.prompt_tokens,
                               s.new_tokens, base["rollout_weights"] > 0, s.sort_draw, s.truncated_draw)}


def probe_phase(m: ModelShape, s: RunShape, dev: Device = Device()) -> dict:
    """{part: bytes} at the probe's peak (the rollout's formula with the probe's shape and waves)."""
    base = resident_base(m, s, dev)
    return {**base, **_rollout(m, dev, s.probe_prompts, s.probe_wave_prompts, s.probe_prefill_prompts,
                               s.probe_samples, s.prompt_tokens, s.probe_new_tokens, base["rollout_weights"] > 0,
                               s.probe_sort_draw, s.probe_truncated_draw)}


def _batch_bytes(s: RunShape) -> int:
    B, S, T = s.rows, s.seq, s.new_tokens
    return B * S * 24 + B * T * (8 + 1 + 4) + B * (8 * 2 + 1 + 4)


def scores_phase(m: ModelShape, s: RunShape, dev: Device = Device()) -> dict | None:
    """{part: bytes} at the no-grad scores' peak, or None when the recipe needs none."""
    if not (s.need_ref or s.need_old):
        return None
    return {**resident_base(m, s, dev), "batch": _batch_bytes(s), **_scores(m, dev, s),
            "moe_routing": moe_memory.record_batch(m, s.rows, s.seq)}


def update_phase(m: ModelShape, s: RunShape, dev: Device = Device()) -> dict:
    """{part: bytes} at the update's peak: one micro-batch's forward + backward."""
    res = m.resident
    B = s.rows
    # Gradients: all of them once a micro-batch has run backward, so a second full micro-batch peaks
    # with every gradient present; a step of one micro-batch (per pass: zero_grad frees them) peaks in
    # its last layer's backward, when only that layer's gradients exist.
    mb = min(s.micro_batch, B)
    masters = res["adapter_masters"] + res.get("moe_adapter_masters", 0)
    grads = masters if B >= 2 * mb else masters // m.layers
    # With k > 1 passes the trainer keeps a host copy of the adapters and AdamW moments during the
    # update, so an out-of-memory retry can undo the passes that stepped; on a CPU host memory is
    # the device's memory (on a GPU it is not counted)
    undo = 3 * masters if dev.kind == "cpu" and s.passes > 1 else 0
    return {**resident_base(m, s, dev), "batch": _batch_bytes(s), "adapter_grads": grads, "undo_copy": undo,
            **_update(m, dev, s, s.gradient_checkpointing), "moe_routing": moe_memory.record_batch(m, s.rows, s.seq)}


def _with_moe_line(phase, m: ModelShape, s: RunShape, dev: Device) -> dict | None:
    """phase(m, s, dev), for a mixture of experts with what the routed experts add to the peak's
    activations on its own line (the same phase without them, less, as the difference)."""
    parts = phase(m, s, dev)
    routed = family_memory(m).experts
    if parts is None or routed is None:
        return parts
    plain = phase(routed.without_routed(m), s, dev)
    shown = ("activations", "logprob_head", "sampling")
    extra = max(0, sum(parts[k] for k in shown) - sum(plain[k] for k in shown))
    return {**parts, **{k: plain[k] for k in shown}, "moe_activations": extra}


def plan_memory(m: ModelShape, s: RunShape, dev: Device = Device()) -> MemoryPlan:
    """Bytes by part for each phase of a step (steady state: AdamW moments exist)."""
    plan = MemoryPlan()
    plan.phases["load"] = load_phase(m)                 # before the first step (fasttrain.plan.load)
    for name, phase in (("rollout", rollout_phase), ("probe", probe_phase), ("scores", scores_phase),
                        ("update", update_phase)):
        parts = _with_moe_line(phase, m, s, dev)
        if parts is not None:
            plan.phases[name] = parts
    other = _update(m, dev, s, not s.gradient_checkpointing)
    n_tok = update_tokens(s)
    plan.notes = {
        "update_activations_other": other["activations"] + other["logprob_head"],
        "checkpointing": s.gradient_checkpointing,
        "head_tokens": n_tok,
        "fused_head_bytes": n_tok * m.hidden * 4,      # the [N, H] fp32 gradient vector
        "unfused_logits_bytes": n_tok * m.vocab * 4,   # [N, V] fp32 logits of an unfused head
    }
    return plan


def gib(b: float) -> float:
    return b / 2**30


def fits(peak: int, memory: int, context: int, margin: float = 0.05) -> tuple[bool, int]:
    """(fits, headroom bytes): peak allocated + `margin` for allocator fragmentation + the CUDA
    context against the device memory."""
    need = int(math.ceil(peak * (1 + margin))) + context
    return need <= memory, memory - need
