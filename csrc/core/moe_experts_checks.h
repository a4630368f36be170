// Argument checks of fasttrain::moe_experts and moe_experts_backward: the sizes of one call read off
// its tensors, every mismatch an error that names the argument. Shared by every backend's host
// function; the device-type check stays in each backend.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

#include "core/checks.h"
#include "core/variant.h"

namespace fasttrain {
FT_VARIANT_BEGIN

// Sizes of one moe_experts call: x [N, H], k slots, E experts of intermediate width I, LoRA ranks.
struct MoEArgs {
  int64_t N, H, k, E, I, r_gu, r_dn;
  bool gu_nf4, dn_nf4;
};

// One stack: NF4 (uint8 [E, ceil(out·in/2)] with absmax fp32 [E, ceil(out·in/bs)]) or 16-bit/fp32/
// fp64 [E, out, in]. Returns whether it is NF4.
inline bool check_moe_stack(const char* op, const char* name, const at::Tensor& w,
                            const std::optional<at::Tensor>& absmax, int64_t E, int64_t out, int64_t in,
                            int64_t blocksize) {
  if (absmax.has_value()) {
    const int64_t numel = out * in;
    FT_CHECK_ARG(w.scalar_type() == at::kByte && w.dim() == 2 && w.size(0) == E && w.size(1) == (numel + 1) / 2,
                 op, name, "as NF4 must be uint8 [E=", E, ", ", (numel + 1) / 2, "] for [", out, ", ", in,
                 "] experts, got ", w.scalar_type(), " ", w.sizes());
    FT_CHECK_ARG(absmax->scalar_type() == at::kFloat && absmax->dim() == 2 && absmax->size(0) == E &&
                     absmax->size(1) == (numel + blocksize - 1) / blocksize,
                 op, name, "'s absmax must be float32 [E=", E, ", ", (numel + blocksize - 1) / blocksize,
                 "], got ", absmax->scalar_type(), " ", absmax->sizes());
    TORCH_CHECK(blocksize >= 2 && blocksize % 2 == 0, op, ": blocksize must be even and >= 2, got ", blocksize);
    return true;
  }
  FT_CHECK_ARG(w.is_floating_point() && w.dim() == 3 && w.size(0) == E && w.size(1) == out && w.size(2) == in,
               op, name, "must be a floating [E=", E, ", ", out, ", ", in, "] stack, got ", w.scalar_type(), " ",
               w.sizes());
  return false;
}

// A stack's LoRA factors A [E, r, in], B [E, out, r] (both or neither); returns r (0 without).
inline int64_t check_moe_lora(const char* op, const char* name, const std::optional<at::Tensor>& a,
                              const std::optional<at::Tensor>& b, int64_t E, int64_t out, int64_t in) {
  FT_CHECK_ARG(a.has_value() == b.has_value(), op, name, "needs both factors A and B or neither");
  if (!a.has_value()) return 0;
  FT_CHECK_ARG(a->is_floating_point() && b->is_floating_point() && a->dim() == 3 && b->dim() == 3 &&
                   a->size(0) == E && b->size(0) == E && a->size(2) == in && b->size(1) == out &&
                   a->size(1) == b->size(2),
               op, name, "must be floating A [E=", E, ", r, ", in, "] and B [E, ", out, ", r], got ", a->sizes(),
               " and ", b->sizes());
  return a->size(1);
}

inline MoEArgs check_moe_args(const char* op, const at::Tensor& x, const at::Tensor& expert_index,
                              const at::Tensor& routing_weights, const at::Tensor& gate_up,
                              const std::optional<at::Tensor>& gate_up_absmax, const at::Tensor& down,
                              const std::optional<at::Tensor>& down_absmax, int64_t blocksize, int64_t I,
                              const std::optional<at::Tensor>& gu_a, const std::optional<at::Tensor>& gu_b,
                              const std::optional<at::Tensor>& dn_a, const std::optional<at::Tensor>& dn_b) {
  FT_CHECK_DIM(op, x, 2);
  FT_CHECK_ARG(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16 ||
                   x.scalar_type() == at::kDouble,
               op, "x", "must be float64, float32, float16 or bfloat16, got ", x.scalar_type());
  FT_CHECK_ARG(expert_index.scalar_type() == at::kLong && expert_index.dim() == 2 &&
                   expert_index.size(0) == x.size(0),
               op, "expert_index", "must be int64 [N=", x.size(0), ", k], got ", expert_index.scalar_type(), " ",
               expert_index.sizes());
  FT_CHECK_ARG(routing_weights.is_floating_point() && routing_weights.sizes() == expert_index.sizes(), op,
               "routing_weights", "must be floating with expert_index's shape ", expert_index.sizes(), ", got ",
               routing_weights.scalar_type(), " ", routing_weights.sizes());
  MoEArgs a{x.size(0), x.size(1), expert_index.size(1), gate_up.size(0), I, 0, 0, false, false};
  FT_CHECK_ARG(a.H > 0 && a.I > 0 && a.E > 0, op, "x", "needs H > 0, I > 0 and E > 0, got H=", a.H, " I=", a.I,
               " E=", a.E);
  a.gu_nf4 = check_moe_stack(op, "gate_up", gate_up, gate_up_absmax, a.E, 2 * a.I, a.H, blocksize);
  a.dn_nf4 = check_moe_stack(op, "down", down, down_absmax, a.E, a.H, a.I, blocksize);
  a.r_gu = check_moe_lora(op, "gate_up_lora", gu_a, gu_b, a.E, 2 * a.I, a.H);
  a.r_dn = check_moe_lora(op, "down_lora", dn_a, dn_b, a.E, a.H, a.I);
  for (const at::Tensor* t : {&expert_index, &routing_weights, &gate_up, &down}) {
    FT_CHECK_ARG(t->device() == x.device(), op, "every tensor", "must be on ", x.device(), ", got one on ",
                 t->device());
  }
  return a;
}

// The backward's dy [N, H] and the forward's saved tensors (order [P], offsets [E + 1], h [P, 2I] and,
// where the forward keeps them (out_saved: the CUDA kernel), out [P, H], in the compute dtype ct: the
// forward must have run with save=True).
inline void check_moe_backward_args(const char* op, const MoEArgs& a, const at::Tensor& dy, const at::Tensor& order,
                                    const at::Tensor& offsets, const at::Tensor& h, const at::Tensor& out,
                                    at::ScalarType ct, bool out_saved = true) {
  const int64_t P = a.N * a.k;
  FT_CHECK_ARG(dy.dim() == 2 && dy.size(0) == a.N && dy.size(1) == a.H && dy.is_floating_point(), op, "dy",
               "must be floating [", a.N, ", ", a.H, "], got ", dy.scalar_type(), " ", dy.sizes());
  FT_CHECK_ARG(order.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && order.numel() == P &&
                   offsets.numel() == a.E + 1 && h.numel() == P * 2 * a.I && h.scalar_type() == ct &&
                   (!out_saved || (out.numel() == P * a.H && out.scalar_type() == ct)),
               op, "order/offsets/h/out", "must be the forward's saved tensors (run it with save=True)");
  for (const at::Tensor* t : {&dy, &order, &offsets, &h, &out})
    FT_CHECK_ARG(t->device() == dy.device(), op, "dy and the saved tensors", "must be on one device, got ",
                 dy.device(), " and ", t->device());
}

FT_VARIANT_END
}  // namespace fasttrain
