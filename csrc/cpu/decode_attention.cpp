// Attention of one decode step, CPU: one query token per row against the row's cached keys and
// values, grouped-query heads served from their shared KV head, fused per (row, KV head).
// What it is: for each row b and KV head h, the G query heads that share h read each cached key
// once (G dot products per key, in the compute dtype), take the softmax over the row's valid keys
// (max-subtracted, core/math.h's lse_weight, the log-prob's exp) and read each value once for the G
// weighted sums. The keys and values stay where the cache keeps them (strided views of it, only
// the last dimension contiguous); nothing of [B, heads, S] is materialised beyond one work item's
// G·S scores.
// Why by hand: a decode step's attention reads the whole KV cache to produce G·D numbers per row
// and head; ATen's CPU flash attention at one query (q [B, kv, G, D] against [B, kv, S, D]) took
// 1.37 ms a layer at SmolLM2's rollout shape (48 rows, 3 KV heads of 64, 300 keys, bf16, caches
// cold) on a 2-core AMX Xeon, 3.4x the 0.40 ms the cache's bytes take to read. This kernel
// (bench/bench_decode_attention.py, all 300 keys valid): 0.97 ms with one horizontal sum per key and
// head, 0.65-0.68 ms with the dots of 4 keys reduced by one shuffle tree, the value rows prefetched
// during the key pass and the keys 8 rows ahead.
// Napkin math: 4·G·S·D flops and 2·S·D elements read per work item; at 48 rows x 3 heads x 300 keys
// that is 33 MFLOP and 11 MB (bf16) a layer, memory-bound on two cores only if the dots vectorize.
// Precision: float32 sums for bf16/fp16/fp32, float64 for float64; each dot in kDotLanes partial
// sums and every sum in a fixed order (results do not depend on the thread count: work items are
// (row, KV head) pairs). A row with no valid key gets zeros (SDPA would give NaN).
// What it is not: a prefill or training attention (one query per row; no backward), nor a CUDA
// kernel: on a GPU the decoder keeps torch's scaled_dot_product_attention (flash attention there).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "core/variant.h"
#include "core/checks.h"
#include "core/math.h"
#include "cpu/parallel.h"
#include "cpu/register.h"
#include "ops.h"

namespace fasttrain {
FT_VARIANT_BEGIN
namespace fm = fasttrain::math;

namespace {
constexpr int kAttnLanes = 16;
constexpr int64_t kAhead = 8;   // keys prefetched ahead of the key pass (a 4 KiB page holds 16-32 rows)

template <typename acc_t, typename scalar_t>
inline void attn_widen(const scalar_t* __restrict__ x, acc_t* __restrict__ out, int64_t n) {
  for (int64_t d = 0; d < n; ++d) out[d] = static_cast<acc_t>(x[d]);
}

// Σ_d a_d·b_d in kAttnLanes partial sums (vectorizes without reassociation flags).
template <typename T>
inline T attn_dot(const T* __restrict__ a, const T* __restrict__ b, int64_t n) {
  T acc[kAttnLanes] = {};
  int64_t j = 0;
  for (; j + kAttnLanes <= n; j += kAttnLanes)
    for (int l = 0; l < kAttnLanes; ++l) acc[l] += a[j + l] * b[j + l];
  T s = 0;
  for (int l = 0; l < kAttnLanes; ++l) s += acc[l];
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

struct AttnShape {
  int64_t B, H, G, D, S;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2, ms0;   // strides of k, v [B, H, S, D] and of key_valid [B, S]
};

template <typename scalar_t, typename acc_t>
void decode_attention_impl(const scalar_t* q, const scalar_t* k, const scalar_t* v, const bool* valid,
                           acc_t scale, const AttnShape& sh, scalar_t* o) {
  const int64_t G = sh.G, D = sh.D, S = sh.S;
  fasttrain::parallel_for(0, sh.B * sh.H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<acc_t> qf(G * D), row(D), p(G * S), acc(G * D);
    std::vector<int64_t> keys(S);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / sh.H, h = item % sh.H;
      const scalar_t* qb = q + item * G * D;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<acc_t>(qb[g * D + d]) * scale;
      int64_t n = 0;
      for (int64_t j = 0; j < S; ++j)
        if (valid[b * sh.ms0 + j]) keys[n++] = j;
      scalar_t* ob = o + item * G * D;
      if (n == 0) {
        for (int64_t e = 0; e < G * D; ++e) ob[e] = scalar_t(0);
        continue;
      }
      const scalar_t* kb = k + b * sh.ks0 + h * sh.ks1;
      const scalar_t* vb = v + b * sh.vs0 + h * sh.vs1;
      // scores p[g][i] for the n valid keys, each key read once for the G heads
      for (int64_t i = 0; i < n; ++i) {
        attn_widen(kb + keys[i] * sh.ks2, row.data(), D);
        for (int64_t g = 0; g < G; ++g) p[g * S + i] = attn_dot(qf.data() + g * D, row.data(), D);
      }
      acc_t inv[64];
      std::vector<acc_t> inv_big;
      acc_t* invp = inv;
      if (G > 64) {
        inv_big.resize(G);
        invp = inv_big.data();
      }
      for (int64_t g = 0; g < G; ++g) {
        acc_t* pg = p.data() + g * S;
        acc_t m = pg[0];
        for (int64_t i = 1; i < n; ++i) m = pg[i] > m ? pg[i] : m;
        acc_t l = 0;
        for (int64_t i = 0; i < n; ++i) {
          pg[i] = fm::lse_weight(pg[i], m);
          l += pg[i];
        }
        invp[g] = acc_t(1) / l;
      }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      // the weighted sum of values, each value row read once for the G heads
      for (int64_t i = 0; i < n; ++i) {
        attn_widen(vb + keys[i] * sh.vs2, row.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const acc_t w = p[g * S + i];
          acc_t* __restrict__ ag = acc.data() + g * D;
          const acc_t* __restrict__ r = row.data();
          for (int64_t d = 0; d < D; ++d) ag[d] += w * r[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) ob[g * D + d] = static_cast<scalar_t>(acc[g * D + d] * invp[g]);
    }
  });
}

using fVec = at::vec::Vectorized<float>;

template <typename T>
inline fVec load_f(const T* p) {
  fVec o;
  at::vec::load_to_float<T>(p, o);
  return o;
}
template <>
inline fVec load_f<float>(const float* p) {
  return fVec::loadu(p);
}

inline float hsum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, v);
}


// p[0, n) <- exp(p - max) (Sleef's exp, 1 ulp; the tail by core/math.h's); returns 1 / their sum.
// The max in vector-wide lanes, then across them (a max is exact in any order).
inline float softmax_weights(float* __restrict__ pg, int64_t n) {
  constexpr int64_t W = fVec::size();
  float m = pg[0];
  int64_t i = 0;
  if (n >= W) {
    fVec mx = fVec::loadu(pg);
    for (i = W; i + W <= n; i += W) mx = at::vec::maximum(mx, fVec::loadu(pg + i));
    float lanes[W];
    mx.store(lanes);
    for (int64_t l = 0; l < W; ++l) m = lanes[l] > m ? lanes[l] : m;
  }
  for (; i < n; ++i) m = pg[i] > m ? pg[i] : m;
  const fVec mv(m);
  fVec lv(0.0f);
  i = 0;
  for (; i + W <= n; i += W) {
    const fVec e = (fVec::loadu(pg + i) - mv).exp();
    e.store(pg + i);
    lv = lv + e;
  }
  float l = hsum(lv);
  for (; i < n; ++i) {
    pg[i] = fm::ft_exp(pg[i] - m);
    l += pg[i];
  }
  return 1.0f / l;
}

template <typename scalar_t>
inline void store_f(const fVec& x, scalar_t* out) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    x.store(out);
  } else {
    float tmp[fVec::size()];
    x.store(tmp);
    for (int64_t d = 0; d < fVec::size(); ++d) out[d] = static_cast<scalar_t>(tmp[d]);
  }
}

// The horizontal sums of 4 vectors, stored to out[0, 4): a tree of in-register shuffles and adds
// (13 instructions on AVX-512 where 4 separate reductions take 36, and one store for 4). The order
// of the sums is fixed by the tree, not by the thread count. Without AVX2/AVX-512, one reduction a
// vector.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(CPU_CAPABILITY_AVX512)
using RawVec = __m512;
using RawVecD = __m512d;
#define FT_RAW(op) _mm512_##op
#else
using RawVec = __m256;
using RawVecD = __m256d;
#define FT_RAW(op) _mm256_##op
#endif
inline void hsum4(const fVec& a0, const fVec& a1, const fVec& a2, const fVec& a3, float* out) {
  const RawVec x0 = a0, x1 = a1, x2 = a2, x3 = a3;
  // in each 128-bit lane: [x0_0+x0_2, x1_0+x1_2, x0_1+x0_3, x1_1+x1_3], and the same for x2, x3
  const RawVec t0 = FT_RAW(add_ps)(FT_RAW(unpacklo_ps)(x0, x1), FT_RAW(unpackhi_ps)(x0, x1));
  const RawVec t1 = FT_RAW(add_ps)(FT_RAW(unpacklo_ps)(x2, x3), FT_RAW(unpackhi_ps)(x2, x3));
  // in each 128-bit lane: that lane's sums of x0..x3, in order
  const RawVecD d0 = FT_RAW(castps_pd)(t0), d1 = FT_RAW(castps_pd)(t1);
  const RawVec u = FT_RAW(add_ps)(FT_RAW(castpd_ps)(FT_RAW(unpacklo_pd)(d0, d1)),
                                  FT_RAW(castpd_ps)(FT_RAW(unpackhi_pd)(d0, d1)));
#undef FT_RAW
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 h = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, 0x4E));        // lanes 0+2, 1+3
  const __m128 r = _mm_add_ps(_mm512_castps512_ps128(h), _mm512_extractf32x4_ps(h, 1));
#else
  const __m128 r = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
#endif
  _mm_storeu_ps(out, r);
}
#else
inline void hsum4(const fVec& a0, const fVec& a1, const fVec& a2, const fVec& a3, float* out) {
  out[0] = hsum(a0);
  out[1] = hsum(a1);
  out[2] = hsum(a2);
  out[3] = hsum(a3);
}
#endif

template <typename T>
inline void prefetch_row(const T* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + off, 0, 3);
}

// One work item with G query heads and C vectors per head row known at compile time, so the G dot
// accumulators and the G·C output accumulators stay in registers and consecutive keys overlap. Keys
// go in blocks of 4: their 4·G dots are reduced by one tree a head (hsum4), and each value row is
// prefetched while its key is read, so the value pass runs from cache.
template <typename scalar_t, int G, int C>
void item_fixed(const scalar_t* __restrict__ qb, const scalar_t* __restrict__ kb, const scalar_t* __restrict__ vb,
                const int64_t* __restrict__ keys, int64_t n, int64_t ks2, int64_t vs2, float scale,
                float* __restrict__ p, int64_t S, scalar_t* __restrict__ ob) {
  constexpr int64_t W = fVec::size();
  constexpr int64_t row_bytes = C * W * sizeof(scalar_t);
  fVec qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = load_f(qb + (g * C + c) * W) * fVec(scale);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const scalar_t* kr[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      kr[j] = kb + keys[i + j] * ks2;
      prefetch_row(vb + keys[i + j] * vs2, row_bytes);
      if (i + j + kAhead < n) prefetch_row(kb + keys[i + j + kAhead] * ks2, row_bytes);
    }
    fVec a[G][4];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) a[g][j] = fVec(0.0f);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const fVec kc = load_f(kr[j] + c * W);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) a[g][j] = at::vec::fmadd(qv[g][c], kc, a[g][j]);
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) hsum4(a[g][0], a[g][1], a[g][2], a[g][3], p + g * S + i);
  }
  for (; i < n; ++i) {
    const scalar_t* kr = kb + keys[i] * ks2;
    fVec a[G];
    for (int g = 0; g < G; ++g) a[g] = fVec(0.0f);
    for (int c = 0; c < C; ++c) {
      const fVec kc = load_f(kr + c * W);
      for (int g = 0; g < G; ++g) a[g] = at::vec::fmadd(qv[g][c], kc, a[g]);
    }
    for (int g = 0; g < G; ++g) p[g * S + i] = hsum(a[g]);
  }
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = softmax_weights(p + g * S, n);
  fVec acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = fVec(0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* vr = vb + keys[i] * vs2;
    fVec w[G];
    for (int g = 0; g < G; ++g) w[g] = fVec(p[g * S + i]);
    for (int c = 0; c < C; ++c) {
      const fVec vc = load_f(vr + c * W);
      for (int g = 0; g < G; ++g) acc[g][c] = at::vec::fmadd(w[g], vc, acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) store_f(acc[g][c] * fVec(inv[g]), ob + (g * C + c) * W);
}

template <typename scalar_t>
using ItemFn = void (*)(const scalar_t*, const scalar_t*, const scalar_t*, const int64_t*, int64_t, int64_t, int64_t,
                        float, float*, int64_t, scalar_t*);

template <typename scalar_t, int G>
ItemFn<scalar_t> pick_c(int64_t C) {
  switch (C) {
    case 2: return &item_fixed<scalar_t, G, 2>;
    case 4: return &item_fixed<scalar_t, G, 4>;
    case 8: return &item_fixed<scalar_t, G, 8>;
    case 16: return &item_fixed<scalar_t, G, 16>;
    default: return nullptr;
  }
}

// The compiled (G, C) pairs: the GQA group sizes and head widths of the models we decode.
template <typename scalar_t>
ItemFn<scalar_t> pick_item(int64_t G, int64_t C) {
  switch (G) {
    case 1: return pick_c<scalar_t, 1>(C);
    case 2: return pick_c<scalar_t, 2>(C);
    case 3: return pick_c<scalar_t, 3>(C);
    case 4: return pick_c<scalar_t, 4>(C);
    case 6: return pick_c<scalar_t, 6>(C);
    case 8: return pick_c<scalar_t, 8>(C);
    default: return nullptr;
  }
}

// The float32 path for D a multiple of the vector width: the same sums as decode_attention_impl's
// (each dot in vector-width partial sums, then their reduction), with Sleef's exp (1 ulp).
template <typename scalar_t>
void decode_attention_vec(const scalar_t* q, const scalar_t* k, const scalar_t* v, const bool* valid, float scale,
                          const AttnShape& sh, scalar_t* o) {
  constexpr int64_t W = fVec::size();
  const int64_t G = sh.G, D = sh.D, S = sh.S, C = D / W;
  const ItemFn<scalar_t> fixed = pick_item<scalar_t>(G, C);
  fasttrain::parallel_for(0, sh.B * sh.H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<fVec> qv(G * C), acc(G * C);
    std::vector<float> p(G * S), inv(G);
    std::vector<int64_t> keys(S);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / sh.H, h = item % sh.H;
      const scalar_t* qb = q + item * G * D;
      for (int64_t e = 0; e < G * C; ++e) qv[e] = load_f(qb + e * W) * fVec(scale);
      int64_t n = 0;
      for (int64_t j = 0; j < S; ++j)
        if (valid[b * sh.ms0 + j]) keys[n++] = j;
      scalar_t* ob = o + item * G * D;
      if (n == 0) {
        for (int64_t e = 0; e < G * D; ++e) ob[e] = scalar_t(0);
        continue;
      }
      const scalar_t* kb = k + b * sh.ks0 + h * sh.ks1;
      const scalar_t* vb = v + b * sh.vs0 + h * sh.vs1;
      if (fixed != nullptr) {
        fixed(qb, kb, vb, keys.data(), n, sh.ks2, sh.vs2, scale, p.data(), S, ob);
        continue;
      }
      for (int64_t i = 0; i < n; ++i) {
        const scalar_t* kr = kb + keys[i] * sh.ks2;
        for (int64_t g = 0; g < G; ++g) acc[g] = fVec(0.0f);
        for (int64_t c = 0; c < C; ++c) {
          const fVec kc = load_f(kr + c * W);
          for (int64_t g = 0; g < G; ++g) acc[g] = at::vec::fmadd(qv[g * C + c], kc, acc[g]);
        }
        for (int64_t g = 0; g < G; ++g) p[g * S + i] = hsum(acc[g]);
      }
      for (int64_t g = 0; g < G; ++g) inv[g] = softmax_weights(p.data() + g * S, n);
      for (int64_t e = 0; e < G * C; ++e) acc[e] = fVec(0.0f);
      for (int64_t i = 0; i < n; ++i) {
        const scalar_t* vr = vb + keys[i] * sh.vs2;
        for (int64_t c = 0; c < C; ++c) {
          const fVec vc = load_f(vr + c * W);
          for (int64_t g = 0; g < G; ++g) acc[g * C + c] = at::vec::fmadd(fVec(p[g * S + i]), vc, acc[g * C + c]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C; ++c) store_f(acc[g * C + c] * fVec(inv[g]), ob + g * D + c * W);
    }
  });
}

}  // namespace

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& key_valid, double scale) {
  constexpr const char* op = "fasttrain::decode_attention";
  FT_CHECK_DEVICE_TYPE(op, q, at::kCPU);
  FT_CHECK_SAME_DEVICE(op, q, k);
  FT_CHECK_SAME_DEVICE(op, q, v);
  FT_CHECK_SAME_DEVICE(op, q, key_valid);
  FT_CHECK_ARG(q.is_floating_point(), op, "q", "must be float64, float32, float16 or bfloat16, got ",
               q.scalar_type());
  FT_CHECK_DIM(op, q, 4);
  FT_CHECK_DIM(op, k, 4);
  FT_CHECK_DIM(op, v, 4);
  FT_CHECK_DIM(op, key_valid, 2);
  FT_CHECK_CONTIGUOUS(op, q);
  FT_CHECK_DTYPE(op, k, q.scalar_type());
  FT_CHECK_DTYPE(op, v, q.scalar_type());
  FT_CHECK_DTYPE(op, key_valid, at::kBool);
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), S = k.size(2);
  FT_CHECK_ARG(k.size(0) == B && k.size(1) == H && k.size(3) == D, op, "k",
               "must be [B, kv_heads, S, D] matching q [B, kv_heads, G, D]");
  FT_CHECK_ARG(v.sizes() == k.sizes(), op, "v", "must have k's shape");
  FT_CHECK_ARG(key_valid.size(0) == B && key_valid.size(1) == S, op, "key_valid", "must be [B, S] bool");
  FT_CHECK_ARG(k.stride(3) == 1 && v.stride(3) == 1 && key_valid.stride(1) == 1, op, "k",
               "k, v and key_valid must be contiguous in their last dimension");
  at::Tensor o = at::empty_like(q);
  if (q.numel() == 0) return o;
  const AttnShape sh{B, H, G, D, S, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                 key_valid.stride(0)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "decode_attention_cpu", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    if constexpr (!std::is_same_v<scalar_t, double>) {
      if (D % fVec::size() == 0) {
        decode_attention_vec<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                       key_valid.data_ptr<bool>(), static_cast<float>(scale), sh,
                                       o.data_ptr<scalar_t>());
        return;
      }
    }
    decode_attention_impl<scalar_t, acc_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                           key_valid.data_ptr<bool>(), static_cast<acc_t>(scale), sh,
                                           o.data_ptr<scalar_t>());
  });
  return o;
}

void register_decode_attention(torch::Library& m) { m.impl("decode_attention", &decode_attention_cpu); }

FT_VARIANT_END
}  // namespace fasttrain
