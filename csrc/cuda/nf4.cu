// NF4 quantize / dequantize and 8-bit blockwise quantization, CUDA. Same math as the CPU kernels
// (core/math.h). Quantize: one warp per quantization block (absmax by warp shuffle, then each lane
// packs pairs). Dequantize: one thread per packed byte, grid-stride; it reads 1 byte + 1 absmax and
// writes 2 values, so it is bandwidth bound: an H100 at 3.35 TB/s moves a 4096x4096 bf16 weight
// (8.4 MB written + 2.1 MB read) in about 3 us. Kernels and launch sequences:
// cuda/kernels/nf4.cuh (shared with the CUDA emulator); this file holds the torch wrappers.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "core/checks.h"
#include "core/nf4_checks.h"
#include "cuda/kernels/nf4.cuh"
#include "cuda/torch_device.h"
#include "ops.h"

namespace fasttrain {

namespace nk = fasttrain::cuda::nf4;

std::tuple<at::Tensor, at::Tensor> nf4_quantize_cuda(const at::Tensor& w, int64_t blocksize) {
  constexpr const char* op = "fasttrain::nf4_quantize";
  FT_CHECK_DEVICE_TYPE(op, w, at::kCUDA);
  check_nf4_quantize(op, w, blocksize);
  const c10::cuda::CUDAGuard guard(w.device());
  const at::Tensor x = w.contiguous();
  const int64_t n = x.numel(), nblocks = (n + blocksize - 1) / blocksize;
  at::Tensor packed = at::empty({(n + 1) / 2}, x.options().dtype(at::kByte));
  at::Tensor absmax = at::empty({nblocks}, x.options().dtype(at::kFloat));
  fasttrain::cuda::TorchDevice dev(x);
  nk::quantize(dev, x.scalar_type(), x.const_data_ptr(), n, blocksize, packed.data_ptr<uint8_t>(),
               absmax.data_ptr<float>());
  return {packed, absmax};
}

at::Tensor nf4_dequantize_cuda(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                               int64_t numel, at::ScalarType dtype) {
  constexpr const char* op = "fasttrain::nf4_dequantize";
  FT_CHECK_DEVICE_TYPE(op, packed, at::kCUDA);
  check_nf4_dequantize(op, packed, absmax, blocksize, numel, dtype);
  const c10::cuda::CUDAGuard guard(packed.device());
  const at::Tensor q = packed.contiguous(), a = absmax.contiguous();
  at::Tensor out = at::empty({numel}, packed.options().dtype(dtype));
  fasttrain::cuda::TorchDevice dev(q);
  nk::dequantize(dev, dtype, q.const_data_ptr<uint8_t>(), a.const_data_ptr<float>(), blocksize, numel, out.data_ptr());
  return out;
}

std::tuple<at::Tensor, at::Tensor> blockwise8_quantize_cuda(const at::Tensor& x_, const at::Tensor& code,
                                                            int64_t blocksize) {
  constexpr const char* op = "fasttrain::blockwise8_quantize";
  FT_CHECK_DEVICE_TYPE(op, x_, at::kCUDA);
  check_blockwise8_quantize(op, x_, code, blocksize);
  const c10::cuda::CUDAGuard guard(x_.device());
  const at::Tensor x = x_.contiguous(), c = code.contiguous();
  const int64_t n = x.numel(), nblocks = (n + blocksize - 1) / blocksize;
  at::Tensor q = at::empty({n}, x.options().dtype(at::kByte));
  at::Tensor absmax = at::empty({nblocks}, x.options());
  fasttrain::cuda::TorchDevice dev(x);
  nk::blockwise8_quantize(dev, x.const_data_ptr<float>(), c.const_data_ptr<float>(), n, blocksize,
                          q.data_ptr<uint8_t>(), absmax.data_ptr<float>());
  return {q, absmax};
}

at::Tensor blockwise8_dequantize_cuda(const at::Tensor& q_, const at::Tensor& absmax, const at::Tensor& code,
                                      int64_t blocksize) {
  constexpr const char* op = "fasttrain::blockwise8_dequantize";
  FT_CHECK_DEVICE_TYPE(op, q_, at::kCUDA);
  check_blockwise8_dequantize(op, q_, absmax, code, blocksize);
  const c10::cuda::CUDAGuard guard(q_.device());
  const at::Tensor q = q_.contiguous(), a = absmax.contiguous(), c = code.contiguous();
  const int64_t n = q.numel();
  at::Tensor out = at::empty({n}, a.options());
  fasttrain::cuda::TorchDevice dev(q);
  nk::blockwise8_dequantize(dev, q.const_data_ptr<uint8_t>(), a.const_data_ptr<float>(), c.const_data_ptr<float>(), n,
                            blocksize, out.data_ptr<float>());
  return out;
}

}  // namespace fasttrain

TORCH_LIBRARY_IMPL(fasttrain, CUDA, m) {
  m.impl("nf4_quantize", &fasttrain::nf4_quantize_cuda);
  m.impl("nf4_dequantize", &fasttrain::nf4_dequantize_cuda);
  m.impl("blockwise8_quantize", &fasttrain::blockwise8_quantize_cuda);
  m.impl("blockwise8_dequantize", &fasttrain::blockwise8_dequantize_cuda);
}
