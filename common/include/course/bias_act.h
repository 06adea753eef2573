// What a bias + activation op (chapter 4's family, chapter 5's fused_op) keeps for its backward,
// and the layout of its sign mask: host and device, torch- and CUDA-free, for the glue, the CPU
// implementations and the kernels alike (course/bias_act.cuh holds the kernels).
#pragma once

#include <course/index_math.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace course {

// The backward of y = act(z), z = x * scale + bias, needs act'(z). For relu that is whether the
// gradient passes, which three things can tell:
//   kOutput  y itself: the gradient passes where y is not <= 0 (y > 0, or NaN);
//   kInput   x, from which z (and any activation's derivative) is recomputed;
//   kMask    one bit per element, written by the forward: set where z is not <= 0.
// "Not <= 0" rather than "> 0" is torch's threshold_backward: at a NaN input relu's gradient
// passes through (and turns NaN in the input's gradient where it should), instead of vanishing.
enum class SaveKind { kOutput, kInput, kMask };

// The bit mask: bit c % 32 of word c / 32 of row r is element (r, c). Every row starts a new
// word, so a row's bits never share a word with another row's and every word has one writer.
COURSE_HOST_DEVICE constexpr int64_t mask_words_per_row(int64_t n) { return (n + 31) / 32; }

// Whether relu's gradient passes at z (or at y = relu(z)): threshold_backward's rule.
template <typename A>
COURSE_HOST_DEVICE constexpr bool relu_passes(A z) {
  return !(z <= A(0));
}

// ---------------------------------------------------------------------------------------
// The forward's column tiles (course/bias_act.cuh's bias_act_tile_kernel): a block of
// kTileThreads threads is tx adjacent packs by kTileThreads / tx rows, and each thread takes
// rows_per_thread rows of them. Here, torch- and CUDA-free, so that the CPU tests can ask the
// forward's choice below with any SM count.
// ---------------------------------------------------------------------------------------
constexpr int kTileThreads = 256;

// Packs of a row a tile spans: the power of two at or above the row's packs, at least min_tx,
// at most a block. Lanes past the row's end in the last tile have nothing to do.
inline int tile_width(int64_t packs_per_row, int min_tx) {
  int tx = min_tx;
  while (tx < kTileThreads && tx < packs_per_row) tx *= 2;
  return tx;
}

// Blocks of the forward's tiles: column tiles by row tiles (at most 65535, gridDim.y's limit).
inline int64_t forward_tile_blocks(int64_t rows, int64_t packs_per_row, int min_tx, int rows_per_thread) {
  const int tx = tile_width(packs_per_row, min_tx);
  const int64_t ty = kTileThreads / tx;
  const int64_t column_tiles = ceil_div<int64_t>(packs_per_row, tx);
  int64_t row_tiles = ceil_div<int64_t>(rows > 1 ? rows : 1, ty * rows_per_thread);
  row_tiles = row_tiles < 65535 ? row_tiles : 65535;
  return column_tiles * row_tiles;
}

// The forward's kernel (course/bias_act.cuh's launch_bias_act), one rule for the launcher and for
// the glue that names it without a GPU (chapter 4's bias_forward_kernel): the flat kernel unless
// it cannot pair the operands' vectors (flat_pairs false: course::flat_applies) or the column
// tiles pay. Tiles pay only for a forward that keeps several rows in flight a thread (GELU-erf's
// four, whose erff needs the registers of four blocks an SM rather than eight), on rows of whole
// vectors from 16-byte boundaries (`aligned`: every operand's pointer) that fill every tile, and
// only when the tiles' grid fills the blocks_per_sm blocks an SM holds of it on every SM. Four rows
// a thread divide the grid by four: bias_gelu at 64 x 4096 in bfloat16 was 2 column tiles by 16
// row tiles, 32 blocks on 132 SMs, and at 2048 x 1024 or 2048 x 2048 256 or 512 blocks for a wave
// of 528; the flat kernel (one vector a thread) gives such shapes four times the blocks and one
// round trip to DRAM. Below a wave, the grid (from the element count and the SM count, not from a
// list of shapes) goes flat; above, the tiles' four independent loads a thread keep more bytes in
// flight than eight blocks of one vector a thread at the same occupancy.
enum class ForwardKernel { kFlat, kTiles };

inline ForwardKernel forward_kernel(int64_t rows, int64_t n, int elem, bool aligned, bool flat_pairs, int min_tx,
                                    int rows_per_thread, int sms, int blocks_per_sm) {
  if (!flat_pairs) return ForwardKernel::kTiles;
  const int64_t vector = 16 / (elem > 0 ? elem : 1);
  if (rows_per_thread <= 1 || !aligned || n % vector != 0) return ForwardKernel::kFlat;
  const int64_t packs = n / vector;
  if (packs % tile_width(packs, min_tx) != 0) return ForwardKernel::kFlat;  // a tile's lanes idle
  const bool fills = forward_tile_blocks(rows, packs, min_tx, rows_per_thread) >=
                     int64_t{sms > 1 ? sms : 1} * (blocks_per_sm > 1 ? blocks_per_sm : 1);
  return fills ? ForwardKernel::kTiles : ForwardKernel::kFlat;
}

// ---------------------------------------------------------------------------------------
// The flat forward (course/bias_act.cuh's bias_act_flat_kernel, and chapter 4's swiglu flat kernel)
// on rows that start mid-vector (hidden 777, 4099): how a thread reaches its operands when the
// grid is one wave or less, where every thread's memory round trips are the kernel's time.
//
// The H100 shapes sweep at f2cdaec: at 64 tokens the odd widths ran 0.5-1.1 us slower than their
// even neighbours (bias_gelu bf16 64 x 4099 2.9 us, 64 x 4096 2.3; swiglu 64 x 8198 3.5 us, 64 x
// 8192 2.4), and at one token too (bias_gelu 1 x 4099 2.2 us, 1 x 4096 1.7): a kernel of one
// vector a thread and 128 blocks on 132 SMs lasts as long as its slowest warp, and three things
// gave some warps two dependent trips to memory where the rest take one:
//   - the few elements before x's first 16-byte boundary and after its last whole vector were
//     block 0's first threads' before their own vectors (a load, its use, then the vector's load);
//   - the bias of the vector that wraps into the next row, and of a row's last vectors, was a
//     gather in a branch of its own beside the other lanes' two aligned loads: the warp ran one
//     branch to its loads' use, then the other (divergent paths do not overlap their waits);
//   - swiglu's vector that straddles two rows issued its third load after the first two landed,
//     and the vectors whose aligned loads would leave x read single elements in a branch first.
// The uniform form (kUniform): those elements go to a warp of their own past the last vector;
// every lane's bias is L single loads at its columns, wrapped or not (from L1: one bias row serves
// every row), issued with x's before any use (course/bias_act.cuh's bias_uniform says why not
// aligned windows); swiglu's straddling lanes issue their third realigned pair with the first two,
// and the single-element lanes issue theirs in a branch that only loads, beside the other lanes'.
// One round trip a warp, for more load instructions a thread (L single loads where the branching
// form made one or two 16-byte ones) and more registers. Past a wave the slow warps overlap other
// blocks' work and those instructions are the cost, so the rule keeps the former (branching) form
// there.
//   COURSE_FORWARD_ODD   bench-only, read by the launchers at each call (a benchmark switches it
//                        between captures): "auto" or unset, the rule; "branch", the former form
//                        at every grid; "uniform", the uniform form at every grid.
// ---------------------------------------------------------------------------------------
enum class FlatOdd { kRule, kBranch, kUniform };

// Blocks of 256 threads an SM holds of the uniform form: the wave the rule counts. ptxas -v (nvcc
// 13.0, sm_90a): swiglu's forward takes 48 registers in 16-bit dtypes (the branching one 38), 42
// in float32 (32); the bias kernels' uniform form fewer (chapter 4's NOTES.md has the counts). 48
// registers a thread hold 5 blocks of 256 in an SM's 64K; the others hold more, so 5 counts low.
constexpr int64_t kFlatUniformBlocksPerSm = 5;

// Whether a flat grid of `blocks` blocks of 256 threads takes the uniform form on `sms` SMs: at
// most one wave of it (132 SMs: 660 blocks, bias_gelu's 64 x 16387 in bfloat16 and less).
inline bool flat_uniform(int64_t blocks, int sms, FlatOdd forced = FlatOdd::kRule) {
  if (forced != FlatOdd::kRule) return forced == FlatOdd::kUniform;
  return blocks <= kFlatUniformBlocksPerSm * (sms > 1 ? sms : 1);
}

// The value of COURSE_FORWARD_ODD (null or empty: the rule); false where it names none.
inline bool parse_flat_odd(const char* value, FlatOdd* v) {
  *v = FlatOdd::kRule;
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) return true;
  if (std::strcmp(value, "branch") == 0) {
    *v = FlatOdd::kBranch;
    return true;
  }
  if (std::strcmp(value, "uniform") == 0) {
    *v = FlatOdd::kUniform;
    return true;
  }
  return false;
}

// This process's choice, from the environment at the time of the call; a value that names none
// leaves the rule (chapter 4's flat_forward_form raises on it).
inline FlatOdd flat_odd_variant() {
  FlatOdd v;
  if (!parse_flat_odd(std::getenv("COURSE_FORWARD_ODD"), &v)) v = FlatOdd::kRule;
  return v;
}

// The first thread (a flat index over the grid) of the elements outside whole vectors: the
// uniform form's warp past the last vector's, or (the branching form) block 0's thread 0.
inline int64_t flat_edge_first(int64_t vectors, bool uniform) { return uniform ? (vectors + 31) / 32 * 32 : 0; }

// Blocks of `threads` threads that cover `vectors` vector threads and, from edge_first on, `edges`
// single-element threads (at least one block).
inline int64_t flat_edge_blocks(int64_t vectors, int64_t edges, int64_t edge_first, int threads) {
  int64_t last = vectors;
  if (edges > 0 && edge_first + edges > last) last = edge_first + edges;
  const int64_t blocks = ceil_div<int64_t>(last, threads);
  return blocks > 1 ? blocks : 1;
}

// ---------------------------------------------------------------------------------------
// The backward's column tiling (course/bias_act.cuh's act_backward_tile_kernel), from the shape
// and the SM count alone, so that the CPU tests can ask it with any SM count. A block of
// kGradThreads threads is a tile of tx adjacent packs by ty = kGradThreads / tx rows; each
// thread sums its columns' gradient over the rows it visits in registers, the block adds its ty
// rows of sums in shared memory, and writes one row: dbias itself when the grid has one row
// tile (one launch), else one partial row per row tile, which the last block of each column
// tile adds in the same launch, or course::column_sum in a second (grad_finishes_in_kernel).
//
// Why the tile narrows at few rows: every thread of the grid takes one step of `rows_in_flight`
// rows (the whole problem one round trip to DRAM) until the grid has the blocks the SMs hold; a
// tile of ty rows then sums ty * rows_in_flight rows on chip. A tile 64 bytes of a row wide
// (two 32-byte sectors: 4 packs of 16 bytes, 32 bfloat16 or 16 float32 single elements) is 64
// rows tall for 16-byte packs, and one step of its threads covers at least 64 rows in every
// dtype: up to 64 tokens, any hidden size is one row tile and one launch, where tiles of 256
// packs left 64 partial rows and a second launch to add them (fused_op's backward at 64 x 3072
// ran 7.7 us on the H200, torch.compile's one kernel 2.2 us). Only when more rows fill the GPU
// anyway does the tile widen to the row's width (up to 256 packs, a warp over 512 contiguous
// bytes), the widest power of two that leaves at most an eighth of the lanes idle (hidden 768 in
// bfloat16 is 96 packs: tiles of 32, not 128 with a quarter idle).
//
// Rows that start mid-vector (hidden 4099) took single elements until the H200 ran
// fused_bias_scale_relu's backward at 2048 x 4099 in bfloat16 at 0.45x torch.compile: 2 bytes a
// lane, a warp load of 64 bytes, and the grid of 4 blocks an SM that suits 16-byte packs left too
// few bytes in flight. They now take 16-byte packs (row_phases below): the same tiles over the
// row's columns, a block owning its columns in every row, with one cap: a tile's ty rows are a
// multiple of the phases (tx at most kGradThreads / phases: 32 packs for an odd bfloat16 row), so
// that each thread meets the rows of one phase. A first version split the row tiles by phase
// instead (a grid of row tiles for every phase, so always partial rows and a column_sum): at 64
// tokens its blocks found 8 rows for 64 tile rows, and the backward at 64 x 4099 took 13 us on
// the H200 where torch.compile took 3.
// ---------------------------------------------------------------------------------------
constexpr int kGradThreads = 256;
// Rows a backward thread loads before it computes any (course/bias_act.cuh's kRowsInFlight and
// kSpanRowsInFlight say why): two of 16-byte packs, eight of single elements, one of the packs of
// rows that start mid-vector (phased).
COURSE_HOST_DEVICE constexpr int grad_rows_in_flight(int lanes, bool phased = false) {
  return phased ? 1 : lanes == 1 ? 8 : 2;
}
// The blocks an SM holds that the tiling counts on where no kernel is asked (the CPU's rule
// tests); the launchers pass the occupancy of the kernel they launch (grad_tiling's last
// argument), which is 3 for the span kernel where z is recomputed from x (GELU-erf's backward).
constexpr int64_t kGradBlocksPerSm = 4;

// Rows of n elements of elem bytes that are not a whole number of 16-byte vectors start at
// several offsets within a vector: row r is r * n * elem bytes past row 0, so the offsets repeat
// every row_phases(n, elem) = 16 / gcd(n * elem, 16) rows (8 for an odd bfloat16 row such as
// hidden 4099, 4 for an odd float32 one, 1 for whole vectors). The rows of one phase all start
// at the same offset: in them, the same columns fall on the same 16-byte boundaries.
COURSE_HOST_DEVICE constexpr int row_phases(int64_t n, int elem) {
  int p = 1;
  while (p < 16 && (static_cast<int64_t>(p) * n * elem) % 16 != 0) p *= 2;
  return p;
}

struct GradTiling {
  int tx;                // packs per row of a tile, a power of two
  int ty;                // rows of a tile: kGradThreads / tx
  int64_t column_tiles;  // gridDim.x
  int64_t row_tiles;     // gridDim.y: 1, the kernel writes dbias; else the partial rows
};

// ---------------------------------------------------------------------------------------
// Few rows (up to 64 tokens), where the narrow tile's one row tile holds every row: each thread
// of a tile 64 bytes wide and kGradThreads / tx rows tall takes one step of rows_in_flight rows,
// so at 64 tokens of 16-byte packs (64-row tiles, two rows a step) every thread loads one row and
// its second slot stays empty, and the grid is one block per 64 bytes of a row. Where that grid
// passes the wave the SMs hold, the blocks past it run as a second wave of full round trips:
// fused_op's backward in float32 at 64 x 12288 is 768 blocks for the 528 that 132 SMs hold at 4
// an SM, and took 6.0 us on the H200 (results/nvidia-h200/chapter5_pytorch_extensions_shapes.json
// at e0364aa) where 64 x 8192, 512 blocks, took 4.3 and torch.compile 4.3 at 12288; at 64 x 16384,
// 1024 blocks, 6.7 against 5.4. A tile twice as wide and half as tall (32 rows, each thread two of
// them in its one step) fills both slots of every thread and halves the grid to one wave, with
// the bytes in flight a block doubled (four 16-byte loads a thread where there were two).
//   kFill    (the default) widen (tx doubled) while one step of every thread still covers every
//            row (one row tile: dbias written by the kernel, one launch), at most an eighth of the
//            lanes idle, and the grid keeps a block on every SM: two rows a thread and half the
//            blocks, where the grid passes the wave and where one wave held either;
//   kNarrow  the narrow tile at any grid (the tiling before this rule);
//   kWave    widen only while the grid passes the wave (the same limits), the first form built.
//   Measured (H200, one process, shuffled rounds, fused_op's backward; chapter 5's NOTES.md):
//   float32 64 x 12288 and 64 x 16384 15-16% less time than kNarrow under either widening form;
//   kFill a further 7-8% at bfloat16 64 x 12288 and 64 x 16384 and 4% at float32 64 x 8192,
//   which kWave leaves narrow (one wave); level (within 1%) at every other row timed.
//   COURSE_BIAS_GRAD_FEW   bench-only, read by the launcher at each call: "auto", "fill" or unset,
//                          kFill; "narrow"; "wave" (course::grad_variant below).
// ---------------------------------------------------------------------------------------
enum class FewRows { kFill, kNarrow, kWave };

// The few-rows rule on a tile width tx that grad_tiling picked (the narrow one): tx, or wider as
// `few` says. sweep_at(w): row tiles at width w if every thread takes one step; p: packs a row;
// target: the wave (blocks); phases: the tile's rows stay a multiple of them (256 / w >= phases).
template <typename SweepAt>
inline int few_rows_width(int tx, int64_t p, int64_t target, int sms, int phases, FewRows few, SweepAt sweep_at) {
  if (few == FewRows::kNarrow || sweep_at(tx) > 1) return tx;
  int w = tx;
  while (2 * w <= kGradThreads / (phases > 1 ? phases : 1)) {
    const int next = 2 * w;
    if (sweep_at(next) > 1) break;                                // one step no longer covers every row
    if (ceil_div<int64_t>(p, next) * next * 8 > p * 9) break;     // more than an eighth of the lanes idle
    if (few == FewRows::kWave && ceil_div<int64_t>(p, w) <= target) break;  // the grid fits a wave
    if (few == FewRows::kFill && ceil_div<int64_t>(p, next) < (sms > 1 ? sms : 1)) break;  // an SM idle
    w = next;
  }
  return w;
}

// phases > 1 (row_phases of rows that start mid-vector): ty stays a multiple of the phases, so
// that every row a thread visits (its first plus multiples of ty) starts its vectors at the same
// column (course/bias_act.cuh's act_backward_span_kernel).
//
// The row tiles: as many as one wave of the GPU holds beside the column tiles, rounded down
// (blocks_per_sm: what the launched kernel's occupancy allows). Rounded up, as they were, a grid
// of column_tiles x ceil(target / column_tiles) blocks passed the resident blocks by up to
// column_tiles - 1, and those few blocks ran as a second wave of a whole block's rows: at 2048 x
// 4099 in bfloat16 (17 column tiles, 132 SMs) 544 blocks for the 528 that fit at 4 an SM, and for
// the 396 that fit at 3 (GELU-erf's span kernel), where every block loops over 8 rows one row at
// a time; the ReLU backward there took 28 us and GELU-erf's 51, torch.compile 32 (H100). Rounded
// down, a thread takes a step or two more and the grid ends in one wave. Only a row of column
// tiles that alone passes the wave (wide rows) takes more than one. Then the fewest row tiles
// that keep those steps a thread: the same time, and fewer partial rows for column_sum to add.
inline GradTiling grad_tiling(int64_t rows, int64_t packs, int pack_bytes, int rows_in_flight, int sms,
                              int phases = 1, int blocks_per_sm = kGradBlocksPerSm, FewRows few = FewRows::kFill) {
  const int64_t p = packs > 1 ? packs : 1;
  const int64_t r = rows > 1 ? rows : 1;
  // The launched kernel's occupancy lowers the wave (GELU-erf's span kernel: 3 an SM) but never
  // raises it past kGradBlocksPerSm: 4 blocks of 256 threads an SM already keep every row of the
  // problem one round trip to DRAM, and a larger target only narrows the tiles (at 2048 x 768 in
  // float32 a kernel that fits 8 an SM turned 3 column tiles of 64 packs into 48 of 4, 64-byte
  // segments a warp, and the ReLU backward went from 9.6 us to 14.2 on an H100).
  const int per_sm = blocks_per_sm < kGradBlocksPerSm ? (blocks_per_sm > 1 ? blocks_per_sm : 1) : kGradBlocksPerSm;
  const int64_t target = int64_t{per_sm} * (sms > 1 ? sms : 1);
  // Narrowest: 64 bytes of a row, or the power of two at or above a shorter row's packs.
  int narrow = pack_bytes >= 64 ? 1 : 64 / pack_bytes;
  while (narrow > 1 && narrow / 2 >= p) narrow /= 2;
  // Widest: up to a block (phases: a block of at least `phases` rows), no wider than the row, and
  // at most an eighth of the lanes idle.
  int wide = kGradThreads / (phases > 1 ? phases : 1);
  while (wide > narrow && (wide / 2 >= p || ceil_div<int64_t>(p, wide) * wide * 8 > p * 9)) wide /= 2;
  // Row tiles if every thread takes one step of rows_in_flight rows, at width tx.
  const auto sweep_at = [&](int tx) { return ceil_div<int64_t>(r, int64_t{kGradThreads / tx} * rows_in_flight); };
  const bool wide_fills = ceil_div<int64_t>(p, wide) * sweep_at(wide) >= target;
  // Narrow where its one row tile holds every row (one launch) or the grid would not fill anyway;
  // at few rows, as wide as few_rows_width allows.
  const int tx = sweep_at(narrow) > 1 && wide_fills ? wide
                                                    : few_rows_width(narrow, p, target, sms, phases, few, sweep_at);
  const int ty = kGradThreads / tx;
  const int64_t column_tiles = ceil_div<int64_t>(p, tx);
  const int64_t sweep = sweep_at(tx);
  int64_t row_tiles = target / column_tiles;  // one wave: rounded down (above)
  row_tiles = row_tiles > 1 ? row_tiles : 1;
  row_tiles = row_tiles < sweep ? row_tiles : sweep;
  row_tiles = ceil_div<int64_t>(sweep, ceil_div<int64_t>(sweep, row_tiles));  // same steps, fewest tiles
  row_tiles = row_tiles < 65535 ? row_tiles : 65535;  // gridDim.y's limit
  return {tx, ty, column_tiles, row_tiles};
}

// Where the grid has several row tiles, the partial rows are added in the backward kernel itself
// (course/bias_act.cuh's finish_tile_column) rather than by a second launch
// (course::column_sum): the last block of each column tile to finish, found with an atomic
// counter per column tile, adds the tile's row_tiles partial rows for its W = tx * lanes
// columns. The second launch costs a launch gap and a round trip of the partials after the
// kernel's own, where torch.compile's backward at a few thousand tokens is one reduction
// kernel. Two limits keep that last block short: a counter for every column tile
// (kFinishCounters of them), and at most kFinishSumsPerThread partials for each of its
// kGradThreads threads to add. Past either (rows of thousands of float32 columns, with dozens of
// partial rows a column tile), one block would add hundreds of kilobytes while the other SMs
// idle, and column_sum's grid spreads them over the GPU.
constexpr int kFinishCounters = 4096;
constexpr int64_t kFinishSumsPerThread = 32;

// (The last block's threads share a column tile's W columns as the tile's own sums do:
// kGradThreads / W lanes a column from 8 columns up, one thread a column below 8, which then adds
// all row_tiles partials of its column alone.)
COURSE_HOST_DEVICE constexpr bool grad_finishes_in_kernel(int64_t column_tiles, int64_t row_tiles, int tx,
                                                          int lanes) {
  return row_tiles > 1 && column_tiles <= kFinishCounters &&
         (int64_t{tx} * lanes >= 8 ? row_tiles * tx * lanes <= kFinishSumsPerThread * kGradThreads
                                   : row_tiles <= kFinishSumsPerThread);
}

// ---------------------------------------------------------------------------------------
// Rows that start mid-vector (hidden 777 or 4099 in bfloat16) have two kernels that can take
// them, where dy, dx and the saved tensor sit equally far from a 16-byte boundary: the span
// kernel (16-byte packs, one row in flight a thread) and the tile kernel on single elements
// (eight rows in flight a thread). Which one the launcher takes: first the one that holds more
// blocks an SM (each kernel's occupancy, which the launcher asks the CUDA runtime for, both
// counted at most at kGradBlocksPerSm, past which the grid does not grow). ptxas -v (nvcc 13.0,
// sm_90a): GELU-erf's span kernel, z recomputed from x (kInput), takes 80 registers and spills
// 20 bytes in bfloat16 (80 in float32), 3 blocks an SM, where its single elements take 54 (56):
// 4 blocks an SM, and single elements ran faster on the H100 at every odd bfloat16 shape (2048 x
// 777 14.2 us against 17.1, 64 x 4099 3.8 against 6.3), about even in float32.
//
// At equal occupancy (ReLU's: 62-64 registers both, 4 blocks an SM) the bytes in flight do not
// decide it: in bfloat16 a thread has 32 bytes outstanding in either kernel where it reads dy and
// y (eight rows of 2 + 2 bytes, or one 16-byte pack of each), 16 of dy and a mask word where it
// reads the mask, yet the two saved kinds went opposite ways on the same H100: with y (chapter
// 5's fused_op) single elements won at every odd shape (8192 x 777 22.8 us against 30.8), with
// the mask the span kernel did (fused_bias_scale_relu at 2048 x 4099 25.0 against 41.1), in
// float32 too, where single elements keep twice the span kernel's bytes in flight. So at equal
// occupancy the choice is by what the backward reads, as measured: the mask (one bit an element
// beside dy) the span kernel, the saved tensor (y) single elements.
// ---------------------------------------------------------------------------------------
enum class OddRows { kRule, kSpan, kSingle };

inline bool odd_rows_take_single(SaveKind source, int span_blocks_per_sm, int single_blocks_per_sm,
                                 OddRows forced = OddRows::kRule) {
  if (forced != OddRows::kRule) return forced == OddRows::kSingle;
  const auto held = [](int blocks) {
    const int most = static_cast<int>(kGradBlocksPerSm);
    return blocks < 1 ? 1 : blocks > most ? most : blocks;
  };
  const int span = held(span_blocks_per_sm);
  const int single = held(single_blocks_per_sm);
  if (span != single) return single > span;
  return source != SaveKind::kMask;
}

// ---------------------------------------------------------------------------------------
// Bench-only variants of the backward, so that one benchmark run times them side by side in one
// build: read from the environment by the launcher (course/bias_act.cuh's launch_fused_backward)
// and by chapter 4's bias_grad_tiling and bias_grad_odd_rows. Nothing in the course sets them;
// unset (or empty), the defaults.
//   COURSE_BIAS_GRAD_FINISH  "batched" (default): the in-kernel finish fences once a block and
//                            reads the partial rows in batches (finish_tile_column);
//                            "serial": its first form, a fence in every thread and one partial
//                            row at a time a thread.
//   COURSE_BIAS_GRAD_ODD     "auto" (default): rows that start mid-vector take the kernel that
//                            odd_rows_take_single picks; "span": always the span kernel's
//                            16-byte packs (phased); "single": always the tile kernel's single
//                            elements, eight rows in flight a thread (grad_rows_in_flight).
// ---------------------------------------------------------------------------------------
struct GradVariant {
  bool batched_finish = true;
  OddRows odd = OddRows::kRule;
  FewRows few = FewRows::kFill;  // COURSE_BIAS_GRAD_FEW (few_rows_width), parsed by parse_few_rows
};

// The variant that the two values name (null or empty: the default); false where either names
// none (the glue's check reports which).
inline bool parse_grad_variant(const char* finish, const char* odd, GradVariant* v) {
  *v = GradVariant{};
  const auto is = [](const char* s, const char* name) { return s != nullptr && std::strcmp(s, name) == 0; };
  const auto unset = [](const char* s) { return s == nullptr || *s == '\0'; };
  bool ok = true;
  if (is(finish, "serial")) {
    v->batched_finish = false;
  } else if (!unset(finish) && !is(finish, "batched")) {
    ok = false;
  }
  if (is(odd, "single")) {
    v->odd = OddRows::kSingle;
  } else if (is(odd, "span")) {
    v->odd = OddRows::kSpan;
  } else if (!unset(odd) && !is(odd, "auto")) {
    ok = false;
  }
  return ok;
}

// The value of COURSE_BIAS_GRAD_FEW (null, empty, "auto" or "fill": the default, kFill); false where
// it names none. Apart from parse_grad_variant, whose two knobs chapter 4's glue checks by name.
inline bool parse_few_rows(const char* value, FewRows* few) {
  *few = FewRows::kFill;
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0 || std::strcmp(value, "fill") == 0) {
    return true;
  }
  if (std::strcmp(value, "narrow") == 0) {
    *few = FewRows::kNarrow;
    return true;
  }
  if (std::strcmp(value, "wave") == 0) {
    *few = FewRows::kWave;
    return true;
  }
  return false;
}

// This process's variant, from the environment at the time of the call (a benchmark switches it
// between captures); a value that names none leaves the default (bias_grad_tiling raises on it).
inline GradVariant grad_variant() {
  GradVariant v;
  if (!parse_grad_variant(std::getenv("COURSE_BIAS_GRAD_FINISH"), std::getenv("COURSE_BIAS_GRAD_ODD"), &v)) {
    v = GradVariant{};
  }
  if (!parse_few_rows(std::getenv("COURSE_BIAS_GRAD_FEW"), &v.few)) v.few = FewRows::kFill;
  return v;
}

}  // namespace course
