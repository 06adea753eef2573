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

// The row in registers, shared by v4 and v5: its maximum, then each value replaced by
// exp(x - shift) (softmax) or x - shift (log_softmax), returning the sum of the exponentials
// over the caller's threads.
template <int kVectors, int kLanes, typename A, bool kLog>
__device__ __forceinline__ A exponentiate(A (&v)[kVectors][kLanes], A shift) {
  A s = A(0);
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
#pragma unroll
    for (int l = 0; l < kLanes; ++l) {
      if constexpr (kLog) {
        v[j][l] -= shift;
        s += exp(v[j][l]);
      } else {
        v[j][l] = exp(v[j][l] - shift);
        s += v[j][l];
      }
    }
  }
  return s;
}

template <int kVectors, int kLanes, typename A>
__device__ __forceinline__ A tile_max(const A (&v)[kVectors][kLanes]) {
  const MaxOp<A> op;
  A m = op.identity();
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
#pragma unroll
    for (int l = 0; l < kLanes; ++l) m = op(m, v[j][l]);
  }
  return m;
}

// y = e * scale (softmax) or y = v + add (log_softmax), in place.
template <int kVectors, int kLanes, typename A, bool kLog>
__device__ __forceinline__ void finish(A (&v)[kVectors][kLanes], A k) {
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
#pragma unroll
    for (int l = 0; l < kLanes; ++l) v[j][l] = kLog ? v[j][l] + k : v[j][l] * k;
  }
}

// v4: the row held in registers. kThreads threads per row (a warp, or a block of 128-512)
// each load kVectors 16-byte vectors of it once; the maximum, the exponentials, the sum and
// the normalized values are all computed on those registers, and each element is written
// once: one read and one write, the copy's traffic. The exponentials are computed once and
// kept. Short rows get a warp each, so the reductions are shuffles alone. Rows longer than the
// largest shape run v3's kernel.
template <typename T, int kThreadsPerRow, int kVectors, bool kLog, bool kVectorized>
__global__ void __launch_bounds__(kThreadsPerRow * kRowsPerBlock<kThreadsPerRow>)
    softmax_resident(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t n) {
  using A = typename Acc<T>::type;
  constexpr int kLanes = course::Vec16<T>::kLanes;
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
    A v[kVectors][kLanes];
    load_tile<kVectorized, kThreadsPerRow, kVectors>(x + offset, len, t, MaxOp<A>::identity(), v);
    const A m = row_reduce<kThreadsPerRow>(tile_max(v), MaxOp<A>(), smem);
    const A s = row_reduce<kThreadsPerRow>(exponentiate<kVectors, kLanes, A, kLog>(v, m), SumOp<A>(), smem);
    finish<kVectors, kLanes, A, kLog>(v, kLog ? -::log(s) : A(1) / s);
    store_tile<kVectorized, kThreadsPerRow, kVectors>(y + offset, len, t, v);
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
// The wait is what keeps v5 below the copy rate at long rows: NOTES.md has the measurements,
// and two attempts to hide it behind the next chunk's loads that did not pay.
//
// Four blocks per SM (64 registers) in float32; 2-byte dtypes, whose float copy of the chunk
// sits beside 16-bit loads, run three.
template <typename T, int kShape, bool kLog, bool kVectorized>
__global__ void __launch_bounds__(kResidentShapes[kShape].threads,
                                  (sizeof(T) == 2 ? 768 : 1024) / kResidentShapes[kShape].threads)
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
    A v[kVectors][kLanes];
    load_tile<kVectorized, kThreadsPerRow, kVectors>(x + offset, len, t, MaxOp<A>::identity(), v);
    const A m = row_reduce<kThreadsPerRow>(tile_max(v), MaxOp<A>(), smem);
    // A chunk of only -inf is shifted by 0, so its exponentials are 0 rather than NaN and its
    // partial (-inf, 0) drops out of the combine.
    const A shift = m == course::negative_infinity<A>() ? A(0) : m;
    const A s = row_reduce<kThreadsPerRow>(exponentiate<kVectors, kLanes, A, kLog>(v, shift), SumOp<A>(), smem);
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
    finish<kVectors, kLanes, A, kLog>(v, kLog ? shift - total.m - ::log(total.s) : exp(shift - total.m) / total.s);
    store_tile<kVectorized, kThreadsPerRow, kVectors>(y + offset, len, t, v);
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

// v4 and v5 for 2- and 4-byte dtypes (float64 is streamed, see plan_row).
template <typename T, bool kLog>
cudaError_t launch_in_registers(const SoftmaxParams& p, cudaStream_t stream) {
  if constexpr (sizeof(T) == 8) {
    return launch_streamed<T, kLog>(p, stream);
  } else {
    const RowPlan plan = plan_row(p.n, sizeof(T), p.version == SoftmaxVersion::kSplitRow, false);
    const T* x = static_cast<const T*>(p.x);
    T* y = static_cast<T*>(p.y);
    const bool vectorized = rows_vectorized<T>(p.n, {p.x, p.y});
    if (plan.kind == RowPlanKind::kResident) {
      return with_shape<T, false>(plan.shape, [&](auto shape) {
        return with_vectorized(vectorized, [&](auto vec) {
          constexpr ResidentShape s = kResidentShapes[decltype(shape)::value];
          constexpr int kRows = kRowsPerBlock<s.threads>;
          softmax_resident<T, s.threads, s.vectors, kLog, decltype(vec)::value>
              <<<row_grid(course::ceil_div(p.rows, int64_t{kRows})), s.threads * kRows, 0, stream>>>(x, y, p.rows, p.n);
          return cudaGetLastError();
        });
      });
    }
    if (plan.kind == RowPlanKind::kSplit) {
      return with_shape<T, false>(plan.shape, [&](auto shape) {
        return with_vectorized(vectorized, [&](auto vec) {
          constexpr int kShape = decltype(shape)::value;
          constexpr int threads = kResidentShapes[kShape].threads;
          if constexpr (threads != kSplitThreads) {
            return cudaErrorInvalidValue;  // plan_row splits over kSplitThreads-thread shapes only
          } else {
          auto* kernel = softmax_split<T, kShape, kLog, decltype(vec)::value>;
          int64_t grid = 0;
          COURSE_CUDA_TRY(split_grid(kernel, threads, plan.blocks, p.rows, &grid));
          if (grid == 0) return launch_streamed<T, kLog>(p, stream);  // too few SMs for one row
          using A = typename Acc<T>::type;
          return launch_cooperative(kernel, grid, threads, stream, x, y, p.rows, p.n, plan.blocks,
                                    static_cast<MaxSum<A>*>(p.workspace), p.counters);
          }
        });
      });
    }
    return launch_streamed<T, kLog>(p, stream);
  }
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
      const RowPlan plan = plan_row(p.n, sizeof(decltype(tag)), true, false);
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
