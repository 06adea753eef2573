// The tensor-core forward (rungs "mma", "pipelined", "tuned" and "split_kv") for __nv_bfloat16,
// head dim 128: one file per dtype and head dim, so that the build compiles them in parallel
// (FlashAttention 2's layout).
#include "flash_fwd_kernel.cuh"

namespace flash_attention {
template cudaError_t run_flash_fwd<__nv_bfloat16, 128, MmaForward::kMma>(const AttentionParams&, const FwdSplit&,
                                                                         cudaStream_t);
template cudaError_t run_flash_fwd<__nv_bfloat16, 128, MmaForward::kPipelined>(const AttentionParams&, const FwdSplit&,
                                                                               cudaStream_t);
template cudaError_t run_flash_fwd<__nv_bfloat16, 128, MmaForward::kTuned>(const AttentionParams&, const FwdSplit&,
                                                                           cudaStream_t);
template cudaError_t run_flash_fwd<__nv_bfloat16, 128, MmaForward::kSplitKv>(const AttentionParams&, const FwdSplit&,
                                                                             cudaStream_t);
}  // namespace flash_attention
