// NF4 quantize / dequantize and 8-bit blockwise quantization (for double-quantized absmax), CPU.
// Bit-compatible with bitsandbytes (0.45-0.50): see core/math.h for the rounding and scale rules.
// Parallel over quantization blocks with at::parallel_for (torch's own thread pool).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "core/variant.h"
#include "core/checks.h"
#include "core/dispatch.h"
#include "core/nf4_checks.h"
#include "core/math.h"
#include "cpu/parallel.h"
#include "cpu/register.h"
#include "ops.h"

namespace fasttrain {
FT_VARIANT_BEGIN
namespace fm = fasttrain::math;

std::tuple<at::Tensor, at::Tensor> nf4_quantize_cpu(const at::Tensor& w, int64_t blocksize) {
  constexpr const char* op = "fasttrain::nf4_quantize";
  FT_CHECK_DEVICE_TYPE(op, w, at::kCPU);
  check_nf4_quantize(op, w, blocksize);
  const at::Tensor x = w.contiguous();
  const int64_t n = x.numel();
  const int64_t nblocks = (n + blocksize - 1) / blocksize;
  at::Tensor packed = at::empty({(n + 1) / 2}, x.options().dtype(at::kByte));
  at::Tensor absmax = at::empty({nblocks}, x.options().dtype(at::kFloat));
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* am = absmax.data_ptr<float>();

  FT_DISPATCH_FLOATING(x.scalar_type(), "nf4_quantize_cpu", [&] {
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    fasttrain::parallel_for(0, nblocks, 64, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t start = b * blocksize, end = std::min(n, start + blocksize);
        const bool tail = (end - start) < blocksize;
        float m = 0.0f;
        for (int64_t i = start; i < end; ++i) m = std::max(m, std::fabs(static_cast<float>(in[i])));
        am[b] = fm::blockwise_stored_absmax(m, tail);
        for (int64_t i = start; i < end; i += 2) {
          const uint8_t hi = fm::nf4_code_of(fm::blockwise_scale(static_cast<float>(in[i]), m, tail));
          // An odd total length pads the last low nibble with the code of 0.0 (as bitsandbytes).
          const float lo_val = (i + 1 < end) ? fm::blockwise_scale(static_cast<float>(in[i + 1]), m, tail) : 0.0f;
          out[i / 2] = fm::nf4_pack(hi, fm::nf4_code_of(lo_val));
        }
      }
    });
  });
  return {packed, absmax};
}

at::Tensor nf4_dequantize_cpu(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                              int64_t numel, at::ScalarType dtype) {
  constexpr const char* op = "fasttrain::nf4_dequantize";
  FT_CHECK_DEVICE_TYPE(op, packed, at::kCPU);
  check_nf4_dequantize(op, packed, absmax, blocksize, numel, dtype);
  const at::Tensor q = packed.contiguous();
  const at::Tensor a = absmax.contiguous();
  at::Tensor out = at::empty({numel}, packed.options().dtype(dtype));
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  const float* ap = a.const_data_ptr<float>();
  // Byte -> (high level, low level) table built once from the shared codebook: a load per byte
  // instead of two 16-way selects. Work per block: one absmax, blocksize/2 table loads.
  static const auto lut = [] {
    std::array<std::array<float, 2>, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = {fm::nf4_level(b >> 4), fm::nf4_level(b & 15)};
    return t;
  }();
  const int64_t nblocks = (numel + blocksize - 1) / blocksize;
  FT_DISPATCH_FLOATING(dtype, "nf4_dequantize_cpu", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    fasttrain::parallel_for(0, nblocks, std::max<int64_t>(1, 16384 / blocksize), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float s = ap[b];
        const int64_t start = b * blocksize, end = std::min(numel, start + blocksize);
        const int64_t pairs_end = start + ((end - start) & ~int64_t(1));
        for (int64_t i = start; i < pairs_end; i += 2) {
          const auto& lv = lut[qp[i / 2]];
          o[i] = static_cast<scalar_t>(lv[0] * s);
          o[i + 1] = static_cast<scalar_t>(lv[1] * s);
        }
        if (pairs_end < end) o[pairs_end] = static_cast<scalar_t>(lut[qp[pairs_end / 2]][0] * s);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> blockwise8_quantize_cpu(const at::Tensor& x_, const at::Tensor& code,
                                                           int64_t blocksize) {
  constexpr const char* op = "fasttrain::blockwise8_quantize";
  FT_CHECK_DEVICE_TYPE(op, x_, at::kCPU);
  check_blockwise8_quantize(op, x_, code, blocksize);
  const at::Tensor x = x_.contiguous();
  const at::Tensor c = code.contiguous();
  const int64_t n = x.numel(), nblocks = (n + blocksize - 1) / blocksize;
  at::Tensor q = at::empty({n}, x.options().dtype(at::kByte));
  at::Tensor absmax = at::empty({nblocks}, x.options());
  const float* in = x.const_data_ptr<float>();
  const float* cp = c.const_data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* am = absmax.data_ptr<float>();
  fasttrain::parallel_for(0, nblocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * blocksize, end = std::min(n, start + blocksize);
      const bool tail = (end - start) < blocksize;
      float m = 0.0f;
      for (int64_t i = start; i < end; ++i) m = std::max(m, std::fabs(in[i]));
      am[b] = fm::blockwise_stored_absmax(m, tail);
      for (int64_t i = start; i < end; ++i)
        qp[i] = static_cast<uint8_t>(fm::sorted_code_index(cp, 256, fm::blockwise_scale(in[i], m, tail)));
    }
  });
  return {q, absmax};
}

at::Tensor blockwise8_dequantize_cpu(const at::Tensor& q_, const at::Tensor& absmax, const at::Tensor& code,
                                     int64_t blocksize) {
  constexpr const char* op = "fasttrain::blockwise8_dequantize";
  FT_CHECK_DEVICE_TYPE(op, q_, at::kCPU);
  check_blockwise8_dequantize(op, q_, absmax, code, blocksize);
  const at::Tensor q = q_.contiguous(), a = absmax.contiguous(), c = code.contiguous();
  const int64_t n = q.numel();
  at::Tensor out = at::empty({n}, a.options());
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  const float* ap = a.const_data_ptr<float>();
  const float* cp = c.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  fasttrain::parallel_for(0, n, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) o[i] = cp[qp[i]] * ap[i / blocksize];
  });
  return out;
}

void register_nf4(torch::Library& m) {
  m.impl("nf4_quantize", &nf4_quantize_cpu);
  m.impl("nf4_dequantize", &nf4_dequantize_cpu);
  m.impl("blockwise8_quantize", &blockwise8_quantize_cpu);
  m.impl("blockwise8_dequantize", &blockwise8_dequantize_cpu);
}

FT_VARIANT_END
}  // namespace fasttrain
