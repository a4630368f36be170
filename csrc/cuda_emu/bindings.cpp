// The CUDA emulator's extension module, fasttrain._C_emu: a development and test artefact, built
// beside fasttrain._C by an in-place build and never shipped in a wheel. Its ops live under
// torch.ops.fasttrain_emu on CPU tensors: every fasttrain op that has CUDA kernels, with the CUDA
// op's schema (copied from torch.ops.fasttrain when tests/cuda_emu/emulator.py loads the module, so
// a schema has one home), and below the few entry points the CUDA ops reach only from inside
// (the NF4 linear's forward launch sequence, its decode path and the DoRA norm kernel) and the
// broken fixtures.
#include "cuda_emu/prelude.h"

#include <torch/extension.h>
#include <torch/library.h>

#include "cuda_emu/device.h"

TORCH_LIBRARY(fasttrain_emu, m) {
  // The CUDA op's forward launch sequence: x [M, K] fp32|fp16|bf16 (any M: the decode path for M <= 64,
  // else the prefill path), W NF4 [N, K]; lora_a [r, K] with lora_b [N, r] fp32 (LoRA), g [N] fp32
  // (DoRA's scale) -> (y [M, N] x's dtype, xa = x·Aᵀ [M, r] fp32 ([0, 0] without adapters), z as below).
  m.def("nf4_linear_forward(Tensor x, Tensor packed, Tensor absmax, int blocksize, int out_features, Tensor? lora_a, "
        "Tensor? lora_b, float scale, Tensor? g, bool want_z) -> (Tensor, Tensor, Tensor)");
  // x [M, K] (M <= 64) fp32|fp16|bf16, W NF4 [N, K]; xa [M, r] fp32 with lora_b [N, r] fp32 (LoRA),
  // g [N] fp32 (DoRA's scale) -> (y [M, N] x's dtype, z [M, N] = y before g when want_z, else [0]).
  m.def("nf4_linear_decode(Tensor x, Tensor packed, Tensor absmax, int blocksize, int out_features, Tensor? xa, "
        "Tensor? lora_b, float scale, Tensor? g, bool want_z) -> (Tensor, Tensor)");
  // wsq, cross, bab [N] fp32|fp64 -> sqrt(max(wsq + 2 s cross + s^2 bab, 0)) [N]
  m.def("dora_norm_kernel(Tensor wsq, Tensor cross, Tensor bab, float scale) -> Tensor");
  // Runs the named fixture kernel (fixtures.cpp) -> what it wrote, fp32 [256].
  m.def("fixture(str name) -> Tensor");
}

namespace {
pybind11::dict counters() {
  const cuda_emu::Counters c = cuda_emu::counters();
  pybind11::dict d;
  d["launches"] = c.launches;
  d["blocks"] = c.blocks;
  d["switches"] = c.switches;
  d["barriers"] = c.barriers;
  d["warp_ops"] = c.warp_ops;
  return d;
}
}  // namespace

PYBIND11_MODULE(_C_emu, m) {
  m.doc() = "fasttrain's CUDA kernels on a CPU emulator (tests only): ops under torch.ops.fasttrain_emu";
  m.def(
      "set_schedule",
      [](int order, uint64_t seed) {
        TORCH_CHECK(order >= 0 && order <= 2, "set_schedule: order must be 0 (forward), 1 (reverse) or 2 (seeded)");
        cuda_emu::set_schedule({static_cast<cuda_emu::Order>(order), seed});
      },
      pybind11::arg("order"), pybind11::arg("seed") = 1,
      "threads and blocks in order (0), in reverse (1) or shuffled from `seed` at every round (2)");
  m.def(
      "set_grid_cap",
      [](int blocks) {
        TORCH_CHECK(blocks >= 1 && blocks <= cuda_emu::kDefaultGridCap, "set_grid_cap: blocks must be in [1, 524280]");
        cuda_emu::set_grid_cap(blocks);
      },
      pybind11::arg("blocks"),
      "the most blocks a grid-stride kernel's launch gets (8 x 65535 by default, as on a GPU)");
  m.def("grid_cap", &cuda_emu::grid_cap, "the grid-stride launches' block cap now in force");
  m.def("counters", &counters, "launches, blocks, fiber switches, barriers and warp exchanges so far");
  m.def("reset_counters", &cuda_emu::reset_counters);
  m.def("set_multiprocessors", &fasttrain::cuda_emu::set_multiprocessors,
        "the SM count the launch sequences see (132 by default)");
  m.def("last_scratch_bytes", &fasttrain::cuda_emu::last_scratch_bytes,
        "device scratch the last emulated op asked for, in bytes");
}
