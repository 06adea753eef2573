// Column reductions: out[o, c] = op over k of x[o, k, c] for a tensor seen as (outer, n, inner),
// reduced over n with the `inner` columns contiguous. The pattern behind every bias and weight
// gradient: chapter 3's `column_split` rung (sum(x, dim=0)) and chapter 4's dbias / dweight,
// which reduce the per-block partial sums their fused backward kernels write.
//
// The layout: a block takes a tile of 32 x kCols adjacent columns, its 8 warps every 8th row of
// the tile, each lane kCols adjacent columns (one 16-byte vector when the rows allow it). A
// warp reads 512 contiguous bytes of a row per instruction, with kColumnUnroll rows in flight.
// The 8 warps' sums meet in shared memory. When the tiles alone cannot fill the GPU, the reduced
// dimension is also split into ranges (grid.y), each written as a partial and combined in order
// by the last block of the tile to arrive. Every combine has a fixed order: deterministic.
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
constexpr int kColumnUnroll = 4;

template <int kCols, typename T, typename Op, typename Out>
__global__ void __launch_bounds__(32 * kColumnWarps) column_reduce_tiles(
    const T* __restrict__ x, int64_t outer, int64_t n, int64_t inner, int64_t range,
    typename Acc<T>::type* __restrict__ partial, unsigned* __restrict__ arrived, Out* __restrict__ out) {
  using A = typename Acc<T>::type;
  constexpr int kTile = 32 * kCols;
  __shared__ A smem[kColumnWarps][kTile];
  __shared__ bool last;
  const Op op;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const unsigned splits = gridDim.y;
  const int64_t tiles = ceil_div(inner, static_cast<int64_t>(kTile));
  const int64_t k_begin = blockIdx.y * range;
  const int64_t k_end = k_begin + range < n ? k_begin + range : n;
  for (int64_t t = blockIdx.x; t < outer * tiles; t += gridDim.x) {
    const int64_t o = t / tiles;
    const int64_t c0 = (t % tiles) * kTile + lane * kCols;  // this lane's first column
    const T* base = x + o * n * inner + c0;
    A acc[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[c] = Op::identity();
    if (c0 < inner) {
      if constexpr (kCols > 1) {
        // Whole vectors only: the launcher picks kCols > 1 only when inner is a multiple of it
        // and the rows are 16-byte aligned.
        using V = Vec16<T>;
        int64_t k = k_begin + warp;
        for (; k + (kColumnUnroll - 1) * kColumnWarps < k_end; k += kColumnUnroll * kColumnWarps) {
          V v[kColumnUnroll];
#pragma unroll
          for (int u = 0; u < kColumnUnroll; ++u) {
            v[u] = load16(reinterpret_cast<const V*>(base + (k + u * kColumnWarps) * inner));
          }
#pragma unroll
          for (int u = 0; u < kColumnUnroll; ++u) {
#pragma unroll
            for (int c = 0; c < kCols; ++c) acc[c] = op(acc[c], to_acc(v[u].v[c]));
          }
        }
        for (; k < k_end; k += kColumnWarps) {
          const V v = load16(reinterpret_cast<const V*>(base + k * inner));
#pragma unroll
          for (int c = 0; c < kCols; ++c) acc[c] = op(acc[c], to_acc(v.v[c]));
        }
      } else {
#pragma unroll 4
        for (int64_t k = k_begin + warp; k < k_end; k += kColumnWarps) acc[0] = op(acc[0], to_acc(base[k * inner]));
      }
    }
    // A previous tile's combine may still be reading smem in a slower warp.
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kCols; ++c) smem[warp][lane * kCols + c] = acc[c];
    __syncthreads();  // all 8 warps' sums are in shared memory before warp 0 adds them
    if (warp == 0) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        A total = smem[0][lane * kCols + c];
        for (int w = 1; w < kColumnWarps; ++w) total = op(total, smem[w][lane * kCols + c]);
        acc[c] = total;
      }
    }
    if (splits == 1) {
      if (warp == 0) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          if (c0 + c < inner) out[o * inner + c0 + c] = from_acc<Out>(acc[c]);
        }
      }
      continue;
    }
    if (warp == 0) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        if (c0 + c < inner) partial[(blockIdx.y * outer + o) * inner + c0 + c] = acc[c];
      }
      // Every lane's partials must be visible device-wide before the count that announces them.
      __threadfence();
      __syncwarp();  // all 32 lanes fenced before lane 0 arrives
      if (lane == 0) last = atomicAdd(&arrived[t], 1u) == splits - 1;
    }
    __syncthreads();  // every thread sees warp 0's `last`
    if (last && warp == 0) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        if (c0 + c < inner) {
          A total = Op::identity();
          for (unsigned s = 0; s < splits; ++s) total = op(total, __ldcg(&partial[(s * outer + o) * inner + c0 + c]));
          out[o * inner + c0 + c] = from_acc<Out>(total);
        }
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

// Tiles of one (outer) slice: the blocks a launch needs before any split of the reduced dim.
template <typename T>
inline int64_t column_tiles(const T* x, int64_t inner) {
  return ceil_div(inner, int64_t{32} * column_lanes(x, inner));
}

// One launch over `grid` (x: tiles, persistent beyond INT_MAX; y: ranges of `range` rows).
// With grid.y > 1, `partial` holds grid.y * outer * inner accumulators and `arrived` one zeroed
// counter per tile; with grid.y == 1 neither is touched.
template <typename T, typename Op, typename Out = T>
cudaError_t launch_column_reduce(const T* x, int64_t outer, int64_t n, int64_t inner, dim3 grid,
                                 int64_t range, typename Acc<T>::type* partial, unsigned* arrived,
                                 Out* out, cudaStream_t stream) {
  if (column_lanes(x, inner) > 1) {
    column_reduce_tiles<Vec16<T>::kLanes, T, Op, Out><<<grid, 32 * kColumnWarps, 0, stream>>>(
        x, outer, n, inner, range, partial, arrived, out);
  } else {
    column_reduce_tiles<1, T, Op, Out><<<grid, 32 * kColumnWarps, 0, stream>>>(
        x, outer, n, inner, range, partial, arrived, out);
  }
  return cudaGetLastError();
}

// out[c] = sum over r of x[r * cols + c], accumulated in Acc<T> and rounded to Out once: a
// row-major [rows, cols] array reduced to one row, one block per tile and no split, so no
// workspace. Meant for what the fused backward kernels leave (a few hundred rows of
// per-block partial sums), not for tall inputs, which want chapter 3's split.
template <typename T, typename Out>
cudaError_t column_sum(const T* x, int64_t rows, int64_t cols, Out* out, cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  const int64_t tiles = column_tiles(x, cols);
  const dim3 grid(static_cast<unsigned>(tiles < INT_MAX ? tiles : INT_MAX), 1);
  return launch_column_reduce<T, SumOp<typename Acc<T>::type>, Out>(x, 1, rows, cols, grid, rows, nullptr,
                                                                     nullptr, out, stream);
}

}  // namespace course
