// The tensor-core forward's dispatch: the runtime dtype and head dim become the template
// arguments of one of the instantiations in instantiations/flash_fwd_<dtype>_hdim<d>.cu.
#include "attention/flash_fwd.h"

#include <course/cuda_utils.h>
#include <course/static_switch.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

namespace flash_attention {
namespace {

// The glue checks kCudaHeadDims (and sends float32 and float64 to the scalar rungs) first: the
// fallbacks below answer only a launcher called from C++ with what nobody compiled.
template <typename T, MmaForward kRung>
cudaError_t with_head_dim(const AttentionParams& p, const FwdSplit& split, cudaStream_t stream) {
  return course::with_listed<kCudaHeadDims>(p.head_dim, cudaErrorInvalidValue, [&](auto d) {
    return run_flash_fwd<T, decltype(d)::value, kRung>(p, split, stream);
  });
}

template <MmaForward kRung>
cudaError_t with_dtype(const AttentionParams& p, const FwdSplit& split, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kBFloat16: return with_head_dim<__nv_bfloat16, kRung>(p, split, stream);
    case DType::kFloat16: return with_head_dim<__half, kRung>(p, split, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <int D>
int64_t smem_bytes(MmaForward rung) {
  switch (rung) {
    case MmaForward::kMma: return FwdTraits<D, MmaForward::kMma>::kSmemBytes;
    case MmaForward::kPipelined: return FwdTraits<D, MmaForward::kPipelined>::kSmemBytes;
    case MmaForward::kTuned: return FwdTraits<D, MmaForward::kTuned>::kSmemBytes;
    case MmaForward::kSplitKv: return FwdTraits<D, MmaForward::kSplitKv>::kSmemBytes;
  }
  return 0;
}

// attention.h's forward_tiles, which the split rule reads on any machine, must be these kernels'
// tiles: checked here, at compile time, for every head dim.
template <int D>
constexpr bool tiles_agree() {
  constexpr ForwardTiles t = forward_tiles(D);
  return t.tuned_rows == FwdTraits<D, MmaForward::kTuned>::kBlockM &&
         t.split_rows == FwdTraits<D, MmaForward::kSplitKv>::kBlockM &&
         t.split_keys == FwdTraits<D, MmaForward::kSplitKv>::kBlockN;
}
static_assert(tiles_agree<32>() && tiles_agree<64>() && tiles_agree<96>() && tiles_agree<128>() && tiles_agree<256>(),
              "forward_tiles (attention.h) must match FwdTraits (flash_fwd.h)");

}  // namespace

int64_t attention_forward_mma_smem_bytes(int64_t head_dim, MmaForward rung) {
  return course::with_listed<kCudaHeadDims>(head_dim, int64_t{0},
                                            [&](auto d) { return smem_bytes<decltype(d)::value>(rung); });
}

cudaError_t launch_attention_forward_mma(const AttentionParams& p, MmaForward rung, cudaStream_t stream,
                                         int64_t splits, void* workspace) {
  if (p.batch * p.heads * p.seqlen_q == 0) return cudaSuccess;
  FwdSplit split;
  if (rung == MmaForward::kSplitKv) {
    // One range is rung "tuned" exactly, so the split kernel runs only when it splits.
    if (splits <= 1) return with_dtype<MmaForward::kTuned>(p, split, stream);
    if (workspace == nullptr) return cudaErrorInvalidValue;
    split.splits = splits;
    split.workspace = static_cast<float*>(workspace);
  }
  switch (rung) {
    case MmaForward::kMma: return with_dtype<MmaForward::kMma>(p, split, stream);
    case MmaForward::kPipelined: return with_dtype<MmaForward::kPipelined>(p, split, stream);
    case MmaForward::kTuned: return with_dtype<MmaForward::kTuned>(p, split, stream);
    case MmaForward::kSplitKv: return with_dtype<MmaForward::kSplitKv>(p, split, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace flash_attention
