// fasttrain_emu::gated_delta_{forward,backward,decode_}: the CUDA kernels and launch sequences of
// cuda/kernels/gated_delta.cuh on CPU tensors, with the CUDA wrappers' checks and allocations.
#include "cuda_emu/prelude.h"

#include <torch/library.h>

#include "core/gated_delta_checks.h"
#include "cuda/kernels/gated_delta.cuh"
#include "cuda_emu/device.h"

namespace fasttrain::cuda_emu {
namespace gated_delta_emu {  // named, not anonymous: the unity build joins the emulator's files
namespace gdk = fasttrain::cuda::gated_delta;

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& g, const at::Tensor& beta,
                                                       const std::optional<at::Tensor>& s0, double scale,
                                                       int64_t checkpoint_every, bool save) {
  constexpr const char* op = "fasttrain_emu::gated_delta_forward";
  check_gated_delta_inputs(op, q, k, v, g, beta, s0, checkpoint_every);
  check_gated_delta_cuda_limits(op, checkpoint_every, q.size(3), v.size(3), q.element_size());
  begin_op();
  const gdk::Dims dm = gdk::dims_of(q.sizes(), v.sizes());
  const int64_t C = checkpoint_every, N = (dm.T + C - 1) / C;
  at::Tensor o = poisoned(v.sizes(), v.options());
  at::Tensor S = poisoned({dm.B, dm.Hv, dm.Dk, dm.Dv}, v.options());
  at::Tensor ckpt = poisoned({save ? dm.B : 0, dm.Hv, N, dm.Dk, dm.Dv}, v.options());
  EmuDevice dev;
  gdk::forward(dev, q.scalar_type(), q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
               s0.has_value() ? s0->data_ptr() : nullptr, scale, C, save, dm, o.data_ptr(), S.data_ptr(),
               save ? ckpt.data_ptr() : nullptr);
  return {o, S, ckpt};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_state, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& ckpt, double scale,
    int64_t checkpoint_every) {
  constexpr const char* op = "fasttrain_emu::gated_delta_backward";
  check_gated_delta_backward_inputs(op, grad_o, grad_state, q, k, v, g, beta, ckpt, checkpoint_every);
  check_gated_delta_cuda_limits(op, checkpoint_every, q.size(3), v.size(3), q.element_size());
  begin_op();
  const gdk::Dims dm = gdk::dims_of(q.sizes(), v.sizes());
  at::Tensor dq = poisoned({dm.B, dm.T, dm.Hv, dm.Dk}, q.options());
  at::Tensor dk = poisoned({dm.B, dm.T, dm.Hv, dm.Dk}, q.options());
  at::Tensor dv = poisoned(v.sizes(), v.options()), dg = poisoned(g.sizes(), g.options());
  at::Tensor dbeta = poisoned(beta.sizes(), beta.options());
  at::Tensor ds0 = poisoned({dm.B, dm.Hv, dm.Dk, dm.Dv}, v.options());
  EmuDevice dev;
  gdk::backward(dev, q.scalar_type(), grad_o.data_ptr(), grad_state.has_value() ? grad_state->data_ptr() : nullptr,
                q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), ckpt.data_ptr(), scale,
                checkpoint_every, dm, dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dg.data_ptr(), dbeta.data_ptr(),
                ds0.data_ptr());
  return {dq, dk, dv, dg, dbeta, ds0};
}

at::Tensor decode(at::Tensor& state, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& g, const at::Tensor& beta, const std::optional<at::Tensor>& active, double scale) {
  constexpr const char* op = "fasttrain_emu::gated_delta_decode_";
  check_gated_delta_decode_inputs(op, state, q, k, v, g, beta, active);
  check_gated_delta_cuda_limits(op, 1, q.size(3), v.size(3), q.element_size());
  begin_op();
  const gdk::Dims dm = gdk::dims_of(q.sizes(), v.sizes());
  at::Tensor o = poisoned(v.sizes(), v.options());
  EmuDevice dev;
  gdk::decode(dev, q.scalar_type(), state.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(),
              beta.data_ptr(), active.has_value() ? active->data_ptr<bool>() : nullptr, scale, dm, o.data_ptr());
  return o;
}
}  // namespace gated_delta_emu

TORCH_LIBRARY_IMPL(fasttrain_emu, CPU, m) {
  m.impl("gated_delta_forward", &gated_delta_emu::forward);
  m.impl("gated_delta_backward", &gated_delta_emu::backward);
  m.impl("gated_delta_decode_", &gated_delta_emu::decode);
}

}  // namespace fasttrain::cuda_emu
