// Chapter 6, part 3: the Hopper forward's rungs and entry points, without the kernel (what the
// glue and the dispatch see). Torch-free; the kernel is in flash_fwd_hopper_kernel.cuh.
#pragma once

#include "attention/attention.h"

#include <cuda_runtime_api.h>

namespace flash_attention {

// The Hopper rungs (sm_90a), each one idea on top of the last:
//   kWgmma            TMA brings Q, K, V tiles into a two-stage shared-memory ring completing on
//                     mbarriers; S = Q K^T and O += P V by wgmma (P from registers); every warp
//                     computes, one thread also issues the copies.
//   kWarpSpecialized  a producer warpgroup issues the copies, two consumer warpgroups compute;
//                     setmaxnreg moves registers to the consumers; full/empty barriers per stage.
//   kPingpong         each consumer warpgroup issues tile n - 1's P V and tile n's Q K^T together,
//                     in turns with the other warpgroup (named barriers), so that one's softmax
//                     runs under the other's products; a third shared-memory stage where it fits.
enum class HopperForward { kWgmma, kWarpSpecialized, kPingpong };

// Head dims the Hopper rungs take: attention.h's kHopperHeadDims.
inline bool attention_forward_hopper_head_dim(int64_t head_dim) { return ::course::is_listed(kHopperHeadDims, head_dim); }

// Shared memory one block takes (the glue compares it with the GPU's per-block limit).
int64_t attention_forward_hopper_smem_bytes(int64_t head_dim, HopperForward rung);

// bfloat16 and float16, head_dim from attention_forward_hopper_head_dim, scale > 0 (the softmax
// keeps each row's maximum of the raw scores, which is the maximum of the scaled ones only for a
// positive scale), every stepped stride of q, k, v a multiple of 8 elements and the pointers
// 16-byte aligned (TMA's rules; the glue checks and copies otherwise). Returns the first error
// (cudaErrorNotSupported when the driver has no TMA encoder); never synchronizes or allocates.
cudaError_t launch_attention_forward_hopper(const AttentionParams& params, HopperForward rung, cudaStream_t stream);

}  // namespace flash_attention
