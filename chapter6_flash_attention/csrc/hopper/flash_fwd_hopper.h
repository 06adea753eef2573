// Chapter 6, part 3: the Hopper forward's rungs and entry points, without the kernel (what the
// glue and the dispatch see). Torch-free; the kernel is in flash_fwd_hopper_kernel.cuh.
#pragma once

#include "attention/attention.h"
#include "attention/fp8.h"
#include "hopper/tile_schedule.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <string>

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
//   kPersistent       the same consumers (pingpong's schedule where its third stage fits, else
//                     warp_specialized's), in a grid of one block per SM slot that walks a list of
//                     tiles (hopper/tile_schedule.h): the producer loads the next tile's Q and
//                     first K/V stages while the consumers finish this tile and store its output.
//                     With a window or a softcap (kHopperWindowHeadDims, the padded layout) a second
//                     instantiation walks only the window's key tiles and caps the scores
//                     (flash_fwd_hopper_persistent.cuh); the other rungs take neither.
enum class HopperForward { kWgmma, kWarpSpecialized, kPingpong, kPersistent };

// Head dims the Hopper rungs take: attention.h's kHopperHeadDims.
inline bool attention_forward_hopper_head_dim(int64_t head_dim) { return ::course::is_listed(kHopperHeadDims, head_dim); }

// FlashAttention 3's intra-warpgroup overlap in the turns (HopperFwdOverlapTraits,
// HopperFwdPersistentOverlapTraits: flash_fwd_hopper_kernel.cuh) instead of the joint schedule, at
// d = 64 and 128 (where the third stage fits), "persistent" in the padded layout without a window or
// a softcap; elsewhere (d = 256, the other rungs, the packed and paged walks, windows) it does not
// apply. Which rung takes it, as measured (H200 runs of `bench_attention.py --ops
// attention_overlap`, NOTES.md): "pingpong" at both head dims, 2-10% faster than its joint schedule
// at every shape where the dispatch runs it (long rows); "persistent" at d = 64 alone, level to 6%
// faster from 512 to 8192 keys. At d = 128 the persistent overlap consumers spill (232 registers)
// and lost 13-24% at 512 keys, so there it keeps the joint schedule.
// FLASH_ATTENTION_HOPPER_OVERLAP overrides it for the bench and the tests, read at every call
// (getenv is a scan of a few dozen strings, against a launch's microseconds), so that one process
// can time and test both: 1 = both rungs overlap, 0 = neither, unset (or anything else) = the
// default above.
inline constexpr const char* kHopperOverlapEnv = "FLASH_ATTENTION_HOPPER_OVERLAP";
inline bool hopper_forward_overlap(HopperForward rung, int head_dim) {
  const char* v = std::getenv(kHopperOverlapEnv);
  if (v != nullptr && std::strcmp(v, "1") == 0) return true;
  if (v != nullptr && std::strcmp(v, "0") == 0) return false;
  return rung == HopperForward::kPingpong || (rung == HopperForward::kPersistent && head_dim == 64);
}

// Shared memory one block takes (the glue compares it with the GPU's per-block limit).
int64_t attention_forward_hopper_smem_bytes(int64_t head_dim, HopperForward rung);

// Workspace bytes a rung needs: the persistent rung's tile counter (an int, which the launcher
// clears before each launch, on the stream), and in the packed layout (p.cu_seqlens_q set) its
// schedule after it, q_tiles + 1 rank starts and batch sequence places (tile_schedule.h), counted
// from max_seqlen_q and the batch, host ints; none for the others.
inline int64_t attention_forward_hopper_workspace(const AttentionParams& p, HopperForward rung) {
  if (rung != HopperForward::kPersistent) return 0;
  if (p.cu_seqlens_q == nullptr) return static_cast<int64_t>(sizeof(int));
  const int64_t q_tiles = (p.seqlen_q + kHopperBlockM - 1) / kHopperBlockM;
  return (2 + q_tiles + p.batch) * static_cast<int64_t>(sizeof(int));
}

// bfloat16 and float16, head_dim from attention_forward_hopper_head_dim, scale > 0 (the softmax
// keeps each row's maximum of the raw scores, which is the maximum of the scaled ones only for a
// positive scale), every stepped stride of q, k, v a multiple of 8 elements and the pointers
// 16-byte aligned (TMA's rules; the glue checks and copies otherwise); `workspace` holds
// attention_forward_hopper_workspace(p, rung) bytes (may be null where that is 0). The packed layout
// (p.cu_seqlens_q set; attention.h) runs on rung kPersistent at kHopperVarlenHeadDims alone, with
// p.total_k set too, and a window or a softcap (uses_window_or_softcap) on rung kPersistent at
// kHopperWindowHeadDims in the padded layout alone (cudaErrorInvalidValue for the others). Returns the first error
// (cudaErrorNotSupported when the driver has no TMA encoder); never synchronizes or allocates.
cudaError_t launch_attention_forward_hopper(const AttentionParams& params, HopperForward rung, cudaStream_t stream,
                                            void* workspace = nullptr);

// The FP8 forward (op attention_fp8; flash_fwd_hopper_fp8.cuh): rung "pingpong"'s schedule on e4m3
// Q, K and V^T with per-tensor descale factors, bfloat16 out.
//   attn: q and k e4m3, (batch, heads, seqlen, head_dim) views as for the other rungs; v is V^T,
//         e4m3 (batch, heads_kv, head_dim, seqlen_k), with v_seq_stride the stride from one of its
//         head_dim rows to the next (a multiple of 16 bytes, as TMA needs: quantize_fp8 pads it),
//         v_head_stride and v_batch_stride as usual; o bfloat16, lse float32; dtype is ignored.
//         head_dim in kFp8HeadDims, scale > 0 (as the 16-bit rungs').
//   descale_q, descale_k, descale_v: one float each, on the device (what quantize_fp8 returned):
//         q = descale_q * q8 and so on; >= 0, so that the scaled scores keep the raw ones' maximum.
struct AttentionFp8Params {
  AttentionParams attn;
  const float* descale_q;
  const float* descale_k;
  const float* descale_v;
};
inline bool attention_fp8_head_dim(int64_t head_dim) { return ::course::is_listed(kFp8HeadDims, head_dim); }
int64_t attention_fp8_smem_bytes(int64_t head_dim);
// Why the launcher's candidate (FLASH_ATTENTION_FP8_FORWARD, read now, as the launch reads it) has
// no kernel at this head dim, naming the knob and its value; empty where it runs. The glue refuses
// the call with it before launching (the launch itself would return cudaErrorInvalidValue).
std::string attention_fp8_candidate_refusal(int64_t head_dim);
// Returns the first error (cudaErrorNotSupported without the driver's TMA encoder); never
// synchronizes or allocates.
cudaError_t launch_attention_fp8_hopper(const AttentionFp8Params& params, cudaStream_t stream);

}  // namespace flash_attention
