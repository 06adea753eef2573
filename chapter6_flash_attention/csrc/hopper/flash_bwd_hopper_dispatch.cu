// The Hopper backward's launches (rung "wgmma"): the padded per-row statistics (lse in log2
// units and D = rowsum(dO * O)), the main kernel (one of the instantiations in
// flash_bwd_hopper_<dtype>_hdim<d>.cu, flash_bwd_hopper_window_<dtype>_hdim<d>.cu with a window or
// a softcap, flash_bwd_hopper_varlen_<dtype>_hdim<d>.cu in the packed layout), and dQ from its
// float32 sums.
#include "hopper/flash_bwd_hopper.h"
#include "hopper/flash_bwd_hopper_kernel.cuh"

#include <course/cuda_utils.h>
#include <course/numeric.cuh>
#include <course/reduce.cuh>
#include <course/static_switch.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flash_attention {

// Instantiated in flash_bwd_hopper_<dtype>_hdim<d>.cu and its window_ and varlen_ twins, one file
// each, compiled in parallel: extern here, so that this file (which includes the kernel for
// HopperBwdTraits' sizes) does not compile them all again.
#define FLASH_BWD_HOPPER_EXTERN(T, D, W, V)                                                            \
  extern template cudaError_t run_flash_bwd_hopper<T, D, W, V>(const AttentionBackwardParams&, float*, \
                                                               const float*, const float*, cudaStream_t);
#define FLASH_BWD_HOPPER_EXTERN_ALL(T, D)      \
  FLASH_BWD_HOPPER_EXTERN(T, D, false, false) \
  FLASH_BWD_HOPPER_EXTERN(T, D, true, false)  \
  FLASH_BWD_HOPPER_EXTERN(T, D, false, true)
FLASH_BWD_HOPPER_EXTERN_ALL(__nv_bfloat16, 64)
FLASH_BWD_HOPPER_EXTERN_ALL(__nv_bfloat16, 128)
FLASH_BWD_HOPPER_EXTERN_ALL(__half, 64)
FLASH_BWD_HOPPER_EXTERN_ALL(__half, 128)
#undef FLASH_BWD_HOPPER_EXTERN_ALL
#undef FLASH_BWD_HOPPER_EXTERN

namespace {

constexpr int kThreads = 256;

// Packed: the sequence whose rows hold statistics row `pr` of a head (flash_bwd_hopper.h's
// hopper_bwd_seq_row0, which grows by at least a tile from one sequence to the next, empty ones
// included): the last b whose first row is at or before pr, by bisection over cu_seqlens_q. Row pr
// is then the sequence's row pr - hopper_bwd_seq_row0(...), a padding row at or past its length.
__device__ __forceinline__ int64_t packed_sequence(const AttentionParams& p, int64_t pr) {
  int64_t lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (hopper_bwd_seq_row0(p.cu_seqlens_q[mid], mid) <= pr) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Where statistics row pr of a head, in sequence b's rows (packed_sequence), lands in the packed
// tensors: its token, or -1 for a padding row (past the sequence's length, clamped at 0 as
// varlen.cuh's sequence_params clamps it).
__device__ __forceinline__ int64_t packed_token(const AttentionParams& p, int64_t b, int64_t pr) {
  const int64_t q0 = p.cu_seqlens_q[b];
  const int64_t len = max(int64_t{0}, p.cu_seqlens_q[b + 1] - q0);
  const int64_t i = pr - hopper_bwd_seq_row0(q0, b);
  return i < len ? q0 + i : -1;
}

// Row r = (b * heads + h) * rows_pad + i of the padded statistics, one warp per row: for a real
// row, lse2 = lse log2(e) (+inf where lse is -inf: a row that sees no key, whose P must be 0) and
// D = sum over d of dO * O in float32; for a padding row (i >= seqlen_q), +inf and 0, so that its
// P, and with it every product it enters, is exactly 0. Packed (kVarlen): r = h * rows_pad + pr,
// rows_pad the packed rows of a head, pr a sequence's row or a padding row (packed_token).
template <typename T, bool kVarlen>
__global__ void __launch_bounds__(kThreads)
    bwd_hopper_rows_kernel(const AttentionBackwardParams g, int64_t rows_pad, float* lse2_rows, float* d_rows) {
  const AttentionParams& p = g.fwd;
  const int64_t rows = (kVarlen ? 1 : p.batch) * p.heads * rows_pad;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32; r < rows; r += warps) {
    const int64_t bh = r / rows_pad;
    // Padded: batch b, head h, row i, lse row bh * seqlen_q + i. Packed: head bh, token i (every
    // batch stride 0), lse row h * total_q + i.
    int64_t i = r % rows_pad;
    if constexpr (kVarlen) i = packed_token(p, packed_sequence(p, i), i);
    if (kVarlen ? i < 0 : i >= p.seqlen_q) {  // uniform across the warp: one row per warp
      if (lane == 0) lse2_rows[r] = INFINITY, d_rows[r] = 0.f;
      continue;
    }
    const int64_t b = kVarlen ? 0 : bh / p.heads;
    const int64_t h = kVarlen ? bh : bh % p.heads;
    const T* o = static_cast<const T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + i * p.o_seq_stride;
    const T* dout = static_cast<const T*>(g.dout) + b * g.do_batch_stride + h * g.do_head_stride + i * g.do_seq_stride;
    float sum = 0.f;
    for (int64_t c = lane; c < p.head_dim; c += 32) sum += course::to_acc(o[c]) * course::to_acc(dout[c]);
    sum = course::warp_reduce(sum, course::SumOp<float>{});
    if (lane == 0) {
      const float lse = static_cast<const float*>(p.lse)[kVarlen ? h * p.total_q + i : bh * p.seqlen_q + i];
      lse2_rows[r] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
      d_rows[r] = sum;
    }
  }
}

// dq = scale * (the float32 sums of the real rows), rounded once to T, in dq's strides. The sums
// are in the main kernel's register order (attention_backward_hopper_workspace): float4 q of a
// tile's 64-column chunk is float4 g = q / 128 of thread ct = q % 128 of the warpgroup that
// computed it, its registers 4g..4g+3: rows 16 (ct / 32) + (ct % 32) / 4 and that + 8, columns
// 8g + 2 (ct % 4) and the next. One float4 a thread: the reads are whole and coalesced, and four
// consecutive threads write 8 consecutive elements of a row. Packed (kVarlen): the rows of head bh
// are packed rows, each mapped to its token (packed_token; padding rows have nowhere to go).
template <typename T, bool kVarlen>
__global__ void __launch_bounds__(kThreads)
    bwd_hopper_dq_kernel(const AttentionBackwardParams g, int64_t rows_pad, const float* dq_accum) {
  constexpr int kBM = kHopperBwdDqRows;  // the sums' tiles (a step of 128 rows at d = 64 is two)
  const AttentionParams& p = g.fwd;
  const int64_t tile_floats = kBM * p.head_dim;  // one query tile's sums, every chunk
  const int64_t total = (kVarlen ? 1 : p.batch) * p.heads * rows_pad * p.head_dim / 4;
  const float scale = static_cast<float>(p.scale);
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; q < total;
       q += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t e = 4 * q;
    const int64_t bh = e / (rows_pad * p.head_dim);
    const int64_t m0 = e % (rows_pad * p.head_dim) / tile_floats * kBM;
    const int in_tile = static_cast<int>(e % tile_floats);
    const int chunk = in_tile / (kBM * 64);
    const int f = in_tile % (kBM * 64);
    const int ct = f / 4 % 128;
    const int64_t row = m0 + 16 * (ct / 32) + ct % 32 / 4;
    const int col = chunk * 64 + 8 * (f / 512) + 2 * (ct % 4);
    const float4 v = *reinterpret_cast<const float4*>(dq_accum + e);
    if constexpr (kVarlen) {
      T* dq = static_cast<T*>(g.dq) + bh * g.dq_head_stride + col;
      const int64_t seq = packed_sequence(p, m0);  // the tile's rows are one sequence's
      const int64_t token = packed_token(p, seq, row), token8 = packed_token(p, seq, row + 8);
      if (token >= 0) {  // padding rows' sums are 0 and have nowhere to go
        dq[token * g.dq_seq_stride] = course::from_acc<T>(v.x * scale);
        dq[token * g.dq_seq_stride + 1] = course::from_acc<T>(v.y * scale);
      }
      if (token8 >= 0) {
        dq[token8 * g.dq_seq_stride] = course::from_acc<T>(v.z * scale);
        dq[token8 * g.dq_seq_stride + 1] = course::from_acc<T>(v.w * scale);
      }
      continue;
    }
    T* dq = static_cast<T*>(g.dq) + (bh / p.heads) * g.dq_batch_stride + (bh % p.heads) * g.dq_head_stride + col;
    if (row < p.seqlen_q) {  // padded rows' sums are 0 and have nowhere to go
      dq[row * g.dq_seq_stride] = course::from_acc<T>(v.x * scale);
      dq[row * g.dq_seq_stride + 1] = course::from_acc<T>(v.y * scale);
    }
    if (row + 8 < p.seqlen_q) {
      dq[(row + 8) * g.dq_seq_stride] = course::from_acc<T>(v.z * scale);
      dq[(row + 8) * g.dq_seq_stride + 1] = course::from_acc<T>(v.w * scale);
    }
  }
}

// dK and dV of a call without query rows (seqlen_q or heads 0): no key is seen, every gradient 0.
// The main kernel would write them too, but its query maps would describe an empty tensor.
template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_hopper_zero_kv_kernel(const AttentionBackwardParams g) {
  const AttentionParams& p = g.fwd;
  const int64_t total = p.batch * p.heads_kv * p.seqlen_k * p.head_dim;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t c = e % p.head_dim;
    const int64_t r = e / p.head_dim;
    const int64_t key = r % p.seqlen_k;
    const int64_t b = r / p.seqlen_k / p.heads_kv;
    const int64_t hk = r / p.seqlen_k % p.heads_kv;
    static_cast<T*>(g.dk)[b * g.dk_batch_stride + hk * g.dk_head_stride + key * g.dk_seq_stride + c] = course::from_acc<T>(0.f);
    static_cast<T*>(g.dv)[b * g.dv_batch_stride + hk * g.dv_head_stride + key * g.dv_seq_stride + c] = course::from_acc<T>(0.f);
  }
}

template <typename T, bool kVarlen>
cudaError_t launch(const AttentionBackwardParams& g, void* workspace, cudaStream_t stream) {
  const AttentionParams& p = g.fwd;
  // Statistics rows per head (padded: per batch and head), and in all.
  const int64_t rows_pad = kVarlen ? attention_backward_hopper_packed_rows(p.total_q, p.batch)
                                   : attention_backward_hopper_rows(p.seqlen_q);
  const int64_t rows = attention_backward_hopper_stat_rows(p);
  // The workspace (attention_backward_hopper_workspace): dQ's sums, then lse2, then D; each part
  // a multiple of 256 bytes long (rows_pad is), so the bulk copies' 16-byte alignment holds.
  float* dq_accum = static_cast<float*>(workspace);
  float* lse2_rows = dq_accum + rows * p.head_dim;
  float* d_rows = lse2_rows + rows;
  int sms = 0;
  COURSE_CUDA_TRY(course::sm_count(&sms));
  // No query row (packed: no query token, though the padded rows of empty sequences exist).
  if (kVarlen ? p.total_q == 0 || p.heads == 0 : rows == 0) {
    // Packed: every key token as one batch, which covers the keys of every sequence.
    AttentionBackwardParams every = g;
    if constexpr (kVarlen) every.fwd.batch = 1, every.fwd.seqlen_k = p.total_k;
    const int64_t work = every.fwd.batch * p.heads_kv * every.fwd.seqlen_k * p.head_dim;
    if (work == 0) return cudaSuccess;
    bwd_hopper_zero_kv_kernel<T><<<static_cast<unsigned>(grid_stride_blocks(work, kThreads * 4, sms)), kThreads, 0,
                                   stream>>>(every);
    return cudaGetLastError();
  }
  bwd_hopper_rows_kernel<T, kVarlen><<<static_cast<unsigned>(grid_stride_blocks(rows, kThreads / 32, sms)), kThreads,
                                       0, stream>>>(g, rows_pad, lse2_rows, d_rows);
  COURSE_CUDA_TRY(cudaGetLastError());
  // The instantiation: a window or a softcap, or the packed layout, or neither (both at once never
  // come here: the glue sends them to "mma_dqpass"). The glue checks attention_backward_hopper_head_dim
  // first: the fallback answers a call from C++ alone.
  const bool featured = uses_window_or_softcap(p);
  if (kVarlen && featured) return cudaErrorInvalidValue;
  COURSE_CUDA_TRY(course::with_listed<kHopperBackwardHeadDims>(p.head_dim, cudaErrorInvalidValue, [&](auto d) {
    constexpr int D = decltype(d)::value;
    if constexpr (kVarlen) {
      return run_flash_bwd_hopper<T, D, false, true>(g, dq_accum, lse2_rows, d_rows, stream);
    } else {
      return featured ? run_flash_bwd_hopper<T, D, true, false>(g, dq_accum, lse2_rows, d_rows, stream)
                      : run_flash_bwd_hopper<T, D, false, false>(g, dq_accum, lse2_rows, d_rows, stream);
    }
  }));
  const int64_t float4s = rows * p.head_dim / 4;
  bwd_hopper_dq_kernel<T, kVarlen><<<static_cast<unsigned>(grid_stride_blocks(float4s, kThreads * 4, sms)), kThreads,
                                     0, stream>>>(g, rows_pad, dq_accum);
  return cudaGetLastError();
}

}  // namespace

int64_t attention_backward_hopper_smem_bytes(int64_t head_dim) {
  return course::with_listed<kHopperBackwardHeadDims>(
      head_dim, int64_t{0}, [](auto d) -> int64_t { return HopperBwdTraits<decltype(d)::value>::kSmemBytes; });
}

cudaError_t launch_attention_backward_hopper(const AttentionBackwardParams& g, void* workspace, cudaStream_t stream) {
  const bool packed = g.fwd.cu_seqlens_q != nullptr;
  switch (g.fwd.dtype) {
    case DType::kBFloat16:
      return packed ? launch<__nv_bfloat16, true>(g, workspace, stream)
                    : launch<__nv_bfloat16, false>(g, workspace, stream);
    case DType::kFloat16:
      return packed ? launch<__half, true>(g, workspace, stream) : launch<__half, false>(g, workspace, stream);
    default: return cudaErrorInvalidValue;  // the glue sends only the 16-bit types here
  }
}

}  // namespace flash_attention
