// The routed experts of a mixture-of-experts layer on CUDA: the kernels of fasttrain::moe_experts and
// moe_experts_backward and their launch sequences, one source for the GPU build
// (csrc/cuda/moe_experts.cu) and the CUDA emulator (csrc/cuda_emu/moe_experts.cpp).
//
//   y_n = Σ_j w_nj · D_e(silu(G_e x_n) ⊙ U_e x_n),  e = expert_index[n, j],
// each projection plus its LoRA term s·(x·A_eᵀ)·B_eᵀ (the CPU kernel's header, csrc/cpu/moe_experts.cpp,
// states the op; the element math, SwiGLU and the NF4 levels, is core/math.h's).
//
// Shape of the work, all on the device and in stream order (no host sync, so a CUDA graph can hold it):
//   1. grouping, a counting sort of the N·k (token, slot) pairs by expert in three launches: per chunk
//      of 256 pairs each pair's stable rank among its chunk's pairs of the same expert and the chunk's
//      count per expert (rank_kernel); one block turns the counts into the per-chunk bases, the
//      expert offsets and the map of token tiles (scan_kernel); each pair then lands at its base plus
//      its rank (place_kernel). Stable (pairs in id order within an expert), so every sum below runs
//      in one order and results repeat bit for bit. An expert index outside [0, E) goes to a bucket
//      after the last expert: no expert computes it and its token's output is NaN (a GPU op cannot
//      raise without a host sync; NaN is loud where a dropped pair would be silent).
//   2. the grouped projections, one kernel (grouped_kernel) for all of them: one block per (expert,
//      tile of 32 of its pairs, tile of 64 output columns); the grid's x holds the worst-case count
//      of token tiles (ceil(N·k/32) + E, known on the host) and a block past the device-side tile map
//      exits at once. Its rows are read through the expert's slice of the order (x gathered by token,
//      never a copy of x per pair), its weights decoded from the expert's own NF4 blocks (or read
//      from a 16-bit stack) a 64×64 tile at a time into shared memory, never a dequantised expert.
//      The LoRA term is a second pass of the same loop over (x·Aᵀ, B) into a second accumulator,
//      v = acc + s·acc_lora (the CPU's addmm). Epilogues: store; SwiGLU (gate_up: a tile holds gate
//      rows j0..j0+31 and up rows I+j0.., the thread holding g_j holds u_j, so act = silu(g)·u is
//      taken in registers and only [pairs, I] goes on to the down projection; h is kept for the
//      backward when asked); SwiGLU's backward (the down projection's transpose: dh from dact and h).
//   3. the combine: y_n = Σ_j w_nj · out[pos(n, j)] per token in slot order (no atomics).
//   Backward: the routing weights' gradient one warp per pair; dact = dO·W_d + (s·dO·B_d)·A_d with the
//   SwiGLU backward fused (dO = w·dy gathered), dx per pair = dh·W_gu + (s·dh·B_g)·A_g and its per-token
//   sum; the LoRA factors' gradients per expert over its rows in order (wgrad_kernel), no atomics.
// Compute: float32 throughout (x, dy and the routing weights converted once, 16-bit weights converted
// exactly, NF4 decoded to float32 as the CPU kernel decodes), FMA accumulation; x float32, float16 or
// bfloat16, the stacks NF4 or float32/float16/bfloat16 (float64 runs on the CPU kernel or the torch form).
// Plain CUDA cores only: no tensor-core instruction (mma, wgmma), which the emulator cannot run, and
// no cuBLAS. Simple and correct first, not fast: no double buffering, no split-K for the decode case,
// no register-level NF4 decode.
//
// What is checked where:
//   path                                                    emulator (tests/cuda_emu)   needs a GPU
//   grouping (ranks, scan, tile map, placement), zero-token  yes, both schedules          -
//     experts, indices outside [0, E)
//   grouped_kernel: NF4 and 16-bit weights, gathered rows,   yes, at Qwen3-30B-A3B's and   -
//     both LoRA passes, all three epilogues, partial tiles     Qwen3.5-35B-A3B's H and I
//   combine, routing-weight gradient, LoRA gradients         yes                          -
//   the launch sequences' host logic (grids, scratch)        yes                          -
//   the op on tensors (run_forward/run_backward: checks,     yes (poisoned outputs)       -
//     conversions, allocations, the output mask)
//   the .cu wrapper (device guard, caching allocator, stream) no                           yes (gpu_check.sh)
//   async launch order on a real stream, graph capture        no                           yes
//   memory-model races between two barriers                   no (one thread at a time)   yes
//   the GPU's expf and nvcc's contraction of a*b + c in the    no (host libm, no           yes (within the
//     SwiGLU derivative                                         contraction)                 same bounds)
//   register use and spills                                   no                           no: `make ptxas`
//   occupancy, timing                                         no                           yes
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <initializer_list>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "core/checks.h"
#include "core/dispatch.h"
#include "core/math.h"
#include "core/moe_experts_checks.h"
#include "cuda/common.cuh"
#include "cuda/device.h"

namespace fasttrain::cuda::moe_experts {
namespace fm = fasttrain::math;
namespace fc = fasttrain::cuda;

constexpr int kChunk = 256;    // pairs per block of the grouping kernels
constexpr int kTM = 32;        // pairs per tile
constexpr int kTN = 64;        // output columns per tile (SwiGLU: 32 gate + 32 up)
constexpr int kTK = 64;        // reduction depth per shared-memory step
constexpr int kThreads = 128;  // thread t: rows 4·(t/16)..+3, columns t%16 + 16·{0,1,2,3} of a tile
constexpr int kEpilogueThreads = 256;
constexpr int kScanThreads = 256;

// ---- operands ------------------------------------------------------------------------------------
// X(i, c): row i of a float32 matrix in pair order ([P, ld]), or, gathered (order set), row
// order[i] / k of a per-token matrix ([N, ld]) times scale[order[i]] when scale is set (dO = w·dy).
struct Rows {
  const float* p = nullptr;
  int64_t ld = 0;
  const int64_t* order = nullptr;
  int64_t k = 1;
  const float* scale = nullptr;
  __device__ float at(int64_t i, int64_t c) const {
    if (order == nullptr) return p[i * ld + c];
    const int64_t pair = order[i];
    const float v = p[(pair / k) * ld + c];
    return scale != nullptr ? v * scale[pair] : v;
  }
};

// W_e(n, c): expert e's [rows, cols] row-major matrix M_e, read as M_e[n][c] or (trans) M_e[c][n];
// WT = uint8_t: the expert's own NF4 blocks (bitsandbytes' layout, `absmax` [E, blocks] fp32);
// else a dense stack of WT, converted exactly to float32.
template <typename WT>
struct Weights {
  const WT* p = nullptr;
  const float* absmax = nullptr;
  int64_t bs = 0, rows = 0, cols = 0;
  bool trans = false;
  __device__ int64_t stride() const {
    return std::is_same_v<WT, uint8_t> ? (rows * cols + 1) / 2 : rows * cols;
  }
  __device__ float at(int64_t e, int64_t n, int64_t c) const {
    const int64_t idx = trans ? c * cols + n : n * cols + c;
    if constexpr (std::is_same_v<WT, uint8_t>) {
      return fc::nf4_decode_at(p + e * stride(), absmax + e * ((rows * cols + bs - 1) / bs), bs, idx);
    } else {
      return static_cast<float>(p[e * stride() + idx]);
    }
  }
};

enum class Epi { kStore, kSwiGLU, kSwiGLUBackward };

// Where a grouped projection's values go. kStore: out[i·ld + n] = alpha·v. kSwiGLU (n = j < I):
// act[i·I + j] = silu(g)·u and, when h is set, h[i·2I + j] = g, h[i·2I + I + j] = u. kSwiGLUBackward
// (v = dact[i, j]): dh[i·2I + j], dh[i·2I + I + j] from h_in.
struct Sink {
  float* out = nullptr;
  int64_t ld = 0;
  float alpha = 1.0f;
  float* act = nullptr;
  float* h = nullptr;
  const float* h_in = nullptr;
  float* dh = nullptr;
  int64_t I = 0;
};

// ---- 1. grouping ---------------------------------------------------------------------------------
// bucket of pair p: its expert, or E for an index outside [0, E)
__device__ __forceinline__ int bucket_of(const int64_t* idx, int64_t p, int E) {
  const int64_t v = idx[p];
  return (v >= 0 && v < E) ? static_cast<int>(v) : E;
}

// counts [chunks + 1, E + 1] int32: row c = chunk c's pairs per bucket; rank [P]: a pair's place among
// its chunk's pairs of the same bucket.
__global__ void __launch_bounds__(kChunk) rank_kernel(const int64_t* __restrict__ idx, int64_t P, int E,
                                                      int* __restrict__ rank, int* __restrict__ counts) {
  FT_SHARED(int, ids, [kChunk]);
  const int t = threadIdx.x;
  const int64_t p = (int64_t)blockIdx.x * kChunk + t;
  int* cnt = counts + (int64_t)blockIdx.x * (E + 1);
  for (int b = t; b <= E; b += kChunk) cnt[b] = 0;
  const int id = p < P ? bucket_of(idx, p, E) : -1;
  ids[t] = id;
  __syncthreads();
  if (p < P) {
    int r = 0;
    bool last = true;
    for (int u = 0; u < kChunk; ++u) {
      if (ids[u] != id) continue;
      if (u < t) ++r;
      else if (u > t) last = false;
    }
    rank[p] = r;
    if (last) cnt[id] = r + 1;  // the chunk's last pair of its bucket knows the count
  }
}

// tile_start [E + 1]: expert e's token tiles are slots tile_start[e] .. tile_start[e + 1] - 1.
__device__ __forceinline__ void tile_starts(const int64_t* offsets, int E, int* tile_start) {
  int tiles = 0;
  for (int e = 0; e < E; ++e) {
    tile_start[e] = tiles;
    tiles += static_cast<int>((offsets[e + 1] - offsets[e] + kTM - 1) / kTM);
  }
  tile_start[E] = tiles;
}

// One block: counts' rows become each chunk's base per bucket (row `chunks` the totals), offsets
// [E + 1] the bucket starts (offsets[E]: the pairs with a valid expert), tile_start the tile map.
__global__ void __launch_bounds__(kScanThreads) scan_kernel(int* __restrict__ counts, int64_t chunks, int E,
                                                            int64_t* __restrict__ offsets,
                                                            int* __restrict__ tile_start) {
  const int64_t W = E + 1;
  for (int b = threadIdx.x; b <= E; b += blockDim.x) {
    int s = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int v = counts[c * W + b];
      counts[c * W + b] = s;
      s += v;
    }
    counts[chunks * W + b] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t run = 0;
    for (int b = 0; b <= E; ++b) {
      offsets[b] = run;
      run += counts[chunks * W + b];
    }
    tile_starts(offsets, E, tile_start);
  }
  __syncthreads();
  for (int b = threadIdx.x; b <= E; b += blockDim.x)
    for (int64_t c = 0; c < chunks; ++c) counts[c * W + b] += static_cast<int>(offsets[b]);
}

// order[pos] = p and pos_of[p] = pos, pos = the chunk's base of p's bucket + p's rank.
__global__ void __launch_bounds__(kChunk) place_kernel(const int64_t* __restrict__ idx, int64_t P, int E,
                                                       const int* __restrict__ rank, const int* __restrict__ counts,
                                                       int64_t* __restrict__ order, int64_t* __restrict__ pos_of) {
  const int64_t p = (int64_t)blockIdx.x * kChunk + threadIdx.x;
  if (p >= P) return;
  const int64_t at = counts[(int64_t)blockIdx.x * (E + 1) + bucket_of(idx, p, E)] + rank[p];
  order[at] = p;
  pos_of[p] = at;
}

// The backward's pos_of (the inverse of the saved order) and tile map (from the saved offsets).
__global__ void __launch_bounds__(kEpilogueThreads) positions_kernel(const int64_t* __restrict__ order, int64_t P,
                                                                     int64_t* __restrict__ pos_of) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < P; i += (int64_t)gridDim.x * blockDim.x)
    pos_of[order[i]] = i;
}

__global__ void __launch_bounds__(32) tile_map_kernel(const int64_t* __restrict__ offsets, int E,
                                                      int* __restrict__ tile_start) {
  if (threadIdx.x == 0) tile_starts(offsets, E, tile_start);
}

// ---- 2. the grouped projections ------------------------------------------------------------------
// acc[a][b] += Σ_c X(i0 + row a, k0 + c)·W_e(col b, k0 + c) over c < K: the tile's rows and weight
// columns staged into shared memory kTK columns at a time. col_of(tile column) -> weight row, or -1.
template <typename WT, typename ColOf>
__device__ void accumulate(float (&acc)[4][4], float (*xs)[kTK + 1], float (*ws)[kTK + 1], const Rows& x,
                           const Weights<WT>& w, int64_t K, int64_t e, int64_t i0, int rows, ColOf col_of) {
  const int t = threadIdx.x, r0 = 4 * (t / 16), c0 = t % 16;
  for (int64_t k0 = 0; k0 < K; k0 += kTK) {
    for (int q = t; q < kTM * kTK; q += kThreads) {
      const int m = q / kTK, c = q % kTK;
      xs[m][c] = (m < rows && k0 + c < K) ? x.at(i0 + m, k0 + c) : 0.0f;
    }
    for (int q = t; q < kTN * kTK; q += kThreads) {
      // transposed weights: consecutive threads on consecutive weight rows n (contiguous in memory)
      const int n = w.trans ? q % kTN : q / kTK, c = w.trans ? q / kTN : q % kTK;
      const int64_t col = col_of(n);
      ws[n][c] = (col >= 0 && k0 + c < K) ? w.at(e, col, k0 + c) : 0.0f;
    }
    __syncthreads();
#pragma unroll 4
    for (int c = 0; c < kTK; ++c) {
      float xv[4], wv[4];
#pragma unroll
      for (int a = 0; a < 4; ++a) xv[a] = xs[r0 + a][c];
#pragma unroll
      for (int b = 0; b < 4; ++b) wv[b] = ws[c0 + 16 * b][c];
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) acc[a][b] = fmaf(xv[a], wv[b], acc[a][b]);
    }
    __syncthreads();
  }
}

// v[i, n] = Σ_c X(i, c)·W_e(n, c) + s2·Σ_c X2(i, c)·W2_e(n, c) for expert e's pairs i, n < n_out,
// into `sink` by kEpi. offsets [E + 1] and tile_start [E + 1] from the grouping; grid (slots, tiles).
template <typename WT, Epi kEpi>
__global__ void __launch_bounds__(kThreads) grouped_kernel(const int64_t* __restrict__ offsets,
                                                           const int* __restrict__ tile_start, int E, Rows x,
                                                           Weights<WT> w, int64_t K, int64_t n_out, Rows x2,
                                                           Weights<float> w2, int64_t K2, float s2, Sink sink) {
  FT_SHARED(float, xs, [kTM][kTK + 1]);
  FT_SHARED(float, ws, [kTN][kTK + 1]);
  const int slot = blockIdx.x;
  if (slot >= tile_start[E]) return;  // past the tile map: the worst case did not happen
  int lo = 0, hi = E - 1;             // the expert e with tile_start[e] <= slot < tile_start[e + 1]
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_start[mid] <= slot) lo = mid;
    else hi = mid - 1;
  }
  const int64_t e = lo;
  const int64_t i0 = offsets[e] + (int64_t)(slot - tile_start[e]) * kTM;
  const int rows = static_cast<int>(min(static_cast<int64_t>(kTM), offsets[e + 1] - i0));
  // SwiGLU: tile columns 0..31 are gate rows j0 + c, 32..63 up rows I + j0 + c - 32
  const int64_t n0 = (int64_t)blockIdx.y * (kEpi == Epi::kSwiGLU ? kTN / 2 : kTN);
  auto col_of = [&](int n) -> int64_t {
    if constexpr (kEpi == Epi::kSwiGLU) {
      const int64_t j = n0 + n % (kTN / 2);
      return j < n_out ? j + (n >= kTN / 2 ? n_out : 0) : -1;
    } else {
      return n0 + n < n_out ? n0 + n : -1;
    }
  };
  float acc[4][4], lora[4][4];
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) acc[a][b] = lora[a][b] = 0.0f;
  accumulate(acc, xs, ws, x, w, K, e, i0, rows, col_of);
  if (K2 > 0) accumulate(lora, xs, ws, x2, w2, K2, e, i0, rows, col_of);

  const int t = threadIdx.x, r0 = 4 * (t / 16), c0 = t % 16;
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    if (r0 + a >= rows) continue;
    const int64_t i = i0 + r0 + a;
    if constexpr (kEpi == Epi::kSwiGLU) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {  // column c0 + 16b is gate j, c0 + 16b + 32 its up partner
        const int64_t j = n0 + c0 + 16 * b;
        if (j >= n_out) continue;
        const float g = fmaf(s2, lora[a][b], acc[a][b]), u = fmaf(s2, lora[a][b + 2], acc[a][b + 2]);
        sink.act[i * n_out + j] = fm::moe_swiglu(g, u);
        if (sink.h != nullptr) {
          sink.h[i * 2 * n_out + j] = g;
          sink.h[i * 2 * n_out + n_out + j] = u;
        }
      }
    } else {
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int64_t n = n0 + c0 + 16 * b;
        if (n >= n_out) continue;
        const float v = fmaf(s2, lora[a][b], acc[a][b]);
        if constexpr (kEpi == Epi::kStore) {
          sink.out[i * sink.ld + n] = sink.alpha * v;
        } else {
          const int64_t I = sink.I;
          float dg, du;
          fm::moe_swiglu_backward(sink.h_in[i * 2 * I + n], sink.h_in[i * 2 * I + I + n], v, dg, du);
          sink.dh[i * 2 * I + n] = dg;
          sink.dh[i * 2 * I + I + n] = du;
        }
      }
    }
  }
}

// The LoRA factors' gradients: G_e[a, b] = alpha·Σ_i L(i, a)·R(i, b) over expert e's pairs i in order,
// a < na, b < nb, G [E, na, nb]; an expert without pairs gets zeros. Grid (ceil(nb/64), ceil(na/32), E).
__global__ void __launch_bounds__(kThreads) wgrad_kernel(const int64_t* __restrict__ offsets, Rows l, Rows r,
                                                         int64_t na, int64_t nb, float alpha, float* __restrict__ g) {
  FT_SHARED(float, ls, [kTM][kTK + 1]);
  FT_SHARED(float, rs, [kTN][kTK + 1]);
  const int64_t e = blockIdx.z, a0 = (int64_t)blockIdx.y * kTM, b0 = (int64_t)blockIdx.x * kTN;
  const int64_t i_begin = offsets[e], i_end = offsets[e + 1];
  const int t = threadIdx.x, r0 = 4 * (t / 16), c0 = t % 16;
  float acc[4][4];
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) acc[a][b] = 0.0f;
  for (int64_t k0 = i_begin; k0 < i_end; k0 += kTK) {
    for (int q = t; q < kTM * kTK; q += kThreads) {  // consecutive threads on consecutive a (one row of L)
      const int a = q % kTM, c = q / kTM;
      ls[a][c] = (a0 + a < na && k0 + c < i_end) ? l.at(k0 + c, a0 + a) : 0.0f;
    }
    for (int q = t; q < kTN * kTK; q += kThreads) {
      const int b = q % kTN, c = q / kTN;
      rs[b][c] = (b0 + b < nb && k0 + c < i_end) ? r.at(k0 + c, b0 + b) : 0.0f;
    }
    __syncthreads();
#pragma unroll 4
    for (int c = 0; c < kTK; ++c)
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) acc[a][b] = fmaf(ls[r0 + a][c], rs[c0 + 16 * b][c], acc[a][b]);
    __syncthreads();
  }
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int64_t ai = a0 + r0 + a, bi = b0 + c0 + 16 * b;
      if (ai < na && bi < nb) g[(e * na + ai) * nb + bi] = alpha * acc[a][b];
    }
}

// ---- 3. per-token sums, the routing weights' gradient, the activation --------------------------------
// y[n, d] = Σ_j w[n·k + j]·src[pos_of[n·k + j]·H + d], slots in order (w null: weights 1); a pair past
// offsets[E] (no valid expert) makes its token's row NaN.
template <typename T>
__global__ void __launch_bounds__(kEpilogueThreads) combine_kernel(const float* __restrict__ src,
                                                                   const int64_t* __restrict__ pos_of,
                                                                   const float* __restrict__ w,
                                                                   const int64_t* __restrict__ offsets, int E,
                                                                   int64_t N, int64_t k, int64_t H, T* __restrict__ y) {
  const int64_t valid = offsets[E];
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < N * H; q += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = q / H, d = q % H;
    float s = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t at = pos_of[n * k + j];
      const float v = at < valid ? src[at * H + d] : std::numeric_limits<float>::quiet_NaN();
      s = w != nullptr ? fmaf(w[n * k + j], v, s) : s + v;
    }
    y[q] = static_cast<T>(s);
  }
}

// dw[p] = Σ_d dy[p / k, d]·out[pos_of[p], d]: one warp per pair, lanes over d, a fixed-order warp sum.
__global__ void __launch_bounds__(kEpilogueThreads) routing_grad_kernel(const float* __restrict__ dy,
                                                                        const float* __restrict__ out,
                                                                        const int64_t* __restrict__ pos_of,
                                                                        const int64_t* __restrict__ offsets, int E,
                                                                        int64_t P, int64_t k, int64_t H,
                                                                        float* __restrict__ dw) {
  const int warps = kEpilogueThreads / 32, lane = threadIdx.x % 32;
  const int64_t valid = offsets[E];
  for (int64_t p = (int64_t)blockIdx.x * warps + threadIdx.x / 32; p < P; p += (int64_t)gridDim.x * warps) {
    const int64_t at = pos_of[p];
    float s = 0.0f;
    if (at < valid)
      for (int64_t d = lane; d < H; d += 32) s = fmaf(dy[(p / k) * H + d], out[at * H + d], s);
    s = fc::warp_sum(s);
    if (lane == 0) dw[p] = at < valid ? s : std::numeric_limits<float>::quiet_NaN();
  }
}

// act [P, I] = silu(g)·u from h [P, 2I] (the backward's input to the down LoRA's gradients).
__global__ void __launch_bounds__(kEpilogueThreads) swiglu_kernel(const float* __restrict__ h, int64_t rows,
                                                                  int64_t I, float* __restrict__ act) {
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < rows * I; q += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = q / I, j = q % I;
    act[q] = fm::moe_swiglu(h[i * 2 * I + j], h[i * 2 * I + I + j]);
  }
}

// ---- launch sequences ------------------------------------------------------------------------------
struct Dims {
  int64_t N, H, I, E, k;
  int64_t P() const { return N * k; }
  // worst-case token tiles: every expert's partial tile plus the full ones
  int64_t slots() const { return (P() + kTM - 1) / kTM + E; }
};

// One expert stack: NF4 (type kByte, absmax fp32 [E, blocks]) or dense [E, rows, cols] of `type`.
struct Stack {
  at::ScalarType type;
  const void* w;
  const float* absmax;
  int64_t bs;
};

// A stack's LoRA factors in float32, A [E, r, in] and B [E, out, r]; r = 0 without.
struct Lora {
  const float* a = nullptr;
  const float* b = nullptr;
  int64_t r = 0;
};

// The pairs grouped by expert (device memory): order [P] and offsets [E + 1] (the op's outputs),
// pos_of [P] (the inverse of order) and tile_start [E + 1].
struct Grouping {
  const int64_t* order;
  const int64_t* offsets;
  const int64_t* pos_of;
  const int* tile_start;
};

// f(Weights<WT>) for the stack's element type: NF4 or float32/float16/bfloat16.
template <typename F>
void with_weights(const Stack& s, int64_t rows, int64_t cols, bool trans, F&& f) {
  auto run = [&](auto* p) {
    using WT = std::remove_const_t<std::remove_pointer_t<decltype(p)>>;
    f(Weights<WT>{p, s.absmax, s.bs, rows, cols, trans});
  };
  switch (s.type) {
    case at::kByte: return run(static_cast<const uint8_t*>(s.w));
    case at::kFloat: return run(static_cast<const float*>(s.w));
    case at::kHalf: return run(static_cast<const at::Half*>(s.w));
    case at::kBFloat16: return run(static_cast<const at::BFloat16*>(s.w));
    default: TORCH_CHECK(false, "fasttrain::moe_experts: no CUDA kernel for a ", s.type, " stack");
  }
}

inline Weights<float> dense(const float* p, int64_t rows, int64_t cols, bool trans) {
  return Weights<float>{p, nullptr, 0, rows, cols, trans};
}

// One grouped projection (grouped_kernel): n_out columns over K (+ the LoRA pass over K2).
template <Epi kEpi, typename WT>
void project(Device& dev, const Dims& d, const Grouping& g, const Rows& x, const Weights<WT>& w, int64_t K,
             int64_t n_out, const Sink& sink, const Rows& x2 = Rows{}, const Weights<float>& w2 = {}, int64_t K2 = 0,
             double s2 = 0.0) {
  if (d.P() == 0 || n_out == 0) return;
  const int64_t per = kEpi == Epi::kSwiGLU ? kTN / 2 : kTN;
  const dim3 grid((unsigned)d.slots(), (unsigned)((n_out + per - 1) / per));
  launch(grouped_kernel<WT, kEpi>, grid, kThreads, 0, dev.stream(), g.offsets, g.tile_start, (int)d.E, x, w, K,
         n_out, x2, w2, K2, (float)s2, sink);
}

// G [E, na, nb] = alpha·Σ_{i of e} L(i, a)·R(i, b) (wgrad_kernel).
inline void weight_grad(Device& dev, const Dims& d, const Grouping& g, const Rows& l, const Rows& r, int64_t na,
                        int64_t nb, double alpha, float* out) {
  if (na == 0 || nb == 0) return;
  const dim3 grid((unsigned)((nb + kTN - 1) / kTN), (unsigned)((na + kTM - 1) / kTM), (unsigned)d.E);
  launch(wgrad_kernel, grid, kThreads, 0, dev.stream(), g.offsets, l, r, na, nb, (float)alpha, out);
}

// `n` elements of `type` at p as float32 (p itself when already float32).
inline const float* as_float(Device& dev, const void* p, at::ScalarType type, int64_t n) {
  if (type == at::kFloat) return static_cast<const float*>(p);
  float* f = dev.scratch_of<float>(n);
  dev.convert(f, at::kFloat, p, type, n);
  return f;
}

// The counting sort of the pairs (section 1): writes order [P] and offsets [E + 1].
inline Grouping group(Device& dev, const Dims& d, const int64_t* expert_index, int64_t* order, int64_t* offsets) {
  const int64_t P = d.P(), chunks = (P + kChunk - 1) / kChunk;
  int64_t* pos_of = dev.scratch_of<int64_t>(std::max<int64_t>(P, 1));
  int* tile_start = dev.scratch_of<int>(d.E + 1);
  if (P == 0) {
    dev.fill(offsets, at::kLong, 0.0, d.E + 1);
    return {order, offsets, pos_of, tile_start};
  }
  int* rank = dev.scratch_of<int>(P);
  int* counts = dev.scratch_of<int>((chunks + 1) * (d.E + 1));
  launch(rank_kernel, (unsigned)chunks, kChunk, 0, dev.stream(), expert_index, P, (int)d.E, rank, counts);
  launch(scan_kernel, 1, kScanThreads, 0, dev.stream(), counts, chunks, (int)d.E, offsets, tile_start);
  launch(place_kernel, (unsigned)chunks, kChunk, 0, dev.stream(), expert_index, P, (int)d.E,
         static_cast<const int*>(rank), static_cast<const int*>(counts), order, pos_of);
  return {order, offsets, pos_of, tile_start};
}

// The forward: y [N, H] in dt; order, offsets; h [P, 2I] float32 (null: not kept); out [P, H] float32
// (the unweighted expert outputs; null: scratch). x and routing weights in their dtypes (dt, wt).
inline void forward(Device& dev, const Dims& d, at::ScalarType dt, const void* x, const int64_t* expert_index,
                    at::ScalarType wt, const void* routing_weights, const Stack& gate_up, const Stack& down,
                    const Lora& lg, const Lora& ld, double scale, void* y, int64_t* order, int64_t* offsets, float* h,
                    float* out) {
  const int64_t N = d.N, H = d.H, I = d.I, P = d.P();
  const Grouping g = group(dev, d, expert_index, order, offsets);
  if (P == 0) return;
  const float* xf = as_float(dev, x, dt, N * H);
  const float* w = as_float(dev, routing_weights, wt, P);
  const Rows xs{xf, H, order, d.k, nullptr};  // x's rows in pair order, gathered on the fly
  float* xa = nullptr;
  if (lg.r > 0) {  // xa = x·A_gᵀ [P, r]
    xa = dev.scratch_of<float>(P * lg.r);
    project<Epi::kStore>(dev, d, g, xs, dense(lg.a, lg.r, H, false), H, lg.r, Sink{xa, lg.r});
  }
  float* act = dev.scratch_of<float>(P * I);
  Sink swiglu;
  swiglu.act = act;
  swiglu.h = h;
  with_weights(gate_up, 2 * I, H, false, [&](auto wg) {
    project<Epi::kSwiGLU>(dev, d, g, xs, wg, H, I, swiglu, Rows{xa, lg.r}, dense(lg.b, 2 * I, lg.r, false), lg.r,
                          scale);
  });
  const Rows as{act, I};
  float* ad = nullptr;
  if (ld.r > 0) {  // act·A_dᵀ [P, r]
    ad = dev.scratch_of<float>(P * ld.r);
    project<Epi::kStore>(dev, d, g, as, dense(ld.a, ld.r, I, false), I, ld.r, Sink{ad, ld.r});
  }
  if (out == nullptr) out = dev.scratch_of<float>(P * H);
  with_weights(down, H, I, false, [&](auto wd) {
    project<Epi::kStore>(dev, d, g, as, wd, I, H, Sink{out, H}, Rows{ad, ld.r}, dense(ld.b, H, ld.r, false), ld.r,
                         scale);
  });
  FT_DISPATCH_FLOATING(dt, "moe_experts_combine", [&] {
    launch(combine_kernel<scalar_t>, fc::grid_for(N * H, kEpilogueThreads), kEpilogueThreads, 0, dev.stream(),
           static_cast<const float*>(out), g.pos_of, w, static_cast<const int64_t*>(offsets), (int)d.E, N, d.k, H,
           static_cast<scalar_t*>(y));
  });
}

// What the backward computes (the op's output_mask) and where: dx [N, H] in dt, dw [N, k] in wt,
// the LoRA gradients float32 in the factors' shapes (null where not asked or without that LoRA).
struct Grads {
  bool x = false, w = false, lora = false;
  void* dx = nullptr;
  void* dw = nullptr;
  float *dga = nullptr, *dgb = nullptr, *dda = nullptr, *ddb = nullptr;
};

inline void backward(Device& dev, const Dims& d, at::ScalarType dt, const void* x, at::ScalarType wt,
                     const void* routing_weights, const Stack& gate_up, const Stack& down, const Lora& lg,
                     const Lora& ld, double scale, const int64_t* order, const int64_t* offsets, const float* h,
                     const float* out, at::ScalarType dyt, const void* dy, const Grads& gr) {
  const int64_t N = d.N, H = d.H, I = d.I, P = d.P();
  if (P == 0) {  // no pairs: the LoRA factors' gradients are zeros (dx and dw are empty)
    const std::pair<float*, int64_t> zero[] = {{gr.dga, lg.r * H}, {gr.dgb, 2 * I * lg.r}, {gr.dda, ld.r * I},
                                               {gr.ddb, H * ld.r}};
    for (const auto& [p, n] : zero)
      if (p != nullptr && n > 0) dev.fill(p, at::kFloat, 0.0, d.E * n);
    return;
  }
  int64_t* pos_of = dev.scratch_of<int64_t>(P);
  int* tile_start = dev.scratch_of<int>(d.E + 1);
  launch(positions_kernel, fc::grid_for(P, kEpilogueThreads), kEpilogueThreads, 0, dev.stream(), order, P, pos_of);
  launch(tile_map_kernel, 1, 32, 0, dev.stream(), offsets, (int)d.E, tile_start);
  const Grouping g{order, offsets, pos_of, tile_start};
  const float* dyf = as_float(dev, dy, dyt, N * H);
  if (gr.w) {
    float* dw = wt == at::kFloat ? static_cast<float*>(gr.dw) : dev.scratch_of<float>(P);
    launch(routing_grad_kernel, fc::grid_for(P * 32, kEpilogueThreads), kEpilogueThreads, 0, dev.stream(), dyf, out,
           static_cast<const int64_t*>(pos_of), offsets, (int)d.E, P, d.k, H, dw);
    if (wt != at::kFloat) dev.convert(gr.dw, wt, dw, at::kFloat, P);
  }
  const bool lora_g = gr.lora && lg.r > 0, lora_d = gr.lora && ld.r > 0;
  if (!gr.x && !lora_g && !lora_d) return;
  const float* w = as_float(dev, routing_weights, wt, P);
  const Rows dO{dyf, H, order, d.k, w};  // w·dy in pair order
  // down: dad = s·dO·B_d [P, r]; dact = dO·W_d + dad·A_d, with SwiGLU's backward -> dh [P, 2I]
  float* dad = nullptr;
  if (ld.r > 0) {
    dad = dev.scratch_of<float>(P * ld.r);
    Sink s{dad, ld.r};
    s.alpha = static_cast<float>(scale);
    project<Epi::kStore>(dev, d, g, dO, dense(ld.b, H, ld.r, true), H, ld.r, s);
  }
  float* dh = dev.scratch_of<float>(P * 2 * I);
  Sink back;
  back.h_in = h;
  back.dh = dh;
  back.I = I;
  with_weights(down, H, I, true, [&](auto wd) {
    project<Epi::kSwiGLUBackward>(dev, d, g, dO, wd, H, I, back, Rows{dad, ld.r}, dense(ld.a, ld.r, I, true), ld.r,
                                  1.0);
  });
  if (lora_d) {  // dB_d = s·dOᵀ·(act·A_dᵀ), dA_d = dadᵀ·act, per expert
    float* act = dev.scratch_of<float>(P * I);
    launch(swiglu_kernel, fc::grid_for(P * I, kEpilogueThreads), kEpilogueThreads, 0, dev.stream(), h, P, I, act);
    float* ad = dev.scratch_of<float>(P * ld.r);
    project<Epi::kStore>(dev, d, g, Rows{act, I}, dense(ld.a, ld.r, I, false), I, ld.r, Sink{ad, ld.r});
    weight_grad(dev, d, g, dO, Rows{ad, ld.r}, H, ld.r, scale, gr.ddb);
    weight_grad(dev, d, g, Rows{dad, ld.r}, Rows{act, I}, ld.r, I, 1.0, gr.dda);
  }
  // gate_up: dxa = s·dh·B_g [P, r]; dx per pair = dh·W_gu + dxa·A_g
  const Rows dhr{dh, 2 * I};
  float* dxa = nullptr;
  if (lg.r > 0 && (gr.x || lora_g)) {
    dxa = dev.scratch_of<float>(P * lg.r);
    Sink s{dxa, lg.r};
    s.alpha = static_cast<float>(scale);
    project<Epi::kStore>(dev, d, g, dhr, dense(lg.b, 2 * I, lg.r, true), 2 * I, lg.r, s);
  }
  if (lora_g) {  // dB_g = s·dhᵀ·(x·A_gᵀ), dA_g = dxaᵀ·x, per expert
    const Rows xs{as_float(dev, x, dt, N * H), H, order, d.k, nullptr};
    float* xa = dev.scratch_of<float>(P * lg.r);
    project<Epi::kStore>(dev, d, g, xs, dense(lg.a, lg.r, H, false), H, lg.r, Sink{xa, lg.r});
    weight_grad(dev, d, g, dhr, Rows{xa, lg.r}, 2 * I, lg.r, scale, gr.dgb);
    weight_grad(dev, d, g, Rows{dxa, lg.r}, xs, lg.r, H, 1.0, gr.dga);
  }
  if (!gr.x) return;
  float* dxp = dev.scratch_of<float>(P * H);
  with_weights(gate_up, 2 * I, H, true, [&](auto wg) {
    project<Epi::kStore>(dev, d, g, dhr, wg, 2 * I, H, Sink{dxp, H}, Rows{dxa, lg.r}, dense(lg.a, lg.r, H, true),
                         lg.r, 1.0);
  });
  FT_DISPATCH_FLOATING(dt, "moe_experts_dx", [&] {
    launch(combine_kernel<scalar_t>, fc::grid_for(N * H, kEpilogueThreads), kEpilogueThreads, 0, dev.stream(),
           static_cast<const float*>(dxp), static_cast<const int64_t*>(pos_of), static_cast<const float*>(nullptr),
           offsets, (int)d.E, N, d.k, H, static_cast<scalar_t*>(gr.dx));
  });
}

}  // namespace fasttrain::cuda::moe_experts

// ---- the ops on tensors: checks, conversions and allocations, shared by the CUDA wrapper
// (csrc/cuda/moe_experts.cu: device guard, at::empty) and the emulator (poisoned CPU tensors) ------
namespace fasttrain::cuda::moe_experts {

// The CUDA kernels' limits beyond the op's own checks (core/moe_experts_checks.h).
inline void check_cuda_args(const char* op, const at::Tensor& x, const MoEArgs& a, const at::Tensor& gate_up,
                            const std::optional<at::Tensor>& gate_up_absmax, const at::Tensor& down,
                            const std::optional<at::Tensor>& down_absmax,
                            std::initializer_list<const std::optional<at::Tensor>*> lora) {
  FT_CHECK_ARG(x.scalar_type() != at::kDouble, op, "x",
               "is float64: the CUDA kernels compute in float32 (float64 runs on the CPU kernel or the torch form)");
  for (const at::Tensor* s : {&gate_up, &down})
    FT_CHECK_ARG(s->scalar_type() == at::kByte || s->scalar_type() == at::kFloat || s->scalar_type() == at::kHalf ||
                     s->scalar_type() == at::kBFloat16,
                 op, "gate_up/down", "must be NF4 or a float32, float16 or bfloat16 stack on CUDA, got ",
                 s->scalar_type());
  for (const std::optional<at::Tensor>* t : {&gate_up_absmax, &down_absmax})
    if (t->has_value()) FT_CHECK_ARG((*t)->device() == x.device(), op, "absmax", "must be on ", x.device());
  for (const std::optional<at::Tensor>* t : lora)
    if (t->has_value()) FT_CHECK_ARG((*t)->device() == x.device(), op, "LoRA factors", "must be on ", x.device());
  const Dims d{a.N, a.H, a.I, a.E, a.k};
  // grid limits: E in gridDim.z, the output tiles (at most max(H, 2I) / 32) in gridDim.y, token tiles in x
  FT_CHECK_ARG(a.E < 65536 && std::max(a.H, 2 * a.I) <= int64_t(65535) * kTM && d.slots() < (int64_t(1) << 31),
               op, "x", "is beyond the CUDA kernels' grids: at most 65,535 experts, H and 2I at most 2,097,120 and "
               "2^31 tiles of 32 pairs, got E=", a.E, ", H=", a.H, ", I=", a.I, " and ", a.N, " x ", a.k, " pairs");
}

// The op's tensors checked (the op's own checks, then the CUDA kernels' limits), contiguous, the
// LoRA factors in float32, and the views the launch sequences take of them.
struct Operands {
  MoEArgs a;
  Dims d;
  at::Tensor x, idx, rw, gu, dn, gu_absmax, dn_absmax, ga, gb, da, db;
  int64_t bs;

  static Stack stack(const at::Tensor& w, const at::Tensor& absmax, int64_t bs) {
    return Stack{w.scalar_type(), w.const_data_ptr(), absmax.defined() ? absmax.const_data_ptr<float>() : nullptr, bs};
  }
  static Lora lora(const at::Tensor& a, const at::Tensor& b) {
    return a.defined() ? Lora{a.const_data_ptr<float>(), b.const_data_ptr<float>(), a.size(1)} : Lora{};
  }
  Stack gate_up() const { return stack(gu, gu_absmax, bs); }
  Stack down() const { return stack(dn, dn_absmax, bs); }
  Lora gate_up_lora() const { return lora(ga, gb); }
  Lora down_lora() const { return lora(da, db); }
  at::TensorOptions f32() const { return x.options().dtype(at::kFloat); }
};

inline Operands operands(const char* op, const at::Tensor& x, const at::Tensor& expert_index,
                         const at::Tensor& routing_weights, const at::Tensor& gate_up,
                         const std::optional<at::Tensor>& gate_up_absmax, const at::Tensor& down,
                         const std::optional<at::Tensor>& down_absmax, int64_t blocksize, int64_t intermediate,
                         const std::optional<at::Tensor>& gu_a, const std::optional<at::Tensor>& gu_b,
                         const std::optional<at::Tensor>& dn_a, const std::optional<at::Tensor>& dn_b) {
  const MoEArgs a = check_moe_args(op, x, expert_index, routing_weights, gate_up, gate_up_absmax, down,
                                   down_absmax, blocksize, intermediate, gu_a, gu_b, dn_a, dn_b);
  check_cuda_args(op, x, a, gate_up, gate_up_absmax, down, down_absmax, {&gu_a, &gu_b, &dn_a, &dn_b});
  auto opt = [](const std::optional<at::Tensor>& t) { return t.has_value() ? t->contiguous() : at::Tensor(); };
  auto f32 = [](const std::optional<at::Tensor>& t, int64_t r) {  // rank 0: no LoRA pass at all
    return t.has_value() && r > 0 ? t->to(at::kFloat).contiguous() : at::Tensor();
  };
  return Operands{a, Dims{a.N, a.H, a.I, a.E, a.k}, x.contiguous(), expert_index.contiguous(),
                  routing_weights.contiguous(), gate_up.contiguous(), down.contiguous(), opt(gate_up_absmax),
                  opt(down_absmax), f32(gu_a, a.r_gu), f32(gu_b, a.r_gu), f32(dn_a, a.r_dn), f32(dn_b, a.r_dn),
                  blocksize};
}

// fasttrain::moe_experts on x's device; alloc(sizes, options) gives an uninitialised tensor there.
template <typename Alloc>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> run_forward(
    const char* op, Device& dev, Alloc&& alloc, const at::Tensor& x, const at::Tensor& expert_index,
    const at::Tensor& routing_weights, const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_absmax,
    const at::Tensor& down, const std::optional<at::Tensor>& down_absmax, int64_t blocksize, int64_t intermediate,
    const std::optional<at::Tensor>& gu_a, const std::optional<at::Tensor>& gu_b,
    const std::optional<at::Tensor>& dn_a, const std::optional<at::Tensor>& dn_b, double scale, bool save) {
  const Operands o = operands(op, x, expert_index, routing_weights, gate_up, gate_up_absmax, down, down_absmax,
                              blocksize, intermediate, gu_a, gu_b, dn_a, dn_b);
  const Dims& d = o.d;
  const int64_t P = d.P();
  at::Tensor y = alloc({d.N, d.H}, o.x.options());
  at::Tensor order = alloc({P}, o.idx.options()), offsets = alloc({d.E + 1}, o.idx.options());
  at::Tensor h = save ? alloc({P, 2 * d.I}, o.f32()) : alloc({0}, o.f32());
  at::Tensor out = save ? alloc({P, d.H}, o.f32()) : alloc({0}, o.f32());
  forward(dev, d, o.x.scalar_type(), o.x.const_data_ptr(), o.idx.const_data_ptr<int64_t>(), o.rw.scalar_type(),
          o.rw.const_data_ptr(), o.gate_up(), o.down(), o.gate_up_lora(), o.down_lora(), scale, y.data_ptr(),
          order.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), save ? h.data_ptr<float>() : nullptr,
          save ? out.data_ptr<float>() : nullptr);
  return {y, order, offsets, h, out};
}

// fasttrain::moe_experts_backward on x's device (alloc as for run_forward).
template <typename Alloc>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> run_backward(
    const char* op, Device& dev, Alloc&& alloc, const at::Tensor& dy_, const at::Tensor& x,
    const at::Tensor& expert_index, const at::Tensor& routing_weights, const at::Tensor& gate_up,
    const std::optional<at::Tensor>& gate_up_absmax, const at::Tensor& down,
    const std::optional<at::Tensor>& down_absmax, int64_t blocksize, int64_t intermediate,
    const std::optional<at::Tensor>& gu_a, const std::optional<at::Tensor>& gu_b,
    const std::optional<at::Tensor>& dn_a, const std::optional<at::Tensor>& dn_b, double scale,
    const at::Tensor& order, const at::Tensor& offsets, const at::Tensor& h, const at::Tensor& out,
    std::array<bool, 3> mask) {
  const Operands o = operands(op, x, expert_index, routing_weights, gate_up, gate_up_absmax, down, down_absmax,
                              blocksize, intermediate, gu_a, gu_b, dn_a, dn_b);
  check_moe_backward_args(op, o.a, dy_, order, offsets, h, out, at::kFloat);
  FT_CHECK_ARG(dy_.device() == x.device(), op, "dy", "must be on ", x.device(), ", got ", dy_.device());
  const Dims& d = o.d;
  const at::Tensor dy = dy_.contiguous();
  Grads gr;
  gr.x = mask[0];
  gr.w = mask[1];
  gr.lora = mask[2];
  at::Tensor dx = gr.x ? alloc({d.N, d.H}, o.x.options()) : alloc({0}, o.x.options());
  at::Tensor dw = gr.w ? alloc({d.N, d.k}, o.rw.options()) : alloc({0}, o.f32());
  auto grad_of = [&](const std::optional<at::Tensor>& t) {
    return gr.lora && t.has_value() ? alloc(t->sizes(), o.f32()) : alloc({0}, o.f32());
  };
  at::Tensor dga = grad_of(gu_a), dgb = grad_of(gu_b), dda = grad_of(dn_a), ddb = grad_of(dn_b);
  auto ptr = [](at::Tensor& t) { return t.numel() > 0 ? t.data_ptr<float>() : nullptr; };
  gr.dx = gr.x ? dx.data_ptr() : nullptr;
  gr.dw = gr.w ? dw.data_ptr() : nullptr;
  gr.dga = ptr(dga);
  gr.dgb = ptr(dgb);
  gr.dda = ptr(dda);
  gr.ddb = ptr(ddb);
  const at::Tensor ord = order.contiguous(), offs = offsets.contiguous(), hs = h.contiguous(), os = out.contiguous();
  backward(dev, d, o.x.scalar_type(), o.x.const_data_ptr(), o.rw.scalar_type(), o.rw.const_data_ptr(), o.gate_up(),
           o.down(), o.gate_up_lora(), o.down_lora(), scale, ord.const_data_ptr<int64_t>(),
           offs.const_data_ptr<int64_t>(), hs.const_data_ptr<float>(), os.const_data_ptr<float>(), dy.scalar_type(),
           dy.const_data_ptr(), gr);
  return {dx, dw, dga, dgb, dda, ddb};
}

}  // namespace fasttrain::cuda::moe_experts
