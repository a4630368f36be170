// The log-prob head's two products on AVX-512 BF16 CPUs that oneDNN's brgemm ukernel does not pack
// for (no AMX: at::native::cpublas::could_pack(bf16) is false there), by the vdpbf16ps instruction.
//
// Why by hand: on such a CPU (an AMD EPYC with avx512_bf16) the fused log-prob's products otherwise
// run on widened fp32 W chunks at the fp32 GEMM rate, while the bf16 dot-product instruction does
// twice the products per instruction and reads half the bytes. ATen offers no bf16 x bf16 -> fp32
// product on the CPU (aten::mm.dtype is CUDA-only; cpublas's bf16 -> fp32 gemm is not exported;
// mkldnn_matmul refuses an fp32 result for bf16 inputs), and a bf16 result would round the logits.
//
// The same sums as the widened path: every product of two bf16 values is exact in fp32, and
// vdpbf16ps adds the two products of a pair to the fp32 accumulator one after the other, each add
// rounded to nearest (only the order of the sums differs). Denormal bf16 inputs count as 0 and
// denormal results flush to 0 (the instruction's fixed DAZ/FTZ): magnitudes below 2^-126, which
// change a logit or an accumulator row by less than its own rounding.
//
// Layouts (W [V, H] bf16, H even), pairs of bf16 read as one 32-bit word, low half first:
//   logits  Pn[q][k2][b][l] = (W[64q + 16b + l][2k2], W[64q + 16b + l][2k2 + 1])
//           q < ceil(V / 64), k2 < H / 2, b < 4, l < 16; rows past V are 0
//   p·W     Pk[c][v2][b][l] = (W[2v2][64c + 16b + l], W[2v2 + 1][64c + 16b + l])
//           c < H / 64 (H a multiple of 64), v2 < ceil(V / 2); the row past an odd V is 0
// A 4-row x 64-column tile keeps 16 accumulators in registers and streams 256 contiguous bytes
// of the packed W per step.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512) && (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#include <immintrin.h>
#define FT_BF16_DOT 1
#define FT_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#else
#define FT_BF16_DOT 0
#endif

#include "cpu/parallel.h"

namespace fasttrain {
FT_VARIANT_BEGIN
namespace bf16_dot {

constexpr int64_t kCols = 64;   // vocabulary rows (logits) or hidden columns (p·W) of one tile
constexpr int64_t kRows = 4;    // tokens of one tile

// Whether this build of the kernels holds the instruction's code (the AVX-512 variant with GCC).
constexpr bool compiled() { return FT_BF16_DOT == 1; }

inline at::Tensor pack_logits(const at::Tensor& w) {
  const int64_t V = w.size(0), H = w.size(1), H2 = H / 2, nq = (V + kCols - 1) / kCols;
  at::Tensor out = at::empty({nq * H2 * kCols}, w.options().dtype(at::kInt));
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w.const_data_ptr<at::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  fasttrain::parallel_for(0, nq, 16, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      uint32_t* d = dst + q * H2 * kCols;
      for (int64_t c = 0; c < kCols; ++c) {
        const int64_t v = q * kCols + c;
        if (v < V) {
          const uint32_t* row = src + v * H2;
          for (int64_t k2 = 0; k2 < H2; ++k2) d[k2 * kCols + c] = row[k2];
        } else {
          for (int64_t k2 = 0; k2 < H2; ++k2) d[k2 * kCols + c] = 0u;
        }
      }
    }
  });
  return out;
}

inline at::Tensor pack_accumulator(const at::Tensor& w) {
  const int64_t V = w.size(0), H = w.size(1), V2 = (V + 1) / 2, nc = H / kCols;
  at::Tensor out = at::empty({nc * V2 * kCols}, w.options().dtype(at::kInt));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.const_data_ptr<at::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  fasttrain::parallel_for(0, V2, 256, [&](int64_t p0, int64_t p1) {
    for (int64_t v2 = p0; v2 < p1; ++v2) {
      const uint16_t* r0 = src + (2 * v2) * H;
      const uint16_t* r1 = 2 * v2 + 1 < V ? src + (2 * v2 + 1) * H : nullptr;
      for (int64_t c = 0; c < nc; ++c) {
        uint32_t* d = dst + (c * V2 + v2) * kCols;
        for (int64_t j = 0; j < kCols; ++j) {
          const int64_t k = c * kCols + j;
          d[j] = uint32_t(r0[k]) | (r1 ? uint32_t(r1[k]) << 16 : 0u);
        }
      }
    }
  });
  return out;
}

#if FT_BF16_DOT
// z[i, j] (row stride ldz) = h[i] . W[v0 + j] for i < nb, j < cs; h bf16 [nb, H] (row stride H),
// v0 a multiple of kCols.
FT_BF16_TARGET inline void logits(const at::BFloat16* h, int64_t nb, int64_t H, const at::Tensor& pn, int64_t v0,
                                  int64_t cs, float* z, int64_t ldz) {
  const int64_t H2 = H / 2;
  const uint32_t* hw = reinterpret_cast<const uint32_t*>(h);
  const uint32_t* pw = reinterpret_cast<const uint32_t*>(pn.const_data_ptr<int32_t>());
  // vocabulary tiles outside, token tiles inside: a tile of the packed W (kCols x H bf16) stays in
  // cache while every token of the block passes over it
  for (int64_t j = 0; j < cs; j += kCols) {
    const uint32_t* blk = pw + ((v0 + j) / kCols) * H2 * kCols;
    for (int64_t i0 = 0; i0 < nb; i0 += kRows) {
      const int64_t nr = std::min(kRows, nb - i0);
      const uint32_t* hr[kRows];
      for (int64_t r = 0; r < kRows; ++r) hr[r] = hw + (i0 + std::min(r, nr - 1)) * H2;
      __m512 acc[kRows][4];
      for (int r = 0; r < kRows; ++r)
        for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_setzero_ps();
      for (int64_t k2 = 0; k2 < H2; ++k2) {
        const uint32_t* s = blk + k2 * kCols;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(s), w1 = (__m512bh)_mm512_loadu_si512(s + 16),
                       w2 = (__m512bh)_mm512_loadu_si512(s + 32), w3 = (__m512bh)_mm512_loadu_si512(s + 48);
        for (int r = 0; r < kRows; ++r) {
          const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(hr[r][k2]));
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
          acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
          acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, w3);
        }
      }
      const int64_t left = cs - j;
      for (int64_t r = 0; r < nr; ++r) {
        float* zr = z + (i0 + r) * ldz + j;
        for (int b = 0; b < 4; ++b) {
          const int64_t n = std::min<int64_t>(16, left - 16 * b);
          if (n <= 0) break;
          const __mmask16 m = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
          _mm512_mask_storeu_ps(zr + 16 * b, m, acc[r][b]);
        }
      }
    }
  }
}

// acc[i, :] += p_hi[i] . W[v0 .. v0 + cp) + p_lo[i] . W[v0 .. v0 + cp) for i < nb: p_hi, p_lo bf16
// [nb, cp] (row stride cp, cp even, entries past the chunk 0), v0 even; acc fp32 [nb, H] (row stride
// H), H a multiple of kCols.
FT_BF16_TARGET inline void accumulate(const at::BFloat16* phi, const at::BFloat16* plo, int64_t nb, int64_t cp,
                                      const at::Tensor& pk, int64_t V, int64_t v0, int64_t H, float* acc) {
  const int64_t V2 = (V + 1) / 2, c2 = cp / 2, nc = H / kCols;
  const uint32_t* pw = reinterpret_cast<const uint32_t*>(pk.const_data_ptr<int32_t>());
  const uint32_t* hiw = reinterpret_cast<const uint32_t*>(phi);
  const uint32_t* low = reinterpret_cast<const uint32_t*>(plo);
  // hidden-column tiles outside, token tiles inside: the chunk's packed W for one column tile
  // (cp / 2 x 256 bytes) stays in cache while every token of the block passes over it
  for (int64_t c = 0; c < nc; ++c) {
    for (int64_t i0 = 0; i0 < nb; i0 += kRows) {
      const int64_t nr = std::min(kRows, nb - i0);
      const uint32_t *hr[kRows], *lr[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        hr[r] = hiw + (i0 + std::min(r, nr - 1)) * c2;
        lr[r] = low + (i0 + std::min(r, nr - 1)) * c2;
      }
      __m512 a[kRows][4];
      for (int64_t r = 0; r < kRows; ++r)
        for (int b = 0; b < 4; ++b)
          a[r][b] = _mm512_loadu_ps(acc + (i0 + std::min(r, nr - 1)) * H + c * kCols + 16 * b);
      const uint32_t* blk = pw + (c * V2 + v0 / 2) * kCols;
      for (int64_t v2 = 0; v2 < c2; ++v2) {
        const uint32_t* s = blk + v2 * kCols;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(s), w1 = (__m512bh)_mm512_loadu_si512(s + 16),
                       w2 = (__m512bh)_mm512_loadu_si512(s + 32), w3 = (__m512bh)_mm512_loadu_si512(s + 48);
        for (int r = 0; r < kRows; ++r) {
          const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(hr[r][v2]));
          const __m512bh y = (__m512bh)_mm512_set1_epi32(static_cast<int>(lr[r][v2]));
          a[r][0] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[r][0], x, w0), y, w0);
          a[r][1] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[r][1], x, w1), y, w1);
          a[r][2] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[r][2], x, w2), y, w2);
          a[r][3] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[r][3], x, w3), y, w3);
        }
      }
      for (int64_t r = 0; r < nr; ++r)
        for (int b = 0; b < 4; ++b) _mm512_storeu_ps(acc + (i0 + r) * H + c * kCols + 16 * b, a[r][b]);
    }
  }
}
#else
inline void logits(const at::BFloat16*, int64_t, int64_t, const at::Tensor&, int64_t, int64_t, float*, int64_t) {
  TORCH_CHECK(false, "fasttrain: the bf16 dot-product head is not compiled into this CPU variant");
}
inline void accumulate(const at::BFloat16*, const at::BFloat16*, int64_t, int64_t, const at::Tensor&, int64_t,
                       int64_t, int64_t, float*) {
  TORCH_CHECK(false, "fasttrain: the bf16 dot-product head is not compiled into this CPU variant");
}
#endif

}  // namespace bf16_dot
FT_VARIANT_END
}  // namespace fasttrain
