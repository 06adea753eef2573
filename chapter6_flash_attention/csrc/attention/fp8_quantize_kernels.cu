// quantize_fp8's kernels (attention/fp8.h): a per-tensor amax, then e4m3 with the scale it gives,
// written as x's layout or transposed (V^T for the FP8 forward). Torch-free. The e4m3 conversion is
// cuda_fp8.h's (one cvt instruction on sm_89 and newer, the same rounding in software before).
#include "attention/fp8.h"

#include <course/cuda_utils.h>
#include <course/numeric.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

namespace flash_attention {
namespace {

constexpr int kThreads = 256;

// max |x| over the tensor. A non-negative float's bits order as the float does, so atomicMax on
// them as integers is a float max (NaN's bits sort above infinity's: a NaN wins, as documented).
template <typename T>
__global__ void amax_kernel(const T* __restrict__ x, int64_t n, float* amax) {
  float m = 0.f;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) {
    m = fmaxf(m, fabsf(course::to_acc(x[i])));
    if (course::to_acc(x[i]) != course::to_acc(x[i])) m = __int_as_float(0x7fffffff);  // fmaxf would drop a NaN
  }
  __shared__ int block_max;
  if (threadIdx.x == 0) block_max = 0;
  __syncthreads();  // block_max is 0 before any thread adds its own
  atomicMax(&block_max, __float_as_int(m));
  __syncthreads();  // every thread's max is in before thread 0 publishes it
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax), block_max);
}

__device__ __forceinline__ float scale_of(float amax) { return amax > 0.f ? kE4m3Max / amax : 1.f; }

__device__ __forceinline__ unsigned char e4m3(float v) {
  return static_cast<unsigned char>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// x's own layout: one element per thread per trip, grid-stride.
template <typename T>
__global__ void convert_kernel(const T* __restrict__ x, int64_t n, const float* amax, unsigned char* out,
                               float* descale) {
  const float a = *amax;
  const float scale = scale_of(a);
  if (blockIdx.x == 0 && threadIdx.x == 0) *descale = a > 0.f ? a / kE4m3Max : 1.f;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) {
    out[i] = e4m3(course::to_acc(x[i]) * scale);
  }
}

// Transposed: a 32 x 32 tile of (seqlen, head_dim) through shared memory, read along head_dim and
// written along seqlen, both coalesced; blockIdx.z is the (batch, head). Keys from seqlen to the
// padded row_stride are written as zeros.
constexpr int kTile = 32;
template <typename T>
__global__ void convert_transposed_kernel(const T* __restrict__ x, const float* amax, unsigned char* out,
                                          float* descale, int64_t rows, int64_t seqlen, int64_t head_dim,
                                          int64_t row_stride) {
  __shared__ unsigned char tile[kTile][kTile + 4];  // + 4: rows land in different banks on the column reads
  const float a = *amax;
  const float scale = scale_of(a);
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    *descale = a > 0.f ? a / kE4m3Max : 1.f;
  }
  const int64_t bh = blockIdx.z;
  // The launch has at least one block, for the descale, even when there are no (batch, head) rows
  // (then the buffer is empty and its pointer null): such a block has nothing to write. Uniform
  // across the block, so no thread misses the barrier below.
  if (bh >= rows) return;
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * kTile, d0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const T* xb = x + bh * seqlen * head_dim;
  // Threads (tx, ty), ty stepping by 8: each thread reads 4 rows of the tile.
  for (int r = threadIdx.y; r < kTile; r += 8) {
    const int64_t s = s0 + r, d = d0 + threadIdx.x;
    // keys past seqlen (the padding) and columns past head_dim hold zeros
    tile[r][threadIdx.x] = (s < seqlen && d < head_dim) ? e4m3(course::to_acc(xb[s * head_dim + d]) * scale) : 0;
  }
  __syncthreads();  // the tile is written before it is read across
  unsigned char* ob = static_cast<unsigned char*>(out) + bh * head_dim * row_stride;
  for (int r = threadIdx.y; r < kTile; r += 8) {
    const int64_t d = d0 + r, s = s0 + threadIdx.x;
    if (d < head_dim && s < row_stride) ob[d * row_stride + s] = tile[threadIdx.x][r];  // the padded row's end
  }
}

template <typename T>
cudaError_t launch_typed(const QuantizeFp8Params& p, cudaStream_t stream) {
  const T* x = static_cast<const T*>(p.x);
  const int64_t blocks = p.numel == 0 ? 0 : std::min<int64_t>(course::ceil_div(p.numel, int64_t{kThreads}), 1024);
  if (blocks > 0) amax_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, p.numel, p.amax);
  COURSE_CUDA_TRY(cudaGetLastError());
  unsigned char* out = static_cast<unsigned char*>(p.out);
  if (!p.transpose) {
    // One block even for an empty tensor: it writes the descale (1).
    const int64_t cb = std::max<int64_t>(1, std::min<int64_t>(course::ceil_div(p.numel, int64_t{kThreads}), 4096));
    convert_kernel<T><<<static_cast<unsigned>(cb), kThreads, 0, stream>>>(x, p.numel, p.amax, out, p.descale);
    return cudaGetLastError();
  }
  const int64_t sx = std::max<int64_t>(1, course::ceil_div(p.row_stride, int64_t{kTile}));
  const int64_t sy = std::max<int64_t>(1, course::ceil_div(p.head_dim, int64_t{kTile}));
  const int64_t sz = std::max<int64_t>(1, p.rows);
  if (sx > INT32_MAX || sy > 65535 || sz > 65535) return cudaErrorInvalidConfiguration;
  convert_transposed_kernel<T><<<dim3(static_cast<unsigned>(sx), static_cast<unsigned>(sy), static_cast<unsigned>(sz)),
                                 dim3(kTile, 8), 0, stream>>>(x, p.amax, out, p.descale, p.rows, p.seqlen,
                                                              p.head_dim, p.row_stride);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_quantize_fp8(const QuantizeFp8Params& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat32: return launch_typed<float>(p, stream);
    case DType::kFloat16: return launch_typed<__half>(p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;  // the glue sends only these three
  }
}

}  // namespace flash_attention
