// Chapter 4's elementwise fusions: fused_bias_scale_relu (forward ladder v1-v3, backward
// ladder v1-v2), bias_gelu / bias_silu (v1-v2) and swiglu (v1-v2), with their backward kernels.
//
// Napkin math. relu(x * scale + bias) on a [rows, n] tensor of b-byte elements must read x and
// write y: 2 b bytes per element, plus n^-1 of that for the bias; the mask for the backward
// adds 1/8 byte per element. Eager PyTorch runs three ops, each a read and a write: 6 b bytes,
// three times the minimum, and the fused kernels' whole game is to reach the minimum at the
// speed of a copy. The backward reads dy and the saved tensor (b bytes for y or x, 1/8 byte for
// the mask) and writes dx: 2 b + 1/8 bytes with the mask against 3 b with y or x.
//
// The kernel templates live in activation_kernels.cuh and common/include/course/bias_act.cuh
// (shared with linear_epilogue_kernels.cu and chapter 5); this file strings them into the rungs
// and says what each changes.
#include "activation_kernels.cuh"
#include "elementwise.h"

#include <course/column_reduce.cuh>
#include <course/cuda_utils.h>
#include <course/numeric.cuh>

namespace fusion {
namespace elementwise {
namespace {

using course::Acc;
using course::from_acc;
using course::to_acc;

// ---------------------------------------------------------------------------------------
// SwiGLU: y = silu(a) * b with a, b the two halves of each row of x.
// ---------------------------------------------------------------------------------------
// v1: eager's two kernels, silu(a) into y, then y * b in place: y makes a round trip and the
// column of every element costs a division.
template <typename T>
__global__ void silu_half_kernel(const T* x, T* y, int64_t rows, int64_t half) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * half;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / half;
    y[i] = from_acc<T>(Silu::forward(to_acc(x[r * 2 * half + (i - r * half)])));
  }
}

template <typename T>
__global__ void mul_half_kernel(const T* x, T* y, int64_t rows, int64_t half) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * half;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / half;
    y[i] = from_acc<T>(to_acc(y[i]) * to_acc(x[r * 2 * half + half + (i - r * half)]));
  }
}

// v2: one kernel on course/bias_act.cuh's column tiling (no bias to keep, but no division either):
// a thread reads a 16-byte pack of a and the matching pack of b, writes one pack of y.
template <typename T, int L>
__global__ void __launch_bounds__(kTileThreads)
    swiglu_tile_kernel(const T* x, T* y, int64_t rows, int64_t half, int tx) {
  using A = typename Acc<T>::type;
  const int ty = kTileThreads / tx;
  const int64_t e = (static_cast<int64_t>(blockIdx.x) * tx + threadIdx.x % tx) * L;
  if (e >= half) return;  // past the row's end: no shuffles in this kernel, so leave
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * ty;
  for (int64_t base = static_cast<int64_t>(blockIdx.y) * ty + threadIdx.x / tx; base < rows;
       base += course::kRowsInFlight<L> * row_step) {
    Pack<T, L> av[course::kRowsInFlight<L>];
    Pack<T, L> bv[course::kRowsInFlight<L>];
#pragma unroll
    for (int u = 0; u < course::kRowsInFlight<L>; ++u) {
      const int64_t r = base + u * row_step;
      if (r < rows) {  // the sweep's second row may lie past the last
        av[u] = load_pack<T, L>(x + r * 2 * half + e);
        bv[u] = load_pack<T, L>(x + r * 2 * half + half + e);
      }
    }
#pragma unroll
    for (int u = 0; u < course::kRowsInFlight<L>; ++u) {
      const int64_t r = base + u * row_step;
      if (r < rows) {
        Pack<T, L> yv;
#pragma unroll
        for (int l = 0; l < L; ++l) {
          const A a = to_acc(av[u].v[l]);
          yv.v[l] = from_acc<T>(Silu::forward(a) * to_acc(bv[u].v[l]));
        }
        store_pack<T, L>(y + r * half + e, yv);
      }
    }
  }
}

// The backward, one kernel: da = dy * b * silu'(a) and db = dy * silu(a), written into the two
// halves of dx; x and dy read once.
template <typename T, int L>
__global__ void __launch_bounds__(kTileThreads)
    swiglu_backward_tile_kernel(const T* dy, const T* x, T* dx, int64_t rows, int64_t half, int tx) {
  using A = typename Acc<T>::type;
  const int ty = kTileThreads / tx;
  const int64_t e = (static_cast<int64_t>(blockIdx.x) * tx + threadIdx.x % tx) * L;
  if (e >= half) return;  // past the row's end
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * ty;
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * ty + threadIdx.x / tx; r < rows; r += row_step) {
    const Pack<T, L> av = load_pack<T, L>(x + r * 2 * half + e);
    const Pack<T, L> bv = load_pack<T, L>(x + r * 2 * half + half + e);
    const Pack<T, L> gv = load_pack<T, L>(dy + r * half + e);
    Pack<T, L> dav;
    Pack<T, L> dbv;
#pragma unroll
    for (int l = 0; l < L; ++l) {
      const A a = to_acc(av.v[l]);
      const A g = to_acc(gv.v[l]);
      dav.v[l] = from_acc<T>(g * to_acc(bv.v[l]) * Silu::derivative(a));
      dbv.v[l] = from_acc<T>(g * Silu::forward(a));
    }
    store_pack<T, L>(dx + r * 2 * half + e, dav);
    store_pack<T, L>(dx + r * 2 * half + half + e, dbv);
  }
}

// The vector path needs both halves of every row on 16-byte boundaries: half a whole number of
// vectors (then 2 * half is too) and x, y aligned.
template <typename T, typename Launch>
cudaError_t launch_swiglu_tiles(int64_t rows, int64_t half, std::initializer_list<const void*> pointers,
                                Launch launch) {
  const bool vector = vectorizable<T>(half, pointers);
  constexpr int kVec = course::Vec16<T>::kLanes;
  Tiling t;
  COURSE_CUDA_TRY(make_tiling(rows, half / (vector ? kVec : 1), 1, &t));
  if (vector) {
    launch(std::integral_constant<int, kVec>{}, t);
  } else {
    launch(std::integral_constant<int, 1>{}, t);
  }
  return cudaGetLastError();
}

}  // namespace

// ---------------------------------------------------------------------------------------
// fused_bias_scale_relu's forward ladder:
//   v1  three kernels, scale, add bias, relu (+ mask): eager's 6 b bytes per element, and each
//       intermediate rounded to the dtype as eager rounds it;
//   v2  one kernel (bias_act_warp_kernel): 2 b bytes, scalar accesses, a warp per mask word;
//   v3  one kernel with 16-byte accesses: the column tiles (bias_act_tile_kernel, the bias held
//       in registers across rows: the copy kernel's access pattern) while rows are whole vectors
//       that fill the tiles, else the flat kernel (bias_act_flat_kernel: one 16-byte vector per
//       thread over the flat array, the bias gathered by column: every lane busy at any hidden
//       size, whole vectors at any row length).
// ---------------------------------------------------------------------------------------
cudaError_t launch_bias_scale_relu(const BiasActParams& p, BsrVersion version, cudaStream_t stream) {
  return with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    const auto* x = static_cast<const T*>(p.x);
    const auto* bias = static_cast<const T*>(p.bias);
    auto* y = static_cast<T*>(p.y);
    const bool mask = p.mask != nullptr;
    switch (version) {
      case BsrVersion::kThreeKernels:
        COURSE_CUDA_TRY(launch_scale<T>(x, p.scale, y, p.rows * p.n, stream));
        COURSE_CUDA_TRY(launch_add_bias<T>(y, bias, y, p.rows, p.n, stream));
        return mask ? launch_bias_act_warps<T, Relu, true>(y, nullptr, 1.0, y, p.mask, p.rows, p.n, stream)
                    : launch_bias_act_warps<T, Relu, false>(y, nullptr, 1.0, y, nullptr, p.rows, p.n, stream);
      case BsrVersion::kFused:
        return mask ? launch_bias_act_warps<T, Relu, true>(x, bias, p.scale, y, p.mask, p.rows, p.n, stream)
                    : launch_bias_act_warps<T, Relu, false>(x, bias, p.scale, y, nullptr, p.rows, p.n, stream);
      case BsrVersion::kVectorized:
        break;
    }
    return mask ? launch_bias_act_fused<T, Relu, true>(p, stream) : launch_bias_act_fused<T, Relu, false>(p, stream);
  });
}

// bias_gelu and bias_silu (any activation): v1 a bias kernel then an activation kernel, v2 the
// tile kernel. scale is 1 for them.
cudaError_t launch_bias_activation(const BiasActParams& p, ActVersion version, cudaStream_t stream) {
  return with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    return with_activation(p.act, [&](auto act) -> cudaError_t {
      using Act = decltype(act);
      if (version == ActVersion::kUnfused) {
        auto* y = static_cast<T*>(p.y);
        COURSE_CUDA_TRY(launch_add_bias<T>(static_cast<const T*>(p.x), static_cast<const T*>(p.bias), y, p.rows,
                                           p.n, stream));
        return launch_bias_act_warps<T, Act, false>(y, nullptr, 1.0, y, nullptr, p.rows, p.n, stream);
      }
      return launch_bias_act_fused<T, Act, false>(p, stream);
    });
  });
}

// ---------------------------------------------------------------------------------------
// The backward ladder (fused_bias_scale_relu's; bias_gelu and bias_silu use v2):
//   v1  masked_grad_kernel writes g = dy * act'(z), scale_kernel dx = g * scale, column_sum
//       reduces g: g written and read twice more, and column_sum walks all the rows with one
//       block per column tile;
//   v2  act_backward_tile_kernel: dy and the saved tensor read once, dx written once, g summed
//       in registers and across each tile's rows in shared memory; one row tile writes dbias
//       itself, more write partial rows that the last block of each column tile adds in the
//       same launch, or column_sum where they are many (course::grad_tiling,
//       course::grad_finishes_in_kernel).
// ---------------------------------------------------------------------------------------
cudaError_t act_backward_workspace(const ActBackwardParams& p, BackwardVersion version, int64_t* bytes) {
  return with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    if (version == BackwardVersion::kSeparate) {
      *bytes = p.rows * p.n * static_cast<int64_t>(sizeof(T));
      return cudaSuccess;
    }
    return fused_backward_workspace<T>(p, bytes);
  });
}

cudaError_t launch_act_backward(const ActBackwardParams& p, BackwardVersion version, cudaStream_t stream) {
  return with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    return with_activation(p.act, [&](auto act) -> cudaError_t {
      using Act = decltype(act);
      return with_source(p.source, [&](auto source) -> cudaError_t {
        constexpr SaveKind kSource = decltype(source)::value;
        // Only relu's derivative is a sign, which y or a mask can stand in for; the glue never
        // asks for other combinations, and they are not instantiated.
        if constexpr (kSource != SaveKind::kInput && !std::is_same_v<Act, Relu>) {
          return cudaErrorInvalidValue;
        } else {
          if (version == BackwardVersion::kFused) return launch_fused_backward<T, Act, kSource>(p, stream);
          auto* g = static_cast<T*>(p.workspace);
          unsigned blocks = 0;
          COURSE_CUDA_TRY(flat_blocks(p.rows * p.n, kFlatThreads, &blocks));
          masked_grad_kernel<T, Act, kSource><<<blocks, kFlatThreads, 0, stream>>>(
              static_cast<const T*>(p.dy), static_cast<const T*>(p.saved), p.mask, static_cast<const T*>(p.bias),
              static_cast<typename Acc<T>::type>(p.scale), g, p.rows, p.n);
          COURSE_CUDA_TRY(cudaGetLastError());
          COURSE_CUDA_TRY(launch_scale<T>(g, p.scale, static_cast<T*>(p.dx), p.rows * p.n, stream));
          return course::column_sum<T, T>(g, p.rows, p.n, static_cast<T*>(p.dbias), stream);
        }
      });
    });
  });
}

// swiglu: v1 two kernels (silu(a), then the product), v2 one tile kernel.
cudaError_t launch_swiglu(const SwigluParams& p, ActVersion version, cudaStream_t stream) {
  return with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    const auto* x = static_cast<const T*>(p.x);
    auto* y = static_cast<T*>(p.y);
    if (version == ActVersion::kUnfused) {
      unsigned blocks = 0;
      COURSE_CUDA_TRY(flat_blocks(p.rows * p.half, kFlatThreads, &blocks));
      silu_half_kernel<T><<<blocks, kFlatThreads, 0, stream>>>(x, y, p.rows, p.half);
      COURSE_CUDA_TRY(cudaGetLastError());
      mul_half_kernel<T><<<blocks, kFlatThreads, 0, stream>>>(x, y, p.rows, p.half);
      return cudaGetLastError();
    }
    return launch_swiglu_tiles<T>(p.rows, p.half, {p.x, p.y}, [&](auto lanes, const Tiling& t) {
      swiglu_tile_kernel<T, decltype(lanes)::value><<<t.grid, kTileThreads, 0, stream>>>(x, y, p.rows, p.half, t.tx);
    });
  });
}

cudaError_t launch_swiglu_backward(const SwigluBackwardParams& p, cudaStream_t stream) {
  return with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    const auto* dy = static_cast<const T*>(p.dy);
    const auto* x = static_cast<const T*>(p.x);
    auto* dx = static_cast<T*>(p.dx);
    return launch_swiglu_tiles<T>(p.rows, p.half, {p.dy, p.x, p.dx}, [&](auto lanes, const Tiling& t) {
      swiglu_backward_tile_kernel<T, decltype(lanes)::value><<<t.grid, kTileThreads, 0, stream>>>(dy, x, dx, p.rows,
                                                                                                 p.half, t.tx);
    });
  });
}

}  // namespace elementwise
}  // namespace fusion
