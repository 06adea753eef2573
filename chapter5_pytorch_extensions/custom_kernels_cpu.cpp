// CPU implementations of chapter 5's ops: the reference semantics in C++, on the same params
// structs as the CUDA launchers. Plain serial loops, the sums in a fixed order, so every result
// is bitwise reproducible.
//
// This file links no libtorch symbol: only the header-only half/bfloat16 types. It is compiled
// into the classic library and into the stable-ABI one (stable_abi/), and a call into ATen
// (AT_DISPATCH's error path, at::parallel_for) would tie the stable binary to one torch
// release. That is also why the loops are serial: threads would come from ATen's pool.
//
// The arithmetic matches the GPU's: 16-bit inputs are widened to float, the forward rounds
// once (one fused multiply-add, then relu), and the sums accumulate in float (double for
// double).
#include "custom_kernels.h"

#include <course/bias_act.h>
#include <course/cpu_dtype.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace custom_ops {
namespace {

using ::course::CpuAcc;
using ::course::with_cpu_type;

// Elements summed in order into one partial by reduce_sum before the partials are added, in
// order: the same two-level shape as the GPU's, which keeps the rounding error near
// (kChunk + numel / kChunk) ulps of the sum of |x| instead of numel ulps.
constexpr int64_t kChunk = 4096;

// relu that lets NaN through, as torch.relu does: NaN < 0 is false.
template <typename A>
A relu(A z) {
  return z < A(0) ? A(0) : z;
}

}  // namespace

void fused_op_cpu(const FusedOpParams& p) {
  with_cpu_type(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename CpuAcc<T>::type;
    const T* x = static_cast<const T*>(p.x);
    const T* bias = static_cast<const T*>(p.bias);
    T* y = static_cast<T*>(p.y);
    const A scale = static_cast<A>(p.scale);
    for (int64_t r = 0; r < p.rows; ++r) {
      for (int64_t c = 0; c < p.n; ++c) {
        const int64_t i = r * p.n + c;
        y[i] = static_cast<T>(relu(std::fma(static_cast<A>(x[i]), scale, static_cast<A>(bias[c]))));
      }
    }
  });
}

void fused_op_backward_cpu(const FusedOpBackwardParams& p) {
  with_cpu_type(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename CpuAcc<T>::type;
    const T* dy = static_cast<const T*>(p.dy);
    const T* y = static_cast<const T*>(p.y);
    T* dx = static_cast<T*>(p.dx);
    T* dbias = static_cast<T*>(p.dbias);
    const A scale = static_cast<A>(p.scale);
    // Row by row, so each column's sum adds its rows top to bottom: one fixed order.
    std::vector<A> sums(static_cast<size_t>(p.n), A(0));
    for (int64_t r = 0; r < p.rows; ++r) {
      for (int64_t c = 0; c < p.n; ++c) {
        const int64_t i = r * p.n + c;
        // The gradient passes where y is not <= 0, NaN included (torch's threshold_backward).
        const A g = course::relu_passes(static_cast<A>(y[i])) ? static_cast<A>(dy[i]) : A(0);
        dx[i] = static_cast<T>(g * scale);
        sums[c] += g;
      }
    }
    for (int64_t c = 0; c < p.n; ++c) dbias[c] = static_cast<T>(sums[c]);
  });
}

void relu_cpu(const ReluParams& p) {
  with_cpu_type(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename CpuAcc<T>::type;
    const T* x = static_cast<const T*>(p.x);
    T* y = static_cast<T*>(p.y);
    for (int64_t i = 0; i < p.numel; ++i) y[i] = static_cast<T>(relu(static_cast<A>(x[i])));
  });
}

void relu_backward_cpu(const ReluBackwardParams& p) {
  with_cpu_type(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename CpuAcc<T>::type;
    const T* dy = static_cast<const T*>(p.dy);
    const T* y = static_cast<const T*>(p.y);
    T* dx = static_cast<T*>(p.dx);
    for (int64_t i = 0; i < p.numel; ++i) dx[i] = course::relu_passes(static_cast<A>(y[i])) ? dy[i] : static_cast<T>(0);
  });
}

void reduce_sum_cpu(const ReduceSumParams& p) {
  with_cpu_type(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename CpuAcc<T>::type;
    const T* x = static_cast<const T*>(p.x);
    const int64_t chunks = (p.numel + kChunk - 1) / kChunk;
    std::vector<A> partial(static_cast<size_t>(chunks), A(0));
    for (int64_t k = 0; k < chunks; ++k) {
      A acc = A(0);
      const int64_t stop = std::min(p.numel, (k + 1) * kChunk);
      for (int64_t i = k * kChunk; i < stop; ++i) acc += static_cast<A>(x[i]);
      partial[k] = acc;
    }
    A total = A(0);
    for (const A v : partial) total += v;
    *static_cast<T*>(p.out) = static_cast<T>(total);
  });
}

}  // namespace custom_ops
