// Broken kernels the CUDA emulator must refuse, each beside a correct twin it must accept, so that a
// refusal is seen to come from the defect and not from the harness. fasttrain_emu::fixture(name)
// runs one and returns what it wrote (tests/cuda_emu/test_emulator.py says what each must give).
#include "cuda_emu/prelude.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <functional>
#include <map>
#include <string>

#include "cuda/common.cuh"

namespace fasttrain::cuda_emu {
namespace {
namespace fc = fasttrain::cuda;

// A block sum through static shared memory; without the barrier thread 0 reads slots other warps
// have not written yet (0xFF poison: NaN).
template <bool kBarrier>
__global__ void block_sum(const float* in, float* out, int n) {
  FT_SHARED(float, partial, [8]);
  float v = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) v += in[i];
  v = fc::warp_sum(v);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  if (kBarrier) __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int w = 0; w < 8; ++w) s += partial[w];
    *out = s;
  }
}

// Each thread reads its neighbour's slot of dynamic shared memory.
template <bool kBarrier>
__global__ void rotate(const float* in, float* out, int n) {
  FT_DYNAMIC_SHARED(float, s);
  s[threadIdx.x] = in[threadIdx.x];
  if (kBarrier) __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 1) % n];
}

// A warp reduction that half the warp skips.
__global__ void divergent_shuffle(float* out) {
  float v = 1.0f;
  if (threadIdx.x % 32 < 16) v = fc::warp_sum(v);
  out[threadIdx.x] = v;
}

// Lanes 0-15 exchange with lanes 16-31, which are not in the mask.
__global__ void read_outside_mask(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x < 16) v = __shfl_xor_sync(0x0000ffffu, v, 16);
  out[threadIdx.x] = v;
}

// The same exchange within lanes 0-15 (xor 8 stays inside the mask).
__global__ void read_inside_mask(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x < 16) v = __shfl_xor_sync(0x0000ffffu, v, 8);
  out[threadIdx.x] = v;
}

// Two __syncthreads, one per branch.
__global__ void divergent_barrier(float* out) {
  if (threadIdx.x < 64) {
    out[threadIdx.x] = 1.0f;
    __syncthreads();
  } else {
    __syncthreads();
  }
}

// A full-warp mask in a block of 48 threads: the second warp has 16 lanes.
__global__ void mask_names_missing_lanes(float* out) { out[threadIdx.x] = fc::warp_sum(1.0f); }

// Lane 0 leaves while the others wait for it at a shuffle.
__global__ void exit_while_awaited(float* out) {
  if (threadIdx.x == 0) return;
  out[threadIdx.x] = __shfl_sync(0xffffffffu, 1.0f, 1);
}

// A kernel that declares its dynamic shared memory as bytes and reads doubles from it (the old
// gated-delta declaration); only the alignment sanitizer of `make test-emu-asan` sees it.
__global__ void bytes_read_as_doubles(double* out) {
  FT_DYNAMIC_SHARED(unsigned char, raw);
  double* d = reinterpret_cast<double*>(raw);
  d[threadIdx.x] = threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = d[(threadIdx.x + 1) % blockDim.x];
}

at::Tensor run(const std::string& name) {
  const at::Tensor ones = at::ones({1000}, at::kFloat);
  at::Tensor out = at::zeros({256}, at::kFloat);
  const float* in = ones.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* first = o;
  const std::map<std::string, std::function<void()>> cases = {
      {"block_sum", [&] { fc::launch(block_sum<true>, 1, 256, 0, nullptr, in, first, 1000); }},
      {"block_sum_without_barrier", [&] { fc::launch(block_sum<false>, 1, 256, 0, nullptr, in, first, 1000); }},
      {"rotate", [&] { fc::launch(rotate<true>, 1, 64, 64 * sizeof(float), nullptr, in, o, 64); }},
      {"rotate_without_barrier", [&] { fc::launch(rotate<false>, 1, 64, 64 * sizeof(float), nullptr, in, o, 64); }},
      {"divergent_shuffle", [&] { fc::launch(divergent_shuffle, 1, 64, 0, nullptr, o); }},
      {"read_outside_mask", [&] { fc::launch(read_outside_mask, 1, 32, 0, nullptr, o); }},
      {"read_inside_mask", [&] { fc::launch(read_inside_mask, 1, 32, 0, nullptr, o); }},
      {"divergent_barrier", [&] { fc::launch(divergent_barrier, 1, 128, 0, nullptr, o); }},
      {"mask_names_missing_lanes", [&] { fc::launch(mask_names_missing_lanes, 1, 48, 0, nullptr, o); }},
      {"exit_while_awaited", [&] { fc::launch(exit_while_awaited, 1, 32, 0, nullptr, o); }},
      {"too_much_dynamic_shared",
       [&] { fc::launch(rotate<true>, 1, 64, size_t(60) << 10, nullptr, in, o, 64); }},
      {"empty_grid", [&] { fc::launch(block_sum<true>, 0, 256, 0, nullptr, in, first, 1000); }},
      {"threads_1025", [&] { fc::launch(block_sum<true>, 1, 1025, 0, nullptr, in, first, 1000); }},
      {"bytes_read_as_doubles", [&] {
         at::Tensor d = at::zeros({64}, at::kDouble);
         fc::launch(bytes_read_as_doubles, 1, 64, 64 * sizeof(double), nullptr, d.data_ptr<double>());
         out.narrow(0, 0, 64).copy_(d);
       }},
  };
  const auto it = cases.find(name);
  TORCH_CHECK(it != cases.end(), "fasttrain_emu::fixture: no fixture named '", name, "'");
  it->second();
  return out;
}
}  // namespace

// A fixture takes no tensor, so it has no dispatch key of its own.
TORCH_LIBRARY_IMPL(fasttrain_emu, CompositeExplicitAutograd, m) { m.impl("fixture", &run); }

}  // namespace fasttrain::cuda_emu
