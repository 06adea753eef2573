// Chapter 4 kernels: the backward of LayerNorm and RMSNorm (fused_add_rms_norm's too), v1..v2.
//
// With xhat = (x - mean) * rstd (RMSNorm: x * rstd) and g = dy * weight:
//   LayerNorm:  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
//   RMSNorm:    dx = rstd * (g - xhat * mean(g * xhat))
//   dweight = sum over rows of dy * xhat,   dbias = sum over rows of dy
// fused_add_rms_norm's backward is RMSNorm's plus the gradient of its second output (the sum h =
// x + residual), which reaches h directly: dh = dx + dsum, added here before dx is rounded and
// stored (kAddGrad), not by a kernel of its own after this one (which re-read dx and dsum and
// wrote dh: six trips of a row where four do).
// dx is a row reduction followed by a map that needs it (the forward's shape again); dweight and
// dbias are column reductions over all rows (the bias-gradient pattern of chapter 3).
//
// Napkin math: read x and dy, write dx, 3 x 2 B per bf16 element (mean, rstd and weight are
// small). The column sums must not re-read x and dy: each block keeps its own partial column
// sums (float32) while it passes over its rows, writes them once as one row of a [blocks, n]
// array, and course::column_sum (common/include/course/column_reduce.cuh, chapter 3's column
// reduction) adds those few hundred rows in a fixed order (LayerNorm's dweight and dbias in one
// launch, course::column_sum_pair). No float atomics: the same input gives the same dweight bits
// on every run, which atomicAdd's arrival order would not. Where the
// blocks take one or a few rows each (64 tokens), those partial rows would outweigh the rows
// they sum: then one launch (norm_backward_few_rows) writes dx in its first blocks and re-reads x
// and dy down the columns in the others (backward_column_pass in norm.h weighs the two).
//
// No torch headers: this file builds with a bare `nvcc -c`.
#include "norm.h"

#include <course/column_reduce.cuh>
#include <course/cuda_utils.h>
#include <course/numeric.cuh>
#include <course/reduce.cuh>
#include <course/rows.cuh>

#include <type_traits>
#include <utility>

namespace fusion {
namespace norm {
namespace {

using namespace ::course::rows;  // NOLINT: load_tile, store_tile, tile_index, grid_for, ...
using course::Acc;
using course::from_acc;
using course::SumOp;
using course::to_acc;
using course::Vec16;

constexpr int kThreads = 256;  // the streamed kernel's block: one row at a time
// The resident kernel's block when a row takes fewer threads: several rows share it, so that
// fewer blocks (and so fewer partial rows for the column sum) still fill an SM.
constexpr int kBackwardBlock = 512;

template <int kThreadsPerRow>
constexpr int kSlots = kThreadsPerRow < kBackwardBlock ? kBackwardBlock / kThreadsPerRow : 1;

// The row sums of v[0..kCount) over the kThreadsPerRow threads of this thread's row (slot) when
// a block holds several rows, in place: shuffles for a warp row; for a multi-warp row, its warps'
// sums meet in smem[s * 32 + slot's warps] (at least 32 * kCount values). Every thread of the
// block must call it. LayerNorm's two sums (of g and of g * xhat) are independent, so they go
// through one call: their shuffles interleave and they share one pair of barriers, where two
// calls in a row were two rounds of shuffles, barriers and shared memory, one after the other
// on the critical path of every row (a whole step of the chain at few rows, where each block
// has one row to do).
template <int kThreadsPerRow, int kCount, typename A>
__device__ __forceinline__ void slot_reduce(A (&v)[kCount], A* smem) {
#pragma unroll
  for (int s = 0; s < kCount; ++s) {
    v[s] = course::warp_reduce(v[s], SumOp<A>(), kThreadsPerRow < 32 ? kThreadsPerRow : 32);
  }
  if constexpr (kThreadsPerRow > 32) {
    constexpr int kWarps = kThreadsPerRow / 32;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    // A previous slot_reduce on the same smem may still be reading it in a slower warp.
    __syncthreads();
    if (lane == 0) {
#pragma unroll
      for (int s = 0; s < kCount; ++s) smem[s * 32 + warp] = v[s];
    }
    // Every warp's sums must be in smem before the warps of its row read them.
    __syncthreads();
    const int first = warp / kWarps * kWarps;
#pragma unroll
    for (int s = 0; s < kCount; ++s) {
      v[s] = course::warp_reduce(lane < kWarps ? smem[s * 32 + first + lane] : A(0), SumOp<A>());
    }
  }
}

// v1: streamed, a block per row (blocks take rows b, b + grid, ...). Pass 1 reads x and dy for
// the two row sums; pass 2 reads them again to write dx, and adds dy * xhat and dy into the
// block's partial rows of dweight and dbias in global memory (each column always by the same
// thread: no race, a fixed order). Straightforward, and the fallback of v2 for rows too long
// for registers; it reads x and dy twice and moves the partials through memory on every row.
template <typename T, bool kCentered>
__global__ void __launch_bounds__(kThreads)
    norm_backward_streamed(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ weight,
                           const typename Acc<T>::type* __restrict__ mean, const typename Acc<T>::type* __restrict__ rstd,
                           T* __restrict__ dx, typename Acc<T>::type* __restrict__ dweight_partial,
                           typename Acc<T>::type* __restrict__ dbias_partial, int64_t rows, int64_t n,
                           const T* __restrict__ dsum) {
  using A = typename Acc<T>::type;
  __shared__ A smem[kThreads / 32];
  A* dw = dweight_partial + blockIdx.x * n;
  A* db = kCentered ? dbias_partial + blockIdx.x * n : nullptr;
  // The launcher's grid never exceeds rows, so every block's first row initializes its
  // partial rows: no zero-filled workspace.
  bool first = true;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    const T* dyr = dy + r * n;
    const A mu = kCentered ? mean[r] : A(0);
    const A rs = rstd[r];
    A sum_g = A(0);
    A sum_gx = A(0);
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      const A g = to_acc(dyr[i]) * to_acc(weight[i]);
      sum_g += g;
      sum_gx += g * (to_acc(xr[i]) - mu) * rs;
    }
    sum_gx = course::block_reduce<kThreads>(sum_gx, SumOp<A>(), smem);
    if constexpr (kCentered) sum_g = course::block_reduce<kThreads>(sum_g, SumOp<A>(), smem);
    const A mean_g = kCentered ? sum_g / static_cast<A>(n) : A(0);
    const A mean_gx = sum_gx / static_cast<A>(n);
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      const A d = to_acc(dyr[i]);
      const A xhat = (to_acc(xr[i]) - mu) * rs;
      // dsum (fused_add_rms_norm, else null): one uniform branch; this kernel is the fallback.
      const A extra = dsum != nullptr ? to_acc(dsum[r * n + i]) : A(0);
      dx[r * n + i] = from_acc<T>(rs * (d * to_acc(weight[i]) - mean_g - xhat * mean_gx) + extra);
      dw[i] = (first ? A(0) : dw[i]) + d * xhat;
      if constexpr (kCentered) db[i] = (first ? A(0) : db[i]) + d;
    }
    first = false;
  }
}

// Writes one block's partial column sums: acc[j][l] of each thread, for the column
// tile_index(j, l, t), summed over the block's kSlots rows in slot order through shared memory
// (one vector of the tile at a time, to keep the buffer at kBackwardBlock x kLanes values).
template <Access kAccess, int kThreadsPerRow, int kVectors, int kLanes, typename A>
__device__ __forceinline__ void write_partial(const A (&acc)[kVectors][kLanes], A* __restrict__ partial, int64_t n,
                                              A* combine) {
  constexpr int kBlock = kThreadsPerRow * kSlots<kThreadsPerRow>;
  const int t = threadIdx.x % kThreadsPerRow;
  const int slot = threadIdx.x / kThreadsPerRow;
  const RowSpan columns{n, 0, n};  // the row of partials: n columns from its start
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
    if constexpr (kSlots<kThreadsPerRow> == 1) {
#pragma unroll
      for (int l = 0; l < kLanes; ++l) {
        // columns past the row end are padding
        if (tile_valid<kAccess, kThreadsPerRow, kVectors, kLanes>(j, l, t, columns)) {
          partial[tile_index<kAccess, kThreadsPerRow, kVectors, kLanes>(j, l, t, columns)] = acc[j][l];
        }
      }
    } else {
      // The previous vector's sums (or the last slot_reduce) may still be reading `combine`.
      __syncthreads();
#pragma unroll
      for (int l = 0; l < kLanes; ++l) combine[l * kBlock + threadIdx.x] = acc[j][l];
      // Every slot's values are in shared memory before slot 0 adds them.
      __syncthreads();
      if (slot == 0) {
#pragma unroll
        for (int l = 0; l < kLanes; ++l) {
          if (tile_valid<kAccess, kThreadsPerRow, kVectors, kLanes>(j, l, t, columns)) {  // not padding
            A total = A(0);
            for (int s = 0; s < kSlots<kThreadsPerRow>; ++s) total += combine[l * kBlock + s * kThreadsPerRow + t];
            partial[tile_index<kAccess, kThreadsPerRow, kVectors, kLanes>(j, l, t, columns)] = total;
          }
        }
      }
    }
  }
}

// v2: x and dy held in registers (course::rows::load_tile, 16-byte vectors, as stored), the
// weight row too (loaded once per thread for all its rows). One pass: the two row sums, then dx
// from the registers; x and dy are read once and dx written once, the least traffic there is.
// Each thread also owns the same columns of every row it takes, so its share of dweight and
// dbias accumulates across rows and leaves the block once, as one partial row (write_partial):
// the column sums cost a few hundred rows of n floats, not a pass over x and dy. Rows that start
// mid-vector read single elements (Access::kScalar), which keeps every thread on the same columns
// of every row: its dweight and dbias sums need that, and a row's head would move them from row
// to row.
//
// Where the sums live: in registers, up to 512-thread rows (8192 elements: 128 registers a
// thread, two blocks of 512 or one of 1024 threads per SM). A 1024-thread row (hidden 12288 and
// 16384: 16 elements a thread) has 64 registers a thread, and its 32 float sums spilled 200-700
// bytes a thread there (ptxas -v): they live in shared memory instead (kSharedSums, 64 or 128 KB
// of dynamic shared memory, one block per SM), each thread updating only its own words, so no
// barrier guards them. Before this shape such rows ran v1's kernel, at 14% of copy on the H200.
template <int kThreadsPerRow>
constexpr bool kSharedSums = kThreadsPerRow >= 1024;

template <typename T, bool kCentered, int kThreadsPerRow, int kVectors, bool kSums = true>
constexpr int64_t shared_sums_bytes() {
  return kSums && kSharedSums<kThreadsPerRow>
             ? int64_t{kCentered ? 2 : 1} * kVectors * Vec16<T>::kLanes * kThreadsPerRow * int64_t{sizeof(typename Acc<T>::type)}
             : 0;
}

// kSums false: the kernel writes dx only, and the column tiles of the same launch sum dweight and
// dbias (norm_backward_few_rows; backward_column_pass in norm.h says when). Without the sums a thread holds x, dy and weight
// and little else, yet nvcc 13.0 gave LayerNorm's bfloat16 rows of 64 to 512 threads 89-94
// registers (ptxas -v): one block of 512 threads an SM, 16 warps to hide each row's loads. Asked
// for two blocks an SM, it fits them in 64 (8-12 bytes a thread spilled, once a row step; ptxas
// -v), as RMSNorm's rows already were: 32 warps an SM. The kernel with the sums keeps its
// registers: its 32 float sums a thread would spill.
template <int kThreadsPerRow, bool kSums>
constexpr int kBackwardMinBlocks = !kSums && kThreadsPerRow * kSlots<kThreadsPerRow> <= kBackwardBlock ? 2 : 1;

// The body is a device function of the block's index and the number of blocks that share the rows
// (blockIdx.x and gridDim.x for norm_backward_resident itself), so that norm_backward_few_rows can
// run it in the first blocks of a grid whose other blocks sum the columns.
// kAddGrad (RMSNorm only): dsum's row is loaded beside x and dy and added to dx before it is
// rounded (fused_add_rms_norm's dh).
template <typename T, bool kCentered, int kThreadsPerRow, int kVectors, Access kAccess, bool kSums, bool kAddGrad>
__device__ __forceinline__ void resident_rows(const T* __restrict__ dy, const T* __restrict__ x,
                                              const T* __restrict__ weight,
                                              const typename Acc<T>::type* __restrict__ mean,
                                              const typename Acc<T>::type* __restrict__ rstd, T* __restrict__ dx,
                                              typename Acc<T>::type* __restrict__ dweight_partial,
                                              typename Acc<T>::type* __restrict__ dbias_partial, int64_t rows,
                                              int64_t n, int64_t block, int64_t blocks, const T* __restrict__ dsum) {
  using A = typename Acc<T>::type;
  static_assert(!(kAddGrad && kCentered), "dsum is fused_add_rms_norm's: RMSNorm only");
  constexpr int kLanes = Vec16<T>::kLanes;
  constexpr int kRows = kSlots<kThreadsPerRow>;
  constexpr int kBlock = kThreadsPerRow * kRows;
  constexpr bool kShared = kSums && kSharedSums<kThreadsPerRow>;
  static_assert(!kShared || kVectors * kLanes == kMaxBackwardElementsPerThread,
                "run_backward sizes the shared sums as kMaxBackwardElementsPerThread a thread");
  __shared__ A smem[2 * 32];  // slot_reduce's: 32 warps' sums of each of LayerNorm's two
  __shared__ A combine[kSums && kRows > 1 ? kBlock * kLanes : 1];
  // kShared: element (j, l) of thread t's dweight sum at [(j * kLanes + l) * kBlock + t] (a warp's
  // 32 threads on 32 banks), dbias's after all of dweight's.
  extern __shared__ __align__(16) unsigned char sums_bytes[];
  A* const sums = reinterpret_cast<A*>(sums_bytes);
  constexpr int kSumsPerThread = kVectors * kLanes;
  const T zero = from_acc<T>(A(0));
  const int t = threadIdx.x % kThreadsPerRow;
  T w[kVectors][kLanes];
  static_assert(kAccess != Access::kChunks, "a thread's columns must not move from row to row");
  load_tile<kAccess, kThreadsPerRow, kVectors>(weight, RowSpan{n, 0, n}, t, zero, w);
  A dw[kShared ? 1 : kVectors][kLanes];
  A db[kShared ? 1 : kVectors][kLanes];
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
#pragma unroll
    for (int l = 0; l < kLanes; ++l) {
      if constexpr (kShared) {
        sums[(j * kLanes + l) * kBlock + threadIdx.x] = A(0);
        if constexpr (kCentered) sums[(kSumsPerThread + j * kLanes + l) * kBlock + threadIdx.x] = A(0);
      } else if constexpr (kSums) {
        dw[j][l] = db[j][l] = A(0);
      }
    }
  }
  // The whole block steps together (its reductions need every thread); a slot past the last
  // row works on padding: x = dy = 0 adds nothing to dweight or dbias, and stores nothing.
  for (int64_t first = block * kRows; first < rows; first += blocks * kRows) {
    const int64_t r = first + threadIdx.x / kThreadsPerRow;
    const int64_t len = r < rows ? n : 0;
    const int64_t row = r < rows ? r : 0;
    T xv[kVectors][kLanes];
    T dyv[kVectors][kLanes];
    const RowSpan span{len, 0, len};
    load_tile<kAccess, kThreadsPerRow, kVectors>(x + row * n, span, t, zero, xv);
    load_tile<kAccess, kThreadsPerRow, kVectors>(dy + row * n, span, t, zero, dyv);
    // Loaded with x and dy, so that its latency hides behind theirs and the row sums, not after
    // them: under the few-rows launch's 64 registers that spills 56-64 bytes a thread (ptxas -v,
    // sm_90a), an L1 trip, where a load after the sums is a second round trip to DRAM.
    T sv[kAddGrad ? kVectors : 1][kLanes];
    if constexpr (kAddGrad) load_tile<kAccess, kThreadsPerRow, kVectors>(dsum + row * n, span, t, zero, sv);
    const A mu = kCentered ? mean[row] : A(0);
    const A rs = rstd[row];
    A sum_g = A(0);
    A sum_gx = A(0);
#pragma unroll
    for (int j = 0; j < kVectors; ++j) {
#pragma unroll
      for (int l = 0; l < kLanes; ++l) {
        const A d = to_acc(dyv[j][l]);
        const A xhat = (to_acc(xv[j][l]) - mu) * rs;
        const A g = d * to_acc(w[j][l]);
        sum_g += g;
        sum_gx += g * xhat;
        if constexpr (kShared) {
          sums[(j * kLanes + l) * kBlock + threadIdx.x] += d * xhat;
          if constexpr (kCentered) sums[(kSumsPerThread + j * kLanes + l) * kBlock + threadIdx.x] += d;
        } else if constexpr (kSums) {
          dw[j][l] += d * xhat;
          db[j][l] += d;
        }
      }
    }
    A sums_row[kCentered ? 2 : 1];
    sums_row[0] = sum_gx;
    if constexpr (kCentered) sums_row[1] = sum_g;
    slot_reduce<kThreadsPerRow>(sums_row, smem);
    const A mean_gx = sums_row[0] / static_cast<A>(n);
    const A mean_g = kCentered ? sums_row[1] / static_cast<A>(n) : A(0);
#pragma unroll
    for (int j = 0; j < kVectors; ++j) {
#pragma unroll
      for (int l = 0; l < kLanes; ++l) {
        const A xhat = (to_acc(xv[j][l]) - mu) * rs;
        A d = rs * (to_acc(dyv[j][l]) * to_acc(w[j][l]) - mean_g - xhat * mean_gx);
        if constexpr (kAddGrad) d += to_acc(sv[j][l]);
        dyv[j][l] = from_acc<T>(d);
      }
    }
    store_tile<kAccess, kThreadsPerRow, kVectors>(dx + row * n, span, t, dyv);
  }
  if constexpr (kShared) {
    // One row per block (kRows == 1). The sums leave as whole rows of the partials, in column
    // order: a thread's own columns are kLanes apart in a row (a 16-byte vector's elements), so
    // each thread storing its own wrote every 4-byte sum into a 32-byte sector of its own, 32
    // sectors a warp store, and these two rows of up to 16384 sums at the end of every block
    // were some 20 us of the H200's LayerNorm backward at hidden 12288 and 16384 (115 us at 2048
    // tokens where torch.compile took 92; most of the 39-47 us at 64). So each array of sums is
    // put in column order in its own shared memory first, then written out by consecutive
    // threads at consecutive columns.
    static_assert(kRows == 1, "shared sums serve one-row blocks");
    const RowSpan columns{n, 0, n};
#pragma unroll
    for (int s = 0; s < (kCentered ? 2 : 1); ++s) {
      A* const region = sums + s * kSumsPerThread * kBlock;  // kSumsPerThread * kBlock >= n sums
      A* const out = (s == 0 ? dweight_partial : dbias_partial) + block * n;
      A mine[kVectors][kLanes];
#pragma unroll
      for (int j = 0; j < kVectors; ++j) {
#pragma unroll
        for (int l = 0; l < kLanes; ++l) mine[j][l] = region[(j * kLanes + l) * kBlock + threadIdx.x];
      }
      __syncthreads();  // every thread holds its sums before any slot of them is overwritten below
#pragma unroll
      for (int j = 0; j < kVectors; ++j) {
#pragma unroll
        for (int l = 0; l < kLanes; ++l) {
          if (tile_valid<kAccess, kThreadsPerRow, kVectors, kLanes>(j, l, t, columns)) {  // padding has no column
            region[tile_index<kAccess, kThreadsPerRow, kVectors, kLanes>(j, l, t, columns)] = mine[j][l];
          }
        }
      }
      __syncthreads();  // the whole row of sums is in column order before any of it is written out
      for (int64_t c = threadIdx.x; c < n; c += kBlock) out[c] = region[c];
    }
  } else if constexpr (kSums) {
    write_partial<kAccess, kThreadsPerRow, kVectors>(dw, dweight_partial + block * n, n, combine);
    if constexpr (kCentered) write_partial<kAccess, kThreadsPerRow, kVectors>(db, dbias_partial + block * n, n, combine);
  }
}

template <typename T, bool kCentered, int kThreadsPerRow, int kVectors, Access kAccess, bool kAddGrad,
          bool kSums = true>
__global__ void __launch_bounds__(kThreadsPerRow * kSlots<kThreadsPerRow>, (kBackwardMinBlocks<kThreadsPerRow, kSums>))
    norm_backward_resident(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ weight,
                           const typename Acc<T>::type* __restrict__ mean, const typename Acc<T>::type* __restrict__ rstd,
                           T* __restrict__ dx, typename Acc<T>::type* __restrict__ dweight_partial,
                           typename Acc<T>::type* __restrict__ dbias_partial, int64_t rows, int64_t n,
                           const T* __restrict__ dsum) {
  resident_rows<T, kCentered, kThreadsPerRow, kVectors, kAccess, kSums, kAddGrad>(
      dy, x, weight, mean, rstd, dx, dweight_partial, dbias_partial, rows, n, blockIdx.x, gridDim.x, dsum);
}

// The column half of backward_column_pass (norm.h): dweight[c] = sum over rows of dy * xhat and
// dbias[c] = sum of dy, read down the columns from x and dy, with the rows' mean and rstd; chapter
// 3's column tiling (course/column_reduce.cuh): a tile is `lanes` x kCols adjacent columns (one
// 16-byte vector a lane where the rows are whole aligned vectors), the block's first 8 warps take
// every 8th group of rows, kUnroll groups in flight; the warps' sums meet in shared memory and the
// block adds them in a fixed order (tile_column_totals). One block a tile and no split of the
// rows: it runs only at few rows (backward_column_pass: one or a few rows a block, or at most
// 256 rows in all). The block may have more than course::kColumnThreads threads (it shares a launch with
// the resident rows, norm_backward_few_rows): the others sum nothing but reach every barrier.
template <typename T, bool kCentered, int kCols, int kUnroll>
__device__ __forceinline__ void column_tile(const T* __restrict__ dy, const T* __restrict__ x,
                                            const typename Acc<T>::type* __restrict__ mean,
                                            const typename Acc<T>::type* __restrict__ rstd, T* __restrict__ dweight,
                                            T* __restrict__ dbias, int64_t rows, int64_t n, int lanes, int64_t tile) {
  using A = typename Acc<T>::type;
  constexpr int kWarps = course::kColumnWarps;
  constexpr int kTile = 32 * kCols;
  // Each warp's sums for its rows of the tile's columns, as course::tile_column_totals reads them.
  __shared__ A sums_w[kWarps * kTile];
  __shared__ A sums_b[kCentered ? kWarps * kTile : 1];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const bool worker = warp < kWarps;     // the block's first kColumnThreads threads
  const int rows_per_warp = 32 / lanes;  // lanes is a power of two: 1, 2, ..., 32
  const int sub = lane / lanes;          // which of the warp's rows this lane reads
  const int64_t c0 = tile * lanes * kCols + lane % lanes * kCols;
  const int64_t row_step = static_cast<int64_t>(kWarps) * rows_per_warp;
  A acc_w[kCols];
  A acc_b[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) acc_w[c] = acc_b[c] = A(0);
  if (worker && c0 < n) {  // the last tile's lanes past the row's end sum nothing
    for (int64_t k = warp * rows_per_warp + sub; k < rows; k += kUnroll * row_step) {
      T dv[kUnroll][kCols];
      T xv[kUnroll][kCols];
      A mu[kUnroll];
      A rs[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t r = k + u * row_step;
        if (r < rows) {  // the group's later rows may lie past the last
          if constexpr (kCols > 1) {
            const Vec16<T> d = course::load16(reinterpret_cast<const Vec16<T>*>(dy + r * n + c0));
            const Vec16<T> v = course::load16(reinterpret_cast<const Vec16<T>*>(x + r * n + c0));
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
              dv[u][c] = d.v[c];
              xv[u][c] = v.v[c];
            }
          } else {
            dv[u][0] = dy[r * n + c0];
            xv[u][0] = x[r * n + c0];
          }
          mu[u] = kCentered ? mean[r] : A(0);
          rs[u] = rstd[r];
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (k + u * row_step < rows) {
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            const A d = to_acc(dv[u][c]);
            acc_w[c] += d * ((to_acc(xv[u][c]) - mu[u]) * rs[u]);
            acc_b[c] += d;
          }
        }
      }
    }
  }
  if (worker) {  // the sums' kWarps * kTile slots are the first kWarps warps'
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      sums_w[warp * kTile + lane * kCols + c] = acc_w[c];
      if constexpr (kCentered) sums_b[warp * kTile + lane * kCols + c] = acc_b[c];
    }
  }
  __syncthreads();  // every warp's sums are in shared memory before the block adds them
  // The whole block adds each column's sums (tile_column_totals, a fixed order): with 2 lanes a
  // tile (hidden 2048 in bfloat16), warp 0's two lanes adding them alone were 1024 dependent
  // adds a lane for each of dweight and dbias.
  const int width = lanes * kCols;
  const int64_t first = tile * width;
  const A total_w = course::tile_column_totals<kCols>(sums_w, lanes, SumOp<A>());
  if (static_cast<int>(threadIdx.x) < width && first + threadIdx.x < n) {  // the last tile's columns past the row's end
    dweight[first + threadIdx.x] = from_acc<T>(total_w);
  }
  if constexpr (kCentered) {
    const A total_b = course::tile_column_totals<kCols>(sums_b, lanes, SumOp<A>());
    if (static_cast<int>(threadIdx.x) < width && first + threadIdx.x < n) dbias[first + threadIdx.x] = from_acc<T>(total_b);
  }
}

// Row groups a column lane keeps in flight in norm_backward_few_rows (few_rows_unroll in norm.h):
// half of chapter 3's. That launch keeps the resident rows' register budget (64 a thread:
// kBackwardMinBlocks), and with four groups of two 16-byte vectors in flight the column half
// spilled 114-228 bytes a thread in bfloat16 (ptxas -v, sm_90a); with two, at most 12, as the dx
// kernel alone.
template <int kCols>
constexpr int kFewRowsUnroll = few_rows_unroll(kCols);
static_assert(kFewRowsUnroll<8> == course::kColumnUnroll / 2 && kFewRowsUnroll<1> == course::kColumnUnrollScalar / 2,
              "norm.h's few_rows_unroll is half of chapter 3's unrolls");
static_assert(course::kColumnWarps == 8, "norm.h's column_pass_step_rows counts 8 warps a column tile");

// backward_column_pass's one launch (norm.h says where): blocks 0 .. dx_blocks - 1 are the
// resident kernel without its sums (dx alone, the rows shared out as in norm_backward_resident),
// the blocks after them each one column tile of dweight and dbias (column_tile). Neither half reads
// what the other writes (both read x, dy, mean and rstd; one writes dx, the other dweight and
// dbias), so no block waits for another: no counter, no fence, and nothing to reset between calls
// (a CUDA graph replays it as is). Each column is still summed by one block in a fixed order:
// deterministic. Why one launch: at few rows every kernel is mostly latency, and what this
// replaces was two kernels back to back (the dx-only rows, then a column pass; or the rows with
// their partial sums, then course::column_sum over them); the column tiles now run beside the rows
// instead of after them. The dx blocks come first in the grid: the block scheduler hands out low
// indices first, and they carry the longer chain (two row sums, then dx). The block is the
// resident shape's (kThreadsPerRow x its rows, 512 or 1024 threads); a column block uses its first
// kColumnThreads (the tiling chapter 3's column sums are written for), and its other threads only
// reach the barriers.
template <typename T, bool kCentered, int kThreadsPerRow, int kVectors, Access kAccess, int kCols, bool kAddGrad>
__global__ void __launch_bounds__(kThreadsPerRow * kSlots<kThreadsPerRow>, (kBackwardMinBlocks<kThreadsPerRow, false>))
    norm_backward_few_rows(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ weight,
                           const typename Acc<T>::type* __restrict__ mean, const typename Acc<T>::type* __restrict__ rstd,
                           T* __restrict__ dx, T* __restrict__ dweight, T* __restrict__ dbias, int64_t rows, int64_t n,
                           int64_t dx_blocks, int lanes, const T* __restrict__ dsum) {
  static_assert(kThreadsPerRow * kSlots<kThreadsPerRow> >= course::kColumnThreads, "a column tile takes 8 warps");
  // Which half is uniform across the block, so each half's barriers see every thread.
  if (static_cast<int64_t>(blockIdx.x) < dx_blocks) {
    resident_rows<T, kCentered, kThreadsPerRow, kVectors, kAccess, false, kAddGrad>(
        dy, x, weight, mean, rstd, dx, nullptr, nullptr, rows, n, blockIdx.x, dx_blocks, dsum);
  } else {
    column_tile<T, kCentered, kCols, kFewRowsUnroll<kCols>>(dy, x, mean, rstd, dweight, dbias, rows, n, lanes,
                                                         blockIdx.x - dx_blocks);
  }
}

// ===========================================================================================
// Launchers
// ===========================================================================================
// Calls f(std::integral_constant<int, I>) for backward shape `shape`; shapes a dtype never
// uses (backward_shape_fits) are not instantiated.
template <typename T, int I = 0, typename F>
cudaError_t with_backward_shape(int shape, F&& f) {
  if constexpr (I == kNumBackwardShapes) {
    return cudaErrorInvalidValue;
  } else {
    if constexpr (backward_shape_fits(kBackwardShapes[I], sizeof(T))) {
      if (shape == I) return f(std::integral_constant<int, I>{});
    }
    return with_backward_shape<T, I + 1>(shape, std::forward<F>(f));
  }
}

// Calls f(centered, add_grad) as std::bool_constant pairs: LayerNorm (no dsum), RMSNorm, and RMSNorm
// with dsum; LayerNorm with a dsum is never instantiated (run_backward refuses it).
template <typename F>
cudaError_t with_norm_kind(bool centered, bool add_grad, F&& f) {
  if (centered) return f(std::true_type{}, std::false_type{});
  return add_grad ? f(std::false_type{}, std::true_type{}) : f(std::false_type{}, std::false_type{});
}

// The grid of a backward launch: as many blocks as the GPU keeps resident (each then takes
// several rows, so its partial row sums many rows), never more than there are rows, since
// every block's partial row must be written.
template <typename Kernel>
cudaError_t backward_grid(Kernel kernel, int threads, int64_t rows_per_block, int64_t rows, int64_t* grid,
                          int64_t smem_bytes = 0) {
  int64_t resident = 0;
  COURSE_CUDA_TRY(course::resident_grid(kernel, threads, &resident, static_cast<size_t>(smem_bytes)));
  const int64_t needed = course::ceil_div(rows, rows_per_block);
  *grid = needed < resident ? needed : resident;
  return cudaSuccess;
}

// Runs the backward, or with `grid_only` only says how many blocks (partial rows) it will use: 0
// where the column pass replaces them (backward_column_pass).
template <typename T>
cudaError_t run_backward(const NormBackwardParams& p, cudaStream_t stream, int64_t* grid_only) {
  using A = typename Acc<T>::type;
  const bool centered = p.kind == NormKind::kLayerNorm;
  const T* dy = static_cast<const T*>(p.dy);
  const T* x = static_cast<const T*>(p.x);
  const T* weight = static_cast<const T*>(p.weight);
  const A* mean = static_cast<const A*>(p.mean);
  const A* rstd = static_cast<const A*>(p.rstd);
  T* dx = static_cast<T*>(p.dx);
  const T* dsum = static_cast<const T*>(p.dsum);
  if (centered && dsum != nullptr) return cudaErrorInvalidValue;  // dsum is RMSNorm's (norm.h)
  A* dw_partial = static_cast<A*>(p.workspace);
  int64_t grid = 0;
  // The partial rows, then the reduction of them into dweight (and dbias), once the grid is known.
  auto finish = [&]() -> cudaError_t {
    COURSE_CUDA_TRY(cudaGetLastError());
    if (centered) {  // dweight's and dbias's partial rows, one array after the other: one launch
      return course::column_sum_pair(dw_partial, grid, p.n, static_cast<T*>(p.dweight), static_cast<T*>(p.dbias),
                                     stream);
    }
    return course::column_sum(dw_partial, grid, p.n, static_cast<T*>(p.dweight), stream);
  };
  int shape = p.version == NormBackwardVersion::kResident ? backward_shape(p.n, sizeof(T)) : -1;
  if (shape >= 0 && kBackwardShapes[shape].threads >= 1024) {
    // The 1024-thread rows' sums in shared memory (64 or 128 KB): more than a block may have on
    // some GPUs (64 KB on sm_75, 99 KB on sm_86 and sm_89); there the row is streamed (v1's kernel).
    int optin = 0;
    COURSE_CUDA_TRY(course::cached_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(&optin));
    const int64_t bytes = int64_t{centered ? 2 : 1} * kMaxBackwardElementsPerThread * kBackwardShapes[shape].threads *
                          static_cast<int64_t>(sizeof(A));
    if (bytes > optin) shape = -1;
  }
  if constexpr (sizeof(T) != 8) {
    if (shape >= 0) {
      const Access access = row_access<T>(p.n, {p.dy, p.x, p.dx, p.dsum}, {p.weight});  // dsum: null ignored
      return with_backward_shape<T>(shape, [&](auto s) {
        constexpr NormShape kShape = kBackwardShapes[decltype(s)::value];
        constexpr int kRows = kSlots<kShape.threads>;
        return with_norm_kind(centered, dsum != nullptr, [&](auto c, auto g) {
          return with_access</*kAllowChunks=*/false>(access, [&](auto a) {
            constexpr bool kC = decltype(c)::value;
            constexpr bool kG = decltype(g)::value;
            auto* kernel = norm_backward_resident<T, kC, kShape.threads, kShape.vectors, decltype(a)::value, kG>;
            constexpr int64_t kSums = shared_sums_bytes<T, kC, kShape.threads, kShape.vectors>();
            if constexpr (kSums > 0) {
              // Past 48 KB a kernel must ask for its dynamic shared memory (set before the
              // occupancy query, which counts it).
              COURSE_CUDA_TRY(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSums)));
            }
            COURSE_CUDA_TRY(backward_grid(kernel, kShape.threads * kRows, kRows, p.rows, &grid, kSums));
            // The column tiles read whole vectors where the rows do (kVectors: every row of dy and x
            // aligned, n a whole number of vectors), else single elements.
            constexpr Access kA = decltype(a)::value;
            constexpr int kCols = kA == Access::kVectors ? Vec16<T>::kLanes : 1;
            int sms = 0;
            COURSE_CUDA_TRY(course::sm_count(&sms));
            if (backward_column_pass(p.rows, p.n, static_cast<int>(sizeof(T)), kCols, kC, grid, sms)) {
              // Few rows: dx and the column sums from one launch (norm_backward_few_rows), no
              // partial rows and no workspace.
              auto* few = norm_backward_few_rows<T, kC, kShape.threads, kShape.vectors, kA, kCols, kG>;
              if (grid_only != nullptr) {
                *grid_only = 0;
                return cudaSuccess;
              }
              int64_t dx_blocks = 0;
              COURSE_CUDA_TRY(backward_grid(few, kShape.threads * kRows, kRows, p.rows, &dx_blocks));
              // The column tiles narrow only as far as the whole grid stays one wave of this
              // kernel (column_pass_tiles in norm.h: the tiles' width, and what a second wave cost).
              int64_t wave = 0;
              COURSE_CUDA_TRY(course::resident_grid(few, kShape.threads * kRows, &wave, 0));
              const ColumnTiles tiles = column_pass_tiles(p.n, kCols, static_cast<int>(sizeof(T)), sms,
                                                          wave > dx_blocks ? wave - dx_blocks : 1);
              // dx_blocks + tiles: at most a wave of the rows plus n tiles, far below gridDim.x's limit.
              few<<<grid_for(dx_blocks + tiles.tiles), kShape.threads * kRows, 0, stream>>>(
                  dy, x, weight, mean, rstd, dx, static_cast<T*>(p.dweight), static_cast<T*>(p.dbias), p.rows, p.n,
                  dx_blocks, tiles.lanes, dsum);
              return cudaGetLastError();
            }
            if (grid_only != nullptr) {
              *grid_only = grid;
              return cudaSuccess;
            }
            kernel<<<grid_for(grid), kShape.threads * kRows, kSums, stream>>>(dy, x, weight, mean, rstd, dx, dw_partial,
                                                                              dw_partial + grid * p.n, p.rows, p.n, dsum);
            return finish();
          });
        });
      });
    }
  }
  return with_flag(centered, [&](auto c) {
    auto* kernel = norm_backward_streamed<T, decltype(c)::value>;
    COURSE_CUDA_TRY(backward_grid(kernel, kThreads, 1, p.rows, &grid));
    if (grid_only != nullptr) {
      *grid_only = grid;
      return cudaSuccess;
    }
    kernel<<<grid_for(grid), kThreads, 0, stream>>>(dy, x, weight, mean, rstd, dx, dw_partial, dw_partial + grid * p.n,
                                                    p.rows, p.n, dsum);
    return finish();
  });
}

}  // namespace

cudaError_t norm_backward_workspace(const NormBackwardParams& p, int64_t* bytes) {
  *bytes = 0;
  if (p.rows == 0 || p.n == 0) return cudaSuccess;
  return with_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    int64_t grid = 0;
    COURSE_CUDA_TRY(run_backward<T>(p, nullptr, &grid));
    const int64_t partial_rows = p.kind == NormKind::kLayerNorm ? 2 : 1;  // dweight (and dbias)
    *bytes = partial_rows * grid * p.n * static_cast<int64_t>(sizeof(typename Acc<T>::type));
    return cudaSuccess;
  });
}

cudaError_t launch_norm_backward(const NormBackwardParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.n == 0) return cudaSuccess;
  return with_dtype(p.dtype, [&](auto tag) { return run_backward<decltype(tag)>(p, stream, nullptr); });
}

}  // namespace norm
}  // namespace fusion
