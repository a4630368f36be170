// Fused policy loss (CISPO | DAPO | GRPO, KL k3 or k3_ratio, REPO-R, token mask), CPU.
// What it is: one pass over the tokens computes each token's loss, its gradient coefficient
// (saved for backward) and the statistics; a short serial pass reduces per-chunk sums into the
// loss, the stats vector and per-row scales. Backward is one elementwise pass:
// grad_logp = grad_loss * coef * rowscale[row].
// What it is not: a gradient for old_logp, advantages, ref_logp or the mask (they are data).
// Determinism: tokens are cut into fixed chunks (a row's tokens, kChunk at a time) whose sums are
// added in chunk order, so results do not depend on the thread count.
// Napkin math: fp32 forward reads 16 B/token (logp, old, adv, mask; +4 with KL) and writes 4 B
// (coef); backward reads 4 B and writes 4 B. 1M tokens = 28 MB of traffic, ~3 ms at the ~10 GB/s
// two cores of this machine stream; the exps are vectorized (core/math.h exp_f32) to stay there.
// GCC keeps float compares as branches under its default -ftrapping-math, which stops it from
// vectorizing the token loop (5x slower here). We never trap on FP exceptions: every CPU kernel unit
// is built with -fno-trapping-math (CMakeLists.txt); results are bit-identical.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "core/variant.h"
#include "core/checks.h"
#include "core/policy_loss_checks.h"
#include "core/dispatch.h"
#include "core/math.h"
#include "cpu/parallel.h"
#include "cpu/register.h"
#include "ops.h"

namespace fasttrain {
FT_VARIANT_BEGIN
namespace fm = fasttrain::math;

namespace {
constexpr int64_t kChunk = 2048;  // tokens per partial sum (fixed: results independent of threads)
constexpr int kBlock = 256;       // tokens per stack buffer (9 x 1 KB, stays in L1)
constexpr int kSumLanes = 8;         // one AVX2 register of floats; independent per-lane sums
// Fewer tokens than this per thread and the thread pool's wake-up costs more than the split saves
// (at ~3 ns/token, 16k tokens are ~50 us; a wake-up on a busy 2-core machine is 10-20 us): small
// batches run on the calling thread. Same fixed chunks either way, so the results do not change.
constexpr int64_t kMinTokensPerThread = 16384;

struct PolicyArgs {
  float beta, eps_low, eps_high, cap, zeta;
};

// One chunk: a vectorizable token loop over blocks of kBlock tokens writes each token's weighted
// terms to a small stack buffer, then kSumLanes-wide partial sums (plain adds, vectorized; no
// reassociation needed) accumulate them. coef is written in the same loop.
template <typename scalar_t, bool kCispo, bool kKl, bool kKlRatio, bool kAdvPerToken>
void policy_chunk(const scalar_t* __restrict__ lp, const scalar_t* __restrict__ old,
                  const float* __restrict__ adv, const void* mask_, bool mask_bool,
                  const scalar_t* __restrict__ ref, float* __restrict__ coef, int64_t n,
                  float adv_row, const PolicyArgs& a, double* __restrict__ out_sums) {
  alignas(64) float buf[fm::kPolicySums][kBlock];
  alignas(64) float mbuf[kBlock];
  float acc[fm::kPolicySums][kSumLanes] = {};
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int m = static_cast<int>(std::min<int64_t>(kBlock, n - b0));
    // A bool mask becomes 0/1 floats block by block (the values a float mask would hold), so one
    // token loop serves both and the caller need not convert the whole mask first.
    const float* __restrict__ mk;  // this block's mask values
    if (mask_bool) {
      const uint8_t* mb = static_cast<const uint8_t*>(mask_) + b0;
      for (int j = 0; j < m; ++j) mbuf[j] = mb[j] != 0 ? 1.0f : 0.0f;
      mk = mbuf;
    } else {
      mk = static_cast<const float*>(mask_) + b0;
    }
    for (int j = 0; j < m; ++j) {
      const int64_t i = b0 + j;
      const float w = mk[j];
      const float A = kAdvPerToken ? adv[i] : adv_row;
      const float r = kKl ? static_cast<float>(ref[i]) : 0.0f;
      const fm::PolicyToken t = fm::policy_token<kCispo, kKl, kKlRatio>(
          static_cast<float>(lp[i]), static_cast<float>(old[i]), A, r, a.beta, a.eps_low, a.eps_high, a.cap, a.zeta);
      const bool on = w != 0.0f;  // masked tokens contribute exactly 0 even if their inputs are inf/NaN
      const float nz = static_cast<float>(A != 0.0f);
      coef[i] = on ? w * t.grad : 0.0f;
      buf[fm::kSumLoss][j] = on ? w * t.loss : 0.0f;
      buf[fm::kSumWeight][j] = w;
      buf[fm::kSumRatio][j] = on ? w * t.ratio : 0.0f;
      buf[fm::kSumClipLow][j] = on ? w * t.clip_low : 0.0f;
      buf[fm::kSumClipHigh][j] = on ? w * t.clip_high : 0.0f;
      buf[fm::kSumCapped][j] = on ? w * t.capped : 0.0f;
      buf[fm::kSumKl][j] = on ? w * t.kl : 0.0f;
      buf[fm::kSumFactor][j] = on ? w * nz * t.factor : 0.0f;
      buf[fm::kSumNonzeroAdv][j] = w * nz;
    }
    const int mp = (m + kSumLanes - 1) / kSumLanes * kSumLanes;
    for (int k = 0; k < fm::kPolicySums; ++k)
      for (int j = m; j < mp; ++j) buf[k][j] = 0.0f;
    // j outer, k inner: kPolicySums independent vector accumulators per step instead of one
    // dependent chain per sum (that chain's add latency was most of the block's time). Each
    // acc[k][l] still adds its terms in j order, so the sums are bit-identical to the k-outer loop.
    for (int j = 0; j < mp; j += kSumLanes)
      for (int k = 0; k < fm::kPolicySums; ++k)
        for (int l = 0; l < kSumLanes; ++l) acc[k][l] += buf[k][j + l];
  }
  for (int k = 0; k < fm::kPolicySums; ++k) {
    double s = 0.0;
    for (int l = 0; l < kSumLanes; ++l) s += acc[k][l];
    out_sums[k] = s;
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss_cpu(
    const at::Tensor& logp_, const at::Tensor& old_logp_, const at::Tensor& advantages_, const at::Tensor& mask_,
    const std::optional<at::Tensor>& ref_logp_, const std::optional<at::Tensor>& token_normalizer,
    int64_t loss_type, double beta, double eps_low, double eps_high, double cispo_cap, double zeta,
    double token_normalizer_value, int64_t kl_type) {
  constexpr const char* op = "fasttrain::policy_loss";
  FT_CHECK_DEVICE_TYPE(op, logp_, at::kCPU);
  check_inputs(op, logp_, old_logp_, advantages_, mask_, ref_logp_, token_normalizer, loss_type, kl_type);
  const bool has_kl = ref_logp_.has_value() && beta != 0.0;
  const at::Tensor logp = logp_.contiguous(), old_logp = old_logp_.contiguous();
  const at::Tensor adv = advantages_.contiguous(), mask = mask_.contiguous();
  const bool mask_bool = mask.scalar_type() == at::kBool;  // else float32 (check_inputs)
  const at::Tensor ref = has_kl ? ref_logp_->contiguous() : at::Tensor();
  const bool adv_per_token = adv.dim() == 2;
  const int64_t B = logp.size(0), T = logp.size(1);
  const int64_t nc = std::max<int64_t>((T + kChunk - 1) / kChunk, 1);
  const int64_t grain = std::max<int64_t>(1, kMinTokensPerThread / std::max<int64_t>(std::min(T, kChunk), 1));

  at::Tensor coef = at::empty({B, T}, logp.options().dtype(at::kFloat));
  at::Tensor rowscale = at::empty({B}, logp.options().dtype(at::kFloat));
  at::Tensor loss = at::empty({}, logp.options().dtype(at::kFloat));
  at::Tensor stats = at::empty({fm::kPolicyStats}, logp.options().dtype(at::kFloat));
  std::vector<double> partial(static_cast<size_t>(B * nc * fm::kPolicySums), 0.0);

  const PolicyArgs args{static_cast<float>(beta), static_cast<float>(eps_low),
                        static_cast<float>(loss_type == fm::kGrpo ? eps_low : eps_high),
                        static_cast<float>(cispo_cap), static_cast<float>(zeta)};
  const bool cispo = loss_type == fm::kCispo;
  const bool kl_ratio = kl_type == fm::kKlK3Ratio;

  FT_DISPATCH_FLOATING(logp.scalar_type(), "policy_loss_cpu", [&] {
    const scalar_t* lp = logp.const_data_ptr<scalar_t>();
    const scalar_t* od = old_logp.const_data_ptr<scalar_t>();
    const scalar_t* rf = has_kl ? ref.const_data_ptr<scalar_t>() : nullptr;
    const float* ap = adv.const_data_ptr<float>();
    const char* mp = static_cast<const char*>(mask.const_data_ptr());
    const int64_t mask_elem = mask_bool ? 1 : static_cast<int64_t>(sizeof(float));
    float* cp = coef.data_ptr<float>();
    double* pp = partial.data();
    auto run = [&](auto kernel) {
      fasttrain::parallel_for(0, B * nc, grain, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t b = c / nc, start = (c % nc) * kChunk, n = std::min(kChunk, T - start);
          if (n <= 0) continue;
          const int64_t off = b * T + start;
          kernel(lp + off, od + off, adv_per_token ? ap + off : ap, mp + off * mask_elem, mask_bool,
                 has_kl ? rf + off : nullptr, cp + off, n,
                 adv_per_token ? 0.0f : ap[b], args, pp + c * fm::kPolicySums);
        }
      });
    };
    // 12 variants: loss family x KL (none, k3, k3_ratio) x advantage per token / per sequence.
    auto by_adv = [&](auto cispo_c, auto kl_c, auto ratio_c) {
      constexpr bool C = decltype(cispo_c)::value, K = decltype(kl_c)::value, R = decltype(ratio_c)::value;
      adv_per_token ? run(policy_chunk<scalar_t, C, K, R, true>) : run(policy_chunk<scalar_t, C, K, R, false>);
    };
    auto by_kl = [&](auto cispo_c) {
      if (!has_kl) by_adv(cispo_c, std::false_type{}, std::false_type{});
      else if (kl_ratio) by_adv(cispo_c, std::true_type{}, std::true_type{});
      else by_adv(cispo_c, std::true_type{}, std::false_type{});
    };
    cispo ? by_kl(std::true_type{}) : by_kl(std::false_type{});
  });

  // Reduce: batch sums in chunk order; GRPO also per-row sums.
  double sums[fm::kPolicySums] = {};
  float* rs = rowscale.data_ptr<float>();
  // A CPU float32 tensor of one element (check_inputs): read it, no op call.
  const double norm_given = token_normalizer.has_value()
                                ? static_cast<double>(*token_normalizer->const_data_ptr<float>())
                                : token_normalizer_value;
  double loss_value = 0.0;
  if (loss_type == fm::kGrpo) {
    // Per-sequence mean, then mean over the sequences with an active token (or over the given count).
    std::vector<double> row_loss(B), row_w(B);
    int64_t active_rows = 0;
    for (int64_t b = 0; b < B; ++b) {
      double l = 0.0, w = 0.0;
      for (int64_t j = 0; j < nc; ++j) {
        const double* p = partial.data() + (b * nc + j) * fm::kPolicySums;
        l += p[fm::kSumLoss];
        w += p[fm::kSumWeight];
      }
      row_loss[b] = l;
      row_w[b] = w;
      active_rows += w > 0.0 ? 1 : 0;
    }
    const double S = norm_given > 0.0 ? norm_given : static_cast<double>(active_rows);
    for (int64_t b = 0; b < B; ++b) {
      const double scale = (row_w[b] > 0.0 && S > 0.0) ? 1.0 / (row_w[b] * S) : 0.0;
      rs[b] = static_cast<float>(scale);
      loss_value += row_loss[b] * scale;
    }
  }
  for (int64_t c = 0; c < B * nc; ++c)
    for (int k = 0; k < fm::kPolicySums; ++k) sums[k] += partial[c * fm::kPolicySums + k];
  if (loss_type != fm::kGrpo) {
    const double N = norm_given > 0.0 ? norm_given : sums[fm::kSumWeight];
    const double inv = N > 0.0 ? 1.0 / N : 0.0;
    loss_value = sums[fm::kSumLoss] * inv;
    for (int64_t b = 0; b < B; ++b) rs[b] = static_cast<float>(inv);
  }
  *loss.data_ptr<float>() = static_cast<float>(loss_value);  // what fill_ stored, without an op call
  fm::policy_stats(sums, stats.data_ptr<float>());
  return {loss, stats, coef, rowscale};
}

at::Tensor policy_loss_backward_cpu(const at::Tensor& grad_loss, const at::Tensor& coef_, const at::Tensor& rowscale_,
                                    at::ScalarType dtype) {
  constexpr const char* op = "fasttrain::policy_loss_backward";
  FT_CHECK_DEVICE_TYPE(op, coef_, at::kCPU);
  FT_CHECK_DIM(op, coef_, 2);
  FT_CHECK_DTYPE(op, coef_, at::kFloat);
  FT_CHECK_DTYPE(op, rowscale_, at::kFloat);
  FT_CHECK_ARG(rowscale_.dim() == 1 && rowscale_.size(0) == coef_.size(0), op, "rowscale", "must be [B] with B = ",
               coef_.size(0), ", got ", rowscale_.sizes());
  FT_CHECK_ARG(grad_loss.numel() == 1, op, "grad_loss", "must hold one value, got shape ", grad_loss.sizes());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": dtype must be float32, float16 or bfloat16, got ", dtype);
  const at::Tensor coef = coef_.contiguous(), rowscale = rowscale_.contiguous();
  const int64_t B = coef.size(0), T = coef.size(1);
  // CPU tensor: a read, not a device sync (float32, the usual case, without an op call).
  const float g = grad_loss.scalar_type() == at::kFloat ? *grad_loss.const_data_ptr<float>()
                                                         : grad_loss.to(at::kFloat).item<float>();
  at::Tensor out = at::empty({B, T}, coef.options().dtype(dtype));
  const float* cp = coef.const_data_ptr<float>();
  const float* rp = rowscale.const_data_ptr<float>();
  FT_DISPATCH_FLOATING(dtype, "policy_loss_backward_cpu", [&] {
    scalar_t* op_ = out.data_ptr<scalar_t>();
    // Flat over tokens (a single long row still uses every core), walking row segments.
    fasttrain::parallel_for(0, B * T, 16384, [&](int64_t i0, int64_t i1) {
      int64_t i = i0;
      while (i < i1) {
        const int64_t b = i / T, end = std::min(i1, (b + 1) * T);
        const float s = g * rp[b];
        for (int64_t j = i; j < end; ++j) op_[j] = static_cast<scalar_t>(cp[j] * s);
        i = end;
      }
    });
  });
  return out;
}

void register_policy_loss(torch::Library& m) {
  m.impl("policy_loss", &policy_loss_cpu);
  m.impl("policy_loss_backward", &policy_loss_backward_cpu);
}

FT_VARIANT_END
}  // namespace fasttrain
