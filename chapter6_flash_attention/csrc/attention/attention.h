// Plain C++ interface between the attention glue (attention_ops.cpp), the CPU reference
// (attention_cpu.cpp) and the CUDA kernels (attention_naive_kernels.cu,
// attention_tiled_kernels.cu). No torch and no
// CUDA types, as FlashAttention's flash.h: the glue compiles without the toolkit, the kernels
// with a bare `nvcc -c`.
//
// Layout: q is (batch, heads, seqlen_q, head_dim), k and v are (batch, heads_kv, seqlen_k,
// head_dim), o is q's shape. Each may be any strided view whose last dim is contiguous: the
// glue passes the other three strides (in elements) instead of copying, so q taken from a
// (batch, seqlen, heads, head_dim) projection costs nothing. 64-bit strides and offsets: a
// (32, 32, 16384, 128) tensor already holds 2^31 elements.
//
// Semantics, for query head h, row i and key j (k/v head h / (heads / heads_kv): grouped-query
// attention, GQA; heads_kv == heads is ordinary multi-head attention):
//   s_ij = scale * q_i . k_j
//   causal: key j is visible to row i iff j <= i + seqlen_k - seqlen_q (the mask's diagonal
//           ends in the bottom-right corner, as FlashAttention 2 and a KV cache want: the last
//           query row sees every key). For seqlen_q == seqlen_k it is the usual j <= i.
//   lse_i = log(sum over visible j of exp(s_ij))       (natural log)
//   o_i   = sum over visible j of exp(s_ij - lse_i) v_j
// A row that sees no key (causal with seqlen_q > seqlen_k: rows i < seqlen_q - seqlen_k; or
// seqlen_k == 0) has an empty softmax. It gives o_i = 0, lse_i = -inf and zero gradients, which
// is what torch's F.scaled_dot_product_attention returns on the CPU for a fully masked row
// (torch 2.13, math and flash-for-CPU alike; its CausalBias warns of NaN, but the kernels write
// 0). Every implementation must keep it: the backward cannot recompute exp(s - lse) there
// (-inf - -inf is NaN), so it skips such rows outright.
//
// Local (sliding-window) attention and softcapping, FlashAttention 2's window_size and softcap:
//   window (left, right): key j is visible to row i iff
//           i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right
//           (the causal mask's bottom-right alignment; -1 leaves that side unbounded). causal is
//           right = 0, and make_params stores it so: causal with a window keeps the window's left.
//   softcap > 0: s_ij becomes softcap * tanh(s_ij / softcap) before the softmax (Gemma 2, Grok),
//           which bounds every score to (-softcap, softcap). lse is of the capped scores, and
//           the backward multiplies dS by the derivative of the cap, 1 - tanh^2(s_ij / softcap).
// Only the right bound can leave a row without keys (rows with i + seqlen_k - seqlen_q + right < 0,
// as causal's rows above the diagonal; the left bound never empties a row of q, whose range
// starts at most at key seqlen_k - 1 - left): the same empty softmax as above.
#pragma once

#include <course/dtype.h>
#include <course/index_math.h>
#include <course/static_switch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace flash_attention {

using DType = ::course::DType;

// Head dims the CUDA kernels are instantiated for (the tiled and tensor-core rungs take each as a
// template parameter: their tile shapes and the registers a row of O takes depend on it; the naive
// rungs would take any, but one list for the whole ladder keeps version= a pure speed choice), and
// the subset the tensor-core backward takes (its dK and dV rows live in registers: 256 would not
// fit). The one place each list is written: the glue checks CUDA inputs against them, every
// launcher's head-dim switch (course::with_listed) runs over them, and
// generate_instantiations.py reads them to write one instantiation file per pass, dtype and head
// dim. The CPU reference takes any head_dim >= 1.
inline constexpr int kCudaHeadDims[] = {32, 64, 96, 128, 256};
inline constexpr int kMmaBackwardHeadDims[] = {32, 64, 96, 128};
// Part 3's Hopper forward (csrc/hopper/): whole 64-column chunks, the width of its 128-byte swizzle.
inline constexpr int kHopperHeadDims[] = {64, 128, 256};
// Part 3's Hopper backward (rung "wgmma"): dK and dV of a warpgroup's 64 keys live in registers,
// which 256 would not fit. Here, not beside the kernel, because version=None's rule reads it in
// every build, the CPU-only one included.
inline constexpr int kHopperBackwardHeadDims[] = {64, 128};
// The packed (varlen) layout on the Hopper forward (rung "persistent", csrc/hopper/): the head dims
// of its pingpong consumers (at 256 it runs warp_specialized's, which the packed layout's
// version=None would not pick over "split_kv" unmeasured).
inline constexpr int kHopperVarlenHeadDims[] = {64, 128};
// A window or a softcap on the Hopper forward (rung "persistent" with its kWindowSoftcap
// instantiation, csrc/hopper/): the head dims of its pingpong consumers, as for the packed layout
// (the instantiations are compiled per dtype and head dim: each one more costs CI's build time).
inline constexpr int kHopperWindowHeadDims[] = {64, 128};

// The log-sum-exp is kept in the accumulation type: float32, float64 for float64 inputs (as
// chapter 4 keeps its norms' statistics). A (batch, heads, seqlen_q) contiguous tensor:
// lse[(b * heads + h) * seqlen_q + i], the layout of FlashAttention 2's softmax_lse and of SDPA's
// logsumexp output. The forward writes it so that the backward can rebuild P row by row without
// a second pass over the keys.
struct AttentionParams {
  DType dtype;
  const void* q;
  const void* k;
  const void* v;
  void* o;
  void* lse;
  int64_t batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim;
  int64_t q_batch_stride, q_head_stride, q_seq_stride;
  int64_t k_batch_stride, k_head_stride, k_seq_stride;
  int64_t v_batch_stride, v_head_stride, v_seq_stride;
  int64_t o_batch_stride, o_head_stride, o_seq_stride;
  double scale;
  bool causal;
  // The window's bounds (-1: none; causal sets window_right to 0) and the softcap (0: none).
  // Only the rungs that take them read them (attention_ops.cpp refuses the rest), and with the
  // defaults every rung computes what it did before they existed.
  int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;
  // The packed (varlen) layout, FlashAttention 2's: null for the padded batch above. Otherwise
  // batch is the number of sequences and sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1])
  // of a (total_q, heads, head_dim) q (its token stride is q_seq_stride, and every batch stride is
  // 0) against rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v, each pair attended to as a
  // batch of one with its own lengths (its own bottom-right causal mask and window); seqlen_q and
  // seqlen_k are then max_seqlen_q and max_seqlen_k, which size the grid (a host int each: the
  // lengths themselves stay on the device, read by the blocks). lse is (heads, total_q):
  // lse[h * total_q + cu_seqlens_q[b] + i]. Only the rungs that take it read these (the glue refuses
  // the rest): the forward's "tuned", "split_kv" and "persistent", the backward's "mma" and
  // "mma_dqpass". total_k is the packed k's token count (the persistent rung's tensor maps need it).
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t total_q = 0, total_k = 0;
  // Paged K/V, with the packed layout (the serving half's paged_prefill_attention, its rung
  // "persistent"; csrc/serving/serving.h): null for every other call. k and v are then the caches,
  // (num_blocks, block_size, heads_kv, head_dim) contiguous; key j of sequence b lives in block
  // block_tables[b * block_table_stride + j / block_size], row j % block_size; sequence b has
  // context_lens[b] keys (clamped to [0, max_blocks * block_size], serving.h's paged_context), and
  // cu_seqlens_k, total_k and the k/v strides are not read. Only the persistent rung's packed
  // instantiation reads these (its producer alone: flash_fwd_hopper_persistent.cuh).
  const int32_t* block_tables = nullptr;
  const int32_t* context_lens = nullptr;
  int64_t block_table_stride = 0, block_size = 0, num_blocks = 0, max_blocks = 0;
};

// Rows of the per-row statistics (lse, and the backward's D): batch * heads * seqlen_q padded,
// heads * total_q packed.
inline int64_t stat_rows(const AttentionParams& p) {
  return p.cu_seqlens_q != nullptr ? p.heads * p.total_q : p.batch * p.heads * p.seqlen_q;
}

// The backward, from the forward's o and lse (P is recomputed, never stored: it is seqlen_q x
// seqlen_k per head, the memory FlashAttention exists to avoid):
//   P  = exp(S - lse)            D  = rowsum(dO * O)
//   dV = P^T dO                  dP = dO V^T
//   dS = P * (dP - D)            dQ = scale dS K        dK = scale dS^T Q
// With GQA, dk and dv of a kv head are the sums over the query heads that share it.
// dq, dk and dv have the shapes of q, k and v, with their own strides (last dim contiguous).
struct AttentionBackwardParams {
  AttentionParams fwd;  // q, k, v, o and lse as the forward saw them; fwd.o and fwd.lse are read
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  int64_t do_batch_stride, do_head_stride, do_seq_stride;
  int64_t dq_batch_stride, dq_head_stride, dq_seq_stride;
  int64_t dk_batch_stride, dk_head_stride, dk_seq_stride;
  int64_t dv_batch_stride, dv_head_stride, dv_seq_stride;
};

// Key j is visible to query row i (bottom-right aligned causal mask; see above). The number of
// keys row i sees is min(seqlen_k, max(0, i + seqlen_k - seqlen_q + 1)) when causal. Host and
// device alike: the CPU reference, the glue and every kernel apply the one rule.
#if defined(__CUDACC__)
#define FLASH_ATTENTION_HD __host__ __device__ __forceinline__
#else
#define FLASH_ATTENTION_HD inline
#endif

FLASH_ATTENTION_HD int64_t visible_keys(int64_t row, int64_t seqlen_q, int64_t seqlen_k, bool causal) {
  if (!causal) return seqlen_k;
  const int64_t last = row + seqlen_k - seqlen_q;  // the last visible key's index
  if (last < 0) return 0;
  return last + 1 < seqlen_k ? last + 1 : seqlen_k;
}

// The first query row that sees key j (the backward walks a key's column from there): row i sees
// j iff i >= j - (seqlen_k - seqlen_q). May be seqlen_q itself (no row sees j).
FLASH_ATTENTION_HD int64_t first_visible_row(int64_t key, int64_t seqlen_q, int64_t seqlen_k, bool causal) {
  if (!causal) return 0;
  const int64_t first = key - (seqlen_k - seqlen_q);
  return first < 0 ? 0 : (first < seqlen_q ? first : seqlen_q);
}

// The window's rule (above), for a row or a key of any rung that takes a window. With
// window_right = 0 and window_left = -1 (plain causal) these are visible_keys and
// first_visible_row; with both -1, every key and every row. Rows past seqlen_q (a kernel's padding
// rows) and keys past seqlen_k are clamped, never negative ranges: key_begin <= key_end and
// row_begin <= row_end always, an empty range where nothing is visible.
FLASH_ATTENTION_HD int64_t clamp_to(int64_t x, int64_t hi) { return x < 0 ? 0 : (x < hi ? x : hi); }
// The first key row i sees, and one past its last.
FLASH_ATTENTION_HD int64_t key_begin(int64_t row, const AttentionParams& p) {
  return p.window_left < 0 ? 0 : clamp_to(row + p.seqlen_k - p.seqlen_q - p.window_left, p.seqlen_k);
}
FLASH_ATTENTION_HD int64_t key_end(int64_t row, const AttentionParams& p) {
  return p.window_right < 0 ? p.seqlen_k : clamp_to(row + p.seqlen_k - p.seqlen_q + p.window_right + 1, p.seqlen_k);
}
// The first row that sees key j, and one past the last (the backward walks a key's column).
FLASH_ATTENTION_HD int64_t row_begin(int64_t key, const AttentionParams& p) {
  return p.window_right < 0 ? 0 : clamp_to(key - (p.seqlen_k - p.seqlen_q) - p.window_right, p.seqlen_q);
}
FLASH_ATTENTION_HD int64_t row_end(int64_t key, const AttentionParams& p) {
  return p.window_left < 0 ? p.seqlen_q : clamp_to(key - (p.seqlen_k - p.seqlen_q) + p.window_left + 1, p.seqlen_q);
}
// Whether a call uses what only some rungs compute: a window beyond causal's own, or a softcap.
inline bool uses_window_or_softcap(const AttentionParams& p) {
  return p.window_left >= 0 || (p.window_right >= 0 && !p.causal) || p.softcap > 0.0;
}

// Bytes of the accumulation type (float32 for float32 and the 16-bit types, float64 for
// float64): what the workspaces below are made of.
inline int64_t acc_bytes(DType dtype) { return dtype == DType::kFloat64 ? 8 : 4; }

// The CUDA ladders' workspaces, asked for by the glue and allocated there (through torch's
// caching allocator, so CUDA-graph capture sees an ordinary stream-ordered allocation and no
// launcher ever calls cudaMalloc).
//   forward "naive":  S, then P in place: batch * heads * seqlen_q * seqlen_k accumulators.
//   forward "tiled":  none (O(seqlen) memory: the point of FlashAttention).
//   backward "naive": P, then dS in place (same size as the forward's), followed by
//                     D = rowsum(dO * O): batch * heads * seqlen_q accumulators.
inline int64_t attention_forward_naive_workspace(const AttentionParams& p) {
  return p.batch * p.heads * p.seqlen_q * p.seqlen_k * acc_bytes(p.dtype);
}
inline int64_t attention_backward_naive_workspace(const AttentionBackwardParams& g) {
  const AttentionParams& p = g.fwd;
  return (p.batch * p.heads * p.seqlen_q * p.seqlen_k + p.batch * p.heads * p.seqlen_q) * acc_bytes(p.dtype);
}

// The grid of a grid-stride kernel (the tensor-core backward's D = rowsum(dO * O) and dQ
// kernels): a block per `per_block` items while that keeps at most kGridStrideBlocksPerSm blocks
// per SM of a GPU with `sms` multiprocessors, then that many, each looping over the rest; at least
// one. Eight 256-thread blocks are 2048 threads, every thread slot of an sm_80 or sm_90 SM, so the
// grid fills the GPU it runs on, whatever its SM count (the launcher asks the device,
// course::sm_count). Plain C++ so that the CPU tests hold the rule with made-up SM counts (the
// `grid_stride_blocks` op).
inline constexpr int64_t kGridStrideBlocksPerSm = 8;
inline int64_t grid_stride_blocks(int64_t work, int64_t per_block, int sms) {
  const int64_t most = kGridStrideBlocksPerSm * (sms > 0 ? sms : 1);
  const int64_t blocks = ::course::ceil_div(work, per_block);
  return blocks < 1 ? 1 : (blocks < most ? blocks : most);
}

// The CPU reference (attention_cpu.cpp): float32 and float64.
void attention_forward_cpu(const AttentionParams& params);
void attention_backward_cpu(const AttentionBackwardParams& params);

// The tile sizes the split-KV rule below reads, per head dim: query rows of rung "tuned"'s tile,
// of rung "split_kv"'s, and keys of "split_kv"'s (csrc/attention/flash_fwd.h's FwdTraits; its
// dispatch static_asserts that they agree). Here, torch- and CUDA-free, so that version=None's rule
// can be asked on any machine (flash_attention.default_choice, the recorded-results test).
struct ForwardTiles {
  int64_t tuned_rows, split_rows, split_keys;
};
constexpr ForwardTiles forward_tiles(int64_t head_dim) {
  return {head_dim <= 128 ? 128 : 64, 64, head_dim <= 64 ? 128 : 64};
}

// How many key ranges make the forward's grid fill a GPU of `sms` multiprocessors (rung
// "split_kv"; 1: no split). FlashAttention 2 decides the same way, in its num_splits_heuristic: a
// grid of tuned blocks that already fills 80% of one wave (two blocks per SM) is not split.
// Otherwise the split rung's (batch, head, 64-row tile) blocks times s splits run in waves of
// `slots`; the last wave of a grid is partly idle, so s is judged by the fraction of its waves'
// slots it keeps busy, waves / ceil(waves), and the fewest splits within 15% of the best fraction
// win: each split costs its partials' float32 writes and a share of the combine. Keys too few for
// two tiles per split are not split either.
inline int64_t attention_forward_splits(const AttentionParams& p, int sms) {
  if (!::course::is_listed(kCudaHeadDims, p.head_dim)) return 1;  // a head dim nobody compiled
  const ForwardTiles tiles = forward_tiles(p.head_dim);
  const int64_t slots = 2 * static_cast<int64_t>(sms);
  const int64_t tuned_blocks = p.batch * p.heads * ::course::ceil_div(p.seqlen_q, tiles.tuned_rows);
  if (tuned_blocks == 0 || 5 * tuned_blocks >= 4 * slots) return 1;
  const int64_t blocks = p.batch * p.heads * ::course::ceil_div(p.seqlen_q, tiles.split_rows);
  const int64_t key_tiles = ::course::ceil_div(p.seqlen_k, tiles.split_keys);
  const int64_t most = std::min<int64_t>({128, key_tiles / 2, ::course::ceil_div(4 * slots, blocks)});
  auto busy = [&](int64_t s) {
    const double waves = static_cast<double>(blocks * s) / static_cast<double>(slots);
    return waves / std::ceil(waves);
  };
  double best = 0.0;
  for (int64_t s = 1; s <= most; ++s) best = std::max(best, busy(s));
  for (int64_t s = 1; s <= most; ++s) {
    if (busy(s) >= 0.85 * best) return s;
  }
  return 1;
}

}  // namespace flash_attention

#if defined(__CUDACC__) || defined(WITH_CUDA)
#include <cuda_runtime_api.h>
namespace flash_attention {
// The CUDA ladders (all four floating dtypes, 16-bit computed in float32; head_dim from
// kCudaHeadDims). Each launcher runs on `stream`, returns the first launch error and never
// synchronizes or allocates; `workspace` holds at least the bytes the matching *_workspace
// function above asks for (it may be null when that is 0).
//   forward "naive" (attention_naive_kernels.cu): S = scale Q K^T into the workspace, a row
//     softmax writing P in place and lse, then O = P V. Three kernels, O(seqlen^2) memory.
//   forward "tiled" (attention_tiled_kernels.cu): FlashAttention 1's online softmax, one
//     block per (batch, head, tile of query rows), K/V tiles in shared memory, scalar FMA.
//   backward "naive" (attention_naive_kernels.cu): P recomputed from lse into the workspace,
//     D = rowsum(dO * O), dV = P^T dO, dS = P * (dP - D) in place, dQ = scale dS K,
//     dK = scale dS^T Q; dk/dv summed over a kv head's query heads in a fixed order (no atomics).
cudaError_t launch_attention_forward_naive(const AttentionParams& params, void* workspace, cudaStream_t stream);
cudaError_t launch_attention_forward_tiled(const AttentionParams& params, cudaStream_t stream);
cudaError_t launch_attention_backward_naive(const AttentionBackwardParams& params, void* workspace,
                                            cudaStream_t stream);
//   forward "mma", "pipelined" and "tuned" (flash_fwd_dispatch.cu, instantiations/flash_fwd_*.cu):
//     FlashAttention 2 on tensor cores, bfloat16 and float16 only, sm_80 and newer; every stride of
//     q, k, v and o a multiple of 8 elements and every pointer 16-byte aligned (16-byte copies).
//     The glue checks all of it. The rungs differ in their loads and tile shapes (flash_fwd.h), not
//     in what they compute. "tuned" and "split_kv" also take the packed layout (cu_seqlens_q set;
//     varlen.cuh).
enum class MmaForward { kMma, kPipelined, kTuned, kSplitKv };
//     Rung "split_kv" (kSplitKv) cuts the keys into `splits` ranges (split-KV, below), with
//     `workspace` holding attention_forward_split_workspace bytes; with splits <= 1 it runs "tuned".
cudaError_t launch_attention_forward_mma(const AttentionParams& params, MmaForward rung, cudaStream_t stream,
                                         int64_t splits = 1, void* workspace = nullptr);
// The dynamic shared memory one block of those kernels takes (0 for an unsupported head dim):
// the glue compares it with what the GPU allows a block.
int64_t attention_forward_mma_smem_bytes(int64_t head_dim, MmaForward rung);
//   backward "mma" and "mma_dqpass" (flash_bwd_dispatch.cu, instantiations/flash_bwd_*.cu):
//     FlashAttention 2's backward on tensor cores, the same dtypes, GPUs and strides as the
//     forward's, head_dim 32-128 (kMmaBackwardHeadDims). dq_atomic: dQ summed across key
//     tiles with float32 atomics ("mma"), else by a second, deterministic pass over the keys
//     ("mma_dqpass"). `workspace`: attention_backward_mma_workspace bytes, zeroed by the caller
//     (dQ's float32 sums when dq_atomic, then D = rowsum(dO * O)). Both take the packed layout.
cudaError_t launch_attention_backward_mma(const AttentionBackwardParams& params, bool dq_atomic, void* workspace,
                                          cudaStream_t stream);
int64_t attention_backward_mma_smem_bytes(int64_t head_dim);
// Split-KV (flash-decoding): when the grid of (batch, head, query tile) blocks cannot fill the
// GPU, the keys are cut into `splits` ranges and each block does one range of one query tile.
// Split s writes its rows' partial output o_s (normalised by its own sum) in float32 and its
// lse_s (natural log; -inf: the range held no visible key, and o_s = 0); the combine merges
//   lse = log sum_s exp(lse_s),   o = sum_s exp(lse_s - lse) o_s
// the online softmax's rescaling done once, across splits instead of across key tiles. Used by the
// forward's rung "split_kv" and by the paged decode's v3 (serving/serving.h). Row r of the partials
// is (b * heads + h) * seqlen + i and goes to
// out + b * out_batch_stride + h * out_head_stride + i * out_seq_stride; the merged lse (if lse is
// not null) to lse[r].
struct SplitCombineParams {
  DType dtype;  // of out: float16 or bfloat16
  const float* o_partial;    // [splits][rows][head_dim]
  const float* lse_partial;  // [splits][rows]
  int64_t splits, rows, head_dim;
  int64_t heads, seqlen;
  void* out;
  int64_t out_batch_stride, out_head_stride, out_seq_stride;
  float* lse;
};
cudaError_t launch_split_combine(const SplitCombineParams& params, cudaStream_t stream);
// The workspace rung "split_kv" takes for `splits` key ranges (attention_forward_splits, above):
// splits * rows * (head_dim + 1) floats, a row per lse row (stat_rows: the packed layout's too).
inline int64_t attention_forward_split_workspace(const AttentionParams& p, int64_t splits) {
  return splits > 1 ? splits * stat_rows(p) * (p.head_dim + 1) * 4 : 0;
}
// dQ's float32 sums (dq_atomic) and D, one row per lse row (stat_rows: the packed layout's too).
inline int64_t attention_backward_mma_workspace(const AttentionBackwardParams& g, bool dq_atomic) {
  const AttentionParams& p = g.fwd;
  return stat_rows(p) * ((dq_atomic ? p.head_dim : 0) + 1) * 4;
}
}  // namespace flash_attention
#endif
