// fused_logprob, CUDA: per-token log p(target), entropy and the gradient vector (W[t] - p.W) / T
// from hidden states, with the logits held only one bounded [Nb, C] chunk at a time.
//
// What it is (the issue's "at minimum" design, the same math as the CPU kernel via core/math.h):
// for each token block (Nb <= N rows) and each vocabulary chunk (C rows of W):
//   1. cuBLAS GemmEx  Z = h_blk . W_c^T   -> fp32 scratch [Nb, C] (bf16/fp16 in, fp32 accumulate+out)
//   2. logprob_stats_kernel, one CTA per token: bias, 1/T, chunk max, lazy rebase of the running
//      (ref, s, u) state, target logit, and (only when hidden needs grad) p~ = exp(z - ref) written
//      as the GEMM operand [Nb, C]; in the rare event the reference moves (see kLseLazyMargin) it
//      also rescales that token's p.W row.
//   3. cuBLAS GemmEx  acc_blk += p~ . W_c  (fp32 accumulator [Nb, H], only when hidden needs grad)
// then logprob_finalize_kernel: lse, log p, entropy, grad_vec = (W[t] - acc / s) / T.
// Forward + hidden gradient therefore costs the two matrix products; the chunk scratch is
// Nb*C*(4 + 2) bytes (default budget 256 MiB: N=15360 -> C=2048 per chunk in bf16).
// Weight gradient (only when W requires grad): per vocabulary chunk, per token block, recompute Z
// (GEMM), D = g (onehot - exp(z - lse)) / T (+ column sums for the bias, only when there is one),
// then dW_c += D^T . h_blk (GEMM, fp32 accumulate), cast into dW once per chunk.
// GEMM operands p~ and D: bf16 for bf16 inputs (bf16 has float32's exponent range, so nothing
// underflows; its rounding is the inputs' own precision), float32 for fp16 inputs: per-token
// gradients near 1/N (~1e-5) times probabilities near 1/V are far below fp16's smallest subnormal
// (6e-8), so an fp16 D would lose most of dW. The fp16 path therefore widens one W chunk (forward)
// and hidden (weight backward) to float32 and runs those two GEMMs in float32.
// Targets outside [0, V) that are not ignore_index raise the CPU's error (a one-kernel search and an
// 16-byte read-back, so one host sync per call); inside a CUDA-graph capture, where no sync is
// allowed, the search is skipped and such a target gives NaN.
// What it is not (yet): the fully fused kernel where logits never leave on-chip memory (CCE /
// Liger style); step 2 reads Z once from L2/HBM. Not run on a GPU yet: written to the CPU kernel's
// tested math, compiled for sm_80 and sm_90a.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublas_v2.h>
#include <torch/library.h>

#include <algorithm>

#include "core/checks.h"
#include "core/fused_logprob_checks.h"
#include "core/math.h"
#include "cuda/common.cuh"
#include "ops.h"

namespace fasttrain {
namespace fm = fasttrain::math;

namespace {

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
__global__ void first_bad_target_kernel(const int64_t* __restrict__ targets, int64_t N, int64_t V,
                                        int64_t ignore_index, int64_t* first) {
  for (int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; n < N; n += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = targets[n];
    if (t != ignore_index && (t < 0 || t >= V))
      atomicMin(reinterpret_cast<unsigned long long*>(first), static_cast<unsigned long long>(n));
  }
}
__global__ void bad_target_value_kernel(const int64_t* __restrict__ targets, int64_t N, int64_t* first) {
  if (first[0] < N) first[1] = targets[first[0]];
}

template <typename acc_t>
__global__ void logprob_init_kernel(acc_t* ref, acc_t* s, acc_t* u, acc_t* zt, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    ref[i] = -INFINITY;
    s[i] = acc_t(0);
    u[i] = acc_t(0);
    zt[i] = acc_t(NAN);  // stays NaN when the target is outside [0, V)
  }
}

// One CTA per token of the block: the fused statistics pass over that token's chunk of logits.
// p may be null (no hidden gradient wanted): then p~ is not written.
template <typename scalar_t, typename gemm_t, typename acc_t>
__global__ void logprob_stats_kernel(const acc_t* __restrict__ z, int64_t ldz, gemm_t* __restrict__ p,
                                     int64_t ldp, const scalar_t* __restrict__ bias,
                                     const int64_t* __restrict__ targets, int64_t n0, int64_t v0, int64_t cs,
                                     acc_t inv_temp, int64_t ignore_index, acc_t* ref, acc_t* s_, acc_t* u_,
                                     acc_t* zt, acc_t* acc, int64_t H) {
  __shared__ acc_t smem[kThreads / 32];
  const int64_t i = blockIdx.x, n = n0 + i;
  const int64_t t = targets[n];
  const acc_t* zr = z + i * ldz;
  gemm_t* pr = p != nullptr ? p + i * ldp : nullptr;
  if (t == ignore_index) {  // contributes nothing: zero probabilities keep its p.W row at 0
    if (pr != nullptr)
      for (int64_t j = threadIdx.x; j < cs; j += kThreads) pr[j] = gemm_t(0);
    return;
  }
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
  acc_t sc = 0, uc = 0;
  for (int64_t j = threadIdx.x; j < cs; j += kThreads) {
    acc_t v = zr[j];
    if (bias) v += static_cast<acc_t>(bias[v0 + j]);
    v *= inv_temp;
    const acc_t d = fm::lse_delta(v, r);  // floored: a -inf logit adds 0, never NaN
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
__global__ void logprob_finalize_kernel(const acc_t* ref, const acc_t* s_, const acc_t* u_, const acc_t* zt,
                                        const int64_t* targets, const scalar_t* __restrict__ weight, int64_t V,
                                        int64_t H, acc_t inv_temp, int64_t ignore_index, acc_t* logp, acc_t* ent,
                                        acc_t* stats, int64_t N, acc_t* grad_vec) {
  const int64_t n = blockIdx.x;
  const int64_t t = targets[n];
  const bool ignored = t == ignore_index;
  const bool valid = t >= 0 && t < V;
  const fm::LseState<acc_t> st{ref[n], s_[n], u_[n]};
  if (threadIdx.x == 0) {
    if (ignored) {
      logp[n] = ent[n] = stats[n] = stats[N + n] = acc_t(0);
    } else {
      const acc_t log_s = fm::ft_log(st.s);
      stats[n] = st.ref;
      stats[N + n] = log_s;
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
template <typename scalar_t, typename gemm_t, typename acc_t>
__global__ void logprob_dlogit_kernel(const acc_t* __restrict__ z, gemm_t* __restrict__ d,
                                      const scalar_t* __restrict__ bias, const acc_t* __restrict__ g,
                                      const acc_t* __restrict__ stats, int64_t N, const int64_t* __restrict__ targets,
                                      int64_t n0, int64_t nb, int64_t v0, int64_t cs, acc_t inv_temp,
                                      int64_t ignore_index, acc_t* grad_bias) {
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
      dv = fm::logprob_dlogit(g[n], v0 + j == t, fm::softmax_prob(zz, stats[n], stats[N + n]), inv_temp);
    }
    d[i * cs + j] = static_cast<gemm_t>(dv);
    colsum += dv;
  }
  if (bias != nullptr) atomicAdd(grad_bias + v0 + j, colsum);
}

template <typename T> struct CudaType;
template <> struct CudaType<float> { static constexpr cudaDataType_t value = CUDA_R_32F; };
template <> struct CudaType<double> { static constexpr cudaDataType_t value = CUDA_R_64F; };
template <> struct CudaType<at::Half> { static constexpr cudaDataType_t value = CUDA_R_16F; };
template <> struct CudaType<at::BFloat16> { static constexpr cudaDataType_t value = CUDA_R_16BF; };

// Column-major GEMM C = alpha op(A) op(B) + beta C with inputs of scalar_t and output/compute acc_t.
// An empty C is a no-op and k = 0 (hidden size 0) gives C = beta C without calling cuBLAS, which
// rejects the leading dimension 0 such operands have.
template <typename scalar_t, typename acc_t>
void gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const scalar_t* A,
          int64_t lda, const scalar_t* B, int64_t ldb, acc_t beta, acc_t* C, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == acc_t(0)) {
      C10_CUDA_CHECK(cudaMemset2DAsync(C, ldc * sizeof(acc_t), 0, m * sizeof(acc_t), n,
                                       at::cuda::getCurrentCUDAStream()));
    }
    return;
  }
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();  // bound to the current stream
  const acc_t alpha = 1;
  const cublasComputeType_t compute =
      std::is_same_v<acc_t, double> ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  TORCH_CUDABLAS_CHECK(cublasGemmEx(handle, ta, tb, (int)m, (int)n, (int)k, &alpha, A, CudaType<scalar_t>::value,
                                    (int)lda, B, CudaType<scalar_t>::value, (int)ldb, &beta, C,
                                    CudaType<acc_t>::value, (int)ldc, compute, CUBLAS_GEMM_DEFAULT));
}

at::ScalarType acc_type_of(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// The element type of p~ and D, the operands of the second GEMM (see the header): float for fp16.
template <typename scalar_t>
using gemm_type = std::conditional_t<std::is_same_v<scalar_t, at::Half>, float, scalar_t>;
at::ScalarType gemm_type_of(at::ScalarType t) { return t == at::kHalf ? at::kFloat : t; }

// Raises the CPU's error for the first target outside [0, V) that is not ignore_index. Skipped
// inside a CUDA-graph capture (no host sync is allowed there; such a target then gives NaN).
void check_targets_cuda(const char* op, const at::Tensor& targets, int64_t V, int64_t ignore_index) {
  const int64_t N = targets.numel();
  if (N == 0 || c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return;
  at::Tensor first = at::full({2}, N, targets.options());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  first_bad_target_kernel<<<fasttrain::cuda::grid_for(N, 256), 256, 0, stream>>>(
      targets.const_data_ptr<int64_t>(), N, V, ignore_index, first.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  bad_target_value_kernel<<<1, 1, 0, stream>>>(targets.const_data_ptr<int64_t>(), N, first.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor host = first.cpu();  // the one sync
  const int64_t pos = host.const_data_ptr<int64_t>()[0];
  if (pos < N) fused_logprob_bad_target(op, host.const_data_ptr<int64_t>()[1], pos, V, ignore_index);
}

// Token block and vocabulary chunk for a scratch budget of `bytes` per (logits fp32 + p in input dtype).
void pick_blocks(int64_t chunk_bytes, int64_t N, int64_t V, int64_t per_elem, int64_t& Nb, int64_t& C) {
  const int64_t budget = chunk_bytes > 0 ? chunk_bytes : kDefaultChunkBytesCuda;
  Nb = std::max<int64_t>(1, std::min<int64_t>(N, 16384));
  C = budget / (Nb * per_elem);
  if (C < 256) {  // a small budget: shrink the token block instead of the chunk
    C = std::min<int64_t>(256, V);
    Nb = std::max<int64_t>(1, std::min<int64_t>(N, budget / (C * per_elem)));
  }
  C = std::max<int64_t>(1, std::min<int64_t>(C >= 128 ? C / 128 * 128 : C, V));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_logprob_forward_cuda(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
    const std::optional<at::Tensor>& bias, double temperature, int64_t ignore_index, bool compute_grad,
    int64_t chunk_bytes) {
  constexpr const char* op = "fasttrain::fused_logprob_forward";
  FT_CHECK_DEVICE_TYPE(op, hidden, at::kCUDA);
  fused_logprob_check_args(op, hidden, weight, targets, bias, temperature);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor h = hidden.contiguous(), w = weight.contiguous(), tg = targets.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t N = h.size(0), H = h.size(1), V = w.size(0);
  check_targets_cuda(op, tg, V, ignore_index);
  const at::ScalarType acc_dt = acc_type_of(h.scalar_type());
  const at::ScalarType gemm_dt = gemm_type_of(h.scalar_type());
  const at::TensorOptions ao = h.options().dtype(acc_dt);
  at::Tensor logp = at::empty({N}, ao), ent = at::empty({N}, ao), stats = at::empty({2, N}, ao);
  at::Tensor grad_vec = compute_grad ? at::zeros({N, H}, ao) : at::empty({0, H}, ao);
  if (N == 0) return {logp, ent, stats, grad_vec};
  // p~ and the p.W product exist only when the hidden gradient is wanted (and H > 0).
  const bool want_pw = compute_grad && H > 0;
  at::Tensor state = at::empty({4, N}, ao);  // ref, s, u, target logit
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  int64_t Nb, C;
  pick_blocks(chunk_bytes, N, V, int64_t(at::elementSize(acc_dt)) + (want_pw ? at::elementSize(gemm_dt) : 0), Nb,
              C);
  at::Tensor zbuf = at::empty({Nb * C}, ao);
  at::Tensor pbuf = want_pw ? at::empty({Nb * C}, h.options().dtype(gemm_dt)) : at::Tensor();
  // fp16: one W chunk widened to float32 for the p.W GEMM
  at::Tensor wbuf = want_pw && gemm_dt != h.scalar_type() ? at::empty({C, H}, h.options().dtype(gemm_dt))
                                                          : at::Tensor();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, h.scalar_type(), "fused_logprob_forward_cuda", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    using gemm_t = gemm_type<scalar_t>;
    acc_t* ref = state.data_ptr<acc_t>();
    acc_t *s = ref + N, *u = ref + 2 * N, *zt = ref + 3 * N;
    const acc_t inv_temp = static_cast<acc_t>(1.0 / temperature);
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    const scalar_t* bp = b.defined() ? b.const_data_ptr<scalar_t>() : nullptr;
    const int64_t* tp = tg.const_data_ptr<int64_t>();
    acc_t* zp = zbuf.data_ptr<acc_t>();
    gemm_t* pp = want_pw ? pbuf.data_ptr<gemm_t>() : nullptr;
    acc_t* gv = want_pw ? grad_vec.data_ptr<acc_t>() : nullptr;
    logprob_init_kernel<acc_t><<<(N + 255) / 256, 256, 0, stream>>>(ref, s, u, zt, N);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    for (int64_t n0 = 0; n0 < N; n0 += Nb) {
      const int64_t nb = std::min(Nb, N - n0);
      for (int64_t v0 = 0; v0 < V; v0 += C) {
        const int64_t cs = std::min(C, V - v0);
        // Z[nb, cs] (row-major) = h[n0:, :] . W[v0:, :]^T  ==  col-major Z^T = W_c^T' . h^T
        gemm<scalar_t, acc_t>(CUBLAS_OP_T, CUBLAS_OP_N, cs, nb, H, wp + v0 * H, H, hp + n0 * H, H, acc_t(0), zp,
                              cs);
        logprob_stats_kernel<scalar_t, gemm_t, acc_t><<<nb, kThreads, 0, stream>>>(
            zp, cs, pp, cs, bp, tp, n0, v0, cs, inv_temp, ignore_index, ref, s, u, zt,
            gv ? gv + n0 * H : nullptr, H);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (gv) {
          const gemm_t* wc = reinterpret_cast<const gemm_t*>(wp + v0 * H);  // same type unless fp16
          if (!std::is_same_v<gemm_t, scalar_t>) {
            wbuf.narrow(0, 0, cs).copy_(w.narrow(0, v0, cs));
            wc = wbuf.const_data_ptr<gemm_t>();
          }
          // acc[nb, H] += p~[nb, cs] . W_c[cs, H]  ==  col-major acc^T = W_c^T . p~^T
          gemm<gemm_t, acc_t>(CUBLAS_OP_N, CUBLAS_OP_N, H, nb, cs, wc, H, pp, cs, acc_t(1), gv + n0 * H, H);
        }
      }
    }
    logprob_finalize_kernel<scalar_t, acc_t><<<N, kThreads, 0, stream>>>(
        ref, s, u, zt, tp, wp, V, H, inv_temp, ignore_index, logp.data_ptr<acc_t>(), ent.data_ptr<acc_t>(),
        stats.data_ptr<acc_t>(), N, gv);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {logp, ent, stats, grad_vec};
}

std::tuple<at::Tensor, at::Tensor> fused_logprob_backward_weight_cuda(
    const at::Tensor& grad_logp, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
    const std::optional<at::Tensor>& bias, const at::Tensor& stats, double temperature, int64_t ignore_index,
    int64_t chunk_bytes) {
  constexpr const char* op = "fasttrain::fused_logprob_backward_weight";
  FT_CHECK_DEVICE_TYPE(op, hidden, at::kCUDA);
  fused_logprob_check_args(op, hidden, weight, targets, bias, temperature);
  const at::ScalarType acc_dt = acc_type_of(hidden.scalar_type());
  const at::ScalarType gemm_dt = gemm_type_of(hidden.scalar_type());
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  fused_logprob_check_backward_weight_args(op, hidden, grad_logp, stats, acc_dt);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor h = hidden.contiguous(), w = weight.contiguous(), tg = targets.contiguous();
  check_targets_cuda(op, tg, V, ignore_index);
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const at::Tensor g = grad_logp.to(acc_dt).contiguous(), l = stats.contiguous();
  at::Tensor grad_weight = at::empty_like(w, at::MemoryFormat::Contiguous);
  at::Tensor grad_bias = at::zeros({V}, h.options().dtype(acc_dt));  // stays 0 without a bias
  if (N == 0 || H == 0) {  // no token, or nothing for dW's rows to hold; the bias gradient still counts
    grad_weight.zero_();
    if (N == 0 || !b.defined()) return {grad_weight, grad_bias};
  }
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  int64_t Nb, C;
  pick_blocks(chunk_bytes, N, V, int64_t(at::elementSize(acc_dt)) + at::elementSize(gemm_dt), Nb, C);
  at::Tensor zbuf = at::empty({Nb * C}, h.options().dtype(acc_dt));
  at::Tensor dbuf = at::empty({Nb * C}, h.options().dtype(gemm_dt));
  at::Tensor dwacc = at::empty({C, H}, h.options().dtype(acc_dt));
  // fp16: hidden widened to float32 once, the dW GEMM's other operand
  const at::Tensor hg = gemm_dt != h.scalar_type() ? h.to(gemm_dt) : h;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, h.scalar_type(), "fused_logprob_backward_cuda", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    using gemm_t = gemm_type<scalar_t>;
    const acc_t inv_temp = static_cast<acc_t>(1.0 / temperature);
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    const gemm_t* hgp = hg.const_data_ptr<gemm_t>();
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    const scalar_t* bp = b.defined() ? b.const_data_ptr<scalar_t>() : nullptr;
    const int64_t* tp = tg.const_data_ptr<int64_t>();
    acc_t* zp = zbuf.data_ptr<acc_t>();
    gemm_t* dp = dbuf.data_ptr<gemm_t>();
    acc_t* dwp = H > 0 ? dwacc.data_ptr<acc_t>() : nullptr;
    for (int64_t v0 = 0; v0 < V; v0 += C) {
      const int64_t cs = std::min(C, V - v0);
      for (int64_t n0 = 0; n0 < N; n0 += Nb) {
        const int64_t nb = std::min(Nb, N - n0);
        gemm<scalar_t, acc_t>(CUBLAS_OP_T, CUBLAS_OP_N, cs, nb, H, wp + v0 * H, H, hp + n0 * H, H, acc_t(0), zp,
                              cs);
        const dim3 grid((cs + kThreads - 1) / kThreads, (nb + 63) / 64);
        logprob_dlogit_kernel<scalar_t, gemm_t, acc_t><<<grid, kThreads, 0, stream>>>(
            zp, dp, bp, g.const_data_ptr<acc_t>(), l.const_data_ptr<acc_t>(), N, tp, n0, nb, v0, cs, inv_temp,
            ignore_index, grad_bias.data_ptr<acc_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        // dW_c[cs, H] (+)= D[nb, cs]^T . h[nb, H]  ==  col-major dW_c^T = h^T . D
        gemm<gemm_t, acc_t>(CUBLAS_OP_N, CUBLAS_OP_T, H, cs, nb, hgp + n0 * H, H, dp, cs,
                            n0 == 0 ? acc_t(0) : acc_t(1), dwp, H);
      }
      if (H > 0) grad_weight.narrow(0, v0, cs).copy_(dwacc.narrow(0, 0, cs));
    }
  });
  return {grad_weight, grad_bias};
}

}  // namespace fasttrain

TORCH_LIBRARY_IMPL(fasttrain, CUDA, m) {
  m.impl("fused_logprob_forward", &fasttrain::fused_logprob_forward_cuda);
  m.impl("fused_logprob_backward_weight", &fasttrain::fused_logprob_backward_weight_cuda);
}
