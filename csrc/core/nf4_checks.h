// Argument checks of fasttrain::nf4_quantize, nf4_dequantize, blockwise8_quantize and
// blockwise8_dequantize, shared by the CPU and CUDA host functions so both backends reject the same
// inputs with the same messages. The device-type check (CPU or CUDA) stays in each backend.
#pragma once
#include <ATen/core/Tensor.h>

#include "core/variant.h"
#include "core/checks.h"

namespace fasttrain {
FT_VARIANT_BEGIN

inline void check_nf4_blocksize(const char* op, int64_t blocksize) {
  TORCH_CHECK(blocksize >= 2 && blocksize % 2 == 0 && blocksize <= 65536, op,
              ": blocksize must be an even number in [2, 65536], got ", blocksize);
}

inline void check_nf4_quantize(const char* op, const at::Tensor& w, int64_t blocksize) {
  FT_CHECK_FLOATING(op, w);
  FT_CHECK_ARG(w.numel() > 0, op, "w", "is empty");
  check_nf4_blocksize(op, blocksize);
}

inline void check_nf4_dequantize(const char* op, const at::Tensor& packed, const at::Tensor& absmax,
                                 int64_t blocksize, int64_t numel, at::ScalarType dtype) {
  FT_CHECK_SAME_DEVICE(op, packed, absmax);
  FT_CHECK_DTYPE(op, packed, at::kByte);
  FT_CHECK_DTYPE(op, absmax, at::kFloat);
  check_nf4_blocksize(op, blocksize);
  FT_CHECK_ARG(numel > 0, op, "numel", "must be positive, got ", numel);
  FT_CHECK_ARG(packed.numel() == (numel + 1) / 2, op, "packed", "must hold ceil(numel/2) = ",
               (numel + 1) / 2, " bytes, got ", packed.numel());
  FT_CHECK_ARG(absmax.numel() == (numel + blocksize - 1) / blocksize, op, "absmax",
               "must hold one value per block (", (numel + blocksize - 1) / blocksize, "), got ",
               absmax.numel());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": dtype must be float32, float16 or bfloat16, got ", dtype);
}

// x_ keeps the host functions' parameter name: the messages name it as they always have.
inline void check_blockwise8_quantize(const char* op, const at::Tensor& x_, const at::Tensor& code,
                                      int64_t blocksize) {
  FT_CHECK_SAME_DEVICE(op, x_, code);
  FT_CHECK_DTYPE(op, x_, at::kFloat);
  FT_CHECK_DTYPE(op, code, at::kFloat);
  FT_CHECK_ARG(code.numel() == 256, op, "code", "must have 256 entries, got ", code.numel());
  FT_CHECK_ARG(x_.numel() > 0, op, "x", "is empty");
  check_nf4_blocksize(op, blocksize);
}

inline void check_blockwise8_dequantize(const char* op, const at::Tensor& q_, const at::Tensor& absmax,
                                        const at::Tensor& code, int64_t blocksize) {
  FT_CHECK_SAME_DEVICE(op, q_, absmax);
  FT_CHECK_SAME_DEVICE(op, q_, code);
  FT_CHECK_DTYPE(op, q_, at::kByte);
  FT_CHECK_DTYPE(op, absmax, at::kFloat);
  FT_CHECK_DTYPE(op, code, at::kFloat);
  check_nf4_blocksize(op, blocksize);
  FT_CHECK_ARG(absmax.numel() == (q_.numel() + blocksize - 1) / blocksize, op, "absmax",
               "must hold one value per block");
}

FT_VARIANT_END
}  // namespace fasttrain
