// The Hopper backward (rung "wgmma") in the packed (varlen) layout (the kVarlen instantiation)
// for __nv_bfloat16, head dim 64: one file per dtype, head dim and feature, so that the build compiles them in
// parallel, apart from the plain instantiations.
#include "hopper/flash_bwd_hopper_kernel.cuh"

namespace flash_attention {
template cudaError_t run_flash_bwd_hopper<__nv_bfloat16, 64, false, true>(const AttentionBackwardParams&, float*,
                                                                          const float*, const float*, cudaStream_t);
}  // namespace flash_attention
