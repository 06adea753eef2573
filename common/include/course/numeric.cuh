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

// The store is the mirror image only in intent. An int4 copied from the elements (memcpy, then a
// C++ store), and even an int4 of four words built by shifts, came out of nvcc 13.0 in chapter
// 4's and 5's bias kernels as four stores (st.global.v2.u16 or st.global.u32 in 16-bit types,
// st.global.f32 in float32): once the int4 is split into its fields, nothing puts them back
// together. So store16 builds the four 32-bit words itself (word_of: the elements' bits, packed
// by shifts) and stores them with one st.global.v4.b32 written out, for every 16-byte type.
// Chapters 3 and 6 also store into shared memory with it, where st.global would be wrong:
// __isGlobal picks the instruction. Where the compiler knows the address space (a kernel's pointer
// arguments are global, a __shared__ array's are shared) the test folds away, and a shared
// slot gets a plain int4 store, which stays one st.shared.v4; elsewhere it is one isspacep.
template <typename T>
__device__ __forceinline__ unsigned int word_of(const Vec16<T>& v, int i) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8, "16 bytes of 1-8 byte elements");
  unsigned int w = 0;
  if constexpr (sizeof(T) == 8) {
    unsigned long long d;
    memcpy(&d, &v.v[i / 2], sizeof(d));
    w = static_cast<unsigned int>(i % 2 == 0 ? d : d >> 32);  // little-endian: the low word first
  } else if constexpr (sizeof(T) == 4) {
    memcpy(&w, &v.v[i], sizeof(w));
  } else if constexpr (sizeof(T) == 2) {
    unsigned short lo, hi;
    memcpy(&lo, &v.v[2 * i], sizeof(lo));
    memcpy(&hi, &v.v[2 * i + 1], sizeof(hi));
    w = static_cast<unsigned int>(lo) | (static_cast<unsigned int>(hi) << 16);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      unsigned char b;
      memcpy(&b, &v.v[4 * i + k], sizeof(b));
      w |= static_cast<unsigned int>(b) << (8 * k);
    }
  }
  return w;
}

template <typename T>
__device__ __forceinline__ void store16(Vec16<T>* p, const Vec16<T>& v) {
  const unsigned int w0 = word_of(v, 0), w1 = word_of(v, 1), w2 = word_of(v, 2), w3 = word_of(v, 3);
  if (__isGlobal(p)) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w0), "r"(w1), "r"(w2), "r"(w3) : "memory");
  } else {
    const int4 bits = make_int4(static_cast<int>(w0), static_cast<int>(w1), static_cast<int>(w2), static_cast<int>(w3));
    *reinterpret_cast<int4*>(p) = bits;
  }
}

}  // namespace course
