// fasttrain_emu::nf4_linear_forward, nf4_linear_decode and dora_norm_kernel: the NF4 linear's forward
// launch sequence (x·Aᵀ, then the decode path's split-K tile kernel and epilogue or the prefill
// path's decode into scratch and GEMMs, cuda/kernels/nf4_linear.cuh), the decode path alone, and
// the DoRA norm kernel, on CPU tensors. The rest of the CUDA op (DoRA's norm terms, the backward) is
// at::mm and elementwise torch calls, which the emulator does not model.
#include "cuda_emu/prelude.h"

#include <torch/library.h>

#include "core/checks.h"
#include "cuda/kernels/nf4_linear.cuh"
#include "cuda_emu/device.h"

namespace fasttrain::cuda_emu {
namespace nf4_linear_emu {  // named, not anonymous: the unity build joins the emulator's files
namespace nlk = fasttrain::cuda::nf4_linear;

std::tuple<at::Tensor, at::Tensor> decode(const at::Tensor& x_, const at::Tensor& packed, const at::Tensor& absmax,
                                          int64_t blocksize, int64_t out_features, const std::optional<at::Tensor>& xa,
                                          const std::optional<at::Tensor>& lora_b, double scale,
                                          const std::optional<at::Tensor>& g, bool want_z) {
  constexpr const char* op = "fasttrain_emu::nf4_linear_decode";
  FT_CHECK_DIM(op, x_, 2);
  FT_CHECK_FLOATING(op, x_);
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  FT_CHECK_ARG(M <= nlk::kDecodeMaxM, op, "x", "must have at most ", nlk::kDecodeMaxM, " rows, got ", M);
  FT_CHECK_ARG(packed.numel() == (N * K + 1) / 2 && absmax.numel() == (N * K + blocksize - 1) / blocksize, op,
               "packed", "must be the NF4 weight [out_features, K]");
  FT_CHECK_ARG(xa.has_value() == lora_b.has_value(), op, "xa", "and lora_b come together");
  for (const auto* t : {&xa, &lora_b, &g})
    if (t->has_value())
      FT_CHECK_ARG((*t)->scalar_type() == at::kFloat && (*t)->is_contiguous(), op, "xa, lora_b, g",
                   "must be contiguous float32");
  begin_op();
  at::Tensor out = poisoned({M, N}, x.options());
  at::Tensor z = want_z ? poisoned({M, N}, x.options()) : at::empty({0}, x.options());
  EmuDevice dev;
  nlk::decode(dev, x.scalar_type(), x.const_data_ptr(), packed.const_data_ptr<uint8_t>(), absmax.const_data_ptr<float>(),
              blocksize, M, N, K, xa.has_value() ? xa->const_data_ptr<float>() : nullptr,
              lora_b.has_value() ? lora_b->const_data_ptr<float>() : nullptr, xa.has_value() ? (int)xa->size(1) : 0,
              scale, g.has_value() ? g->const_data_ptr<float>() : nullptr, want_z ? z.data_ptr() : nullptr,
              out.data_ptr());
  return {out, z};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& x_, const at::Tensor& packed,
                                                       const at::Tensor& absmax, int64_t blocksize,
                                                       int64_t out_features, const std::optional<at::Tensor>& lora_a,
                                                       const std::optional<at::Tensor>& lora_b, double scale,
                                                       const std::optional<at::Tensor>& g, bool want_z) {
  constexpr const char* op = "fasttrain_emu::nf4_linear_forward";
  FT_CHECK_DIM(op, x_, 2);
  FT_CHECK_FLOATING(op, x_);
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  FT_CHECK_ARG(packed.numel() == (N * K + 1) / 2 && absmax.numel() == (N * K + blocksize - 1) / blocksize, op,
               "packed", "must be the NF4 weight [out_features, K]");
  FT_CHECK_ARG(lora_a.has_value() == lora_b.has_value(), op, "lora_a", "and lora_b come together");
  for (const auto* t : {&lora_a, &lora_b, &g})
    if (t->has_value())
      FT_CHECK_ARG((*t)->scalar_type() == at::kFloat && (*t)->is_contiguous(), op, "lora_a, lora_b, g",
                   "must be contiguous float32");
  const int r = lora_a.has_value() ? static_cast<int>(lora_a->size(0)) : 0;
  if (r > 0)
    FT_CHECK_ARG(lora_a->sizes() == c10::IntArrayRef({r, K}) && lora_b->sizes() == c10::IntArrayRef({N, r}), op,
                 "lora_a", "must be [r, K] with lora_b [out_features, r]");
  begin_op();
  at::Tensor out = poisoned({M, N}, x.options());
  at::Tensor xa = poisoned({lora_a.has_value() ? M : 0, r}, x.options().dtype(at::kFloat));  // as the CUDA op
  at::Tensor z = want_z ? poisoned({M, N}, x.options()) : at::empty({0}, x.options());
  EmuDevice dev;
  nlk::forward(dev, x.scalar_type(), x.const_data_ptr(), packed.const_data_ptr<uint8_t>(),
               absmax.const_data_ptr<float>(), blocksize, M, N, K, r > 0 ? lora_a->const_data_ptr<float>() : nullptr,
               r > 0 ? lora_b->const_data_ptr<float>() : nullptr, r, scale,
               g.has_value() ? g->const_data_ptr<float>() : nullptr, r > 0 ? xa.data_ptr<float>() : nullptr,
               want_z ? z.data_ptr() : nullptr, out.data_ptr());
  return {out, xa, z};
}

at::Tensor dora_norm(const at::Tensor& wsq, const at::Tensor& cross, const at::Tensor& bab, double scale) {
  constexpr const char* op = "fasttrain_emu::dora_norm_kernel";
  for (const at::Tensor* t : {&cross, &bab})
    FT_CHECK_ARG(t->sizes() == wsq.sizes() && t->scalar_type() == wsq.scalar_type(), op, "cross, bab",
                 "must match wsq");
  FT_CHECK_ARG(wsq.dim() == 1 && (wsq.scalar_type() == at::kFloat || wsq.scalar_type() == at::kDouble), op, "wsq",
               "must be float32 or float64 [N]");
  const at::Tensor w = wsq.contiguous(), c = cross.contiguous(), b = bab.contiguous();
  at::Tensor norm = poisoned(w.sizes(), w.options());
  EmuDevice dev;
  nlk::dora_norm(dev, w.scalar_type(), w.const_data_ptr(), c.const_data_ptr(), b.const_data_ptr(), scale, w.numel(),
                 norm.data_ptr());
  return norm;
}
}  // namespace nf4_linear_emu

TORCH_LIBRARY_IMPL(fasttrain_emu, CPU, m) {
  m.impl("nf4_linear_forward", &nf4_linear_emu::forward);
  m.impl("nf4_linear_decode", &nf4_linear_emu::decode);
  m.impl("dora_norm_kernel", &nf4_linear_emu::dora_norm);
}

}  // namespace fasttrain::cuda_emu
