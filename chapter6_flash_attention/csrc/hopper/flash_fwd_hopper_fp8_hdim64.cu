// The FP8 forward (op attention_fp8) at head dim 64: one file per head dim, so that the build
// compiles them in parallel.
#include "hopper/flash_fwd_hopper_fp8.cuh"

namespace flash_attention {
template cudaError_t run_flash_fwd_hopper_fp8<64>(const AttentionFp8Params&, cudaStream_t);
}  // namespace flash_attention
