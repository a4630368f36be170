"""The mixture-of-experts terms of the plan (Qwen3-MoE, Qwen3.5-MoE): the experts' bytes, their
LoRA, the routing record and what the routed experts add to each phase's activations.

Resident (read off the meta model that fasttrain.models.moe builds, as a run builds it):
  moe_experts          each layer's stacks gate_up [E, 2I, H] and down [E, H, I]: NF4 per expert
                       slice (packed 4-bit codes + one fp32 absmax per 64 weights, the layout the
                       streamed load stores), or with policy.quantize "none" the model's 16-bit stacks
  moe_router           the router [E, H] and Qwen3.5-MoE's shared-expert gate [1, H], kept 16-bit
                       (models/moe.py); the shared expert itself is a dense MLP whose projections are
                       NF4 + LoRA like any other and count in the frozen base
  moe_adapter_masters  the experts' LoRA, A [E, r, in] and B [E, out, r] per stack, fp32; their AdamW
                       moments (moe_adam_moments) twice that from step 2 on
The routing record (moe_routing): the rollout keeps every forwarded token's top-k experts of each
MoE layer, as int64 while it decodes ([n, P, L, k] for the prompts, [B, L, k] per step, assembled
into [B, P+T, L, k]) and then in the smallest integer dtype (uint8 for E <= 256) with the step's
batch; each scored or updated micro-batch widens its rows' record to int64 and keeps per layer the
forced experts and its own top-k [N, k] (fasttrain.rollout.moe_routing).

Activations: a MoE layer is its base family's layer (the Llama layer, or the hybrid's two kinds:
fasttrain.plan.hybrid_memory) whose dense MLP is the shared expert (width 0 when there is none),
plus the routed experts of fasttrain.ops.moe_experts over the N·k (token, expert) rows: the router's
logits and softmax [N, E] (float32), the gathered inputs [N·k, H], each expert's gate_up output
[·, 2I], act(gate) and its product with up [·, I], the outputs [N·k, H] (the list and their
concatenation), their float32 weighted copy and the [N, H] float32 sum; with autograd the gathered
inputs, gate_up's output, act and product, each projection's x·Aᵀ [·, r], the float32 weighted
copy and the sorting indices are saved. A Qwen3-MoE with dense layers (mlp_only_layers, or off
decoder_sparse_step) takes the costlier of its two layer kinds. That is the torch form, which runs
where no kernel does (form_for): on CUDA under FASTTRAIN_MOE_CUDA=torch and for float64. On the
CPU the experts run fasttrain's kernel, which keeps less (kernel_live, kernel_saved, kernel_grads:
no per-expert gathered inputs or LoRA products are saved, only gate_up's output). On CUDA they run
fasttrain's CUDA kernel (the default), which saves gate_up's output and the unweighted outputs
(float32: cuda_kernel_saved) and whose scratch (cuda_forward_bytes, cuda_backward_bytes: read off the launch
code, csrc/cuda/kernels/moe_experts.cuh) lives until the op returns: cuda_kernel_live and
cuda_kernel_grads; it decodes its NF4 blocks inside the grouped projections, so no dequantised
expert adds to the CUDA workspace. `plan_memory` prints what the routed experts add to a phase's
peak as its own line (moe_activations).

What is not counted: the per-expert loop's short-lived pieces (one expert's NF4 kernel output in its
compute dtype), the host copy of the tokens per expert.
"""
from __future__ import annotations

from dataclasses import replace

__all__ = ["PARTS", "moe_shape", "describe", "MoELayers", "form_for", "expert_rank", "cuda_forward_bytes",
           "cuda_backward_bytes", "resident_parts", "expert_shapes", "record_rollout",
           "record_batch", "record_micro_batch", "without_routed", "load_parts"]

PARTS = {
    "moe_experts": "MoE experts (NF4: 4-bit + absmax; none: 16-bit)",
    "moe_router": "MoE router + shared-expert gate (16-bit)",
    "moe_adapter_masters": "MoE experts' LoRA: fp32 masters",
    "moe_adam_moments": "MoE experts' LoRA: AdamW moments",
    "moe_routing": "MoE routing record (layers x k per token)",
    "moe_activations": "MoE activations (k expert rows/token, router)",
}


def _bytes(t) -> int:
    return t.numel() * t.element_size()


def moe_shape(model, cfg) -> dict:
    """The MoE facts of a built (meta) model: {"moe": the fields of ModelShape.moe (a MoEShape), "active": expert weights per
    token, "resident": {part: bytes}, "tensors": ids of the tensors counted here, "intermediate":
    the dense MLP width}, or {} for a dense model."""
    from fasttrain.nn.moe_experts import moe_blocks
    blocks = [b for _, b in moe_blocks(model)]
    if not blocks:
        return {}
    ex = blocks[0].experts
    E, k, H, I = ex.num_experts, blocks[0].top_k, ex.hidden, ex.intermediate
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0) if blocks[0].shared_expert is not None else 0
    seen: set[int] = set()
    parts = {"moe_experts": 0, "moe_router": 0, "moe_adapter_masters": 0}

    def count(part, t):
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            parts[part] += _bytes(t)
    for b in blocks:
        for t in b.experts.buffers(recurse=False):
            count("moe_experts", t)
        for t in b.experts.adapter_parameters():
            count("moe_adapter_masters", t)
        count("moe_router", b.gate.weight)
        if b.shared_expert_gate is not None:
            for t in b.shared_expert_gate.parameters():
                count("moe_router", t)
    return {"moe": {"experts": E, "active": k, "width": I, "layers": len(blocks), "shared": shared},
            "active": len(blocks) * k * 3 * I * H, "resident": parts,
            "tensors": seen, "intermediate": getattr(cfg, "intermediate_size", None) or shared}


def describe(m) -> str:
    """The model line's MoE part ("" for a dense model)."""
    if not m.moe:
        return ""
    E, k, I, n, shared = m.moe.experts, m.moe.active, m.moe.width, m.moe.layers, m.moe.shared
    return (f"; {n} MoE layers of {E} experts ({k} active) of width {I}" + (f" + a shared expert of {shared}"
            if shared else "") + f", {m.moe_active_params / 1e9:.2f} B expert weights active per token")


def resident_parts(m) -> dict:
    """{part: bytes} of the MoE parts resident in every phase (zeros for a dense model)."""
    r = m.resident
    masters = r.get("moe_adapter_masters", 0)
    return {"moe_experts": r.get("moe_experts", 0), "moe_router": r.get("moe_router", 0),
            "moe_adapter_masters": masters, "moe_adam_moments": 2 * masters}


def load_parts(m) -> tuple[dict, int]:
    """({part: bytes} resident while loading, the largest MoE transient): the streamed load quantizes
    each expert's slices as read ([gate; up] of one expert in 16 bits, its codes), and at the end
    stacks each layer's quantized experts into that layer's stacks (one layer's NF4 bytes twice)."""
    if not m.moe:
        return {}, 0
    E, I, n = m.moe.experts, m.moe.width, m.moe.layers
    H, w = m.hidden, m.w
    parts = {"moe_experts": m.resident.get("moe_experts", 0), "moe_router": m.resident.get("moe_router", 0)}
    one = 2 * I * H
    transient = max(parts["moe_experts"] // n if m.quantize == "nf4" else 0, 2 * one * w + one // 2 + one // 16)
    return parts, transient


def expert_shapes(m) -> list[tuple[int, int]]:
    """(out, in) of one expert's two projections (what the NF4 kernels' scratch must hold)."""
    if not m.moe:
        return []
    I = m.moe.width
    return [(2 * I, m.hidden), (m.hidden, I)]


def without_routed(m):
    """m with the routed experts' activations removed (k = 0, width 0); the layers keep their kinds."""
    return replace(m, moe=replace(m.moe, active=0, width=0))


def _f(m) -> int:
    return 8 if m.w == 8 else 4


def _g(m) -> int:
    """Bytes of the CPU kernel's GEMM operands (h, act, the outputs, the gathered inputs): 2 for a
    16-bit model where this host's CPU has native bf16 GEMMs (the kernel then runs them in bf16, as
    nf4_linear does, and as its plan counts a 16-bit width as bf16), else the compute dtype's."""
    if m.w != 2:
        return _f(m)
    try:
        from fasttrain.host import cpu_bf16_compute
        return 2 if cpu_bf16_compute() else 4
    except (ImportError, OSError, RuntimeError):
        return 4


def _router_live(m, N: int) -> int:
    """route(): the [N, E] logits (model dtype), their float32 copy and softmax, top-k weights and
    indices (and the renormalised weights); what the forward keeps after it: indices and weights."""
    E, k = m.moe.experts, m.moe.active
    w, f = m.w, _f(m)
    return N * E * (w + (f if w != f else 0) + f) + N * k * (8 + 2 * f)


def routed_live(m, N: int) -> int:
    """No-grad peak of the routed experts over N tokens: at the float32 sum (see the module header)."""
    E, k, I = m.moe.experts, m.moe.active, m.moe.width
    if not k:
        return 0
    w, f, H = m.w, _f(m), m.hidden
    rows = N * k
    kept = N * k * (8 + f)                               # the route's indices and weights
    experts = rows * (16 + H * w + 2 * H * w + H * (f if w != f else 0) + H * f + f) + 2 * N * H * f
    return max(_router_live(m, N), kept + experts)


def routed_saved(m, N: int, c_xa: int) -> int:
    """What the routed experts save for the backward over N tokens (see the module header)."""
    E, k, I = m.moe.experts, m.moe.active, m.moe.width
    if not k:
        return 0
    w, f, H, r = m.w, _f(m), m.hidden, m.rank
    rows = N * k
    per_row = H * w + 4 * I * w + 2 * r * c_xa + H * f + f + 24
    if m.quantize == "none" and w != f:                  # the fp32 copies of each projection's input
        per_row += (H + I) * f
    return N * E * f + N * k * (8 + 2 * f) + rows * per_row


def routed_grads(m, N: int) -> int:
    """The routed experts' gradients live at once in their backward: of the weighted outputs (f) and
    the outputs, of gate_up's output and act, of the gathered inputs, the inputs' [N, H] sum."""
    E, k, I = m.moe.experts, m.moe.active, m.moe.width
    if not k:
        return 0
    w, f, H = m.w, _f(m), m.hidden
    return N * k * (H * (f + 2 * w) + 3 * I * w) + N * H * w + N * E * f


def kernel_live(m, N: int) -> int:
    """No-grad peak of fasttrain's CPU kernel (csrc/cpu/moe_experts.cpp) over N tokens, at its last
    step (the weighted sum): the pairs' order [P] and the offsets [E + 1] (int64), act [P, I], the
    down projection's act·Aᵀ [P, r], the outputs [P, H], the routing weights' copy [P] and the sum
    [N, H] in the compute dtype (float32, float64 for float64) and the sum's copy in the model dtype.
    The gathered inputs [P, H] and x·Aᵀ [P, r] of the gate_up step are dropped before the outputs
    are made (that step holds less: P·(H + r + I) against P·(H + r + I + 1) + N·H·(f + w)); the
    decoded weight tiles (256 KiB a thread) are not counted."""
    E, k, I = m.moe.experts, m.moe.active, m.moe.width
    if not k:
        return 0
    w, f, g, H, r = m.w, _f(m), _g(m), m.hidden, m.rank
    P = N * k
    kept = N * k * (8 + f)                               # the route's indices and weights
    body = P * 8 + (E + 1) * 8 + P * H * g + P * I * g + P * r * g + P * f + N * H * (f + w)
    return max(_router_live(m, N), kept + body)


def kernel_saved(m, N: int) -> int:
    """What the CPU kernel saves for its backward: the router's softmax and the route, the pairs'
    order and offsets, and gate_up's output [P, 2I] (in the GEMM dtype, _g)."""
    E, k, I = m.moe.experts, m.moe.active, m.moe.width
    if not k:
        return 0
    f = _f(m)
    P = N * k
    return N * E * f + N * k * (8 + 2 * f) + P * 8 + (E + 1) * 8 + P * 2 * I * _g(m)


def cuda_kernel_saved(m, N: int) -> int:
    """What the CUDA kernel saves: the router's softmax and the route, the pairs' order and offsets,
    gate_up's output [P, 2I] and the unweighted outputs [P, H] (float32), which its backward reads
    for the routing weights' gradient."""
    E, k, I = m.moe.experts, m.moe.active, m.moe.width
    if not k:
        return 0
    f = _f(m)
    P = N * k
    return N * E * f + N * k * (8 + 2 * f) + P * 8 + (E + 1) * 8 + P * (2 * I + m.hidden) * f


def kernel_grads(m, N: int) -> int:
    """The CPU kernel's backward, in the compute dtype f (GEMM operands in _g): dy's and x's copies
    [N, H] (where the model dtype differs), the gathered routing weights, their gradient and the
    pairs' tokens [P]; the input gradient's sums, C [N, H] (C = min(threads, E) chunks of experts)
    where C < k, else a per-pair [P, H] and at the end the [N, H] sum; and while the C tasks run,
    each one expert's rows: of dy (f and g), x (for the LoRA gradients), the input gradient [c, H],
    act, dy·W_d and gate_up's gradient (f and g) [c, 4I], four [c, r] LoRA products. The rows in
    flight are the C tasks' experts at twice an expert's mean share each (min(P, C·⌈2P/E⌉)): routing
    replay keeps the rollout's load and a balanced router spreads it; a collapsed router that sends
    more than twice its share to one expert exceeds this. Then the [N, H] sum's cast and the
    router's [N, E]."""
    E, k, I = m.moe.experts, m.moe.active, m.moe.width
    if not k:
        return 0
    w, f, g, H, r = m.w, _f(m), _g(m), m.hidden, expert_rank(m)
    P = N * k
    import torch
    C = max(1, min(torch.get_num_threads(), E))         # this host's threads: the CPU form plans this host
    copies = (N * H * f if w != f else 0) + (N * H * g if w != g else 0)
    kept = copies + P * (2 * f + 8)
    by_chunk = C < k
    sums = C * N * H * f if by_chunk else P * H * f
    rows = min(P, C * -(-2 * P // E))
    per_row = (3 * H + 4 * I + 4 * r) * f + ((H + 2 * I) * g if g != f else 0)
    loop = kept + sums + rows * per_row
    end = kept + sums + (0 if by_chunk else N * H * f) + N * H * w
    return max(loop, end) + N * E * f


def expert_rank(m) -> int:
    """The experts' LoRA rank: the run's rank where the experts take LoRA, else 0."""
    return m.rank if m.resident.get("moe_adapter_masters", 0) else 0


def cuda_forward_bytes(N: int, H: int, I: int, E: int, k: int, r_gu: int, r_dn: int, w: int, save: bool,
                       weights_bytes: int = 4) -> int:
    """What one forward of fasttrain's CUDA kernel allocates (run_forward and forward in
    csrc/cuda/kernels/moe_experts.cuh), all of it live until the op returns (the launch's Device holds
    its scratch): the outputs y [N, H] (x's dtype, w bytes), order [P] and offsets [E + 1] (int64),
    with `save` h [P, 2I] and out [P, H] (float32); the scratch: the grouping's pos_of [P] (int64),
    tile map [E + 1], ranks [P] and per-chunk counts [(ceil(P / 256) + 1)·(E + 1)] (int32), x's
    float32 copy [N, H] (x not float32), the routing weights' float32 copy [P] (not float32),
    x·A_gᵀ [P, r_gu], act [P, I], act·A_dᵀ [P, r_dn], and without `save` out [P, H] (float32)."""
    P = N * k
    outputs = N * H * w + 8 * P + 8 * (E + 1) + (P * (2 * I + H) * 4 if save else 0)
    grouping = 8 * max(P, 1) + 4 * (E + 1)
    if P == 0:
        return outputs + grouping
    grouping += 4 * P + 4 * (-(-P // 256) + 1) * (E + 1)
    copies = (N * H * 4 if w != 4 else 0) + (P * 4 if weights_bytes != 4 else 0)
    return outputs + grouping + copies + 4 * P * (r_gu + I + r_dn) + (0 if save else 4 * P * H)


def cuda_backward_bytes(N: int, H: int, I: int, E: int, k: int, r_gu: int, r_dn: int, w: int,
                        lora_grads: bool = False) -> int:
    """What one backward of fasttrain's CUDA kernel allocates (run_backward and backward), every
    gradient asked for, all of it live until the op returns: the outputs dx [N, H] (w bytes) and the
    routing weights' dw [N, k] (float32); the scratch: pos_of [P] (int64), the tile map [E + 1]
    (int32), dy's float32 copy [N, H] (dy not float32), s·dO·B_d [P, r_dn], dh [P, 2I], for the
    down LoRA's gradients act [P, I] and act·A_dᵀ [P, r_dn], s·dh·B_g [P, r_gu], for the gate_up
    LoRA's gradients x's float32 copy [N, H] (x not float32) and x·A_gᵀ [P, r_gu], and dx per pair
    [P, H] (float32). The LoRA factors' gradients (float32, the factors' shapes) are outputs the plan
    counts as the adapters' gradients (memory.update_phase); `lora_grads` adds them."""
    P = N * k
    grads = E * (r_gu * (H + 2 * I) + r_dn * (I + H)) * 4 if lora_grads else 0
    out = N * H * w + 4 * P + grads
    if P == 0:
        return out
    f32 = 4 if w != 4 else 0
    scratch = 8 * P + 4 * (E + 1) + N * H * f32 + 4 * P * (r_dn + 2 * I) + 4 * P * H
    if r_dn:
        scratch += 4 * P * (I + r_dn)
    if r_gu:
        scratch += 4 * P * r_gu + N * H * f32 + 4 * P * r_gu
    return out + scratch


def cuda_kernel_live(m, N: int) -> int:
    """No-grad peak of the CUDA kernel over N tokens: the route's indices and weights with the op's
    forward (cuda_forward_bytes), or the router's own peak before it."""
    E, k, I = m.moe.experts, m.moe.active, m.moe.width
    if not k:
        return 0
    r, f = expert_rank(m), _f(m)
    return max(_router_live(m, N), N * k * (8 + f) + cuda_forward_bytes(N, m.hidden, I, E, k, r, r, m.w, False))


def cuda_kernel_grads(m, N: int) -> int:
    """The CUDA kernel's backward (cuda_backward_bytes) and the router softmax's gradient [N, E]."""
    E, k, I = m.moe.experts, m.moe.active, m.moe.width
    if not k:
        return 0
    r = expert_rank(m)
    return cuda_backward_bytes(N, m.hidden, I, E, k, r, r, m.w) + N * E * _f(m)


def form_for(device_kind: str, m) -> str:
    """What runs the routed experts on a device of `device_kind` (fasttrain.ops.moe_experts): "cpu"
    (fasttrain's CPU kernel), "cuda" (fasttrain's CUDA kernel, the default on CUDA), or "torch" (the
    torch form: on CUDA for a float64 model, or under FASTTRAIN_MOE_CUDA=torch, read now)."""
    import os

    from fasttrain.ops.moe_experts import CUDA_FORM_VAR
    if device_kind == "cpu":
        return "cpu"
    if m.w == 8 or os.environ.get(CUDA_FORM_VAR, "kernel").strip().lower() == "torch":
        return "torch"
    return "cuda"


_FORMS = {"cpu": (kernel_live, lambda m, N, c_xa: kernel_saved(m, N), kernel_grads),
          "cuda": (cuda_kernel_live, lambda m, N, c_xa: cuda_kernel_saved(m, N), cuda_kernel_grads),
          "torch": (routed_live, routed_saved, routed_grads)}


class MoELayers:
    """The layer terms of a MoE model: its base family's (`base`: memory._PlainLayers or
    hybrid_memory) for its dense layers (m) and its MoE layers (the shared expert's width, plus the
    routed experts); the costlier kind where the update or a prefill holds one layer, each kind
    times its count where every layer keeps its saved bytes."""

    def __init__(self, base, form: str = "torch"):
        self.base = base
        # the routed experts' terms by what runs them (form_for): CPU kernel, CUDA kernel, torch form
        self.live, self.saved, self.grads = _FORMS[form]

    @staticmethod
    def _moe_m(m):
        return replace(m, intermediate=m.moe.shared)

    @staticmethod
    def _dense_layers(m) -> int:
        return m.layers - m.moe.layers

    def prefix_inputs(self, m, U, P, B, A):
        return self.base.prefix_inputs(m, U, P, B, A)

    def _kinds(self, m, dense: int, moe: int) -> int:
        return max(dense if self._dense_layers(m) else 0, moe)

    def _at_mlp(self, m, N: int, c: int) -> int:
        """What the routed experts add to the MLP's live bytes: they run before the shared expert (the
        dense MLP of a MoE layer), which runs with their output [N, H] held."""
        I, w = m.moe.shared, m.w
        if not I:
            return self.live(m, N)
        shared = N * (3 * I * w + (I * c if c != w else 0))
        return max(self.live(m, N) - shared, N * m.hidden * w)

    def prefix_layer_live(self, m, U, P, B, A, c, *, grad: bool = False):
        N = U * P + B * A
        return self._kinds(m, self.base.prefix_layer_live(m, U, P, B, A, c, grad=grad),
                           self.base.prefix_layer_live(self._moe_m(m), U, P, B, A, c, self._at_mlp(m, N, c),
                                                       grad=grad))

    def prefix_saved(self, m, U, P, B, A, c_xa):
        L, n = m.layers, m.moe.layers
        N = U * P + B * A
        dense = self.base.prefix_saved(m, U, P, B, A, c_xa) * (L - n) // L if L > n else 0
        return dense + self.base.prefix_saved(self._moe_m(m), U, P, B, A, c_xa) * n // L + n * self.saved(m, N, c_xa)

    def backward_temps(self, m, U, P, B, A, c_xa):
        N = U * P + B * A
        return self._kinds(m, self.base.backward_temps(m, U, P, B, A, c_xa),
                           max(self.base.backward_temps(self._moe_m(m), U, P, B, A, c_xa), self.grads(m, N)))

    def attention_backward_extra(self, m, U, P, B, A, c_xa):
        """The base family's (saved, extra) at fasttrain's attention backward, for the kind whose
        saved + extra is larger; a MoE layer's routed experts' saved bytes are gone by then (its MLP's
        backward ran), so they add to the saved bytes and come off the extra."""
        N = U * P + B * A
        dense = self.base.attention_backward_extra(m, U, P, B, A, c_xa) if self._dense_layers(m) else (0, 0)
        saved, extra = self.base.attention_backward_extra(self._moe_m(m), U, P, B, A, c_xa)
        if saved or extra:
            experts = self.saved(m, N, c_xa)
            saved, extra = saved + experts, max(0, extra - experts)
        return max(dense, (saved, extra), key=sum)

    def backward_peak(self, m, U, P, B, A, c_xa):
        """The base layer's backward peak with the routed experts' saved bytes, and their gradients
        where they exceed the dense MLP's ([N, H] and 2 x [N, I], live at the same point)."""
        N = U * P + B * A
        mlp_grads = N * m.hidden * m.w + 2 * N * m.moe.shared * m.w
        return self._kinds(m, self.base.backward_peak(m, U, P, B, A, c_xa),
                           self.base.backward_peak(self._moe_m(m), U, P, B, A, c_xa) + self.saved(m, N, c_xa)
                           + max(0, self.grads(m, N) - mlp_grads))

    def prefill_layer_peak(self, m, n, P, c, dense):
        N = n * P
        return self._kinds(m, self.base.prefill_layer_peak(m, n, P, c, dense),
                           self.base.prefill_layer_peak(self._moe_m(m), n, P, c, dense, self._at_mlp(m, N, c)))

    def decode_locals(self, m, B):
        return self.base.decode_locals(m, B)

    def decode_mlp(self, m, B):
        return self._kinds(m, self.base.decode_mlp(m, B), self.base.decode_mlp(self._moe_m(m), B) +
                           self._at_mlp(m, B, m.w))


# ---- the routing record ----------------------------------------------------------------------------
def _per_token(m) -> int:
    """Expert indices per token: MoE layers x k."""
    return m.moe.layers * m.moe.active if m.moe else 0


def _record_w(m) -> int:
    return 1 if m.moe.experts <= 256 else 2          # fasttrain.rollout.moe_decoder.record_dtype


def record_rollout(m, n_all: int, n: int, G: int, P: int, T: int) -> tuple[int, int, int]:
    """One wave's record (with the earlier waves', in the stored dtype) at the prefill's peak (its
    prompts' experts, int64), at the last decode step (and every step's before it, int64) and while it
    is assembled after the decode ([B, P, L, k] repeated per answer, joined, cast)."""
    if not m.moe:
        return 0, 0, 0
    per, B = _per_token(m), n * G
    earlier = (n_all - n) * G * (P + T) * per * _record_w(m)
    decoding = (n * P + B * T) * per * 8
    assembling = decoding + B * P * per * 8 + B * (P + T) * per * (8 + _record_w(m))
    return earlier + n * P * per * 8, earlier + decoding, earlier + assembling


def record_batch(m, rows: int, S: int) -> int:
    """The step batch's record [rows, S, L, k] in its stored dtype."""
    return rows * S * _per_token(m) * _record_w(m) if m.moe else 0


def record_micro_batch(m, mb: int, S: int, N: int) -> int:
    """One forward's ReplayRouting: the rows' record widened to int64, and per layer the forced
    experts and the forward's own top-k over its N tokens (int64)."""
    if not m.moe:
        return 0
    per = _per_token(m)
    return mb * S * per * 8 + 2 * N * per * 8
