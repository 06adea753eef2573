// The CPU implementations' dtype dispatch: the element type of a course::DType, and the type
// its arithmetic accumulates in (float for the 16-bit types, as on the GPU; double for double).
// The counterpart of dtype.h's CUDA dispatch, for the chapters' *_cpu.cpp files.
//
// Header-only types only, no libtorch symbol: chapter 5 compiles its CPU twin into a
// stable-ABI library too, which must not link against any libtorch C++ function.
#pragma once

#include <course/dtype.h>

// torch/headeronly holds the 16-bit types from torch 2.9 on; older releases keep them in c10.
#if __has_include(<torch/headeronly/util/BFloat16.h>)
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>
#else
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#endif

namespace course {

template <typename T>
struct CpuAcc {
  using type = float;
};
template <>
struct CpuAcc<double> {
  using type = double;
};

// Calls f(T{}) with the element type of `dtype`, over the four dtypes the chapters support
// (the glue has refused any other before a kernel is called).
template <typename F>
void with_cpu_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(float{});
    case DType::kFloat16: return f(c10::Half{});
    case DType::kBFloat16: return f(c10::BFloat16{});
    case DType::kFloat64: return f(double{});
  }
}

}  // namespace course
