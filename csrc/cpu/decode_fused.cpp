// The elementwise work of one Llama-family decode step, CPU, fused: RMSNorm (with the residual add
// before it), the rotary embedding of q and k together with the write of k and v into the cache,
// and the SwiGLU between the MLP's gate_up and down projections.
// What it is: each op reads its inputs once and writes its outputs once, and rounds where the
// model's own eager modules round (core/math.h's decode_fused formulas), so a decode step through
// these ops computes what the modules compute, up to the order of the RMSNorm's sum of squares and
// the exp of the SiLU (one float ulp each before the final rounding).
// Why by hand: at rollout batch sizes a decode step's elementwise work is tiny (48 rows x 576 at
// SmolLM2's shape) but in eager PyTorch it is about 40 ops a layer (HF's RMSNorm alone is 8: a cast,
// pow, mean, add, rsqrt, mul, a cast back and the weight's mul; the rotary 12 for q and k; the cache
// writes, the split, SiLU, the product), each a dispatch, an allocation and a pass over memory. On
// a 2-core AMX Xeon they took about a quarter of SmolLM2's 62 ms decode step (bench/profile_decode.py:
// aten::mul, copy_, add, silu, pow, cat, _to_copy... ~16 ms of op self time beside the GEMMs'
// 19.6 ms and the attention's 18.3 ms). These ops do the same work in 4 calls a layer: the step
// took 52.2-53.2 ms against the modules' 65.5-65.7 ms (alternating runs, bench/results decode-fused).
// What it is not: a training op (no backward; the rollout runs without autograd), nor a CUDA
// kernel: on a GPU the decoder keeps the modules (and the compiled step fuses them there).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "core/variant.h"
#include "core/checks.h"
#include "core/math.h"
#include "cpu/register.h"
#include "ops.h"

namespace fasttrain {
FT_VARIANT_BEGIN
namespace fm = fasttrain::math;

namespace {
using fVec = at::vec::Vectorized<float>;
constexpr int64_t W = fVec::size();
constexpr int64_t kGrain = 1 << 14;   // elements a thread takes at least (a row is ~576-3072)
constexpr int64_t kMaxHead = 512;      // the widest head a q/k norm is taken of (on the stack)

// float32, bfloat16 and float16 (float64 stays with the reference formulas: no float lanes for it)
#define FT_DISPATCH_DECODE_FUSED(dt, name, ...)                 \
  AT_DISPATCH_SWITCH(dt, name, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// Two float vectors (2W elements) from scalar_t memory, and back with the rounding to scalar_t.
template <typename scalar_t>
inline void load2(const scalar_t* p, fVec& a, fVec& b) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    a = fVec::loadu(p);
    b = fVec::loadu(p + W);
  } else {
    std::tie(a, b) = at::vec::convert_to_float<scalar_t>(at::vec::Vectorized<scalar_t>::loadu(p));
  }
}
template <typename scalar_t>
inline void store2(const fVec& a, const fVec& b, scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    a.store(p);
    b.store(p + W);
  } else {
    at::vec::convert_from_float<scalar_t>(a, b).store(p);
  }
}
// a, b <- their values rounded to scalar_t (an intermediate the modules store in the model's dtype).
template <typename scalar_t>
inline void round2(fVec& a, fVec& b) {
  if constexpr (!std::is_same_v<scalar_t, float>)
    std::tie(a, b) = at::vec::convert_to_float<scalar_t>(at::vec::convert_from_float<scalar_t>(a, b));
}
template <typename scalar_t>
inline float rnd(float x) {
  return static_cast<float>(static_cast<scalar_t>(x));
}
// A value the compiler may not fold into the next operation: where a product is stored in the
// model's dtype before a sum (the rotary's two products), float32 included, a fused multiply-add
// would skip that rounding (GCC contracts a·b + c into an FMA wherever the variant has one).
inline fVec opaque(fVec v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r = v;
  asm("" : "+v"(r));
  return fVec(r);
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 r = v;
  asm("" : "+x"(r));
  return fVec(r);
#else
  return v;   // the baseline variant: x86-64 without FMA
#endif
}
inline float opaque(float v) {
  asm("" : "+x"(v));
  return v;
}

// One row of RMSNorm: y = rnd(w · rnd(x · r)). The sum of squares in 2W float lanes, then across.
template <typename scalar_t>
inline void rms_row(const scalar_t* x, const scalar_t* w, float eps, int64_t H, scalar_t* y) {
  fVec s0(0.0f), s1(0.0f);
  int64_t d = 0;
  for (; d + 2 * W <= H; d += 2 * W) {
    fVec a, b;
    load2(x + d, a, b);
    s0 = at::vec::fmadd(a, a, s0);
    s1 = at::vec::fmadd(b, b, s1);
  }
  float lanes[2 * W];
  s0.store(lanes);
  s1.store(lanes + W);
  float ss = 0.0f;
  for (int64_t l = 0; l < 2 * W; ++l) ss += lanes[l];
  for (int64_t e = d; e < H; ++e) {
    const float v = static_cast<float>(x[e]);
    ss += v * v;
  }
  const float r = fm::rms_inv(ss, static_cast<float>(H), eps);
  const fVec rv(r);
  d = 0;
  for (; d + 2 * W <= H; d += 2 * W) {
    fVec a, b, wa, wb;
    load2(x + d, a, b);
    load2(w + d, wa, wb);
    a = a * rv;
    b = b * rv;
    round2<scalar_t>(a, b);
    store2(wa * a, wb * b, y + d);
  }
  for (int64_t e = d; e < H; ++e)
    y[e] = static_cast<scalar_t>(static_cast<float>(w[e]) * rnd<scalar_t>(static_cast<float>(x[e]) * r));
}

void check_norm(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  FT_CHECK_DIM(op, x, 2);
  FT_CHECK_DIM(op, weight, 1);
  FT_CHECK_CONTIGUOUS(op, x);
  FT_CHECK_CONTIGUOUS(op, weight);
  FT_CHECK_ARG(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
               op, "x", "must be float32, bfloat16 or float16, got ", x.scalar_type());
  FT_CHECK_DTYPE(op, weight, x.scalar_type());
  FT_CHECK_ARG(weight.size(0) == x.size(1), op, "weight", "must be [H] for x [N, H], got ", weight.sizes(),
               " and ", x.sizes());
}

template <typename scalar_t>
void rms_rows(const scalar_t* x, const scalar_t* w, float eps, int64_t N, int64_t H, scalar_t* y) {
  at::parallel_for(0, N, std::max<int64_t>(1, kGrain / std::max<int64_t>(H, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_row(x + r * H, w, eps, H, y + r * H);
  });
}
}  // namespace

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm("rms_norm", x, weight);
  at::Tensor y = at::empty_like(x);
  FT_DISPATCH_DECODE_FUSED(x.scalar_type(), "rms_norm_cpu", [&] {
      rms_rows(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), static_cast<float>(eps), x.size(0), x.size(1),
               y.data_ptr<scalar_t>());
  });
  return y;
}

at::Tensor add_rms_norm_cpu(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_norm("add_rms_norm_", x, weight);
  FT_CHECK_CONTIGUOUS("add_rms_norm_", delta);
  FT_CHECK_DTYPE("add_rms_norm_", delta, x.scalar_type());
  FT_CHECK_ARG(delta.sizes() == x.sizes(), "add_rms_norm_", "delta", "must have x's shape ", x.sizes(), ", got ",
               delta.sizes());
  at::Tensor y = at::empty_like(x);
  const int64_t N = x.size(0), H = x.size(1);
  FT_DISPATCH_DECODE_FUSED(x.scalar_type(), "add_rms_norm_cpu", [&] {
    {
      scalar_t* xp = x.data_ptr<scalar_t>();
      const scalar_t* dp = delta.data_ptr<scalar_t>();
      const scalar_t* wp = weight.data_ptr<scalar_t>();
      scalar_t* yp = y.data_ptr<scalar_t>();
      at::parallel_for(0, N, std::max<int64_t>(1, kGrain / std::max<int64_t>(H, 1)), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          scalar_t* xr = xp + r * H;
          const scalar_t* dr = dp + r * H;
          int64_t d = 0;
          for (; d + 2 * W <= H; d += 2 * W) {     // x <- rnd(x + delta), the residual add
            fVec a, b, da, db;
            load2(xr + d, a, b);
            load2(dr + d, da, db);
            store2(a + da, b + db, xr + d);
          }
          for (; d < H; ++d) xr[d] = static_cast<scalar_t>(static_cast<float>(xr[d]) + static_cast<float>(dr[d]));
          rms_row(xr, wp, static_cast<float>(eps), H, yp + r * H);
        }
      });
    }
  });
  return y;
}

namespace {
// One head of the rotary embedding: y_d = rnd(rnd(x_d·c_d) + rnd(rot_d·s_d)), rot = (−x₂, x₁).
template <typename scalar_t>
inline void rotary_head(const scalar_t* x, const scalar_t* c, const scalar_t* s, int64_t D, scalar_t* y) {
  const int64_t h = D / 2;
  int64_t d = 0;
  if (h % (2 * W) == 0) {
    for (; d < h; d += 2 * W) {
      fVec x1a, x1b, x2a, x2b, c1a, c1b, c2a, c2b, s1a, s1b, s2a, s2b;
      load2(x + d, x1a, x1b);
      load2(x + h + d, x2a, x2b);
      load2(c + d, c1a, c1b);
      load2(c + h + d, c2a, c2b);
      load2(s + d, s1a, s1b);
      load2(s + h + d, s2a, s2b);
      fVec p1a = x1a * c1a, p1b = x1b * c1b, q1a = x2a.neg() * s1a, q1b = x2b.neg() * s1b;
      fVec p2a = x2a * c2a, p2b = x2b * c2b, q2a = x1a * s2a, q2b = x1b * s2b;
      round2<scalar_t>(p1a, p1b);
      round2<scalar_t>(q1a, q1b);
      round2<scalar_t>(p2a, p2b);
      round2<scalar_t>(q2a, q2b);
      store2(opaque(p1a) + opaque(q1a), opaque(p1b) + opaque(q1b), y + d);
      store2(opaque(p2a) + opaque(q2a), opaque(p2b) + opaque(q2b), y + h + d);
    }
    return;
  }
  for (; d < D; ++d) {
    const float xd = static_cast<float>(x[d]);
    const float rot = d < h ? -static_cast<float>(x[d + h]) : static_cast<float>(x[d - h]);
    y[d] = static_cast<scalar_t>(opaque(rnd<scalar_t>(xd * static_cast<float>(c[d]))) +
                                 opaque(rnd<scalar_t>(rot * static_cast<float>(s[d]))));
  }
}
}  // namespace

at::Tensor rotary_cache_write_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                  at::Tensor& k_cache, at::Tensor& v_cache, int64_t column, int64_t n_heads,
                                  const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                                  double norm_eps) {
  const char* op = "rotary_cache_write_";
  FT_CHECK_DIM(op, qkv, 2);
  FT_CHECK_DIM(op, cos, 2);
  FT_CHECK_DIM(op, sin, 2);
  FT_CHECK_DIM(op, k_cache, 4);
  FT_CHECK_DIM(op, v_cache, 4);
  FT_CHECK_CONTIGUOUS(op, qkv);
  FT_CHECK_CONTIGUOUS(op, cos);
  FT_CHECK_CONTIGUOUS(op, sin);
  const auto dt = qkv.scalar_type();
  FT_CHECK_ARG(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op, "qkv",
               "must be float32, bfloat16 or float16, got ", dt);
  FT_CHECK_DTYPE(op, cos, dt);
  FT_CHECK_DTYPE(op, sin, dt);
  FT_CHECK_DTYPE(op, k_cache, dt);
  FT_CHECK_DTYPE(op, v_cache, dt);
  const int64_t B = qkv.size(0), KV = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3);
  FT_CHECK_ARG(v_cache.sizes() == k_cache.sizes(), op, "v_cache", "must have k_cache's shape");
  FT_CHECK_ARG(k_cache.size(0) == B, op, "k_cache", "must be [B, kv_heads, S, D] for qkv [B, ...]");
  FT_CHECK_ARG(D % 2 == 0 && n_heads > 0 && n_heads % KV == 0, op, "n_heads",
               "must be a multiple of kv_heads with an even head width, got ", n_heads, " heads, ", KV,
               " kv heads of ", D);
  FT_CHECK_ARG(qkv.size(1) == (n_heads + 2 * KV) * D, op, "qkv", "must be [B, (n_heads + 2 kv_heads)·D] = [", B,
               ", ", (n_heads + 2 * KV) * D, "], got ", qkv.sizes());
  FT_CHECK_ARG(cos.size(0) == B && cos.size(1) == D && sin.sizes() == cos.sizes(), op, "cos",
               "cos and sin must be [B, D]");
  FT_CHECK_ARG(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, op, "k_cache",
               "k_cache and v_cache must be contiguous in their last dimension");
  FT_CHECK_ARG(column >= 0 && column < S, op, "column", "must be in [0, ", S, "), got ", column);
  FT_CHECK_ARG(q_norm.has_value() == k_norm.has_value(), op, "q_norm", "q_norm and k_norm come together");
  const bool qk_norm = q_norm.has_value();
  if (qk_norm) {
    for (const at::Tensor* w : {&*q_norm, &*k_norm}) {
      FT_CHECK_ARG(w->dim() == 1 && w->size(0) == D && w->is_contiguous() && w->scalar_type() == dt, op, "q_norm",
                   "q_norm and k_norm must be contiguous [D] = [", D, "] weights of qkv's dtype");
    }
    FT_CHECK_ARG(D <= kMaxHead, op, "q_norm", "a normed head is at most ", kMaxHead, " wide, got ", D);
  }
  at::Tensor q = at::empty({B, KV, n_heads / KV, D}, qkv.options());
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const int64_t heads = n_heads + 2 * KV, row = heads * D;
  FT_DISPATCH_DECODE_FUSED(dt, "rotary_cache_write_cpu", [&] {
    {
      const scalar_t* xp = qkv.data_ptr<scalar_t>();
      const scalar_t* cp = cos.data_ptr<scalar_t>();
      const scalar_t* sp = sin.data_ptr<scalar_t>();
      scalar_t* qp = q.data_ptr<scalar_t>();
      scalar_t* kp = k_cache.data_ptr<scalar_t>();
      scalar_t* vp = v_cache.data_ptr<scalar_t>();
      const scalar_t* qn = qk_norm ? q_norm->data_ptr<scalar_t>() : nullptr;
      const scalar_t* kn = qk_norm ? k_norm->data_ptr<scalar_t>() : nullptr;
      at::parallel_for(0, B * heads, std::max<int64_t>(1, kGrain / D), [&](int64_t i0, int64_t i1) {
        scalar_t normed[kMaxHead];
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t b = i / heads, hd = i % heads;
          const scalar_t* x = xp + b * row + hd * D;
          if (qk_norm && hd < n_heads + KV) {    // Qwen3's per-head q/k RMSNorm before the rotation
            rms_row(x, hd < n_heads ? qn : kn, static_cast<float>(norm_eps), D, normed);
            x = normed;
          }
          if (hd < n_heads) {
            rotary_head(x, cp + b * D, sp + b * D, D, qp + (b * n_heads + hd) * D);
          } else if (hd < n_heads + KV) {
            rotary_head(x, cp + b * D, sp + b * D, D, kp + b * ks0 + (hd - n_heads) * ks1 + column * ks2);
          } else {
            scalar_t* dst = vp + b * vs0 + (hd - n_heads - KV) * vs1 + column * vs2;
            std::copy(x, x + D, dst);
          }
        }
      });
    }
  });
  return q;
}

at::Tensor silu_mul_cpu(const at::Tensor& gate_up) {
  const char* op = "silu_mul";
  FT_CHECK_DIM(op, gate_up, 2);
  FT_CHECK_CONTIGUOUS(op, gate_up);
  const auto dt = gate_up.scalar_type();
  FT_CHECK_ARG(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op, "gate_up",
               "must be float32, bfloat16 or float16, got ", dt);
  FT_CHECK_ARG(gate_up.size(1) % 2 == 0, op, "gate_up", "must be [N, 2I] (gate then up), got ", gate_up.sizes());
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor a = at::empty({N, I}, gate_up.options());
  FT_DISPATCH_DECODE_FUSED(dt, "silu_mul_cpu", [&] {
    {
      const scalar_t* gp = gate_up.data_ptr<scalar_t>();
      scalar_t* ap = a.data_ptr<scalar_t>();
      at::parallel_for(0, N, std::max<int64_t>(1, kGrain / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
        const fVec one(1.0f);
        for (int64_t r = r0; r < r1; ++r) {
          const scalar_t* g = gp + r * 2 * I;
          const scalar_t* u = g + I;
          scalar_t* out = ap + r * I;
          int64_t d = 0;
          for (; d + 2 * W <= I; d += 2 * W) {
            fVec ga, gb, ua, ub;
            load2(g + d, ga, gb);
            load2(u + d, ua, ub);
            fVec sa = ga / (one + ga.neg().exp()), sb = gb / (one + gb.neg().exp());   // Sleef's exp, 1 ulp
            round2<scalar_t>(sa, sb);
            store2(sa * ua, sb * ub, out + d);
          }
          for (; d < I; ++d)
            out[d] = static_cast<scalar_t>(rnd<scalar_t>(fm::silu(static_cast<float>(g[d]))) * static_cast<float>(u[d]));
        }
      });
    }
  });
  return a;
}

void register_decode_fused(torch::Library& m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("add_rms_norm_", &add_rms_norm_cpu);
  m.impl("rotary_cache_write_", &rotary_cache_write_cpu);
  m.impl("silu_mul", &silu_mul_cpu);
}

FT_VARIANT_END
}  // namespace fasttrain
