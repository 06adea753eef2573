// A runtime size turned into a template argument, for the values of one list: the course's form of
// FlashAttention 2's HEADDIM_SWITCH. A kernel whose tile shapes depend on the head dim is a
// template on it and is compiled once per listed value; the launcher meets the head dim as a
// runtime number and calls
//
//   course::with_listed<kCudaHeadDims>(head_dim, cudaErrorInvalidValue, [&](auto d) {
//     return run_kernel<T, decltype(d)::value>(params, stream);
//   });
//
// The list lives in one constexpr array (chapter 6: attention.h's kCudaHeadDims), which the glue's
// checks read too, so the switch's cases cannot drift from what the glue lets through. Torch- and
// CUDA-free: host code, both compilers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

namespace course {

// f(std::integral_constant<int, v>{}) for the entry v of kValues equal to `value`, or `otherwise`
// when the list has no such entry (every caller's glue has refused it already: this is the
// answer for a launcher called directly with a value nobody compiled).
template <const auto& kValues, std::size_t I = 0, typename R, typename F>
R with_listed(int64_t value, R otherwise, F&& f) {
  constexpr std::size_t kCount = sizeof(kValues) / sizeof(kValues[0]);
  if constexpr (I == kCount) {
    return otherwise;
  } else {
    if (value == kValues[I]) return f(std::integral_constant<int, kValues[I]>{});
    return with_listed<kValues, I + 1>(value, otherwise, std::forward<F>(f));
  }
}

// Whether `value` is one of `values`, and the list as "32, 64, 96": the glue's check and its
// message, from the same array as the switch.
template <std::size_t N>
constexpr bool is_listed(const int (&values)[N], int64_t value) {
  for (int v : values) {
    if (v == value) return true;
  }
  return false;
}

template <std::size_t N>
std::string list_text(const int (&values)[N]) {
  std::string text;
  for (int v : values) text += (text.empty() ? "" : ", ") + std::to_string(v);
  return text;
}

}  // namespace course
