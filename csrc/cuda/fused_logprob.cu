// fused_logprob, CUDA: per-token log p(target), entropy and the gradient vector (W[t] - p.W) / T
// from hidden states, with the logits held only one bounded [Nb, C] chunk at a time.
//
// What it is (the issue's "at minimum" design, the same math as the CPU kernel via core/math.h):
// for each token block (Nb <= N rows) and each vocabulary chunk (C rows of W):
//   1. cuBLAS GemmEx  Z = h_blk . W_c^T   -> fp32 scratch [Nb, C] (bf16/fp16 in, fp32 accumulate+out)
//   2. logprob_stats_kernel, one CTA per token: bias, 1/T, chunk max, lazy rebase of the running
//      (ref, s, u) state, target logit, and (only when hidden needs grad) p~ = exp(z - ref) written
//      as the GEMM operand [Nb, C]; in the rare event the reference moves (see kLseLazyMargin) it
//      also rescales that token's p.W row.
//   3. cuBLAS GemmEx  acc_blk += p~ . W_c  (fp32 accumulator [Nb, H], only when hidden needs grad)
// then logprob_finalize_kernel: lse, log p, entropy, grad_vec = (W[t] - acc / s) / T.
// Forward + hidden gradient therefore costs the two matrix products; the chunk scratch is
// Nb*C*(4 + 2) bytes (default budget 256 MiB: N=15360 -> C=2048 per chunk in bf16).
// Weight gradient (only when W requires grad): per vocabulary chunk, per token block, recompute Z
// (GEMM), D = g (onehot - exp(z - lse)) / T (+ column sums for the bias, only when there is one),
// then dW_c += D^T . h_blk (GEMM, fp32 accumulate), cast into dW once per chunk.
// GEMM operands p~ and D: bf16 for bf16 inputs (bf16 has float32's exponent range, so nothing
// underflows; its rounding is the inputs' own precision), float32 for fp16 inputs: per-token
// gradients near 1/N (~1e-5) times probabilities near 1/V are far below fp16's smallest subnormal
// (6e-8), so an fp16 D would lose most of dW. The fp16 path therefore widens one W chunk (forward)
// and hidden (weight backward) to float32 and runs those two GEMMs in float32.
// Targets outside [0, V) that are not ignore_index raise the CPU's error (a one-kernel search and an
// 16-byte read-back, so one host sync per call); inside a CUDA-graph capture, where no sync is
// allowed, the search is skipped and such a target gives NaN.
// What it is not (yet): the fully fused kernel where logits never leave on-chip memory (CCE /
// Liger style); step 2 reads Z once from L2/HBM. Not run on a GPU yet: written to the CPU kernel's
// tested math, compiled for sm_80 and sm_90a, run on the CUDA emulator. Kernels and launch
// sequences: cuda/kernels/fused_logprob.cuh (shared with the emulator); this file holds the torch
// wrappers.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "core/checks.h"
#include "core/fused_logprob_checks.h"
#include "cuda/kernels/fused_logprob.cuh"
#include "cuda/torch_device.h"
#include "ops.h"

namespace fasttrain {
namespace flk = fasttrain::cuda::fused_logprob;

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_logprob_forward_cuda(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
    const std::optional<at::Tensor>& bias, double temperature, int64_t ignore_index, bool compute_grad,
    int64_t chunk_bytes, const std::optional<at::Tensor>& keep_delta) {
  constexpr const char* op = "fasttrain::fused_logprob_forward";
  FT_CHECK_DEVICE_TYPE(op, hidden, at::kCUDA);
  fused_logprob_check_args(op, hidden, weight, targets, bias, temperature);
  fused_logprob_check_keep_delta(op, hidden, keep_delta);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor h = hidden.contiguous(), w = weight.contiguous(), tg = targets.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t N = h.size(0), H = h.size(1), V = w.size(0);
  const at::Tensor kd = keep_delta.has_value()
                            ? keep_delta->to(flk::acc_type_of(h.scalar_type())).contiguous() : at::Tensor();
  const at::TensorOptions ao = h.options().dtype(flk::acc_type_of(h.scalar_type()));
  at::Tensor logp = at::empty({N}, ao), ent = at::empty({N}, ao), stats = at::empty({keep_delta.has_value() ? 3 : 2, N}, ao);
  at::Tensor grad_vec = compute_grad ? at::zeros({N, H}, ao) : at::empty({0, H}, ao);
  fasttrain::cuda::TorchDevice dev(h);
  flk::forward(dev, op, h.scalar_type(), h.const_data_ptr(), w.const_data_ptr(), tg.const_data_ptr<int64_t>(),
               b.defined() ? b.const_data_ptr() : nullptr, N, H, V, temperature, ignore_index, compute_grad,
               chunk_bytes, logp.data_ptr(), ent.data_ptr(), stats.data_ptr(), grad_vec.data_ptr(),
               kd.defined() ? kd.const_data_ptr() : nullptr);
  return {logp, ent, stats, grad_vec};
}

std::tuple<at::Tensor, at::Tensor> fused_logprob_backward_weight_cuda(
    const at::Tensor& grad_logp, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
    const std::optional<at::Tensor>& bias, const at::Tensor& stats, double temperature, int64_t ignore_index,
    int64_t chunk_bytes) {
  constexpr const char* op = "fasttrain::fused_logprob_backward_weight";
  FT_CHECK_DEVICE_TYPE(op, hidden, at::kCUDA);
  fused_logprob_check_args(op, hidden, weight, targets, bias, temperature);
  const at::ScalarType acc_dt = flk::acc_type_of(hidden.scalar_type());
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  fused_logprob_check_backward_weight_args(op, hidden, grad_logp, stats, acc_dt);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor h = hidden.contiguous(), w = weight.contiguous(), tg = targets.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const at::Tensor g = grad_logp.to(acc_dt).contiguous(), l = stats.contiguous();
  at::Tensor grad_weight = at::empty_like(w, at::MemoryFormat::Contiguous);
  at::Tensor grad_bias = at::zeros({V}, h.options().dtype(acc_dt));  // stays 0 without a bias
  fasttrain::cuda::TorchDevice dev(h);
  flk::backward_weight(dev, op, h.scalar_type(), g.const_data_ptr(), h.const_data_ptr(), w.const_data_ptr(),
                       tg.const_data_ptr<int64_t>(), b.defined() ? b.const_data_ptr() : nullptr, l.const_data_ptr(), N,
                       H, V, temperature, ignore_index, chunk_bytes, grad_weight.data_ptr(), grad_bias.data_ptr(),
                       l.size(0) == 3);
  return {grad_weight, grad_bias};
}

}  // namespace fasttrain

TORCH_LIBRARY_IMPL(fasttrain, CUDA, m) {
  m.impl("fused_logprob_forward", &fasttrain::fused_logprob_forward_cuda);
  m.impl("fused_logprob_backward_weight", &fasttrain::fused_logprob_backward_weight_cuda);
}
