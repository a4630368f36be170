// fasttrain_emu::moe_experts and moe_experts_backward: the CUDA op's code (cuda/kernels/moe_experts.cuh:
// its checks, conversions, the grouping, grouped-projection, combine and gradient kernels and their
// launch sequences) on CPU tensors, outputs poisoned so that an element no thread writes shows as NaN.
#include "cuda_emu/prelude.h"

#include <torch/library.h>

#include "cuda/kernels/moe_experts.cuh"
#include "cuda_emu/device.h"

namespace fasttrain::cuda_emu {
namespace moe_experts_emu {  // named, not anonymous: the unity build joins the emulator's files
namespace mek = fasttrain::cuda::moe_experts;

at::Tensor alloc(c10::IntArrayRef sizes, const at::TensorOptions& options) { return poisoned(sizes, options); }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& x, const at::Tensor& expert_index, const at::Tensor& routing_weights,
    const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_absmax, const at::Tensor& down,
    const std::optional<at::Tensor>& down_absmax, int64_t blocksize, int64_t intermediate,
    const std::optional<at::Tensor>& gu_a, const std::optional<at::Tensor>& gu_b,
    const std::optional<at::Tensor>& dn_a, const std::optional<at::Tensor>& dn_b, double scale, bool save) {
  begin_op();
  EmuDevice dev;
  return mek::run_forward("fasttrain_emu::moe_experts", dev, alloc, x, expert_index, routing_weights, gate_up,
                          gate_up_absmax, down, down_absmax, blocksize, intermediate, gu_a, gu_b, dn_a, dn_b, scale,
                          save);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& expert_index, const at::Tensor& routing_weights,
    const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_absmax, const at::Tensor& down,
    const std::optional<at::Tensor>& down_absmax, int64_t blocksize, int64_t intermediate,
    const std::optional<at::Tensor>& gu_a, const std::optional<at::Tensor>& gu_b,
    const std::optional<at::Tensor>& dn_a, const std::optional<at::Tensor>& dn_b, double scale,
    const at::Tensor& order, const at::Tensor& offsets, const at::Tensor& h, const at::Tensor& out,
    std::array<bool, 3> mask) {
  begin_op();
  EmuDevice dev;
  return mek::run_backward("fasttrain_emu::moe_experts_backward", dev, alloc, dy, x, expert_index, routing_weights,
                           gate_up, gate_up_absmax, down, down_absmax, blocksize, intermediate, gu_a, gu_b, dn_a,
                           dn_b, scale, order, offsets, h, out, mask);
}
}  // namespace moe_experts_emu

TORCH_LIBRARY_IMPL(fasttrain_emu, CPU, m) {
  m.impl("moe_experts", &moe_experts_emu::forward);
  m.impl("moe_experts_backward", &moe_experts_emu::backward);
}

}  // namespace fasttrain::cuda_emu
