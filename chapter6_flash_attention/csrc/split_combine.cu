// The split-KV combine (attention.h, SplitCombineParams): the last step of flash-decoding, shared
// by the forward's rung "split_kv" and the paged decode's v3.
//
// Each split of a row left a partial output o_s, normalised by its own sum, and lse_s, the log of
// that sum (in the units of the scores). The row's softmax over all its keys is then
//   lse = log sum_s exp(lse_s)   and   o = sum_s exp(lse_s - lse) o_s,
// which is chapter 3's online softmax with splits in place of key tiles: the (max, sum) pair of
// course/reduce.cuh's OnlineSoftmaxOp, folded over the splits' lse, gives lse without overflow.
//
// One warp per row: its lanes fold the splits' lse (a few dozen at most) into the warp's (max,
// sum), then each lane owns head_dim / 32 columns and walks the splits, so a warp reads one
// split's row of 128 floats as one coalesced 512-byte request. The partials are read once and
// are splits x larger than the output: the combine costs about one more pass over them, which
// is why the split count is kept to what fills the GPU (attention_forward_splits).
//
// No torch headers: this file builds with a bare `nvcc -c`.
#include "../attention.h"

#include <course/cuda_utils.h>
#include <course/dtype.h>
#include <course/numeric.cuh>
#include <course/reduce.cuh>

#include <cmath>

namespace flash_attention {
namespace {

constexpr int kCombineWarps = 4;

template <typename T>
__global__ void __launch_bounds__(kCombineWarps * 32) split_combine_kernel(const SplitCombineParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kCombineWarps;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kCombineWarps + threadIdx.x / 32; row < p.rows;
       row += warps) {
    course::MaxSum<float> state = course::OnlineSoftmaxOp<float>::identity();
    for (int64_t s = lane; s < p.splits; s += 32) {
      state = course::OnlineSoftmaxOp<float>{}(state, {p.lse_partial[s * p.rows + row], 1.f});
    }
    state = course::warp_reduce(state, course::OnlineSoftmaxOp<float>{});
    // Every split of the row saw no visible key: o = 0 and lse = -inf, as the unsplit kernel
    // writes for such a row (attention.h).
    const bool empty = state.m == -INFINITY;
    const float lse = empty ? -INFINITY : state.m + logf(state.s);

    const int64_t bh = row / p.seqlen;
    const int64_t i = row % p.seqlen;
    T* out = static_cast<T*>(p.out) + (bh / p.heads) * p.out_batch_stride + (bh % p.heads) * p.out_head_stride +
             i * p.out_seq_stride;
    for (int64_t col = lane; col < p.head_dim; col += 32) {
      float acc = 0.f;
      if (!empty) {
        for (int64_t s = 0; s < p.splits; ++s) {
          const float lse_s = p.lse_partial[s * p.rows + row];
          // An empty split's weight is exp(-inf) = 0; skipping it also skips its o_s read.
          if (lse_s != -INFINITY) acc += expf(lse_s - lse) * p.o_partial[(s * p.rows + row) * p.head_dim + col];
        }
      }
      out[col] = course::from_acc<T>(acc);
    }
    if (p.lse != nullptr && lane == 0) p.lse[row] = lse;
  }
}

}  // namespace

cudaError_t launch_split_combine(const SplitCombineParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  int64_t resident = 0;
  COURSE_CUDA_TRY(course::resident_threads(&resident));
  // A warp per row, grid-strided: no more blocks than the GPU keeps resident.
  const int64_t wanted = course::ceil_div(p.rows, static_cast<int64_t>(kCombineWarps));
  const int64_t cap = resident / (kCombineWarps * 32);
  const unsigned blocks = static_cast<unsigned>(wanted < cap ? wanted : cap);
  switch (p.dtype) {
    case DType::kBFloat16:
      split_combine_kernel<__nv_bfloat16><<<blocks, kCombineWarps * 32, 0, stream>>>(p);
      break;
    case DType::kFloat16:
      split_combine_kernel<__half><<<blocks, kCombineWarps * 32, 0, stream>>>(p);
      break;
    default: return cudaErrorInvalidValue;  // the split kernels are the tensor-core and decode ones: 16-bit
  }
  return cudaGetLastError();
}

}  // namespace flash_attention
