// The Hopper forward with a window or a softcap (rung "persistent"'s kWindowSoftcap instantiation,
// flash_fwd_hopper_persistent.cuh) for __half, head dim 64: one file per dtype and head dim, so that
// the build compiles them in parallel, apart from the plain instantiations.
#include "hopper/flash_fwd_hopper_persistent.cuh"

namespace flash_attention {
template cudaError_t run_flash_fwd_hopper_window<__half, 64>(const AttentionParams&, cudaStream_t, void*);
}  // namespace flash_attention
