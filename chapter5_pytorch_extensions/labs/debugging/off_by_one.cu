// The debugging exercise: y = relu(x * scale + bias), a kernel with an off-by-one that writes
// one float past the end of y, and its fixed twin. Chapter 5's debugging walkthrough
// (README.md next to this file) hunts the bug with compute-sanitizer, stops inside the kernel
// with cuda-gdb, and turns it into a device-side assert.
//
// Kept out of every default build on purpose: the course's builds and its nvcc check compile
// chapterN/*.cu, not this folder, and nothing imports it. It is built only by
// `python debugging/debug_lab.py ...` and by debugging/test_debug_lab.py.
//
// EXERCISE. Before reading scale_bias_relu_fixed, run
//     python debugging/debug_lab.py run --broken
// and see the result match PyTorch. Then find the bug in scale_bias_relu_broken:
//   1. Which thread (block, thread) writes where it must not, and at which element of y?
//   2. Why does it need n not to be a multiple of 256 to happen?
//   3. Why does the comparison with PyTorch not notice, and what would?
// `python debugging/debug_lab.py sanitize` answers 1 with the source line; the README walks
// through 2 and 3.
#include "off_by_one.h"

#include <cassert>
#include <cstdint>

namespace {

// Threads per block: 8 warps, the block size every chapter 5 kernel uses. The grid is
// ceil(n / 256) blocks of them, so whenever n is not a multiple of 256 the last block has
// threads with no element of their own.
constexpr int kThreads = 256;

// relu that lets NaN through, as torch.relu does: NaN < 0 is false.
__device__ __forceinline__ float scale_bias_relu(float v, float scale, float bias) {
  const float z = fmaf(v, scale, bias);
  return z < 0.0f ? 0.0f : z;
}

__device__ __forceinline__ int64_t global_index() {
  // 64-bit before the multiply: blockIdx.x * blockDim.x overflows 32 bits past 2^32 elements.
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// BROKEN ON PURPOSE (the exercise). Out-of-range threads load 0 instead of skipping the load,
// so every thread of a warp runs the same instructions down to the store: the way tiled
// kernels stage their inputs. The load and the store are then guarded separately, and two
// guards for one bound are where off-by-ones live.
__global__ void __launch_bounds__(kThreads)
    scale_bias_relu_broken(const float* __restrict__ x, float scale, float bias, float* __restrict__ y, int64_t n) {
  const int64_t i = global_index();
  const float v = i < n ? x[i] : 0.0f;  // the load's guard: threads past the end read nothing
  const float out = scale_bias_relu(v, scale, bias);
  if (i <= n) {  // the store's guard, written by hand a second time
    y[i] = out;
  }
}

// FIXED. One predicate, computed once, guards both accesses. Valid indices are 0 .. n-1, so
// the test is i < n; the broken version let the first spare thread of the last block, the one
// with i == n, store relu(0 * scale + bias) into y[n], 4 bytes past the end of y.
//
// Why nothing noticed: y[0 .. n-1] are all correct, so a comparison with PyTorch passes, and
// y[n] is memory the kernel does not own. With PyTorch's caching allocator it is the rounding
// slack of y's block (sizes round up to 512 bytes) or the start of another tensor, which is
// then silently corrupted. Only a check of the memory around y sees it: a canary element
// after the end (debug_lab.py run), or compute-sanitizer with the caching allocator off
// (debug_lab.py sanitize). And when n is a multiple of 256 no thread has i == n, so tests at
// round sizes can never catch it: test sizes like 1000, 257, 1.
__global__ void __launch_bounds__(kThreads)
    scale_bias_relu_fixed(const float* __restrict__ x, float scale, float bias, float* __restrict__ y, int64_t n) {
  const int64_t i = global_index();
  if (i < n) {  // the grid has up to 255 more threads than elements
    y[i] = scale_bias_relu(x[i], scale, bias);
  }
}

// A store that checks its index with a device-side assert. A failing assert prints the file,
// line, function, block and thread and the condition, then traps: the kernel stops, and the
// CUDA context reports cudaErrorAssert to every call that follows, for the rest of the process.
// Compiled out by -DNDEBUG, like the host's assert. y_numel comes from the caller separately
// from the loop bound n, so the compiler cannot prove the condition and drop the check: what
// debug_lab.py times is a check that really runs (test_debug_lab.py holds the PTX to that).
__device__ __forceinline__ void store_checked(float* y, int64_t i, int64_t y_numel, float value) {
  assert(i < y_numel);
  y[i] = value;
}

// The broken kernel's guards (kOffByOne) or the fixed one's, with every store checked.
template <bool kOffByOne>
__global__ void __launch_bounds__(kThreads)
    scale_bias_relu_asserted(const float* __restrict__ x, float scale, float bias, float* __restrict__ y, int64_t n,
                             int64_t y_numel) {
  const int64_t i = global_index();
  const float v = i < n ? x[i] : 0.0f;            // threads past the end read nothing
  const bool store = kOffByOne ? i <= n : i < n;  // the exercise's bug, or its fix
  if (store) {
    store_checked(y, i, y_numel, scale_bias_relu(v, scale, bias));
  }
}

}  // namespace

extern "C" cudaError_t debug_lab_launch(DebugLabKernel kernel, const float* x, float scale, float bias, float* y,
                                        int64_t n, int64_t y_numel, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;  // a grid of 0 blocks is a launch error
  const unsigned blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  switch (kernel) {
    case kBroken:
      scale_bias_relu_broken<<<blocks, kThreads, 0, stream>>>(x, scale, bias, y, n);
      break;
    case kFixed:
      scale_bias_relu_fixed<<<blocks, kThreads, 0, stream>>>(x, scale, bias, y, n);
      break;
    case kAssertedBroken:
      scale_bias_relu_asserted<true><<<blocks, kThreads, 0, stream>>>(x, scale, bias, y, n, y_numel);
      break;
    case kAsserted:
      scale_bias_relu_asserted<false><<<blocks, kThreads, 0, stream>>>(x, scale, bias, y, n, y_numel);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}
