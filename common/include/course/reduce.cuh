// Torch-free building blocks of every reduction in the course: the reduction operators, the
// warp and block combines, a row fold with 16-byte loads at any alignment, the online softmax
// state, Welford's mean and variance state, and the arrive-and-wait of blocks that share a
// row. Chapter 3 teaches them; chapter 4's norms and chapter 6's attention softmax reuse them.
//
// The hierarchy, fastest first: a thread folds its elements in registers; a warp combines its
// 32 values with shuffles (registers to registers, no memory); a block combines its warps'
// values through shared memory; blocks combine through global memory.
//
// Determinism: every combine below happens in an order fixed by the shapes and the launch
// configuration alone, so the same input gives the same bits on every run (no atomics decide
// an order).
#pragma once

#include <course/numeric.cuh>

#include <cstdint>

namespace course {

template <typename A> __device__ __forceinline__ A negative_infinity() { return -A(INFINITY); }

// The reduction operators, written once as functors (as CUB does) so every kernel takes either.
template <typename A> struct SumOp {
  static __device__ __forceinline__ A identity() { return A(0); }
  __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};

// NaN propagates, as in torch.amax: `a != a` holds only for NaN, and `a > b` is false when b
// is NaN, so either NaN wins.
template <typename A> struct MaxOp {
  static __device__ __forceinline__ A identity() { return negative_infinity<A>(); }
  __device__ __forceinline__ A operator()(A a, A b) const { return (a != a || a > b) ? a : b; }
};

// The online softmax state (Milakov and Gimelshein, 2018): the running maximum m of the
// elements seen and the sum s of exp(x - m) over them. Two states combine by rescaling both
// sums to the larger maximum, so a row's normalizer can be built in one pass, in any grouping.
template <typename A> struct MaxSum {
  A m;
  A s;
};

template <typename A> struct OnlineSoftmaxOp {
  static __device__ __forceinline__ MaxSum<A> identity() { return {negative_infinity<A>(), A(0)}; }
  // One exponential per combine: only the state with the smaller maximum is rescaled. A NaN
  // maximum fails both comparisons and ends in the sum, so NaN spreads to the whole row.
  __device__ __forceinline__ MaxSum<A> operator()(MaxSum<A> a, MaxSum<A> b) const {
    // Both states empty (or all -inf): exp(-inf - -inf) would be NaN; there is nothing to
    // rescale. A row of only -inf still ends as NaN, as torch's does, when it is normalized.
    if (a.m == negative_infinity<A>() && b.m == negative_infinity<A>()) return {a.m, a.s + b.s};
    if (a.m >= b.m) return {a.m, a.s + b.s * exp(b.m - a.m)};
    return {b.m, b.s + a.s * exp(a.m - b.m)};
  }
};

// Welford's running mean and variance (Welford, 1962), in the pairwise form of Chan, Golub and
// LeVeque (1979): a state is (count, mean, m2) with m2 the sum of squared deviations from the
// mean; two states combine as
//   count = na + nb,  mean = (na * ma + nb * mb) / count,
//   m2 = m2a + m2b + (mb - ma)^2 * na * nb / count.
// One pass yields mean and variance (m2 / count) without the cancellation of sum(x^2) - n mean^2.
// A single element is the state (1, x, 0), so folding elements one by one and combining the
// threads' states are the same operation. The count is kept in the accumulation type: exact up
// to 2^24 elements in float32, far beyond any row.
template <typename A> struct Welford {
  A count;
  A mean;
  A m2;
};

// A product the compiler may not fuse into a neighbouring addition (an FMA rounds once where
// the written expression rounds twice, and which side gets fused would depend on the operand
// order: see WelfordOp).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

template <typename A> struct WelfordOp {
  static __device__ __forceinline__ Welford<A> identity() { return {A(0), A(0), A(0)}; }
  static __device__ __forceinline__ Welford<A> element(A x) { return {A(1), x, A(0)}; }
  // Symmetric in a and b bit for bit (na * ma + nb * mb is, with its products kept apart from
  // the addition, and (mb - ma)^2 == (ma - mb)^2), unlike the textbook ma + delta * nb / count:
  // the two lanes of a butterfly (warp_reduce) combine the same pair in opposite orders and
  // must end with the same bits.
  __device__ __forceinline__ Welford<A> operator()(Welford<A> a, Welford<A> b) const {
    const A count = a.count + b.count;
    if (count == A(0)) return identity();  // two empty states: nothing to divide
    const A delta = b.mean - a.mean;
    return {count, (mul_rn(a.count, a.mean) + mul_rn(b.count, b.mean)) / count,
            a.m2 + b.m2 + delta * delta * (a.count * b.count / count)};
  }
};

// Shuffles, overloaded for the states above (a struct moves field by field).
template <typename A>
__device__ __forceinline__ A shfl_xor(A v, int offset, int width) {
  return __shfl_xor_sync(0xffffffffu, v, offset, width);
}
template <typename A>
__device__ __forceinline__ MaxSum<A> shfl_xor(MaxSum<A> v, int offset, int width) {
  return {__shfl_xor_sync(0xffffffffu, v.m, offset, width),
          __shfl_xor_sync(0xffffffffu, v.s, offset, width)};
}

template <typename A>
__device__ __forceinline__ Welford<A> shfl_xor(Welford<A> v, int offset, int width) {
  return {__shfl_xor_sync(0xffffffffu, v.count, offset, width),
          __shfl_xor_sync(0xffffffffu, v.mean, offset, width),
          __shfl_xor_sync(0xffffffffu, v.m2, offset, width)};
}

// Combines v across each group of `width` consecutive lanes (a power of two <= 32) with a
// butterfly: every lane ends with the group's result, and every lane combines the same
// operands in the same grouping (a + b == b + a exactly in IEEE arithmetic), so all lanes hold
// the same bits. All 32 lanes must call it.
template <typename V, typename Op>
__device__ __forceinline__ V warp_reduce(V v, Op op, int width = 32) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    if (offset < width) v = op(v, shfl_xor(v, offset, width));
  }
  return v;
}

// Combines v across a block of kThreads threads (a multiple of 32), returning the result in
// every thread. `smem` holds at least kThreads / 32 values. Every warp reduces the warps'
// partials itself, which saves a third barrier for a broadcast.
template <int kThreads, typename V, typename Op>
__device__ __forceinline__ V block_reduce(V v, Op op, V* smem) {
  constexpr int kWarps = kThreads / 32;
  v = warp_reduce(v, op);
  if constexpr (kWarps == 1) {
    return v;
  } else {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    // A previous block_reduce on the same smem may still be reading it in a slower warp.
    __syncthreads();
    if (lane == 0) smem[warp] = v;
    // Every warp's partial must be in smem before any warp reads them.
    __syncthreads();
    v = lane < kWarps ? smem[lane] : Op::identity();
    return warp_reduce(v, op);
  }
}

// Folds f(x[i]) for i in [0, n) into acc, thread t of `threads` taking its share. Elements
// before p's first 16-byte boundary (the head) and after the last whole vector (the tail) are
// read one by one; the body as 16-byte vectors, kUnroll of them loaded before any is used, so
// each thread keeps kUnroll * 16 bytes in flight. Any alignment works: a row of an odd length
// starts wherever the previous one ended.
template <int kUnroll, typename T, typename A, typename Op, typename F>
__device__ __forceinline__ A fold_row(const T* __restrict__ p, int64_t n, int64_t t,
                                      int64_t threads, A acc, Op op, F f) {
  constexpr int kLanes = Vec16<T>::kLanes;
  const int64_t misaligned = (reinterpret_cast<uintptr_t>(p) % 16) / sizeof(T);
  const int64_t head = misaligned ? (kLanes - misaligned < n ? kLanes - misaligned : n) : 0;
  for (int64_t i = t; i < head; i += threads) acc = op(acc, f(to_acc(p[i])));
  const Vec16<T>* body = reinterpret_cast<const Vec16<T>*>(p + head);
  const int64_t vectors = (n - head) / kLanes;
  int64_t i = t;
  for (; i + (kUnroll - 1) * threads < vectors; i += kUnroll * threads) {
    Vec16<T> v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load16(body + i + u * threads);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int l = 0; l < kLanes; ++l) acc = op(acc, f(to_acc(v[u].v[l])));
    }
  }
  for (; i < vectors; i += threads) {
    const Vec16<T> v = load16(body + i);
#pragma unroll
    for (int l = 0; l < kLanes; ++l) acc = op(acc, f(to_acc(v.v[l])));
  }
  for (int64_t j = head + vectors * kLanes + t; j < n; j += threads) acc = op(acc, f(to_acc(p[j])));
  return acc;
}

struct Identity {
  template <typename A>
  __device__ __forceinline__ A operator()(A x) const { return x; }
};

// Blocks that share one row publish a partial each and wait until all `expected` have. In two
// halves, so a block may do other work between them: arrive() makes the block's partial
// visible device-wide and counts the block in; wait_for() polls until every block has. Only safe when every block of the row is resident at
// once (a cooperative launch guarantees it), else a waiting block could hold the SM a missing
// one needs.
__device__ __forceinline__ void arrive(unsigned* counter) {
  __syncthreads();  // every thread's share of the partial is written before thread 0 arrives
  if (threadIdx.x == 0) {
    __threadfence();  // the partial is visible device-wide before the count that announces it
    atomicAdd(counter, 1u);
  }
}

// An acquire load: what the other blocks wrote before their arrival is visible to reads after
// it. A full __threadfence() here would also wait for every load this thread still has in
// flight (work started between arrive and wait).
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void wait_for(const unsigned* counter, unsigned expected) {
  if (threadIdx.x == 0) {
    while (load_acquire(counter) < expected) {
    }
  }
  __syncthreads();  // no thread reads the partials before thread 0 saw them all
}

__device__ __forceinline__ void arrive_and_wait(unsigned* counter, unsigned expected) {
  arrive(counter);
  wait_for(counter, expected);
}

}  // namespace course
