// The activations of chapter 4 as functors, each a forward and a derivative written once and
// used by the CPU implementation (elementwise_cpu.cpp, host code) and by every CUDA kernel of
// the family: one templated kernel per memory pattern, instantiated per activation, instead of
// one hand-written kernel per activation (what PyTorch's own epilogues and CUTLASS do). The
// kernels that use them are in activation_kernels.cuh (this chapter's ladder) and
// common/include/course/bias_act.cuh (the fast ones, which chapter 5's fused_op runs too).
// Torch-free and CUDA-free: host and device code include it alike.
#pragma once

#include "elementwise.h"

#include <course/bias_act.h>
#include <course/index_math.h>

#include <math.h>

#include <cstdint>
#include <type_traits>

namespace fusion {
namespace elementwise {

// The float and double overloads of the math functions the functors need, callable from host
// and device code alike (C's erff, expf and tanhf exist on both sides).
COURSE_HOST_DEVICE inline float erf_of(float v) { return erff(v); }
COURSE_HOST_DEVICE inline double erf_of(double v) { return erf(v); }
COURSE_HOST_DEVICE inline float exp_of(float v) { return expf(v); }
COURSE_HOST_DEVICE inline double exp_of(double v) { return exp(v); }
COURSE_HOST_DEVICE inline float tanh_of(float v) { return tanhf(v); }
COURSE_HOST_DEVICE inline double tanh_of(double v) { return tanh(v); }

// kFast: the hardware's approximate exp (ex2.approx) and a reciprocal instead of a division,
// for kernels whose outputs are 16-bit (kFastMath below). Rounding to bfloat16 (8 significant
// bits) or float16 (11) hides their few-ulp float error. The motive is the instruction budget
// of a kernel at copy speed (about 40 per element for a bfloat16 map on an H100); measured, it
// bought the backward kernels a few percent and the forward ones nothing (the README's
// activation section). float32 and float64 results, and the CPU, keep the exact forms.
template <bool kFast, typename A>
COURSE_HOST_DEVICE inline A exp_maybe_fast(A v) {
#if defined(__CUDA_ARCH__)
  if constexpr (kFast && std::is_same_v<A, float>) return __expf(v);
#endif
  return exp_of(v);
}
template <bool kFast, typename A>
COURSE_HOST_DEVICE inline A reciprocal_maybe_fast(A v) {
#if defined(__CUDA_ARCH__)
  if constexpr (kFast && std::is_same_v<A, float>) return __fdividef(A(1), v);
#endif
  return A(1) / v;
}

// relu(z) = max(z, 0). NaN propagates, as in torch.relu. The derivative at 0 is 0, as autograd's,
// and at NaN 1, as torch's threshold_backward lets the gradient through where z is not <= 0
// (course::relu_passes). kGates: a derivative of 0 or 1, so the backward selects dy or 0 rather
// than multiplying (an infinite dy where relu is flat gives 0, as threshold_backward's does).
struct Relu {
  static constexpr bool kGates = true;
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A forward(A z) {
    return (z > A(0) || z != z) ? z : A(0);
  }
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A derivative(A z) {
    return course::relu_passes(z) ? A(1) : A(0);
  }
};

// gelu(z) = z * Phi(z), Phi the standard normal CDF (torch.nn.functional.gelu, approximate="none").
struct GeluErf {
  static constexpr bool kGates = false;
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A forward(A z) {
    return A(0.5) * z * (A(1) + erf_of(z * A(0.70710678118654752440)));  // 1 / sqrt(2)
  }
  // Phi(z) + z * phi(z), phi the normal density.
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A derivative(A z) {
    const A cdf = A(0.5) * (A(1) + erf_of(z * A(0.70710678118654752440)));
    const A pdf = exp_maybe_fast<kFast>(A(-0.5) * z * z) * A(0.39894228040143267794);  // 1 / sqrt(2 pi)
    return cdf + z * pdf;
  }
};

// gelu's tanh approximation (approximate="tanh"): 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))),
// its derivative written as torch's GeluBackward writes it.
struct GeluTanh {
  static constexpr bool kGates = false;
  static constexpr double kBeta = 0.79788456080286535588;  // sqrt(2 / pi)
  static constexpr double kKappa = 0.044715;
  // kFast uses 0.5 (1 + tanh(u)) = sigmoid(2u), exact algebra: one approximate exp and one
  // reciprocal instead of tanhf, and no cancellation in 1 + tanh(u) where tanh(u) nears -1.
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A forward(A z) {
    const A inner = A(kBeta) * (z + A(kKappa) * z * z * z);
    if constexpr (kFast) return z * reciprocal_maybe_fast<kFast>(A(1) + exp_maybe_fast<kFast>(A(-2) * inner));
    return A(0.5) * z * (A(1) + tanh_of(inner));
  }
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A derivative(A z) {
    const A inner = A(kBeta) * (z + A(kKappa) * z * z * z);
    const A inner_derivative = A(kBeta) * (A(1) + A(3 * kKappa) * z * z);
    if constexpr (kFast) {  // s = sigmoid(2u) = 0.5 (1 + t), and 1 - t^2 = 4 s (1 - s)
      const A s = reciprocal_maybe_fast<kFast>(A(1) + exp_maybe_fast<kFast>(A(-2) * inner));
      return s + A(2) * z * s * (A(1) - s) * inner_derivative;
    }
    const A t = tanh_of(inner);
    return A(0.5) * (A(1) + t) + A(0.5) * z * (A(1) - t * t) * inner_derivative;
  }
};

// silu(z) = z * sigmoid(z). For z -> -inf, exp(-z) overflows to inf and sigmoid to 0: the limits
// are right without a branch.
struct Silu {
  static constexpr bool kGates = false;
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A sigmoid(A z) {
    return reciprocal_maybe_fast<kFast>(A(1) + exp_maybe_fast<kFast>(-z));
  }
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A forward(A z) {
    return z * sigmoid<A, kFast>(z);
  }
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A derivative(A z) {
    const A s = sigmoid<A, kFast>(z);
    return s * (A(1) + z * (A(1) - s));
  }
};

// The forward's shape: one 16-byte pack per thread and 8 blocks of 256 threads per SM (32
// registers), the shape of a copy kernel. Measured on the H100 with
// experiments/activation_tile_shapes.cu (results/<gpu>/chapter4_activation_tile_shapes.txt;
// rows in flight x blocks per SM, bias_silu and
// GELU-tanh on 16384 x 8192 bfloat16): two rows
// per thread at 62-70 registers (4 blocks per SM) ran at 86-90% of cudaMemcpy, one row at 32
// registers at 98-99%; with __frcp_rn's correctly rounded reciprocal (a slow path for
// denormals that holds registers) in place of the approximate one, no shape passed 90%.
// erff's polynomial does not fit 32 registers (ptxas: 52-60 bytes of spills in 16-bit types,
// and the run at one row and 8 blocks was the slowest of the experiment's GELU-erf shapes): it
// takes four rows in flight at 64 registers (4 blocks per SM), the experiment's best for it.
template <typename Act>
constexpr int kForwardRows = std::is_same_v<Act, GeluErf> ? 4 : 1;
template <typename Act>
constexpr int kForwardMinBlocks = 2048 / course::kTileThreads / (std::is_same_v<Act, GeluErf> ? 2 : 1);
// The same for the runtime enum: what the glue asks (course::forward_kernel) to name the
// forward's kernel without a GPU.
inline int forward_rows(Activation act) { return act == Activation::kGeluErf ? kForwardRows<GeluErf> : 1; }
inline int forward_min_blocks(Activation act) {
  return act == Activation::kGeluErf ? kForwardMinBlocks<GeluErf> : kForwardMinBlocks<Relu>;
}

// Calls f(Functor{}) for the activation `act` names: the one switch from the runtime enum to the
// compile-time functor that every launcher (and the CPU code) goes through.
template <typename F>
decltype(auto) with_activation(Activation act, F&& f) {
  switch (act) {
    case Activation::kRelu: return f(Relu{});
    case Activation::kGeluErf: return f(GeluErf{});
    case Activation::kGeluTanh: return f(GeluTanh{});
    case Activation::kSilu: break;
  }
  return f(Silu{});
}

}  // namespace elementwise
}  // namespace fusion
