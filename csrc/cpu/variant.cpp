// One variant's CPU kernels, registered together (compiled once per variant, like every file of
// csrc/cpu except register.cpp).
#include "cpu/register.h"

namespace fasttrain {
FT_VARIANT_BEGIN

void register_cpu_kernels(torch::Library& m) {
  register_nf4(m);
  register_fused_logprob(m);
  register_policy_loss(m);
  register_nf4_linear(m);
  register_gated_delta(m);
  register_moe_experts(m);
  register_decode_attention(m);
  register_decode_fused(m);
  register_attention_backward(m);
}

FT_VARIANT_END
}  // namespace fasttrain
