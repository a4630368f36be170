// nf4_linear on CUDA: y = g ⊙ (x·Wᵀ + s·(x·Aᵀ)·Bᵀ), W an NF4 matrix [N, K] (bitsandbytes layout).
//
// Paths by token count M:
//   decode (M ≤ 64): nf4_skinny_kernel reads each 4-bit weight once, decodes a [64 rows × 64] tile into
//     shared memory and multiplies it with the staged x tile (fp32 FMA); the K range is split across
//     blockIdx.y so that small N still fills the GPU (split-K), each split writing fp32 partial sums.
//     nf4_skinny_epilogue_kernel adds the splits in a fixed order, the LoRA term s·xa[m]·B[n] and
//     DoRA's g[n], and stores with consecutive threads on consecutive n (coalesced).
//   prefill/training (M > 64): the NF4 decode kernel (nf4.cu) writes W in x's dtype into a scratch
//     buffer (the caching allocator reuses it), then cuBLAS with a float32 output; the LoRA term is
//     a second fp32 GEMM into that output (alpha = s) and DoRA's scale is applied before the one
//     rounding (the decode path's epilogue kernel over one split).
// Both paths round at the same points, so a row's output does not depend on how many rows came with
// it (M): W is decoded to x's dtype (the operand of a bf16/fp16 tensor-core GEMM), everything after
// the products (xa = x·Aᵀ, the LoRA term, g, the sums) stays in float32 and y is rounded once to x's
// dtype (z, DoRA's saved pre-scale output, likewise). What differs is only the float32 summation
// order, so two paths differ by at most one unit in the last place of x's dtype plus the float32
// accumulation error (tests/ops/test_cuda_kernels.py checks that bound).
// DoRA: A·Wᵀ is the decode kernel with x := A (one pass over the 4-bit weight); the row norm comes
// from fm::dora_row_norm (core/math.h, shared with the CPU), in float64 when A is float64.
//
// What it is not (yet): a tensor-core skinny GEMM. Napkin math for the issue's decode shape,
// 5120×27648 at M = 48 on an H200: the weight is 76 MB → 16 µs at 4.8 TB/s, but 13.6 GFLOP of
// fp32 FMA at ~60 TFLOP/s is ~230 µs, so this SIMT kernel is compute-bound above M ≈ 8 and will not
// reach the bandwidth floor at M = 48; that needs mma.sync with in-register dequantisation (Marlin-
// style). Not run on a GPU yet. The forward's kernels and launch sequence (x·Aᵀ, both paths) and the
// DoRA norm kernel: cuda/kernels/nf4_linear.cuh (shared with the CUDA emulator, which runs them in
// the tests, the GEMMs through at::mm).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/checks.h"
#include "core/math.h"
#include "core/nf4_linear_checks.h"
#include "cuda/kernels/nf4_linear.cuh"
#include "cuda/torch_device.h"
#include "ops.h"

namespace fasttrain {
namespace fm = fasttrain::math;
namespace nlk = fasttrain::cuda::nf4_linear;

namespace {

// x must be float32, float16 or bfloat16 here: the CPU op also takes float64, these kernels do not.
constexpr bool kXMayBeFloat64 = false;
constexpr int kDecodeMaxM = nlk::kDecodeMaxM;

// W [N, K] in dtype dt (float32, float16 or bfloat16), by the NF4 decode kernel of nf4.cu.
at::Tensor dequant_weight(const at::Tensor& packed, const at::Tensor& absmax, int64_t bs, int64_t N, int64_t K,
                          at::ScalarType dt) {
  return nf4_dequantize_cuda(packed, absmax, bs, N * K, dt).view({N, K});
}

// y [M, N] in x's dtype from the decode path; with z_out also z (the output before g), same dtype.
// xa [M, r] fp32 with B [N, r] fp32 (LoRA) and g [N] fp32 (DoRA) are optional (undefined tensors).
at::Tensor skinny(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax, int64_t bs, int64_t N,
                  const at::Tensor& xa, const at::Tensor& B, double scale, const at::Tensor& g,
                  at::Tensor* z_out = nullptr) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M <= kDecodeMaxM && N < (1ll << 31) && K < (1ll << 31), "nf4_linear: decode path shape out of range");
  at::Tensor out = at::empty({M, N}, x.options());
  if (z_out != nullptr) *z_out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  fasttrain::cuda::TorchDevice dev(x);
  nlk::decode(dev, x.scalar_type(), x.const_data_ptr(), packed.const_data_ptr<uint8_t>(), absmax.const_data_ptr<float>(),
              bs, M, N, K, xa.defined() ? xa.const_data_ptr<float>() : nullptr,
              B.defined() ? B.const_data_ptr<float>() : nullptr, xa.defined() ? (int)xa.size(1) : 0, scale,
              g.defined() ? g.const_data_ptr<float>() : nullptr, z_out != nullptr ? z_out->data_ptr() : nullptr,
              out.data_ptr());
  return out;
}

// ‖W + sBA‖ [N] in dtype st (float32, or float64 for nf4_dora_norm with float64 A, as on the CPU).
// AW = A·Wᵀ through the decode path (one pass over the 4-bit weight) when st is float32 and r ≤ 64,
// else from a dequantised W.
at::Tensor dora_norm(const at::Tensor& packed, const at::Tensor& absmax, int64_t bs, int64_t N, int64_t K,
                     const at::Tensor& A, const at::Tensor& B, double scale,
                     const std::optional<at::Tensor>& weight_sq_norm, at::ScalarType st) {
  const at::Tensor As = A.to(st).contiguous(), Bs = B.to(st).contiguous();
  at::Tensor aw, wsq, w;
  const at::Tensor none;
  auto decoded = [&]() -> const at::Tensor& {  // W in st, decoded once (fp32 values are exact in fp64)
    if (!w.defined()) w = dequant_weight(packed, absmax, bs, N, K, at::kFloat).to(st);
    return w;
  };
  if (st == at::kFloat && As.size(0) <= kDecodeMaxM) {
    aw = skinny(As, packed, absmax, bs, N, none, none, 0.0, none);  // [r, N]
  } else {
    aw = at::mm(As, decoded().t());
  }
  if (weight_sq_norm.has_value()) wsq = weight_sq_norm->to(st).contiguous();
  else wsq = decoded().square().sum(1);
  const at::Tensor cross = (Bs * aw.t()).sum(1).contiguous();
  const at::Tensor bab = (at::mm(Bs, at::mm(As, As.t())) * Bs).sum(1).contiguous();
  at::Tensor rn = at::empty({N}, wsq.options());
  fasttrain::cuda::TorchDevice dev(rn);
  nlk::dora_norm(dev, st, wsq.const_data_ptr(), cross.const_data_ptr(), bab.const_data_ptr(), scale, N, rn.data_ptr());
  return rn;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> nf4_linear_cuda(
    const at::Tensor& x_, const at::Tensor& packed_, const at::Tensor& absmax_, int64_t blocksize,
    int64_t out_features, const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
    double scale, const std::optional<at::Tensor>& dora_m, const std::optional<at::Tensor>& weight_sq_norm) {
  constexpr const char* op = "fasttrain::nf4_linear";
  FT_CHECK_DEVICE_TYPE(op, x_, at::kCUDA);
  const NF4LinearArgs a = check_nf4_linear_args(op, kXMayBeFloat64, x_, packed_, absmax_, blocksize, out_features,
                                                lora_a, lora_b, dora_m, weight_sq_norm);
  const c10::cuda::CUDAGuard guard(x_.device());
  const at::Tensor x = x_.contiguous(), packed = packed_.contiguous(), absmax = absmax_.contiguous();
  const at::TensorOptions f32 = x.options().dtype(at::kFloat);
  const int r = a.lora ? static_cast<int>(lora_a->size(0)) : 0;
  // xa [M, r] fp32 (also [M, 0] for rank-0 adapters), [0] without adapters
  at::Tensor xa = lora_a.has_value() ? at::empty({a.M, r}, f32) : at::empty({0}, f32);
  at::Tensor rnorm = at::empty({0}, f32);
  at::Tensor g;
  if (a.dora) {
    const at::Tensor norm = dora_norm(packed, absmax, blocksize, a.N, a.K, *lora_a, *lora_b, scale, weight_sq_norm,
                                      at::kFloat);
    rnorm = norm.reciprocal();  // saved for the backward
    g = (dora_m->to(at::kFloat) / norm).contiguous();
  }
  const at::Tensor Af = a.lora ? lora_a->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor Bf = a.lora ? lora_b->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({a.M, a.N}, x.options());
  at::Tensor z = a.dora ? at::empty({a.M, a.N}, x.options()) : at::empty({0}, x.options());
  TORCH_CHECK(a.M < (1ll << 31) && a.N < (1ll << 31) && a.K < (1ll << 31), op,
              ": the CUDA kernels take fewer than 2^31 rows, columns and outputs, got x ", x.sizes(), " and ", a.N,
              " outputs");
  if (a.M > 0) {
    fasttrain::cuda::TorchDevice dev(x);
    nlk::forward(dev, x.scalar_type(), x.const_data_ptr(), packed.const_data_ptr<uint8_t>(),
                 absmax.const_data_ptr<float>(), blocksize, a.M, a.N, a.K, a.lora ? Af.const_data_ptr<float>() : nullptr,
                 a.lora ? Bf.const_data_ptr<float>() : nullptr, r, scale, a.dora ? g.const_data_ptr<float>() : nullptr,
                 a.lora ? xa.data_ptr<float>() : nullptr, a.dora ? z.data_ptr() : nullptr, y.data_ptr());
  }
  return {y, xa, rnorm, z};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> nf4_linear_backward_cuda(
    const at::Tensor& dy_, const at::Tensor& x_, const at::Tensor& packed_, const at::Tensor& absmax_,
    int64_t blocksize, int64_t out_features, const std::optional<at::Tensor>& lora_a,
    const std::optional<at::Tensor>& lora_b, double scale, const std::optional<at::Tensor>& dora_m,
    const at::Tensor& xa, const at::Tensor& rnorm, const at::Tensor& z, std::array<bool, 4> mask) {
  constexpr const char* op = "fasttrain::nf4_linear_backward";
  FT_CHECK_DEVICE_TYPE(op, x_, at::kCUDA);
  const NF4LinearArgs a = check_nf4_linear_args(op, kXMayBeFloat64, x_, packed_, absmax_, blocksize, out_features,
                                                lora_a, lora_b, dora_m, std::nullopt);
  check_nf4_linear_backward_args(op, a, dy_, xa, rnorm, z);
  const c10::cuda::CUDAGuard guard(x_.device());
  const at::ScalarType ct = x_.scalar_type();
  const at::Tensor dy = dy_.to(ct).contiguous();
  at::Tensor dz = dy;
  // Every output is its own tensor (outputs that alias each other break custom-op rules).
  at::Tensor dm = at::empty({0}, x_.options().dtype(a.dora ? dora_m->scalar_type() : at::kFloat));
  at::Tensor dx = at::empty({0}, x_.options()), dA = at::empty({0}, x_.options()), dB = at::empty({0}, x_.options());
  if (lora_a.has_value() && !a.lora) {  // rank 0: gradients of the empty factors have their shapes
    if (mask[1]) dA = at::zeros(lora_a->sizes(), lora_a->options());
    if (mask[2]) dB = at::zeros(lora_b->sizes(), lora_b->options());
  }
  if (a.dora) {
    const at::Tensor g = dora_m->to(at::kFloat) * rnorm;
    dz = (dy.to(at::kFloat) * g).to(ct);
    if (mask[3]) dm = ((dy.to(at::kFloat) * z.to(at::kFloat)).sum(0) * rnorm).to(dora_m->scalar_type());
  }
  at::Tensor dzb;  // [M, r] fp32
  if (a.lora && (mask[0] || mask[1])) dzb = at::mm(dz.to(at::kFloat), lora_b->to(at::kFloat));
  if (mask[0]) {
    const at::Tensor w = dequant_weight(packed_.contiguous(), absmax_.contiguous(), blocksize, a.N, a.K, ct);
    at::Tensor gx = at::mm(dz, w);
    if (a.lora) gx.addmm_(dzb.to(ct), lora_a->to(ct), 1.0, scale);
    dx = gx;
  }
  if (a.lora && mask[1]) dA = at::mm(dzb.t(), x_.to(at::kFloat)).mul_(scale).to(lora_a->scalar_type());
  if (a.lora && mask[2]) dB = at::mm(dz.to(at::kFloat).t(), xa).mul_(scale).to(lora_b->scalar_type());
  return {dx, dA, dB, dm};
}

at::Tensor nf4_dora_norm_cuda(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                              int64_t out_features, const at::Tensor& lora_a, const at::Tensor& lora_b, double scale,
                              const std::optional<at::Tensor>& weight_sq_norm) {
  constexpr const char* op = "fasttrain::nf4_dora_norm";
  FT_CHECK_DEVICE_TYPE(op, lora_a, at::kCUDA);
  FT_CHECK_DIM(op, lora_a, 2);
  const at::Tensor probe = at::empty({0, lora_a.size(1)}, lora_a.options().dtype(at::kFloat));
  check_nf4_linear_args(op, kXMayBeFloat64, probe, packed, absmax, blocksize, out_features, lora_a, lora_b,
                        std::nullopt, weight_sq_norm);
  const c10::cuda::CUDAGuard guard(lora_a.device());
  // float64 for float64 A, as the CPU op, the fake kernel and the schema say
  const at::ScalarType st = lora_a.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return dora_norm(packed.contiguous(), absmax.contiguous(), blocksize, out_features, lora_a.size(1), lora_a, lora_b,
                   scale, weight_sq_norm, st);
}

at::Tensor nf4_weight_sq_norm_cuda(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                                   int64_t out_features, int64_t in_features) {
  constexpr const char* op = "fasttrain::nf4_weight_sq_norm";
  FT_CHECK_DEVICE_TYPE(op, packed, at::kCUDA);
  const at::Tensor probe = at::empty({0, in_features}, absmax.options());
  check_nf4_linear_args(op, kXMayBeFloat64, probe, packed, absmax, blocksize, out_features, std::nullopt,
                        std::nullopt, std::nullopt, std::nullopt);
  const c10::cuda::CUDAGuard guard(packed.device());
  return dequant_weight(packed.contiguous(), absmax.contiguous(), blocksize, out_features, in_features, at::kFloat)
      .to(at::kDouble).square().sum(1).to(at::kFloat);
}

}  // namespace fasttrain

TORCH_LIBRARY_IMPL(fasttrain, CUDA, m) {
  m.impl("nf4_linear", &fasttrain::nf4_linear_cuda);
  m.impl("nf4_linear_backward", &fasttrain::nf4_linear_backward_cuda);
  m.impl("nf4_dora_norm", &fasttrain::nf4_dora_norm_cuda);
  m.impl("nf4_weight_sq_norm", &fasttrain::nf4_weight_sq_norm_cuda);
}
