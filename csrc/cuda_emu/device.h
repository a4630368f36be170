// fasttrain::cuda::Device on the CPU for the CUDA emulator: scratch is CPU memory filled with 0xFF
// (a NaN for floats, as uninitialised device memory may hold anything), the GEMMs are at::mm in the
// GEMM's accumulation precision, and the scratch handed out is counted so that tests can bound it.
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "cuda/device.h"

namespace fasttrain::cuda_emu {

class EmuDevice final : public fasttrain::cuda::Device {
 public:
  cudaStream_t stream() const override { return nullptr; }
  int multiprocessors() const override;
  void* scratch(int64_t bytes) override;
  void gemm_nonempty(const fasttrain::cuda::Gemm& g) override;
  void zero_2d(void* dst, int64_t pitch_bytes, int64_t width_bytes, int64_t height) override;
  void fill(void* dst, at::ScalarType type, double value, int64_t n) override;
  void convert(void* dst, at::ScalarType dst_type, const void* src, at::ScalarType src_type, int64_t n) override;
  void copy_to_host(void* dst, const void* src, int64_t bytes) override;
  bool capturing() const override { return false; }

 private:
  std::vector<at::Tensor> held_;
};

// The SM count the launch sequences see (132: an H100 SXM or H200) and the scratch the last op
// asked for, in bytes; set and read from Python through fasttrain._C_emu.
void set_multiprocessors(int n);
int64_t last_scratch_bytes();
void begin_op();

// A tensor to hand to a kernel as an output: filled with 0xFF so that an element no thread writes
// reads as NaN (or as an impossible integer) in the tests.
at::Tensor poisoned(c10::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace fasttrain::cuda_emu
