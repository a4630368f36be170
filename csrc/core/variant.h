// The CPU kernels (csrc/cpu/*.cpp) are compiled once per x86-64 level ATen dispatches (DEFAULT,
// AVX2, AVX-512; CMakeLists.txt), each translation unit with -DFASTTRAIN_CPU_VARIANT=<name>.
// Everything fasttrain defines in those units, the inline functions of the headers they include
// (core/math.h, core/*_checks.h) among them, lives in the inline namespace of that name, so each
// variant's copy is its own symbol. Without it the variants would define the same inline functions
// compiled for different instruction sets, and the linker would keep one copy for all of them (a
// one-definition-rule clash: an AVX-512 copy called on an AVX2 host is an illegal instruction).
// Outside the variants (torch_bindings.cpp, csrc/cpu/register.cpp, the CUDA files) the macros are
// empty. Inline functions of ATen, c10 and the standard library are left to the link order: the
// baseline objects come first, and the linker keeps the first copy (tests/ops/test_cpu_variants.py
// disassembles the result).
#pragma once

#ifdef FASTTRAIN_CPU_VARIANT
#define FT_VARIANT_BEGIN inline namespace FASTTRAIN_CPU_VARIANT {
#define FT_VARIANT_END }
#else
#define FT_VARIANT_BEGIN
#define FT_VARIANT_END
#endif
