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
// consumer warpgroups of 64, wgmma's m) and query rows per step.
inline constexpr int kHopperBwdBlockN = 128;
inline constexpr int kHopperBwdBlockM = 64;

// Query rows padded to whole steps: the per-row statistics and dQ's float32 sums are kept for
// every row of every step, so that a step's statistics are one 256-byte bulk copy with nothing
// past the end, and the atomics need no row guard.
inline int64_t attention_backward_hopper_rows(int64_t seqlen_q) {
  return ::course::ceil_div(seqlen_q, int64_t{kHopperBwdBlockM}) * kHopperBwdBlockM;
}

// The workspace, which the caller zeroes: dQ's float32 sums (batch x heads x padded rows x d),
// then each padded row's lse in log2 units and D = rowsum(dO * O) (float32 each). The sums of one
// (batch, head, query tile) are kBlockM x d contiguous floats, 64-column chunk after chunk, each
// chunk in the main kernel's register order rather than row-major (what a warpgroup's threads
// hold, stored as 512-byte warp-wide rows: flash_bwd_hopper_kernel.cuh), so that the kernel adds
// a whole tile with one bulk reduction; only the dispatch's last kernel reads them.
inline int64_t attention_backward_hopper_workspace(const AttentionBackwardParams& g) {
  const AttentionParams& p = g.fwd;
  return p.batch * p.heads * attention_backward_hopper_rows(p.seqlen_q) * (p.head_dim + 2) * 4;
}

// Shared memory one block takes (the glue compares it with the GPU's per-block limit).
int64_t attention_backward_hopper_smem_bytes(int64_t head_dim);

// bfloat16 and float16, head_dim from attention_backward_hopper_head_dim, every stepped stride of
// q, k, v and dout a non-zero multiple of 8 elements and the pointers 16-byte aligned (TMA's rules;
// the glue copies otherwise), dq, dk and dv with even strides. `workspace`:
// attention_backward_hopper_workspace bytes, zeroed. Returns the first error
// (cudaErrorNotSupported when the driver has no TMA encoder); never synchronizes or allocates.
cudaError_t launch_attention_backward_hopper(const AttentionBackwardParams& params, void* workspace,
                                             cudaStream_t stream);

}  // namespace flash_attention
