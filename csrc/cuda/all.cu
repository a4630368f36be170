// The CUDA module's kernels as one translation unit, compiled instead of the files it includes when
// FASTTRAIN_UNITY is on (CMakeLists.txt). CMake's unity builds leave CUDA sources out, and every
// nvcc pass (the host one and one per target) parses torch's headers again for each file, which
// costs more than the kernels themselves. Names at namespace scope must differ between these files.
#include "cuda/nf4.cu"
#include "cuda/fused_logprob.cu"
#include "cuda/policy_loss.cu"
#include "cuda/nf4_linear.cu"
#include "cuda/gated_delta.cu"
#include "cuda/moe_experts.cu"
