// Chapter 3 kernels: softmax and log_softmax over rows, the ladder v1..v5.
//
//   y_i = exp(x_i - m) / s,   m = max_j x_j,   s = sum_j exp(x_j - m)
//   log_softmax: y_i = x_i - m - log(s)
//
// Subtracting the row maximum keeps every exponent <= 0, so nothing overflows (exp(89) is
// already inf in float32). The price is a reduction before the sum can start: the naive
// kernel reads the row three times (max, sum, normalize).
//
// Napkin math: softmax reads each element once and writes it once, 2 x 2^28 x 4 B = 2 GiB for
// 2^28 float32 elements, ~0.7 ms at the ~3 TB/s an H100 copies at. Every extra read of the row
// from DRAM adds half of that again: three reads and a write can reach at most 2/4 of copy,
// two reads 2/3; only one read reaches copy. Rows short enough for the L2 (50 MB) or a block's
// L1 may be re-read from cache instead, which is why the measured gaps are smaller than these
// bounds at short rows.
//
// No torch headers: this file builds with a bare `nvcc -c`.
#include "softmax_rows.cuh"

namespace shared_reduction {
namespace {

using namespace rows;  // NOLINT: the shared machinery of softmax_rows.cuh
using course::MaxOp;
using course::MaxSum;
using course::OnlineSoftmaxOp;
using course::SumOp;

// The streamed kernels (v1-v3) give a block of 256 threads to each row.
constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename A>
__device__ __forceinline__ A normalized(A shifted, A s, bool log) {
  return log ? shifted - ::log(s) : exp(shifted) / s;
}

// v1: three passes, three kernels, as a composition of PyTorch ops would run: the row maxima,
// then the row sums of exp(x - max), then an elementwise normalize. Each kernel reads the whole
// input again from DRAM (at 2^28 elements nothing stays in the L2 between kernels): three
// reads and one write, so at best half of copy.
template <typename T, bool kSumOfExp>
__global__ void __launch_bounds__(kThreads) softmax_row_statistic(const T* __restrict__ x, int64_t rows, int64_t n,
                                                                  typename Acc<T>::type* __restrict__ row_max,
                                                                  typename Acc<T>::type* __restrict__ row_sum) {
  using A = typename Acc<T>::type;
  __shared__ A smem[kThreads / 32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = x + r * n;
    if constexpr (!kSumOfExp) {
      A m = course::fold_row<kUnroll>(row, n, threadIdx.x, kThreads, MaxOp<A>::identity(), MaxOp<A>(),
                                      course::Identity());
      m = course::block_reduce<kThreads>(m, MaxOp<A>(), smem);
      if (threadIdx.x == 0) row_max[r] = m;
    } else {
      const A m = row_max[r];
      A s = course::fold_row<kUnroll>(row, n, threadIdx.x, kThreads, A(0), SumOp<A>(),
                                      [m](A v) { return exp(v - m); });
      s = course::block_reduce<kThreads>(s, SumOp<A>(), smem);
      if (threadIdx.x == 0) row_sum[r] = s;
    }
  }
}

template <typename T, bool kLog>
__global__ void __launch_bounds__(kThreads) softmax_normalize(const T* __restrict__ x, T* __restrict__ y, int64_t total,
                                                              int64_t n, const typename Acc<T>::type* __restrict__ row_max,
                                                              const typename Acc<T>::type* __restrict__ row_sum) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total; i += step) {
    const int64_t r = i / n;
    y[i] = from_acc<T>(normalized(to_acc(x[i]) - row_max[r], row_sum[r], kLog));
  }
}

// v2: one kernel, one block per row, the three passes inside it with shared-memory block
// reductions between them. The statistics never leave the chip and there is one launch instead
// of three, but the row is still read three times; a row of a few KB stays in L1/L2 between
// the passes, a row of hundreds of KB (times the rows in flight) does not.
template <typename T, bool kLog>
__global__ void __launch_bounds__(kThreads) softmax_block_per_row(const T* __restrict__ x, T* __restrict__ y,
                                                                  int64_t rows, int64_t n) {
  using A = typename Acc<T>::type;
  __shared__ A smem[kThreads / 32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = x + r * n;
    A m = course::fold_row<kUnroll>(row, n, threadIdx.x, kThreads, MaxOp<A>::identity(), MaxOp<A>(),
                                    course::Identity());
    m = course::block_reduce<kThreads>(m, MaxOp<A>(), smem);
    A s = course::fold_row<kUnroll>(row, n, threadIdx.x, kThreads, A(0), SumOp<A>(),
                                    [m](A v) { return exp(v - m); });
    s = course::block_reduce<kThreads>(s, SumOp<A>(), smem);
    map_row(row, y + r * n, n, threadIdx.x, kThreads, [m, s](A v) { return normalized(v - m, s, kLog); });
  }
}

// v3: online softmax (Milakov and Gimelshein, "Online normalizer calculation for softmax",
// 2018). The maximum and the sum come out of one pass: each thread keeps (m, s) and, when a
// larger element arrives, rescales s by exp(m_old - m_new) before adding (course::
// OnlineSoftmaxOp); the block then combines its threads' states the same way. The row is read
// twice (statistics, normalize) instead of three times. This is the step FlashAttention takes:
// it never sees a whole row of scores, so it keeps exactly this (m, s) per row and rescales
// its running output whenever m grows.
template <typename T, bool kLog>
__global__ void __launch_bounds__(kThreads) softmax_online(const T* __restrict__ x, T* __restrict__ y,
                                                           int64_t rows, int64_t n) {
  using A = typename Acc<T>::type;
  __shared__ MaxSum<A> smem[kThreads / 32];
  const OnlineSoftmaxOp<A> op;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = x + r * n;
    MaxSum<A> st = course::fold_row<kUnroll>(row, n, threadIdx.x, kThreads, op.identity(), op,
                                             [](A v) { return MaxSum<A>{v, A(1)}; });
    st = course::block_reduce<kThreads>(st, op, smem);
    const A m = st.m;
    const A s = st.s;
    map_row(row, y + r * n, n, threadIdx.x, kThreads, [m, s](A v) { return normalized(v - m, s, kLog); });
  }
}

// The row in registers, shared by v4 and v5: a thread's tile of it, with the three steps of a
// softmax on it (its maximum, its sum of exponentials, and the normalized values written out).
// Two ways to keep the tile:
//   FloatTile   the elements as float32 values, each replaced by its exponential (computed once);
//   PackedTile  the elements as loaded, 16-bit, two to a 32-bit word (2-byte dtypes past the
//               floats' capacity, keeps_raw in reduction.h): twice the elements per register,
//               and exp computed again at the write. Words, not an array of 16-bit values: nvcc
//               keeps each value of such an array in a register of its own, which doubled the
//               registers and spilled.
template <typename T, Access kAccess, int kThreads, int kVectors>
struct FloatTile {
  using A = typename Acc<T>::type;
  static constexpr int kLanes = course::Vec16<T>::kLanes;
  A v[kTileVectors<kAccess, kVectors>][kLanes];

  __device__ __forceinline__ void load(const T* __restrict__ row, const RowSpan& span, int t) {
    load_tile<kAccess, kThreads, kVectors>(row, span, t, MaxOp<A>::identity(), v);
  }
  __device__ __forceinline__ A max() const {
    const MaxOp<A> op;
    A m = op.identity();
#pragma unroll
    for (const auto& vec : v) {
#pragma unroll
      for (A e : vec) m = op(m, e);
    }
    return m;
  }
  // The sum of exp(x - shift); each element becomes exp(x - shift) (softmax) or x - shift
  // (log_softmax) on the way, so the write needs no exp.
  template <bool kLog>
  __device__ __forceinline__ A exponentiate(A shift) {
    A s = A(0);
#pragma unroll
    for (auto& vec : v) {
#pragma unroll
      for (A& e : vec) {
        if constexpr (kLog) {
          e -= shift;
          s += exp(e);
        } else {
          e = exp(e - shift);
          s += e;
        }
      }
    }
    return s;
  }
  // y = e * k (softmax) or y = (x - shift) + k (log_softmax), written to `row`.
  template <bool kLog>
  __device__ __forceinline__ void store(T* __restrict__ row, const RowSpan& span, int t, A /*shift*/, A k) {
#pragma unroll
    for (auto& vec : v) {
#pragma unroll
      for (A& e : vec) e = kLog ? e + k : e * k;
    }
    store_tile<kAccess, kThreads, kVectors>(row, span, t, v);
  }
};

// bfloat16 and float16 as float32 from half of a 32-bit word (hi: the upper half). The half is
// taken out by a volatile instruction, which the compiler must repeat at every use: otherwise
// it keeps each element's float (one register per element) from the max to the write, which is
// what packing two elements to a register was meant to avoid (ptxas: 128 registers for the 512 x
// 8 shape, against 64 with the halves taken out at every use).
__device__ __forceinline__ uint32_t half_of(uint32_t w, bool hi) {
  uint32_t out;
  if (hi) {
    asm volatile("and.b32 %0, %1, 0xffff0000;" : "=r"(out) : "r"(w));
  } else {
    asm volatile("shl.b32 %0, %1, 16;" : "=r"(out) : "r"(w));
  }
  return out;  // the half, in the upper 16 bits
}
__device__ __forceinline__ float from_bits(uint32_t w, bool hi, __nv_bfloat16) {
  return __uint_as_float(half_of(w, hi));  // a bfloat16 is a float32's upper half
}
__device__ __forceinline__ float from_bits(uint32_t w, bool hi, __half) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(half_of(w, hi) >> 16)));
}
__device__ __forceinline__ uint32_t bits_of(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ __forceinline__ uint32_t bits_of(__half v) { return __half_as_ushort(v); }

template <typename T, Access kAccess, int kThreads, int kVectors>
struct PackedTile {
  static_assert(sizeof(T) == 2, "packed tiles hold 2-byte dtypes");
  using A = float;
  static constexpr int kLanes = course::Vec16<T>::kLanes;
  static constexpr int kSlots = kTileVectors<kAccess, kVectors>;
  uint32_t w[kSlots][kLanes / 2];  // element l of slot j: the (l % 2) half of word l / 2

  __device__ __forceinline__ float at(int j, int l) const { return from_bits(w[j][l / 2], l % 2 == 1, T{}); }

  __device__ __forceinline__ void load(const T* __restrict__ row, const RowSpan& span, int t) {
    const uint32_t pad = bits_of(from_acc<T>(-INFINITY));
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      if (kAccess != Access::kScalar && j < kVectors) {
        if (tile_valid<kAccess, kThreads, kVectors, kLanes>(j, 0, t, span)) {
          const int4 bits = *reinterpret_cast<const int4*>(row + tile_index<kAccess, kThreads, kVectors, kLanes>(j, 0, t, span));
          w[j][0] = bits.x;
          w[j][1] = bits.y;
          w[j][2] = bits.z;
          w[j][3] = bits.w;
        } else {
#pragma unroll
          for (int k = 0; k < kLanes / 2; ++k) w[j][k] = pad | pad << 16;
        }
      } else {
#pragma unroll
        for (int k = 0; k < kLanes / 2; ++k) {
          uint32_t word = 0;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int l = 2 * k + h;
            const uint32_t e = tile_valid<kAccess, kThreads, kVectors, kLanes>(j, l, t, span)
                                   ? bits_of(row[tile_index<kAccess, kThreads, kVectors, kLanes>(j, l, t, span)])
                                   : pad;
            word |= e << (16 * h);
          }
          w[j][k] = word;
        }
      }
    }
  }
  __device__ __forceinline__ float max() const {
    const MaxOp<float> op;
    float m = op.identity();
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
#pragma unroll
      for (int l = 0; l < kLanes; ++l) m = op(m, at(j, l));
    }
    return m;
  }
  template <bool kLog>
  __device__ __forceinline__ float exponentiate(float shift) const {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
#pragma unroll
      for (int l = 0; l < kLanes; ++l) s += exp(at(j, l) - shift);
    }
    return s;
  }
  // y = exp(x - shift) * k (softmax) or (x - shift) + k (log_softmax), the arithmetic of
  // FloatTile's two steps, computed vector by vector as it is written.
  template <bool kLog>
  __device__ __forceinline__ void store(T* __restrict__ row, const RowSpan& span, int t, float shift, float k) const {
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      course::Vec16<T> out;
#pragma unroll
      for (int l = 0; l < kLanes; ++l) {
        const float d = at(j, l) - shift;
        out.v[l] = from_acc<T>(kLog ? d + k : exp(d) * k);
      }
      if (kAccess != Access::kScalar && j < kVectors) {
        if (tile_valid<kAccess, kThreads, kVectors, kLanes>(j, 0, t, span)) {
          course::store16(reinterpret_cast<course::Vec16<T>*>(row + tile_index<kAccess, kThreads, kVectors, kLanes>(j, 0, t, span)), out);
        }
      } else {
#pragma unroll
        for (int l = 0; l < kLanes; ++l) {
          if (tile_valid<kAccess, kThreads, kVectors, kLanes>(j, l, t, span)) {
            row[tile_index<kAccess, kThreads, kVectors, kLanes>(j, l, t, span)] = out.v[l];
          }
        }
      }
    }
  }
};

// The tile a thread keeps for shape kThreads x kVectors (keeps_raw in reduction.h). Rows read
// element by element (kScalar: x and y misaligned differently, a rare view) keep floats: 64
// single loads packed two to a word took ptxas past 128 registers (960 bytes of spills), and
// 64 floats fit.
template <typename T, Access kAccess, int kThreads, int kVectors>
using Tile = std::conditional_t<keeps_raw({kThreads, kVectors}, sizeof(T), false) && kAccess != Access::kScalar,
                                PackedTile<T, kAccess, kThreads, kVectors>, FloatTile<T, kAccess, kThreads, kVectors>>;

// v4: the row held in registers. kThreads threads per row (a warp, or a block of 128-512)
// each load kVectors 16-byte vectors of it once; the maximum, the exponentials, the sum and
// the normalized values are all computed on those registers, and each element is written
// once: one read and one write, the copy's traffic. Short rows get a warp each, so the
// reductions are shuffles alone. Rows longer than the largest shape run v3's kernel. Rows that
// start mid-vector (a length that is not a multiple of 8 bf16 or 4 float32) still move as
// 16-byte chunks from their first boundary on, with a few single elements at each end
// (course::rows::Access::kChunks).
template <typename T, int kThreadsPerRow, int kVectors, bool kLog, Access kAccess>
__global__ void __launch_bounds__(kThreadsPerRow * kRowsPerBlock<kThreadsPerRow>)
    softmax_resident(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t n) {
  using A = typename Acc<T>::type;
  constexpr int kRows = kRowsPerBlock<kThreadsPerRow>;
  __shared__ A smem[32];
  const int t = threadIdx.x % kThreadsPerRow;
  // The whole block steps together, so two half-warp rows of one warp stay converged for the
  // shuffles; a thread past the last row works on padding and stores nothing.
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kRows; first < rows;
       first += static_cast<int64_t>(gridDim.x) * kRows) {
    const int64_t r = first + threadIdx.x / kThreadsPerRow;
    const int64_t len = r < rows ? n : 0;
    const int64_t offset = (r < rows ? r : 0) * n;
    const RowSpan span = row_span<kAccess>(x + offset, len);
    Tile<T, kAccess, kThreadsPerRow, kVectors> tile;
    tile.load(x + offset, span, t);
    const A m = row_reduce<kThreadsPerRow>(tile.max(), MaxOp<A>(), smem);
    const A s = row_reduce<kThreadsPerRow>(tile.template exponentiate<kLog>(m), SumOp<A>(), smem);
    tile.template store<kLog>(y + offset, span, t, m, kLog ? -::log(s) : A(1) / s);
  }
}

// v5: rows too long for one block, split over `splits` blocks. Each block holds its chunk in
// registers as v4 does and computes the chunk's (max, sum of exp) as a partial; the blocks of
// a row then wait for each other (course::arrive_and_wait), every one combines the row's
// partials in the same order (online-softmax rescaling), and each normalizes and writes its
// own chunk. Still one read and one write per element.
//
// Waiting blocks are only safe when all blocks of a row run at once: the launch is cooperative
// (every block resident, or the launch fails) and persistent: block b takes work items
// b, b + grid, ... with item = row * splits + chunk, and the grid is a multiple of `splits`, so
// all chunks of a row are taken in the same round by resident blocks.
//
// The wait is what keeps v5 below the copy rate at long rows (NOTES.md has the measurements):
// the fewer bytes a block holds, the more often it waits for the same bytes moved. 2-byte
// dtypes therefore keep their chunk as loaded (keeps_raw: 256 x 8 vectors, as many elements as
// float32's 256 x 8 holds twice over) and compute exp twice, rather than keep float
// exponentials in half the elements.
//
// Four blocks per SM (64 registers) in float32; 2-byte dtypes run three.
template <typename T, int kShape, bool kLog, Access kAccess>
__global__ void __launch_bounds__(kResidentShapes[kShape].threads,
                                  split_blocks_per_sm(sizeof(T), false))
    softmax_split(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t n, int64_t splits,
                  MaxSum<typename Acc<T>::type>* __restrict__ partial, unsigned* __restrict__ arrived) {
  using A = typename Acc<T>::type;
  constexpr int kThreadsPerRow = kResidentShapes[kShape].threads;
  constexpr int kVectors = kResidentShapes[kShape].vectors;
  constexpr int kLanes = course::Vec16<T>::kLanes;
  constexpr int64_t kChunk = static_cast<int64_t>(kThreadsPerRow) * kVectors * kLanes;
  __shared__ A smem[32];
  const OnlineSoftmaxOp<A> op;
  const int t = threadIdx.x;
  for (int64_t item = blockIdx.x; item < rows * splits; item += gridDim.x) {
    const int64_t r = item / splits;
    const int64_t begin = (item % splits) * kChunk;
    const int64_t len = n - begin < kChunk ? n - begin : kChunk;
    const int64_t offset = r * n + begin;
    // kChunk is a whole number of vectors: every chunk of a row starts as far from a 16-byte
    // boundary as the row does.
    const RowSpan span = row_span<kAccess>(x + offset, len);
    Tile<T, kAccess, kThreadsPerRow, kVectors> tile;
    tile.load(x + offset, span, t);
    const A m = row_reduce<kThreadsPerRow>(tile.max(), MaxOp<A>(), smem);
    // A chunk of only -inf is shifted by 0, so its exponentials are 0 rather than NaN and its
    // partial (-inf, 0) drops out of the combine.
    const A shift = m == course::negative_infinity<A>() ? A(0) : m;
    const A s = row_reduce<kThreadsPerRow>(tile.template exponentiate<kLog>(shift), SumOp<A>(), smem);
    if (t == 0) partial[item] = {m, s};
    course::arrive_and_wait(&arrived[r], static_cast<unsigned>(splits));
    // Every warp of every block of the row folds the partials in the same order and then
    // combines its lanes with the same butterfly: the same (M, S) bits everywhere. __ldcg reads
    // through L2, which the other SMs wrote to (this SM's L1 is not coherent with them).
    MaxSum<A> total = op.identity();
    for (int64_t k = t % 32; k < splits; k += 32) {
      const MaxSum<A>* p = partial + r * splits + k;
      total = op(total, MaxSum<A>{__ldcg(&p->m), __ldcg(&p->s)});
    }
    total = course::warp_reduce(total, op);
    tile.template store<kLog>(y + offset, span, t, shift,
                              kLog ? shift - total.m - ::log(total.s) : exp(shift - total.m) / total.s);
  }
}

// v5, a row parked in shared memory (RowPlanKind::kShared, reduction.h): a 2-byte row too long
// for one block's registers (16385 to 57344 elements: the vocabularies of Llama 2 and GPT-2)
// when there are rows enough for every SM. One block of kSharedThreads per row copies the row
// from DRAM into shared memory as loaded, keeping the maximum on the way; reads it back for the
// sum of exponentials; reads it again to write y. One read and one write of DRAM, and no block
// waits for another (the split rows' cost). Each thread reads back only the 16-byte slots it
// wrote, so the passes need no barrier of their own; the two block reductions have theirs.
// The slots start at the row's first 16-byte boundary (lead puts it on one in shared memory);
// the few elements before it and after the last whole vector stay in registers.
template <typename T, bool kLog, Access kAccess>
__global__ void __launch_bounds__(kSharedThreads)
    softmax_shared(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t n) {
  using A = typename Acc<T>::type;
  using V = course::Vec16<T>;
  constexpr int kLanes = V::kLanes;
  extern __shared__ int4 parked_words[];
  __shared__ A smem[32];
  const MaxOp<A> max_op;
  const int t = threadIdx.x;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    const RowSpan span = row_span<kAccess>(xr, n);
    const int64_t vectors = (span.body_end - span.head) / kLanes;
    // The row's vector j sits in slot j of `parked`: shared memory is 16-byte aligned.
    V* parked = reinterpret_cast<V*>(parked_words);
    const V* xv = reinterpret_cast<const V*>(xr + span.head);
    A m = max_op.identity();
    for (int64_t j = t; j < vectors; j += kSharedThreads) {
      const V w = course::load16(xv + j);
      course::store16(parked + j, w);
#pragma unroll
      for (int l = 0; l < kLanes; ++l) m = max_op(m, to_acc(w.v[l]));
    }
    // Head and tail: thread t holds element t of each, fewer than kLanes of either.
    const int64_t tail = span.len - span.body_end;
    const A head_v = t < span.head ? to_acc(xr[t]) : max_op.identity();
    const A tail_v = t < tail ? to_acc(xr[span.body_end + t]) : max_op.identity();
    m = course::block_reduce<kSharedThreads>(max_op(m, max_op(head_v, tail_v)), max_op, smem);
    A s = A(0);
    for (int64_t j = t; j < vectors; j += kSharedThreads) {
      const V w = course::load16(parked + j);
#pragma unroll
      for (int l = 0; l < kLanes; ++l) s += exp(to_acc(w.v[l]) - m);
    }
    if (t < span.head) s += exp(head_v - m);
    if (t < tail) s += exp(tail_v - m);
    s = course::block_reduce<kSharedThreads>(s, SumOp<A>(), smem);
    // y as FloatTile computes it: exp(x - m) * (1 / s), or (x - m) + (-log s).
    const A k = kLog ? -::log(s) : A(1) / s;
    V* yv = reinterpret_cast<V*>(yr + span.head);
    for (int64_t j = t; j < vectors; j += kSharedThreads) {
      const V w = course::load16(parked + j);
      V out;
#pragma unroll
      for (int l = 0; l < kLanes; ++l) {
        const A d = to_acc(w.v[l]) - m;
        out.v[l] = from_acc<T>(kLog ? d + k : exp(d) * k);
      }
      course::store16(yv + j, out);
    }
    if (t < span.head) yr[t] = from_acc<T>(kLog ? (head_v - m) + k : exp(head_v - m) * k);
    if (t < tail) yr[span.body_end + t] = from_acc<T>(kLog ? (tail_v - m) + k : exp(tail_v - m) * k);
  }
}

// ===========================================================================================
// Launchers
// ===========================================================================================
unsigned row_grid(int64_t rows) { return grid_for(rows); }

template <typename T, bool kLog>
cudaError_t launch_streamed(const SoftmaxParams& p, cudaStream_t stream) {
  softmax_online<T, kLog><<<row_grid(p.rows), kThreads, 0, stream>>>(
      static_cast<const T*>(p.x), static_cast<T*>(p.y), p.rows, p.n);
  return cudaGetLastError();
}

// v4 and v5 (float64 is streamed, see plan_row): softmax_rows.cuh's run_row_plan picks the
// kernel (resident, shared-memory row, split), as it does for the backward.
template <typename T, bool kLog>
cudaError_t launch_in_registers(const SoftmaxParams& p, cudaStream_t stream) {
  int sms = 0;
  COURSE_CUDA_TRY(course::sm_count(&sms));
  const RowPlan plan = plan_row(p.n, sizeof(T), p.version == SoftmaxVersion::kSplitRow, false, sms, p.rows);
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  using A = typename Acc<T>::type;
  auto streamed = [&] { return launch_streamed<T, kLog>(p, stream); };
  return run_row_plan<T, false>(
      plan, row_access<T>(p.n, {p.x, p.y}),
      [&](auto shape, auto access) -> cudaError_t {
        constexpr ResidentShape s = kResidentShapes[decltype(shape)::value];
        if constexpr (keeps_raw(s, sizeof(T), false)) {
          return cudaErrorInvalidValue;  // raw shapes serve split rows only (plan_row)
        } else {
          return launch_resident<s.threads>(softmax_resident<T, s.threads, s.vectors, kLog, decltype(access)::value>,
                                            p.rows, stream, x, y, p.rows, p.n);
        }
      },
      [&](auto access) {
        return launch_shared(softmax_shared<T, kLog, decltype(access)::value>, p.rows, parked_bytes<T>(p.n), stream,
                             streamed, x, y, p.rows, p.n);
      },
      [&](auto shape, auto access) {
        return launch_split(softmax_split<T, decltype(shape)::value, kLog, decltype(access)::value>, plan.blocks,
                            p.rows, stream, streamed, x, y, p.rows, p.n, plan.blocks,
                            static_cast<MaxSum<A>*>(p.workspace), p.counters);
      },
      streamed);
}

template <typename T, bool kLog>
cudaError_t run_softmax(const SoftmaxParams& p, cudaStream_t stream) {
  using A = typename Acc<T>::type;
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  switch (p.version) {
    case SoftmaxVersion::kThreePasses: {
      A* row_max = static_cast<A*>(p.workspace);
      A* row_sum = row_max + p.rows;
      softmax_row_statistic<T, false><<<row_grid(p.rows), kThreads, 0, stream>>>(x, p.rows, p.n, row_max, row_sum);
      COURSE_CUDA_TRY(cudaGetLastError());
      softmax_row_statistic<T, true><<<row_grid(p.rows), kThreads, 0, stream>>>(x, p.rows, p.n, row_max, row_sum);
      COURSE_CUDA_TRY(cudaGetLastError());
      const int64_t total = p.rows * p.n;
      softmax_normalize<T, kLog><<<grid_for(course::ceil_div(total, int64_t{kThreads})), kThreads, 0, stream>>>(
          x, y, total, p.n, row_max, row_sum);
      return cudaGetLastError();
    }
    case SoftmaxVersion::kBlockPerRow:
      softmax_block_per_row<T, kLog><<<row_grid(p.rows), kThreads, 0, stream>>>(x, y, p.rows, p.n);
      return cudaGetLastError();
    case SoftmaxVersion::kOnline:
      return launch_streamed<T, kLog>(p, stream);
    default:
      return launch_in_registers<T, kLog>(p, stream);
  }
}

}  // namespace

cudaError_t softmax_workspace(const SoftmaxParams& p, Workspace* ws) {
  return with_dtype(p.dtype, [&](auto tag) {
    using A = typename Acc<decltype(tag)>::type;
    *ws = Workspace{};
    if (p.version == SoftmaxVersion::kThreePasses) {
      ws->bytes = 2 * p.rows * static_cast<int64_t>(sizeof(A));
    } else if (p.version == SoftmaxVersion::kSplitRow) {
      int sms = 0;
      COURSE_CUDA_TRY(course::sm_count(&sms));
      const RowPlan plan = plan_row(p.n, sizeof(decltype(tag)), true, false, sms, p.rows);
      if (plan.kind == RowPlanKind::kSplit) {
        ws->bytes = p.rows * plan.blocks * static_cast<int64_t>(sizeof(MaxSum<A>));
        ws->counters = p.rows;
      }
    }
    return cudaSuccess;
  });
}

cudaError_t launch_softmax(const SoftmaxParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.n == 0) return cudaSuccess;
  return with_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    return p.log ? run_softmax<T, true>(p, stream) : run_softmax<T, false>(p, stream);
  });
}

}  // namespace shared_reduction
