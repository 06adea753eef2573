// The softcap of the tensor-core kernels of both passes (attention.h: c = softcap * tanh(s / softcap)
// of each scaled score s), for flash_fwd_kernel.cuh and flash_bwd_kernel.cuh.
//
// Which tanh. tanh.approx.f32 is one MUFU.TANH, the price of the exponential each score already
// pays; its error, though, is bounded only by about 2^-11 (the PTX ISA's figure; tanh itself is at
// most 1), so a capped score c may move by about 2^-11 softcap, and p = exp(c - lse) by that much
// relatively. Rounding P to bfloat16 for P V already costs every p up to 2^-8 (the bound
// test_attention.py holds the tensor-core rungs to): the approximation stays inside that bound
// while 2^-11 softcap <= 2^-8, softcap <= 8 (kTanhApproxMaxSoftcap), and for bfloat16 only
// (float16's 2^-11 leaves it no room). Everywhere else (float16, and the caps of 30 and 50 that
// Grok and Gemma 2 use) tanh comes from the exponential, 1 - 2 / (2^(2 x log2 e) + 1): one
// MUFU.EX2 and one MUFU.RCP, and an error of a few float32 ulps of 1 (~1e-6 of softcap in c), far
// inside either bound. (tanhf would be exact to an ulp or two, but it is a longer libdevice
// routine with branches on the argument's range.) The kernels' kWindowSoftcap instantiations take
// the choice as a runtime flag (uniform across the grid): it costs a branch per tile, not one more
// instantiation of every kernel; a call without a softcap or window runs the other instantiation,
// which has no softcap code at all.
#pragma once

#include <cstdint>

namespace flash_attention {

// The largest softcap at which bfloat16 takes tanh.approx.f32 (above).
inline constexpr double kTanhApproxMaxSoftcap = 8.0;

// What a kernel needs: x = s * in is the tanh's argument (s an unscaled score q . k, in = scale /
// softcap), and c * out the capped score in the kernel's units (out = softcap, times log2(e) for
// kernels that work in log2 units). in == 0: no softcap.
struct Softcap {
  float in = 0.f;
  float out = 0.f;
  bool approx = false;
};

// From the params: `log2_units` for kernels whose softmax works in exp2.
inline Softcap make_softcap(double scale, double softcap, bool bf16, bool log2_units) {
  Softcap c;
  if (softcap > 0.0) {
    c.in = static_cast<float>(scale / softcap);
    c.out = static_cast<float>(softcap * (log2_units ? 1.4426950408889634 : 1.0));
    c.approx = bf16 && softcap <= kTanhApproxMaxSoftcap;
  }
  return c;
}

#if defined(__CUDACC__)
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// 1 - 2 / (e^(2x) + 1): e^(2x) overflows to inf for large x, and 2 / inf is 0, so tanh saturates to
// +-1 without a branch. __fdividef is rcp.approx and a multiply (it returns 0 for a divisor above
// 2^126, which is the limit wanted here).
__device__ __forceinline__ float tanh_exp2(float x) {
  return 1.f - __fdividef(2.f, exp2f(x * 2.8853900817779268f) + 1.f);
}
__device__ __forceinline__ float softcap_tanh(float x, bool approx) { return approx ? tanh_approx(x) : tanh_exp2(x); }
#endif

}  // namespace flash_attention
