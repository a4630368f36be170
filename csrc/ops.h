// C++ declarations of every op's backend implementations. Schemas live in torch_bindings.cpp;
// each backend file registers its own implementations with TORCH_LIBRARY_IMPL at its bottom.
#pragma once
#include <ATen/core/Tensor.h>
#include <optional>
#include <tuple>

namespace fasttrain {

// ---- nf4 (issue 2) ------------------------------------------------------------------
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

// ---- fused_logprob (issue 3) ----------------------------------------------------------

// ---- policy_loss (issue 4) ------------------------------------------------------------
// Returns (loss fp32 [], stats fp32 [7], coef fp32 [B,T], rowscale fp32 [B]); see torch_bindings.cpp.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss_cpu(
    const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages, const at::Tensor& mask,
    const std::optional<at::Tensor>& ref_logp, const std::optional<at::Tensor>& token_normalizer,
    int64_t loss_type, double beta, double eps_low, double eps_high, double cispo_cap, double zeta,
    double token_normalizer_value);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss_cuda(
    const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages, const at::Tensor& mask,
    const std::optional<at::Tensor>& ref_logp, const std::optional<at::Tensor>& token_normalizer,
    int64_t loss_type, double beta, double eps_low, double eps_high, double cispo_cap, double zeta,
    double token_normalizer_value);
// grad_logp [B,T] of `dtype` = grad_loss * coef * rowscale[row].
at::Tensor policy_loss_backward_cpu(const at::Tensor& grad_loss, const at::Tensor& coef, const at::Tensor& rowscale,
                                    at::ScalarType dtype);
at::Tensor policy_loss_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& coef, const at::Tensor& rowscale,
                                     at::ScalarType dtype);

// ---- nf4_linear (issue 5) -------------------------------------------------------------

}  // namespace fasttrain
