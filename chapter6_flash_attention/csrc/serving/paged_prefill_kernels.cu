// Chapter 6, serving half: chunked prefill over the paged KV cache (serving.h's
// PagedPrefillParams), FlashAttention 2 on tensor cores with its K/V tiles read through the block
// table.
//
// What it is for. A prompt need not be prefilled in one piece: its tokens can be written to the
// cache in chunks of N (reshape_and_cache), each chunk attending to everything cached before it
// plus itself, so that a long prompt shares each step with the decode tokens of other sequences
// instead of stalling them; and a prompt whose first blocks are already cached (a radix match:
// the same system prompt) prefills only its suffix, which reads the shared prefix from the cache
// instead of recomputing it. Both are attention of a few query rows against a longer, paged
// context: the training half's forward, with the keys found through a table.
//
// Napkin math, per sequence of q_len new tokens over a context of c tokens, per query head:
//   FLOPs ~ 4 q_len (c - q_len / 2) head_dim (causal: the chunk's own triangle is half visible)
//   bytes ~ (2 c heads_kv + 2 q_len heads) head_dim sizeof(T) (K/V once per kv head in the ideal)
// A chunk of 512 over a 4096 context, 32/8 heads, d = 128: 33.5 GFLOP against 17 MB, about 2000
// FLOP per byte: compute bound, so tensor cores, as the training forward. A decode token in the
// same batch (q_len 1) is memory bound and pads a 64-row tile of mma work: paged_attention is
// its kernel when a batch is all decode; here it rides along for one launch.
//
// The kernel is flash_fwd_kernel.cuh's pipelined forward with three changes, built from the same
// pieces: FwdTraits for the tile shapes and the swizzled layout, flash_tiles.cuh's load_tile for
// Q, mma.cuh's gemm_nt for S = Q K^T and gemm_rs for O += P V, cp.async double buffering. The
// shape is the one FwdTraits gives rung 6 ("split_kv"), 4 warps of 16 query rows, 64 rows a block
// (64 keys a tile at d = 128, 128 at d = 64): a chunk is short next to its context, a decode
// token in the batch pads a tile to its rows, and 64 rows waste half what 128 would. The tuned
// rung's 32 rows per warp, tried first, spilled (255 registers and ~350 bytes of spill loads at
// both head dims on sm_90a, the table ids and the extra bounds on top of its registers); this
// shape takes 178 (d = 64) and 228 (d = 128) with no spill.
//   1. The grid is one block per (query tile, head, sequence), the sequences packed: a block finds
//      its rows through cu_seqlens_q and its keys through its sequence's block-table row.
//   2. A K/V tile is kBlockN consecutive tokens of the sequence: 2 to 8 cache blocks (16 or 32
//      tokens each). Each thread copies its 16-byte chunks of its rows, and row r of the tile is
//      token n0 + r, at row (n0 + r) % block_size of cache block table[(n0 + r) / block_size].
//      The table entries of tile n + 2 are loaded into registers while tile n computes, so the
//      copies of tile n + 1 never wait on a table read: the one extra dependent load per tile that
//      paging costs is hidden like the K/V copies are. Nothing about a tile needs the block size
//      at compile time (any size works; the glue keeps to serving.h's list for one cache format).
//   3. Bottom-right causal: query row i of the chunk is token context - q_len + i, so it sees
//      keys j <= i + context - q_len (attention.h's diag = seqlen_k - seqlen_q), and the key loop
//      stops at the last key the block's last row sees, as in the training forward.
//
// Memory safety whatever the inputs (serving.h): a sequence's rows are prefill_rows (inside the
// query), its context paged_context (inside its table row); a token whose block id lies outside
// the cache is copied as zeros and then masked out of the softmax (its tile takes a slow path that
// re-reads the table, found in the barrier every tile passes anyway: __syncthreads_or).
//
// No torch headers: this file builds with a bare `nvcc -c`. The kernel body needs sm_80 (mma.sync
// in 16-bit types, cp.async); for older GPUs it compiles to an empty kernel the glue never
// launches (it checks the capability first), so the file builds for sm_75 as the others do.
#include "attention/attention.h"
#include "attention/flash_fwd.h"
#include "attention/flash_tiles.cuh"
#include "attention/mma.cuh"
#include "serving/serving.h"

#include <course/cuda_utils.h>
#include <course/index_math.h>
#include <course/static_switch.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

namespace flash_attention {
namespace {

// The split-KV rung's tile shape (flash_fwd.h; see the top of the file): 64 query rows per block
// in 4 warps of 16, a key tile of 64 (d = 128) or 128 (d = 64) tokens, double-buffered, swizzled.
// Only the shape is borrowed: this kernel never splits the keys (its kSplit is unread).
template <int D>
using PrefillTraits = FwdTraits<D, MmaForward::kSplitKv>;

// The chunks (16 bytes) of one K or V tile each thread copies, and the tile row of its i-th.
template <typename K>
struct PagedCopy {
  static constexpr int kLoads = K::kBlockN * K::kChunks / K::kThreads;
  static_assert(K::kBlockN * K::kChunks % K::kThreads == 0, "every thread copies the same number of chunks");
  __device__ static __forceinline__ int row(int i) { return (threadIdx.x + i * K::kThreads) / K::kChunks; }
  __device__ static __forceinline__ int col(int i) { return ((threadIdx.x + i * K::kThreads) % K::kChunks) * 8; }
};

// The block ids of this thread's rows of key tile n; -1 past the context (rows copied as zeros).
// A plain load per row: the rows of one thread fall in a few cache blocks, so most hit L1.
template <typename K>
__device__ __forceinline__ void lookup_blocks(int32_t (&ids)[PagedCopy<K>::kLoads], const int32_t* table, int n,
                                              int64_t context, int64_t block_size) {
#pragma unroll
  for (int i = 0; i < PagedCopy<K>::kLoads; ++i) {
    const int64_t token = static_cast<int64_t>(n) * K::kBlockN + PagedCopy<K>::row(i);
    ids[i] = token < context ? table[token / block_size] : -1;
  }
}

// Whether any of this thread's rows below the context has a block id outside the cache.
template <typename K>
__device__ __forceinline__ bool any_absent(const int32_t (&ids)[PagedCopy<K>::kLoads], int n, int64_t context,
                                           int64_t num_blocks) {
  bool absent = false;
#pragma unroll
  for (int i = 0; i < PagedCopy<K>::kLoads; ++i) {
    const int64_t token = static_cast<int64_t>(n) * K::kBlockN + PagedCopy<K>::row(i);
    absent |= token < context && (ids[i] < 0 || ids[i] >= num_blocks);
  }
  return absent;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// Key tile n of K and V into a stage, through the ids: flash_tiles.cuh's load_tile with the
// address of a row taken from the table. A row past the context or in a block outside the cache
// is copied as zeros (cp.async with source size 0 reads nothing): a finite score that the mask
// then replaces, and 0 * 0 in P V.
template <typename T, typename K>
__device__ __forceinline__ void load_paged_tile(T* k_tile, T* v_tile, const T* k_head, const T* v_head,
                                                const int32_t (&ids)[PagedCopy<K>::kLoads], int n,
                                                const KVCacheLayout& cache) {
#pragma unroll
  for (int i = 0; i < PagedCopy<K>::kLoads; ++i) {
    const int r = PagedCopy<K>::row(i);
    const int col = PagedCopy<K>::col(i);
    const int64_t token = static_cast<int64_t>(n) * K::kBlockN + r;
    const bool valid = ids[i] >= 0 && ids[i] < cache.num_blocks;
    const int64_t slot = valid ? ids[i] * cache.block_size + token % cache.block_size : 0;
    const int64_t offset = slot * cache.heads_kv * K::kHeadDim + col;  // slot_elems(), a host function
    mma::cp_async_16(mma::smem_address(k_tile + K::offset(r, col)), k_head + offset, valid);
    mma::cp_async_16(mma::smem_address(v_tile + K::offset(r, col)), v_head + offset, valid);
  }
}
#endif

template <typename T, typename K>
__global__ void __launch_bounds__(K::kThreads)
    paged_prefill_kernel(const PagedPrefillParams p, unsigned q_tiles, float score_scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kD = K::kHeadDim;
  constexpr int kMT = K::kWarpMTiles;
  constexpr int kNTiles = K::kBlockN / 8;
  constexpr int kDTiles = kD / 8;
  constexpr int kLoads = PagedCopy<K>::kLoads;
  extern __shared__ __align__(16) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);
  T* k_s = q_s + K::kQElems;
  T* v_s = k_s + K::kStages * K::kKVElems;

  // Query tiles fastest, then heads, then sequences (flattened, as the training forward's grid).
  const int64_t tile = blockIdx.x % q_tiles;
  const int64_t bh = blockIdx.x / q_tiles;
  const int64_t h = bh % p.heads;
  const int64_t b = bh / p.heads;
  const PrefillRows rows = prefill_rows(p.cu_seqlens_q, b, p.total_q);
  const int64_t q_len = rows.end - rows.begin;
  const int64_t m0 = tile * K::kBlockM;
  // The grid is sized for the longest chunk (max_seqlen_q, known on the host; the chunks' own
  // lengths are on the device), so the tiles past a shorter chunk's end (a decode token's every
  // tile but the first, an empty chunk's every tile) have no rows: they leave at once, before
  // reading anything more. The test is uniform, so the whole block leaves together, before any
  // barrier: no __syncthreads is left waiting for a thread that returned.
  if (m0 >= q_len) return;

  const KVCacheLayout& cache = p.cache;
  const int64_t context = paged_context(p.context_lens[b], p.max_blocks, cache.block_size);
  const int64_t diag = context - q_len;  // key j is visible to chunk row i iff j <= i + diag
  const int64_t hk = h / (p.heads / cache.heads_kv);
  const int32_t* table = p.block_tables + b * p.block_table_stride;
  const T* q = static_cast<const T*>(p.q) + rows.begin * p.q_token_stride + h * p.q_head_stride;
  const T* k_head = static_cast<const T*>(p.key_cache) + hk * kD;
  const T* v_head = static_cast<const T*>(p.value_cache) + hk * kD;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;  // mma.cuh's group: in each m16 tile this lane's rows are g and g + 8
  const int t = lane % 4;
  const int warp_row = warp * K::kWarpRows;
  const int64_t row0 = m0 + warp_row + g;
  // Keys the block's last row sees (attention.h's visible_keys): the causal loop bound.
  const int64_t last_row = (m0 + K::kBlockM < q_len ? m0 + K::kBlockM : q_len) - 1;
  const int n_end = static_cast<int>((visible_keys(last_row, q_len, context, true) + K::kBlockN - 1) / K::kBlockN);

  float acc_o[kMT][kDTiles][4];
#pragma unroll
  for (int m = 0; m < kMT; ++m) {
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) acc_o[m][d][0] = acc_o[m][d][1] = acc_o[m][d][2] = acc_o[m][d][3] = 0.f;
  }
  float row_max[kMT][2];
  float row_sum[kMT][2];
#pragma unroll
  for (int m = 0; m < kMT; ++m) {
    row_max[m][0] = row_max[m][1] = -INFINITY;
    row_sum[m][0] = row_sum[m][1] = 0.f;
  }

  // The pipeline: tile 0's copies before the loop, tile n + 1's at the top of trip n, and the
  // table entries one tile further ahead than the copies (see the top of the file).
  int32_t ids[kLoads];
  bool absent = false;  // tile n has a token in a block outside the cache (this thread's rows)
  if (n_end > 0) {
    lookup_blocks<K>(ids, table, 0, context, cache.block_size);
    absent = any_absent<K>(ids, 0, context, cache.num_blocks);
    load_tile<K, K::kBlockM>(q_s, q, p.q_token_stride, m0, q_len);
    load_paged_tile<T, K>(k_s, v_s, k_head, v_head, ids, 0, cache);
    mma::cp_async_commit();
    if (n_end > 1) lookup_blocks<K>(ids, table, 1, context, cache.block_size);
  }

  for (int n = 0; n < n_end; ++n) {
    const int stage = n % 2;
    const int64_t n0 = static_cast<int64_t>(n) * K::kBlockN;
    bool absent_next = false;
    if (n + 1 < n_end) {
      // Tile n + 1 into the other stage, whose last readers (tile n - 1) passed the barrier at
      // the end of the previous trip; its ids were loaded a trip ago. Then the ids of tile n + 2,
      // whose loads complete while tile n computes; then wait for tile n only.
      absent_next = any_absent<K>(ids, n + 1, context, cache.num_blocks);
      load_paged_tile<T, K>(k_s + (1 - stage) * K::kKVElems, v_s + (1 - stage) * K::kKVElems, k_head, v_head, ids,
                            n + 1, cache);
      mma::cp_async_commit();
      if (n + 2 < n_end) lookup_blocks<K>(ids, table, n + 2, context, cache.block_size);
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    // Each thread waited for its own copies only: the barrier makes every thread's part of Q and
    // of tile n visible to all the warps that read it. Its OR of the threads' flags says whether
    // any row of tile n lies in a block outside the cache (each thread knows only its own rows).
    const bool tile_absent = __syncthreads_or(absent) != 0;
    const T* k_tile = k_s + stage * K::kKVElems;
    const T* v_tile = v_s + stage * K::kKVElems;

    float s[kMT][kNTiles][4];
#pragma unroll
    for (int m = 0; m < kMT; ++m) {
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) s[m][j][0] = s[m][j][1] = s[m][j][2] = s[m][j][3] = 0.f;
    }
    mma::gemm_nt<T, K, kD, K::kBlockN>(s, q_s, warp_row, k_tile, 0, lane);

    // Scale into log2 units, then mask. Score s[m][j][e] is chunk row row0 + 16m + 8 (e / 2), key
    // n0 + 8j + 2t + e % 2. Only the tiles a mask can bite are masked: the last (keys past the
    // context) and those crossing the diagonal, judged for the warp's first row (its rows see the
    // fewest keys); the per-row bound is then one compare per score.
    const bool mask = n0 + K::kBlockN > context || n0 + K::kBlockN - 1 > m0 + warp_row + diag;
#pragma unroll
    for (int m = 0; m < kMT; ++m) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        int col_limit = K::kBlockN;
        if (mask) {
          const int64_t row = row0 + 16 * m + 8 * r;
          const int64_t limit = min(context - n0, row + diag - n0 + 1);
          col_limit = static_cast<int>(max(int64_t{0}, min(limit, int64_t{K::kBlockN})));
        }
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[m][j][e] *= score_scale;
            if (8 * j + 2 * t + e % 2 >= col_limit) s[m][j][e] = -INFINITY;
          }
        }
      }
    }
    // The rare tile with a token in a block outside the cache (serving.h: such tokens are absent):
    // its scores are dropped too, each key's block re-read from the table (uniform branch).
    if (tile_absent) {
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t key = n0 + 8 * j + 2 * t + e;
          const int32_t id = key < context ? table[key / cache.block_size] : 0;
          if (id < 0 || id >= cache.num_blocks) {
#pragma unroll
            for (int m = 0; m < kMT; ++m) s[m][j][e] = s[m][j][e + 2] = -INFINITY;
          }
        }
      }
    }

    // The online softmax, per row, as in the training forward: the new maximum over the four
    // lanes of the row, the old sum and output rescaled by exp2(old max - new max), then the tile's
    // exponentials.
#pragma unroll
    for (int m = 0; m < kMT; ++m) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[m][r];
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) mx = fmaxf(mx, fmaxf(s[m][j][2 * r], s[m][j][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // A row that has seen no visible key yet keeps max -inf: subtract 0 instead, so that its
        // masked scores give exp2(-inf) = 0 rather than exp2(-inf + inf) = NaN.
        const float m_use = mx == -INFINITY ? 0.f : mx;
        const float corr = row_max[m][r] == -INFINITY ? 0.f : exp2f(row_max[m][r] - mx);
        row_max[m][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[m][j][e] = exp2f(s[m][j][e] - m_use);
            sum += s[m][j][e];
          }
        }
        row_sum[m][r] = row_sum[m][r] * corr + sum;
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
          acc_o[m][d][2 * r] *= corr;
          acc_o[m][d][2 * r + 1] *= corr;
        }
      }
    }

    mma::gemm_rs<T, K, K::kBlockN, kD>(acc_o, s, v_tile, 0, lane);
    // Every warp is done reading this stage before the copies issued at the top of the next trip
    // refill the other one, and those of the trip after refill this one.
    __syncthreads();
    absent = absent_next;
  }

  // out = acc / l per row; a row with no visible key (l = 0) gets 0 (attention.h). The shuffles
  // come before any branch on the row: all 32 lanes take part.
#pragma unroll
  for (int m = 0; m < kMT; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_sum[m][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int64_t row = row0 + 16 * m + 8 * r;
      if (row < q_len) {  // the last tile's rows past the chunk computed on zero rows of Q
        T* o_row = static_cast<T*>(p.out) + ((rows.begin + row) * p.heads + h) * kD;
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
          *reinterpret_cast<uint32_t*>(o_row + d * 8 + 2 * t) =
              mma::pack2<T>(acc_o[m][d][2 * r] * inv, acc_o[m][d][2 * r + 1] * inv);
        }
      }
    }
  }
#endif  // __CUDA_ARCH__ >= 800
}

template <typename T, int D>
cudaError_t run_paged_prefill(const PagedPrefillParams& p, cudaStream_t stream) {
  using K = PrefillTraits<D>;
  const int64_t q_tiles = course::ceil_div(p.max_seqlen_q, static_cast<int64_t>(K::kBlockM));
  const int64_t blocks = q_tiles * p.heads * p.batch;
  if (blocks == 0) return cudaSuccess;  // a grid of 0 blocks is not a launch
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  auto kernel = paged_prefill_kernel<T, K>;
  // Above 48 KiB a kernel must ask for its dynamic shared memory (both head dims do).
  COURSE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::kSmemBytes));
  const float score_scale = static_cast<float>(p.scale * 1.4426950408889634);  // log2(e): exp2 in the softmax
  kernel<<<static_cast<unsigned>(blocks), K::kThreads, K::kSmemBytes, stream>>>(p, static_cast<unsigned>(q_tiles),
                                                                                score_scale);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_paged_prefill_attention(const PagedPrefillParams& p, cudaStream_t stream) {
  // No row or no head: nothing to write.
  if (p.total_q == 0 || p.heads == 0 || p.batch == 0) return cudaSuccess;
  const KVCacheLayout& cache = p.cache;
  // What the glue guarantees, checked again here so that a wrong call is an error, never a fault:
  // a whole group per kv head, and 16-byte aligned Q rows and caches for cp.async.
  if (cache.heads_kv <= 0 || p.heads % cache.heads_kv != 0 || cache.block_size <= 0) return cudaErrorInvalidValue;
  if (!course::is_aligned(p.key_cache, 16) || !course::is_aligned(p.value_cache, 16) || !course::is_aligned(p.q, 16))
    return cudaErrorInvalidValue;
  if ((p.q_token_stride * 2) % 16 != 0 || (p.q_head_stride * 2) % 16 != 0) return cudaErrorInvalidValue;
  return course::with_listed<kPagedHeadDims>(cache.head_dim, cudaErrorInvalidValue, [&](auto d) {
    constexpr int D = decltype(d)::value;
    switch (cache.dtype) {
      case DType::kBFloat16: return run_paged_prefill<__nv_bfloat16, D>(p, stream);
      case DType::kFloat16: return run_paged_prefill<__half, D>(p, stream);
      default: return cudaErrorInvalidValue;  // the glue takes only the 16-bit types here
    }
  });
}

}  // namespace flash_attention
