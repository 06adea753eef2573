// Plain C++ interface between the torch glue (memory_ops.cpp) and the CUDA kernels
// (memory_kernels.cu). No torch and no CUDA types here: the glue must also compile on a
// machine without the CUDA toolkit, and the kernels with a bare `nvcc -c`.
//
// Every op of this chapter only moves data, so the kernels never look at values: they are
// instantiated per element *size* (2, 4 or 8 bytes), not per dtype. float16 and bfloat16 run
// the same 2-byte kernels, float64 the 8-byte ones.
#pragma once

#include <cstdint>

namespace memory_ops {

// copy's ladder (memory_kernels.cu): one element per thread per grid-stride step, then
// 16 bytes per access with several accesses in flight.
enum class CopyVersion { kScalar, kVectorized };

// transpose's ladder, in teaching order (memory_kernels.cu says what each one fixes).
enum class TransposeVersion { kNaive, kTiled, kTiledPadded, kWideTiles };

struct CopyParams {
  CopyVersion version;
  int elem_bytes;   // 2, 4 or 8
  const void* src;  // n contiguous elements
  void* dst;        // n contiguous elements, written exactly once each
  int64_t n;        // may exceed 2^31: indices are 64-bit
};

// dst[i] = src[i * stride] for i < n_out: the elements a strided view would see.
struct StridedCopyParams {
  int elem_bytes;
  const void* src;  // contiguous, at least (n_out - 1) * stride + 1 elements
  void* dst;        // n_out contiguous elements
  int64_t n_out;
  int64_t stride;   // >= 1
};

// dst[b][c][r] = src[b * batch_stride + r * row_stride + c * col_stride]: the last two dims
// of a (batch, rows, cols) tensor swapped into a contiguous (batch, cols, rows) one. The
// source strides are read as they are, so a non-contiguous input needs no copy first.
struct TransposeParams {
  TransposeVersion version;
  int elem_bytes;
  const void* src;
  void* dst;
  int64_t batch, rows, cols;
  int64_t batch_stride, row_stride, col_stride;  // source strides, in elements (>= 0)
};

// The CPU implementations (memory_cpu.cpp): the reference semantics in C++, taking the same
// params as the CUDA launchers. `version` is ignored there: the ladder is a set of GPU thread
// mappings, and the CPU has one loop.
void copy_cpu(const CopyParams& params);
void strided_copy_cpu(const StridedCopyParams& params);
void transpose_cpu(const TransposeParams& params);

// Calls f(T{}) with T the unsigned integer of `elem_bytes` bytes, and returns what f returns;
// any other size calls unsupported(). Shared by the CUDA launchers and the CPU loops.
template <typename F, typename Unsupported>
auto with_element_type(int elem_bytes, F&& f, Unsupported&& unsupported) {
  switch (elem_bytes) {
    case 2: return f(uint16_t{});
    case 4: return f(uint32_t{});
    case 8: return f(uint64_t{});
    default: return unsupported();
  }
}

}  // namespace memory_ops

#if defined(__CUDACC__) || defined(WITH_CUDA)
#include <cuda_runtime_api.h>
namespace memory_ops {
// Each launcher runs on `stream`, returns the launch error (or cudaSuccess) and never
// synchronizes. Empty problems launch nothing.
cudaError_t launch_copy(const CopyParams& params, cudaStream_t stream);
cudaError_t launch_strided_copy(const StridedCopyParams& params, cudaStream_t stream);
cudaError_t launch_transpose(const TransposeParams& params, cudaStream_t stream);
}  // namespace memory_ops
#endif
