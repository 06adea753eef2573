// The floating dtypes the course's kernels are instantiated for, as a torch-free enum. The glue
// maps at::ScalarType onto it (course::to_dtype in checks.h), so a chapter's params struct stays
// plain C++ with type-erased pointers, as FlashAttention's does; the launchers map it back onto
// a storage type with with_dtype. One enum for every chapter: one switch to keep in step.
#pragma once

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

namespace course {

enum class DType { kFloat32, kFloat16, kBFloat16, kFloat64 };

#if defined(__CUDACC__)
// Calls f(T{}) with T the storage type of `dtype`: the runtime enum becomes a template argument
// of the kernels here and nowhere else.
template <typename F>
cudaError_t with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(float{});
    case DType::kFloat16: return f(__half{});
    case DType::kBFloat16: return f(__nv_bfloat16{});
    case DType::kFloat64: return f(double{});
  }
  return cudaErrorInvalidValue;
}
#endif

}  // namespace course
