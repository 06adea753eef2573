// Torch-free device helpers every chapter's kernels share: the accumulation type of each
// storage dtype, the conversions to and from it, and explicit 16-byte vector accesses.
// Chapter 1 introduced them; chapters 3, 4 and 6 reuse them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

template <typename T>
__device__ __forceinline__ void store16(Vec16<T>* p, const Vec16<T>& v) {
  int4 bits;
  memcpy(&bits, &v, sizeof(bits));
  *reinterpret_cast<int4*>(p) = bits;
}

}  // namespace course
