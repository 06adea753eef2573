// Chapter 6, rung 1 of both ladders: "naive" attention, written the way three PyTorch ops would
// run it, with the seqlen_q x seqlen_k matrix materialised in global memory.
//
//   forward:  S = scale Q K^T        (one thread per score, masked scores written as -inf)
//             P = softmax(S), lse    (one warp per row: max, then sum, then normalize in place)
//             O = P V                (one thread per output element)
//   backward: P = exp(scale Q K^T - lse)   D = rowsum(dO * O)
//             dV = P^T dO   dS = P * (dO V^T - D) in place   dQ = scale dS K   dK = scale dS^T Q
//
// Napkin math, per (batch, head) at seqlen s and head_dim d: the matmuls are 4 s^2 d FLOPs, as in
// every rung, but S and P cost 4-byte writes and reads of s^2 elements each: at s = 4096 that is
// 64 MiB of S per head, written once, read and rewritten by the softmax, read again by P V (four
// trips, ~256 MiB per head), against 2 MiB for Q, K, V and O together in bf16. The tiled rung
// (attention_tiled_kernels.cu) exists to delete those trips. Every kernel here also reads its
// operands straight from global memory, with no reuse through shared memory: this rung is the
// correctness baseline the others are measured against, not a contender.
//
// Everything is computed in the accumulation type A (float32 for float32, float16 and bfloat16;
// float64 for float64, which exists so that gradcheck runs on the GPU), and the workspace holds A.
// Rows that see no key (attention.h) give O = 0, lse = -inf and no gradient.
//
// No torch headers: this file builds with a bare `nvcc -c`.
#include "attention/attention.h"

#include <course/cuda_utils.h>
#include <course/numeric.cuh>
#include <course/reduce.cuh>

#include <climits>

namespace flash_attention {
namespace {

using course::Acc;
using course::from_acc;
using course::MaxOp;
using course::SumOp;
using course::to_acc;

// The 2-D kernels (one thread per element of a seqlen x something matrix) use 32 x 8 blocks:
// threadIdx.x runs along the contiguous dim of what the kernel writes, so a warp stores 32
// consecutive elements (one 128-byte transaction in float32).
constexpr int kTileX = 32;
constexpr int kTileY = 8;
// The row kernels (softmax, D) give one warp to a row and put kRowsPerBlock rows in a block.
constexpr int kRowsPerBlock = 4;

// Where a (batch, head, row) starts in a tensor described by its three outer strides (elements).
template <typename T>
__device__ __forceinline__ T* row_at(T* base, int64_t b, int64_t h, int64_t i, int64_t batch_stride,
                                     int64_t head_stride, int64_t seq_stride) {
  return base + b * batch_stride + h * head_stride + i * seq_stride;
}

template <typename A, typename T, typename U>
__device__ __forceinline__ A dot(const T* a, const U* b, int64_t n) {
  A sum = A(0);
  for (int64_t c = 0; c < n; ++c) sum += to_acc(a[c]) * to_acc(b[c]);
  return sum;
}

// A 2-D launch over `rows` x `cols` per (batch, head) pair, flattened into grid.x (2^31 - 1
// blocks; grid.y and grid.z stop at 65535, which batch * heads alone can pass). Every kernel
// below decodes blockIdx.x with Grid2d::locate.
struct Grid2d {
  int64_t tiles_x, tiles_y;
  __device__ __forceinline__ void locate(int64_t* bh, int64_t* y, int64_t* x) const {
    const int64_t block = blockIdx.x;
    const int64_t per_bh = tiles_x * tiles_y;
    *bh = block / per_bh;
    *y = (block % per_bh) / tiles_x * kTileY + threadIdx.y;
    *x = (block % tiles_x) * kTileX + threadIdx.x;
  }
};

// The grid for `pairs` (batch, head) pairs of a rows x cols matrix; false when it does not fit
// in grid.x (the launcher then reports cudaErrorInvalidConfiguration instead of launching a
// truncated grid).
bool make_grid(int64_t pairs, int64_t rows, int64_t cols, Grid2d* grid, unsigned* blocks) {
  grid->tiles_x = course::ceil_div(cols, int64_t{kTileX});
  grid->tiles_y = course::ceil_div(rows, int64_t{kTileY});
  const int64_t total = pairs * grid->tiles_x * grid->tiles_y;
  *blocks = static_cast<unsigned>(total);
  return total <= INT_MAX;
}

// ------------------------------------------------------------------------------------------
// Forward
// ------------------------------------------------------------------------------------------

// S[bh][i][j] = scale * q_i . k_j, or -inf where the causal mask hides key j from row i (the
// softmax then gives it exactly 0: exp(-inf - m) == 0). With kProbs (the backward) it writes
// P = exp(S - lse_i) instead, and 0 where masked: the same grid, the same dot products.
template <typename T, bool kProbs>
__global__ void __launch_bounds__(kTileX * kTileY)
    scores_kernel(const AttentionParams p, Grid2d grid, typename Acc<T>::type* __restrict__ s) {
  using A = typename Acc<T>::type;
  int64_t bh, i, j;
  grid.locate(&bh, &i, &j);
  // The last tile of each dim runs past seqlen_q / seqlen_k: those threads have no element.
  if (i >= p.seqlen_q || j >= p.seqlen_k) return;
  const int64_t b = bh / p.heads;
  const int64_t h = bh % p.heads;
  const int64_t hk = h / (p.heads / p.heads_kv);  // GQA: the kv head this query head reads
  A value;
  if (j < visible_keys(i, p.seqlen_q, p.seqlen_k, p.causal)) {
    const T* q = row_at(static_cast<const T*>(p.q), b, h, i, p.q_batch_stride, p.q_head_stride, p.q_seq_stride);
    const T* k = row_at(static_cast<const T*>(p.k), b, hk, j, p.k_batch_stride, p.k_head_stride, p.k_seq_stride);
    value = static_cast<A>(p.scale) * dot<A>(q, k, p.head_dim);
    if constexpr (kProbs) value = exp(value - static_cast<const A*>(p.lse)[bh * p.seqlen_q + i]);
  } else {
    value = kProbs ? A(0) : course::negative_infinity<A>();
  }
  s[(bh * p.seqlen_q + i) * p.seqlen_k + j] = value;
}

// One warp per row of S (chapter 3's row softmax, its two-pass form): the max, then the sum of
// exp(s - max), then P = exp(s - max) / sum written over S, and lse = max + log(sum). A row
// whose every score is -inf saw no key: P stays all zeros (exp(-inf - -inf) would be NaN) and
// lse = -inf, the empty softmax of attention.h. The max and the sum are warp shuffles, so the
// row needs no shared memory and no __syncthreads.
template <typename A>
__global__ void __launch_bounds__(32 * kRowsPerBlock)
    softmax_rows_kernel(A* __restrict__ s, A* __restrict__ lse, int64_t rows, int64_t n) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  // The last block may hold fewer than kRowsPerBlock rows. The guard is per warp (a whole warp
  // shares `row`), so the shuffles below still see all 32 lanes of every warp that runs them.
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  A* x = s + row * n;
  A m = MaxOp<A>::identity();
  for (int64_t j = lane; j < n; j += 32) m = MaxOp<A>()(m, x[j]);
  m = course::warp_reduce(m, MaxOp<A>());
  if (m == course::negative_infinity<A>()) {
    for (int64_t j = lane; j < n; j += 32) x[j] = A(0);
    if (lane == 0) lse[row] = m;
    return;
  }
  A sum = A(0);
  for (int64_t j = lane; j < n; j += 32) sum += exp(x[j] - m);
  sum = course::warp_reduce(sum, SumOp<A>());
  // sum >= 1: the maximum's own term is exp(0).
  const A inv = A(1) / sum;
  for (int64_t j = lane; j < n; j += 32) x[j] = exp(x[j] - m) * inv;
  if (lane == 0) lse[row] = m + log(sum);
}

// O[bh][i][c] = sum over the keys row i sees of P[i][j] v_j[c]. threadIdx.x runs along c: a
// warp reads 32 consecutive elements of a v row and writes 32 of an o row. A row that sees no
// key sums nothing and writes 0.
template <typename T>
__global__ void __launch_bounds__(kTileX * kTileY)
    pv_kernel(const AttentionParams p, Grid2d grid, const typename Acc<T>::type* __restrict__ probs) {
  using A = typename Acc<T>::type;
  int64_t bh, i, c;
  grid.locate(&bh, &i, &c);
  // The last tiles run past seqlen_q and head_dim.
  if (i >= p.seqlen_q || c >= p.head_dim) return;
  const int64_t b = bh / p.heads;
  const int64_t h = bh % p.heads;
  const int64_t hk = h / (p.heads / p.heads_kv);
  const A* prow = probs + (bh * p.seqlen_q + i) * p.seqlen_k;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride + c;
  // Only the visible keys: P is 0 beyond them, and skipping them keeps a non-finite v at a
  // masked key out of the sum, as in the CPU reference.
  const int64_t n = visible_keys(i, p.seqlen_q, p.seqlen_k, p.causal);
  A acc = A(0);
  for (int64_t j = 0; j < n; ++j) acc += prow[j] * to_acc(v[j * p.v_seq_stride]);
  row_at(static_cast<T*>(p.o), b, h, i, p.o_batch_stride, p.o_head_stride, p.o_seq_stride)[c] = from_acc<T>(acc);
}

template <typename T>
cudaError_t forward_naive(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  using A = typename Acc<T>::type;
  A* s = static_cast<A*>(workspace);
  const int64_t pairs = p.batch * p.heads;
  const dim3 block(kTileX, kTileY);
  Grid2d grid;
  unsigned blocks = 0;
  // An empty key range has no S to write; the softmax still runs, to give those rows lse = -inf.
  if (p.seqlen_k > 0) {
    if (!make_grid(pairs, p.seqlen_q, p.seqlen_k, &grid, &blocks)) return cudaErrorInvalidConfiguration;
    scores_kernel<T, false><<<blocks, block, 0, stream>>>(p, grid, s);
    COURSE_CUDA_TRY(cudaGetLastError());
  }
  const int64_t rows = pairs * p.seqlen_q;
  const int64_t row_blocks = course::ceil_div(rows, int64_t{kRowsPerBlock});
  if (row_blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  softmax_rows_kernel<A><<<static_cast<unsigned>(row_blocks), 32 * kRowsPerBlock, 0, stream>>>(
      s, static_cast<A*>(p.lse), rows, p.seqlen_k);
  COURSE_CUDA_TRY(cudaGetLastError());
  if (!make_grid(pairs, p.seqlen_q, p.head_dim, &grid, &blocks)) return cudaErrorInvalidConfiguration;
  pv_kernel<T><<<blocks, block, 0, stream>>>(p, grid, s);
  return cudaGetLastError();
}

// ------------------------------------------------------------------------------------------
// Backward
// ------------------------------------------------------------------------------------------

// D[bh][i] = dO_i . O_i, one warp per row. D is what rowsum(P * dP) equals (the softmax's
// Jacobian-vector product needs it), computed from O instead of P, so that it costs one pass
// over d elements instead of seqlen_k. Rows that see no key have O = 0, hence D = 0.
template <typename T>
__global__ void __launch_bounds__(32 * kRowsPerBlock)
    delta_kernel(const AttentionBackwardParams g, typename Acc<T>::type* __restrict__ delta) {
  using A = typename Acc<T>::type;
  const AttentionParams& p = g.fwd;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  // Per warp, as in softmax_rows_kernel: the warp_reduce below needs all 32 lanes.
  if (row >= p.batch * p.heads * p.seqlen_q) return;
  const int lane = threadIdx.x % 32;
  const int64_t bh = row / p.seqlen_q;
  const int64_t i = row % p.seqlen_q;
  const int64_t b = bh / p.heads;
  const int64_t h = bh % p.heads;
  const T* o = row_at(static_cast<const T*>(p.o), b, h, i, p.o_batch_stride, p.o_head_stride, p.o_seq_stride);
  const T* dout = row_at(static_cast<const T*>(g.dout), b, h, i, g.do_batch_stride, g.do_head_stride, g.do_seq_stride);
  A sum = A(0);
  for (int64_t c = lane; c < p.head_dim; c += 32) sum += to_acc(dout[c]) * to_acc(o[c]);
  sum = course::warp_reduce(sum, SumOp<A>());
  if (lane == 0) delta[row] = sum;
}

// dV[b][hk][j][c] = sum over the query heads h of kv head hk, and over the rows i that see key
// j, of P[h][i][j] dO[h][i][c]. One thread per element of dV, looping in a fixed order (heads,
// then rows): GQA's sum over heads needs no atomics and gives the same bits on every run. A key
// no row sees gets 0. threadIdx.x runs along c (coalesced dO reads and dv writes).
template <typename T>
__global__ void __launch_bounds__(kTileX * kTileY)
    dv_kernel(const AttentionBackwardParams g, Grid2d grid, const typename Acc<T>::type* __restrict__ probs) {
  using A = typename Acc<T>::type;
  const AttentionParams& p = g.fwd;
  int64_t bhk, j, c;
  grid.locate(&bhk, &j, &c);
  // The last tiles run past seqlen_k and head_dim.
  if (j >= p.seqlen_k || c >= p.head_dim) return;
  const int64_t b = bhk / p.heads_kv;
  const int64_t hk = bhk % p.heads_kv;
  const int64_t group = p.heads / p.heads_kv;
  const int64_t first = first_visible_row(j, p.seqlen_q, p.seqlen_k, p.causal);
  A acc = A(0);
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const A* pcol = probs + (b * p.heads + h) * p.seqlen_q * p.seqlen_k + j;
    const T* dout = static_cast<const T*>(g.dout) + b * g.do_batch_stride + h * g.do_head_stride + c;
    for (int64_t i = first; i < p.seqlen_q; ++i) acc += pcol[i * p.seqlen_k] * to_acc(dout[i * g.do_seq_stride]);
  }
  row_at(static_cast<T*>(g.dv), b, hk, j, g.dv_batch_stride, g.dv_head_stride, g.dv_seq_stride)[c] = from_acc<T>(acc);
}

// dS[i][j] = P[i][j] (dO_i . v_j - D_i), written over P (each thread reads and writes its own
// element only, so in place is safe). Masked and empty-row entries hold P = 0 and stay 0.
template <typename T>
__global__ void __launch_bounds__(kTileX * kTileY)
    ds_kernel(const AttentionBackwardParams g, Grid2d grid, typename Acc<T>::type* __restrict__ probs,
              const typename Acc<T>::type* __restrict__ delta) {
  using A = typename Acc<T>::type;
  const AttentionParams& p = g.fwd;
  int64_t bh, i, j;
  grid.locate(&bh, &i, &j);
  // The last tiles run past seqlen_q and seqlen_k.
  if (i >= p.seqlen_q || j >= p.seqlen_k) return;
  // Only visible keys: elsewhere P is 0 and dS is 0 already (and dO . v_j is not needed).
  if (j >= visible_keys(i, p.seqlen_q, p.seqlen_k, p.causal)) return;
  const int64_t b = bh / p.heads;
  const int64_t h = bh % p.heads;
  const int64_t hk = h / (p.heads / p.heads_kv);
  const T* dout = row_at(static_cast<const T*>(g.dout), b, h, i, g.do_batch_stride, g.do_head_stride, g.do_seq_stride);
  const T* v = row_at(static_cast<const T*>(p.v), b, hk, j, p.v_batch_stride, p.v_head_stride, p.v_seq_stride);
  A* e = probs + (bh * p.seqlen_q + i) * p.seqlen_k + j;
  *e = *e * (dot<A>(dout, v, p.head_dim) - delta[bh * p.seqlen_q + i]);
}

// dQ[bh][i][c] = scale * sum over visible j of dS[i][j] k_j[c]. An empty row writes 0.
template <typename T>
__global__ void __launch_bounds__(kTileX * kTileY)
    dq_kernel(const AttentionBackwardParams g, Grid2d grid, const typename Acc<T>::type* __restrict__ ds) {
  using A = typename Acc<T>::type;
  const AttentionParams& p = g.fwd;
  int64_t bh, i, c;
  grid.locate(&bh, &i, &c);
  // The last tiles run past seqlen_q and head_dim.
  if (i >= p.seqlen_q || c >= p.head_dim) return;
  const int64_t b = bh / p.heads;
  const int64_t h = bh % p.heads;
  const int64_t hk = h / (p.heads / p.heads_kv);
  const A* row = ds + (bh * p.seqlen_q + i) * p.seqlen_k;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride + c;
  const int64_t n = visible_keys(i, p.seqlen_q, p.seqlen_k, p.causal);
  A acc = A(0);
  for (int64_t j = 0; j < n; ++j) acc += row[j] * to_acc(k[j * p.k_seq_stride]);
  row_at(static_cast<T*>(g.dq), b, h, i, g.dq_batch_stride, g.dq_head_stride, g.dq_seq_stride)[c] =
      from_acc<T>(static_cast<A>(p.scale) * acc);
}

// dK[b][hk][j][c] = scale * sum over the query heads of hk and the rows that see j of
// dS[h][i][j] q_i[c]: dv_kernel's loop with dS for P and Q for dO.
template <typename T>
__global__ void __launch_bounds__(kTileX * kTileY)
    dk_kernel(const AttentionBackwardParams g, Grid2d grid, const typename Acc<T>::type* __restrict__ ds) {
  using A = typename Acc<T>::type;
  const AttentionParams& p = g.fwd;
  int64_t bhk, j, c;
  grid.locate(&bhk, &j, &c);
  // The last tiles run past seqlen_k and head_dim.
  if (j >= p.seqlen_k || c >= p.head_dim) return;
  const int64_t b = bhk / p.heads_kv;
  const int64_t hk = bhk % p.heads_kv;
  const int64_t group = p.heads / p.heads_kv;
  const int64_t first = first_visible_row(j, p.seqlen_q, p.seqlen_k, p.causal);
  A acc = A(0);
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const A* col = ds + (b * p.heads + h) * p.seqlen_q * p.seqlen_k + j;
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + c;
    for (int64_t i = first; i < p.seqlen_q; ++i) acc += col[i * p.seqlen_k] * to_acc(q[i * p.q_seq_stride]);
  }
  row_at(static_cast<T*>(g.dk), b, hk, j, g.dk_batch_stride, g.dk_head_stride, g.dk_seq_stride)[c] =
      from_acc<T>(static_cast<A>(p.scale) * acc);
}

template <typename T>
cudaError_t backward_naive(const AttentionBackwardParams& g, void* workspace, cudaStream_t stream) {
  using A = typename Acc<T>::type;
  const AttentionParams& p = g.fwd;
  const int64_t pairs = p.batch * p.heads;
  const int64_t kv_pairs = p.batch * p.heads_kv;
  A* probs = static_cast<A*>(workspace);                    // P, then dS
  A* delta = probs + pairs * p.seqlen_q * p.seqlen_k;       // D, one per query row
  const dim3 block(kTileX, kTileY);
  Grid2d grid;
  unsigned blocks = 0;
  const int64_t rows = pairs * p.seqlen_q;
  // The query-side kernels have nothing to do without query rows (and grid size 0 is not a
  // valid launch); the key-side ones must still run, to write dk = dv = 0.
  if (rows > 0) {
    if (p.seqlen_k > 0) {
      if (!make_grid(pairs, p.seqlen_q, p.seqlen_k, &grid, &blocks)) return cudaErrorInvalidConfiguration;
      scores_kernel<T, true><<<blocks, block, 0, stream>>>(p, grid, probs);
      COURSE_CUDA_TRY(cudaGetLastError());
    }
    const int64_t row_blocks = course::ceil_div(rows, int64_t{kRowsPerBlock});
    if (row_blocks > INT_MAX) return cudaErrorInvalidConfiguration;
    delta_kernel<T><<<static_cast<unsigned>(row_blocks), 32 * kRowsPerBlock, 0, stream>>>(g, delta);
    COURSE_CUDA_TRY(cudaGetLastError());
  }
  // dV reads P, so it runs before dS overwrites P.
  if (kv_pairs * p.seqlen_k > 0) {
    if (!make_grid(kv_pairs, p.seqlen_k, p.head_dim, &grid, &blocks)) return cudaErrorInvalidConfiguration;
    dv_kernel<T><<<blocks, block, 0, stream>>>(g, grid, probs);
    COURSE_CUDA_TRY(cudaGetLastError());
  }
  if (rows > 0) {
    if (p.seqlen_k > 0) {
      if (!make_grid(pairs, p.seqlen_q, p.seqlen_k, &grid, &blocks)) return cudaErrorInvalidConfiguration;
      ds_kernel<T><<<blocks, block, 0, stream>>>(g, grid, probs, delta);
      COURSE_CUDA_TRY(cudaGetLastError());
    }
    if (!make_grid(pairs, p.seqlen_q, p.head_dim, &grid, &blocks)) return cudaErrorInvalidConfiguration;
    dq_kernel<T><<<blocks, block, 0, stream>>>(g, grid, probs);
    COURSE_CUDA_TRY(cudaGetLastError());
  }
  if (kv_pairs * p.seqlen_k > 0) {
    if (!make_grid(kv_pairs, p.seqlen_k, p.head_dim, &grid, &blocks)) return cudaErrorInvalidConfiguration;
    dk_kernel<T><<<blocks, block, 0, stream>>>(g, grid, probs);
    COURSE_CUDA_TRY(cudaGetLastError());
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_attention_forward_naive(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  // No query rows: no output and no lse to write (and grid size 0 is not a valid launch).
  if (p.batch * p.heads * p.seqlen_q == 0) return cudaSuccess;
  return course::with_dtype(p.dtype, [&](auto tag) { return forward_naive<decltype(tag)>(p, workspace, stream); });
}

cudaError_t launch_attention_backward_naive(const AttentionBackwardParams& g, void* workspace, cudaStream_t stream) {
  return course::with_dtype(g.fwd.dtype,
                            [&](auto tag) { return backward_naive<decltype(tag)>(g, workspace, stream); });
}

}  // namespace flash_attention
