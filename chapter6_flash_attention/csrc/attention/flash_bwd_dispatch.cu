// The tensor-core backward's three launches: D = rowsum(dO * O) per query row, the main kernel
// (one of the instantiations in flash_bwd_<dtype>_hdim<d>.cu), and dQ from its float32 sums.
#include "flash_bwd.h"

#include <course/cuda_utils.h>
#include <course/numeric.cuh>
#include <course/reduce.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flash_attention {
namespace {

constexpr int kThreads = 256;
// Enough blocks of grid-stride work to fill an H100 (132 SMs) several times over.
constexpr int64_t kMaxBlocks = 132 * 8;

unsigned blocks_for(int64_t work, int64_t per_block) {
  const int64_t blocks = course::ceil_div(work, per_block);
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks < kMaxBlocks ? blocks : kMaxBlocks));
}

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
  // The workspace: dQ's float32 sums (atomic rung only), then D.
  float* dq_accum = dq_atomic ? static_cast<float*>(workspace) : nullptr;
  float* d_rows = static_cast<float*>(workspace) + (dq_atomic ? p.batch * p.heads * p.seqlen_q * p.head_dim : 0);
  const int64_t rows = p.batch * p.heads * p.seqlen_q;
  if (rows > 0) {
    bwd_row_dot_kernel<T><<<blocks_for(rows, kThreads / 32), kThreads, 0, stream>>>(g, d_rows);
    COURSE_CUDA_TRY(cudaGetLastError());
  }
  switch (p.head_dim) {
    case 32: COURSE_CUDA_TRY((run_flash_bwd<T, 32>(g, dq_accum, d_rows, stream))); break;
    case 64: COURSE_CUDA_TRY((run_flash_bwd<T, 64>(g, dq_accum, d_rows, stream))); break;
    case 96: COURSE_CUDA_TRY((run_flash_bwd<T, 96>(g, dq_accum, d_rows, stream))); break;
    case 128: COURSE_CUDA_TRY((run_flash_bwd<T, 128>(g, dq_accum, d_rows, stream))); break;
    default: return cudaErrorInvalidValue;  // the glue checks attention_backward_mma_head_dim first
  }
  if (dq_atomic && rows > 0) {
    bwd_dq_kernel<T><<<blocks_for(rows * p.head_dim, kThreads * 4), kThreads, 0, stream>>>(g, dq_accum);
  }
  return cudaGetLastError();
}

}  // namespace

bool attention_backward_mma_head_dim(int64_t head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128;
}

int64_t attention_backward_mma_smem_bytes(int64_t head_dim) {
  switch (head_dim) {
    case 32: return BwdTraits<32>::kSmemBytes;
    case 64: return BwdTraits<64>::kSmemBytes;
    case 96: return BwdTraits<96>::kSmemBytes;
    case 128: return BwdTraits<128>::kSmemBytes;
    default: return 0;
  }
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
