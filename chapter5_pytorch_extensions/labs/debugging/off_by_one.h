// The debugging exercise's one entry point, shared by off_by_one.cu and the torch binding
// (debug_lab_ops.cpp). Plain C++ and the CUDA runtime: no torch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

// Which kernel of off_by_one.cu to launch; debug_lab.py names them by the same words.
enum DebugLabKernel : int {
  kBroken = 0,          // the exercise: passes every check against PyTorch, and is wrong
  kFixed = 1,           // its fixed twin
  kAssertedBroken = 2,  // the broken guard, with a device assert on the store index
  kAsserted = 3,        // the fixed guard, with the same assert (what the assert costs)
};

// y = relu(x * scale + bias) over n floats, one thread per element, on `stream`. y_numel is the
// size of y's allocation as the caller knows it, which only the asserting kernels read.
//
// C linkage: an unmangled name is what one types at a debugger prompt (`break
// debug_lab_launch`) and what ctypes or another language can call without torch. Hidden
// visibility: debug_lab.py loads two builds of this file into one process (with and without
// NDEBUG), and each binding must call its own library's launcher, never the first one loaded.
extern "C" __attribute__((visibility("hidden"))) cudaError_t debug_lab_launch(DebugLabKernel kernel, const float* x,
                                                                               float scale, float bias, float* y,
                                                                               int64_t n, int64_t y_numel,
                                                                               cudaStream_t stream);
