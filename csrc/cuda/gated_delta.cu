// The gated delta rule, CUDA: the same recurrence and element math as csrc/cpu/gated_delta.cpp
// (core/math.h gdr_*), for a GPU without flash-linear-attention (fasttrain.ops.gated_delta picks fla's
// chunked kernel when it is installed; this one is the fallback, so that the op always has a kernel).
// Kernels and launch sequences: cuda/kernels/gated_delta.cuh (shared with the CUDA emulator, which
// runs them in the tests); this file holds the torch wrappers.
// What it is not: fast. Tokens are sequential within a CTA, and B·Hv CTAs fill an H100 only at large
// batches; the chunked form (matmuls over chunks) is what a GPU wants, which is fla's. Not run on a
// GPU yet: it compiles in CI, runs on the CUDA emulator, and the selftest compares it with the float64
// reference on a GPU.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "core/checks.h"
#include "core/gated_delta_checks.h"
#include "core/math.h"
#include "cuda/kernels/gated_delta.cuh"
#include "cuda/torch_device.h"
#include "ops.h"

namespace fasttrain {
namespace gdk = fasttrain::cuda::gated_delta;

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_delta_forward_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
    const std::optional<at::Tensor>& s0, double scale, int64_t checkpoint_every, bool save) {
  constexpr const char* op = "fasttrain::gated_delta_forward";
  FT_CHECK_DEVICE_TYPE(op, q, at::kCUDA);
  check_gated_delta_inputs(op, q, k, v, g, beta, s0, checkpoint_every);
  check_gated_delta_cuda_limits(op, checkpoint_every, q.size(3), v.size(3), q.element_size());
  const c10::cuda::CUDAGuard guard(q.device());
  const gdk::Dims dm = gdk::dims_of(q.sizes(), v.sizes());
  const int64_t C = checkpoint_every, N = (dm.T + C - 1) / C;
  at::Tensor o = at::empty_like(v);
  at::Tensor S = at::empty({dm.B, dm.Hv, dm.Dk, dm.Dv}, v.options());
  at::Tensor ckpt = at::empty({save ? dm.B : 0, dm.Hv, N, dm.Dk, dm.Dv}, v.options());
  fasttrain::cuda::TorchDevice dev(q);
  gdk::forward(dev, q.scalar_type(), q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
               s0.has_value() ? s0->data_ptr() : nullptr, scale, C, save, dm, o.data_ptr(), S.data_ptr(),
               save ? ckpt.data_ptr() : nullptr);
  return {o, S, ckpt};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_delta_backward_cuda(
    const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_state, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& ckpt, double scale,
    int64_t checkpoint_every) {
  constexpr const char* op = "fasttrain::gated_delta_backward";
  FT_CHECK_DEVICE_TYPE(op, q, at::kCUDA);
  check_gated_delta_backward_inputs(op, grad_o, grad_state, q, k, v, g, beta, ckpt, checkpoint_every);
  check_gated_delta_cuda_limits(op, checkpoint_every, q.size(3), v.size(3), q.element_size());
  const c10::cuda::CUDAGuard guard(q.device());
  const gdk::Dims dm = gdk::dims_of(q.sizes(), v.sizes());
  const int64_t C = checkpoint_every;
  at::Tensor dq = at::empty({dm.B, dm.T, dm.Hv, dm.Dk}, q.options());
  at::Tensor dk = at::empty({dm.B, dm.T, dm.Hv, dm.Dk}, q.options());
  at::Tensor dv = at::empty_like(v), dg = at::empty_like(g), dbeta = at::empty_like(beta);
  at::Tensor ds0 = at::empty({dm.B, dm.Hv, dm.Dk, dm.Dv}, v.options());
  fasttrain::cuda::TorchDevice dev(q);
  gdk::backward(dev, q.scalar_type(), grad_o.data_ptr(), grad_state.has_value() ? grad_state->data_ptr() : nullptr,
                q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), ckpt.data_ptr(), scale, C,
                dm, dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dg.data_ptr(), dbeta.data_ptr(), ds0.data_ptr());
  return {dq, dk, dv, dg, dbeta, ds0};
}

at::Tensor gated_delta_decode_cuda(at::Tensor& state, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                                   const std::optional<at::Tensor>& active, double scale) {
  constexpr const char* op = "fasttrain::gated_delta_decode_";
  FT_CHECK_DEVICE_TYPE(op, q, at::kCUDA);
  check_gated_delta_decode_inputs(op, state, q, k, v, g, beta, active);
  check_gated_delta_cuda_limits(op, 1, q.size(3), v.size(3), q.element_size());
  const c10::cuda::CUDAGuard guard(q.device());
  const gdk::Dims dm = gdk::dims_of(q.sizes(), v.sizes());
  at::Tensor o = at::empty_like(v);
  fasttrain::cuda::TorchDevice dev(q);
  gdk::decode(dev, q.scalar_type(), state.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(),
              beta.data_ptr(), active.has_value() ? active->data_ptr<bool>() : nullptr, scale, dm, o.data_ptr());
  return o;
}

TORCH_LIBRARY_IMPL(fasttrain, CUDA, m) {
  m.impl("gated_delta_decode_", &gated_delta_decode_cuda);
  m.impl("gated_delta_forward", &gated_delta_forward_cuda);
  m.impl("gated_delta_backward", &gated_delta_backward_cuda);
}

}  // namespace fasttrain
