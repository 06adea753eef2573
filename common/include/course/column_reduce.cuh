// Column reductions: out[o, c] = op over k of x[o, k, c] for a tensor seen as (outer, n, inner),
// reduced over n with the `inner` columns contiguous. The pattern behind every bias and weight
// gradient: chapter 3's `column_split` rung (sum(x, dim=0)) and chapter 4's dbias / dweight,
// which reduce the per-block partial sums their fused backward kernels write.
//
// The layout: a block takes a tile of `lanes` x kCols adjacent columns (lanes = 32 unless the
// tensor is narrower), its 8 warps every 8th group of rows, each lane kCols adjacent columns (one
// 16-byte vector when the rows allow it, or, where the caller asks for it, two aligned vectors
// shifted into place when the rows start mid-vector: load16_realigned, course/numeric.cuh). With
// 32 lanes a warp reads 512 contiguous bytes of a row per instruction; a narrower tile lays the warp over
// 32 / lanes rows at once, so that every lane still has a column (an 8-column bfloat16 tensor:
// one vector per row, 32 rows per warp instruction, where a warp per row would leave 31 lanes
// idle). kColumnUnroll row groups are
// in flight per lane (kColumnUnrollScalar of single elements). The warps' sums meet in shared
// memory. When the tiles alone cannot fill the GPU, the reduced dimension is also split into
// ranges (grid.y), each written as a partial, and the last block of the tile to arrive combines
// them in order, its threads sharing the partials of each column between them. Every combine has
// a fixed order: deterministic.
//
// Torch-free, like every kernel of the course.
#pragma once

#include <course/cuda_utils.h>
#include <course/index_math.h>
#include <course/numeric.cuh>
#include <course/reduce.cuh>

#include <climits>
#include <cstdint>

namespace course {

constexpr int kColumnWarps = 8;
constexpr int kColumnThreads = 32 * kColumnWarps;
constexpr int kColumnUnroll = 4;
// Single elements (rows that are not whole 16-byte vectors) are 8 to 16 times fewer bytes a
// load: 16 row groups of them in flight, or a block of a (8191, 4099) bfloat16 sum over dim 0
// (64 bytes a warp load) kept 2 KB in flight, 8 KB an SM at the splits' four blocks per SM.
constexpr int kColumnUnrollScalar = 16;
// Row groups a lane keeps in flight with kCols columns per lane.
constexpr int column_unroll(int cols) { return cols > 1 ? kColumnUnroll : kColumnUnrollScalar; }
// The tail of a lane's range: the row groups left after the unrolled batches, fewer than one
// batch, are one more batch whose loads past the range are skipped, not a loop of one row group
// at a time. Such a loop keeps one load (or the few nvcc unrolls) in flight per lane: a lane of
// a 1000-row range at 32 rows a block step (a narrow tile of 7 columns, 64 x 1000 x 7 over dim
// 1) did one batch of 16 loads and then 15 more in that loop, nearly a DRAM round trip each, and
// every warp of the launch reaches its tail at about the same time, so no other warp hides them.
// The guarded tail batch (column_reduce_tiles, below) is for single elements of 2 and 4 bytes
// only, compiled for four blocks an SM: chapter 3's split aims its ranges at four
// (kColumnBlocksPerSm there), so 64 registers a thread at most. Unbounded, the batch took 64
// registers to 72-80 at sm_90a: three blocks an SM, and a grid of four an SM ran as a full wave
// and a second of one block an SM (a (1000003, 7) 16-bit sum over dim 0 fell from 0.87x to 0.70x
// PyTorch on the H100). In the vector tiles the batch took 48 registers to 80-100 (a (1048576,
// 64) bfloat16 sum over dim 0: 0.83x to 0.44x), and float64 single elements 64-80 to 124 (at
// four or three blocks ptxas spilled): both keep the one-at-a-time tail (float64 also no bound;
// the vector tiles have one now for another reason: kColumnMinBlocks). On sm_75 (1024 threads
// an SM) four blocks of 256 threads are also the most it holds.
constexpr int kColumnMinBlocksPerSm = 4;
template <int kCols, typename T>
constexpr bool kColumnTailBatch = kCols == 1 && sizeof(T) < 8;
// The vector tiles of 2- and 4-byte dtypes are bounded the same way since their loads roll
// (column_reduce_tiles: each vector refilled with the next batch's as soon as it is folded):
// unbounded, ptxas took the bfloat16 sum to 78 registers; bounded, 64 and no spills at sm_90a.
// float64 vectors stay unbounded (62-64 registers; bounded they spill 12-32 bytes).
template <typename T>
constexpr int kColumnMinBlocks = sizeof(T) < 8 ? kColumnMinBlocksPerSm : 0;

// The column totals of one tile from the block's partial sums in shared memory: sums[w * 32 *
// kCols + (s * lanes + l) * kCols + c] is warp w's sum, over its rows s, s + 32 / lanes, ..., of
// tile column l * kCols + c. Every column has kColumnWarps * (32 / lanes) of them. All the block's
// threads add them: `groups` = kColumnThreads / width threads a column, each adding every
// groups-th of the column's sums (kCols of them), then the first thread of the column adding the
// groups' totals, both in a fixed order, so the result is the same bits on every run.
// Before, warp 0's first `lanes` lanes added every sum of their kCols columns alone: with 2 lanes
// of 8 bfloat16 columns (a tile of 16 columns, which hidden 2048 takes to give 132 SMs a tile
// each), 1024 dependent shared-memory adds a lane, two such chains for LayerNorm's dweight and
// dbias: some 8 us a chain on the H200, longer than reading the rows (LayerNorm's backward at 64
// x 2048 took 19.8 us where torch took 6.3). Now each thread adds kCols sums and then at most 256
// / width group totals.
// Returns the total of tile column threadIdx.x in threads threadIdx.x < width (the identity in
// the others). Every thread of the block must call it (a block of any size of at least
// kColumnThreads threads), after the barrier that follows the sums'
// stores; it overwrites the first kColumnThreads sums, and the caller must put a barrier between
// its return and the next writes to `sums`.
template <int kCols, typename A, typename Op>
__device__ __forceinline__ A tile_column_totals(A* sums, int lanes, const Op& op) {
  constexpr int kTile = 32 * kCols;
  const int width = lanes * kCols;             // divides kColumnThreads: both powers of two
  const int groups = kColumnThreads / width;   // 1 (32 lanes of 8 columns) to 256 (1 lane of 1)
  const int rows_per_warp = 32 / lanes;
  const int j = threadIdx.x % width;           // this thread's column of the tile
  const int l = j / kCols;
  const int c = j % kCols;
  // A block of more than kColumnThreads threads (chapter 4's norm_backward_few_rows) adds with its
  // first kColumnThreads; the others only reach the barriers (their slots would pass the sums).
  const bool adder = threadIdx.x < kColumnThreads;
  A part = Op::identity();
  for (int q = threadIdx.x / width; adder && q < kColumnWarps * rows_per_warp; q += groups) {
    part = op(part, sums[(q / rows_per_warp) * kTile + ((q % rows_per_warp) * lanes + l) * kCols + c]);
  }
  __syncthreads();  // every thread has read its sums before the groups' totals overwrite them
  if (adder) sums[threadIdx.x] = part;  // kTile * kColumnWarps >= kColumnThreads slots
  __syncthreads();  // every group's total is in shared memory before the columns' first threads add them
  A total = Op::identity();
  if (static_cast<int>(threadIdx.x) < width) {
    for (int g = 0; g < groups; ++g) total = op(total, sums[g * width + j]);
  }
  return total;
}

template <int kCols, typename T, typename Op, typename Out, bool kRealign = false>
__global__ void __launch_bounds__(kColumnThreads, kColumnMinBlocks<T>) column_reduce_tiles(
    const T* __restrict__ x, int64_t outer, int64_t n, int64_t inner, int64_t range, int lanes,
    typename Acc<T>::type* __restrict__ partial, unsigned* __restrict__ arrived, Out* __restrict__ out,
    Out* __restrict__ out1) {
  using A = typename Acc<T>::type;
  constexpr int kTile = 32 * kCols;  // the widest tile; a narrower one uses the first lanes x kCols
  __shared__ A smem[kColumnWarps][kTile];
  __shared__ bool last;
  const Op op;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int rows_per_warp = 32 / lanes;  // lanes is a power of two: 1, 2, ..., 32
  const int sub = lane / lanes;          // which of the warp's rows this lane reads
  const int width = lanes * kCols;       // columns of a tile
  const unsigned splits = gridDim.y;
  const int64_t tiles = ceil_div(inner, static_cast<int64_t>(width));
  const int64_t k_begin = blockIdx.y * range;
  const int64_t k_end = k_begin + range < n ? k_begin + range : n;
  const int64_t row_step = static_cast<int64_t>(kColumnWarps) * rows_per_warp;
  for (int64_t t = blockIdx.x; t < outer * tiles; t += gridDim.x) {
    const int64_t o = t / tiles;
    // Slice o's results: out's row o, or out1 for slice 1 where the caller gives one (LayerNorm's
    // dbias, summed in the same launch as its dweight).
    Out* const dest = o == 1 && out1 != nullptr ? out1 : out + o * inner;
    const int64_t c0 = (t % tiles) * width + lane % lanes * kCols;  // this lane's first column
    const T* base = x + o * n * inner + c0;
    A acc[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[c] = Op::identity();
    if (c0 < inner) {
      int64_t k = k_begin + warp * rows_per_warp + sub;
      if constexpr (kRealign) {
        // Rows that start mid-vector (load16_realigned): the same batches of kColumnUnroll row
        // groups, each lane's vector of kCols columns shifted into place, and the lane at the
        // end of a row (inner not a multiple of kCols) adding only its first `wanted` columns,
        // the rest being the next row's.
        using V = Vec16<T>;
        const int wanted = inner - c0 < kCols ? static_cast<int>(inner - c0) : kCols;
        const T* const x_end = x + outer * n * inner;
        // Whole batches, not the rolling loads of the aligned vectors below: rolling, the
        // shifts' temporaries spilled 20-44 bytes in bfloat16 under the bound (sm_90a). A batch
        // whose vectors could reach outside the tensor (its first or last row: 16 bytes on
        // either side of the batch's rows are inside otherwise) reads its elements one by one;
        // checked inside the unrolled batch, that fallback's registers spilled 52-84 bytes.
        for (; k + (kColumnUnroll - 1) * row_step < k_end; k += kColumnUnroll * row_step) {
          const T* const p0 = base + k * inner;
          const T* const p_last = base + (k + (kColumnUnroll - 1) * row_step) * inner;
          if (p0 - x >= kCols && x_end - p_last >= 2 * kCols) {
            V v[kColumnUnroll];
#pragma unroll
            for (int u = 0; u < kColumnUnroll; ++u) v[u] = load16_realigned(base + (k + u * row_step) * inner, wanted);
#pragma unroll
            for (int u = 0; u < kColumnUnroll; ++u) {
#pragma unroll
              for (int c = 0; c < kCols; ++c) {
                if (c < wanted) acc[c] = op(acc[c], to_acc(v[u].v[c]));  // past `wanted`: the next row
              }
            }
          } else {  // element by element: only the lane's own columns, inside the tensor
#pragma unroll 1
            for (int u = 0; u < kColumnUnroll; ++u) {
              const T* const p = base + (k + u * row_step) * inner;
#pragma unroll
              for (int c = 0; c < kCols; ++c) {
                if (c < wanted) acc[c] = op(acc[c], to_acc(p[c]));
              }
            }
          }
        }
        for (; k < k_end; k += row_step) {  // the last fewer than kColumnUnroll row groups
          const V v = load16_realigned_within(base + k * inner, wanted, x, x_end);
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            if (c < wanted) acc[c] = op(acc[c], to_acc(v.v[c]));  // the same guard
          }
        }
      } else if constexpr (kCols > 1) {
        // Whole vectors only: the launcher picks kCols > 1 without kRealign only when inner is a
        // multiple of it and the rows are 16-byte aligned.
        // Rolling loads: each vector of a batch is folded and its registers at once refilled with
        // the same slot of the next batch, so a lane keeps up to kColumnUnroll - 1 loads in
        // flight while it converts and combines, in the registers one batch takes. Loading a
        // whole batch and then folding it left the lane with no load in flight for as long as
        // the fold took, which grows with the operator and the dtype: a 2-byte vector is 8
        // conversions and 8 ops (amax: a compare, a NaN test and a select each) where a float32
        // one is 4 adds, and at (1048576, 64) over dim 0 the 16-bit amax took 1.3x the 16-bit
        // sum's time, float32's amax the same as its sum. (Two whole batches in registers, one
        // loading while the other folds, took bfloat16 to 80 registers, or spills under the
        // bound of four blocks an SM.)
        using V = Vec16<T>;
        const int64_t batch = kColumnUnroll * row_step;
        if (k + (kColumnUnroll - 1) * row_step < k_end) {
          V v[kColumnUnroll];
#pragma unroll
          for (int u = 0; u < kColumnUnroll; ++u) {
            v[u] = load16(reinterpret_cast<const V*>(base + (k + u * row_step) * inner));
          }
          for (;;) {
            const int64_t k_next = k + batch;
            const bool more = k_next + (kColumnUnroll - 1) * row_step < k_end;  // a whole next batch
#pragma unroll
            for (int u = 0; u < kColumnUnroll; ++u) {
#pragma unroll
              for (int c = 0; c < kCols; ++c) acc[c] = op(acc[c], to_acc(v[u].v[c]));
              if (more) v[u] = load16(reinterpret_cast<const V*>(base + (k_next + u * row_step) * inner));
            }
            k = k_next;
            if (!more) break;
          }
        }
        // The last fewer than kColumnUnroll row groups, one at a time (kColumnTailBatch says why
        // not a batch): at most 3 loads of 16 bytes a lane.
        for (; k < k_end; k += row_step) {
          const V v = load16(reinterpret_cast<const V*>(base + k * inner));
#pragma unroll
          for (int c = 0; c < kCols; ++c) acc[c] = op(acc[c], to_acc(v.v[c]));
        }
      } else {
        for (; k + (kColumnUnrollScalar - 1) * row_step < k_end; k += kColumnUnrollScalar * row_step) {
          T v[kColumnUnrollScalar];
#pragma unroll
          for (int u = 0; u < kColumnUnrollScalar; ++u) v[u] = base[(k + u * row_step) * inner];
#pragma unroll
          for (int u = 0; u < kColumnUnrollScalar; ++u) acc[0] = op(acc[0], to_acc(v[u]));
        }
        if constexpr (kColumnTailBatch<kCols, T>) {
          if (k < k_end) {  // the last fewer than kColumnUnrollScalar row groups: one guarded batch
            T v[kColumnUnrollScalar];
#pragma unroll
            for (int u = 0; u < kColumnUnrollScalar; ++u) {
              if (k + u * row_step < k_end) v[u] = base[(k + u * row_step) * inner];  // past the range
            }
#pragma unroll
            for (int u = 0; u < kColumnUnrollScalar; ++u) {
              if (k + u * row_step < k_end) acc[0] = op(acc[0], to_acc(v[u]));  // the same guard
            }
          }
        } else {
          for (; k < k_end; k += row_step) acc[0] = op(acc[0], to_acc(base[k * inner]));
        }
      }
    }
    // A previous tile's combine may still be reading smem in a slower warp.
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kCols; ++c) smem[warp][lane * kCols + c] = acc[c];
    __syncthreads();  // every warp's sums are in shared memory before the block adds them
    // The block adds the tile's sums (tile_column_totals): thread k < width holds column k's.
    const int64_t tile_c0 = (t % tiles) * width;
    const A total = tile_column_totals<kCols>(&smem[0][0], lanes, op);
    const bool writer = static_cast<int>(threadIdx.x) < width && tile_c0 + threadIdx.x < inner;
    if (splits == 1) {
      if (writer) dest[tile_c0 + threadIdx.x] = from_acc<Out>(total);
      continue;  // the next tile's first barrier keeps its stores off the sums read here
    }
    if (writer) partial[(blockIdx.y * outer + o) * inner + tile_c0 + threadIdx.x] = total;
    // Every writer's partials must be visible device-wide before the count that announces them.
    __threadfence();
    // Every thread fenced before thread 0 arrives; and every read of smem above is done before
    // the last block's combine below reuses it.
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&arrived[t], 1u) == splits - 1;
    __syncthreads();  // every thread sees thread 0's `last`
    if (last) {
      // The whole block combines the tile's partials: `groups` threads per column each fold every
      // groups-th range, then one thread per column adds the groups, both in a fixed order. A
      // thread keeps kChains sums, range s going to chain s / groups % kChains, so kChains loads
      // are in flight at once: with one chain, each load waited for the last (a dependent chain
      // of L2 round trips, one per range: with 132 ranges it took longer than the reading of the
      // tensor). 16 chains: a narrow tile (64 columns of a (1048576, 64) sum: 4 threads a column)
      // folds 4 blocks per SM of ranges, 132 partials a thread on an H200, 9 round trips to L2
      // rather than 17 at the end of the launch. __ldcg reads through L2: this SM's L1 is not
      // coherent with the other SMs' writes.
      constexpr int kChains = 16;
      const int groups = kColumnThreads / width;
      const int column = threadIdx.x % width;
      const int group = threadIdx.x / width;
      const bool has_column = group < groups && tile_c0 + column < inner;
      A chain[kChains];
#pragma unroll
      for (int k = 0; k < kChains; ++k) chain[k] = Op::identity();
      if (has_column) {
        const A* first = partial + o * inner + tile_c0 + column;
        const int64_t stride = outer * inner;  // from one range's partials to the next's
        unsigned s = group;
        for (; s + (kChains - 1) * groups < splits; s += kChains * groups) {
#pragma unroll
          for (int k = 0; k < kChains; ++k) chain[k] = op(chain[k], __ldcg(first + (s + k * groups) * stride));
        }
#pragma unroll
        for (int k = 0; k < kChains - 1; ++k) {  // the last few ranges, fewer than kChains per thread
          if (s + k * groups < splits) chain[k] = op(chain[k], __ldcg(first + (s + k * groups) * stride));
        }
      }
      A total = chain[0];
#pragma unroll
      for (int k = 1; k < kChains; ++k) total = op(total, chain[k]);
      A* fold = &smem[0][0];  // kColumnThreads values; the block's sums above are done with
      fold[threadIdx.x] = total;
      __syncthreads();  // every group's sum is in shared memory before the adds read them
      if (group == 0 && has_column) {
        A sum = Op::identity();
        for (int g = 0; g < groups; ++g) sum = op(sum, fold[g * width + column]);
        dest[tile_c0 + column] = from_acc<Out>(sum);
      }
    }
  }
}

// Columns per lane: a 16-byte vector when every row starts on a 16-byte boundary, else one.
template <typename T>
inline int column_lanes(const T* x, int64_t inner) {
  constexpr int kLanes = Vec16<T>::kLanes;
  return (inner % kLanes == 0 && is_aligned(x, 16)) ? kLanes : 1;
}

// Whether a launch that allows it (launch_column_reduce's kRealign, chapter 3's column_split)
// reads rows that start mid-vector as realigned vectors (load16_realigned) rather than one element
// a lane: where column_lanes gives one column a lane and the rows are at least a warp of vectors
// wide. One element a lane moves sizeof(T) x 32 bytes a warp load (64 in 2-byte dtypes, against
// 512), and 16 of them in flight a lane are half the bytes of 4 vectors. Narrower rows keep one
// element a lane: their tiles already lay a warp over several rows, and a lane's two loads and
// shifts would fetch a vector for a few columns.
// float64 (here for gradcheck) keeps single elements: its realigned tiles spilled under the bound.
template <typename T>
inline bool column_realigns(const T* x, int64_t inner) {
  constexpr int kLanes = Vec16<T>::kLanes;
  return sizeof(T) < 8 && column_lanes(x, inner) == 1 && inner >= int64_t{32} * kLanes &&
         is_aligned(x, sizeof(T));
}

// Columns per lane of a launch with or without kRealign.
template <typename T>
inline int column_lanes(const T* x, int64_t inner, bool realign) {
  return realign && column_realigns(x, inner) ? Vec16<T>::kLanes : column_lanes(x, inner);
}

// Tiles of one (outer) slice: the blocks a launch needs before any split of the reduced dim.
template <typename T>
inline int64_t column_tiles(const T* x, int64_t inner, int lanes = 32, bool realign = false) {
  return ceil_div(inner, int64_t{lanes} * column_lanes(x, inner, realign));
}

// One launch over `grid` (x: tiles, persistent beyond INT_MAX; y: ranges of `range` rows).
// With grid.y > 1, `partial` holds grid.y * outer * inner accumulators and `arrived` one zeroed
// counter per tile; with grid.y == 1 neither is touched. Slice o's results go to out + o * inner,
// slice 1's to out1 instead where it is not null.
// With kRealign, rows that start mid-vector are read as realigned vectors where
// column_realigns says so (the caller's tiles must then be counted with column_lanes(x, inner,
// true)). A template argument, so that callers without it (chapter 4's partial sums) do not
// compile the realigned kernels.
template <typename T, typename Op, typename Out = T, bool kRealign = false>
cudaError_t launch_column_reduce(const T* x, int64_t outer, int64_t n, int64_t inner, dim3 grid,
                                 int64_t range, typename Acc<T>::type* partial, unsigned* arrived,
                                 Out* out, cudaStream_t stream, int lanes = 32, Out* out1 = nullptr) {
  if constexpr (kRealign && sizeof(T) < 8) {  // column_realigns: never float64
    if (column_realigns(x, inner)) {
      column_reduce_tiles<Vec16<T>::kLanes, T, Op, Out, true><<<grid, kColumnThreads, 0, stream>>>(
          x, outer, n, inner, range, lanes, partial, arrived, out, out1);
      return cudaGetLastError();
    }
  }
  if (column_lanes(x, inner) > 1) {
    column_reduce_tiles<Vec16<T>::kLanes, T, Op, Out><<<grid, kColumnThreads, 0, stream>>>(
        x, outer, n, inner, range, lanes, partial, arrived, out, out1);
  } else {
    column_reduce_tiles<1, T, Op, Out><<<grid, kColumnThreads, 0, stream>>>(
        x, outer, n, inner, range, lanes, partial, arrived, out, out1);
  }
  return cudaGetLastError();
}

// Lanes per column tile for a tensor of `inner` columns that gives the SMs a tile each where it
// can: 32 (a warp across 512 contiguous bytes of a row) while that makes at least one tile per
// SM, else halved down to the narrowest tile whose lanes still read a whole 32-byte sector of a
// row together. Hidden 768 in float32 is 6 tiles of 32 lanes on a 132-SM GPU (6 blocks each
// reading every row: 25 us for 2048 rows on the H200); 96 tiles of 2 lanes.
// `outer` slices of the same columns make outer times the tiles.
template <typename T>
inline cudaError_t filling_lanes(const T* x, int64_t inner, int* lanes, int64_t outer = 1) {
  int sms = 0;
  COURSE_CUDA_TRY(sm_count(&sms));
  const int64_t bytes_per_lane = int64_t{column_lanes(x, inner)} * static_cast<int64_t>(sizeof(T));
  const int64_t narrowest = bytes_per_lane >= 32 ? 1 : 32 / bytes_per_lane;
  int l = 32;
  while (l > narrowest && outer * column_tiles(x, inner, l) < sms) l /= 2;
  *lanes = l;
  return cudaSuccess;
}

// out[c] = sum over r of x[r * cols + c], accumulated in Acc<T> and rounded to Out once: a
// row-major [rows, cols] array reduced to one row, one block per tile and no split, so no
// workspace; narrow tiles (filling_lanes) when the columns alone make fewer tiles than SMs.
// Meant for what the fused backward kernels leave (a few hundred to a few thousand rows of
// per-block partial sums), not for tall inputs, which want chapter 3's split.
template <typename T, typename Out>
cudaError_t column_sum(const T* x, int64_t rows, int64_t cols, Out* out, cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  int lanes = 32;
  COURSE_CUDA_TRY(filling_lanes(x, cols, &lanes));
  const int64_t tiles = column_tiles(x, cols, lanes);
  const dim3 grid(static_cast<unsigned>(tiles < INT_MAX ? tiles : INT_MAX), 1);
  return launch_column_reduce<T, SumOp<typename Acc<T>::type>, Out>(x, 1, rows, cols, grid, rows, nullptr,
                                                                     nullptr, out, stream, lanes);
}

// Two such sums in one launch: out0[c] over the rows of x[0 .. rows), out1[c] over those of
// x[rows .. 2 rows) (LayerNorm's dweight and dbias partials, one array after the other). A
// launch less than two column_sum calls, and the two sums' tiles fill the SMs together.
template <typename T, typename Out>
cudaError_t column_sum_pair(const T* x, int64_t rows, int64_t cols, Out* out0, Out* out1, cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  int lanes = 32;
  COURSE_CUDA_TRY(filling_lanes(x, cols, &lanes, 2));
  const int64_t tiles = 2 * column_tiles(x, cols, lanes);
  const dim3 grid(static_cast<unsigned>(tiles < INT_MAX ? tiles : INT_MAX), 1);
  return launch_column_reduce<T, SumOp<typename Acc<T>::type>, Out>(x, 2, rows, cols, grid, rows, nullptr,
                                                                     nullptr, out0, stream, lanes, out1);
}

}  // namespace course
