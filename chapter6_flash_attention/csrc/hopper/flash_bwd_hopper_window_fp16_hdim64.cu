// The Hopper backward (rung "wgmma") with a window or a softcap (the kWindowSoftcap instantiation)
// for __half, head dim 64: one file per dtype, head dim and feature, so that the build compiles them in
// parallel, apart from the plain instantiations.
#include "hopper/flash_bwd_hopper_kernel.cuh"

namespace flash_attention {
template cudaError_t run_flash_bwd_hopper<__half, 64, true, false>(const AttentionBackwardParams&, float*,
                                                                   const float*, const float*, cudaStream_t);
}  // namespace flash_attention
