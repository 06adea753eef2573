// Chapter 6, serving half: decode attention over the paged KV cache (serving.h), the ladder
// per_head (v1) -> per_kv_head (v2) -> split_kv (v3).
//
// Napkin math. A decode step has one query token per sequence and reads every cached K and V
// byte of every sequence once:
//   bytes = batch * context * heads_kv * head_dim * 2 (K and V) * sizeof(T)
//   FLOPs = batch * heads * context * head_dim * 4 (a multiply-add for q.k, one for p v)
// batch 64, context 4096, 32 query / 8 kv heads, head_dim 128, bfloat16: 1.07 GB, 0.36 ms at
// 3 TB/s, against 4.3 GFLOP, 0.07 ms of an H100's float32 FMA units. Memory bound, but not by so
// much that the arithmetic is free: at full bandwidth an SM receives one token of one kv head
// (512 bytes) every ~40 cycles, and the ~100 instructions the kernel spends on it (dot products,
// shuffles, exponentials, conversions) take ~27 of them at four a cycle. No tensor cores: with
// one query row there is no matrix to multiply (an mma tile would be mostly padding).
//
// The work split, one thread block per (sequence, kv head, tile of its query heads, split):
//   - 4 warps; warp w takes tiles w, w + 4, ... of kTileTokens tokens. A tile lies inside one
//     cache block (kTileTokens divides block_size), so it needs one block-table lookup, loaded a
//     trip ahead of its use.
//   - Inside a warp, kLanesPerRow lanes share a K or V row, each holding kElems elements of it as
//     16-byte vectors (vector i of lane `part` is chunk i * kLanesPerRow + part: each copy
//     instruction of the lanes of a row covers one contiguous run). The warp's 32 / kLanesPerRow
//     lane groups ("streams") take different tokens side by side, kUnroll tokens each per tile:
//     a tile is 4 KiB of K and V per warp, whatever the dtype and head dim (DecodeShape below).
//   - Bytes in flight: each lane copies its 16-byte chunks of tile n + 1 into its own slots of
//     shared memory with cp.async (no registers held, no barrier: a lane reads back only what it
//     copied) while it computes tile n. Per SM: 4 blocks x 4 warps x 4 KiB = 64 KiB in flight,
//     against the ~25 KiB an H100 needs (3 TB/s x ~1 us over 132 SMs). Holding the same bytes in
//     registers instead cost 32 registers a thread more and capped an SM at 3 blocks.
//   - Every stream keeps its own online softmax (running max m and sum l per query head, in log2
//     units: log2(e) is folded into q's scale, so each exponential is one exp2) and its own
//     partial output over its columns. Streams never talk during the loop: the only
//     communication per token is the dot product's sum over the kLanesPerRow lanes of a row
//     (log2(kLanesPerRow) shuffles per query head). At the end the streams of a warp merge with
//     shuffles and the warps through shared memory, so shared memory is bounded for any context.
//
// v1, per_head: kGroup = 1 query head per block, a grid of (sequence, query head). With GQA the
//   `group = heads / heads_kv` blocks of a kv head each read its K and V: group times the bytes
//   through L2 (and from DRAM for whatever L2 does not keep between them). H100, batch 64,
//   context 4096, 32/8 heads: 54% of copy bandwidth over the unique K/V bytes.
// v2, per_kv_head: kGroup query heads per block (the whole group up to 8; DecodeShape), each K or
//   V element copied once, converted once, and used for all of them: the GQA lesson, K/V bytes
//   read once per kv head, not once per query head. The kernel is v1's with a larger kGroup; with
//   group 1 (no GQA) v1 and v2 are the same launch. Same shape: 96% of copy.
// v3, split_kv (flash-decoding): batch * heads_kv blocks cannot fill 132 SMs at batch 1 (8 blocks
//   for Llama-style 8 kv heads: v2 streams at 5% of copy). The context is cut into `splits` ranges
//   of whole cache blocks (paged_attention_splits says how many); each block does one range and
//   writes float32 partials (normalized by its own sum) and their lse to the workspace, which
//   launch_split_combine (attention/split_combine.cu) merges. The partials cost splits * rows *
//   (head_dim + 1) * 4 bytes, next to nothing against the K/V they summarize.
//
// Group sizes: the kernel is instantiated for kGroup = 1, 2, 4 and 8. Any group = heads / heads_kv
// runs: it is served by ceil(group / kGroup) head tiles of the smallest kGroup >= min(group, 8),
// the last one padded with zero queries that are never written (group 3: one tile of 4; group 16:
// two tiles of 8, so K/V is read twice). Past 8 the registers per query head (q and the output,
// kElems floats each) would not fit: group 8 already takes ~250 registers, 2 blocks per SM.
//
// block_size is a runtime value: it enters only the address of a tile's first row, and a tile
// never crosses a cache block as long as kTileTokens (2 to 16) divides it, which holds for
// serving.h's 16 and 32. A template parameter would double the instantiations for nothing.
//
// Memory safety whatever the inputs (serving.h): a sequence sees paged_context(...) tokens, so its
// table row is read only below max_blocks; a tile whose block id lies outside [0, num_blocks) is
// skipped without a copy (its tokens add nothing), and rows past the context are never read.
// q and out are read and written element by element (q may be any strided, misaligned view);
// the cache is read in 16-byte vectors, so the launcher refuses caches that are not 16-byte
// aligned (cudaErrorInvalidValue; serving_ops.cpp checks it first, by name).
//
// Everything accumulates in float32 (float64 for float64 inputs) and rounds once, at the store.
// cp.async only on sm_80 and newer; sm_75 copies into the same slots with a load and a store, and
// converts bf16 with cuda_bf16.h, so the file compiles for sm_75 as it does for sm_80 and sm_90.
//
// No torch headers: this file builds with a bare `nvcc -c`.
#include "attention/attention.h"
#include "attention/mma.cuh"
#include "serving/serving.h"

#include <course/cuda_utils.h>
#include <course/dtype.h>
#include <course/numeric.cuh>
#include <course/reduce.cuh>
#include <course/static_switch.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace flash_attention {
namespace {

using course::Acc;
using course::from_acc;
using course::SumOp;
using course::to_acc;
using course::Vec16;

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;
// The largest kGroup instantiated (see the top of the file).
constexpr int kMaxGroupTile = 8;
// Splits are whole cache blocks and no shorter than this: a shorter range spends a larger share
// of its time on the block's start (the context length, the first table entry, then the first
// K/V rows: three memory round trips before any byte streams) and on its partials.
constexpr int64_t kMinSplitTokens = 256;
constexpr double kLog2e = 1.4426950408889634;

// 2^x in the accumulation type. float32: one MUFU.EX2 (ex2.approx.ftz: relative error ~2^-22,
// and results below 2^-126 flush to 0, a softmax weight that small being 0 in any output). exp2f
// would add a range check and two multiplies around it to keep those denormals: four
// instructions where the loop spends one per score. float64: the exact exp2.
__device__ __forceinline__ float exp2_acc(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ double exp2_acc(double x) { return exp2(x); }

// max as one FMNMX. A NaN score is dropped from the max but not from the sums: exp2(NaN - m) is
// NaN, so the output is NaN all the same (course::MaxOp keeps NaN in the max too, in three
// instructions).
__device__ __forceinline__ float max_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_acc(double a, double b) { return fmax(a, b); }

template <typename T>
__device__ __forceinline__ Vec16<T> zero16() {
  const int4 bits = make_int4(0, 0, 0, 0);
  Vec16<T> v;
  memcpy(&v, &bits, sizeof(v));
  return v;
}

// ------------------------------------------------------------------------------------------
// The per-lane shape of a row and of a tile
// ------------------------------------------------------------------------------------------
// kElems, the elements of a K or V row one lane holds, is picked by three limits:
//   - at least one 16-byte vector (kVec elements), and at most 32 lanes per row (D / 32);
//   - at most 64 bytes of a row per lane, so that a tile holds kUnroll >= 1 rows of it;
//   - q and the output, kElems accumulators per query head each, at most 128 bytes (32 float
//     registers) apiece, so that kGroup query heads fit in 128 registers a thread.
// Within those, as many elements as possible: fewer lanes per row mean fewer shuffles per dot
// product (log2(kLanesPerRow) per query head per token row). kUnroll then fills 64 bytes of K and
// 64 of V per lane per tile: 4 KiB per warp, 16 KiB per block, for every dtype and head dim.
//   bfloat16/float16, D = 128: kGroup 1: 32 elements, 4 lanes a row, 8 streams x 1 token
//                              kGroup 2: 16, 8 lanes, 4 x 2;  kGroup 4 and 8: 8, 16 lanes, 2 x 4
//   bfloat16/float16, D = 64:  the same elements on half the lanes: 16-token tiles
template <typename T, int D, int kGroup>
struct DecodeShape {
  using A = typename Acc<T>::type;
  static constexpr int kVec = Vec16<T>::kLanes;
  static constexpr int kMaxRowBytes = 64;
  static constexpr int kMaxAccBytes = 128;
  static constexpr int kByAcc = kMaxAccBytes / (kGroup * static_cast<int>(sizeof(A)));
  static constexpr int kByRow = kMaxRowBytes / static_cast<int>(sizeof(T));
  static constexpr int kElems = std::max({kVec, D / 32, std::min(kByRow, kByAcc)});
  static constexpr int kVecs = kElems / kVec;  // 16-byte loads per lane per row
  static constexpr int kLanesPerRow = D / kElems;
  static constexpr int kStreams = 32 / kLanesPerRow;  // token rows a warp reads side by side
  static constexpr int kUnroll = kMaxRowBytes / (kElems * static_cast<int>(sizeof(T)));
  static constexpr int kTileTokens = kStreams * kUnroll;
  // Four blocks per SM (128 registers a thread) where q and o leave room for it: the 512 blocks
  // of batch 64 x 8 kv heads then run as one wave on an H100's 132 SMs. Group 8 (q and o alone
  // take 128 registers) and float64 get what they need.
  static constexpr int kMinBlocksPerSm = kGroup <= 4 && sizeof(A) == 4 ? 4 : 1;
  static_assert(D % kElems == 0 && kElems % kVec == 0, "a lane holds whole 16-byte vectors of a row");
  static_assert(kLanesPerRow <= 32 && 32 % kLanesPerRow == 0, "a row's lanes are a power-of-two part of a warp");
  static_assert(kUnroll >= 1 && 16 % kTileTokens == 0, "a tile must divide every supported block_size");
};

// What the launcher adds to the params: the grid's shape and, for v3, the workspace.
struct DecodeLaunch {
  int group;          // query heads per kv head, heads / heads_kv
  int head_tiles;     // blocks per (sequence, kv head) along its group: ceil(group / kGroup)
  int splits;         // context ranges per (sequence, kv head, head tile); 1: no split
  float* o_partial;   // splits > 1: [splits][batch * heads][head_dim], attention.h's layout
  float* lse_partial; // splits > 1: [splits][batch * heads]
};

// ------------------------------------------------------------------------------------------
// The copies into shared memory
// ------------------------------------------------------------------------------------------
// Every lane copies K and V into slots of shared memory that only it reads back (its own 16-byte
// chunks of its own rows), so the pipeline needs no barrier and no __syncwarp for visibility:
// cp.async.wait_group makes a lane's completed copies visible to that lane.
template <typename T>
__device__ __forceinline__ void copy16(Vec16<T>* slot, const T* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // Asynchronous: no registers hold the bytes in flight and the lane does not wait for them.
  // A source size of 0 (valid false) writes 16 zero bytes and reads nothing.
  mma::cp_async_16(mma::smem_address(slot), src, valid);
#else
  // sm_75 has no cp.async: a load and a store, the same slots, no overlap beyond one tile.
  course::store16(slot, valid ? course::load16(reinterpret_cast<const Vec16<T>*>(src)) : zero16<T>());
#endif
}

__device__ __forceinline__ void copies_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  mma::cp_async_commit();
#endif
}

// Waits until at most kPending of this lane's commit groups are still in flight.
template <int kPending>
__device__ __forceinline__ void copies_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  mma::cp_async_wait<kPending>();
#endif
}

// ------------------------------------------------------------------------------------------
// The kernel (all three rungs)
// ------------------------------------------------------------------------------------------
// Double buffering per warp: while a warp computes its tile n (from shared memory), the copies of
// its tile n + 1 are in flight. The ring holds two tiles of every warp: 2 x 4 KiB x 4 warps =
// 32 KiB per block for every dtype and head dim (kUnroll x kVecs = 4 vectors of K and 4 of V per
// lane per tile). After the loop the same bytes serve the merge of the warps' states.
template <typename T, int D, int kGroup>
struct DecodeSmem {
  using S = DecodeShape<T, D, kGroup>;
  using A = typename S::A;
  static constexpr int kStages = 2;
  static constexpr int kRingBytes = kStages * 2 * S::kUnroll * S::kVecs * kDecodeThreads * 16;
  static constexpr int kMergeBytes = kDecodeWarps * kGroup * D * static_cast<int>(sizeof(A));
  static constexpr int kBytes = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;
  static_assert(kBytes + 2 * kDecodeWarps * kGroup * sizeof(A) <= 48 * 1024, "static shared memory is 48 KiB");
};

template <typename T, int D, int kGroup>
__global__ void __launch_bounds__(kDecodeThreads, DecodeShape<T, D, kGroup>::kMinBlocksPerSm)
    paged_attention_kernel(const PagedAttentionParams p, const DecodeLaunch launch) {
  using S = DecodeShape<T, D, kGroup>;
  using M = DecodeSmem<T, D, kGroup>;
  using A = typename S::A;
  constexpr int kVec = S::kVec;
  constexpr int kVecs = S::kVecs;
  constexpr int kElems = S::kElems;
  constexpr int kLanesPerRow = S::kLanesPerRow;
  constexpr int kStreams = S::kStreams;
  constexpr int kUnroll = S::kUnroll;
  constexpr int kTile = S::kTileTokens;
  const A neg_inf = course::negative_infinity<A>();

  // The copy ring during the loop; the warps' output states (o_s) for the merge after it.
  __shared__ __align__(16) unsigned char smem[M::kBytes];
  __shared__ A m_s[kDecodeWarps][kGroup];
  __shared__ A l_s[kDecodeWarps][kGroup];
  Vec16<T>* ring = reinterpret_cast<Vec16<T>*>(smem);
  A(*o_s)[kGroup][D] = reinterpret_cast<A(*)[kGroup][D]>(smem);
  // This thread's slot of vector i of row u of K (kv = 0) or V (kv = 1) in `stage`: consecutive
  // threads own consecutive 16 bytes, so every copy and every read of a warp is conflict-free.
  auto slot = [&](int stage, int kv, int u, int i) {
    return ring + (((stage * 2 + kv) * kUnroll + u) * kVecs + i) * kDecodeThreads + threadIdx.x;
  };

  // The grid is flattened (splits fastest, then head tiles, kv heads, sequences) so that no
  // dimension meets grid.y's 65535 limit. 32-bit division: the launcher keeps the grid below 2^31.
  unsigned block = blockIdx.x;
  const int split = static_cast<int>(block % static_cast<unsigned>(launch.splits));
  block /= static_cast<unsigned>(launch.splits);
  const int head_tile = static_cast<int>(block % static_cast<unsigned>(launch.head_tiles));
  block /= static_cast<unsigned>(launch.head_tiles);
  const unsigned heads_kv = static_cast<unsigned>(p.cache.heads_kv);
  const int64_t hk = block % heads_kv;
  const int64_t b = block / heads_kv;
  const int64_t h0 = hk * launch.group + head_tile * kGroup;  // the tile's first query head
  // The last tile of a group that kGroup does not divide is partly padding.
  const int n_heads = min(kGroup, launch.group - head_tile * kGroup);

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int stream = lane / kLanesPerRow;  // which token row of a step this lane reads
  const int part = lane % kLanesPerRow;    // which part of the row
  // The head_dim column of element e of this lane's elements: vector e / kVec is chunk
  // (e / kVec) * kLanesPerRow + part of the row.
  auto column = [&](int e) { return ((e / kVec) * kLanesPerRow + part) * kVec + e % kVec; };

  // This block's range of the sequence: whole cache blocks [page_begin, page_end) of it, clipped
  // to the visible tokens. 64-bit: a context near 2^31 rounded up to whole blocks overflows int.
  const int64_t bs = p.cache.block_size;
  const int64_t context = paged_context(p.context_lens[b], p.max_blocks, bs);
  const int64_t pages = course::ceil_div(context, bs);
  int64_t page_begin = 0;
  int64_t page_end = pages;
  if (launch.splits > 1) {
    const int64_t per_split = course::ceil_div(pages, static_cast<int64_t>(launch.splits));
    page_begin = min(pages, split * per_split);
    page_end = min(pages, page_begin + per_split);
  }
  const int64_t token_begin = page_begin * bs;
  const int64_t token_end = min(page_end * bs, context);
  const int64_t range = token_end > token_begin ? token_end - token_begin : 0;
  const int tiles = static_cast<int>(course::ceil_div(range, int64_t{kTile}));
  // The launcher checked that kTile divides bs. Unsigned: the divisions by it below are per tile.
  const unsigned tiles_per_page = static_cast<unsigned>(bs) / kTile;

  const int32_t* table = p.block_tables + b * p.block_table_stride;
  // The id of the cache block tile t of this range lies in. Past the range: -1, without reading
  // the table (its entries past a sequence's context may hold anything).
  auto block_id = [&](int t) {
    return t < tiles ? table[page_begin + static_cast<unsigned>(t) / tiles_per_page] : -1;
  };
  auto in_cache = [&](int32_t id) { return id >= 0 && id < p.cache.num_blocks; };
  const int64_t row_stride = p.cache.heads_kv * D;  // between one kv head's rows of consecutive slots
  const T* k_cache = static_cast<const T*>(p.key_cache);
  const T* v_cache = static_cast<const T*>(p.value_cache);
  const int64_t lane_offset = hk * D + stream * row_stride + part * kVec;

  // Starts the copies of tile t (in cache block `id`) into `stage`. Tiles past the range and
  // blocks outside the cache copy nothing (the compute skips them); rows past the context are
  // zero-filled, so that their p = 0 meets v = 0, not 0 * garbage = NaN. One commit group per
  // tile, empty or not, so that "all groups but the newest" always means "the current tile".
  auto start_tile = [&](int t, int32_t id, int stage) {
    if (t < tiles && in_cache(id)) {
      const int64_t first_token = token_begin + static_cast<int64_t>(t) * kTile;
      const int64_t row0 = (static_cast<unsigned>(t) % tiles_per_page) * kTile;  // first row in the block
      const int64_t tile_offset = (id * bs + row0) * row_stride + lane_offset;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const bool valid = first_token + u * kStreams + stream < token_end;
        const int64_t row = tile_offset + static_cast<int64_t>(u * kStreams) * row_stride;
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
          const int64_t at = valid ? row + i * kLanesPerRow * kVec : 0;  // an invalid copy reads nothing
          copy16(slot(stage, 0, u, i), k_cache + at, valid);
          copy16(slot(stage, 1, u, i), v_cache + at, valid);
        }
      }
    }
    copies_commit();
  };

  // q, scaled into log2 units, as kElems registers per query head. Element by element: q may be
  // any view whose last dim is contiguous, aligned or not. The padding heads of a partial tile
  // get q = 0 (finite scores, never written) and read nothing.
  A q[kGroup][kElems];
  const A q_scale = static_cast<A>(p.scale * kLog2e);
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    const T* q_row = static_cast<const T*>(p.q) + b * p.q_batch_stride + (h0 + g) * p.q_head_stride;
#pragma unroll
    for (int e = 0; e < kElems; ++e) q[g][e] = g < n_heads ? to_acc(q_row[column(e)]) * q_scale : A(0);
  }

  // This stream's online softmax per query head: m the running max of the scores (log2 units), l
  // the sum of exp2(s - m), o the sum of exp2(s - m) v over this lane's columns.
  A m[kGroup];
  A l[kGroup];
  A o[kGroup][kElems];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    m[g] = neg_inf;
    l[g] = A(0);
#pragma unroll
    for (int e = 0; e < kElems; ++e) o[g][e] = A(0);
  }

  // Warp `warp` takes tiles warp, warp + 4, ...: the copies of its next tile start before it
  // computes the current one, and the table entry of the tile after that is loaded a whole trip
  // ahead of its use. The loop and the block-id tests are uniform across the warp, so the
  // shuffles inside see all 32 lanes.
  int32_t id = block_id(warp);
  int32_t id_next = block_id(warp + kDecodeWarps);
  start_tile(warp, id, 0);
  for (int t = warp, n = 0; t < tiles; t += kDecodeWarps, ++n) {
    const int32_t id_after = block_id(t + 2 * kDecodeWarps);
    start_tile(t + kDecodeWarps, id_next, (n + 1) % 2);
    copies_wait<1>();  // every group but the one just started: tile t has landed
    // A compiler barrier, not a visibility one (each lane reads only its own slots): mma.cuh's wait
    // is an asm statement without a memory clobber, and the reads of tile t's slots below must
    // not be hoisted above it.
    __syncwarp();
    // A block id outside the cache: its tokens are absent (serving.h), and nothing was copied.
    if (in_cache(id)) {
      const int stage = n % 2;
      const int64_t first_token = token_begin + static_cast<int64_t>(t) * kTile;

      // Scores: each K element is converted once and used for all kGroup query heads; the
      // partial dot products are then summed over the row's lanes.
      A s[kUnroll][kGroup];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int g = 0; g < kGroup; ++g) s[u][g] = A(0);
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
          const Vec16<T> kv = course::load16(slot(stage, 0, u, i));
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            const A k = to_acc(kv.v[e]);
#pragma unroll
            for (int g = 0; g < kGroup; ++g) s[u][g] += q[g][i * kVec + e] * k;
          }
        }
#pragma unroll
        for (int g = 0; g < kGroup; ++g) s[u][g] = course::warp_reduce(s[u][g], SumOp<A>(), kLanesPerRow);
      }
      // Tokens past the context (only the range's last tile has any): probability exactly 0.
      if (first_token + kTile > token_end) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (first_token + u * kStreams + stream >= token_end) {
#pragma unroll
            for (int g = 0; g < kGroup; ++g) s[u][g] = neg_inf;
          }
        }
      }

      // The online softmax, once per tile: one rescale of o per query head for kUnroll tokens.
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        A tile_max = s[0][g];
#pragma unroll
        for (int u = 1; u < kUnroll; ++u) tile_max = max_acc(tile_max, s[u][g]);
        const A m_new = max_acc(m[g], tile_max);
        // No valid token yet (m_new = -inf): exp2(s - m_new) would be exp2(-inf + inf) = NaN.
        // Shifting by 0 instead gives exp2(-inf) = 0 for every term, and alpha = 0 scales an o
        // and l that are still 0.
        const A shift = m_new == neg_inf ? A(0) : m_new;
        const A alpha = exp2_acc(m[g] - shift);
        A tile_sum = A(0);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          s[u][g] = exp2_acc(s[u][g] - shift);
          tile_sum += s[u][g];
        }
        l[g] = l[g] * alpha + tile_sum;
        m[g] = m_new;
#pragma unroll
        for (int e = 0; e < kElems; ++e) o[g][e] *= alpha;
      }
      // o += p v: each V element converted once, used for all kGroup query heads.
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
          const Vec16<T> vv = course::load16(slot(stage, 1, u, i));
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            const A v = to_acc(vv.v[e]);
#pragma unroll
            for (int g = 0; g < kGroup; ++g) o[g][i * kVec + e] += s[u][g] * v;
          }
        }
      }
    }
    // The next trip's copies overwrite this stage: this lane's reads of it must not sink below
    // them (a compiler barrier again; the hardware keeps one lane's accesses in order).
    __syncwarp();
    id = id_next;
    id_next = id_after;
  }
  copies_wait<0>();  // nothing of the ring may still be landing when it becomes o_s

  // Merge the warp's streams: lanes `offset` apart hold the same columns of different tokens.
  // Two states with maxima m_a, m_b combine to max(m_a, m_b), each rescaled by exp2(m - max).
#pragma unroll
  for (int offset = kLanesPerRow; offset < 32; offset *= 2) {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const A m_other = course::shfl_xor(m[g], offset, 32);
      const A l_other = course::shfl_xor(l[g], offset, 32);
      const A m_new = max_acc(m[g], m_other);
      const A shift = m_new == neg_inf ? A(0) : m_new;  // both empty: see the loop above
      const A mine = exp2_acc(m[g] - shift);
      const A theirs = exp2_acc(m_other - shift);
      l[g] = l[g] * mine + l_other * theirs;
#pragma unroll
      for (int e = 0; e < kElems; ++e) o[g][e] = o[g][e] * mine + course::shfl_xor(o[g][e], offset, 32) * theirs;
      m[g] = m_new;
    }
  }
  // o_s overlays the ring, whose slots interleave every warp's: no warp may write its state while
  // another is still reading its last tile.
  __syncthreads();
  // Stream 0 of each warp now holds the warp's state; it publishes it for the merge of warps.
  if (stream == 0) {
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
#pragma unroll
      for (int e = 0; e < kElems; ++e) o_s[warp][g][column(e)] = o[g][e];
      if (part == 0) {
        m_s[warp][g] = m[g];
        l_s[warp][g] = l[g];
      }
    }
  }
  // Every warp's state must be in shared memory before any thread merges them.
  __syncthreads();

  // One output element per thread and step: the warps' states merged, normalized, stored.
  for (int idx = threadIdx.x; idx < n_heads * D; idx += kDecodeThreads) {
    const int g = idx / D;
    const int c = idx % D;
    A m_all = neg_inf;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) m_all = max_acc(m_all, m_s[w][g]);
    // No visible token in the whole range (context 0, every block outside the cache, or a
    // split past the sequence's end): out = 0 and lse = -inf (l = 0: o / l would be NaN).
    const bool empty = m_all == neg_inf;
    A l_all = A(0);
    A o_all = A(0);
    if (!empty) {
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        const A weight = exp2_acc(m_s[w][g] - m_all);
        l_all += l_s[w][g] * weight;
        o_all += o_s[w][g][c] * weight;
      }
    }
    // l_all >= 1 when not empty: the largest score contributed exp2(0).
    const A out = empty ? A(0) : o_all / l_all;
    const int64_t row = b * p.heads + h0 + g;  // attention.h's row of the (batch, heads) output
    if (launch.splits > 1) {
      launch.o_partial[(split * (p.batch * p.heads) + row) * D + c] = static_cast<float>(out);
      if (c == 0) {
        // Natural log: the scores were in log2 units, s = s_natural * log2(e).
        const A lse = empty ? neg_inf : (m_all + log2(l_all)) / static_cast<A>(kLog2e);
        launch.lse_partial[split * (p.batch * p.heads) + row] = static_cast<float>(lse);
      }
    } else {
      static_cast<T*>(p.out)[row * D + c] = from_acc<T>(out);
    }
  }
}

// ------------------------------------------------------------------------------------------
// Launch
// ------------------------------------------------------------------------------------------

// The query heads one block serves: the whole group up to kMaxGroupTile, as the smallest
// instantiated kGroup that holds it (group 3 runs as 4 with one padding head).
int group_tile(int64_t group) {
  int tile = 1;
  while (tile < group && tile < kMaxGroupTile) tile *= 2;
  return tile;
}

template <typename T, int D, int kGroup>
cudaError_t run_paged_attention(const PagedAttentionParams& p, int group, int splits, float* workspace,
                                cudaStream_t stream) {
  using S = DecodeShape<T, D, kGroup>;
  // A tile of kTileTokens must not cross a cache block (serving.h's sizes 16 and 32 are fine).
  if (p.cache.block_size % S::kTileTokens != 0) return cudaErrorInvalidValue;
  DecodeLaunch launch{};
  launch.group = group;
  launch.head_tiles = static_cast<int>(course::ceil_div(int64_t{group}, int64_t{kGroup}));
  launch.splits = splits;
  if (splits > 1) {
    launch.o_partial = workspace;
    launch.lse_partial = workspace + splits * p.batch * p.heads * D;
  }
  const int64_t blocks = p.batch * p.cache.heads_kv * launch.head_tiles * splits;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  paged_attention_kernel<T, D, kGroup><<<static_cast<unsigned>(blocks), kDecodeThreads, 0, stream>>>(p, launch);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t with_group_tile(const PagedAttentionParams& p, int tile, int group, int splits, float* workspace,
                            cudaStream_t stream) {
  switch (tile) {
    case 1: return run_paged_attention<T, D, 1>(p, group, splits, workspace, stream);
    case 2: return run_paged_attention<T, D, 2>(p, group, splits, workspace, stream);
    case 4: return run_paged_attention<T, D, 4>(p, group, splits, workspace, stream);
    case 8: return run_paged_attention<T, D, 8>(p, group, splits, workspace, stream);
    default: return cudaErrorInvalidValue;  // group_tile returns one of these
  }
}

bool is_16bit(DType dtype) { return dtype == DType::kBFloat16 || dtype == DType::kFloat16; }

}  // namespace

// How many context ranges v3 cuts each (sequence, kv head) into, from host-known values only:
// context_lens lives on the device, so the table's width, max_blocks * block_size, stands for the
// longest context. The target is about two blocks per SM, rounded down:
//   - two 4-warp blocks keep 32 KiB of K/V in flight per SM, enough to cover HBM's latency (v2 at
//     batch 32 x 8 kv heads, 256 blocks, streams at 93% of copy on an H100);
//   - never a second, partial wave: a few blocks left over after the first wave stream at a
//     fraction of the bandwidth while the rest of the GPU waits (batch 8 x 8 kv heads at 16K
//     tokens: 8 splits, 512 blocks, 86% of copy; 9 splits, 576 blocks, 59%). Two per SM is within
//     one wave for every group (4 resident up to group 4, 2 at group 8);
//   - each split adds partials the combine must read back (splits x rows x (head_dim + 1) floats)
//     and a range start (three memory round trips before its bytes stream), so more splits than
//     fill the GPU cost time: batch 64 x 4096 tokens, already one full wave, loses ~3% of copy
//     at 2 splits and ~7% at 16 (bench_paged.py's num_splits sweep).
// The table's width stands for every context: with mixed lengths one wave of blocks ends with
// its longest sequence, and splitting would even the load out (the same sweep: 71% of copy
// unsplit, 92% at 8 splits), but only context_lens says so, and it is on the device. A caller
// that holds the lengths on the host names the count (num_splits) instead.
// A grid of more blocks than SMs is not split (2 * sms / blocks rounds to 1). Each range is at least
// kMinSplitTokens long and there are at most kPagedMaxSplits. Only the 16-bit types split: the combine
// writes float16 and bfloat16 (float32 and float64 are the ladder's correctness dtypes).
int64_t paged_attention_splits(const PagedAttentionParams& p, int sms) {
  if (!is_16bit(p.cache.dtype) || p.batch <= 0 || p.heads <= 0 || p.cache.heads_kv <= 0 || sms <= 0) return 1;
  if (p.heads % p.cache.heads_kv != 0) return 1;  // the launcher refuses these: no split to size
  const int64_t group = p.heads / p.cache.heads_kv;
  const int64_t blocks = p.batch * p.cache.heads_kv * course::ceil_div(group, int64_t{group_tile(group)});
  const int64_t by_length = p.max_blocks * p.cache.block_size / kMinSplitTokens;
  return std::max<int64_t>(1, std::min({2 * static_cast<int64_t>(sms) / blocks, by_length, kPagedMaxSplits}));
}

cudaError_t launch_paged_attention(const PagedAttentionParams& p, PagedVersion version, int64_t splits,
                                   void* workspace, cudaStream_t stream) {
  // No sequence or no query head: nothing to write (and a grid of 0 blocks is not a launch).
  if (p.batch == 0 || p.heads == 0) return cudaSuccess;
  const KVCacheLayout& cache = p.cache;
  // What the glue guarantees, checked again here so that a wrong call is an error, never a fault:
  // a whole group per kv head, and caches aligned for the 16-byte loads.
  if (cache.heads_kv <= 0 || p.heads % cache.heads_kv != 0 || cache.block_size <= 0) return cudaErrorInvalidValue;
  if (!course::is_aligned(p.key_cache, 16) || !course::is_aligned(p.value_cache, 16)) return cudaErrorInvalidValue;
  const int64_t group = p.heads / cache.heads_kv;
  if (group > INT_MAX) return cudaErrorInvalidValue;
  const int tile = version == PagedVersion::kPerHead ? 1 : group_tile(group);
  // v3 with one range is v2 exactly: no partials, no combine.
  const bool split = version == PagedVersion::kSplitKv && splits > 1;
  if (split && (workspace == nullptr || !is_16bit(cache.dtype) || splits > INT_MAX)) return cudaErrorInvalidValue;
  float* partials = split ? static_cast<float*>(workspace) : nullptr;
  const int used_splits = split ? static_cast<int>(splits) : 1;

  COURSE_CUDA_TRY(course::with_dtype(cache.dtype, [&](auto tag) {
    using T = decltype(tag);
    // The glue checked kPagedHeadDims: a head dim outside it reaches here only from C++.
    return course::with_listed<kPagedHeadDims>(cache.head_dim, cudaErrorInvalidValue, [&](auto d) {
      return with_group_tile<T, decltype(d)::value>(p, tile, static_cast<int>(group), used_splits, partials, stream);
    });
  }));
  if (!split) return cudaSuccess;

  SplitCombineParams c{};
  c.dtype = cache.dtype;
  c.o_partial = partials;
  c.lse_partial = partials + splits * p.batch * p.heads * cache.head_dim;
  c.splits = splits;
  c.rows = p.batch * p.heads;
  c.head_dim = cache.head_dim;
  c.heads = p.heads;
  c.seqlen = 1;
  c.out = p.out;
  c.out_batch_stride = p.heads * cache.head_dim;
  c.out_head_stride = cache.head_dim;
  c.out_seq_stride = 0;
  c.lse = nullptr;
  return launch_split_combine(c, stream);
}

}  // namespace flash_attention
