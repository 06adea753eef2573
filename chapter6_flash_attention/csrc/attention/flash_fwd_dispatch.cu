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

// Query rows per tile of the tuned rung (which runs unless splitting pays) and of the split one,
// and keys per tile of the split one.
struct SplitTiles {
  int64_t tuned_rows, split_rows, split_keys;
};
template <int D>
SplitTiles split_tiles() {
  return {FwdTraits<D, MmaForward::kTuned>::kBlockM, FwdTraits<D, MmaForward::kSplitKv>::kBlockM,
          FwdTraits<D, MmaForward::kSplitKv>::kBlockN};
}

}  // namespace

int64_t attention_forward_mma_smem_bytes(int64_t head_dim, MmaForward rung) {
  return course::with_listed<kCudaHeadDims>(head_dim, int64_t{0},
                                            [&](auto d) { return smem_bytes<decltype(d)::value>(rung); });
}

// How many key ranges make the grid fill the GPU (FlashAttention 2 decides the same way, in its
// num_splits_heuristic). A grid of tuned blocks that already fills 80% of one wave (two blocks per
// SM: flash_fwd.h) is not split. Otherwise the split rung's `blocks` (batch, head, 64-row tile)
// blocks times s splits run in waves of `slots`; the last wave of a grid is partly idle, so s is
// judged by the fraction of its waves' slots it keeps busy, waves / ceil(waves), and the fewest
// splits within 15% of the best fraction win: each split costs its partials' float32 writes and a
// share of the combine. Keys too few for two tiles per split are not split either.
int64_t attention_forward_splits(const AttentionParams& p, int sms) {
  const SplitTiles tiles = course::with_listed<kCudaHeadDims>(
      p.head_dim, SplitTiles{}, [](auto d) { return split_tiles<decltype(d)::value>(); });
  if (tiles.tuned_rows == 0) return 1;  // a head dim nobody compiled: nothing to split
  const int64_t slots = 2 * static_cast<int64_t>(sms);
  const int64_t tuned_blocks = p.batch * p.heads * course::ceil_div(p.seqlen_q, tiles.tuned_rows);
  if (tuned_blocks == 0 || 5 * tuned_blocks >= 4 * slots) return 1;
  const int64_t blocks = p.batch * p.heads * course::ceil_div(p.seqlen_q, tiles.split_rows);
  const int64_t key_tiles = course::ceil_div(p.seqlen_k, tiles.split_keys);
  const int64_t most = std::min<int64_t>({128, key_tiles / 2, course::ceil_div(4 * slots, blocks)});
  auto busy = [&](int64_t s) {
    const double waves = static_cast<double>(blocks * s) / static_cast<double>(slots);
    return waves / std::ceil(waves);
  };
  double best = 0.0;
  for (int64_t s = 1; s <= most; ++s) best = std::max(best, busy(s));
  for (int64_t s = 1; s <= most; ++s) {
    if (busy(s) >= 0.85 * best) return s;
  }
  return 1;
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
