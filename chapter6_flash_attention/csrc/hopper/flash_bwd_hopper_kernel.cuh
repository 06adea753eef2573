// Chapter 6, part 3: FlashAttention's backward on Hopper (sm_90a), backward rung "wgmma". The
// algorithm is rung "mma"'s (csrc/attention/flash_bwd_kernel.cuh: FlashAttention 2's work split,
// P recomputed from the forward's lse, D = rowsum(dO * O) precomputed, dQ summed in float32 with
// atomics); what changes is the forward's part 3 story told again:
//
//   - a block owns kBlockN = 128 keys of one kv head. A producer warpgroup (one thread issuing
//     the loads, one of another warp dQ's reductions: below) brings the block's K and V once by
//     TMA and then streams, per step (a query tile of kBlockM rows of one of the query heads that
//     read this kv head: 64 at d = 128, 128 at d = 64, HopperBwdTraits), Q, dO, and the rows' lse
//     (log2 units) and D through a two-stage ring on mbarriers:
//     full barriers the copies complete on, empty ones the consumer threads arrive on when they
//     are done with a stage;
//   - two consumer warpgroups own 64 keys each, keys as wgmma's m, so that the products whose
//     rows are keys keep their A operand in registers (the C-to-A identity of the forward's P):
//       S^T  = K_wg Q^T         ss: K and Q K-major                     m64 n(kBlockM: query rows)
//       dP^T = V_wg dO^T        ss: V and dO K-major                    m64 n(kBlockM)
//       P^T  = exp2(S^T scale log2(e) - lse2)                           registers
//       dV  += P^T dO           rs: P^T from registers, dO read MN-major m64 n(d)
//       dS^T = P^T * (dP^T - D)                                         registers
//       dK  += dS^T Q           rs: dS^T from registers, Q MN-major     m64 n(d)
//     dK and dV stay in registers for the whole walk (64 floats each at d = 128) and are written
//     once at the end: the group's query heads are steps of the same walk, so GQA sums for free;
//   - dQ = dS K has query rows as m: it needs dS, the transpose of what the registers hold. Each
//     thread stores its dS^T into shared memory in the 128-byte swizzle (the layout TMA writes and
//     the descriptors read), and wgmma reads it back as an MN-major A operand (tnspA), K as an
//     MN-major B. The step's dQ (kBlockM x d) is two 64 x 64 quarters: warpgroup w computes
//     columns 64w..64w+63 at d = 128, rows 64w..64w+63 at d = 64, over all 128 keys either way
//     (both warpgroups' dS^T, so a barrier of the 256 consumer threads hands them over), and a
//     thread ends a step with 32 floats of dQ;
//   - the consumers do not add them into dQ's float32 sums themselves (float2 atomics from
//     registers: 16 RED instructions a thread a step, each holding its registers until the load/
//     store unit takes it, on the critical path between one step's dQ and the next step's S^T).
//     Each thread stores its 32 floats into a shared-memory buffer (8 float4 stores, in the
//     register order, so a warp's store is 512 contiguous bytes: no bank conflict), fences them
//     into the async proxy and arrives on the buffer's full barrier; one thread of the producer
//     warpgroup (warp 1) waits for it and hands the whole tile to the copy engine as one bulk
//     reduction (cp.reduce.async.bulk ... add.f32) into the sums, which keep that register order
//     (attention_backward_hopper_workspace's layout); once the engine has read the buffer it
//     frees it on the buffer's empty barrier. Two buffers where they fit, so that step i + 1's
//     stores never wait for step i's reduction (HopperBwdTraits::kDqBuffers).
//     flash_bwd_hopper_dispatch.cu scales the sums, reorders and rounds.
//
// Rows past seqlen_q in the last query tile arrive as zero rows of Q and dO (TMA's zero-fill) with
// lse2 = +inf and D = 0 (the dispatch's padded statistics), so their P, dS and dQ are exactly 0.
// Keys past seqlen_k arrive as zero rows of K and V: their scores are 0, not -inf, and exp2(0 -
// lse2) can overflow for a row whose lse is very negative, so the last key tile masks them like
// the causal diagonal does (only the steps a mask can bite take the masked code: a compile-time
// tag, as in the forward).
//
// A window and a softcap (attention.h; kWindowSoftcap, a template parameter: the plain
// instantiations compile none of it). A block walks only the query tiles whose rows see one of its
// keys, hopper_window_query_tiles (tile_schedule.h): the transpose of the forward's key range, on
// the same bottom-right rule. Only the pairs an edge of the window crosses take the masked step
// (part 1's tile_mask, flash_bwd_kernel.cuh). With a softcap P is recomputed from the capped scores
// and the forward's lse, and dS^T takes the cap's derivative, as part 1's backward does
// (recompute_p): dS^T = P^T (dP^T - D) (1 - tanh^2). The derivative is known with P, and holding
// it until dP^T is in spilled at d = 128, so with a softcap the step waits for dP^T first and makes
// P^T and dS^T in one pass (below, where P^T is made).
//
// The packed (varlen) layout (attention.h's cu_seqlens; kVarlen): a block per (sequence, key tile,
// kv head) over the padded grid of max_seqlen_k, which returns at once past its sequence's keys.
// The tensor maps describe the packed (total_tokens, heads, head_dim) tensors as one batch, and a
// tile's coordinates are its sequence's first token plus the tile's row. So a partial tile carries
// rows of the next sequence, not TMA's zeros: as keys they are masked like keys past seqlen_k (the
// sequence's own length; the dK and dV stores stop there), and as queries they read the padded
// statistics rows (lse2 +inf, D 0), whose P and dS are 0. The statistics and dQ's sums are indexed
// by packed row, each sequence's rows starting on a whole tile (hopper_bwd_seq_row0).
//
// No torch headers: this file builds with a bare nvcc for sm_90a (and to empty kernels for any
// other target, which the glue never launches).
#pragma once

#include "attention/attention.h"
#include "attention/flash_bwd_kernel.cuh"  // tile_mask, recompute_p (part 1's window and softcap)
#include "attention/softcap.cuh"
#include "attention/varlen.cuh"
#include "hopper/flash_bwd_hopper.h"
#include "hopper/flash_fwd_hopper_kernel.cuh"  // make_bhsd_map, hopper_fwd::pack2
#include "hopper/hopper.cuh"
#include "hopper/tensor_map.h"

#include <course/cuda_utils.h>

#include <climits>
#include <cstdint>
#include <type_traits>

namespace flash_attention {

template <int kHeadDim_>
struct HopperBwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kHopperBwdBlockN;  // keys per block: two consumer warpgroups x 64
  // Query rows per step, what the registers leave beside dK and dV (flash_bwd_hopper.h): 64 at
  // d = 128, 128 at d = 64. S^T and dP^T are m64 x n(kBlockM) per warpgroup.
  static constexpr int kBlockM = kHopperBwdAccumulators - kHeadDim;
  static constexpr int kStages = 2;
  static constexpr int kChunks = kHeadDim / 64;  // 64-column chunks: one TMA box, one swizzle width
  static constexpr int kRowChunks = kBlockM / 64;  // the same for dS^T's query rows
  static constexpr int kConsumerThreads = 256, kProducerThreads = 128;
  static constexpr int kThreads = kConsumerThreads + kProducerThreads;
  // dQ of a step (kBlockM x d) is two 64 x 64 quarters, and each warpgroup computes one over all
  // the block's keys (m64 n64 k128): at d = 128 a 64-column chunk, at d = 64 a 64-row half. Either
  // way the two partials are one contiguous tile of the sums, one bulk reduction a step.
  static constexpr bool kDqSplitRows = kRowChunks == 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;      // K (or V) of the block
  static constexpr int kRowTileBytes = kBlockM * kHeadDim * 2;  // Q (or dO) of one step
  static constexpr int kStatBytes = kBlockM * 4;                // lse2 (or D) of one step
  static constexpr int kStageBytes = 2 * kRowTileBytes + 2 * kStatBytes;  // what one stage's barrier expects
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;        // dS^T of one step, 16-bit
  // dQ's partial of one warpgroup for one step: 64 rows x 64 columns of float32 (16 KiB), in the
  // register order (kDqFloats / 128 floats a thread); one buffer holds both warpgroups'.
  static constexpr int kDqFloats = kHopperBwdDqRows * 64;
  static constexpr int kDqBytes = 2 * kDqFloats * 4;
  // K, V, two stages of Q and of dO, two buffers of dS^T (a warpgroup may write step i + 1's while
  // the other still reads step i's), dQ's partials, the statistics; + 1024 for the swizzle atoms'
  // alignment.
  static constexpr int smem_bytes(int dq_buffers) {
    return 2 * kKVBytes + 2 * kStages * kRowTileBytes + 2 * kDsBytes + dq_buffers * kDqBytes +
           2 * kStages * kStatBytes + 1024;
  }
  // Two buffers of dQ's partials where they fit (d = 128: 226 KiB of the 227 a block may take), so
  // that step i + 1's stores never wait for step i's reduction; one at d = 64 (195 KiB; two would
  // be 128 bytes too many), where a step (as much tensor work as one at d = 128) gives the copy engine
  // its length to read the 32 KiB before the next step's stores.
  static constexpr int kDqBuffers = smem_bytes(2) + 128 <= 227 * 1024 ? 2 : 1;
  static constexpr int kSmemBytes = smem_bytes(kDqBuffers);
  // setmaxnreg as the forward's warp-specialized rungs: 128 x 24 + 256 x 240 = 64,512 registers.
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static_assert(kChunks == 1 || kChunks == 2, "dK and dV of 64 keys in registers: head_dim 64 or 128");
  static_assert(kBlockN == 128 && (kRowChunks == 1 || kRowChunks == 2) && kChunks * kRowChunks == 2,
                "two warpgroups of 64 keys; dQ's tile two 64 x 64 quarters");
  static_assert(kHopperBwdRowTile % kBlockM == 0, "the statistics' padding: whole steps");
  static_assert(kDqFloats == 8 * 4 * 128, "dQ's partial: 8 float4 stores of each of a warpgroup's 128 threads");
  // The static barriers (under 128 bytes) come on top of this.
  static_assert(kSmemBytes + 128 <= 227 * 1024, "more shared memory than an sm_90 block may take");
};

#if COURSE_HOPPER_DEVICE
namespace hopper_bwd {

// The step's query-row statistics (lse2 or D) of register j of S^T and its neighbour: register j
// is column 8 (j >> 2) + 2t + (j & 1), query row of the tile, so registers 4c..4c+3 read the pair
// at 8c + 2t. Read from shared memory where they are used, a pair at a time, rather than all
// kBlockM / 4 of a lane's held across the loop (32 registers at kBlockM = 128, which spilled).
__device__ __forceinline__ float2 column_pair(const float* stat, int j, int t) {
  return *reinterpret_cast<const float2*>(stat + 8 * (j >> 2) + 2 * t);
}

// The two values of a packed pair (pack2's inverse: exact, every 16-bit value is a float).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&v));
  }
}

// An m64 x n(kBlockM) accumulator's C layout as kBlockM / 16 k16 A fragments (the forward's pack_p).
template <typename T, int kBlockM>
__device__ __forceinline__ void pack_a(uint32_t (&a)[kBlockM / 16][4], const float (&c)[kBlockM / 2]) {
#pragma unroll
  for (int kk = 0; kk < kBlockM / 16; ++kk) {
#pragma unroll
    for (int x = 0; x < 4; ++x) a[kk][x] = hopper_fwd::pack2<T>(c[8 * kk + 2 * x], c[8 * kk + 2 * x + 1]);
  }
}

}  // namespace hopper_bwd
#endif

// lse2_rows and d_rows: (batch * heads) x rows_pad floats (attention_backward_hopper_rows), padded
// rows +inf and 0; dq_accum the same rows x head_dim, zeroed. Packed (kVarlen): heads x packed rows
// (attention_backward_hopper_packed_rows). kWindowSoftcap: `cap` is the softcap (unread otherwise).
template <typename T, typename K, bool kWindowSoftcap, bool kVarlen>
__global__ void __launch_bounds__(K::kThreads, 1)
    flash_bwd_hopper_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                            const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_do,
                            const AttentionBackwardParams params, float* __restrict__ dq_accum,
                            const float* __restrict__ lse2_rows, const float* __restrict__ d_rows, unsigned k_tiles,
                            float scale_log2, const Softcap cap) {
#if COURSE_HOPPER_DEVICE
  using namespace hopper;
  using namespace hopper_bwd;
  constexpr int kD = K::kHeadDim, kBN = K::kBlockN, kBM = K::kBlockM, kStages = K::kStages;
  constexpr int kSRegs = kBM / 2;  // S^T, dP^T: m64 x n(kBlockM) each
  constexpr int kGradRegs = kD / 2;  // dK, dV: m64 x d
  constexpr int kDqRegs = 32;        // dQ: one m64 x n64 quarter
  constexpr int kASteps = kBM / 16;  // k16 steps of dV and dK (over the step's query rows)
  static_assert(!(kWindowSoftcap && kVarlen), "the packed layout with a window runs on part 1's backward");
  extern __shared__ unsigned char smem_raw[];
  // The swizzle pattern repeats every 1024 bytes and the descriptors assume atoms there.
  unsigned char* smem = smem_aligned_1024(smem_raw);
  unsigned char* k_s = smem;                                 // [chunk][kBlockN rows][64]
  unsigned char* v_s = k_s + K::kKVBytes;                    // same
  unsigned char* q_s = v_s + K::kKVBytes;                    // [stage][chunk][kBlockM rows][64]
  unsigned char* do_s = q_s + kStages * K::kRowTileBytes;    // same
  unsigned char* ds_s = do_s + kStages * K::kRowTileBytes;   // [buffer][row chunk][kBlockN keys][64 query rows]
  float* dq_s = reinterpret_cast<float*>(ds_s + 2 * K::kDsBytes);  // [buffer][warpgroup][kDqFloats]
  float* lse_s = dq_s + K::kDqBuffers * 2 * K::kDqFloats;          // [stage][kBlockM]
  float* dd_s = lse_s + kStages * kBM;                              // [stage][kBlockM]
  __shared__ uint64_t kv_full, full[kStages], empty[kStages];
  __shared__ uint64_t dq_full[K::kDqBuffers], dq_empty[K::kDqBuffers];

  // The block's (key tile, batch, kv head), key tiles fastest: causal blocks with the most query
  // tiles (the first key tiles) are launched first, so the short ones fill the tail of the grid.
  const int64_t tile = blockIdx.x % k_tiles;
  const int64_t bhk = blockIdx.x / k_tiles;
  const int64_t b = bhk / params.fwd.heads_kv;
  const int64_t hk = bhk % params.fwd.heads_kv;
  const int64_t n0 = tile * kBN;
  // Packed: sequence b as a batch of one (varlen.cuh: its lengths, and dK and dV at its first key).
  // k_tiles covers the longest sequence's keys, so a shorter one's last tiles hold none of its keys:
  // the whole block leaves together, before any barrier. Its first query and key tokens are the
  // tensor maps' coordinates of its row 0 and key 0, and its statistics start at packed row
  // seq_row0 of each head (rows_pad, here the packed rows of a head: flash_bwd_hopper.h).
  [[maybe_unused]] AttentionBackwardParams sequence;
  [[maybe_unused]] int q_token0 = 0, k_token0 = 0;
  if constexpr (kVarlen) {
    sequence = sequence_params<T>(params, b);
    if (n0 >= sequence.fwd.seqlen_k) return;
    q_token0 = params.fwd.cu_seqlens_q[b];
    k_token0 = params.fwd.cu_seqlens_k[b];
  }
  const AttentionBackwardParams& g = kVarlen ? sequence : params;
  const AttentionParams& p = g.fwd;
  const int64_t group = p.heads / p.heads_kv;
  const int64_t rows_pad = kVarlen ? attention_backward_hopper_packed_rows(params.fwd.total_q, params.fwd.batch)
                                   : attention_backward_hopper_rows(p.seqlen_q);
  [[maybe_unused]] const int64_t seq_row0 = kVarlen ? hopper_bwd_seq_row0(q_token0, b) : 0;
  // The steps: every query tile from the one holding the first row that sees key n0 (causal rows
  // above it see none of the block's keys) to the last, of every query head of the group; step i
  // is head hk * group + i / tiles_per_head, tile i % tiles_per_head. A window also ends the walk
  // at the tile of the last row that sees the block's last key (hopper_window_query_tiles). None (a
  // block whose keys no row sees): the block writes zeros.
  int64_t m_begin, tiles_per_head;
  if constexpr (kWindowSoftcap) {
    const HopperKeyTiles rows = hopper_window_query_tiles(p, n0, kBN, kBM);
    m_begin = int64_t{rows.first} * kBM;
    tiles_per_head = rows.count;
  } else {
    m_begin = first_visible_row(n0, p.seqlen_q, p.seqlen_k, p.causal) / kBM * kBM;
    tiles_per_head = (p.seqlen_q - m_begin + kBM - 1) / kBM;
  }
  const int64_t steps = group * tiles_per_head;

  if (threadIdx.x == 0) {
    prefetch_tensor_map(&map_q);
    prefetch_tensor_map(&map_k);
    prefetch_tensor_map(&map_v);
    prefetch_tensor_map(&map_do);
    mbarrier_init(&kv_full, 1);  // the producer's arrive, with K's and V's bytes
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);   // the producer's arrive, with the stage's bytes
      // Every consumer thread arrives once it is done with the stage, not one lane per warp as the
      // forward's K/V ring does: here the lanes also read the stage's statistics with ordinary loads
      // (column_pair), and each reader's own arrive is what orders its reads before the producer's
      // next bulk copy into the stage (racecheck reported the per-warp form, __syncwarp or not).
      mbarrier_init(&empty[s], K::kConsumerThreads);
    }
    for (int s = 0; s < K::kDqBuffers; ++s) {
      // Every consumer thread arrives after its own stores and fence (each orders only its own
      // writes before the copy engine's read); the writer arrives once the engine has read it.
      mbarrier_init(&dq_full[s], K::kConsumerThreads);
      mbarrier_init(&dq_empty[s], 1);
    }
    fence_barrier_init();
  }
  __syncthreads();  // the barriers are initialised before anyone waits on them

  if (threadIdx.x < K::kProducerThreads) {
    // The producer: one thread issues every load; stage i % kStages is free for step i once the 256
    // consumer threads have arrived on its empty barrier for step i - kStages.
    setmaxnreg_dec<K::kProducerRegs>();
    if (threadIdx.x == 0 && steps > 0) {
      mbarrier_arrive_expect_tx(&kv_full, 2 * K::kKVBytes);
#pragma unroll
      for (int c = 0; c < K::kChunks; ++c) {
        // Packed: one batch of every token, the sequence's keys from its first token on.
        const int key_row = k_token0 + static_cast<int>(n0), batch = kVarlen ? 0 : static_cast<int>(b);
        tma_load_4d(k_s + c * kBN * 128, &map_k, &kv_full, c * 64, key_row, static_cast<int>(hk), batch);
        tma_load_4d(v_s + c * kBN * 128, &map_v, &kv_full, c * 64, key_row, static_cast<int>(hk), batch);
      }
      for (int64_t i = 0; i < steps; ++i) {
        const int stage = static_cast<int>(i % kStages);
        if (i >= kStages) mbarrier_wait(&empty[stage], static_cast<uint32_t>((i / kStages - 1) & 1));
        const int64_t h = hk * group + i / tiles_per_head;
        const int64_t m0 = m_begin + i % tiles_per_head * kBM;
        mbarrier_arrive_expect_tx(&full[stage], K::kStageBytes);
#pragma unroll
        for (int c = 0; c < K::kChunks; ++c) {
          const int q_row = q_token0 + static_cast<int>(m0), batch = kVarlen ? 0 : static_cast<int>(b);
          tma_load_4d(q_s + stage * K::kRowTileBytes + c * kBM * 128, &map_q, &full[stage], c * 64, q_row,
                      static_cast<int>(h), batch);
          tma_load_4d(do_s + stage * K::kRowTileBytes + c * kBM * 128, &map_do, &full[stage], c * 64, q_row,
                      static_cast<int>(h), batch);
        }
        // The tile's kBlockM padded rows of statistics: 256 or 512 bytes at a 256-byte multiple, all
        // inside the workspace (rows_pad and seq_row0 are whole numbers of steps).
        const int64_t row = kVarlen ? h * rows_pad + seq_row0 + m0 : (b * p.heads + h) * rows_pad + m0;
        bulk_load(lse_s + stage * kBM, lse2_rows + row, K::kStatBytes, &full[stage]);
        bulk_load(dd_s + stage * kBM, d_rows + row, K::kStatBytes, &full[stage]);
      }
    } else if (threadIdx.x == 32 && steps > 0) {
      // dQ's writer (warp 1, so that it never waits behind the copies above): step i's partials
      // from buffer i % kDqBuffers into query tile m0 of head h of the sums. The two warpgroups'
      // quarters (column chunks at d = 128, row halves at d = 64) are adjacent there: one 32 KiB
      // reduction.
      // The destination walks the group's heads tile by tile (kept incrementally: this thread has
      // 24 registers, and the divisions and 64-bit products of the loader's form spill there).
      float* head_sums = dq_accum + (kVarlen ? hk * group * rows_pad + seq_row0 + m_begin
                                             : (b * p.heads + hk * group) * rows_pad + m_begin) * kD;
      int tile_in_head = 0;
      for (int64_t i = 0; i < steps; ++i) {
        const int buf = static_cast<int>(i % K::kDqBuffers);
        mbarrier_wait(&dq_full[buf], static_cast<uint32_t>((i / K::kDqBuffers) & 1));
        float* dst = head_sums + tile_in_head * int64_t{kBM * kD};
        if (++tile_in_head == tiles_per_head) {
          tile_in_head = 0;
          head_sums += rows_pad * kD;
        }
        bulk_reduce_add_f32(dst, dq_s + buf * 2 * K::kDqFloats, K::kDqBytes);
        bulk_commit_group();
        // The engine has read the buffer (the adds into L2 may still be under way): the consumers
        // may write it again, for step i + kDqBuffers.
        bulk_wait_group_read<0>();
        mbarrier_arrive(&dq_empty[buf]);
      }
      // The last reductions complete before the block retires.
      bulk_wait_group<0>();
    }
    return;
  }
  setmaxnreg_inc<K::kConsumerRegs>();

  // ---------------------------------------------------------------- the consumers
  const int ct = threadIdx.x - K::kProducerThreads;
  const int wg = ct / 128;  // consumer warpgroup: keys 64 wg .. 64 wg + 63 of the block's tile
  const int warp = (ct % 128) / 32;
  const int lane = ct % 32;
  const int t = lane % 4;
  const int key_lo = wg * 64 + warp * 16 + lane / 4;  // this lane's keys in the tile: key_lo and key_lo + 8
  const unsigned char* k_wg = k_s + wg * 64 * 128;
  const unsigned char* v_wg = v_s + wg * 64 * 128;
  const float scale = static_cast<float>(p.scale);  // dK = scale dS^T Q
  const int64_t diag = p.seqlen_k - p.seqlen_q;  // key j is visible to row i iff j <= i + diag
  // dQ's quarter of this warpgroup (kDqSplitRows above), over all the block's keys: its rows (dS^T's
  // chunk of query rows) at d = 64, its columns (K's chunk) at d = 128.
  const int dq_row_chunk = K::kDqSplitRows ? wg : 0;
  const int dq_chunk = K::kDqSplitRows ? 0 : wg;

  float dk[kGradRegs], dv[kGradRegs];
#pragma unroll
  for (int j = 0; j < kGradRegs; ++j) dk[j] = dv[j] = 0.f;

  // One step: query tile m0 of head h, from stage i % kStages. kMask (a compile-time tag): the
  // steps a mask can bite (the last key tile, the pairs crossing the causal diagonal) run a copy
  // with the mask, the rest one without, and the branch between them is outside every wgmma group.
  auto step = [&](auto mask_tag, int64_t i) {
    const int stage = static_cast<int>(i % kStages);
    const uint32_t parity = static_cast<uint32_t>((i / kStages) & 1);
    const int64_t m0 = m_begin + i % tiles_per_head * kBM;  // (its head matters only to the writer)
    const unsigned char* q_t = q_s + stage * K::kRowTileBytes;
    const unsigned char* do_t = do_s + stage * K::kRowTileBytes;
    unsigned char* ds_t = ds_s + (i & 1) * K::kDsBytes;
    mbarrier_wait(&full[stage], parity);
    // The operands' descriptors: one per tile, stepped by adding (byte offset >> 4) to the start
    // address field (bits 0-13; shared addresses stay below 2^18, so the sum never carries out of
    // it). K's and V's would be the same every step: made opaque here, so that the compiler builds
    // them again in each step rather than keeping all 40 of them (80 registers) live across the walk.
    uint64_t k_desc = smem_desc_sw128(k_wg, 16, 1024), v_desc = smem_desc_sw128(v_wg, 16, 1024);
    uint64_t kt_desc = smem_desc_sw128(k_s + dq_chunk * kBN * 128, kBN * 128, 1024);
    opaque(k_desc);
    opaque(v_desc);
    opaque(kt_desc);
    const uint64_t q_desc = smem_desc_sw128(q_t, 16, 1024), do_desc = smem_desc_sw128(do_t, 16, 1024);
    const uint64_t qt_desc = smem_desc_sw128(q_t, kBM * 128, 1024), dot_desc = smem_desc_sw128(do_t, kBM * 128, 1024);
    const uint64_t dst_desc = smem_desc_sw128(ds_t + dq_row_chunk * kBN * 128, kBN * 128, 1024);

    // S^T and dP^T, two groups: d / 16 k16 steps each, both operands K-major (a k16 slice is 32
    // bytes further inside a 64-column chunk, or the next chunk).
    float s[kSRegs], dp[kSRegs];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const int chunk = kk / 4, col = (kk % 4) * 32;
      Wgmma<T, kBM>::ss(s, k_desc + ((chunk * kBN * 128 + col) >> 4), q_desc + ((chunk * kBM * 128 + col) >> 4),
                        kk > 0);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const int chunk = kk / 4, col = (kk % 4) * 32;
      Wgmma<T, kBM>::ss(dp, v_desc + ((chunk * kBN * 128 + col) >> 4), do_desc + ((chunk * kBM * 128 + col) >> 4),
                        kk > 0);
    }
    wgmma_commit();

    // P^T while dP^T runs: groups complete in order, so one pending group is dP^T.
    wgmma_wait<1>();
    fence_operands(s);
    // With a softcap (kWindowSoftcap), dS^T is made here, with P^T: it takes the cap's derivative
    // 1 - tanh^2 of each score, which would otherwise wait for dP^T in 32 more registers (d = 128
    // has none to spare: ptxas spilled them). So this path waits for dP^T too, giving up the
    // overlap of P^T's exponentials with dP^T's product, which the tanh per score dwarfs anyway.
    bool ds_done = false;
    if constexpr (kWindowSoftcap) {
      const auto mask = tile_mask<K, true>(p, m0, n0);  // part 1's: the window's edges and seqlen_k
      auto visible = [&](int j) {
        return !decltype(mask_tag)::value || mask.visible(8 * (j >> 2) + 2 * t + (j & 1), key_lo + 8 * ((j >> 1) & 1));
      };
      if (cap.in != 0.f) {  // uniform across the grid
        wgmma_wait<0>();
        fence_operands(dp);
        with_softcap_tanh(cap, [&](auto mode) {  // one loop per softcap mode (softcap.cuh)
          constexpr SoftcapTanh kMode = decltype(mode)::value;
#pragma unroll
          for (int j = 0; j < kSRegs; j += 2) {
            const float2 l = column_pair(lse_s + stage * kBM, j, t);
            const float2 d = column_pair(dd_s + stage * kBM, j, t);
            // Part 1's recompute_p: P from the capped score and the forward's lse, and the derivative.
            // Every score's exponential, then the mask as a select: recompute_p's own `visible ? :`
            // around its asm exponential was a branch a score here, and the convergence points
            // held registers that this loop then spilled at d = 128 (nvcc 13.0).
            float dc0, dc1;
            const float p0 = recompute_p<kMode>(s[j], l.x, true, scale_log2, cap, &dc0);
            const float p1 = recompute_p<kMode>(s[j + 1], l.y, true, scale_log2, cap, &dc1);
            s[j] = visible(j) ? p0 : 0.f;
            s[j + 1] = visible(j + 1) ? p1 : 0.f;
            dp[j] = s[j] * (dp[j] - d.x) * dc0;
            dp[j + 1] = s[j + 1] * (dp[j + 1] - d.y) * dc1;
          }
        });
        ds_done = true;
      } else {
#pragma unroll
        for (int j = 0; j < kSRegs; ++j) {
          const float2 l = column_pair(lse_s + stage * kBM, j, t);
          s[j] = visible(j) ? exp2_approx(fmaf(s[j], scale_log2, -((j & 1) ? l.y : l.x))) : 0.f;
        }
      }
    } else {
      [[maybe_unused]] int key_limit = 0, causal_off = 0;
      if constexpr (decltype(mask_tag)::value) {
        // Key kc of the tile is visible to row rc iff kc < key_limit and (causal) kc <= rc + causal_off;
        // worked out in 64 bits, clamped into int where a bound decides nothing more.
        key_limit = static_cast<int>(min(p.seqlen_k - n0, int64_t{kBN}));
        const int64_t off = p.causal ? m0 + diag - n0 : int64_t{kBN};
        causal_off = static_cast<int>(max(min(off, int64_t{kBN}), int64_t{-kBM - 1}));
      }
#pragma unroll
      for (int j = 0; j < kSRegs; ++j) {
        const float2 l = column_pair(lse_s + stage * kBM, j, t);
        s[j] = exp2_approx(fmaf(s[j], scale_log2, -((j & 1) ? l.y : l.x)));
        if constexpr (decltype(mask_tag)::value) {
          const int kc = key_lo + 8 * ((j >> 1) & 1);
          const int rc = 8 * (j >> 2) + 2 * t + (j & 1);
          if (kc >= key_limit || kc > rc + causal_off) s[j] = 0.f;
        }
      }
    }
    uint32_t pf[kASteps][4];  // P^T as wgmma's A fragments, one k16 step of query rows each
    pack_a<T, kBM>(pf, s);

    // dV += P^T dO: dO's 16 rows (2048 bytes) per step, read transposed, its chunks kBlockM rows apart.
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kASteps; ++kk) {
      Wgmma<T, kD>::template rs<1>(dv, pf[kk], dot_desc + ((kk * 16 * 128) >> 4), 1);
    }
    wgmma_commit();

    // dS^T = P^T (dP^T - D) once dP^T is in (dV may still run; with a softcap it was made above),
    // with P^T as rounded for dV, read back from its fragments: the float P^T would stay live beside
    // dP^T, and at d = 128 those 32 registers spill (nvcc 13.0, -Xptxas -v). The error is the u
    // relative that the tensor-core rungs' dS carries anyway (rung "mma" rounds dS itself:
    // test_attention.py's rounding_bounds).
    // The wait for dP^T on both paths, outside the branch: the softcap's path has it already, and
    // this one returns at once there (dV is the one group left). Inside `if (!ds_done)` alone,
    // ptxas saw dP^T's registers read by pack_a below on a path it could not prove had waited,
    // and serialized every wgmma of the kernel behind its own wait (warning C7514).
    wgmma_wait<1>();
    fence_operands(dp);
    if (!ds_done) {
#pragma unroll
      for (int j = 0; j < kSRegs; j += 2) {
        const float2 d = column_pair(dd_s + stage * kBM, j, t);
        const float2 pr = hopper_bwd::unpack2<T>(pf[j >> 3][(j & 7) >> 1]);
        dp[j] = pr.x * (dp[j] - d.x);
        dp[j + 1] = pr.y * (dp[j + 1] - d.y);
      }
    }
    uint32_t dsf[kASteps][4];  // dS^T as A fragments
    pack_a<T, kBM>(dsf, dp);
    // dS^T into shared memory for dQ, in the 128-byte swizzle, 64 query columns to a chunk of
    // kBlockN rows (TMA's box layout): key row r, query column c at (c / 64) * kBlockN * 128 +
    // r * 128 + ((c % 64 / 8) ^ (r % 8)) * 16 + (c % 8) * 2. Register pair j holds column
    // c = 8 (j / 4) + 2t: chunk j / 32 and 8-column group (j / 4) % 8, both known at compile time.
    // For one register pair the warp's 8 rows (r % 8 = lane / 4) and 4 column pairs hit 32
    // different banks.
#pragma unroll
    for (int j = 0; j < kSRegs; j += 2) {
      const int r = key_lo + 8 * ((j >> 1) & 1);
      *reinterpret_cast<uint32_t*>(ds_t + (j >> 5) * kBN * 128 + r * 128 + ((((j >> 2) & 7) ^ (r & 7)) << 4) + 4 * t) =
          dsf[j >> 3][(j & 7) >> 1];
    }

    // dQ = dS K, then dK += dS^T Q, and the wait for dQ alone: dK runs on the tensor cores while this
    // warpgroup stores dQ's partial below. (Issued the other way round, as before, the one wait
    // covered both products back to back: ncu's source view at d = 128, 2048 keys, put 10% of the
    // kernel's stall samples on that wait.) dQ reads dS^T from shared memory: the stores above are
    // ordinary ones and wgmma reads through the async proxy, so each thread fences its own, then the
    // barrier of the 256 consumer threads hands the tile over (each warpgroup's quarter of dQ sums
    // over both warpgroups' keys). dK reads dS^T from registers and needs neither.
    fence_proxy_async_shared();
    named_barrier_sync(1, 256);
    float dq[kDqRegs];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      // A: dS (query rows x keys), stored keys-major as dS^T: MN-major, the warpgroup's 64-row chunk,
      // 16 keys (2048 bytes) a step. B: K (keys x columns), the column chunk's rows: MN-major, the
      // same steps.
      const int key = kk * 16;
      Wgmma<T, 64>::template ss<1, 1>(dq, dst_desc + ((key * 128) >> 4), kt_desc + ((key * 128) >> 4), kk > 0);
    }
    wgmma_commit();
    // dK += dS^T Q, Q read transposed like dO above.
#pragma unroll
    for (int kk = 0; kk < kASteps; ++kk) {
      Wgmma<T, kD>::template rs<1>(dk, dsf[kk], qt_desc + ((kk * 16 * 128) >> 4), 1);
    }
    wgmma_commit();
    // Groups complete in order: with one pending (dK), dQ (and dV before it) are done.
    wgmma_wait<1>();
    fence_operands(dq);

    // dQ's partial to the writer, through buffer i % kDqBuffers once the copy engine has read what
    // step i - kDqBuffers left there (the writer's arrive; at steady state long done). Thread ct's
    // float4 g is its registers 4g..4g+3 at float 512 g + 4 (ct % 128): register j is row
    // 16 warp + lane / 4 + 8 ((j >> 1) & 1) of the quarter, column 8 (j >> 2) + 2t + (j & 1). Padded
    // rows need no guard (their dS is 0 and their sums are never read).
    const int buf = static_cast<int>(i % K::kDqBuffers);
    if (i >= K::kDqBuffers) {
      mbarrier_wait(&dq_empty[buf], static_cast<uint32_t>((i / K::kDqBuffers - 1) & 1));
    }
    float* dq_t = dq_s + (buf * 2 + wg) * K::kDqFloats + (ct % 128) * 4;
#pragma unroll
    for (int g4 = 0; g4 < kDqRegs / 4; ++g4) {
      *reinterpret_cast<float4*>(dq_t + g4 * 512) =
          make_float4(dq[4 * g4], dq[4 * g4 + 1], dq[4 * g4 + 2], dq[4 * g4 + 3]);
    }
    // Ordinary stores that the copy engine reads next: each thread fences its own before arriving.
    fence_proxy_async_shared();
    mbarrier_arrive(&dq_full[buf]);

    wgmma_wait<0>();
    fence_operands(dv);
    fence_operands(dk);
    fence_operands(pf);   // P^T's and dS^T's registers stayed live until dV and dK read them
    fence_operands(dsf);
    // Every product that read this stage (S^T, dP^T, dV, dK) has completed: every consumer
    // thread's arrive frees it for step i + kStages. (dS^T's buffer is freed by the next step's
    // barrier instead: a warpgroup writes buffer i % 2 again only after both passed step i + 1's
    // barrier, which each reaches after its step-i dQ has completed.)
    mbarrier_arrive(&empty[stage]);
  };

  if (steps > 0) {
    mbarrier_wait(&kv_full, 0);
    for (int64_t i = 0; i < steps; ++i) {
      const int64_t m0 = m_begin + i % tiles_per_head * kBM;
      // The pair needs no mask when every key of the tile exists and (causal) the tile's first row
      // sees its last key; with a window, when neither of its edges crosses the pair either.
      bool masked;
      if constexpr (kWindowSoftcap) {
        masked = tile_mask<K, true>(p, m0, n0).active;
      } else {
        masked = n0 + kBN > p.seqlen_k || (p.causal && m0 + diag < n0 + kBN - 1);
      }
      if (masked) {
        step(std::true_type{}, i);
      } else {
        step(std::false_type{}, i);
      }
    }
  }

  // dK (scaled: dK = scale dS^T Q) and dV of this lane's two keys, rows past seqlen_k skipped.
  T* dk_out = static_cast<T*>(g.dk) + b * g.dk_batch_stride + hk * g.dk_head_stride;
  T* dv_out = static_cast<T*>(g.dv) + b * g.dv_batch_stride + hk * g.dv_head_stride;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = n0 + key_lo + 8 * r;
    if (key < p.seqlen_k) {  // the last tile's keys past the end were computed on zero rows
#pragma unroll
      for (int j = 2 * r; j < kGradRegs; j += 4) {
        const int c = 8 * (j >> 2) + 2 * t;
        *reinterpret_cast<uint32_t*>(dk_out + key * g.dk_seq_stride + c) =
            hopper_fwd::pack2<T>(dk[j] * scale, dk[j + 1] * scale);
        *reinterpret_cast<uint32_t*>(dv_out + key * g.dv_seq_stride + c) = hopper_fwd::pack2<T>(dv[j], dv[j + 1]);
      }
    }
  }
#endif  // COURSE_HOPPER_DEVICE: other targets compile an empty kernel the glue never launches
}

// Launches the main kernel; the dispatch runs the statistics kernel before it and dQ's after.
// kWindowSoftcap, kVarlen: the instantiations above (one file each per dtype and head dim).
// Packed, the grid is the padded one over max_seqlen_k (seqlen_k here) and the maps describe the
// packed tensors as one batch of total_q and total_k tokens.
template <typename T, int D, bool kWindowSoftcap, bool kVarlen>
cudaError_t run_flash_bwd_hopper(const AttentionBackwardParams& g, float* dq_accum, const float* lse2_rows,
                                 const float* d_rows, cudaStream_t stream) {
  using K = HopperBwdTraits<D>;
  const AttentionParams& p = g.fwd;
  const int64_t k_tiles = course::ceil_div(p.seqlen_k, static_cast<int64_t>(K::kBlockN));
  const int64_t blocks = k_tiles * p.batch * p.heads_kv;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX || p.seqlen_q > INT_MAX || p.seqlen_k > INT_MAX || p.batch * p.heads > INT_MAX) {
    return cudaErrorInvalidConfiguration;
  }
  // Packed: a tile's coordinate is its sequence's first token plus the row, an int for TMA. No key
  // token at all (every sequence's keys empty, whatever max_seqlen_k says): no block has a key tile,
  // dQ stays 0, and the key maps would describe an empty tensor.
  if (kVarlen && (p.total_q > INT_MAX / 2 || p.total_k > INT_MAX / 2)) return cudaErrorInvalidConfiguration;
  if (kVarlen && p.total_k == 0) return cudaSuccess;
  // A query side with no rows (seqlen_q or heads 0) still has maps to make: a dim of 0 becomes 1
  // in make_bhsd_map (seqlen) or here (heads), and no step reads it.
  const int64_t heads = p.heads > 0 ? p.heads : 1;
  const int64_t map_batch = kVarlen ? 1 : p.batch;  // packed: every token of every sequence, one batch
  const int64_t rows_q = kVarlen ? p.total_q : p.seqlen_q, rows_k = kVarlen ? p.total_k : p.seqlen_k;
  CUtensorMap map_q, map_k, map_v, map_do;
  COURSE_CUDA_TRY(make_bhsd_map(&map_q, p.q, map_batch, heads, rows_q, D, p.q_batch_stride, p.q_head_stride,
                                p.q_seq_stride, K::kBlockM));
  COURSE_CUDA_TRY(make_bhsd_map(&map_do, g.dout, map_batch, heads, rows_q, D, g.do_batch_stride, g.do_head_stride,
                                g.do_seq_stride, K::kBlockM));
  COURSE_CUDA_TRY(make_bhsd_map(&map_k, p.k, map_batch, p.heads_kv, rows_k, D, p.k_batch_stride, p.k_head_stride,
                                p.k_seq_stride, K::kBlockN));
  COURSE_CUDA_TRY(make_bhsd_map(&map_v, p.v, map_batch, p.heads_kv, rows_k, D, p.v_batch_stride, p.v_head_stride,
                                p.v_seq_stride, K::kBlockN));
  auto kernel = flash_bwd_hopper_kernel<T, K, kWindowSoftcap, kVarlen>;
  COURSE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::kSmemBytes));
  const float scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  // The softcap in log2 units, part 1's backward's (P = exp2(c - lse2) with c the capped score).
  const Softcap cap =
      kWindowSoftcap ? make_softcap(p.scale, p.softcap, p.dtype == DType::kBFloat16, /*log2_units=*/true) : Softcap{};
  kernel<<<static_cast<unsigned>(blocks), K::kThreads, K::kSmemBytes, stream>>>(
      map_q, map_k, map_v, map_do, g, dq_accum, lse2_rows, d_rows, static_cast<unsigned>(k_tiles), scale_log2, cap);
  return cudaGetLastError();
}

}  // namespace flash_attention
