// moe_experts on the CPU: the routed experts of a mixture-of-experts layer in one op,
//     y_n = Σ_j w_nj · D_e(silu(G_e x_n) ⊙ U_e x_n) (+ each projection's LoRA term s·(x·A_eᵀ)·B_eᵀ),
// forward and backward (to x, the routing weights and the LoRA factors; the stacks are frozen).
//
// Why by hand: what the torch form pays per call is a host round trip for the tokens per expert, one
// pair of projections per active expert, and (under NF4) the decoded expert as a whole weight per
// projection. Here:
//   - the N·k (token, slot) pairs are grouped by expert by a counting sort inside the op (counts,
//     offsets, a stable placement: O(N·k) integer work, no host sync, no argsort);
//   - each expert's weight is read a tile of rows at a time: the tile is decoded from NF4 (or
//     converted from 16 bits) into a small per-task buffer, multiplied with the expert's rows by the
//     vendor GEMM, and dropped; no dequantised expert, let alone stack, exists;
//   - gate and up rows j0..j1 form one tile, so the SwiGLU a = silu(g)·u is taken right there and
//     only a [pairs, I] activation goes on to the down projection;
//   - LoRA runs factorised: x·Aᵀ once per expert, then each tile adds (x·Aᵀ)·B_tileᵀ·s;
//   - the routing weights and the k-slot sum are applied per token at the end, in a fixed slot
//     order (deterministic; no atomics, no races between experts).
// Parallel (at::parallel_for) over (expert, row tile) work items in the forward and over chunks of
// experts in the backward (each expert's LoRA gradients are its own; the input gradient is summed
// per token in a fixed order at the end).
// Compute dtype: float64 for float64 x (the tests' exact path), else float32; the forward saves
// only the gate/up values h [pairs, 2I] for the backward (when asked to), which decodes the weights
// again and gathers each expert's rows of dy and x in its own task: its routing weights' gradient
// goes through the down projection (dy·W_d against the activation), so no [pairs, H] tensor is
// kept from the forward or made in the backward except the input gradient's per-pair buffer when
// there are at least as many threads as slots (else per-task sums of [tokens, H]).
// The element math (SwiGLU and its derivative, the NF4 levels) is core/math.h's.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "core/cpu_features.h"
#include "core/math.h"
#include "core/moe_experts_checks.h"
#include "core/variant.h"
#include "cpu/nf4_decode.h"
#include "cpu/parallel.h"
#include "cpu/register.h"
#include "ops.h"

namespace fasttrain {
FT_VARIANT_BEGIN
namespace fm = fasttrain::math;

namespace {

constexpr const char* kOp = "fasttrain::moe_experts";
constexpr int64_t kTileBytes = 256 * 1024;  // one decoded tile: a quarter of a 1 MiB L2

// One expert stack read a tile of rows at a time.
struct Stack {
  int64_t out, in, bs = 0;
  bool nf4;
  at::Tensor w;       // NF4: packed uint8 [E, bytes]; else [E, out, in] (contiguous)
  at::Tensor absmax;  // NF4: fp32 [E, blocks]

  // Rows [r0, r0 + rows) of expert e as a [rows, in] tensor of dtype ct: a view when the stack is
  // already in ct, else decoded / converted into buf (at least rows·in elements of ct).
  at::Tensor rows(int64_t e, int64_t r0, int64_t rows, at::ScalarType ct, at::Tensor& buf) const {
    if (!nf4 && w.scalar_type() == ct) return w[e].narrow(0, r0, rows);
    if (!buf.defined() || buf.numel() < rows * in) buf = at::empty({rows * in}, w.options().dtype(ct));
    at::Tensor t = buf.narrow(0, 0, rows * in).view({rows, in});
    if (!nf4) return t.copy_(w[e].narrow(0, r0, rows));
    const uint8_t* q = w.const_data_ptr<uint8_t>() + e * w.size(1);
    const float* am = absmax.const_data_ptr<float>() + e * absmax.size(1);
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, ct, "moe_experts_decode", [&] {
      nf4cpu::decode_range<scalar_t>(q, am, bs, r0 * in, (r0 + rows) * in, t.data_ptr<scalar_t>());
    });
    return t;
  }

  // Rows per tile: a tile of about kTileBytes, at least 8 rows, at most all of them.
  int64_t tile(at::ScalarType ct, int64_t limit) const {
    return std::max<int64_t>(1, std::min<int64_t>(limit, std::max<int64_t>(8, kTileBytes / (in * at::elementSize(ct)))));
  }
};

Stack make_stack(const at::Tensor& w, const std::optional<at::Tensor>& absmax, int64_t out, int64_t in, int64_t bs) {
  Stack s{out, in, bs, absmax.has_value(), w.contiguous(), at::Tensor()};
  if (s.nf4) s.absmax = absmax->contiguous();
  return s;
}

// The pairs grouped by expert: order [P] (pair ids p = n·k + j, stable within an expert),
// offsets [E + 1] (expert e owns order[offsets[e] .. offsets[e+1])), pos [P] (the inverse of order).
struct Grouping {
  at::Tensor order, offsets;
  std::vector<int64_t> pos;
};

Grouping group_pairs(const at::Tensor& expert_index, int64_t E) {
  const at::Tensor idx = expert_index.contiguous();
  const int64_t P = idx.numel();
  const int64_t* ei = idx.const_data_ptr<int64_t>();
  Grouping g{at::empty({P}, idx.options()), at::zeros({E + 1}, idx.options()), std::vector<int64_t>(P)};
  int64_t* off = g.offsets.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(ei[p] >= 0 && ei[p] < E, kOp, ": argument 'expert_index' holds ", ei[p], " (pair ", p,
                "), outside [0, E=", E, ")");
    ++off[ei[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  std::vector<int64_t> next(off, off + E);
  int64_t* ord = g.order.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) {
    const int64_t at = next[ei[p]]++;
    ord[at] = p;
    g.pos[p] = at;
  }
  return g;
}

// x's rows in pair order, [P, H] in ct.
at::Tensor gather_rows(const at::Tensor& x, const at::Tensor& order, int64_t k) {
  return x.index_select(0, at::floor_divide(order, k));
}

// One unit of the forward: expert e, output rows [r0, r0 + rows) of its projection.
struct Item {
  int64_t e, r0, rows;
};

std::vector<Item> tiles(const int64_t* off, int64_t E, int64_t total, int64_t tile) {
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e)
    if (off[e + 1] > off[e])
      for (int64_t r = 0; r < total; r += tile) items.push_back({e, r, std::min(tile, total - r)});
  return items;
}

// lora = (A [E, r, in], B [E, out, r]) in ct, or undefined tensors.
struct Lora {
  at::Tensor a, b;
  bool on() const { return a.defined() && a.size(1) > 0; }
};

Lora make_lora(const std::optional<at::Tensor>& a, const std::optional<at::Tensor>& b, at::ScalarType ct) {
  if (!a.has_value()) return {};
  return {a->to(ct).contiguous(), b->to(ct).contiguous()};
}

// x·Aᵀ per expert for the pairs in order: [P, r] (r = 0 without LoRA).
at::Tensor lora_in(const at::Tensor& xs, const Lora& l, const int64_t* off, int64_t E) {
  if (!l.on()) return at::empty({xs.size(0), 0}, xs.options());
  at::Tensor xa = at::empty({xs.size(0), l.a.size(1)}, xs.options());
  fasttrain::parallel_for(0, E, 1, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t c = off[e + 1] - off[e];
      if (c) {
        at::Tensor o = xa.narrow(0, off[e], c);
        at::mm_out(o, xs.narrow(0, off[e], c), l.a[e].t());
      }
    }
  });
  return xa;
}

// The GEMMs' dtype: bfloat16 when x is bfloat16 and the CPU has native bf16 GEMMs (avx512_bf16 /
// AMX, several times the fp32 rate there; a bf16 GEMM without them is far slower than fp32), as
// nf4_linear decides; else the compute dtype. The sums across tiles, the SwiGLU, the k-slot sum and
// every gradient's accumulation stay in the compute dtype.
at::ScalarType gemm_dtype(const at::Tensor& x, at::ScalarType ct) {
  return (x.scalar_type() == at::kBFloat16 && cpu_has_bf16()) ? at::kBFloat16 : ct;
}

// acc += a·b: in place when a and b are acc's dtype, else their GEMM in theirs (one rounding of the
// product) added into acc.
void add_mm(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == acc.scalar_type()) acc.addmm_(a, b);
  else acc.add_(at::mm(a, b));
}

// dst_n = Σ_j w_nj · src[pos(n, j)] over the k slots of row n, in slot order (w null: weights of 1),
// accumulated in acc_t: the forward's weighted combine and the backward's dx sum share it.
template <typename acc_t, typename src_t>
void slot_sum(acc_t* dst, const src_t* src, const int64_t* pos, const acc_t* w, int64_t N, int64_t k, int64_t H) {
  fasttrain::parallel_for(0, N, std::max<int64_t>(1, 4096 / H), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      acc_t* dn = dst + n * H;
      std::fill(dn, dn + H, acc_t(0));
      for (int64_t j = 0; j < k; ++j) {
        const acc_t wj = w ? w[n * k + j] : acc_t(1);
        const src_t* sn = src + pos[n * k + j] * H;
        for (int64_t d = 0; d < H; ++d) dn[d] += wj * static_cast<acc_t>(sn[d]);
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_experts_cpu(
    const at::Tensor& x, const at::Tensor& expert_index, const at::Tensor& routing_weights,
    const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_absmax, const at::Tensor& down,
    const std::optional<at::Tensor>& down_absmax, int64_t blocksize, int64_t intermediate,
    const std::optional<at::Tensor>& gu_a, const std::optional<at::Tensor>& gu_b,
    const std::optional<at::Tensor>& dn_a, const std::optional<at::Tensor>& dn_b, double scale, bool save) {
  FT_CHECK_DEVICE_TYPE(kOp, x, at::kCPU);
  const MoEArgs a = check_moe_args(kOp, x, expert_index, routing_weights, gate_up, gate_up_absmax, down,
                                   down_absmax, blocksize, intermediate, gu_a, gu_b, dn_a, dn_b);
  const at::ScalarType ct = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::ScalarType gt = gemm_dtype(x, ct);
  const int64_t N = a.N, H = a.H, I = a.I, k = a.k, P = N * k;
  const Stack gu = make_stack(gate_up, gate_up_absmax, 2 * I, H, blocksize);
  const Stack dn = make_stack(down, down_absmax, H, I, blocksize);
  const Lora lg = make_lora(gu_a, gu_b, gt), ld = make_lora(dn_a, dn_b, gt);
  Grouping g = group_pairs(expert_index, a.E);
  const int64_t* off = g.offsets.const_data_ptr<int64_t>();
  const at::TensorOptions opt = x.options().dtype(ct), gopt = x.options().dtype(gt);

  at::Tensor xs = gather_rows(x.to(gt), g.order, k);        // [P, H], dropped after gate_up
  at::Tensor xa = lora_in(xs, lg, off, a.E);                 // [P, r_gu]
  at::Tensor act = at::empty({P, I}, gopt);
  at::Tensor h = save ? at::empty({P, 2 * I}, gopt) : at::empty({0}, gopt);

  // gate_up: tile j0..j1 of the intermediate width = gate rows j0..j1 and up rows I+j0..I+j1
  const std::vector<Item> gitems = tiles(off, a.E, I, std::max<int64_t>(1, gu.tile(gt, I) / 2));
  fasttrain::parallel_for(0, (int64_t)gitems.size(), 1, [&](int64_t i0, int64_t i1) {
    at::Tensor bg, bu;
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = gitems[i];
      const int64_t o = off[it.e], c = off[it.e + 1] - o;
      const at::Tensor xe = xs.narrow(0, o, c);
      at::Tensor gv = at::mm(xe, gu.rows(it.e, it.r0, it.rows, gt, bg).t());        // [c, rows]
      at::Tensor uv = at::mm(xe, gu.rows(it.e, I + it.r0, it.rows, gt, bu).t());
      if (lg.on()) {
        const at::Tensor xae = xa.narrow(0, o, c);
        gv.addmm_(xae, lg.b[it.e].narrow(0, it.r0, it.rows).t(), 1.0, scale);
        uv.addmm_(xae, lg.b[it.e].narrow(0, I + it.r0, it.rows).t(), 1.0, scale);
      }
      AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gt, "moe_experts_swiglu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* pg = gv.const_data_ptr<scalar_t>();
        const scalar_t* pu = uv.const_data_ptr<scalar_t>();
        scalar_t* pa = act.data_ptr<scalar_t>() + o * I + it.r0;
        scalar_t* ph = save ? h.data_ptr<scalar_t>() + o * 2 * I + it.r0 : nullptr;
        for (int64_t m = 0; m < c; ++m)
          for (int64_t j = 0; j < it.rows; ++j) {
            const scalar_t gj = pg[m * it.rows + j], uj = pu[m * it.rows + j];
            pa[m * I + j] = static_cast<scalar_t>(fm::moe_swiglu<acc_t>(gj, uj));
            if (ph) {
              ph[m * 2 * I + j] = gj;
              ph[m * 2 * I + I + j] = uj;
            }
          }
      });
    }
  });

  xs.reset();
  xa.reset();

  // down: tile h0..h1 of the output rows; out [P, H] the unweighted expert outputs
  const at::Tensor ad = lora_in(act, ld, off, a.E);  // [P, r_dn]
  at::Tensor out = at::empty({P, H}, gopt);
  const std::vector<Item> ditems = tiles(off, a.E, H, dn.tile(gt, H));
  fasttrain::parallel_for(0, (int64_t)ditems.size(), 1, [&](int64_t i0, int64_t i1) {
    at::Tensor bd;
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = ditems[i];
      const int64_t o = off[it.e], c = off[it.e + 1] - o;
      at::Tensor ov = at::mm(act.narrow(0, o, c), dn.rows(it.e, it.r0, it.rows, gt, bd).t());  // [c, rows]
      if (ld.on()) ov.addmm_(ad.narrow(0, o, c), ld.b[it.e].narrow(0, it.r0, it.rows).t(), 1.0, scale);
      out.narrow(0, o, c).narrow(1, it.r0, it.rows).copy_(ov);
    }
  });

  // y_n = Σ_j w_nj · out[pos(n, j)], slots in order
  at::Tensor y = at::empty({N, H}, opt);
  const at::Tensor w = routing_weights.to(ct).contiguous();
  AT_DISPATCH_FLOATING_TYPES(ct, "moe_experts_combine", [&] {
    using acc_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gt, "moe_experts_combine_out", [&] {
      slot_sum(y.data_ptr<acc_t>(), out.const_data_ptr<scalar_t>(), g.pos.data(), w.const_data_ptr<acc_t>(), N, k, H);
    });
  });
  // the outputs are not saved: the backward takes the routing weights' gradient through W_d instead
  return {y.to(x.scalar_type()), g.order, g.offsets, h, at::empty({0}, gopt)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_experts_backward_cpu(
    const at::Tensor& dy_, const at::Tensor& x, const at::Tensor& expert_index, const at::Tensor& routing_weights,
    const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_absmax, const at::Tensor& down,
    const std::optional<at::Tensor>& down_absmax, int64_t blocksize, int64_t intermediate,
    const std::optional<at::Tensor>& gu_a, const std::optional<at::Tensor>& gu_b,
    const std::optional<at::Tensor>& dn_a, const std::optional<at::Tensor>& dn_b, double scale,
    const at::Tensor& order, const at::Tensor& offsets, const at::Tensor& h, const at::Tensor& out,
    std::array<bool, 3> mask) {
  constexpr const char* op = "fasttrain::moe_experts_backward";
  FT_CHECK_DEVICE_TYPE(op, x, at::kCPU);
  const MoEArgs a = check_moe_args(op, x, expert_index, routing_weights, gate_up, gate_up_absmax, down,
                                   down_absmax, blocksize, intermediate, gu_a, gu_b, dn_a, dn_b);
  const at::ScalarType ct = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::ScalarType gt = gemm_dtype(x, ct);  // the forward's GEMM dtype, h's dtype
  const int64_t N = a.N, H = a.H, I = a.I, k = a.k, P = N * k, E = a.E;
  check_moe_backward_args(op, a, dy_, order, offsets, h, out, gt, /*out_saved=*/false);
  const bool need_x = mask[0], need_w = mask[1], need_lora = mask[2];
  const Stack gu = make_stack(gate_up, gate_up_absmax, 2 * I, H, blocksize);
  const Stack dn = make_stack(down, down_absmax, H, I, blocksize);
  const Lora lg = make_lora(gu_a, gu_b, ct), ld = make_lora(dn_a, dn_b, ct);
  const at::TensorOptions opt = x.options().dtype(ct);
  const at::Tensor ord = order.contiguous(), offs = offsets.contiguous();
  const int64_t* off = offs.const_data_ptr<int64_t>();
  const int64_t* po = ord.const_data_ptr<int64_t>();

  // Each expert's rows of dy and x are gathered inside its task (no [P, H] copies of either), and the
  // routing weights' gradient comes without the forward's outputs: with g = dy_n·W_d and
  // gb = dy_n·B_d (the output gradient seen through the down projection and its LoRA factor),
  //   dw_p = dy_n · out_p = act_p · g + s·(act_p·A_dᵀ) · gb,   dact_p = w_p·(g + s·gb·A_d),
  // the same sums regrouped, so the forward saves only h.
  const at::Tensor dyg = dy_.to(gt).contiguous();                                   // [N, H]
  const at::Tensor wv = routing_weights.to(ct).contiguous().view({P}).index_select(0, ord);  // [P]
  const at::Tensor tok = at::floor_divide(ord, k);                                  // [P] the pairs' tokens
  const int64_t* pt = tok.const_data_ptr<int64_t>();
  at::Tensor dw = at::zeros({P}, opt);
  auto zeros_like_opt = [&](const std::optional<at::Tensor>& t) {
    return (need_lora && t.has_value()) ? at::zeros(t->sizes(), opt) : at::empty({0}, opt);
  };
  at::Tensor dga = zeros_like_opt(gu_a), dgb = zeros_like_opt(gu_b), dda = zeros_like_opt(dn_a),
             ddb = zeros_like_opt(dn_b);
  const bool chain = need_x || (need_lora && (lg.on() || ld.on()));
  const at::Tensor xc = (need_lora && lg.on()) ? x.to(ct).contiguous() : at::Tensor();

  // The experts in C contiguous chunks, one task each. The input gradient: with fewer chunks than
  // slots, each chunk adds its pairs' rows into its own [N, H] sum (C·N·H < P·H), summed over the
  // chunks in chunk order at the end; else each pair's row goes to a [P, H] buffer, summed per token
  // in slot order. Both orders are fixed by C alone (deterministic for a given thread count).
  const int64_t C = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), E));
  const bool by_chunk = need_x && C < k;
  at::Tensor dxs = !need_x ? at::empty({0}, opt) : by_chunk ? at::zeros({C, N, H}, opt) : at::empty({P, H}, opt);

  fasttrain::parallel_for(0, C, 1, [&](int64_t c0, int64_t c1) {
    at::Tensor buf;
    for (int64_t ch = c0; ch < c1; ++ch)
      for (int64_t e = ch * E / C; e < (ch + 1) * E / C; ++e) {
        const int64_t o = off[e], c = off[e + 1] - o;
        if (!c) continue;
        const at::Tensor te = tok.narrow(0, o, c);
        const at::Tensor dyeg = dyg.index_select(0, te);                                // [c, H] in gt
        const at::Tensor dye = dyeg.to(ct);
        const at::Tensor we = wv.narrow(0, o, c).unsqueeze(1);                          // [c, 1]
        const at::Tensor he = h.view({P, 2 * I}).narrow(0, o, c);
        at::Tensor act = at::empty({c, I}, opt);
        AT_DISPATCH_FLOATING_TYPES(ct, "moe_experts_act", [&] {
          using acc_t = scalar_t;
          acc_t* pa = act.data_ptr<acc_t>();
          AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gt, "moe_experts_act_h", [&] {
            const scalar_t* ph = he.const_data_ptr<scalar_t>();
            for (int64_t m = 0; m < c; ++m)
              for (int64_t j = 0; j < I; ++j)
                pa[m * I + j] = fm::moe_swiglu<acc_t>(ph[m * 2 * I + j], ph[m * 2 * I + I + j]);
          });
        });
        // g = dy·W_d, tile by tile of the decoded down rows
        at::Tensor g = at::zeros({c, I}, opt);
        const int64_t td = dn.tile(gt, H);
        for (int64_t r0 = 0; r0 < H; r0 += td) {
          const int64_t rows = std::min(td, H - r0);
          add_mm(g, dyeg.narrow(1, r0, rows), dn.rows(e, r0, rows, gt, buf));
        }
        at::Tensor gb, ad;
        if (ld.on()) {
          gb = at::mm(dye, ld.b[e]);                                                    // [c, r]
          ad = at::mm(act, ld.a[e].t());                                                // [c, r]
        }
        if (need_w) {
          at::Tensor d = (act * g).sum(1);
          if (ld.on()) d.add_((ad * gb).sum(1), scale);
          AT_DISPATCH_FLOATING_TYPES(ct, "moe_experts_dw", [&] {
            scalar_t* pdw = dw.data_ptr<scalar_t>();
            const scalar_t* pd = d.const_data_ptr<scalar_t>();
            for (int64_t m = 0; m < c; ++m) pdw[po[o + m]] = pd[m];
          });
        }
        if (!chain) continue;
        // down: dact = w·(g + s·gb·A_d); dB_d = s·(w·dy)ᵀ·ad; dA_d = s·(w·gb)ᵀ·act
        at::Tensor dact = g;
        if (ld.on()) {
          const at::Tensor dad = (gb * we).mul_(scale);                                 // s·(dO·B_d)
          if (need_lora) {
            ddb[e].copy_(at::mm((dye * we).t(), ad).mul_(scale));
            dda[e].copy_(at::mm(dad.t(), act));
          }
          dact.addmm_(gb, ld.a[e], 1.0, scale);
        }
        dact.mul_(we);
        // SwiGLU
        at::Tensor dh = at::empty({c, 2 * I}, opt);
        AT_DISPATCH_FLOATING_TYPES(ct, "moe_experts_swiglu_backward", [&] {
          using acc_t = scalar_t;
          const acc_t* pda = dact.const_data_ptr<acc_t>();
          acc_t* pdh = dh.data_ptr<acc_t>();
          AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gt, "moe_experts_swiglu_backward_h", [&] {
            const scalar_t* ph = he.const_data_ptr<scalar_t>();
            for (int64_t m = 0; m < c; ++m)
              for (int64_t j = 0; j < I; ++j)
                fm::moe_swiglu_backward<acc_t>(ph[m * 2 * I + j], ph[m * 2 * I + I + j], pda[m * I + j],
                                               pdh[m * 2 * I + j], pdh[m * 2 * I + I + j]);
          });
        });
        // gate_up: dx = dh·W_gu + s·(dh·B_g)·A_g; dB_g = s·dhᵀ·(x·A_gᵀ); dA_g = s·(dh·B_g)ᵀ·x
        const at::Tensor xe = (lg.on() && need_lora) ? xc.index_select(0, te) : at::Tensor();
        at::Tensor dxe;
        if (lg.on()) {
          const at::Tensor dxa = at::mm(dh, lg.b[e]).mul_(scale);
          if (need_lora) {
            dgb[e].copy_(at::mm(dh.t(), at::mm(xe, lg.a[e].t())).mul_(scale));
            dga[e].copy_(at::mm(dxa.t(), xe));
          }
          if (need_x) dxe = at::mm(dxa, lg.a[e]);
        }
        if (!need_x) continue;
        if (!dxe.defined()) dxe = at::zeros({c, H}, opt);
        const at::Tensor dhg = dh.to(gt);
        const int64_t tg = gu.tile(gt, 2 * I);
        for (int64_t r0 = 0; r0 < 2 * I; r0 += tg) {
          const int64_t rows = std::min(tg, 2 * I - r0);
          add_mm(dxe, dhg.narrow(1, r0, rows), gu.rows(e, r0, rows, gt, buf));
        }
        if (by_chunk) {
          AT_DISPATCH_FLOATING_TYPES(ct, "moe_experts_dx_add", [&] {
            scalar_t* acc = dxs.data_ptr<scalar_t>() + ch * N * H;
            const scalar_t* pd = dxe.const_data_ptr<scalar_t>();
            for (int64_t m = 0; m < c; ++m) {
              scalar_t* an = acc + pt[o + m] * H;
              const scalar_t* dm = pd + m * H;
              for (int64_t d = 0; d < H; ++d) an[d] += dm[d];
            }
          });
        } else {
          dxs.narrow(0, o, c).copy_(dxe);
        }
      }
  });

  at::Tensor dx = at::empty({0}, x.options());
  if (need_x && by_chunk) {  // dx = Σ_chunks, in chunk order
    at::Tensor acc = dxs[0];
    for (int64_t ch = 1; ch < C; ++ch) acc.add_(dxs[ch]);
    dx = acc.to(x.scalar_type());
  } else if (need_x) {  // dx_n = Σ_j dxs[pos(n, j)], slots in order
    std::vector<int64_t> pos(P);
    for (int64_t i = 0; i < P; ++i) pos[po[i]] = i;
    at::Tensor acc = at::empty({N, H}, opt);
    AT_DISPATCH_FLOATING_TYPES(ct, "moe_experts_dx", [&] {
      slot_sum(acc.data_ptr<scalar_t>(), dxs.const_data_ptr<scalar_t>(), pos.data(),
               static_cast<const scalar_t*>(nullptr), N, k, H);
    });
    dx = acc.to(x.scalar_type());
  }
  at::Tensor dwn = need_w ? dw.view({N, k}).to(routing_weights.scalar_type()) : at::empty({0}, opt);
  return {dx, dwn, dga, dgb, dda, ddb};
}

void register_moe_experts(torch::Library& m) {
  m.impl("moe_experts", &moe_experts_cpu);
  m.impl("moe_experts_backward", &moe_experts_backward_cpu);
}

FT_VARIANT_END
}  // namespace fasttrain
