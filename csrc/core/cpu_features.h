// What the CPU kernels may use on this host, decided once and read by both the kernels and Python
// (fasttrain._C.cpu_has_bf16), so the two never disagree.
//
// bfloat16 GEMMs are worth it on a CPU only with the avx512_bf16 instructions (about 2x the fp32
// rate); without them a bf16 GEMM is ~10x slower than fp32, so bf16 inputs are computed in fp32.
// The answer follows ATen's own view of the host: the avx512_bf16 flag from its cpuinfo, and the
// vector level ATen dispatches at (ATEN_CPU_CAPABILITY). Setting ATEN_CPU_CAPABILITY=avx2 on an
// AVX-512 host therefore runs the path an AVX2 host runs, which is how the tests cover both.
#pragma once
#include <ATen/Version.h>
#include <ATen/cpu/Utils.h>

#include <string>

#include "core/variant.h"

namespace fasttrain {
FT_VARIANT_BEGIN

inline bool cpu_has_bf16() {
  static const bool has = [] {
#if defined(__x86_64__) || defined(_M_X64)
    const auto caps = at::cpu::get_cpu_capabilities();
    const auto it = caps.find("avx512_bf16");
    const bool flag = it != caps.end() && it->second.isBool() && it->second.toBool();
    return flag && at::get_cpu_capability() == "AVX512";
#else
    return false;
#endif
  }();
  return has;
}

FT_VARIANT_END
}  // namespace fasttrain
