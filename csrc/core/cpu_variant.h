// Which compiled variant of the CPU kernels runs in this process (csrc/cpu/register.cpp picks it
// once, when the module loads): "default", "avx2", "avx512", or "native" for a -march=native build.
#pragma once

namespace fasttrain {

// The variant the CPU dispatch key runs.
const char* cpu_variant();
// The variants this module holds, comma-separated, lowest first ("default,avx2,avx512").
const char* cpu_variants_compiled();

}  // namespace fasttrain
