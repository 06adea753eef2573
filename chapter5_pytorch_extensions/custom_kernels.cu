// Chapter 5's CUDA kernels: fused_op (relu(x * scale + bias)) and its backward, relu and its
// backward, and reduce_sum, a two-stage shared-memory block reduction.
//
// The lesson of this chapter is the binding, not the kernel: each op has one kernel, and all
// three binding routes launch exactly these. fused_op's is the shape chapter 4's ladder ends on
// (16-byte accesses, the bias kept in registers), because the benchmark holds it to
// torch.compile's generated kernel; chapter 4 is where that shape is derived, and chapter 3
// where the reduction gets its ladder.
//
// Napkin math for fused_op on [rows, n] elements of b bytes: read x, write y, 2 b bytes per
// element (the bias is n elements, read once per row but served from cache). Eager PyTorch's
// relu(x * scale + bias) is three kernels and 6 b bytes. The backward reads dy and y and
// writes dx: 3 b bytes, plus the column partials of dbias, a few rows of n floats.
//
// No torch headers: this file builds with a bare `nvcc -c`.
#include "custom_kernels.h"

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

// CUDA's limit on gridDim.y (gridDim.x allows 2^31 - 1).
constexpr int64_t kMaxGridY = 65535;

unsigned flat_blocks(int64_t work, int64_t per_block) {
  const int64_t blocks = ceil_div(work, per_block);
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// relu that lets NaN through, as torch.relu does: NaN < 0 is false.
template <typename A>
__device__ __forceinline__ A relu(A z) {
  return z < A(0) ? A(0) : z;
}

// ---------------------------------------------------------------------------------------
// fused_op: y = relu(x * scale + bias), one read of x and one write of y per element.
// ---------------------------------------------------------------------------------------
// The copy kernel's shape, where chapter 4's ladder for this op ends (its v3). A block is a tile
// of tx adjacent packs of one row by ty = kThreads / tx rows, and each thread handles one pack
// of one row per step down the rows:
//   - a pack is one 16-byte vector when every row starts on a 16-byte boundary (n a whole
//     number of vectors, x, bias and y aligned), else one element: a warp's loads are 512
//     contiguous bytes, a quarter (float32) to an eighth (bfloat16) of the instructions of
//     scalar accesses;
//   - a thread keeps its columns for life, so it loads their bias once, into registers, and no
//     element pays a division to find its column;
//   - many short blocks rather than a grid-stride loop over one resident wave. Measured on the
//     H100 (results/<gpu>/chapter5_pytorch_extensions.json at commit 66d95f3): a
//     flat grid-stride loop with scalar accesses ran at 89% of copy in float32 and 57% in
//     bfloat16, 0.88x and 0.57x torch.compile.
template <typename T, int L>
__global__ void __launch_bounds__(kThreads)
    fused_op_kernel(const T* __restrict__ x, const T* __restrict__ bias, typename Acc<T>::type scale,
                    T* __restrict__ y, int64_t rows, int64_t n, int tx) {
  using A = typename Acc<T>::type;
  const int ty = kThreads / tx;
  const int64_t e = (static_cast<int64_t>(blockIdx.x) * tx + threadIdx.x % tx) * L;  // first element
  // The last column tile may hang over the row's end (n not a multiple of the tile's width);
  // no barrier or shuffle follows, so those threads may simply leave.
  if (e >= n) return;
  A b[L];
  course::Vec16<T> v;
  if constexpr (L > 1) {
    v = course::load16(reinterpret_cast<const course::Vec16<T>*>(bias + e));
#pragma unroll
    for (int l = 0; l < L; ++l) b[l] = to_acc(v.v[l]);
  } else {
    b[0] = to_acc(bias[e]);
  }
  // gridDim.y stops at 65535 row tiles: larger row counts loop (one trip in the common case).
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * ty + threadIdx.x / tx; r < rows;
       r += static_cast<int64_t>(gridDim.y) * ty) {
    const int64_t i = r * n + e;
    if constexpr (L > 1) {
      v = course::load16(reinterpret_cast<const course::Vec16<T>*>(x + i));
#pragma unroll
      for (int l = 0; l < L; ++l) v.v[l] = from_acc<T>(relu(fma(to_acc(v.v[l]), scale, b[l])));
      course::store16(reinterpret_cast<course::Vec16<T>*>(y + i), v);
    } else {
      y[i] = from_acc<T>(relu(fma(to_acc(x[i]), scale, b[0])));
    }
  }
}

template <typename T, int L>
cudaError_t launch_fused_op_packs(const FusedOpParams& p, cudaStream_t stream) {
  const int64_t packs = p.n / L;
  int tx = 1;  // the narrowest power of two that covers the row's packs, at most the block
  while (tx < kThreads && tx < packs) tx *= 2;
  const int64_t ty = kThreads / tx;
  const int64_t row_tiles = ceil_div(p.rows, ty);
  const dim3 grid(static_cast<unsigned>(ceil_div(packs, static_cast<int64_t>(tx))),
                  static_cast<unsigned>(row_tiles < kMaxGridY ? row_tiles : kMaxGridY));
  fused_op_kernel<T, L><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(p.x), static_cast<const T*>(p.bias),
                                                       static_cast<typename Acc<T>::type>(p.scale),
                                                       static_cast<T*>(p.y), p.rows, p.n, tx);
  return cudaGetLastError();
}

// The backward. A block is 32 columns x kSlotRows rows: lane threadIdx.x owns column
// tile * 32 + threadIdx.x, so a warp reads 32 adjacent elements of one row (coalesced), and
// each thread walks the rows of its slot (every gridDim.y * kSlotRows-th row), writing dx as it
// goes and summing g for dbias in a register. Each (slot, column) partial has exactly one
// writer: no atomics, and course::column_sum then adds the slots in a fixed order.
constexpr int kSlotRows = kThreads / 32;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    fused_op_backward_kernel(const T* __restrict__ dy, const T* __restrict__ y, typename Acc<T>::type scale,
                             T* __restrict__ dx, typename Acc<T>::type* __restrict__ partial, int64_t rows,
                             int64_t n) {
  using A = typename Acc<T>::type;
  const int64_t slot = static_cast<int64_t>(blockIdx.y) * kSlotRows + threadIdx.y;
  const int64_t slots = static_cast<int64_t>(gridDim.y) * kSlotRows;
  const int64_t tiles = ceil_div(n, int64_t{32});
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t c = tile * 32 + threadIdx.x;
    // The last tile of a row whose length is not a multiple of 32: lanes past the end have no
    // column. No barrier or shuffle follows, so they may simply skip it.
    if (c >= n) continue;
    A acc = A(0);
    for (int64_t r = slot; r < rows; r += slots) {
      const int64_t i = r * n + c;
      // y > 0 exactly where x * scale + bias > 0 (custom_kernels.h says why y is kept).
      const A g = to_acc(y[i]) > A(0) ? to_acc(dy[i]) : A(0);
      dx[i] = from_acc<T>(g * scale);
      acc += g;
    }
    // Written even by slots past the last row (as 0), so column_sum never reads garbage.
    partial[slot * n + c] = acc;
  }
}

// The backward's grid: x over column tiles, y over row slots, kMaxBlocks blocks in all at
// most; at least one slot, so that 0 rows still write dbias = 0.
dim3 backward_grid(int64_t rows, int64_t n) {
  const int64_t tiles = ceil_div(n, int64_t{32});
  const int64_t gx = tiles < kMaxBlocks ? tiles : kMaxBlocks;
  int64_t gy = kMaxBlocks / (gx > 0 ? gx : 1);
  const int64_t wanted = ceil_div(rows, int64_t{kSlotRows});
  if (gy > wanted) gy = wanted;
  if (gy > kMaxGridY) gy = kMaxGridY;
  if (gy < 1) gy = 1;
  return dim3(static_cast<unsigned>(gx > 0 ? gx : 1), static_cast<unsigned>(gy));
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
    dx[i] = to_acc(y[i]) > A(0) ? dy[i] : from_acc<T>(A(0));
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
    constexpr int kLanes = course::Vec16<T>::kLanes;
    const bool vector = p.n % kLanes == 0 && course::is_aligned(p.x, 16) && course::is_aligned(p.bias, 16) &&
                        course::is_aligned(p.y, 16);
    return vector ? launch_fused_op_packs<T, kLanes>(p, stream) : launch_fused_op_packs<T, 1>(p, stream);
  });
}

cudaError_t fused_op_backward_workspace(const FusedOpBackwardParams& p, int64_t* bytes) {
  return course::with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using A = typename Acc<decltype(tag)>::type;
    const dim3 grid = backward_grid(p.rows, p.n);
    *bytes = static_cast<int64_t>(grid.y) * kSlotRows * p.n * static_cast<int64_t>(sizeof(A));
    return cudaSuccess;
  });
}

cudaError_t launch_fused_op_backward(const FusedOpBackwardParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;  // dx and dbias are both empty
  return course::with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    using A = typename Acc<T>::type;
    const dim3 grid = backward_grid(p.rows, p.n);
    auto* partial = static_cast<A*>(p.workspace);
    fused_op_backward_kernel<T><<<grid, dim3(32, kSlotRows), 0, stream>>>(
        static_cast<const T*>(p.dy), static_cast<const T*>(p.y), static_cast<A>(p.scale), static_cast<T*>(p.dx),
        partial, p.rows, p.n);
    COURSE_CUDA_TRY(cudaGetLastError());
    // dbias: the [slots, n] partials summed over the slots, rounded once to T.
    return course::column_sum<A, T>(partial, static_cast<int64_t>(grid.y) * kSlotRows, p.n,
                                    static_cast<T*>(p.dbias), stream);
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
