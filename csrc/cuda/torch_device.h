// fasttrain::cuda::Device on a GPU: the current stream, scratch from PyTorch's caching allocator,
// cuBLAS for the GEMMs. Included by the .cu torch wrappers only (nvcc).
#pragma once
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <cublas_v2.h>

#include <vector>

#include "cuda/device.h"

namespace fasttrain::cuda {

class TorchDevice final : public Device {
 public:
  explicit TorchDevice(const at::Tensor& like) : options_(like.options()) {}

  cudaStream_t stream() const override { return at::cuda::getCurrentCUDAStream(); }
  int multiprocessors() const override { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

  void* scratch(int64_t bytes) override {
    held_.push_back(at::empty({bytes}, options_.dtype(at::kByte)));
    return held_.back().data_ptr();
  }

  void gemm_nonempty(const Gemm& g) override {
    cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();  // bound to the current stream
    const bool f64 = g.out == at::kDouble;
    const double alpha64 = g.alpha, beta64 = g.beta;
    const float alpha32 = static_cast<float>(g.alpha), beta32 = static_cast<float>(g.beta);
    TORCH_CUDABLAS_CHECK(cublasGemmEx(
        handle, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, (int)g.m, (int)g.n,
        (int)g.k, f64 ? static_cast<const void*>(&alpha64) : &alpha32, g.a, type_of(g.in), (int)g.lda, g.b,
        type_of(g.in), (int)g.ldb, f64 ? static_cast<const void*>(&beta64) : &beta32, g.c, type_of(g.out),
        (int)g.ldc, f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

  void zero_2d(void* dst, int64_t pitch_bytes, int64_t width_bytes, int64_t height) override {
    C10_CUDA_CHECK(cudaMemset2DAsync(dst, pitch_bytes, 0, width_bytes, height, stream()));
  }

  void fill(void* dst, at::ScalarType type, double value, int64_t n) override {
    at::from_blob(dst, {n}, options_.dtype(type)).fill_(value);
  }

  void convert(void* dst, at::ScalarType dst_type, const void* src, at::ScalarType src_type, int64_t n) override {
    at::from_blob(dst, {n}, options_.dtype(dst_type))
        .copy_(at::from_blob(const_cast<void*>(src), {n}, options_.dtype(src_type)));
  }

  void copy_to_host(void* dst, const void* src, int64_t bytes) override {
    C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream()));
    C10_CUDA_CHECK(cudaStreamSynchronize(stream()));
  }

  bool capturing() const override {
    return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  }

 private:
  static cudaDataType_t type_of(at::ScalarType t) {
    switch (t) {
      case at::kDouble: return CUDA_R_64F;
      case at::kHalf: return CUDA_R_16F;
      case at::kBFloat16: return CUDA_R_16BF;
      default: return CUDA_R_32F;
    }
  }
  at::TensorOptions options_;
  std::vector<at::Tensor> held_;
};

}  // namespace fasttrain::cuda
