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
// Which reciprocal (SoftcapTanh). tanh|x| = 2 / (1 + E) - 1 with E = 2^(-2 |x| log2 e). kRcp
// (tanh_exp2, the default) takes the reciprocal from the special-function unit too (MUFU.RCP), so
// a capped score costs three MUFU instructions with the softmax's own exponential, where a plain
// score costs one. kFma (tanh_exp2_fma, COURSE_SOFTCAP_TANH=fma) computes it on the FMA pipe
// instead: E lies in [0, 1], so d = 1 + E lies in [1, 2], where a quadratic seed p(E) (the minimax
// one: relative error 1/99) and two Newton steps y <- y + y (1 - d y) (two FMAs each; the error
// squares: 1/99, 1.0e-4, 1.04e-8) reach float32, and copysign puts the sign back. One MUFU and ten
// other instructions a score (seven FMAs, an add, a multiply, a LOP3 for the sign) instead of two
// MUFU and eight. No clamp is needed: E = 0 at |x| = inf gives y = 1 exactly, and NaN stays NaN.
//   Why kRcp stays the default. The napkin said the unit was the limit: it serves 16 lanes a clock
// per SM, so on a Hopper a 128 x 128 tile's 16384 scores take ~1024 cycles of it per MUFU per
// score, and three of them (~3070) fill the ~3300 cycles of tensor-core time of the tile's two
// products at d = 128. Measured on an H100 (both modes from one build, b2 h16 s8192 d128 bf16
// causal softcap 30, against the same call without softcap): the forward went from 0.61x (kRcp,
// 1.456 ms) to 0.56x (kFma, 1.556 ms), slower, and the backward stayed within noise (0.72x ->
// 0.74x). So the Hopper forward is bound by issue slots, the consumer warpgroups' instructions per
// score, not by the unit: in its SASS the tanh is MUFU.EX2 + MUFU.RCP and 8 others with kRcp, one
// MUFU.EX2 and 10 others with kFma, 10 -> 11 instructions issued a score, and the ten on the FMA
// and ALU pipes cost more than the MUFU slot they free. Next to try: fewer instructions a score,
// or FlashAttention 4's split of the exponentials between the unit and a polynomial on the FMA
// pipe, only where the unit is measured to be the limit.
//   The error of tanh_exp2_fma, absolute (|tanh| <= 1): rounding d costs y 2^-24 relatively (2^-23
// in tanh = 2y - 1), the last Newton step's result 2^-25 (2^-24), the last FMA 2^-25, the Newton
// residual 2^-26.5: 2^-22.05 in all with an exact exponential (a float32 mirror of these steps
// over all 2^32 arguments: at most 2^-22.26), plus half of ex2.approx's relative error
// (d tanh / (dE / E) = 2E / (1 + E)^2 <= 1/2): within 2^-21 (experiments/softcap_tanh_check.cu
// measures every float32 argument on the GPU). The argument a = |s| * in is rounded once, as
// x = s * in was before (in carries the 2 log2 e).
//   Which one a call takes is read on the host, per launch, from the environment variable
// COURSE_SOFTCAP_TANH: unset, empty or "rcp" for the MUFU reciprocal, "fma" for the FMA one (any
// other value: the default; bench_attention.py refuses it by name), so one build times both
// (bench_attention.py --ops attention_softcap, once per value). tanh.approx keeps its cases.
//   The kernels' kWindowSoftcap instantiations take the choice as a runtime value (uniform across
// the grid): it costs a branch per tile, not one more instantiation of every kernel; a call without
// a softcap or window runs the other instantiation, which has no softcap code at all.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace flash_attention {

// The largest softcap at which bfloat16 takes tanh.approx.f32 (above).
inline constexpr double kTanhApproxMaxSoftcap = 8.0;

// The tanh of the softcap (above): none (no softcap), MUFU.TANH, or from the exponential with the
// reciprocal on the special-function unit (kRcp, the default) or on the FMA pipe (kFma).
enum class SoftcapTanh : int { kNone, kApprox, kRcp, kFma };

// The environment variable that picks kRcp or kFma (above), and its reading.
inline constexpr const char* kSoftcapTanhEnv = "COURSE_SOFTCAP_TANH";
inline SoftcapTanh softcap_tanh_from_env() {
  const char* v = std::getenv(kSoftcapTanhEnv);
  return v != nullptr && std::strcmp(v, "fma") == 0 ? SoftcapTanh::kFma : SoftcapTanh::kRcp;
}

// What a kernel needs: the capped score of an unscaled score s (q . k) is out * tanh(x), x = s *
// scale / softcap, and out = softcap in the kernel's units (times log2(e) for kernels that work in
// log2 units). s * in is the argument the mode's helper takes: x itself for kApprox and kRcp, 2 log2
// e times it for kFma (folded here: one rounding of the argument, and one multiply less a score).
// in == 0 (tanh kNone): no softcap.
struct Softcap {
  float in = 0.f;
  float out = 0.f;
  SoftcapTanh tanh = SoftcapTanh::kNone;
};

// From the params: `log2_units` for kernels whose softmax works in exp2.
inline Softcap make_softcap(double scale, double softcap, bool bf16, bool log2_units) {
  Softcap c;
  if (softcap > 0.0) {
    constexpr double kLog2e = 1.4426950408889634;
    c.tanh = bf16 && softcap <= kTanhApproxMaxSoftcap ? SoftcapTanh::kApprox : softcap_tanh_from_env();
    c.in = static_cast<float>(scale / softcap * (c.tanh == SoftcapTanh::kFma ? 2.0 * kLog2e : 1.0));
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
// kRcp: 1 - 2 / (e^(2x) + 1): e^(2x) overflows to inf for large x, and 2 / inf is 0, so tanh
// saturates to +-1 without a branch. __fdividef is rcp.approx and a multiply (it returns 0 for a
// divisor above 2^126, which is the limit wanted here).
__device__ __forceinline__ float tanh_exp2(float x) {
  return 1.f - __fdividef(2.f, exp2f(x * 2.8853900817779268f) + 1.f);
}
// 2^a on the special-function unit alone: ex2.approx.ftz (exp2f would add a rescaling around it
// for results below 2^-126, which flush to 0 here: 1 + E rounds them away anyway).
__device__ __forceinline__ float softcap_ex2(float a) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(a));
  return y;
}
// kFma: 1 / (1 + E), E = 2^(-a) of a = 2 |x| log2 e >= 0 (NaN stays NaN), on the FMA pipe (above).
__device__ __forceinline__ float softcap_rcp_fma(float e) {
  const float d = 1.f + e;  // in [1, 2]
  // The minimax quadratic of 1 / (1 + E) over [0, 1], relative error 1/99 (Remez).
  float y = fmaf(fmaf(32.f / 99.f, e, -80.f / 99.f), e, 98.f / 99.f);
  y = fmaf(y, fmaf(-d, y, 1.f), y);  // Newton: relative error (1/99)^2
  y = fmaf(y, fmaf(-d, y, 1.f), y);  // (1/99)^4, below float32's rounding
  return y;
}
// kFma's tanh(x) of a2 = 2 x log2 e (what s * cap.in is in that mode).
__device__ __forceinline__ float tanh_exp2_fma(float a2) {
  const float y = softcap_rcp_fma(softcap_ex2(-fabsf(a2)));
  return copysignf(fmaf(2.f, y, -1.f), a2);
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
    case SoftcapTanh::kFma: return body(SoftcapMode<SoftcapTanh::kFma>{});
    default: return body(SoftcapMode<SoftcapTanh::kRcp>{});
  }
}

// tanh(s * scale / softcap) of an unscaled score s: what the backward's derivative 1 - tanh^2 needs.
template <SoftcapTanh M>
__device__ __forceinline__ float softcap_tanh(float s, const Softcap& cap) {
  static_assert(M != SoftcapTanh::kNone, "no softcap: no tanh");
  const float x = s * cap.in;
  if constexpr (M == SoftcapTanh::kApprox) return tanh_approx(x);
  else if constexpr (M == SoftcapTanh::kRcp) return tanh_exp2(x);
  else return tanh_exp2_fma(x);
}
// The capped score out * tanh(s * scale / softcap). kFma folds out into the last step:
// out (2y - 1) = fma(y, 2 out, -out), one rounding instead of two and one instruction less.
template <SoftcapTanh M>
__device__ __forceinline__ float softcap_score(float s, const Softcap& cap) {
  if constexpr (M != SoftcapTanh::kFma) {
    return cap.out * softcap_tanh<M>(s, cap);
  } else {
    const float a2 = s * cap.in;
    const float y = softcap_rcp_fma(softcap_ex2(-fabsf(a2)));
    return copysignf(fmaf(y, cap.out + cap.out, -cap.out), a2);
  }
}
#endif

}  // namespace flash_attention
