// The split-KV combine (attention.h, SplitCombineParams): the last step of flash-decoding, shared
// by the forward's rung "split_kv" and the paged decode's v3.
//
// Each split of a row left a partial output o_s, normalised by its own sum, and lse_s, the log of
// that sum (in the units of the scores). The row's softmax over all its keys is then
//   lse = log sum_s exp(lse_s)   and   o = sum_s exp(lse_s - lse) o_s,
// which is chapter 3's online softmax with splits in place of key tiles: the (max, sum) pair of
// course/reduce.cuh's OnlineSoftmaxOp, folded over the splits' lse, gives lse without overflow.
//
// One block per row. Warp 0 folds the splits' lse (a few dozen, at most a few hundred) into the
// row's (max, sum) and writes each split's weight exp(lse_s - lse) to shared memory once; then
// every thread owns one float4 of columns and one residue class of splits, so a block has
// head_dim / 4 x (128 / (head_dim / 4)) independent 16-byte loads in flight instead of a warp
// walking the splits one dependent load at a time (measured: ~1 us per split with one warp per
// row, which at batch 1 was a fifth of the decode). The residue classes are summed through
// shared memory at the end. The partials are read once and are splits x larger than the output:
// the combine costs about one more pass over them, which is why the split count is kept to what
// fills the GPU (attention_forward_splits, paged_attention_splits).
//
// No torch headers: this file builds with a bare `nvcc -c`.
#include "attention/attention.h"

#include <course/cuda_utils.h>
#include <course/dtype.h>
#include <course/numeric.cuh>
#include <course/reduce.cuh>

#include <cmath>

namespace flash_attention {
namespace {

constexpr int kCombineThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kCombineThreads) split_combine_kernel(const SplitCombineParams p) {
  extern __shared__ float smem[];
  float* weight = smem;               // [splits]
  float4* partial_sums = reinterpret_cast<float4*>(smem + ((p.splits + 3) & ~3LL));  // [phases][head_dim / 4]
  __shared__ float row_lse;
  const int64_t row = blockIdx.x;
  const int quads = static_cast<int>(p.head_dim / 4);
  const int phases = kCombineThreads / quads;

  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    course::MaxSum<float> state = course::OnlineSoftmaxOp<float>::identity();
    for (int64_t s = lane; s < p.splits; s += 32) {
      state = course::OnlineSoftmaxOp<float>{}(state, {p.lse_partial[s * p.rows + row], 1.f});
    }
    state = course::warp_reduce(state, course::OnlineSoftmaxOp<float>{});
    // Every split of the row saw no visible key: o = 0 and lse = -inf, as the unsplit kernel
    // writes for such a row (attention.h); every weight is then 0 as well.
    const bool empty = state.m == -INFINITY;
    const float lse = empty ? -INFINITY : state.m + logf(state.s);
    // An empty split (lse_s = -inf) weighs exp(-inf) = 0.
    for (int64_t s = lane; s < p.splits; s += 32) {
      weight[s] = empty ? 0.f : expf(p.lse_partial[s * p.rows + row] - lse);
    }
    if (lane == 0) row_lse = lse;
  }
  // The weights and the row's lse are written by warp 0 and read by every thread below.
  __syncthreads();

  const int quad = threadIdx.x % quads;
  const int phase = threadIdx.x / quads;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  // Threads past phases * quads (head_dim / 4 not dividing 128, e.g. 96) have no class of splits.
  if (phase < phases) {
    const float4* o = reinterpret_cast<const float4*>(p.o_partial) + row * quads + quad;
    const int64_t split_stride = p.rows * quads;
#pragma unroll 4
    for (int64_t s = phase; s < p.splits; s += phases) {
      const float w = weight[s];
      // A weight of 0 (an empty split, which may not have written its o_s) is skipped, not
      // multiplied: 0 * NaN is NaN. The branch is uniform across the block (one s for all).
      if (w == 0.f) continue;
      const float4 v = o[s * split_stride];
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
    }
    partial_sums[phase * quads + quad] = acc;
  }
  // Every phase's sums are in shared memory before phase 0 adds them up.
  __syncthreads();
  if (phase != 0) return;
  for (int k = 1; k < phases; ++k) {
    const float4 v = partial_sums[k * quads + quad];
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  }
  const int64_t bh = row / p.seqlen;
  const int64_t i = row % p.seqlen;
  T* out = static_cast<T*>(p.out) + (bh / p.heads) * p.out_batch_stride + (bh % p.heads) * p.out_head_stride +
           i * p.out_seq_stride + 4 * quad;
  out[0] = course::from_acc<T>(acc.x);
  out[1] = course::from_acc<T>(acc.y);
  out[2] = course::from_acc<T>(acc.z);
  out[3] = course::from_acc<T>(acc.w);
  if (p.lse != nullptr && quad == 0) p.lse[row] = row_lse;
}

}  // namespace

cudaError_t launch_split_combine(const SplitCombineParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  // float4 columns (the partials' rows are then 16-byte aligned), and a row's quads in one block.
  if (p.head_dim % 4 != 0 || p.head_dim / 4 > kCombineThreads || p.rows > INT32_MAX) return cudaErrorInvalidValue;
  const int64_t quads = p.head_dim / 4;
  const size_t smem = (((p.splits + 3) & ~3LL) + (kCombineThreads / quads) * p.head_dim) * sizeof(float);
  const unsigned blocks = static_cast<unsigned>(p.rows);
  switch (p.dtype) {
    case DType::kBFloat16:
      split_combine_kernel<__nv_bfloat16><<<blocks, kCombineThreads, smem, stream>>>(p);
      break;
    case DType::kFloat16:
      split_combine_kernel<__half><<<blocks, kCombineThreads, smem, stream>>>(p);
      break;
    default: return cudaErrorInvalidValue;  // the split kernels are the tensor-core and decode ones: 16-bit
  }
  return cudaGetLastError();
}

}  // namespace flash_attention
