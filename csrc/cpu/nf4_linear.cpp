// nf4_linear on the CPU: y = g ⊙ (x·Wᵀ + s·(x·Aᵀ)·Bᵀ), W an NF4 matrix [N, K] in the bitsandbytes
// layout, A [r, K] and B [N, r] the LoRA factors, g = m / ‖W + s·B·A‖_row for DoRA (else 1).
//
// What it is: a fast NF4 → fp32 (or bf16) dequantisation into a reusable per-thread scratch (AVX2
// table lookup, 16 values per step; bf16 rounded to nearest even in the same registers), then the vendor GEMM (at::mm → oneDNN/MKL), with the LoRA term added
// into the same output buffer (addmm, beta = 1) and DoRA's scale applied to the output. The DoRA
// row norm comes from the factorised form ‖W‖² + 2s·rowdot(B, A·Wᵀ) + s²·rowdot(B·(A·Aᵀ), B)
// (never W + s·B·A). Backward re-dequantises W (the dequantised weight is never saved).
// What it is not: a fused dequant-GEMM microkernel. On 2 shared cores the dequantisation of a
// 576×1536 block (~0.3 ms) is small against the GEMM at training shapes; at decode shapes it is the
// part that bitsandbytes pays ~10× more for (its CPU dequant is scalar).
//
// Compute dtype: float64 for float64 inputs (the tests' exact path); otherwise float32, or bfloat16
// when x is bfloat16 and the CPU has avx512_bf16 (2× the fp32 GEMM rate there; without it a bf16
// GEMM is ~10× slower than fp32, measured on this AVX2 host).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "core/variant.h"
#include "core/checks.h"
#include "core/cpu_features.h"
#include "core/dispatch.h"
#include "core/math.h"
#include "core/nf4_linear_checks.h"
#include "cpu/nf4_decode.h"
#include "cpu/parallel.h"
#include "cpu/register.h"
#include "ops.h"

#include <type_traits>

namespace fasttrain {
FT_VARIANT_BEGIN
namespace fm = fasttrain::math;
using nf4cpu::decode_range;

namespace {

// The CPU op also accepts float64 (the tests' exact path); the CUDA one does not.
constexpr bool kXMayBeFloat64 = true;

// The reusable scratch: one per thread and dtype, grown on demand, never shrunk. Saves the page
// faults of a fresh multi-MB allocation per call; never escapes the op (results are new tensors).
at::Tensor scratch_weight(int64_t N, int64_t K, at::ScalarType dt) {
  thread_local at::Tensor buf[3];
  const int slot = dt == at::kDouble ? 0 : (dt == at::kFloat ? 1 : 2);
  at::Tensor& b = buf[slot];
  if (!b.defined() || b.numel() < N * K || b.scalar_type() != dt) b = at::empty({N * K}, at::TensorOptions().dtype(dt));
  return b.narrow(0, 0, N * K).view({N, K});
}

// W [N, K] in dtype `dt`, decoded in parallel over rows (into the scratch).
at::Tensor dequant_weight(const at::Tensor& packed, const at::Tensor& absmax, int64_t bs, int64_t N, int64_t K,
                          at::ScalarType dt) {
  at::Tensor w = scratch_weight(N, K, dt);
  const uint8_t* q = packed.const_data_ptr<uint8_t>();
  const float* am = absmax.const_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dt, "nf4_linear_dequant", [&] {
    scalar_t* o = w.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1));
    fasttrain::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      decode_range<scalar_t>(q, am, bs, n0 * K, n1 * K, o + n0 * K);
    });
  });
  return w;
}

// Decode shapes (M ≤ 64): dequantise W a tile of rows at a time into a cache-resident buffer and
// multiply it right away, so the decoded weight never leaves L2 (whole-W dequantisation writes and
// re-reads N·K·4 bytes through memory: ~40% of the op at M = 16 for a 1536×576 weight).
constexpr int64_t kDecodeMaxM = 64;
at::Tensor decode_tiled(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax, int64_t bs,
                        int64_t N, int64_t K) {
  const at::ScalarType ct = x.scalar_type();
  const int64_t esz = at::elementSize(ct);
  // Half of a 1 MiB L2 per tile: measured best of 32/128/512/4096 KiB here (32 KiB: ~2x slower).
  constexpr int64_t tile_bytes = 512 * 1024;
  const int64_t tile = std::max<int64_t>(8, std::min<int64_t>(N, tile_bytes / (K * esz)));
  const int64_t ntiles = (N + tile - 1) / tile;
  at::Tensor out = at::empty({N, x.size(0)}, x.options());  // yᵀ: each tile writes contiguous rows
  const uint8_t* q = packed.const_data_ptr<uint8_t>();
  const float* am = absmax.const_data_ptr<float>();
  fasttrain::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
    at::Tensor buf = at::empty({tile, K}, x.options());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, rows = std::min(tile, N - n0);
      AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, ct, "nf4_linear_decode_tile", [&] {
        decode_range<scalar_t>(q, am, bs, n0 * K, (n0 + rows) * K, buf.data_ptr<scalar_t>());
      });
      at::Tensor o = out.narrow(0, n0, rows);
      at::mm_out(o, buf.narrow(0, 0, rows), x.t());  // [rows, M] = W_tile · xᵀ
    }
  });
  return out.t();  // [M, N] view; callers add into it / cast it
}

at::ScalarType compute_dtype(const at::Tensor& x) {
  if (x.scalar_type() == at::kDouble) return at::kDouble;
  if (x.scalar_type() == at::kBFloat16 && cpu_has_bf16()) return at::kBFloat16;
  return at::kFloat;
}

// DoRA: ‖W + s·B·A‖ per row from the factorised form, in float32 (float64 when ct is double).
// The norm itself, not its reciprocal: callers form g = m / ‖·‖ by one division, so at
// initialisation (B = 0, m = ‖W‖ from the same ‖W‖²) g is exactly 1; m · (1/‖·‖) is not (1 ± 1 ulp
// for some rows), and that ulp flips the bf16 rounding of some outputs.
// w: the dequantised W [N, K] in ct. Returns [N] in the statistics dtype.
at::Tensor dora_norm(const at::Tensor& w, const at::Tensor& A, const at::Tensor& B, double scale,
                     const std::optional<at::Tensor>& weight_sq_norm, at::ScalarType ct) {
  const at::ScalarType st = ct == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor As = A.to(st), Bs = B.to(st);
  const at::Tensor wsq = weight_sq_norm.has_value() ? weight_sq_norm->to(st)
                                                    : w.to(st).square().sum(1);
  const at::Tensor aw = at::mm(A.to(ct), w.t()).to(st);              // [r, N]: one pass over W
  const at::Tensor cross = (Bs * aw.t()).sum(1);                       // rowdot(B, A·Wᵀ)
  const at::Tensor bab = (at::mm(Bs, at::mm(As, As.t())) * Bs).sum(1); // rowdot(B·(A·Aᵀ), B)
  at::Tensor rn = at::empty_like(wsq);
  AT_DISPATCH_FLOATING_TYPES(st, "dora_norm", [&] {
    const scalar_t* pw = wsq.const_data_ptr<scalar_t>();
    const scalar_t* pc = cross.const_data_ptr<scalar_t>();
    const scalar_t* pb = bab.const_data_ptr<scalar_t>();
    scalar_t* o = rn.data_ptr<scalar_t>();
    for (int64_t n = 0; n < rn.numel(); ++n)
      o[n] = fm::dora_row_norm<scalar_t>(pw[n], pc[n], pb[n], static_cast<scalar_t>(scale));
  });
  return rn;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> nf4_linear_cpu(
    const at::Tensor& x_, const at::Tensor& packed_, const at::Tensor& absmax_, int64_t blocksize,
    int64_t out_features, const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
    double scale, const std::optional<at::Tensor>& dora_m, const std::optional<at::Tensor>& weight_sq_norm) {
  constexpr const char* op = "fasttrain::nf4_linear";
  FT_CHECK_DEVICE_TYPE(op, x_, at::kCPU);
  const NF4LinearArgs a = check_nf4_linear_args(op, kXMayBeFloat64, x_, packed_, absmax_, blocksize, out_features,
                                                lora_a, lora_b, dora_m, weight_sq_norm);
  const at::ScalarType ct = compute_dtype(x_);
  const at::Tensor packed = packed_.contiguous(), absmax = absmax_.contiguous();
  const at::Tensor x = x_.to(ct).contiguous();
  at::Tensor z, w;
  // The base term is computed the same way with or without adapters (decode kernel at M <= 64,
  // dequantise + GEMM above), so that at initialisation (B = 0, DoRA scale 1) the output equals
  // the base bit for bit.
  if (a.M <= kDecodeMaxM) {
    z = decode_tiled(x, packed, absmax, blocksize, a.N, a.K);
    if (a.dora) w = dequant_weight(packed, absmax, blocksize, a.N, a.K, ct);  // for the DoRA norm only
  } else {
    w = dequant_weight(packed, absmax, blocksize, a.N, a.K, ct);  // scratch [N, K]
    z = at::mm(x, w.t());                                        // [M, N]
  }
  // xa [M, r]: also [M, 0] for rank-0 adapters, [0] without adapters
  at::Tensor xa = lora_a.has_value() ? at::empty({a.M, 0}, x.options()) : at::empty({0}, x.options());
  at::Tensor rnorm = at::empty({0}, x.options().dtype(ct == at::kDouble ? at::kDouble : at::kFloat));
  if (a.lora) {
    const at::Tensor A = lora_a->to(ct), B = lora_b->to(ct);
    xa = at::mm(x, A.t());                // [M, r]
    z.addmm_(xa, B.t(), 1.0, scale);      // the LoRA term lands in the base output's buffer
  }
  at::Tensor y;
  if (a.dora) {
    const at::Tensor norm = dora_norm(w, *lora_a, *lora_b, scale, weight_sq_norm, ct);
    rnorm = norm.reciprocal();                                              // saved for the backward
    const at::Tensor g = (dora_m->to(norm.scalar_type()) / norm).to(ct);  // m / ‖W + sBA‖
    z = z.contiguous();  // at M <= 64 a transposed view; z is returned (saved), y is formed from it
    y = (z * g).to(x_.scalar_type());
  } else {
    y = z.to(x_.scalar_type()).contiguous();
    z = at::empty({0}, x.options());  // LoRA needs no z in backward
  }
  return {y, xa, rnorm, z};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> nf4_linear_backward_cpu(
    const at::Tensor& dy_, const at::Tensor& x_, const at::Tensor& packed_, const at::Tensor& absmax_,
    int64_t blocksize, int64_t out_features, const std::optional<at::Tensor>& lora_a,
    const std::optional<at::Tensor>& lora_b, double scale, const std::optional<at::Tensor>& dora_m,
    const at::Tensor& xa, const at::Tensor& rnorm, const at::Tensor& z, std::array<bool, 4> mask) {
  constexpr const char* op = "fasttrain::nf4_linear_backward";
  FT_CHECK_DEVICE_TYPE(op, x_, at::kCPU);
  const NF4LinearArgs a = check_nf4_linear_args(op, kXMayBeFloat64, x_, packed_, absmax_, blocksize, out_features,
                                                lora_a, lora_b, dora_m, std::nullopt);
  check_nf4_linear_backward_args(op, a, dy_, xa, rnorm, z);
  const at::ScalarType ct = compute_dtype(x_);
  const at::Tensor dy = dy_.to(ct);
  at::Tensor dz = dy;
  at::Tensor dm = at::empty({0}, x_.options().dtype(a.dora ? dora_m->scalar_type() : at::kFloat));
  if (a.dora) {
    const at::Tensor g = (dora_m->to(rnorm.scalar_type()) * rnorm).to(ct);
    dz = dy * g;
    // dm = Σ_tokens dy ⊙ z / ‖W + sBA‖ (the norm is detached, as in the DoRA paper and PEFT)
    if (mask[3]) dm = ((dy * z.to(ct)).sum(0).to(rnorm.scalar_type()) * rnorm).to(dora_m->scalar_type());
  }
  at::Tensor dx = at::empty({0}, x_.options()), dA = at::empty({0}, x_.options()), dB = at::empty({0}, x_.options());
  if (lora_a.has_value() && !a.lora) {  // rank 0: gradients of the empty factors have their shapes
    if (mask[1]) dA = at::zeros(lora_a->sizes(), lora_a->options());
    if (mask[2]) dB = at::zeros(lora_b->sizes(), lora_b->options());
  }
  at::Tensor dzb;
  if (a.lora && (mask[0] || mask[1])) dzb = at::mm(dz, lora_b->to(ct));  // [M, r]
  if (mask[0]) {
    const at::Tensor w = dequant_weight(packed_.contiguous(), absmax_.contiguous(), blocksize, a.N, a.K, ct);
    at::Tensor g = at::mm(dz, w);  // [M, K]
    if (a.lora) g.addmm_(dzb, lora_a->to(ct), 1.0, scale);
    dx = g.to(x_.scalar_type());
  }
  if (a.lora && mask[1]) dA = at::mm(dzb.t(), x_.to(ct)).mul_(scale).to(lora_a->scalar_type());
  if (a.lora && mask[2]) dB = at::mm(dz.t(), xa.to(ct)).mul_(scale).to(lora_b->scalar_type());
  return {dx, dA, dB, dm};
}

at::Tensor nf4_dora_norm_cpu(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                             int64_t out_features, const at::Tensor& lora_a, const at::Tensor& lora_b,
                             double scale, const std::optional<at::Tensor>& weight_sq_norm) {
  constexpr const char* op = "fasttrain::nf4_dora_norm";
  FT_CHECK_DEVICE_TYPE(op, lora_a, at::kCPU);
  FT_CHECK_DIM(op, lora_a, 2);
  const at::Tensor probe = at::empty({0, lora_a.size(1)}, lora_a.options());
  check_nf4_linear_args(op, kXMayBeFloat64, probe, packed, absmax, blocksize, out_features, lora_a, lora_b,
                        std::nullopt, weight_sq_norm);
  const at::ScalarType ct = lora_a.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor w = dequant_weight(packed.contiguous(), absmax.contiguous(), blocksize, out_features,
                                      lora_a.size(1), ct);
  return dora_norm(w, lora_a, lora_b, scale, weight_sq_norm, ct);
}

at::Tensor nf4_weight_sq_norm_cpu(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                                  int64_t out_features, int64_t in_features) {
  constexpr const char* op = "fasttrain::nf4_weight_sq_norm";
  FT_CHECK_DEVICE_TYPE(op, packed, at::kCPU);
  const at::Tensor probe = at::empty({0, in_features}, absmax.options());
  check_nf4_linear_args(op, kXMayBeFloat64, probe, packed, absmax, blocksize, out_features, std::nullopt,
                        std::nullopt, std::nullopt, std::nullopt);
  const at::Tensor w = dequant_weight(packed.contiguous(), absmax.contiguous(), blocksize, out_features,
                                      in_features, at::kDouble);
  return w.square().sum(1).to(at::kFloat);
}

void register_nf4_linear(torch::Library& m) {
  m.impl("nf4_linear", &nf4_linear_cpu);
  m.impl("nf4_linear_backward", &nf4_linear_backward_cpu);
  m.impl("nf4_dora_norm", &nf4_dora_norm_cpu);
  m.impl("nf4_weight_sq_norm", &nf4_weight_sq_norm_cpu);
}

FT_VARIANT_END
}  // namespace fasttrain
