// Argument checks of the gated_delta ops, shared by the CPU and CUDA host functions.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

#include "core/variant.h"
#include "core/checks.h"

namespace fasttrain {
FT_VARIANT_BEGIN

inline void check_gated_delta_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& g, const at::Tensor& beta,
                                     const std::optional<at::Tensor>& s0, int64_t checkpoint_every) {
  FT_CHECK_DIM(op, q, 4);
  FT_CHECK_DIM(op, v, 4);
  FT_CHECK_ARG(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, op, "q",
               "must be float32 or float64 (the caller converts 16-bit inputs), got ", q.scalar_type());
  FT_CHECK_ARG(k.sizes() == q.sizes(), op, "k", "must have q's shape ", q.sizes(), ", got ", k.sizes());
  FT_CHECK_ARG(v.size(0) == q.size(0) && v.size(1) == q.size(1), op, "v", "must be [B, T, Hv, Dv] with q's B, T; got ",
               v.sizes());
  FT_CHECK_ARG(q.size(2) > 0 && v.size(2) % q.size(2) == 0, op, "v",
               "must have a multiple of q's heads, got ", v.size(2), " and ", q.size(2));
  FT_CHECK_ARG(q.size(3) > 0 && v.size(3) > 0, op, "q, v",
               "must have head dims of at least 1 (a delta rule over an empty key or value is no layer), got Dk = ",
               q.size(3), " and Dv = ", v.size(3));
  for (const at::Tensor* t : {&g, &beta})
    FT_CHECK_ARG(t->dim() == 3 && t->size(0) == v.size(0) && t->size(1) == v.size(1) && t->size(2) == v.size(2), op,
                 t == &g ? "g" : "beta", "must be [B, T, Hv], got ", t->sizes());
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta}) {
    FT_CHECK_ARG(t->scalar_type() == q.scalar_type(), op, "inputs", "must share one dtype");
    FT_CHECK_ARG(t->is_contiguous(), op, "inputs", "must be contiguous");
    FT_CHECK_ARG(t->device() == q.device(), op, "inputs", "must be on one device");
  }
  if (s0.has_value()) {
    FT_CHECK_ARG(s0->dim() == 4 && s0->size(0) == v.size(0) && s0->size(1) == v.size(2) &&
                     s0->size(2) == q.size(3) && s0->size(3) == v.size(3),
                 op, "initial_state", "must be [B, Hv, Dk, Dv], got ", s0->sizes());
    FT_CHECK_ARG(s0->scalar_type() == q.scalar_type() && s0->is_contiguous() && s0->device() == q.device(), op,
                 "initial_state", "must be contiguous, with q's dtype and device");
  }
  FT_CHECK_ARG(checkpoint_every >= 1, op, "checkpoint_every", "must be >= 1, got ", checkpoint_every);
}

inline void check_gated_delta_backward_inputs(const char* op, const at::Tensor& grad_o,
                                              const std::optional<at::Tensor>& grad_state, const at::Tensor& q,
                                              const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                              const at::Tensor& beta, const at::Tensor& ckpt,
                                              int64_t checkpoint_every) {
  check_gated_delta_inputs(op, q, k, v, g, beta, std::nullopt, checkpoint_every);
  FT_CHECK_ARG(grad_o.sizes() == v.sizes() && grad_o.scalar_type() == v.scalar_type() && grad_o.is_contiguous(), op,
               "grad_o", "must be contiguous with v's shape and dtype, got ", grad_o.sizes());
  const int64_t N = (q.size(1) + checkpoint_every - 1) / checkpoint_every;
  FT_CHECK_ARG(ckpt.dim() == 5 && ckpt.size(0) == v.size(0) && ckpt.size(1) == v.size(2) && ckpt.size(2) == N &&
                   ckpt.size(3) == q.size(3) && ckpt.size(4) == v.size(3) && ckpt.is_contiguous() &&
                   ckpt.scalar_type() == q.scalar_type(),
               op, "checkpoints", "must be the forward's saved states [B, Hv, ", N, ", Dk, Dv], got ", ckpt.sizes(),
               " (was the forward run with save = false?)");
  if (grad_state.has_value())
    FT_CHECK_ARG(grad_state->dim() == 4 && grad_state->size(0) == v.size(0) && grad_state->size(1) == v.size(2) &&
                     grad_state->size(2) == q.size(3) && grad_state->size(3) == v.size(3) &&
                     grad_state->is_contiguous() && grad_state->scalar_type() == q.scalar_type(),
                 op, "grad_state", "must be contiguous [B, Hv, Dk, Dv] with q's dtype, got ", grad_state->sizes());
}

// The CUDA kernels' limits: the backward's scratch keeps min(checkpoint_every, T) + 1 states per
// (row, value head), so checkpoint_every is capped there (at 128 x 128 float32 states and 48 value
// heads, 256 tokens is 0.8 GB per row; uncapped, a chunk of 4096 would be 12.9 GB), and a CTA's
// dynamic shared memory (2·Dk + 4·Dv elements in the backward) must fit the 48 KiB a kernel gets.
constexpr int64_t kMaxCheckpointEveryCuda = 256;
constexpr int64_t kMaxSharedBytesCuda = 48 << 10;
inline void check_gated_delta_cuda_limits(const char* op, int64_t checkpoint_every, int64_t Dk, int64_t Dv,
                                          int64_t element_bytes) {
  FT_CHECK_ARG(checkpoint_every <= kMaxCheckpointEveryCuda, op, "checkpoint_every",
               "must be at most ", kMaxCheckpointEveryCuda, " on CUDA (the backward holds that many states per row "
               "and value head in scratch), got ", checkpoint_every);
  FT_CHECK_ARG((2 * Dk + 4 * Dv) * element_bytes <= kMaxSharedBytesCuda, op, "q, v",
               "head dims Dk = ", Dk, ", Dv = ", Dv, " need ", (2 * Dk + 4 * Dv) * element_bytes,
               " bytes of shared memory per CTA on CUDA, more than the ", kMaxSharedBytesCuda, " a kernel gets");
}

// The decode step: q, k [B, 1, Hk, Dk], v [B, 1, Hv, Dv], g, beta [B, 1, Hv] (the forward's layout with
// T = 1), the state [B, Hv, Dk, Dv] written in place, active bool [B]?.
inline void check_gated_delta_decode_inputs(const char* op, const at::Tensor& state, const at::Tensor& q,
                                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                            const at::Tensor& beta, const std::optional<at::Tensor>& active) {
  check_gated_delta_inputs(op, q, k, v, g, beta, state, 1);
  FT_CHECK_ARG(q.size(1) == 1, op, "q", "must hold one token per row [B, 1, Hk, Dk], got ", q.sizes());
  if (active.has_value())
    FT_CHECK_ARG(active->dim() == 1 && active->size(0) == q.size(0) && active->scalar_type() == at::kBool &&
                     active->is_contiguous() && active->device() == q.device(),
                 op, "active", "must be a contiguous bool [B] on q's device, got ", active->sizes());
}

FT_VARIANT_END
}  // namespace fasttrain
