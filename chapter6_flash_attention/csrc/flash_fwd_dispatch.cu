// The tensor-core forward's dispatch: the runtime dtype and head dim become the template
// arguments of one of the instantiations in flash_fwd_<dtype>_hdim<d>.cu.
#include "flash_fwd.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flash_attention {
namespace {

template <typename T, MmaForward kRung>
cudaError_t with_head_dim(const AttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 32: return run_flash_fwd<T, 32, kRung>(p, stream);
    case 64: return run_flash_fwd<T, 64, kRung>(p, stream);
    case 96: return run_flash_fwd<T, 96, kRung>(p, stream);
    case 128: return run_flash_fwd<T, 128, kRung>(p, stream);
    case 256: return run_flash_fwd<T, 256, kRung>(p, stream);
    default: return cudaErrorInvalidValue;  // the glue checks kCudaHeadDims first
  }
}

template <MmaForward kRung>
cudaError_t with_dtype(const AttentionParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kBFloat16: return with_head_dim<__nv_bfloat16, kRung>(p, stream);
    case DType::kFloat16: return with_head_dim<__half, kRung>(p, stream);
    default: return cudaErrorInvalidValue;  // the glue sends float32 and float64 to the scalar rungs
  }
}

}  // namespace

template <int D>
int64_t smem_bytes(MmaForward rung) {
  switch (rung) {
    case MmaForward::kMma: return FwdTraits<D, MmaForward::kMma>::kSmemBytes;
    case MmaForward::kPipelined: return FwdTraits<D, MmaForward::kPipelined>::kSmemBytes;
    case MmaForward::kTuned: return FwdTraits<D, MmaForward::kTuned>::kSmemBytes;
  }
  return 0;
}

int64_t attention_forward_mma_smem_bytes(int64_t head_dim, MmaForward rung) {
  switch (head_dim) {
    case 32: return smem_bytes<32>(rung);
    case 64: return smem_bytes<64>(rung);
    case 96: return smem_bytes<96>(rung);
    case 128: return smem_bytes<128>(rung);
    case 256: return smem_bytes<256>(rung);
    default: return 0;
  }
}

cudaError_t launch_attention_forward_mma(const AttentionParams& p, MmaForward rung, cudaStream_t stream) {
  if (p.batch * p.heads * p.seqlen_q == 0) return cudaSuccess;
  switch (rung) {
    case MmaForward::kMma: return with_dtype<MmaForward::kMma>(p, stream);
    case MmaForward::kPipelined: return with_dtype<MmaForward::kPipelined>(p, stream);
    case MmaForward::kTuned: return with_dtype<MmaForward::kTuned>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace flash_attention
