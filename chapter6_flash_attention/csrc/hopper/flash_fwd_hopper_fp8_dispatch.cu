// The FP8 forward's dispatch: the runtime head dim becomes the template argument of one of the
// instantiations in flash_fwd_hopper_fp8_hdim<d>.cu.
#include "hopper/flash_fwd_hopper.h"
#include "hopper/flash_fwd_hopper_fp8.cuh"

namespace flash_attention {

template <int D>
cudaError_t run_flash_fwd_hopper_fp8(const AttentionFp8Params& p, cudaStream_t stream);

int64_t attention_fp8_smem_bytes(int64_t head_dim) {
  switch (head_dim) {
    case 64: return HopperFp8Traits<64>::kSmemBytes;
    case 128: return HopperFp8Traits<128>::kSmemBytes;
    default: return 0;
  }
}

cudaError_t launch_attention_fp8_hopper(const AttentionFp8Params& p, cudaStream_t stream) {
  if (p.attn.batch * p.attn.heads * p.attn.seqlen_q == 0) return cudaSuccess;
  switch (p.attn.head_dim) {
    case 64: return run_flash_fwd_hopper_fp8<64>(p, stream);
    case 128: return run_flash_fwd_hopper_fp8<128>(p, stream);
    default: return cudaErrorInvalidValue;  // the glue checks attention_fp8_head_dim first
  }
}

}  // namespace flash_attention
