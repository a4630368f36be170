// C++ declarations of every op's backend implementations. Schemas live in torch_bindings.cpp;
// each backend file registers its own implementations with TORCH_LIBRARY_IMPL at its bottom.
#pragma once
#include <ATen/core/Tensor.h>
#include <array>
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

// ---- nf4_linear (issue 5) -------------------------------------------------------------
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

}  // namespace fasttrain
