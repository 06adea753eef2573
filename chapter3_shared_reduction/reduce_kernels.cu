// Chapter 3 kernels: sum and amax, three ladders over one reduction operator.
//
// Napkin math: a reduction reads every element once and writes almost nothing, so its floor is
// bytes read / bandwidth. 2^28 float32 is 1 GiB: ~0.33 ms at ~3.2 TB/s of pure reads (an H100
// reads a little faster than it copies: no writes share the bus). Nothing in the ladders below
// changes that floor; each rung removes one thing that keeps a kernel from reaching it.
//
// Every kernel takes the operator as a functor (course::SumOp, course::MaxOp): written once,
// instantiated for both, as CUB does. The accumulator is float for float32, float16 and
// bfloat16 and double for float64 (course::Acc); the result is rounded to the input's dtype
// once, at the end.
//
// Determinism: no floating-point atomic decides an order anywhere below (launch_atomic_sum, at
// the bottom, is the counter-example the lesson measures). Partial results are combined in an
// order fixed by the shape and the launch configuration, so a run repeats bit for bit.
//
// No torch headers: this file builds with a bare `nvcc -c`.
#include "reduction.h"

#include <course/cuda_utils.h>
#include <course/column_reduce.cuh>
#include <course/reduce.cuh>

#include <algorithm>
#include <climits>

namespace shared_reduction {
namespace {

using course::Acc;
using course::from_acc;
using course::to_acc;

// 256 threads = 8 warps: Harris's block size, and 8 blocks of it fill an SM's 2048 threads.
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
// 16-byte vectors each thread loads before it adds any: 64 bytes in flight per thread.
constexpr int kUnroll = 4;
// The grid's y dimension is limited to 65535; kernels that put rows there loop over the rest.
constexpr int64_t kMaxGridY = 65535;
// Column splits: blocks per SM the ranges of a split column reduction aim at (plan_reduce).
constexpr int64_t kColumnBlocksPerSm = 4;
// column_split reads rows that start mid-vector (an odd number of columns, a view at an odd
// offset) as realigned 16-byte vectors wherever course::column_realigns allows it.
constexpr bool kRealign = true;
constexpr int64_t kMaxGridX = INT_MAX;

unsigned clamp_grid(int64_t blocks, int64_t limit = kMaxGridX) {
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > limit ? limit : blocks));
}

// ===========================================================================================
// The whole-tensor ladder (dim=None): Harris, "Optimizing Parallel Reduction in CUDA" (2007),
// seven steps, then three that a 2020s GPU adds. v1-v6 reduce blockDim.x (or 2 x blockDim.x)
// elements per block into one partial, and are launched again on the partials until one value
// is left (one launch per level: 2^28 elements take four); v7-v9 take two launches, v10 one.
// ===========================================================================================

// v1: interleaved addressing with a divergent branch. Each thread loads one element into
// shared memory; at level s, threads whose index is a multiple of 2s add their neighbour s
// away. The working threads are scattered over every warp, so every warp stays busy (and
// diverges) until the last level while doing less and less; the modulo is slow too.
template <typename A, typename Op, typename In, typename Out>
__global__ void reduce_interleaved_divergent(const In* __restrict__ x, int64_t n, Out* __restrict__ out) {
  __shared__ A smem[kThreads];
  const Op op;
  const unsigned tid = threadIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + tid;
  // The last block may run past n: its extra threads hold the identity.
  smem[tid] = i < n ? to_acc(x[i]) : Op::identity();
  __syncthreads();  // every element is in shared memory before the tree reads it
  for (unsigned s = 1; s < blockDim.x; s *= 2) {
    if (tid % (2 * s) == 0) smem[tid] = op(smem[tid], smem[tid + s]);
    __syncthreads();  // this level's results are written before the next level reads them
  }
  if (tid == 0) out[blockIdx.x] = from_acc<Out>(smem[0]);
}

// v2: strided index, no divergence. Thread t works on slot 2st, so the working threads are
// the first ones, packed into as few warps as possible, and whole warps retire together. The
// price: at level s the threads of a warp touch slots 2s apart, so for 4-byte values (32
// banks of 4 bytes) two, four, ... of a warp's accesses fall into the same bank and serialize.
template <typename A, typename Op, typename In, typename Out>
__global__ void reduce_interleaved_strided(const In* __restrict__ x, int64_t n, Out* __restrict__ out) {
  __shared__ A smem[kThreads];
  const Op op;
  const unsigned tid = threadIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + tid;
  smem[tid] = i < n ? to_acc(x[i]) : Op::identity();
  __syncthreads();  // every element is in shared memory before the tree reads it
  for (unsigned s = 1; s < blockDim.x; s *= 2) {
    const unsigned index = 2 * s * tid;
    if (index < blockDim.x) smem[index] = op(smem[index], smem[index + s]);
    __syncthreads();  // this level's results are written before the next level reads them
  }
  if (tid == 0) out[blockIdx.x] = from_acc<Out>(smem[0]);
}

// The sequential-addressing tree that v3 introduces and v4 keeps: at level s the first s
// threads add the slot s away. Consecutive threads touch consecutive slots: no bank conflicts.
template <typename A, typename Op>
__device__ __forceinline__ void tree_sequential(A* smem, unsigned tid, unsigned stop) {
  const Op op;
  for (unsigned s = blockDim.x / 2; s > stop; s >>= 1) {
    if (tid < s) smem[tid] = op(smem[tid], smem[tid + s]);
    __syncthreads();  // this level's results are written before the next level reads them
  }
}

// v3: sequential addressing. Conflict-free and divergence-free, but half of the threads idle
// from the first level on: they only loaded an element.
template <typename A, typename Op, typename In, typename Out>
__global__ void reduce_sequential(const In* __restrict__ x, int64_t n, Out* __restrict__ out) {
  __shared__ A smem[kThreads];
  const unsigned tid = threadIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + tid;
  smem[tid] = i < n ? to_acc(x[i]) : Op::identity();
  __syncthreads();  // every element is in shared memory before the tree reads it
  tree_sequential<A, Op>(smem, tid, 0);
  if (tid == 0) out[blockIdx.x] = from_acc<Out>(smem[0]);
}

// Each thread's first addition, done while loading: two elements a block apart (v4-v6).
template <typename A, typename Op, typename In>
__device__ __forceinline__ A load_pair(const In* __restrict__ x, int64_t n) {
  const Op op;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * (2 * blockDim.x) + threadIdx.x;
  A v = i < n ? to_acc(x[i]) : Op::identity();
  if (i + blockDim.x < n) v = op(v, to_acc(x[i + blockDim.x]));
  return v;
}

// v4: first add during load. A block covers 2 x blockDim.x elements and every thread adds two
// of them before the tree: half the blocks, and no thread idles at the first level.
template <typename A, typename Op, typename In, typename Out>
__global__ void reduce_first_add(const In* __restrict__ x, int64_t n, Out* __restrict__ out) {
  __shared__ A smem[kThreads];
  const unsigned tid = threadIdx.x;
  smem[tid] = load_pair<A, Op>(x, n);
  __syncthreads();  // every pair is in shared memory before the tree reads it
  tree_sequential<A, Op>(smem, tid, 0);
  if (tid == 0) out[blockIdx.x] = from_acc<Out>(smem[0]);
}

// The last six levels, within warp 0, without __syncthreads (v5, v6). Harris's 2007 code
// relied on the 32 threads of a warp executing in lockstep, with `volatile` alone. Since Volta
// the threads of a warp are scheduled independently, so a lane may read its neighbour's slot
// before the neighbour wrote it (compute-sanitizer's racecheck reports exactly that):
// __syncwarp() between the reads and the writes of a level restores the order, at the cost of
// a cheap warp-level barrier instead of a block-wide one.
template <typename A, typename Op>
__device__ __forceinline__ void last_warp(A* smem, unsigned tid) {
  const Op op;
  volatile A* v = smem;
  A acc = v[tid];
#pragma unroll
  for (int offset = 32; offset > 0; offset >>= 1) {
    acc = op(acc, v[tid + offset]);
    __syncwarp();  // every lane has read this level's inputs before any overwrites them
    v[tid] = acc;
    __syncwarp();  // this level's results are written before the next level reads them
  }
}

// v5: unroll the last warp. Once s <= 32 only one warp works, and a block-wide barrier per
// level is wasted: the last six levels run in warp 0 with warp barriers (last_warp). Needs
// blockDim.x >= 64.
template <typename A, typename Op, typename In, typename Out>
__global__ void reduce_unroll_last_warp(const In* __restrict__ x, int64_t n, Out* __restrict__ out) {
  __shared__ A smem[kThreads];
  const unsigned tid = threadIdx.x;
  smem[tid] = load_pair<A, Op>(x, n);
  __syncthreads();  // every pair is in shared memory before the tree reads it
  tree_sequential<A, Op>(smem, tid, 32);
  if (tid < 32) last_warp<A, Op>(smem, tid);
  if (tid == 0) out[blockIdx.x] = from_acc<Out>(smem[0]);
}

// v6: complete unroll with templates. The block size is a template parameter, so every loop
// bound is a compile-time constant: the tree unrolls into straight-line code, and levels a
// block is too small for vanish at compile time (no runtime `s > 32` tests, no loop counter).
template <int kBlock, typename A, typename Op, typename In, typename Out>
__global__ void __launch_bounds__(kBlock) reduce_complete_unroll(const In* __restrict__ x, int64_t n,
                                                                 Out* __restrict__ out) {
  static_assert(kBlock >= 64 && (kBlock & (kBlock - 1)) == 0, "a power of two >= 64");
  __shared__ A smem[kBlock];
  const Op op;
  const unsigned tid = threadIdx.x;
  smem[tid] = load_pair<A, Op>(x, n);
  __syncthreads();  // every pair is in shared memory before the tree reads it
#pragma unroll
  for (int s = kBlock / 2; s > 32; s >>= 1) {
    if (tid < s) smem[tid] = op(smem[tid], smem[tid + s]);
    __syncthreads();  // this level's results are written before the next level reads them
  }
  if (tid < 32) last_warp<A, Op>(smem, tid);
  if (tid == 0) out[blockIdx.x] = from_acc<Out>(smem[0]);
}

// v7: many elements per thread (Harris's "algorithm cascading"). A fixed grid, as many blocks
// as the GPU keeps resident, and each thread adds up a grid-stride share of the input in a
// register before the tree: the tree (and its barriers) now runs once per block instead of
// once per 512 elements, and the second level reduces a few hundred partials.
template <int kBlock, typename A, typename Op, typename In, typename Out>
__global__ void __launch_bounds__(kBlock) reduce_many_per_thread(const In* __restrict__ x, int64_t n,
                                                                 Out* __restrict__ out) {
  __shared__ A smem[kBlock];
  const Op op;
  const unsigned tid = threadIdx.x;
  A acc = Op::identity();
  const int64_t step = static_cast<int64_t>(gridDim.x) * kBlock;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kBlock + tid; i < n; i += step) {
    acc = op(acc, to_acc(x[i]));
  }
  smem[tid] = acc;
  __syncthreads();  // every thread's sum is in shared memory before the tree reads it
#pragma unroll
  for (int s = kBlock / 2; s > 32; s >>= 1) {
    if (tid < s) smem[tid] = op(smem[tid], smem[tid + s]);
    __syncthreads();  // this level's results are written before the next level reads them
  }
  if (tid < 32) last_warp<A, Op>(smem, tid);
  if (tid == 0) out[blockIdx.x] = from_acc<Out>(smem[0]);
}

// v8: warp shuffles instead of shared memory. After the per-thread loop, each warp combines
// its 32 values register to register (__shfl_xor_sync: no shared memory, no bank, no
// barrier), and only the 8 warp results meet in shared memory (course::block_reduce).
template <int kBlock, typename A, typename Op, typename In, typename Out>
__global__ void __launch_bounds__(kBlock) reduce_warp_shuffle(const In* __restrict__ x, int64_t n,
                                                              Out* __restrict__ out) {
  __shared__ A smem[kBlock / 32];
  const Op op;
  A acc = Op::identity();
  const int64_t step = static_cast<int64_t>(gridDim.x) * kBlock;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; i < n; i += step) {
    acc = op(acc, to_acc(x[i]));
  }
  acc = course::block_reduce<kBlock>(acc, op, smem);
  if (threadIdx.x == 0) out[blockIdx.x] = from_acc<Out>(acc);
}

// v9: 128-bit loads. The per-thread loop reads 16-byte vectors, kUnroll of them issued before
// any is added (course::fold_row): a quarter of the load instructions in float32 (an eighth in
// 16-bit dtypes), and 64 bytes in flight per thread to cover DRAM's latency. Any alignment:
// the elements before the first 16-byte boundary are read one by one.
template <int kBlock, typename A, typename Op, typename In, typename Out>
__global__ void __launch_bounds__(kBlock) reduce_vectorized(const In* __restrict__ x, int64_t n,
                                                            Out* __restrict__ out) {
  __shared__ A smem[kBlock / 32];
  const Op op;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x;
  A acc = course::fold_row<kUnroll>(x, n, t, static_cast<int64_t>(gridDim.x) * kBlock,
                                    Op::identity(), op, course::Identity());
  acc = course::block_reduce<kBlock>(acc, op, smem);
  if (threadIdx.x == 0) out[blockIdx.x] = from_acc<Out>(acc);
}

// ===========================================================================================
// Rows: rows of n adjacent elements, one result each (inner == 1).
// ===========================================================================================

// block_per_row: one block per row, its 256 threads folding the row with 16-byte loads, then
// a block reduction. Right for long rows; a short row leaves most of the block idle.
template <typename T, typename Op>
__global__ void __launch_bounds__(kThreads) reduce_block_per_row(const T* __restrict__ x, int64_t rows,
                                                                 int64_t n, T* __restrict__ out) {
  using A = typename Acc<T>::type;
  __shared__ A smem[kWarpsPerBlock];
  const Op op;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    A acc = course::fold_row<kUnroll>(x + r * n, n, threadIdx.x, kThreads, Op::identity(), op,
                                      course::Identity());
    acc = course::block_reduce<kThreads>(acc, op, smem);
    if (threadIdx.x == 0) out[r] = from_acc<T>(acc);
  }
}

// warp_per_row: one warp per row, 8 rows per block. A row of a few hundred elements fills a
// warp's loads, and a warp reduces with shuffles alone: no shared memory, no __syncthreads.
template <typename T, typename Op>
__global__ void __launch_bounds__(kThreads) reduce_warp_per_row(const T* __restrict__ x, int64_t rows,
                                                                int64_t n, T* __restrict__ out) {
  using A = typename Acc<T>::type;
  const Op op;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; r < rows;
       r += warps) {
    A acc = course::fold_row<kUnroll>(x + r * n, n, lane, 32, Op::identity(), op, course::Identity());
    acc = course::warp_reduce(acc, op);
    if (lane == 0) out[r] = from_acc<T>(acc);
  }
}

// rows_per_warp: rows shorter than a warp share one. `group` lanes (the power of two >= n, at
// most 32) take a row, so a warp covers 32 / group adjacent rows: one contiguous stretch of
// memory per warp instruction, coalesced, where a warp per row would leave lanes idle. The
// shuffles run within each group (width = group).
template <typename T, typename Op>
__global__ void __launch_bounds__(kThreads) reduce_rows_per_warp(const T* __restrict__ x, int64_t rows,
                                                                 int64_t n, int group,
                                                                 T* __restrict__ out) {
  using A = typename Acc<T>::type;
  const Op op;
  const int lane = threadIdx.x % 32;
  const int rows_per_warp = 32 / group;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock * rows_per_warp;
  for (int64_t first = warp * rows_per_warp; first < rows; first += step) {
    const int64_t r = first + lane / group;
    A acc = Op::identity();
    // Lanes of a group past the last row still take part in the shuffles, with the identity.
    if (r < rows) {
      for (int64_t j = lane % group; j < n; j += group) acc = op(acc, to_acc(x[r * n + j]));
    }
    acc = course::warp_reduce(acc, op, group);
    if (r < rows && lane % group == 0) out[r] = from_acc<T>(acc);
  }
}

// split_row (and v10, the whole tensor as one row): few long rows cannot fill the GPU with a
// block each, so each row is shared by `splits` blocks. Every block writes
// its partial, then counts itself in; the block that arrives last (last-block-done,
// the CUDA samples' threadFenceReduction) combines the row's partials in block order and
// writes the result. One launch, and the order of every addition is fixed: deterministic.
template <typename T, typename Op>
__global__ void __launch_bounds__(kThreads) reduce_split_row(const T* __restrict__ x, int64_t rows, int64_t n,
                                                             typename Acc<T>::type* __restrict__ partial,
                                                             unsigned* __restrict__ arrived,
                                                             T* __restrict__ out) {
  using A = typename Acc<T>::type;
  __shared__ A smem[kWarpsPerBlock];
  __shared__ bool last;
  const Op op;
  const unsigned splits = gridDim.x;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    // The row's blocks interleave: block b's threads take vectors b * 256 + t, then every
    // splits * 256 further, as v9's grid does over the whole tensor. (Giving each block one
    // contiguous segment instead measured 95% of copy for 2^28 float32, against v9's 101%:
    // a thousand streams each crossing DRAM pages on their own, rather than the whole GPU
    // sweeping the array together.)
    A acc = course::fold_row<kUnroll>(x + r * n, n, static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x,
                                      static_cast<int64_t>(splits) * kThreads, Op::identity(), op,
                                      course::Identity());
    acc = course::block_reduce<kThreads>(acc, op, smem);
    if (splits == 1) {
      if (threadIdx.x == 0) out[r] = from_acc<T>(acc);
      continue;
    }
    if (threadIdx.x == 0) {
      partial[r * splits + blockIdx.x] = acc;
      // The partial must be visible device-wide before the count that announces it.
      __threadfence();
      last = atomicAdd(&arrived[r], 1u) == splits - 1;
    }
    __syncthreads();  // every thread sees thread 0's `last`
    if (last) {
      // __ldcg reads through L2: this SM's L1 is not coherent with the other SMs' writes.
      A total = Op::identity();
      for (unsigned s = threadIdx.x; s < splits; s += kThreads) total = op(total, __ldcg(&partial[r * splits + s]));
      total = course::block_reduce<kThreads>(total, op, smem);
      if (threadIdx.x == 0) out[r] = from_acc<T>(total);
    }
  }
}

// ===========================================================================================
// Columns: (outer, n, inner) reduced over n, elements `inner` apart (inner > 1).
// ===========================================================================================

// column_loop: one thread per output column, looping down the reduced dimension. Adjacent
// threads read adjacent columns, so every warp load is coalesced, but there are only
// outer x inner threads: a 16384-column matrix gives 64 blocks, half an H100's SMs, each with
// four loads in flight per thread (`unroll 4`). Issuing a batch of 16 rows' loads before adding
// any was measured on an H100 at (100003, 16, 3) over dim 1: float32 0.80x -> 0.94x torch, but
// 16-bit 0.85x -> 0.71x (not profiled), so the loop stays as it was. Measured again side by side in
// one process, on top of the 32-bit indexing below, the batches took 0.76-0.87 of the time at
// n = 16 and 63 in every dtype and up to 1.38x at n = 3 and 7 (NOTES.md, "column_loop without the
// 64-bit division"): a choice by n is the next step, not yet tested on a GPU.

// Where output c lies: slice c / inner, column c % inner, a division by a size known only at run
// time. In 64 bits that is a CALL to nvcc's 64-bit division routine for every output (SASS,
// sm_90a), where torch.compile's kernel, compiled for its sizes, divides by a constant. While every
// element index fits 31 bits (column_loop_fits_32_bits, reduction.h; the launcher asks) the kernel
// divides by inner's magic number (course::FastDivmod: a multiply-high, an add and a shift) and
// indexes in 32 bits; a larger tensor keeps 64-bit indices and the division. One body serves both:
// Index is the index type, InnerDiv divides by inner in it. Each output still adds its n elements
// in order k = 0 .. n-1, so both give the same bits.
struct Divide64 {
  int64_t divisor;
  __device__ int64_t div(int64_t i) const { return i / divisor; }
};

template <typename T, typename Op, typename Index, typename InnerDiv>
__global__ void __launch_bounds__(kThreads) reduce_column_loop(const T* __restrict__ x, Index columns, Index n,
                                                               InnerDiv inner_div, T* __restrict__ out) {
  using A = typename Acc<T>::type;
  const Op op;
  const Index inner = inner_div.divisor;
  const Index step = static_cast<Index>(gridDim.x) * kThreads;
  // 32-bit indices: c + step stays below 2^32 (c < columns < 2^31, and step, the columns rounded up
  // to whole blocks, at most 2^31), so the loop cannot wrap around.
  for (Index c = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x; c < columns; c += step) {
    const Index slice = inner_div.div(c);
    const T* col = x + (slice * n * inner + (c - slice * inner));
    A acc = Op::identity();
#pragma unroll 4
    for (Index k = 0; k < n; ++k) acc = op(acc, to_acc(col[k * inner]));
    out[c] = from_acc<T>(acc);
  }
}

// column_split: course::column_reduce_tiles (common/include/course/column_reduce.cuh), which
// chapter 4's bias and weight gradients use too: a tile of 32 x 4 adjacent columns per block,
// coalesced 16-byte row loads, and the reduced dimension split over more blocks (combined in
// order by the last to arrive) when the tiles alone cannot fill the GPU. Rows that start
// mid-vector (4099 columns, an offset view) are read as pairs of aligned vectors shifted into
// place (course::load16_realigned) once they are a warp of vectors wide, not one element a
// lane: chapter 3 asks for it (kRealign); chapter 4's partial sums keep single elements.
//
//
// A tensor narrower than a tile (a (1000003, 3) sum over dim 0, a bias of 64 columns) would
// give each row to a warp whose lanes mostly have no column, and split the million rows over
// thousands of blocks whose partials the last block then adds. The launcher then lays each warp
// over 32 / lanes rows at once, every lane a column (course::column_tile_lanes says how many
// lanes a row keeps), makes the grid one resident wave so each block has many row groups in
// flight, and the last block adds the ranges' partials with all its threads.

// ===========================================================================================
// The atomic counter-example: v9's loop and block reduction, then one floating-point
// atomicAdd per block into the result. One launch, no partials; but float addition is not
// associative, and the blocks add in whatever order they finish, so the last bits of the sum
// change from run to run.
// ===========================================================================================
__global__ void __launch_bounds__(kThreads) sum_atomic(const float* __restrict__ x, int64_t n,
                                                       float* __restrict__ out) {
  __shared__ float smem[kWarpsPerBlock];
  const course::SumOp<float> op;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  float acc = course::fold_row<kUnroll>(x, n, t, static_cast<int64_t>(gridDim.x) * kThreads, 0.0f,
                                        op, course::Identity());
  acc = course::block_reduce<kThreads>(acc, op, smem);
  if (threadIdx.x == 0) atomicAdd(out, acc);
}

// ===========================================================================================
// Launchers
// ===========================================================================================

// How a launch is laid out; computed the same way for the workspace query and the launch.
struct Plan {
  int64_t blocks = 1;      // grid of the first (or only) launch
  int64_t splits = 1;      // split_row, v10 and the column tiles: blocks per row / ranges per tile
  int64_t segment = 0;     // column_split: rows per range
  int lanes = 32;          // column_split: lanes a row of the tile keeps (32, or fewer for narrow tensors)
  int64_t levels_ws = 0;   // v1-v9: accumulator slots for the partials of every level
};

// Elements one block of v1-v3 (one per thread) or v4-v6 (two per thread) reduces.
int64_t per_block(ReduceVersion v) {
  return v <= ReduceVersion::kSequential ? kThreads : 2 * kThreads;
}

bool is_tree(ReduceVersion v) { return v <= ReduceVersion::kCompleteUnroll; }

template <typename T>
cudaError_t make_plan(const ReduceParams& p, Plan* plan) {
  int64_t resident = 0;
  COURSE_CUDA_TRY(course::resident_threads(&resident));
  const int64_t resident_blocks = resident / kThreads;
  constexpr int64_t kLanes = course::Vec16<T>::kLanes;
  // The fewest elements worth a block of its own: 256 threads x kUnroll vectors.
  const int64_t min_segment = kThreads * kUnroll * kLanes;
  *plan = Plan{};
  switch (layout_of(p.version)) {
    case Layout::kWhole:
      if (is_tree(p.version)) {
        const int64_t b1 = course::ceil_div(p.n, per_block(p.version));
        plan->blocks = b1;
        plan->levels_ws = b1 > 1 ? b1 + course::ceil_div(b1, per_block(p.version)) : 0;
      } else if (p.version != ReduceVersion::kOnePass) {
        // v7-v9: at most one resident wave, each block at least one segment's worth.
        plan->blocks = std::min(resident_blocks, course::ceil_div(p.n, min_segment));
        plan->levels_ws = plan->blocks > 1 ? plan->blocks : 0;
      } else {
        plan->splits = std::min(resident_blocks, course::ceil_div(p.n, min_segment));
      }
      break;
    case Layout::kRows:
      if (p.version == ReduceVersion::kSplitRow) {
        // Enough blocks for every resident slot, at least one segment's worth each.
        const int64_t want = course::ceil_div(resident_blocks, p.outer);
        plan->splits = std::max<int64_t>(1, std::min(want, course::ceil_div(p.n, min_segment)));
      }
      break;
    case Layout::kColumns:
      if (p.version == ReduceVersion::kColumnSplit) {
        const T* x = static_cast<const T*>(p.x);
        // Rows that start mid-vector are read as realigned vectors where they are a warp of
        // vectors wide (course::column_realigns): kRealign below.
        const int cols = course::column_lanes(x, p.inner, kRealign);
        plan->lanes = course::column_tile_lanes(p.inner, cols);
        const bool narrow = plan->lanes < 32;
        const int64_t tiles = p.outer * course::column_tiles<T>(x, p.inner, plan->lanes, kRealign);
        // Ranges enough for kColumnBlocksPerSm blocks per SM (each keeps 8 warps x 4 row groups
        // of loads in flight, 64 KB an SM at 4 blocks: enough for DRAM), not more: every range
        // is a partial that the tile's last block folds after all others are done (and an
        // arrival on one counter), so a grid of several resident waves (2112 blocks for a
        // 16384 x 4096 bfloat16 sum on the H200: 79 us, torch.compile's split 36 us) ends in a
        // long serial tail. And the ranges a tile takes round down, not up: tiles x splits must
        // fit the kColumnBlocksPerSm x SMs slots, one wave. Rounding up (129 tiles of a (8191,
        // 4099) sum over dim 0: 5 ranges, 645 blocks for 528 slots on an H100) ran a second wave
        // of 117 blocks after the first: each block's range no shorter than in the first wave,
        // and a fifth of the GPU's slots to read it with. Rounded down (4 ranges, 516 blocks)
        // every block starts at once and the ranges are a quarter longer: under the wave model
        // (time ~ waves x rows per range) never slower, since splits - 1 >= splits / 2. Every
        // range at least 64 rows (8 per warp); narrow tiles at least two unrolled steps of the
        // block's row groups.
        int sms = 0;
        COURSE_CUDA_TRY(course::sm_count(&sms));
        const int64_t rows_per_step = int64_t{course::kColumnWarps} * (32 / plan->lanes) *
                                      course::column_unroll(cols);
        const int64_t want = kColumnBlocksPerSm * sms / tiles;  // 0 past one wave of tiles: no split
        const int64_t min_range = narrow ? 2 * rows_per_step : 64;
        plan->splits = std::max<int64_t>(1, std::min({want, course::ceil_div(p.n, min_range), kMaxGridY}));
        plan->segment = course::ceil_div(p.n, plan->splits);
        plan->splits = course::ceil_div(p.n, plan->segment);
        plan->blocks = tiles;
      }
      break;
  }
  return cudaSuccess;
}

template <typename T>
Workspace workspace_of(const ReduceParams& p, const Plan& plan) {
  using A = typename Acc<T>::type;
  Workspace ws;
  if (plan.levels_ws > 0) ws.bytes = plan.levels_ws * static_cast<int64_t>(sizeof(A));
  if (plan.splits > 1) {
    if (layout_of(p.version) == Layout::kColumns) {
      ws.bytes = plan.splits * p.outer * p.inner * static_cast<int64_t>(sizeof(A));
      ws.counters = plan.blocks;
    } else {
      ws.bytes = plan.splits * p.outer * static_cast<int64_t>(sizeof(A));
      ws.counters = p.outer;
    }
  }
  return ws;
}

// One level of v1-v6: n inputs of In into ceil(n / per_block) outputs of Out.
template <typename A, typename Op, typename In, typename Out>
cudaError_t launch_tree_level(ReduceVersion v, const In* in, int64_t n, Out* out, cudaStream_t stream) {
  const unsigned blocks = clamp_grid(course::ceil_div(n, per_block(v)));
  switch (v) {
    case ReduceVersion::kInterleavedDivergent:
      reduce_interleaved_divergent<A, Op><<<blocks, kThreads, 0, stream>>>(in, n, out);
      break;
    case ReduceVersion::kInterleavedStrided:
      reduce_interleaved_strided<A, Op><<<blocks, kThreads, 0, stream>>>(in, n, out);
      break;
    case ReduceVersion::kSequential:
      reduce_sequential<A, Op><<<blocks, kThreads, 0, stream>>>(in, n, out);
      break;
    case ReduceVersion::kFirstAddDuringLoad:
      reduce_first_add<A, Op><<<blocks, kThreads, 0, stream>>>(in, n, out);
      break;
    case ReduceVersion::kUnrollLastWarp:
      reduce_unroll_last_warp<A, Op><<<blocks, kThreads, 0, stream>>>(in, n, out);
      break;
    default:
      reduce_complete_unroll<kThreads, A, Op><<<blocks, kThreads, 0, stream>>>(in, n, out);
      break;
  }
  return cudaGetLastError();
}

// One stage of v7-v9 with `blocks` blocks: n inputs of In into `blocks` outputs of Out.
template <typename A, typename Op, typename In, typename Out>
cudaError_t launch_wide_stage(ReduceVersion v, const In* in, int64_t n, int64_t blocks, Out* out,
                              cudaStream_t stream) {
  const unsigned grid = clamp_grid(blocks);
  if (v == ReduceVersion::kManyPerThread) {
    reduce_many_per_thread<kThreads, A, Op><<<grid, kThreads, 0, stream>>>(in, n, out);
  } else if (v == ReduceVersion::kWarpShuffle) {
    reduce_warp_shuffle<kThreads, A, Op><<<grid, kThreads, 0, stream>>>(in, n, out);
  } else {
    reduce_vectorized<kThreads, A, Op><<<grid, kThreads, 0, stream>>>(in, n, out);
  }
  return cudaGetLastError();
}

template <typename T, typename Op>
cudaError_t run_whole(const ReduceParams& p, const Plan& plan, cudaStream_t stream) {
  using A = typename Acc<T>::type;
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  A* ws = static_cast<A*>(p.workspace);
  if (p.version == ReduceVersion::kOnePass) {
    reduce_split_row<T, Op><<<dim3(clamp_grid(plan.splits), 1), kThreads, 0, stream>>>(
        x, 1, p.n, ws, p.counters, out);
    return cudaGetLastError();
  }
  if (!is_tree(p.version)) {  // v7-v9: partials of a resident grid, then one block
    if (plan.blocks == 1) return launch_wide_stage<A, Op>(p.version, x, p.n, 1, out, stream);
    COURSE_CUDA_TRY(launch_wide_stage<A, Op>(p.version, x, p.n, plan.blocks, ws, stream));
    return launch_wide_stage<A, Op>(p.version, static_cast<const A*>(ws), plan.blocks, 1, out, stream);
  }
  // v1-v6: one launch per level, the partials ping-ponging between the two halves of ws.
  if (plan.blocks == 1) return launch_tree_level<A, Op>(p.version, x, p.n, out, stream);
  A* level_out[2] = {ws, ws + plan.blocks};
  COURSE_CUDA_TRY(launch_tree_level<A, Op>(p.version, x, p.n, level_out[0], stream));
  int64_t n = plan.blocks;
  for (int level = 1;; ++level) {
    const A* in = level_out[(level - 1) % 2];
    if (course::ceil_div(n, per_block(p.version)) == 1) {
      return launch_tree_level<A, Op>(p.version, in, n, out, stream);
    }
    COURSE_CUDA_TRY(launch_tree_level<A, Op>(p.version, in, n, level_out[level % 2], stream));
    n = course::ceil_div(n, per_block(p.version));
  }
}

template <typename T, typename Op>
cudaError_t run_rows(const ReduceParams& p, const Plan& plan, cudaStream_t stream) {
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  switch (p.version) {
    case ReduceVersion::kBlockPerRow:
      reduce_block_per_row<T, Op><<<clamp_grid(p.outer), kThreads, 0, stream>>>(x, p.outer, p.n, out);
      break;
    case ReduceVersion::kWarpPerRow:
      reduce_warp_per_row<T, Op><<<clamp_grid(course::ceil_div(p.outer, int64_t{kWarpsPerBlock})),
                                   kThreads, 0, stream>>>(x, p.outer, p.n, out);
      break;
    case ReduceVersion::kRowsPerWarp: {
      int group = 1;
      while (group < 32 && group < p.n) group *= 2;
      const int64_t rows_per_block = int64_t{kWarpsPerBlock} * (32 / group);
      reduce_rows_per_warp<T, Op><<<clamp_grid(course::ceil_div(p.outer, rows_per_block)), kThreads, 0,
                                    stream>>>(x, p.outer, p.n, group, out);
      break;
    }
    default:
      reduce_split_row<T, Op><<<dim3(clamp_grid(plan.splits), clamp_grid(p.outer, kMaxGridY)), kThreads, 0,
                                 stream>>>(x, p.outer, p.n,
                                           static_cast<typename Acc<T>::type*>(p.workspace), p.counters, out);
      break;
  }
  return cudaGetLastError();
}

template <typename T, typename Op>
cudaError_t run_columns(const ReduceParams& p, const Plan& plan, cudaStream_t stream) {
  using A = typename Acc<T>::type;
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  if (p.version == ReduceVersion::kColumnLoop) {
    const int64_t columns = p.outer * p.inner;
    const unsigned blocks = clamp_grid(course::ceil_div(columns, int64_t{kThreads}));
    if (column_loop_fits_32_bits(p.outer, p.n, p.inner)) {
      reduce_column_loop<T, Op, uint32_t><<<blocks, kThreads, 0, stream>>>(
          x, static_cast<uint32_t>(columns), static_cast<uint32_t>(p.n),
          course::FastDivmod(static_cast<uint32_t>(p.inner)), out);
    } else {
      reduce_column_loop<T, Op, int64_t><<<blocks, kThreads, 0, stream>>>(x, columns, p.n, Divide64{p.inner}, out);
    }
    return cudaGetLastError();
  }
  const dim3 grid(clamp_grid(plan.blocks), static_cast<unsigned>(plan.splits));
  return course::launch_column_reduce<T, Op, T, kRealign>(x, p.outer, p.n, p.inner, grid, plan.segment,
                                                          static_cast<A*>(p.workspace), p.counters, out, stream,
                                                          plan.lanes);
}

template <typename T, typename Op>
cudaError_t run_reduce(const ReduceParams& p, cudaStream_t stream) {
  Plan plan;
  COURSE_CUDA_TRY(make_plan<T>(p, &plan));
  switch (layout_of(p.version)) {
    case Layout::kWhole: return run_whole<T, Op>(p, plan, stream);
    case Layout::kRows: return run_rows<T, Op>(p, plan, stream);
    default: return run_columns<T, Op>(p, plan, stream);
  }
}

using ::course::with_dtype;

}  // namespace

cudaError_t reduce_workspace(const ReduceParams& p, Workspace* ws) {
  return with_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    Plan plan;
    COURSE_CUDA_TRY(make_plan<T>(p, &plan));
    *ws = workspace_of<T>(p, plan);
    return cudaSuccess;
  });
}

cudaError_t launch_reduce(const ReduceParams& p, cudaStream_t stream) {
  if (p.outer * p.inner == 0 || p.n == 0) return cudaSuccess;  // the glue fills these itself
  return with_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename Acc<T>::type;
    return p.op == ReduceOp::kSum ? run_reduce<T, course::SumOp<A>>(p, stream)
                                  : run_reduce<T, course::MaxOp<A>>(p, stream);
  });
}

cudaError_t launch_atomic_sum(const AtomicSumParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  int64_t resident = 0;
  COURSE_CUDA_TRY(course::resident_threads(&resident));
  const int64_t blocks = std::min(resident / kThreads, course::ceil_div(p.n, int64_t{kThreads * kUnroll * 4}));
  sum_atomic<<<clamp_grid(blocks), kThreads, 0, stream>>>(p.x, p.n, p.out);
  return cudaGetLastError();
}

}  // namespace shared_reduction
