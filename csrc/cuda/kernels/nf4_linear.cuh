// The NF4 linear's CUDA kernels (the decode path for M <= 64 rows and the DoRA norm) and the launch
// sequences of its forward (the LoRA factor x·Aᵀ, then the decode path or, for M > 64, the decode of
// W into scratch and the vendor GEMMs), one source for the GPU build (csrc/cuda/nf4_linear.cu, whose
// header says what they are) and the CUDA emulator (csrc/cuda_emu).
#pragma once
#include <ATen/Dispatch.h>

#include <algorithm>

#include "core/dispatch.h"
#include "core/math.h"
#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/kernels/nf4.cuh"

namespace fasttrain::cuda::nf4_linear {
namespace fm = fasttrain::math;
namespace fc = fasttrain::cuda;

constexpr int kDecodeMaxM = 64;
constexpr int kTileN = 64;    // W rows per block
constexpr int kTileK = 64;    // columns per step
constexpr int kThreads = 256; // 8 warps: warp w owns rows 8w..8w+7 of the tile, lane l owns m = l (+ 32)
constexpr int kMaxSplits = 16;
constexpr int kEpilogueThreads = 256;  // the epilogue and the DoRA norm: grid-stride

// ---- decode path, part 1: partial[split, m, n] = Σ_{k in the split} x[m,k]·W[n,k] -------------------
// kHalves = 1 computes rows m < 32 only (M ≤ 32), 2 computes m < 64; rows m ≥ M read zeros.
template <typename T, int kHalves>
__global__ void __launch_bounds__(kThreads) nf4_skinny_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ q, const float* __restrict__ absmax, int64_t bs,
    int M, int N, int K, int k_per_split, float* __restrict__ partial) {
  constexpr int kRows = 32 * kHalves;
  FT_SHARED(float, ws, [kTileN][kTileK + 1]);
  FT_SHARED(float, xs, [kRows][kTileK + 1]);
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
__global__ void __launch_bounds__(kEpilogueThreads) nf4_skinny_epilogue_kernel(const float* __restrict__ partial, int splits, int64_t M, int64_t N,
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
__global__ void __launch_bounds__(kEpilogueThreads) dora_norm_kernel(const T* __restrict__ wsq, const T* __restrict__ cross, const T* __restrict__ bab,
                                 T s, int64_t N, T* __restrict__ norm) {
  for (int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; n < N; n += (int64_t)gridDim.x * blockDim.x)
    norm[n] = fm::dora_row_norm<T>(wsq[n], cross[n], bab[n], s);
}

// ---- launch sequences --------------------------------------------------------------------------
// K splits for the decode path: enough blocks for about two waves of the GPU's SMs when N alone
// gives too few, each split a whole number of K tiles.
inline int skinny_splits(int64_t N, int64_t K, int64_t sms, int& k_per_split) {
  const int64_t blocks_n = (N + kTileN - 1) / kTileN;
  const int64_t ktiles = (K + kTileK - 1) / kTileK;
  int64_t splits = std::min<int64_t>({(2 * sms + blocks_n - 1) / blocks_n, ktiles, int64_t(kMaxSplits)});
  splits = std::max<int64_t>(splits, 1);
  const int64_t tiles_per = (ktiles + splits - 1) / splits;
  k_per_split = static_cast<int>(tiles_per * kTileK);
  return static_cast<int>((ktiles + tiles_per - 1) / tiles_per);
}

// The decode path: x [M, K] (M <= 64) of dtype dt, W NF4 [N, K] -> out [M, N] (and z, the output
// before g, when non-null) in dt. xa [M, r] with lora_b [N, r] (LoRA, r > 0) and g [N] (DoRA) are
// fp32 and may be null.
inline void decode(Device& dev, at::ScalarType dt, const void* x, const uint8_t* packed, const float* absmax,
                   int64_t bs, int64_t M, int64_t N, int64_t K, const float* xa, const float* lora_b, int r,
                   double scale, const float* g, void* z, void* out) {
  if (M == 0) return;
  int k_per_split = 0;
  const int splits = skinny_splits(N, K, dev.multiprocessors(), k_per_split);
  float* partial = dev.scratch_of<float>(int64_t(splits) * M * N);
  const dim3 grid((unsigned)((N + kTileN - 1) / kTileN), (unsigned)splits);
  FT_DISPATCH_FLOATING(dt, "nf4_skinny", [&] {
    auto kernel = M > 32 ? nf4_skinny_kernel<scalar_t, 2> : nf4_skinny_kernel<scalar_t, 1>;
    launch(kernel, grid, kThreads, 0, dev.stream(), static_cast<const scalar_t*>(x), packed, absmax, bs, (int)M,
           (int)N, (int)K, k_per_split, partial);
    launch(nf4_skinny_epilogue_kernel<scalar_t>, fc::grid_for(M * N, kEpilogueThreads), kEpilogueThreads, 0,
           dev.stream(), static_cast<const float*>(partial), splits, M, N, r > 0 ? xa : nullptr,
           r > 0 ? lora_b : nullptr, r, (float)scale, g, static_cast<scalar_t*>(z), static_cast<scalar_t*>(out));
  });
}

// The prefill path (any M, used for M > 64): W decoded to dt into scratch [N, K] (nf4.cuh's kernel),
// v = x·Wᵀ by the vendor GEMM with a float32 output, + s·xa·Bᵀ by a second GEMM (LoRA, r > 0), then
// one rounding to dt with DoRA's g (the epilogue kernel over one split); a float32 x without DoRA
// gets the GEMM's output as it is. Arguments as for decode.
inline void prefill(Device& dev, at::ScalarType dt, const void* x, const uint8_t* packed, const float* absmax,
                    int64_t bs, int64_t M, int64_t N, int64_t K, const float* xa, const float* lora_b, int r,
                    double scale, const float* g, void* z, void* out) {
  if (M == 0 || N == 0) return;
  void* w = dev.scratch(N * K * static_cast<int64_t>(c10::elementSize(dt)));
  fasttrain::cuda::nf4::dequantize(dev, dt, packed, absmax, bs, N * K, w);
  const bool direct = dt == at::kFloat && g == nullptr && z == nullptr;
  float* v = direct ? static_cast<float*>(out) : dev.scratch_of<float>(M * N);
  // Row-major v [M, N] is column-major vᵀ [N, M] = W·xᵀ: W row-major [N, K] read transposed.
  gemm(dev, {true, false, N, M, K, w, K, x, K, 0.0, v, N, dt, at::kFloat});
  if (r > 0) gemm(dev, {true, false, N, M, r, lora_b, r, xa, r, 1.0, v, N, at::kFloat, at::kFloat, scale});
  if (direct) return;
  FT_DISPATCH_FLOATING(dt, "nf4_linear_prefill", [&] {
    launch(nf4_skinny_epilogue_kernel<scalar_t>, fc::grid_for(M * N, kEpilogueThreads), kEpilogueThreads, 0,
           dev.stream(), static_cast<const float*>(v), 1, M, N, static_cast<const float*>(nullptr),
           static_cast<const float*>(nullptr), 0, 0.0f, g, static_cast<scalar_t*>(z), static_cast<scalar_t*>(out));
  });
}

// The forward: x [M, K] of dtype dt, W NF4 [N, K] -> out [M, N] in dt (and z, the output before g,
// when non-null); with LoRA (r > 0) lora_a [r, K] and lora_b [N, r] fp32, and xa [M, r] fp32 written
// with x·Aᵀ (in float32, x converted first); g [N] fp32 (DoRA) or null. The decode path for
// M <= kDecodeMaxM, else the prefill path.
inline void forward(Device& dev, at::ScalarType dt, const void* x, const uint8_t* packed, const float* absmax,
                    int64_t bs, int64_t M, int64_t N, int64_t K, const float* lora_a, const float* lora_b, int r,
                    double scale, const float* g, float* xa, void* z, void* out) {
  if (M == 0) return;
  if (r > 0) {
    const float* xf = static_cast<const float*>(x);
    if (dt != at::kFloat) {
      float* conv = dev.scratch_of<float>(M * K);
      dev.convert(conv, at::kFloat, x, dt, M * K);
      xf = conv;
    }
    // column-major xaᵀ [r, M] = A·xᵀ: A row-major [r, K] read transposed
    gemm(dev, {true, false, r, M, K, lora_a, K, xf, K, 0.0, xa, r, at::kFloat, at::kFloat});
  }
  if (M <= kDecodeMaxM) decode(dev, dt, x, packed, absmax, bs, M, N, K, xa, lora_b, r, scale, g, z, out);
  else prefill(dev, dt, x, packed, absmax, bs, M, N, K, xa, lora_b, r, scale, g, z, out);
}

// norm [N] = ‖W_n + s·B_n·A‖ from wsq, cross, bab [N], all of dtype st (float32 or float64).
inline void dora_norm(Device& dev, at::ScalarType st, const void* wsq, const void* cross, const void* bab,
                      double scale, int64_t N, void* norm) {
  AT_DISPATCH_FLOATING_TYPES(st, "dora_norm", [&] {
    launch(dora_norm_kernel<scalar_t>, fc::grid_for(N, kEpilogueThreads), kEpilogueThreads, 0, dev.stream(),
           static_cast<const scalar_t*>(wsq), static_cast<const scalar_t*>(cross), static_cast<const scalar_t*>(bab),
           static_cast<scalar_t>(scale), N, static_cast<scalar_t*>(norm));
  });
}

}  // namespace fasttrain::cuda::nf4_linear
