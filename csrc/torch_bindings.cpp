// Every fasttrain op schema, in one place (the vLLM habit): shapes and dtypes above each m.def.
// Implementations register beside their kernels (csrc/cpu/*.cpp, csrc/cuda/*.cu). This file also
// defines the pybind11 module fasttrain._C, whose import loads the library and so registers the ops.
#include <torch/library.h>
#include <torch/extension.h>

#include "ops.h"

TORCH_LIBRARY(fasttrain, m) {
  // ---- nf4 (issue 2): bitsandbytes-compatible NF4 -----------------------------------
  // w [*] fp32|fp16|bf16 -> packed uint8 [ceil(n/2)] (element 2j high nibble), absmax fp32 [ceil(n/bs)]
  m.def("nf4_quantize(Tensor w, int blocksize) -> (Tensor, Tensor)");
  // packed uint8 [ceil(n/2)], absmax fp32 [ceil(n/bs)] -> [numel] of dtype
  m.def("nf4_dequantize(Tensor packed, Tensor absmax, int blocksize, int numel, ScalarType dtype) -> Tensor");
  // x fp32 [n], code fp32 [256] sorted -> q uint8 [n], absmax fp32 [ceil(n/bs)]
  m.def("blockwise8_quantize(Tensor x, Tensor code, int blocksize) -> (Tensor, Tensor)");
  // q uint8 [n], absmax fp32 [ceil(n/bs)], code fp32 [256] -> fp32 [n]
  m.def("blockwise8_dequantize(Tensor q, Tensor absmax, Tensor code, int blocksize) -> Tensor");

  // ---- fused_logprob (issue 3) --------------------------------------------------------

  // ---- policy_loss (issue 4) ----------------------------------------------------------
  // logp, old_logp, ref_logp [B,T] fp32|fp16|bf16 (one dtype); advantages fp32 [B] or [B,T]; mask fp32 [B,T]
  // (0 = inactive, else the token's weight); token_normalizer fp32 [] or [1] (or the float value, used
  // when > 0): the divisor of the token-level loss (GRPO: the number of sequences).
  // loss_type 0 cispo, 1 dapo, 2 grpo. Returns loss fp32 [], stats fp32 [7] (ratio_mean, clip_low_frac,
  // clip_high_frac, cap_frac, kl_mean, repo_r_factor_mean, active_tokens), and for backward the
  // per-token gradient coefficient fp32 [B,T] and per-row scale fp32 [B].
  m.def("policy_loss(Tensor logp, Tensor old_logp, Tensor advantages, Tensor mask, Tensor? ref_logp, "
        "Tensor? token_normalizer, int loss_type, float beta, float eps_low, float eps_high, float cispo_cap, "
        "float zeta, float token_normalizer_value) -> (Tensor, Tensor, Tensor, Tensor)");
  // grad_loss fp32 [], coef fp32 [B,T], rowscale fp32 [B] -> grad_logp [B,T] of dtype
  m.def("policy_loss_backward(Tensor grad_loss, Tensor coef, Tensor rowscale, ScalarType dtype) -> Tensor");

  // ---- nf4_linear (issue 5) -----------------------------------------------------------
}

namespace {
pybind11::dict build_info() {
  pybind11::dict info;
  info["version"] = FASTTRAIN_VERSION;
  info["torch_version"] = TORCH_VERSION;
  pybind11::list backends;
  backends.append("CPU");
#ifdef FASTTRAIN_WITH_CUDA
  backends.append("CUDA");
  info["cuda_archs"] = FASTTRAIN_CUDA_ARCHS;
#else
  info["cuda_archs"] = "";
#endif
  info["backends"] = backends;
  info["cxx_standard"] = static_cast<long>(__cplusplus);
  return info;
}
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fasttrain native extension: ops are registered under torch.ops.fasttrain";
  m.def("build_info", &build_info, "version, torch version, compiled backends, CUDA archs");
}
