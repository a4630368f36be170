// Argument checks of fasttrain::fused_logprob_forward and fused_logprob_backward_weight, shared by
// the CPU and CUDA host functions so both backends reject the same inputs with the same messages.
// The device-type check (CPU or CUDA) stays in each backend, and so does the search for a target
// outside [0, V) (the CPU scans the ids; CUDA finds the first in a kernel and reads it back): both
// report it with fused_logprob_bad_target, so the message is the same on every device.
#pragma once
#include <ATen/core/Tensor.h>

#include <cmath>
#include <optional>

#include "core/variant.h"
#include "core/checks.h"

namespace fasttrain {
FT_VARIANT_BEGIN

inline void fused_logprob_check_args(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                                     const at::Tensor& targets, const std::optional<at::Tensor>& bias,
                                     double temperature) {
  FT_CHECK_DIM(op, hidden, 2);
  FT_CHECK_DIM(op, weight, 2);
  FT_CHECK_DIM(op, targets, 1);
  FT_CHECK_ARG(hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kHalf ||
                   hidden.scalar_type() == at::kBFloat16 || hidden.scalar_type() == at::kDouble,
               op, "hidden", "must be float32, float16, bfloat16 or float64, got ", hidden.scalar_type());
  FT_CHECK_ARG(weight.scalar_type() == hidden.scalar_type(), op, "weight", "must have the dtype of hidden (",
               hidden.scalar_type(), "), got ", weight.scalar_type());
  FT_CHECK_DTYPE(op, targets, at::kLong);
  FT_CHECK_SAME_DEVICE(op, hidden, weight);
  FT_CHECK_SAME_DEVICE(op, hidden, targets);
  FT_CHECK_ARG(weight.size(1) == hidden.size(1), op, "weight", "must be [V, H] with H = hidden.size(1) = ",
               hidden.size(1), ", got shape ", weight.sizes());
  FT_CHECK_ARG(targets.size(0) == hidden.size(0), op, "targets", "must be [N] with N = hidden.size(0) = ",
               hidden.size(0), ", got shape ", targets.sizes());
  FT_CHECK_ARG(weight.size(0) >= 1, op, "weight", "must have at least one row (vocabulary entry)");
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0, op, ": argument 'temperature' must be a positive "
              "finite number, got ", temperature);
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    FT_CHECK_DIM(op, b, 1);
    FT_CHECK_ARG(b.size(0) == weight.size(0), op, "bias", "must be [V] with V = weight.size(0) = ",
                 weight.size(0), ", got shape ", b.sizes());
    FT_CHECK_ARG(b.scalar_type() == hidden.scalar_type(), op, "bias", "must have the dtype of hidden (",
                 hidden.scalar_type(), "), got ", b.scalar_type());
    FT_CHECK_SAME_DEVICE(op, hidden, b);
  }
}

// The error for targets[pos] = value outside [0, V) that is not ignore_index (every backend).
inline void fused_logprob_bad_target(const char* op, int64_t value, int64_t pos, int64_t V, int64_t ignore_index) {
  TORCH_CHECK(false, op, ": argument 'targets' holds ", value, " at position ", pos, ", outside [0, ", V,
              ") and not ignore_index (", ignore_index, ")");
}

// keep_delta [N] (float32, or float64 for float64 inputs): each token's kept set as delta >= 0 from its
// target logit (core/math.h kept_cut; +inf keeps the whole vocabulary). Its values are not scanned
// (a device read-back); a NaN or negative delta keeps the target alone, or more than its set.
inline void fused_logprob_check_keep_delta(const char* op, const at::Tensor& hidden,
                                           const std::optional<at::Tensor>& keep_delta) {
  if (!keep_delta.has_value()) return;
  const at::Tensor& d = *keep_delta;
  FT_CHECK_ARG(d.dim() == 1 && d.size(0) == hidden.size(0), op, "keep_delta", "must be [N] with N = ",
               hidden.size(0), ", got shape ", d.sizes());
  FT_CHECK_ARG(d.scalar_type() == at::kFloat || d.scalar_type() == at::kDouble, op, "keep_delta",
               "must be float32 or float64, got ", d.scalar_type());
  FT_CHECK_SAME_DEVICE(op, hidden, d);
}

// The backward's own inputs: grad_logp [N] and the forward's stats [2, N] in the accumulation dtype.
inline void fused_logprob_check_backward_weight_args(const char* op, const at::Tensor& hidden,
                                                     const at::Tensor& grad_logp, const at::Tensor& stats,
                                                     at::ScalarType acc_dt) {
  const int64_t N = hidden.size(0);
  FT_CHECK_ARG(grad_logp.dim() == 1 && grad_logp.size(0) == N, op, "grad_logp", "must be [N] with N = ", N,
               ", got shape ", grad_logp.sizes());
  FT_CHECK_ARG(stats.dim() == 2 && (stats.size(0) == 2 || stats.size(0) == 3) && stats.size(1) == N, op, "stats",
               "must be [2, N] or [3, N] with N = ", N, " (the forward's third output), got shape ", stats.sizes());
  FT_CHECK_DTYPE(op, stats, acc_dt);
  FT_CHECK_SAME_DEVICE(op, hidden, grad_logp);
  FT_CHECK_SAME_DEVICE(op, hidden, stats);
}

FT_VARIANT_END
}  // namespace fasttrain
