// fused_logprob, CPU: per-token log p(target) and entropy of softmax(hidden . weight^T / T), and the
// per-token gradient vector (W[t] - p.W) / T, without ever holding the [N, V] logits.
//
// What it is: threads take groups of token blocks (B rows each) from a shared counter and walk the
// vocabulary in chunks of C rows of W for them; per (block, chunk) a thread does
//   1. one GEMM  Z = h_blk . W_c^T           into a thread-local [B, C] scratch (fits L2),
//   2. one fused pass over Z: z = (Z + b) / T, chunk max, lazy rebase of the running
//      (ref, s, u) state (core/math.h), p~ = exp(z - ref) written back over Z, target logit,
//   3. one GEMM  acc_blk += p~ . W_c         (only when the hidden gradient is wanted),
// so each chunk's logits are produced, consumed and forgotten while still in cache: forward +
// hidden gradient = two matrix products. Extra memory: nthreads * B * C floats + (for bf16/fp16
// inputs) an fp32 copy of hidden [N, H] and of one W chunk [C, H]; never N * V.
// What it is not: a hand-written GEMM. The products are at::mm on fp32 (fp64 for fp64 inputs);
// at::mm called inside at::parallel_for runs single-threaded, which is what we want here.
// bf16/fp16 inputs are widened to fp32 per chunk: this CPU (AMD EPYC, AVX2, no avx512_bf16) runs a
// bf16 at::mm several times slower than fp32, and fp32 logits are also more exact. Except step 1 for
// bf16 h and W where oneDNN's brgemm ukernel packs bf16 (AMX, AVX-512 bf16; at::native::cpublas):
// there Z is the bf16 x bf16 -> fp32 product of W packed once per call, the same exact products
// and fp32 sums as the widened GEMM in another order (FASTTRAIN_LOGPROB_BRGEMM=0 turns it off).
// Where the CPU has avx512_bf16 but the ukernel does not pack bf16 (no AMX), steps 1 and 3 run on
// the vdpbf16ps instruction instead, on W packed into tiles (cpu/bf16_dot.h says why by hand).
// The accumulator rows (the grad_vec output itself) are revisited once per chunk: B*H floats
// against B*C*H FMAs. A widened W chunk (bf16/fp16 inputs) is made per group of token blocks per
// chunk, into a buffer each thread holds for the whole call.
//
// Backward for W (only when W requires grad): chunks of the vocabulary in parallel (disjoint rows of
// dW, no reduction), token blocks inside: Z recomputed, D = g (onehot - exp(z - lse)) / T,
// dW_c += D^T . h_blk, dbias_c += colsum(D).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#if !defined(CPU_CAPABILITY)
#if defined(__AVX512F__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif
#endif
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
#include <ATen/cpu/vec/vec.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/variant.h"
#include "core/cpu_features.h"
#include "core/checks.h"
#include "core/fused_logprob_checks.h"
#include "core/math.h"
#include "cpu/bf16_dot.h"
#include "cpu/pack_cache.h"
#include "cpu/parallel.h"
#include "cpu/register.h"
#include "ops.h"

namespace fasttrain {
FT_VARIANT_BEGIN
namespace fm = fasttrain::math;

namespace {

constexpr int64_t kDefaultChunkBytes = 8 << 20;  // 8 MiB of scratch across all threads
constexpr int64_t kTokenBlock = 128;             // tokens per task: B*C fp32 scratch stays in L2

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::atoll(v) : fallback;
}

// Vocabulary rows per chunk so that the per-thread logits scratch (B x C) plus one widened W chunk
// (C x H) fit the budget. Multiple of 16, at least 16, at most 8192.
int64_t vocab_chunk(int64_t chunk_bytes, int64_t block, int64_t H, int64_t V, int64_t elem, int64_t nthreads) {
  const int64_t budget = chunk_bytes > 0 ? chunk_bytes : kDefaultChunkBytes;
  int64_t c = budget / (elem * (nthreads * block + H));
  c = std::max<int64_t>(16, std::min<int64_t>(8192, c / 16 * 16));
  return std::min(c, std::max<int64_t>(V, 1));
}

// ---- bf16 logits through ATen's brgemm (oneDNN's ukernel: AMX or AVX-512 bf16 where the CPU has them)
// z = h·Wᵀ of bf16 h and W: every product of two bf16 values is exact in float32 and the sums are
// float32, as in the widened float32 GEMM (only their order differs). W is packed once per call into
// oneDNN's VNNI layout in blocks of kPackCols vocabulary rows (the widest block the ukernel packs
// here), the last block zero-padded. Measured on the 2-core AMX Xeon, one thread, [128, 576] x
// [576, 2048]: 1254 GFLOP/s against 162 for the float32 at::mm of the widened values.
constexpr int64_t kPackCols = 64;
// Packing W costs about as much as the brgemm saves on 140 tokens (2-core AMX Xeon, SmolLM2's head:
// 26 against 7 ms a call at 1 token, 212 against 361 ms at 1024; both scale with V·H), so a call of
// fewer tokens keeps the widened GEMM. FASTTRAIN_LOGPROB_BRGEMM_MIN_TOKENS overrides it (tests).
constexpr int64_t kBrgemmMinTokens = 256;

bool brgemm_logits_usable(const at::Tensor& hidden, const at::Tensor& weight) {
  if (hidden.scalar_type() != at::kBFloat16 || weight.scalar_type() != at::kBFloat16 || hidden.size(1) % 2 != 0)
    return false;
  if (hidden.size(0) < env_int("FASTTRAIN_LOGPROB_BRGEMM_MIN_TOKENS", kBrgemmMinTokens)) return false;
  const char* v = std::getenv("FASTTRAIN_LOGPROB_BRGEMM");
  if (v && std::string(v) == "0") return false;
  return at::native::cpublas::could_pack(at::kBFloat16);
}

// W [V, H] bf16 -> [ceil(V / kPackCols), H, kPackCols] VNNI blocks of Wᵀ (undefined if packing fails).
at::Tensor pack_weight_blocks(const at::Tensor& w) {
  const int64_t V = w.size(0), H = w.size(1), nblk = (V + kPackCols - 1) / kPackCols;
  at::Tensor out = at::empty({nblk * H * kPackCols}, w.options());
  const at::BFloat16* src = w.const_data_ptr<at::BFloat16>();
  at::BFloat16* dst = out.data_ptr<at::BFloat16>();
  std::atomic<bool> ok{true};
  fasttrain::parallel_for(0, nblk, 8, [&](int64_t j0, int64_t j1) {
    std::vector<at::BFloat16> t(H * kPackCols);
    for (int64_t j = j0; j < j1 && ok; ++j) {
      const int64_t r0 = j * kPackCols, nr = std::min(kPackCols, V - r0);
      for (int64_t h = 0; h < H; ++h)            // Wᵀ block [H, kPackCols], rows past V zero
        for (int64_t c = 0; c < kPackCols; ++c) t[h * kPackCols + c] = c < nr ? src[(r0 + c) * H + h] : at::BFloat16(0.0f);
      try {
        at::native::cpublas::pack(H, kPackCols, kPackCols, kPackCols, at::kBFloat16, at::kBFloat16, t.data(),
                                  dst + j * H * kPackCols);
      } catch (const std::exception&) {
        ok = false;
      }
    }
  });
  return ok ? out : at::Tensor();
}

// ---- the hidden gradient's p·W accumulator through the same brgemm, p split into two bf16 terms
// acc += p~·W_c has fp32 p~ and bf16 W. p~ = p_hi + p_lo + e with p_hi = bf16(p~) and p_lo =
// bf16(p~ - p_hi) (the difference is exact in fp32): |e| <= 2^-18 |p~| (two bf16 roundings, unit
// roundoff 2^-9 each), so the two bf16 x bf16 -> fp32 products add at most 2^-18 Σ p~|W| to the
// fp32 sum's own rounding (at least V·2^-24 Σ p~|W| in the worst case). Where it runs (W bf16,
// H a multiple of kPackCols, brgemm packs bf16) W is packed a second time, K-major: blocks of
// kPackK vocabulary rows by kPackCols hidden columns, the last vocabulary block zero-padded.
// Measured on the 2-core AMX Xeon, SmolLM2's head: the fp32 addmm of widened W chunks ran at about
// 100 GFLOP/s a thread.
constexpr int64_t kPackK = 512;

bool brgemm_accumulator_usable(const at::Tensor& hidden, const at::Tensor& weight) {
  if (hidden.size(1) % kPackCols != 0) return false;
  const char* v = std::getenv("FASTTRAIN_LOGPROB_BRGEMM_PW");
  if (v && std::string(v) == "0") return false;
  return brgemm_logits_usable(hidden, weight);
}

// W [V, H] bf16 -> [ceil(V / kPackK), H / kPackCols, kPackK, kPackCols] VNNI blocks of W itself
// (K = vocabulary rows), rows past V zero; undefined if packing fails.
at::Tensor pack_weight_kblocks(const at::Tensor& w) {
  const int64_t V = w.size(0), H = w.size(1), nkb = (V + kPackK - 1) / kPackK, ncb = H / kPackCols;
  at::Tensor out = at::empty({nkb * ncb * kPackK * kPackCols}, w.options());
  const at::BFloat16* src = w.const_data_ptr<at::BFloat16>();
  at::BFloat16* dst = out.data_ptr<at::BFloat16>();
  std::atomic<bool> ok{true};
  fasttrain::parallel_for(0, nkb * ncb, 4, [&](int64_t i0, int64_t i1) {
    std::vector<at::BFloat16> t(kPackK * kPackCols);
    for (int64_t i = i0; i < i1 && ok; ++i) {
      const int64_t kb = i / ncb, cb = i % ncb, r0 = kb * kPackK, nr = std::min(kPackK, V - r0);
      for (int64_t r = 0; r < kPackK; ++r)
        for (int64_t c = 0; c < kPackCols; ++c)
          t[r * kPackCols + c] = r < nr ? src[(r0 + r) * H + cb * kPackCols + c] : at::BFloat16(0.0f);
      try {
        at::native::cpublas::pack(kPackK, kPackCols, kPackCols, kPackCols, at::kBFloat16, at::kBFloat16, t.data(),
                                  dst + i * kPackK * kPackCols);
      } catch (const std::exception&) {
        ok = false;
      }
    }
  });
  return ok ? out : at::Tensor();
}

// The packed copies of W for this call: from the open pack scope's cache (cpu/pack_cache.h) where
// one is open, else packed now (each undefined where unusable or not wanted).
std::pair<at::Tensor, at::Tensor> packed_weight(const at::Tensor& w, bool want, bool want_k) {
  if (!want) return {at::Tensor(), at::Tensor()};
  auto [packed, packed_k] = logprob_pack_lookup(w);
  const bool hit = packed.defined();
  if (!hit) packed = pack_weight_blocks(w);
  const bool pack_k = want_k && packed.defined() && !packed_k.defined();
  if (pack_k) packed_k = pack_weight_kblocks(w);
  if (!want_k) packed_k = at::Tensor();
  if (!hit || pack_k) logprob_pack_store(w, packed, packed_k);
  return {packed, packed_k};
}

// ---- both products by the bf16 dot-product instruction (cpu/bf16_dot.h) where the CPU has
// avx512_bf16 but oneDNN's ukernel does not pack bf16 (no AMX). Packing W costs about one pass over
// it (a copy in the tile layout); the trainer's pack scope keeps the copies across a phase's calls,
// so a call of any size uses it (FASTTRAIN_LOGPROB_BF16DOT=0 turns it off;
// FASTTRAIN_LOGPROB_BF16DOT_MIN_TOKENS sets the fewest tokens a call needs, default 1).
bool bf16_dot_usable(const at::Tensor& hidden, const at::Tensor& weight) {
  if (!bf16_dot::compiled()) return false;
  if (hidden.scalar_type() != at::kBFloat16 || weight.scalar_type() != at::kBFloat16 || hidden.size(1) % 2 != 0)
    return false;
  if (hidden.size(0) < env_int("FASTTRAIN_LOGPROB_BF16DOT_MIN_TOKENS", 1)) return false;
  const char* v = std::getenv("FASTTRAIN_LOGPROB_BF16DOT");
  if (v && std::string(v) == "0") return false;
  return cpu_has_bf16() && !at::native::cpublas::could_pack(at::kBFloat16);
}

// (logits layout, p·W layout) of W for this call, from the pack scope's cache where one is open;
// the p·W layout only where wanted and H is a multiple of its tile (else undefined).
std::pair<at::Tensor, at::Tensor> bf16_dot_weight(const at::Tensor& w, bool want_k) {
  want_k = want_k && w.size(1) % bf16_dot::kCols == 0;
  auto [pn, pk] = logprob_pack_lookup(w);
  const bool hit = pn.defined();
  if (!hit) pn = bf16_dot::pack_logits(w);
  const bool pack_k = want_k && !pk.defined();
  if (pack_k) pk = bf16_dot::pack_accumulator(w);
  if (!hit || pack_k) logprob_pack_store(w, pn, pk);
  return {pn, want_k ? pk : at::Tensor()};
}

// Rows of p~ (fp32, row stride ldz, cs columns) as p_hi and p_lo (bf16, row stride ldp), columns
// cs..ldp zero; a row whose target is ignored is all zeros.
// bf16 of a finite float, rounded to nearest even (c10::BFloat16's rounding without its NaN branch,
// written on the bits so that the loop below vectorizes); p~ is finite and >= 0 here
inline uint16_t bf16_bits_rne(uint32_t u) { return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16); }

void split_bf16_rows(const float* z, int64_t ldz, int64_t nb, int64_t cs, int64_t ldp, const int64_t* tg,
                     int64_t ignore_index, at::BFloat16* hi, at::BFloat16* lo) {
  for (int64_t i = 0; i < nb; ++i) {
    uint16_t* h = reinterpret_cast<uint16_t*>(hi + i * ldp);
    uint16_t* l = reinterpret_cast<uint16_t*>(lo + i * ldp);
    if (tg[i] == ignore_index) {
      std::fill(h, h + ldp, uint16_t(0));
      std::fill(l, l + ldp, uint16_t(0));
      continue;
    }
    const float* zr = z + i * ldz;
    for (int64_t j = 0; j < cs; ++j) {
      uint32_t u;
      std::memcpy(&u, zr + j, 4);
      const uint16_t hb = bf16_bits_rne(u);
      const uint32_t hu = uint32_t(hb) << 16;
      float hf;
      std::memcpy(&hf, &hu, 4);
      const float r = zr[j] - hf;                    // exact: hf is within a factor 2 of zr[j]
      uint32_t ru;
      std::memcpy(&ru, &r, 4);
      h[j] = hb;
      l[j] = bf16_bits_rne(ru);
    }
    std::fill(h + cs, h + ldp, uint16_t(0));
    std::fill(l + cs, l + ldp, uint16_t(0));
  }
}

// Fused statistics pass over one row of chunk logits (in place): z = (zr + b) * inv_temp, chunk
// max, rebase, p~ = exp(z - ref) written back, sums s and u added. Returns alpha (the factor for
// the p.W accumulator of this row) and sets z_target when the target falls in this chunk.
// cut: the kept set's absolute cut (fm::kept_cut; -inf keeps all): an entry below it weighs 0 and
// adds nothing to s and u, except the target (fm::kept). The chunk max and so the reference still
// see every entry; the kept set holds the row's maximum (z_max >= z_target >= cut), so r is its max.
template <typename acc_t>
acc_t fused_row_pass(acc_t* z, int64_t C, const acc_t* bias, acc_t inv_temp, int64_t t_local,
                     fm::LseState<acc_t>& st, acc_t& z_target, acc_t cut) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  const Vec vscale(inv_temp);
  // 1. scale (+ bias) and chunk max
  Vec vmax(-INFINITY);
  int64_t j = 0;
  for (; j + W <= C; j += W) {
    Vec v = Vec::loadu(z + j);
    if (bias) v = v + Vec::loadu(bias + j);
    v = v * vscale;
    v.store(z + j);
    vmax = at::vec::maximum(vmax, v);
  }
  acc_t cmax = -INFINITY;
  {
    alignas(64) acc_t buf[W];
    vmax.store(buf);
    for (int64_t k = 0; k < W; ++k) cmax = std::max(cmax, buf[k]);
  }
  for (; j < C; ++j) {
    acc_t v = z[j];
    if (bias) v += bias[j];
    v *= inv_temp;
    z[j] = v;
    cmax = std::max(cmax, v);
  }
  if (t_local >= 0) z_target = z[t_local];
  // 2. lazy rebase of the running state
  const acc_t alpha = fm::lse_rebase(st, fm::lse_next_ref(st.ref, cmax));
  const acc_t ref = st.ref;
  // 3. p~ = exp(z - ref), s += sum p~, u += sum p~ (z - ref)
  // (z - ref floored as fm::lse_delta does: a -inf logit adds 0 to s and u, never NaN)
  const Vec vref(ref), vfloor(acc_t(fm::kLseDeltaFloor)), vneginf(acc_t(-INFINITY)), vcut(cut);
  Vec vs(0), vu(0);
  j = 0;
  for (; j + W <= C; j += W) {
    const Vec zj = Vec::loadu(z + j);
    const Vec d0 = zj - vref;
    const Vec d = Vec::blendv(d0, vfloor, (d0 < vfloor) | (zj == vneginf) | (zj < vcut));
    const Vec p = d.exp();
    p.store(z + j);
    vs = vs + p;
    vu = at::vec::fmadd(p, d, vu);
  }
  acc_t s_c = 0, u_c = 0;
  {
    alignas(64) acc_t bs[W], bu[W];
    vs.store(bs);
    vu.store(bu);
    for (int64_t k = 0; k < W; ++k) { s_c += bs[k]; u_c += bu[k]; }
  }
  for (; j < C; ++j) {
    const acc_t d = z[j] < cut ? acc_t(fm::kLseDeltaFloor) : fm::lse_delta(z[j], ref);
    const acc_t p = fm::ft_exp(d);
    z[j] = p;
    s_c += p;
    u_c += p * d;
  }
  if (t_local >= 0 && !(z_target >= cut)) {  // the target below its own cut (rounding): kept anyway
    const acc_t d = fm::lse_delta(z_target, ref);
    const acc_t p = fm::ft_exp(d);
    z[t_local] = p;
    s_c += p;
    u_c += p * d;
  }
  fm::lse_add(st, s_c, u_c);
  return alpha;
}

at::ScalarType acc_type_of(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

}  // namespace

static void check_targets_cpu(const char* op, const at::Tensor& targets, int64_t V, int64_t ignore_index) {
  const int64_t* t = targets.const_data_ptr<int64_t>();
  for (int64_t n = 0; n < targets.numel(); ++n) {
    if (t[n] != ignore_index && (t[n] < 0 || t[n] >= V)) fused_logprob_bad_target(op, t[n], n, V, ignore_index);
  }
}

template <typename acc_t>
static void forward_impl(const at::Tensor& hid, const at::Tensor& weight, const int64_t* tg, const acc_t* bias,
                         acc_t inv_temp, int64_t ignore_index, bool compute_grad, int64_t chunk_bytes,
                         acc_t* logp, acc_t* ent, acc_t* stats, at::Tensor& grad_vec, const acc_t* delta,
                         const at::Tensor& hid16 = at::Tensor(), const at::Tensor& wpacked = at::Tensor(),
                         const at::Tensor& wpacked_k = at::Tensor(), const at::Tensor& wdot = at::Tensor(),
                         const at::Tensor& wdot_k = at::Tensor()) {
  const int64_t N = hid.size(0), H = hid.size(1), V = weight.size(0);
  // The kept sets' absolute cuts (fm::kept_cut) from each token's own target logit, one dot product
  // a token before the chunk loop: what makes the replay one pass over the vocabulary.
  std::vector<acc_t> cut(N, acc_t(-INFINITY));
  if (delta != nullptr) {
    fasttrain::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "fused_logprob_cut", [&] {
        for (int64_t n = n0; n < n1; ++n) {
          const int64_t t = tg[n];
          if (t == ignore_index) continue;
          const acc_t* hr = hid.const_data_ptr<acc_t>() + n * H;
          const scalar_t* wr = weight.const_data_ptr<scalar_t>() + t * H;
          acc_t zt_dot = 0;
          for (int64_t h = 0; h < H; ++h) zt_dot += hr[h] * static_cast<acc_t>(wr[h]);
          if (bias) zt_dot += bias[t];
          cut[n] = fm::kept_cut(zt_dot * inv_temp, delta[n]);
        }
      });
    });
  }
  const at::ScalarType acc_dt = hid.scalar_type();
  const int64_t nthreads = at::get_num_threads();
  // Tokens per block: at most kTokenBlock, and few enough that each thread gets a block of a small
  // call (160 tokens on 2 threads: 2 blocks of 80, not 128 + 32, one thread idle for most of it).
  const int64_t B = std::max<int64_t>(
      1, env_int("FASTTRAIN_LOGPROB_BLOCK", std::min(kTokenBlock, ((N + nthreads - 1) / nthreads + 3) / 4 * 4)));
  // with packed W (bf16 logits by brgemm) a chunk is whole packed blocks
  const bool packed = wpacked.defined() && std::is_same_v<acc_t, float>;
  int64_t C = vocab_chunk(chunk_bytes, B, H, V, sizeof(acc_t), nthreads);
  // with W also packed K-major (the p·W accumulator by brgemm) a chunk is whole kPackK blocks
  const bool packed_k = packed && compute_grad && wpacked_k.defined();
  if (packed) C = std::max<int64_t>(kPackCols, C / kPackCols * kPackCols);
  if (packed_k) C = std::max<int64_t>(kPackK, C / kPackK * kPackK);
  // by the bf16 dot-product instruction (cpu/bf16_dot.h): a chunk is whole tiles
  const bool dot = !packed && wdot.defined() && std::is_same_v<acc_t, float>;
  const bool dot_k = dot && compute_grad && wdot_k.defined();
  if (dot) C = std::max<int64_t>(bf16_dot::kCols, C / bf16_dot::kCols * bf16_dot::kCols);
  const int64_t nblocks = (N + B - 1) / B;

  std::vector<fm::LseState<acc_t>> st(N, fm::lse_init<acc_t>());
  std::vector<acc_t> zt(N, acc_t(0));
  std::vector<at::Tensor> scratch(nthreads);
  for (auto& s : scratch) s = at::empty({B * C}, hid.options());
  std::vector<acc_t> alpha_all(N, acc_t(1));
  // the W chunk in the GEMM dtype: for both GEMMs, or (packed W) only for the p·W accumulator
  const bool widen = weight.scalar_type() != acc_dt && (!(packed || dot) || (compute_grad && !(packed_k || dot_k)));
  // Widened W chunks go into one buffer per thread, allocated here once: a fresh [C, H] tensor per
  // (group, chunk) is a large allocation that the allocator maps and unmaps each time, and its
  // page faults cost more than the widening itself (measured on a 2-core Xeon: 2.7-5.4 ms per
  // 2512 x 576 chunk, varying run to run).
  std::vector<at::Tensor> wbuf(widen ? nthreads : 0);
  for (auto& w : wbuf) w = at::empty({C, H}, hid.options());

  // One parallel region: each thread owns a contiguous range of token blocks and walks the whole
  // vocabulary for it (one barrier in all; a barrier per chunk costs seconds on an oversubscribed
  // machine). A widened W chunk is made once per thread per chunk and reused by all its blocks.
  // Groups of blocks are handed out dynamically (an atomic counter), not statically: on a shared,
  // oversubscribed machine a static split waits for the most-descheduled thread.
  const int64_t group = std::max<int64_t>(1, nblocks / (4 * nthreads));
  const int64_t ngroups = (nblocks + group - 1) / group;
  std::atomic<int64_t> next_group{0};
  fasttrain::parallel_for(0, std::min(nthreads, ngroups), 1, [&](int64_t, int64_t) {
   at::Tensor& zbuf = scratch[at::get_thread_num()];
   at::Tensor* wb = widen ? &wbuf[at::get_thread_num()] : nullptr;
   std::vector<float> ztail(packed ? B * kPackCols : 0);      // the last, partial packed block's logits
   std::vector<at::BFloat16> phi(packed_k || dot_k ? B * C : 0), plo(packed_k || dot_k ? B * C : 0);   // p~ = p_hi + p_lo
   for (int64_t gi = next_group.fetch_add(1); gi < ngroups; gi = next_group.fetch_add(1)) {
    const int64_t b0 = gi * group, b1 = std::min(nblocks, b0 + group);
    for (int64_t v0 = 0; v0 < V; v0 += C) {
      const int64_t cs = std::min(C, V - v0);
      // the W chunk as the GEMM dtype (a view when no widening is needed)
      const at::Tensor wc = widen ? wb->narrow(0, 0, cs).copy_(weight.narrow(0, v0, cs))
                                  : (packed || dot ? at::Tensor() : weight.narrow(0, v0, cs));
      const acc_t* bc = bias ? bias + v0 : nullptr;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * B, nb = std::min(B, N - n0);
        // [nb, cs] with contiguous rows (leading dimension cs) inside the thread's scratch
        at::Tensor z = zbuf.narrow(0, 0, nb * cs).view({nb, cs});
        acc_t* zp = z.data_ptr<acc_t>();
        if constexpr (std::is_same_v<acc_t, float>) {
          if (packed) {
            const at::BFloat16* a = hid16.const_data_ptr<at::BFloat16>() + n0 * H;
            const at::BFloat16* wp = wpacked.const_data_ptr<at::BFloat16>();
            for (int64_t c0 = 0; c0 < cs; c0 += kPackCols) {
              const at::BFloat16* blk = wp + ((v0 + c0) / kPackCols) * H * kPackCols;
              const int64_t nc = std::min(kPackCols, cs - c0);
              if (nc == kPackCols) {
                at::native::cpublas::brgemm(nb, kPackCols, H, H, kPackCols, cs, false, a, blk, zp + c0, true);
              } else {                               // zero-padded block: its first nc columns
                at::native::cpublas::brgemm(nb, kPackCols, H, H, kPackCols, kPackCols, false, a, blk, ztail.data(), true);
                for (int64_t i = 0; i < nb; ++i)
                  std::copy(ztail.data() + i * kPackCols, ztail.data() + i * kPackCols + nc, zp + i * cs + c0);
              }
            }
          }
        }
        if constexpr (std::is_same_v<acc_t, float>) {
          if (dot) bf16_dot::logits(hid16.const_data_ptr<at::BFloat16>() + n0 * H, nb, H, wdot, v0, cs, zp, cs);
        }
        if (!packed && !dot) at::mm_out(z, hid.narrow(0, n0, nb), wc.t());
        bool any_rescale = false;
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t n = n0 + i, t = tg[n];
          if (t == ignore_index) continue;
          const int64_t t_local = (t >= v0 && t < v0 + cs) ? t - v0 : -1;
          const acc_t a = fused_row_pass<acc_t>(zp + i * cs, cs, bc, inv_temp, t_local, st[n], zt[n], cut[n]);
          alpha_all[n] = a;
          any_rescale |= (a != acc_t(1));
        }
        if (compute_grad) {
          at::Tensor acc = grad_vec.narrow(0, n0, nb);
          if (any_rescale) {
            acc_t* ap = acc.data_ptr<acc_t>();
            for (int64_t i = 0; i < nb; ++i) {
              const acc_t a = alpha_all[n0 + i];
              if (a == acc_t(1) || tg[n0 + i] == ignore_index) continue;
              for (int64_t h = 0; h < H; ++h) ap[i * H + h] *= a;
            }
          }
          // ignored rows of z still hold raw logits: their accumulator rows are zeroed at the end
          if constexpr (std::is_same_v<acc_t, float>) {
            if (packed_k) {
              const int64_t ck = (cs + kPackK - 1) / kPackK * kPackK, ncb = H / kPackCols;
              split_bf16_rows(zp, cs, nb, cs, ck, tg + n0, ignore_index, phi.data(), plo.data());
              const at::BFloat16* wk = wpacked_k.const_data_ptr<at::BFloat16>();
              float* ap = acc.data_ptr<float>();
              for (int64_t k0 = 0; k0 < ck; k0 += kPackK) {
                const at::BFloat16* kblk = wk + ((v0 + k0) / kPackK) * ncb * kPackK * kPackCols;
                for (int64_t cb = 0; cb < ncb; ++cb) {
                  const at::BFloat16* blk = kblk + cb * kPackK * kPackCols;
                  at::native::cpublas::brgemm(nb, kPackCols, kPackK, ck, kPackCols, H, true, phi.data() + k0, blk,
                                              ap + cb * kPackCols, true);
                  at::native::cpublas::brgemm(nb, kPackCols, kPackK, ck, kPackCols, H, true, plo.data() + k0, blk,
                                              ap + cb * kPackCols, true);
                }
              }
            }
          }
          if constexpr (std::is_same_v<acc_t, float>) {
            if (dot_k) {
              const int64_t cp = (cs + 1) / 2 * 2;
              split_bf16_rows(zp, cs, nb, cs, cp, tg + n0, ignore_index, phi.data(), plo.data());
              bf16_dot::accumulate(phi.data(), plo.data(), nb, cp, wdot_k, V, v0, H, acc.data_ptr<float>());
            }
          }
          if (!packed_k && !dot_k) at::addmm_out(acc, acc, z, wc);
        }
      }
    }
   }
   if (packed) at::native::cpublas::brgemm_release(true);
  });

  // finalize: stats (ref, log s), log p, entropy; grad_vec = (W[t] - acc / s) / T
  fasttrain::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t t = tg[n];
      acc_t* g = compute_grad ? grad_vec.data_ptr<acc_t>() + n * H : nullptr;
      if (t == ignore_index) {
        logp[n] = ent[n] = stats[n] = stats[N + n] = acc_t(0);
        if (delta) stats[2 * N + n] = acc_t(0);
        if (g) std::fill(g, g + H, acc_t(0));
        continue;
      }
      const acc_t log_s = std::log(st[n].s);
      stats[n] = st[n].ref;
      stats[N + n] = log_s;
      if (delta) stats[2 * N + n] = cut[n];
      logp[n] = fm::lse_logprob(zt[n], st[n].ref, log_s);
      ent[n] = fm::lse_entropy(st[n]);
      if (g) {
        const acc_t inv_s = acc_t(1) / st[n].s;
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "fused_logprob_wt", [&] {
          const scalar_t* wt = weight.const_data_ptr<scalar_t>() + t * H;
          for (int64_t h = 0; h < H; ++h) g[h] = (static_cast<acc_t>(wt[h]) - g[h] * inv_s) * inv_temp;
        });
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_logprob_forward_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
    const std::optional<at::Tensor>& bias, double temperature, int64_t ignore_index, bool compute_grad,
    int64_t chunk_bytes, const std::optional<at::Tensor>& keep_delta) {
  constexpr const char* op = "fasttrain::fused_logprob_forward";
  FT_CHECK_DEVICE_TYPE(op, hidden, at::kCPU);
  fused_logprob_check_args(op, hidden, weight, targets, bias, temperature);
  fused_logprob_check_keep_delta(op, hidden, keep_delta);
  const at::Tensor w = weight.contiguous();
  const at::Tensor tg = targets.contiguous();
  const int64_t N = hidden.size(0), H = hidden.size(1), V = w.size(0);
  check_targets_cpu(op, tg, V, ignore_index);
  const at::ScalarType acc_dt = acc_type_of(hidden.scalar_type());
  const at::TensorOptions ao = hidden.options().dtype(acc_dt);
  at::Tensor logp = at::empty({N}, ao), ent = at::empty({N}, ao);
  at::Tensor stats = at::empty({keep_delta.has_value() ? 3 : 2, N}, ao);
  at::Tensor grad_vec = compute_grad ? at::zeros({N, H}, ao) : at::empty({0, H}, ao);
  if (N == 0) return {logp, ent, stats, grad_vec};
  const at::Tensor hid = hidden.to(acc_dt).contiguous();  // a no-op for fp32 / fp64 contiguous input
  const at::Tensor b = bias.has_value() ? bias->to(acc_dt).contiguous() : at::Tensor();
  const at::Tensor kd = keep_delta.has_value() ? keep_delta->to(acc_dt).contiguous() : at::Tensor();
  if (acc_dt == at::kDouble) {
    forward_impl<double>(hid, w, tg.const_data_ptr<int64_t>(), b.defined() ? b.const_data_ptr<double>() : nullptr,
                         1.0 / temperature, ignore_index, compute_grad, chunk_bytes, logp.data_ptr<double>(),
                         ent.data_ptr<double>(), stats.data_ptr<double>(), grad_vec,
                         kd.defined() ? kd.const_data_ptr<double>() : nullptr);
  } else {
    // bf16 logits by brgemm where the CPU's oneDNN ukernel packs bf16 (W packed once per call)
    // (from the open pack scope's cache: w is the caller's W where it is contiguous, else a copy
    // of it made here, which no later call matches)
    const bool want = brgemm_logits_usable(hidden, w);
    const bool want_k = want && compute_grad && brgemm_accumulator_usable(hidden, w);
    const auto [wpacked, wpacked_k] = packed_weight(w, want, want_k);
    const bool want_dot = !wpacked.defined() && bf16_dot_usable(hidden, w);
    const auto [wdot, wdot_k] = want_dot ? bf16_dot_weight(w, compute_grad) : std::pair<at::Tensor, at::Tensor>();
    forward_impl<float>(hid, w, tg.const_data_ptr<int64_t>(), b.defined() ? b.const_data_ptr<float>() : nullptr,
                        static_cast<float>(1.0 / temperature), ignore_index, compute_grad, chunk_bytes,
                        logp.data_ptr<float>(), ent.data_ptr<float>(), stats.data_ptr<float>(), grad_vec,
                        kd.defined() ? kd.const_data_ptr<float>() : nullptr,
                        wpacked.defined() || wdot.defined() ? hidden.contiguous() : at::Tensor(), wpacked, wpacked_k,
                        wdot, wdot_k);
  }
  return {logp, ent, stats, grad_vec};
}

template <typename acc_t>
static void backward_weight_impl(const acc_t* g, const at::Tensor& hid, const at::Tensor& weight,
                                 const int64_t* tg, const acc_t* bias, const acc_t* stats, acc_t inv_temp,
                                 int64_t ignore_index, int64_t chunk_bytes, at::Tensor& grad_weight,
                                 acc_t* grad_bias, bool kept_rows) {
  const int64_t N = hid.size(0), H = hid.size(1), V = weight.size(0);
  const at::ScalarType acc_dt = hid.scalar_type();
  const int64_t nthreads = at::get_num_threads();
  const int64_t B = 256;  // tokens per inner step
  // per thread: Z [B, C], a widened W chunk [C, H] and its fp32 gradient [C, H]
  const int64_t budget = chunk_bytes > 0 ? chunk_bytes : kDefaultChunkBytes;
  int64_t C = budget / (int64_t(sizeof(acc_t)) * nthreads * (B + 2 * H));
  C = std::max<int64_t>(16, std::min<int64_t>(1024, C / 16 * 16));
  // enough chunks to keep every thread busy
  C = std::min(C, std::max<int64_t>(16, (V + 4 * nthreads - 1) / (4 * nthreads)));
  const int64_t nchunks = (V + C - 1) / C;
  const bool widen = weight.scalar_type() != acc_dt;

  fasttrain::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t v0 = c * C, cs = std::min(C, V - v0);
      const at::Tensor wc = widen ? weight.narrow(0, v0, cs).to(acc_dt) : weight.narrow(0, v0, cs);
      at::Tensor dw = widen ? at::zeros({cs, H}, hid.options()) : grad_weight.narrow(0, v0, cs);
      if (!widen) dw.zero_();
      at::Tensor z = at::empty({B, cs}, hid.options());
      acc_t* db = grad_bias + v0;
      std::fill(db, db + cs, acc_t(0));
      for (int64_t n0 = 0; n0 < N; n0 += B) {
        const int64_t nb = std::min(B, N - n0);
        at::Tensor zb = z.narrow(0, 0, nb);
        at::mm_out(zb, hid.narrow(0, n0, nb), wc.t());
        acc_t* zp = zb.data_ptr<acc_t>();
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t n = n0 + i, t = tg[n];
          acc_t* zr = zp + i * cs;
          if (t == ignore_index || g[n] == acc_t(0)) {
            std::fill(zr, zr + cs, acc_t(0));
            continue;
          }
          const acc_t gn = g[n], ref = stats[n], log_s = stats[N + n];
          const acc_t cut = kept_rows ? stats[2 * N + n] : acc_t(-INFINITY);
          for (int64_t j = 0; j < cs; ++j) {
            const acc_t zz = (zr[j] + (bias ? bias[v0 + j] : acc_t(0))) * inv_temp;
            const acc_t d = fm::logprob_dlogit(gn, v0 + j == t, fm::kept_prob(zz, ref, log_s, cut, v0 + j == t),
                                               inv_temp);
            zr[j] = d;
            if (bias) db[j] += d;
          }
        }
        at::addmm_out(dw, dw, zb.t(), hid.narrow(0, n0, nb));
      }
      if (widen) grad_weight.narrow(0, v0, cs).copy_(dw);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> fused_logprob_backward_weight_cpu(
    const at::Tensor& grad_logp, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
    const std::optional<at::Tensor>& bias, const at::Tensor& stats, double temperature, int64_t ignore_index,
    int64_t chunk_bytes) {
  constexpr const char* op = "fasttrain::fused_logprob_backward_weight";
  FT_CHECK_DEVICE_TYPE(op, hidden, at::kCPU);
  fused_logprob_check_args(op, hidden, weight, targets, bias, temperature);
  const at::ScalarType acc_dt = acc_type_of(hidden.scalar_type());
  const int64_t V = weight.size(0);
  fused_logprob_check_backward_weight_args(op, hidden, grad_logp, stats, acc_dt);
  const at::Tensor w = weight.contiguous(), tg = targets.contiguous();
  check_targets_cpu(op, tg, V, ignore_index);
  at::Tensor grad_weight = at::empty_like(w, at::MemoryFormat::Contiguous);
  at::Tensor grad_bias = at::empty({V}, hidden.options().dtype(acc_dt));
  const at::Tensor hid = hidden.to(acc_dt).contiguous();
  const at::Tensor g = grad_logp.to(acc_dt).contiguous(), l = stats.contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(acc_dt).contiguous() : at::Tensor();
  if (acc_dt == at::kDouble) {
    backward_weight_impl<double>(g.const_data_ptr<double>(), hid, w, tg.const_data_ptr<int64_t>(),
                                 b.defined() ? b.const_data_ptr<double>() : nullptr, l.const_data_ptr<double>(),
                                 1.0 / temperature, ignore_index, chunk_bytes, grad_weight,
                                 grad_bias.data_ptr<double>(), l.size(0) == 3);
  } else {
    backward_weight_impl<float>(g.const_data_ptr<float>(), hid, w, tg.const_data_ptr<int64_t>(),
                                b.defined() ? b.const_data_ptr<float>() : nullptr, l.const_data_ptr<float>(),
                                static_cast<float>(1.0 / temperature), ignore_index, chunk_bytes, grad_weight,
                                grad_bias.data_ptr<float>(), l.size(0) == 3);
  }
  return {grad_weight, grad_bias};
}

void register_fused_logprob(torch::Library& m) {
  m.impl("fused_logprob_forward", &fused_logprob_forward_cpu);
  m.impl("fused_logprob_backward_weight", &fused_logprob_backward_weight_cpu);
}

FT_VARIANT_END
}  // namespace fasttrain
