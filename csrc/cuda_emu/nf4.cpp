// fasttrain_emu::nf4_{quantize,dequantize}, blockwise8_{quantize,dequantize}: the CUDA kernels and
// launch sequences of cuda/kernels/nf4.cuh on CPU tensors, with the CUDA wrappers' checks.
#include "cuda_emu/prelude.h"

#include <torch/library.h>

#include "core/nf4_checks.h"
#include "cuda/kernels/nf4.cuh"
#include "cuda_emu/device.h"

namespace fasttrain::cuda_emu {
namespace nf4_emu {  // named, not anonymous: the unity build joins the emulator's files
namespace nk = fasttrain::cuda::nf4;

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& w, int64_t blocksize) {
  check_nf4_quantize("fasttrain_emu::nf4_quantize", w, blocksize);
  const at::Tensor x = w.contiguous();
  const int64_t n = x.numel(), nblocks = (n + blocksize - 1) / blocksize;
  at::Tensor packed = poisoned({(n + 1) / 2}, x.options().dtype(at::kByte));
  at::Tensor absmax = poisoned({nblocks}, x.options().dtype(at::kFloat));
  EmuDevice dev;
  nk::quantize(dev, x.scalar_type(), x.const_data_ptr(), n, blocksize, packed.data_ptr<uint8_t>(),
               absmax.data_ptr<float>());
  return {packed, absmax};
}

at::Tensor dequantize(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize, int64_t numel,
                      at::ScalarType dtype) {
  check_nf4_dequantize("fasttrain_emu::nf4_dequantize", packed, absmax, blocksize, numel, dtype);
  const at::Tensor q = packed.contiguous(), a = absmax.contiguous();
  at::Tensor out = poisoned({numel}, packed.options().dtype(dtype));
  EmuDevice dev;
  nk::dequantize(dev, dtype, q.const_data_ptr<uint8_t>(), a.const_data_ptr<float>(), blocksize, numel, out.data_ptr());
  return out;
}

std::tuple<at::Tensor, at::Tensor> b8_quantize(const at::Tensor& x_, const at::Tensor& code, int64_t blocksize) {
  check_blockwise8_quantize("fasttrain_emu::blockwise8_quantize", x_, code, blocksize);
  const at::Tensor x = x_.contiguous(), c = code.contiguous();
  const int64_t n = x.numel(), nblocks = (n + blocksize - 1) / blocksize;
  at::Tensor q = poisoned({n}, x.options().dtype(at::kByte));
  at::Tensor absmax = poisoned({nblocks}, x.options());
  EmuDevice dev;
  nk::blockwise8_quantize(dev, x.const_data_ptr<float>(), c.const_data_ptr<float>(), n, blocksize,
                          q.data_ptr<uint8_t>(), absmax.data_ptr<float>());
  return {q, absmax};
}

at::Tensor b8_dequantize(const at::Tensor& q_, const at::Tensor& absmax, const at::Tensor& code, int64_t blocksize) {
  check_blockwise8_dequantize("fasttrain_emu::blockwise8_dequantize", q_, absmax, code, blocksize);
  const at::Tensor q = q_.contiguous(), a = absmax.contiguous(), c = code.contiguous();
  at::Tensor out = poisoned({q.numel()}, a.options());
  EmuDevice dev;
  nk::blockwise8_dequantize(dev, q.const_data_ptr<uint8_t>(), a.const_data_ptr<float>(), c.const_data_ptr<float>(),
                            q.numel(), blocksize, out.data_ptr<float>());
  return out;
}
}  // namespace nf4_emu

TORCH_LIBRARY_IMPL(fasttrain_emu, CPU, m) {
  m.impl("nf4_quantize", &nf4_emu::quantize);
  m.impl("nf4_dequantize", &nf4_emu::dequantize);
  m.impl("blockwise8_quantize", &nf4_emu::b8_quantize);
  m.impl("blockwise8_dequantize", &nf4_emu::b8_dequantize);
}

}  // namespace fasttrain::cuda_emu
