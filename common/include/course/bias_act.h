// What a bias + activation op (chapter 4's family, chapter 5's fused_op) keeps for its backward,
// and the layout of its sign mask: host and device, torch- and CUDA-free, for the glue, the CPU
// implementations and the kernels alike (course/bias_act.cuh holds the kernels).
#pragma once

#include <course/index_math.h>

#include <cstdint>

namespace course {

// The backward of y = act(z), z = x * scale + bias, needs act'(z). For relu that is whether the
// gradient passes, which three things can tell:
//   kOutput  y itself: the gradient passes where y is not <= 0 (y > 0, or NaN);
//   kInput   x, from which z (and any activation's derivative) is recomputed;
//   kMask    one bit per element, written by the forward: set where z is not <= 0.
// "Not <= 0" rather than "> 0" is torch's threshold_backward: at a NaN input relu's gradient
// passes through (and turns NaN in the input's gradient where it should), instead of vanishing.
enum class SaveKind { kOutput, kInput, kMask };

// The bit mask: bit c % 32 of word c / 32 of row r is element (r, c). Every row starts a new
// word, so a row's bits never share a word with another row's and every word has one writer.
COURSE_HOST_DEVICE constexpr int64_t mask_words_per_row(int64_t n) { return (n + 31) / 32; }

// Whether relu's gradient passes at z (or at y = relu(z)): threshold_backward's rule.
template <typename A>
COURSE_HOST_DEVICE constexpr bool relu_passes(A z) {
  return !(z <= A(0));
}

}  // namespace course
