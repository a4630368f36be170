// Argument checks of fasttrain::policy_loss, shared by the CPU and CUDA host functions so both
// backends reject the same inputs with the same messages.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

#include "core/variant.h"
#include "core/checks.h"

namespace fasttrain {
FT_VARIANT_BEGIN

inline void check_inputs(const char* op, const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
                  const at::Tensor& mask, const std::optional<at::Tensor>& ref_logp,
                  const std::optional<at::Tensor>& token_normalizer, int64_t loss_type, int64_t kl_type) {
  FT_CHECK_DIM(op, logp, 2);
  FT_CHECK_FLOATING(op, logp);
  FT_CHECK_ARG(old_logp.sizes() == logp.sizes(), op, "old_logp", "must have logp's shape ", logp.sizes(),
               ", got ", old_logp.sizes());
  FT_CHECK_DTYPE(op, old_logp, logp.scalar_type());
  FT_CHECK_SAME_DEVICE(op, logp, old_logp);
  FT_CHECK_ARG(mask.sizes() == logp.sizes(), op, "mask", "must have logp's shape ", logp.sizes(), ", got ",
               mask.sizes());
  FT_CHECK_ARG(mask.scalar_type() == at::kFloat || mask.scalar_type() == at::kBool, op, "mask",
               "must have dtype float32 (token weights) or bool, got ", mask.scalar_type());
  FT_CHECK_SAME_DEVICE(op, logp, mask);
  FT_CHECK_DTYPE(op, advantages, at::kFloat);
  FT_CHECK_SAME_DEVICE(op, logp, advantages);
  FT_CHECK_ARG(advantages.sizes() == logp.sizes() || (advantages.dim() == 1 && advantages.size(0) == logp.size(0)),
               op, "advantages", "must be [B] or [B, T] with [B, T] = ", logp.sizes(), ", got ", advantages.sizes());
  if (ref_logp.has_value()) {
    const at::Tensor& ref = *ref_logp;
    FT_CHECK_ARG(ref.sizes() == logp.sizes(), op, "ref_logp", "must have logp's shape ", logp.sizes(), ", got ",
                 ref.sizes());
    FT_CHECK_DTYPE(op, ref, logp.scalar_type());
    FT_CHECK_SAME_DEVICE(op, logp, ref);
  }
  if (token_normalizer.has_value()) {
    const at::Tensor& tn = *token_normalizer;
    FT_CHECK_ARG(tn.numel() == 1, op, "token_normalizer", "must hold one value, got shape ", tn.sizes());
    FT_CHECK_DTYPE(op, tn, at::kFloat);
    FT_CHECK_SAME_DEVICE(op, logp, tn);
  }
  FT_CHECK_ARG(loss_type >= 0 && loss_type <= 2, op, "loss_type", "must be 0 (cispo), 1 (dapo) or 2 (grpo), got ",
               loss_type);
  FT_CHECK_ARG(kl_type == 0 || kl_type == 1, op, "kl_type", "must be 0 (k3) or 1 (k3_ratio), got ", kl_type);
}

// The CUDA backward's arguments (the CPU backward checks its own).
inline void check_policy_loss_backward(const char* op, const at::Tensor& grad_loss, const at::Tensor& coef,
                                       const at::Tensor& rowscale, at::ScalarType dtype) {
  FT_CHECK_DIM(op, coef, 2);
  FT_CHECK_DTYPE(op, coef, at::kFloat);
  FT_CHECK_DTYPE(op, rowscale, at::kFloat);
  FT_CHECK_SAME_DEVICE(op, coef, rowscale);
  FT_CHECK_SAME_DEVICE(op, coef, grad_loss);
  FT_CHECK_ARG(rowscale.dim() == 1 && rowscale.size(0) == coef.size(0), op, "rowscale", "must be [B] with B = ",
               coef.size(0), ", got ", rowscale.sizes());
  FT_CHECK_ARG(grad_loss.numel() == 1, op, "grad_loss", "must hold one value, got shape ", grad_loss.sizes());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": dtype must be float32, float16 or bfloat16, got ", dtype);
}

FT_VARIANT_END
}  // namespace fasttrain
