// The tensor-core forward's dispatch: the runtime dtype and head dim become the template
// arguments of one of the instantiations in flash_fwd_<dtype>_hdim<d>.cu.
#include "flash_fwd.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flash_attention {
namespace {

template <typename T, bool kPipelined>
cudaError_t with_head_dim(const AttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 32: return run_flash_fwd<T, 32, kPipelined>(p, stream);
    case 64: return run_flash_fwd<T, 64, kPipelined>(p, stream);
    case 96: return run_flash_fwd<T, 96, kPipelined>(p, stream);
    case 128: return run_flash_fwd<T, 128, kPipelined>(p, stream);
    case 256: return run_flash_fwd<T, 256, kPipelined>(p, stream);
    default: return cudaErrorInvalidValue;  // the glue checks kCudaHeadDims first
  }
}

template <bool kPipelined>
cudaError_t with_dtype(const AttentionParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kBFloat16: return with_head_dim<__nv_bfloat16, kPipelined>(p, stream);
    case DType::kFloat16: return with_head_dim<__half, kPipelined>(p, stream);
    default: return cudaErrorInvalidValue;  // the glue sends float32 and float64 to the scalar rungs
  }
}

}  // namespace

int64_t attention_forward_mma_smem_bytes(int64_t head_dim, bool pipelined) {
  switch (head_dim) {
    case 32: return pipelined ? FwdTraits<32, true>::kSmemBytes : FwdTraits<32, false>::kSmemBytes;
    case 64: return pipelined ? FwdTraits<64, true>::kSmemBytes : FwdTraits<64, false>::kSmemBytes;
    case 96: return pipelined ? FwdTraits<96, true>::kSmemBytes : FwdTraits<96, false>::kSmemBytes;
    case 128: return pipelined ? FwdTraits<128, true>::kSmemBytes : FwdTraits<128, false>::kSmemBytes;
    case 256: return pipelined ? FwdTraits<256, true>::kSmemBytes : FwdTraits<256, false>::kSmemBytes;
    default: return 0;
  }
}

cudaError_t launch_attention_forward_mma(const AttentionParams& p, bool pipelined, cudaStream_t stream) {
  if (p.batch * p.heads * p.seqlen_q == 0) return cudaSuccess;
  return pipelined ? with_dtype<true>(p, stream) : with_dtype<false>(p, stream);
}

}  // namespace flash_attention
