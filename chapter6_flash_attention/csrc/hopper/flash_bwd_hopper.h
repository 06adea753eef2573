// Chapter 6, part 3: the Hopper backward's entry points, without the kernel (what the glue and the
// dispatch see). Torch-free; the kernel is in flash_bwd_hopper_kernel.cuh.
#pragma once

#include "attention/attention.h"

#include <cuda_runtime_api.h>

namespace flash_attention {

// Backward rung "wgmma" (sm_90a): FlashAttention 2's work split (a block per key tile of one kv
// head, walking every query tile of the heads that read it) on part 3's machinery. A producer warp
// brings the block's K and V once and streams Q, dO and the rows' statistics through a two-stage
// ring on mbarriers; two consumer warpgroups, 64 keys each, compute S^T, dP^T, dV and dK with
// wgmma, P^T and dS^T from registers as the A operand; dQ = dS K takes dS^T through shared memory,
// and its partial goes back through shared memory to a producer thread that adds it into float32
// sums with one bulk reduction a step (the copy engine's, off the consumers' path); a last kernel
// scales, reorders and rounds dQ.
// Head dims: kHopperBackwardHeadDims (attention.h).
inline bool attention_backward_hopper_head_dim(int64_t head_dim) {
  return ::course::is_listed(kHopperBackwardHeadDims, head_dim);
}

// The tile shapes (flash_bwd_hopper_kernel.cuh's HopperBwdTraits reads these): keys per block (two
// consumer warpgroups of 64, wgmma's m), and what sets the query rows per step: a consumer thread
// holds S^T's and dP^T's accumulators (kBlockM / 2 floats each) and dK's and dV's (head_dim / 2
// each) across a step, kHopperBwdAccumulators in all whatever the head dim (the 240 registers leave
// room for P^T's and dS^T's fragments and the addresses beside them). So kBlockM = 192 - head_dim:
// 64 query rows a step at head_dim 128, 128 at head_dim 64, and the same tensor work per step (and
// per barrier) at both.
inline constexpr int kHopperBwdBlockN = 128;
inline constexpr int kHopperBwdAccumulators = 192;
// dQ's float32 sums come in tiles of 64 rows x 64 columns (one warpgroup's m64 n64 partial, in its
// register order: attention_backward_hopper_workspace); a step's kBlockM x head_dim is two of them.
inline constexpr int kHopperBwdDqRows = 64;
// Query rows are padded to whole tiles of the largest step (128 rows, head_dim 64; 64 divides it).
inline constexpr int kHopperBwdRowTile = 128;

// Query rows padded to whole steps: the per-row statistics and dQ's float32 sums are kept for
// every row of every step, so that a step's statistics are one bulk copy with nothing past the
// end, and the reductions need no row guard.
FLASH_ATTENTION_HD int64_t attention_backward_hopper_rows(int64_t seqlen_q) {
  return (seqlen_q + kHopperBwdRowTile - 1) / kHopperBwdRowTile * kHopperBwdRowTile;
}

// The packed (varlen) layout (attention.h's cu_seqlens; kVarlen below): the statistics and dQ's
// sums are indexed by packed row, each sequence's rows starting on a whole tile, so that its tiles
// are the same statistics copies and contiguous sums as a padded batch's. Sequence b's rows start
// at hopper_bwd_seq_row0(cu_seqlens_q[b], b), FlashAttention 3's padded offset: (cu_seqlens_q[b] /
// kHopperBwdRowTile + b) tiles. A sequence of length n from offset c takes ceil(n / tile) tiles,
// which end at or before the next sequence's start, since (c + n) / tile + 1 >= c / tile +
// ceil(n / tile) in integer division; and the last one ends within
// attention_backward_hopper_packed_rows(total_q, batch) rows of a head: the host sizes the workspace
// from total_q and the sequence count alone, never reading cu_seqlens. (A step of 64 rows walks
// the same 128-row tiles two steps each.)
FLASH_ATTENTION_HD int64_t hopper_bwd_seq_row0(int64_t cu_seqlen_q, int64_t b) {
  return (cu_seqlen_q / kHopperBwdRowTile + b) * kHopperBwdRowTile;
}
FLASH_ATTENTION_HD int64_t attention_backward_hopper_packed_rows(int64_t total_q, int64_t batch) {
  return (total_q / kHopperBwdRowTile + batch) * kHopperBwdRowTile;
}
// The statistics rows of the whole call: batch x heads x padded rows, or heads x packed rows.
inline int64_t attention_backward_hopper_stat_rows(const AttentionParams& p) {
  return p.cu_seqlens_q != nullptr ? p.heads * attention_backward_hopper_packed_rows(p.total_q, p.batch)
                                   : p.batch * p.heads * attention_backward_hopper_rows(p.seqlen_q);
}

// The workspace, whose contents on entry the launch never reads (its statistics kernel zeroes
// dQ's sums and writes every statistics row; only the old side kernels, HopperBwdSide::kOld, need
// the caller to zero it): dQ's float32 sums (batch x heads x padded rows x d; packed, heads x
// packed rows x d), then each padded row's lse in log2 units and D = rowsum(dO * O)
// (float32 each). The sums of 64 rows (kHopperBwdDqRows) are 64 x d contiguous floats, 64-column
// chunk after chunk, each chunk in the main kernel's register order rather than row-major (what a
// warpgroup's threads hold, stored as 512-byte warp-wide rows: flash_bwd_hopper_kernel.cuh), so
// that the kernel adds a whole step's tile (two such chunks, of columns at d = 128 and of rows at
// d = 64) with one bulk reduction; only the dispatch's last kernel reads them.
inline int64_t attention_backward_hopper_workspace(const AttentionBackwardParams& g) {
  const AttentionParams& p = g.fwd;
  return attention_backward_hopper_stat_rows(p) * (p.head_dim + 2) * 4;
}

// Shared memory one block takes (the glue compares it with the GPU's per-block limit).
int64_t attention_backward_hopper_smem_bytes(int64_t head_dim);

// The side kernels around the main one (flash_bwd_hopper_dispatch.cu), a bench-only knob,
// FLASH_ATTENTION_BWD_SIDE, read by the glue at every call (getenv is a scan of a few dozen strings,
// against a launch's microseconds), so that one process times both designs:
//   kNew ("new", or unset): the statistics kernel reads O and dO 16 bytes a thread (a row of d
//     elements is d / 8 threads) and zeroes dQ's sums in the same pass, and dQ's conversion stages
//     a 64 x 64 chunk through shared memory and writes whole rows 16 bytes a thread; element-wise
//     loads or stores, in the same kernels, where a view's pointer or strides forbid 16 bytes;
//   kElementwise ("elementwise"): kNew's kernels on their element-wise path whatever the views (the
//     tests' way to reach the fallback with the views the glue hands over, dq always contiguous);
//   kOld ("old"): the kernels before (one warp per statistics row, 2-byte loads; dQ written 4
//     bytes a thread over rows r and r + 8) on a workspace the caller zeroes;
//   kUnknown: any other value (the launcher refuses it: cudaErrorInvalidValue).
enum class HopperBwdSide { kNew, kElementwise, kOld, kUnknown };
HopperBwdSide attention_backward_hopper_side();

// bfloat16 and float16, head_dim from attention_backward_hopper_head_dim; a window or a softcap at
// kHopperBackwardHeadDims (the kWindowSoftcap instantiations), the packed layout likewise (kVarlen)
// but not both at once (cudaErrorInvalidValue: the glue sends those to "mma_dqpass"); every stepped stride of
// q, k, v and dout a non-zero multiple of 8 elements and the pointers 16-byte aligned (TMA's rules;
// the glue copies otherwise), dq, dk and dv with even strides. `workspace`:
// attention_backward_hopper_workspace bytes, zeroed for `side` kOld only. Returns the first error
// (cudaErrorNotSupported when the driver has no TMA encoder); never synchronizes or allocates.
cudaError_t launch_attention_backward_hopper(const AttentionBackwardParams& params, HopperBwdSide side,
                                             void* workspace, cudaStream_t stream);

}  // namespace flash_attention
