// NF4 and 8-bit blockwise kernels and their launch sequences, one source for the GPU build
// (csrc/cuda/nf4.cu, whose header says what they are) and the CUDA emulator (csrc/cuda_emu).
// Included by nf4.cu and nf4_linear.cu (the prefill path decodes W with it): the kernels that are
// no templates are static, so the two translation units do not define them twice.
#pragma once
#include "core/dispatch.h"
#include "core/math.h"
#include "cuda/common.cuh"
#include "cuda/device.h"

namespace fasttrain::cuda::nf4 {
namespace fm = fasttrain::math;

constexpr int kWarpsPerCta = 8;
constexpr int kThreads = 32 * kWarpsPerCta;

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) nf4_quantize_kernel(const scalar_t* __restrict__ in, uint8_t* __restrict__ out,
                                    float* __restrict__ absmax, int64_t n, int64_t blocksize,
                                    int64_t nblocks) {
  const int lane = threadIdx.x & 31;
  const int64_t b = (int64_t)blockIdx.x * kWarpsPerCta + (threadIdx.x >> 5);
  if (b >= nblocks) return;
  const int64_t start = b * blocksize;
  const int64_t end = min(n, start + blocksize);
  const bool tail = (end - start) < blocksize;
  float m = 0.0f;
  for (int64_t i = start + lane; i < end; i += 32) m = fmaxf(m, fabsf(static_cast<float>(in[i])));
  m = fasttrain::cuda::warp_max(m);
  if (lane == 0) absmax[b] = fm::blockwise_stored_absmax(m, tail);
  for (int64_t i = start + 2 * lane; i < end; i += 64) {
    const uint8_t hi = fm::nf4_code_of(fm::blockwise_scale(static_cast<float>(in[i]), m, tail));
    const float lo = (i + 1 < end) ? fm::blockwise_scale(static_cast<float>(in[i + 1]), m, tail) : 0.0f;
    out[i / 2] = fm::nf4_pack(hi, fm::nf4_code_of(lo));
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) nf4_dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ absmax,
                                      scalar_t* __restrict__ out, int64_t numel, int64_t blocksize) {
  const int64_t npairs = (numel + 1) / 2;
  for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < npairs;
       j += (int64_t)gridDim.x * blockDim.x) {
    out[2 * j] = static_cast<scalar_t>(fasttrain::cuda::nf4_decode_at(q, absmax, blocksize, 2 * j));
    if (2 * j + 1 < numel) out[2 * j + 1] = static_cast<scalar_t>(fasttrain::cuda::nf4_decode_at(q, absmax, blocksize, 2 * j + 1));
  }
}

static __global__ void __launch_bounds__(kThreads) blockwise8_quantize_kernel(const float* __restrict__ in, const float* __restrict__ code,
                                           uint8_t* __restrict__ out, float* __restrict__ absmax, int64_t n,
                                           int64_t blocksize, int64_t nblocks) {
  FT_SHARED(float, c, [256]);
  for (int i = threadIdx.x; i < 256; i += blockDim.x) c[i] = code[i];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t b = (int64_t)blockIdx.x * kWarpsPerCta + (threadIdx.x >> 5);
  if (b >= nblocks) return;
  const int64_t start = b * blocksize, end = min(n, start + blocksize);
  const bool tail = (end - start) < blocksize;
  float m = 0.0f;
  for (int64_t i = start + lane; i < end; i += 32) m = fmaxf(m, fabsf(in[i]));
  m = fasttrain::cuda::warp_max(m);
  if (lane == 0) absmax[b] = fm::blockwise_stored_absmax(m, tail);
  for (int64_t i = start + lane; i < end; i += 32)
    out[i] = static_cast<uint8_t>(fm::sorted_code_index(c, 256, fm::blockwise_scale(in[i], m, tail)));
}

static __global__ void __launch_bounds__(kThreads) blockwise8_dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ absmax,
                                             const float* __restrict__ code, float* __restrict__ out,
                                             int64_t n, int64_t blocksize) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = code[q[i]] * absmax[i / blocksize];
}


// ---- launch sequences --------------------------------------------------------------------------
// in [n] of dtype dt -> packed uint8 [ceil(n/2)], absmax fp32 [ceil(n/blocksize)]. One warp per
// quantization block.
inline void quantize(Device& dev, at::ScalarType dt, const void* in, int64_t n, int64_t blocksize, uint8_t* packed,
                     float* absmax) {
  const int64_t nblocks = (n + blocksize - 1) / blocksize;
  const int ctas = (int)((nblocks + kWarpsPerCta - 1) / kWarpsPerCta);
  FT_DISPATCH_FLOATING(dt, "nf4_quantize", [&] {
    launch(nf4_quantize_kernel<scalar_t>, ctas, kThreads, 0, dev.stream(), (const scalar_t*)in, packed, absmax, n,
           blocksize, nblocks);
  });
}

// packed, absmax -> out [numel] of dtype dt (grid-stride, one thread per packed byte).
inline void dequantize(Device& dev, at::ScalarType dt, const uint8_t* q, const float* absmax, int64_t blocksize,
                       int64_t numel, void* out) {
  FT_DISPATCH_FLOATING(dt, "nf4_dequantize", [&] {
    launch(nf4_dequantize_kernel<scalar_t>, fasttrain::cuda::grid_for((numel + 1) / 2, kThreads), kThreads, 0,
           dev.stream(), q, absmax, (scalar_t*)out, numel, blocksize);
  });
}

// x fp32 [n], code fp32 [256] -> q uint8 [n], absmax fp32 [ceil(n/blocksize)].
inline void blockwise8_quantize(Device& dev, const float* x, const float* code, int64_t n, int64_t blocksize,
                                uint8_t* q, float* absmax) {
  const int64_t nblocks = (n + blocksize - 1) / blocksize;
  const int ctas = (int)((nblocks + kWarpsPerCta - 1) / kWarpsPerCta);
  launch(blockwise8_quantize_kernel, ctas, kThreads, 0, dev.stream(), x, code, q, absmax, n, blocksize, nblocks);
}

inline void blockwise8_dequantize(Device& dev, const uint8_t* q, const float* absmax, const float* code, int64_t n,
                                  int64_t blocksize, float* out) {
  launch(blockwise8_dequantize_kernel, fasttrain::cuda::grid_for(n, kThreads), kThreads, 0, dev.stream(), q, absmax,
         code, out, n, blocksize);
}

}  // namespace fasttrain::cuda::nf4
