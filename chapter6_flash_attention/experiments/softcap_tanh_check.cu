// Checks the softcap's tanh (csrc/attention/softcap.cuh) on the GPU over every float32 argument, each
// mode against tanh in float64: the smallest program that can tell a wrong constant, saturation or
// sign in a mode's helper (the kernels' own tests see it only through rounded outputs) from the rest.
//
//   nvcc -std=c++17 -arch=sm_80 -o /tmp/softcap_tanh_check softcap_tanh_check.cu   (-arch: the GPU's)
//   /tmp/softcap_tanh_check   (prints each mode's largest error; exit 1 past a bound or on a wrong
//                              special value)
//
// Each mode is checked through both values capped_score gives the kernels: the capped score c (here
// with out = 1, softcap_score) and tanh itself (the backward's), with in = 1 (and kRcp's in_exp2 =
// 2 log2(e), as make_softcap sets it), so the argument s is exactly the helper's x. All 2^32
// bit patterns: zeros, subnormals, the largest floats, both infinities (tanh +-1) and the NaNs
// (NaN). The bounds, absolute: 2^-21 for kRcp (this program measured 2^-22.01 on an H100: the
// chapter's NOTES.md, which also has the FMA form this file checked until it was taken out), and
// twice the PTX ISA's ~2^-11 for tanh.approx.
#include "../csrc/attention/softcap.cuh"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace fa = flash_attention;

// The largest error found, as (error's float bits << 32 | argument's bits): non-negative floats
// order as their bits, so one 64-bit atomicMax keeps the worst argument with its error. `bad`: the
// special values answered wrongly (NaN where tanh is a number, a number where it is NaN).
struct Found {
  unsigned long long worst;
  unsigned long long bad;
  unsigned int first_bad;
};

template <fa::SoftcapTanh M, bool kScore>
__global__ void check(Found* found) {
  fa::Softcap cap;
  cap.in = 1.f, cap.out = 1.f, cap.tanh = M, cap.in_exp2 = static_cast<float>(2.0 * 1.4426950408889634);
  unsigned long long worst = 0, bad = 0;
  unsigned int first_bad = 0;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  // 64-bit index: a 32-bit one would wrap before 2^32 and never end.
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < (uint64_t{1} << 32); i += stride) {
    const unsigned int bits = static_cast<unsigned int>(i);
    const float s = __uint_as_float(bits);
    const float got = kScore ? fa::softcap_score<M>(s, cap) : fa::capped_score<M>(s, cap).tanh;
    const double want = tanh(static_cast<double>(s));
    if (isnan(want) != isnan(got)) {
      if (bad++ == 0) first_bad = bits;
      continue;
    }
    if (isnan(want)) continue;
    const float err = static_cast<float>(fabs(static_cast<double>(got) - want));
    const unsigned long long key = (static_cast<unsigned long long>(__float_as_uint(err)) << 32) | bits;
    worst = key > worst ? key : worst;
  }
  atomicMax(&found->worst, worst);
  if (bad > 0) {
    atomicAdd(&found->bad, bad);
    atomicCAS(&found->first_bad, 0u, first_bad);
  }
}

// The capped scores of n arguments in one mode, as a kernel's loop makes them: the special values'
// table below, and the kernel whose PTX test_attention.py reads (kRcp: its exponential and its
// reciprocal; kApprox: tanh.approx alone).
template <fa::SoftcapTanh M>
__global__ void cap_scores(const float* s, float* c, int n, fa::Softcap cap) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = fa::softcap_score<M>(s[i], cap);  // the grid's last block runs past n
}

template <fa::SoftcapTanh M, bool kScore>
bool run(const char* name, double bound, Found* d_found) {
  cudaMemset(d_found, 0, sizeof(Found));
  check<M, kScore><<<4096, 256>>>(d_found);
  Found f;
  if (cudaMemcpy(&f, d_found, sizeof(Found), cudaMemcpyDeviceToHost) != cudaSuccess) {
    std::printf("%s: %s\n", name, cudaGetErrorString(cudaGetLastError()));
    return false;
  }
  const unsigned int err_bits = static_cast<unsigned int>(f.worst >> 32), arg_bits = static_cast<unsigned int>(f.worst);
  float err, arg, first_bad;
  std::memcpy(&err, &err_bits, 4), std::memcpy(&arg, &arg_bits, 4), std::memcpy(&first_bad, &f.first_bad, 4);
  const bool ok = err <= bound && f.bad == 0;
  std::printf("%-22s max |error| %.3e (2^%.2f) at s = %.9g, bound 2^%.0f; wrong NaN or not: %llu  %s\n", name, err,
              err > 0 ? std::log2(err) : -INFINITY, arg, std::log2(bound), f.bad, ok ? "ok" : "FAILED");
  if (f.bad) std::printf("  first wrong special value: s = %.9g (bits 0x%08x)\n", first_bad, f.first_bad);
  return ok;
}

int main() {
  Found* d_found = nullptr;
  if (cudaMalloc(&d_found, sizeof(Found)) != cudaSuccess) {
    std::printf("no CUDA device: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  using T = fa::SoftcapTanh;
  const double exp2_bound = std::ldexp(1.0, -21), approx_bound = std::ldexp(1.0, -10);
  bool ok = true;
  ok &= run<T::kRcp, true>("rcp softcap_score", exp2_bound, d_found);
  ok &= run<T::kRcp, false>("rcp tanh", exp2_bound, d_found);
  ok &= run<T::kApprox, true>("approx softcap_score", approx_bound, d_found);
  ok &= run<T::kApprox, false>("approx tanh", approx_bound, d_found);
  // The special values in each mode, capped as the kernels cap them (out = 1). kRcp saturates
  // without a branch: exactly +-1 at +-inf (rcp.approx(+inf) is +0, the PTX ISA), NaN at NaN.
  const float specials[] = {0.f, -0.f, 1e-30f, 0.5f, 20.f, -20.f, INFINITY, -INFINITY, NAN};
  constexpr int kN = sizeof(specials) / sizeof(float);
  float *d_s = nullptr, *d_c = nullptr, c[2][kN];
  cudaMalloc(&d_s, sizeof(specials)), cudaMalloc(&d_c, 2 * sizeof(specials));
  cudaMemcpy(d_s, specials, sizeof(specials), cudaMemcpyHostToDevice);
  fa::Softcap cap;
  cap.in = 1.f, cap.out = 1.f, cap.in_exp2 = static_cast<float>(2.0 * 1.4426950408889634);
  cap_scores<T::kRcp><<<1, 32>>>(d_s, d_c, kN, cap);
  cap_scores<T::kApprox><<<1, 32>>>(d_s, d_c + kN, kN, cap);
  cudaMemcpy(c, d_c, sizeof(c), cudaMemcpyDeviceToHost);
  std::printf("%12s %14s %14s\n", "s", "rcp", "approx");
  for (int i = 0; i < kN; ++i) {
    std::printf("%12g %14.9g %14.9g\n", specials[i], c[0][i], c[1][i]);
  }
  const bool specials_ok = c[0][6] == 1.f && c[0][7] == -1.f && std::isnan(c[0][8]);
  std::printf("rcp special values (+-inf to +-1 exactly, NaN to NaN): %s\n", specials_ok ? "ok" : "FAILED");
  ok &= specials_ok;
  cudaFree(d_s), cudaFree(d_c);
  cudaFree(d_found);
  std::printf("%s\n", ok ? "all within their bounds" : "FAILED");
  return ok ? 0 : 1;
}
