// C++ declarations of every op's backend implementations. Schemas live in torch_bindings.cpp;
// each backend file registers its own implementations with TORCH_LIBRARY_IMPL at its bottom.
#pragma once
#include <ATen/core/Tensor.h>
#include <array>
#include <optional>
#include <tuple>

namespace fasttrain {

// ---- nf4 ----------------------------------------------------------------------------
// w: any shape, float32/float16/bfloat16, contiguous. Returns (packed uint8 [ceil(n/2)],
// absmax float32 [ceil(n/blocksize)]).
std::tuple<at::Tensor, at::Tensor> nf4_quantize_cpu(const at::Tensor& w, int64_t blocksize);
std::tuple<at::Tensor, at::Tensor> nf4_quantize_cuda(const at::Tensor& w, int64_t blocksize);
// Returns a flat [numel] tensor of `dtype`.
at::Tensor nf4_dequantize_cpu(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                              int64_t numel, at::ScalarType dtype);
at::Tensor nf4_dequantize_cuda(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                               int64_t numel, at::ScalarType dtype);
// 8-bit blockwise quantization against a sorted 256-entry code (double quantization of absmax).
std::tuple<at::Tensor, at::Tensor> blockwise8_quantize_cpu(const at::Tensor& x, const at::Tensor& code,
                                                           int64_t blocksize);
std::tuple<at::Tensor, at::Tensor> blockwise8_quantize_cuda(const at::Tensor& x, const at::Tensor& code,
                                                            int64_t blocksize);
at::Tensor blockwise8_dequantize_cpu(const at::Tensor& q, const at::Tensor& absmax, const at::Tensor& code,
                                     int64_t blocksize);
at::Tensor blockwise8_dequantize_cuda(const at::Tensor& q, const at::Tensor& absmax, const at::Tensor& code,
                                      int64_t blocksize);

// ---- fused_logprob --------------------------------------------------------------------
// See the schemas in torch_bindings.cpp. Returns (logp, entropy, stats, grad_vec).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_logprob_forward_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
    const std::optional<at::Tensor>& bias, double temperature, int64_t ignore_index, bool compute_grad,
    int64_t chunk_bytes, const std::optional<at::Tensor>& keep_delta);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_logprob_forward_cuda(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
    const std::optional<at::Tensor>& bias, double temperature, int64_t ignore_index, bool compute_grad,
    int64_t chunk_bytes, const std::optional<at::Tensor>& keep_delta);
// Returns (grad_weight, grad_bias).
std::tuple<at::Tensor, at::Tensor> fused_logprob_backward_weight_cpu(
    const at::Tensor& grad_logp, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
    const std::optional<at::Tensor>& bias, const at::Tensor& stats, double temperature, int64_t ignore_index,
    int64_t chunk_bytes);
std::tuple<at::Tensor, at::Tensor> fused_logprob_backward_weight_cuda(
    const at::Tensor& grad_logp, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
    const std::optional<at::Tensor>& bias, const at::Tensor& stats, double temperature, int64_t ignore_index,
    int64_t chunk_bytes);

// ---- policy_loss ----------------------------------------------------------------------
// Returns (loss fp32 [], stats fp32 [7], coef fp32 [B,T], rowscale fp32 [B]); see torch_bindings.cpp.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss_cpu(
    const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages, const at::Tensor& mask,
    const std::optional<at::Tensor>& ref_logp, const std::optional<at::Tensor>& token_normalizer,
    int64_t loss_type, double beta, double eps_low, double eps_high, double cispo_cap, double zeta,
    double token_normalizer_value, int64_t kl_type);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss_cuda(
    const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages, const at::Tensor& mask,
    const std::optional<at::Tensor>& ref_logp, const std::optional<at::Tensor>& token_normalizer,
    int64_t loss_type, double beta, double eps_low, double eps_high, double cispo_cap, double zeta,
    double token_normalizer_value, int64_t kl_type);
// grad_logp [B,T] of `dtype` = grad_loss * coef * rowscale[row].
at::Tensor policy_loss_backward_cpu(const at::Tensor& grad_loss, const at::Tensor& coef, const at::Tensor& rowscale,
                                    at::ScalarType dtype);
at::Tensor policy_loss_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& coef, const at::Tensor& rowscale,
                                     at::ScalarType dtype);

// ---- nf4_linear -----------------------------------------------------------------------
// x [M, K]; W NF4 [out_features, K]; lora_a [r, K]; lora_b [out_features, r]; dora_m [out_features].
using OptTensor = std::optional<at::Tensor>;
using NF4LinearOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
#define FT_NF4_LINEAR_DECLS(dev)                                                                          \
  NF4LinearOut nf4_linear_##dev(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,   \
                                int64_t blocksize, int64_t out_features, const OptTensor& lora_a,          \
                                const OptTensor& lora_b, double scale, const OptTensor& dora_m,            \
                                const OptTensor& weight_sq_norm);                                          \
  NF4LinearOut nf4_linear_backward_##dev(                                                                  \
      const at::Tensor& dy, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,       \
      int64_t blocksize, int64_t out_features, const OptTensor& lora_a, const OptTensor& lora_b,           \
      double scale, const OptTensor& dora_m, const at::Tensor& xa, const at::Tensor& rnorm,                \
      const at::Tensor& z, std::array<bool, 4> output_mask);                                               \
  at::Tensor nf4_dora_norm_##dev(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,   \
                                 int64_t out_features, const at::Tensor& lora_a, const at::Tensor& lora_b, \
                                 double scale, const OptTensor& weight_sq_norm);                           \
  at::Tensor nf4_weight_sq_norm_##dev(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize, \
                                      int64_t out_features, int64_t in_features);
FT_NF4_LINEAR_DECLS(cpu)
FT_NF4_LINEAR_DECLS(cuda)
#undef FT_NF4_LINEAR_DECLS

// ---- gated_delta ----------------------------------------------------------------------
// Returns (o [B,T,Hv,Dv], final state [B,Hv,Dk,Dv], checkpoints [B,Hv,N,Dk,Dv] or [0,...]).
#define FT_GATED_DELTA_DECLS(dev)                                                                          \
  std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_delta_forward_##dev(                                \
      const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,                  \
      const at::Tensor& beta, const std::optional<at::Tensor>& s0, double scale, int64_t checkpoint_every, \
      bool save);                                                                                          \
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>                       \
      gated_delta_backward_##dev(const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_state,    \
                                 const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,            \
                                 const at::Tensor& g, const at::Tensor& beta, const at::Tensor& ckpt,      \
                                 double scale, int64_t checkpoint_every);                                  \
  at::Tensor gated_delta_decode_##dev(at::Tensor& state, const at::Tensor& q, const at::Tensor& k,         \
                                      const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,    \
                                      const std::optional<at::Tensor>& active, double scale);
FT_GATED_DELTA_DECLS(cpu)
FT_GATED_DELTA_DECLS(cuda)
#undef FT_GATED_DELTA_DECLS

// ---- decode_attention (CPU only; see the schema in torch_bindings.cpp) ------------------
at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& key_valid, double scale);

// ---- attention_softmax_grad (CPU only; see the schema in torch_bindings.cpp) -------------
std::tuple<at::Tensor, at::Tensor> attention_softmax_grad_cpu(const at::Tensor& s, const at::Tensor& dp,
                                                              const std::optional<at::Tensor>& mask, double scale,
                                                              at::ScalarType out_dtype);

// ---- decode_fused: a decode step's elementwise work (CPU only; schemas in torch_bindings.cpp) ----
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_cpu(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps);
at::Tensor rotary_cache_write_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                  at::Tensor& k_cache, at::Tensor& v_cache, int64_t column, int64_t n_heads,
                                  const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                                  double norm_eps);
at::Tensor silu_mul_cpu(const at::Tensor& gate_up);

}  // namespace fasttrain
