// The tensor-core backward's three launches: D = rowsum(dO * O) per query row, the main kernel (one
// of the instantiations in instantiations/flash_bwd_<dtype>_hdim<d>.cu), and dQ from its float32
// sums.
#include "attention/flash_bwd.h"

#include <course/cuda_utils.h>
#include <course/numeric.cuh>
#include <course/reduce.cuh>
#include <course/static_switch.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flash_attention {
namespace {

constexpr int kThreads = 256;

// D[(b * heads + h) * seqlen_q + i] = sum over d of dO * O in float32, one warp per row (the
// lanes take every 32nd element of the row, then a warp sum): the dS = P (dP - D) term, read
// by the main kernel once per key tile instead of recomputed from two rows of d elements.
template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_row_dot_kernel(const AttentionBackwardParams g, float* d_rows) {
  const AttentionParams& p = g.fwd;
  const int64_t rows = p.batch * p.heads * p.seqlen_q;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32; r < rows; r += warps) {
    const int64_t bh = r / p.seqlen_q;
    const int64_t i = r % p.seqlen_q;
    const int64_t b = bh / p.heads;
    const int64_t h = bh % p.heads;
    const T* o = static_cast<const T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + i * p.o_seq_stride;
    const T* dout = static_cast<const T*>(g.dout) + b * g.do_batch_stride + h * g.do_head_stride + i * g.do_seq_stride;
    float sum = 0.f;
    for (int64_t c = lane; c < p.head_dim; c += 32) sum += course::to_acc(o[c]) * course::to_acc(dout[c]);
    sum = course::warp_reduce(sum, course::SumOp<float>{});
    if (lane == 0) d_rows[r] = sum;
  }
}

// dq = scale * (the float32 sums), rounded once to T, in dq's strides.
template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_dq_kernel(const AttentionBackwardParams g, const float* dq_accum) {
  const AttentionParams& p = g.fwd;
  const int64_t total = p.batch * p.heads * p.seqlen_q * p.head_dim;
  const float scale = static_cast<float>(p.scale);
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t c = e % p.head_dim;
    const int64_t r = e / p.head_dim;
    const int64_t bh = r / p.seqlen_q;
    const int64_t i = r % p.seqlen_q;
    T* dq = static_cast<T*>(g.dq) + (bh / p.heads) * g.dq_batch_stride + (bh % p.heads) * g.dq_head_stride +
            i * g.dq_seq_stride;
    dq[c] = course::from_acc<T>(dq_accum[e] * scale);
  }
}

template <typename T>
cudaError_t launch(const AttentionBackwardParams& g, bool dq_atomic, void* workspace, cudaStream_t stream) {
  const AttentionParams& p = g.fwd;
  // The workspace: dQ's float32 sums (atomic rung only), then D, one row per lse row.
  const int64_t rows = stat_rows(p);
  float* dq_accum = dq_atomic ? static_cast<float*>(workspace) : nullptr;
  float* d_rows = static_cast<float*>(workspace) + (dq_atomic ? rows * p.head_dim : 0);
  // The two row kernels walk the statistics' rows. Packed, those are (heads, total_q), which is the
  // padded layout of a batch of one sequence of total_q tokens (the batch strides are 0): the same
  // kernels, with no need to know where a sequence starts.
  AttentionBackwardParams by_rows = g;
  if (p.cu_seqlens_q != nullptr) {
    by_rows.fwd.batch = 1;
    by_rows.fwd.seqlen_q = p.total_q;
  }
  // The two grid-stride kernels' grids come from this GPU's SM count (attention.h).
  int sms = 0;
  COURSE_CUDA_TRY(course::sm_count(&sms));
  if (rows > 0) {
    const int64_t blocks = grid_stride_blocks(rows, kThreads / 32, sms);
    bwd_row_dot_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(by_rows, d_rows);
    COURSE_CUDA_TRY(cudaGetLastError());
  }
  // The glue checks kMmaBackwardHeadDims first: the fallback answers a call from C++ alone.
  COURSE_CUDA_TRY(course::with_listed<kMmaBackwardHeadDims>(p.head_dim, cudaErrorInvalidValue, [&](auto d) {
    return run_flash_bwd<T, decltype(d)::value>(g, dq_accum, d_rows, stream);
  }));
  if (dq_atomic && rows > 0) {
    const int64_t blocks = grid_stride_blocks(rows * p.head_dim, kThreads * 4, sms);
    bwd_dq_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(by_rows, dq_accum);
  }
  return cudaGetLastError();
}

}  // namespace

int64_t attention_backward_mma_smem_bytes(int64_t head_dim) {
  return course::with_listed<kMmaBackwardHeadDims>(
      head_dim, int64_t{0}, [](auto d) -> int64_t { return BwdTraits<decltype(d)::value>::kSmemBytes; });
}

cudaError_t launch_attention_backward_mma(const AttentionBackwardParams& g, bool dq_atomic, void* workspace,
                                          cudaStream_t stream) {
  switch (g.fwd.dtype) {
    case DType::kBFloat16: return launch<__nv_bfloat16>(g, dq_atomic, workspace, stream);
    case DType::kFloat16: return launch<__half>(g, dq_atomic, workspace, stream);
    default: return cudaErrorInvalidValue;  // the glue sends float32 and float64 to "naive"
  }
}

}  // namespace flash_attention
