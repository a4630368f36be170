// The gated delta rule (Gated DeltaNet layers of hybrid models), CPU: forward, backward and the
// one-token step, fused per (row, value head).
// What it is: the recurrence itself, one token at a time, on a state [Dk x Dv] that stays in the
// core's cache (64 KiB in float32 at Dk = Dv = 128): two passes over the state per token forward
// (decay + recall, then write + read-out) and two backward, all in contiguous rows of Dv that the
// compiler vectorizes. The per-element math is core/math.h's (gdr_*), shared with the CUDA kernel.
// Why by hand: the decode step (one token per row on a cache of float32 states) as ~10 torch ops
// passed over the whole state each time; here it is two sweeps, in place. For sequences, the
// chunked torch form (fasttrain.ops.gated_delta._chunked) keeps [C x C] decay masks, a triangular
// solve and ~20 small tensors per chunk for autograd; this forward keeps only the state at the start
// of every `checkpoint_every` tokens, and the backward recomputes one such span of states at a time
// (C + 1 states of scratch per worker).
// Napkin math: 4·Dk·Dv multiply-adds per token forward, ~10 backward (with the recompute). At the
// benchmark hybrid (Dk = Dv = 128, 6 value heads) that is 0.4 MFLOP per token and layer forward.
// Precision: float32 for float32 inputs (the caller converts bf16/fp16: the state is float32 in
// every path of fasttrain), float64 for float64. Sums over rows use kDotLanes partial sums (fixed
// order: results do not depend on the thread count; work items are (row, head) pairs).
// What it is not: chunked (no WY representation, no matmuls), so it does the recurrence's O(T·Dk·Dv)
// work and no more, at vector speed, not matmul speed. Measured on 2 cores (bench_gated_delta.py):
// the decode step 12x faster than the torch ops it replaced; forward + backward over sequences
// 1.4-1.55x SLOWER than the chunked torch form, whose chunk products are matmuls. A GPU uses
// flash-linear-attention when installed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "core/variant.h"
#include "core/checks.h"
#include "core/gated_delta_checks.h"
#include "core/math.h"
#include "cpu/parallel.h"
#include "cpu/register.h"
#include "ops.h"

namespace fasttrain {
FT_VARIANT_BEGIN
namespace fm = fasttrain::math;

namespace {
constexpr int kDotLanes = 16;

// Σ_j a_j·b_j in kDotLanes partial sums (vectorizes without reassociation flags).
template <typename T>
inline T dot(const T* __restrict__ a, const T* __restrict__ b, int64_t n) {
  T acc[kDotLanes] = {};
  int64_t j = 0;
  for (; j + kDotLanes <= n; j += kDotLanes)
    for (int l = 0; l < kDotLanes; ++l) acc[l] += a[j + l] * b[j + l];
  T s = 0;
  for (int l = 0; l < kDotLanes; ++l) s += acc[l];
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

struct Dims {
  int64_t B, T, Hk, Hv, Dk, Dv, rep;
  int64_t qk(int64_t b, int64_t t, int64_t h) const { return ((b * T + t) * Hk + h / rep) * Dk; }
  int64_t vv(int64_t b, int64_t t, int64_t h) const { return ((b * T + t) * Hv + h) * Dv; }
  int64_t gb(int64_t b, int64_t t, int64_t h) const { return (b * T + t) * Hv + h; }
};

// One token forward on S (in place): a read-only sweep for r = (e^g S)ᵀk, then one read-write sweep
// for S' = e^g S + k dᵀ and o = scale·S'ᵀq, so the state (the decode's largest traffic: 64 KiB per
// row and head) is read twice and written once. r, d: [Dv] scratch; o: [Dv] output or null.
template <typename T>
inline void step_forward(T* __restrict__ S, const T* __restrict__ q, const T* __restrict__ k,
                         const T* __restrict__ v, T g, T beta, T scale, T* __restrict__ r, T* __restrict__ d,
                         T* __restrict__ o, int64_t Dk, int64_t Dv) {
  const T alpha = fm::gdr_decay(g);
  std::fill(r, r + Dv, T(0));
  for (int64_t i = 0; i < Dk; ++i) {
    const T* __restrict__ Si = S + i * Dv;
    const T ki = k[i];
    for (int64_t j = 0; j < Dv; ++j) r[j] += ki * fm::gdr_decayed(alpha, Si[j]);
  }
  for (int64_t j = 0; j < Dv; ++j) d[j] = fm::gdr_delta(beta, v[j], r[j]);
  if (o != nullptr) std::fill(o, o + Dv, T(0));
  for (int64_t i = 0; i < Dk; ++i) {
    T* __restrict__ Si = S + i * Dv;
    const T ki = k[i];
    if (o != nullptr) {
      const T qi = scale * q[i];
      for (int64_t j = 0; j < Dv; ++j) {
        Si[j] = fm::gdr_updated(fm::gdr_decayed(alpha, Si[j]), ki, d[j]);
        o[j] += qi * Si[j];
      }
    } else {
      for (int64_t j = 0; j < Dv; ++j) Si[j] = fm::gdr_updated(fm::gdr_decayed(alpha, Si[j]), ki, d[j]);
    }
  }
}

template <typename T>
void forward_impl(const T* q, const T* k, const T* v, const T* g, const T* beta, const T* s0, T scale,
                  int64_t C, bool save, const Dims& dm, T* o, T* S_out, T* ckpt) {
  const int64_t N = (dm.T + C - 1) / C, DD = dm.Dk * dm.Dv;
  fasttrain::parallel_for(0, dm.B * dm.Hv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<T> rd(2 * dm.Dv);
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t b = w / dm.Hv, h = w % dm.Hv;
      T* S = S_out + w * DD;
      if (s0 != nullptr) std::copy(s0 + w * DD, s0 + (w + 1) * DD, S);
      else std::fill(S, S + DD, T(0));
      for (int64_t t = 0; t < dm.T; ++t) {
        if (save && t % C == 0) std::copy(S, S + DD, ckpt + (w * N + t / C) * DD);
        step_forward(S, q + dm.qk(b, t, h), k + dm.qk(b, t, h), v + dm.vv(b, t, h), g[dm.gb(b, t, h)],
                     beta[dm.gb(b, t, h)], scale, rd.data(), rd.data() + dm.Dv, o + dm.vv(b, t, h), dm.Dk, dm.Dv);
      }
    }
  });
}

template <typename T>
void backward_impl(const T* dO, const T* dSf, const T* q, const T* k, const T* v, const T* g, const T* beta,
                   const T* ckpt, T scale, int64_t C, const Dims& dm, T* dq, T* dk, T* dv, T* dg, T* dbeta,
                   T* ds0) {
  const int64_t N = (dm.T + C - 1) / C, DD = dm.Dk * dm.Dv, Dk = dm.Dk, Dv = dm.Dv;
  fasttrain::parallel_for(0, dm.B * dm.Hv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<T> states((C + 1) * DD), rs(C * Dv), ds(C * Dv), dd(Dv), dr(Dv);
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t b = w / dm.Hv, h = w % dm.Hv;
      T* dS = ds0 + w * DD;  // the carried cotangent of the state; ends as the initial state's
      if (dSf != nullptr) std::copy(dSf + w * DD, dSf + (w + 1) * DD, dS);
      else std::fill(dS, dS + DD, T(0));
      for (int64_t n = N - 1; n >= 0; --n) {
        const int64_t t0 = n * C, L = std::min(C, dm.T - t0);
        // Recompute the span's states from its checkpoint: states[tt] is the state before token t0 + tt.
        std::copy(ckpt + (w * N + n) * DD, ckpt + (w * N + n + 1) * DD, states.data());
        for (int64_t tt = 0; tt < L; ++tt) {
          const int64_t t = t0 + tt;
          T* S = states.data() + (tt + 1) * DD;
          std::copy(S - DD, S, S);
          step_forward(S, q + dm.qk(b, t, h), k + dm.qk(b, t, h), v + dm.vv(b, t, h), g[dm.gb(b, t, h)],
                       beta[dm.gb(b, t, h)], scale, rs.data() + tt * Dv, ds.data() + tt * Dv, (T*)nullptr, Dk, Dv);
        }
        for (int64_t tt = L - 1; tt >= 0; --tt) {
          const int64_t t = t0 + tt;
          const T* St = states.data() + (tt + 1) * DD;
          const T* Sp = states.data() + tt * DD;
          const T* qt = q + dm.qk(b, t, h);
          const T* kt = k + dm.qk(b, t, h);
          const T* vt = v + dm.vv(b, t, h);
          const T* dot_ = dO + dm.vv(b, t, h);
          const T* r = rs.data() + tt * Dv;
          const T* d = ds.data() + tt * Dv;
          const T bt = beta[dm.gb(b, t, h)], alpha = fm::gdr_decay(g[dm.gb(b, t, h)]);
          T* dqt = dq + dm.vv(b, t, h) / Dv * Dk;  // dq, dk are per value head: [B, T, Hv, Dk]
          T* dkt = dk + dm.vv(b, t, h) / Dv * Dk;
          std::fill(dd.begin(), dd.end(), T(0));
          // Pass A: the read-out's cotangent into dS, then dq = scale·S' do, dd = dSᵀk, dk = dS d.
          for (int64_t i = 0; i < Dk; ++i) {
            T* __restrict__ dSi = dS + i * Dv;
            const T sq = scale * qt[i], ki = kt[i];
            for (int64_t j = 0; j < Dv; ++j) {
              dSi[j] = fm::gdr_readout_grad(dSi[j], sq, dot_[j]);
              dd[j] += ki * dSi[j];
            }
            dqt[i] = scale * dot(St + i * Dv, dot_, Dv);
            dkt[i] = dot(dSi, d, Dv);
          }
          T db = 0;
          {
            T acc[kDotLanes] = {};
            int64_t j = 0;
            for (; j + kDotLanes <= Dv; j += kDotLanes)
              for (int l = 0; l < kDotLanes; ++l) acc[l] += dd[j + l] * (vt[j + l] - r[j + l]);
            for (int l = 0; l < kDotLanes; ++l) db += acc[l];
            for (; j < Dv; ++j) db += dd[j] * (vt[j] - r[j]);
          }
          T* dvt = dv + dm.vv(b, t, h);
          for (int64_t j = 0; j < Dv; ++j) {
            dvt[j] = bt * dd[j];
            dr[j] = -bt * dd[j];
          }
          // Pass B: dS_a = dS + k drᵀ; dk += S_a dr; dg = <dS_a, S_a>; dS <- e^g dS_a.
          T gacc[kDotLanes] = {};
          for (int64_t i = 0; i < Dk; ++i) {
            T* __restrict__ dSi = dS + i * Dv;
            const T* __restrict__ Spi = Sp + i * Dv;
            const T ki = kt[i];
            T kacc[kDotLanes] = {};
            int64_t j = 0;
            for (; j + kDotLanes <= Dv; j += kDotLanes)
              for (int l = 0; l < kDotLanes; ++l) {
                const T sa = fm::gdr_decayed(alpha, Spi[j + l]);
                const T dsa = fm::gdr_ds_decayed(dSi[j + l], ki, dr[j + l]);
                kacc[l] += sa * dr[j + l];
                gacc[l] += dsa * sa;
                dSi[j + l] = alpha * dsa;
              }
            T kx = 0;
            for (int l = 0; l < kDotLanes; ++l) kx += kacc[l];
            for (; j < Dv; ++j) {
              const T sa = fm::gdr_decayed(alpha, Spi[j]);
              const T dsa = fm::gdr_ds_decayed(dSi[j], ki, dr[j]);
              kx += sa * dr[j];
              gacc[0] += dsa * sa;
              dSi[j] = alpha * dsa;
            }
            dkt[i] += kx;
          }
          T gx = 0;
          for (int l = 0; l < kDotLanes; ++l) gx += gacc[l];
          dg[dm.gb(b, t, h)] = gx;
          dbeta[dm.gb(b, t, h)] = db;
        }
      }
    }
  });
}

// The decode step in place on the cache's state: rows whose `active` is false are not touched.
template <typename T>
void decode_impl(T* S, const T* q, const T* k, const T* v, const T* g, const T* beta, const bool* active, T scale,
                 const Dims& dm, T* o) {
  const int64_t DD = dm.Dk * dm.Dv;
  fasttrain::parallel_for(0, dm.B * dm.Hv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<T> rd(2 * dm.Dv);
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t b = w / dm.Hv, h = w % dm.Hv;
      if (active != nullptr && !active[b]) {
        std::fill(o + dm.vv(b, 0, h), o + dm.vv(b, 0, h) + dm.Dv, T(0));
        continue;
      }
      step_forward(S + w * DD, q + dm.qk(b, 0, h), k + dm.qk(b, 0, h), v + dm.vv(b, 0, h), g[dm.gb(b, 0, h)],
                   beta[dm.gb(b, 0, h)], scale, rd.data(), rd.data() + dm.Dv, o + dm.vv(b, 0, h), dm.Dk, dm.Dv);
    }
  });
}

Dims dims_of(const at::Tensor& q, const at::Tensor& v) {
  Dims d{q.size(0), q.size(1), q.size(2), v.size(2), q.size(3), v.size(3), 1};
  d.rep = d.Hv / d.Hk;
  return d;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_delta_forward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
    const std::optional<at::Tensor>& s0, double scale, int64_t checkpoint_every, bool save) {
  constexpr const char* op = "fasttrain::gated_delta_forward";
  FT_CHECK_DEVICE_TYPE(op, q, at::kCPU);
  check_gated_delta_inputs(op, q, k, v, g, beta, s0, checkpoint_every);
  const Dims dm = dims_of(q, v);
  const int64_t C = checkpoint_every, N = (dm.T + C - 1) / C;
  at::Tensor o = at::empty_like(v);
  at::Tensor S = at::empty({dm.B, dm.Hv, dm.Dk, dm.Dv}, v.options());
  at::Tensor ckpt = at::empty({save ? dm.B : 0, dm.Hv, N, dm.Dk, dm.Dv}, v.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gated_delta_forward_cpu", [&] {
    forward_impl<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                           g.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(),
                           s0.has_value() ? s0->data_ptr<scalar_t>() : nullptr, static_cast<scalar_t>(scale), C,
                           save, dm, o.data_ptr<scalar_t>(), S.data_ptr<scalar_t>(),
                           save ? ckpt.data_ptr<scalar_t>() : nullptr);
  });
  return {o, S, ckpt};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_delta_backward_cpu(
    const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_state, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& ckpt, double scale,
    int64_t checkpoint_every) {
  constexpr const char* op = "fasttrain::gated_delta_backward";
  FT_CHECK_DEVICE_TYPE(op, q, at::kCPU);
  check_gated_delta_backward_inputs(op, grad_o, grad_state, q, k, v, g, beta, ckpt, checkpoint_every);
  const Dims dm = dims_of(q, v);
  at::Tensor dq = at::empty({dm.B, dm.T, dm.Hv, dm.Dk}, q.options());
  at::Tensor dk = at::empty({dm.B, dm.T, dm.Hv, dm.Dk}, q.options());
  at::Tensor dv = at::empty_like(v), dg = at::empty_like(g), dbeta = at::empty_like(beta);
  at::Tensor ds0 = at::empty({dm.B, dm.Hv, dm.Dk, dm.Dv}, v.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gated_delta_backward_cpu", [&] {
    backward_impl<scalar_t>(grad_o.data_ptr<scalar_t>(),
                            grad_state.has_value() ? grad_state->data_ptr<scalar_t>() : nullptr,
                            q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                            g.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(), ckpt.data_ptr<scalar_t>(),
                            static_cast<scalar_t>(scale), checkpoint_every, dm, dq.data_ptr<scalar_t>(),
                            dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), dg.data_ptr<scalar_t>(),
                            dbeta.data_ptr<scalar_t>(), ds0.data_ptr<scalar_t>());
  });
  return {dq, dk, dv, dg, dbeta, ds0};
}

at::Tensor gated_delta_decode_cpu(at::Tensor& state, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& g, const at::Tensor& beta, const std::optional<at::Tensor>& active,
                                  double scale) {
  constexpr const char* op = "fasttrain::gated_delta_decode_";
  FT_CHECK_DEVICE_TYPE(op, q, at::kCPU);
  check_gated_delta_decode_inputs(op, state, q, k, v, g, beta, active);
  const Dims dm = dims_of(q, v);
  at::Tensor o = at::empty_like(v);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gated_delta_decode_cpu", [&] {
    decode_impl<scalar_t>(state.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                          v.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(),
                          active.has_value() ? active->data_ptr<bool>() : nullptr, static_cast<scalar_t>(scale), dm,
                          o.data_ptr<scalar_t>());
  });
  return o;
}

void register_gated_delta(torch::Library& m) {
  m.impl("gated_delta_decode_", &gated_delta_decode_cpu);
  m.impl("gated_delta_forward", &gated_delta_forward_cpu);
  m.impl("gated_delta_backward", &gated_delta_backward_cpu);
}

FT_VARIANT_END
}  // namespace fasttrain
