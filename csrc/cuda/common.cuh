// Device helpers every CUDA file uses, written once: warp reductions, the launch grid of a
// grid-stride kernel, the NF4 decode of one element, the declaration of dynamic shared memory, the
// kernel launch itself, and a compile-time flag dispatch for host code. Math (the formulas
// themselves) stays in core/math.h, shared with the CPU kernels.
// Compiled by nvcc for the GPU and by g++ for the CUDA emulator (csrc/cuda_emu), where
// <cuda_runtime.h> is the emulator's and FASTTRAIN_CUDA_EMU is defined: the launch below is the one
// place where the two differ.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#ifndef FASTTRAIN_CUDA_EMU
#include <c10/cuda/CUDAException.h>
#endif

#include "core/math.h"

namespace fasttrain::cuda {

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Blocks for a grid-stride kernel over `work` items: at least 1 (a launch with 0 blocks is an error
// even when the kernel would do nothing), at most 8 x 65,535 (the kernels loop over the rest). On the
// emulator the cap is a runtime setting (cuda_emu::set_grid_cap) that the tests set small, so that
// the grid-stride loops run more than once at shapes a CPU can afford.
inline int grid_for(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
#ifdef FASTTRAIN_CUDA_EMU
  const int64_t cap = ::cuda_emu::grid_cap();
#else
  const int64_t cap = int64_t(65535) * 8;
#endif
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(blocks, 1), cap));
}

// Element i of a row-major NF4 matrix (bitsandbytes layout: element 2j in the high nibble of byte j).
__device__ __forceinline__ float nf4_decode_at(const uint8_t* __restrict__ q, const float* __restrict__ absmax,
                                               int64_t blocksize, int64_t i) {
  return fasttrain::math::nf4_decode(q[i >> 1], (i & 1) == 0, absmax[i / blocksize]);
}

// `T* name` = the block's dynamic shared memory, declared aligned for T (an undeclared alignment is
// 1 byte in the language; the hardware happens to give 16, which a double* cast relies on).
#ifdef FASTTRAIN_CUDA_EMU
#define FT_DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(::cuda_emu::dynamic_shared(alignof(T)))
#else
#define FT_DYNAMIC_SHARED(T, name)                                         \
  extern __shared__ __align__(16) unsigned char ft_dynamic_shared_raw[]; \
  T* name = reinterpret_cast<T*>(ft_dynamic_shared_raw)
#endif

// `__shared__ T name dims;` (dims such as [8][9], or nothing for a scalar). On the emulator the
// variable is filled with 0xFF when the first thread of each block reaches it, as a kernel may find
// anything there (one copy serves every block: blocks run one at a time).
#ifdef FASTTRAIN_CUDA_EMU
#define FT_SHARED(T, name, dims) \
  static T name dims;            \
  ::cuda_emu::poison_shared(&name, sizeof(name))
#else
#define FT_SHARED(T, name, dims) __shared__ T name dims
#endif

// kernel<<<grid, block, smem, stream>>>(args...) and the launch check; on the emulator, the same
// kernel run on the CPU (the stream is ignored: one grid runs at a time).
template <typename... P, typename... A>
inline void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, A&&... args) {
#ifdef FASTTRAIN_CUDA_EMU
  (void)stream;
  ::cuda_emu::launch(kernel, grid, block, smem, std::forward<A>(args)...);
#else
  kernel<<<grid, block, smem, stream>>>(std::forward<A>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
#endif
}

// Calls f(std::true_type{}) or f(std::false_type{}): one branch per runtime flag of a kernel
// template, read as `with_flag(has_kl, [&](auto kl) { ... decltype(kl)::value ... })`.
template <typename F>
inline void with_flag(bool flag, F&& f) {
  if (flag) f(std::true_type{});
  else f(std::false_type{});
}

}  // namespace fasttrain::cuda
