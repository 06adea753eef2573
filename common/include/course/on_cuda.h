// The glue's one way onto the GPU: run a launch statement under a device guard on the current
// stream, or fail clearly in a build without CUDA kernels (never included by .cu files).
#pragma once

#include <course/checks.h>

#ifdef WITH_CUDA
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
