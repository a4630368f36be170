// Argument checks of fasttrain::nf4_linear, nf4_linear_backward, nf4_dora_norm and
// nf4_weight_sq_norm, shared by the CPU and CUDA host functions so both backends reject the same
// inputs with the same messages. The device-type check (CPU or CUDA) stays in each backend; so does
// the one dtype rule that differs: the CPU op also takes a float64 x (the tests' exact path), the
// CUDA kernels do not (x_may_be_float64).
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

#include "core/variant.h"
#include "core/checks.h"

#define FT_CHECK_FLOATING_OR_DOUBLE(op, t)                                                     \
  FT_CHECK_ARG((t).scalar_type() == at::kFloat || (t).scalar_type() == at::kHalf ||          \
                   (t).scalar_type() == at::kBFloat16 || (t).scalar_type() == at::kDouble,   \
               op, #t, "must be float64, float32, float16 or bfloat16, got ", (t).scalar_type())

namespace fasttrain {
FT_VARIANT_BEGIN

// Sizes of one nf4_linear call: x [M, K], W [N, K], LoRA rank r (0 without adapters).
struct NF4LinearArgs {
  int64_t M, K, N, r;
  bool lora, dora;
};

inline NF4LinearArgs check_nf4_linear_args(const char* op, bool x_may_be_float64, const at::Tensor& x,
                                           const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                                           int64_t out_features, const std::optional<at::Tensor>& lora_a,
                                           const std::optional<at::Tensor>& lora_b,
                                           const std::optional<at::Tensor>& dora_m,
                                           const std::optional<at::Tensor>& weight_sq_norm) {
  FT_CHECK_DIM(op, x, 2);
  if (x_may_be_float64) {
    FT_CHECK_FLOATING_OR_DOUBLE(op, x);
  } else {
    FT_CHECK_FLOATING(op, x);
  }
  FT_CHECK_DTYPE(op, packed, at::kByte);
  FT_CHECK_DTYPE(op, absmax, at::kFloat);
  FT_CHECK_SAME_DEVICE(op, x, packed);
  FT_CHECK_SAME_DEVICE(op, x, absmax);
  TORCH_CHECK(blocksize >= 2 && blocksize % 2 == 0, op, ": blocksize must be even and >= 2, got ", blocksize);
  NF4LinearArgs a{x.size(0), x.size(1), out_features, 0, false, false};
  FT_CHECK_ARG(a.K > 0, op, "x", "must have in_features > 0, got shape ", x.sizes());
  FT_CHECK_ARG(a.N > 0, op, "out_features", "must be positive, got ", a.N);
  const int64_t numel = a.N * a.K;
  FT_CHECK_ARG(packed.numel() == (numel + 1) / 2, op, "packed", "must hold ceil(out*in/2) = ", (numel + 1) / 2,
               " bytes for a [", a.N, ", ", a.K, "] weight, got ", packed.numel());
  FT_CHECK_ARG(absmax.numel() == (numel + blocksize - 1) / blocksize, op, "absmax", "must hold ",
               (numel + blocksize - 1) / blocksize, " block scales, got ", absmax.numel());
  FT_CHECK_ARG(lora_a.has_value() == lora_b.has_value(), op, "lora_b",
               "must be given exactly when lora_a is given");
  if (lora_a.has_value()) {
    const at::Tensor& A = *lora_a;
    const at::Tensor& B = *lora_b;
    FT_CHECK_DIM(op, A, 2);
    FT_CHECK_DIM(op, B, 2);
    FT_CHECK_SAME_DEVICE(op, x, A);
    FT_CHECK_SAME_DEVICE(op, x, B);
    FT_CHECK_FLOATING_OR_DOUBLE(op, A);
    FT_CHECK_FLOATING_OR_DOUBLE(op, B);
    FT_CHECK_ARG(A.size(1) == a.K, op, "lora_a", "must be [r, in_features=", a.K, "], got ", A.sizes());
    FT_CHECK_ARG(B.size(0) == a.N && B.size(1) == A.size(0), op, "lora_b", "must be [out_features=", a.N,
                 ", r=", A.size(0), "], got ", B.sizes());
    a.r = A.size(0);
    a.lora = a.r > 0;
  }
  if (dora_m.has_value()) {
    FT_CHECK_ARG(a.lora, op, "dora_m", "needs lora_a and lora_b (DoRA is LoRA plus a magnitude)");
    FT_CHECK_ARG(dora_m->dim() == 1 && dora_m->size(0) == a.N, op, "dora_m", "must be [out_features=", a.N,
                 "], got ", dora_m->sizes());
    FT_CHECK_SAME_DEVICE(op, x, (*dora_m));
    FT_CHECK_FLOATING_OR_DOUBLE(op, (*dora_m));
    a.dora = true;
  }
  if (weight_sq_norm.has_value()) {
    FT_CHECK_ARG(weight_sq_norm->dim() == 1 && weight_sq_norm->size(0) == a.N, op, "weight_sq_norm",
                 "must be [out_features=", a.N, "], got ", weight_sq_norm->sizes());
    FT_CHECK_SAME_DEVICE(op, x, (*weight_sq_norm));
  }
  return a;
}

// The backward's own inputs: dy, and the forward's saved xa (LoRA), rnorm and z (DoRA).
inline void check_nf4_linear_backward_args(const char* op, const NF4LinearArgs& a, const at::Tensor& dy_,
                                           const at::Tensor& xa, const at::Tensor& rnorm, const at::Tensor& z) {
  FT_CHECK_ARG(dy_.dim() == 2 && dy_.size(0) == a.M && dy_.size(1) == a.N, op, "dy", "must be [", a.M, ", ",
               a.N, "], got ", dy_.sizes());
  if (a.lora) FT_CHECK_ARG(xa.dim() == 2 && xa.size(0) == a.M && xa.size(1) == a.r, op, "xa", "must be [M, r]");
  if (a.dora) {
    FT_CHECK_ARG(rnorm.numel() == a.N, op, "rnorm", "must be [out_features]");
    FT_CHECK_ARG(z.dim() == 2 && z.size(0) == a.M && z.size(1) == a.N, op, "z", "must be [M, out_features]");
  }
}

FT_VARIANT_END
}  // namespace fasttrain
