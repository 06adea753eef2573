// CPU implementations of the norms: the reference semantics in C++, on the same params as the
// CUDA launchers, parallelised over rows with at::parallel_for. 16-bit inputs compute in
// float32, float64 in float64; the statistics are two-pass (mean, then the mean of squared
// deviations). Deterministic: dweight and dbias are sums over fixed chunks of rows whose
// partials are added in chunk order, whatever the thread count.
#include "norm.h"

#include <ATen/Parallel.h>
#include <course/cpu_dtype.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace fusion {
namespace norm {
namespace {

// Rows one task of the column sums takes, in order.
constexpr int64_t kRowChunk = 64;

using ::course::CpuAcc;
using ::course::with_cpu_type;

template <typename T>
void norm_rows(const NormParams& p) {
  using A = typename CpuAcc<T>::type;
  const bool centered = p.kind == NormKind::kLayerNorm;
  const T* w = static_cast<const T*>(p.weight);
  const T* b = static_cast<const T*>(p.bias);
  const int64_t n = p.n;
  at::parallel_for(0, p.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> h(static_cast<size_t>(n));
    for (int64_t r = begin; r < end; ++r) {
      const T* x = static_cast<const T*>(p.x) + r * n;
      if (p.residual != nullptr) {
        // The sum is rounded to the dtype (what it is stored as) before it is normalized.
        const T* res = static_cast<const T*>(p.residual) + r * n;
        T* sum = static_cast<T*>(p.sum) + r * n;
        for (int64_t i = 0; i < n; ++i) {
          sum[i] = static_cast<T>(static_cast<A>(x[i]) + static_cast<A>(res[i]));
          h[i] = static_cast<A>(sum[i]);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) h[i] = static_cast<A>(x[i]);
      }
      A mean = A(0);
      if (centered) {
        for (int64_t i = 0; i < n; ++i) mean += h[i];
        mean /= static_cast<A>(n);
      }
      A var = A(0);
      for (int64_t i = 0; i < n; ++i) var += (h[i] - mean) * (h[i] - mean);
      var /= static_cast<A>(n);
      const A rstd = A(1) / std::sqrt(var + static_cast<A>(p.eps));
      if (centered) static_cast<A*>(p.mean)[r] = mean;
      static_cast<A*>(p.rstd)[r] = rstd;
      T* y = static_cast<T*>(p.y) + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const A v = (h[i] - mean) * rstd * static_cast<A>(w[i]);
        y[i] = static_cast<T>(centered ? v + static_cast<A>(b[i]) : v);
      }
    }
  });
}

template <typename T>
void norm_backward_rows(const NormBackwardParams& p) {
  using A = typename CpuAcc<T>::type;
  const bool centered = p.kind == NormKind::kLayerNorm;
  const int64_t n = p.n;
  const T* w = static_cast<const T*>(p.weight);
  const A* mean = static_cast<const A*>(p.mean);
  const A* rstd = static_cast<const A*>(p.rstd);
  const T* dsum = static_cast<const T*>(p.dsum);
  const int64_t chunks = (p.rows + kRowChunk - 1) / kRowChunk;
  // Per chunk of rows: partial dweight, then partial dbias.
  std::vector<A> partial(static_cast<size_t>(chunks * 2 * n), A(0));
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      A* dw = partial.data() + c * 2 * n;
      A* db = dw + n;
      for (int64_t r = c * kRowChunk; r < std::min(p.rows, (c + 1) * kRowChunk); ++r) {
        const T* x = static_cast<const T*>(p.x) + r * n;
        const T* dy = static_cast<const T*>(p.dy) + r * n;
        T* dx = static_cast<T*>(p.dx) + r * n;
        const A mu = centered ? mean[r] : A(0);
        const A rs = rstd[r];
        A sum_g = A(0);
        A sum_gx = A(0);
        for (int64_t i = 0; i < n; ++i) {
          const A g = static_cast<A>(dy[i]) * static_cast<A>(w[i]);
          sum_g += g;
          sum_gx += g * (static_cast<A>(x[i]) - mu) * rs;
        }
        const A mean_g = centered ? sum_g / static_cast<A>(n) : A(0);
        const A mean_gx = sum_gx / static_cast<A>(n);
        for (int64_t i = 0; i < n; ++i) {
          const A d = static_cast<A>(dy[i]);
          const A xhat = (static_cast<A>(x[i]) - mu) * rs;
          const A extra = dsum != nullptr ? static_cast<A>(dsum[r * n + i]) : A(0);  // norm.h: RMSNorm's dsum
          dx[i] = static_cast<T>(rs * (d * static_cast<A>(w[i]) - mean_g - xhat * mean_gx) + extra);
          dw[i] += d * xhat;
          db[i] += d;
        }
      }
    }
  });
  T* dweight = static_cast<T*>(p.dweight);
  T* dbias = static_cast<T*>(p.dbias);
  at::parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      A sw = A(0);
      A sb = A(0);
      for (int64_t c = 0; c < chunks; ++c) {
        sw += partial[c * 2 * n + i];
        sb += partial[c * 2 * n + n + i];
      }
      dweight[i] = static_cast<T>(sw);
      if (centered) dbias[i] = static_cast<T>(sb);
    }
  });
}

}  // namespace

void norm_cpu(const NormParams& p) {
  if (p.rows == 0 || p.n == 0) return;
  with_cpu_type(p.dtype, [&](auto tag) { norm_rows<decltype(tag)>(p); });
}

void norm_backward_cpu(const NormBackwardParams& p) {
  if (p.n == 0) return;
  with_cpu_type(p.dtype, [&](auto tag) { norm_backward_rows<decltype(tag)>(p); });
}

}  // namespace norm
}  // namespace fusion
