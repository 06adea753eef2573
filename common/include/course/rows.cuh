// A row held in registers, spread over the threads that own it: how chapter 3's softmax (forward
// and backward) and chapter 4's LayerNorm and RMSNorm (forward and backward) keep each element
// in a register between reading it once and writing it once. Chapter 3 teaches it
// (softmax_rows.cuh adds its compile-time shapes and its split rows); chapter 4 reuses it.
//
//   load_tile / store_tile   thread t's share of a row into / out of a [kVectors][kLanes] array:
//                            16-byte vectors, from the row's first 16-byte boundary on when rows
//                            start mid-vector (row_access says which path a call takes)
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

// Blocks of half-warp or one-warp rows hold 128 threads (8 or 4 rows); larger shapes one row: a
// row of several warps reduces across the whole block (row_reduce's block_reduce), which two
// rows in one block would mix.
template <int kThreads> constexpr int kRowsPerBlock = kThreads <= 32 ? 128 / kThreads : 1;

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

// How a row reaches the registers of the threads that own it. The launcher decides once per
// call (row_access) and kernels take the choice as a template parameter, so each carries only
// its own path:
//   kVectors  every row starts on a 16-byte boundary and its length is a whole number of
//             vectors: thread t's vector j is vector j * kThreads + t of the row, so a warp's
//             loads are contiguous, and every vector is wholly inside the row or past its end;
//   kChunks   rows start anywhere (a length that is not a multiple of the vector moves each
//             row's start; a view may start mid-vector), but x and y start equally far from a
//             boundary: the row's aligned 16-byte chunks are vectors as above, counted from the
//             row's first boundary, and the few elements before it (the head) and after the last
//             whole chunk (the tail) are single elements in one extra slot of the tile: thread
//             t < head holds head element t, thread t < tail holds tail element t. Never more
//             than kLanes - 1 of each, so a row is at most 2 (kLanes - 1) single loads;
//   kScalar   x and y start at different distances from a boundary: single elements kThreads
//             apart, which keeps a warp's loads contiguous too.
enum class Access { kScalar, kVectors, kChunks };

// Vectors a thread's tile holds: kVectors, plus the slot of head and tail elements (kChunks).
template <Access kAccess, int kVectors>
constexpr int kTileVectors = kVectors + (kAccess == Access::kChunks ? 1 : 0);

// Where a row's elements are: its length, and for kChunks the elements before its first 16-byte
// boundary (head, fewer than a vector) and the end of its last whole chunk (body_end). Computed
// once per row (row_span) from the row's address; every tensor of the row (x and y) starts as far
// from a boundary (row_access checked it), so one span serves them all.
struct RowSpan {
  int64_t len;
  int64_t head;
  int64_t body_end;
};

template <Access kAccess, typename T>
__device__ __forceinline__ RowSpan row_span(const T* p, int64_t len) {
  if constexpr (kAccess != Access::kChunks) {
    return {len, 0, len};
  } else {
    constexpr int kLanes = course::Vec16<T>::kLanes;
    // p is a whole number of elements from any boundary: PyTorch keeps storage offsets in elements.
    const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % 16 / sizeof(T));
    int64_t head = misaligned ? kLanes - misaligned : 0;
    head = head < len ? head : len;
    return {len, head, head + (len - head) / kLanes * kLanes};
  }
}

// Element (j, l) of thread t's tile: its index in the row (tile_index) and whether the tile holds
// an element there at all (tile_valid: not past the row's end, not an empty edge slot). kVectors:
// vector j * kThreads + t; kChunks: the same counted from the row's head, and slot kVectors for
// the head (l == 0) and the tail (l == 1); kScalar: single elements kThreads apart, which keeps a
// warp's loads contiguous. Two functions rather than an index of -1 for "none": the compiler
// then keeps one base index per thread and constant offsets from it, not a register per element.
template <Access kAccess, int kThreads, int kVectors, int kLanes>
__device__ __forceinline__ int64_t tile_index(int j, int l, int t, const RowSpan& row) {
  if constexpr (kAccess == Access::kScalar) {
    return (static_cast<int64_t>(j) * kLanes + l) * kThreads + t;
  } else {
    if (kAccess == Access::kVectors || j < kVectors) {
      return row.head + (static_cast<int64_t>(j) * kThreads + t) * kLanes + l;
    }
    return l == 0 ? t : row.body_end + t;
  }
}

template <Access kAccess, int kThreads, int kVectors, int kLanes>
__device__ __forceinline__ bool tile_valid(int j, int l, int t, const RowSpan& row) {
  if constexpr (kAccess == Access::kScalar) {
    return tile_index<kAccess, kThreads, kVectors, kLanes>(j, l, t, row) < row.len;
  } else {
    if (kAccess == Access::kVectors || j < kVectors) {
      // The vector's first element decides: every vector is wholly inside the body or past it.
      return row.head + (static_cast<int64_t>(j) * kThreads + t) * kLanes < row.body_end;
    }
    return l == 0 ? t < row.head : (l == 1 && row.body_end + t < row.len);
  }
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

// Slot j of load_tile alone: what a kernel that uses a parameter row one vector at a time loads
// (weight and bias in the norms' last step, beside the one vector of x they scale).
template <Access kAccess, int kThreads, int kVectors, bool kColumns = false, typename T, typename S>
__device__ __forceinline__ void load_slot(const T* __restrict__ row, const RowSpan& span, int t, int j, S pad,
                                          S (&v)[course::Vec16<T>::kLanes]) {
  constexpr int kLanes = course::Vec16<T>::kLanes;
  constexpr bool kVectorLoads = kAccess == Access::kVectors || (kAccess == Access::kChunks && !kColumns);
  if (kVectorLoads && j < kVectors) {
    if (tile_valid<kAccess, kThreads, kVectors, kLanes>(j, 0, t, span)) {
      const int64_t first = tile_index<kAccess, kThreads, kVectors, kLanes>(j, 0, t, span);
      const course::Vec16<T> w = course::load16(reinterpret_cast<const course::Vec16<T>*>(row + first));
#pragma unroll
      for (int l = 0; l < kLanes; ++l) v[l] = convert_in<S>(w.v[l]);
    } else {
#pragma unroll
      for (int l = 0; l < kLanes; ++l) v[l] = pad;
    }
  } else {
#pragma unroll
    for (int l = 0; l < kLanes; ++l) {
      v[l] = tile_valid<kAccess, kThreads, kVectors, kLanes>(j, l, t, span)
                 ? convert_in<S>(row[tile_index<kAccess, kThreads, kVectors, kLanes>(j, l, t, span)])
                 : pad;
    }
  }
}

// Thread t's share of the row `span` describes, at row, into v; padding gets `pad`.
// kColumns: `row` is a parameter row (weight, bias) read at the columns the tile of another row
// holds, not a row of its own: with kChunks those columns start mid-vector in the parameter,
// which is read element by element (from L1: one row shared by every row of x).
template <Access kAccess, int kThreads, int kVectors, bool kColumns = false, typename T, typename S, int kSlots>
__device__ __forceinline__ void load_tile(const T* __restrict__ row, const RowSpan& span, int t, S pad,
                                          S (&v)[kSlots][course::Vec16<T>::kLanes]) {
  static_assert(kSlots == kTileVectors<kAccess, kVectors>, "a tile holds kVectors vectors (and kChunks' edge slot)");
#pragma unroll
  for (int j = 0; j < kSlots; ++j) load_slot<kAccess, kThreads, kVectors, kColumns>(row, span, t, j, pad, v[j]);
}

// The inverse of load_tile: thread t's share written to the row `span` describes, at row.
template <Access kAccess, int kThreads, int kVectors, typename T, typename S, int kSlots>
__device__ __forceinline__ void store_tile(T* __restrict__ row, const RowSpan& span, int t,
                                           const S (&v)[kSlots][course::Vec16<T>::kLanes]) {
  constexpr int kLanes = course::Vec16<T>::kLanes;
  constexpr bool kVectorStores = kAccess != Access::kScalar;
  static_assert(kSlots == kTileVectors<kAccess, kVectors>, "a tile holds kVectors vectors (and kChunks' edge slot)");
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    if (kVectorStores && j < kVectors) {
      if (tile_valid<kAccess, kThreads, kVectors, kLanes>(j, 0, t, span)) {
        const int64_t first = tile_index<kAccess, kThreads, kVectors, kLanes>(j, 0, t, span);
        course::Vec16<T> w;
#pragma unroll
        for (int l = 0; l < kLanes; ++l) w.v[l] = convert_out<T>(v[j][l]);
        course::store16(reinterpret_cast<course::Vec16<T>*>(row + first), w);
      }
    } else {
#pragma unroll
      for (int l = 0; l < kLanes; ++l) {
        if (tile_valid<kAccess, kThreads, kVectors, kLanes>(j, l, t, span)) {
          row[tile_index<kAccess, kThreads, kVectors, kLanes>(j, l, t, span)] = convert_out<T>(v[j][l]);
        }
      }
    }
  }
}

// Which path rows of n elements take (see Access), from the tensors' addresses: `rows` are the
// tensors of rows x n elements (x, y, ...), `columns` the parameter rows of n elements read at
// the same columns (weight, bias; null ones ignored). The launcher decides once per call.
template <typename T>
inline Access row_access(int64_t n, std::initializer_list<const void*> rows,
                         std::initializer_list<const void*> columns = {}) {
  bool aligned = n % course::Vec16<T>::kLanes == 0;
  bool same = true;
  const uintptr_t first = reinterpret_cast<uintptr_t>(*rows.begin()) % 16;
  for (const void* p : rows) {
    if (p == nullptr) continue;
    aligned = aligned && course::is_aligned(p, 16);
    same = same && reinterpret_cast<uintptr_t>(p) % 16 == first;
  }
  for (const void* p : columns) aligned = aligned && (p == nullptr || course::is_aligned(p, 16));
  return aligned ? Access::kVectors : (same ? Access::kChunks : Access::kScalar);
}

// Calls f(std::integral_constant<Access, a>): kernels take the path as a template parameter.
// kAllowChunks false: the kernel has no kChunks path (its tiles keep columns fixed across rows,
// which the head of each row would shift), and such rows read single elements.
template <bool kAllowChunks = true, typename F>
cudaError_t with_access(Access a, F&& f) {
  if (a == Access::kVectors) return f(std::integral_constant<Access, Access::kVectors>{});
  if constexpr (kAllowChunks) {
    if (a == Access::kChunks) return f(std::integral_constant<Access, Access::kChunks>{});
  }
  return f(std::integral_constant<Access, Access::kScalar>{});
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
