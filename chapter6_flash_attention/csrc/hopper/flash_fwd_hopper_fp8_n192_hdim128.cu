// The FP8 forward (op attention_fp8) at head dim 128, 192-key tiles: the launcher's candidate n192
// (flash_fwd_hopper_fp8.cuh's Fp8Forward), in a file of its own so that it compiles beside the others.
#include "hopper/flash_fwd_hopper_fp8.cuh"

namespace flash_attention {
template cudaError_t run_flash_fwd_hopper_fp8<128, 192>(const AttentionFp8Params&, Fp8Forward, cudaStream_t);
}  // namespace flash_attention
