// The tensor-core backward (rung "mma") for __nv_bfloat16, head dim 64: one file per dtype and head dim,
// as for the forward.
#include "flash_bwd_kernel.cuh"

namespace flash_attention {
template cudaError_t run_flash_bwd<__nv_bfloat16, 64>(const AttentionBackwardParams&, float*, const float*, cudaStream_t);
}  // namespace flash_attention
