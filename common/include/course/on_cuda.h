// The glue's one way onto the GPU: run a launch statement under a device guard on the current
// stream, or fail clearly in a build without CUDA kernels (never included by .cu files).
#pragma once

#include <course/checks.h>

#ifdef WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

// Runs the statement(s) after `t` with `stream` bound to t's device's current stream (never the
// default stream: the caller's streams and CUDA graph capture must see the work), under a guard
// for t's device.
#define COURSE_ON_CUDA(op, package, t, ...)                                             \
  do {                                                                                  \
    const c10::cuda::CUDAGuard device_guard((t).device());                              \
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream((t).device().index()); \
    __VA_ARGS__;                                                                        \
  } while (0)
#else
// A CPU-only build: the launchers do not exist, so the statement is compiled out.
#define COURSE_ON_CUDA(op, package, t, ...) ::course::fail_no_cuda_kernels(op, package)
#endif

namespace course {

// The SM count of the GPU a dispatch decides for: a launch on a T4 (40 SMs) or an A100 (108)
// must size its grid, and choose its kernel, for that GPU and not for the H100 the thresholds
// were measured on. Tensors not on a GPU (a CPU call, where the version is only validated; a
// meta tensor) get the H100's, the GPU the course's results were measured on; default_choice
// takes the count as an argument, so a question about another GPU can be asked anywhere.
constexpr int kReferenceSms = 132;

inline int device_sms(const at::Tensor& t) {
#ifdef WITH_CUDA
  if (t.is_cuda()) return at::cuda::getDeviceProperties(t.device().index())->multiProcessorCount;
#endif
  (void)t;
  return kReferenceSms;
}

}  // namespace course
