// dtype dispatch, wrapped once (as vLLM's dispatch_utils.h does) so every op accepts the same set.
#pragma once
#include <ATen/Dispatch.h>

// float32, float16, bfloat16 inputs; scalar_t is the element type inside the lambda.
#define FT_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)
