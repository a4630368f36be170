// The math of every fasttrain op, written once as __host__ __device__ inline functions so the CPU
// kernels (and therefore the CPU tests) run exactly the formulas the CUDA kernels run.
// This file is math only: no tensors, no allocation, no launch code.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>

#include "core/variant.h"

#if defined(__CUDACC__)
#define FT_HD __host__ __device__ __forceinline__
#define FT_UNROLL _Pragma("unroll")
#else
// always_inline: these are the bodies of the kernels' inner loops, a few instructions each. In a
// unity build (one translation unit per target, holding torch's headers) GCC's unit-growth limits
// left them as calls, 5-byte functions called per element, which kept the loops from vectorizing:
// the gated-delta kernel ran 10x below the chunked torch form on a 2-core AVX2 EPYC until this.
// tests/ops/test_cpu_variants.py checks that no fasttrain::math function is left out of line.
#define FT_HD inline __attribute__((always_inline))
#define FT_UNROLL
#endif

namespace fasttrain::math {
FT_VARIANT_BEGIN

// =====================================================================================
// NF4. The 16 NormalFloat-4 levels of QLoRA (Dettmers et al. 2023), as float32 values
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
// fused_logprob: online log-sum-exp and entropy over vocabulary chunks.
// =====================================================================================
// Per token n, over the vocabulary v, with z_v = (h_n . w_v + b_v) / T:
//   lse = log sum_v exp(z_v),  log p(target) = z_t - lse,  entropy = lse - sum_v p_v z_v.
// The sums are streamed over vocabulary chunks against a reference r (a running max), as
//   s = sum_v exp(z_v - r),  u = sum_v exp(z_v - r) (z_v - r),
// so that lse = r + log s and entropy = log s - u / s. Keeping u relative to r (instead of
// sum p z) avoids the cancellation lse - sum p z when |z| ~ 1e4 (both terms ~1e4 in fp32).
// The gradient vector a = sum_v exp(z_v - r) w_v is streamed the same way (the p.W product), and
// d log p / d h = (w_t - a / s) / T.
//
// Lazy rescaling: r only moves up when a chunk's max exceeds r by more than kLseLazyMargin
// (the "conditional rescale" of FlashAttention-4). Then exp(z - r) <= e^8 ~ 2981 cannot overflow
// (fp32 sums stay < V * 2981), r stays within 8 of the true max so s >= 1 never underflows, and
// the rescale of s, u and a (an N x H product on the GPU) happens a handful of times per token
// instead of once per chunk.
constexpr float kLseLazyMargin = 8.0f;

// exp/log resolved by type on host and device alike (expf/logf for float, exp/log for double).
FT_HD float ft_exp(float x) { return expf(x); }
FT_HD double ft_exp(double x) { return ::exp(x); }
FT_HD float ft_log(float x) { return logf(x); }
FT_HD double ft_log(double x) { return ::log(x); }

template <typename T>
struct LseState {
  T ref;  // reference r (-inf before the first chunk)
  T s;    // sum exp(z - r)
  T u;    // sum exp(z - r) (z - r)
};

template <typename T>
FT_HD LseState<T> lse_init() {
  return LseState<T>{-INFINITY, T(0), T(0)};
}

// The reference to use for a chunk whose max is chunk_max (lazy: keep r when close enough).
template <typename T>
FT_HD T lse_next_ref(T ref, T chunk_max) {
  return (chunk_max > ref + T(kLseLazyMargin)) ? chunk_max : ref;
}

// Move the state to a new reference new_ref >= ref; returns the factor exp(ref - new_ref) by which
// any other sum against the old reference (the p.W accumulator) must be multiplied.
template <typename T>
FT_HD T lse_rebase(LseState<T>& st, T new_ref) {
  if (!(new_ref > st.ref)) return T(1);
  T alpha;
  if (st.ref == -INFINITY) {  // nothing accumulated yet: (ref - new_ref) * s would be -inf * 0
    alpha = T(0);
    st.s = T(0);
    st.u = T(0);
  } else {
    const T d = st.ref - new_ref;  // < 0
    alpha = ft_exp(d);
    // sum e^{z-r'} (z-r') = e^{r-r'} sum e^{z-r} ((z-r) + (r-r'))
    st.u = alpha * (st.u + d * st.s);
    st.s = alpha * st.s;
  }
  st.ref = new_ref;
  return alpha;
}

// z - r for one vocabulary entry, floored at kLseDeltaFloor. exp of anything below the floor is
// exactly 0 in float32 and float64 alike (the smallest float64 subnormal is e^-744.4), so the floor
// changes no weight; what it changes is a logit of -inf (a banned token's bias, say): its entropy
// term exp(z - r) (z - r) becomes 0 * floor = 0 instead of 0 * (-inf) = NaN, and while no finite
// logit has been seen (r = -inf, a chunk whose logits are all -inf) its weight is exp(floor) = 0
// instead of exp(-inf + inf) = NaN. A NaN logit stays NaN.
constexpr float kLseDeltaFloor = -1024.0f;
template <typename T>
FT_HD T lse_delta(T z, T ref) {
  const T d = z - ref;
  return (d < T(kLseDeltaFloor) || z == T(-INFINITY)) ? T(kLseDeltaFloor) : d;
}

// One vocabulary entry's weight exp(z - r); its contribution to u is weight * lse_delta(z, r).
template <typename T>
FT_HD T lse_weight(T z, T ref) {
  return ft_exp(lse_delta(z, ref));
}

// Add partial sums (s_c, u_c) that were taken against the same reference.
template <typename T>
FT_HD void lse_add(LseState<T>& st, T s_c, T u_c) {
  st.s += s_c;
  st.u += u_c;
}

// Merge two states taken against different references (split-vocabulary reductions).
template <typename T>
FT_HD LseState<T> lse_merge(LseState<T> a, LseState<T> b) {
  if (b.ref > a.ref) { LseState<T> t = a; a = b; b = t; }
  if (b.ref == -INFINITY) return a;
  const T d = b.ref - a.ref;  // <= 0
  const T e = ft_exp(d);
  a.s += e * b.s;
  a.u += e * (b.u + d * b.s);
  return a;
}

template <typename T>
FT_HD T lse_value(const LseState<T>& st) { return st.ref + ft_log(st.s); }

// log p of an entry as (z - r) - log s, not z - (r + log s): z - r is exact when z is near the max
// (Sterbenz), as in log_softmax, so |z| ~ 1e4 does not cost 1e4 * eps of absolute error. The
// backward keeps (r, log s) for the same reason instead of their rounded sum lse.
template <typename T>
FT_HD T lse_logprob(T z, T ref, T log_s) { return (z - ref) - log_s; }

// Entropy of the distribution: lse - sum p z = log s - u / s (>= 0 up to rounding; clamped).
template <typename T>
FT_HD T lse_entropy(const LseState<T>& st) {
  const T h = ft_log(st.s) - st.u / st.s;
  return h > T(0) ? h : T(0);
}

// Probability of an entry from the saved statistics (backward recompute).
template <typename T>
FT_HD T softmax_prob(T z, T ref, T log_s) { return ft_exp(lse_logprob(z, ref, log_s)); }

// The kept set of a truncated draw (top_k / top_p / min_p): each filter keeps a prefix of the
// sorted logits, so one number per token names the set. The sampler records
// delta = z_target - z_cut > 0 in temperature-scaled logits (z_cut: midway between the smallest kept
// logit and the largest dropped one); the op rebuilds the absolute cut from its own target logit,
// cut = z_target - delta, and keeps
// {v : z_v >= cut} (ties at the boundary kept) and the target itself (the rounding of another
// forward never drops the sampled token). delta = +inf is the whole vocabulary (cut = -inf, also
// for a target logit of -inf, where z_target - delta would be NaN).
template <typename T>
FT_HD T kept_cut(T z_target, T delta) { return delta == T(INFINITY) ? T(-INFINITY) : z_target - delta; }

template <typename T>
FT_HD bool kept(T z, T cut, bool is_target) { return is_target || z >= cut; }

// Probability of an entry under the kept set's renormalised softmax (backward recompute): 0 outside.
template <typename T>
FT_HD T kept_prob(T z, T ref, T log_s, T cut, bool is_target) {
  return kept(z, cut, is_target) ? softmax_prob(z, ref, log_s) : T(0);
}

// d log p(t) / d z_v = 1[v == t] - p_v, scaled by the upstream gradient g and by 1/T for the
// logits before temperature: the coefficient of w_v (for dH) and of h (for dW) and of dbias.
template <typename T>
FT_HD T logprob_dlogit(T g, bool is_target, T p, T inv_temp) {
  return g * ((is_target ? T(1) : T(0)) - p) * inv_temp;
}

// =====================================================================================
// policy_loss: per-token loss, gradient and REPO-R factor.
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
// Which KL estimator the loss holds (the op's `kl_type`).
enum PolicyKlKind : int { kKlK3 = 0, kKlK3Ratio = 1 };

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
  float kl;       // the KL term (without beta): k3, or r * k3 for k3_ratio; 0 when has_kl is false
  float factor;   // REPO-R factor
  float clip_low, clip_high, capped;  // 0/1 indicators
};

// Per-token loss of the recipe (docs/design.md), one formula for CPU and CUDA.
//  CISPO (MiniMax-M1, 2025): -sg(min(r, cap)) * A' * logp; its gradient -min(r, cap) * A' never
//    vanishes, capped tokens still learn (the point of CISPO against PPO's clip).
//  DAPO (Yu et al. 2025, clip-higher) / PPO: -min(r A', clip(r, 1-eps_low, 1+eps_high) A'); the
//    gradient -A' r, or 0 where the clipped branch is the smaller (r > 1+eps_high with A' > 0,
//    r < 1-eps_low with A' < 0). Ties follow torch.minimum/clamp, whose gradients sum to -A' r.
//    GRPO is the same with eps_high = eps_low (the caller passes that).
//  KL to the reference, with d = ref - logp and k3 = e^d - d - 1 (Schulman 2020), k3 >= 0:
//   k3        beta * k3, gradient beta * (1 - e^d). Its expectation over tokens sampled from the
//             policy is grad KL(pi_ref || pi): the forward KL on-policy, neither KL off-policy.
//   k3_ratio  beta * r * k3 with r = exp(logp - old_logp) differentiable (DeepSeek-V3.2 §3.1; TRL's
//             use_bias_correction_kl). d/dlogp (r k3) = r k3 + r (1 - e^d) = r (k3 + 1 - e^d) = -r d,
//             so the gradient is beta * r * (logp - ref): the importance-weighted, unbiased estimate of
//             grad KL(pi || pi_ref) over tokens sampled from pi_old (the reverse KL, on- and off-policy).
//             Written as -r d, not r (k3 + 1 - e^d): no cancellation, and it stays linear in d where
//             the value grows as e^d. Not clamped (a clamp of the value would zero the gradient of the
//             tokens furthest from the reference; docs/design.md).
template <bool kCispoLoss, bool kHasKl, bool kKlRatio = false>
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
    const float k3 = e - d - 1.0f;
    if (kKlRatio) {
      t.kl = r * k3;
      t.grad += -beta * r * d;
    } else {
      t.kl = k3;
      t.grad += beta * (1.0f - e);
    }
    t.loss += beta * t.kl;
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
// nf4_linear: LoRA / DoRA helpers.
// =====================================================================================

// DoRA's row norm ‖W_n + s·B_n·A‖ from its factorised parts (Liu et al. 2024 "DoRA"; the expansion
// is ours): ‖W_n‖² + 2s·B_n·(A·W_nᵀ) + s²·B_n·(A·Aᵀ)·B_nᵀ. Clamped at 0 against rounding.
template <typename T>
FT_HD T dora_row_norm(T w_sq, T b_dot_aw, T b_aat_b, T s) {
  const T n2 = w_sq + T(2) * s * b_dot_aw + s * s * b_aat_b;
  return n2 > T(0) ? sqrt(n2) : T(0);
}

// =====================================================================================
// gated_delta: the gated delta rule (Gated DeltaNet; Yang, Kautz & Hatamizadeh 2024), one
// token of one (row, value head) with state S [Dk x Dv]:
//     S_a = e^g S;   r = S_aᵀk;   d = β(v − r);   S' = S_a + k dᵀ;   o = scale · S'ᵀq.
// Its backward, given the cotangents dS (of S') and do (of o):
//     dS += scale · q doᵀ;  dq = scale · S' do;  dd = dSᵀk;  dk = dS d + S_a dr;
//     dβ = dd·(v − r);  dv = β dd;  dr = −β dd;  dS_a = dS + k drᵀ;  dg = <dS_a, S_a>;  dS ← e^g dS_a.
// The CPU kernel walks rows of S and the CUDA kernel columns; both call these element formulas.
// =====================================================================================
template <typename T>
FT_HD T gdr_decay(T g) { return ft_exp(g); }
// The value written into the state: d_j = β (v_j − r_j).
template <typename T>
FT_HD T gdr_delta(T beta, T v, T r) { return beta * (v - r); }
// One element of the decayed state and of the updated state.
template <typename T>
FT_HD T gdr_decayed(T alpha, T s) { return alpha * s; }
template <typename T>
FT_HD T gdr_updated(T s_a, T k_i, T d_j) { return s_a + k_i * d_j; }
// dS_ij after the read-out's cotangent: dS_ij + scale·q_i·do_j.
template <typename T>
FT_HD T gdr_readout_grad(T ds, T scaled_q_i, T do_j) { return ds + scaled_q_i * do_j; }
// dS_a,ij = dS_ij + k_i·dr_j, and the carried cotangent e^g·dS_a,ij.
template <typename T>
FT_HD T gdr_ds_decayed(T ds, T k_i, T dr_j) { return ds + k_i * dr_j; }

// =====================================================================================
// moe_experts: the SwiGLU between an expert's gate_up and down projections, a = silu(g)·u with
// silu(g) = g·σ(g), and its backward: dg = da·u·σ(g)·(1 + g·(1 − σ(g))), du = da·silu(g).
// σ(g) = 1 / (1 + e^−g) saturates to 0 or 1 without NaN (e^−g = inf gives 1/inf = 0).
// =====================================================================================
template <typename T>
FT_HD T moe_sigmoid(T g) { return T(1) / (T(1) + ft_exp(-g)); }
template <typename T>
FT_HD T moe_swiglu(T g, T u) { return g * moe_sigmoid(g) * u; }
template <typename T>
FT_HD void moe_swiglu_backward(T g, T u, T da, T& dg, T& du) {
  const T sg = moe_sigmoid(g);
  dg = da * u * sg * (T(1) + g * (T(1) - sg));
  du = da * g * sg;
}

// =====================================================================================
// decode_fused: the elementwise work of a Llama-family decode step, each formula rounded where the
// model's own eager modules round (x is the model's dtype; rnd(.) rounds a float to it):
//   RMSNorm (HF's LlamaRMSNorm): y = rnd(w · rnd(x · r)), r = 1 / sqrt(mean(x²) + eps) in float;
//   rotary (HF's rotate_half form): y_d = rnd(rnd(x_d·cos_d) + rnd(±x_{d∓D/2}·sin_d));
//   SwiGLU between gate_up and down: a = rnd(rnd(silu(g)) · u), silu(g) = g / (1 + e^−g).
// =====================================================================================
template <typename T>
FT_HD T rms_inv(T sum_sq, T n, T eps) { return T(1) / sqrt(sum_sq / n + eps); }
template <typename T>
FT_HD T silu(T g) { return g / (T(1) + ft_exp(-g)); }

FT_VARIANT_END
}  // namespace fasttrain::math
