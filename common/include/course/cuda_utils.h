// Torch-free helpers for kernel files (.cu): error propagation and launch sizing.
//
// Launchers return cudaError_t to the glue, which checks it with C10_CUDA_CHECK; kernel code
// itself never throws and never includes torch headers, so it builds with a bare `nvcc -c`.
#pragma once

#include <course/index_math.h>
#include <cuda_runtime_api.h>

#include <cstdint>

// Return the error of a CUDA runtime call to our caller instead of swallowing it. Variadic, so
// a call with template arguments (f<A, B>(x)) passes through the preprocessor whole.
#define COURSE_CUDA_TRY(...)               \
  do {                                     \
    cudaError_t course_err_ = (__VA_ARGS__); \
    if (course_err_ != cudaSuccess) {      \
      return course_err_;                  \
    }                                      \
  } while (0)

namespace course {

// A device attribute of the current device, cached per device and attribute because the query
// is a driver round trip that would otherwise sit in every launch.
template <cudaDeviceAttr kAttr>
inline cudaError_t cached_attribute(int* out) {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {0};
  int device = 0;
  COURSE_CUDA_TRY(cudaGetDevice(&device));
  if (device < kMaxDevices && cached[device] > 0) {
    *out = cached[device];
    return cudaSuccess;
  }
  int value = 0;
  COURSE_CUDA_TRY(cudaDeviceGetAttribute(&value, kAttr, device));
  if (device < kMaxDevices) cached[device] = value;
  *out = value;
  return cudaSuccess;
}

// Streaming multiprocessor count of the current device.
inline cudaError_t sm_count(int* out) { return cached_attribute<cudaDevAttrMultiProcessorCount>(out); }

// Threads the whole device keeps resident at once (SMs x threads per SM: 2048 per SM on sm_80
// and sm_90, 1024 on sm_75): how many blocks of a size can run together, before occupancy
// limits of a particular kernel.
inline cudaError_t resident_threads(int64_t* out) {
  int sms = 0;
  int per_sm = 0;
  COURSE_CUDA_TRY(sm_count(&sms));
  COURSE_CUDA_TRY(cached_attribute<cudaDevAttrMaxThreadsPerMultiProcessor>(&per_sm));
  *out = static_cast<int64_t>(sms) * per_sm;
  return cudaSuccess;
}

// Blocks that keep every SM fully occupied with `kernel` at `block_threads` threads: the grid
// for a grid-stride loop. More blocks than this only queue behind the resident ones.
template <typename Kernel>
cudaError_t resident_grid(Kernel kernel, int block_threads, int64_t* blocks, size_t dynamic_smem = 0) {
  int sms = 0;
  int per_sm = 0;
  COURSE_CUDA_TRY(sm_count(&sms));
  COURSE_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block_threads, dynamic_smem));
  *blocks = static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
  return cudaSuccess;
}

}  // namespace course
