// nf4_linear on CUDA: y = g ⊙ (x·Wᵀ + s·(x·Aᵀ)·Bᵀ), W an NF4 matrix [N, K] (bitsandbytes layout).
//
// Paths by token count M:
//   decode (M ≤ 64): nf4_skinny_kernel reads each 4-bit weight once, decodes a [64 rows × 64] tile into
//     shared memory, multiplies it with the staged x tile (fp32 FMA) and adds the LoRA term
//     s·xa[m]·B[n] and DoRA's g[n] in the epilogue (xa = x·Aᵀ is a tiny GEMM done first).
//   prefill/training (M > 64): nf4_dequant_kernel decodes W into a scratch buffer (the caching
//     allocator reuses it), then cuBLAS (at::mm); the LoRA term is an addmm into the same output.
// DoRA: A·Wᵀ is the decode kernel with x := A (one pass over the 4-bit weight); the row norm comes
// from fm::dora_row_norm (core/math.h, shared with the CPU).
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
#include "ops.h"

namespace fasttrain {
namespace fm = fasttrain::math;

namespace {

// x must be float32, float16 or bfloat16 here: the CPU op also takes float64, these kernels do not.
constexpr bool kXMayBeFloat64 = false;

constexpr int kDecodeMaxM = 64;
constexpr int kTileN = 64;    // W rows per block
constexpr int kTileK = 64;    // columns per step
constexpr int kThreads = 256; // 8 warps: warp w owns rows 8w..8w+7 of the tile, lane l owns m = l, l+32

// ---- dequantisation: 2 values per thread-iteration, flat index over [N*K] -----------------------
template <typename T>
__global__ void nf4_dequant_kernel(const uint8_t* __restrict__ q, const float* __restrict__ absmax, int64_t bs,
                                   int64_t numel, T* __restrict__ out) {
  const int64_t nbytes = (numel + 1) / 2;
  for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; j < nbytes; j += (int64_t)gridDim.x * blockDim.x) {
    const uint8_t b = q[j];
    const float s = absmax[(2 * j) / bs];  // bs even: both nibbles share a block
    out[2 * j] = static_cast<T>(fm::nf4_decode(b, true, s));
    if (2 * j + 1 < numel) out[2 * j + 1] = static_cast<T>(fm::nf4_decode(b, false, s));
  }
}

// ---- decode path: out[m, n] = g[n]·(Σ_k x[m,k]·W[n,k] + s·Σ_j xa[m,j]·B[n,j]) ------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads) nf4_skinny_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ q, const float* __restrict__ absmax, int64_t bs,
    int M, int N, int K, const float* __restrict__ xa, const float* __restrict__ lora_b, int r, float scale,
    const float* __restrict__ g, T* __restrict__ out) {
  __shared__ float ws[kTileN][kTileK + 1];
  __shared__ float xs[kDecodeMaxM][kTileK + 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = blockIdx.x * kTileN;
  float acc[8][2];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = 0.0f;

  for (int k0 = 0; k0 < K; k0 += kTileK) {
    // Stage W tile (decoded once, from the 4-bit weight) and x tile, as fp32.
    for (int e = threadIdx.x; e < kTileN * kTileK; e += kThreads) {
      const int rr = e / kTileK, cc = e % kTileK;
      const int n = n0 + rr, k = k0 + cc;
      float v = 0.0f;
      if (n < N && k < K) {
        const int64_t i = (int64_t)n * K + k;
        v = fm::nf4_decode(q[i / 2], (i & 1) == 0, absmax[i / bs]);
      }
      ws[rr][cc] = v;
    }
    for (int e = threadIdx.x; e < M * kTileK; e += kThreads) {
      const int mm = e / kTileK, cc = e % kTileK;
      const int k = k0 + cc;
      xs[mm][cc] = k < K ? static_cast<float>(x[(int64_t)mm * K + k]) : 0.0f;
    }
    __syncthreads();
#pragma unroll 4
    for (int c = 0; c < kTileK; ++c) {
      const float x0 = xs[lane][c];
      const float x1 = (lane + 32 < kDecodeMaxM) ? xs[lane + 32][c] : 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float w = ws[warp * 8 + i][c];  // broadcast within the warp
        acc[i][0] = fmaf(w, x0, acc[i][0]);
        acc[i][1] = fmaf(w, x1, acc[i][1]);
      }
    }
    __syncthreads();
  }
  // Epilogue: the LoRA term and DoRA's scale, then one store.
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int n = n0 + warp * 8 + i;
    if (n >= N) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = lane + 32 * h;
      if (m >= M) continue;
      float v = acc[i][h];
      if (xa != nullptr) {
        float l = 0.0f;
        for (int j = 0; j < r; ++j) l = fmaf(xa[(int64_t)m * r + j], lora_b[(int64_t)n * r + j], l);
        v = fmaf(scale, l, v);
      }
      if (g != nullptr) v *= g[n];
      out[(int64_t)m * N + n] = static_cast<T>(v);
    }
  }
}

// norm[n] = ‖W_n + s·B_n·A‖ from the factorised parts (fm::dora_row_norm). The norm itself, not its
// reciprocal: g = m / ‖·‖ is then exactly 1 at initialisation (B = 0, m = ‖W‖), m · (1/‖·‖) is not.
__global__ void dora_norm_kernel(const float* __restrict__ wsq, const float* __restrict__ cross,
                                 const float* __restrict__ bab, float s, int N, float* __restrict__ norm) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n < N) norm[n] = fm::dora_row_norm<float>(wsq[n], cross[n], bab[n], s);
}

int blocks_for(int64_t work, int threads) {
  return (int)std::min<int64_t>((work + threads - 1) / threads, 65535);
}

at::Tensor dequant_weight(const at::Tensor& packed, const at::Tensor& absmax, int64_t bs, int64_t N, int64_t K,
                          at::ScalarType dt) {
  at::Tensor w = at::empty({N, K}, packed.options().dtype(dt));  // caching allocator: a reused scratch
  const int64_t numel = N * K;
  auto stream = at::cuda::getCurrentCUDAStream();
  FT_DISPATCH_FLOATING(dt, "nf4_linear_dequant_cuda", [&] {
    nf4_dequant_kernel<scalar_t><<<blocks_for((numel + 1) / 2, 256), 256, 0, stream>>>(
        packed.const_data_ptr<uint8_t>(), absmax.const_data_ptr<float>(), bs, numel, w.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return w;
}

// out [M, N] in x's dtype from the skinny kernel. xa/B/g optional (nullptr-able via undefined tensors).
at::Tensor skinny(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax, int64_t bs, int64_t N,
                  const at::Tensor& xa, const at::Tensor& B, double scale, const at::Tensor& g) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M <= kDecodeMaxM && N < (1ll << 31) && K < (1ll << 31), "nf4_linear: decode path shape out of range");
  at::Tensor out = at::empty({M, N}, x.options());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int r = xa.defined() ? (int)xa.size(1) : 0;
  FT_DISPATCH_FLOATING(x.scalar_type(), "nf4_skinny_cuda", [&] {
    nf4_skinny_kernel<scalar_t><<<(unsigned)((N + kTileN - 1) / kTileN), kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), packed.const_data_ptr<uint8_t>(), absmax.const_data_ptr<float>(), bs,
        (int)M, (int)N, (int)K, xa.defined() ? xa.const_data_ptr<float>() : nullptr,
        B.defined() ? B.const_data_ptr<float>() : nullptr, r, (float)scale,
        g.defined() ? g.const_data_ptr<float>() : nullptr, out.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// ‖W + sBA‖ [N] fp32. AW = A·Wᵀ through the skinny kernel (one pass over the 4-bit weight) when
// r ≤ 64, else from a dequantised W.
at::Tensor dora_norm(const at::Tensor& packed, const at::Tensor& absmax, int64_t bs, int64_t N, int64_t K,
                     const at::Tensor& A, const at::Tensor& B, double scale,
                     const std::optional<at::Tensor>& weight_sq_norm) {
  const at::Tensor Af = A.to(at::kFloat).contiguous(), Bf = B.to(at::kFloat).contiguous();
  at::Tensor aw, wsq;
  const at::Tensor none;
  if (Af.size(0) <= kDecodeMaxM) {
    aw = skinny(Af, packed, absmax, bs, N, none, none, 0.0, none);  // [r, N]
  } else {
    aw = at::mm(Af, dequant_weight(packed, absmax, bs, N, K, at::kFloat).t());
  }
  if (weight_sq_norm.has_value()) wsq = weight_sq_norm->to(at::kFloat).contiguous();
  else wsq = dequant_weight(packed, absmax, bs, N, K, at::kFloat).square().sum(1);
  const at::Tensor cross = (Bf * aw.t()).sum(1).contiguous();
  const at::Tensor bab = (at::mm(Bf, at::mm(Af, Af.t())) * Bf).sum(1).contiguous();
  at::Tensor rn = at::empty({N}, wsq.options());
  dora_norm_kernel<<<blocks_for(N, 256), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      wsq.const_data_ptr<float>(), cross.const_data_ptr<float>(), bab.const_data_ptr<float>(), (float)scale, (int)N,
      rn.data_ptr<float>());
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
  at::Tensor xa = at::empty({0}, x.options().dtype(at::kFloat));
  at::Tensor rnorm = at::empty({0}, x.options().dtype(at::kFloat));
  at::Tensor z = at::empty({0}, x.options());
  at::Tensor g;
  if (a.lora) xa = at::mm(x.to(at::kFloat), lora_a->to(at::kFloat).t());  // [M, r], fp32 (small)
  if (a.dora) {
    const at::Tensor norm = dora_norm(packed, absmax, blocksize, a.N, a.K, *lora_a, *lora_b, scale, weight_sq_norm);
    rnorm = norm.reciprocal();  // saved for the backward
    g = (dora_m->to(at::kFloat) / norm).contiguous();
  }
  const at::Tensor Bf = a.lora ? lora_b->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y;
  if (a.M <= kDecodeMaxM) {
    const at::Tensor none;
    if (a.dora) {  // backward needs z (pre-scale); the decode path is inference-shaped, so two passes is fine
      z = skinny(x, packed, absmax, blocksize, a.N, xa, Bf, scale, none);
      y = (z.to(at::kFloat) * g).to(ct);
    } else {
      y = skinny(x, packed, absmax, blocksize, a.N, a.lora ? xa : none, Bf, scale, none);
    }
  } else {
    const at::Tensor w = dequant_weight(packed, absmax, blocksize, a.N, a.K, ct);
    at::Tensor zz = at::mm(x, w.t());
    if (a.lora) zz.addmm_(xa.to(ct), Bf.to(ct).t(), 1.0, scale);
    if (a.dora) {
      z = zz;
      y = (zz * g.to(ct));
    } else {
      y = zz;
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
  at::Tensor dm = at::empty({0}, x_.options().dtype(at::kFloat));
  if (a.dora) {
    const at::Tensor g = dora_m->to(at::kFloat) * rnorm;
    dz = (dy.to(at::kFloat) * g).to(ct);
    if (mask[3]) dm = ((dy.to(at::kFloat) * z.to(at::kFloat)).sum(0) * rnorm).to(dora_m->scalar_type());
  }
  at::Tensor dx = at::empty({0}, x_.options()), dA = dx, dB = dx;
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
  return dora_norm(packed.contiguous(), absmax.contiguous(), blocksize, out_features, lora_a.size(1), lora_a, lora_b,
                   scale, weight_sq_norm);
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
