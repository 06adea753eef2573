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

// Lanes of a warp that a column tile of `inner` columns keeps busy when each lane takes `cols`
// adjacent columns: the power of two at or above inner / cols, at most 32. Below 32 a warp lays
// itself over 32 / lanes rows at once (course/column_reduce.cuh); the glue's dispatch asks too.
inline int column_tile_lanes(int64_t inner, int cols) {
  const int64_t need = ceil_div<int64_t>(inner, cols);
  int lanes = 1;
  while (lanes < 32 && lanes < need) lanes *= 2;
  return lanes;
}

}  // namespace course
