// CPU implementations of the elementwise family: the reference semantics in C++, on the same
// params as the CUDA launchers and with the same functors (activation.h), parallelised with
// at::parallel_for. Deterministic: the bias gradient sums fixed chunks of rows in order, and
// the chunks' partials in order, whatever the thread count.
#include "activation.h"
#include "elementwise.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <course/checks.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace fusion {
namespace elementwise {
namespace {

// Rows one task of the bias gradient sums in order before its partial joins the others.
constexpr int64_t kRowChunk = 64;


// Enough elements per task to amortize it.
int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

}  // namespace

void bias_act_cpu(const BiasActParams& p) {
  COURSE_CPU_DISPATCH(p.dtype, "bias_act_cpu", [&] {
    using T = scalar_t;
    using A = at::opmath_type<T>;
    const T* x = static_cast<const T*>(p.x);
    const T* bias = static_cast<const T*>(p.bias);
    T* y = static_cast<T*>(p.y);
    T* pre = static_cast<T*>(p.pre);
    const A scale = static_cast<A>(p.scale);
    const int64_t words = mask_words_per_row(p.n);
    with_activation(p.act, [&](auto act) {
      using Act = decltype(act);
      at::parallel_for(0, p.rows, row_grain(p.n), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          uint32_t* mask = p.mask != nullptr ? p.mask + r * words : nullptr;
          if (mask != nullptr) std::fill(mask, mask + words, 0u);
          for (int64_t c = 0; c < p.n; ++c) {
            // x may be y or pre (in place): read before either is written.
            const A z = std::fma(static_cast<A>(x[r * p.n + c]), scale, bias ? static_cast<A>(bias[c]) : A(0));
            y[r * p.n + c] = static_cast<T>(Act::forward(z));
            if (pre != nullptr) pre[r * p.n + c] = static_cast<T>(z);
            if (mask != nullptr && course::relu_passes(z)) mask[c / 32] |= 1u << (c % 32);
          }
        }
      });
    });
  });
}

void act_backward_cpu(const ActBackwardParams& p) {
  COURSE_CPU_DISPATCH(p.dtype, "act_backward_cpu", [&] {
    using T = scalar_t;
    using A = at::opmath_type<T>;
    const T* dy = static_cast<const T*>(p.dy);
    const T* saved = static_cast<const T*>(p.saved);
    const T* bias = static_cast<const T*>(p.bias);
    T* dx = static_cast<T*>(p.dx);
    T* dbias = static_cast<T*>(p.dbias);
    const A scale = static_cast<A>(p.scale);
    const int64_t words = mask_words_per_row(p.n);
    const int64_t chunks = (p.rows + kRowChunk - 1) / kRowChunk;
    std::vector<A> partial(static_cast<size_t>(chunks * p.n), A(0));
    with_activation(p.act, [&](auto act) {
      using Act = decltype(act);
      at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t k = begin; k < end; ++k) {
          A* sum = partial.data() + k * p.n;
          for (int64_t r = k * kRowChunk; r < std::min(p.rows, (k + 1) * kRowChunk); ++r) {
            for (int64_t c = 0; c < p.n; ++c) {
              const int64_t i = r * p.n + c;
              A d;
              if (p.source == SaveKind::kInput) {
                d = Act::derivative(std::fma(static_cast<A>(saved[i]), scale, bias ? static_cast<A>(bias[c]) : A(0)));
              } else if (p.source == SaveKind::kOutput) {
                d = course::relu_passes(static_cast<A>(saved[i])) ? A(1) : A(0);
              } else {
                d = ((p.mask[r * words + c / 32] >> (c % 32)) & 1u) ? A(1) : A(0);
              }
              // relu's 0-or-1 derivative selects dy (threshold_backward: 0, not inf * 0, where
              // relu is flat); a smooth activation's multiplies, as the kernels do.
              const bool gate = p.source != SaveKind::kInput || Act::kGates;
              const A g = gate ? (d != A(0) ? static_cast<A>(dy[i]) : A(0)) : static_cast<A>(dy[i]) * d;
              dx[i] = static_cast<T>(g * scale);
              sum[c] += g;
            }
          }
        }
      });
    });
    for (int64_t c = 0; c < p.n; ++c) {
      A total = 0;
      for (int64_t k = 0; k < chunks; ++k) total += partial[k * p.n + c];
      dbias[c] = static_cast<T>(total);
    }
  });
}

void swiglu_cpu(const SwigluParams& p) {
  COURSE_CPU_DISPATCH(p.dtype, "swiglu_cpu", [&] {
    using T = scalar_t;
    using A = at::opmath_type<T>;
    const T* x = static_cast<const T*>(p.x);
    T* y = static_cast<T*>(p.y);
    at::parallel_for(0, p.rows, row_grain(p.half), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* a = x + r * 2 * p.half;
        const T* b = a + p.half;
        for (int64_t c = 0; c < p.half; ++c) {
          y[r * p.half + c] = static_cast<T>(Silu::forward(static_cast<A>(a[c])) * static_cast<A>(b[c]));
        }
      }
    });
  });
}

void swiglu_backward_cpu(const SwigluBackwardParams& p) {
  COURSE_CPU_DISPATCH(p.dtype, "swiglu_backward_cpu", [&] {
    using T = scalar_t;
    using A = at::opmath_type<T>;
    const T* x = static_cast<const T*>(p.x);
    const T* dy = static_cast<const T*>(p.dy);
    T* dx = static_cast<T*>(p.dx);
    at::parallel_for(0, p.rows, row_grain(p.half), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* a = x + r * 2 * p.half;
        const T* b = a + p.half;
        T* da = dx + r * 2 * p.half;
        T* db = da + p.half;
        for (int64_t c = 0; c < p.half; ++c) {
          const A av = static_cast<A>(a[c]);
          const A g = static_cast<A>(dy[r * p.half + c]);
          da[c] = static_cast<T>(g * static_cast<A>(b[c]) * Silu::derivative(av));
          db[c] = static_cast<T>(g * Silu::forward(av));
        }
      }
    });
  });
}

}  // namespace elementwise
}  // namespace fusion
