// The Hopper forward (rungs "wgmma", "warp_specialized", "pingpong" and "persistent") for __nv_bfloat16, head
// dim 64: one file per dtype and head dim, so that the build compiles them in parallel.
#include "hopper/flash_fwd_hopper_persistent.cuh"

namespace flash_attention {
#define INSTANTIATE(RUNG)                                                                         \
  template cudaError_t run_flash_fwd_hopper<__nv_bfloat16, 64, HopperForward::RUNG>(const AttentionParams&, \
                                                                   cudaStream_t, void*);
INSTANTIATE(kWgmma)
INSTANTIATE(kWarpSpecialized)
INSTANTIATE(kPingpong)
INSTANTIATE(kPersistent)
#undef INSTANTIATE
}  // namespace flash_attention
