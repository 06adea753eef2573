// What the softmax forward (softmax_kernels.cu) and backward (softmax_backward_kernels.cu)
// kernels share beyond the course-wide row machinery of <course/rows.cuh> (a row held in
// registers, the reduction across the threads of a row, the streamed row map): the dispatch
// over this chapter's compile-time shapes, written once for both directions (run_row_plan), and
// the cooperative launch of split rows.
// Torch-free, like the kernels.
#pragma once

#include "reduction.h"

#include <course/cuda_utils.h>
#include <course/reduce.cuh>
#include <course/rows.cuh>

#include <type_traits>
#include <utility>

namespace shared_reduction {
namespace rows {

// The row-in-registers machinery (load_tile, store_tile, row_reduce, map_row, ...) lives in
// common/include/course/rows.cuh, shared with chapter 4's norms.
using namespace ::course::rows;  // NOLINT
using course::Acc;
using course::from_acc;
using course::to_acc;

// Calls f(std::integral_constant<int, I>) for the resident shape with runtime index `shape`,
// so kernels take the shape as template parameters. Shapes a dtype never uses (shape_fits)
// are not instantiated.
template <typename T, bool kBackward, int I = 0, typename F>
cudaError_t with_shape(int shape, F&& f) {
  if constexpr (I == kNumResidentShapes) {
    return cudaErrorInvalidValue;
  } else {
    if constexpr (shape_fits(kResidentShapes[I], sizeof(T), kBackward)) {
      if (shape == I) return f(std::integral_constant<int, I>{});
    }
    return with_shape<T, kBackward, I + 1>(shape, std::forward<F>(f));
  }
}

using ::course::with_dtype;

// The grid of a split-row kernel: as many blocks as can be resident at once (a cooperative
// launch refuses more), rounded down to a multiple of `splits`, so that the `splits` blocks of
// a row are always in the same wave (see the split kernels). 0 when one row needs more blocks
// than the GPU holds: the caller streams instead.
template <typename Kernel>
cudaError_t split_grid(Kernel kernel, int threads, int64_t splits, int64_t rows, int64_t* grid) {
  int sms = 0;
  int per_sm = 0;
  COURSE_CUDA_TRY(course::sm_count(&sms));
  COURSE_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  const int64_t resident = static_cast<int64_t>(sms) * per_sm;
  const int64_t waves_of_rows = resident / splits;
  *grid = (waves_of_rows < rows ? waves_of_rows : rows) * splits;
  return cudaSuccess;
}

// A cooperative launch: the runtime guarantees every block is resident at once, or fails.
// The arguments are taken as the kernel's own parameter types (common_type<P>::type is P in a
// context the compiler does not deduce from), so each pointer handed over is what it expects.
template <typename... KernelArgs>
cudaError_t launch_cooperative(void (*kernel)(KernelArgs...), int64_t grid, int threads,
                               cudaStream_t stream, typename std::common_type<KernelArgs>::type... args) {
  void* arg_ptrs[] = {static_cast<void*>(&args)...};
  return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(grid_for(grid)),
                                     dim3(threads), arg_ptrs, 0, stream);
}

// The plan of a row as launches, written once for the forward and the backward. The plan's shape
// and the rows' access path become compile-time constants handed to the direction's own
// launches: resident(shape, access) and split(shape, access) receive integral constants (each
// launches its kernel, through launch_resident and launch_split below); a row that cannot be
// held in registers runs streamed().
template <typename T, bool kBackward, typename Resident, typename Shared, typename Split, typename Streamed>
cudaError_t run_row_plan(const RowPlan& plan, Access access, Resident&& resident, Shared&& shared, Split&& split,
                         Streamed&& streamed) {
  if constexpr (sizeof(T) == 8) {  // float64 is always streamed (plan_row), never instantiated
    return streamed();
  } else {
    if (plan.kind == RowPlanKind::kStreamed) return streamed();
    if (plan.kind == RowPlanKind::kShared) {
      // Rows whose x and y start at different distances from a 16-byte boundary cannot move as
      // vectors on both sides: such rows (a view) are streamed.
      if (access == Access::kScalar) return streamed();
      return with_access(access, [&](auto acc) { return shared(acc); });
    }
    return with_shape<T, kBackward>(plan.shape, [&](auto shape) {
      constexpr int kShape = decltype(shape)::value;
      return with_access(access, [&](auto acc) -> cudaError_t {
        if (plan.kind == RowPlanKind::kResident) return resident(shape, acc);
        if constexpr (kResidentShapes[kShape].threads != kSplitThreads) {
          return cudaErrorInvalidValue;  // plan_row splits over kSplitThreads-thread shapes only
        } else {
          return split(shape, acc);
        }
      });
    });
  }
}

// A resident kernel over `rows` rows: kRowsPerBlock rows of kThreadsPerRow threads per block.
template <int kThreadsPerRow, typename... KernelArgs, typename... Args>
cudaError_t launch_resident(void (*kernel)(KernelArgs...), int64_t rows, cudaStream_t stream, Args... args) {
  constexpr int kRows = kRowsPerBlock<kThreadsPerRow>;
  kernel<<<grid_for(course::ceil_div(rows, int64_t{kRows})), kThreadsPerRow * kRows, 0, stream>>>(args...);
  return cudaGetLastError();
}

// A shared-memory row kernel over `rows` rows: one block of kSharedThreads per row, as many as
// fit the SMs (persistent over the rest), with smem_bytes of dynamic shared memory, which past
// 48 KB a kernel must ask for. A GPU that cannot give it (a T4 has 64 KB a block) streams.
template <typename Streamed, typename... KernelArgs, typename... Args>
cudaError_t launch_shared(void (*kernel)(KernelArgs...), int64_t rows, int64_t smem_bytes, cudaStream_t stream,
                          Streamed&& streamed, Args... args) {
  if (cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem_bytes)) != cudaSuccess) {
    (void)cudaGetLastError();  // the refusal is an answer, not an error of this launch
    return streamed();
  }
  int sms = 0;
  int per_sm = 0;
  COURSE_CUDA_TRY(course::sm_count(&sms));
  COURSE_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kSharedThreads,
                                                                 static_cast<size_t>(smem_bytes)));
  if (per_sm == 0) return streamed();
  const int64_t resident = static_cast<int64_t>(sms) * per_sm;
  kernel<<<grid_for(rows < resident ? rows : resident), kSharedThreads, static_cast<size_t>(smem_bytes), stream>>>(
      args...);
  return cudaGetLastError();
}

// Bytes of shared memory a row of n elements of T takes parked in 16-byte slots from its first
// 16-byte boundary on: n plus up to one vector of lead, rounded up to whole vectors.
template <typename T>
inline int64_t parked_bytes(int64_t n) {
  constexpr int64_t kLanes = course::Vec16<T>::kLanes;
  return course::ceil_div(n + kLanes, kLanes) * 16;
}

// A split kernel over `rows` rows of `splits` blocks each: the cooperative grid split_grid sizes,
// or streamed() when the GPU cannot hold one row's blocks at once.
template <typename Streamed, typename... KernelArgs, typename... Args>
cudaError_t launch_split(void (*kernel)(KernelArgs...), int64_t splits, int64_t rows, cudaStream_t stream,
                         Streamed&& streamed, Args... args) {
  int64_t grid = 0;
  COURSE_CUDA_TRY(split_grid(kernel, kSplitThreads, splits, rows, &grid));
  if (grid == 0) return streamed();  // too few SMs for one row
  return launch_cooperative(kernel, grid, kSplitThreads, stream, args...);
}

}  // namespace rows
}  // namespace shared_reduction
