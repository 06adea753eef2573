// The Hopper backward (rung "wgmma") for __half, head dim 64: one file per dtype and head dim, so that
// the build compiles them in parallel.
#include "hopper/flash_bwd_hopper_kernel.cuh"

namespace flash_attention {
template cudaError_t run_flash_bwd_hopper<__half, 64, false, false>(const AttentionBackwardParams&, float*,
                                                                    const float*, const float*, cudaStream_t);
}  // namespace flash_attention
