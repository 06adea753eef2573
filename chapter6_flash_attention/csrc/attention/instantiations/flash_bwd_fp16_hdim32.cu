// The tensor-core backward (rung "mma") for __half, head dim 32: one file per dtype and head dim,
// as for the forward.
#include "flash_bwd_kernel.cuh"

namespace flash_attention {
template cudaError_t run_flash_bwd<__half, 32>(const AttentionBackwardParams&, float*, const float*, cudaStream_t);
}  // namespace flash_attention
