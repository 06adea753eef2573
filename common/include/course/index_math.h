// Torch-free and CUDA-free arithmetic that both the kernels (.cu) and the glue (.cpp) need:
// the glue decides the dispatch (which depends on alignment and sizes) on machines without the
// CUDA toolkit too, so these cannot live in cuda_utils.h.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define COURSE_HOST_DEVICE __host__ __device__
#else
#define COURSE_HOST_DEVICE
#endif

namespace course {

template <typename T>
COURSE_HOST_DEVICE constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

inline bool is_aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace course
