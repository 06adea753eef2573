// Chapter 6, forward rungs 3 to 6: FlashAttention 2 on tensor cores (mma.sync m16n8k16,
// bfloat16 or float16 in, float32 accumulate). Included only by the instantiation files
// instantiations/flash_fwd_<dtype>_hdim<d>.cu, one per dtype and head dim, so that the build
// compiles them in parallel and a change of one head dim's tiles rebuilds one file.
//
// What changes from rung 2 ("tiled", attention_tiled_kernels.cu):
//   - the FlashAttention 2 work split: a block owns kBlockM query rows, and each of its warps
//     owns 16 of them outright. A warp computes its rows' scores S = Q K^T for a tile of kBlockN
//     keys with mma.sync into registers, and its rows' statistics need only the four lanes that
//     share a row (two shuffles); warps never exchange scores, so there is no P tile in shared
//     memory and no barrier between the softmax and P V;
//   - S becomes P in registers (mma.cuh: the C layout of two n8 tiles is the A layout of one
//     k16 tile), so P V reads only V from shared memory;
//   - Q, K and V stay 16-bit in shared memory (rung 2 converted them to float32): half the bytes
//     per tile, and ldmatrix loads them straight into mma's operand layout.
//
// Rung 3, "mma" (kPipelined = false): the loads are synchronous (16-byte loads into registers,
// then stores to shared memory, then a barrier), each row is padded by 16 bytes so that the 8
// rows one ldmatrix reads start in 8 different bank groups, and every tile is masked and every
// exponential is expf of a scaled score.
//
// Rung 4, "pipelined" (kPipelined = true), the memory pipeline:
//   - cp.async double buffering: K and V for tile n + 1 are copied while tile n computes; the
//     copies bypass registers and the warps do not wait on them until the next trip;
//   - an XOR swizzle in place of the padding (16-byte chunk c of row r stored at chunk c ^ (r % 8)):
//     conflict-free for ldmatrix and for the copies alike, and no wasted bytes, which is what lets
//     head dim 256 double-buffer within an A100's 163 KiB (head dims 32 and 96, whose rows are not
//     a multiple of 8 chunks, keep the padding);
//   - exp2 with log2(e) folded into the scale: without --use_fast_math (the course builds without
//     it) exp2f compiles to the MUFU.EX2 plus a compare and two predicated multiplies that keep
//     results below 2^-126 as denormals, four instructions; expf is about twice that (a range
//     reduction with log2(e) split in two FMAs before its MUFU.EX2);
//   - masks only where they can bite: the last tile (keys past seqlen_k) and, when causal, the
//     tiles that cross the diagonal. Tiles entirely above the diagonal were already never
//     visited (the key loop stops at the last key the block's last row sees), from rung 2 on.
//
// Rung 5, "tuned" (FwdTraits' kTuned): the pipelined kernel with FlashAttention 2's tile shapes,
// each warp owning 32 query rows (two m16 tiles) in blocks of 4 warps, so each K and V fragment
// read from shared memory feeds two mma instructions (flash_fwd.h says what it costs). The code
// below is written for kMT m16 tiles per warp; rungs 3 and 4 are kMT = 1.
//
// Rung 6, "split_kv" (flash-decoding), the same kernel: when batch x heads x query tiles leaves
// SMs idle (a short query against a long context: decoding, a chunk of a prompt against its cache),
// the keys are cut into ranges (`splits`, attention_forward_splits) and each block does one range
// of one 64-row query tile (flash_fwd.h says why 64), so the grid fills the GPU; its rows' outputs
// and lse go to a float32 workspace, and split_combine.cu merges them. Where the grid fills the GPU
// without splitting, the dispatch runs rung 5 instead.
//
// Local attention and softcapping (attention.h's window and softcap), taken by rungs 5 and 6 (the
// glue refuses them on 3 and 4, which share this code): the key loop runs over the tiles that hold
// a key some row of the block sees, [key_begin(first row), key_end(last row)), so a window of w keys
// costs about (kBlockM + w) / kBlockN tiles per block instead of seqlen_k / kBlockN: the loop bounds
// are where the speed comes from, as causal's were. The tiles the window's edges cross are masked
// like the diagonal's (one more compare per score), and the softcap replaces the scaling of the
// scores before the online softmax sees them (softcap.cuh).
//   That code is compiled in only where it is used: kWindowSoftcap, a template parameter as
// FlashAttention 2's Is_local and Is_softcap are, and one flag for both (the window's bounds and
// the cap are read at run time inside that instantiation), so that rungs 5 and 6 compile twice,
// not four times. A call with neither (attention.h's uses_window_or_softcap) runs the
// kWindowSoftcap = false instantiation, whose code is the kernel's as it was before they existed:
// the window's few more registers per thread were spills at some head dims, on every GPU.
//
// The packed (varlen) layout (attention.h's cu_seqlens), taken by rungs 5 and 6: kVarlen, a template
// parameter as kWindowSoftcap is (varlen.cuh says why not a runtime branch). The grid is the padded
// one over max_seqlen_q; a block reads its sequence's start and length, returns at once if its tile
// lies past that sequence's end, and otherwise runs the code below on the sequence as a batch of
// one: its own bottom-right causal mask and window, lse (and rung 6's partials) at (head, packed
// row). The combine then walks the (heads, total_q) rows as one sequence of total_q tokens.
//
// The output is written straight from the accumulators, two elements (4 bytes) per lane per
// n8 tile; FlashAttention 2 stages it through shared memory for 16-byte stores, which no rung
// here does (not measured).
//
// No torch headers: this file builds with a bare `nvcc -c`.
#pragma once

#include "attention/attention.h"
#include "attention/flash_fwd.h"
#include "attention/flash_tiles.cuh"
#include "attention/mma.cuh"
#include "attention/softcap.cuh"
#include "attention/varlen.cuh"

#include <course/cuda_utils.h>

#include <climits>
#include <cstdint>

namespace flash_attention {

// kWindowSoftcap: this instantiation computes a window and a softcap (`cap`); without it, `cap` is
// unread and p.causal is the only mask (K::kWindowSoftcap says which rungs have the other one).
// `cap` comes last so that the other arguments sit where they did before it existed. kVarlen: the
// packed layout (above).
template <typename T, typename K, bool kWindowSoftcap, bool kVarlen>
__global__ void __launch_bounds__(K::kThreads)
    flash_fwd_kernel(const AttentionParams params, unsigned q_tiles, float score_scale, unsigned splits_arg,
                     float* __restrict__ o_split, const Softcap cap) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kD = K::kHeadDim;
  constexpr int kMT = K::kWarpMTiles;      // m16 tiles of query rows per warp
  constexpr int kNTiles = K::kBlockN / 8;  // n8 score tiles per key tile
  constexpr int kDTiles = kD / 8;          // n8 output tiles
  // Rung "split_kv" takes a range of the keys and writes partials; the others keep every register
  // for the main loop.
  constexpr bool kSplit = K::kSplit;
  extern __shared__ __align__(16) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);
  T* k_s = q_s + K::kQElems;
  T* v_s = k_s + K::kStages * K::kKVElems;

  // The grid is flattened (query tiles fastest, then splits), as in rung 2, so batch * heads may
  // exceed 65535. Without split-KV, splits is 1 and split 0.
  const unsigned splits = kSplit ? splits_arg : 1;
  const int64_t tile = blockIdx.x % q_tiles;
  const unsigned split = (blockIdx.x / q_tiles) % splits;
  const int64_t bh = blockIdx.x / q_tiles / splits;
  const int64_t b = bh / params.heads;
  const int64_t h = bh % params.heads;
  const int64_t m0 = tile * K::kBlockM;
  // Packed: sequence b as a batch of one (varlen.cuh). q_tiles covers the longest sequence, so a
  // shorter one's last tiles hold none of its rows: nothing to load and no row to write, and the
  // whole block leaves together, before any barrier. (A sequence without keys stays: its rows get
  // o = 0 and lse = -inf, below.)
  AttentionParams sequence;
  if constexpr (kVarlen) {
    sequence = sequence_params<T>(params, b);
    if (m0 >= sequence.seqlen_q) return;
  }
  const AttentionParams& p = kVarlen ? sequence : params;
  const int64_t hk = h / (p.heads / p.heads_kv);  // GQA: the kv head this query head reads
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;  // mma.cuh's group: in each m16 tile this lane's rows are g and g + 8
  const int t = lane % 4;
  const int warp_row = warp * K::kWarpRows;       // the warp's first row in the block's tile
  const int64_t row0 = m0 + warp_row + g;         // this lane's row in m16 tile 0
  const int64_t diag = p.seqlen_k - p.seqlen_q;  // key j is visible to row i iff j <= i + diag

  // Keys any row of the block sees: from the first row's first (a window's left edge; else key 0)
  // to the last valid row's last (rung 2's causal skipping; a window's right edge). With neither
  // bound the range is every key (attention.h).
  const int64_t last_row = (m0 + K::kBlockM < p.seqlen_q ? m0 + K::kBlockM : p.seqlen_q) - 1;
  const int64_t keys_end =
      kWindowSoftcap ? key_end(last_row, p) : visible_keys(last_row, p.seqlen_q, p.seqlen_k, p.causal);
  // An empty range stays empty.
  const int64_t keys_begin = kWindowSoftcap ? min(key_begin(m0, p), keys_end) : 0;
  // Split-KV (rung "split_kv"): this block takes the split-th of ceil(tiles / splits) of its key
  // tiles; the last splits of a causal or windowed block may get none.
  const int first_tile = static_cast<int>(keys_begin / K::kBlockN);
  const int tiles = static_cast<int>((keys_end + K::kBlockN - 1) / K::kBlockN) - first_tile;
  const int per_split = (tiles + static_cast<int>(splits) - 1) / static_cast<int>(splits);
  const int n_begin = first_tile + (kSplit ? min(tiles, static_cast<int>(split) * per_split) : 0);
  const int n_end = kSplit ? min(first_tile + tiles, n_begin + per_split) : first_tile + tiles;

  float acc_o[kMT][kDTiles][4];
#pragma unroll
  for (int m = 0; m < kMT; ++m) {
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) acc_o[m][d][0] = acc_o[m][d][1] = acc_o[m][d][2] = acc_o[m][d][3] = 0.f;
  }
  // Per row (m16 tile m, rows g and g + 8): the running maximum of the scaled scores (log2 units
  // from rung 4 on) and this lane's share of the running sum of exponentials (the four lanes of a
  // row add theirs up once, at the end).
  float row_max[kMT][2];
  float row_sum[kMT][2];
#pragma unroll
  for (int m = 0; m < kMT; ++m) {
    row_max[m][0] = row_max[m][1] = -INFINITY;
    row_sum[m][0] = row_sum[m][1] = 0.f;
  }

  // No visible key (no tile: causal rows above every key, seqlen_k == 0, or a split past the
  // block's last tile): nothing to load, and the epilogue writes o = 0, lse = -inf.
  if (n_begin < n_end) {
    const int64_t first = static_cast<int64_t>(n_begin) * K::kBlockN;
    load_tile<K, K::kBlockM>(q_s, q, p.q_seq_stride, m0, p.seqlen_q);
    load_tile<K, K::kBlockN>(k_s, k, p.k_seq_stride, first, p.seqlen_k);
    load_tile<K, K::kBlockN>(v_s, v, p.v_seq_stride, first, p.seqlen_k);
    if constexpr (K::kPipelined) mma::cp_async_commit();
  }

  for (int n = n_begin; n < n_end; ++n) {
    const int stage = K::kPipelined ? (n - n_begin) % 2 : 0;
    const int64_t n0 = static_cast<int64_t>(n) * K::kBlockN;
    if constexpr (K::kPipelined) {
      // Tile n + 1 into the other stage, whose last readers (tile n - 1) passed the barrier at
      // the end of the previous trip; then wait for tile n only (one batch may stay in flight).
      if (n + 1 < n_end) {
        const int next = 1 - stage;
        load_tile<K, K::kBlockN>(k_s + next * K::kKVElems, k, p.k_seq_stride, n0 + K::kBlockN, p.seqlen_k);
        load_tile<K, K::kBlockN>(v_s + next * K::kKVElems, v, p.v_seq_stride, n0 + K::kBlockN, p.seqlen_k);
        mma::cp_async_commit();
        mma::cp_async_wait<1>();
      } else {
        mma::cp_async_wait<0>();
      }
    } else if (n > n_begin) {
      load_tile<K, K::kBlockN>(k_s, k, p.k_seq_stride, n0, p.seqlen_k);
      load_tile<K, K::kBlockN>(v_s, v, p.v_seq_stride, n0, p.seqlen_k);
    }
    // Each thread waited for (or made) its own copies only: the barrier makes every thread's
    // part of Q and of tile n visible to all the warps that read it.
    __syncthreads();
    const T* k_tile = k_s + stage * K::kKVElems;
    const T* v_tile = v_s + stage * K::kKVElems;

    // S = Q K^T for the warp's rows and the tile's kBlockN keys.
    float s[kMT][kNTiles][4];
#pragma unroll
    for (int m = 0; m < kMT; ++m) {
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) s[m][j][0] = s[m][j][1] = s[m][j][2] = s[m][j][3] = 0.f;
    }
    mma::gemm_nt<T, K, kD, K::kBlockN>(s, q_s, warp_row, k_tile, 0, lane);

    // Scale (into log2 units from rung 4 on), or cap (softcap.cuh; in the same units), then mask:
    // in that order, so that a negative scale cannot turn a masked -inf into +inf. Score s[m][j][e]
    // is row row0 + 16m + 8 * (e / 2), key n0 + 8j + 2t + e % 2. From rung 4 on only the tiles a
    // mask can bite are masked: the last (keys past seqlen_k) and those crossing the diagonal
    // (causal) or a window's right edge, judged for the warp's own first row (its rows see the
    // fewest keys on the right), and with a window those crossing its left edge, judged for its
    // last row (the fewest on the left). Without a window or softcap the scaling happens in the
    // masking loop below; with them it is a pass of its own, as the cap takes its place.
    if constexpr (kWindowSoftcap) {
      if (cap.in != 0.f) {  // uniform: the same branch for every thread of the grid
        with_softcap_tanh(cap, [&](auto mode) {  // one loop per softcap mode (softcap.cuh)
#pragma unroll
          for (int m = 0; m < kMT; ++m) {
#pragma unroll
            for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
              for (int e = 0; e < 4; ++e) s[m][j][e] = softcap_score<decltype(mode)::value>(s[m][j][e], cap);
            }
          }
        });
      } else {
#pragma unroll
        for (int m = 0; m < kMT; ++m) {
#pragma unroll
          for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[m][j][e] *= score_scale;
          }
        }
      }
    }
    bool mask = true;
    if constexpr (K::kPipelined && kWindowSoftcap) {
      mask = n0 + K::kBlockN > p.seqlen_k ||
             (p.window_right >= 0 && n0 + K::kBlockN - 1 > m0 + warp_row + diag + p.window_right) ||
             (p.window_left >= 0 && n0 < m0 + warp_row + K::kWarpRows - 1 + diag - p.window_left);
    } else if constexpr (K::kPipelined) {
      mask = n0 + K::kBlockN > p.seqlen_k || (p.causal && n0 + K::kBlockN - 1 > m0 + warp_row + diag);
    }
#pragma unroll
    for (int m = 0; m < kMT; ++m) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // The row's visible columns of the tile, [col_start, col_limit), worked out once per row
        // in 64 bits, so that the per-score test is one 32-bit compare against a column known at
        // compile time but for 2t (with a window, unsigned: a column left of col_start wraps to a
        // large number; without one, col_start is 0).
        int col_start = 0, col_limit = K::kBlockN;
        if (mask) {
          const int64_t row = row0 + 16 * m + 8 * r;
          if constexpr (kWindowSoftcap) {
            const int64_t start = key_begin(row, p) - n0;
            col_limit = static_cast<int>(max(int64_t{0}, min(key_end(row, p) - n0, int64_t{K::kBlockN})));
            col_start = static_cast<int>(max(int64_t{0}, min(start, int64_t{col_limit})));
          } else {
            int64_t limit = p.seqlen_k - n0;
            if (p.causal) limit = min(limit, row + diag - n0 + 1);
            col_limit = static_cast<int>(max(int64_t{0}, min(limit, int64_t{K::kBlockN})));
          }
        }
        const unsigned width = static_cast<unsigned>(col_limit - col_start);
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            const int col = 8 * j + 2 * t + e % 2;
            if constexpr (kWindowSoftcap) {
              if (static_cast<unsigned>(col - col_start) >= width) s[m][j][e] = -INFINITY;
            } else {
              s[m][j][e] *= score_scale;
              if (col >= col_limit) s[m][j][e] = -INFINITY;
            }
          }
        }
      }
    }

    // The online softmax (chapter 3), per row: the new maximum over the four lanes of the row,
    // the old sums and outputs rescaled by exp(old max - new max), then the tile's exponentials.
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
        // masked scores give exp(-inf) = 0 rather than exp(-inf + inf) = NaN.
        const float m_use = mx == -INFINITY ? 0.f : mx;
        float corr = 0.f;  // old max -inf: the old sum and output are 0, nothing to rescale
        if (row_max[m][r] != -INFINITY) {
          corr = K::kPipelined ? exp2f(row_max[m][r] - mx) : expf(row_max[m][r] - mx);
        }
        row_max[m][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[m][j][e] = K::kPipelined ? exp2f(s[m][j][e] - m_use) : expf(s[m][j][e] - m_use);
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

    // O += P V: P from the score registers (mma.cuh), V through ldmatrix.trans.
    mma::gemm_rs<T, K, K::kBlockN, kD>(acc_o, s, v_tile, 0, lane);
    // Every warp is done reading this stage before the next trip refills it (rung 3: the same
    // buffer at the top of the next trip; from rung 4 on: this stage two trips on, by the copies
    // issued at the top of the next one).
    __syncthreads();
  }

  // o = acc / l and lse = max + log(l) per row; a row with no visible key (l = 0) gets o = 0 and
  // lse = -inf (attention.h). The shuffles come before any branch on the row: all 32 lanes.
  // Packed: the sequence's first row and its length read again here rather than kept from the top
  // (the loop's barriers make them fresh loads, from L1): registers the main loop needs more.
  const int64_t q_start = kVarlen ? params.cu_seqlens_q[b] : 0;
  const int64_t seqlen_q = kVarlen ? params.cu_seqlens_q[b + 1] - q_start : p.seqlen_q;
  T* o = static_cast<T*>(params.o) + (kVarlen ? q_start * params.o_seq_stride : b * p.o_batch_stride) +
         h * p.o_head_stride;
  // This block's first statistics row: (batch, heads, seqlen_q) padded, (heads, total_q) packed.
  const int64_t stat_row0 = kVarlen ? h * params.total_q + q_start : bh * p.seqlen_q;
  auto* lse = static_cast<float*>(p.lse) + stat_row0;
  // Split-KV: the partial output in float32 and the split's lse go to the workspace
  // (attention.h's SplitCombineParams layout), for the combine kernel to merge; one row per lse row.
  const int64_t rows = kVarlen ? params.heads * params.total_q : p.batch * p.heads * p.seqlen_q;
  float* o_part = kSplit ? o_split + (split * rows + stat_row0) * kD : nullptr;
  float* lse_part = kSplit ? o_split + splits * rows * kD + split * rows + stat_row0 : nullptr;
#pragma unroll
  for (int m = 0; m < kMT; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_sum[m][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int64_t row = row0 + 16 * m + 8 * r;
      if (row < seqlen_q) {  // the last block's rows past the end computed on zero rows of Q
        // The maximum is in units of scale * s (rung 3) or log2(e) * scale * s (rungs 4-6).
        constexpr float kToNatural = K::kPipelined ? 0.69314718055994531f : 1.f;
        if constexpr (kSplit) {
#pragma unroll
          for (int d = 0; d < kDTiles; ++d) {
            *reinterpret_cast<float2*>(o_part + row * kD + d * 8 + 2 * t) =
                make_float2(acc_o[m][d][2 * r] * inv, acc_o[m][d][2 * r + 1] * inv);
          }
          if (t == 0) lse_part[row] = l > 0.f ? row_max[m][r] * kToNatural + logf(l) : -INFINITY;
        } else {
          T* o_row = o + row * p.o_seq_stride;
#pragma unroll
          for (int d = 0; d < kDTiles; ++d) {
            *reinterpret_cast<uint32_t*>(o_row + d * 8 + 2 * t) =
                mma::pack2<T>(acc_o[m][d][2 * r] * inv, acc_o[m][d][2 * r + 1] * inv);
          }
          if (t == 0) lse[row] = l > 0.f ? row_max[m][r] * kToNatural + logf(l) : -INFINITY;
        }
      }
    }
  }
#endif  // __CUDA_ARCH__ >= 800: older GPUs never launch it (the glue checks the capability)
}

template <typename T, typename K, bool kWindowSoftcap, bool kVarlen>
cudaError_t launch_flash_fwd(const AttentionParams& p, const FwdSplit& split, cudaStream_t stream) {
  constexpr int D = K::kHeadDim;
  const int64_t q_tiles = course::ceil_div(p.seqlen_q, static_cast<int64_t>(K::kBlockM));
  const int64_t splits = K::kSplit ? split.splits : 1;
  const int64_t blocks = q_tiles * p.batch * p.heads * splits;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  float* o_split = K::kSplit ? split.workspace : nullptr;
  auto kernel = flash_fwd_kernel<T, K, kWindowSoftcap, kVarlen>;
  // Above 48 KiB a kernel must ask for its dynamic shared memory (every tile shape here does).
  COURSE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::kSmemBytes));
  const double log2e = 1.4426950408889634;
  const float score_scale = static_cast<float>(K::kPipelined ? p.scale * log2e : p.scale);
  const Softcap cap =
      kWindowSoftcap ? make_softcap(p.scale, p.softcap, p.dtype == DType::kBFloat16, K::kPipelined) : Softcap{};
  kernel<<<static_cast<unsigned>(blocks), K::kThreads, K::kSmemBytes, stream>>>(
      p, static_cast<unsigned>(q_tiles), score_scale, static_cast<unsigned>(splits), o_split, cap);
  COURSE_CUDA_TRY(cudaGetLastError());
  if (o_split == nullptr) return cudaSuccess;
  // The combine walks the statistics' rows: packed, (heads, total_q) is the padded layout of a batch
  // of one sequence of total_q tokens (the batch strides are 0), so it needs no cu_seqlens.
  const int64_t rows = stat_rows(p);
  SplitCombineParams c{};
  c.dtype = p.dtype;
  c.o_partial = o_split;
  c.lse_partial = o_split + splits * rows * D;
  c.splits = splits, c.rows = rows, c.head_dim = D;
  c.heads = p.heads, c.seqlen = p.cu_seqlens_q != nullptr ? p.total_q : p.seqlen_q;
  c.out = p.o;
  c.out_batch_stride = p.o_batch_stride, c.out_head_stride = p.o_head_stride, c.out_seq_stride = p.o_seq_stride;
  c.lse = static_cast<float*>(p.lse);
  return launch_split_combine(c, stream);
}

// The one place a call picks its instantiation: with a window or a softcap, the kWindowSoftcap one
// of the rungs that have it; without, the plain one; packed (cu_seqlens_q set), the kVarlen one of
// rungs "tuned" and "split_kv". Rungs 3 and 4 have neither (the glue refuses such calls there; this
// answers a launcher called from C++).
template <typename T, int D, MmaForward kRung>
cudaError_t run_flash_fwd(const AttentionParams& p, const FwdSplit& split, cudaStream_t stream) {
  using K = FwdTraits<D, kRung>;
  if (p.cu_seqlens_q != nullptr) {
    if constexpr (K::kWindowSoftcap) {  // rungs 5 and 6: the same pair takes the packed layout
      return uses_window_or_softcap(p) ? launch_flash_fwd<T, K, true, true>(p, split, stream)
                                       : launch_flash_fwd<T, K, false, true>(p, split, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  }
  if (!uses_window_or_softcap(p)) return launch_flash_fwd<T, K, false, false>(p, split, stream);
  if constexpr (K::kWindowSoftcap) {
    return launch_flash_fwd<T, K, true, false>(p, split, stream);
  } else {
    return cudaErrorInvalidValue;
  }
}

}  // namespace flash_attention
