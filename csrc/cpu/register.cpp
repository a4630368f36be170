// The CPU kernels' registration: picks one compiled variant when the module loads and registers
// its kernels under the CPU dispatch key (and the autograd of policy_loss, for every backend).
//
// The variants (CMakeLists.txt): "default" (x86-64 baseline, SSE2), "avx2" (AVX2 + FMA + F16C)
// and "avx512" (AVX-512 F/BW/VL/DQ), the levels ATen itself dispatches at, with ATen's flags; a
// -march=native build (FASTTRAIN_NATIVE_ARCH=ON, local use only) holds one variant, "native".
// The pick is the level ATen runs at (at::get_cpu_capability(): the host's best, or a lower one
// forced by ATEN_CPU_CAPABILITY) capped by what the CPU has: ATen takes ATEN_CPU_CAPABILITY=avx512
// at its word even on an AVX2 host, and an AVX-512 kernel there would stop at its first
// instruction. So forcing a lower capability runs the matching variant, and the two sides of a
// comparison (ATen's vectorized ops and fasttrain's kernels) are always at one level.
// This file is compiled once, at the baseline, like torch_bindings.cpp: nothing here may use an
// instruction that the weakest host lacks.
#include <ATen/Version.h>
#include <ATen/cpu/Utils.h>
#include <torch/library.h>

#include <string>

#include "core/cpu_variant.h"
#include "core/policy_loss_autograd.h"

namespace fasttrain {

#define FT_DECLARE_VARIANT(ns) \
  namespace ns {               \
  void register_cpu_kernels(torch::Library& m); \
  }
#ifdef FASTTRAIN_CPU_NATIVE
FT_DECLARE_VARIANT(cpu_native)
#else
FT_DECLARE_VARIANT(cpu_default)
#endif
#ifdef FASTTRAIN_CPU_AVX2
FT_DECLARE_VARIANT(cpu_avx2)
#endif
#ifdef FASTTRAIN_CPU_AVX512
FT_DECLARE_VARIANT(cpu_avx512)
#endif
#undef FT_DECLARE_VARIANT

namespace {

struct Variant {
  const char* name;
  void (*register_kernels)(torch::Library&);
};

bool cpu_has(const std::unordered_map<std::string, c10::IValue>& caps, const char* flag) {
  const auto it = caps.find(flag);
  return it != caps.end() && it->second.isBool() && it->second.toBool();
}

Variant pick() {
#ifdef FASTTRAIN_CPU_NATIVE
  return {"native", &cpu_native::register_cpu_kernels};
#else
  [[maybe_unused]] const std::string aten = at::get_cpu_capability();
  [[maybe_unused]] const auto caps = at::cpu::get_cpu_capabilities();
#ifdef FASTTRAIN_CPU_AVX512
  if (aten == "AVX512" && cpu_has(caps, "avx512_f") && cpu_has(caps, "avx512_bw") && cpu_has(caps, "avx512_vl") &&
      cpu_has(caps, "avx512_dq") && cpu_has(caps, "fma3") && cpu_has(caps, "f16c"))
    return {"avx512", &cpu_avx512::register_cpu_kernels};
#endif
#ifdef FASTTRAIN_CPU_AVX2
  if ((aten == "AVX512" || aten == "AVX2") && cpu_has(caps, "avx2") && cpu_has(caps, "fma3") && cpu_has(caps, "f16c"))
    return {"avx2", &cpu_avx2::register_cpu_kernels};
#endif
  return {"default", &cpu_default::register_cpu_kernels};
#endif
}

const Variant& chosen() {
  static const Variant v = pick();
  return v;
}

}  // namespace

const char* cpu_variant() { return chosen().name; }

const char* cpu_variants_compiled() {
#ifdef FASTTRAIN_CPU_NATIVE
  return "native";
#else
  return "default"
#ifdef FASTTRAIN_CPU_AVX2
         ",avx2"
#endif
#ifdef FASTTRAIN_CPU_AVX512
         ",avx512"
#endif
      ;
#endif
}

}  // namespace fasttrain

TORCH_LIBRARY_IMPL(fasttrain, CPU, m) { fasttrain::chosen().register_kernels(m); }

// Autograd for every backend (CPU and CUDA): this module is loaded in every build, the CUDA one not.
TORCH_LIBRARY_IMPL(fasttrain, Autograd, m) {
  m.impl("policy_loss", &fasttrain::policy_loss_autograd);
}
