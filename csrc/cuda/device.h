// What a launch sequence (csrc/cuda/kernels/*.cuh) needs from the machine besides its kernels: the
// stream, the SM count, scratch memory, the vendor GEMM, a few copies. Two implementations: the GPU's
// (cuda/torch_device.h: the caching allocator, cuBLAS, the current stream) and the CUDA emulator's
// (cuda_emu/device.h: CPU tensors and at::mm), so one launch sequence serves both and the emulator
// runs the host logic (grid sizes, split-K, chunking, dispatch) the GPU runs.
#pragma once
#include <c10/core/ScalarType.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fasttrain::cuda {

// C = alpha·op(A)·op(B) + beta·C in column-major storage, cuBLAS's conventions: op(A) is m×k, op(B)
// k×n, C m×n. A and B hold `in` elements, C `out` elements; the products accumulate in `out`'s
// precision (float32 for 16-bit and float32 inputs, float64 for float64). beta = 0 never reads C.
struct Gemm {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  double beta = 0.0;
  void* c = nullptr;
  int64_t ldc = 0;
  at::ScalarType in = at::kFloat, out = at::kFloat;
  double alpha = 1.0;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual cudaStream_t stream() const = 0;
  virtual int multiprocessors() const = 0;
  // `bytes` of uninitialised device memory, alive until the Device is destroyed.
  virtual void* scratch(int64_t bytes) = 0;
  // The GEMM itself, for m, n, k > 0 (fasttrain::cuda::gemm below handles the empty cases).
  virtual void gemm_nonempty(const Gemm& g) = 0;
  // Zero `height` rows of `width_bytes`, `pitch_bytes` apart (cudaMemset2DAsync).
  virtual void zero_2d(void* dst, int64_t pitch_bytes, int64_t width_bytes, int64_t height) = 0;
  // n elements of dtype `type` set to `value`.
  virtual void fill(void* dst, at::ScalarType type, double value, int64_t n) = 0;
  // n elements converted between dtypes (rounding to nearest), on the stream.
  virtual void convert(void* dst, at::ScalarType dst_type, const void* src, at::ScalarType src_type, int64_t n) = 0;
  // Waits for the stream, then copies `bytes` to the host.
  virtual void copy_to_host(void* dst, const void* src, int64_t bytes) = 0;
  // Whether the stream is being captured into a CUDA graph (no host sync is allowed then).
  virtual bool capturing() const = 0;

  template <typename T>
  T* scratch_of(int64_t n) {
    return static_cast<T*>(scratch(n * static_cast<int64_t>(sizeof(T))));
  }
};

// An empty C is a no-op and k = 0 (a hidden size of 0) gives C = beta·C without calling the GEMM,
// which rejects the leading dimension 0 such operands have.
inline void gemm(Device& dev, const Gemm& g) {
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) {
    if (g.beta == 0.0) {
      const int64_t es = c10::elementSize(g.out);
      dev.zero_2d(g.c, g.ldc * es, g.m * es, g.n);
    }
    return;
  }
  dev.gemm_nonempty(g);
}

}  // namespace fasttrain::cuda
