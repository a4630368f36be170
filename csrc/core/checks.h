// Argument checks shared by every host function. Messages name the op and the argument, so a
// user who passes a wrong tensor reads which one and why (not a CUDA error three calls later).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#define FT_CHECK_ARG(cond, op, arg, ...) \
  TORCH_CHECK(cond, op, ": argument '", arg, "' ", __VA_ARGS__)

#define FT_CHECK_DEFINED(op, t) FT_CHECK_ARG((t).defined(), op, #t, "is undefined")

#define FT_CHECK_DIM(op, t, d) \
  FT_CHECK_ARG((t).dim() == (d), op, #t, "must have ", d, " dimensions, got shape ", (t).sizes())

#define FT_CHECK_CONTIGUOUS(op, t) \
  FT_CHECK_ARG((t).is_contiguous(), op, #t, "must be contiguous (call .contiguous())")

#define FT_CHECK_DTYPE(op, t, dt) \
  FT_CHECK_ARG((t).scalar_type() == (dt), op, #t, "must have dtype ", dt, ", got ", (t).scalar_type())

#define FT_CHECK_FLOATING(op, t)                                                        \
  FT_CHECK_ARG((t).scalar_type() == at::kFloat || (t).scalar_type() == at::kHalf ||   \
                   (t).scalar_type() == at::kBFloat16,                                  \
               op, #t, "must be float32, float16 or bfloat16, got ", (t).scalar_type())

#define FT_CHECK_SAME_DEVICE(op, a, b)                                                  \
  FT_CHECK_ARG((a).device() == (b).device(), op, #b, "must be on ", (a).device(),      \
               " like '", #a, "', got ", (b).device())

#define FT_CHECK_DEVICE_TYPE(op, t, dev) \
  FT_CHECK_ARG((t).device().type() == (dev), op, #t, "must be on ", dev, ", got ", (t).device())
