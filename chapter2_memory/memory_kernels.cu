// Chapter 2 kernels: what moving data costs, and how the access pattern decides it.
//
// Three ops, all pure data movement, so every kernel is instantiated per element size
// (uint16_t, uint32_t, uint64_t) and never interprets a value:
//   copy          the bandwidth ceiling itself: v1 scalar, v2 16-byte vectorized;
//   strided_copy  dst[i] = src[i * stride]: what a strided read costs;
//   transpose     the ladder v1..v5, from scattered writes to a bank-conflict-free wide tile
//                 at any alignment, and the thin kernels that version=None runs when one of
//                 the two dims is short.
//
// Napkin math for every op: bytes read + bytes written, the minimum being each useful element
// read once and written once. At 3.0 TB/s (the H100's measured copy rate) a 16384 x 16384
// float32 transpose (2 GiB of traffic) should take ~0.72 ms; PyTorch's x.t().contiguous()
// takes about three times that.
//
// The H100's DRAM and L2 move data in 32-byte sectors; an L1 cache line is 128 bytes. A warp
// instruction whose 32 addresses fall into the fewest possible sectors is "coalesced"; one
// whose addresses scatter pays a whole sector for each few useful bytes.
#include "memory.h"

#include <course/cuda_utils.h>

#include <climits>

namespace memory_ops {
namespace {

// 16 bytes is the widest access one thread can issue (LDG.E.128 / STG.E.128).
constexpr int kVectorBytes = 16;

// Explicit 128-bit accesses. A plain uint4 assignment is not enough for the stores: where
// the address comes from T-sized index arithmetic, nvcc split it into four 4-byte stores (the
// PTX test in test_memory_ops.py caught it). __stwb ("store, write-back", the default cache
// policy) always compiles to one st.global.wb.v4.
__device__ __forceinline__ uint4 load16(const void* p) {
  return *reinterpret_cast<const uint4*>(p);
}
__device__ __forceinline__ void store16(void* p, const uint4& v) {
  __stwb(reinterpret_cast<uint4*>(p), v);
}

// A vector's 16 bytes as kVectorBytes / sizeof(T) elements and back, spelled out word by word:
// a memcpy between a T array and a uint4 let nvcc store 2-byte elements as two 8-byte halves
// (st.global.v2.u16) instead of one 16-byte store; test_memory_ops.py checks the PTX.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& v, T* e) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < kVectorBytes / static_cast<int>(sizeof(T)); ++i) {
    if constexpr (sizeof(T) == 2) {
      e[i] = static_cast<T>(w[i / 2] >> (16 * (i % 2)));
    } else if constexpr (sizeof(T) == 4) {
      e[i] = w[i];
    } else {
      e[i] = static_cast<T>(w[2 * i]) | (static_cast<T>(w[2 * i + 1]) << 32);
    }
  }
}
template <typename T>
__device__ __forceinline__ uint4 pack16(const T* e) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 2) {
      w[i] = static_cast<uint32_t>(e[2 * i]) | (static_cast<uint32_t>(e[2 * i + 1]) << 16);
    } else if constexpr (sizeof(T) == 4) {
      w[i] = e[i];
    } else {
      w[i] = static_cast<uint32_t>(e[i / 2] >> (32 * (i % 2)));
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Grids are sized to cover the problem in one pass; a problem larger than the grid limit
// still finishes because every kernel below strides by the grid.
constexpr int64_t kMaxGrid = INT_MAX;

unsigned one_pass_blocks(int64_t work_items, int64_t per_block) {
  const int64_t blocks = course::ceil_div(work_items, per_block);
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxGrid ? kMaxGrid : blocks));
}

// The glue only passes 2, 4 or 8 bytes; anything else is reported, never launched.
cudaError_t unsupported_size() { return cudaErrorInvalidValue; }

// ---------------------------------------------------------------------------------------
// copy
// ---------------------------------------------------------------------------------------
constexpr int kCopyThreads = 256;

// copy v1: one element per thread per step. Coalesced (a warp reads 32 consecutive
// elements), but a 2-byte element means a warp instruction moves only 64 bytes: more
// instructions, and fewer bytes in flight per thread, for the same traffic.
template <typename T>
__global__ void copy_scalar(const T* __restrict__ src, T* __restrict__ dst, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    dst[i] = src[i];
  }
}

// copy v2: 16 bytes per access, kCopyUnroll independent accesses per thread, all loads issued
// before the first store. A warp instruction now moves 512 bytes whatever the dtype, and each
// thread keeps 64 bytes in flight: the bytes-in-flight that HBM's latency demands (Little's
// law: ~3 TB/s x ~0.7 us is ~2 MB across the GPU) are reached with fewer threads.
constexpr int kCopyUnroll = 4;

template <typename T>
__global__ void copy_vectorized(const T* __restrict__ src, T* __restrict__ dst, int64_t n) {
  constexpr int kPerVector = kVectorBytes / sizeof(T);
  const int64_t n_vectors = n / kPerVector;
  const uint4* src_v = reinterpret_cast<const uint4*>(src);
  uint4* dst_v = reinterpret_cast<uint4*>(dst);
  const int64_t per_block = static_cast<int64_t>(blockDim.x) * kCopyUnroll;
  const int64_t step = per_block * gridDim.x;
  for (int64_t base = blockIdx.x * per_block + threadIdx.x; base < n_vectors; base += step) {
    uint4 v[kCopyUnroll];
#pragma unroll
    for (int j = 0; j < kCopyUnroll; ++j) {
      // Consecutive threads take consecutive vectors: each of the kCopyUnroll loads is coalesced.
      const int64_t i = base + static_cast<int64_t>(j) * blockDim.x;
      if (i < n_vectors) v[j] = load16(src_v + i);  // the last block may run past the end
    }
#pragma unroll
    for (int j = 0; j < kCopyUnroll; ++j) {
      const int64_t i = base + static_cast<int64_t>(j) * blockDim.x;
      if (i < n_vectors) store16(dst_v + i, v[j]);
    }
  }
  // The last n % kPerVector elements do not fill a vector: the grid's first threads copy them.
  const int64_t tail = n_vectors * kPerVector + static_cast<int64_t>(blockIdx.x) * blockDim.x +
                       threadIdx.x;
  if (tail < n) dst[tail] = src[tail];
}

template <typename T>
cudaError_t launch_copy_typed(const CopyParams& p, cudaStream_t stream) {
  const T* src = static_cast<const T*>(p.src);
  T* dst = static_cast<T*>(p.dst);
  // A view that starts mid-vector (x[1:]) cannot be read with aligned 16-byte loads: v2 falls
  // back to v1 there rather than fault.
  const bool aligned = course::is_aligned(src, kVectorBytes) && course::is_aligned(dst, kVectorBytes);
  if (p.version == CopyVersion::kVectorized && aligned) {
    const int64_t vectors = p.n / (kVectorBytes / sizeof(T));
    copy_vectorized<T><<<one_pass_blocks(vectors, kCopyThreads * kCopyUnroll), kCopyThreads, 0,
                         stream>>>(src, dst, p.n);
  } else {
    copy_scalar<T><<<one_pass_blocks(p.n, kCopyThreads), kCopyThreads, 0, stream>>>(src, dst, p.n);
  }
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------
// strided_copy
// ---------------------------------------------------------------------------------------

// Lane i reads src[i * stride]: once stride * sizeof(T) reaches the 32-byte sector, every
// useful element costs a whole sector of DRAM traffic, so the useful bandwidth falls as
// 1 / stride until each lane has its own sector (stride * sizeof(T) >= 32) and then stays at
// sizeof(T) / 32 of the sector rate. The writes stay coalesced throughout.
template <typename T>
__global__ void strided_gather(const T* __restrict__ src, T* __restrict__ dst, int64_t n_out,
                               int64_t stride) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_out;
       i += step) {
    dst[i] = src[i * stride];
  }
}

// ---------------------------------------------------------------------------------------
// transpose: dst[b][c][r] = src[b][r][c]
// ---------------------------------------------------------------------------------------
//
// All versions walk a flat index of tiles, column tiles fastest, and stride by the grid, so
// any (batch, rows, cols) fits the grid limits. Source elements are read through the given
// strides, so a non-contiguous input is transposed directly, without a copy first.

struct TileIndex {
  int64_t b, r0, c0;
};

__device__ __forceinline__ TileIndex tile_at(int64_t t, int64_t tiles_r, int64_t tiles_c,
                                             int tile_rows, int tile_cols) {
  return {t / (tiles_r * tiles_c), (t / tiles_c) % tiles_r * tile_rows, t % tiles_c * tile_cols};
}

// v1..v3 share one geometry: 32 x 32 tiles, a 32 x 32 thread block, one element per thread.
// So the only thing that changes between them is where the data goes in between.
constexpr int kTile = 32;

// transpose v1, naive: thread (x, y) reads src[r0 + y][c0 + x] and writes dst[c0 + x][r0 + y].
// The reads are coalesced: a warp (fixed y) reads 32 consecutive elements of one source row.
// The writes are not: the same warp writes 32 elements down a destination column, each one
// `rows` elements from the next, so every element costs its own 32-byte sector write for
// 2 to 8 useful bytes (a read-modify-write of the sector in L2). Expect a fraction of copy.
template <typename T>
__global__ void transpose_naive(TransposeParams p, int64_t tiles_r, int64_t tiles_c) {
  const T* src = static_cast<const T*>(p.src);
  T* dst = static_cast<T*>(p.dst);
  const int64_t tiles = p.batch * tiles_r * tiles_c;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const TileIndex at = tile_at(t, tiles_r, tiles_c, kTile, kTile);
    const int64_t r = at.r0 + threadIdx.y;
    const int64_t c = at.c0 + threadIdx.x;
    if (r < p.rows && c < p.cols) {  // edge tiles hang over the matrix
      dst[(at.b * p.cols + c) * p.rows + r] =
          src[at.b * p.batch_stride + r * p.row_stride + c * p.col_stride];
    }
  }
}

// transpose v2 (kPad = 0), tiled: the block first reads its 32 x 32 tile row by row into
// shared memory (coalesced, as in v1), then writes the destination row by row too, reading
// the tile by columns: tile[x][y] for lane x. Both global sides are now coalesced; the
// scattering moved into shared memory, which has no sectors, only 32 banks of 4 bytes.
//
// But a tile column is the worst case for those banks: with a row pitch of 32 elements, the
// 32 elements of a float32 column all sit in the same bank, and the warp's read is replayed
// 32 times (a 32-way bank conflict). With 2-byte elements a row is 16 banks wide and the
// column touches 2 banks (16-way); with 8-byte elements a half-warp of 16 lanes hits one bank
// pair (16-way per half). Expect v2 far above v1, yet short of copy.
//
// transpose v3 (kPad = one 4-byte bank), tiled + padded: the same tile, one bank wider per
// row. Row y of a float32 tile now starts y banks further along, so a column's 32 elements
// land in 32 different banks: no conflicts, the same global traffic, and the gap to v2 is the
// price of the conflicts. The pad is a whole bank whatever the element size: with 2-byte
// elements a one-*element* pad makes a row 16.5 banks long, which spreads even columns over
// all 32 banks but leaves odd columns with one 2-way conflict (predicted in NOTES.md, then
// measured by ncu as 1.5 shared-memory wavefronts per load); two elements make it 17 banks,
// an odd number, and every column is conflict-free. With 8-byte elements a row is 66 banks,
// an offset of 2 per row, and each half-warp (8-byte accesses are served 16 lanes at a time)
// covers all 32 banks once.
template <typename T>
constexpr int kBankPad = sizeof(T) >= 4 ? 1 : 4 / static_cast<int>(sizeof(T));

template <typename T, int kPad>
__global__ void transpose_tiled(TransposeParams p, int64_t tiles_r, int64_t tiles_c) {
  __shared__ T tile[kTile][kTile + kPad];
  const T* src = static_cast<const T*>(p.src);
  T* dst = static_cast<T*>(p.dst);
  const int x = threadIdx.x;
  const int y = threadIdx.y;
  const int64_t tiles = p.batch * tiles_r * tiles_c;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const TileIndex at = tile_at(t, tiles_r, tiles_c, kTile, kTile);
    const int64_t r = at.r0 + y;
    const int64_t c = at.c0 + x;
    if (r < p.rows && c < p.cols) {  // edge tiles hang over; their outside is never read below
      tile[y][x] = src[at.b * p.batch_stride + r * p.row_stride + c * p.col_stride];
    }
    // Thread (x, y) writes an element that thread (y, x) loaded: all loads must be done.
    __syncthreads();
    const int64_t out_row = at.c0 + y;  // a destination row is a source column
    const int64_t out_col = at.r0 + x;
    if (out_row < p.cols && out_col < p.rows) {
      dst[(at.b * p.cols + out_row) * p.rows + out_col] = tile[x][y];
    }
    // The next tile's loads overwrite `tile`: every thread must be done reading this one.
    __syncthreads();
  }
}

// transpose v4, wide tiles. v3 has both sides coalesced and no bank conflicts, but each
// thread moves a single 2- to 8-byte element per tile, then waits at a barrier: few bytes in
// flight per thread, and per 2-byte element a whole load, store, two shared-memory accesses
// and two barriers. v4 changes three things:
//   - 16-byte global accesses on both sides: a thread loads 16 bytes along a source row and,
//     after the tile, stores 16 bytes along a destination row (kVec elements each way);
//   - a larger tile, 128 source rows x one 128-byte line of columns (32 float32, 64 bf16,
//     16 float64), four 16-byte loads per thread, all issued before the first is used: 64
//     bytes in flight per thread, one barrier pair per 16 KB;
//   - a lane mapping chosen so that the shared-memory side stays conflict-free although each
//     thread now writes kVec consecutive elements of a tile row and gathers kVec consecutive
//     elements of a tile column:
//       load:  8 lanes cover one 128-byte source row segment, a warp covers 4 rows; with the
//              row pitch padded by one 4-byte bank, the 4 rows start 1 bank apart (8 bytes
//              for float64, whose 8-byte accesses are served per half-warp);
//       store: kStoreLanes lanes cover kStoreLanes * kVec consecutive tile rows (one column),
//              a warp covers 32 / kStoreLanes columns. For 4- and 8-byte elements 8 lanes
//              gather rows kVec apart, which the pad spreads over distinct banks; for 2-byte
//              elements 8 lanes would leave a 2-way conflict (rows 8 apart, 33 words per row
//              pair, repeat every 4 lanes), so 4 lanes x 8 columns are used, and lanes of
//              neighbouring columns read the two halves of the same 4-byte word (a broadcast,
//              not a conflict).
// 16-byte accesses need 16-byte-aligned rows on both sides (cols and rows multiples of kVec,
// unit column stride, aligned pointers and strides: wide_tiles_apply in memory.h);
// launch_transpose checks and falls back to v3 otherwise, as 1823 x 781 does. v5 lifts that.
template <typename T>
struct WideTile {
  static constexpr int kVec = kVectorBytes / sizeof(T);
  static constexpr int kCols = 128 / sizeof(T);  // one 128-byte line of a source row
  static constexpr int kRows = 128;
  static constexpr int kPad = kBankPad<T>;
  static constexpr int kStoreLanes = sizeof(T) == 2 ? 4 : 8;
  static constexpr int kLoadLanes = kCols / kVec;  // 8 for every element size
};
constexpr int kWideThreads = 256;
constexpr int kWideVectorsPerThread = 4;

template <typename T>
__global__ void __launch_bounds__(kWideThreads)
    transpose_wide_tiles(TransposeParams p, int64_t tiles_r, int64_t tiles_c) {
  using W = WideTile<T>;
  static_assert(W::kRows * W::kCols / W::kVec == kWideThreads * kWideVectorsPerThread,
                "every thread moves kWideVectorsPerThread vectors each way");
  __shared__ T tile[W::kRows][W::kCols + W::kPad];
  const T* src = static_cast<const T*>(p.src);
  T* dst = static_cast<T*>(p.dst);
  const int64_t tiles = p.batch * tiles_r * tiles_c;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const TileIndex at = tile_at(t, tiles_r, tiles_c, W::kRows, W::kCols);
    const T* src_b = src + at.b * p.batch_stride;
    T* dst_b = dst + at.b * p.cols * p.rows;

    uint4 v[kWideVectorsPerThread];
#pragma unroll
    for (int i = 0; i < kWideVectorsPerThread; ++i) {
      const int idx = i * kWideThreads + threadIdx.x;
      const int64_t r = at.r0 + idx / W::kLoadLanes;
      const int64_t c = at.c0 + idx % W::kLoadLanes * W::kVec;
      // cols is a multiple of kVec here, so a vector is wholly inside the matrix or outside.
      if (r < p.rows && c < p.cols) v[i] = load16(src_b + r * p.row_stride + c);
    }
#pragma unroll
    for (int i = 0; i < kWideVectorsPerThread; ++i) {
      const int idx = i * kWideThreads + threadIdx.x;
      const int row = idx / W::kLoadLanes;
      const int col = idx % W::kLoadLanes * W::kVec;
      if (at.r0 + row < p.rows && at.c0 + col < p.cols) {  // the same guard as the load
        T e[W::kVec];
        unpack16(v[i], e);
#pragma unroll
        for (int k = 0; k < W::kVec; ++k) tile[row][col + k] = e[k];
      }
    }
    // The gathers below read tile columns that other threads wrote.
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kWideVectorsPerThread; ++i) {
      const int idx = i * kWideThreads + threadIdx.x;
      const int rest = idx / W::kStoreLanes;
      const int col = rest % W::kCols;  // tile column = destination row within the tile
      const int row = (rest / W::kCols * W::kStoreLanes + idx % W::kStoreLanes) * W::kVec;
      const int64_t out_row = at.c0 + col;
      const int64_t out_col = at.r0 + row;
      // rows is a multiple of kVec: the kVec gathered rows are all inside or all outside.
      if (out_row < p.cols && out_col < p.rows) {
        T e[W::kVec];
#pragma unroll
        for (int k = 0; k < W::kVec; ++k) e[k] = tile[row + k][col];
        store16(dst_b + out_row * p.rows + out_col, pack16(e));
      }
    }
    // The next tile's writes into `tile` must wait until every gather above is done.
    __syncthreads();
  }
}

// transpose v5, wide tiles at any alignment. v4 needs every source and destination row to
// start on a 16-byte boundary. An odd number of columns (8191 x 8193 float32), a sliced view
// (x[:, 1:]) or a vocabulary-sized dimension breaks that for most rows, and v4 falls back to
// v3's one-element-per-thread tile, a third of the speed. v5 keeps every global access of the
// tile's interior a whole, aligned 16-byte vector, as in v4, whatever the alignment, by cutting
// the data along 16-byte boundaries in memory instead of along tile boundaries:
//
//   source side. Row r's 128 bytes of tile columns start d_r elements past a 16-byte boundary
//     (d_r differs from row to row when the row length is not a multiple of 16 bytes). The 9
//     aligned vectors ("chunks") from that boundary on cover the 8 vectors' worth of columns at
//     any d_r; they are loaded whole and stored into the tile row from position 0, so column c
//     sits at position (c - c0) + d_r. The shift is undone when the tile is read, not by
//     shuffling registers. One chunk in 9 re-reads data the neighbouring tile also reads (an
//     L2 hit, not DRAM traffic).
//   destination side. Destination row c's vectors start where (c * rows + r) is a multiple of
//     kVec, s_c rows into the tile. The tile owns the kRows / kVec vectors whose first row lies
//     in its rows [r0, r0 + kRows); the last of them reaches up to kVec - 1 rows past the tile,
//     so the tile loads kVec extra source rows when rows is not a multiple of kVec. The s_c
//     rows before the first boundary of a destination row belong to no vector; the tiles of
//     the first row band (r0 == 0) store them one by one.
// Only chunks that cross the matrix edge (the first and last columns and rows, where a whole
// vector would leave the matrix) are moved element by element. The price against v4: 9 chunks
// per 8 vectors on the source side, kVec extra rows per tile, and the shift arithmetic. The
// tile's row pitch keeps v4's odd number of banks, so the gathers stay conflict-free for rows
// kVec apart, which share one shift.
template <typename T>
struct AnyAlignmentTile {
  static constexpr int kVec = WideTile<T>::kVec;
  static constexpr int kCols = WideTile<T>::kCols;  // columns a tile owns (one 128-byte line)
  static constexpr int kRows = WideTile<T>::kRows;  // rows a tile owns
  static constexpr int kChunks = kCols / kVec + 1;  // aligned vectors covering kCols at any shift
  static constexpr int kLoadRows = kRows + kVec;    // owned rows plus the destination overhang
  static constexpr int kPitch = kChunks * kVec + kBankPad<T>;  // an odd number of banks
  // v4's 4 (8 chunks of the 128 owned rows), and one more for the rest (chunk_slot).
  static constexpr int kLoadsPerThread = kWideVectorsPerThread + 1;
  static_assert(kRows * (kChunks - 1) == kWideVectorsPerThread * kWideThreads &&
                    kRows + kVec * kChunks <= kWideThreads,
                "chunk_slot's mapping covers every chunk of the kLoadRows rows");
};

// Which chunk a thread loads in step i (of kLoadsPerThread). Steps 0-3 are v4's mapping: 8
// lanes per row, a warp on 4 rows, so the tile writes stay conflict-free as in v4. Step 4
// takes what is left: the 9th chunk of the 128 owned rows, then the 9 chunks of each
// overhang row.
struct ChunkSlot {
  int row, chunk;
};
template <typename T>
__device__ __forceinline__ ChunkSlot chunk_slot(int i, int thread) {
  using A = AnyAlignmentTile<T>;
  constexpr int kPerRow = A::kChunks - 1;
  if (i < A::kLoadsPerThread - 1) {
    const int idx = i * kWideThreads + thread;
    return {idx / kPerRow, idx % kPerRow};
  }
  if (thread < A::kRows) return {thread, kPerRow};
  const int rest = thread - A::kRows;  // < kVec * 9 = 72 overhang chunks, of 128 threads
  return {A::kRows + rest / A::kChunks, rest % A::kChunks};
}

// The position, in elements, of address p past the 16-byte boundary at or below it. p is a
// multiple of sizeof(T): PyTorch keeps storage offsets whole elements.
template <typename T>
__device__ __forceinline__ unsigned elements_past_boundary(const T* p) {
  return static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) % kVectorBytes / sizeof(T));
}

// Three blocks per SM (v4 fits four). Four would cap v5 at 64 registers per thread, where nvcc
// spills 12-48 bytes per thread to local memory; measured, that cost bfloat16 a quarter of
// its speed (NOTES.md), far more than the fourth block gains.
template <typename T>
__global__ void __launch_bounds__(kWideThreads, 3)
    transpose_wide_tiles_any_alignment(TransposeParams p, int64_t tiles_r, int64_t tiles_c) {
  using A = AnyAlignmentTile<T>;
  constexpr int kVec = A::kVec;
  __shared__ T tile[A::kLoadRows][A::kPitch];
  const T* src = static_cast<const T*>(p.src);
  T* dst = static_cast<T*>(p.dst);
  // Rows kVec apart start equally far past a boundary: row r's shift is
  // (shift of row 0 + r * (row_stride mod kVec)) mod kVec. Unsigned, so that the modulo by the
  // power of two kVec is a single AND.
  const unsigned stride_mod = static_cast<unsigned>(p.row_stride % kVec);
  // With rows a multiple of kVec every destination vector starts on a tile row: no overhang.
  const int load_rows = p.rows % kVec == 0 ? A::kRows : A::kLoadRows;
  const int64_t tiles = p.batch * tiles_r * tiles_c;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const TileIndex at = tile_at(t, tiles_r, tiles_c, A::kRows, A::kCols);
    const T* src_b = src + at.b * p.batch_stride;
    T* dst_b = dst + at.b * p.cols * p.rows;
    const unsigned shift0 = elements_past_boundary(src_b + at.r0 * p.row_stride + at.c0);

    // Load: every chunk issued before any is stored, as in v4 (5 per thread). position[i] is
    // where step i's chunk goes in its tile row, or -1 when the step loads nothing.
    uint4 v[A::kLoadsPerThread];
    int position[A::kLoadsPerThread];
#pragma unroll
    for (int i = 0; i < A::kLoadsPerThread; ++i) {
      const ChunkSlot slot = chunk_slot<T>(i, threadIdx.x);
      const int64_t r = at.r0 + slot.row;
      const unsigned shift = (shift0 + slot.row * stride_mod) % kVec;
      // Past the loaded rows or the matrix, or the 9th chunk of a row that 8 cover: nothing.
      position[i] = slot.row >= load_rows || r >= p.rows ||
                            (slot.chunk == A::kChunks - 1 && shift == 0)
                        ? -1
                        : slot.chunk * kVec;
      if (position[i] < 0) continue;
      const int64_t c = at.c0 - shift + slot.chunk * kVec;  // the chunk's first column
      const T* segment = src_b + r * p.row_stride;
      if (c >= 0 && c + kVec <= p.cols) {
        v[i] = load16(segment + c);
      } else {  // the chunk crosses the first or last column: only the columns inside
        T e[kVec] = {};
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          if (c + k >= 0 && c + k < p.cols) e[k] = segment[c + k];
        }
        v[i] = pack16(e);
      }
    }
#pragma unroll
    for (int i = 0; i < A::kLoadsPerThread; ++i) {
      if (position[i] < 0) continue;  // positions never loaded are never read below either
      T e[kVec];
      unpack16(v[i], e);
      T* dst_row = tile[chunk_slot<T>(i, threadIdx.x).row] + position[i];
#pragma unroll
      for (int k = 0; k < kVec; ++k) dst_row[k] = e[k];
    }
    // The gathers below read tile columns that other threads wrote.
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kWideVectorsPerThread; ++i) {
      const int idx = i * kWideThreads + threadIdx.x;
      const int rest = idx / WideTile<T>::kStoreLanes;
      const int col = rest % A::kCols;  // tile column = destination row within the tile
      const int vec = rest / A::kCols * WideTile<T>::kStoreLanes + idx % WideTile<T>::kStoreLanes;
      const int64_t out_row = at.c0 + col;
      if (out_row >= p.cols) continue;  // edge tiles hang over the last source column
      T* segment = dst_b + out_row * p.rows;
      // Rows before the first 16-byte boundary of this destination row; tile row of vector vec.
      const unsigned first = (kVec - elements_past_boundary(segment)) % kVec;
      const int tile_row = first + vec * kVec;
      // The kVec rows of one vector have kVec consecutive shifts: stepped, not recomputed.
      unsigned shift = (shift0 + first * stride_mod) % kVec;  // tile_row = first (mod kVec)
      const T* column = &tile[tile_row][col];
      T g[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        g[k] = column[k * A::kPitch + shift];
        shift = (shift + stride_mod) % kVec;
      }
      const int64_t r = at.r0 + tile_row;
      if (r + kVec <= p.rows) {
        store16(segment + r, pack16(g));
      } else {  // the last vector of the row crosses its end: only the rows inside
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          if (r + k < p.rows) segment[r + k] = g[k];
        }
      }
      // The rows before the first boundary: owned by the first row band, stored one by one.
      if (at.r0 == 0 && vec == 0) {
#pragma unroll 1  // fewer than kVec rows, in one band of tiles: not worth the code
        for (unsigned row = 0; row < first && row < p.rows; ++row) {
          segment[row] = tile[row][col + (shift0 + row * stride_mod) % kVec];
        }
      }
    }
    // The next tile's writes into `tile` must wait until every gather above is done.
    __syncthreads();
  }
}

// transpose of a thin matrix (version=None only; memory.h's thin_applies says when, and why
// the bound is kThinMaxShort = 64). The key fact: with one dim short, one side of every block's
// work is a single contiguous run of memory. For short rows (R x C, R <= 64, 3 x 1000003), the
// columns [c0, c0 + W) become destination rows c0 .. c0 + W - 1, which lie back to back: one
// run of W * R elements. For short columns (C <= 64, 1000003 x 3) the same holds for the
// source: rows [r0, r0 + H) of a row-contiguous input are one run of H * C elements.
//
// So each block stages one such tile in shared memory in the run's order, and the run side
// moves with consecutive threads on consecutive elements, 16 bytes per access (scalar only for
// the head before the run's first 16-byte boundary and the tail after its last). The other
// side is R (or C) segments of W (H) consecutive elements, one per short index, each moved
// with consecutive threads on consecutive elements: coalesced too.
//
//   transpose_thin_rows: load row segment r of the tile (src[r][c0 + j]) into run position
//     j * R + r; store the run with 16-byte vectors.
//   transpose_thin_cols: load the run with 16-byte vectors (single elements gathered by the
//     strides where the rows are not one run: x[:, 1:], x[:, ::2]); store destination row c's
//     segment (dst[c][r0 + j]) from run position j * C + c.
//
// The tile is kThinRunBytes of the run (W, H: the largest power of two whose run fits, so the
// segment loops split their flat index with a shift and a mask; the run is then between half
// and all of the 8 KiB). 8 KiB per block keeps 3 x 1000003 in 16 bits at ~1000 blocks, several
// per SM, and each thread's 8 loads (4-byte elements) are issued before its first
// shared-memory write: enough bytes in flight per SM to cover DRAM's latency. At the bound of
// 64 short indices a segment is 8192 / 64 = 128 bytes, one whole line (memory.h).
//
// Bank conflicts: the segment side walks the run with stride R (C) elements, which for R = 16
// puts a warp's 32 four-byte writes into 2 banks (16-way). One padding element after every 32
// (thin_pos) spreads them, except where the stride is a multiple of 31: 31 elements plus the
// pad every 32 is 32 words apart (62, 64), every lane in one bank again, so there the pad comes
// after every 16 (thin_log2_pad). bank_model.py's thin_segment counts it bank by bank: for every
// short length 1-64 and element size, at most 4 times the fewest wavefronts a warp access can
// take (without the exception, 31 and 62 take 16-32 times). The run side reads or writes
// consecutive elements, with either pad at most 4 wavefronts per warp access.
constexpr int kThinShort = static_cast<int>(kThinMaxShort);
constexpr int kThinThreads = 256;
constexpr int kThinRunBytes = 8192;
constexpr int kThinMinLog2Pad = 4;  // one padding element after every 16 at the most

// Blocks of kThinThreads an SM can hold, at most 5: 2048 threads from sm_80 on (1536 on sm_86
// and sm_89), 1024 on sm_75, where ptxas would otherwise ignore the bound with a warning.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr int kThinMaxBlocksPerSm = 4;
#else
constexpr int kThinMaxBlocksPerSm = 5;
#endif

template <typename T>
struct ThinTile {
  static constexpr int kRun = kThinRunBytes / static_cast<int>(sizeof(T));
  static constexpr int kPadded = kRun + (kRun >> kThinMinLog2Pad);
  // Element-by-element loads per thread in flight at once: a whole tile's worth in one pass
  // (8 for 4-byte elements, 16 for 2-byte ones, whose loads move half the bytes each). Left
  // alone, nvcc takes 69 registers for the 2-byte thin_rows, three blocks per SM; asking for
  // four caps it at 64 without spilling (48, for five, spills): 32 KB of 2-byte loads in flight
  // per SM, where two passes of 8 at five blocks had 20 KB. 4- and 8-byte elements keep the
  // five blocks (48 registers or fewer, no spills) they had without the bound, where the SM
  // holds that many (kThinMaxBlocksPerSm).
  static constexpr int kUnroll = kRun / kThinThreads;
  static constexpr int kMinBlocksPerSm = sizeof(T) == 2 ? 4 : kThinMaxBlocksPerSm;
  // At the bound a segment is still one whole 128-byte line (memory.h's argument for 64).
  static_assert(kRun / kThinShort * static_cast<int>(sizeof(T)) >= 128,
                "a thin tile's segments must be whole lines");
};

// Run position k's slot in the tile: one padding element after every 2^log2_pad.
__device__ __forceinline__ int thin_pos(int k, int log2_pad) { return k + (k >> log2_pad); }

// The pad interval for a short side of short_len (the bank count above): 16 where the stride
// is a multiple of 31, 32 elsewhere.
int thin_log2_pad(int64_t short_len) { return short_len % 31 == 0 ? kThinMinLog2Pad : 5; }

// log2 of the long extent per tile: the largest power of two L with L * short_len <= the run,
// but no more than the power of two that covers long_len (a batch of small matrices would
// otherwise loop over thousands of empty slots per tile).
int thin_log2_long(int64_t short_len, int64_t long_len, int elem_bytes) {
  const int64_t run = kThinRunBytes / elem_bytes;
  int log2 = 0;
  while ((int64_t{2} << log2) * short_len <= run && (int64_t{1} << log2) < long_len) ++log2;
  return log2;
}

// Elements before the first 16-byte boundary at or after p (a T-aligned address), at most n.
template <typename T>
__device__ __forceinline__ int thin_head(const void* p, int n) {
  const int past = static_cast<int>(reinterpret_cast<uintptr_t>(p) % kVectorBytes);
  const int head = past == 0 ? 0 : (kVectorBytes - past) / static_cast<int>(sizeof(T));
  return head < n ? head : n;
}

// The run side, tile -> global: run[k] = tile[thin_pos(k, log2_pad)] for k < n. The alignment
// comes from the address itself (the run starts wherever c0 * R puts it), so no launcher check
// is needed: only the aligned middle takes 16-byte stores.
template <typename T>
__device__ __forceinline__ void thin_store_run(T* run, const T* tile, int n, int log2_pad) {
  constexpr int kPerVector = kVectorBytes / sizeof(T);
  const int head = thin_head<T>(run, n);
  const int vectors = (n - head) / kPerVector;
  for (int q = threadIdx.x; q < vectors; q += blockDim.x) {
    const int k = head + q * kPerVector;
    T e[kPerVector];
#pragma unroll
    for (int i = 0; i < kPerVector; ++i) e[i] = tile[thin_pos(k + i, log2_pad)];
    store16(run + k, pack16(e));
  }
  // The head and the tail, fewer than kPerVector elements each: one element per thread.
  const int tail = head + vectors * kPerVector;
  for (int i = threadIdx.x; i < head + (n - tail); i += blockDim.x) {
    const int k = i < head ? i : tail + (i - head);
    run[k] = tile[thin_pos(k, log2_pad)];
  }
}

// The run side, global -> tile, the mirror of thin_store_run. Two vectors per thread are
// loaded before either is written, so each thread keeps 32 bytes in flight.
template <typename T>
__device__ __forceinline__ void thin_load_run(const T* run, T* tile, int n, int log2_pad) {
  constexpr int kPerVector = kVectorBytes / sizeof(T);
  const int head = thin_head<T>(run, n);
  const int vectors = (n - head) / kPerVector;
  for (int q0 = threadIdx.x; q0 < vectors; q0 += 2 * blockDim.x) {
    uint4 v[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int q = q0 + u * blockDim.x;
      if (q < vectors) v[u] = load16(run + head + q * kPerVector);  // the last pass may be half
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int q = q0 + u * blockDim.x;
      if (q < vectors) {  // the same guard as the load
        T e[kPerVector];
        unpack16(v[u], e);
#pragma unroll
        for (int i = 0; i < kPerVector; ++i) {
          tile[thin_pos(head + q * kPerVector + i, log2_pad)] = e[i];
        }
      }
    }
  }
  const int tail = head + vectors * kPerVector;
  for (int i = threadIdx.x; i < head + (n - tail); i += blockDim.x) {
    const int k = i < head ? i : tail + (i - head);
    tile[thin_pos(k, log2_pad)] = run[k];
  }
}

// Pairs on the segment side, for 2-byte elements, in thin_cols only (memory.h,
// thin_pairs_apply). A warp of single 2-byte accesses moves 64 bytes a segment per instruction,
// half a line. So a 2-byte segment moves as pairs: item q of a segment covers its long indices j = 2q - head and j + 1, where
// head is 1 when the segment starts in the middle of a 4-byte word (rows of odd length alternate
// between the two). Both inside the segment: one 4-byte access, aligned by that choice of head;
// otherwise one element each, and j = -1 stands for the segment's last slot, 2^log2 - 1, which
// a mid-word start leaves to no pair. Half the items, each one word: the same bytes in flight
// per thread in half the instructions, a warp's access one whole line. The pair's tile slots
// are 2 x short apart from lane to lane; bank_model.thin_pairs counts them (at most 3
// wavefronts at every short side, either head).
__device__ __forceinline__ int thin_pair_first(const void* segment, int q) {
  const int head = static_cast<int>(reinterpret_cast<uintptr_t>(segment) >> 1) & 1;
  return 2 * q - head;
}

// Short rows: one block per tile of W = 2^log2_w source columns of one matrix.
template <typename T>
__global__ void __launch_bounds__(kThinThreads, ThinTile<T>::kMinBlocksPerSm)
    transpose_thin_rows(TransposeParams p, int log2_w, int log2_pad, int64_t tiles_c) {
  constexpr int kUnroll = ThinTile<T>::kUnroll;
  __shared__ T tile[ThinTile<T>::kPadded];
  const T* src = static_cast<const T*>(p.src);
  T* dst = static_cast<T*>(p.dst);
  const int rows = static_cast<int>(p.rows);  // <= kThinShort
  const int w_full = 1 << log2_w;
  const int n_seg = rows << log2_w;  // the tile's (row, column) slots, partial tile included
  for (int64_t t = blockIdx.x; t < p.batch * tiles_c; t += gridDim.x) {
    const int64_t b = t / tiles_c;
    const int64_t c0 = (t - b * tiles_c) << log2_w;
    const int w = static_cast<int>(p.cols - c0 < w_full ? p.cols - c0 : w_full);
    const T* in = src + b * p.batch_stride + c0 * p.col_stride;
    // Consecutive threads on consecutive columns of one source row: coalesced where the
    // columns are adjacent. A thread's kUnroll loads (the whole tile: one pass) are in flight
    // before its first write.
    for (int base = threadIdx.x; base < n_seg; base += kUnroll * blockDim.x) {
      T e[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * blockDim.x;
        const int r = i >> log2_w, j = i & (w_full - 1);
        // past the tile's slots, or past the matrix's last column in its last tile
        if (i < n_seg && j < w) e[u] = in[r * p.row_stride + j * p.col_stride];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * blockDim.x;
        const int r = i >> log2_w, j = i & (w_full - 1);
        if (i < n_seg && j < w) tile[thin_pos(j * rows + r, log2_pad)] = e[u];  // the same guard
      }
    }
    // The run gathers elements that other threads loaded.
    __syncthreads();
    // Destination rows c0 .. c0 + w - 1 of matrix b: (b * cols + c0) * rows on, w * rows long.
    thin_store_run(dst + (b * p.cols + c0) * rows, tile, w * rows, log2_pad);
    // The next tile's loads overwrite `tile`: every read of this one must be done.
    __syncthreads();
  }
}

// Short columns: one block per tile of H = 2^log2_h source rows of one matrix.
// kPairs (2-byte elements, H >= 2): the segments store as pairs (thin_pair_first).
template <typename T, bool kPairs>
__global__ void __launch_bounds__(kThinThreads, ThinTile<T>::kMinBlocksPerSm)
    transpose_thin_cols(TransposeParams p, int log2_h, int log2_pad, int64_t tiles_r) {
  constexpr int kUnroll = ThinTile<T>::kUnroll;
  __shared__ T tile[ThinTile<T>::kPadded];
  const T* src = static_cast<const T*>(p.src);
  T* dst = static_cast<T*>(p.dst);
  const int cols = static_cast<int>(p.cols);  // <= kThinShort
  const int h_full = 1 << log2_h;
  const int n_seg = cols << log2_h;
  // The tile's rows are one run of memory only when each row's cols elements are adjacent and
  // the next row starts right after them (not x[:, 1:], not x[:, ::2]).
  const bool one_run = p.col_stride == 1 && p.row_stride == p.cols;
  for (int64_t t = blockIdx.x; t < p.batch * tiles_r; t += gridDim.x) {
    const int64_t b = t / tiles_r;
    const int64_t r0 = (t - b * tiles_r) << log2_h;
    const int h = static_cast<int>(p.rows - r0 < h_full ? p.rows - r0 : h_full);
    const T* in = src + b * p.batch_stride + r0 * p.row_stride;
    if (one_run) {
      thin_load_run(in, tile, h * cols, log2_pad);
    } else {
      // Run order, element by element through the strides: consecutive threads still read
      // along the source rows. The division by cols is the price of the general view.
      for (int base = threadIdx.x; base < h * cols; base += kUnroll * blockDim.x) {
        T e[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int k = base + u * blockDim.x;
          const int r = k / cols, c = k - r * cols;
          if (k < h * cols) e[u] = in[r * p.row_stride + c * p.col_stride];  // past the tile
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int k = base + u * blockDim.x;
          if (k < h * cols) tile[thin_pos(k, log2_pad)] = e[u];  // the same guard as the load
        }
      }
    }
    // Each destination segment gathers elements that other threads loaded.
    __syncthreads();
    // Destination row c of matrix b holds source column c: its elements r0 .. r0 + h - 1.
    T* out = dst + b * p.cols * p.rows + r0;
    if constexpr (kPairs) {
      // A word stores two elements of its own segment only (both inside it), so no other
      // block's elements are rewritten.
      const int log2_half = log2_h - 1;
      for (int i = threadIdx.x; i < n_seg / 2; i += blockDim.x) {
        const int c = i >> log2_half;
        T* segment = out + c * p.rows;
        const int j = thin_pair_first(segment, i & ((1 << log2_half) - 1));
        if (j >= 0 && j + 1 < h) {  // both in the segment: one aligned word
          const uint32_t lo = tile[thin_pos(j * cols + c, log2_pad)];
          const uint32_t hi = tile[thin_pos((j + 1) * cols + c, log2_pad)];
          *reinterpret_cast<uint32_t*>(segment + j) = lo | (hi << 16);
        } else {
          const int first = j < 0 ? h_full - 1 : j;
          if (first < h) segment[first] = tile[thin_pos(first * cols + c, log2_pad)];  // past the last row
          if (j + 1 < h) segment[j + 1] = tile[thin_pos((j + 1) * cols + c, log2_pad)];  // likewise
        }
      }
    } else {
      for (int i = threadIdx.x; i < n_seg; i += blockDim.x) {
        const int c = i >> log2_h, j = i & (h_full - 1);
        if (j < h) out[c * p.rows + j] = tile[thin_pos(j * cols + c, log2_pad)];  // past the last row
      }
    }
    // The next tile's loads overwrite `tile`: every read of this one must be done.
    __syncthreads();
  }
}

template <typename T>
cudaError_t launch_transpose_typed(const TransposeParams& p, cudaStream_t stream) {
  using W = WideTile<T>;
  const bool v4 = p.version == TransposeVersion::kWideTiles && wide_tiles_apply(p);
  // v5 reads source rows with 16-byte vectors, so it needs a unit column stride (any other
  // stride, as in x[:, ::2], gathers single elements anyway and takes v3's tile).
  const bool v5 = p.version == TransposeVersion::kWideTilesAnyAlignment && p.col_stride == 1;
  if (v4 || v5) {
    const int64_t tiles_r = course::ceil_div<int64_t>(p.rows, W::kRows);
    const int64_t tiles_c = course::ceil_div<int64_t>(p.cols, W::kCols);
    const unsigned blocks = one_pass_blocks(p.batch * tiles_r * tiles_c, 1);
    if (v4) {
      transpose_wide_tiles<T><<<blocks, kWideThreads, 0, stream>>>(p, tiles_r, tiles_c);
    } else {
      transpose_wide_tiles_any_alignment<T><<<blocks, kWideThreads, 0, stream>>>(p, tiles_r, tiles_c);
    }
    return cudaGetLastError();
  }
  const int64_t tiles_r = course::ceil_div<int64_t>(p.rows, kTile);
  const int64_t tiles_c = course::ceil_div<int64_t>(p.cols, kTile);
  const int64_t blocks = one_pass_blocks(p.batch * tiles_r * tiles_c, 1);
  const dim3 threads(kTile, kTile);
  switch (p.version) {
    case TransposeVersion::kNaive:
      transpose_naive<T><<<blocks, threads, 0, stream>>>(p, tiles_r, tiles_c);
      break;
    case TransposeVersion::kTiled:
      transpose_tiled<T, 0><<<blocks, threads, 0, stream>>>(p, tiles_r, tiles_c);
      break;
    case TransposeVersion::kTiledPadded:
    case TransposeVersion::kWideTiles:  // rows not 16-byte aligned: the padded tile instead
    case TransposeVersion::kWideTilesAnyAlignment:  // no unit column stride: likewise
      transpose_tiled<T, kBankPad<T>><<<blocks, threads, 0, stream>>>(p, tiles_r, tiles_c);
      break;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_copy(const CopyParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  return with_element_type(p.elem_bytes, [&](auto tag) {
    return launch_copy_typed<decltype(tag)>(p, stream);
  }, unsupported_size);
}

cudaError_t launch_strided_copy(const StridedCopyParams& p, cudaStream_t stream) {
  if (p.n_out == 0) return cudaSuccess;
  return with_element_type(p.elem_bytes, [&](auto tag) {
    using T = decltype(tag);
    strided_gather<T><<<one_pass_blocks(p.n_out, kCopyThreads), kCopyThreads, 0, stream>>>(
        static_cast<const T*>(p.src), static_cast<T*>(p.dst), p.n_out, p.stride);
    return cudaGetLastError();
  }, unsupported_size);
}

cudaError_t launch_transpose_thin(const TransposeParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.rows == 0 || p.cols == 0) return cudaSuccess;
  // The tile's segments are sized for a short side of at most kThinShort.
  if (!thin_applies(p)) return cudaErrorInvalidValue;
  return with_element_type(p.elem_bytes, [&](auto tag) {
    using T = decltype(tag);
    // The run along the longer dim: with both dims short either mapping is correct, and this
    // one gives each tile the longer segments. (rows <= cols here means rows <= kThinShort.)
    if (p.rows <= p.cols) {
      const int log2_w = thin_log2_long(p.rows, p.cols, p.elem_bytes);
      const int64_t tiles_c = course::ceil_div<int64_t>(p.cols, int64_t{1} << log2_w);
      transpose_thin_rows<T><<<one_pass_blocks(p.batch * tiles_c, 1), kThinThreads, 0, stream>>>(
          p, log2_w, thin_log2_pad(p.rows), tiles_c);
    } else {
      const int log2_h = thin_log2_long(p.cols, p.rows, p.elem_bytes);
      const int64_t tiles_r = course::ceil_div<int64_t>(p.rows, int64_t{1} << log2_h);
      const unsigned blocks = one_pass_blocks(p.batch * tiles_r, 1);
      if constexpr (sizeof(T) == 2) {
        if (thin_pairs_apply(p)) {
          transpose_thin_cols<T, true><<<blocks, kThinThreads, 0, stream>>>(p, log2_h, thin_log2_pad(p.cols), tiles_r);
          return cudaGetLastError();
        }
      }
      transpose_thin_cols<T, false><<<blocks, kThinThreads, 0, stream>>>(p, log2_h, thin_log2_pad(p.cols), tiles_r);
    }
    return cudaGetLastError();
  }, unsupported_size);
}

cudaError_t launch_transpose(const TransposeParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.rows == 0 || p.cols == 0) return cudaSuccess;
  return with_element_type(p.elem_bytes, [&](auto tag) {
    return launch_transpose_typed<decltype(tag)>(p, stream);
  }, unsupported_size);
}

}  // namespace memory_ops
