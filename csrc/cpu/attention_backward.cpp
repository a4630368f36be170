// The softmax step of a masked attention's backward, CPU, fused: from the raw scores S = q·kᵀ and
// dP = dO·vᵀ (both float32, one row per query) to the probabilities P and the scores' gradient
// dS = scale·P ⊙ (dP − Σ_j P_j dP_j), each written once in the GEMMs' dtype.
// What it is: per query row, in one pass over L1-resident memory, the softmax of scale·S over the
// row's allowed keys (max-subtracted; masked keys get 0; a row with none gets P = dS = 0), then the
// row's Σ P·dP and dS. fasttrain.ops.attention runs the rest of the backward (S, dP, dV = Pᵀ dO,
// dQ = dS k, dK = dSᵀ q) as batched GEMMs around it.
// Why by hand: ATen's CPU flash-attention backward at the update's answer shape (12 rows x 3 KV
// heads, 189 query rows of a KV head over 360 keys, bf16) took 25-27 ms a call on a 2-core AMX Xeon
// (about 60 GFLOP/s: it runs many small GEMMs on 32-query blocks), 14% of SmolLM2's update; the
// same five GEMMs batched take about 4.5 ms there. In eager PyTorch the softmax step between them
// is six to eight passes over the [rows, L] scores (mask, exp, sums, products, two casts: ~9 ms at
// that shape); `aten::_masked_softmax` with an expanded mask took 15 ms alone. Here it is one: about
// 1.5 ms for a 4 MiB chunk of those scores (5 rows), the whole backward 14-15 ms against ATen's 25-27
// (bench/bench_attention_backward.py; fasttrain.ops.attention says where it is used).
// Precision: every sum in float32 (float32 inputs), in a fixed order per row; results do not depend
// on the thread count (work items are whole rows). The exp is Sleef's (1 ulp) through at::vec.
// What it is not: a forward (the forward stays ATen's flash attention), nor a CUDA kernel: on a GPU
// the backward stays torch's (flash attention there).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "core/variant.h"
#include "core/checks.h"
#include "cpu/parallel.h"
#include "cpu/register.h"
#include "ops.h"

namespace fasttrain {
FT_VARIANT_BEGIN

namespace {
using fVec = at::vec::Vectorized<float>;

// W floats from `src` written to `dst` as out_t (2W at a time for the 16-bit types: one vector of them).
template <typename out_t>
inline void store_out(const fVec& lo, const fVec& hi, out_t* dst) {
  if constexpr (std::is_same_v<out_t, float>) {
    lo.store(dst);
    hi.store(dst + fVec::size());
  } else {
    at::vec::convert_from_float<out_t>(lo, hi).store(dst);
  }
}

template <typename out_t>
void softmax_grad_rows(const float* s, const float* dp, const bool* mask, int64_t rows_per_a, int64_t rows_per_b,
                       int64_t stride_a, int64_t stride_b, int64_t stride_c, int64_t L, float scale,
                       int64_t r0, int64_t r1, out_t* p_out, out_t* ds_out, float* buf) {
  constexpr int64_t W = fVec::size();
  const float ninf = -std::numeric_limits<float>::infinity();
  float* mf = buf + L;  // the row's mask as 0/1 floats
  const fVec vninf(ninf), vzero(0.f), vscale(scale);
  for (int64_t r = r0; r < r1; ++r) {
    const float* sr = s + r * L;
    const float* dpr = dp + r * L;
    const bool* mr = nullptr;
    if (mask != nullptr) {
      const int64_t a = r / rows_per_a, b = (r % rows_per_a) / rows_per_b, c = r % rows_per_b;
      mr = mask + a * stride_a + b * stride_b + c * stride_c;
      const uint8_t* mb = reinterpret_cast<const uint8_t*>(mr);
      for (int64_t j = 0; j < L; ++j) mf[j] = static_cast<float>(mb[j]);
    }
    // pass 1: buf = scale·s (−inf where masked), its max
    int64_t j = 0;
    fVec vmax(ninf);
    for (; j + W <= L; j += W) {
      fVec z = fVec::loadu(sr + j) * vscale;
      if (mr != nullptr) z = fVec::blendv(vninf, z, fVec::loadu(mf + j) != vzero);
      z.store(buf + j);
      vmax = at::vec::maximum(vmax, z);
    }
    float mx = at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return at::vec::maximum(x, y); }, vmax);
    for (; j < L; ++j) {
      buf[j] = (mr == nullptr || mr[j]) ? sr[j] * scale : ninf;
      mx = buf[j] > mx ? buf[j] : mx;
    }
    out_t* pr = p_out + r * L;
    out_t* dsr = ds_out + r * L;
    if (mx == ninf) {  // no allowed key: nothing flows through this row
      for (j = 0; j < L; ++j) {
        pr[j] = out_t(0.f);
        dsr[j] = out_t(0.f);
      }
      continue;
    }
    // pass 2: buf = e^(z − max) (0 where masked), their sum
    const fVec vmx(mx);
    fVec vsum(0.f);
    for (j = 0; j + W <= L; j += W) {
      const fVec e = (fVec::loadu(buf + j) - vmx).exp();
      e.store(buf + j);
      vsum = vsum + e;
    }
    float sum = at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, vsum);
    for (; j < L; ++j) {
      buf[j] = std::exp(buf[j] - mx);
      sum += buf[j];
    }
    // pass 3: P = e / sum, Σ P·dP
    const float inv = 1.f / sum;
    const fVec vinv(inv);
    fVec vdot(0.f);
    for (j = 0; j + W <= L; j += W) {
      const fVec pv = fVec::loadu(buf + j) * vinv;
      pv.store(buf + j);
      vdot = vdot + pv * fVec::loadu(dpr + j);
    }
    float dot = at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, vdot);
    for (; j < L; ++j) {
      buf[j] *= inv;
      dot += buf[j] * dpr[j];
    }
    // pass 4: P and dS = scale·P·(dP − Σ P·dP), written in out_t
    const fVec vdotv(dot);
    for (j = 0; j + 2 * W <= L; j += 2 * W) {
      const fVec p0 = fVec::loadu(buf + j), p1 = fVec::loadu(buf + j + W);
      store_out<out_t>(p0, p1, pr + j);
      store_out<out_t>(vscale * p0 * (fVec::loadu(dpr + j) - vdotv),
                       vscale * p1 * (fVec::loadu(dpr + j + W) - vdotv), dsr + j);
    }
    for (; j < L; ++j) {
      pr[j] = out_t(buf[j]);
      dsr[j] = out_t(scale * buf[j] * (dpr[j] - dot));
    }
  }
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_softmax_grad_cpu(const at::Tensor& s, const at::Tensor& dp,
                                                              const std::optional<at::Tensor>& mask_opt, double scale,
                                                              at::ScalarType out_dtype) {
  constexpr const char* op = "fasttrain::attention_softmax_grad";
  FT_CHECK_DEVICE_TYPE(op, s, at::kCPU);
  FT_CHECK_SAME_DEVICE(op, s, dp);
  FT_CHECK_DIM(op, s, 4);
  FT_CHECK_DTYPE(op, s, at::kFloat);
  FT_CHECK_DTYPE(op, dp, at::kFloat);
  FT_CHECK_CONTIGUOUS(op, s);
  FT_CHECK_CONTIGUOUS(op, dp);
  FT_CHECK_ARG(dp.sizes() == s.sizes(), op, "dp", "must have the shape of s ", s.sizes(), ", got ", dp.sizes());
  FT_CHECK_ARG(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf, op, "out_dtype",
               "must be float32, bfloat16 or float16, got ", out_dtype);
  const int64_t A = s.size(0), B = s.size(1), C = s.size(2), L = s.size(3);
  int64_t sa = 0, sb = 0, sc = 0;
  const bool* mptr = nullptr;
  at::Tensor mask;
  if (mask_opt.has_value()) {
    mask = *mask_opt;
    const at::Tensor& m = mask;
    FT_CHECK_SAME_DEVICE(op, s, mask);
    FT_CHECK_DTYPE(op, mask, at::kBool);
    FT_CHECK_DIM(op, mask, 4);
    for (int64_t d = 0; d < 4; ++d)
      FT_CHECK_ARG(m.size(d) == s.size(d) || m.size(d) == 1, op, "mask", "must broadcast to ", s.sizes(),
                   ", got ", m.sizes());
    FT_CHECK_ARG(m.size(3) == L && (m.stride(3) == 1 || L == 1), op, "mask",
                 "must have the keys' dimension whole and contiguous, got shape ", m.sizes(), " strides ",
                 m.strides());
    sa = m.size(0) == 1 ? 0 : m.stride(0);
    sb = m.size(1) == 1 ? 0 : m.stride(1);
    sc = m.size(2) == 1 ? 0 : m.stride(2);
    mptr = m.data_ptr<bool>();
  }
  at::Tensor p = at::empty(s.sizes(), s.options().dtype(out_dtype));
  at::Tensor ds = at::empty(s.sizes(), s.options().dtype(out_dtype));
  const int64_t R = A * B * C;
  if (R == 0 || L == 0) return {p, ds};
  const float fscale = static_cast<float>(scale);
  const float* sp = s.data_ptr<float>();
  const float* dpp = dp.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / L);
  AT_DISPATCH_SWITCH(out_dtype, op, AT_DISPATCH_CASE(at::kFloat, [&] {
    parallel_for(0, R, grain, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(2 * L);
      softmax_grad_rows<float>(sp, dpp, mptr, B * C, C, sa, sb, sc, L, fscale, r0, r1, p.data_ptr<float>(),
                               ds.data_ptr<float>(), buf.data());
    });
  }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
    parallel_for(0, R, grain, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(2 * L);
      softmax_grad_rows<at::BFloat16>(sp, dpp, mptr, B * C, C, sa, sb, sc, L, fscale, r0, r1,
                                      p.data_ptr<at::BFloat16>(), ds.data_ptr<at::BFloat16>(), buf.data());
    });
  }) AT_DISPATCH_CASE(at::kHalf, [&] {
    parallel_for(0, R, grain, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(2 * L);
      softmax_grad_rows<at::Half>(sp, dpp, mptr, B * C, C, sa, sb, sc, L, fscale, r0, r1, p.data_ptr<at::Half>(),
                                  ds.data_ptr<at::Half>(), buf.data());
    });
  }));
  return {p, ds};
}

void register_attention_backward(torch::Library& m) {
  m.impl("attention_softmax_grad", &attention_softmax_grad_cpu);
}

FT_VARIANT_END
}  // namespace fasttrain
