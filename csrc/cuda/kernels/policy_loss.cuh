// The fused policy loss's CUDA kernels and their launch sequences, one source for the GPU build
// (csrc/cuda/policy_loss.cu, whose header says what they are) and the CUDA emulator (csrc/cuda_emu).
#pragma once
#include "core/dispatch.h"
#include "core/math.h"
#include "cuda/common.cuh"
#include "cuda/device.h"

namespace fasttrain::cuda::policy_loss {
namespace fm = fasttrain::math;

constexpr int kThreads = 256;
constexpr int64_t kChunk = 2048;  // tokens per CTA (8 per thread)

template <typename scalar_t, bool kCispo, bool kKl, bool kKlRatio, bool kAdvPerToken>
__global__ void __launch_bounds__(kThreads) policy_chunk_kernel(const scalar_t* __restrict__ lp, const scalar_t* __restrict__ old,
                                    const float* __restrict__ adv, const float* __restrict__ mask,
                                    const uint8_t* __restrict__ mask_bool, const scalar_t* __restrict__ ref,
                                    float* __restrict__ coef,
                                    float* __restrict__ partial, int64_t T, int64_t nc, float beta, float eps_low,
                                    float eps_high, float cap, float zeta) {
  const int64_t c = blockIdx.x;
  const int64_t b = c / nc, start = (c % nc) * kChunk;
  const int64_t end = min(T, start + kChunk);
  float acc[fm::kPolicySums];
#pragma unroll
  for (int k = 0; k < fm::kPolicySums; ++k) acc[k] = 0.0f;
  const float adv_row = kAdvPerToken ? 0.0f : adv[b];
  for (int64_t t = start + threadIdx.x; t < end; t += kThreads) {
    const int64_t i = b * T + t;
    // A bool mask reads as the 0/1 a float mask would hold (a uniform branch: one of the two is null).
    const float w = mask_bool != nullptr ? (mask_bool[i] != 0 ? 1.0f : 0.0f) : mask[i];
    const float A = kAdvPerToken ? adv[i] : adv_row;
    const float r = kKl ? static_cast<float>(ref[i]) : 0.0f;
    const fm::PolicyToken tk = fm::policy_token<kCispo, kKl, kKlRatio>(static_cast<float>(lp[i]), static_cast<float>(old[i]), A,
                                                             r, beta, eps_low, eps_high, cap, zeta);
    const bool on = w != 0.0f;
    const bool nz = on && (A != 0.0f);
    coef[i] = on ? w * tk.grad : 0.0f;
    acc[fm::kSumLoss] += on ? w * tk.loss : 0.0f;
    acc[fm::kSumWeight] += w;
    acc[fm::kSumRatio] += on ? w * tk.ratio : 0.0f;
    acc[fm::kSumClipLow] += on ? w * tk.clip_low : 0.0f;
    acc[fm::kSumClipHigh] += on ? w * tk.clip_high : 0.0f;
    acc[fm::kSumCapped] += on ? w * tk.capped : 0.0f;
    acc[fm::kSumKl] += on ? w * tk.kl : 0.0f;
    acc[fm::kSumFactor] += nz ? w * tk.factor : 0.0f;
    acc[fm::kSumNonzeroAdv] += nz ? w : 0.0f;
  }
  FT_SHARED(float, smem, [kThreads / 32][fm::kPolicySums]);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < fm::kPolicySums; ++k) {
    const float v = fasttrain::cuda::warp_sum(acc[k]);
    if (lane == 0) smem[warp][k] = v;
  }
  __syncthreads();
  if (threadIdx.x < fm::kPolicySums) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) s += smem[w][threadIdx.x];
    partial[c * fm::kPolicySums + threadIdx.x] = s;
  }
}

// One CTA. Batch sums in double, in chunk order; GRPO row sums likewise.
__global__ void __launch_bounds__(kThreads) policy_finalize_kernel(const float* __restrict__ partial, int64_t B, int64_t nc, int grpo,
                                       const float* __restrict__ norm_tensor, double norm_value,
                                       float* __restrict__ loss, float* __restrict__ stats,
                                       float* __restrict__ rowscale) {
  FT_SHARED(double, sums, [fm::kPolicySums]);
  FT_SHARED(double, red, [kThreads]);
  FT_SHARED(double, S_shared, );
  const double norm_given = norm_tensor != nullptr ? static_cast<double>(*norm_tensor) : norm_value;
  // Batch sums: thread k < kPolicySums walks the chunks in order.
  if (threadIdx.x < fm::kPolicySums) {
    double s = 0.0;
    for (int64_t c = 0; c < B * nc; ++c) s += partial[c * fm::kPolicySums + threadIdx.x];
    sums[threadIdx.x] = s;
  }
  __syncthreads();
  if (grpo) {
    // Active rows (fixed-order tree reduction of per-thread counts).
    double cnt = 0.0;
    for (int64_t b = threadIdx.x; b < B; b += kThreads) {
      double w = 0.0;
      for (int64_t j = 0; j < nc; ++j) w += partial[(b * nc + j) * fm::kPolicySums + fm::kSumWeight];
      cnt += w > 0.0 ? 1.0 : 0.0;
    }
    red[threadIdx.x] = cnt;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
      __syncthreads();
    }
    if (threadIdx.x == 0) S_shared = norm_given > 0.0 ? norm_given : red[0];
    __syncthreads();
    const double S = S_shared;
    double lsum = 0.0;
    for (int64_t b = threadIdx.x; b < B; b += kThreads) {
      double w = 0.0, l = 0.0;
      for (int64_t j = 0; j < nc; ++j) {
        const float* p = partial + (b * nc + j) * fm::kPolicySums;
        w += p[fm::kSumWeight];
        l += p[fm::kSumLoss];
      }
      const double scale = (w > 0.0 && S > 0.0) ? 1.0 / (w * S) : 0.0;
      rowscale[b] = static_cast<float>(scale);
      lsum += l * scale;
    }
    // No barrier before this write: every read of red (the count's reduction, thread 0's read of
    // red[0]) happened before the barrier that published S_shared.
    red[threadIdx.x] = lsum;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
      __syncthreads();
    }
    if (threadIdx.x == 0) *loss = static_cast<float>(red[0]);
  } else {
    const double N = norm_given > 0.0 ? norm_given : sums[fm::kSumWeight];
    const double inv = N > 0.0 ? 1.0 / N : 0.0;
    for (int64_t b = threadIdx.x; b < B; b += kThreads) rowscale[b] = static_cast<float>(inv);
    if (threadIdx.x == 0) *loss = static_cast<float>(sums[fm::kSumLoss] * inv);
  }
  if (threadIdx.x == 0) fm::policy_stats(sums, stats);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) policy_backward_kernel(const float* __restrict__ grad_loss, const float* __restrict__ coef,
                                       const float* __restrict__ rowscale, scalar_t* __restrict__ out, int64_t n,
                                       int64_t T) {
  const float g = *grad_loss;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = static_cast<scalar_t>(coef[i] * g * rowscale[i / T]);
}


// ---- launch sequences --------------------------------------------------------------------------
// The forward: logp, old (and ref, used when non-null and beta != 0) [B, T] of dtype dt; adv fp32 [B]
// or [B, T]; one of mask (fp32) and mask_bool (bytes 0/1) [B, T]; norm_tensor fp32 [1] or null (then
// norm_value); kl_type fm::kKlK3 or fm::kKlK3Ratio. -> coef [B, T], rowscale [B], loss [], stats
// [kPolicyStats], all fp32.
inline void forward(Device& dev, at::ScalarType dt, const void* logp, const void* old_logp, const float* adv,
                    bool adv_per_token, const float* mask, const uint8_t* mask_bool, const void* ref,
                    const float* norm_tensor, double norm_value, int64_t B, int64_t T, int64_t loss_type, double beta,
                    double eps_low, double eps_high, double cispo_cap, double zeta, int64_t kl_type, float* coef,
                    float* rowscale,
                    float* loss, float* stats) {
  const bool has_kl = ref != nullptr && beta != 0.0;
  const int64_t nc = std::max<int64_t>((T + kChunk - 1) / kChunk, 1);
  const int64_t npartial = std::max<int64_t>(B * nc, 1) * fm::kPolicySums;
  float* partial = dev.scratch_of<float>(npartial);
  dev.fill(partial, at::kFloat, 0.0, npartial);
  const float el = static_cast<float>(eps_low);
  const float eh = static_cast<float>(loss_type == fm::kGrpo ? eps_low : eps_high);
  if (B * T > 0) {
    FT_DISPATCH_FLOATING(dt, "policy_loss", [&] {
      const scalar_t* rf = has_kl ? static_cast<const scalar_t*>(ref) : nullptr;
      auto run = [&](auto kernel) {
        launch(kernel, (unsigned)(B * nc), kThreads, 0, dev.stream(), static_cast<const scalar_t*>(logp),
               static_cast<const scalar_t*>(old_logp), adv, mask_bool != nullptr ? nullptr : mask, mask_bool, rf,
               coef, partial, T, nc, static_cast<float>(beta), el, eh, static_cast<float>(cispo_cap),
               static_cast<float>(zeta));
      };
      // One kernel per (CISPO or not, KL none / k3 / k3_ratio, per-token advantages or per-row), picked
      // flag by flag; the ratio flag without KL is never instantiated.
      // (std::decay_t: GCC names a flag captured by a nested generic lambda as a reference type.)
      with_flag(loss_type == fm::kCispo, [&](auto cispo) {
        with_flag(has_kl, [&](auto kl) {
          with_flag(has_kl && kl_type == fm::kKlK3Ratio, [&](auto ratio) {
            constexpr bool kC = std::decay_t<decltype(cispo)>::value, kK = std::decay_t<decltype(kl)>::value,
                           kR = std::decay_t<decltype(ratio)>::value;
            if constexpr (kK || !kR) {
              with_flag(adv_per_token, [&](auto per_token) {
                run(policy_chunk_kernel<scalar_t, kC, kK, kR, std::decay_t<decltype(per_token)>::value>);
              });
            }
          });
        });
      });
    });
  }
  launch(policy_finalize_kernel, 1, kThreads, 0, dev.stream(), static_cast<const float*>(partial), B, nc,
         loss_type == fm::kGrpo ? 1 : 0, norm_tensor, norm_value, loss, stats, rowscale);
}

// grad [B, T] of dtype dt = grad_loss * coef * rowscale[row].
inline void backward(Device& dev, at::ScalarType dt, const float* grad_loss, const float* coef, const float* rowscale,
                     int64_t B, int64_t T, void* grad) {
  const int64_t n = B * T;
  if (n == 0) return;
  FT_DISPATCH_FLOATING(dt, "policy_loss_backward", [&] {
    launch(policy_backward_kernel<scalar_t>, fasttrain::cuda::grid_for(n, kThreads), kThreads, 0, dev.stream(),
           grad_loss, coef, rowscale, static_cast<scalar_t*>(grad), n, T);
  });
}

}  // namespace fasttrain::cuda::policy_loss
