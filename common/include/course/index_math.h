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

// Division by a divisor known only at run time. The compiler's own is a dozen instructions around a
// reciprocal on the special-function unit (I2F, MUFU.RCP, F2I, IMAD.HI, two fix-ups; SASS, sm_90a:
// some 60 cycles in series), because it cannot know the divisor; torch.compile's kernels avoid it
// by being compiled for their sizes, constants. Two ways to avoid it here:
//
// Pow2: p a power of two (a tile's width the launcher picked): i / p = i >> shift, i % p = i & mask.
struct Pow2 {
  int shift;
  int mask;
};
#if defined(__CUDACC__)
__device__ __forceinline__ Pow2 pow2(int p) { return {__ffs(p) - 1, p - 1}; }
#endif

// FastDivmod: any d (a row length), for every i below 2^32, as a multiply-high, an add and a shift:
// the divisor's magic number, worked out once on the host (Granlund and Montgomery, "Division by
// invariant integers using multiplication", 1994: shift = ceil(log2 d), multiplier = floor(2^32
// (2^shift - d) / d) + 1, q = (mulhi(i, multiplier) + i) >> shift, exact for every 32-bit i; the
// add in 64 bits, where it can pass 2^32).
struct FastDivmod {
  uint32_t divisor;
  uint32_t multiplier;
  uint32_t shift;

  FastDivmod() : divisor(1), multiplier(1), shift(0) {}
  explicit FastDivmod(uint32_t d) : divisor(d > 0 ? d : 1), multiplier(0), shift(0) {
    while (shift < 32 && (uint64_t{1} << shift) < divisor) ++shift;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - divisor)) / divisor + 1);
  }
  COURSE_HOST_DEVICE uint32_t div(uint32_t i) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(i, multiplier);
#else
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(i) * multiplier) >> 32);
#endif
    return static_cast<uint32_t>((static_cast<uint64_t>(hi) + i) >> shift);
  }
  COURSE_HOST_DEVICE uint32_t mod(uint32_t i) const { return i - div(i) * divisor; }
};

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
