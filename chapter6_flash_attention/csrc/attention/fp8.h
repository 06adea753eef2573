// Part 3's FP8 forward, what the glue sees of it without CUDA: the head dims its kernel takes, and
// quantize_fp8. Plain C++, as attention.h.
//
// quantize_fp8 (the FP8 forward takes its inputs from it): a tensor to e4m3 with one scale for the
// whole tensor, and the factor that undoes it.
//
//   amax    = max |x| over the tensor
//   scale   = 448 / amax (1 when amax = 0: every element is 0 and any scale does)
//   x8      = e4m3(x * scale), rounded to nearest even; |x * scale| <= 448, e4m3's largest finite
//             value, so nothing overflows
//   descale = amax / 448 (1 when amax = 0): x ~ descale * x8
// Each step one float32 operation, in this order, on the CPU (quantize_fp8_cpu in fp8_ops.cpp) and
// on CUDA alike, so the two agree bit for bit. A NaN anywhere gives a NaN amax and NaN everywhere.
//
// transpose: x is (batch, heads, seqlen, head_dim) and x8 is written as (batch, heads, head_dim,
// seqlen) -- V^T, the layout the FP8 forward's P V reads (8-bit wgmma takes both operands K-major)
// -- with each row of seqlen keys padded with zeros to a multiple of 16 bytes (`row_stride`), the
// alignment TMA needs of a row stride.
#pragma once

#include "attention/attention.h"

#include <cstdint>

namespace flash_attention {

// The FP8 forward's head dims (attention_fp8 on CUDA; the CPU reference takes any): a row of Q or
// K is head_dim bytes, one 64- or 128-byte swizzle row, and O (64 x head_dim floats per warpgroup)
// must fit beside S in a consumer's 240 registers.
inline constexpr int kFp8HeadDims[] = {64, 128};

inline constexpr float kE4m3Max = 448.f;

// The padded row of the transposed layout: seqlen rounded up to 16 bytes, and 16 for no keys at all
// (a row stride of 0 is no stride a tensor map takes).
inline int64_t fp8_transposed_row(int64_t seqlen) { return seqlen > 0 ? (seqlen + 15) / 16 * 16 : 16; }

struct QuantizeFp8Params {
  DType dtype;        // of x: float32, float16 or bfloat16
  const void* x;      // contiguous
  void* out;          // e4m3 bytes: x's layout, or (rows, head_dim, row_stride) when transposed
  float* amax;        // workspace: one float, zeroed by the caller (the first kernel's atomicMax)
  float* descale;     // one float out
  int64_t numel;
  bool transpose;
  int64_t rows, seqlen, head_dim, row_stride;  // transposed: x is (rows = batch * heads, seqlen, head_dim)
};

}  // namespace flash_attention

#if defined(__CUDACC__) || defined(WITH_CUDA)
#include <cuda_runtime_api.h>
namespace flash_attention {
// Two kernels on `stream`: amax (a grid-stride max, one atomicMax per block), then the conversion
// (which reads amax from the device: no host round trip). Never synchronizes or allocates.
cudaError_t launch_quantize_fp8(const QuantizeFp8Params& params, cudaStream_t stream);
}  // namespace flash_attention
#endif
