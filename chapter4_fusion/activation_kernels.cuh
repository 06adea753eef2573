// Chapter 4's kernel templates for the activation functors of activation.h: the rungs of its
// ladders that only this chapter runs (v1's separate kernels, v2's warp per mask word, v1's
// backward), and the adapters from the chapter's params structs to the fast kernels it shares
// with chapter 5 (common/include/course/bias_act.cuh: the column tiles, the flat kernel, the
// fused backward). Included by elementwise_kernels.cu and linear_epilogue_kernels.cu; nvcc only
// and torch-free, like every kernel file of the course.
#pragma once

#include "activation.h"
#include "elementwise.h"

#include <course/bias_act.cuh>
#include <course/column_reduce.cuh>
#include <course/cuda_utils.h>
#include <course/numeric.cuh>

#include <algorithm>
#include <type_traits>

namespace fusion {
namespace elementwise {

using ::course::fma_acc;
using ::course::flat_blocks;
using ::course::kFastMath;
using ::course::kFlatThreads;
using ::course::kTileThreads;
using ::course::load_pack;
using ::course::make_tiling;
using ::course::Pack;
using ::course::store_pack;
using ::course::Tiling;
using ::course::vectorizable;
using ::course::with_dtype;
using ::course::with_source;

// The forward's shape per activation (kForwardRows, kForwardMinBlocks): activation.h.
// Rows that the tiles take as single elements move eight of them in flight
// (course::launch_bias_act_tiles).

// ---------------------------------------------------------------------------------------
// Forward, unfused pieces (v1 of every ladder): what eager runs, one op per kernel, each a
// trip through memory that rounds its result to the dtype.
// ---------------------------------------------------------------------------------------
// out = in * scale (may be in place).
template <typename T>
__global__ void scale_kernel(const T* in, typename course::Acc<T>::type scale, T* out, int64_t numel) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = course::from_acc<T>(course::to_acc(in[i]) * scale);
  }
}

// out = in + bias broadcast over rows of n (may be in place). The column of every element costs
// a 64-bit division, as in eager's broadcasting TensorIterator.
template <typename T>
__global__ void add_bias_kernel(const T* in, const T* bias, T* out, int64_t numel, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = course::from_acc<T>(course::to_acc(in[i]) + course::to_acc(bias[i % n]));
  }
}

// ---------------------------------------------------------------------------------------
// v2 of fused_bias_scale_relu (and the activation kernel of the unfused rungs, bias == null):
// one kernel, so x is read once and y written once. A warp takes 32 adjacent columns of one
// row per step, which is exactly one word of the mask: __ballot_sync gathers the 32 signs and
// lane 0 stores the word, with no shared memory. Scalar loads, and the bias re-read (from L1)
// for every element.
// ---------------------------------------------------------------------------------------
template <typename T, typename Act, bool kMask>
__global__ void bias_act_warp_kernel(const T* x, const T* bias, typename course::Acc<T>::type scale, T* y,
                                     uint32_t* mask, int64_t rows, int64_t n) {
  using A = typename course::Acc<T>::type;
  const int lane = threadIdx.x % 32;
  const int64_t words_per_row = mask_words_per_row(n);
  const int64_t tiles = rows * words_per_row;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  // t is the same in every lane of a warp, so all 32 lanes reach the ballot together.
  for (int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; t < tiles; t += warps) {
    const int64_t r = t / words_per_row;
    const int64_t c = (t - r * words_per_row) * 32 + lane;
    // The row's last word may be partial: lanes past its end compute nothing and vote 0.
    const bool active = c < n;
    A z = A(0);
    if (active) {
      z = course::to_acc(x[r * n + c]) * scale;
      if (bias != nullptr) z += course::to_acc(bias[c]);
      y[r * n + c] = course::from_acc<T>(Act::template forward<A, kFastMath<T>>(z));
    }
    if constexpr (kMask) {
      const uint32_t bits = __ballot_sync(0xffffffffu, active && course::relu_passes(z));
      if (lane == 0) mask[t] = bits;
    }
  }
}

// ---------------------------------------------------------------------------------------
// v3 of fused_bias_scale_relu, v2 of bias_gelu / bias_silu, linear's fused epilogue: 16-byte
// accesses, in one of two kernels (course/bias_act.cuh). The column tiles
// (bias_act_tile_kernel): against v2, 16-byte loads and stores (a quarter to an eighth of the
// memory instructions), the bias loaded once per thread instead of once per element, no division
// per element. The flat kernel (bias_act_flat_kernel): one vector per thread over the flat
// array, the bias gathered by column: every lane busy at any row length, and faster than tiles
// of one row per thread even where those are full (course::launch_bias_act says by how much).
// ---------------------------------------------------------------------------------------
template <typename T>
course::BiasAct<T> bias_act_args(const BiasActParams& p) {
  return {static_cast<const T*>(p.x), static_cast<const T*>(p.bias), static_cast<typename course::Acc<T>::type>(p.scale),
          static_cast<T*>(p.y), static_cast<T*>(p.pre), p.mask, p.rows, p.n};
}

// The fused forward a call takes (course::launch_bias_act): the flat kernel wherever the operands'
// vectors pair up, the column tiles for GELU-erf's four rows in flight on rows that fill them, and
// the tiles' single elements where a mask's rows are not whole 32-bit words.
template <typename T, typename Act, bool kMask>
cudaError_t launch_bias_act_fused(const BiasActParams& p, cudaStream_t stream) {
  return course::launch_bias_act<T, Act, kMask, kForwardRows<Act>, kForwardMinBlocks<Act>>(bias_act_args<T>(p), stream);
}

template <typename T, typename Act, bool kMask>
cudaError_t launch_bias_act_warps(const T* x, const T* bias, double scale, T* y, uint32_t* mask, int64_t rows,
                                  int64_t n, cudaStream_t stream) {
  unsigned blocks = 0;
  COURSE_CUDA_TRY(flat_blocks(rows * mask_words_per_row(n) * 32, kFlatThreads, &blocks));
  bias_act_warp_kernel<T, Act, kMask><<<blocks, kFlatThreads, 0, stream>>>(
      x, bias, static_cast<typename course::Acc<T>::type>(scale), y, mask, rows, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_scale(const T* in, double scale, T* out, int64_t numel, cudaStream_t stream) {
  unsigned blocks = 0;
  COURSE_CUDA_TRY(flat_blocks(numel, kFlatThreads, &blocks));
  scale_kernel<T><<<blocks, kFlatThreads, 0, stream>>>(in, static_cast<typename course::Acc<T>::type>(scale), out,
                                                       numel);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_add_bias(const T* in, const T* bias, T* out, int64_t rows, int64_t n, cudaStream_t stream) {
  unsigned blocks = 0;
  COURSE_CUDA_TRY(flat_blocks(rows * n, kFlatThreads, &blocks));
  add_bias_kernel<T><<<blocks, kFlatThreads, 0, stream>>>(in, bias, out, rows * n, n);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------
// Backward v1: g = dy * act'(z) written out in the dtype, as eager's `dy * (y > 0)` is; then
// dx = g * scale (scale_kernel) and dbias = the column sum of g (course::column_sum): three
// kernels and g's round trip through memory.
// ---------------------------------------------------------------------------------------
// act'(z) for element (r, c) of a row of n, from what the forward kept.
template <typename Act, SaveKind kSource, typename T, typename A>
__device__ __forceinline__ A derivative_at(const T* saved, const uint32_t* mask, A bias_c, A scale, int64_t r,
                                           int64_t c, int64_t n) {
  if constexpr (kSource == SaveKind::kInput) {
    return Act::template derivative<A, kFastMath<T>>(fma_acc(course::to_acc(saved[r * n + c]), scale, bias_c));
  } else if constexpr (kSource == SaveKind::kOutput) {
    return course::relu_passes(course::to_acc(saved[r * n + c])) ? A(1) : A(0);
  } else {
    return ((mask[r * mask_words_per_row(n) + c / 32] >> (c % 32)) & 1u) ? A(1) : A(0);
  }
}

template <typename T, typename Act, SaveKind kSource>
__global__ void masked_grad_kernel(const T* dy, const T* saved, const uint32_t* mask, const T* bias,
                                   typename course::Acc<T>::type scale, T* g, int64_t rows, int64_t n) {
  using A = typename course::Acc<T>::type;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / n;
    const int64_t c = i - r * n;
    const A bias_c = bias != nullptr ? course::to_acc(bias[c]) : A(0);
    const A d = derivative_at<Act, kSource>(saved, mask, bias_c, scale, r, c, n);
    // relu's 0-or-1 derivative selects dy or 0, as threshold_backward (see act_backward_tile_kernel).
    constexpr bool kGate = kSource != SaveKind::kInput || Act::kGates;
    g[i] = course::from_acc<T>(kGate ? (d != A(0) ? course::to_acc(dy[i]) : A(0)) : course::to_acc(dy[i]) * d);
  }
}

// ---------------------------------------------------------------------------------------
// Backward v2: one pass on the column tiles (course::act_backward_tile_kernel).
// ---------------------------------------------------------------------------------------
template <typename T>
course::BiasActGrad<T> bias_act_grad_args(const ActBackwardParams& p) {
  return {static_cast<const T*>(p.dy), static_cast<const T*>(p.saved), p.mask, static_cast<const T*>(p.bias),
          static_cast<typename course::Acc<T>::type>(p.scale), static_cast<T*>(p.dx), static_cast<T*>(p.dbias),
          p.rows, p.n, p.workspace};
}

template <typename T>
cudaError_t fused_backward_workspace(const ActBackwardParams& p, int64_t* bytes) {
  return course::fused_backward_workspace<T>(bias_act_grad_args<T>(p), bytes);
}

template <typename T, typename Act, SaveKind kSource>
cudaError_t launch_fused_backward(const ActBackwardParams& p, cudaStream_t stream) {
  return course::launch_fused_backward<T, Act, kSource>(bias_act_grad_args<T>(p), stream);
}

}  // namespace elementwise
}  // namespace fusion
