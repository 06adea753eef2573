// Torch-free device helpers every chapter's kernels share: the accumulation type of each
// storage dtype, the conversions to and from it, and explicit 16-byte vector accesses (aligned,
// and realigned for elements that start mid-vector). Chapter 1 introduced them; chapters 3, 4 and
// 6 reuse them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

namespace course {

// fp16 and bf16 are widened to fp32, computed, and rounded once at the store (what PyTorch's
// own kernels do); fp32 stays fp32 and fp64 stays fp64.
template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_acc(typename Acc<T>::type x) { return x; }
template <> __device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// 16 bytes of T, the unit of one 128-bit load or store (see load16/store16). Callers check
// that the pointers really are 16-byte aligned.
template <typename T> struct alignas(16) Vec16 {
  static constexpr int kLanes = 16 / sizeof(T);
  T v[kLanes];
};

// Explicit 128-bit accesses. Copying a Vec16 struct straight from global memory is not
// enough: once nvcc splits the struct into its fields it may load them one by one (it did in
// chapter 1: four 4-byte loads for v3's inputs, which ncu showed as 2.5x the load
// instructions). Moving the bits as CUDA's built-in int4 always compiles to one LDG.E.128 /
// STG.E.128; the memcpy between registers is free.
template <typename T>
__device__ __forceinline__ Vec16<T> load16(const Vec16<T>* p) {
  const int4 bits = *reinterpret_cast<const int4*>(p);
  Vec16<T> v;
  memcpy(&v, &bits, sizeof(v));
  return v;
}

// The mirror image, for global and shared memory alike. Where nvcc splits it into narrower stores
// (chapter 4's and 5's bias kernels: four 2- or 4-byte stores in nvcc 13.0), the kernel writes its
// one st.global.v4 itself (bias_act.cuh's store16_words). Not here: that form, four packed words
// and an asm store, raised LayerNorm's forward from 60 to 72 registers a thread (ptxas -v, sm_90a;
// blocks of 256 threads, 4 an SM down to 3), and its 8192 x 8192 forward went 15% slower on an H200.
template <typename T>
__device__ __forceinline__ void store16(Vec16<T>* p, const Vec16<T>& v) {
  int4 bits;
  memcpy(&bits, &v, sizeof(bits));
  *reinterpret_cast<int4*>(p) = bits;
}

// The kLanes = 16 / sizeof(T) elements from p on, where p is any element address, not
// necessarily on a 16-byte boundary (a row of 4099 bfloat16 elements starts 8198 bytes after the
// last: every distance from a boundary in turn): the aligned vector that holds p and, when the
// `wanted` first elements run past it (at most kLanes of them; all by default), the next aligned
// vector, shifted left by p's distance from the boundary. Why two aligned loads rather than
// single elements: in a warp walking adjacent elements the second vector is the neighbouring
// lane's first, so it is mostly an L1 hit, not a second trip to DRAM, and each lane still moves
// 16 bytes an instruction. The shift is selects and funnel shifts on registers: the distance is
// known only at run time, and an array indexed by it would live in local memory. No branch
// either: the second load is predicated and the selects run whatever the distance (0 is a shift
// of nothing), so the loads of a batch of these can all issue before any of their data is used.
// The second vector starts at zero, not at a copy of the first: the copy is a register move that
// waits for the first load's data, and the second load, predicated on top of it, then issued
// only once the first had returned: two memory round trips in a row where one suffices (SASS of
// swiglu's forward, sm_90a; ptxas may still make that copy where it sees the second vector's
// words go unused without the load, as in chapter 3's batches). The aligned address is p's
// pointer moved back, not rebuilt from an integer, so nvcc still knows it is global memory and
// emits LDG rather than a generic load.
// Elements past `wanted` are garbage (zeros, or the next row's): the caller must not use them.
// The caller also guarantees that the aligned vectors read lie inside the tensor
// (realigned_reads_inside, or load16_realigned_within where they may not).
// It comes in two halves, for a kernel that must issue several lanes' loads (of different kinds)
// before it uses any: realigned_issue makes the loads (the aligned vectors and p's distance from
// the boundary), realigned_finish the shift, once their data is wanted; load16_realigned is both.
struct Realigned {
  uint4 lo;
  uint4 hi;
  int bytes;
};

template <typename T>
__device__ __forceinline__ Realigned realigned_issue(const T* p, int wanted = Vec16<T>::kLanes) {
  constexpr int kLanes = Vec16<T>::kLanes;
  Realigned r;
  r.bytes = static_cast<int>(reinterpret_cast<uintptr_t>(p) % 16);  // a multiple of sizeof(T)
  const uint4* chunk = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(p) - r.bytes);
  r.lo = chunk[0];
  r.hi = make_uint4(0u, 0u, 0u, 0u);  // unused unless loaded: the words shifted in past `wanted`
  if (r.bytes / static_cast<int>(sizeof(T)) + wanted > kLanes) r.hi = chunk[1];
  return r;
}

template <typename T>
__device__ __forceinline__ Vec16<T> realigned_finish(const Realigned& r) {
  const uint32_t w[8] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w, r.hi.x, r.hi.y, r.hi.z, r.hi.w};
  // Whole words first (a two-level shifter: by 1 word, then by 2), then the half word a 2-byte
  // dtype may be off by, which __funnelshift_r takes from the next word (a shift of 0 is none).
  const int words = r.bytes / 4;
  uint32_t by1[7];
#pragma unroll
  for (int i = 0; i < 7; ++i) by1[i] = (words & 1) ? w[i + 1] : w[i];
  uint32_t by2[5];
#pragma unroll
  for (int i = 0; i < 5; ++i) by2[i] = (words & 2) ? by1[i + 2] : by1[i];
  const unsigned half = 8u * static_cast<unsigned>(r.bytes % 4);
  uint4 out;
  out.x = __funnelshift_r(by2[0], by2[1], half);
  out.y = __funnelshift_r(by2[1], by2[2], half);
  out.z = __funnelshift_r(by2[2], by2[3], half);
  out.w = __funnelshift_r(by2[3], by2[4], half);
  Vec16<T> v;
  memcpy(&v, &out, sizeof(v));
  return v;
}

template <typename T>
__device__ __forceinline__ Vec16<T> load16_realigned(const T* p, int wanted = Vec16<T>::kLanes) {
  return realigned_finish<T>(realigned_issue(p, wanted));
}

// Whether load16_realigned(p, wanted) reads only bytes of [lo, hi): the aligned vectors it loads
// must not start before lo nor end past hi. Bytes outside are harmless to the hardware
// (allocations are 256-byte aligned) but they are not the tensor's (a view at an odd offset, the
// end of the last row), and compute-sanitizer reports the read.
template <typename T>
__device__ __forceinline__ bool realigned_reads_inside(const T* p, int wanted, const T* lo, const T* hi) {
  constexpr int kLanes = Vec16<T>::kLanes;
  const int off = static_cast<int>(reinterpret_cast<uintptr_t>(p) % 16) / static_cast<int>(sizeof(T));
  const T* first = p - off;
  return first >= lo && first + (off + wanted > kLanes ? 2 : 1) * kLanes <= hi;
}

// load16_realigned for a row of the tensor [lo, hi) whose aligned vectors may reach past it (the
// first row of a view at an odd offset starts mid-vector, the last row may end mid-vector): there
// the lane reads its `wanted` elements one by one, and the rest are zero (unused).
template <typename T>
__device__ __forceinline__ Vec16<T> load16_realigned_within(const T* p, int wanted, const T* lo, const T* hi) {
  constexpr int kLanes = Vec16<T>::kLanes;
  if (realigned_reads_inside(p, wanted, lo, hi)) return load16_realigned(p, wanted);
  Vec16<T> v{};
#pragma unroll
  for (int c = 0; c < kLanes; ++c) {
    if (c < wanted) v.v[c] = p[c];  // the lane's own elements: inside the tensor
  }
  return v;
}

}  // namespace course
