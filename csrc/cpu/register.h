// What each CPU kernel file registers, as functions of its variant (core/variant.h): one function
// per op family, called by register_cpu_kernels (cpu/variant.cpp) of the variant that
// cpu/register.cpp picks at load time. No file of a variant registers anything by itself: a
// static registration in an AVX-512 unit would run AVX-512 code on every host that loads the module.
#pragma once
#include <torch/library.h>

#include "core/variant.h"

namespace fasttrain {
FT_VARIANT_BEGIN

void register_nf4(torch::Library& m);
void register_fused_logprob(torch::Library& m);
void register_policy_loss(torch::Library& m);
void register_nf4_linear(torch::Library& m);
void register_gated_delta(torch::Library& m);
void register_moe_experts(torch::Library& m);
void register_decode_attention(torch::Library& m);
void register_decode_fused(torch::Library& m);
void register_attention_backward(torch::Library& m);

// All of the above: the variant's CPU kernels under the CPU dispatch key.
void register_cpu_kernels(torch::Library& m);

FT_VARIANT_END
}  // namespace fasttrain
