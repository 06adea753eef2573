// Plain C++ interface between the torch glue (reduction_ops.cpp) and the CUDA kernels
// (reduce_kernels.cu, softmax_kernels.cu, softmax_backward_kernels.cu). No torch and no CUDA
// types: the glue must also compile on a machine without the CUDA toolkit, and the kernels with
// a bare `nvcc -c`.
//
// Every reduction sees its input as a contiguous (outer, n, inner) array reduced over n:
//   inner == 1: a row reduction, rows of n adjacent elements (dim=-1, or dim=None as one row);
//   inner >  1: a column reduction, the n elements `inner` apart (dim=0 of a matrix): the
//               pattern behind every bias gradient.
#pragma once

#include <course/dtype.h>
#include <course/index_math.h>

#include <cstdint>

namespace shared_reduction {

// The dtypes the kernels are instantiated for (course/dtype.h); the glue maps at::ScalarType onto it.
using DType = ::course::DType;

enum class ReduceOp { kSum, kMax };

// Three ladders share one enum: the whole-tensor ladder (Harris's seven steps and three modern
// ones), the row ladder and the column ladder. reduce_kernels.cu says what every rung changes.
enum class ReduceVersion {
  // whole tensor (dim=None), v1 .. v10
  kInterleavedDivergent, kInterleavedStrided, kSequential, kFirstAddDuringLoad,
  kUnrollLastWarp, kCompleteUnroll, kManyPerThread, kWarpShuffle, kVectorized, kOnePass,
  // rows (inner == 1)
  kBlockPerRow, kWarpPerRow, kRowsPerWarp, kSplitRow,
  // columns (inner > 1)
  kColumnLoop, kColumnSplit,
};

enum class Layout { kWhole, kRows, kColumns };

inline Layout layout_of(ReduceVersion v) {
  if (v <= ReduceVersion::kOnePass) return Layout::kWhole;
  if (v <= ReduceVersion::kSplitRow) return Layout::kRows;
  return Layout::kColumns;
}

struct ReduceParams {
  ReduceOp op;
  ReduceVersion version;
  DType dtype;
  const void* x;     // contiguous (outer, n, inner)
  void* out;         // outer * inner elements of dtype, written once each
  int64_t outer, n, inner;
  // Scratch the launcher asks for (reduce_workspace): partial results, and counters that
  // must be zero at launch (the glue zero-fills them).
  void* workspace;
  unsigned* counters;
};

// The atomic demo: a float32 whole-tensor sum in which every block adds its partial into the
// result with atomicAdd. Fast, but the order of the additions is whatever order the blocks
// finish in, so the last bits change from run to run.
struct AtomicSumParams {
  const float* x;
  float* out;  // one float, zeroed by the caller
  int64_t n;
};

// ---------------------------------------------------------------------------------------
// Softmax and log_softmax over rows of n adjacent elements (the glue moves `dim` last).
// ---------------------------------------------------------------------------------------
enum class SoftmaxVersion {
  kThreePasses,   // v1: three kernels: row max, row sum of exp, normalize
  kBlockPerRow,   // v2: one kernel, one block per row, the row read three times
  kOnline,        // v3: online max and sum in one pass, the row read twice
  kResidentRow,   // v4: the row held in registers while it fits: one read, one write
  kSplitRow,      // v5: rows too long for one block split over several, with a combine step
};

// How a row is mapped onto threads when it is held in registers (v4, v5, backward):
// `threads` threads per row (16: half a warp, 32: a warp, several rows per block; more: one row
// per block), each holding `vectors` 16-byte vectors of it. kResidentShapes lists the
// instantiated ones, smallest first; a dtype uses those that fit its register budget
// (shape_fits).
struct ResidentShape {
  int threads;
  int vectors;
};
// 64 x 4 serves rows of 1025-2048 2-byte elements (and 513-1024 in the float32 backward), which
// took 128 x 4 before it, three quarters of every thread's vectors padding (a row of 1025 bf16
// ran at 0.67x torch.softmax on an H200).
constexpr ResidentShape kResidentShapes[] = {{16, 1},  {32, 1},  {32, 2},  {32, 4},  {32, 8},  {64, 4},
                                             {128, 4}, {256, 4}, {512, 4}, {256, 8}, {512, 8}};
constexpr int kNumResidentShapes = sizeof(kResidentShapes) / sizeof(kResidentShapes[0]);

// What the forward keeps of its row. While the row fits one block as float32 values, at most 32
// per thread, it keeps the exponentials, each computed once. A split row's block in a 2-byte
// dtype instead keeps its chunk as loaded, 16-bit, two to a register: 256 x 8 vectors, twice the
// elements of the float chunk, so each wait for the other blocks of the row covers twice the
// bytes; exp is then computed again at the write (two per element, against the 16 per clock an
// SM's special-function units give; the copy rate needs about 4 elements per clock per SM).
// float32 keeps floats everywhere.
constexpr bool keeps_raw(ResidentShape s, int elem_bytes, bool backward) {
  return !backward && elem_bytes == 2 && s.vectors * (16 / elem_bytes) > 32;
}

// The raw shape: a split row's block only.
constexpr int kRawThreads = 256;

// The forward keeps its row as float32 values (at most 32 per thread) or, for a 2-byte split
// row, as 8 raw vectors (keeps_raw); the backward keeps y and dy as stored, 16-byte vectors, at
// most 4 of each per thread.
constexpr bool shape_fits(ResidentShape s, int elem_bytes, bool backward) {
  return backward ? s.vectors <= 4
                  : (s.vectors * (16 / elem_bytes) <= 32 || (elem_bytes == 2 && s.vectors == 8 && s.threads == kRawThreads));
}

// Rows longer than one block holds are split over several blocks of kSplitThreads threads (v5),
// the largest such shape that fits the dtype (256 x 8 vectors: float32 values, or 16-bit ones in
// 2-byte dtypes; the backward 256 x 4), all of which must be resident at once. How many that is
// depends on the GPU: SMs x the blocks per SM each split kernel is compiled to fit (its
// __launch_bounds__: four in float32, two in 2-byte dtypes, whose 16-bit chunk takes 128
// registers a thread). A row needing more than that is streamed (v3's kernel) instead; the
// launcher checks the real occupancy again and streams too if it falls short.
constexpr int kSplitThreads = 256;

constexpr int split_blocks_per_sm(int elem_bytes, bool /*backward*/) { return elem_bytes == 2 ? 2 : 4; }

constexpr int64_t resident_capacity(ResidentShape s, int elem_bytes) {
  return static_cast<int64_t>(s.threads) * s.vectors * (16 / elem_bytes);
}

// How a softmax row of n elements runs: held by one resident shape (index into
// kResidentShapes); held in one block's shared memory (a 2-byte row too long for registers,
// when there are rows enough for every SM); split over `blocks` blocks of the largest shape
// that fits; or streamed (read twice, v3) when none of these is possible.
enum class RowPlanKind { kResident, kShared, kSplit, kStreamed };

// The shared-memory row: one block of kSharedThreads threads per row, the row parked in shared
// memory as loaded (each thread its own 16-byte slots, so no barrier guards them), read back
// twice (the sum, the write). One read from DRAM and no waiting on other blocks, where a split
// row's blocks wait for each other; it needs a block of shared memory per row (y and dy both in
// the backward: 2 x 50257 bf16 is 201 KB, of the 227 KB an H100 or H200 block may ask for), and
// at least one row per SM, or split rows keep more SMs busy. 2-byte dtypes only: float32 splits
// at four blocks of 32 KB per SM and stays near the copy rate (README, softmax table).
constexpr int kSharedThreads = 1024;
constexpr int64_t kSharedRowBytes = 112 * 1024;  // per array: x (forward); y and dy (backward)
struct RowPlan {
  RowPlanKind kind;
  int shape;       // kResident, kSplit: index into kResidentShapes
  int64_t blocks;  // kSplit: blocks per row
};

// float64 is streamed in every rung from v3 on: it is here for gradcheck, and holding rows of
// doubles in registers would only add instantiations. sms: the GPU's SM count (device_sms);
// rows: how many rows the call has (0: the plan of one row alone).
inline RowPlan plan_row(int64_t n, int elem_bytes, bool allow_split, bool backward, int sms, int64_t rows = 0) {
  if (elem_bytes == 8) return {RowPlanKind::kStreamed, 0, 0};
  int split_shape = 0;
  for (int i = 0; i < kNumResidentShapes; ++i) {
    const ResidentShape s = kResidentShapes[i];
    if (!shape_fits(s, elem_bytes, backward)) continue;
    if (s.threads == kSplitThreads) split_shape = i;  // the largest such shape fitting the dtype
    // Held by one block: the first shape that holds the row, as float32 values (raw shapes are
    // for split rows only).
    if (!keeps_raw(s, elem_bytes, backward) && n <= resident_capacity(s, elem_bytes)) {
      return {RowPlanKind::kResident, i, 1};
    }
  }
  if (allow_split && elem_bytes == 2 && n * elem_bytes <= kSharedRowBytes && rows >= sms) {
    return {RowPlanKind::kShared, 0, 1};
  }
  const int64_t blocks = course::ceil_div(n, resident_capacity(kResidentShapes[split_shape], elem_bytes));
  if (allow_split && blocks <= int64_t{sms} * split_blocks_per_sm(elem_bytes, backward)) {
    return {RowPlanKind::kSplit, split_shape, blocks};
  }
  return {RowPlanKind::kStreamed, 0, 0};
}

struct SoftmaxParams {
  SoftmaxVersion version;
  DType dtype;
  bool log;        // log_softmax
  const void* x;   // rows x n, contiguous
  void* y;         // rows x n, contiguous
  int64_t rows, n;
  void* workspace;     // see softmax_workspace
  unsigned* counters;  // zeroed by the caller
};

// dx = y * (dy - sum(dy * y))          for softmax (y its output)
// dx = dy - exp(y) * sum(dy)           for log_softmax (y = log_softmax(x))
struct SoftmaxBackwardParams {
  DType dtype;
  bool log;
  const void* y;
  const void* dy;
  void* dx;
  int64_t rows, n;
  void* workspace;
  unsigned* counters;
};

// Scratch a launch needs: bytes of workspace and zeroed unsigned counters.
struct Workspace {
  int64_t bytes = 0;
  int64_t counters = 0;
};

// ---------------------------------------------------------------------------------------
// version=None: the one place where the chapter decides (README, "version=None", shows the
// measurements the thresholds come from). sms is the SM count of the GPU the call runs on
// (read off the device by the glue; default_choice takes it as an argument, so any machine can
// ask what a GPU of any size would run).
// ---------------------------------------------------------------------------------------
// Rows shorter than this share a warp (rows_per_warp); up to kWarpRowMax they get a warp each.
constexpr int64_t kRowsPerWarpBelow = 32;
constexpr int64_t kWarpRowMax = 2048;
// With fewer rows than this many per SM, one block per row cannot fill the GPU: rows are split
// (four 256-thread blocks per SM: 528 rows on an H100's 132 SMs, 160 on a T4's 40).
constexpr int64_t kSplitRowsPerSm = 4;
// Columns: an input with at least this many outputs per SM thread slot and a reduced dim shorter
// than 64 gives every output a thread of its own (column_loop): 2048 threads per SM on sm_80/sm_90,
// so 270336 outputs on an H100. At 64 rows column_split was already ahead (64 x 1048576 float32
// on the H100: 95 us against 100). Otherwise column_split, whose tiles lay a warp over several rows
// when the tensor is narrower than a warp of columns (course/column_reduce.cuh).
constexpr int64_t kColumnLoopBelowN = 64;
constexpr int64_t kColumnLoopOutputsPerSm = 2048;

inline ReduceVersion default_reduce(int64_t outer, int64_t n, int64_t inner, bool whole, int sms) {
  if (whole) return ReduceVersion::kOnePass;
  if (inner > 1) {
    if (n < kColumnLoopBelowN && outer * inner >= int64_t{sms} * kColumnLoopOutputsPerSm) return ReduceVersion::kColumnLoop;
    return ReduceVersion::kColumnSplit;
  }
  if (n < kRowsPerWarpBelow) return ReduceVersion::kRowsPerWarp;
  if (n <= kWarpRowMax) return ReduceVersion::kWarpPerRow;
  if (outer < int64_t{sms} * kSplitRowsPerSm) return ReduceVersion::kSplitRow;
  return ReduceVersion::kBlockPerRow;
}

// column_loop indexes in 32 bits, dividing by inner's magic number (course::FastDivmod), while
// the tensor has fewer than 2^31 elements: every element index and output index then fits 32 bits,
// and so does the grid loop's next index (below 2^31 + 2^31). Larger tensors take 64-bit indices
// and the compiler's division (reduce_kernels.cu says what that costs).
inline bool column_loop_fits_32_bits(int64_t outer, int64_t n, int64_t inner) {
  return outer * n * inner <= int64_t{INT32_MAX};
}

// Softmax: v4 while a row fits one block's registers, v5 beyond.
inline SoftmaxVersion default_softmax(int64_t n, int elem_bytes) {
  const RowPlan plan = plan_row(n, elem_bytes, /*allow_split=*/false, /*backward=*/false, /*sms=*/0);
  return plan.kind == RowPlanKind::kResident ? SoftmaxVersion::kResidentRow : SoftmaxVersion::kSplitRow;
}

// The CPU implementations (reduction_cpu.cpp): the reference semantics in C++, on the same
// params. `version` is ignored: the ladders are GPU thread mappings.
void reduce_cpu(const ReduceParams& params);
void softmax_cpu(const SoftmaxParams& params);
void softmax_backward_cpu(const SoftmaxBackwardParams& params);

}  // namespace shared_reduction

#if defined(__CUDACC__) || defined(WITH_CUDA)
#include <cuda_runtime_api.h>
namespace shared_reduction {
// Each launcher runs on `stream`, returns the launch error (or cudaSuccess) and never
// synchronizes. The *_workspace functions say what scratch the matching launch needs; the
// caller allocates it (counters zero-filled) and passes it in the params.
cudaError_t reduce_workspace(const ReduceParams& params, Workspace* ws);
cudaError_t launch_reduce(const ReduceParams& params, cudaStream_t stream);
cudaError_t launch_atomic_sum(const AtomicSumParams& params, cudaStream_t stream);
cudaError_t softmax_workspace(const SoftmaxParams& params, Workspace* ws);
cudaError_t launch_softmax(const SoftmaxParams& params, cudaStream_t stream);
cudaError_t softmax_backward_workspace(const SoftmaxBackwardParams& params, Workspace* ws);
cudaError_t launch_softmax_backward(const SoftmaxBackwardParams& params, cudaStream_t stream);
}  // namespace shared_reduction
#endif
