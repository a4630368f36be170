// First include of every CUDA emulator translation unit: the emulator runtime, then core/math.h with
// the device branches taken (as nvcc takes them in device code: the libm expf where the CPU kernels
// use their own polynomial), so kernels here compute what they compute on the GPU.
#pragma once
#include "cuda_emu/runtime.h"

#define __CUDA_ARCH__ 900
#include "core/math.h"
#undef __CUDA_ARCH__
