"""The layers of a Qwen3.5 hybrid on paper: the buffers of its two layer kinds in each code path.

fasttrain.plan.memory asks this module for what a hybrid's layers add to a phase, where a plain
transformer's come from its own formulas; everything outside the layers (the resident model, the
caches' fixed parts, the log-prob head, the batch) is counted there, the same for both.

The two layer kinds (per token row, element sizes: w the model's dtype, f the state's: float32, or
float64 for a float64 model):
  Gated DeltaNet (fasttrain.rollout.hybrid_decoder.HybridDecoder._delta and
    fasttrain.train.prefix_forward_hybrid._delta): the input zeroed at padding [H], in_proj_qkv [C]
    (C = 2·Hk·Dk + Hv·Dv conv channels), in_proj_z [Z = Hv·Dv], in_proj_b/a [Hv] and the decay g [Hv]
    in float32; the causal conv over [K-1 + tokens] inputs per sequence (fasttrain.ops.causal_conv1d:
    a float32 sum, SiLU, back to w); q, k L2-normalised in f [Hk·Dk each]; the delta rule
    (fasttrain.ops.gated_delta_rule) in the form gated_delta_backend picks on the CPU: without a
    gradient (the rollout's prefill, the scores) the fused kernel (f contiguous copies of its
    inputs, o [Z] in f, the final state [Hv, Dk, Dv] in f per sequence); with one (the update) the
    chunked form (update_rule_form; its per-call terms are _chunked_forward_peak and
    _chunked_backward_peak below, from _ChunkedRule's accounting), both keeping the state at the
    start of every CHUNK tokens for the backward; the gated RMSNorm (float32 inside) and out_proj.
  gated full attention (HybridDecoder._attention, prefix_forward_hybrid._attention): q_proj gives
    the query and an output gate [2·qd], per-head q_norm/k_norm (float32 inside), the rotary
    embedding on the first `rotary_dim` dims, K/V repeated for grouped-query attention (no grouping
    of query heads as rows, unlike the Llama path), SDPA with the float mask it makes of the bool
    one, o · sigmoid(gate), o_proj.
Both kinds are followed by the same zero-centred RMSNorm and SwiGLU MLP as a Llama layer's.

What is not counted: the kernel's own scratch outside torch's allocator (the backward's per-worker
C+1 states, a few vectors per thread), and the short-lived float32 temporaries of the RMSNorms,
q_norm/k_norm and the rotary embedding (smaller than the peaks counted here). The terms follow the CPU code paths
(tests/plan measures them there); on CUDA with flash-linear-attention or causal-conv1d installed
those libraries' own buffers replace the fused kernel's and the conv's.
"""
from __future__ import annotations

from math import ceil

from fasttrain.plan.meta_model import ModelShape, fasttrain_attention_call

__all__ = ["CHUNK", "update_rule_form", "prefix_inputs", "prefix_layer_live", "prefix_saved",
           "backward_peak", "backward_temps", "prefill_layer_peak", "decode_locals", "decode_mlp"]

CHUNK = 32          # fasttrain.ops.gated_delta_rule's chunk_size: a state is kept every CHUNK tokens


def update_rule_form() -> str:
    """The delta rule's form in the update (a gradient wanted) on the CPU, as
    fasttrain.ops.gated_delta_backend picks it now: "chunked" (the torch form, the default) or
    "fused" (the token kernel: forced with set_gated_delta_backend("fused"); the reference, a
    plain-PyTorch fallback, is counted as the kernel)."""
    from fasttrain.ops.gated_delta import gated_delta_backend
    return "chunked" if gated_delta_backend("cpu", grad=True) == "torch" else "fused"


def _chunk_terms(m: ModelShape, rows: int, T: int) -> tuple[int, int, int, int, int, int]:
    """Bytes of one chunked-form call over `rows` sequences of T tokens, padded to N chunks of
    CHUNK: (X_k, X_v, X_c, X_1, s, N) of fasttrain.ops.gated_delta_chunked._ChunkedRule's accounting, i.e.
    [rows, Hv, N·CHUNK] cells times Dk, Dv, CHUNK and 1 elements of f, and one state per row."""
    Dk, Hv, Dv = m.delta.key_dim, m.delta.value_heads, m.delta.value_dim
    f = _dims(m)[1]
    N = ceil(T / CHUNK)
    cells = rows * Hv * N * CHUNK * f
    return cells * Dk, cells * Dv, cells * CHUNK, cells, rows * Hv * Dk * Dv * f, N


def _chunked_forward_peak(m: ModelShape, rows: int, T: int, given_state: bool) -> int:
    """The chunked form's forward with a gradient wanted, at its peak above what the caller holds
    (_ChunkedRule: its own tensors, o [rows, T, Hv, Dv] in f (and its cast to w), the kept states
    and the running state; `given_state`: the caller passes the initial state, so the first chunk's
    is the caller's)."""
    w, f = _dims(m)[:2]
    Z = _dims(m)[3]
    Xk, Xv, Xc, X1, s, N = _chunk_terms(m, rows, T)
    o = rows * T * Z * f
    kept = N * s
    s_old = s if (N > 1 or not given_state) else 0
    scores = 3 * Xk + Xv + 2 * Xc + 2 * X1
    loop = 3 * Xk + Xv + Xc + X1 + o + kept + s_old + max(3 * Xv // N, Xv // N + 2 * s)
    end = o + (rows * T * Z * w if w != f else 0) + s + kept
    return max(scores, loop, end)


def _chunked_backward_peak(m: ModelShape, rows: int, T: int) -> int:
    """The chunked form's backward at its peak above what it keeps (the states) and the gradients
    it is handed (_ChunkedRule: in the loop, or at the scores' gradient, or at the dQ/dK product,
    or with V made again), with the final state's gradient it was given and the running one."""
    Xk, Xv, Xc, X1, s, N = _chunk_terms(m, rows, T)
    cv, ck, cc = Xv // N, Xk // N, Xc // N
    s_cur = s if N > 1 else 0
    loop = 6 * Xk + 2 * Xv + 4 * Xc + 3 * X1 + s + s_cur + 3 * cv + max(cv, cc, ck, 2 * s)
    scores = 6 * Xk + 2 * Xv + 5 * Xc + 3 * X1 + 2 * s
    products = 7 * Xk + 2 * Xv + 4 * Xc + 3 * X1 + 2 * s
    values = 4 * Xk + 3 * Xv + 2 * Xc + 3 * X1 + 2 * s
    return max(loop, scores, products, values)


def _dims(m: ModelShape) -> tuple[int, int, int, int, int, int, int, int]:
    """(w, f, Hk·Dk, Z = Hv·Dv, C = conv channels, Hv, state elements per sequence Hv·Dk·Dv, K)."""
    Hk, Dk, Hv, Dv, K = m.delta.key_heads, m.delta.key_dim, m.delta.value_heads, m.delta.value_dim, m.delta.conv_kernel
    w = m.w
    f = 8 if w == 8 else 4
    kq = Hk * Dk
    Z = Hv * Dv
    return w, f, kq, Z, 2 * kq + Z, Hv, Hv * Dk * Dv, K


def _rot(m: ModelShape) -> int:
    return m.rotary_dim or m.head_dim


def _mlp_live(m: ModelShape, tokens: int, c: int) -> int:
    """The MLP at its product: the norm's output, act(gate), up and their product (plus the NF4
    kernel's output in its compute dtype when that is not the model's): the Llama layer's."""
    w, H, I = m.w, m.hidden, m.intermediate
    return tokens * (H * w + 3 * I * w + (I * c if c != w else 0))


def _gated_norm_peak(m: ModelShape, tokens: int) -> int:
    """The gated RMSNorm's own buffers at its peak over its inputs: weight·norm(o) in w, silu(z)
    and their product in float32 (for a 16-bit model the product's float32 copy of weight·norm(o)
    too: a CPU op casts mixed inputs to the common dtype first)."""
    w, f, _, Z, _, _, _, _ = _dims(m)
    return tokens * Z * (w + 2 * f + (f if w != f else 0))


def _conv_peak(m: ModelShape, rows: int, steps: int) -> int:
    """causal_conv1d over `steps` inputs of `rows` sequences at its peak: the window [rows, K-1+steps,
    C] (model dtype, and its f copy when that differs) and, while K shifted products are summed, the
    running sum, a product and the new sum in f."""
    w, f, _, _, C, _, _, K = _dims(m)
    return rows * (K - 1 + steps) * C * (w + (f if w != f else 0)) + 3 * rows * steps * C * f


# ---- the update's and the scores' forward: fasttrain.train.prefix_forward_hybrid ------------------
def prefix_inputs(m: ModelShape, U: int, P: int, B: int, A: int) -> int:
    """What prefix_forward_hybrid builds before its layers and keeps through them: the prompts' mask
    [U, P, P] and its causal/identity [P, P] parts, the answers' mask [B, A, P+A] (bool, not repeated
    per query head), the valid-token flags, and the rotary tables [N, rotary_dim] (cos and sin, model
    dtype). The answers' causal part [B, A, A] is prefix_masks' local, gone before the layers run."""
    N = U * P + B * A
    masks = U * P * P + 2 * P * P + (B * A * (P + A) if A else 0)
    return masks + N + 2 * N * _rot(m) * m.w


def _delta_live(m: ModelShape, U: int, P: int, B: int, A: int, grad: bool = False) -> int:
    """A Gated DeltaNet layer's mixer at its peak (every local of _delta stays referenced until it
    returns), no gradient kept (the scores; the update's forward under checkpointing, `grad`, where
    the delta rule is the chunked form: update_rule_form). Over the N rows qkv, z, beta, g
    throughout; then the largest of: the prompts' conv; with the chunked form, the prompts' delta
    rule (_chunked_forward_peak, with their conv window [U, K-1+P, C], output, q and k held); the
    answers' conv (their gathered conv states [B, K-1, C]) with the prompts' conv window and output,
    q, k, delta-rule output and final states [U, Hv, Dk, Dv] held; with the answers' conv output and
    q, k held in place of the prompts', the answers' delta rule (the gathered initial states
    [B, Hv, Dk, Dv] and the kernel's f copy of v, its output and final states, o cast to w; or the
    chunked form's peak) or the gated norm (with the answers' o and final states, still bound: o of
    all rows stacked, the norm's buffers)."""
    w, f, kq, Z, C, Hv, st, K = _dims(m)
    N = U * P + B * A
    chunked = grad and update_rule_form() == "chunked"
    base = N * (C + Z + Hv) * w + N * Hv * 4
    prompts = U * (K - 1 + P) * C * w + U * P * (C + Z) * w + U * st * f
    prompt_rule = U * (K - 1 + P) * C * w + U * P * (C * w + 2 * kq * f) + _chunked_forward_peak(m, U, P, False) \
        if chunked else 0
    if not A:
        return base + max(_conv_peak(m, U, P), prompt_rule, prompts + U * P * 2 * kq * f + _gated_norm_peak(m, N))
    answers_conv = prompts + U * P * 2 * kq * f + B * (K - 1) * C * w + _conv_peak(m, B, A)
    held = prompts + B * A * (C * w + 2 * kq * f)
    if chunked:
        # (also the answers' conv window [B, K-1+A, C], held by `_` (their new conv state, a view) until
        # the rule returns)
        at_rule = B * st * f + B * (K - 1 + A) * C * w + _chunked_forward_peak(m, B, A, True)
    else:
        at_rule = 2 * B * st * f + B * A * Z * (2 * f + (w if w != f else 0))
    at_norm = B * A * Z * w + B * st * f + N * Z * w + _gated_norm_peak(m, N)
    return base + max(_conv_peak(m, U, P), prompt_rule, answers_conv, held + max(at_rule, at_norm))


def _attention_live(m: ModelShape, U: int, P: int, B: int, A: int) -> int:
    """A gated attention layer's mixer at the answers' SDPA, no gradient: q_proj's query+gate, k, v
    over the N rows; per prompt token its rotated q, k, the gate (reshaped: a copy), the attention
    output times sigmoid(gate); per answer token its rotated q, k and gate, the prompt's gathered
    keys/values [B, kv, P+A, D], their repeats [B, heads, P+A, D], SDPA's output and float mask."""
    w = m.w
    qd, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    N = U * P + B * A
    rep = 2 * B * (P + A) * qd * w if m.heads != m.kv_heads else 0
    proj = N * (2 * qd + 2 * kd) * w
    prompts = U * P * (3 * qd + kd) * w
    answers = B * A * (3 * qd + kd) * w + 2 * B * (P + A) * kd * w + rep + B * A * (P + A) * w if A else 0
    return proj + prompts + answers


def prefix_layer_live(m: ModelShape, U: int, P: int, B: int, A: int, c: int, mlp_extra: int = 0, *,
                      grad: bool = False) -> int:
    """Peak of the costlier layer kind of prefix_forward_hybrid with no saved tensors kept (no grad,
    or `grad`: the update's forward of a checkpointed layer, whose delta rule is the update's form):
    the layer's input and its normalised copy [N, H] held through it, plus the mixer's peak, or
    (after the mixer returned) its output, the new residual and the MLP at its product (plus
    `mlp_extra`: a MoE layer's routed experts, fasttrain.plan.moe_memory)."""
    w, H = m.w, m.hidden
    N = U * P + B * A
    mixer = max(_delta_live(m, U, P, B, A, grad), _attention_live(m, U, P, B, A) if m.full_layers else 0)
    return max(2 * N * H * w + mixer, 4 * N * H * w + _mlp_live(m, N, c) + mlp_extra)


def _dense_saved(m: ModelShape, projs: list[tuple[int, int]]) -> int:
    """Per token row, what the fp32 adapter path of 16-bit projections (DenseLinear) saves beyond
    x·Aᵀ: the fp32 copy of each one's input (none for an fp32 model) and for DoRA two fp32 [out]."""
    acc = 8 if m.w == 8 else 4
    copies = sum(acc * i for _, i in projs) if m.w != acc else 0
    dora = sum(2 * acc * o for o, _ in projs) if m.adapter_kind == "dora" else 0
    return copies + dora


def _common_saved_per_row(m: ModelShape, c_xa: int) -> int:
    """Per token row, what both layer kinds save around their mixer (the Llama layer's terms): the
    input's fp32 copy for the first norm and the projections' normalised input, the residual's fp32
    copy and its normalised copy, gate/act/up/product of the MLP and its three x·Aᵀ."""
    w, H, I, r = m.w, m.hidden, m.intermediate, m.rank
    mlp = [(I, H), (I, H), (H, I)]
    dense = _dense_saved(m, mlp) if m.quantize == "none" else 0
    return 2 * (4 * H + H * w) + 4 * I * w + 3 * r * c_xa + dense


def _delta_saved(m: ModelShape, U: int, P: int, B: int, A: int, c_xa: int) -> int:
    """What a Gated DeltaNet mixer saves for its backward. Per token row: x·Aᵀ of its projections
    (in_proj_b/a run on the 16-bit path: fp32, with their inputs' fp32 copies in a 16-bit model);
    softplus's input, sigmoid's output, g and beta as the kernel reads them (f; the chunked form
    keeps beta as given, the sigmoid's output); the conv's pre-activation (f) and what the L2 norms
    read (fp32 model: the conv's float32 output, whole; else the f copies of q and k); the rule's
    inputs q, k (f) and its contiguous copy of v (the kernel's in f, the chunked form's in w); the
    gated norm's float32 input, weight·norm(o), silu(z)'s input and output, out_proj's input. Per
    sequence: the state at the start of every CHUNK tokens [Hv, Dk, Dv] in f (both forms)."""
    w, f, kq, Z, C, Hv, st, K = _dims(m)
    chunked = update_rule_form() == "chunked"
    H, r = m.hidden, m.rank
    N = U * P + B * A
    nf4 = [(C, H), (Z, H), (H, Z)]
    dense = [(Hv, H), (Hv, H)]
    if m.quantize == "none":
        dense, nf4 = dense + nf4, []
    proj = len(nf4) * r * c_xa + len(dense) * r * (8 if w == 8 else 4) + _dense_saved(m, dense)
    heads = Hv * (4 + w + 4 + (f if w != f and not chunked else 0))
    conv = C * f + (C * f if w == f else 2 * kq * f)
    rule = 2 * kq * f + Z * (w if chunked else f)
    norm = Z * (3 * f + 2 * w)
    ckpt = (U * ceil(P / CHUNK) + (B * ceil(A / CHUNK) if A else 0)) * st * f
    return N * (proj + heads + conv + rule + norm) + ckpt


def _attention_saved(m: ModelShape, U: int, P: int, B: int, A: int, c_xa: int) -> int:
    """What a gated attention mixer saves for its backward. Per token row: x·Aᵀ of q/k/v/o_proj and
    o_proj's input; what q_norm and k_norm read (fp32 model: q_proj's whole output and k; else their
    fp32 copies of q and k); sigmoid(gate) and the attention output it multiplies; SDPA's rotated
    queries, output and log-sum-exp. Per attention: the keys and values it read, repeated per query
    head, and its float mask."""
    w, H, r = m.w, m.hidden, m.rank
    qd, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    N = U * P + B * A
    projs = [(2 * qd, H), (kd, H), (kd, H), (H, qd)]
    dense = _dense_saved(m, projs) if m.quantize == "none" else 0
    norms = (2 * qd + kd) * 4 if w == 4 else (qd + kd) * (8 if w == 8 else 4)
    per_row = 4 * r * c_xa + qd * w + dense + norms + 4 * qd * w + m.heads * 4
    prompts = U * P * (2 * qd * w + P * w)
    answers = B * ((P + A) * 2 * qd * w + A * (P + A) * w) if A else 0
    # fasttrain's backward (fasttrain.ops.attention) saves q, k, v and the shared bool mask only: no
    # output, log-sum-exp or float mask
    (_, h, M, L), *rest = attention_calls(m, U, P, B, A)
    if fasttrain_attention_call(m, h, M, L):
        prompts -= U * P * (qd * w + m.heads * 4 + P * w)
    if rest and fasttrain_attention_call(m, *rest[0][1:]):
        answers -= B * A * (qd * w + m.heads * 4 + (P + A) * w)
    return N * per_row + prompts + answers


def attention_calls(m: ModelShape, U: int, P: int, B: int, A: int) -> list[tuple[int, int, int, int]]:
    """A gated attention layer's two calls as (rows, heads, query rows, keys): the prompts' and the
    answers', K/V repeated per query head."""
    return [(U, m.heads, P, P)] + ([(B, m.heads, A, P + A)] if A else [])


def attention_backward_extra(m: ModelShape, U: int, P: int, B: int, A: int, c_xa: int) -> tuple[int, int]:
    """(a gated attention layer's saved bytes, what fasttrain's attention backward holds beyond them)
    at the costlier of its calls; (0, 0) where neither takes it (or the model has no such layer). Left
    of the saved bytes then: the input's fp32 copy and norm output and the mixer's saved bytes less
    o_proj's (its x·Aᵀ and input, with a 16-bit base its input's fp32 copy) and the gate product's
    (sigmoid(gate) and the attention output), consumed by then. Held with them: the residual's
    gradient [N, H], the gradients of the attention output and the gate [N, 2·qd], the call's dq,
    dk, dv and its workspace (fasttrain.ops.attention.backward_workspace)."""
    from fasttrain.ops.attention import backward_workspace
    calls = attention_calls(m, U, P, B, A)
    if not m.full_layers or not any(fasttrain_attention_call(m, *c[1:]) for c in calls):
        return 0, 0
    w, H, D = m.w, m.hidden, m.head_dim
    qd = m.heads * D
    N = U * P + B * A
    saved = N * _common_saved_per_row(m, c_xa) + _attention_saved(m, U, P, B, A, c_xa)
    consumed = N * (m.rank * c_xa + 3 * qd * w) + (N * _dense_saved(m, [(H, qd)]) if m.quantize == "none" else 0)
    live = N * (4 * H + H * w) + _attention_saved(m, U, P, B, A, c_xa) - consumed + N * (H + 2 * qd) * w
    best = max(live + n * h * (M + 2 * L) * D * w + backward_workspace(n, h, M, L, D, w)
               for n, h, M, L in calls if fasttrain_attention_call(m, h, M, L))
    return saved, max(0, best - saved)


def backward_peak(m: ModelShape, U: int, P: int, B: int, A: int, c_xa: int) -> int:
    """A checkpointed layer in its backward, the costlier kind: what it saved when recomputed plus
    the gradients live at once in its backward (_mlp_grads, and for a Gated DeltaNet layer its
    delta rule's, _rule_grads)."""
    N = U * P + B * A
    common = N * _common_saved_per_row(m, c_xa)
    delta = _delta_saved(m, U, P, B, A, c_xa) + max(_mlp_grads(m, N), _rule_grads(m, U, P, B, A, c_xa))
    attention = _attention_saved(m, U, P, B, A, c_xa) + _mlp_grads(m, N) if m.full_layers else 0
    return common + max(delta, attention)


def prefix_saved(m: ModelShape, U: int, P: int, B: int, A: int, c_xa: int) -> int:
    """Saved bytes of all layers (no checkpointing): each kind's times its count."""
    N = U * P + B * A
    full = m.full_layers or 0
    common = m.layers * N * _common_saved_per_row(m, c_xa)
    return common + (m.layers - full) * _delta_saved(m, U, P, B, A, c_xa) + full * _attention_saved(
        m, U, P, B, A, c_xa)


def _mlp_grads(m: ModelShape, N: int) -> int:
    """The MLP's gradients live at once in its backward (the Llama layer's [N, H] and 2 x [N, I])."""
    return N * m.hidden * m.w + 2 * N * m.intermediate * m.w


def _rule_grads(m: ModelShape, U: int, P: int, B: int, A: int, c_xa: int) -> int:
    """The delta rule's backward beyond what the layer saved: the gradient of o and the kernel's dq,
    dk per value head [N, Hv, Dk], dv, dg, dbeta, the initial states' gradient, with the gated
    norm's gradients of z and o and the conv's still referenced, less what the layer's backward
    freed before it (the MLP's, the second norm's and the gated norm's saved tensors, consumed).
    With the chunked form (update_rule_form) also, the larger of: in the answers' call, the
    gradients of o and z of all rows and _chunked_backward_peak of the answers; in the prompts'
    call, those, the answers' conv gradient and initial states' gradients, and the prompts' peak."""
    w, f, kq, Z, C, Hv, st, K = _dims(m)
    H, I = m.hidden, m.intermediate
    N = U * P + B * A
    grads = N * (2 * (Hv * m.delta.key_dim) * f + 3 * Z * f + 2 * Hv * f + C * f) + 2 * B * st * f
    if update_rule_form() == "chunked":
        handed = N * 2 * Z * f
        answers = handed + _chunked_backward_peak(m, B, A) if A else 0
        prompts = handed + (B * A * C * f + 2 * B * st * f if A else 0) + _chunked_backward_peak(m, U, P)
        grads = max(N * (2 * kq * f + 3 * Z * f + 2 * Hv * f + C * f) + 2 * B * st * f, answers, prompts)
    freed = N * ((4 * H + H * w) + 4 * I * w + 3 * m.rank * c_xa + Z * (3 * f + 2 * w))
    return grads - freed


def backward_temps(m: ModelShape, U: int, P: int, B: int, A: int, c_xa: int) -> int:
    """The largest set of gradients live at once in any layer's backward beyond the saved bytes (no
    checkpointing). The delta rule's run in the last Gated DeltaNet layer's backward, after the
    full-attention layers behind it (trailing_full) ran theirs and freed what they saved."""
    N = U * P + B * A
    after = m.trailing_full * (N * _common_saved_per_row(m, c_xa) + _attention_saved(m, U, P, B, A, c_xa))
    return max(_mlp_grads(m, N), _rule_grads(m, U, P, B, A, c_xa) - after)


# ---- the rollout: fasttrain.rollout.hybrid_decoder --------------------------------------------------
def prefill_layer_peak(m: ModelShape, n: int, P: int, c: int, dense: bool, mlp_extra: int = 0) -> int:
    """No-grad peak of one layer of HybridDecoder's prefill over n prompts of P tokens (the residual
    counted by the caller), with the previous Gated DeltaNet layer's output, conv window and state
    still referenced (its loop variables, reassigned by the next one): a Gated DeltaNet layer's locals
    at the largest of its conv, its delta rule and its gated norm (the normalised input, qkv, z,
    beta, g, the conv window [n, K-1+P, C] and output, q, k, the kernel's copy of v, o, the final
    states [n, Hv, Dk, Dv]), or after it the MLP with the layer's output, conv window and state
    still referenced; a gated attention layer's at SDPA
    (norm output, q_proj's query+gate, k, v, rotated q and k, the gate's copy, K/V repeated per
    query head, the output and SDPA's float mask [n, P, P])."""
    w, f, kq, Z, C, Hv, st, K = _dims(m)
    H, I = m.hidden, m.intermediate
    qd, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    t = n * P
    base = t * (H + C + Z + Hv) * w + t * Hv * 4
    held = base + t * C * w + n * (K - 1 + P) * C * w + t * 2 * kq * f + n * st * f
    rule = t * Z * (2 * f + (w if w != f else 0))
    norm = t * Z * w + _gated_norm_peak(m, t)
    mlp = t * (H * w + 4 * I * w) if dense else _mlp_live(m, t, c)
    delta = max(base + _conv_peak(m, n, P), held + max(rule, norm),
                t * 2 * H * w + n * (K - 1 + P) * C * w + n * st * f + mlp + mlp_extra)
    rep = 2 * t * qd * w if m.heads != m.kv_heads else 0
    attention = t * (H + 2 * qd + 2 * kd + qd + kd + 2 * qd) * w + rep + n * P * P * w
    previous = t * H * w + n * (K - 1 + P) * C * w + n * st * f
    return previous + max(delta, attention if m.full_layers else 0)


def decode_locals(m: ModelShape, B: int) -> int:
    """A decode step's Gated DeltaNet locals in place of attention's scores (the residual and MLP
    terms are the Llama step's), at the conv: qkv, z, b/a,
    beta, g over the B rows, the conv window [B, K, C] (its f copy in a 16-bit model), the window
    times the weights and their sum in f, and two conv states [B, K-1, C] (the held-rows select of
    this layer's and the previous layer's, still referenced). The recurrent state advances in place
    in the cache (fasttrain.ops.gated_delta_step_): no copy of it."""
    w, f, kq, Z, C, Hv, st, K = _dims(m)
    return B * ((C + Z + 2 * Hv) * w + Hv * (w + 4) + K * C * (w + (f if w != f else 0) + f) + C * f) + \
        2 * B * (K - 1) * C * w


def decode_mlp(m: ModelShape, B: int) -> int:
    """A decode step's MLP locals (act(gate), up, their product): the Llama step's."""
    return B * 3 * m.intermediate * m.w
