// Plain C++ interface between the torch glue (elementwise_ops.cpp) and the CUDA kernels
// (elementwise_kernels.cu). No torch and no CUDA types here: the glue must also compile on a
// machine without the CUDA toolkit, and the kernels with a bare `nvcc -c`.
#pragma once

#include <cstdint>

namespace cuda_basics {

enum class ElementwiseOp { kAdd, kSaxpy, kRelu };

// The ladder, in teaching order. kUncoalesced is the deliberately bad foil; v1..v4 each fix
// one thing the previous version leaves on the table (see elementwise_kernels.cu).
enum class KernelVersion { kUncoalesced, kV1, kV2, kV3, kV4 };

// The dtypes the kernels are instantiated for. The glue maps at::ScalarType onto this, so the
// pointers below can stay type-erased (FlashAttention's params struct does the same).
enum class DType { kFloat32, kFloat16, kBFloat16, kFloat64 };

struct ElementwiseParams {
  ElementwiseOp op;
  KernelVersion version;
  DType dtype;
  const void* a;  // first input, n contiguous elements
  const void* b;  // second input (nullptr for unary ops)
  void* out;      // n contiguous elements, written exactly once each
  int64_t n;      // may exceed 2^31: every index in the kernels is 64-bit
  double alpha;   // saxpy's scalar; unused by the other ops
};

// The CPU implementation of every op (elementwise_cpu.cpp): the reference semantics in C++,
// taking the same params as the CUDA launcher. `version` is ignored: the ladder is a set of
// GPU thread mappings, and the CPU has one loop.
void elementwise_cpu(const ElementwiseParams& params);

}  // namespace cuda_basics

#if defined(__CUDACC__) || defined(WITH_CUDA)
#include <cuda_runtime_api.h>
namespace cuda_basics {
// Launches params.op with params.version on `stream`. Returns the launch error (or
// cudaSuccess); never synchronizes. n == 0 launches nothing.
cudaError_t launch_elementwise(const ElementwiseParams& params, cudaStream_t stream);
}  // namespace cuda_basics
#endif
