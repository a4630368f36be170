// fasttrain_emu::policy_loss and policy_loss_backward: the CUDA kernels and launch sequences of
// cuda/kernels/policy_loss.cuh on CPU tensors, with the CUDA wrappers' checks.
#include "cuda_emu/prelude.h"

#include <torch/library.h>

#include "core/policy_loss_checks.h"
#include "cuda/kernels/policy_loss.cuh"
#include "cuda_emu/device.h"

namespace fasttrain::cuda_emu {
namespace policy_loss_emu {  // named, not anonymous: the unity build joins the emulator's files
namespace fm = fasttrain::math;
namespace pk = fasttrain::cuda::policy_loss;

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& logp_, const at::Tensor& old_logp_, const at::Tensor& advantages_, const at::Tensor& mask_,
    const std::optional<at::Tensor>& ref_logp_, const std::optional<at::Tensor>& token_normalizer, int64_t loss_type,
    double beta, double eps_low, double eps_high, double cispo_cap, double zeta, double token_normalizer_value,
    int64_t kl_type) {
  check_inputs("fasttrain_emu::policy_loss", logp_, old_logp_, advantages_, mask_, ref_logp_, token_normalizer,
               loss_type, kl_type);
  begin_op();
  const at::Tensor logp = logp_.contiguous(), old_logp = old_logp_.contiguous();
  const at::Tensor adv = advantages_.contiguous(), mask = mask_.contiguous();
  const at::Tensor ref = ref_logp_.has_value() ? ref_logp_->contiguous() : at::Tensor();
  const at::Tensor norm = token_normalizer.has_value() ? token_normalizer->contiguous() : at::Tensor();
  const bool mask_is_bool = mask.scalar_type() == at::kBool;
  const int64_t B = logp.size(0), T = logp.size(1);
  const auto f32 = logp.options().dtype(at::kFloat);
  at::Tensor coef = poisoned({B, T}, f32), rowscale = poisoned({B}, f32);
  at::Tensor loss = poisoned({}, f32), stats = poisoned({fm::kPolicyStats}, f32);
  EmuDevice dev;
  pk::forward(dev, logp.scalar_type(), logp.const_data_ptr(), old_logp.const_data_ptr(), adv.const_data_ptr<float>(),
              adv.dim() == 2, mask_is_bool ? nullptr : mask.const_data_ptr<float>(),
              mask_is_bool ? static_cast<const uint8_t*>(mask.const_data_ptr()) : nullptr,
              ref.defined() ? ref.const_data_ptr() : nullptr, norm.defined() ? norm.const_data_ptr<float>() : nullptr,
              token_normalizer_value, B, T, loss_type, beta, eps_low, eps_high, cispo_cap, zeta, kl_type,
              coef.data_ptr<float>(), rowscale.data_ptr<float>(), loss.data_ptr<float>(), stats.data_ptr<float>());
  return {loss, stats, coef, rowscale};
}

at::Tensor backward(const at::Tensor& grad_loss, const at::Tensor& coef_, const at::Tensor& rowscale_,
                    at::ScalarType dtype) {
  check_policy_loss_backward("fasttrain_emu::policy_loss_backward", grad_loss, coef_, rowscale_, dtype);
  const at::Tensor coef = coef_.contiguous(), rowscale = rowscale_.contiguous();
  const at::Tensor g = grad_loss.to(at::kFloat).contiguous();
  at::Tensor out = poisoned(coef.sizes(), coef.options().dtype(dtype));
  EmuDevice dev;
  pk::backward(dev, dtype, g.const_data_ptr<float>(), coef.const_data_ptr<float>(), rowscale.const_data_ptr<float>(),
               coef.size(0), coef.size(1), out.data_ptr());
  return out;
}
}  // namespace policy_loss_emu

TORCH_LIBRARY_IMPL(fasttrain_emu, CPU, m) {
  m.impl("policy_loss", &policy_loss_emu::forward);
  m.impl("policy_loss_backward", &policy_loss_emu::backward);
}

}  // namespace fasttrain::cuda_emu
