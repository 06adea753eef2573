// Chapter 6, part 3: FlashAttention's forward on Hopper (sm_90a): TMA, mbarriers, wgmma, warp
// specialization and the ping-pong of two consumer warpgroups. The algorithm is rung 5's
// (csrc/flash_fwd_kernel.cuh: the online softmax over key tiles, S and P in registers, bottom-right
// causal mask, lse out); what changes is who moves the data and who multiplies:
//
//   - the tensor memory accelerator (TMA) copies whole tiles of Q, K and V, 64 columns (128 bytes)
//     per copy, into shared memory with the 128-byte swizzle, and completes them on mbarriers: no
//     thread computes an address or holds a register for the copies, and rows past the end of the
//     sequence arrive as zeros;
//   - a block is two consumer warpgroups of 64 query rows each (128 rows). Each computes its
//     S = Q K^T with wgmma (m64 x kBlockN x 16 per instruction, Q and K read by the tensor cores
//     straight from shared memory: no ldmatrix), runs the online softmax on the accumulator
//     registers (the same C layout as mma.sync's, so rung 5's row statistics carry over: four lanes
//     a row, two shuffles), and adds O += P V with P from registers as wgmma's A operand and V read
//     transposed from shared memory.
//
// The rungs (flash_fwd_hopper.h), one idea each:
//   kWgmma            all 8 warps compute; thread 0 also issues the copies, two stages ahead,
//                     after a block barrier says a stage is free;
//   kWarpSpecialized  a third warpgroup, the producer, issues the copies and nothing else, waiting
//                     on per-stage "empty" barriers the consumers arrive on; it gives its registers
//                     away (setmaxnreg 24) so that the consumers can hold 240 each;
//   kPingpong         each consumer warpgroup sends tile n - 1's P V and tile n's Q K^T to the
//                     tensor cores together, in a turn it takes from the other warpgroup (two
//                     named barriers), then runs tile n's softmax with nothing in flight: the
//                     turns keep the two warpgroups half a period apart, so one's exponentials
//                     run while the other's products keep the tensor cores busy. A third stage
//                     keeps the producer ahead of the earlier requests.
// HopperFwdConfig also holds FlashAttention 3's intra-warpgroup overlap (kOverlap: tile n's softmax
// while tile n - 1's P V runs). Written first with the wait for P V after the softmax, it lost
// 10-20%: ptxas scheduled that wait (WARPGROUP.DEPBAR) right after the maximum, ahead of the
// exponentials it was meant to overlap (README, part 3). It is now written as the FP8 forward
// writes it (the wait at the top of the next step, P in two register arrays; the kernel's
// comments): rung "pingpong" runs it at d = 64 and 128, and "persistent" can
// (hopper_forward_overlap, flash_fwd_hopper.h, says which does by default and why).
//
// No torch headers: this file builds with a bare nvcc for sm_90a (and to empty kernels for any
// other target, which the glue never launches).
#pragma once

#include "attention/attention.h"
#include "hopper/flash_fwd_hopper.h"
#include "hopper/hopper.cuh"
#include "hopper/tensor_map.h"

#include <course/cuda_utils.h>

#include <climits>
#include <cstdint>
#include <type_traits>

namespace flash_attention {

// The knobs of one configuration of the kernel; the rungs (HopperFwdTraits, below) are points of
// this space, and experiments/hopper_forward_check.cu times others.
template <int kHeadDim_, int kBlockN_, int kStages_, bool kWarpSpecialized_, bool kJoint_, bool kPingpong_,
          bool kOverlap_ = false, bool kPersistent_ = false, int kOStoreBytes_ = 16>
struct HopperFwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kHopperBlockM;  // two consumer warpgroups x 64 rows (wgmma's m64)
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kWarpSpecialized = kWarpSpecialized_;
  static constexpr bool kJoint = kJoint_;        // tile n - 1's P V and tile n's Q K^T issued together
  static constexpr bool kPingpong = kPingpong_;  // the consumer warpgroups take turns issuing products
  static constexpr bool kOverlap = kOverlap_;    // tile n's softmax while tile n - 1's P V runs (FA3)
  static constexpr bool kPersistent = kPersistent_;  // a block per SM slot walks a tile schedule
  // The epilogue's store of O per thread instruction: 16 bytes (every rung), a lane's 8 columns
  // gathered by two rounds of shuffles inside the quad (store_o_lse); 8 after one round, or 4 as
  // wgmma's accumulator holds them (a lane's two columns of an 8-column group), for
  // experiments/hopper_forward_check.cu --epilogue. At 512 keys (4 key tiles an item) the 4-byte
  // stores cost the persistent rung 10-14% of its time on an H200 (NOTES.md, "The forward's epilogue").
  static constexpr int kOStoreBytes = kOStoreBytes_;
  static constexpr int kChunks = kHeadDim / 64;  // 64-column chunks: one TMA box, one swizzle width
  static constexpr int kConsumerThreads = 256;
  static constexpr int kProducerThreads = kWarpSpecialized ? 128 : 0;
  static constexpr int kThreads = kConsumerThreads + kProducerThreads;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // one stage of K (or of V)
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kKVBytes + 1024;  // + 1024-byte alignment
  // setmaxnreg: 128 x 24 + 256 x 240 = 64,512 of the SM's 65,536 registers. The persistent
  // producer also decodes tiles and draws them from a counter: at 24 registers ptxas spilled 24 bytes
  // of its state, at 40 nothing, and 128 x 40 + 256 x 232 is the same 64,512 (the consumers showed
  // no spill at 232 either, nvcc 13.0 -Xptxas -v). Gathering paged K/V (pages under 64 rows), all
  // 128 producer threads copy rows, each with a table entry and a 64-bit source address in hand:
  // at 40 registers ptxas spilled 48 bytes there, at 56 it spills 8 (d128; none at d64), and
  // 128 x 56 + 256 x 224 is the same 64,512 (the consumers show no spill at 224 at any head dim).
  // The overlap's persistent consumers (two P buffers) spilled in the unmasked loop at 224 (d = 128:
  // 536 bytes stored); they run the padded layout alone, no paged gather, so the producer goes back
  // to the 40 at which its walk did not spill: 128 x 40 + 256 x 232.
  static constexpr int kProducerRegs = kPersistent_ ? (kOverlap_ ? 40 : 56) : 24;
  static constexpr int kConsumerRegs = kPersistent_ ? (kOverlap_ ? 232 : 224) : 240;
  static_assert(kHeadDim % 64 == 0, "the 128-byte swizzle holds 64 columns of 16-bit elements");
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm_90 block may take");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "P V steps over 16 keys; TMA boxes hold up to 256 rows");
  static_assert(kWarpSpecialized || !(kJoint || kPingpong || kOverlap), "these schedules assume a producer");
  static_assert(!kPingpong || kJoint || kOverlap, "a turn holds one iteration's two products");
  // The overlap frees tile i - 2's stage only at step i, after its waits for tile i's K: with two
  // stages the producer would wait for that very release before loading tile i.
  static_assert(!kOverlap || kStages >= 3, "the overlap releases a stage a step late: three stages or more");
  static_assert(!kPersistent || kWarpSpecialized, "the persistent loop is the producer's");
  static_assert(kOStoreBytes == 4 || kOStoreBytes == 8 || kOStoreBytes == 16, "a lane's 2, 4 or 8 columns a store");
};

// Whether O's rows can take the configuration's store width: its pointer and every stride that
// moves the store's address (in elements of 2 bytes) a multiple of the width. The 4-byte stores
// need only even strides (two columns a store). The ops allocate O themselves, contiguous, at head
// dims that are multiples of 64: always aligned; a launcher refuses anything else rather than
// store past a row's bounds.
template <typename K>
inline bool hopper_o_store_aligned(const AttentionParams& p) {
  if constexpr (K::kOStoreBytes == 4) {
    return true;
  } else {
    constexpr int64_t kElems = K::kOStoreBytes / 2;
    return reinterpret_cast<uintptr_t>(p.o) % K::kOStoreBytes == 0 && p.o_seq_stride % kElems == 0 &&
           p.o_head_stride % kElems == 0 && p.o_batch_stride % kElems == 0;
  }
}

// Kernel traits per rung. Registers pick the tile: a consumer thread holds kBlockN / 2 floats of
// S (64 at 128 keys), head_dim / 2 of O (64 at d = 128), and P as kBlockN / 4 packed pairs; at
// d = 256 O alone is 128 floats, so the key tile halves to 64. Shared memory: Q (kBlockM x d) plus
// two stages of K and V: 160 KiB at d = 128, 193 KiB at d = 256 (a block may take 227 KiB).
// Rung "pingpong" takes a third stage where it fits (d = 64 and 128: 112 and 225 KiB): a warpgroup
// now asks for tile n - 1's V and tile n's K in the same turn, so the producer must run a tile
// further ahead (measured on an H200, d = 128, s = 8192: 547 TFLOP/s with two stages, 659 with
// three; experiments/hopper_forward_check.cu --variants).
constexpr int kHopperSmemLimit = 227 * 1024;  // what sm_90 lets one block opt in to
// The key tile per head dim: hopper_block_n (tile_schedule.h, which the schedule reads too).
template <int kHeadDim>
constexpr int hopper_pingpong_stages() {
  return 128 * kHeadDim * 2 + 3 * 2 * hopper_block_n(kHeadDim) * kHeadDim * 2 + 1024 <= kHopperSmemLimit ? 3 : 2;
}
// Rung "persistent" runs the consumers of the dispatch's choice for each head dim: pingpong's where
// its third stage fits (d = 64, 128), warp_specialized's where it does not (d = 256).
template <int kHeadDim, HopperForward kRung>
constexpr bool hopper_pingpong_rung() {
  return kRung == HopperForward::kPingpong ||
         (kRung == HopperForward::kPersistent && hopper_pingpong_stages<kHeadDim>() == 3);
}
template <int kHeadDim, HopperForward kRung>
struct HopperFwdTraits
    : HopperFwdConfig<kHeadDim, hopper_block_n(kHeadDim),
                      hopper_pingpong_rung<kHeadDim, kRung>() ? hopper_pingpong_stages<kHeadDim>() : 2,
                      kRung != HopperForward::kWgmma, hopper_pingpong_rung<kHeadDim, kRung>(),
                      hopper_pingpong_rung<kHeadDim, kRung>(), false, kRung == HopperForward::kPersistent> {};
// Rung "pingpong" with FlashAttention 3's intra-warpgroup overlap in its turns instead of the joint
// schedule (its default at d = 64 and 128: hopper_forward_overlap): the same tile, stages and shared memory, at the head
// dims where the third stage fits (the overlap needs it: HopperFwdConfig's static_assert).
template <int kHeadDim>
struct HopperFwdOverlapTraits
    : HopperFwdConfig<kHeadDim, hopper_block_n(kHeadDim), hopper_pingpong_stages<kHeadDim>(), true, false, true,
                      true> {
  static_assert(hopper_pingpong_stages<kHeadDim>() == 3, "the overlap runs where the third stage fits");
};
// Rung "persistent" with the same consumers (FLASH_ATTENTION_HOPPER_OVERLAP=1 only: it spills at
// d = 128; the padded layout without a window or a softcap; flash_fwd_hopper_persistent.cuh).
template <int kHeadDim>
struct HopperFwdPersistentOverlapTraits
    : HopperFwdConfig<kHeadDim, hopper_block_n(kHeadDim), hopper_pingpong_stages<kHeadDim>(), true, false, true,
                      true, true> {
  static_assert(hopper_pingpong_stages<kHeadDim>() == 3, "the overlap runs where the third stage fits");
};

#if COURSE_HOPPER_DEVICE
namespace hopper_fwd {

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// The per-tile math of the consumer warpgroups, shared by the one-tile kernel below and the
// persistent one (flash_fwd_hopper_persistent.cuh): what a warpgroup does with a stage of K and V,
// whoever decided which tile it is. Register arrays by reference; every function is inlined, so
// they stay registers.

// S = Q K^T for this warpgroup's 64 rows and the stage's kBlockN keys: d / 16 instructions, each
// reading a k16 slice of Q and of K (32 bytes further inside a 64-column chunk, or the next chunk).
template <typename T, typename K>
__device__ __forceinline__ void issue_qk(float (&s)[K::kBlockN / 2], const unsigned char* q_wg,
                                         const unsigned char* k_tile) {
  hopper::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < K::kHeadDim / 16; ++kk) {
    const int chunk = kk / 4, col = (kk % 4) * 32;
    const uint64_t da = hopper::smem_desc_sw128(q_wg + chunk * K::kBlockM * 128 + col, 16, 1024);
    const uint64_t db = hopper::smem_desc_sw128(k_tile + chunk * K::kBlockN * 128 + col, 16, 1024);
    hopper::Wgmma<T, K::kBlockN>::ss(s, da, db, kk > 0);  // the first step overwrites S: no zeroing
  }
  hopper::wgmma_commit();
}

// O += P V: kBlockN / 16 instructions, P's k16 fragment from registers, V's 16 rows (2048 bytes
// further per step) read transposed, its 64-column chunks kBlockN rows apart.
template <typename T, typename K>
__device__ __forceinline__ void issue_pv(float (&o)[K::kHeadDim / 2], const uint32_t (&pf)[K::kBlockN / 16][4],
                                         const unsigned char* v_tile) {
  hopper::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < K::kBlockN / 16; ++kk) {
    const uint64_t db = hopper::smem_desc_sw128(v_tile + kk * 16 * 128, K::kBlockN * 128, 1024);
    hopper::Wgmma<T, K::kHeadDim>::template rs<1>(o, pf[kk], db, 1);
  }
  hopper::wgmma_commit();
}

// The same two products from descriptors built once (hopper::desc_advance: one 32-bit add per
// instruction): `dq` the warpgroup's Q rows, `dk` and `dv` the stage's K and V tiles (V's with the
// MN-major strides above). The overlap schedule's (below): with two P buffers live its consumer
// threads are at the 240-register limit, and the eight Q descriptors that issue_qk's addresses
// become, kept live across the loop, were what ptxas spilled to local memory (nvcc 13.0, d = 128).
template <typename T, typename K>
__device__ __forceinline__ void issue_qk_desc(float (&s)[K::kBlockN / 2], uint64_t dq, uint64_t dk) {
  hopper::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < K::kHeadDim / 16; ++kk) {
    const int chunk = kk / 4, col = (kk % 4) * 32;
    hopper::Wgmma<T, K::kBlockN>::ss(s, hopper::desc_advance(dq, chunk * K::kBlockM * 128 + col),
                                     hopper::desc_advance(dk, chunk * K::kBlockN * 128 + col), kk > 0);
  }
  hopper::wgmma_commit();
}
template <typename T, typename K>
__device__ __forceinline__ void issue_pv_desc(float (&o)[K::kHeadDim / 2], const uint32_t (&pf)[K::kBlockN / 16][4],
                                              uint64_t dv) {
  hopper::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < K::kBlockN / 16; ++kk) {
    hopper::Wgmma<T, K::kHeadDim>::template rs<1>(o, pf[kk], hopper::desc_advance(dv, kk * 16 * 128), 1);
  }
  hopper::wgmma_commit();
}

// The online softmax of key tile i on S (rung 5's, on wgmma's accumulator layout: register r of S
// is row g + 8 * ((r >> 1) & 1), key 8 * (r >> 2) + 2t + (r & 1) of the tile). Leaves exp2 of the
// scaled scores in S and returns, per row half, the factor the old O and sums must be multiplied
// by. scale * log2(e) is folded into one FFMA per score: exp2(s * c - max * c).
// kMask (a compile-time tag): only the tiles a mask can bite (the last one past seqlen_k, those
// crossing the causal diagonal) mask, and the caller runs them in a loop of their own, so that no
// branch sits inside the overlapped region: at a branch's join ptxas stops tracking which wgmma
// groups are still running and waits for all of them (seen in the SASS: a WARPGROUP.DEPBAR 0
// right after the mask's if, before the exponentials it was meant to overlap).
// kExpBias: P comes out as 2^kExpBias exp(...) instead (the FP8 forward's 256 P, which e4m3 holds
// more finely than P itself: flash_fwd_hopper_fp8.cuh); the row sums carry the same factor, and
// the correction factors, ratios of two exponentials, do not. 0 for the 16-bit rungs.
// kWindow (the persistent rung's kWindowSoftcap instantiation): the mask is the window's, each row's
// visible keys [key_begin(row), key_end(row)) (attention.h, part 1's rule and its one unsigned
// compare per score: flash_fwd_kernel.cuh), causal being its right bound 0; i is then the key tile's
// index in the sequence, not in the walk.
template <typename K, int kExpBias = 0, bool kWindow = false, typename MaskTag>
__device__ __forceinline__ void online_softmax(MaskTag, float (&s)[K::kBlockN / 2], float (&row_max)[2],
                                               float (&row_sum)[2], float (&corr)[2], const AttentionParams& p,
                                               int64_t row0, int64_t diag, int i, int t, float scale_log2) {
  constexpr int kSRegs = K::kBlockN / 2;
  if constexpr (MaskTag::value && kWindow) {
    const int64_t n0 = static_cast<int64_t>(i) * K::kBlockN;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // The row's visible columns [col_start, col_limit) in 64 bits once; then per score one 32-bit
      // unsigned compare (a column left of col_start wraps to a large number).
      const int64_t row = row0 + 8 * r;
      const int col_limit = static_cast<int>(max(int64_t{0}, min(key_end(row, p) - n0, int64_t{K::kBlockN})));
      const int col_start = static_cast<int>(max(int64_t{0}, min(key_begin(row, p) - n0, int64_t{col_limit})));
      const unsigned width = static_cast<unsigned>(col_limit - col_start);
#pragma unroll
      for (int j = 0; j < kSRegs; ++j) {
        const int col = 8 * (j >> 2) + 2 * t + (j & 1);
        if (((j >> 1) & 1) == r && static_cast<unsigned>(col - col_start) >= width) s[j] = -INFINITY;
      }
    }
  } else if constexpr (MaskTag::value) {
    const int64_t n0 = static_cast<int64_t>(i) * K::kBlockN;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // The row's first masked key in the tile, in 64 bits once, then a 32-bit compare per score.
      int64_t limit = p.seqlen_k - n0;
      if (p.causal) limit = min(limit, row0 + 8 * r + diag - n0 + 1);
      const int col_limit = static_cast<int>(max(int64_t{0}, min(limit, int64_t{K::kBlockN})));
#pragma unroll
      for (int j = 0; j < kSRegs; ++j) {
        if (((j >> 1) & 1) == r && 8 * (j >> 2) + 2 * t + (j & 1) >= col_limit) s[j] = -INFINITY;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = row_max[r];
#pragma unroll
    for (int j = 0; j < kSRegs; ++j) {
      if (((j >> 1) & 1) == r) mx = fmaxf(mx, s[j]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // A row with no visible key so far keeps max -inf: subtract 0, so exp2(-inf) = 0, not NaN.
    float neg_max = mx == -INFINITY ? 0.f : -mx * scale_log2;
    if constexpr (kExpBias != 0) neg_max += static_cast<float>(kExpBias);
    corr[r] = row_max[r] == -INFINITY ? 0.f : hopper::exp2_approx((row_max[r] - mx) * scale_log2);
    row_max[r] = mx;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kSRegs; ++j) {
      if (((j >> 1) & 1) == r) {
        s[j] = hopper::exp2_approx(fmaf(s[j], scale_log2, neg_max));
        sum += s[j];
      }
    }
    row_sum[r] = row_sum[r] * corr[r] + sum;
  }
}

// S's C layout is P's A layout (mma.cuh): n8 tiles 2kk and 2kk + 1 are k16 step kk.
template <typename T, typename K>
__device__ __forceinline__ void pack_p(uint32_t (&pf)[K::kBlockN / 16][4], const float (&s)[K::kBlockN / 2]) {
#pragma unroll
  for (int kk = 0; kk < K::kBlockN / 16; ++kk) {
    pf[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
    pf[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
    pf[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
    pf[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

// The quad's exchange for the wider stores of O (HopperFwdConfig's kOStoreBytes 8 or 16). w[c] holds
// this lane's (t's) two columns 8c + 2t, 8c + 2t + 1 of a row; the quad's four lanes hold the row's
// 8-column group c between them. On return, word k of a piece is lane k's (columns 8c + 2k, + 1):
//   8 bytes: pair m (groups 2m, 2m + 1): w[2m], w[2m + 1] are columns 4 (t >> 1) .. + 3 of group
//            2m + (t & 1): one shuffle (xor 1) a pair;
//   16 bytes: groups 4m .. 4m + 3 as a 4 x 4 matrix of words (lane, group), transposed: w[4m + k]
//            is lane k's word of group 4m + t. Two rounds: the 2 x 2 blocks of the matrix swap
//            across lanes t, t ^ 2 (xor 2), then each block transposes across t, t ^ 1 (xor 1);
//            two shuffles a round (3 would be the least, each lane receiving 3 words, but with
//            indices that depend on the lane in every round: more selects).
// Each shuffle sends the word the partner lacks, picked by the lane's bit (a select), and the word
// received replaces the one sent (two selects, or predicated moves: ptxas's choice). Words, not
// floats: the rounding is done (pack2) and the bits move unchanged.
template <int kBytes, int kGroups>
__device__ __forceinline__ void quad_gather_o(uint32_t (&w)[kGroups], int t) {
  auto exchange = [&](uint32_t& mine, uint32_t& theirs, bool upper, int lane_mask) {
    // Lanes with `upper` keep `theirs` and send `mine`, the others the reverse; the word received
    // goes where the sent one was.
    const uint32_t sent = upper ? mine : theirs;
    const uint32_t got = __shfl_xor_sync(0xffffffffu, sent, lane_mask);
    if (upper) {
      mine = got;
    } else {
      theirs = got;
    }
  };
  if constexpr (kBytes == 8) {
    static_assert(kGroups % 2 == 0, "whole pairs of groups");
#pragma unroll
    for (int m = 0; m < kGroups / 2; ++m) exchange(w[2 * m], w[2 * m + 1], (t & 1) != 0, 1);
  } else {
    static_assert(kBytes == 16 && kGroups % 4 == 0, "whole quads of groups");
#pragma unroll
    for (int m = 0; m < kGroups / 4; ++m) {
      uint32_t* a = w + 4 * m;
      exchange(a[0], a[2], (t & 2) != 0, 2);  // the off-diagonal 2 x 2 blocks swap lanes
      exchange(a[1], a[3], (t & 2) != 0, 2);
      exchange(a[0], a[1], (t & 1) != 0, 1);  // then each block transposes
      exchange(a[2], a[3], (t & 1) != 0, 1);
    }
  }
}

// One of this lane's two rows of O (r: the row's half, rows row0 and row0 + 8), o * inv, to o_row
// (nullptr: a row past seqlen_q, computed and not stored), kBytes a store. o[4c + 2r], o[4c + 2r + 1]
// are this lane's (t's) columns 8c + 2t, 8c + 2t + 1. Both epilogues store through it (store_o_lse
// below, and the FP8 forward's store_o_lse_fp8). Every lane must call it: the wider stores shuffle
// inside the quad first.
template <typename T, int kHeadDim, int kBytes>
__device__ __forceinline__ void store_o_row(const float (&o)[kHeadDim / 2], int r, float inv, T* o_row, int t) {
  if constexpr (kBytes == 4) {
    if (o_row != nullptr) {
#pragma unroll
      for (int j = 2 * r; j < kHeadDim / 2; j += 4) {
        *reinterpret_cast<uint32_t*>(o_row + 8 * (j >> 2) + 2 * t) = pack2<T>(o[j] * inv, o[j + 1] * inv);
      }
    }
  } else {
    // The same packed words (the same rounding: the output's bits do not change), w[c] this lane's
    // columns of group c, moved inside the quad (the row's four lanes) so that each lane holds
    // whole 8- or 16-byte pieces: quad_gather_o above. The shuffles come before the row's guard:
    // the quads of a warp hold different rows, and every lane of the mask must take part.
    constexpr int kGroups = kHeadDim / 8;
    uint32_t w[kGroups];
#pragma unroll
    for (int c = 0; c < kGroups; ++c) w[c] = pack2<T>(o[4 * c + 2 * r] * inv, o[4 * c + 2 * r + 1] * inv);
    quad_gather_o<kBytes>(w, t);
    if (o_row != nullptr) {
      // The lane's part of the address once, the pieces then at constant offsets from it (the
      // stores' immediates).
      if constexpr (kBytes == 8) {
        // Pair m (groups 2m, 2m + 1): lane t holds group 2m + (t & 1)'s columns 4 (t >> 1) .. + 3.
        T* o_lane = o_row + 8 * (t & 1) + 2 * (t & 2);
#pragma unroll
        for (int m = 0; m < kGroups / 2; ++m) {
          *reinterpret_cast<uint2*>(o_lane + 16 * m) = make_uint2(w[2 * m], w[2 * m + 1]);
        }
      } else {
        // Groups 4m .. 4m + 3: lane t holds all of group 4m + t.
        T* o_lane = o_row + 8 * t;
#pragma unroll
        for (int m = 0; m < kGroups / 4; ++m) {
          *reinterpret_cast<uint4*>(o_lane + 32 * m) = make_uint4(w[4 * m], w[4 * m + 1], w[4 * m + 2], w[4 * m + 3]);
        }
      }
    }
  }
}

// o = acc / l and lse = max * scale + log(l) for this lane's two rows of a tile; a row with no
// visible key (l = 0) gets o = 0 and lse = -inf (attention.h). `out` and `lse` point at the tile's
// (batch, head). Shuffles before any branch on the row: all 32 lanes take part.
template <typename T, typename K>
__device__ __forceinline__ void store_o_lse(const float (&o)[K::kHeadDim / 2], const float (&row_sum)[2],
                                            const float (&row_max)[2], T* out, float* lse, int64_t row0,
                                            const AttentionParams& p, int t, float scale_log2) {
  const float scale = scale_log2 * 0.69314718055994531f;  // back to natural units
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int64_t row = row0 + 8 * r;
    const bool stored = row < p.seqlen_q;  // the last tile's rows past the end computed on zero rows of Q
    store_o_row<T, K::kHeadDim, K::kOStoreBytes>(o, r, inv, stored ? out + row * p.o_seq_stride : nullptr, t);
    // One explicit fma: left to the compiler, `max * scale + log(l)` is contracted in one kernel
    // and not in another (it depends on what else uses the product), and the rungs that share
    // this epilogue would disagree in lse's last bit while their o agrees bit for bit.
    if (stored && t == 0) lse[row] = l > 0.f ? __fmaf_rn(row_max[r], scale, logf(l)) : -INFINITY;
  }
}

// FlashAttention 3's intra-warpgroup overlap (the kOverlap schedule), written once for the one-tile
// kernel below and the persistent consumer (flash_fwd_hopper_persistent.cuh), the way the FP8
// forward writes it (flash_fwd_hopper_fp8.cuh; NOTES.md, "The FP8 forward's turn shortened", change
// 2). Step i: tile i's Q K^T, then (O rescaled to tile i - 1's maximum meanwhile) tile i - 1's P V,
// in one turn; the wait for Q K^T alone (groups complete in order); tile i's softmax and P's
// conversion while P V is still on the tensor cores; the wait for that P V at the top of the next
// step, behind its mbarrier waits. Where that wait is written is what makes the overlap work: after
// the softmax, in the same basic block, ptxas hoisted it to the row maximum's first shuffle, ahead
// of every exponential (this configuration's 10-20% loss before); behind the mbarrier waits' retry
// loops, branches ptxas does not move it across, it stays.
// P in two register arrays (tile i packed while P V reads tile i - 1's), the steps two at a time so
// that which array a step fills is a constant of its code (an array indexed at run time would go to
// local memory). Two arrays, not one copied into the other: ptxas treats a wgmma's A registers as
// free once it has issued (fence_operands emits no PTX) and merged such a copy into the registers
// the running P V reads (the FP8 forward's SASS, NOTES.md). Tile i - 2's stage is freed after that
// wait, so the producer needs a third stage to run a tile ahead (the config's static_assert).
// The kernels' pieces, as callables (all inlined: the code is the one each kernel had inline):
//   stage_of(i), parity_of(i): tile i's stage of the K/V ring and the parity its barriers complete
//     with (the one-tile kernel counts from its first tile, the persistent one over its whole walk);
//   wait_k(stage, parity), wait_v(stage, parity): the mbarrier waits for a stage's K and V;
//   release(stage): this warp is done with a stage; take_turn(), pass_turn(last): ping-pong's turns
//     (`last`: the walk's last hand-over, which the one-tile kernel's warpgroup 1 skips);
//   open(issue_qk_at): tile 0's Q K^T and softmax into s and corr where the kernel has not already
//     run them (the one-tile kernel shares that opening with its joint schedule);
//   before_last_pv(): what may go once the last Q K^T has completed (the persistent rung's Q);
//   softmax(mask_tag, i, corr), rescale_o(corr): the kernel's per-tile math on s and o.
// s, o, P's two arrays (pf2) and the corrections (corr) are the caller's registers, by reference.
// The callables go by value. Both kernels' SASS was compared instruction for instruction with the
// schedule written inline (nvcc 13.0), and small differences in how the pieces are handed over
// showed: callables by reference reordered a persistent producer loop's phis (PTX) and three of its
// SASS instructions; its stage_of reading kv_trips by reference put one add more in its SASS. A
// change here wants the same comparison.
// On return every product has completed and every stage of the walk is released.
template <typename T, typename K, typename StageOf, typename ParityOf, typename WaitK, typename WaitV,
          typename Release, typename TakeTurn, typename PassTurn, typename Open, typename BeforeLastPv,
          typename Softmax, typename RescaleO>
__device__ __forceinline__ void overlap_walk(float (&s)[K::kBlockN / 2], float (&o)[K::kHeadDim / 2],
                                             uint32_t (&pf2)[2][K::kBlockN / 16][4], float (&corr)[2],
                                             const unsigned char* q_wg, const unsigned char* k_s,
                                             const unsigned char* v_s, int n_tiles, int n_full, StageOf stage_of,
                                             ParityOf parity_of, WaitK wait_k, WaitV wait_v, Release release,
                                             TakeTurn take_turn, PassTurn pass_turn, Open open,
                                             BeforeLastPv before_last_pv, Softmax softmax, RescaleO rescale_o) {
  using hopper::desc_advance;
  using hopper::fence_operands;
  using hopper::smem_desc_sw128;
  using hopper::wgmma_wait;
  constexpr int kBN = K::kBlockN;
  const std::false_type unmasked;
  const std::true_type masked;
  const std::integral_constant<int, 0> even;
  const std::integral_constant<int, 1> odd;
  const uint64_t desc_q = smem_desc_sw128(q_wg, 16, 1024), desc_k = smem_desc_sw128(k_s, 16, 1024);
  const uint64_t desc_v = smem_desc_sw128(v_s, kBN * 128, 1024);
  auto issue_qk_at = [&](int stage) {
    issue_qk_desc<T, K>(s, desc_q, desc_advance(desc_k, stage * K::kKVBytes));
  };
  auto issue_pv_from = [&](int stage, auto buf) {
    issue_pv_desc<T, K>(o, pf2[buf.value], desc_advance(desc_v, stage * K::kKVBytes));
  };
  auto pack_p_into = [&](auto buf) { pack_p<T, K>(pf2[buf.value], s); };
  open(issue_qk_at);
  pack_p_into(even);
  auto step = [&](auto mask_tag, int i, auto buf, auto first) {
    const int stage = stage_of(i), prev = stage_of(i - 1);
    const std::integral_constant<int, 1 - decltype(buf)::value> other;
    wait_v(prev, parity_of(i - 1));
    wait_k(stage, parity_of(i));
    wgmma_wait<0>();  // tile i - 2's P V, issued by the last step
    fence_operands(o);
    fence_operands(pf2[buf.value]);  // that P V's fragments: written again below
    if constexpr (!decltype(first)::value) release(stage_of(i - 2));
    take_turn();
    issue_qk_at(stage);
    rescale_o(corr);  // tile i - 1's corrections: O holds tiles up to i - 2
    issue_pv_from(prev, other);
    pass_turn(false);
    wgmma_wait<1>();  // Q K^T of tile i; P V of tile i - 1 may still run
    fence_operands(s);
    softmax(mask_tag, i, corr);
    pack_p_into(buf);
  };
  // Step 1 has no stage to free (tile -1); the rest two at a time, even then odd.
  const std::true_type first;
  const std::false_type later;
  if (n_tiles > 1) {
    if (n_full > 1) {
      step(unmasked, 1, odd, first);
    } else {
      step(masked, 1, odd, first);
    }
  }
  auto run = [&](auto mask_tag, int i, int end) {
    if (i < end && (i & 1)) step(mask_tag, i++, odd, later);
    for (; i + 1 < end; i += 2) {
      step(mask_tag, i, even, later);
      step(mask_tag, i + 1, odd, later);
    }
    if (i < end) step(mask_tag, i, even, later);
  };
  run(unmasked, 2, n_full);
  run(masked, n_full > 2 ? n_full : 2, n_tiles);
  // The last Q K^T has completed (the wait above): what waited for it goes before the last P V.
  before_last_pv();
  // The last tile's P V, after the one before it (whose wait frees tile n_tiles - 2's stage).
  wgmma_wait<0>();  // the P V before the last
  fence_operands(o);
  if (n_tiles > 1) release(stage_of(n_tiles - 2));
  const int last = stage_of(n_tiles - 1);
  wait_v(last, parity_of(n_tiles - 1));
  take_turn();
  rescale_o(corr);
  if ((n_tiles - 1) & 1) {
    issue_pv_from(last, odd);
  } else {
    issue_pv_from(last, even);
  }
  pass_turn(true);
  wgmma_wait<0>();
  fence_operands(o);
  fence_operands(pf2[0]);
  fence_operands(pf2[1]);
  release(last);
}

}  // namespace hopper_fwd
#endif

template <typename T, typename K>
__global__ void __launch_bounds__(K::kThreads, 1)
    flash_fwd_hopper_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                            const __grid_constant__ CUtensorMap map_v, const AttentionParams p, unsigned q_tiles,
                            float scale_log2) {
#if COURSE_HOPPER_DEVICE
  using namespace hopper;
  using namespace hopper_fwd;
  constexpr int kD = K::kHeadDim, kBN = K::kBlockN, kBM = K::kBlockM, kStages = K::kStages;
  constexpr int kSRegs = kBN / 2;  // S: one m64 x kBlockN accumulator tile per warpgroup
  constexpr int kORegs = kD / 2;   // O: m64 x d
  constexpr int kPSteps = kBN / 16;  // k16 steps of P V
  extern __shared__ unsigned char smem_raw[];
  // The swizzle pattern repeats every 1024 bytes and the descriptors assume atoms there.
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  unsigned char* q_s = smem;                          // [chunk][kBlockM rows][64]
  unsigned char* k_s = q_s + K::kQBytes;              // [stage][chunk][kBlockN rows][64]
  unsigned char* v_s = k_s + kStages * K::kKVBytes;   // same
  __shared__ uint64_t q_full, k_full[kStages], v_full[kStages], kv_empty[kStages];

  // The block's (batch, head, query tile). Causal blocks with the most keys (the last tiles) are
  // launched first, so the short ones fill the tail of the grid.
  const int64_t tile_index = blockIdx.x % q_tiles;
  const int64_t tile = p.causal ? q_tiles - 1 - tile_index : tile_index;
  const int64_t bh = blockIdx.x / q_tiles;
  const int b = static_cast<int>(bh / p.heads);
  const int h = static_cast<int>(bh % p.heads);
  const int hk = static_cast<int>(h / (p.heads / p.heads_kv));  // GQA
  const int64_t m0 = tile * kBM;
  const int64_t diag = p.seqlen_k - p.seqlen_q;  // key j is visible to row i iff j <= i + diag
  const int64_t last_row = (m0 + kBM < p.seqlen_q ? m0 + kBM : p.seqlen_q) - 1;
  const int n_tiles = static_cast<int>((visible_keys(last_row, p.seqlen_q, p.seqlen_k, p.causal) + kBN - 1) / kBN);

  if (threadIdx.x == 0) {
    prefetch_tensor_map(&map_q);
    prefetch_tensor_map(&map_k);
    prefetch_tensor_map(&map_v);
    mbarrier_init(&q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&k_full[s], 1);   // the producer's arrive, with the tile's bytes
      mbarrier_init(&v_full[s], 1);
      mbarrier_init(&kv_empty[s], 8); // one arrive per consumer warp once it is done with the stage
    }
    fence_barrier_init();
  }
  __syncthreads();  // the barriers are initialised before anyone waits on them

  // The copies. K and V complete on separate barriers, so that S = Q K^T starts before V lands.
  auto load_q = [&] {
    mbarrier_arrive_expect_tx(&q_full, K::kQBytes);
#pragma unroll
    for (int c = 0; c < K::kChunks; ++c) {
      tma_load_4d(q_s + c * kBM * 128, &map_q, &q_full, c * 64, static_cast<int>(m0), h, b);
    }
  };
  auto load_kv = [&](int i) {
    const int stage = i % kStages;
    const int n0 = i * kBN;
    mbarrier_arrive_expect_tx(&k_full[stage], K::kKVBytes);
#pragma unroll
    for (int c = 0; c < K::kChunks; ++c) {
      tma_load_4d(k_s + stage * K::kKVBytes + c * kBN * 128, &map_k, &k_full[stage], c * 64, n0, hk, b);
    }
    mbarrier_arrive_expect_tx(&v_full[stage], K::kKVBytes);
#pragma unroll
    for (int c = 0; c < K::kChunks; ++c) {
      tma_load_4d(v_s + stage * K::kKVBytes + c * kBN * 128, &map_v, &v_full[stage], c * 64, n0, hk, b);
    }
  };

  if constexpr (K::kWarpSpecialized) {
    if (threadIdx.x < K::kProducerThreads) {
      // The producer: one thread issues every copy; the stage of tile i is free once the 8
      // consumer warps have arrived on its empty barrier for tile i - kStages.
      setmaxnreg_dec<K::kProducerRegs>();
      if (threadIdx.x == 0 && n_tiles > 0) {
        load_q();
        for (int i = 0; i < n_tiles; ++i) {
          if (i >= kStages) mbarrier_wait(&kv_empty[i % kStages], ((i / kStages) - 1) & 1);
          load_kv(i);
        }
      }
      return;
    }
    setmaxnreg_inc<K::kConsumerRegs>();
  } else if (threadIdx.x == 0 && n_tiles > 0) {
    load_q();
    for (int i = 0; i < n_tiles && i < kStages; ++i) load_kv(i);
  }

  // ---------------------------------------------------------------- the consumers
  const int ct = threadIdx.x - K::kProducerThreads;
  const int wg = ct / 128;  // consumer warpgroup: rows 64 wg .. 64 wg + 63 of the block's tile
  const int warp = (ct % 128) / 32;
  const int lane = ct % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t row0 = m0 + wg * 64 + warp * 16 + g;  // this lane's rows: row0 and row0 + 8
  const unsigned char* q_wg = q_s + wg * 64 * 128;

  float o[kORegs];
#pragma unroll
  for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
  float s[kSRegs];
  uint32_t pf[kPSteps][4];  // P as wgmma's A fragments, one k16 step of keys each
  float row_max[2] = {-INFINITY, -INFINITY};  // raw scores (not scaled): scale > 0
  float row_sum[2] = {0.f, 0.f};              // this lane's share; the row's four lanes add at the end

  // The per-tile math (hopper_fwd, above) on this warpgroup's registers.
  auto issue_qk = [&](int stage) { hopper_fwd::issue_qk<T, K>(s, q_wg, k_s + stage * K::kKVBytes); };
  auto issue_pv = [&](int stage) { hopper_fwd::issue_pv<T, K>(o, pf, v_s + stage * K::kKVBytes); };
  auto softmax = [&](auto mask_tag, int i, float (&corr)[2]) {
    online_softmax<K>(mask_tag, s, row_max, row_sum, corr, p, row0, diag, i, t, scale_log2);
  };
  auto rescale_o = [&](const float (&corr)[2]) {
#pragma unroll
    for (int j = 0; j < kORegs; ++j) o[j] *= corr[(j >> 1) & 1];
  };
  auto pack_p = [&] { hopper_fwd::pack_p<T, K>(pf, s); };
  // A consumer warp is done with a stage (its products completed): one arrive per warp.
  auto release = [&](int stage) {
    if (lane == 0) mbarrier_arrive(&kv_empty[stage]);
  };

  if (n_tiles > 0) mbarrier_wait(&q_full, 0);
  // Tiles 0 .. n_full - 1 need no mask for any row of the block: every key in them exists and,
  // when causal, is visible to the block's first row (the one that sees the fewest).
  int64_t full_tiles = p.seqlen_k / kBN;
  if (p.causal) full_tiles = min(full_tiles, max(int64_t{0}, m0 + diag + 1) / kBN);
  const int n_full = static_cast<int>(min(full_tiles, static_cast<int64_t>(n_tiles)));
  const std::false_type unmasked;
  const std::true_type masked;

  // Ping-pong: warpgroup wg issues its products after bar.sync on hardware barrier 1 + wg and then
  // lets the other go (bar.arrive on the other's barrier); 256 = its 128 threads syncing plus the
  // other's 128 arriving. Warpgroup 0 goes first (warpgroup 1 arrives once up front) and warpgroup
  // 1 skips its last hand-over, so each barrier sees as many arrivals as syncs. Both warpgroups
  // take the same number of turns: they walk the same key tiles.
  auto take_turn = [&] {
    if constexpr (K::kPingpong) named_barrier_sync(1 + wg, 256);
  };
  auto pass_turn = [&](bool last) {
    if constexpr (K::kPingpong) {
      if (!(last && wg == 1)) named_barrier_arrive(2 - wg, 256);
    }
  };
  if constexpr (K::kPingpong) {
    if (wg == 1 && n_tiles > 0) named_barrier_arrive(1, 256);
  }

  if constexpr (!K::kJoint && !K::kOverlap) {
    // Each tile in order: product, softmax, product.
    auto step = [&](auto mask_tag, int i) {
      const int stage = i % kStages;
      const uint32_t parity = (i / kStages) & 1;
      mbarrier_wait(&k_full[stage], parity);
      issue_qk(stage);
      wgmma_wait<0>();
      fence_operands(s);
      float corr[2];
      softmax(mask_tag, i, corr);
      rescale_o(corr);
      pack_p();
      mbarrier_wait(&v_full[stage], parity);
      issue_pv(stage);
      wgmma_wait<0>();
      fence_operands(o);
      fence_operands(pf);
      if constexpr (K::kWarpSpecialized) {
        release(stage);
      } else {
        // Every warp is past its products on this stage before thread 0 refills it.
        __syncthreads();
        if (threadIdx.x == 0 && i + kStages < n_tiles) load_kv(i + kStages);
      }
    };
    for (int i = 0; i < n_full; ++i) step(unmasked, i);
    for (int i = n_full; i < n_tiles; ++i) step(masked, i);
  } else if (n_tiles > 0) {
    // The two schedules that carry tile i - 1's P V into tile i's turn (kJoint: rung "pingpong";
    // kOverlap: FlashAttention 3's intra-warpgroup overlap, the candidate HopperFwdOverlapTraits).
    // The first tile's Q K^T and softmax open both, the last tile's P V closes both.
    mbarrier_wait(&k_full[0], 0);
    take_turn();
    issue_qk(0);
    pass_turn(false);
    wgmma_wait<0>();
    fence_operands(s);
    float corr[2];
    if (n_full > 0) {
      softmax(unmasked, 0, corr);  // O is still 0: nothing to rescale
    } else {
      softmax(masked, 0, corr);
    }
    if constexpr (!K::kOverlap) {
      pack_p();
      // kJoint: tile i - 1's P V and tile i's Q K^T go to the tensor cores together (one turn when
      // the warpgroups take turns), then one wait, then tile i's softmax with nothing in flight:
      // each warpgroup's tensor-core work is one burst per tile, and the other warpgroup's burst
      // fills the tensor cores while this one runs its exponentials.
      auto step = [&](auto mask_tag, int i) {
        const int stage = i % kStages, prev = (i - 1) % kStages;
        mbarrier_wait(&v_full[prev], ((i - 1) / kStages) & 1);
        mbarrier_wait(&k_full[stage], (i / kStages) & 1);
        take_turn();
        issue_pv(prev);
        issue_qk(stage);
        pass_turn(false);
        wgmma_wait<0>();
        fence_operands(o);
        fence_operands(pf);
        fence_operands(s);
        release(prev);
        softmax(mask_tag, i, corr);
        rescale_o(corr);
        pack_p();
      };
      for (int i = 1; i < n_full; ++i) step(unmasked, i);
      for (int i = n_full > 1 ? n_full : 1; i < n_tiles; ++i) step(masked, i);
      const int last = (n_tiles - 1) % kStages;
      mbarrier_wait(&v_full[last], ((n_tiles - 1) / kStages) & 1);
      take_turn();
      issue_pv(last);
      pass_turn(true);
      wgmma_wait<0>();
      fence_operands(o);
      fence_operands(pf);
      release(last);
    } else {
      // kOverlap, FlashAttention 3's intra-warpgroup overlap (the candidate HopperFwdOverlapTraits):
      // hopper_fwd::overlap_walk (above) says why each piece is where it is. Tile 0's Q K^T and
      // softmax are the opening above, so the walk's own opening is empty here.
      // A tile's stage; i >= 0 here, and the unsigned remainder needs no sign fix-up (in the FP8
      // forward the signed one made ptxas branch around the release).
      auto stage_of = [](int i) { return static_cast<int>(static_cast<unsigned>(i) % kStages); };
      auto parity_of = [](int i) { return (i / kStages) & 1; };
      auto wait_k = [&](int stage, uint32_t parity) { mbarrier_wait(&k_full[stage], parity); };
      auto wait_v = [&](int stage, uint32_t parity) { mbarrier_wait(&v_full[stage], parity); };
      uint32_t pf2[2][kPSteps][4];
      hopper_fwd::overlap_walk<T, K>(s, o, pf2, corr, q_wg, k_s, v_s, n_tiles, n_full, stage_of, parity_of, wait_k,
                                     wait_v, release, take_turn, pass_turn, [](auto&&) {}, [] {}, softmax,
                                     rescale_o);
    }
  }

  T* out = static_cast<T*>(p.o) + static_cast<int64_t>(b) * p.o_batch_stride + static_cast<int64_t>(h) * p.o_head_stride;
  store_o_lse<T, K>(o, row_sum, row_max, out, static_cast<float*>(p.lse) + bh * p.seqlen_q, row0, p, t, scale_log2);
#endif  // COURSE_HOPPER_DEVICE: other targets compile an empty kernel the glue never launches
}

// A 4-D tensor map over a (batch, heads, seqlen, head_dim) view with element strides, boxes of 64
// columns by `rows` rows of one head. A dim of size 1 is never stepped, so its stride (which a view
// may leave at any value) is replaced by a valid one; a dim of size 0 (no keys) becomes 1 and is
// never read.
inline cudaError_t make_bhsd_map(CUtensorMap* map, const void* base, int64_t batch, int64_t heads, int64_t seqlen,
                                 int64_t head_dim, int64_t batch_stride, int64_t head_stride, int64_t seq_stride,
                                 int rows) {
  const uint64_t dims[4] = {static_cast<uint64_t>(head_dim), static_cast<uint64_t>(seqlen > 0 ? seqlen : 1),
                            static_cast<uint64_t>(heads), static_cast<uint64_t>(batch)};
  uint64_t strides[3];
  const int64_t elem_strides[3] = {seq_stride, head_stride, batch_stride};
  uint64_t inner = static_cast<uint64_t>(head_dim) * 2;
  for (int i = 0; i < 3; ++i) {
    strides[i] = dims[i + 1] == 1 ? inner : static_cast<uint64_t>(elem_strides[i]) * 2;
    inner = strides[i];
  }
  const uint32_t box[4] = {64, static_cast<uint32_t>(rows), 1, 1};
  return hopper::make_tensor_map_16bit(map, base, 4, dims, strides, box);
}

// A paged KV cache (num_blocks, block_size, heads_kv, head_dim), contiguous (serving.h), as TMA's
// (head_dim, heads_kv, block_size, num_blocks), innermost first, boxes of 64 columns by `rows` rows
// of one head in one block: the persistent rung's paged producer (flash_fwd_hopper_persistent.cuh)
// copies one page's rows of a key tile per box, coordinates (column, kv head, row in the page, block).
inline cudaError_t make_paged_map(CUtensorMap* map, const void* base, int64_t num_blocks, int64_t block_size,
                                  int64_t heads_kv, int64_t head_dim, int rows) {
  const uint64_t dims[4] = {static_cast<uint64_t>(head_dim), static_cast<uint64_t>(heads_kv),
                            static_cast<uint64_t>(block_size), static_cast<uint64_t>(num_blocks > 0 ? num_blocks : 1)};
  const uint64_t row_bytes = static_cast<uint64_t>(head_dim) * 2;
  const uint64_t strides[3] = {row_bytes, row_bytes * dims[1], row_bytes * dims[1] * dims[2]};
  const uint32_t box[4] = {64, 1, static_cast<uint32_t>(rows), 1};
  return hopper::make_tensor_map_16bit(map, base, 4, dims, strides, box);
}

// Launches one configuration (the rungs' instantiation files and the experiments call this).
template <typename T, typename K>
cudaError_t run_flash_fwd_hopper_config(const AttentionParams& p, cudaStream_t stream) {
  const int64_t q_tiles = course::ceil_div(p.seqlen_q, static_cast<int64_t>(K::kBlockM));
  const int64_t blocks = q_tiles * p.batch * p.heads;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX || p.seqlen_q > INT_MAX || p.seqlen_k > INT_MAX) return cudaErrorInvalidConfiguration;
  if (!hopper_o_store_aligned<K>(p)) return cudaErrorInvalidValue;  // a wider store of O than O's rows allow
  CUtensorMap map_q, map_k, map_v;
  COURSE_CUDA_TRY(make_bhsd_map(&map_q, p.q, p.batch, p.heads, p.seqlen_q, K::kHeadDim, p.q_batch_stride,
                                p.q_head_stride, p.q_seq_stride, K::kBlockM));
  COURSE_CUDA_TRY(make_bhsd_map(&map_k, p.k, p.batch, p.heads_kv, p.seqlen_k, K::kHeadDim, p.k_batch_stride,
                                p.k_head_stride, p.k_seq_stride, K::kBlockN));
  COURSE_CUDA_TRY(make_bhsd_map(&map_v, p.v, p.batch, p.heads_kv, p.seqlen_k, K::kHeadDim, p.v_batch_stride,
                                p.v_head_stride, p.v_seq_stride, K::kBlockN));
  auto kernel = flash_fwd_hopper_kernel<T, K>;
  COURSE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::kSmemBytes));
  const float scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  kernel<<<static_cast<unsigned>(blocks), K::kThreads, K::kSmemBytes, stream>>>(map_q, map_k, map_v, p,
                                                                                static_cast<unsigned>(q_tiles),
                                                                                scale_log2);
  return cudaGetLastError();
}

}  // namespace flash_attention
