// Chapter 6, forward rung 2: "tiled", FlashAttention 1's online softmax on scalar FMAs.
//
// What changes from "naive" (attention_naive_kernels.cu): S and P never reach global memory.
// One thread block owns Br query rows of one (batch, head); it streams the keys and values past
// them in tiles of Bc rows staged in shared memory, and keeps per row only
//   m: the largest score seen so far,   l: the sum of exp(s - m) over the keys seen so far,
//   o: the sum of exp(s - m) v over the keys seen so far (d numbers, in registers).
// When a tile raises the maximum from m to m', everything accumulated so far is scaled by
// exp(m - m') (chapter 3's online softmax, with o riding along); at the end o / l is the output
// and m + log(l) the lse. Memory is O(seqlen): Q, K, V, O and the lse, nothing seqlen^2, so the
// four seqlen^2 trips of the naive rung are gone. Each K/V element is read from global memory
// once per block of Br rows (instead of once per row, as the naive rung does through the cache
// at best), and each Q element once.
//
// Causal: a block's rows see keys [0, visible_keys(its last row)) at most, so the key loop stops
// there: the tiles entirely above the diagonal are never loaded (about half of them at
// seqlen_q == seqlen_k). Tiles that straddle the diagonal are masked score by score.
//
// Still scalar: every multiply-add is an FFMA on CUDA cores, reading both operands from shared
// memory. Tensor cores (mma.sync) are the next rung.
//
// Everything is computed in the accumulation type A (float32; float64 for float64 inputs).
// Shared memory holds A as well, converted once at the load, so the inner loops never convert.
//
// No torch headers: this file builds with a bare `nvcc -c`.
#include "attention/attention.h"

#include <course/cuda_utils.h>
#include <course/numeric.cuh>
#include <course/reduce.cuh>
#include <course/static_switch.h>

#include <climits>

namespace flash_attention {
namespace {

using course::Acc;
using course::from_acc;
using course::MaxOp;
using course::SumOp;
using course::to_acc;

// ------------------------------------------------------------------------------------------
// Tile shapes
// ------------------------------------------------------------------------------------------
// The block: Br query rows, Bc keys per tile, kThreads threads. Each query row belongs to a
// group of G = kThreads / Br consecutive threads (G divides 32, so a group never leaves its
// warp and combines with shuffles). Thread g of the group computes the scores of keys
// g, g + G, ... of a tile (Bc / G of them) and the output columns g, g + G, ... (d / G).
struct TileShape {
  int br, bc, threads;
};

// Shared memory: the Q tile (Br x d), one K-or-V tile (Bc x d: K and V take turns in one
// buffer, which is what lets d = 256 fit at all) and the P tile (Br x Bc), each row padded by
// one element so that the rows of a warp's reads fall in different banks (an unpadded row of
// d = 32k floats starts in the same bank as every other row: a 32/G-way conflict on every Q read).
constexpr int shared_bytes(TileShape s, int d, int elem) {
  return ((s.br + s.bc) * (d + 1) + s.br * (s.bc + 1)) * elem;
}

// 48 KiB is what a kernel may take without cudaFuncSetAttribute on every architecture (sm_75's
// default carve-out; static __shared__ arrays cannot ask for more). That is what binds: the
// largest shape in this list that fits is taken, so at d = 128 (float32) the Q and K/V tiles
// alone are 32 KiB at Br = Bc = 32 and 48 KiB at Br = 64, Bc = 32. Registers bind next: each
// thread keeps d * Br / kThreads output accumulators (32 at d = 128 and 256 in float32) and
// Bc * Br / kThreads scores. Larger tiles amortize the barriers and raise each K/V element's
// reuse (Br rows read it); these shapes were not tuned by measurement. The tensor-core rungs
// (csrc/) leave the limit behind: they ask for dynamic shared memory above 48 KiB.
constexpr int kSharedBudget = 48 * 1024;
constexpr TileShape kShapes[] = {{64, 32, 128}, {32, 32, 128}, {32, 16, 128}, {16, 16, 128}, {8, 8, 64}};

constexpr bool shape_valid(TileShape s, int d) {
  const int g = s.threads / s.br;
  return s.threads % s.br == 0 && g >= 1 && 32 % g == 0 && s.bc % g == 0 && d % g == 0 && s.threads % 32 == 0;
}

// The first shape of kShapes that fits the budget and divides evenly at head dim d with
// elements of `elem` bytes. float32 (and the 16-bit types, staged as float32) gives
//   d = 32, 64, 96: 64 x 32, 128 threads (20, 33, 45 KiB)    d = 128: 32 x 32 (36 KiB)
//   d = 256: 16 x 16 (33 KiB)
// float64: d = 32: 64 x 32; d = 64: 32 x 32; d = 96: 32 x 16; d = 128: 16 x 16; d = 256: 8 x 8
// on 64 threads (all between 32 and 41 KiB).
constexpr TileShape pick_shape(int d, int elem) {
  for (TileShape s : kShapes) {
    if (shape_valid(s, d) && shared_bytes(s, d, elem) <= kSharedBudget) return s;
  }
  return {0, 0, 0};
}

// ------------------------------------------------------------------------------------------
// The kernel
// ------------------------------------------------------------------------------------------

// Copies rows [row0, row0 + kRows) of a (seqlen, d) slice into a padded shared tile, converted to
// A, all threads of the block taking consecutive elements (a warp reads 32 consecutive elements
// of a row: coalesced). Rows past `rows` are filled with zeros: the tiles at the end of the
// sequence are partial, and zeros keep the unused scores finite and the unused values harmless
// (their probabilities are 0, and 0 * 0 is 0 where 0 * garbage could be NaN).
template <int kRows, int D, int kThreads, typename T, typename A>
__device__ __forceinline__ void load_tile(A (*tile)[D + 1], const T* __restrict__ base, int64_t seq_stride,
                                          int64_t row0, int64_t rows) {
  for (int e = threadIdx.x; e < kRows * D; e += kThreads) {
    const int r = e / D;
    const int c = e % D;
    const int64_t row = row0 + r;
    tile[r][c] = row < rows ? to_acc(base[row * seq_stride + c]) : A(0);
  }
}

template <typename T, int D, int kBr, int kBc, int kThreads>
__global__ void __launch_bounds__(kThreads) forward_tiled_kernel(const AttentionParams p, unsigned q_tiles) {
  using A = typename Acc<T>::type;
  constexpr int G = kThreads / kBr;     // threads per query row
  constexpr int kScores = kBc / G;      // scores per thread per key tile
  constexpr int kCols = D / G;          // output columns per thread

  __shared__ A q_s[kBr][D + 1];
  __shared__ A kv_s[kBc][D + 1];
  __shared__ A p_s[kBr][kBc + 1];

  // The grid is flattened (query tiles fastest) so that batch * heads may exceed grid.y's 65535.
  // 32-bit division: the grid has at most 2^31 - 1 blocks (a 64-bit one is a slow library call).
  const int64_t tile = blockIdx.x % q_tiles;
  const int64_t bh = blockIdx.x / q_tiles;
  const int64_t b = bh / p.heads;
  const int64_t h = bh % p.heads;
  const int64_t hk = h / (p.heads / p.heads_kv);  // GQA: the kv head this query head reads
  const int64_t q0 = tile * kBr;

  const int r = threadIdx.x / G;  // this thread's row in the tile
  const int g = threadIdx.x % G;  // its place in the row's group
  const int64_t row = q0 + r;
  // Keys this row sees (0 for the rows of the last tile that lie past seqlen_q: they compute on
  // the zero rows load_tile wrote, never store, and must not raise the block's key range).
  const int64_t n_row = row < p.seqlen_q ? visible_keys(row, p.seqlen_q, p.seqlen_k, p.causal) : 0;
  // Keys any row of the block sees: the last valid row sees the most. This bound is the causal
  // tile skipping: tiles at or past it are above the diagonal for every row of the block.
  const int64_t last_row = (q0 + kBr < p.seqlen_q ? q0 + kBr : p.seqlen_q) - 1;
  const int64_t n_block = visible_keys(last_row, p.seqlen_q, p.seqlen_k, p.causal);

  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
  load_tile<kBr, D, kThreads>(q_s, q, p.q_seq_stride, q0, p.seqlen_q);

  const A scale = static_cast<A>(p.scale);
  const A neg_inf = course::negative_infinity<A>();
  A m = neg_inf;  // running max of this row's scores (the same in every thread of the group)
  A l = A(0);     // running sum of exp(s - m)
  A o[kCols];     // running sum of exp(s - m) v, columns g, g + G, ...
#pragma unroll
  for (int t = 0; t < kCols; ++t) o[t] = A(0);

  for (int64_t k0 = 0; k0 < n_block; k0 += kBc) {
    // The previous tile's V (in kv_s) and P (in p_s) are still being read by slower warps:
    // nobody overwrites kv_s with K until every warp has finished the P V products.
    __syncthreads();
    load_tile<kBc, D, kThreads>(kv_s, k, p.k_seq_stride, k0, p.seqlen_k);
    // The K tile (and, on the first pass, the Q tile) must be complete before any score reads it.
    __syncthreads();

    // Scores of keys k0 + g + G t, as s[t]. A dot product of d terms, Q row and K row from
    // shared memory; the padded rows put the group's G different K rows in G different banks.
    A s[kScores];
#pragma unroll
    for (int t = 0; t < kScores; ++t) s[t] = A(0);
    // A partial unroll: full unrolling of d = 256 iterations bloats the code and, in the
    // compiler's register allocation, cost spills (ptxas -v) for no gain on a loop that waits on
    // shared memory anyway.
#pragma unroll 8
    for (int c = 0; c < D; ++c) {
      const A qc = q_s[r][c];
#pragma unroll
      for (int t = 0; t < kScores; ++t) s[t] += qc * kv_s[g + G * t][c];
    }
    A tile_max = neg_inf;
#pragma unroll
    for (int t = 0; t < kScores; ++t) {
      const int64_t j = k0 + g + G * t;
      // Keys past what this row sees (the causal mask, the end of the sequence) are -inf: they
      // get probability exactly 0 below.
      s[t] = j < n_row ? scale * s[t] : neg_inf;
      tile_max = MaxOp<A>()(tile_max, s[t]);
    }
    // The row's maximum over the tile: its G threads are consecutive lanes of one warp.
    tile_max = course::warp_reduce(tile_max, MaxOp<A>(), G);
    const A m_new = MaxOp<A>()(m, tile_max);
    // A row that has seen no visible key yet has m_new = -inf, and exp(s - m_new) would be
    // exp(-inf - -inf) = NaN. Shifting by 0 instead gives exp(-inf) = 0 for every term, and the
    // rescale exp(m - 0) = exp(-inf) = 0 of a zero o and l is harmless.
    const A shift = m_new == neg_inf ? A(0) : m_new;
    const A alpha = exp(m - shift);  // rescales what was accumulated against the old max
    A tile_sum = A(0);
#pragma unroll
    for (int t = 0; t < kScores; ++t) {
      s[t] = exp(s[t] - shift);
      tile_sum += s[t];
      p_s[r][g + G * t] = s[t];
    }
    tile_sum = course::warp_reduce(tile_sum, SumOp<A>(), G);
    l = l * alpha + tile_sum;
    m = m_new;

    // Every warp has finished its scores (its reads of K in kv_s) before V overwrites it.
    __syncthreads();
    load_tile<kBc, D, kThreads>(kv_s, v, p.v_seq_stride, k0, p.seqlen_k);
    // The V tile and every group's P row must be complete before the products read them.
    __syncthreads();

#pragma unroll
    for (int t = 0; t < kCols; ++t) o[t] *= alpha;
#pragma unroll 4
    for (int j = 0; j < kBc; ++j) {
      const A pj = p_s[r][j];  // the group's threads read the same element: a broadcast
#pragma unroll
      for (int t = 0; t < kCols; ++t) o[t] += pj * kv_s[j][g + G * t];
    }
  }

  // The last tile's rows past seqlen_q have nowhere to go.
  if (row >= p.seqlen_q) return;
  T* out = static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + row * p.o_seq_stride;
  A* lse = static_cast<A*>(p.lse) + bh * p.seqlen_q + row;
  if (n_row == 0) {
    // The empty softmax of attention.h: O = 0, lse = -inf (l is 0 here, o / l would be NaN).
#pragma unroll
    for (int t = 0; t < kCols; ++t) out[g + G * t] = from_acc<T>(A(0));
    if (g == 0) *lse = neg_inf;
    return;
  }
  // l >= 1: the row's maximum contributed exp(0).
  const A inv = A(1) / l;
#pragma unroll
  for (int t = 0; t < kCols; ++t) out[g + G * t] = from_acc<T>(o[t] * inv);
  if (g == 0) *lse = m + log(l);
}

template <typename T, int D>
cudaError_t forward_tiled(const AttentionParams& p, cudaStream_t stream) {
  using A = typename Acc<T>::type;
  constexpr TileShape kShape = pick_shape(D, sizeof(A));
  static_assert(kShape.br > 0, "no tile shape fits this head dim in 48 KiB");
  static_assert(shared_bytes(kShape, D, sizeof(A)) <= kSharedBudget, "the kernel's static tiles exceed 48 KiB");
  const int64_t q_tiles = course::ceil_div(p.seqlen_q, int64_t{kShape.br});
  const int64_t blocks = p.batch * p.heads * q_tiles;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  forward_tiled_kernel<T, D, kShape.br, kShape.bc, kShape.threads>
      <<<static_cast<unsigned>(blocks), kShape.threads, 0, stream>>>(p, static_cast<unsigned>(q_tiles));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_attention_forward_tiled(const AttentionParams& p, cudaStream_t stream) {
  // No query rows: nothing to write (and grid size 0 is not a valid launch).
  if (p.batch * p.heads * p.seqlen_q == 0) return cudaSuccess;
  return course::with_dtype(p.dtype, [&](auto tag) {
    // The glue checked kCudaHeadDims: a head dim outside it reaches here only from C++.
    return course::with_listed<kCudaHeadDims>(p.head_dim, cudaErrorInvalidValue, [&](auto d) {
      return forward_tiled<decltype(tag), decltype(d)::value>(p, stream);
    });
  });
}

}  // namespace flash_attention
