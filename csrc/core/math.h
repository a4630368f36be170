// The math of every fasttrain op, written once as __host__ __device__ inline functions so the CPU
// kernels (and therefore the CPU tests) run exactly the formulas the CUDA kernels run.
// This file is math only: no tensors, no allocation, no launch code.
#pragma once
#include <bit>
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

// exp for float32. On the GPU: the hardware-assisted expf. On the CPU: a branch-free Cephes-style
// exp (range reduction by ln2 in two parts + degree-6 polynomial, max error ~2 ulp on [-87, 88]),
// written so GCC vectorizes the token loop with AVX-512 (a libm expf call would keep it scalar).
FT_HD float exp_f32(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  const float hi = 88.7228317f, lo = -87.3365479f;
  const float xc = x > hi ? hi : (x < lo ? lo : x);
  // Round to nearest by the 1.5*2^23 trick (vectorizes; nearbyint may become a libm call).
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = xc - n * 0.693359375f;          // ln2 split: exact high part ...
  r = r - n * -2.12194440e-4f;              // ... and the low remainder
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n by building the exponent bits; n in [-126, 128]: split in two factors to stay normal.
  const int ni = (int)n;
  const int n1 = ni >> 1, n2 = ni - n1;
  float y = p * std::bit_cast<float>((n1 + 127) << 23) * std::bit_cast<float>((n2 + 127) << 23);
  y = x > hi ? INFINITY : y;
  y = x < lo ? 0.0f : y;
  return x != x ? x : y;  // NaN in, NaN out
#endif
}

// Which policy-gradient term (the op's `loss_type`).
enum PolicyLossKind : int { kCispo = 0, kDapo = 1, kGrpo = 2 };

// REPO-R advantage factor: A' = A * factor with factor = 1 - zeta*log p (A > 0) or 1 + zeta*log p
// (A < 0), log p detached and clamped at -20, and never below 0 so the advantage's sign never
// flips. A = 0 gets factor 1 (A' = 0 either way). zeta = 0 gives exactly 1.
FT_HD float repo_r_factor(float adv, float logp, float zeta) {
  const float lp = logp < -20.0f ? -20.0f : logp;
  // sign(-A) as arithmetic, not nested selects: GCC keeps this vectorizable when A is loop-invariant.
  const float s = static_cast<float>(adv < 0.0f) - static_cast<float>(adv > 0.0f);
  const float f = 1.0f + s * zeta * lp;
  return f < 0.0f ? 0.0f : f;
}

// Everything one token contributes: its loss, d loss / d logp, and the statistics' terms.
struct PolicyToken {
  float loss;     // policy-gradient term + beta * k3 KL
  float grad;     // d loss / d logp (the REPO-R factor and the CISPO weight are detached)
  float ratio;    // r = exp(logp - old_logp)
  float kl;       // k3 KL estimate (without beta); 0 when has_kl is false
  float factor;   // REPO-R factor
  float clip_low, clip_high, capped;  // 0/1 indicators
};

// Per-token loss of shared/DESIGN.md section 5, one formula for CPU and CUDA.
//  CISPO (MiniMax-M1, 2025): -sg(min(r, cap)) * A' * logp; its gradient -min(r, cap) * A' never
//    vanishes, capped tokens still learn (the point of CISPO against PPO's clip).
//  DAPO (Yu et al. 2025, clip-higher) / PPO: -min(r A', clip(r, 1-eps_low, 1+eps_high) A'); the
//    gradient -A' r, or 0 where the clipped branch is the smaller (r > 1+eps_high with A' > 0,
//    r < 1-eps_low with A' < 0). Ties follow torch.minimum/clamp, whose gradients sum to -A' r.
//    GRPO is the same with eps_high = eps_low (the caller passes that).
//  k3 KL (Schulman 2020): beta * (exp(ref - logp) - (ref - logp) - 1), gradient beta * (1 - exp(ref - logp)).
template <bool kCispoLoss, bool kHasKl>
FT_HD PolicyToken policy_token(float logp, float old_logp, float adv, float ref_logp, float beta,
                               float eps_low, float eps_high, float cispo_cap, float zeta) {
  PolicyToken t;
  t.factor = repo_r_factor(adv, logp, zeta);
  const float a = adv * t.factor;
  const float r = exp_f32(logp - old_logp);
  t.ratio = r;
  if (kCispoLoss) {
    const float w = r < cispo_cap ? r : cispo_cap;
    t.loss = -w * a * logp;
    t.grad = -w * a;
    t.capped = static_cast<float>(r > cispo_cap);
    t.clip_low = 0.0f;
    t.clip_high = 0.0f;
  } else {
    const float lo = 1.0f - eps_low, hi = 1.0f + eps_high;
    const float rc = r < lo ? lo : (r > hi ? hi : r);
    const float u1 = r * a, u2 = rc * a;
    t.loss = -(u1 < u2 ? u1 : u2);
    // Indicators as float products, not bool selects: GCC vectorizes this when A is loop-invariant.
    t.clip_high = static_cast<float>(a > 0.0f) * static_cast<float>(r > hi);
    t.clip_low = static_cast<float>(a < 0.0f) * static_cast<float>(r < lo);
    t.capped = 0.0f;
    t.grad = -a * r * (1.0f - t.clip_high - t.clip_low);  // the two are exclusive
  }
  if (kHasKl) {
    const float d = ref_logp - logp;
    const float e = exp_f32(d);
    t.kl = e - d - 1.0f;
    t.loss += beta * t.kl;
    t.grad += beta * (1.0f - e);
  } else {
    t.kl = 0.0f;
  }
  return t;
}

// Sums one chunk of tokens contributes, in this order (the partials buffer's layout).
enum PolicySum : int {
  kSumLoss = 0,    // sum w * loss
  kSumWeight,      // sum w (the active tokens: mask values)
  kSumRatio,       // sum w * r
  kSumClipLow,     // sum w * [clipped low]
  kSumClipHigh,    // sum w * [clipped high]
  kSumCapped,      // sum w * [r > cap]
  kSumKl,          // sum w * kl
  kSumFactor,      // sum w * factor over tokens with A != 0
  kSumNonzeroAdv,  // sum w over tokens with A != 0
  kPolicySums
};

// The stats vector returned by the op, in this order (python/fasttrain/ops/policy_loss.py names them).
enum PolicyStat : int {
  kStatRatioMean = 0, kStatClipLowFrac, kStatClipHighFrac, kStatCapFrac, kStatKlMean,
  kStatRepoRFactorMean, kStatActiveTokens, kPolicyStats
};

// Batch sums -> stats. Means are over the active tokens weighted by the mask; with no active token
// the means are the neutral values (ratio 1, fractions 0, KL 0, factor 1) rather than NaN.
FT_HD void policy_stats(const double* sums, float* stats) {
  const double w = sums[kSumWeight];
  const double inv = w > 0.0 ? 1.0 / w : 0.0;
  stats[kStatRatioMean] = w > 0.0 ? (float)(sums[kSumRatio] * inv) : 1.0f;
  stats[kStatClipLowFrac] = (float)(sums[kSumClipLow] * inv);
  stats[kStatClipHighFrac] = (float)(sums[kSumClipHigh] * inv);
  stats[kStatCapFrac] = (float)(sums[kSumCapped] * inv);
  stats[kStatKlMean] = (float)(sums[kSumKl] * inv);
  const double wa = sums[kSumNonzeroAdv];
  stats[kStatRepoRFactorMean] = wa > 0.0 ? (float)(sums[kSumFactor] / wa) : 1.0f;
  stats[kStatActiveTokens] = (float)w;
}

// =====================================================================================
// nf4_linear (issue 5): LoRA / DoRA helpers.
// =====================================================================================

}  // namespace fasttrain::math
