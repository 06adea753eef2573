// Chapter 6, backward rung 2: "mma", FlashAttention 2's backward on tensor cores. Included only by
// the instantiation files instantiations/flash_bwd_<dtype>_hdim<d>.cu.
//
// The derivation (attention.h): with P = exp(S - lse) recomputed from the forward's lse and
// D = rowsum(dO * O) (flash_bwd_dispatch.cu's preprocess kernel),
//   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = scale dS K,   dK = scale dS^T Q.
// A block holds K and V of its kBlockN keys (flash_bwd.h: the work split) and, per query tile,
// Q, dO, lse and D. Each warp computes, for its 16 keys and the tile's 64 rows, with keys as
// the mma's m:
//   S^T  = K_w Q^T          A: K rows (ldmatrix)            B: Q rows (ldmatrix, n-major)
//   P^T  = exp2(S^T scale log2(e) - lse log2(e)), 0 where the key is not visible
//   dV_w += P^T dO          A: P^T from the S^T registers   B: dO (ldmatrix.trans, k-major)
//   dP^T = V_w dO^T         A: V rows (ldmatrix)            B: dO rows (ldmatrix)
//   dS^T = P^T * (dP^T - D)
//   dK_w += dS^T Q          A: dS^T from registers          B: Q (ldmatrix.trans)
// and stores dS^T (16-bit) to shared memory. After a barrier, warp w takes rows 16w..16w+15 of
// the tile for dQ += dS K: A is dS, read from the dS^T tile with ldmatrix.trans (a transposed
// store read transposed is the A layout), B is K (ldmatrix.trans); the products go to the
// float32 dQ with atomicAdd. The C-to-A register identity of the forward (mma.cuh) serves twice
// here: P^T and dS^T are A operands straight from the accumulators.
//
// The loads are cp.async copies, double-buffered (flash_bwd.h), and only the (query tile, key
// tile) pairs a mask can bite are masked: the forward's rung 4, applied here. dQ's atomics make
// the float32 sums' order, and so dQ's last bits, vary from run to run.
//
// Local attention and softcapping (attention.h), as in the forward's rungs 5 and 6: each kernel walks
// only the tiles its rows or keys see through the window (the loop bounds), masks those a window's
// edge crosses, and with a softcap recomputes c = softcap * tanh(s scale / softcap) in place of the
// scaled score, P = exp2(c log2(e) - lse log2(e)), and multiplies dS by the cap's derivative,
//   dS = P * (dP - D) * (1 - tanh^2(s scale / softcap)),
// so that dQ = scale dS K and dK = scale dS^T Q stay as they are. As in the forward, that code is
// compiled in only where it is used: both kernels take kWindowSoftcap (FlashAttention 2's Is_local
// and Is_softcap in one flag), and a call with neither runs the instantiation without it, whose
// code is the kernels' as it was before they existed.
//
// The packed (varlen) layout (attention.h's cu_seqlens), as in the forward's rung 5: kVarlen, a
// template parameter of both kernels (varlen.cuh). The grids are the padded ones over max_seqlen_k
// (key tiles) and max_seqlen_q (dQ's query tiles); a block reads its sequence's start and lengths,
// returns at once if its tile lies past that sequence's end, and otherwise runs on the sequence as
// a batch of one. lse, D and the atomic rung's dQ sums are indexed (head, packed row).
//
// No torch headers: this file builds with a bare `nvcc -c`.
#pragma once

#include "attention/attention.h"
#include "attention/flash_bwd.h"
#include "attention/flash_tiles.cuh"
#include "attention/mma.cuh"
#include "attention/softcap.cuh"
#include "attention/varlen.cuh"

#include <course/cuda_utils.h>

#include <climits>
#include <cstdint>

namespace flash_attention {

// Which scores of a (query tile, key tile) pair are visible, in tile coordinates (row rc, key kc):
// worked out once per pair in 64 bits, then one or two 32-bit compares per score. Only the pairs a
// mask can bite are masked (the forward's rung 4): a key tile running past seqlen_k and, causal, a
// pair crossing the diagonal. Rows past seqlen_q need no mask: their lse is +inf (load_row_stats),
// so their P is 0 whatever the score.
struct TileMask {
  bool active;    // false: every score of the pair is visible
  bool causal;
  int key_limit;  // keys kc >= key_limit are past seqlen_k
  int diag;       // causal: key kc is visible to row rc iff kc <= rc + diag
  __device__ __forceinline__ bool visible(int rc, int kc) const {
    return !active || (kc < key_limit && (!causal || kc <= rc + diag));
  }
};

// The same with a window (kWindowSoftcap): three compares per score, and a pair is masked where
// the diagonal (causal) or either edge of the window crosses it.
struct WindowTileMask {
  bool active;    // false: every score of the pair is visible
  int key_limit;  // keys kc >= key_limit are past seqlen_k
  int lo, hi;     // key kc is visible to row rc iff lo <= kc - rc <= hi (the window; causal: hi = diag)
  // Bitwise, not short-circuit: && and || here became branches around each score's exponential
  // in the Hopper backward (BSSY / BRA per score), whose convergence points held registers that
  // its softcap loop then spilled (nvcc 13.0, sm_90a).
  __device__ __forceinline__ bool visible(int rc, int kc) const {
    return !active | ((kc < key_limit) & (kc - rc <= hi) & (kc - rc >= lo));
  }
};

template <typename K, bool kWindowSoftcap>
__device__ __forceinline__ auto tile_mask(const AttentionParams& p, int64_t m0, int64_t n0) {
  const int64_t diag = m0 + p.seqlen_k - p.seqlen_q - n0;
  if constexpr (kWindowSoftcap) {
    // kc - rc lies in [-(kBlockM - 1), kBlockN - 1]: bounds beyond that decide nothing more, so
    // they are clamped into int there. No bound on a side: one past the range.
    const int64_t lo = p.window_left < 0 ? -K::kBlockM : diag - p.window_left;
    const int64_t hi = p.window_right < 0 ? K::kBlockN : diag + p.window_right;
    WindowTileMask m;
    m.active = n0 + K::kBlockN > p.seqlen_k || K::kBlockN - 1 > hi || lo > -(K::kBlockM - 1);
    m.key_limit = static_cast<int>(min(p.seqlen_k - n0, int64_t{K::kBlockN}));
    m.lo = static_cast<int>(max(min(lo, int64_t{K::kBlockN}), int64_t{-K::kBlockM}));
    m.hi = static_cast<int>(max(min(hi, int64_t{K::kBlockN}), int64_t{-K::kBlockM - 1}));
    return m;
  } else {
    TileMask m;
    m.causal = p.causal;
    m.active = n0 + K::kBlockN > p.seqlen_k || (p.causal && K::kBlockN - 1 > diag);
    // Clamped into int: a limit beyond the tile's edges decides nothing more.
    m.key_limit = static_cast<int>(min(p.seqlen_k - n0, int64_t{K::kBlockN}));
    m.diag = static_cast<int>(max(min(diag, int64_t{K::kBlockN}), int64_t{-K::kBlockM - 1}));
    return m;
  }
}

// The kWindowSoftcap instantiations' P (and the cap's derivative, 1 - tanh^2, in `dcap`; 1 without a
// softcap, M = kNone) of unscaled score s in a row whose lse is lse2 (log2 units). `visible` false:
// P = 0. M is the call's softcap mode, a compile-time constant from with_softcap_tanh around the
// loop (softcap.cuh says why). The plain instantiations compute P inline, as they did before the
// softcap existed (through this helper with dcap = 1 they would compile to other instructions).
template <SoftcapTanh M>
__device__ __forceinline__ float recompute_p(float s, float lse2, bool visible, float scale_log2, const Softcap& cap,
                                             float* dcap) {
  float c = s * scale_log2;
  *dcap = 1.f;
  if constexpr (M != SoftcapTanh::kNone) {
    const CappedScore capped = capped_score<M>(s, cap);  // c as the forward computed it, bit for bit
    c = capped.c;
    *dcap = 1.f - capped.tanh * capped.tanh;
  }
  // ex2.approx.ftz: exp2f's rescaling for results below 2^-126 is three more instructions a score,
  // for a P that adds nothing to a float32 sum of terms near 1 (the plain instantiations' exp2f
  // keeps it).
  return visible ? softcap_ex2(c - lse2) : 0.f;
}

// Query row `row` of head bh's lse and D, as the P and dS formulas use them: lse in log2 units,
// and +inf for rows past the end and rows without a visible key (lse -inf), so that their
// exp2(s - lse) is 0 whatever the mask says. kVarlen: the row's statistics are packed_row0 + row
// (varlen.cuh's packed_stat_row of the row's sequence and head), bh unused.
struct RowStats {
  float lse2, d;
};
template <bool kVarlen>
__device__ __forceinline__ RowStats row_stats(const AttentionParams& p, const float* d_rows, int64_t bh,
                                              int64_t row, int64_t packed_row0) {
  constexpr float kLog2e = 1.4426950408889634f;
  if (row >= p.seqlen_q) return {INFINITY, 0.f};
  const int64_t r = kVarlen ? packed_row0 + row : bh * p.seqlen_q + row;
  const float lse = static_cast<const float*>(p.lse)[r];
  return {lse == -INFINITY ? INFINITY : lse * kLog2e, d_rows[r]};
}

// kDqAtomic: this kernel also adds each key tile's dQ into the float32 sums (rung "mma");
// without it, it computes dK and dV only and flash_bwd_dq_kernel below makes dQ (rung
// "mma_dqpass"). kWindowSoftcap: a window and a softcap (`cap`) are computed (above). kVarlen: the
// packed layout (above).
template <typename T, typename K, bool kDqAtomic, bool kWindowSoftcap, bool kVarlen>
__global__ void __launch_bounds__(K::kThreads)
    flash_bwd_kernel(const AttentionBackwardParams params, float* __restrict__ dq_accum,
                     const float* __restrict__ d_rows, unsigned k_tiles, float scale_log2, const Softcap cap) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kD = K::kHeadDim;
  constexpr int kMTiles = K::kBlockM / 8;  // n8 tiles of S^T (query rows as n)
  constexpr int kDTiles = kD / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);  // two stages
  T* do_s = q_s + K::kStages * K::kTileElems;  // two stages
  T* k_s = do_s + K::kStages * K::kTileElems;
  T* v_s = k_s + K::kTileElems;
  T* ds_s = v_s + K::kTileElems;
  float* lse_s = reinterpret_cast<float*>(ds_s + K::kBlockN * K::kDsStride);  // two stages
  float* dr_s = lse_s + K::kStages * K::kBlockM;                             // two stages

  // Flattened grid, key tiles fastest: (key tile, batch, kv head).
  const int64_t tile = blockIdx.x % k_tiles;
  const int64_t bhk = blockIdx.x / k_tiles;
  const int64_t b = bhk / params.fwd.heads_kv;
  const int64_t hk = bhk % params.fwd.heads_kv;
  const int64_t n0 = tile * K::kBlockN;
  // Packed: sequence b as a batch of one (varlen.cuh). k_tiles covers the longest sequence's keys,
  // so a shorter one's last tiles hold none of its keys: no dK or dV row to write, and the whole
  // block leaves together, before any copy or barrier. (Keys no row sees stay: they get zeros.)
  AttentionBackwardParams sequence;
  if constexpr (kVarlen) {
    sequence = sequence_params<T>(params, b);
    if (n0 >= sequence.fwd.seqlen_k) return;
  }
  const AttentionBackwardParams& g = kVarlen ? sequence : params;
  const AttentionParams& p = g.fwd;
  const int64_t group = p.heads / p.heads_kv;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int gr = lane / 4;  // mma.cuh's g
  const int t = lane % 4;

  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;

  float dk[kDTiles][4];
  float dv[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.f;
  }

  // The steps: every query tile that sees a key of this tile, from the tile of the first row that
  // sees its first key (causal rows above it, or a window's right edge, see none of them) to the tile
  // of the last row that sees its last key (a window's left edge: rows below see none), of every
  // query head that reads this kv head; step i is head hk * group + i / tiles_per_head, tile
  // i % tiles_per_head.
  int64_t m_begin, tiles_per_head;
  if constexpr (kWindowSoftcap) {
    const int64_t rows_end = row_end(min(n0 + K::kBlockN, p.seqlen_k) - 1, p);
    m_begin = min(row_begin(n0, p), rows_end) / K::kBlockM * K::kBlockM;
    tiles_per_head = course::ceil_div(rows_end - m_begin, static_cast<int64_t>(K::kBlockM));
  } else {
    m_begin = first_visible_row(n0, p.seqlen_q, p.seqlen_k, p.causal) / K::kBlockM * K::kBlockM;
    tiles_per_head = course::ceil_div(p.seqlen_q - m_begin, static_cast<int64_t>(K::kBlockM));
  }
  const int64_t steps = group * tiles_per_head;
  // Step i's Q and dO copied into stage `stage`, and the row statistics thread x < kBlockM keeps
  // for row x of the step's tile (plain loads into registers, stored to the stage's shared memory
  // one trip later, by which time they have long arrived: a store right after the load would
  // wait out the global memory's latency).
  static_assert(K::kThreads >= K::kBlockM, "one row's statistics per thread");
  auto load_step = [&](int64_t i, int stage) {
    const int64_t h = hk * group + i / tiles_per_head;
    const int64_t m0 = m_begin + i % tiles_per_head * K::kBlockM;
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
    const T* dout = static_cast<const T*>(g.dout) + b * g.do_batch_stride + h * g.do_head_stride;
    load_tile<K, K::kBlockM>(q_s + stage * K::kTileElems, q, p.q_seq_stride, m0, p.seqlen_q);
    load_tile<K, K::kBlockM>(do_s + stage * K::kTileElems, dout, g.do_seq_stride, m0, p.seqlen_q);
    return threadIdx.x < K::kBlockM ? row_stats<kVarlen>(p, d_rows, b * p.heads + h, m0 + threadIdx.x,
                                                         kVarlen ? packed_stat_row(params.fwd, b, h) : 0)
                                    : RowStats{};
  };
  auto stash_stats = [&](const RowStats& r, int stage) {
    if (threadIdx.x < K::kBlockM) {
      lse_s[stage * K::kBlockM + threadIdx.x] = r.lse2;
      dr_s[stage * K::kBlockM + threadIdx.x] = r.d;
    }
  };

  // K, V and the first step's tiles in one batch of copies.
  load_tile<K, K::kBlockN>(k_s, k, p.k_seq_stride, n0, p.seqlen_k);
  load_tile<K, K::kBlockN>(v_s, v, p.v_seq_stride, n0, p.seqlen_k);
  if (steps > 0) stash_stats(load_step(0, 0), 0);
  mma::cp_async_commit();

  for (int64_t i = 0; i < steps; ++i) {
    const int stage = static_cast<int>(i % 2);
    const int64_t h = hk * group + i / tiles_per_head;
    const int64_t m0 = m_begin + i % tiles_per_head * K::kBlockM;
    const int64_t bh = b * p.heads + h;
    // Step i + 1 into the other stage, whose last readers (step i - 1) passed the barrier at the
    // end of the previous trip; then wait for step i's copies only (one batch may stay in flight).
    RowStats next{};
    if (i + 1 < steps) {
      next = load_step(i + 1, 1 - stage);
      mma::cp_async_commit();
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    // Each thread waited for its own copies only: the barrier makes every thread's part of this
    // step's tiles and row statistics (and K and V, on the first trip) visible to all the warps.
    __syncthreads();
    const T* qt = q_s + stage * K::kTileElems;
    const T* dot = do_s + stage * K::kTileElems;
    const float* lse_t = lse_s + stage * K::kBlockM;
    const float* dr_t = dr_s + stage * K::kBlockM;

    // S^T = K_w Q^T: the warp's 16 keys x the tile's 64 rows.
    float st[kMTiles][4];
    float dpt[kMTiles][4];
#pragma unroll
    for (int j = 0; j < kMTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.f;
    }
    mma::gemm_nt<T, K, kD, K::kBlockM>(st, k_s, warp * 16, qt, 0, lane);
    mma::gemm_nt<T, K, kD, K::kBlockM>(dpt, v_s, warp * 16, dot, 0, lane);

    // P^T and dS^T in place: element st[j][e] is key 16w + gr + 8(e / 2) of the tile, query row
    // 8j + 2t + e % 2.
    const auto mask = tile_mask<K, kWindowSoftcap>(p, m0, n0);
    // One loop per softcap mode (with_softcap_tanh; the plain instantiation has the one loop).
    auto p_and_ds = [&](auto mode) {
#pragma unroll
      for (int j = 0; j < kMTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int rc = 8 * j + 2 * t + e % 2;
          const bool visible = mask.visible(rc, 16 * warp + gr + 8 * (e / 2));
          if constexpr (kWindowSoftcap) {
            float dcap;
            const float pt =
                recompute_p<decltype(mode)::value>(st[j][e], lse_t[rc], visible, scale_log2, cap, &dcap);
            st[j][e] = pt;
            dpt[j][e] = pt * (dpt[j][e] - dr_t[rc]) * dcap;  // dS^T
          } else {
            const float pt = visible ? exp2f(st[j][e] * scale_log2 - lse_t[rc]) : 0.f;
            st[j][e] = pt;
            dpt[j][e] = pt * (dpt[j][e] - dr_t[rc]);  // dS^T
          }
        }
      }
    };
    if constexpr (kWindowSoftcap) {
      with_softcap_tanh<true>(cap, p_and_ds);
    } else {
      p_and_ds(SoftcapMode<SoftcapTanh::kNone>{});
    }

    // dV_w += P^T dO and dK_w += dS^T Q, the k dimension being the tile's query rows.
    mma::gemm_rs<T, K, K::kBlockM, kD>(dv, st, dot, 0, lane);
    mma::gemm_rs<T, K, K::kBlockM, kD>(dk, dpt, qt, 0, lane);

    if constexpr (kDqAtomic) {
      float* dq = dq_accum + (kVarlen ? packed_stat_row(params.fwd, b, h) : bh * p.seqlen_q) * kD;
      // dS^T to shared memory, rounded to T as the mma will read it: row 16w + gr (+8) of the
      // tile's keys, columns 8j + 2t and + 1 (one 4-byte store).
#pragma unroll
      for (int j = 0; j < kMTiles; ++j) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          *reinterpret_cast<uint32_t*>(ds_s + (16 * warp + gr + 8 * r) * K::kDsStride + 8 * j + 2 * t) =
              mma::pack2<T>(dpt[j][2 * r], dpt[j][2 * r + 1]);
        }
      }
      // Every warp's dS^T rows are in shared memory before any warp reads a column of them.
      __syncthreads();

      // dQ rows 16w..16w+15 of the tile += dS K over the block's 64 keys, d in n8 tiles.
      float acc[kDTiles][4];
#pragma unroll
      for (int d = 0; d < kDTiles; ++d) acc[d][0] = acc[d][1] = acc[d][2] = acc[d][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < K::kBlockN / 16; ++kk) {
        // A = dS (rows x keys) from the dS^T tile (keys x rows), read transposed: matrices
        // (keys 0-7, rows 0-7), (keys 0-7, rows 8-15), (keys 8-15, rows 0-7), (keys 8-15, rows 8-15).
        uint32_t a[4];
        mma::ldmatrix_x4_trans(a, mma::smem_address(ds_s + (kk * 16 + lane % 8 + (lane / 16) * 8) * K::kDsStride +
                                                    warp * 16 + ((lane / 8) % 2) * 8));
#pragma unroll
        for (int dp = 0; dp < kD / 16; ++dp) {
          uint32_t bk[4];
          mma::ldmatrix_x4_trans(bk, mma::smem_address(k_s + K::offset(kk * 16 + lane % 8 + ((lane / 8) % 2) * 8,
                                                                       dp * 16 + (lane / 16) * 8)));
          mma::mma_16816<T>(acc[2 * dp], a, bk[0], bk[1]);
          mma::mma_16816<T>(acc[2 * dp + 1], a, bk[2], bk[3]);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t row = m0 + 16 * warp + gr + 8 * r;
        if (row < p.seqlen_q) {  // the tile's rows past the end were zeros: nothing to add
#pragma unroll
          for (int d = 0; d < kDTiles; ++d) {
            atomicAdd(dq + row * kD + 8 * d + 2 * t, acc[d][2 * r]);
            atomicAdd(dq + row * kD + 8 * d + 2 * t + 1, acc[d][2 * r + 1]);
          }
        }
      }
    }
    // Step i + 1's row statistics into the other stage (read by no one since step i - 1).
    if (i + 1 < steps) stash_stats(next, 1 - stage);
    // Every warp is done with this stage's Q, dO and row statistics (and dS^T) before the copies
    // of step i + 2, issued at the top of the next trip, overwrite them; and the statistics just
    // stashed are visible to every warp at the top of the next trip.
    __syncthreads();
  }
  // No step (no row sees these keys): K and V's copies may still be in flight; they must land
  // before the block's shared memory is handed to another block.
  mma::cp_async_wait<0>();

  // dK = scale dS^T Q and dV, summed over the group's query heads, once per key.
  const float scale = static_cast<float>(p.scale);
  T* dkp = static_cast<T*>(g.dk) + b * g.dk_batch_stride + hk * g.dk_head_stride;
  T* dvp = static_cast<T*>(g.dv) + b * g.dv_batch_stride + hk * g.dv_head_stride;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = n0 + 16 * warp + gr + 8 * r;
    if (key < p.seqlen_k) {  // the last tile's keys past the end were zeros
#pragma unroll
      for (int d = 0; d < kDTiles; ++d) {
        *reinterpret_cast<uint32_t*>(dkp + key * g.dk_seq_stride + 8 * d + 2 * t) =
            mma::pack2<T>(dk[d][2 * r] * scale, dk[d][2 * r + 1] * scale);
        *reinterpret_cast<uint32_t*>(dvp + key * g.dv_seq_stride + 8 * d + 2 * t) =
            mma::pack2<T>(dv[d][2 * r], dv[d][2 * r + 1]);
      }
    }
  }
#endif  // __CUDA_ARCH__ >= 800: older GPUs never launch it (the glue checks the capability)
}

// The deterministic dQ (rung "mma_dqpass"): FlashAttention 2's other option. A block owns 64
// query rows of one head, each warp 16 of them, and walks the key tiles as the forward does
// (K and V double-buffered through cp.async, as in the forward's rung 4), recomputing S and P,
// and dP = dO V^T, then dQ_w += dS K in registers: one writer per dQ element, so no atomics and
// the same bits on every run, for a second pass over K and V.
//   S   = Q_w K^T    A: Q rows (ldmatrix)     B: K rows (ldmatrix, n-major)
//   dP  = dO_w V^T   A: dO rows (ldmatrix)    B: V rows (ldmatrix, n-major)
//   dS  = P * (dP - D),   P = exp2(S scale log2(e) - lse log2(e)), 0 where not visible
//   dQ += dS K       A: dS from the registers B: K (ldmatrix.trans, k-major)
template <typename T, typename K, bool kWindowSoftcap, bool kVarlen>
__global__ void __launch_bounds__(K::kThreads)
    flash_bwd_dq_kernel(const AttentionBackwardParams params, const float* __restrict__ d_rows, unsigned q_tiles,
                        float scale_log2, const Softcap cap) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kD = K::kHeadDim;
  constexpr int kNTiles = K::kBlockN / 8;
  constexpr int kDTiles = kD / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);
  T* do_s = q_s + K::kTileElems;
  T* k_s = do_s + K::kTileElems;                 // two stages
  T* v_s = k_s + K::kStages * K::kTileElems;    // two stages

  const int64_t tile = blockIdx.x % q_tiles;
  const int64_t bh = blockIdx.x / q_tiles;
  const int64_t b = bh / params.fwd.heads;
  const int64_t h = bh % params.fwd.heads;
  const int64_t m0 = tile * K::kBlockM;
  // Packed: as in the forward, a tile past its sequence's end has no row of dQ to write.
  AttentionBackwardParams sequence;
  if constexpr (kVarlen) {
    sequence = sequence_params<T>(params, b);
    if (m0 >= sequence.fwd.seqlen_q) return;
  }
  const AttentionBackwardParams& g = kVarlen ? sequence : params;
  const AttentionParams& p = g.fwd;
  const int64_t hk = h / (p.heads / p.heads_kv);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int gr = lane / 4;
  const int t = lane % 4;
  const int64_t row0 = m0 + warp * 16 + gr;

  // The key tiles any row of the tile sees (the forward's loop bounds): [n_first, n_end).
  const int64_t last_row = (m0 + K::kBlockM < p.seqlen_q ? m0 + K::kBlockM : p.seqlen_q) - 1;
  const int64_t keys_end =
      kWindowSoftcap ? key_end(last_row, p) : visible_keys(last_row, p.seqlen_q, p.seqlen_k, p.causal);
  const int n_first = kWindowSoftcap ? static_cast<int>(min(key_begin(m0, p), keys_end) / K::kBlockN) : 0;
  const int n_end = static_cast<int>((keys_end + K::kBlockN - 1) / K::kBlockN);

  // This lane's two rows' lse (log2 units) and D.
  const int64_t packed_row0 = kVarlen ? packed_stat_row(params.fwd, b, h) : 0;
  const RowStats stats[2] = {row_stats<kVarlen>(p, d_rows, bh, row0, packed_row0),
                             row_stats<kVarlen>(p, d_rows, bh, row0 + 8, packed_row0)};
  float acc[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) acc[d][0] = acc[d][1] = acc[d][2] = acc[d][3] = 0.f;

  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
  // Q, dO and the first K and V tiles in one batch of copies.
  if (n_first < n_end) {
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
    const T* dout = static_cast<const T*>(g.dout) + b * g.do_batch_stride + h * g.do_head_stride;
    load_tile<K, K::kBlockM>(q_s, q, p.q_seq_stride, m0, p.seqlen_q);
    load_tile<K, K::kBlockM>(do_s, dout, g.do_seq_stride, m0, p.seqlen_q);
    const int64_t first = static_cast<int64_t>(n_first) * K::kBlockN;
    load_tile<K, K::kBlockN>(k_s, k, p.k_seq_stride, first, p.seqlen_k);
    load_tile<K, K::kBlockN>(v_s, v, p.v_seq_stride, first, p.seqlen_k);
    mma::cp_async_commit();
  }
  for (int n = n_first; n < n_end; ++n) {
    const int stage = (n - n_first) % 2;
    const int64_t n0 = static_cast<int64_t>(n) * K::kBlockN;
    // Tile n + 1 into the other stage (its last readers, tile n - 1, passed the barrier at the end
    // of the previous trip); then wait for tile n only.
    if (n + 1 < n_end) {
      load_tile<K, K::kBlockN>(k_s + (1 - stage) * K::kTileElems, k, p.k_seq_stride, n0 + K::kBlockN, p.seqlen_k);
      load_tile<K, K::kBlockN>(v_s + (1 - stage) * K::kTileElems, v, p.v_seq_stride, n0 + K::kBlockN, p.seqlen_k);
      mma::cp_async_commit();
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    // Every thread's copies of tile n (and of Q and dO, on the first trip) visible to every warp.
    __syncthreads();
    const T* kt = k_s + stage * K::kTileElems;
    const T* vt = v_s + stage * K::kTileElems;

    float s[kNTiles][4];
    float dp[kNTiles][4];
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
    }
    mma::gemm_nt<T, K, kD, K::kBlockN>(s, q_s, warp * 16, kt, 0, lane);
    mma::gemm_nt<T, K, kD, K::kBlockN>(dp, do_s, warp * 16, vt, 0, lane);
    // dS in place of dP: element [j][e] is row 16w + gr + 8(e / 2) of the tile, key 8j + 2t + e % 2.
    const auto mask = tile_mask<K, kWindowSoftcap>(p, m0, n0);
    // One loop per softcap mode, as in the dK/dV kernel.
    auto ds = [&](auto mode) {
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool visible = mask.visible(16 * warp + gr + 8 * (e / 2), 8 * j + 2 * t + e % 2);
          if constexpr (kWindowSoftcap) {
            float dcap;
            const float pr =
                recompute_p<decltype(mode)::value>(s[j][e], stats[e / 2].lse2, visible, scale_log2, cap, &dcap);
            dp[j][e] = pr * (dp[j][e] - stats[e / 2].d) * dcap;
          } else {
            const float pr = visible ? exp2f(s[j][e] * scale_log2 - stats[e / 2].lse2) : 0.f;
            dp[j][e] = pr * (dp[j][e] - stats[e / 2].d);
          }
        }
      }
    };
    if constexpr (kWindowSoftcap) {
      with_softcap_tanh<true>(cap, ds);
    } else {
      ds(SoftcapMode<SoftcapTanh::kNone>{});
    }
    mma::gemm_rs<T, K, K::kBlockN, kD>(acc, dp, kt, 0, lane);
    // Every warp is done with this stage's K and V before the copies of tile n + 2, issued at the
    // top of the next trip, overwrite them.
    __syncthreads();
  }

  const float scale = static_cast<float>(p.scale);
  T* dqp = static_cast<T*>(g.dq) + b * g.dq_batch_stride + h * g.dq_head_stride;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row0 + 8 * r;
    if (row < p.seqlen_q) {
#pragma unroll
      for (int d = 0; d < kDTiles; ++d) {
        *reinterpret_cast<uint32_t*>(dqp + row * g.dq_seq_stride + 8 * d + 2 * t) =
            mma::pack2<T>(acc[d][2 * r] * scale, acc[d][2 * r + 1] * scale);
      }
    }
  }
#endif  // __CUDA_ARCH__ >= 800
}

template <typename T, typename K, bool kWindowSoftcap, bool kVarlen>
cudaError_t launch_flash_bwd(const AttentionBackwardParams& g, float* dq_accum, const float* d_rows,
                             cudaStream_t stream) {
  const AttentionParams& p = g.fwd;
  const float scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  const Softcap cap =
      kWindowSoftcap ? make_softcap(p.scale, p.softcap, p.dtype == DType::kBFloat16, /*log2_units=*/true) : Softcap{};
  const int64_t k_tiles = course::ceil_div(p.seqlen_k, static_cast<int64_t>(K::kBlockN));
  const int64_t blocks = k_tiles * p.batch * p.heads_kv;
  const int64_t q_tiles = course::ceil_div(p.seqlen_q, static_cast<int64_t>(K::kBlockM));
  const int64_t dq_blocks = q_tiles * p.batch * p.heads;
  if (blocks > INT_MAX || dq_blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  if (blocks > 0) {
    // The dQ sums (dq_accum non-null: rung "mma") or not (rung "mma_dqpass").
    auto kernel = dq_accum != nullptr ? flash_bwd_kernel<T, K, true, kWindowSoftcap, kVarlen>
                                      : flash_bwd_kernel<T, K, false, kWindowSoftcap, kVarlen>;
    COURSE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::kSmemBytes));
    kernel<<<static_cast<unsigned>(blocks), K::kThreads, K::kSmemBytes, stream>>>(
        g, dq_accum, d_rows, static_cast<unsigned>(k_tiles), scale_log2, cap);
    COURSE_CUDA_TRY(cudaGetLastError());
  }
  if (dq_accum == nullptr && dq_blocks > 0) {
    auto kernel = flash_bwd_dq_kernel<T, K, kWindowSoftcap, kVarlen>;
    COURSE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::kSmemBytes));
    kernel<<<static_cast<unsigned>(dq_blocks), K::kThreads, K::kSmemBytes, stream>>>(
        g, d_rows, static_cast<unsigned>(q_tiles), scale_log2, cap);
    COURSE_CUDA_TRY(cudaGetLastError());
  }
  return cudaSuccess;
}

// The one place a call picks its instantiation, as in the forward: with a window or a softcap, the
// kWindowSoftcap kernels; without, the plain ones; packed (cu_seqlens_q set), their kVarlen twins.
template <typename T, int D>
cudaError_t run_flash_bwd(const AttentionBackwardParams& g, float* dq_accum, const float* d_rows,
                          cudaStream_t stream) {
  using K = BwdTraits<D>;
  const bool featured = uses_window_or_softcap(g.fwd);
  if (g.fwd.cu_seqlens_q != nullptr) {
    return featured ? launch_flash_bwd<T, K, true, true>(g, dq_accum, d_rows, stream)
                    : launch_flash_bwd<T, K, false, true>(g, dq_accum, d_rows, stream);
  }
  return featured ? launch_flash_bwd<T, K, true, false>(g, dq_accum, d_rows, stream)
                  : launch_flash_bwd<T, K, false, false>(g, dq_accum, d_rows, stream);
}

}  // namespace flash_attention
