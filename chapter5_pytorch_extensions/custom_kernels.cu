// Chapter 5's CUDA kernels: fused_op (relu(x * scale + bias)) and its backward, relu and its
// backward, and reduce_sum, a two-stage shared-memory block reduction.
//
// The lesson of this chapter is the binding, not the kernel: each op has one kernel, and all
// three binding routes launch exactly these. fused_op's are the kernels chapter 4's ladder ends
// on (common/include/course/bias_act.cuh: one 16-byte vector per thread with the bias gathered
// by column, and the backward on the column tiles), because the benchmark holds them to
// torch.compile's generated kernels; chapter 4 is where they are derived, and chapter 3 where
// the reduction gets its ladder.
//
// Napkin math for fused_op on [rows, n] elements of b bytes: read x, write y, 2 b bytes per
// element (the bias is n elements, read once per row but served from cache). Eager PyTorch's
// relu(x * scale + bias) is three kernels and 6 b bytes. The backward reads dy and y and
// writes dx: 3 b bytes, plus the column partials of dbias, a few rows of n floats.
//
// No torch headers: this file builds with a bare `nvcc -c`.
#include "custom_kernels.h"

#include <course/bias_act.cuh>
#include <course/column_reduce.cuh>
#include <course/cuda_utils.h>
#include <course/numeric.cuh>
#include <course/reduce.cuh>

#include <cstdint>

namespace custom_ops {
namespace {

using course::Acc;
using course::ceil_div;
using course::from_acc;
using course::to_acc;

// Threads per block of every kernel here: 8 warps, enough to hide memory latency with a
// handful of blocks per SM, and the block size chapter 3's reduction measured best.
constexpr int kThreads = 256;

// The most blocks a grid-stride kernel launches: about what an H100 keeps resident (132 SMs x
// 8 blocks of 256 threads); more would only queue. A constant rather than a query of the
// device, so that reduce_sum adds in the same order, and gives the same bits, on every GPU.
constexpr int64_t kMaxBlocks = 1024;

unsigned flat_blocks(int64_t work, int64_t per_block) {
  const int64_t blocks = ceil_div(work, per_block);
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// relu that lets NaN through, as torch.relu does: NaN < 0 is false.
template <typename A>
__device__ __forceinline__ A relu(A z) {
  return z < A(0) ? A(0) : z;
}

// relu as the functor course/bias_act.cuh's kernels take (chapter 4's activation.h has the
// others): its derivative is 0 or 1 (kGates), 1 where the gradient passes: z not <= 0, which
// includes NaN, as torch's threshold_backward.
struct Relu {
  static constexpr bool kGates = true;
  template <typename A, bool kFast = false>
  __device__ static A forward(A z) {
    return relu(z);
  }
  template <typename A, bool kFast = false>
  __device__ static A derivative(A z) {
    return course::relu_passes(z) ? A(1) : A(0);
  }
};

// ---------------------------------------------------------------------------------------
// fused_op: y = relu(x * scale + bias), one read of x and one write of y per element.
// ---------------------------------------------------------------------------------------
// course::launch_bias_act: the flat kernel (16-byte vectors, one per thread, the bias gathered
// by column): every lane busy at any row length, and a row that starts mid-vector (n not a
// multiple of 8 bfloat16) still moves as whole aligned vectors; the column tiles' single
// elements only for operands at different distances from a 16-byte boundary. Measured on the H100
// (results/<gpu>/chapter5_pytorch_extensions.json at commit 66d95f3): a flat grid-stride loop
// with scalar accesses ran at 89% of copy in float32 and 57% in bfloat16, 0.88x and 0.57x
// torch.compile; the column tiles alone lost to torch.compile at hidden sizes that leave a
// tile's lanes idle and at rows that are not whole vectors (chapter 4's v3 says how).
template <typename T>
course::BiasAct<T> fused_op_args(const FusedOpParams& p) {
  return {static_cast<const T*>(p.x), static_cast<const T*>(p.bias), static_cast<typename Acc<T>::type>(p.scale),
          static_cast<T*>(p.y), nullptr, nullptr, p.rows, p.n};
}

// The backward: course::act_backward_tile_kernel on y (y > 0 exactly where x * scale + bias >
// 0: custom_kernels.h says why y is kept). A thread keeps 16-byte packs of the same columns for
// every row it visits, writes dx and sums g for dbias in registers; the block adds its rows'
// sums in shared memory and writes dbias itself when one row tile holds every row (up to 64
// tokens: one launch), else one partial row, which the last block of its column tile to finish
// (an atomic counter a column tile) adds with the others in the same launch, or, where the
// partials are too many for one block, course::column_sum in a second (course::grad_tiling,
// course::grad_finishes_in_kernel). Every sum in a fixed order: deterministic.
template <typename T>
course::BiasActGrad<T> fused_op_grad_args(const FusedOpBackwardParams& p) {
  return {static_cast<const T*>(p.dy), static_cast<const T*>(p.y), nullptr, nullptr,
          static_cast<typename Acc<T>::type>(p.scale), static_cast<T*>(p.dx), static_cast<T*>(p.dbias),
          p.rows, p.n, p.workspace};
}

// ---------------------------------------------------------------------------------------
// relu and its backward: flat grid-stride loops, one read and one write per element.
// ---------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads) relu_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t numel) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = from_acc<T>(relu(to_acc(x[i])));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    relu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx, int64_t numel) {
  using A = typename Acc<T>::type;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // The gradient passes where y is not <= 0 (NaN included), as torch's threshold_backward.
    dx[i] = course::relu_passes(to_acc(y[i])) ? dy[i] : from_acc<T>(A(0));
  }
}

// ---------------------------------------------------------------------------------------
// reduce_sum: the shared-memory block reduction, in two stages.
//   stage 1: `blocks` blocks each fold a grid-stride share of x and write one partial sum;
//   stage 2: one block folds the partials into the result.
// A small input (up to kThreads * kMinPerThread elements) takes one block and one launch.
// Nothing is atomic, so the order of every addition is fixed by numel (and by x's alignment,
// which decides where the 16-byte loads start): the same input gives the same bits every run.
// ---------------------------------------------------------------------------------------
// Elements a thread should fold at least before a second block pays for itself: below
// 256 x 16 = 4096 elements one block reads everything faster than two launches would.
constexpr int64_t kMinPerThread = 16;

template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads) block_sum_kernel(const In* __restrict__ x, int64_t n, Out* __restrict__ out) {
  static_assert(kThreads >= 64 && (kThreads & (kThreads - 1)) == 0, "the tree halves a power of two down to 32");
  using A = typename Acc<In>::type;
  __shared__ A smem[kThreads];
  const unsigned tid = threadIdx.x;
  // 1. Registers: each thread folds its grid-stride share of x (16-byte loads where x's
  //    alignment allows, course::fold_row); threads past the end keep the identity, 0.
  const int64_t threads = static_cast<int64_t>(gridDim.x) * kThreads;
  A acc = course::fold_row<4>(x, n, static_cast<int64_t>(blockIdx.x) * kThreads + tid, threads, A(0),
                              course::SumOp<A>(), course::Identity());
  // 2. Shared memory: the block's 256 sums meet on chip and a tree halves them down to 32,
  //    each level's active threads adjacent (no divergence inside a warp) and reading
  //    adjacent slots (no bank conflicts). course::block_reduce would shuffle within warps
  //    first and keep only 8 values in shared memory; this tree is written out because the
  //    lesson is the shared-memory reduction (chapter 3 measures the two).
  smem[tid] = acc;
  __syncthreads();  // every thread's sum is in shared memory before the tree reads any of them
  for (unsigned s = kThreads / 2; s >= 32; s /= 2) {
    if (tid < s) smem[tid] += smem[tid + s];
    __syncthreads();  // this level's sums are written before the next level reads them
  }
  // 3. Registers again: warp 0 adds the last 32 values with shuffles (course::warp_reduce),
  //    which need no barrier at all.
  if (tid < 32) {
    const A total = course::warp_reduce(smem[tid], course::SumOp<A>());
    if (tid == 0) out[blockIdx.x] = from_acc<Out>(total);
  }
}

int64_t reduce_blocks(int64_t numel) {
  const int64_t blocks = ceil_div(numel, int64_t{kThreads} * kMinPerThread);
  return blocks < 1 ? 1 : (blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

}  // namespace

cudaError_t launch_fused_op(const FusedOpParams& p, cudaStream_t stream) {
  if (p.rows * p.n == 0) return cudaSuccess;  // nothing to write, and n may be 0: no division by it
  return course::with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    return course::launch_bias_act<T, Relu, false>(fused_op_args<T>(p), stream);
  });
}

cudaError_t fused_op_backward_workspace(const FusedOpBackwardParams& p, int64_t* bytes) {
  return course::with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    return course::fused_backward_workspace(fused_op_grad_args<decltype(tag)>(p), bytes);
  });
}

cudaError_t launch_fused_op_backward(const FusedOpBackwardParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;  // dx and dbias are both empty
  return course::with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    return course::launch_fused_backward<T, Relu, course::SaveKind::kOutput>(fused_op_grad_args<T>(p), stream);
  });
}

cudaError_t launch_relu(const ReluParams& p, cudaStream_t stream) {
  if (p.numel == 0) return cudaSuccess;
  return course::with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    relu_kernel<T><<<flat_blocks(p.numel, kThreads), kThreads, 0, stream>>>(static_cast<const T*>(p.x),
                                                                            static_cast<T*>(p.y), p.numel);
    return cudaGetLastError();
  });
}

cudaError_t launch_relu_backward(const ReluBackwardParams& p, cudaStream_t stream) {
  if (p.numel == 0) return cudaSuccess;
  return course::with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    relu_backward_kernel<T><<<flat_blocks(p.numel, kThreads), kThreads, 0, stream>>>(
        static_cast<const T*>(p.dy), static_cast<const T*>(p.y), static_cast<T*>(p.dx), p.numel);
    return cudaGetLastError();
  });
}

cudaError_t reduce_sum_workspace(const ReduceSumParams& p, int64_t* bytes) {
  return course::with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using A = typename Acc<decltype(tag)>::type;
    const int64_t blocks = reduce_blocks(p.numel);
    *bytes = blocks > 1 ? blocks * static_cast<int64_t>(sizeof(A)) : 0;
    return cudaSuccess;
  });
}

cudaError_t launch_reduce_sum(const ReduceSumParams& p, cudaStream_t stream) {
  return course::with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    using A = typename Acc<T>::type;
    const auto* x = static_cast<const T*>(p.x);
    auto* out = static_cast<T*>(p.out);
    const int64_t blocks = reduce_blocks(p.numel);
    if (blocks == 1) {  // 0 elements too: the block's threads all hold 0 and it writes 0
      block_sum_kernel<T, T><<<1, kThreads, 0, stream>>>(x, p.numel, out);
      return cudaGetLastError();
    }
    auto* partial = static_cast<A*>(p.workspace);
    block_sum_kernel<T, A><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, p.numel, partial);
    COURSE_CUDA_TRY(cudaGetLastError());
    // Stage 2 on the same stream: it starts only after every block of stage 1 has written its
    // partial, the grid-wide barrier a single kernel cannot have.
    block_sum_kernel<A, T><<<1, kThreads, 0, stream>>>(partial, blocks, out);
    return cudaGetLastError();
  });
}

}  // namespace custom_ops
