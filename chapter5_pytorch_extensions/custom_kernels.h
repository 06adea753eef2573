// The plain C++ interface between chapter 5's kernels and everything that calls them: the
// params structs, the CPU implementations (custom_kernels_cpu.cpp) and the CUDA launchers
// (custom_kernels.cu). No torch and no CUDA types: the kernels compile with a bare `nvcc -c`,
// and the glue (kernel_glue.cpp) compiles without the CUDA toolkit on a CPU-only machine.
//
// Every binding route of the chapter (pybind11, TORCH_LIBRARY, torch.library.custom_op) ends
// in these same functions, so the routes differ only in what sits between Python and here.
//
// Shapes: fused_op sees its input as a contiguous [rows, n] array, n = input.size(-1), the
// length of the bias, which broadcasts over the rows (every leading dim flattened into one).
// The elementwise and reduction ops see a flat array of `numel` elements.
#pragma once

#include <course/dtype.h>

#include <cstdint>

namespace custom_ops {

// float32, float16, bfloat16, float64 (course/dtype.h). 16-bit inputs compute in float32 and
// round once at the store; float64 computes in float64.
using DType = ::course::DType;

// y = relu(x * scale + bias).
struct FusedOpParams {
  DType dtype;
  const void* x;     // [rows, n]
  const void* bias;  // [n]
  double scale;
  void* y;  // [rows, n]
  int64_t rows, n;
};

// The backward of fused_op, from the output the forward returned:
//   g = dy where y is not <= 0 (y > 0, or NaN), else 0;   dx = g * scale;
//   dbias[c] = sum over rows of g[r, c].
// "Not <= 0" is torch's threshold_backward: at a NaN input relu's gradient passes.
// Why y and not x or a bit mask: relu'(z) only needs the sign of z, and y > 0 exactly where
// z > 0, so y answers it without the bias or the scale, and y costs nothing to keep (the
// forward allocated it anyway, and the next layer usually keeps it alive). A mask would be a
// second tensor written by the forward; x would make the backward read the bias and redo the
// arithmetic. PyTorch's own relu saves its result for the same reason (threshold_backward).
struct FusedOpBackwardParams {
  DType dtype;
  const void* dy;  // [rows, n]
  const void* y;   // [rows, n], the forward's output
  double scale;
  void* dx;         // [rows, n]
  void* dbias;      // [n]
  void* workspace;  // CUDA only: fused_op_backward_workspace bytes, uninitialized
  int64_t rows, n;
};

// y = relu(x) elementwise; its backward dx = dy where y is not <= 0, else 0 (y as above).
struct ReluParams {
  DType dtype;
  const void* x;
  void* y;
  int64_t numel;
};
struct ReluBackwardParams {
  DType dtype;
  const void* dy;
  const void* y;
  void* dx;
  int64_t numel;
};

// out (one element of dtype) = the sum of x's numel elements, accumulated in float32 (float64
// for float64). 0 elements sum to 0. Deterministic: the order of the additions depends on
// numel alone, never on timing, the thread count or the GPU model.
struct ReduceSumParams {
  DType dtype;
  const void* x;
  int64_t numel;
  void* out;
  void* workspace;  // CUDA only: reduce_sum_workspace bytes, uninitialized
};

// The CPU implementations: the reference semantics in C++, on the same params (workspace is
// not used). Plain loops; the sums run in a fixed order.
void fused_op_cpu(const FusedOpParams& p);
void fused_op_backward_cpu(const FusedOpBackwardParams& p);
void relu_cpu(const ReluParams& p);
void relu_backward_cpu(const ReluBackwardParams& p);
void reduce_sum_cpu(const ReduceSumParams& p);

}  // namespace custom_ops

#if defined(__CUDACC__) || defined(WITH_CUDA)
#include <cuda_runtime_api.h>
namespace custom_ops {
// Each launcher runs on `stream`, returns the first error (or cudaSuccess) and never
// synchronizes or allocates: the caller owns every buffer, so a launch can be captured in a
// CUDA graph. Empty inputs launch nothing (reduce_sum still writes its 0).
cudaError_t launch_fused_op(const FusedOpParams& p, cudaStream_t stream);
// Bytes of scratch launch_fused_op_backward needs: the column partials of g, one row per row
// tile of the backward's grid (none when one row tile writes dbias itself).
cudaError_t fused_op_backward_workspace(const FusedOpBackwardParams& p, int64_t* bytes);
cudaError_t launch_fused_op_backward(const FusedOpBackwardParams& p, cudaStream_t stream);
cudaError_t launch_relu(const ReluParams& p, cudaStream_t stream);
cudaError_t launch_relu_backward(const ReluBackwardParams& p, cudaStream_t stream);
// Bytes of scratch launch_reduce_sum needs: one partial per block of the first stage (0 when
// one block does it all).
cudaError_t reduce_sum_workspace(const ReduceSumParams& p, int64_t* bytes);
cudaError_t launch_reduce_sum(const ReduceSumParams& p, cudaStream_t stream);
}  // namespace custom_ops
#endif
