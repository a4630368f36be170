// moe_experts on CUDA: the routed experts of a mixture-of-experts layer, forward and backward, by the
// grouped kernels of cuda/kernels/moe_experts.cuh (whose header says what they do, what they are not,
// and which paths the CUDA emulator checks and which need a GPU). This file is the torch-facing part:
// the device type, the device guard and the caching allocator around the shared op code.
// Not run on a GPU yet: it compiles and links here, and the emulator runs the same kernels and launch
// sequences in tests/cuda_emu against float64.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "core/checks.h"
#include "cuda/kernels/moe_experts.cuh"
#include "cuda/torch_device.h"

namespace fasttrain {
namespace {
namespace mek = fasttrain::cuda::moe_experts;

at::Tensor empty_cuda(c10::IntArrayRef sizes, const at::TensorOptions& options) { return at::empty(sizes, options); }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_experts_cuda(
    const at::Tensor& x, const at::Tensor& expert_index, const at::Tensor& routing_weights,
    const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_absmax, const at::Tensor& down,
    const std::optional<at::Tensor>& down_absmax, int64_t blocksize, int64_t intermediate,
    const std::optional<at::Tensor>& gu_a, const std::optional<at::Tensor>& gu_b,
    const std::optional<at::Tensor>& dn_a, const std::optional<at::Tensor>& dn_b, double scale, bool save) {
  constexpr const char* op = "fasttrain::moe_experts";
  FT_CHECK_DEVICE_TYPE(op, x, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  fasttrain::cuda::TorchDevice dev(x);
  return mek::run_forward(op, dev, empty_cuda, x, expert_index, routing_weights, gate_up, gate_up_absmax, down,
                          down_absmax, blocksize, intermediate, gu_a, gu_b, dn_a, dn_b, scale, save);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_experts_backward_cuda(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& expert_index, const at::Tensor& routing_weights,
    const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_absmax, const at::Tensor& down,
    const std::optional<at::Tensor>& down_absmax, int64_t blocksize, int64_t intermediate,
    const std::optional<at::Tensor>& gu_a, const std::optional<at::Tensor>& gu_b,
    const std::optional<at::Tensor>& dn_a, const std::optional<at::Tensor>& dn_b, double scale,
    const at::Tensor& order, const at::Tensor& offsets, const at::Tensor& h, const at::Tensor& out,
    std::array<bool, 3> mask) {
  constexpr const char* op = "fasttrain::moe_experts_backward";
  FT_CHECK_DEVICE_TYPE(op, x, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  fasttrain::cuda::TorchDevice dev(x);
  return mek::run_backward(op, dev, empty_cuda, dy, x, expert_index, routing_weights, gate_up, gate_up_absmax, down,
                           down_absmax, blocksize, intermediate, gu_a, gu_b, dn_a, dn_b, scale, order, offsets, h,
                           out, mask);
}

}  // namespace
}  // namespace fasttrain

TORCH_LIBRARY_IMPL(fasttrain, CUDA, m) {
  m.impl("moe_experts", &fasttrain::moe_experts_cuda);
  m.impl("moe_experts_backward", &fasttrain::moe_experts_backward_cuda);
}
