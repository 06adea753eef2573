// The softcap of the tensor-core kernels of both passes (attention.h: c = softcap * tanh(s / softcap)
// of each scaled score s), for flash_fwd_kernel.cuh, flash_bwd_kernel.cuh and the Hopper kernels.
//
// Which tanh. tanh.approx.f32 is one MUFU.TANH, the price of the exponential each score already
// pays; its error, though, is bounded only by about 2^-11 (the PTX ISA's figure; tanh itself is at
// most 1), so a capped score c may move by about 2^-11 softcap, and p = exp(c - lse) by that much
// relatively. Rounding P to bfloat16 for P V already costs every p up to 2^-8 (the bound
// test_attention.py holds the tensor-core rungs to): the approximation stays inside that bound
// while 2^-11 softcap <= 2^-8, softcap <= 8 (kTanhApproxMaxSoftcap), and for bfloat16 only
// (float16's 2^-11 leaves it no room). Everywhere else (float16, and the caps of 30 and 50 that
// Grok and Gemma 2 use) tanh comes from the exponential, to a few float32 ulps of 1 (~1e-6 of
// softcap in c), far inside either bound. (tanhf would be exact to an ulp or two, but it is a
// longer libdevice routine with branches on the argument's range.)
//
// Which reciprocal. tanh x = 1 - 2 / (e^(2x) + 1): capped_score takes the exponential and the
// reciprocal from the special-function unit (MUFU.EX2 and MUFU.RCP), so a capped score costs three
// MUFU instructions with the softmax's own exponential, where a plain score costs one. A reciprocal
// on the FMA pipe instead (a quadratic seed and two Newton steps: one MUFU and ten other
// instructions a score against two MUFU and eight) was tried and taken out: on an H100 it made the
// Hopper forward ~7% slower and left the backward within noise, since the forward is bound by the
// consumer warpgroups' instructions issued per score, not by the unit (the chapter's NOTES.md, "The
// softcap's tanh"). So the capped score is written in as few instructions as it takes: five (one
// multiply by a factor folded on the host, ex2.approx.ftz, an add, rcp.approx, one FFMA for
// out - 2 out r), where exp2f, __fdividef and out * (1 - 2 r) issued eight to ten.
//   The kernels' kWindowSoftcap instantiations take the choice of tanh as a runtime value (uniform
// across the grid): it costs a branch per tile, not one more instantiation of every kernel; a call
// without a softcap or window runs the other instantiation, which has no softcap code at all.
#pragma once

#include <cstdint>
#include <type_traits>

namespace flash_attention {

// The largest softcap at which bfloat16 takes tanh.approx.f32 (above).
inline constexpr double kTanhApproxMaxSoftcap = 8.0;

// The tanh of the softcap (above): none (no softcap), MUFU.TANH, or from the exponential (kRcp).
// The values are the ones the kernels' mangled names carry (test_attention.py reads them there).
enum class SoftcapTanh : int { kNone, kApprox, kRcp };

// What a kernel needs: the capped score of an unscaled score s (q . k) is out * tanh(x), x = s *
// scale / softcap, and out = softcap in the kernel's units (times log2(e) for kernels that work in
// log2 units). s * in is x, the argument of the mode's helper. in == 0 (tanh kNone): no softcap.
struct Softcap {
  float in = 0.f;
  float out = 0.f;
  SoftcapTanh tanh = SoftcapTanh::kNone;
  float in_exp2 = 0.f;  // in * 2 log2(e): kRcp's e^(2x) as one ex2 of s * in_exp2
};

// From the params: `log2_units` for kernels whose softmax works in exp2.
inline Softcap make_softcap(double scale, double softcap, bool bf16, bool log2_units) {
  Softcap c;
  if (softcap > 0.0) {
    constexpr double kLog2e = 1.4426950408889634;
    c.tanh = bf16 && softcap <= kTanhApproxMaxSoftcap ? SoftcapTanh::kApprox : SoftcapTanh::kRcp;
    c.in = static_cast<float>(scale / softcap);
    c.in_exp2 = static_cast<float>(scale / softcap * 2.0 * kLog2e);
    c.out = static_cast<float>(softcap * (log2_units ? kLog2e : 1.0));
  }
  return c;
}

#if defined(__CUDACC__)
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// 2^a on the special-function unit alone: ex2.approx.ftz (exp2f would add a rescaling around it
// for results below 2^-126, which flush to 0 here: 1 + E rounds them away anyway).
__device__ __forceinline__ float softcap_ex2(float a) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(a));
  return y;
}
// 1 / a on the special-function unit alone (1 / inf = 0: the saturation below).
__device__ __forceinline__ float softcap_rcp(float a) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(a));
  return y;
}
// The per-score helpers take the mode as a template argument, and a kernel runs its loop over the
// scores inside with_softcap_tanh, which passes the call's mode as a compile-time constant: each
// mode's loop is then code of its own. A runtime switch per score is if-converted (nvcc 13.0, the
// Hopper backward): every score would issue the instructions of every mode, predicated off.
template <SoftcapTanh M>
using SoftcapMode = std::integral_constant<SoftcapTanh, M>;
// kNoneToo: a kernel that reaches the loop without a softcap too (a window alone) gets kNone there;
// otherwise the caller has checked cap.in != 0 and kNone never comes (it runs kRcp's code).
template <bool kNoneToo = false, class Body>
__device__ __forceinline__ void with_softcap_tanh(const Softcap& cap, Body&& body) {
  if constexpr (kNoneToo) {
    if (cap.tanh == SoftcapTanh::kNone) return body(SoftcapMode<SoftcapTanh::kNone>{});
  }
  switch (cap.tanh) {
    case SoftcapTanh::kApprox: return body(SoftcapMode<SoftcapTanh::kApprox>{});
    default: return body(SoftcapMode<SoftcapTanh::kRcp>{});
  }
}

// The capped score c = out * tanh(x) of an unscaled score s (x = s * scale / softcap), and tanh(x)
// itself, which the backward's derivative 1 - tanh^2 needs (the forward uses c alone, and the
// compiler drops the rest). kRcp: tanh x = 1 - 2 r with r = 1 / (e^(2x) + 1), so c = out - 2 out r,
// one FFMA; with the multiply by in_exp2 (scale / softcap and 2 log2(e) in one factor), ex2, the
// add and rcp, five instructions a score, two of them MUFU. e^(2x) overflows to inf for large x and
// its reciprocal is 0, so tanh saturates to +-1 without a branch; for very negative x, ex2 flushes
// to 0 and tanh is -1 exactly, as 1 + E rounds any E below 2^-24 away anyway.
struct CappedScore {
  float c, tanh;
};
template <SoftcapTanh M>
__device__ __forceinline__ CappedScore capped_score(float s, const Softcap& cap) {
  static_assert(M != SoftcapTanh::kNone, "no softcap: no tanh");
  if constexpr (M == SoftcapTanh::kApprox) {
    const float th = tanh_approx(s * cap.in);
    return {cap.out * th, th};
  } else {
    const float r = softcap_rcp(softcap_ex2(s * cap.in_exp2) + 1.f);
    return {fmaf(-2.f * cap.out, r, cap.out), fmaf(-2.f, r, 1.f)};
  }
}
template <SoftcapTanh M>
__device__ __forceinline__ float softcap_score(float s, const Softcap& cap) {
  return capped_score<M>(s, cap).c;
}
#endif

}  // namespace flash_attention
