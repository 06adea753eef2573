// Chapter 3 kernels: the backward of softmax and log_softmax, one fused pass per row.
//
//   softmax:      dx_i = y_i * (dy_i - sum_j dy_j * y_j)
//   log_softmax:  dx_i = dy_i - exp(y_i) * sum_j dy_j
//
// A row reduction followed by an elementwise map that needs the reduced value: the forward's
// shape again. Napkin math: read y and dy, write dx, 3 x 2^28 x 4 B = 3 GiB for 2^28 float32
// elements, ~1.07 ms at ~3 TB/s. Reading y and dy a second time after the reduction would add
// two thirds to that; holding both in registers (as the forward's v4 holds x) does not.
//
// No torch headers: this file builds with a bare `nvcc -c`.
#include "softmax_rows.cuh"

namespace shared_reduction {
namespace {

using namespace rows;  // NOLINT: the shared machinery of softmax_rows.cuh
using course::SumOp;

constexpr int kThreads = 256;

template <bool kLog, typename A>
__device__ __forceinline__ A dot_term(A y, A dy) { return kLog ? dy : dy * y; }

// exp(y) for log_softmax's dx. In 2-byte dtypes the hardware's approximate exponential
// (__expf: one multiply and one MUFU.EX2, at most 2 + 1.173 |y| ulp of float32 off, far below
// the 2^-8 or 2^-11 of dx's own rounding) rather than expf, whose range reduction adds half a
// dozen dependent FMAs to every element. That exponential is all log_softmax's backward does
// beyond softmax's (same kernels, same bytes), and the 16-bit split rows took 1.45x softmax's
// time at 262 x 256000 on the H100: a split row's blocks wait for the row's sum together and
// then compute together, so the arithmetic of the write pass is not hidden behind other
// blocks' loads. float32 keeps expf, where the difference would show in dx.
template <typename T, typename A>
__device__ __forceinline__ A exp_of_y(A y) {
  if constexpr (sizeof(T) == 2) {
    return __expf(y);
  } else {
    return exp(y);
  }
}

template <bool kLog, typename T, typename A>
__device__ __forceinline__ A grad_input(A y, A dy, A total) {
  return kLog ? dy - exp_of_y<T>(y) * total : y * (dy - total);
}

// The row sum over this thread's registers.
template <bool kLog, int kVectors, int kLanes, typename T>
__device__ __forceinline__ typename Acc<T>::type tile_dot(const T (&y)[kVectors][kLanes],
                                                          const T (&dy)[kVectors][kLanes]) {
  typename Acc<T>::type s = 0;
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
#pragma unroll
    for (int l = 0; l < kLanes; ++l) s += dot_term<kLog>(to_acc(y[j][l]), to_acc(dy[j][l]));
  }
  return s;
}

// dx into dy's registers.
template <bool kLog, int kVectors, int kLanes, typename T, typename A>
__device__ __forceinline__ void tile_grad(const T (&y)[kVectors][kLanes], T (&dy)[kVectors][kLanes], A total) {
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
#pragma unroll
    for (int l = 0; l < kLanes; ++l) dy[j][l] = from_acc<T>(grad_input<kLog, T>(to_acc(y[j][l]), to_acc(dy[j][l]), total));
  }
}

// Rows that fit: y and dy each held as kVectors 16-byte vectors per thread, as stored (4
// registers per vector in every dtype), one reduction, dx written from the registers. Rows that
// start mid-vector move as 16-byte chunks from their first boundary on (Access::kChunks).
template <typename T, int kThreadsPerRow, int kVectors, bool kLog, Access kAccess>
__global__ void __launch_bounds__(kThreadsPerRow * kRowsPerBlock<kThreadsPerRow>)
    softmax_backward_resident(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx,
                              int64_t rows, int64_t n) {
  using A = typename Acc<T>::type;
  constexpr int kLanes = course::Vec16<T>::kLanes;
  constexpr int kRows = kRowsPerBlock<kThreadsPerRow>;
  constexpr int kSlots = kTileVectors<kAccess, kVectors>;
  __shared__ A smem[32];
  const int t = threadIdx.x % kThreadsPerRow;
  // The whole block steps together (see softmax_resident in softmax_kernels.cu).
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kRows; first < rows;
       first += static_cast<int64_t>(gridDim.x) * kRows) {
    const int64_t r = first + threadIdx.x / kThreadsPerRow;
    const int64_t len = r < rows ? n : 0;
    const int64_t offset = (r < rows ? r : 0) * n;
    const RowSpan span = row_span<kAccess>(y + offset, len);
    T yv[kSlots][kLanes];
    T gv[kSlots][kLanes];
    // Padding is 0 in both: it adds nothing to either sum and is never stored.
    load_tile<kAccess, kThreadsPerRow, kVectors>(y + offset, span, t, from_acc<T>(0.0f), yv);
    load_tile<kAccess, kThreadsPerRow, kVectors>(dy + offset, span, t, from_acc<T>(0.0f), gv);
    const A total = row_reduce<kThreadsPerRow>(tile_dot<kLog>(yv, gv), SumOp<A>(), smem);
    tile_grad<kLog>(yv, gv, total);
    store_tile<kAccess, kThreadsPerRow, kVectors>(dx + offset, span, t, gv);
  }
}

// Long rows: split over `splits` cooperative blocks as the forward's v5 (softmax_kernels.cu
// explains the persistent, co-resident grid); each block's partial is its chunk's sum. Four
// 256-thread blocks per SM cap a thread at 64 registers, which 2-byte dtypes exceed (nvcc keeps
// each 16-bit element of y and dy in a register of its own, and spilled): they run two.
template <typename T, int kShape, bool kLog, Access kAccess>
__global__ void __launch_bounds__(kResidentShapes[kShape].threads, split_blocks_per_sm(sizeof(T), true))
    softmax_backward_split(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx, int64_t rows,
                           int64_t n, int64_t splits, typename Acc<T>::type* __restrict__ partial,
                           unsigned* __restrict__ arrived) {
  using A = typename Acc<T>::type;
  constexpr int kThreadsPerRow = kResidentShapes[kShape].threads;
  constexpr int kVectors = kResidentShapes[kShape].vectors;
  constexpr int kLanes = course::Vec16<T>::kLanes;
  constexpr int kSlots = kTileVectors<kAccess, kVectors>;
  constexpr int64_t kChunk = static_cast<int64_t>(kThreadsPerRow) * kVectors * kLanes;
  __shared__ A smem[32];
  const int t = threadIdx.x;
  for (int64_t item = blockIdx.x; item < rows * splits; item += gridDim.x) {
    const int64_t r = item / splits;
    const int64_t begin = (item % splits) * kChunk;
    const int64_t len = n - begin < kChunk ? n - begin : kChunk;
    const int64_t offset = r * n + begin;
    const RowSpan span = row_span<kAccess>(y + offset, len);
    T yv[kSlots][kLanes];
    T gv[kSlots][kLanes];
    load_tile<kAccess, kThreadsPerRow, kVectors>(y + offset, span, t, from_acc<T>(0.0f), yv);
    load_tile<kAccess, kThreadsPerRow, kVectors>(dy + offset, span, t, from_acc<T>(0.0f), gv);
    const A s = row_reduce<kThreadsPerRow>(tile_dot<kLog>(yv, gv), SumOp<A>(), smem);
    if (t == 0) partial[item] = s;
    course::arrive_and_wait(&arrived[r], static_cast<unsigned>(splits));
    // The same fold order in every warp of every block of the row: the same total everywhere.
    A total = 0;
    for (int64_t k = t % 32; k < splits; k += 32) total += __ldcg(&partial[r * splits + k]);
    total = course::warp_reduce(total, SumOp<A>());
    tile_grad<kLog>(yv, gv, total);
    store_tile<kAccess, kThreadsPerRow, kVectors>(dx + offset, span, t, gv);
  }
}

// Rows parked in shared memory (RowPlanKind::kShared): the forward's softmax_shared with two
// rows, y and dy, each in 16-byte slots from its first boundary on (dy starts as far from one as
// y: row_access checked), one reduction, dx written from the slots. Each thread reads back only
// what it wrote: no barrier but the reduction's.
//
// log_softmax parks dy alone: its sum is of dy only, so y is read once, from DRAM, in the pass
// that writes dx. Half the shared memory a block: a 32000-element bfloat16 row is 64 KB where y
// and dy took 128 KB, so two blocks of 1024 threads fit an SM (all its 2048 threads, at 32
// registers a thread: the launch bound's second argument) instead of one. With one, an SM read
// its next row only after the last one was written, its loads idle through every reduction and
// write pass (log_softmax's backward at 2097 x 32000 in bfloat16 ran at 0.80x PyTorch on the
// H100); with two, one block's loads overlap the other's writes. (At those 32 registers ptxas
// spills 16 bytes in the bfloat16 instantiation for rows that start mid-vector, on sm_90a; the
// float32 ones, which never take this path, keep one block's bound.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr int kSharedLogBlocksPerSm = 1;  // sm_75 holds 1024 threads an SM: one such block
#else
constexpr int kSharedLogBlocksPerSm = 2;
#endif

template <typename T, bool kLog, Access kAccess>
__global__ void __launch_bounds__(kSharedThreads, kLog && sizeof(T) == 2 ? kSharedLogBlocksPerSm : 1)
    softmax_backward_shared(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx, int64_t rows,
                            int64_t n, int64_t slots) {
  using A = typename Acc<T>::type;
  using V = course::Vec16<T>;
  constexpr int kLanes = V::kLanes;
  extern __shared__ int4 parked_words[];
  __shared__ A smem[32];
  const int t = threadIdx.x;
  // softmax: y's slots, then dy's; log_softmax: dy's only (parked_y unused)
  V* parked_y = reinterpret_cast<V*>(parked_words);
  V* parked_g = kLog ? parked_y : parked_y + slots;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t offset = r * n;
    const RowSpan span = row_span<kAccess>(y + offset, n);
    const int64_t vectors = (span.body_end - span.head) / kLanes;
    const V* yv = reinterpret_cast<const V*>(y + offset + span.head);
    const V* gv = reinterpret_cast<const V*>(dy + offset + span.head);
    A dot = A(0);
    for (int64_t j = t; j < vectors; j += kSharedThreads) {
      const V b = course::load16(gv + j);
      course::store16(parked_g + j, b);
      if constexpr (kLog) {
#pragma unroll
        for (int l = 0; l < kLanes; ++l) dot += to_acc(b.v[l]);
      } else {
        const V a = course::load16(yv + j);
        course::store16(parked_y + j, a);
#pragma unroll
        for (int l = 0; l < kLanes; ++l) dot += dot_term<kLog>(to_acc(a.v[l]), to_acc(b.v[l]));
      }
    }
    const int64_t tail = span.len - span.body_end;
    const int64_t head_i = t;
    const int64_t tail_i = span.body_end + t;
    const A head_g = t < span.head ? to_acc(dy[offset + head_i]) : A(0);
    const A tail_g = t < tail ? to_acc(dy[offset + tail_i]) : A(0);
    // log_softmax reads y's head and tail after the reduction too: nothing of y is live across it.
    A head_y = A(0);
    A tail_y = A(0);
    if constexpr (!kLog) {
      head_y = t < span.head ? to_acc(y[offset + head_i]) : A(0);
      tail_y = t < tail ? to_acc(y[offset + tail_i]) : A(0);
    }
    dot += dot_term<kLog>(head_y, head_g) + dot_term<kLog>(tail_y, tail_g);  // 0 where absent
    const A total = course::block_reduce<kSharedThreads>(dot, SumOp<A>(), smem);
    if constexpr (kLog) {
      head_y = t < span.head ? to_acc(y[offset + head_i]) : A(0);
      tail_y = t < tail ? to_acc(y[offset + tail_i]) : A(0);
    }
    V* xv = reinterpret_cast<V*>(dx + offset + span.head);
    for (int64_t j = t; j < vectors; j += kSharedThreads) {
      const V a = kLog ? course::load16(yv + j) : course::load16(parked_y + j);
      const V b = course::load16(parked_g + j);
      V out;
#pragma unroll
      for (int l = 0; l < kLanes; ++l) out.v[l] = from_acc<T>(grad_input<kLog, T>(to_acc(a.v[l]), to_acc(b.v[l]), total));
      course::store16(xv + j, out);
    }
    if (t < span.head) dx[offset + head_i] = from_acc<T>(grad_input<kLog, T>(head_y, head_g, total));
    if (t < tail) dx[offset + tail_i] = from_acc<T>(grad_input<kLog, T>(tail_y, tail_g, total));
  }
}

// Streamed: one block per row reads y and dy twice (the sum, then dx). float64, and rows
// longer than split blocks can hold.
template <typename T, bool kLog>
__global__ void __launch_bounds__(kThreads) softmax_backward_streamed(const T* __restrict__ y, const T* __restrict__ dy,
                                                                      T* __restrict__ dx, int64_t rows, int64_t n) {
  using A = typename Acc<T>::type;
  __shared__ A smem[kThreads / 32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t offset = r * n;
    A s = 0;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) s += dot_term<kLog>(to_acc(y[offset + i]), to_acc(dy[offset + i]));
    const A total = course::block_reduce<kThreads>(s, SumOp<A>(), smem);
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      dx[offset + i] = from_acc<T>(grad_input<kLog, T>(to_acc(y[offset + i]), to_acc(dy[offset + i]), total));
    }
  }
}

template <typename T, bool kLog>
cudaError_t launch_streamed(const SoftmaxBackwardParams& p, cudaStream_t stream) {
  softmax_backward_streamed<T, kLog><<<grid_for(p.rows), kThreads, 0, stream>>>(
      static_cast<const T*>(p.y), static_cast<const T*>(p.dy), static_cast<T*>(p.dx), p.rows, p.n);
  return cudaGetLastError();
}

// The same plan and dispatch as the forward (run_row_plan, softmax_rows.cuh).
template <typename T, bool kLog>
cudaError_t run_backward(const SoftmaxBackwardParams& p, cudaStream_t stream) {
  int sms = 0;
  COURSE_CUDA_TRY(course::sm_count(&sms));
  const RowPlan plan = plan_row(p.n, sizeof(T), true, true, sms, p.rows);
  const T* y = static_cast<const T*>(p.y);
  const T* dy = static_cast<const T*>(p.dy);
  T* dx = static_cast<T*>(p.dx);
  auto streamed = [&] { return launch_streamed<T, kLog>(p, stream); };
  return run_row_plan<T, true>(
      plan, row_access<T>(p.n, {p.y, p.dy, p.dx}),
      [&](auto shape, auto access) {
        constexpr ResidentShape s = kResidentShapes[decltype(shape)::value];
        return launch_resident<s.threads>(
            softmax_backward_resident<T, s.threads, s.vectors, kLog, decltype(access)::value>, p.rows, stream, y,
            dy, dx, p.rows, p.n);
      },
      [&](auto access) {
        const int64_t slots = parked_bytes<T>(p.n) / 16;
        const int64_t arrays = kLog ? 1 : 2;  // log_softmax parks dy alone (softmax_backward_shared)
        return launch_shared(softmax_backward_shared<T, kLog, decltype(access)::value>, p.rows, arrays * slots * 16, stream,
                             streamed, y, dy, dx, p.rows, p.n, slots);
      },
      [&](auto shape, auto access) {
        return launch_split(softmax_backward_split<T, decltype(shape)::value, kLog, decltype(access)::value>,
                            plan.blocks, p.rows, stream, streamed, y, dy, dx, p.rows, p.n, plan.blocks,
                            static_cast<typename Acc<T>::type*>(p.workspace), p.counters);
      },
      streamed);
}

}  // namespace

cudaError_t softmax_backward_workspace(const SoftmaxBackwardParams& p, Workspace* ws) {
  return with_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    *ws = Workspace{};
    int sms = 0;
    COURSE_CUDA_TRY(course::sm_count(&sms));
    const RowPlan plan = plan_row(p.n, sizeof(T), true, true, sms, p.rows);
    if (plan.kind == RowPlanKind::kSplit) {
      ws->bytes = p.rows * plan.blocks * static_cast<int64_t>(sizeof(typename Acc<T>::type));
      ws->counters = p.rows;
    }
    return cudaSuccess;
  });
}

cudaError_t launch_softmax_backward(const SoftmaxBackwardParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.n == 0) return cudaSuccess;
  return with_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    return p.log ? run_backward<T, true>(p, stream) : run_backward<T, false>(p, stream);
  });
}

}  // namespace shared_reduction
