// CPU implementations of chapter 3's ops: the reference semantics in C++, on the same params as
// the CUDA launchers, parallelised with at::parallel_for. Deterministic too: every sum is
// split into fixed chunks whose partials are combined in order, whatever the thread count.
#include "reduction.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <course/cpu_dtype.h>

#include <cmath>
#include <limits>
#include <vector>

namespace shared_reduction {
namespace {

// Elements one task folds in order before its partial joins the others: long enough to
// amortize a task, short enough that float32 sums of millions of elements stay accurate.
constexpr int64_t kChunk = 4096;

using ::course::CpuAcc;

// NaN propagates, as on the GPU (course::MaxOp).
template <typename A>
A max_op(A a, A b) { return (a != a || a > b) ? a : b; }

}  // namespace

void reduce_cpu(const ReduceParams& p) {
  ::course::with_cpu_type(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename CpuAcc<T>::type;
    const T* x = static_cast<const T*>(p.x);
    T* out = static_cast<T*>(p.out);
    const bool is_sum = p.op == ReduceOp::kSum;
    const A identity = is_sum ? A(0) : -std::numeric_limits<A>::infinity();
    const int64_t outputs = p.outer * p.inner;
    const int64_t chunks = (p.n + kChunk - 1) / kChunk;
    std::vector<A> partial(static_cast<size_t>(outputs * chunks), identity);
    at::parallel_for(0, outputs * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t o = task / chunks / p.inner;
        const int64_t i = task / chunks % p.inner;
        const int64_t k0 = task % chunks * kChunk;
        const int64_t k1 = std::min(k0 + kChunk, p.n);
        A acc = identity;
        for (int64_t k = k0; k < k1; ++k) {
          const A v = static_cast<A>(x[(o * p.n + k) * p.inner + i]);
          acc = is_sum ? acc + v : max_op(acc, v);
        }
        partial[task] = acc;
      }
    });
    for (int64_t c = 0; c < outputs; ++c) {
      A acc = identity;
      for (int64_t k = 0; k < chunks; ++k) acc = is_sum ? acc + partial[c * chunks + k] : max_op(acc, partial[c * chunks + k]);
      out[c] = static_cast<T>(acc);
    }
  });
}

void softmax_cpu(const SoftmaxParams& p) {
  ::course::with_cpu_type(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename CpuAcc<T>::type;
    const T* x = static_cast<const T*>(p.x);
    T* y = static_cast<T*>(p.y);
    at::parallel_for(0, p.rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* row = x + r * p.n;
        A m = -std::numeric_limits<A>::infinity();
        for (int64_t i = 0; i < p.n; ++i) m = max_op(m, static_cast<A>(row[i]));
        A s = 0;
        for (int64_t i = 0; i < p.n; ++i) s += std::exp(static_cast<A>(row[i]) - m);
        const A log_s = std::log(s);
        for (int64_t i = 0; i < p.n; ++i) {
          const A shifted = static_cast<A>(row[i]) - m;
          y[r * p.n + i] = static_cast<T>(p.log ? shifted - log_s : std::exp(shifted) / s);
        }
      }
    });
  });
}

void softmax_backward_cpu(const SoftmaxBackwardParams& p) {
  ::course::with_cpu_type(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename CpuAcc<T>::type;
    const T* y = static_cast<const T*>(p.y);
    const T* dy = static_cast<const T*>(p.dy);
    T* dx = static_cast<T*>(p.dx);
    at::parallel_for(0, p.rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t o = r * p.n;
        A total = 0;
        for (int64_t i = 0; i < p.n; ++i) {
          total += p.log ? static_cast<A>(dy[o + i]) : static_cast<A>(dy[o + i]) * static_cast<A>(y[o + i]);
        }
        for (int64_t i = 0; i < p.n; ++i) {
          const A yi = static_cast<A>(y[o + i]);
          const A gi = static_cast<A>(dy[o + i]);
          dx[o + i] = static_cast<T>(p.log ? gi - std::exp(yi) * total : yi * (gi - total));
        }
      }
    });
  });
}

}  // namespace shared_reduction
