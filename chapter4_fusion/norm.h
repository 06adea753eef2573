// Plain C++ interface between the norms' torch glue (norm_ops.cpp, norm_cpu.cpp) and their CUDA
// kernels (norm_kernels.cu: forward, norm_backward_kernels.cu: backward). No torch and no CUDA
// types: the glue must also compile without the CUDA toolkit, the kernels with a bare `nvcc -c`.
//
// Every norm normalizes rows of n adjacent elements (the last dim; the glue makes x contiguous):
//   LayerNorm:  y = (x - mean) * rstd * weight + bias,  rstd = 1 / sqrt(var + eps)
//   RMSNorm:    y = x * rstd * weight,                  rstd = 1 / sqrt(mean(x^2) + eps)
// with var the biased variance, as torch.nn.functional.layer_norm / rms_norm. The forward saves
// mean and rstd per row in the accumulation type (float32; float64 for float64 inputs), as
// PyTorch does, so the backward need not recompute them.
#pragma once

#include <course/dtype.h>
#include <course/index_math.h>

#include <cstdint>
#include <limits>

namespace fusion {
namespace norm {

// The dtypes the kernels are instantiated for (course/dtype.h); the glue maps at::ScalarType onto it.
using DType = ::course::DType;

enum class NormKind { kLayerNorm, kRmsNorm };

// The forward ladder (norm_kernels.cu says what each rung changes and why).
enum class NormVersion {
  kTwoPass,   // v1: a block per row; mean, then variance, then normalize: the row read 3 times
  kWelford,   // v2: mean and variance in one Welford pass: the row read twice
  kResident,  // v3: the row held in registers, 16-byte loads: read once, written once
};

// The backward ladder (norm_backward_kernels.cu).
enum class NormBackwardVersion {
  kStreamed,  // v1: a block per row, x and dy streamed twice, dweight partials in global memory
  kResident,  // v2: x and dy held in registers, one pass; dweight partials in registers
};

// fused_add_rms_norm's ladder.
enum class AddNormVersion {
  kUnfused,  // v1: an add kernel writes x + residual, then rms_norm reads it back
  kFused,    // v2: one kernel: x and residual read once, the sum and the norm written once
};

// How a row is held in registers: `threads` threads per row (32: one warp, several rows per
// block; more: one row per block), each holding `vectors` 16-byte vectors of it, as stored (a
// vector stays 4 registers in every dtype). Smallest capacity first; a row takes the first
// shape that holds it.
struct NormShape {
  int threads;
  int vectors;
};

// The forward holds x (and for fused_add_rms_norm the sum) as stored: at most 4 vectors, 16
// registers, per thread. 1024 x 4 holds 32768 2-byte or 16384 4-byte elements; longer rows
// are streamed (v2's kernel).
// Past a warp row the thread counts are whole warps, not only powers of two: every 32 threads up
// to 256, every 64 up to 512. A slot past the row's end is a lane that holds registers and loads
// nothing, and an SM fits as many blocks as the register file holds whole blocks of, so the
// padding was bytes not in flight: with powers of two, hidden 5120 in bfloat16 (640 vectors) took
// 256 x 4, 1024 slots, 37.5% of every block idle; now 160 x 4, none, and at about the same
// registers a thread more blocks (rows) fit an SM.
// The table is sorted by capacity and every shape has 4 vectors a thread past the warp rows, so
// the first shape that holds a row is the one of least padding and, of those, fewest threads:
// fewer than 32 threads' slots (one warp) are padding below 256 threads, 64 below 512. Past 512
// only 1024 x 4 (rows of 2049-4096 vectors): float32 at hidden 12288 (3072 vectors) would take
// 768 x 4, and at the 48-63 registers a thread of these kernels (ptxas -v, sm_90a) that block is
// alone on its SM as the 1024-thread one is: the same bytes in flight, more kernels to build.
// A warp row steps by vectors the same way in 2-byte dtypes: 32 x 3 holds 96 vectors (hidden 768),
// which 32 x 4 held with a quarter of every lane's slots padding, 8 floats a thread holding
// nothing (a 2-byte vector is converted to 8 floats), summed and normalized as zeros. ptxas -v
// (sm_90a), plain kernels: bfloat16 LayerNorm 68 -> 56 registers, RMSNorm 68 -> 53,
// fused_add_rms_norm 79 -> 61, 7, 7 and 6 blocks of 4 rows an SM -> 9, 9, 8 (float16 8, 9, 8 ->
// 10, 10, 9). float32 keeps 32 x 4 for 257-384 elements (forward_shape_in): a padded slot is 4
// floats there, LayerNorm's two kernels both round to 48 registers (10 blocks an SM either way),
// and on an H100 its 32 x 3 ran slower, not faster (8192 x 384: 10.7 -> 11.2 us).
// Instantiations: 16 shapes (8 before the whole warps), each a plain kernel per dtype, op and
// access (32 x 3 in 2-byte dtypes only), and for rows of whole vectors the variants below (held
// up to 512 threads, prefetching, capped at 160-512).
constexpr NormShape kForwardShapes[] = {{32, 1},   {32, 2},  {32, 3},  {32, 4},  {64, 4},  {96, 4},
                                        {128, 4},  {160, 4}, {192, 4}, {224, 4}, {256, 4}, {320, 4},
                                        {384, 4},  {448, 4}, {512, 4}, {1024, 4}};
constexpr int kNumForwardShapes = sizeof(kForwardShapes) / sizeof(kForwardShapes[0]);
// What forward_shape's first-fit and the kernels rely on: capacities strictly increasing (first
// fit = least padding), and a row past a warp of whole warps (block_reduce's partial a warp) in
// at most 1024 threads.
constexpr bool forward_shapes_valid() {
  for (int i = 0; i < kNumForwardShapes; ++i) {
    const NormShape s = kForwardShapes[i];
    if (s.threads > 1024 || (s.threads > 32 && s.threads % 32 != 0) || s.vectors < 1 || s.vectors > 4) return false;
    if (i > 0 && s.threads * s.vectors <= kForwardShapes[i - 1].threads * kForwardShapes[i - 1].vectors) return false;
  }
  return true;
}
static_assert(forward_shapes_valid(), "kForwardShapes: whole warps past a warp row, capacities increasing");

// The backward holds x, dy and weight as stored plus two float accumulators per element it
// owns (the thread's share of dweight and dbias, summed over its rows): at most 16 elements per
// thread keeps it near 64 registers. 2-byte dtypes take the 2-vector shapes, float32 the
// 4-vector ones; both reach 16384 elements a row. 1024-thread rows (capped at 64 registers,
// where the two float sums per element spilled hundreds of bytes) keep those sums in shared
// memory instead (norm_backward_kernels.cu, kSharedSums); longer rows run the streamed kernel.
// The 64-thread shapes exist for hidden 1024, the commonest short row: without them it took the
// 128-thread shape and half of every block held padding (55% of copy for LayerNorm on the H100).
constexpr NormShape kBackwardShapes[] = {{32, 1}, {32, 2}, {32, 4}, {64, 2}, {64, 4}, {128, 2},
                                         {128, 4}, {256, 2}, {256, 4}, {512, 2}, {512, 4}, {1024, 2}, {1024, 4}};
constexpr int kNumBackwardShapes = sizeof(kBackwardShapes) / sizeof(kBackwardShapes[0]);
constexpr int kMaxBackwardElementsPerThread = 16;

constexpr int64_t shape_capacity(NormShape s, int elem_bytes) {
  return static_cast<int64_t>(s.threads) * s.vectors * (16 / elem_bytes);
}

// Whether a backward shape is instantiated for a dtype: exactly the 16-element shapes, plus the
// smaller warp shapes that short rows need. 2-byte: 8 lanes x 2 vectors; 4-byte: 4 lanes x 4.
constexpr bool backward_shape_fits(NormShape s, int elem_bytes) {
  return s.vectors * (16 / elem_bytes) <= kMaxBackwardElementsPerThread &&
         (s.threads == 32 || s.vectors * (16 / elem_bytes) == kMaxBackwardElementsPerThread);
}

// Whether a shape of kForwardShapes serves (and is built for) a dtype: the 32 x 3 warp row in
// 2-byte dtypes only (the table's comment says why), every other shape in all.
constexpr bool forward_shape_in(NormShape s, int elem_bytes) {
  return !(s.threads == 32 && s.vectors == 3) || elem_bytes == 2;
}

// The index of the shape that holds a row of n elements, or -1: streamed. float64 is always
// streamed: it is here for gradcheck, and holding doubles in registers would only add
// instantiations. three_vector_warps false: the table without 32 x 3, as before it (the
// benchmarks' "before" rule, COURSE_NORM_FORWARD_SHAPES in norm_kernels.cu).
inline int forward_shape(int64_t n, int elem_bytes, bool three_vector_warps = true) {
  if (elem_bytes == 8) return -1;
  for (int i = 0; i < kNumForwardShapes; ++i) {
    const NormShape s = kForwardShapes[i];
    if (!forward_shape_in(s, elem_bytes) || (!three_vector_warps && s.threads == 32 && s.vectors == 3)) continue;
    if (n <= shape_capacity(s, elem_bytes)) return i;
  }
  return -1;
}

// The forward's resident kernel in two variants beside its plain one (norm_kernels.cu, "Rows in
// flight").
// Capped registers, chosen from the plain kernel's own occupancy, blocks_per_sm, as the launch
// asks it of the runtime (nvcc's register count decides, not an estimate of it): where that leaves
// fewer than kMinForwardRowsInFlight rows on an SM (a block of one long row at more than 64
// registers a thread: one row in flight, the SM's DRAM idle while it reduces), the instantiation
// built for that many blocks an SM runs instead. It exists only for the blocks where a cap can be
// both needed and met: blocks of one row, of more than 128 threads (at 128, nvcc's ceiling of 255
// registers a thread still leaves two blocks an SM) and of at most 512 (two blocks' share of the
// register file, 64 a thread, holds the row's 16 and the rest), rows of whole vectors (the rows
// that start mid-vector, whose edge slot holds one more set of registers, spilled 40-88 bytes a
// thread under the same cap; ptxas -v).
constexpr int kMinForwardRowsInFlight = 2;
constexpr int forward_rows_per_block(int threads) { return threads <= 32 ? 128 / threads : 1; }
constexpr bool forward_cappable(int block_threads, int rows_per_block, bool whole_vectors) {
  return whole_vectors && rows_per_block == 1 && block_threads > 128 && block_threads <= 512;
}
inline bool forward_caps_registers(int blocks_per_sm, int rows_per_block) {
  return static_cast<int64_t>(blocks_per_sm) * rows_per_block < kMinForwardRowsInFlight;
}
// Where the forward's last step gets weight (and bias) (norm_kernels.cu, kParams). kHeld: loaded
// into registers with x, where the grid is one step of the kernel that holds them: every block
// resident from the start (blocks <= held_wave, that kernel's blocks an SM as the runtime gives
// them x the SMs) with one group of rows to do. Then every block of an SM reaches its last step at
// the same moment, nothing else is in flight to hide a trip for weight then, and it was a second
// round trip after x's. Not in 1024-thread blocks of 4 vectors a thread: such a block has 64
// registers a thread, 16 of them the row's, and weight and bias would take 32 more (at 2 vectors,
// 8 and 16: LayerNorm's bfloat16 row spills 12 bytes a thread there, ptxas -v sm_90a). kPrefetch:
// asked of the L1 beside x's loads, where each SM gets at most one block but the block cannot hold
// them. kLate: loaded in the last step, where blocks queue for slots (the others' loads run during the trip, and the
// first of them leaves weight in the L1 for the rest).
enum class ParamLoad { kLate, kPrefetch, kHeld };
constexpr bool forward_holdable(int block_threads, int vectors) { return block_threads <= 512 || vectors <= 2; }
inline bool forward_holds_params(int64_t blocks, int64_t held_wave) { return blocks <= held_wave; }
inline bool forward_prefetches(int64_t blocks, int sms) { return blocks <= sms; }
inline ParamLoad forward_params(int64_t blocks, int block_threads, int vectors, int64_t held_wave, int sms) {
  if (forward_holdable(block_threads, vectors) && forward_holds_params(blocks, held_wave)) return ParamLoad::kHeld;
  return forward_prefetches(blocks, sms) ? ParamLoad::kPrefetch : ParamLoad::kLate;
}

// LayerNorm rows the resident rung streams with v1's kernel instead of holding (NOTES.md, "The
// norm forward by bytes in flight"). Where weight is loaded late (the grid queues blocks), a
// resident block has its row in flight only while it loads it: the two block reductions, the
// weight and bias trip and the stores that follow hold nothing in flight, and the SM's DRAM is kept
// busy by its other blocks alone. DRAM latency at the copy rate wants ~4.8 TB/s x ~1 us / 132 SMs
// = ~36 KB in flight an SM (H200); a LayerNorm block with its loads in flight about 70% of its
// row's time then needs ~50 KB of rows an SM (rows in flight, from the kernel's occupancy, x the
// row's bytes), kHeldBytesInFlight. Below it v1 (256 threads, 4 16-byte loads in flight a thread:
// up to kStreamedStepBytes of a row a step, re-read from the L1 for the variance and the
// normalize) keeps more in flight wherever its first pass does (its blocks an SM x a step), its
// blocks out of phase with each other. The H200 records at d563885, 753f326 and 933003d: every
// LayerNorm row of 2048 and 8192 tokens under 50 KB (6144 and 12288 in 2-byte dtypes, 12288 in
// float32, 4099 in all three) ran 0-11 points of copy faster as v1 but one (float32 2048 x 12288,
// 3 slower), and every row over it slower as v1 but hidden 7168 and 8192 in 2-byte dtypes (1-4
// faster; they stay resident). Warp rows (a few KB) fail the second test: v1's block moves one
// short row a step. RMSNorm never: one reduction and weight alone make its tail shorter, and its
// v1 ran behind its v3 at every such row (by up to 24 points; float32 4099 +2 the most).
constexpr int64_t kHeldBytesInFlight = 50 * 1024;
constexpr int64_t kStreamedStepBytes = 256 * 4 * 16;  // norm_kernels.cu: kThreads x kUnroll x 16 bytes
// Rows the resident kernel that runs keeps in flight an SM: its blocks an SM x rows a block, or the
// capped kernel's kMinForwardRowsInFlight where forward_caps_registers sends the launch there.
inline int64_t forward_rows_in_flight(int blocks_per_sm, int rows_per_block, bool cappable) {
  if (cappable && forward_caps_registers(blocks_per_sm, rows_per_block)) return kMinForwardRowsInFlight;
  return static_cast<int64_t>(blocks_per_sm) * rows_per_block;
}
// held_rows: forward_rows_in_flight; streamed_blocks_per_sm: v1's kernel's occupancy (256 threads).
// Only where the rows queue for the held kernel's slots (more rows than held_rows x sms): at fewer,
// every row is in flight from the start, and the one-wave kernels (few rows, weight held) serve them.
inline bool forward_streams(bool centered, int64_t rows, int64_t row_bytes, int64_t held_rows,
                            int64_t streamed_blocks_per_sm, int sms) {
  if (!centered || rows <= held_rows * sms) return false;
  const int64_t held = held_rows * row_bytes;
  const int64_t streamed = streamed_blocks_per_sm * (row_bytes < kStreamedStepBytes ? row_bytes : kStreamedStepBytes);
  return held < kHeldBytesInFlight && streamed > held;
}

// The row shapes at few rows: where the grid has at most one block an SM (rows <= SMs) and the
// row is a block's (longer than a warp row holds), each block is alone on its SM, and the SM has
// as many warps as the row's shape gives it. kForwardShapes packs 4 vectors into each thread, the
// fewest threads that hold the row (64 x 4096 in bfloat16: 128 threads, one warp on each of the
// SM's four schedulers), which is right where many rows share an SM, and at one row an SM leaves
// each scheduler one warp, every latency in its chain (the loads, the conversions, the sums, the
// shuffles) exposed with no other warp to run. These shapes spread the row one 16-byte vector a
// thread (the row's vectors rounded up to a power of two: from 256 threads, since a row past a
// warp row's 128 vectors has more), up to 1024 threads, then 2 and 4 vectors: 64 x 4096 takes 512
// threads, four warps a scheduler, as Inductor's persistent reduction takes its warps from the
// row's length.
constexpr NormShape kFewRowsShapes[] = {{256, 1}, {512, 1}, {1024, 1}, {1024, 2}, {1024, 4}};
constexpr int kNumFewRowsShapes = sizeof(kFewRowsShapes) / sizeof(kFewRowsShapes[0]);

// The index into kFewRowsShapes for rows x n on a GPU of `sms` SMs, or -1 (kForwardShapes):
// rows of whole vectors only (a thread's one vector never straddles the head of a row that
// starts mid-vector), at most one block an SM, and a row too long for a warp row.
inline int few_rows_forward_shape(int64_t rows, int64_t n, int elem_bytes, bool whole_vectors, int sms) {
  const int shape = forward_shape(n, elem_bytes);
  if (!whole_vectors || shape < 0 || kForwardShapes[shape].threads <= 32 || rows > sms) return -1;
  for (int i = 0; i < kNumFewRowsShapes; ++i) {
    if (n <= shape_capacity(kFewRowsShapes[i], elem_bytes)) return i;
  }
  return -1;
}

inline int backward_shape(int64_t n, int elem_bytes) {
  if (elem_bytes == 8) return -1;
  for (int i = 0; i < kNumBackwardShapes; ++i) {
    if (backward_shape_fits(kBackwardShapes[i], elem_bytes) && n <= shape_capacity(kBackwardShapes[i], elem_bytes)) {
      return i;
    }
  }
  return -1;
}

// The column half of the backward's one launch at few rows (norm_backward_few_rows in
// norm_backward_kernels.cu, backward_column_pass below says when): a tile is `lanes` adjacent
// lanes of `cols` columns each (cols: one 16-byte vector's elements where every row of dy and x is
// whole aligned vectors, else 1), one block a tile, its 8 warps each 32 / lanes rows at a time. 32
// lanes (a warp across 512 contiguous bytes of a row) while that gives every SM a tile, else halved
// down to the narrowest tile whose lanes still read a whole 32-byte sector of a row together:
// hidden 12288 in bfloat16 is 1536 vectors, 48 tiles of 32 lanes on 132 SMs, 192 tiles of 8.
// max_tiles: the blocks the launch has room for beside the dx blocks in one wave (the kernel's
// occupancy x the SMs, less the dx blocks). A tile is halved only while the halves still fit it:
// the column blocks share the dx kernel's block of 512 or 1024 threads and its two blocks an SM or
// one, and at 64 x 4096 in bfloat16 (LayerNorm: 32 dx blocks) the 2-lane tiles made 256 column
// blocks, 288 in all for the 264 that one wave holds on 132 SMs; the 24 left over waited for a
// whole block's time again, where the 4-lane tiles (128, each lane one row: still one step) fit.
struct ColumnTiles {
  int lanes;
  int64_t tiles;
};
inline ColumnTiles column_pass_tiles(int64_t n, int cols, int elem_bytes, int sms,
                                     int64_t max_tiles = std::numeric_limits<int64_t>::max()) {
  const int64_t bytes_per_lane = int64_t{cols} * elem_bytes;
  const int narrowest = bytes_per_lane >= 32 ? 1 : static_cast<int>(32 / bytes_per_lane);
  int lanes = 32;
  while (lanes > narrowest && ::course::ceil_div<int64_t>(n, int64_t{lanes} * cols) < sms &&
         ::course::ceil_div<int64_t>(n, int64_t{lanes / 2} * cols) <= max_tiles) {
    lanes /= 2;
  }
  return {lanes, ::course::ceil_div<int64_t>(n, int64_t{lanes} * cols)};
}

// Row groups a column lane keeps in flight there: half of chapter 3's column sums (4 of whole
// vectors, 16 of single elements), since the launch keeps the dx kernel's 64 registers a thread
// (norm_backward_kernels.cu says what four groups spilled).
constexpr int few_rows_unroll(int cols) { return cols > 1 ? 2 : 8; }

// Rows a column tile's loads cover in one step, every lane's loads issued before any is used:
// 8 warps x 32 / lanes rows x the row groups in flight. Up to that many rows the column half is
// one round trip to memory, as the dx half is.
inline int64_t column_pass_step_rows(int lanes, int cols) { return int64_t{8} * (32 / lanes) * few_rows_unroll(cols); }

// Where the backward's dweight and dbias come from (norm_backward_kernels.cu). The resident
// kernel can sum each block's columns over its rows as it goes, and write them as partial rows
// (one row of n float sums per column sum and block) that course::column_sum reads back in a
// second launch: per column, blocks * sums * 2 * 4 bytes. Or it writes none, and other blocks of
// the same launch re-read x and dy down the columns (norm_backward_few_rows): per column, rows * 2
// * elem bytes, and no second launch. The one launch where either holds:
//   - the bytes: the partial rows would move at least as many as the re-read. Partial rows pay
//     where each block sums many rows; where a block takes one or a few (64 tokens of hidden 12288:
//     one row a block, the whole grid one step), each would cost more than the row it sums, four
//     times x and dy's bytes in bfloat16 for LayerNorm;
//   - the latency: the column tiles' loads cover every row in one step (column_pass_step_rows),
//     so the column half costs one round trip beside the dx half's, where the partial rows cost a
//     second launch after it. At 64 x 2048 the blocks hold 4 rows each, and by bytes alone
//     RMSNorm (one sum) and float32 kept the partial rows and two launches for under a megabyte.
// n, cols and sms give the column tiles (column_pass_tiles); blocks is the resident kernel's grid.
inline bool backward_column_pass(int64_t rows, int64_t n, int elem_bytes, int cols, bool centered, int64_t blocks,
                                 int sms) {
  const int64_t acc_bytes = elem_bytes == 8 ? 8 : 4;
  const int64_t partial_bytes = int64_t{centered ? 2 : 1} * blocks * 2 * acc_bytes;
  const int64_t reread_bytes = 2 * rows * elem_bytes;
  const ColumnTiles tiles = column_pass_tiles(n, cols, elem_bytes, sms);
  return partial_bytes >= reread_bytes || rows <= column_pass_step_rows(tiles.lanes, cols);
}

// ---------------------------------------------------------------------------------------
// version=None: v3 forward and v2 backward at every size (they fall back to streaming by
// themselves past the register capacity, and v3's LayerNorm where its held rows keep too few bytes
// in flight: forward_streams); fused_add_rms_norm v2.
// ---------------------------------------------------------------------------------------
inline NormVersion default_norm() { return NormVersion::kResident; }
inline NormBackwardVersion default_norm_backward() { return NormBackwardVersion::kResident; }
inline AddNormVersion default_add_norm() { return AddNormVersion::kFused; }

struct NormParams {
  NormKind kind;
  NormVersion version;
  DType dtype;
  const void* x;         // rows x n, contiguous
  const void* residual;  // fused_add_rms_norm: rows x n, contiguous; else nullptr
  void* sum;             // fused_add_rms_norm: x + residual (rows x n); else nullptr
  const void* weight;    // n
  const void* bias;      // n (LayerNorm), nullptr (RMSNorm)
  void* y;               // rows x n
  void* mean;            // rows accumulators (LayerNorm), nullptr (RMSNorm)
  void* rstd;            // rows accumulators
  int64_t rows, n;
  double eps;
};

// dx, and the per-block partial column sums of dy * xhat (dweight) and dy (dbias) reduced to
// dweight and dbias. xhat = (x - mean) * rstd (LayerNorm) or x * rstd (RMSNorm), g = dy * weight:
//   LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
//   RMSNorm:   dx = rstd * (g - xhat * mean(g * xhat))  (+ dsum, where given)
struct NormBackwardParams {
  NormKind kind;
  NormBackwardVersion version;
  DType dtype;
  const void* dy;      // rows x n
  const void* x;       // rows x n (fused_add_rms_norm: the saved sum)
  const void* weight;  // n
  const void* mean;    // rows (LayerNorm), nullptr (RMSNorm)
  const void* rstd;    // rows
  void* dx;            // rows x n
  void* dweight;       // n
  void* dbias;         // n (LayerNorm), nullptr (RMSNorm)
  int64_t rows, n;
  void* workspace;     // norm_backward_workspace bytes: the partial column sums
  // RMSNorm only, or nullptr: rows x n, a gradient that reaches x directly and is added to dx in
  // the same pass (fused_add_rms_norm: the gradient of its second output, the sum h = x +
  // residual, beside the one through y). Added unfused it cost a third kernel that re-read dx.
  const void* dsum = nullptr;
};

// The elementwise add of fused_add_rms_norm's v1: out = x + residual, rounded to the dtype.
struct AddParams {
  DType dtype;
  const void* x;
  const void* residual;
  void* out;
  int64_t numel;
};

// The CPU implementations (norm_cpu.cpp): the reference semantics in C++, on the same params.
// `version` is ignored: the ladders are GPU thread mappings.
void norm_cpu(const NormParams& params);
void norm_backward_cpu(const NormBackwardParams& params);

}  // namespace norm
}  // namespace fusion

#if defined(__CUDACC__) || defined(WITH_CUDA)
#include <cuda_runtime_api.h>
namespace fusion {
namespace norm {
// Each launcher runs on `stream`, returns the launch error (or cudaSuccess) and never
// synchronizes. launch_norm with a residual writes the sum and normalizes it (fused or, for
// v1, in two kernels).
cudaError_t launch_norm(const NormParams& params, cudaStream_t stream);
cudaError_t launch_add(const AddParams& params, cudaStream_t stream);
// Bytes of workspace the backward launch needs (the caller allocates it, uninitialized).
cudaError_t norm_backward_workspace(const NormBackwardParams& params, int64_t* bytes);
cudaError_t launch_norm_backward(const NormBackwardParams& params, cudaStream_t stream);
}  // namespace norm
}  // namespace fusion
#endif

#ifdef __CUDACC__
// What both kernel files dispatch with: the launchers pick kernels by template parameters.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>
namespace fusion {
namespace norm {
using ::course::with_dtype;

// Calls f(std::bool_constant<b>): a runtime choice made once per launch, a template
// parameter (no branch) inside the kernel.
template <typename F>
cudaError_t with_flag(bool b, F&& f) {
  return b ? f(std::true_type{}) : f(std::false_type{});
}
}  // namespace norm
}  // namespace fusion
#endif
