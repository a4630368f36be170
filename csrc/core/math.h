// The math of every fasttrain op, written once as __host__ __device__ inline functions so the CPU
// kernels (and therefore the CPU tests) run exactly the formulas the CUDA kernels run.
// This file is math only: no tensors, no allocation, no launch code.
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FT_HD __host__ __device__ __forceinline__
#define FT_UNROLL _Pragma("unroll")
#else
#define FT_HD inline
#define FT_UNROLL
#endif

namespace fasttrain::math {

// =====================================================================================
// NF4 (issue 2). The 16 NormalFloat-4 levels of QLoRA (Dettmers et al. 2023), as float32 values
// exactly as bitsandbytes stores them. A code is the 4-bit index into this table.
// =====================================================================================
FT_HD float nf4_level(int code) {
  // Branch-free table in a switch so nvcc keeps it in registers/immediates (no local memory).
  switch (code & 15) {
    case 0: return -1.0f;
    case 1: return -0.6961928009986877f;
    case 2: return -0.5250730514526367f;
    case 3: return -0.39491748809814453f;
    case 4: return -0.28444138169288635f;
    case 5: return -0.18477343022823334f;
    case 6: return -0.09105003625154495f;
    case 7: return 0.0f;
    case 8: return 0.07958029955625534f;
    case 9: return 0.16093020141124725f;
    case 10: return 0.24611230194568634f;
    case 11: return 0.33791524171829224f;
    case 12: return 0.44070982933044434f;
    case 13: return 0.5626170039176941f;
    case 14: return 0.7229568362236023f;
    default: return 1.0f;
  }
}

// Nearest level for a value already scaled into [-1, 1]. bitsandbytes' rule: the code is the number
// of float32 midpoints (l[i] + l[i+1]) / 2 that lie strictly below x, so a value exactly on a
// midpoint rounds to the lower level.
FT_HD uint8_t nf4_code_of(float x) {
  uint8_t q = 0;
FT_UNROLL
  for (int i = 0; i < 15; ++i) {
    const float mid = (nf4_level(i) + nf4_level(i + 1)) / 2.0f;
    q += (x > mid) ? 1 : 0;
  }
  return q;
}

// Scale of a block: values are multiplied by 1/absmax (a float32 reciprocal, then a product), as
// bitsandbytes does for full blocks; clamp keeps rounding noise inside [-1, 1].
FT_HD float nf4_clamp_unit(float x) { return x < -1.0f ? -1.0f : (x > 1.0f ? 1.0f : x); }

// Byte layout: element 2j in the high nibble, element 2j+1 in the low nibble.
FT_HD uint8_t nf4_pack(uint8_t even, uint8_t odd) { return (uint8_t)((even << 4) | (odd & 15)); }
FT_HD float nf4_decode(uint8_t byte, bool high, float absmax) {
  return nf4_level(high ? (byte >> 4) : (byte & 15)) * absmax;
}

// Nearest entry of a sorted code table (256 entries for 8-bit blockwise): the number of float32
// midpoints (c[i] + c[i+1]) / 2 strictly below x, found by binary search. Same tie rule as NF4.
FT_HD int sorted_code_index(const float* code, int n, float x) {
  int lo = 0, hi = n - 1;  // answer in [0, n-1]: count of midpoints below x
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    const float m = (code[mid] + code[mid + 1]) / 2.0f;
    if (x > m) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Block scale rule of bitsandbytes: full blocks multiply by the float32 reciprocal of absmax
// (floored at 1e-38, and the unfloored absmax is stored); the trailing partial block divides by
// its floored absmax, which is what gets stored. Returns the factor actually stored.
FT_HD float blockwise_stored_absmax(float absmax, bool tail) {
  return tail ? (absmax < 1e-38f ? 1e-38f : absmax) : absmax;
}
FT_HD float blockwise_scale(float x, float absmax, bool tail) {
  const float a = absmax < 1e-38f ? 1e-38f : absmax;
  return nf4_clamp_unit(tail ? x / a : x * (1.0f / a));
}

// =====================================================================================
// fused_logprob (issue 3): online log-sum-exp and entropy over vocabulary chunks.
// =====================================================================================

// =====================================================================================
// policy_loss (issue 4): per-token loss, gradient and REPO-R factor.
// =====================================================================================

// =====================================================================================
// nf4_linear (issue 5): LoRA / DoRA helpers.
// =====================================================================================

// DoRA's row norm ‖W_n + s·B_n·A‖ from its factorised parts (Liu et al. 2024 "DoRA"; the expansion
// is ours): ‖W_n‖² + 2s·B_n·(A·W_nᵀ) + s²·B_n·(A·Aᵀ)·B_nᵀ. Clamped at 0 against rounding.
template <typename T>
FT_HD T dora_row_norm(T w_sq, T b_dot_aw, T b_aat_b, T s) {
  const T n2 = w_sq + T(2) * s * b_dot_aw + s * s * b_aat_b;
  return n2 > T(0) ? sqrt(n2) : T(0);
}

}  // namespace fasttrain::math
