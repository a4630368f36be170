// Every fasttrain op schema, in one place (the vLLM habit): shapes and dtypes above each m.def.
// The CPU kernels register through csrc/cpu/register.cpp (one variant, picked at load), the CUDA
// kernels beside their code in the separate module fasttrain._C_cuda (csrc/cuda/*.cu). This file
// also defines the pybind11 module fasttrain._C, whose import loads the library and so registers
// the schemas and the CPU kernels.
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>
#include <torch/extension.h>

#include "core/cpu_features.h"
#include "core/cpu_variant.h"
#include "cpu/pack_cache.h"
#include "ops.h"

TORCH_LIBRARY(fasttrain, m) {
  // ---- nf4: bitsandbytes-compatible NF4 ---------------------------------------------
  // w [*] fp32|fp16|bf16 -> packed uint8 [ceil(n/2)] (element 2j high nibble), absmax fp32 [ceil(n/bs)]
  m.def("nf4_quantize(Tensor w, int blocksize) -> (Tensor, Tensor)");
  // packed uint8 [ceil(n/2)], absmax fp32 [ceil(n/bs)] -> [numel] of dtype
  m.def("nf4_dequantize(Tensor packed, Tensor absmax, int blocksize, int numel, ScalarType dtype) -> Tensor");
  // x fp32 [n], code fp32 [256] sorted -> q uint8 [n], absmax fp32 [ceil(n/bs)]
  m.def("blockwise8_quantize(Tensor x, Tensor code, int blocksize) -> (Tensor, Tensor)");
  // q uint8 [n], absmax fp32 [ceil(n/bs)], code fp32 [256] -> fp32 [n]
  m.def("blockwise8_dequantize(Tensor q, Tensor absmax, Tensor code, int blocksize) -> Tensor");

  // ---- fused_logprob ------------------------------------------------------------------
  // hidden [N,H], weight [V,H] (fp32|fp16|bf16|fp64, same dtype), targets [N] int64, bias [V]?
  // -> logp [N], entropy [N], stats [2,N] = (ref, log s) with lse = ref + log s (fp32; fp64 for fp64
  // inputs), grad_vec [N,H] fp32|fp64 when
  // compute_grad (d logp_n / d h_n = (W[t_n] - sum_v p_nv W[v]) / T), else [0,H]. Tokens whose
  // target == ignore_index give 0 everywhere. chunk_bytes bounds the scratch (0: default).
  // keep_delta [N] fp32|fp64 (optional): each token's kept set of a truncated draw, delta = z_target - z_cut
  // (core/math.h kept_cut; +inf: all): logp, entropy and gradients are those of the softmax restricted
  // to {v : z_v >= z_target - delta}, renormalised; stats then has a third row, the absolute cut.
  m.def("fused_logprob_forward(Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, float temperature, "
        "int ignore_index, bool compute_grad, int chunk_bytes, Tensor? keep_delta=None) -> (Tensor, Tensor, Tensor, Tensor)");
  // grad_logp [N] fp32|fp64, stats [2,N] or [3,N] (a kept set's cut) from the forward -> grad_weight [V,H] (weight's dtype),
  // grad_bias [V] fp32|fp64 (zeros when bias is None): dW = sum_n g_n (onehot(t_n) - p_n) h_n^T / T, p
  // recomputed per chunk. Both ops raise for a target outside [0, V) that is not ignore_index.
  m.def("fused_logprob_backward_weight(Tensor grad_logp, Tensor hidden, Tensor weight, Tensor targets, "
        "Tensor? bias, Tensor stats, float temperature, int ignore_index, int chunk_bytes) -> (Tensor, Tensor)");

  // ---- policy_loss --------------------------------------------------------------------
  // logp, old_logp, ref_logp [B,T] fp32|fp16|bf16 (one dtype); advantages fp32 [B] or [B,T]; mask [B,T] bool or
  // fp32 (0 = inactive, else the token's weight); token_normalizer fp32 [] or [1] (or the float value, used
  // when > 0): the divisor of the token-level loss (GRPO: the number of sequences).
  // loss_type 0 cispo, 1 dapo, 2 grpo; kl_type (used when ref_logp is given and beta != 0) 0 k3 as the loss,
  // 1 k3_ratio (r * k3, r differentiable); last and defaulted so that callers written before it keep k3. Returns loss fp32 [], stats fp32 [7] (ratio_mean, clip_low_frac,
  // clip_high_frac, cap_frac, kl_mean, repo_r_factor_mean, active_tokens), and for backward the
  // per-token gradient coefficient fp32 [B,T] and per-row scale fp32 [B].
  m.def("policy_loss(Tensor logp, Tensor old_logp, Tensor advantages, Tensor mask, Tensor? ref_logp, "
        "Tensor? token_normalizer, int loss_type, float beta, float eps_low, float eps_high, float cispo_cap, "
        "float zeta, float token_normalizer_value, int kl_type=0) -> (Tensor, Tensor, Tensor, Tensor)");
  // grad_loss fp32 [], coef fp32 [B,T], rowscale fp32 [B] -> grad_logp [B,T] of dtype
  m.def("policy_loss_backward(Tensor grad_loss, Tensor coef, Tensor rowscale, ScalarType dtype) -> Tensor");

  // ---- nf4_linear ---------------------------------------------------------------------
  // y = g ⊙ (x·Wᵀ + scale·(x·Aᵀ)·Bᵀ), W NF4 [N=out_features, K] (packed uint8 [ceil(NK/2)], absmax
  // fp32 [ceil(NK/bs)]), A [r, K], B [N, r] (fp32 masters), g = m / ‖W + scale·B·A‖_row (DoRA) or 1.
  // x [M, K] fp32|bf16|fp16 (fp64 on CPU) -> y [M, N] x.dtype, xa [M, r] (or [0] without LoRA), rnorm [N] fp32
  // 1/‖W + sBA‖ (or [0]), z [M, N] pre-scale output (DoRA only, else [0]); the last three are saved
  // for the backward. weight_sq_norm [N] fp32 ‖W‖² per row (computed once; optional).
  m.def("nf4_linear(Tensor x, Tensor packed, Tensor absmax, int blocksize, int out_features, Tensor? lora_a, "
        "Tensor? lora_b, float scale, Tensor? dora_m, Tensor? weight_sq_norm) -> (Tensor, Tensor, Tensor, Tensor)");
  // dy [M, N] -> (dx [M, K] x.dtype, dA [r, K], dB [N, r], dm [N]); an output whose mask bit is off is [0]
  // (a fresh tensor each, never one shared); dm's dtype is dora_m's (fp32 without DoRA). Rank 0
  // (A [0, K], B [N, 0]) gives xa [M, 0], dA [0, K] and dB [N, 0].
  m.def("nf4_linear_backward(Tensor dy, Tensor x, Tensor packed, Tensor absmax, int blocksize, int out_features, "
        "Tensor? lora_a, Tensor? lora_b, float scale, Tensor? dora_m, Tensor xa, Tensor rnorm, Tensor z, "
        "bool[4] output_mask) -> (Tensor, Tensor, Tensor, Tensor)");
  // ‖W + scale·B·A‖ per row [N] (fp32; fp64 for fp64 A) from the factorised form, for tests and merges.
  m.def("nf4_dora_norm(Tensor packed, Tensor absmax, int blocksize, int out_features, Tensor lora_a, "
        "Tensor lora_b, float scale, Tensor? weight_sq_norm) -> Tensor");
  // ‖W‖² per row [N] fp32 (accumulated in fp64), computed once per layer.
  m.def("nf4_weight_sq_norm(Tensor packed, Tensor absmax, int blocksize, int out_features, int in_features) -> Tensor");

  // ---- gated_delta: the gated delta rule of Gated DeltaNet layers ---------------------
  // q, k [B,T,Hk,Dk], v [B,T,Hv,Dv] (Hv a multiple of Hk; q/k head h serves value heads h·Hv/Hk..),
  // g (log decay) and beta [B,T,Hv], s0 [B,Hv,Dk,Dv]? (zeros when None); one dtype, float32 or
  // float64, contiguous. Per token: S = e^g S; d = beta (v - Sᵀk); S += k dᵀ; o = scale Sᵀq.
  // -> o [B,T,Hv,Dv], final state [B,Hv,Dk,Dv], and when save the state before every
  // checkpoint_every-th token [B,Hv,ceil(T/C),Dk,Dv] for the backward (else [0,Hv,N,Dk,Dv]).
  m.def("gated_delta_forward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? s0, float scale, "
        "int checkpoint_every, bool save) -> (Tensor, Tensor, Tensor)");
  // grad_o [B,T,Hv,Dv], grad_state [B,Hv,Dk,Dv]? -> dq, dk [B,T,Hv,Dk] (per value head: the caller sums
  // the heads that share a q/k head), dv, dg, dbeta, d_initial_state; the states are recomputed from
  // the checkpoints, one span at a time.
  m.def("gated_delta_backward(Tensor grad_o, Tensor? grad_state, Tensor q, Tensor k, Tensor v, Tensor g, "
        "Tensor beta, Tensor checkpoints, float scale, int checkpoint_every) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // The decode step in place: state [B,Hv,Dk,Dv] (float32|float64, contiguous) advanced by one token
  // q, k [B,1,Hk,Dk], v [B,1,Hv,Dv], g, beta [B,1,Hv] (the state's dtype); a row whose active [B]
  // bool is false is left as it was (its o is 0). -> o [B,1,Hv,Dv].
  m.def("gated_delta_decode_(Tensor(a!) state, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
        "Tensor? active, float scale) -> Tensor");

  // ---- decode_attention: one decode step's attention (CPU; a GPU keeps torch's SDPA) ------
  // q [B,kv,G,D] contiguous (the G query heads sharing each KV head), k, v [B,kv,S,D] (views of a
  // cache: only the last dimension contiguous), key_valid bool [B,S]; one floating dtype.
  // -> o [B,kv,G,D] = softmax(scale·q·kᵀ over the row's valid keys)·v (zeros for a row with none).
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor key_valid, float scale) -> Tensor");

  // ---- attention_softmax_grad: the softmax step of a masked attention's backward (CPU) --------------
  // s = q·kᵀ and dp = dO·vᵀ float32 [A,B,C,L] contiguous (unscaled scores), mask bool broadcastable to
  // them (keys' dimension contiguous; True = may attend) -> (p, ds) in out_dtype: p = softmax(scale·s)
  // over the allowed keys, ds = scale·p·(dp − Σ p·dp); a row with no allowed key gets zeros.
  m.def("attention_softmax_grad(Tensor s, Tensor dp, Tensor? mask, float scale, ScalarType out_dtype) "
        "-> (Tensor, Tensor)");

  // ---- decode_fused: a Llama-family decode step's elementwise work (CPU; a GPU keeps the modules) ----
  // x [N,H] contiguous, weight [H] (x's dtype: fp32|bf16|fp16) -> y = rnd(w·rnd(x/sqrt(mean(x²)+eps))),
  // HF's LlamaRMSNorm rounding. add_rms_norm_ first sets x <- rnd(x + delta) (delta [N,H]), in place.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  // qkv [B,(n_heads+2·kv)·D] contiguous (q, k, v heads in that order), cos, sin [B,D]; k_cache, v_cache
  // [B,kv,S,D] (last dimension contiguous): writes the rotated k and v at cache column `column` and
  // returns the rotated q [B,kv,G,D] (G = n_heads/kv, query head h = kv head h/G). Rotary in HF's
  // rotate_half form, rounded as its ops round. q_norm, k_norm [D] (both or neither): each q and k head
  // first through rms_norm with that weight and norm_eps (Qwen3's per-head norms).
  m.def("rotary_cache_write_(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "int column, int n_heads, Tensor? q_norm=None, Tensor? k_norm=None, float norm_eps=0.) -> Tensor");
  // gate_up [N,2I] contiguous (gate then up) -> a [N,I] = rnd(rnd(silu(gate))·up)
  m.def("silu_mul(Tensor gate_up) -> Tensor");

  // ---- moe_experts: the routed experts of a mixture-of-experts layer -----------------
  // x [N,H] fp32|fp16|bf16|fp64, expert_index int64 [N,k] in [0,E), routing_weights [N,k] floating;
  // gate_up: NF4 uint8 [E, ceil(2I·H/2)] with gate_up_absmax fp32 [E, ceil(2I·H/bs)], or a floating
  // [E, 2I, H] stack (absmax None); down likewise for [E, H, I]; LoRA A [E,r,in], B [E,out,r] per
  // stack (or None). y_n = Σ_j w_nj · D_e(silu(G_e x_n) ⊙ U_e x_n), each projection plus s·(x·Aᵀ)·Bᵀ.
  // -> y [N,H] x.dtype, and for the backward (save): order int64 [N·k] (pair ids n·k+j grouped by
  // expert), offsets int64 [E+1], h [N·k, 2I] (gate, up) and out [N·k, H] (unweighted expert outputs),
  // both in the compute dtype (fp64 for fp64 x, else fp32); h and out are [0] without save.
  m.def("moe_experts(Tensor x, Tensor expert_index, Tensor routing_weights, Tensor gate_up, Tensor? gate_up_absmax, "
        "Tensor down, Tensor? down_absmax, int blocksize, int intermediate, Tensor? gate_up_a, Tensor? gate_up_b, "
        "Tensor? down_a, Tensor? down_b, float scale, bool save) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // dy [N,H] and the forward's saved tensors -> dx [N,H] x.dtype, d routing_weights [N,k] (its dtype),
  // dA, dB of each LoRA stack (compute dtype; [0] without that LoRA); an output whose mask bit
  // (x, routing_weights, LoRA) is off is [0]. The stacks are frozen (no gradient).
  m.def("moe_experts_backward(Tensor dy, Tensor x, Tensor expert_index, Tensor routing_weights, Tensor gate_up, "
        "Tensor? gate_up_absmax, Tensor down, Tensor? down_absmax, int blocksize, int intermediate, "
        "Tensor? gate_up_a, Tensor? gate_up_b, Tensor? down_a, Tensor? down_b, float scale, Tensor order, "
        "Tensor offsets, Tensor h, Tensor out, bool[3] output_mask) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

namespace {
pybind11::dict build_info() {
  pybind11::dict info;
  info["version"] = FASTTRAIN_VERSION;
  info["torch_version"] = TORCH_VERSION;
  info["cpu_variants"] = fasttrain::cpu_variants_compiled();
  info["cxx_standard"] = static_cast<long>(__cplusplus);
  return info;
}
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fasttrain native extension (CPU): op schemas and CPU kernels under torch.ops.fasttrain";
  m.def("build_info", &build_info, "version, the torch it was built against, the CPU variants it holds");
  m.def("cpu_variant", &fasttrain::cpu_variant,
        "the variant of the CPU kernels that runs here: default, avx2, avx512 (or native)");
  m.def("cpu_has_bf16", &fasttrain::cpu_has_bf16,
        "whether the CPU kernels compute bfloat16 inputs in bfloat16 (avx512_bf16 and ATen at AVX512), else fp32");
  m.def("logprob_pack_scope", &fasttrain::logprob_pack_scope,
        "open (True) or close (False) a scope in which the CPU fused_logprob keeps W's packed copies "
        "across calls (fasttrain.ops.logprob_pack_cache)");
  m.def("logprob_pack_entries", &fasttrain::logprob_pack_entries, "entries the pack scope holds now (tests)");
  m.def("cpu_brgemm_bf16", [] { return at::native::cpublas::could_pack(at::kBFloat16); },
        "whether ATen's brgemm ukernel packs bfloat16 here (oneDNN: AMX or AVX-512 bf16), which the fused "
        "log-prob head's bf16 GEMMs use");
  m.def("cpu_bf16_dot",
        [] {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
          return fasttrain::cpu_has_bf16() && !at::native::cpublas::could_pack(at::kBFloat16);
#else
          return false;
#endif
        },
        "whether the fused log-prob head's bf16 products run on the avx512_bf16 dot-product instruction "
        "here (cpu/bf16_dot.h: avx512_bf16 where oneDNN's ukernel does not pack bf16)");
}
