// nf4_linear on CUDA: y = g ⊙ (x·Wᵀ + s·(x·Aᵀ)·Bᵀ), W an NF4 matrix [N, K] (bitsandbytes layout).
//
// Paths by token count M:
//   decode (M ≤ 64): nf4_skinny_kernel reads each 4-bit weight once, decodes a [64 rows × 64] tile into
//     shared memory and multiplies it with the staged x tile (fp32 FMA); the K range is split across
//     blockIdx.y so that small N still fills the GPU (split-K), each split writing fp32 partial sums.
//     nf4_skinny_epilogue_kernel adds the splits in a fixed order, the LoRA term s·xa[m]·B[n] and
//     DoRA's g[n], and stores with consecutive threads on consecutive n (coalesced).
//   prefill/training (M > 64): the NF4 decode kernel (nf4.cu) writes W in x's dtype into a scratch
//     buffer (the caching allocator reuses it), then cuBLAS (at::mm with a float32 output); the LoRA
//     term is an fp32 addmm into that output and DoRA's scale is applied before the one rounding.
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
// style). Not run on a GPU yet.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/checks.h"
#include "core/dispatch.h"
#include "core/math.h"
#include "core/nf4_linear_checks.h"
#include "cuda/common.cuh"
#include "ops.h"

namespace fasttrain {
namespace fm = fasttrain::math;
namespace fc = fasttrain::cuda;

namespace {

// x must be float32, float16 or bfloat16 here: the CPU op also takes float64, these kernels do not.
constexpr bool kXMayBeFloat64 = false;

constexpr int kDecodeMaxM = 64;
constexpr int kTileN = 64;    // W rows per block
constexpr int kTileK = 64;    // columns per step
constexpr int kThreads = 256; // 8 warps: warp w owns rows 8w..8w+7 of the tile, lane l owns m = l (+ 32)
constexpr int kMaxSplits = 16;

// ---- decode path, part 1: partial[split, m, n] = Σ_{k in the split} x[m,k]·W[n,k] -------------------
// kHalves = 1 computes rows m < 32 only (M ≤ 32), 2 computes m < 64; rows m ≥ M read zeros.
template <typename T, int kHalves>
__global__ void __launch_bounds__(kThreads) nf4_skinny_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ q, const float* __restrict__ absmax, int64_t bs,
    int M, int N, int K, int k_per_split, float* __restrict__ partial) {
  constexpr int kRows = 32 * kHalves;
  __shared__ float ws[kTileN][kTileK + 1];
  __shared__ float xs[kRows][kTileK + 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = blockIdx.x * kTileN;
  const int kb = blockIdx.y * k_per_split, ke = min(K, kb + k_per_split);
  float acc[8][kHalves];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int h = 0; h < kHalves; ++h) acc[i][h] = 0.0f;

  for (int k0 = kb; k0 < ke; k0 += kTileK) {
    // Stage the W tile, decoded once from the 4-bit weight and rounded to T as the M > 64 path's
    // decode is, and the x tile (zeros past M and past the split), both as fp32.
    for (int e = threadIdx.x; e < kTileN * kTileK; e += kThreads) {
      const int rr = e / kTileK, cc = e % kTileK;
      const int n = n0 + rr, k = k0 + cc;
      float v = 0.0f;
      if (n < N && k < ke) v = static_cast<float>(static_cast<T>(fc::nf4_decode_at(q, absmax, bs, (int64_t)n * K + k)));
      ws[rr][cc] = v;
    }
    for (int e = threadIdx.x; e < kRows * kTileK; e += kThreads) {
      const int mm = e / kTileK, cc = e % kTileK;
      const int k = k0 + cc;
      xs[mm][cc] = (mm < M && k < ke) ? static_cast<float>(x[(int64_t)mm * K + k]) : 0.0f;
    }
    __syncthreads();
#pragma unroll 4
    for (int c = 0; c < kTileK; ++c) {
      float xv[kHalves];
#pragma unroll
      for (int h = 0; h < kHalves; ++h) xv[h] = xs[lane + 32 * h][c];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float w = ws[warp * 8 + i][c];  // broadcast within the warp
#pragma unroll
        for (int h = 0; h < kHalves; ++h) acc[i][h] = fmaf(w, xv[h], acc[i][h]);
      }
    }
    __syncthreads();
  }
  // Store through shared memory (ws as [m][n]) so that consecutive threads write consecutive n.
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
#pragma unroll
    for (int i = 0; i < 8; ++i) ws[lane][warp * 8 + i] = acc[i][h];
    __syncthreads();
    for (int e = threadIdx.x; e < 32 * kTileN; e += kThreads) {
      const int ml = e / kTileN, nl = e % kTileN;
      const int m = 32 * h + ml, n = n0 + nl;
      if (m < M && n < N) partial[((int64_t)blockIdx.y * M + m) * N + n] = ws[ml][nl];
    }
    __syncthreads();
  }
}

// ---- decode path, part 2: v = Σ_splits partial (fixed order) + s·xa[m]·B[n]; z = v, y = g[n]·v ------
// xa, lora_b, g and z may be null.
template <typename T>
__global__ void nf4_skinny_epilogue_kernel(const float* __restrict__ partial, int splits, int64_t M, int64_t N,
                                           const float* __restrict__ xa, const float* __restrict__ lora_b, int r,
                                           float scale, const float* __restrict__ g, T* __restrict__ z,
                                           T* __restrict__ out) {
  const int64_t MN = M * N;
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < MN; idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t m = idx / N, n = idx % N;
    float v = 0.0f;
    for (int s = 0; s < splits; ++s) v += partial[s * MN + idx];
    if (xa != nullptr) {
      float l = 0.0f;
      for (int j = 0; j < r; ++j) l = fmaf(xa[m * r + j], lora_b[n * r + j], l);
      v = fmaf(scale, l, v);
    }
    if (z != nullptr) z[idx] = static_cast<T>(v);
    out[idx] = static_cast<T>(g != nullptr ? v * g[n] : v);
  }
}

// norm[n] = ‖W_n + s·B_n·A‖ from the factorised parts (fm::dora_row_norm); grid-stride, so any N.
// The norm itself, not its reciprocal: g = m / ‖·‖ is then exactly 1 at initialisation (B = 0,
// m = ‖W‖ from the same ‖W‖²); m · (1/‖·‖) is 1 ± 1 ulp on some rows.
template <typename T>
__global__ void dora_norm_kernel(const T* __restrict__ wsq, const T* __restrict__ cross, const T* __restrict__ bab,
                                 T s, int64_t N, T* __restrict__ norm) {
  for (int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; n < N; n += (int64_t)gridDim.x * blockDim.x)
    norm[n] = fm::dora_row_norm<T>(wsq[n], cross[n], bab[n], s);
}

// W [N, K] in dtype dt (float32, float16 or bfloat16), by the NF4 decode kernel of nf4.cu.
at::Tensor dequant_weight(const at::Tensor& packed, const at::Tensor& absmax, int64_t bs, int64_t N, int64_t K,
                          at::ScalarType dt) {
  return nf4_dequantize_cuda(packed, absmax, bs, N * K, dt).view({N, K});
}

// K splits for the decode path: enough blocks for about two waves of the GPU's SMs when N alone
// gives too few, each split a whole number of K tiles.
int skinny_splits(int64_t N, int64_t K, int& k_per_split) {
  const int64_t blocks_n = (N + kTileN - 1) / kTileN;
  const int64_t ktiles = (K + kTileK - 1) / kTileK;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t splits = std::min<int64_t>({(2 * sms + blocks_n - 1) / blocks_n, ktiles, int64_t(kMaxSplits)});
  splits = std::max<int64_t>(splits, 1);
  const int64_t tiles_per = (ktiles + splits - 1) / splits;
  k_per_split = static_cast<int>(tiles_per * kTileK);
  return static_cast<int>((ktiles + tiles_per - 1) / tiles_per);
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
  int k_per_split = 0;
  const int splits = skinny_splits(N, K, k_per_split);
  at::Tensor partial = at::empty({splits, M, N}, x.options().dtype(at::kFloat));
  auto stream = at::cuda::getCurrentCUDAStream();
  const int r = xa.defined() ? (int)xa.size(1) : 0;
  const dim3 grid((unsigned)((N + kTileN - 1) / kTileN), (unsigned)splits);
  FT_DISPATCH_FLOATING(x.scalar_type(), "nf4_skinny_cuda", [&] {
    auto kernel = M > 32 ? nf4_skinny_kernel<scalar_t, 2> : nf4_skinny_kernel<scalar_t, 1>;
    kernel<<<grid, kThreads, 0, stream>>>(x.const_data_ptr<scalar_t>(), packed.const_data_ptr<uint8_t>(),
                                        absmax.const_data_ptr<float>(), bs, (int)M, (int)N, (int)K, k_per_split,
                                        partial.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    nf4_skinny_epilogue_kernel<scalar_t><<<fc::grid_for(M * N, 256), 256, 0, stream>>>(
        partial.const_data_ptr<float>(), splits, M, N, r > 0 ? xa.const_data_ptr<float>() : nullptr,
        r > 0 ? B.const_data_ptr<float>() : nullptr, r, (float)scale,
        g.defined() ? g.const_data_ptr<float>() : nullptr,
        z_out != nullptr ? z_out->data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
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
  AT_DISPATCH_FLOATING_TYPES(st, "dora_norm_cuda", [&] {
    dora_norm_kernel<scalar_t><<<fc::grid_for(N, 256), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        wsq.const_data_ptr<scalar_t>(), cross.const_data_ptr<scalar_t>(), bab.const_data_ptr<scalar_t>(),
        static_cast<scalar_t>(scale), N, rn.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  const at::ScalarType ct = x.scalar_type();
  const at::TensorOptions f32 = x.options().dtype(at::kFloat);
  // xa [M, r] fp32 (also [M, 0] for rank-0 adapters), [0] without adapters
  at::Tensor xa = lora_a.has_value() ? at::empty({a.M, 0}, f32) : at::empty({0}, f32);
  at::Tensor rnorm = at::empty({0}, f32);
  at::Tensor z = at::empty({0}, x.options());
  at::Tensor g;
  if (a.lora) xa = at::mm(x.to(at::kFloat), lora_a->to(at::kFloat).t());  // [M, r], fp32 (small)
  if (a.dora) {
    const at::Tensor norm = dora_norm(packed, absmax, blocksize, a.N, a.K, *lora_a, *lora_b, scale, weight_sq_norm,
                                      at::kFloat);
    rnorm = norm.reciprocal();  // saved for the backward
    g = (dora_m->to(at::kFloat) / norm).contiguous();
  }
  const at::Tensor Bf = a.lora ? lora_b->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor none;
  at::Tensor y;
  if (a.M <= kDecodeMaxM) {
    y = skinny(x, packed, absmax, blocksize, a.N, a.lora ? xa : none, Bf, scale, a.dora ? g : none,
               a.dora ? &z : nullptr);
  } else {
    const at::Tensor w = dequant_weight(packed, absmax, blocksize, a.N, a.K, ct);  // W rounded to x's dtype
    at::Tensor zf = ct == at::kFloat ? at::mm(x, w.t()) : at::mm(x, w.t(), at::kFloat);  // [M, N] fp32
    if (a.lora) zf.addmm_(xa, Bf.t(), 1.0, scale);
    if (a.dora) {
      z = zf.to(ct);
      y = (zf * g).to(ct);
    } else {
      y = zf.to(ct);
    }
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
