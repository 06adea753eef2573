// The FP8 forward (op attention_fp8) at head dim 128, 128-key tiles: one file per head dim and key
// tile, so that the build compiles them in parallel.
#include "hopper/flash_fwd_hopper_fp8.cuh"

namespace flash_attention {
template cudaError_t run_flash_fwd_hopper_fp8<128, 128>(const AttentionFp8Params&, Fp8Forward, cudaStream_t);
}  // namespace flash_attention
