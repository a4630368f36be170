// The pybind11 module fasttrain._C_cuda: the CUDA kernels (csrc/cuda/*.cu register themselves under
// the CUDA dispatch key when this library loads), built and loaded apart from fasttrain._C so a
// CPU-only torch, which has no libtorch_cuda or libcudart to link against, still imports
// fasttrain and runs its CPU kernels. fasttrain._native loads it after fasttrain._C (which holds
// the op schemas) whenever torch is a CUDA build.
#include <torch/extension.h>

#include <cuda_runtime_api.h>

namespace {
pybind11::dict build_info() {
  pybind11::dict info;
  info["version"] = FASTTRAIN_VERSION;
  info["torch_version"] = TORCH_VERSION;
  info["cuda_archs"] = FASTTRAIN_CUDA_ARCHS;  // SASS targets, e.g. "80,90a"
  info["cuda_ptx"] = FASTTRAIN_CUDA_PTX;      // PTX kept for newer GPUs to JIT, e.g. "80"
  info["cuda_runtime"] = static_cast<long>(CUDART_VERSION);
  return info;
}
}  // namespace

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "fasttrain native extension (CUDA): the CUDA kernels of torch.ops.fasttrain";
  m.def("build_info", &build_info, "version, torch version, CUDA archs and PTX it was compiled for");
}
