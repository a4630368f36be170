// fasttrain_emu::fused_logprob_forward and fused_logprob_backward_weight: the CUDA kernels and the
// chunk loop of cuda/kernels/fused_logprob.cuh on CPU tensors (the GEMMs by at::mm), with the CUDA
// wrappers' checks.
#include "cuda_emu/prelude.h"

#include <torch/library.h>

#include "core/fused_logprob_checks.h"
#include "cuda/kernels/fused_logprob.cuh"
#include "cuda_emu/device.h"

namespace fasttrain::cuda_emu {
namespace fused_logprob_emu {  // named, not anonymous: the unity build joins the emulator's files
namespace flk = fasttrain::cuda::fused_logprob;

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& hidden, const at::Tensor& weight,
                                                                   const at::Tensor& targets,
                                                                   const std::optional<at::Tensor>& bias,
                                                                   double temperature, int64_t ignore_index,
                                                                   bool compute_grad, int64_t chunk_bytes,
                                                                   const std::optional<at::Tensor>& keep_delta) {
  constexpr const char* op = "fasttrain_emu::fused_logprob_forward";
  fused_logprob_check_args(op, hidden, weight, targets, bias, temperature);
  fused_logprob_check_keep_delta(op, hidden, keep_delta);
  begin_op();
  const at::Tensor h = hidden.contiguous(), w = weight.contiguous(), tg = targets.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t N = h.size(0), H = h.size(1), V = w.size(0);
  const at::Tensor kd = keep_delta.has_value()
                            ? keep_delta->to(flk::acc_type_of(h.scalar_type())).contiguous() : at::Tensor();
  const at::TensorOptions ao = h.options().dtype(flk::acc_type_of(h.scalar_type()));
  at::Tensor logp = poisoned({N}, ao), ent = poisoned({N}, ao), stats = poisoned({keep_delta.has_value() ? 3 : 2, N}, ao);
  at::Tensor grad_vec = compute_grad ? at::zeros({N, H}, ao) : at::empty({0, H}, ao);
  EmuDevice dev;
  flk::forward(dev, op, h.scalar_type(), h.const_data_ptr(), w.const_data_ptr(), tg.const_data_ptr<int64_t>(),
               b.defined() ? b.const_data_ptr() : nullptr, N, H, V, temperature, ignore_index, compute_grad,
               chunk_bytes, logp.data_ptr(), ent.data_ptr(), stats.data_ptr(), grad_vec.data_ptr(),
               kd.defined() ? kd.const_data_ptr() : nullptr);
  return {logp, ent, stats, grad_vec};
}

std::tuple<at::Tensor, at::Tensor> backward_weight(const at::Tensor& grad_logp, const at::Tensor& hidden,
                                                   const at::Tensor& weight, const at::Tensor& targets,
                                                   const std::optional<at::Tensor>& bias, const at::Tensor& stats,
                                                   double temperature, int64_t ignore_index, int64_t chunk_bytes) {
  constexpr const char* op = "fasttrain_emu::fused_logprob_backward_weight";
  fused_logprob_check_args(op, hidden, weight, targets, bias, temperature);
  const at::ScalarType acc_dt = flk::acc_type_of(hidden.scalar_type());
  fused_logprob_check_backward_weight_args(op, hidden, grad_logp, stats, acc_dt);
  begin_op();
  const at::Tensor h = hidden.contiguous(), w = weight.contiguous(), tg = targets.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const at::Tensor g = grad_logp.to(acc_dt).contiguous(), l = stats.contiguous();
  const int64_t N = h.size(0), H = h.size(1), V = w.size(0);
  at::Tensor grad_weight = poisoned(w.sizes(), w.options());
  at::Tensor grad_bias = at::zeros({V}, h.options().dtype(acc_dt));
  EmuDevice dev;
  flk::backward_weight(dev, op, h.scalar_type(), g.const_data_ptr(), h.const_data_ptr(), w.const_data_ptr(),
                       tg.const_data_ptr<int64_t>(), b.defined() ? b.const_data_ptr() : nullptr, l.const_data_ptr(), N,
                       H, V, temperature, ignore_index, chunk_bytes, grad_weight.data_ptr(), grad_bias.data_ptr(),
                       l.size(0) == 3);
  return {grad_weight, grad_bias};
}
}  // namespace fused_logprob_emu

TORCH_LIBRARY_IMPL(fasttrain_emu, CPU, m) {
  m.impl("fused_logprob_forward", &fused_logprob_emu::forward);
  m.impl("fused_logprob_backward_weight", &fused_logprob_emu::backward_weight);
}

}  // namespace fasttrain::cuda_emu
