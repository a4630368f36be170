// fused_logprob's CUDA kernels and launch sequences (the chunk loop with its two GEMMs per chunk),
// one source for the GPU build (csrc/cuda/fused_logprob.cu, whose header says what they are) and the
// CUDA emulator (csrc/cuda_emu), where the GEMMs are at::mm on the CPU.
#pragma once
#include <ATen/Dispatch.h>

#include <algorithm>
#include <type_traits>

#include "core/fused_logprob_checks.h"
#include "core/math.h"
#include "cuda/common.cuh"
#include "cuda/device.h"

namespace fasttrain::cuda::fused_logprob {
namespace fm = fasttrain::math;

constexpr int64_t kDefaultChunkBytesCuda = int64_t(256) << 20;
constexpr int kThreads = 256;

// Block-wide reduction for kThreads threads; every thread gets the result.
template <typename T, bool kMax>
__device__ __forceinline__ T block_reduce(T v, T* smem) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  v = kMax ? fasttrain::cuda::warp_max(v) : fasttrain::cuda::warp_sum(v);
  __syncthreads();  // smem may still be read from a previous reduction
  if (lane == 0) smem[wid] = v;
  __syncthreads();
  T r = smem[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; ++i) r = kMax ? max(r, smem[i]) : r + smem[i];
  return r;
}

// first[0] = the smallest position n whose target is outside [0, V) and not ignore_index (left at N
// when there is none), then first[1] = that target.
__global__ void __launch_bounds__(kThreads) first_bad_target_kernel(const int64_t* __restrict__ targets, int64_t N, int64_t V,
                                        int64_t ignore_index, int64_t* first) {
  for (int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; n < N; n += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = targets[n];
    if (t != ignore_index && (t < 0 || t >= V))
      atomicMin(reinterpret_cast<unsigned long long*>(first), static_cast<unsigned long long>(n));
  }
}
__global__ void __launch_bounds__(1) bad_target_value_kernel(const int64_t* __restrict__ targets, int64_t N, int64_t* first) {
  if (first[0] < N) first[1] = targets[first[0]];
}

template <typename acc_t>
__global__ void __launch_bounds__(kThreads) logprob_init_kernel(acc_t* ref, acc_t* s, acc_t* u, acc_t* zt, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    ref[i] = -INFINITY;
    s[i] = acc_t(0);
    u[i] = acc_t(0);
    zt[i] = acc_t(NAN);  // stays NaN when the target is outside [0, V)
  }
}

// One CTA per token: the kept set's absolute cut, cut[n] = kept_cut((h_n . W[t_n] + b[t_n]) / T,
// delta[n]) (core/math.h), one dot product a token before the chunk loop (the replay stays one pass).
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) logprob_cut_kernel(const scalar_t* __restrict__ hidden,
                                   const scalar_t* __restrict__ weight, const scalar_t* __restrict__ bias,
                                   const int64_t* __restrict__ targets, const acc_t* __restrict__ delta, int64_t V,
                                   int64_t H, acc_t inv_temp, int64_t ignore_index, acc_t* cut) {
  FT_SHARED(acc_t, smem, [kThreads / 32]);
  const int64_t n = blockIdx.x, t = targets[n];
  if (t == ignore_index || t < 0 || t >= V) {
    if (threadIdx.x == 0) cut[n] = acc_t(-INFINITY);
    return;
  }
  acc_t dot = 0;
  for (int64_t h = threadIdx.x; h < H; h += kThreads)
    dot += static_cast<acc_t>(hidden[n * H + h]) * static_cast<acc_t>(weight[t * H + h]);
  dot = block_reduce<acc_t, false>(dot, smem);
  if (threadIdx.x == 0) {
    if (bias) dot += static_cast<acc_t>(bias[t]);
    cut[n] = fm::kept_cut(dot * inv_temp, delta[n]);
  }
}

// One CTA per token of the block: the fused statistics pass over that token's chunk of logits.
// p may be null (no hidden gradient wanted): then p~ is not written. cut may be null (the whole
// vocabulary); else an entry outside the token's kept set (fm::kept) weighs 0.
template <typename scalar_t, typename gemm_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) logprob_stats_kernel(const acc_t* __restrict__ z, int64_t ldz, gemm_t* __restrict__ p,
                                     int64_t ldp, const scalar_t* __restrict__ bias,
                                     const int64_t* __restrict__ targets, int64_t n0, int64_t v0, int64_t cs,
                                     acc_t inv_temp, int64_t ignore_index, acc_t* ref, acc_t* s_, acc_t* u_,
                                     acc_t* zt, acc_t* acc, int64_t H, const acc_t* __restrict__ cut) {
  FT_SHARED(acc_t, smem, [kThreads / 32]);
  const int64_t i = blockIdx.x, n = n0 + i;
  const int64_t t = targets[n];
  const acc_t* zr = z + i * ldz;
  gemm_t* pr = p != nullptr ? p + i * ldp : nullptr;
  // An ignored token contributes nothing. Its p~ row is not written: that row feeds only the token's
  // own p.W row in the GEMM, which the finalize kernel sets to 0 without reading it.
  if (t == ignore_index) return;
  acc_t m = -INFINITY;
  for (int64_t j = threadIdx.x; j < cs; j += kThreads) {
    acc_t v = zr[j];
    if (bias) v += static_cast<acc_t>(bias[v0 + j]);
    v *= inv_temp;
    m = max(m, v);
    if (v0 + j == t) zt[n] = v;
  }
  m = block_reduce<acc_t, true>(m, smem);
  fm::LseState<acc_t> st{ref[n], s_[n], u_[n]};
  const acc_t alpha = fm::lse_rebase(st, fm::lse_next_ref(st.ref, m));
  const acc_t r = st.ref;
  const acc_t c = cut != nullptr ? cut[n] : acc_t(-INFINITY);
  acc_t sc = 0, uc = 0;
  for (int64_t j = threadIdx.x; j < cs; j += kThreads) {
    acc_t v = zr[j];
    if (bias) v += static_cast<acc_t>(bias[v0 + j]);
    v *= inv_temp;
    // floored: a -inf logit adds 0, never NaN; so does an entry outside the kept set
    const acc_t d = fm::kept(v, c, v0 + j == t) ? fm::lse_delta(v, r) : acc_t(fm::kLseDeltaFloor);
    const acc_t w = fm::ft_exp(d);
    if (pr != nullptr) pr[j] = static_cast<gemm_t>(w);
    sc += w;
    uc += w * d;
  }
  sc = block_reduce<acc_t, false>(sc, smem);
  uc = block_reduce<acc_t, false>(uc, smem);
  if (acc != nullptr && alpha != acc_t(1)) {  // the reference moved: rescale this token's p.W row
    acc_t* ar = acc + i * H;
    for (int64_t h = threadIdx.x; h < H; h += kThreads) ar[h] *= alpha;
  }
  if (threadIdx.x == 0) {
    fm::lse_add(st, sc, uc);
    ref[n] = st.ref;
    s_[n] = st.s;
    u_[n] = st.u;
  }
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) logprob_finalize_kernel(const acc_t* ref, const acc_t* s_, const acc_t* u_, const acc_t* zt,
                                        const int64_t* targets, const scalar_t* __restrict__ weight, int64_t V,
                                        int64_t H, acc_t inv_temp, int64_t ignore_index, acc_t* logp, acc_t* ent,
                                        acc_t* stats, int64_t N, acc_t* grad_vec, const acc_t* cut) {
  const int64_t n = blockIdx.x;
  const int64_t t = targets[n];
  const bool ignored = t == ignore_index;
  const bool valid = t >= 0 && t < V;
  const fm::LseState<acc_t> st{ref[n], s_[n], u_[n]};
  if (threadIdx.x == 0) {
    if (ignored) {
      logp[n] = ent[n] = stats[n] = stats[N + n] = acc_t(0);
      if (cut != nullptr) stats[2 * N + n] = acc_t(0);
    } else {
      const acc_t log_s = fm::ft_log(st.s);
      stats[n] = st.ref;
      stats[N + n] = log_s;
      if (cut != nullptr) stats[2 * N + n] = cut[n];
      logp[n] = fm::lse_logprob(zt[n], st.ref, log_s);  // NaN for an invalid target (graph capture only)
      ent[n] = fm::lse_entropy(st);
    }
  }
  if (grad_vec == nullptr) return;
  acc_t* g = grad_vec + n * H;
  const acc_t inv_s = acc_t(1) / st.s;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    if (ignored) g[h] = acc_t(0);
    else if (!valid) g[h] = acc_t(NAN);
    else g[h] = (static_cast<acc_t>(weight[t * H + h]) - g[h] * inv_s) * inv_temp;
  }
}

// D[i, j] = g_n (1[v == t] - exp(z - lse)) / T for one token block x vocabulary chunk, written as the
// dW GEMM's operand type; with a bias, column sums go to its gradient (one atomic per 64 rows).
// kept_rows: stats has the kept sets' cuts as a third row (p is 0 outside each token's set).
template <typename scalar_t, typename gemm_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) logprob_dlogit_kernel(const acc_t* __restrict__ z, gemm_t* __restrict__ d,
                                      const scalar_t* __restrict__ bias, const acc_t* __restrict__ g,
                                      const acc_t* __restrict__ stats, int64_t N, const int64_t* __restrict__ targets,
                                      int64_t n0, int64_t nb, int64_t v0, int64_t cs, acc_t inv_temp,
                                      int64_t ignore_index, acc_t* grad_bias, bool kept_rows) {
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= cs) return;
  const int64_t i0 = (int64_t)blockIdx.y * 64, i1 = min(nb, i0 + 64);
  const acc_t b = bias ? static_cast<acc_t>(bias[v0 + j]) : acc_t(0);
  acc_t colsum = 0;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t n = n0 + i, t = targets[n];
    acc_t dv = 0;
    if (t != ignore_index) {
      const acc_t zz = (z[i * cs + j] + b) * inv_temp;
      const acc_t c = kept_rows ? stats[2 * N + n] : acc_t(-INFINITY);
      dv = fm::logprob_dlogit(g[n], v0 + j == t, fm::kept_prob(zz, stats[n], stats[N + n], c, v0 + j == t), inv_temp);
    }
    d[i * cs + j] = static_cast<gemm_t>(dv);
    colsum += dv;
  }
  if (bias != nullptr) atomicAdd(grad_bias + v0 + j, colsum);
}

inline at::ScalarType acc_type_of(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// The element type of p~ and D, the operands of the second GEMM (see the header): float for fp16.
template <typename scalar_t>
using gemm_type = std::conditional_t<std::is_same_v<scalar_t, at::Half>, float, scalar_t>;
inline at::ScalarType gemm_type_of(at::ScalarType t) { return t == at::kHalf ? at::kFloat : t; }


// Token block and vocabulary chunk for a scratch budget of `bytes` per (logits fp32 + p in input dtype).
inline void pick_blocks(int64_t chunk_bytes, int64_t N, int64_t V, int64_t per_elem, int64_t& Nb, int64_t& C) {
  const int64_t budget = chunk_bytes > 0 ? chunk_bytes : kDefaultChunkBytesCuda;
  Nb = std::max<int64_t>(1, std::min<int64_t>(N, 16384));
  C = budget / (Nb * per_elem);
  if (C < 256) {  // a small budget: shrink the token block instead of the chunk
    C = std::min<int64_t>(256, V);
    Nb = std::max<int64_t>(1, std::min<int64_t>(N, budget / (C * per_elem)));
  }
  C = std::max<int64_t>(1, std::min<int64_t>(C >= 128 ? C / 128 * 128 : C, V));
}


// ---- launch sequences --------------------------------------------------------------------------
// Raises the CPU's error for the first target outside [0, V) that is not ignore_index. Skipped
// inside a CUDA-graph capture (no host sync is allowed there; such a target then gives NaN).
inline void check_targets(Device& dev, const char* op, const int64_t* targets, int64_t N, int64_t V,
                          int64_t ignore_index) {
  if (N == 0 || dev.capturing()) return;
  int64_t* first = dev.scratch_of<int64_t>(2);
  dev.fill(first, at::kLong, static_cast<double>(N), 2);
  launch(first_bad_target_kernel, fasttrain::cuda::grid_for(N, kThreads), kThreads, 0, dev.stream(), targets, N, V,
         ignore_index, first);
  launch(bad_target_value_kernel, 1, 1, 0, dev.stream(), targets, N, first);
  int64_t host[2];
  dev.copy_to_host(host, first, sizeof host);  // the one sync
  if (host[0] < N) fused_logprob_bad_target(op, host[1], host[0], V, ignore_index);
}

// hidden [N, H], weight [V, H], bias [V] or null, of dtype dt; targets [N] -> logp, ent [N],
// stats [2, N] ([3, N] with keep_delta: the cuts) and (when compute_grad) grad_vec [N, H], zeroed by
// the caller, in the accumulation dtype (float64 for float64, else float32). keep_delta [N] in the
// accumulation dtype, or null: the kept sets (core/math.h kept_cut).
inline void forward(Device& dev, const char* op, at::ScalarType dt, const void* hidden, const void* weight,
                    const int64_t* targets, const void* bias, int64_t N, int64_t H, int64_t V, double temperature,
                    int64_t ignore_index, bool compute_grad, int64_t chunk_bytes, void* logp_, void* ent_,
                    void* stats_, void* grad_vec_, const void* keep_delta = nullptr) {
  check_targets(dev, op, targets, N, V, ignore_index);
  if (N == 0) return;
  const at::ScalarType acc_dt = acc_type_of(dt), gemm_dt = gemm_type_of(dt);
  // p~ and the p.W product exist only when the hidden gradient is wanted (and H > 0).
  const bool want_pw = compute_grad && H > 0;
  int64_t Nb, C;
  pick_blocks(chunk_bytes, N, V, int64_t(c10::elementSize(acc_dt)) + (want_pw ? c10::elementSize(gemm_dt) : 0), Nb,
              C);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "fused_logprob_forward", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    using gemm_t = gemm_type<scalar_t>;
    acc_t* ref = dev.scratch_of<acc_t>(4 * N);  // ref, s, u, target logit
    acc_t *s = ref + N, *u = ref + 2 * N, *zt = ref + 3 * N;
    acc_t* zp = dev.scratch_of<acc_t>(Nb * C);
    gemm_t* pp = want_pw ? dev.scratch_of<gemm_t>(Nb * C) : nullptr;
    // fp16: one W chunk widened to float32 for the p.W GEMM
    gemm_t* wbuf = want_pw && !std::is_same_v<gemm_t, scalar_t> ? dev.scratch_of<gemm_t>(C * H) : nullptr;
    const acc_t inv_temp = static_cast<acc_t>(1.0 / temperature);
    const scalar_t* hp = static_cast<const scalar_t*>(hidden);
    const scalar_t* wp = static_cast<const scalar_t*>(weight);
    const scalar_t* bp = static_cast<const scalar_t*>(bias);
    acc_t* gv = want_pw ? static_cast<acc_t*>(grad_vec_) : nullptr;
    launch(logprob_init_kernel<acc_t>, (unsigned)((N + 255) / 256), 256, 0, dev.stream(), ref, s, u, zt, N);
    acc_t* cut = nullptr;
    if (keep_delta != nullptr) {
      cut = dev.scratch_of<acc_t>(N);
      launch(logprob_cut_kernel<scalar_t, acc_t>, (unsigned)N, kThreads, 0, dev.stream(), hp, wp, bp, targets,
             static_cast<const acc_t*>(keep_delta), V, H, inv_temp, ignore_index, cut);
    }
    for (int64_t n0 = 0; n0 < N; n0 += Nb) {
      const int64_t nb = std::min(Nb, N - n0);
      for (int64_t v0 = 0; v0 < V; v0 += C) {
        const int64_t cs = std::min(C, V - v0);
        // Z[nb, cs] (row-major) = h[n0:, :] . W[v0:, :]^T  ==  col-major Z^T = W_c^T' . h^T
        gemm(dev, {true, false, cs, nb, H, wp + v0 * H, H, hp + n0 * H, H, 0.0, zp, cs, dt, acc_dt});
        launch(logprob_stats_kernel<scalar_t, gemm_t, acc_t>, (unsigned)nb, kThreads, 0, dev.stream(),
               static_cast<const acc_t*>(zp), cs, pp, cs, bp, targets, n0, v0, cs, inv_temp, ignore_index, ref, s, u,
               zt, gv ? gv + n0 * H : nullptr, H, static_cast<const acc_t*>(cut));
        if (gv) {
          const gemm_t* wc = reinterpret_cast<const gemm_t*>(wp + v0 * H);  // same type unless fp16
          if (wbuf != nullptr) {
            dev.convert(wbuf, gemm_dt, wp + v0 * H, dt, cs * H);
            wc = wbuf;
          }
          // acc[nb, H] += p~[nb, cs] . W_c[cs, H]  ==  col-major acc^T = W_c^T . p~^T
          gemm(dev, {false, false, H, nb, cs, wc, H, pp, cs, 1.0, gv + n0 * H, H, gemm_dt, acc_dt});
        }
      }
    }
    launch(logprob_finalize_kernel<scalar_t, acc_t>, (unsigned)N, kThreads, 0, dev.stream(),
           static_cast<const acc_t*>(ref), static_cast<const acc_t*>(s), static_cast<const acc_t*>(u),
           static_cast<const acc_t*>(zt), targets, wp, V, H, inv_temp, ignore_index, static_cast<acc_t*>(logp_),
           static_cast<acc_t*>(ent_), static_cast<acc_t*>(stats_), N, gv, static_cast<const acc_t*>(cut));
  });
}

// grad_logp [N] and stats [2, N] ([3, N]: kept_rows) in the accumulation dtype -> grad_weight [V, H]
// (dtype dt) and grad_bias [V] (accumulation dtype, zeroed by the caller; it stays 0 without a bias).
inline void backward_weight(Device& dev, const char* op, at::ScalarType dt, const void* grad_logp, const void* hidden,
                            const void* weight, const int64_t* targets, const void* bias, const void* stats, int64_t N,
                            int64_t H, int64_t V, double temperature, int64_t ignore_index, int64_t chunk_bytes,
                            void* grad_weight, void* grad_bias_, bool kept_rows = false) {
  check_targets(dev, op, targets, N, V, ignore_index);
  if (N == 0 || H == 0) {  // no token, or nothing for dW's rows to hold; the bias gradient still counts
    dev.fill(grad_weight, dt, 0.0, V * H);
    if (N == 0 || bias == nullptr) return;
  }
  const at::ScalarType acc_dt = acc_type_of(dt), gemm_dt = gemm_type_of(dt);
  int64_t Nb, C;
  pick_blocks(chunk_bytes, N, V, int64_t(c10::elementSize(acc_dt)) + c10::elementSize(gemm_dt), Nb, C);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "fused_logprob_backward", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    using gemm_t = gemm_type<scalar_t>;
    const acc_t inv_temp = static_cast<acc_t>(1.0 / temperature);
    const scalar_t* hp = static_cast<const scalar_t*>(hidden);
    const scalar_t* wp = static_cast<const scalar_t*>(weight);
    const scalar_t* bp = static_cast<const scalar_t*>(bias);
    acc_t* zp = dev.scratch_of<acc_t>(Nb * C);
    gemm_t* dp = dev.scratch_of<gemm_t>(Nb * C);
    acc_t* dwp = H > 0 ? dev.scratch_of<acc_t>(C * H) : nullptr;
    // fp16: hidden widened to float32 once, the dW GEMM's other operand
    const gemm_t* hgp = reinterpret_cast<const gemm_t*>(hp);
    if (!std::is_same_v<gemm_t, scalar_t>) {
      gemm_t* widened = dev.scratch_of<gemm_t>(N * H);
      dev.convert(widened, gemm_dt, hp, dt, N * H);
      hgp = widened;
    }
    for (int64_t v0 = 0; v0 < V; v0 += C) {
      const int64_t cs = std::min(C, V - v0);
      for (int64_t n0 = 0; n0 < N; n0 += Nb) {
        const int64_t nb = std::min(Nb, N - n0);
        gemm(dev, {true, false, cs, nb, H, wp + v0 * H, H, hp + n0 * H, H, 0.0, zp, cs, dt, acc_dt});
        const dim3 grid((cs + kThreads - 1) / kThreads, (nb + 63) / 64);
        launch(logprob_dlogit_kernel<scalar_t, gemm_t, acc_t>, grid, kThreads, 0, dev.stream(),
               static_cast<const acc_t*>(zp), dp, bp, static_cast<const acc_t*>(grad_logp),
               static_cast<const acc_t*>(stats), N, targets, n0, nb, v0, cs, inv_temp, ignore_index,
               static_cast<acc_t*>(grad_bias_), kept_rows);
        // dW_c[cs, H] (+)= D[nb, cs]^T . h[nb, H]  ==  col-major dW_c^T = h^T . D
        gemm(dev, {false, true, H, cs, nb, hgp + n0 * H, H, dp, cs, n0 == 0 ? 0.0 : 1.0, dwp, H, gemm_dt, acc_dt});
      }
      if (H > 0) dev.convert(static_cast<scalar_t*>(grad_weight) + v0 * H, dt, dwp, acc_dt, cs * H);
    }
  });
}

}  // namespace fasttrain::cuda::fused_logprob
