// The gated delta rule, CUDA: the same recurrence and element math as csrc/cpu/gated_delta.cpp
// (core/math.h gdr_*), for a GPU without flash-linear-attention (fasttrain.ops.gated_delta picks fla's
// chunked kernel when it is installed; this one is the fallback, so that the op always has a kernel).
// Layout: one CTA per (row, value head); thread j owns column j of the state [Dk x Dv] (kept in
// global memory, L2-resident at 64 KiB) for the column sweeps (decay + recall, write + read-out,
// the backward's dd and dS updates: each a sum over rows that one thread does alone), and row i for
// the row sweeps of the backward (dq, dk: sums over columns). Reductions run in a fixed order, so
// results are deterministic. The backward recomputes each span of `checkpoint_every` states into a
// global scratch [C + 1, Dk, Dv] per CTA.
// What it is not: fast. Tokens are sequential within a CTA, and B·Hv CTAs fill an H100 only at large
// batches; the chunked form (matmuls over chunks) is what a GPU wants, which is fla's. Not run on a
// GPU yet: it compiles in CI, and the selftest compares it with the float64 reference on a GPU.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "core/checks.h"
#include "core/gated_delta_checks.h"
#include "core/math.h"
#include "cuda/common.cuh"
#include "ops.h"

namespace fasttrain {
namespace fm = fasttrain::math;

namespace {

struct Dims {
  int64_t B, T, Hk, Hv, Dk, Dv, rep;
  __host__ __device__ int64_t qk(int64_t b, int64_t t, int64_t h) const { return ((b * T + t) * Hk + h / rep) * Dk; }
  __host__ __device__ int64_t vv(int64_t b, int64_t t, int64_t h) const { return ((b * T + t) * Hv + h) * Dv; }
  __host__ __device__ int64_t gb(int64_t b, int64_t t, int64_t h) const { return (b * T + t) * Hv + h; }
};

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
  extern __shared__ unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);
  T* ks = qs + dm.Dk;
  const int64_t w = blockIdx.x, b = w / dm.Hv, h = w % dm.Hv, DD = dm.Dk * dm.Dv;
  const int64_t N = (dm.T + C - 1) / C;
  T* S = S_out + w * DD;
  for (int64_t e = threadIdx.x; e < DD; e += blockDim.x) S[e] = s0 != nullptr ? s0[w * DD + e] : T(0);
  __syncthreads();
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

template <typename T>
__global__ void backward_kernel(const T* __restrict__ dO, const T* __restrict__ dSf, const T* __restrict__ q,
                                const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ g,
                                const T* __restrict__ beta, const T* __restrict__ ckpt, T scale, int64_t C, Dims dm,
                                T* __restrict__ states_all, T* __restrict__ rd_all, T* __restrict__ dq,
                                T* __restrict__ dk, T* __restrict__ dv, T* __restrict__ dg, T* __restrict__ dbeta,
                                T* __restrict__ ds0) {
  extern __shared__ unsigned char smem_raw[];
  const int64_t Dk = dm.Dk, Dv = dm.Dv, DD = Dk * Dv;
  T* qs = reinterpret_cast<T*>(smem_raw);
  T* ks = qs + Dk;
  T* dos = ks + Dk;
  T* dr = dos + Dv;
  T* part_b = dr + Dv;
  T* part_g = part_b + Dv;
  const int64_t w = blockIdx.x, b = w / dm.Hv, h = w % dm.Hv;
  const int64_t N = (dm.T + C - 1) / C;
  T* dS = ds0 + w * DD;
  T* states = states_all + w * (C + 1) * DD;
  T* rs = rd_all + w * 2 * C * Dv;
  T* ds = rs + C * Dv;
  for (int64_t e = threadIdx.x; e < DD; e += blockDim.x) dS[e] = dSf != nullptr ? dSf[w * DD + e] : T(0);
  for (int64_t n = N - 1; n >= 0; --n) {
    const int64_t t0 = n * C, L = min(C, dm.T - t0);
    for (int64_t e = threadIdx.x; e < DD; e += blockDim.x) states[e] = ckpt[(w * N + n) * DD + e];
    __syncthreads();
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
        dq[dm.vv(b, t, h) / Dv * Dk + i] = scale * aq;
        dk[dm.vv(b, t, h) / Dv * Dk + i] = ak + ax;
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
      __syncthreads();
    }
  }
}

// The decode step in place: one CTA per (row, value head); inactive rows are left as they were.
template <typename T>
__global__ void decode_kernel(T* __restrict__ state, const T* __restrict__ q, const T* __restrict__ k,
                              const T* __restrict__ v, const T* __restrict__ g, const T* __restrict__ beta,
                              const bool* __restrict__ active, T scale, Dims dm, T* __restrict__ o) {
  extern __shared__ unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);
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

Dims dims_of(const at::Tensor& q, const at::Tensor& v) {
  Dims d{q.size(0), q.size(1), q.size(2), v.size(2), q.size(3), v.size(3), 1};
  d.rep = d.Hv / d.Hk;
  return d;
}

int threads_for(const Dims& dm) {
  const int64_t widest = std::max<int64_t>(dm.Dk, dm.Dv);
  return static_cast<int>(std::min<int64_t>(1024, std::max<int64_t>(32, (widest + 31) / 32 * 32)));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_delta_forward_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
    const std::optional<at::Tensor>& s0, double scale, int64_t checkpoint_every, bool save) {
  constexpr const char* op = "fasttrain::gated_delta_forward";
  FT_CHECK_DEVICE_TYPE(op, q, at::kCUDA);
  check_gated_delta_inputs(op, q, k, v, g, beta, s0, checkpoint_every);
  const c10::cuda::CUDAGuard guard(q.device());
  const Dims dm = dims_of(q, v);
  const int64_t C = checkpoint_every, N = (dm.T + C - 1) / C;
  at::Tensor o = at::empty_like(v);
  at::Tensor S = at::empty({dm.B, dm.Hv, dm.Dk, dm.Dv}, v.options());
  at::Tensor ckpt = at::empty({save ? dm.B : 0, dm.Hv, N, dm.Dk, dm.Dv}, v.options());
  if (dm.B * dm.Hv == 0) return {o, S, ckpt};
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gated_delta_forward_cuda", [&] {
    const size_t smem = 2 * dm.Dk * sizeof(scalar_t);
    forward_kernel<scalar_t><<<dm.B * dm.Hv, threads_for(dm), smem, at::cuda::getCurrentCUDAStream()>>>(
        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(),
        beta.data_ptr<scalar_t>(), s0.has_value() ? s0->data_ptr<scalar_t>() : nullptr,
        static_cast<scalar_t>(scale), C, save, dm, o.data_ptr<scalar_t>(), S.data_ptr<scalar_t>(),
        save ? ckpt.data_ptr<scalar_t>() : nullptr);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {o, S, ckpt};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_delta_backward_cuda(
    const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_state, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& ckpt, double scale,
    int64_t checkpoint_every) {
  constexpr const char* op = "fasttrain::gated_delta_backward";
  FT_CHECK_DEVICE_TYPE(op, q, at::kCUDA);
  check_gated_delta_backward_inputs(op, grad_o, grad_state, q, k, v, g, beta, ckpt, checkpoint_every);
  const c10::cuda::CUDAGuard guard(q.device());
  const Dims dm = dims_of(q, v);
  const int64_t C = checkpoint_every;
  at::Tensor dq = at::empty({dm.B, dm.T, dm.Hv, dm.Dk}, q.options());
  at::Tensor dk = at::empty({dm.B, dm.T, dm.Hv, dm.Dk}, q.options());
  at::Tensor dv = at::empty_like(v), dg = at::empty_like(g), dbeta = at::empty_like(beta);
  at::Tensor ds0 = at::empty({dm.B, dm.Hv, dm.Dk, dm.Dv}, v.options());
  if (dm.B * dm.Hv == 0) return {dq, dk, dv, dg, dbeta, ds0};
  at::Tensor states = at::empty({dm.B * dm.Hv, C + 1, dm.Dk, dm.Dv}, v.options());
  at::Tensor rd = at::empty({dm.B * dm.Hv, 2, C, dm.Dv}, v.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gated_delta_backward_cuda", [&] {
    const size_t smem = (2 * dm.Dk + 4 * dm.Dv) * sizeof(scalar_t);
    backward_kernel<scalar_t><<<dm.B * dm.Hv, threads_for(dm), smem, at::cuda::getCurrentCUDAStream()>>>(
        grad_o.data_ptr<scalar_t>(), grad_state.has_value() ? grad_state->data_ptr<scalar_t>() : nullptr,
        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(),
        beta.data_ptr<scalar_t>(), ckpt.data_ptr<scalar_t>(), static_cast<scalar_t>(scale), C, dm,
        states.data_ptr<scalar_t>(), rd.data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
        dv.data_ptr<scalar_t>(), dg.data_ptr<scalar_t>(), dbeta.data_ptr<scalar_t>(), ds0.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dq, dk, dv, dg, dbeta, ds0};
}

at::Tensor gated_delta_decode_cuda(at::Tensor& state, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                                   const std::optional<at::Tensor>& active, double scale) {
  constexpr const char* op = "fasttrain::gated_delta_decode_";
  FT_CHECK_DEVICE_TYPE(op, q, at::kCUDA);
  check_gated_delta_decode_inputs(op, state, q, k, v, g, beta, active);
  const c10::cuda::CUDAGuard guard(q.device());
  const Dims dm = dims_of(q, v);
  at::Tensor o = at::empty_like(v);
  if (dm.B * dm.Hv == 0) return o;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gated_delta_decode_cuda", [&] {
    decode_kernel<scalar_t><<<dm.B * dm.Hv, threads_for(dm), 2 * dm.Dk * sizeof(scalar_t),
                              at::cuda::getCurrentCUDAStream()>>>(
        state.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
        g.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(), active.has_value() ? active->data_ptr<bool>() : nullptr,
        static_cast<scalar_t>(scale), dm, o.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return o;
}

TORCH_LIBRARY_IMPL(fasttrain, CUDA, m) {
  m.impl("gated_delta_decode_", &gated_delta_decode_cuda);
  m.impl("gated_delta_forward", &gated_delta_forward_cuda);
  m.impl("gated_delta_backward", &gated_delta_backward_cuda);
}

}  // namespace fasttrain
