// Fused policy loss (CISPO | DAPO | GRPO, KL k3 or k3_ratio, REPO-R, token mask), CUDA. Same per-token math as
// the CPU kernel (core/math.h policy_token). Three launches, no host sync (CUDA-graph safe):
//  1. chunk kernel: one CTA per (row, kChunk tokens); each thread does a few tokens, writes the
//     gradient coefficient and block-reduces the 9 sums into partial[chunk] (fixed order, so
//     results are deterministic);
//  2. finalize kernel: one CTA adds the chunk partials in order (per row for GRPO) and writes the
//     loss, the stats vector and the per-row scale of the gradient;
//  3. backward: grad = grad_loss * coef * rowscale[row], elementwise.
// What it is not: tuned. Napkin math: fp32, 1M tokens, forward moves 20 MB (24 with KL), backward
// 8 MB: ~9 us at 3.35 TB/s; the launches (~3 x 3 us) dominate, as they do for any loss this size.
// Kernels and launch sequences: cuda/kernels/policy_loss.cuh (shared with the CUDA emulator); this
// file holds the torch wrappers.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "core/checks.h"
#include "core/policy_loss_checks.h"
#include "core/math.h"
#include "cuda/kernels/policy_loss.cuh"
#include "cuda/torch_device.h"
#include "ops.h"

namespace fasttrain {
namespace fm = fasttrain::math;
namespace pk = fasttrain::cuda::policy_loss;

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss_cuda(
    const at::Tensor& logp_, const at::Tensor& old_logp_, const at::Tensor& advantages_, const at::Tensor& mask_,
    const std::optional<at::Tensor>& ref_logp_, const std::optional<at::Tensor>& token_normalizer,
    int64_t loss_type, double beta, double eps_low, double eps_high, double cispo_cap, double zeta,
    double token_normalizer_value, int64_t kl_type) {
  constexpr const char* op = "fasttrain::policy_loss";
  FT_CHECK_DEVICE_TYPE(op, logp_, at::kCUDA);
  check_inputs(op, logp_, old_logp_, advantages_, mask_, ref_logp_, token_normalizer, loss_type, kl_type);
  const c10::cuda::CUDAGuard guard(logp_.device());
  const bool has_kl = ref_logp_.has_value() && beta != 0.0;
  const at::Tensor logp = logp_.contiguous(), old_logp = old_logp_.contiguous();
  const at::Tensor adv = advantages_.contiguous(), mask = mask_.contiguous();
  const at::Tensor ref = has_kl ? ref_logp_->contiguous() : at::Tensor();
  const at::Tensor norm = token_normalizer.has_value() ? token_normalizer->contiguous() : at::Tensor();
  const bool adv_per_token = adv.dim() == 2;
  const bool mask_is_bool = mask.scalar_type() == at::kBool;  // else float32 (check_inputs)
  const int64_t B = logp.size(0), T = logp.size(1);
  const auto f32 = logp.options().dtype(at::kFloat);
  at::Tensor coef = at::empty({B, T}, f32);
  at::Tensor rowscale = at::empty({B}, f32);
  at::Tensor loss = at::empty({}, f32);
  at::Tensor stats = at::empty({fm::kPolicyStats}, f32);
  fasttrain::cuda::TorchDevice dev(logp);
  pk::forward(dev, logp.scalar_type(), logp.const_data_ptr(), old_logp.const_data_ptr(), adv.const_data_ptr<float>(),
              adv_per_token, mask_is_bool ? nullptr : mask.const_data_ptr<float>(),
              mask_is_bool ? static_cast<const uint8_t*>(mask.const_data_ptr()) : nullptr,
              has_kl ? ref.const_data_ptr() : nullptr, norm.defined() ? norm.const_data_ptr<float>() : nullptr,
              token_normalizer_value, B, T, loss_type, beta, eps_low, eps_high, cispo_cap, zeta, kl_type,
              coef.data_ptr<float>(), rowscale.data_ptr<float>(), loss.data_ptr<float>(), stats.data_ptr<float>());
  return {loss, stats, coef, rowscale};
}

at::Tensor policy_loss_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& coef_, const at::Tensor& rowscale_,
                                     at::ScalarType dtype) {
  constexpr const char* op = "fasttrain::policy_loss_backward";
  FT_CHECK_DEVICE_TYPE(op, coef_, at::kCUDA);
  check_policy_loss_backward(op, grad_loss, coef_, rowscale_, dtype);
  const c10::cuda::CUDAGuard guard(coef_.device());
  const at::Tensor coef = coef_.contiguous(), rowscale = rowscale_.contiguous();
  const at::Tensor g = grad_loss.to(at::kFloat).contiguous();
  const int64_t B = coef.size(0), T = coef.size(1), n = B * T;
  at::Tensor out = at::empty({B, T}, coef.options().dtype(dtype));
  fasttrain::cuda::TorchDevice dev(coef);
  pk::backward(dev, dtype, g.const_data_ptr<float>(), coef.const_data_ptr<float>(), rowscale.const_data_ptr<float>(), B,
               T, out.data_ptr());
  return out;
}

}  // namespace fasttrain

TORCH_LIBRARY_IMPL(fasttrain, CUDA, m) {
  m.impl("policy_loss", &fasttrain::policy_loss_cuda);
  m.impl("policy_loss_backward", &fasttrain::policy_loss_backward_cuda);
}
