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
  // hidden [N,H], weight [V,H] (fp32|fp16|bf16|fp64, same dtype), targets [N] int64, bias [V]?
  // -> logp [N], entropy [N], stats [2,N] = (ref, log s) with lse = ref + log s (fp32; fp64 for fp64
  // inputs), grad_vec [N,H] fp32|fp64 when
  // compute_grad (d logp_n / d h_n = (W[t_n] - sum_v p_nv W[v]) / T), else [0,H]. Tokens whose
  // target == ignore_index give 0 everywhere. chunk_bytes bounds the scratch (0: default).
  m.def("fused_logprob_forward(Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, float temperature, "
        "int ignore_index, bool compute_grad, int chunk_bytes) -> (Tensor, Tensor, Tensor, Tensor)");
  // grad_logp [N] fp32|fp64, stats [2,N] from the forward -> grad_weight [V,H] (weight's dtype),
  // grad_bias [V] fp32|fp64: dW = sum_n g_n (onehot(t_n) - p_n) h_n^T / T, p recomputed per chunk.
  m.def("fused_logprob_backward_weight(Tensor grad_logp, Tensor hidden, Tensor weight, Tensor targets, "
        "Tensor? bias, Tensor stats, float temperature, int ignore_index, int chunk_bytes) -> (Tensor, Tensor)");

  // ---- policy_loss (issue 4) ----------------------------------------------------------

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
