// Stand-in for the CUDA toolkit header of this name: kernel sources compiled by the CUDA emulator
// include it as they include the real one under nvcc.
#pragma once
#include "cuda_emu/runtime.h"
