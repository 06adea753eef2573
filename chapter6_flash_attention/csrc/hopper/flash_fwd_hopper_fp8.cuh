// Chapter 6, part 3: the FP8 forward (op attention_fp8). Rung "pingpong" (flash_fwd_hopper_kernel.cuh)
// on e4m3 inputs: a producer warpgroup brings Q, K and V^T tiles by TMA, two consumer warpgroups take
// turns sending tile n's Q K^T and tile n - 1's P V to the tensor cores, each running its softmax
// while the other's products run, and (unlike pingpong) while its own P V still runs: at e4m3's rate
// the products no longer cover a softmax, so a warpgroup waits for its Q K^T only (the step's
// comment). Why pingpong and not the persistent rung: the persistent loop changes who decides the
// tile, not what a tile computes, and everything FP8 changes is inside a tile (the products, P's
// conversion, the epilogue); pingpong's one-tile kernel is the smaller thing to extend, and the
// persistent schedule could take these consumers as it takes pingpong's.
//
// What FP8 changes, each where it happens:
//   - the products are wgmma m64nNk32 e4m3 x e4m3 -> float32 (hopper::WgmmaFp8): twice the 16-bit
//     rate, half the bytes per tile. A row of Q or K is head_dim bytes: one 128-byte swizzle row at
//     d = 128 (one TMA box per tile, no 64-column chunks), one 64-byte swizzle row at d = 64.
//   - 8-bit wgmma reads both operands K-major (no transpose), so O = P V wants V^T in shared
//     memory, head_dim rows of keys. The op takes V already transposed, (batch, heads_kv,
//     head_dim, seqlen_k): quantize_fp8(v, transpose=True) writes it so in the same pass that reads
//     v and writes its bytes, for free, as FlashAttention 3's FP8 path takes "V colmajor". The other
//     way, a transpose inside the kernel (shared memory to registers and back, in the producer
//     warpgroup), costs every call shared-memory traffic and a synchronisation per tile for what
//     one pass at quantization does once per tensor.
//   - the scores: S = Q8 K8^T is exact products summed in float32; the true scores are
//     scale * descale_q * descale_k * S, so the two descales fold into scale_log2 once per block
//     (the kernel reads them from the device: the host never sees their values), and descale_v
//     multiplies O at the end, with 1 / l.
//   - P to e4m3 for P V: e4m3 keeps 3 mantissa bits down to 2^-6 (subnormals to 2^-9, then 0). P
//     itself lies in [0, 1]: every weight below 2^-10 would round to 0. The softmax computes
//     256 P instead (exp2 with 8 added to the exponent: online_softmax's kExpBias), in [0, 256],
//     under e4m3's largest 448 so nothing saturates, and normal down to P = 2^-14: 2^8 is the
//     largest power of two under 448 (a power of two, so the scaling itself rounds nothing).
//     The row sums carry the same 256, so O / l cancels it; lse takes off 8 ln 2.
//   - P's registers: the accumulator layout of S is not the A-operand layout of an 8-bit k32 step;
//     pack_p_fp8 (below) moves the bytes with four shuffles per step inside each quad of lanes.
//   - O goes out in bfloat16, 16 bytes a store (store_o_lse_fp8, through the 16-bit forward's store_o_row).
// No torch headers: this file builds with a bare nvcc for sm_90a (and to empty kernels for any
// other target, which the glue never launches).
#pragma once

#include "hopper/flash_fwd_hopper_kernel.cuh"

#include <cuda_fp8.h>

namespace flash_attention {

// The FP8 kernel's shapes. 128 query rows (two consumer warpgroups), kBlockN keys a tile (128, or
// 192: the launcher's candidates, below): a thread holds kBlockN / 2 floats of S, head_dim / 2 of O
// and P as kBlockN / 32 k32 steps x 4 registers (half of what 16-bit P takes), twice (the step's
// comment). Shared memory: Q (128 x d bytes) and kStages stages of K (kBlockN x d) and V^T (d x
// kBlockN): 4 stages of 128 keys are 144 KiB at d = 128, 72 KiB at 64 (of 192 keys: 208 and 104);
// the products run twice as fast as bfloat16's while a tile's bytes halve, so the ring is one stage
// deeper than pingpong's, for the producer to stay ahead.
// V^T's tile is kBlockN / kVtKeys TMA boxes of head_dim rows by kVtKeys keys, each row one swizzle
// row: 128 keys with the 128-byte swizzle where the tile is a multiple of 128 keys, else 64 with the
// 64-byte one (192 keys: three boxes). A k32 step of P V reads 32 keys of one box.
template <int kHeadDim_, int kBlockN_ = 128>
struct HopperFp8Traits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kHopperBlockM;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = 4;
  static constexpr int kSwizzle = kHeadDim;       // bytes of a Q or K row: its swizzle width (64 or 128)
  static constexpr int kAtomBytes = 8 * kSwizzle;  // 8 rows to a swizzle atom: the K-major descriptor's sbo
  static constexpr int kVtKeys = kBlockN % 128 == 0 ? 128 : 64;  // keys (bytes) of a V^T box's row
  static constexpr int kVtBoxBytes = kHeadDim * kVtKeys;
  static constexpr int kConsumerThreads = 256, kProducerThreads = 128;
  static constexpr int kThreads = kConsumerThreads + kProducerThreads;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;  // pingpong's split of the register file
  static constexpr int kQBytes = kBlockM * kHeadDim;
  static constexpr int kKBytes = kBlockN * kHeadDim;   // one stage of K
  static constexpr int kVBytes = kHeadDim * kBlockN;   // one stage of V^T: head_dim rows of kBlockN keys
  static constexpr int kSmemBytes = kQBytes + kStages * (kKBytes + kVBytes) + 1024;  // + 1024-byte alignment
  static constexpr int kExpBias = 8;  // P is computed as 2^8 P (above)
  static constexpr int kOStoreBytes = 16;  // O (bfloat16) stored as the 16-bit forward's: store_o_row
  static_assert(kHeadDim == 64 || kHeadDim == 128, "a Q or K row must be one 64- or 128-byte swizzle row");
  static_assert(kBlockN == 128 || kBlockN == 192, "the e4m3 wgmma widths hopper::WgmmaFp8 has (and below)");
  static_assert(kBlockN % kVtKeys == 0 && kVtKeys % 32 == 0, "V^T's boxes tile the key tile, k32 steps each box");
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm_90 block may take");
};

// The launcher's candidates (a bench-only knob: the environment variable FLASH_ATTENTION_FP8_FORWARD,
// read at each call, so one process can time them side by side; unset is the default):
//   (unset)        the default: n192_full at head dim 128, longest_first at 64 (below);
//   longest_first  128-key tiles, the grid in hopper_fp8_tile_schedule's order
//                  (tile_schedule.h): L2 sections of heads, causal query tiles longest first;
//   head_order     128-key tiles, the grid head by head (block i: query tile i % q_tiles of head
//                  i / q_tiles, causal ones from the last), the order before the schedule;
//   n192           192-key tiles (FlashAttention 3's FP8 tile at d = 128 with V given transposed), the
//                  longest_first order: a step's fixed work (its barriers, waits, the row maximum's
//                  shuffles and corrections, the turn) spread over 1.5 times the keys;
//   n192_full      n192 without a causal mask, longest_first with one: at 192 keys the masked steps
//                  spill (up to ~40 local loads and stores a step, where the unmasked ones have 1-3),
//                  and a causal block of 128 rows crosses the diagonal in one or two of them.
// Any other value fails the call (cudaErrorInvalidValue) rather than time something else; so do
// n192 and n192_full at head dim 64, refused by name in the glue (attention_fp8_candidate_refusal),
// where the 192-key tile is not built (below).
// The default is n192_full only at d = 128, where it was measured (the chapter's NOTES.md: full,
// 1.38-1.42x pingpong where the 128-key tile gave 1.33-1.35x; causal, the 128-key tile). At d = 64 a key's share of the step's fixed work is
// larger but its unmasked 192-key loop saves less (SASS, sm_90a, per warp: 657 instructions a 192-key
// step against 469 a 128-key one, 3.4 against 3.7 a key, where d = 128 has 3.6 against 4.0) and
// still reloads 2 spilled registers a step; and the one d = 64 shape timed (causal, s = 2048, where
// n192_full runs longest_first) took 15% longer at n192, against 7% at d = 128. Never the default
// and never ahead, the d = 64 192-key instantiation was then taken out (one kernel less to compile).
enum class Fp8Forward { kDefault, kLongestFirst, kHeadOrder, kBlockN192, kBlockN192Full, kUnknown };

#if COURSE_HOPPER_DEVICE
}  // namespace flash_attention
namespace hopper {
// m64n192k32 e4m3, for the 192-key tile (hopper.cuh has the widths the 16-bit rungs and the 128-key
// tile use; this one only the FP8 forward takes): 96 accumulators, operands as hopper.cuh's WgmmaFp8.
#define COURSE_WGMMA_FP8_D96                                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "  \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, " \
  "%65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, " \
  "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
template <>
struct WgmmaFp8<192> {
  __device__ static __forceinline__ void ss(float (&d)[96], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 " COURSE_WGMMA_FP8_D96 ", %96, %97, p, 1, 1;\n}\n"
                 : COURSE_F64, COURSE_F32(64)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
};
#undef COURSE_WGMMA_FP8_D96
}  // namespace hopper
namespace flash_attention {
namespace hopper_fp8 {

using hopper::desc_advance;  // one 32-bit add moves a descriptor (hopper.cuh)

template <typename K>
__device__ __forceinline__ uint64_t kmajor_desc(const unsigned char* start) {
  if constexpr (K::kSwizzle == 128) {
    return hopper::smem_desc_sw128(start, 16, K::kAtomBytes);
  } else {
    return hopper::smem_desc_sw64(start, 16, K::kAtomBytes);
  }
}

// S = Q K^T for this warpgroup's 64 rows and the stage's 128 keys: d / 32 instructions, each reading
// a k32 slice (32 bytes further along the rows) of Q and of K. `dq`, `dk`: the descriptors of the
// warpgroup's Q rows and of the stage's K tile.
template <typename K>
__device__ __forceinline__ void issue_qk(float (&s)[K::kBlockN / 2], uint64_t dq, uint64_t dk) {
  hopper::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < K::kHeadDim / 32; ++kk) {
    hopper::WgmmaFp8<K::kBlockN>::ss(s, desc_advance(dq, kk * 32), desc_advance(dk, kk * 32), kk > 0);
  }
  hopper::wgmma_commit();
}

// O += P V: kBlockN / 32 instructions, P's k32 fragment from registers, V^T's (head_dim rows x
// kBlockN keys in boxes of kVtKeys; `dv` the descriptor of the stage's first box) next 32 keys 32
// bytes further along a box's rows, or the next box.
template <typename K>
__device__ __forceinline__ void issue_pv(float (&o)[K::kHeadDim / 2], const uint32_t (&pf)[K::kBlockN / 32][4],
                                         uint64_t dv) {
  hopper::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < K::kBlockN / 32; ++kk) {
    const int key = kk * 32;
    hopper::WgmmaFp8<K::kHeadDim>::rs(o, pf[kk],
                                      desc_advance(dv, (key / K::kVtKeys) * K::kVtBoxBytes + key % K::kVtKeys), 1);
  }
  hopper::wgmma_commit();
}

// Four floats to four e4m3 in one register, the first in the lowest byte (round to nearest even,
// saturating: 256 P never exceeds 448, so nothing saturates here). __nv_cvt_float2_to_fp8x2 puts
// .x in the low byte: one cvt.rn.satfinite.e4m3x2.f32 per pair on sm_90.
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// P from S's accumulators to the A fragments of the k32 steps of P V.
//
// Where the values are. Lane (g, t) = (lane / 4, lane % 4) holds, of each n8 tile j of S (keys
// 8j..8j+7), the four registers s[4j..4j+3] = row g keys 8j+2t, 8j+2t+1, then row g+8 the same
// two keys (hopper.cuh's accumulator layout). Step kk of P V covers keys 32kk..32kk+31: tiles
// j = 4kk..4kk+3. Converted, tile j of the step is one register T_j (e4m3x4 of s[4j..4j+3]):
//   T_j = [row g: 8j'+2t, 8j'+2t+1 | row g+8: 8j'+2t, 8j'+2t+1]   (j' = j - 4kk, bytes low to high)
// Where they must go. The 8-bit A fragment (hopper.cuh, WgmmaFp8) wants in lane t
//   a0 = row g keys 4t..4t+3, a1 = row g+8 keys 4t..4t+3, a2, a3 = the same 16 keys further.
// Keys 4t..4t+3 (< 16) lie in tile h = t >> 1 (keys 8h..8h+7), pairs 2t - 4h and 2t - 4h + 1 of it:
// the pairs lanes b = 2t & 3 and b + 1 of the quad hold, each in its T_h. So lane t needs T_h from
// lanes b and b + 1 (and T_{2+h} from the same two lanes for a2, a3), and of each only the bytes it
// holds: 2 of row g, 2 of row g+8. A shuffle moves one register from one lane, so:
//   shuffle A: lane t reads lane b + h, shuffle B: lane b + 1 - h (the two lanes, in an order
//   chosen so that every lane read in A is read by lanes of one h only: b + h has the parity of h);
//   a lane of parity q sends T_q in A and T_{1-q} in B, which is T_h for whoever reads it.
//   The pair with the lower keys (from lane b) is A's word when h = 0 and B's when h = 1. With
//   first / second the lower / higher pair's word: a0 = [first.b0, first.b1, second.b0,
//   second.b1] (row g), a1 = [first.b2, first.b3, second.b2, second.b3] (row g+8): __byte_perm
//   of (first, second) with 0x5410 and 0x7632, which is __byte_perm of (A, B) with those for h = 0
//   and with 0x1054 and 0x3276 (the same bytes, the two words' roles swapped) for h = 1: one
//   selector per lane, chosen once, and no select of first and second per step. The same two
//   shuffles again with T_2, T_3 give a2, a3.
// Four shuffles per step, 16 per 128-key tile, every byte moved used. (The other way is to permute
// the keys of V^T in memory to match the accumulator order, which needs no shuffle but makes the
// layout of v a contract of this kernel; FlashAttention 3 shuffles as here for V given transposed.)
template <typename K>
__device__ __forceinline__ void pack_p_fp8(uint32_t (&pf)[K::kBlockN / 32][4], const float (&s)[K::kBlockN / 2],
                                           int lane) {
  const int t = lane & 3, h = t >> 1, q = lane & 1;
  const int b = (lane & ~3) | ((2 * t) & 3);
  const int src_a = b + h, src_b = b + 1 - h;
  const uint32_t sel_lo = h ? 0x1054u : 0x5410u, sel_hi = h ? 0x3276u : 0x7632u;
#pragma unroll
  for (int kk = 0; kk < K::kBlockN / 32; ++kk) {
    uint32_t tile[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = 16 * kk + 4 * j;
      tile[j] = e4m3x4(s[r], s[r + 1], s[r + 2], s[r + 3]);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // keys 0..15 of the step (a0, a1), then 16..31 (a2, a3)
      const uint32_t even = tile[2 * half], odd = tile[2 * half + 1];
      const uint32_t wa = __shfl_sync(0xffffffffu, q ? odd : even, src_a);
      const uint32_t wb = __shfl_sync(0xffffffffu, q ? even : odd, src_b);
      pf[kk][2 * half] = __byte_perm(wa, wb, sel_lo);
      pf[kk][2 * half + 1] = __byte_perm(wa, wb, sel_hi);
    }
  }
}

// o = descale_v * acc / l in bfloat16 and lse = max * scale + log(l) - 8 ln 2 (l carries P's 2^8)
// for this lane's two rows; a row with no visible key gets o = 0 and lse = -inf. `scale_log2`
// includes the two descales. Shuffles before any branch on the row: all 32 lanes take part.
template <typename K>
__device__ __forceinline__ void store_o_lse_fp8(const float (&o)[K::kHeadDim / 2], const float (&row_sum)[2],
                                                const float (&row_max)[2], __nv_bfloat16* out, float* lse,
                                                int64_t row0, const AttentionParams& p, int t, float scale_log2,
                                                float descale_v) {
  const float scale = scale_log2 * 0.69314718055994531f;  // back to natural units
  const float bias = static_cast<float>(K::kExpBias) * 0.69314718055994531f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.f ? descale_v / l : 0.f;
    const int64_t row = row0 + 8 * r;
    const bool stored = row < p.seqlen_q;  // the last tile's rows past the end computed on zero rows of Q
    hopper_fwd::store_o_row<__nv_bfloat16, K::kHeadDim, K::kOStoreBytes>(
        o, r, inv, stored ? out + row * p.o_seq_stride : nullptr, t);
    if (stored && t == 0) lse[row] = l > 0.f ? __fmaf_rn(row_max[r], scale, logf(l)) - bias : -INFINITY;
  }
}

}  // namespace hopper_fp8
#endif

template <typename K>
__global__ void __launch_bounds__(K::kThreads, 1)
    flash_fwd_hopper_fp8_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                                const __grid_constant__ CUtensorMap map_vt, const AttentionParams p,
                                const float* descale_q, const float* descale_k, const float* descale_v,
                                unsigned q_tiles, float scale_log2_raw, const HopperTileSchedule order,
                                bool head_order) {
#if COURSE_HOPPER_DEVICE
  using namespace hopper;
  using namespace hopper_fp8;
  constexpr int kD = K::kHeadDim, kBN = K::kBlockN, kBM = K::kBlockM, kStages = K::kStages;
  constexpr int kSRegs = kBN / 2;
  constexpr int kORegs = kD / 2;
  extern __shared__ unsigned char smem_raw[];
  // The swizzle pattern repeats every 1024 bytes (512 for the 64-byte one) and the descriptors
  // assume atoms there; every buffer below is a multiple of 1024 bytes.
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  unsigned char* q_s = smem;                          // [kBlockM rows][d bytes]
  unsigned char* k_s = q_s + K::kQBytes;              // [stage][kBlockN rows][d bytes]
  unsigned char* v_s = k_s + kStages * K::kKBytes;    // [stage][box][d rows][kVtKeys bytes]: V^T
  __shared__ uint64_t q_full, k_full[kStages], v_full[kStages], kv_empty[kStages];

  // The block's (batch, head, query tile): the tile at index blockIdx.x of the schedule's order (the
  // launcher's comment), or head by head with each head's causal tiles from the longest (pingpong's).
  int64_t tile, bh;
  if (head_order) {
    const int64_t tile_index = blockIdx.x % q_tiles;
    tile = p.causal ? q_tiles - 1 - tile_index : tile_index;
    bh = blockIdx.x / q_tiles;
  } else {
    int pair = 0, q_tile = 0;
    hopper_tile_at(order, static_cast<int>(blockIdx.x), &pair, &q_tile);
    tile = q_tile;
    bh = pair;
  }
  const int b = static_cast<int>(bh / p.heads);
  const int h = static_cast<int>(bh % p.heads);
  const int hk = static_cast<int>(h / (p.heads / p.heads_kv));  // GQA
  const int64_t m0 = tile * kBM;
  const int64_t diag = p.seqlen_k - p.seqlen_q;
  const int64_t last_row = (m0 + kBM < p.seqlen_q ? m0 + kBM : p.seqlen_q) - 1;
  const int n_tiles = static_cast<int>((visible_keys(last_row, p.seqlen_q, p.seqlen_k, p.causal) + kBN - 1) / kBN);

  if (threadIdx.x == 0) {
    prefetch_tensor_map(&map_q);
    prefetch_tensor_map(&map_k);
    prefetch_tensor_map(&map_vt);
    mbarrier_init(&q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&k_full[s], 1);   // the producer's arrive, with the tile's bytes
      mbarrier_init(&v_full[s], 1);
      mbarrier_init(&kv_empty[s], 8); // one arrive per consumer warp once it is done with the stage
    }
    fence_barrier_init();
  }
  __syncthreads();  // the barriers are initialised before anyone waits on them

  if (threadIdx.x < K::kProducerThreads) {
    // The producer: one thread issues every copy (Q once, then K and V^T per key tile, each on its
    // own barrier so that Q K^T starts before V^T lands); the stage of tile i is free once the 8
    // consumer warps have arrived on its empty barrier for tile i - kStages.
    setmaxnreg_dec<K::kProducerRegs>();
    if (threadIdx.x == 0 && n_tiles > 0) {
      mbarrier_arrive_expect_tx(&q_full, K::kQBytes);
      tma_load_4d(q_s, &map_q, &q_full, 0, static_cast<int>(m0), h, b);
      for (int i = 0; i < n_tiles; ++i) {
        const int stage = i % kStages;
        if (i >= kStages) mbarrier_wait(&kv_empty[stage], ((i / kStages) - 1) & 1);
        mbarrier_arrive_expect_tx(&k_full[stage], K::kKBytes);
        tma_load_4d(k_s + stage * K::kKBytes, &map_k, &k_full[stage], 0, i * kBN, hk, b);
        mbarrier_arrive_expect_tx(&v_full[stage], K::kVBytes);  // boxes past seqlen_k arrive as zeros, counted
#pragma unroll
        for (int c = 0; c < kBN / K::kVtKeys; ++c) {
          tma_load_4d(v_s + stage * K::kVBytes + c * K::kVtBoxBytes, &map_vt, &v_full[stage], i * kBN + c * K::kVtKeys,
                      0, hk, b);
        }
      }
    }
    return;
  }
  setmaxnreg_inc<K::kConsumerRegs>();

  // ---------------------------------------------------------------- the consumers
  const int ct = threadIdx.x - K::kProducerThreads;
  const int wg = ct / 128;
  const int warp = (ct % 128) / 32;
  const int lane = ct % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t row0 = m0 + wg * 64 + warp * 16 + g;
  const unsigned char* q_wg = q_s + wg * 64 * kD;
  // The true scores are scale * descale_q * descale_k * (Q8 K8^T): one factor, read once.
  const float scale_log2 = scale_log2_raw * __ldg(descale_q) * __ldg(descale_k);

  float o[kORegs];
#pragma unroll
  for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
  float s[kSRegs];
  // P's A fragments twice: tile i's are written while tile i - 1's P V still reads the others (the
  // schedule below); which buffer a step fills, i & 1, is a constant of its code (the steps run two
  // at a time), since a register array indexed at run time would go to local memory. Two named
  // buffers and not one buffer copied into the other at each step: ptxas treats a wgmma's A
  // registers as free once it has issued (fence_operands emits no PTX), and it merged such a copy
  // into the very registers the running P V reads. With two buffers nothing is written to the
  // running P V's registers before its wait (checked in the SASS: NOTES.md).
  uint32_t pf[2][kBN / 32][4];
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};

  const uint64_t desc_q = kmajor_desc<K>(q_wg), desc_k = kmajor_desc<K>(k_s);
  uint64_t desc_vt;
  if constexpr (K::kVtKeys == 128) {
    desc_vt = smem_desc_sw128(v_s, 16, 1024);
  } else {
    desc_vt = smem_desc_sw64(v_s, 16, 512);
  }
  auto issue_qk = [&](int stage) {
    hopper_fp8::issue_qk<K>(s, desc_q, desc_advance(desc_k, stage * K::kKBytes));
  };
  auto issue_pv = [&](int stage, auto buf) {
    hopper_fp8::issue_pv<K>(o, pf[buf.value], desc_advance(desc_vt, stage * K::kVBytes));
  };
  auto softmax = [&](auto mask_tag, int i, float (&corr)[2]) {
    hopper_fwd::online_softmax<K, K::kExpBias>(mask_tag, s, row_max, row_sum, corr, p, row0, diag, i, t, scale_log2);
  };
  // O's rescale, always (a warp-uniform skip when no row has a new maximum, a vote and a branch,
  // saved the 64 multiplies on most tiles, but a branch ends the block ptxas schedules, and the
  // step's instructions after it could no longer fill the idle issue cycles of the exponentials).
  // It runs in the turn, while this warpgroup's Q K^T is on the tensor cores, before the P V that
  // adds to O; a corr of exactly 1 changes no bit of O.
  auto rescale_o = [&](const float (&corr)[2]) {
#pragma unroll
    for (int j = 0; j < kORegs; ++j) o[j] *= corr[(j >> 1) & 1];
  };
  auto pack_p = [&](auto buf) { pack_p_fp8<K>(pf[buf.value], s, lane); };
  auto release = [&](int stage) {
    if (lane == 0) mbarrier_arrive(&kv_empty[stage]);
  };

  if (n_tiles > 0) mbarrier_wait(&q_full, 0);
  int64_t full_tiles = p.seqlen_k / kBN;
  if (p.causal) full_tiles = min(full_tiles, max(int64_t{0}, m0 + diag + 1) / kBN);
  const int n_full = static_cast<int>(min(full_tiles, static_cast<int64_t>(n_tiles)));
  const std::false_type unmasked;
  const std::true_type masked;

  // The ping-pong turns, as in flash_fwd_hopper_kernel.cuh: warpgroup wg syncs on hardware barrier
  // 1 + wg before issuing, then arrives on the other's; warpgroup 1 gives the first turn and skips
  // its last hand-over, so each barrier sees as many arrivals as syncs.
  auto take_turn = [&] { named_barrier_sync(1 + wg, 256); };
  auto pass_turn = [&](bool last) {
    if (!(last && wg == 1)) named_barrier_arrive(2 - wg, 256);
  };
  if (wg == 1 && n_tiles > 0) named_barrier_arrive(1, 256);

  if (n_tiles > 0) {
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
    const std::integral_constant<int, 0> even;
    const std::integral_constant<int, 1> odd;
    pack_p(even);
    // Step i: tile i's Q K^T, then (O rescaled to tile i - 1's maximum meanwhile) tile i - 1's P V,
    // in one turn; the wait for Q K^T alone (groups complete in order); tile i's softmax and P's
    // conversion while P V is still on the tensor cores; the wait for P V at the top of the next
    // step, behind its mbarrier waits. This is FlashAttention 3's intra-warpgroup overlap, and where
    // the wait sits is what makes it work: written after the softmax, in the same basic block
    // (flash_fwd_hopper_kernel.cuh's kOverlap), ptxas hoists it into the first stall it finds, the
    // row maximum's shuffle, ahead of every exponential. At the top of the next step, behind the
    // branches of the mbarrier waits, it stays there (SASS: one WARPGROUP.DEPBAR.LE gsb0, 0x1
    // before the maximum, the 0x0 after the next step's SYNCS loops; NOTES.md). P goes to the
    // buffer P V is not reading; tile i - 2's stage is free once its P V is waited for.
    // A tile's stage; i >= 0 here, and the unsigned remainder is a mask where the signed one costs
    // a sign fix-up (and, before the release below, made ptxas branch around it).
    auto stage_of = [](int i) { return static_cast<int>(static_cast<unsigned>(i) % kStages); };
    auto step = [&](auto mask_tag, int i, auto buf, auto first) {
      const int stage = stage_of(i), prev = stage_of(i - 1);
      const std::integral_constant<int, 1 - decltype(buf)::value> other;
      mbarrier_wait(&v_full[prev], ((i - 1) / kStages) & 1);
      mbarrier_wait(&k_full[stage], (i / kStages) & 1);
      wgmma_wait<0>();  // tile i - 2's P V, issued by the last step
      fence_operands(o);
      fence_operands(pf[buf.value]);  // that P V's fragments: written again below
      if constexpr (!decltype(first)::value) release(stage_of(i - 2));
      take_turn();
      issue_qk(stage);
      rescale_o(corr);  // tile i - 1's corrections: O holds tiles up to i - 2
      issue_pv(prev, other);
      pass_turn(false);
      wgmma_wait<1>();  // Q K^T of tile i; P V of tile i - 1 may still run
      fence_operands(s);
      softmax(mask_tag, i, corr);
      pack_p(buf);
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
    // The last tile's P V, after the one before it.
    wgmma_wait<0>();
    fence_operands(o);
    if (n_tiles > 1) release((n_tiles - 2) % kStages);
    const int last = (n_tiles - 1) % kStages;
    mbarrier_wait(&v_full[last], ((n_tiles - 1) / kStages) & 1);
    take_turn();
    rescale_o(corr);
    if ((n_tiles - 1) & 1) {
      issue_pv(last, odd);
    } else {
      issue_pv(last, even);
    }
    pass_turn(true);
    wgmma_wait<0>();
    fence_operands(o);
    fence_operands(pf[0]);
    fence_operands(pf[1]);
    release(last);
  }

  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.o) + static_cast<int64_t>(b) * p.o_batch_stride +
                       static_cast<int64_t>(h) * p.o_head_stride;
  store_o_lse_fp8<K>(o, row_sum, row_max, out, static_cast<float*>(p.lse) + bh * p.seqlen_q, row0, p, t, scale_log2,
                     __ldg(descale_v));
#endif  // COURSE_HOPPER_DEVICE: other targets compile an empty kernel the glue never launches
}

// A 4-D tensor map over one-byte elements: dims innermost first, byte strides of the outer three
// (a dim of size 1 is never stepped, so a view's arbitrary stride there is replaced by a valid one;
// a dim of size 0 becomes 1 and is never read), boxes of `inner` x `rows` of one (head, batch).
inline cudaError_t make_fp8_map(CUtensorMap* map, const void* base, const int64_t (&sizes)[4],
                                const int64_t (&elem_strides)[3], uint32_t inner, uint32_t rows, int swizzle) {
  uint64_t dims[4];
  for (int i = 0; i < 4; ++i) dims[i] = static_cast<uint64_t>(sizes[i] > 0 ? sizes[i] : 1);
  uint64_t strides[3];
  uint64_t prev = dims[0];
  for (int i = 0; i < 3; ++i) {
    strides[i] = dims[i + 1] == 1 ? ((prev + 15) / 16) * 16 : static_cast<uint64_t>(elem_strides[i]);
    prev = strides[i] * dims[i + 1];
  }
  const uint32_t box[4] = {inner, rows, 1, 1};
  return hopper::make_tensor_map_8bit(map, base, 4, dims, strides, box, swizzle);
}

// One candidate (Fp8Forward, above) of head dim D and key tile kBlockN: the instantiation files
// compile each pair the dispatch (flash_fwd_hopper_fp8_dispatch.cu) may pick.
template <int D, int kBlockN>
cudaError_t run_flash_fwd_hopper_fp8(const AttentionFp8Params& f, Fp8Forward candidate, cudaStream_t stream) {
  using K = HopperFp8Traits<D, kBlockN>;
  const AttentionParams& p = f.attn;
  const int64_t q_tiles = course::ceil_div(p.seqlen_q, static_cast<int64_t>(K::kBlockM));
  const int64_t blocks = q_tiles * p.batch * p.heads;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX || p.seqlen_q > INT_MAX || p.seqlen_k > INT_MAX) return cudaErrorInvalidConfiguration;
  if (!hopper_o_store_aligned<K>(p)) return cudaErrorInvalidValue;  // the op's own O always is (fp8_ops.cpp)
  CUtensorMap map_q, map_k, map_vt;
  COURSE_CUDA_TRY(make_fp8_map(&map_q, p.q, {D, p.seqlen_q, p.heads, p.batch},
                               {p.q_seq_stride, p.q_head_stride, p.q_batch_stride}, D, K::kBlockM, K::kSwizzle));
  COURSE_CUDA_TRY(make_fp8_map(&map_k, p.k, {D, p.seqlen_k, p.heads_kv, p.batch},
                               {p.k_seq_stride, p.k_head_stride, p.k_batch_stride}, D, K::kBlockN, K::kSwizzle));
  // V^T: rows of keys (past seqlen_k they arrive as zeros: the masked keys' P is 0, and 0 x 0 adds
  // nothing, where whatever lay in memory there could be a NaN), boxes of kVtKeys keys by head_dim rows.
  COURSE_CUDA_TRY(make_fp8_map(&map_vt, p.v, {p.seqlen_k, D, p.heads_kv, p.batch},
                               {p.v_seq_stride, p.v_head_stride, p.v_batch_stride}, K::kVtKeys, D, K::kVtKeys));
  // The grid's order: the schedule of this GPU's L2 (one attribute query, which the runtime answers
  // from its cache), unless the candidate asks for the order head by head.
  int device = 0, l2_bytes = 0;
  COURSE_CUDA_TRY(cudaGetDevice(&device));
  COURSE_CUDA_TRY(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  const HopperTileSchedule order = hopper_fp8_tile_schedule(p, l2_bytes);
  auto kernel = flash_fwd_hopper_fp8_kernel<K>;
  COURSE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::kSmemBytes));
  const float scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  kernel<<<static_cast<unsigned>(blocks), K::kThreads, K::kSmemBytes, stream>>>(
      map_q, map_k, map_vt, p, f.descale_q, f.descale_k, f.descale_v, static_cast<unsigned>(q_tiles), scale_log2,
      order, candidate == Fp8Forward::kHeadOrder);
  return cudaGetLastError();
}

}  // namespace flash_attention
