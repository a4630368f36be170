// The CUDA emulator's fasttrain::cuda::Device (device.h says what it serves and how).
#include "cuda_emu/device.h"

#include <cstring>

namespace fasttrain::cuda_emu {
namespace {
int g_multiprocessors = 132;
int64_t g_scratch_bytes = 0;

// A column-major matrix (rows x cols, leading dimension ld) as a CPU tensor view [rows, cols].
at::Tensor column_major(const void* p, int64_t rows, int64_t cols, int64_t ld, at::ScalarType t) {
  return at::from_blob(const_cast<void*>(p), {cols, rows}, {ld, 1}, at::TensorOptions().dtype(t)).t();
}
}  // namespace

void set_multiprocessors(int n) { g_multiprocessors = n; }
int64_t last_scratch_bytes() { return g_scratch_bytes; }
void begin_op() { g_scratch_bytes = 0; }
int EmuDevice::multiprocessors() const { return g_multiprocessors; }

void* EmuDevice::scratch(int64_t bytes) {
  held_.push_back(poisoned({bytes}, at::TensorOptions().dtype(at::kByte)));
  g_scratch_bytes += bytes;
  return held_.back().data_ptr();
}

void EmuDevice::gemm_nonempty(const fasttrain::cuda::Gemm& g) {
  const at::ScalarType acc = g.out == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor a = g.trans_a ? column_major(g.a, g.k, g.m, g.lda, g.in).t() : column_major(g.a, g.m, g.k, g.lda, g.in);
  at::Tensor b = g.trans_b ? column_major(g.b, g.n, g.k, g.ldb, g.in).t() : column_major(g.b, g.k, g.n, g.ldb, g.in);
  at::Tensor c = column_major(g.c, g.m, g.n, g.ldc, g.out);
  at::Tensor prod = at::mm(a.to(acc), b.to(acc));
  if (g.alpha != 1.0) prod.mul_(g.alpha);
  if (g.beta != 0.0) prod.add_(c.to(acc), g.beta);
  c.copy_(prod);
}

void EmuDevice::zero_2d(void* dst, int64_t pitch_bytes, int64_t width_bytes, int64_t height) {
  for (int64_t r = 0; r < height; ++r) std::memset(static_cast<char*>(dst) + r * pitch_bytes, 0, width_bytes);
}

void EmuDevice::fill(void* dst, at::ScalarType type, double value, int64_t n) {
  at::from_blob(dst, {n}, at::TensorOptions().dtype(type)).fill_(value);
}

void EmuDevice::convert(void* dst, at::ScalarType dst_type, const void* src, at::ScalarType src_type, int64_t n) {
  at::from_blob(dst, {n}, at::TensorOptions().dtype(dst_type))
      .copy_(at::from_blob(const_cast<void*>(src), {n}, at::TensorOptions().dtype(src_type)));
}

void EmuDevice::copy_to_host(void* dst, const void* src, int64_t bytes) { std::memcpy(dst, src, bytes); }

at::Tensor poisoned(c10::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  if (t.numel() > 0) std::memset(t.data_ptr(), 0xFF, t.nbytes());
  return t;
}

}  // namespace fasttrain::cuda_emu
