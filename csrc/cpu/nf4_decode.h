// NF4 rows decoded on the CPU into a caller's buffer (float32, bfloat16 or float64): the one decode
// loop of the CPU kernels that multiply NF4 weights (nf4_linear, moe_experts). The element math is
// core/math.h's nf4_decode; with AVX2 + FMA, 16 values per step by a register table lookup. Compiled
// once per CPU variant (core/variant.h), so the AVX2 path exists only in the variants that have it.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FT_NF4_AVX2 1
#endif

#include "core/math.h"
#include "core/variant.h"

namespace fasttrain {
FT_VARIANT_BEGIN
namespace nf4cpu {
namespace fm = fasttrain::math;

#ifdef FT_NF4_AVX2
// 16 fp32 values (a then b) -> 16 bf16, rounded to nearest even as c10::BFloat16(float) rounds
// (bits + 0x7FFF + bit 16, then the high half). The decoded values are finite (a level times an
// absmax), so the NaN case of that conversion never arises; the result equals the scalar path's.
inline __m256i bf16_round_pack(__m256 a, __m256 b) {
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  auto round = [&](__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
  };
  // packus works within 128-bit lanes: [a0-3 b0-3 | a4-7 b4-7]; restore the order a0-7 b0-7
  const __m256i p = _mm256_packus_epi32(round(a), round(b));
  return _mm256_permute4x64_epi64(p, 0xD8);
}
#endif

// Decode the flat NF4 range [i0, i1) (row-major index over the [N, K] matrix) into out[0 .. i1-i0).
template <typename T>
inline void decode_range(const uint8_t* q, const float* absmax, int64_t bs, int64_t i0, int64_t i1, T* out) {
  int64_t i = i0;
  while (i < i1) {
    const int64_t block_end = std::min(i1, (i / bs + 1) * bs);
    const float s = absmax[i / bs];
    if (i & 1) {  // odd start: the low nibble of a byte
      out[i - i0] = static_cast<T>(fm::nf4_decode(q[i / 2], false, s));
      ++i;
    }
#ifdef FT_NF4_AVX2
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
      // 16 levels in two 8-lane registers; permutevar8x32 looks up the low 3 bits, bit 3 selects.
      alignas(32) static const float lv[16] = {
          fm::nf4_level(0), fm::nf4_level(1), fm::nf4_level(2),  fm::nf4_level(3),
          fm::nf4_level(4), fm::nf4_level(5), fm::nf4_level(6),  fm::nf4_level(7),
          fm::nf4_level(8), fm::nf4_level(9), fm::nf4_level(10), fm::nf4_level(11),
          fm::nf4_level(12), fm::nf4_level(13), fm::nf4_level(14), fm::nf4_level(15)};
      const __m256 t0 = _mm256_load_ps(lv), t1 = _mm256_load_ps(lv + 8);
      const __m256 sv = _mm256_set1_ps(s);
      const __m256i fifteen = _mm256_set1_epi32(15);
      auto lookup = [&](__m256i c) {
        const __m256 a = _mm256_permutevar8x32_ps(t0, c), b = _mm256_permutevar8x32_ps(t1, c);
        const __m256 hi_half = _mm256_castsi256_ps(_mm256_slli_epi32(c, 28));  // bit 3 → sign bit
        return _mm256_blendv_ps(a, b, hi_half);
      };
      for (; i + 16 <= block_end; i += 16) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i / 2)));
        const __m256 h = lookup(_mm256_srli_epi32(v, 4));          // elements 2j
        const __m256 l = lookup(_mm256_and_si256(v, fifteen));     // elements 2j+1
        const __m256 u0 = _mm256_unpacklo_ps(h, l), u1 = _mm256_unpackhi_ps(h, l);
        T* o = out + (i - i0);
        const __m256 f0 = _mm256_mul_ps(_mm256_permute2f128_ps(u0, u1, 0x20), sv);
        const __m256 f1 = _mm256_mul_ps(_mm256_permute2f128_ps(u0, u1, 0x31), sv);
        if constexpr (std::is_same_v<T, float>) {
          _mm256_storeu_ps(o, f0);
          _mm256_storeu_ps(o + 8, f1);
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), bf16_round_pack(f0, f1));
        }
      }
    }
#endif
    for (; i + 2 <= block_end; i += 2) {
      const uint8_t b = q[i / 2];
      out[i - i0] = static_cast<T>(fm::nf4_decode(b, true, s));
      out[i - i0 + 1] = static_cast<T>(fm::nf4_decode(b, false, s));
    }
    if (i < block_end) {  // one element left in this block (i even): high nibble
      out[i - i0] = static_cast<T>(fm::nf4_decode(q[i / 2], true, s));
      ++i;
    }
  }
}

}  // namespace nf4cpu
FT_VARIANT_END
}  // namespace fasttrain
