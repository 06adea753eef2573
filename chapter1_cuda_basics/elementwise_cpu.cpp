// CPU implementations of vector_add, saxpy and relu: plain loops over contiguous memory,
// split across threads by at::parallel_for. Same arithmetic as the CUDA kernels: fp16/bf16
// computed in fp32 and rounded once, so the two backends agree to the last bit on add and relu.
#include "elementwise.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

namespace cuda_basics {
namespace {

// Below ~32K elements a loop finishes faster than waking another thread would take.
constexpr int64_t kGrainSize = 32768;

template <typename T>
void elementwise_cpu_typed(const ElementwiseParams& p) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  T* out = static_cast<T*>(p.out);
  const A alpha = static_cast<A>(p.alpha);
  const ElementwiseOp op = p.op;
  at::parallel_for(0, p.n, kGrainSize, [=](int64_t begin, int64_t end) {
    // The switch sits outside the loops so each loop body is branch-free and vectorizes.
    switch (op) {
      case ElementwiseOp::kAdd:
        for (int64_t i = begin; i < end; ++i) out[i] = static_cast<T>(A(a[i]) + A(b[i]));
        break;
      case ElementwiseOp::kSaxpy:
        for (int64_t i = begin; i < end; ++i) out[i] = static_cast<T>(alpha * A(a[i]) + A(b[i]));
        break;
      case ElementwiseOp::kRelu:
        // NaN < 0 is false, so NaN propagates as in torch.relu.
        for (int64_t i = begin; i < end; ++i) {
          const A x = A(a[i]);
          out[i] = static_cast<T>(x < A(0) ? A(0) : x);
        }
        break;
    }
  });
}

}  // namespace

void elementwise_cpu(const ElementwiseParams& params) {
  switch (params.dtype) {
    case DType::kFloat32: return elementwise_cpu_typed<float>(params);
    case DType::kFloat16: return elementwise_cpu_typed<c10::Half>(params);
    case DType::kBFloat16: return elementwise_cpu_typed<c10::BFloat16>(params);
    case DType::kFloat64: return elementwise_cpu_typed<double>(params);
  }
}

}  // namespace cuda_basics
