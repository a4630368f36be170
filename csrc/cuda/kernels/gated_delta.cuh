// The gated delta rule's CUDA kernels and their launch sequences, one source for the GPU build
// (csrc/cuda/gated_delta.cu) and the CUDA emulator (csrc/cuda_emu). What the kernels do and are not:
// see gated_delta.cu's header.
// Layout: one CTA per (row, value head); thread j owns column j of the state [Dk x Dv] (kept in
// global memory, L2-resident at 64 KiB) for the column sweeps (decay + recall, write + read-out,
// the backward's dd and dS updates: each a sum over rows that one thread does alone), and row i for
// the row sweeps of the backward (dq, dk: sums over columns). Reductions run in a fixed order, so
// results are deterministic. The backward recomputes each span of `checkpoint_every` tokens (at most
// the sequence, at most kMaxSpanCuda) into a global scratch [span + 1, Dk, Dv] per CTA.
#pragma once
#include <ATen/Dispatch.h>

#include <algorithm>

#include "core/math.h"
#include "cuda/common.cuh"
#include "cuda/device.h"

namespace fasttrain::cuda::gated_delta {
namespace fm = fasttrain::math;

struct Dims {
  int64_t B, T, Hk, Hv, Dk, Dv, rep;
  __host__ __device__ int64_t qk(int64_t b, int64_t t, int64_t h) const { return ((b * T + t) * Hk + h / rep) * Dk; }
  __host__ __device__ int64_t vv(int64_t b, int64_t t, int64_t h) const { return ((b * T + t) * Hv + h) * Dv; }
  __host__ __device__ int64_t gb(int64_t b, int64_t t, int64_t h) const { return (b * T + t) * Hv + h; }
  // dq, dk are per value head: [B, T, Hv, Dk]
  __host__ __device__ int64_t qv(int64_t b, int64_t t, int64_t h) const { return ((b * T + t) * Hv + h) * Dk; }
};

// q [B,T,Hk,Dk] and v [B,T,Hv,Dv]'s sizes.
inline Dims dims_of(c10::IntArrayRef q, c10::IntArrayRef v) {
  return Dims{q[0], q[1], q[2], v[2], q[3], v[3], v[2] / q[2]};
}

// One token forward on the CTA's state S (columns swept by the threads). qs, ks: shared [Dk];
// r_out, d_out: where to keep r and d (or null); o: the output row (or null).
template <typename T>
__device__ void step_columns(T* S, const T* qs, const T* ks, const T* v, T alpha, T beta, T scale, T* o, T* r_out,
                             T* d_out, int64_t Dk, int64_t Dv) {
  for (int64_t j = threadIdx.x; j < Dv; j += blockDim.x) {
    T r = 0;
    for (int64_t i = 0; i < Dk; ++i) r += ks[i] * fm::gdr_decayed(alpha, S[i * Dv + j]);
    const T d = fm::gdr_delta(beta, v[j], r);
    T acc = 0;
    for (int64_t i = 0; i < Dk; ++i) {
      const T s = fm::gdr_updated(fm::gdr_decayed(alpha, S[i * Dv + j]), ks[i], d);
      S[i * Dv + j] = s;
      acc += (scale * qs[i]) * s;
    }
    if (o != nullptr) o[j] = acc;
    if (r_out != nullptr) r_out[j] = r;
    if (d_out != nullptr) d_out[j] = d;
  }
}

template <typename T>
__global__ void forward_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                               const T* __restrict__ g, const T* __restrict__ beta, const T* __restrict__ s0, T scale,
                               int64_t C, bool save, Dims dm, T* __restrict__ o, T* __restrict__ S_out,
                               T* __restrict__ ckpt) {
  FT_DYNAMIC_SHARED(T, qs);
  T* ks = qs + dm.Dk;
  const int64_t w = blockIdx.x, b = w / dm.Hv, h = w % dm.Hv, DD = dm.Dk * dm.Dv;
  const int64_t N = (dm.T + C - 1) / C;
  T* S = S_out + w * DD;
  // No barrier after this fill: until the first barrier in the loop, each thread reads back (into the
  // checkpoint) only the elements it wrote itself; step_columns, which reads other threads' elements,
  // runs after that barrier, and a sequence of no tokens reads nothing.
  for (int64_t e = threadIdx.x; e < DD; e += blockDim.x) S[e] = s0 != nullptr ? s0[w * DD + e] : T(0);
  for (int64_t t = 0; t < dm.T; ++t) {
    if (save && t % C == 0)
      for (int64_t e = threadIdx.x; e < DD; e += blockDim.x) ckpt[(w * N + t / C) * DD + e] = S[e];
    for (int64_t i = threadIdx.x; i < dm.Dk; i += blockDim.x) {
      qs[i] = q[dm.qk(b, t, h) + i];
      ks[i] = k[dm.qk(b, t, h) + i];
    }
    __syncthreads();
    step_columns(S, qs, ks, v + dm.vv(b, t, h), fm::gdr_decay(g[dm.gb(b, t, h)]), beta[dm.gb(b, t, h)], scale,
                 o + dm.vv(b, t, h), (T*)nullptr, (T*)nullptr, dm.Dk, dm.Dv);
    __syncthreads();
  }
}

// span: the scratch's tokens per CTA (min(C, T)); states_all [B·Hv, span + 1, Dk, Dv] and
// rd_all [B·Hv, 2, span, Dv].
template <typename T>
__global__ void backward_kernel(const T* __restrict__ dO, const T* __restrict__ dSf, const T* __restrict__ q,
                                const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ g,
                                const T* __restrict__ beta, const T* __restrict__ ckpt, T scale, int64_t C,
                                int64_t span, Dims dm, T* __restrict__ states_all, T* __restrict__ rd_all,
                                T* __restrict__ dq, T* __restrict__ dk, T* __restrict__ dv, T* __restrict__ dg,
                                T* __restrict__ dbeta, T* __restrict__ ds0) {
  const int64_t Dk = dm.Dk, Dv = dm.Dv, DD = Dk * Dv;
  FT_DYNAMIC_SHARED(T, qs);
  T* ks = qs + Dk;
  T* dos = ks + Dk;
  T* dr = dos + Dv;
  T* part_b = dr + Dv;
  T* part_g = part_b + Dv;
  const int64_t w = blockIdx.x, b = w / dm.Hv, h = w % dm.Hv;
  const int64_t N = (dm.T + C - 1) / C;
  T* dS = ds0 + w * DD;
  T* states = states_all + w * (span + 1) * DD;
  T* rs = rd_all + w * 2 * span * Dv;
  T* ds = rs + span * Dv;
  for (int64_t e = threadIdx.x; e < DD; e += blockDim.x) dS[e] = dSf != nullptr ? dSf[w * DD + e] : T(0);
  for (int64_t n = N - 1; n >= 0; --n) {
    const int64_t t0 = n * C, L = min(C, dm.T - t0);
    // No barrier after this fill: each thread copies forward (S[e] = S[e - DD] below) only the elements
    // it wrote itself, and step_columns, which reads other threads' elements, runs after the barrier that
    // follows the q and k loads. Every read of these elements in the previous chunk's pass (Sp at its
    // first token) came before that pass's last barrier.
    for (int64_t e = threadIdx.x; e < DD; e += blockDim.x) states[e] = ckpt[(w * N + n) * DD + e];
    for (int64_t tt = 0; tt < L; ++tt) {
      const int64_t t = t0 + tt;
      T* S = states + (tt + 1) * DD;
      for (int64_t e = threadIdx.x; e < DD; e += blockDim.x) S[e] = S[e - DD];
      for (int64_t i = threadIdx.x; i < Dk; i += blockDim.x) {
        qs[i] = q[dm.qk(b, t, h) + i];
        ks[i] = k[dm.qk(b, t, h) + i];
      }
      __syncthreads();
      step_columns(S, qs, ks, v + dm.vv(b, t, h), fm::gdr_decay(g[dm.gb(b, t, h)]), beta[dm.gb(b, t, h)], scale,
                   (T*)nullptr, rs + tt * Dv, ds + tt * Dv, Dk, Dv);
      __syncthreads();
    }
    for (int64_t tt = L - 1; tt >= 0; --tt) {
      const int64_t t = t0 + tt;
      const T* St = states + (tt + 1) * DD;
      const T* Sp = states + tt * DD;
      const T* vt = v + dm.vv(b, t, h);
      const T* r = rs + tt * Dv;
      const T* d = ds + tt * Dv;
      const T bt = beta[dm.gb(b, t, h)], alpha = fm::gdr_decay(g[dm.gb(b, t, h)]);
      for (int64_t i = threadIdx.x; i < Dk; i += blockDim.x) {
        qs[i] = q[dm.qk(b, t, h) + i];
        ks[i] = k[dm.qk(b, t, h) + i];
      }
      for (int64_t j = threadIdx.x; j < Dv; j += blockDim.x) dos[j] = dO[dm.vv(b, t, h) + j];
      __syncthreads();
      // Columns: the read-out's cotangent into dS, dd = dSᵀk, dv, dr and dβ's terms.
      for (int64_t j = threadIdx.x; j < Dv; j += blockDim.x) {
        T ddj = 0;
        for (int64_t i = 0; i < Dk; ++i) {
          const T x = fm::gdr_readout_grad(dS[i * Dv + j], scale * qs[i], dos[j]);
          dS[i * Dv + j] = x;
          ddj += ks[i] * x;
        }
        dv[dm.vv(b, t, h) + j] = bt * ddj;
        dr[j] = -bt * ddj;
        part_b[j] = ddj * (vt[j] - r[j]);
      }
      __syncthreads();
      // Rows: dq = scale·S' do, dk = dS d + S_a dr (per value head).
      for (int64_t i = threadIdx.x; i < Dk; i += blockDim.x) {
        T aq = 0, ak = 0;
        for (int64_t j = 0; j < Dv; ++j) {
          aq += St[i * Dv + j] * dos[j];
          ak += dS[i * Dv + j] * d[j];
        }
        T ax = 0;
        for (int64_t j = 0; j < Dv; ++j) ax += fm::gdr_decayed(alpha, Sp[i * Dv + j]) * dr[j];
        dq[dm.qv(b, t, h) + i] = scale * aq;
        dk[dm.qv(b, t, h) + i] = ak + ax;
      }
      __syncthreads();
      // Columns: dS_a = dS + k drᵀ, dg's terms, dS <- e^g dS_a.
      for (int64_t j = threadIdx.x; j < Dv; j += blockDim.x) {
        T gj = 0;
        for (int64_t i = 0; i < Dk; ++i) {
          const T sa = fm::gdr_decayed(alpha, Sp[i * Dv + j]);
          const T dsa = fm::gdr_ds_decayed(dS[i * Dv + j], ks[i], dr[j]);
          gj += dsa * sa;
          dS[i * Dv + j] = alpha * dsa;
        }
        part_g[j] = gj;
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        T sb = 0, sg = 0;
        for (int64_t j = 0; j < Dv; ++j) {
          sb += part_b[j];
          sg += part_g[j];
        }
        dbeta[dm.gb(b, t, h)] = sb;
        dg[dm.gb(b, t, h)] = sg;
      }
      // No barrier here: thread 0 reads only part_b and part_g, which no thread writes again before the
      // barrier after the next token's q, k and dO loads, and thread 0 reaches that barrier after its reads.
    }
  }
}

// The decode step in place: one CTA per (row, value head); inactive rows are left as they were.
template <typename T>
__global__ void decode_kernel(T* __restrict__ state, const T* __restrict__ q, const T* __restrict__ k,
                              const T* __restrict__ v, const T* __restrict__ g, const T* __restrict__ beta,
                              const bool* __restrict__ active, T scale, Dims dm, T* __restrict__ o) {
  FT_DYNAMIC_SHARED(T, qs);
  T* ks = qs + dm.Dk;
  const int64_t w = blockIdx.x, b = w / dm.Hv, h = w % dm.Hv;
  if (active != nullptr && !active[b]) {
    for (int64_t j = threadIdx.x; j < dm.Dv; j += blockDim.x) o[dm.vv(b, 0, h) + j] = T(0);
    return;
  }
  for (int64_t i = threadIdx.x; i < dm.Dk; i += blockDim.x) {
    qs[i] = q[dm.qk(b, 0, h) + i];
    ks[i] = k[dm.qk(b, 0, h) + i];
  }
  __syncthreads();
  step_columns(state + w * dm.Dk * dm.Dv, qs, ks, v + dm.vv(b, 0, h), fm::gdr_decay(g[dm.gb(b, 0, h)]),
               beta[dm.gb(b, 0, h)], scale, o + dm.vv(b, 0, h), (T*)nullptr, (T*)nullptr, dm.Dk, dm.Dv);
}

// ---- launch sequences ------------------------------------------------------------------------------
// One warp per 32 columns or rows of the wider head dim (at least one warp, at most 1024 threads).
inline int threads_for(const Dims& dm) {
  const int64_t widest = std::max<int64_t>(dm.Dk, dm.Dv);
  return static_cast<int>(std::min<int64_t>(1024, std::max<int64_t>(32, (widest + 31) / 32 * 32)));
}

// Tokens the backward's scratch holds per CTA: a span, never more than the sequence.
inline int64_t backward_span(int64_t T, int64_t C) { return std::min(C, T); }

// o [B,T,Hv,Dv], S [B,Hv,Dk,Dv], ckpt [B,Hv,ceil(T/C),Dk,Dv] (when save); float32 or float64.
inline void forward(Device& dev, at::ScalarType dt, const void* q, const void* k, const void* v, const void* g,
                    const void* beta, const void* s0, double scale, int64_t C, bool save, const Dims& dm, void* o,
                    void* S, void* ckpt) {
  if (dm.B * dm.Hv == 0) return;
  AT_DISPATCH_FLOATING_TYPES(dt, "gated_delta_forward", [&] {
    using T = scalar_t;
    launch(forward_kernel<T>, dim3((unsigned)(dm.B * dm.Hv)), dim3(threads_for(dm)), 2 * dm.Dk * sizeof(T),
           dev.stream(), (const T*)q, (const T*)k, (const T*)v, (const T*)g, (const T*)beta, (const T*)s0,
           static_cast<T>(scale), C, save, dm, (T*)o, (T*)S, save ? (T*)ckpt : nullptr);
  });
}

// dq, dk [B,T,Hv,Dk], dv, dg, dbeta like v, g, beta; ds0 [B,Hv,Dk,Dv].
inline void backward(Device& dev, at::ScalarType dt, const void* dO, const void* dSf, const void* q, const void* k,
                     const void* v, const void* g, const void* beta, const void* ckpt, double scale, int64_t C,
                     const Dims& dm, void* dq, void* dk, void* dv, void* dg, void* dbeta, void* ds0) {
  if (dm.B * dm.Hv == 0) return;
  const int64_t span = backward_span(dm.T, C);
  AT_DISPATCH_FLOATING_TYPES(dt, "gated_delta_backward", [&] {
    using T = scalar_t;
    T* states = dev.scratch_of<T>(dm.B * dm.Hv * (span + 1) * dm.Dk * dm.Dv);
    T* rd = dev.scratch_of<T>(dm.B * dm.Hv * 2 * span * dm.Dv);
    launch(backward_kernel<T>, dim3((unsigned)(dm.B * dm.Hv)), dim3(threads_for(dm)),
           (2 * dm.Dk + 4 * dm.Dv) * sizeof(T), dev.stream(), (const T*)dO, (const T*)dSf, (const T*)q, (const T*)k,
           (const T*)v, (const T*)g, (const T*)beta, (const T*)ckpt, static_cast<T>(scale), C, span, dm, states, rd,
           (T*)dq, (T*)dk, (T*)dv, (T*)dg, (T*)dbeta, (T*)ds0);
  });
}

// state [B,Hv,Dk,Dv] advanced in place; o [B,1,Hv,Dv]; active [B] or null.
inline void decode(Device& dev, at::ScalarType dt, void* state, const void* q, const void* k, const void* v,
                   const void* g, const void* beta, const bool* active, double scale, const Dims& dm, void* o) {
  if (dm.B * dm.Hv == 0) return;
  AT_DISPATCH_FLOATING_TYPES(dt, "gated_delta_decode", [&] {
    using T = scalar_t;
    launch(decode_kernel<T>, dim3((unsigned)(dm.B * dm.Hv)), dim3(threads_for(dm)), 2 * dm.Dk * sizeof(T),
           dev.stream(), (T*)state, (const T*)q, (const T*)k, (const T*)v, (const T*)g, (const T*)beta, active,
           static_cast<T>(scale), dm, (T*)o);
  });
}

}  // namespace fasttrain::cuda::gated_delta
