// A row held in registers, spread over the threads that own it: how chapter 3's softmax (forward
// and backward) and chapter 4's LayerNorm and RMSNorm (forward and backward) keep each element
// in a register between reading it once and writing it once. Chapter 3 teaches it
// (softmax_rows.cuh adds its compile-time shapes and its split rows); chapter 4 reuses it.
//
//   load_tile / store_tile   thread t's share of a row into / out of a [kVectors][kLanes] array,
//                            16-byte vectors when every row allows it (rows_vectorized)
//   row_reduce               one value per thread combined across the threads of a row
//   map_row                  the streamed counterpart: out = f(in) over a row of any alignment
//
// Torch-free, like the kernels that include it.
#pragma once

#include <course/index_math.h>
#include <course/numeric.cuh>
#include <course/reduce.cuh>

#include <cuda_runtime_api.h>

#include <climits>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace course {
namespace rows {

// Blocks of half-warp or one-warp rows hold 128 threads (8 or 4 rows); larger shapes one row.
template <int kThreads> constexpr int kRowsPerBlock = kThreads < 128 ? 128 / kThreads : 1;

// Combines v across the threads of one row: shuffles alone for a (half-)warp row, a block
// reduction otherwise.
template <int kThreads, typename V, typename Op>
__device__ __forceinline__ V row_reduce(V v, Op op, V* smem) {
  if constexpr (kThreads <= 32) {
    return course::warp_reduce(v, op, kThreads);
  } else {
    return course::block_reduce<kThreads>(v, op, smem);
  }
}

// Element (j, l) of thread t's share of a row. kVectorized (rows 16-byte aligned, their length
// a multiple of the vector): 16-byte vector j of the thread, vectors kThreads apart so a warp's
// loads are contiguous, and every vector wholly inside the row or wholly past its end. Else
// single elements kThreads apart, which keeps a warp's scalar loads contiguous too. A
// template parameter, not a branch: the kernel that takes the vector path carries no scalar
// path (and none of its 64-bit index registers).
template <bool kVectorized, int kThreads, int kLanes>
__device__ __forceinline__ int64_t tile_index(int j, int l, int t) {
  return kVectorized ? (static_cast<int64_t>(j) * kThreads + t) * kLanes + l
                     : (static_cast<int64_t>(j) * kLanes + l) * kThreads + t;
}

// S is the storage: the accumulation type (the forward keeps exponentials) or T itself (the
// backward keeps y and dy as stored: a 16-byte vector stays 4 registers in every dtype).
template <typename S, typename T>
__device__ __forceinline__ S convert_in(T x) {
  if constexpr (std::is_same_v<S, T>) {
    return x;
  } else {
    return to_acc(x);
  }
}
template <typename T, typename S>
__device__ __forceinline__ T convert_out(S x) {
  if constexpr (std::is_same_v<S, T>) {
    return x;
  } else {
    return from_acc<T>(x);
  }
}

// Thread t's share of row[0, len) into v; elements past len get `pad`.
template <bool kVectorized, int kThreads, int kVectors, typename T, typename S>
__device__ __forceinline__ void load_tile(const T* __restrict__ row, int64_t len, int t, S pad,
                                          S (&v)[kVectors][course::Vec16<T>::kLanes]) {
  constexpr int kLanes = course::Vec16<T>::kLanes;
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
    if constexpr (kVectorized) {
      const int64_t first = tile_index<true, kThreads, kLanes>(j, 0, t);
      if (first < len) {
        const course::Vec16<T> w = course::load16(reinterpret_cast<const course::Vec16<T>*>(row + first));
#pragma unroll
        for (int l = 0; l < kLanes; ++l) v[j][l] = convert_in<S>(w.v[l]);
      } else {
#pragma unroll
        for (int l = 0; l < kLanes; ++l) v[j][l] = pad;
      }
    } else {
#pragma unroll
      for (int l = 0; l < kLanes; ++l) {
        const int64_t i = tile_index<false, kThreads, kLanes>(j, l, t);
        v[j][l] = i < len ? convert_in<S>(row[i]) : pad;
      }
    }
  }
}

// The inverse of load_tile: thread t's share written to row[0, len).
template <bool kVectorized, int kThreads, int kVectors, typename T, typename S>
__device__ __forceinline__ void store_tile(T* __restrict__ row, int64_t len, int t,
                                           const S (&v)[kVectors][course::Vec16<T>::kLanes]) {
  constexpr int kLanes = course::Vec16<T>::kLanes;
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
    if constexpr (kVectorized) {
      const int64_t first = tile_index<true, kThreads, kLanes>(j, 0, t);
      if (first < len) {
        course::Vec16<T> w;
#pragma unroll
        for (int l = 0; l < kLanes; ++l) w.v[l] = convert_out<T>(v[j][l]);
        course::store16(reinterpret_cast<course::Vec16<T>*>(row + first), w);
      }
    } else {
#pragma unroll
      for (int l = 0; l < kLanes; ++l) {
        const int64_t i = tile_index<false, kThreads, kLanes>(j, l, t);
        if (i < len) row[i] = convert_out<T>(v[j][l]);
      }
    }
  }
}

// Whether rows of n elements at these addresses take the vector path (see tile_index). The
// launcher decides once per call: every row then starts on a 16-byte boundary.
template <typename T>
inline bool rows_vectorized(int64_t n, std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (!course::is_aligned(p, 16)) return false;
  }
  return n % course::Vec16<T>::kLanes == 0;
}

// Calls f(std::bool_constant<b>) : kernels take the choice as a template parameter.
template <typename F>
cudaError_t with_vectorized(bool b, F&& f) {
  return b ? f(std::true_type{}) : f(std::false_type{});
}

// out[i] = f(in[i]) for i in [0, n) of one row, thread t of `threads` (the streamed kernels:
// v1-v3 and the fallbacks). When in and out are equally misaligned, the body between their
// 16-byte boundaries moves as vectors; otherwise element by element.
template <typename T, typename F>
__device__ __forceinline__ void map_row(const T* __restrict__ in, T* __restrict__ out, int64_t n,
                                        int t, int threads, F f) {
  constexpr int kLanes = course::Vec16<T>::kLanes;
  const uintptr_t misaligned = reinterpret_cast<uintptr_t>(out) % 16;
  int64_t head = n;  // everything element by element unless the two rows line up
  if (reinterpret_cast<uintptr_t>(in) % 16 == misaligned) {
    head = misaligned ? kLanes - static_cast<int64_t>(misaligned / sizeof(T)) : 0;
    head = head < n ? head : n;
  }
  for (int64_t i = t; i < head; i += threads) out[i] = from_acc<T>(f(to_acc(in[i])));
  const int64_t vectors = (n - head) / kLanes;
  using V = course::Vec16<T>;
  for (int64_t v = t; v < vectors; v += threads) {
    const V a = course::load16(reinterpret_cast<const V*>(in + head) + v);
    V b;
#pragma unroll
    for (int l = 0; l < kLanes; ++l) b.v[l] = from_acc<T>(f(to_acc(a.v[l])));
    course::store16(reinterpret_cast<V*>(out + head) + v, b);
  }
  for (int64_t i = head + vectors * kLanes + t; i < n; i += threads) out[i] = from_acc<T>(f(to_acc(in[i])));
}

// A grid of `blocks` blocks, clamped to what a launch takes: at least one (a kernel with nothing
// to do returns at once), at most INT_MAX (grid-stride loops cover the rest).
inline unsigned grid_for(int64_t blocks) {
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > INT_MAX ? INT_MAX : blocks));
}

}  // namespace rows
}  // namespace course
