// The Hopper forward (rungs "wgmma", "warp_specialized" and "pingpong") for __half, head dim 64:
// one file per dtype and head dim, so that the build compiles them in parallel.
#include "hopper/flash_fwd_hopper_kernel.cuh"

namespace flash_attention {
template cudaError_t run_flash_fwd_hopper<__half, 64, HopperForward::kWgmma>(const AttentionParams&, cudaStream_t);
template cudaError_t run_flash_fwd_hopper<__half, 64, HopperForward::kWarpSpecialized>(const AttentionParams&,
                                                                                    cudaStream_t);
template cudaError_t run_flash_fwd_hopper<__half, 64, HopperForward::kPingpong>(const AttentionParams&, cudaStream_t);
}  // namespace flash_attention
