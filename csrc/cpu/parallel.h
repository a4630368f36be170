// fasttrain's CPU kernels split their work with `parallel_for`: ATen's at::parallel_for on the
// intra-op thread pool (OpenMP: the kernel units are built with -fopenmp, on torch's own libgomp),
// with the caller's thread-local state carried into every worker. A kernel that calls ATen ops
// inside its loop (at::mm on a tile) needs it: on a pool thread the dispatcher's thread-local
// state (autograd already handled, inference mode, grad mode) is not the caller's, so the op would
// be dispatched to autograd again and refuse its out= arguments.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include "core/variant.h"

namespace fasttrain {
FT_VARIANT_BEGIN

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const at::ThreadLocalState state;
  at::parallel_for(begin, end, grain, [&](int64_t lo, int64_t hi) {
    at::ThreadLocalStateGuard guard(state);
    f(lo, hi);
  });
}

FT_VARIANT_END
}  // namespace fasttrain
