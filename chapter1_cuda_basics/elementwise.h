// Plain C++ interface between the torch glue (elementwise_ops.cpp) and the CUDA kernels
// (elementwise_kernels.cu). No torch and no CUDA types here: the glue must also compile on a
// machine without the CUDA toolkit, and the kernels with a bare `nvcc -c`.
#pragma once

#include <course/dtype.h>

#include <cstdint>

namespace cuda_basics {

enum class ElementwiseOp { kAdd, kSaxpy, kRelu };

// The ladder, in teaching order. kUncoalesced is the deliberately bad foil; v1..v5 each fix
// one thing the previous version leaves on the table (see elementwise_kernels.cu).
enum class KernelVersion { kUncoalesced, kV1, kV2, kV3, kV4, kV5 };

// The launch shape of the one-pass vectorized kernel that v4 and v5 share: threads per block,
// and 16-byte vectors each thread moves per input (loaded before any is used). v4 is always
// {256, 4}; v5 is kV5Launch below, the shape the tuning sweep found fastest.
struct VectorLaunch {
  int threads = 0;
  int vectors = 0;  // 1, 2 or 4: the kernel is instantiated for these
};

// The dtypes the kernels are instantiated for (course/dtype.h): the glue maps at::ScalarType
// onto it, so the pointers below can stay type-erased (FlashAttention's params struct does the same).
using DType = ::course::DType;

struct ElementwiseParams {
  ElementwiseOp op;
  KernelVersion version;
  DType dtype;
  const void* a;  // first input, n contiguous elements
  const void* b;  // second input (nullptr for unary ops)
  void* out;      // n contiguous elements, written exactly once each
  int64_t n;      // may exceed 2^31: every index in the kernels is 64-bit
  double alpha;   // saxpy's scalar; unused by the other ops
  // v5 only: a launch shape to use instead of kV5Launch (tune_cuda_basics.py measures shapes
  // through it); threads == 0 means kV5Launch.
  VectorLaunch launch;
};

// The CPU implementation of every op (elementwise_cpu.cpp): the reference semantics in C++,
// taking the same params as the CUDA launcher. `version` is ignored: the ladder is a set of
// GPU thread mappings, and the CPU has one loop.
void elementwise_cpu(const ElementwiseParams& params);

// ---------------------------------------------------------------------------------------------
// version=None: which rung, and which launch shape, for this call.
//
// The one place where the chapter decides. Plain C++ (no CUDA), so the glue can report the
// choice on any machine (cuda_basics.default_choice) and the tests can hold every threshold.
// The thresholds come from measurements on the H100 (tune_cuda_basics.py for the launch
// shapes, the benchmark's size sweep for the rungs); the README's "version=None" section shows
// the curves they were read from.
// ---------------------------------------------------------------------------------------------

// v5's launch shape: one 16-byte vector per thread, 256 threads per block, one pass over the
// data. tune_cuda_basics.py timed vector_add in every shape of {64, 128, 256, 512} threads x
// {1, 2, 4} vectors at every size from 2^16 to 2^28, float32 and bfloat16
// (results/<gpu>/chapter1_cuda_basics_tuning.json): this shape was within a few percent of the
// fastest at every size, while v4's 256 x 4 fell far behind below 2^22 (too few blocks to
// cover the SMs). No size threshold on aligned inputs earned its complexity: the remaining
// differences between shapes were a percent or two.
constexpr VectorLaunch kV5Launch{256, 1};

// Misaligned views (x[1:]: every pointer 2-8 bytes past a 16-byte boundary) cannot use 16-byte
// accesses. v5 then runs its scalar form, the same 16 bytes per thread in flight as single
// elements (elementwise_kernels.cu): 8 elements per thread in 2-byte dtypes, 2048 per block.
// The benchmark's misaligned sweep (README, "version=None") measured it against the scalar
// rungs v1 and v2: from 2^20 elements on it is the fastest in every dtype, well ahead of v2,
// but below, a 2-byte view has too few of those blocks to cover the SMs (32 at 2^16, the
// problem v4 has on aligned inputs), and v1's one element per thread and 8x the blocks was
// faster at 2^16 and 2^18. The threshold sits between the measured 2^18 and 2^20. In float32
// v5 has twice the blocks and kept within a few percent of v1 at every size; float64 (not in
// the sweep) has four times the blocks of the 2-byte case and takes v5 too.
constexpr int64_t kMisalignedSmallBelow = int64_t{1} << 19;

inline KernelVersion default_version(int64_t n, int elem_bytes, bool aligned) {
  if (!aligned && elem_bytes <= 2 && n < kMisalignedSmallBelow) return KernelVersion::kV1;
  return KernelVersion::kV5;
}

}  // namespace cuda_basics

#if defined(__CUDACC__) || defined(WITH_CUDA)
#include <cuda_runtime_api.h>
namespace cuda_basics {
// Launches params.op with params.version on `stream`. Returns the launch error (or
// cudaSuccess); never synchronizes. n == 0 launches nothing.
cudaError_t launch_elementwise(const ElementwiseParams& params, cudaStream_t stream);
}  // namespace cuda_basics
#endif
