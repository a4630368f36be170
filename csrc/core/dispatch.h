// dtype dispatch, wrapped once (as vLLM's dispatch_utils.h does) so every op accepts the same set.
#pragma once
#include <ATen/Dispatch.h>

// float32, float16, bfloat16 inputs; scalar_t is the element type inside the lambda. No float64
// case: the ops that use it reject float64 in their checks, so no double kernel is instantiated.
#define FT_DISPATCH_FLOATING(TYPE, NAME, ...)                 \
  AT_DISPATCH_SWITCH(TYPE, NAME,                              \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))
