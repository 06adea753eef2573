// The kernels of y = act(x * scale + bias) over a [rows, n] array, bias broadcast over the rows,
// and of its backward (dx, and dbias the column sum of the gradient), for any activation functor
// Act (a struct with `template <typename A, bool kFast> static A forward(A)` and `derivative`).
// Chapter 4 derives them (fused_bias_scale_relu v3-v4, bias_gelu and bias_silu v2, linear's
// epilogue; its activation.h has the functors) and chapter 5's fused_op runs them.
//
//   bias_act_tile_kernel   the column tiling: a thread keeps its columns for life, so it loads
//                          their bias once; 16-byte accesses when every row starts on a 16-byte
//                          boundary, single elements otherwise;
//   bias_act_flat_kernel   one 16-byte vector per thread over the flat array, the bias of each
//                          element found by its column: every lane busy at any row length,
//                          and rows that start mid-vector (n not a multiple of the vector) still
//                          read and write whole aligned vectors, their bias too (bias_window);
//   act_backward_tile_kernel  the backward on the column tiling: dx written once, the gradient
//                          summed per column in registers and across the tile's rows in
//                          shared memory; dbias written by the kernel itself when one row tile
//                          covers every row, else from its partial rows by the last block of
//                          each column tile (finish_tile_column) or by course::column_sum;
//   act_backward_span_kernel  the same for rows that start mid-vector (hidden 4099): a block
//                          owns a span of columns in every row, each thread meets one phase of
//                          rows, so that they too move whole aligned vectors, with only the
//                          span's two ends and the row's last pack element by element.
//
// nvcc only, torch-free, like every kernel of the course.
#pragma once

#include <course/bias_act.h>
#include <course/column_reduce.cuh>
#include <course/cuda_utils.h>
#include <course/numeric.cuh>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace course {

// The functors' approximate exp and reciprocal where results are 16-bit (chapter 4's
// activation.h says why rounding to 8 or 11 significant bits hides their error).
template <typename T>
constexpr bool kFastMath = sizeof(T) == 2;

template <typename F>
cudaError_t with_source(SaveKind source, F&& f) {
  switch (source) {
    case SaveKind::kOutput: return f(std::integral_constant<SaveKind, SaveKind::kOutput>{});
    case SaveKind::kInput: return f(std::integral_constant<SaveKind, SaveKind::kInput>{});
    case SaveKind::kMask: break;
  }
  return f(std::integral_constant<SaveKind, SaveKind::kMask>{});
}

// A tile's width (tx packs, or the G lanes of a column in add_down_columns) and the row phases are
// powers of two that the launcher picks at run time (tile_width and few_rows_width double them;
// row_phases too): the kernels divide by them with course::pow2 (index_math.h), a shift and a
// mask. As divisions by a run-time value, the backward's tile kernel did two before its first load
// and three in a row before its column sums, on a kernel that at 64 tokens is little else (ncu,
// fused_op's backward at 64 x 2048 in float32: 'wait' the second stall reason after the loads).

// Every kernel's z = x * scale + bias is one fused multiply-add, written out so that the
// forward's mask and the backward's recomputation from x (save="x") round z identically.
__device__ __forceinline__ float fma_acc(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_acc(double a, double b, double c) { return fma(a, b, c); }

// The operands, as the kernels see them. bias may be null (no bias: linear's activation kernel
// after a separate bias kernel); pre, null or where z = x * scale + bias is stored as well (it
// may be x itself); mask, null or rows * mask_words_per_row(n) words; y may be x (in place).
template <typename T>
struct BiasAct {
  const T* x;
  const T* bias;
  typename Acc<T>::type scale;
  T* y;
  T* pre;
  uint32_t* mask;
  int64_t rows, n;
};

// The backward's: saved is x (kInput), y (kOutput) or unused (kMask); bias is read for kInput
// only; dbias receives n elements; workspace holds fused_backward_workspace bytes.
template <typename T>
struct BiasActGrad {
  const T* dy;
  const T* saved;
  const uint32_t* mask;
  const T* bias;
  typename Acc<T>::type scale;
  T* dx;
  T* dbias;
  int64_t rows, n;
  void* workspace;
};

// L adjacent elements of a row, the unit a thread loads, computes and stores: one 16-byte vector
// (L = 16 / sizeof(T)) on the vector path, one element on the scalar path. Which one is a
// template parameter, so neither path carries a runtime branch in its loop.
template <typename T, int L>
struct Pack {
  T v[L];
};

template <typename T, int L>
__device__ __forceinline__ Pack<T, L> load_pack(const T* p) {
  Pack<T, L> out;
  if constexpr (L == Vec16<T>::kLanes) {
    const Vec16<T> v = load16(reinterpret_cast<const Vec16<T>*>(p));
#pragma unroll
    for (int l = 0; l < L; ++l) out.v[l] = v.v[l];
  } else {
    static_assert(L == 1, "a pack is one element or one 16-byte vector");
    out.v[0] = *p;
  }
  return out;
}

// The bits of 2 bytes of T: a 16-bit element as the low half of a word.
template <typename T>
__device__ __forceinline__ uint32_t bits16(T v) {
  uint16_t b;
  memcpy(&b, &v, sizeof(b));
  return b;
}

// One 16-byte store of the L elements of v, as four 32-bit words that the kernel builds itself
// and one st.global.v4.b32. course::store16 (an int4 copied from the elements) came out of nvcc
// 13.0 as four st.global.v2.u16 in 16-bit types and as four st.global.f32 in float32 (ptx and
// SASS of these kernels, sm_90a), four store instructions where one moves the same bytes, in
// kernels whose instruction budget at copy speed is some 40 an element in bfloat16. p is 16-byte
// aligned (the launchers check), and global memory. Kept here, not made course::store16: in
// LayerNorm's forward the same form cost 12 registers a thread and a block an SM (numeric.cuh).
template <typename T, int L>
__device__ __forceinline__ void store16_words(T* p, const T (&v)[L]) {
  static_assert(L * sizeof(T) == 16, "one 16-byte vector");
  uint32_t w[4];
  if constexpr (sizeof(T) == 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = bits16(v[2 * i]) | (bits16(v[2 * i + 1]) << 16);
  } else {
    memcpy(w, v, 16);  // float32 and float64: whole words already
  }
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
               : "memory");
}

template <typename T, int L>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, L>& in) {
  if constexpr (L == Vec16<T>::kLanes) {
    store16_words<T, L>(p, in.v);
  } else {
    static_assert(L == 1, "a pack is one element or one 16-byte vector");
    *p = in.v[0];
  }
}

// The vector path of the tiles needs every row to start on a 16-byte boundary: every pointer
// aligned and the row length a whole number of vectors. Null pointers (absent operands) do not
// count.
template <typename T>
inline bool vectorizable(int64_t n, std::initializer_list<const void*> pointers) {
  if (n % Vec16<T>::kLanes != 0) return false;
  for (const void* p : pointers) {
    if (p != nullptr && !is_aligned(p, 16)) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------
// The column tiling of the fused kernels. A block of kTileThreads threads is a tile of tx
// adjacent packs (columns) by ty = kTileThreads / tx rows; it walks down the rows with a
// stride of gridDim.y * ty (make_tiling: a few rows per thread in the forward, many in the
// backward). A thread keeps the same columns for its whole life, so it loads the bias of its
// columns once and keeps it in registers for every row it visits (and, in the backward, sums its
// columns' gradient over those rows in registers). Consecutive threads take consecutive packs
// of one row: a warp reads 32 * 16 = 512 contiguous bytes per instruction.
// ---------------------------------------------------------------------------------------
// kTileThreads and tile_width: course/bias_act.h.
// Rows a backward thread loads before it computes any: two independent 16-byte loads of dy
// (and two of what the forward saved) in flight per thread, to cover DRAM latency at the
// occupancy its per-column sums leave. Single elements (rows that are not whole vectors) are
// 8 to 16 times fewer bytes a load: eight rows of them.
template <int L>
constexpr int kRowsInFlight = grad_rows_in_flight(L);

struct Tiling {
  int tx;          // packs per row in a tile: a power of two, >= min_tx
  dim3 grid;       // x: column tiles, y: row tiles
  int64_t slots;   // the backward's partial rows: gridDim.y, or 0 when the kernel writes dbias
};

// The forward kernels' (and swiglu's backward's) tiling: no per-row state, so one sweep of
// `rows_per_thread` rows per thread and as many blocks as that takes, the grid of a copy kernel.
// A grid sized to one resident wave ran well below copy on the H100: it counted 2048 threads
// per SM, while these kernels' 40-68 registers (ptxas -v) fit 768-1536, so the "one wave" ran as
// one and a fraction waves with the SMs idle in the last. Many short blocks leave no such tail;
// the bias, reloaded per thread, is an L1/L2 hit. (The backward's bias gradient has per-row
// state: grad_tiling in course/bias_act.h.)
inline cudaError_t make_tiling(int64_t rows, int64_t packs_per_row, int min_tx, Tiling* t, int rows_per_thread = 2) {
  const int tx = tile_width(packs_per_row, min_tx);
  const int ty = kTileThreads / tx;
  const int64_t column_tiles = ceil_div(packs_per_row, static_cast<int64_t>(tx));
  int64_t row_tiles = ceil_div(std::max<int64_t>(rows, 1), static_cast<int64_t>(ty) * rows_per_thread);
  row_tiles = std::min<int64_t>(row_tiles, 65535);  // gridDim.y's limit
  t->tx = tx;
  t->grid = dim3(static_cast<unsigned>(std::min<int64_t>(column_tiles, INT_MAX)), static_cast<unsigned>(row_tiles));
  t->slots = 0;
  return cudaSuccess;
}

// Blocks of `threads` for a grid-stride loop over `work` items: one resident wave at most.
inline cudaError_t flat_blocks(int64_t work, int threads, unsigned* blocks) {
  int64_t resident = 0;
  COURSE_CUDA_TRY(resident_threads(&resident));
  const int64_t wanted = ceil_div(std::max<int64_t>(work, 1), static_cast<int64_t>(threads));
  *blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min(wanted, resident / threads)));
  return cudaSuccess;
}

constexpr int kFlatThreads = 256;

// ---------------------------------------------------------------------------------------
// The column tiles, forward: 16-byte accesses, the bias held in registers across rows, kRows
// rows in flight per thread. The mask: a pack of L elements gives L bits; the 32 / L lanes whose
// packs make one 32-bit word OR their bits together with shuffles, and the first of them stores
// the word.
// ---------------------------------------------------------------------------------------
// kMinBlocks counts for sm_80/sm_90 (2048 threads per SM); sm_75 holds 1024, so its device pass
// asks for half (the template arguments, and so the kernel's name, stay the same in every pass).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define COURSE_MIN_BLOCKS(blocks) ((blocks) > 1 ? (blocks) / 2 : 1)
#else
#define COURSE_MIN_BLOCKS(blocks) (blocks)
#endif
template <typename T, typename Act, int L, bool kMask, int kRows, int kMinBlocks>
__global__ void __launch_bounds__(kTileThreads, COURSE_MIN_BLOCKS(kMinBlocks))
    bias_act_tile_kernel(const T* x, const T* bias, typename Acc<T>::type scale, T* y, T* pre,
                         uint32_t* mask, int64_t rows, int64_t n, int tx) {
  using A = typename Acc<T>::type;
  const Pow2 x_split = pow2(tx);
  const int ty = kTileThreads >> x_split.shift;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * tx + (threadIdx.x & x_split.mask);  // pack index in a row
  const int64_t e = col * L;                                                     // its first element
  // The last column tile may hang over the row's end; its extra threads only join the shuffles.
  const bool col_ok = e < n;
  A b[L];
#pragma unroll
  for (int l = 0; l < L; ++l) b[l] = A(0);
  if (col_ok && bias != nullptr) {
    const Pack<T, L> bv = load_pack<T, L>(bias + e);
#pragma unroll
    for (int l = 0; l < L; ++l) b[l] = to_acc(bv.v[l]);
  }
  const int64_t row_in_tile = threadIdx.x >> x_split.shift;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * ty;
  const int64_t words_per_row = mask_words_per_row(n);
  // base is the same in every thread of the block, so every lane of a warp makes the same trips
  // and reaches the mask's shuffles (which need all 32) together.
  for (int64_t base = static_cast<int64_t>(blockIdx.y) * ty; base < rows; base += kRows * row_step) {
    Pack<T, L> xv[kRows];
    bool active[kRows];
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int64_t r = base + row_in_tile + u * row_step;
      active[u] = col_ok && r < rows;
      if (active[u]) xv[u] = load_pack<T, L>(x + r * n + e);
    }
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int64_t r = base + row_in_tile + u * row_step;
      uint32_t bits = 0;
      if (active[u]) {
        Pack<T, L> yv;
        Pack<T, L> zv;
#pragma unroll
        for (int l = 0; l < L; ++l) {
          const A z = fma_acc(to_acc(xv[u].v[l]), scale, b[l]);
          yv.v[l] = from_acc<T>(Act::template forward<A, kFastMath<T>>(z));
          zv.v[l] = from_acc<T>(z);
          bits |= static_cast<uint32_t>(relu_passes(z)) << l;
        }
        store_pack<T, L>(y + r * n + e, yv);
        // pre may be x itself (linear's in-place z): each element is read above before this
        // thread, its only writer, stores it.
        if (pre != nullptr) store_pack<T, L>(pre + r * n + e, zv);
      }
      if constexpr (kMask) {
        constexpr int kGroup = 32 / L;  // lanes whose packs share one mask word
        // tx is a multiple of kGroup (make_tiling's min_tx), so a group never straddles two rows
        // and its first lane's pack starts a word.
        bits <<= (col % kGroup) * L;
#pragma unroll
        for (int offset = kGroup / 2; offset > 0; offset /= 2) {
          bits |= __shfl_xor_sync(0xffffffffu, bits, offset, kGroup);
        }
        if (active[u] && col % kGroup == 0) mask[r * words_per_row + col / kGroup] = bits;
      }
    }
  }
}

// kRows and kMinBlocks: the activation's register budget (chapter 4's activation_kernels.cuh);
// rows that are not whole vectors move single elements, eight rows of them in flight.
template <typename T, typename Act, bool kMask, int kRows = 1, int kMinBlocks = 2048 / kTileThreads>
cudaError_t launch_bias_act_tiles(const BiasAct<T>& p, cudaStream_t stream) {
  const bool vector = vectorizable<T>(p.n, {p.x, p.bias, p.y, p.pre});
  constexpr int kLanes = Vec16<T>::kLanes;
  Tiling t;
  if (vector) {
    COURSE_CUDA_TRY(make_tiling(p.rows, p.n / kLanes, kMask ? 32 / kLanes : 1, &t, kRows));
    bias_act_tile_kernel<T, Act, kLanes, kMask, kRows, kMinBlocks><<<t.grid, kTileThreads, 0, stream>>>(
        p.x, p.bias, p.scale, p.y, p.pre, p.mask, p.rows, p.n, t.tx);
  } else {
    constexpr int kScalarRows = 8;
    COURSE_CUDA_TRY(make_tiling(p.rows, p.n, kMask ? 32 : 1, &t, kScalarRows));
    bias_act_tile_kernel<T, Act, 1, kMask, kScalarRows, 4><<<t.grid, kTileThreads, 0, stream>>>(
        p.x, p.bias, p.scale, p.y, p.pre, p.mask, p.rows, p.n, t.tx);
  }
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------
// The flat forward: the flat [rows, n] array as 16-byte vectors, one per thread, 256 threads a
// block, one pass: chapter 1's v5 with a bias. A vector's column is its first element's index
// mod n (while the array has fewer than 2^32 elements, by n's magic number, course::FastDivmod:
// the bias's load waits for it), and its bias is one
// 16-byte load (n a whole number of vectors: a vector never crosses a row) or, where rows start
// mid-vector, two aligned 16-byte loads shifted into place (bias_window), single elements
// gathered at their columns only for the vector that wraps at the row's end (from L1: one row of
// bias serves every row of x). What the column tiles leave on the table, this keeps: every lane has a vector at
// any n (the tiles round a row up to a power of two of packs: hidden 768 in bf16 is 96 packs in
// a tile of 128, a quarter of the lanes idle), and a row that starts mid-vector (hidden 4099)
// still moves as whole aligned vectors: only the few elements before x's first 16-byte
// boundary and after its last whole vector are single ones, for the whole array, not per row.
// The mask: with n a multiple of 32 (every row a whole number of words) the mask of the array
// is the flat array of its bits, and the lanes of one word OR theirs as in the tiles.
// ---------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ int64_t column_of(int64_t i, int64_t n, const FastDivmod& n_div, bool narrow) {
  return narrow ? static_cast<int64_t>(n_div.mod(static_cast<uint32_t>(i))) : i % n;
}

// The bias of a vector whose first column c is not a multiple of L (rows that start mid-vector,
// hidden 4099), from the two aligned 16-byte vectors of the bias row that hold columns c to
// c + L - 1: two loads, then a shift of their 32 bytes by s = c % L elements, in place of L
// single loads and L column computations. The shift is by selects and funnel shifts, never by an
// index into the words: a register array indexed at run time goes to local memory. Only where
// both vectors lie inside the row (the launcher sees to the bias's alignment); the vector that
// wraps into the next row, and the last ones of a row whose second vector would pass its end,
// gather single elements.
template <typename T>
__device__ __forceinline__ Vec16<T> bias_window(const Vec16<T>& lo, const Vec16<T>& hi, int s) {
  unsigned int w[8];
  memcpy(w, &lo, 16);
  memcpy(w + 4, &hi, 16);
  const int bytes = s * static_cast<int>(sizeof(T));  // 0 to 15
  const int words = bytes / 4;                          // 0 to 3: two stages of selects
  unsigned int v[6];
#pragma unroll
  for (int i = 0; i < 6; ++i) v[i] = (words & 2) ? w[i + 2] : w[i];
  unsigned int u[5];
#pragma unroll
  for (int i = 0; i < 5; ++i) u[i] = (words & 1) ? v[i + 1] : v[i];
  unsigned int r[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) r[j] = __funnelshift_r(u[j], u[j + 1], (bytes % 4) * 8);  // 16-bit types: 0 or 16
  Vec16<T> out;
  memcpy(&out, r, 16);
  return out;
}

// The uniform form's bias (course::FlatOdd in bias_act.h says why): columns c .. c + L - 1 of
// the row, wrapping past n to columns 0 on (a vector may end in the next row), as L single loads
// that every lane makes alike (from L1: one bias row serves every row of x), issued with x's and
// used after. Not the aligned windows: their selects need the bias's data, and in 16-bit dtypes
// ptxas (nvcc 13.0, sm_90a) scheduled them right after the window loads and x's load after them,
// whether x's load came before or after in the source: two round trips, where these single
// loads all issue before the first use. Rows of at least one vector (n >= L, the launcher's
// condition): a vector then ends in its row or the next, never further, and no 64-bit remainder
// (a call in SASS) finds the column.
template <typename T>
__device__ __forceinline__ void bias_uniform(const T* __restrict__ bias, int64_t c, int64_t n,
                                             typename Acc<T>::type (&b)[Vec16<T>::kLanes]) {
  constexpr int L = Vec16<T>::kLanes;
  T single[L];
#pragma unroll
  for (int l = 0; l < L; ++l) {
    const int64_t cl = c + l;
    single[l] = bias[cl < n ? cl : cl - n];
  }
#pragma unroll
  for (int l = 0; l < L; ++l) b[l] = to_acc(single[l]);
}

// edge_first: the flat thread index that takes the first element outside whole vectors
// (course::flat_edge_first): past the last vector's warp in the uniform form, thread 0 otherwise.
// kUniform: the bias of rows that start mid-vector by bias_uniform (a bias, n >= L), rather than
// the branch between a window and a gather.
template <typename T, typename Act, bool kMask, bool kBiasVectors, bool kUniform>
__global__ void __launch_bounds__(kFlatThreads)
    bias_act_flat_kernel(const T* __restrict__ x, const T* __restrict__ bias, typename Acc<T>::type scale,
                         T* __restrict__ y, T* __restrict__ pre, uint32_t* __restrict__ mask, int64_t total,
                         int64_t n, FastDivmod n_div, int head, bool bias_windows, int64_t edge_first) {
  using A = typename Acc<T>::type;
  constexpr int L = Vec16<T>::kLanes;
  const bool narrow = total <= static_cast<int64_t>(UINT32_MAX);
  const int64_t vectors = (total - head) / L;
  const int64_t v = static_cast<int64_t>(blockIdx.x) * kFlatThreads + threadIdx.x;
  // The elements outside whole vectors (fewer than L before x's first 16-byte boundary, fewer
  // than L after its last whole vector): one thread each from edge_first on.
  {
    const int64_t tail = head + vectors * L;
    const int64_t k = v - edge_first;
    if (k >= 0 && k < head + (total - tail)) {
      const int64_t i = k < head ? k : tail + (k - head);
      const A z = fma_acc(to_acc(x[i]), scale, bias != nullptr ? to_acc(bias[column_of<T>(i, n, n_div, narrow)]) : A(0));
      y[i] = from_acc<T>(Act::template forward<A, kFastMath<T>>(z));
      if (pre != nullptr) pre[i] = from_acc<T>(z);
    }
  }
  const bool active = v < vectors;
  uint32_t bits = 0;
  if (active) {
    const int64_t first = head + v * L;
    const int64_t c = column_of<T>(first, n, n_div, narrow);
    const Vec16<T> xv = load16(reinterpret_cast<const Vec16<T>*>(x + first));
    A b[L];
    if constexpr (kBiasVectors) {
      const Vec16<T> bv = load16(reinterpret_cast<const Vec16<T>*>(bias + c));
#pragma unroll
      for (int l = 0; l < L; ++l) b[l] = to_acc(bv.v[l]);
    } else if constexpr (kUniform) {
      bias_uniform<T>(bias, c, n, b);  // the launcher takes it only with a bias and n >= L
    } else {
      const int s = static_cast<int>(c % L);
      const int64_t a = c - s;  // bias + a is 16-byte aligned (bias_windows)
      if (bias_windows && (s == 0 ? c + L <= n : a + 2 * L <= n)) {
        const Vec16<T> lo = load16(reinterpret_cast<const Vec16<T>*>(bias + a));
        const Vec16<T> hi = s == 0 ? lo : load16(reinterpret_cast<const Vec16<T>*>(bias + a + L));
        const Vec16<T> bv = bias_window(lo, hi, s);
#pragma unroll
        for (int l = 0; l < L; ++l) b[l] = to_acc(bv.v[l]);
      } else {
#pragma unroll
        for (int l = 0; l < L; ++l) {
          int64_t cl = c + l;  // past the row's end the vector continues in the next row
          cl = cl < n ? cl : (cl - n < n ? cl - n : cl % n);
          b[l] = bias != nullptr ? to_acc(bias[cl]) : A(0);
        }
      }
    }
    Vec16<T> yv;
    Vec16<T> zv;
#pragma unroll
    for (int l = 0; l < L; ++l) {
      const A z = fma_acc(to_acc(xv.v[l]), scale, b[l]);
      yv.v[l] = from_acc<T>(Act::template forward<A, kFastMath<T>>(z));
      zv.v[l] = from_acc<T>(z);
      bits |= static_cast<uint32_t>(relu_passes(z)) << l;
    }
    store16_words<T, L>(y + first, yv.v);
    if (pre != nullptr) store16_words<T, L>(pre + first, zv.v);
  }
  if constexpr (kMask) {
    // head == 0 and n % 32 == 0 here (flat_applies): vector v's bits are bits v * L % 32 on of
    // word v * L / 32, and the number of vectors is a whole number of words, so a group of lanes
    // is wholly active or wholly past the end.
    constexpr int kGroup = 32 / L;
    bits <<= (v % kGroup) * L;
#pragma unroll
    for (int offset = kGroup / 2; offset > 0; offset /= 2) bits |= __shfl_xor_sync(0xffffffffu, bits, offset, kGroup);
    if (active && v % kGroup == 0) mask[v * L / 32] = bits;
  }
}

// Elements before x's first 16-byte boundary; -1 when y or pre start at another distance from one
// (the flat kernel then cannot pair x's vectors with theirs).
template <typename T>
inline int flat_head(const BiasAct<T>& p) {
  const uintptr_t misaligned = reinterpret_cast<uintptr_t>(p.x) % 16;
  if (reinterpret_cast<uintptr_t>(p.y) % 16 != misaligned) return -1;
  if (p.pre != nullptr && reinterpret_cast<uintptr_t>(p.pre) % 16 != misaligned) return -1;
  const int64_t head = misaligned ? (16 - static_cast<int64_t>(misaligned)) / static_cast<int64_t>(sizeof(T)) : 0;
  return static_cast<int>(std::min(head, p.rows * p.n));
}

// Whether the flat kernel takes these operands: x, y and pre equally far from a 16-byte
// boundary, and for a mask, every row a whole number of words from an aligned start.
template <typename T>
inline bool flat_applies(const BiasAct<T>& p) {
  const int head = flat_head(p);
  return head >= 0 && (p.mask == nullptr || (head == 0 && p.n % 32 == 0));
}

// The flat kernel's form (course::flat_uniform, bias_act.h) for these operands on this GPU: the
// uniform one where the grid is one wave or less, or as COURSE_FORWARD_ODD forces. Whole vectors
// from aligned pointers have nothing it changes (no edges, one aligned bias load): they say false.
template <typename T>
inline cudaError_t flat_form(const BiasAct<T>& p, int head, bool* uniform) {
  constexpr int L = Vec16<T>::kLanes;
  const int64_t total = p.rows * p.n;
  const int64_t vectors = (total - head) / L;
  const bool odd = head != 0 || p.n % L != 0 || (p.bias != nullptr && !is_aligned(p.bias, 16));
  *uniform = false;
  if (!odd) return cudaSuccess;
  int sms = 1;
  COURSE_CUDA_TRY(sm_count(&sms));
  *uniform = flat_uniform(flat_edge_blocks(vectors, 0, 0, kFlatThreads), sms, flat_odd_variant());
  return cudaSuccess;
}

template <typename T, typename Act, bool kMask>
cudaError_t launch_bias_act_flat(const BiasAct<T>& p, cudaStream_t stream) {
  constexpr int L = Vec16<T>::kLanes;
  const int head = flat_head(p);
  if (head < 0 || (kMask && (head != 0 || p.n % 32 != 0))) return cudaErrorInvalidValue;  // flat_applies
  const int64_t total = p.rows * p.n;
  const int64_t vectors = (total - head) / L;
  bool uniform = false;
  COURSE_CUDA_TRY(flat_form(p, head, &uniform));
  const int64_t edges = total - vectors * L;  // head plus the tail after the last whole vector
  const int64_t edge_first = flat_edge_first(vectors, uniform);
  const unsigned blocks = static_cast<unsigned>(flat_edge_blocks(vectors, edges, edge_first, kFlatThreads));
  const bool bias_vectors = head == 0 && p.n % L == 0 && (p.bias == nullptr || is_aligned(p.bias, 16));
  // Other rows: the bias in aligned windows (bias_window) where the bias row starts on a 16-byte
  // boundary, as a fresh tensor does; else element by element (every lane the same path).
  const bool bias_windows = p.bias != nullptr && is_aligned(p.bias, 16);
  // n's magic number where the kernel's columns take 32-bit arithmetic (total < 2^32, so n is too).
  const FastDivmod n_div(total <= static_cast<int64_t>(UINT32_MAX) ? static_cast<uint32_t>(p.n) : 1u);
  if (bias_vectors && p.bias != nullptr) {
    bias_act_flat_kernel<T, Act, kMask, true, false><<<blocks, kFlatThreads, 0, stream>>>(
        p.x, p.bias, p.scale, p.y, p.pre, p.mask, total, p.n, n_div, head, bias_windows, edge_first);
  } else if (uniform && p.bias != nullptr && p.n >= L) {
    bias_act_flat_kernel<T, Act, kMask, false, true><<<blocks, kFlatThreads, 0, stream>>>(
        p.x, p.bias, p.scale, p.y, p.pre, p.mask, total, p.n, n_div, head, bias_windows, edge_first);
  } else {
    bias_act_flat_kernel<T, Act, kMask, false, false><<<blocks, kFlatThreads, 0, stream>>>(
        p.x, p.bias, p.scale, p.y, p.pre, p.mask, total, p.n, n_div, head, bias_windows, edge_first);
  }
  return cudaGetLastError();
}

// The forward a call takes (course::forward_kernel, the rule the glue asks too): the flat kernel
// wherever it can pair the operands' vectors, unless the activation keeps several rows in flight
// (kRows > 1, GELU-erf), the rows are whole aligned vectors that fill every tile, and the tiles'
// grid fills a wave of the GPU (at 64 tokens four rows a thread left 32 blocks for 132 SMs). A
// tile of one row per thread is the flat kernel's work with a two-dimensional index, the bias
// reloaded per thread in both, and on the H200 the flat kernel ran the sweep's bfloat16 rows at
// 3.7-3.8 TB/s where the tiles ran 3.1-3.2 (fused_op forward at 8192 tokens: hidden 5120 and 7168
// flat, 0.97x torch.compile; 4096, 6144, 8192, 12288 and 16384 in tiles, 0.81-0.83x). It also
// keeps every lane busy and moves whole vectors at any row length (hidden 768 in bf16 is 96 packs,
// a tile of 128 with a quarter of its lanes idle; hidden 4099 is no whole number of vectors). The
// tiles' single elements only where the flat kernel cannot pair the operands' vectors, or a mask's
// rows are not whole 32-bit words.
template <typename T, typename Act, bool kMask, int kRows = 1, int kMinBlocks = 2048 / kTileThreads>
cudaError_t launch_bias_act(const BiasAct<T>& p, cudaStream_t stream) {
  int sms = 1;
  if constexpr (kRows > 1) COURSE_CUDA_TRY(sm_count(&sms));  // only a rule with tiles asks the GPU
  const ForwardKernel kernel =
      forward_kernel(p.rows, p.n, static_cast<int>(sizeof(T)), vectorizable<T>(p.n, {p.x, p.bias, p.y, p.pre}),
                     flat_applies(p), kMask ? 32 / Vec16<T>::kLanes : 1, kRows, sms, kMinBlocks);
  if (kernel == ForwardKernel::kTiles) return launch_bias_act_tiles<T, Act, kMask, kRows, kMinBlocks>(p, stream);
  return launch_bias_act_flat<T, Act, kMask>(p, stream);
}

// ---------------------------------------------------------------------------------------
// The backward on the column tiles (grad_tiling, course/bias_act.h). Each thread keeps its
// columns for life: it reads dy and what the forward saved, writes dx, and adds g into
// per-column float accumulators in registers over every row it visits. The block then adds its
// ty rows of accumulators in shared memory, in a fixed order, and writes one row: dbias itself
// when the grid has one row tile, else its row of a [row tiles, n] array of partial sums (every
// row written once: no zero fill), which the last block of each column tile adds in the same
// launch (finish_tile_column: an atomic counts the blocks, never adds a value) or, where they are
// many, course::column_sum in a second. Both add in a fixed order: deterministic, and g never
// goes to memory. Two kernels share this: act_backward_tile_kernel
// for rows of whole vectors (or single elements), act_backward_span_kernel for rows that start
// mid-vector (below).
// ---------------------------------------------------------------------------------------
// One pack's gradient: g = dy * act'(z) for its L elements, dx = g * scale, and g added to the
// thread's per-column sums. act'(z) comes from x (kInput, with the thread's bias b), from y's sign
// (kOutput) or from the pack's L mask bits (kMask, bit l for element l).
template <typename T, typename Act, SaveKind kSource, int L>
__device__ __forceinline__ Pack<T, L> grad_pack(const Pack<T, L>& dyv, const Pack<T, L>& sv, uint32_t bits,
                                                const typename Acc<T>::type (&b)[L], typename Acc<T>::type scale,
                                                typename Acc<T>::type (&sum)[L]) {
  using A = typename Acc<T>::type;
  Pack<T, L> dxv;
#pragma unroll
  for (int l = 0; l < L; ++l) {
    A d;
    if constexpr (kSource == SaveKind::kInput) {
      d = Act::template derivative<A, kFastMath<T>>(fma_acc(to_acc(sv.v[l]), scale, b[l]));
    } else if constexpr (kSource == SaveKind::kOutput) {
      d = relu_passes(to_acc(sv.v[l])) ? A(1) : A(0);
    } else {
      d = ((bits >> l) & 1u) ? A(1) : A(0);
    }
    // A 0-or-1 derivative (relu's: Act::kGates, or a sign from y or the mask) selects dy or 0,
    // not dy * 0: an infinite dy where relu is flat gives 0, as threshold_backward does, not
    // NaN. A smooth activation's derivative multiplies.
    constexpr bool kGate = kSource != SaveKind::kInput || Act::kGates;
    const A g = kGate ? (d != A(0) ? to_acc(dyv.v[l]) : A(0)) : to_acc(dyv.v[l]) * d;
    dxv.v[l] = from_acc<T>(g * scale);
    sum[l] += g;
  }
  return dxv;
}

// Adds each of W columns down `count` rows of values (value(r, k): row r, column k) in a fixed
// order, with every thread of the block, and passes column k's total to emit(k, total). Column
// k's rows: G = kGradThreads / W adjacent lanes share them (each adds rows part, part + G, ...)
// and a shuffle tree adds the lanes' totals; at least 256 columns (G = 1) give each thread whole
// columns. Below 8 columns G would pass a warp: one thread adds each column's rows alone. The
// order depends on W and count only, never on which block or thread runs first: the same bits
// every run.
//
// A thread's rows are read kBatch at a time, every value of a batch before the first add, and
// added in row order: the same sums as one row at a time, with kBatch reads in flight. One at a
// time, as the loop was first written, nvcc 13.0 unrolled the G = 1 and lone-thread loops but not
// the G-lane one (SASS, sm_90a, the span kernel): there, each row was one load and an add that
// waited for it, and in the in-kernel finish (finish_tile_column) a load is an L2 round trip, so
// a lane of 4 (W = 64, 13 column tiles at hidden 777) adding 22-32 partial rows waited 6-8 of
// them in a row, in the last block of each column tile, after every other block had finished.
// kBatch = 1 is that loop: the finish's serial form (course::grad_variant, kept for a side-by-side
// timing), and the block's own sums in shared memory (write_tile_sums), a few dozen cycles a read,
// where batches only added registers (ptxas -v, sm_90a: the 16-bit single-element tile kernel
// with saved x took 64 with batches there as well, 54 with them in the finish alone, 48 before).
template <typename A, int kBatch = 8, typename Value, typename Emit>
__device__ __forceinline__ void add_down_columns(int W, int count, Value value, Emit emit) {
  // Rows first, first + step, ... of column k, added in that order onto total.
  const auto add_rows = [&](A total, int first, int step, int k) {
    for (int r = first; r < count; r += kBatch * step) {
      A v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (r + u * step < count) v[u] = value(r + u * step, k);  // the batch's rows past the last: none
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (r + u * step < count) total += v[u];  // the same guard: a row past the last adds nothing
      }
    }
    return total;
  };
  if (W >= kGradThreads) {
    for (int k = threadIdx.x; k < W; k += kGradThreads) emit(k, add_rows(A(0), 0, 1, k));
  } else if (W >= 8) {
    const int G = kGradThreads >> pow2(W).shift;  // 2 to 32, a power of two: its lanes lie in one warp
    const Pow2 g_split = pow2(G);
    const int k = threadIdx.x >> g_split.shift;
    const int part = threadIdx.x & g_split.mask;
    A total = add_rows(A(0), part, G, k);
    for (int offset = G / 2; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset, G);
    if (part == 0) emit(k, total);
  } else if (static_cast<int>(threadIdx.x) < W) {
    emit(threadIdx.x, add_rows(A(0), 0, 1, threadIdx.x));
  }
}

// The block's sums in shared memory: tile_sums[row of the tile][column of the tile], rows
// tile_sums_stride(W) apart rather than W. Packed W apart, both sides of the barrier met bank
// conflicts, and at a few dozen rows (one row a thread, then this epilogue) they are most of the
// block's time after its loads: a 64-byte-wide tile of bfloat16 (W = 32, L = 8) stored each
// thread's 8 sums at threadIdx.x * 8 + l, 8 lanes to a bank, 8 times a store instruction, and
// add_down_columns' G = 8 lanes of a column read rows W apart, one bank for all of them, 8 ways
// again. With W / 8 more words a row (W from 8 to 128 columns, G = 256 / W lanes a column and
// W / 8 columns a warp), lane (part, k) reads bank part * W / 8 + k: every bank once. The stores
// go 16 bytes at a time (store_sums: the stride keeps every thread's sums 16-byte aligned), a
// quarter-warp's 16-byte stores on distinct banks. Narrower rows (W 16, fp32's 64-byte tile) pad 4
// words, two ways at most; from 256 columns (G = 1) consecutive lanes read consecutive words.
COURSE_HOST_DEVICE constexpr int tile_sums_stride(int W) {
  return W >= kGradThreads ? W : W + (W / 8 > 4 ? W / 8 : 4);
}

// Accumulators of tile_sums: kGradThreads * L sums, and the padding of ty rows, at most
// max(W / 8, 4) words each: 32 * L for the first (ty * W = kGradThreads * L), 4 * kGradThreads for
// the second.
template <int L>
constexpr int kTileSumsSize = kGradThreads * L + (32 * L > 4 * kGradThreads ? 32 * L : 4 * kGradThreads);

// A thread's L sums at dst, 16 bytes a store where they fill whole 16-byte units (dst then is
// 16-byte aligned: tile_sums_stride keeps every row a multiple of 4 words, and the thread's
// first column is a multiple of L); element by element otherwise.
template <typename A, int L>
__device__ __forceinline__ void store_sums(A* dst, const A (&sum)[L]) {
  if constexpr (sizeof(A) == 4 && L % 4 == 0) {
#pragma unroll
    for (int i = 0; i < L / 4; ++i) {
      reinterpret_cast<float4*>(dst)[i] = make_float4(sum[4 * i], sum[4 * i + 1], sum[4 * i + 2], sum[4 * i + 3]);
    }
  } else if constexpr (sizeof(A) == 8 && L % 2 == 0) {
#pragma unroll
    for (int i = 0; i < L / 2; ++i) reinterpret_cast<double2*>(dst)[i] = make_double2(sum[2 * i], sum[2 * i + 1]);
  } else {
#pragma unroll
    for (int l = 0; l < L; ++l) dst[l] = sum[l];
  }
}

// The block's sums (W columns from column `first`, ty rows, tile_sums_stride(W) apart), added down
// each column (add_down_columns) and written as one row: dbias when the grid has one row tile, else
// the block's row of partials. Called by every thread of the block, after the barrier that follows
// the sums' stores.
template <typename T>
__device__ __forceinline__ void write_tile_sums(const typename Acc<T>::type* tile_sums, int W, int ty, int64_t first,
                                                int64_t n, T* dbias, typename Acc<T>::type* partials) {
  using A = typename Acc<T>::type;
  const int stride = tile_sums_stride(W);
  add_down_columns<A, 1>(W, ty, [&](int r, int k) { return tile_sums[r * stride + k]; }, [&](int k, A total) {
    if (first + k < n) {  // the last tile's columns past the row's end
      if (gridDim.y == 1) {
        dbias[first + k] = from_acc<T>(total);
      } else {
        partials[static_cast<int64_t>(blockIdx.y) * n + first + k] = total;
      }
    }
  });
}

// The last-block-done finish of dbias (course::grad_finishes_in_kernel says when the launcher
// asks for it): after the block has written its partial row, the last of the gridDim.y blocks of
// its column tile to arrive adds the tile's gridDim.y partial rows for its W columns, in row
// order, and writes dbias, where otherwise course::column_sum would be a second launch. Which
// block is last changes from run to run; the order of the sum does not (add_down_columns).
//
// counters: one per column tile, this launch's own (the call's workspace, zeroed on the call's
// stream just before the kernel: finish_counters), never a __device__ array shared by every
// launch. A shared array, reset by each tile's last block, would be right only while launches
// never overlap: two backward calls running at once on two streams would count each other's
// blocks, and a launch that stopped part-way would leave every later call's count off.
//
// The fences: the block's partial rows must reach the L2 before its count does, and the last
// block must read them after its own count. Every thread fenced its stores first, as this was
// written: a fence.sc.gpu in each of the block's warps (MEMBAR.SC.GPU and an L1 invalidate in
// the SASS), each waiting for its warp's stores to be acknowledged, dx's last row among them.
// batched (the default) fences in thread 0 only, after the barrier that follows every thread's
// stores, and again after the count, as cooperative groups' grid barrier does: the barrier
// orders the other threads' stores before thread 0's fence at the block's scope, and the fence is
// cumulative, so its release covers them; the second fence and the barrier after it order the
// last block's reads after the count. And it adds the partial rows in batches of loads
// (add_down_columns). !batched is the form before, kept for a side-by-side timing
// (COURSE_BIAS_GRAD_FINISH=serial, course::grad_variant).
template <typename T>
__device__ __forceinline__ void finish_tile_column(const typename Acc<T>::type* partials, unsigned int* counters,
                                                   int W, int64_t first, int64_t n, T* dbias, bool batched) {
  using A = typename Acc<T>::type;
  __shared__ bool last;
  // Each thread's partial stores reach the device (L2) before the block counts itself done, so
  // that the last block, on another SM, reads every one of them.
  if (!batched) __threadfence();
  __syncthreads();  // every thread's partials stored (and, !batched, fenced) before thread 0 counts the block
  if (threadIdx.x == 0) {
    if (batched) __threadfence();  // cumulative: the stores the barrier ordered before it
    const unsigned arrived = atomicAdd(counters + blockIdx.x, 1u) + 1u;
    last = arrived == gridDim.y;
    if (batched && last) __threadfence();  // the count before the reads the barrier below orders after it
  }
  __syncthreads();  // `last` is written before any thread reads it
  if (!last) return;  // the same value in every thread of the block: no barrier follows
  if (!batched) __threadfence();  // the other blocks' partials, fenced before their count, are read after ours
  // __ldcg: from L2, never from this SM's L1, which other SMs' stores do not update.
  const auto partial = [&](int r, int k) {
    return first + k < n ? __ldcg(partials + static_cast<int64_t>(r) * n + first + k) : A(0);
  };
  const auto emit = [&](int k, A total) {
    if (first + k < n) dbias[first + k] = from_acc<T>(total);  // columns past the row's end
  };
  if (batched) {
    add_down_columns<A>(W, static_cast<int>(gridDim.y), partial, emit);
  } else {
    add_down_columns<A, 1>(W, static_cast<int>(gridDim.y), partial, emit);
  }
}

// Rows whose every pack is whole: 16-byte vectors where every row starts on a 16-byte boundary,
// single elements (L = 1) otherwise. The last parameter, unused (every row is phase 0 here), gives
// it the span kernel's signature, so that the launcher holds either kernel in one pointer and
// asks its occupancy before sizing the grid.
//
// __launch_bounds__: where the saved tensor gives the derivative's sign (kOutput, kMask), the
// kGradBlocksPerSm blocks an SM that the grid counts on (64 registers a thread): with the last
// block's finish (finish_tile_column), nvcc 13.0 otherwise took 76 for fused_op's backward in
// bfloat16, three blocks an SM. Where z is recomputed from x (kInput), and in float64, no
// minimum at all (0: the ptx has no .minnctapersm), ptxas's own choice: a minimum of 1 is not
// the same thing, it frees ptxas to take up to 255 registers, and bias_gelu's backward in
// bfloat16 went from 80 (3 blocks an SM) to 116 (2). At 64 x 12288 its grid is 384 column tiles
// of one row tile, one wave at 3 an SM on 132 SMs and two at 2: the H100 measured 5.7 us before
// and 7.3 us with the minimum of 1. Without one, 80 again (64 in float16 and float32; 48-80 in
// float64, at most 8 bytes spilled, where a cap of 64 spilled 56).
template <typename T, typename Act, int L, SaveKind kSource>
__global__ void __launch_bounds__(kGradThreads,
                                  kSource == SaveKind::kInput || sizeof(T) == 8 ? 0 : kGradBlocksPerSm)
    act_backward_tile_kernel(const T* dy, const T* saved, const uint32_t* mask, const T* bias,
                             typename Acc<T>::type scale, T* dx, typename Acc<T>::type* partials, T* dbias,
                             int64_t rows, int64_t n, int tx, int /*phases*/, unsigned int* counters,
                             bool batched_finish) {
  using A = typename Acc<T>::type;
  constexpr int kRows = kRowsInFlight<L>;
  // Every thread's L sums, [row of the tile][column of the tile] (tile_sums_stride apart).
  __shared__ __align__(16) A tile_sums[kTileSumsSize<L>];
  const Pow2 x_split = pow2(tx);
  const int ty = kGradThreads >> x_split.shift;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * tx + (threadIdx.x & x_split.mask);
  const int64_t e = col * L;
  // The last column tile may hang over the row's end: its extra threads sum nothing but still
  // reach the block's barrier below.
  const bool col_ok = e < n;
  // The bias (kInput: z is recomputed from x) is one row, read once a thread, in the first step
  // after that step's loads of dy and x (bias_due): read before the loop, as it was, the loop's
  // loads waited behind its conversion, two round trips in a row where a thread's one row is the
  // whole kernel (up to 64 tokens).
  A b[L];
#pragma unroll
  for (int l = 0; l < L; ++l) b[l] = A(0);
  bool bias_due = kSource == SaveKind::kInput && bias != nullptr;
  A sum[L];
#pragma unroll
  for (int l = 0; l < L; ++l) sum[l] = A(0);
  const int row_in_tile = threadIdx.x >> x_split.shift;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * ty;
  const int64_t words_per_row = mask_words_per_row(n);
  // rows, clamped at 0: a bound the compiler knows is not negative (with rows itself, the loop
  // took 8 to 17 registers more, in nvcc 13.0: 97 rather than 80 for bias_gelu in bfloat16, a block
  // fewer per SM).
  const int64_t row_end = rows > 0 ? rows : 0;
  for (int64_t base = blockIdx.y * int64_t{ty} + row_in_tile; col_ok && base < row_end; base += kRows * row_step) {
    Pack<T, L> dyv[kRows];
    Pack<T, L> sv[kRows];
    uint32_t bits[kRows];
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int64_t r = base + u * row_step;
      if (r < row_end) {  // the step's later rows may lie past the last
        dyv[u] = load_pack<T, L>(dy + r * n + e);
        if constexpr (kSource == SaveKind::kMask) {
          // L divides 32 and e is a multiple of L, so the pack's L bits sit in one word.
          bits[u] = mask[r * words_per_row + e / 32] >> (e % 32);
        } else {
          sv[u] = load_pack<T, L>(saved + r * n + e);
        }
      }
    }
    if (bias_due) {  // the first step only
      bias_due = false;
      const Pack<T, L> bv = load_pack<T, L>(bias + e);
#pragma unroll
      for (int l = 0; l < L; ++l) b[l] = to_acc(bv.v[l]);
    }
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int64_t r = base + u * row_step;
      if (r < row_end) store_pack<T, L>(dx + r * n + e, grad_pack<T, Act, kSource, L>(dyv[u], sv[u], bits[u], b, scale, sum));
    }
  }
  const int W = tx * L;
  store_sums<A, L>(tile_sums + row_in_tile * tile_sums_stride(W) + (threadIdx.x & x_split.mask) * L, sum);
  __syncthreads();  // every row's sums are in shared memory before any column's are added
  write_tile_sums<T>(tile_sums, W, ty, static_cast<int64_t>(blockIdx.x) * W, n, dbias, partials);
  if (counters != nullptr && gridDim.y > 1) {
    finish_tile_column<T>(partials, counters, W, static_cast<int64_t>(blockIdx.x) * W, n, dbias, batched_finish);
  }
}

// ---------------------------------------------------------------------------------------
// act_backward_span_kernel: rows that are not a whole number of 16-byte vectors (hidden 4099)
// still move whole aligned vectors. Row r's first 16-byte boundary lies `head` elements in, and
// head repeats every `phases` rows (course::row_phases). A block owns the W = tx * L columns
// S .. S + W - 1 of every row it visits, all phases alike, so that one block sums each column
// (one row tile: dbias in one launch). Its tile's ty rows are a multiple of the phases
// (grad_tiling caps tx), and the grid steps down the rows by a multiple of ty: each thread meets
// the rows of one phase only, in which its columns sit at fixed places in the aligned vectors.
// Thread c > 0 takes the aligned pack that starts at S + head + (c - 1) * L, one 16-byte access
// (the row's last pack, cut by the row's end, element by element); thread 0 takes the two ends
// of the span that those packs leave, columns S .. S + head - 1 and S + W - L + head ..
// S + W - 1, element by element (with head 0, the aligned pack at S + W - L). The tile's sums then
// meet by column in shared memory, as in the tile kernel.
//
// Before this, a block took the rows of one phase (8 row tiles at least, so partial rows and a
// second launch at every shape): at 64 x 4099 in bfloat16, 1032 blocks of which each found 8
// rows for its 64 tile rows, and fused_bias_scale_relu's backward took 13.2 us on the H200
// against torch.compile's 2.9. Before that, such rows moved single elements only: 64 bytes a
// warp load, and the same backward at 2048 x 4099 ran at 0.45x torch.compile.
//
// One row in flight a thread (kSpanRowsInFlight), not the tile kernel's two: the element-wise
// ends double the registers a pack takes, and two rows of them left the kernel at 96 registers
// (two blocks an SM) where the grid counts on kGradBlocksPerSm; 16 bytes of dy and 16 of what
// the forward saved in flight a thread, as many as the single elements' eight rows.
// ---------------------------------------------------------------------------------------
// The pack of L elements that a thread owns, at q = its row + e: lane l is q[l] where bit l of
// `high` is set, else q[l - back] (thread 0's wrapped lanes: the span's first columns) where bit
// l of `low` is set; lanes in neither lie past the row's end. One aligned 16-byte access when the
// pack is one vector inside the row (`whole`), else the elements one at a time, those past the
// row's end read as zero: their dy of zero adds nothing to any sum, and they are never stored.
// Each lane's address is one of two bases plus a constant, chosen by bits set once a thread: a
// 64-bit address a lane, kept across the rows, cost the kernel some 30 registers.
template <typename T, int L>
__device__ __forceinline__ Pack<T, L> load_owned(const T* q, bool whole, uint32_t high, uint32_t low, int back) {
  if (whole) return load_pack<T, L>(q);
  const T* q_low = q - back;
  Pack<T, L> out;
#pragma unroll
  for (int l = 0; l < L; ++l) {
    out.v[l] = (high >> l) & 1u ? q[l] : (low >> l) & 1u ? q_low[l] : from_acc<T>(typename Acc<T>::type(0));
  }
  return out;
}

template <typename T, int L>
__device__ __forceinline__ void store_owned(T* q, bool whole, uint32_t high, uint32_t low, int back,
                                            const Pack<T, L>& in) {
  if (whole) {
    store_pack<T, L>(q, in);
    return;
  }
  T* q_low = q - back;
#pragma unroll
  for (int l = 0; l < L; ++l) {
    if ((high >> l) & 1u) q[l] = in.v[l];  // only the lanes inside the row
    if ((low >> l) & 1u) q_low[l] = in.v[l];
  }
}

// Bits e .. e + 31 of a row's mask words (bit l of the result is column e + l; 0 <= e < n), for a
// pack that may straddle two words.
__device__ __forceinline__ uint32_t mask_bits_at(const uint32_t* row_words, int64_t e, int64_t words) {
  const int64_t w = e / 32;
  const uint64_t lo = row_words[w];
  const uint64_t hi = w + 1 < words ? row_words[w + 1] : 0u;  // the row's last word has no next
  return static_cast<uint32_t>(((hi << 32) | lo) >> (e % 32));
}

// Elements before the first 16-byte boundary of a row that starts at p.
template <typename T>
__device__ __forceinline__ int head_elements(const T* p) {
  const int misaligned = static_cast<int>(reinterpret_cast<uintptr_t>(p) % 16);
  return misaligned ? (16 - misaligned) / static_cast<int>(sizeof(T)) : 0;
}

constexpr int kSpanRowsInFlight = grad_rows_in_flight(Vec16<float>::kLanes, /*phased=*/true);

// __launch_bounds__: the kGradBlocksPerSm blocks an SM that the grid counts on (64 registers a
// thread), where nvcc 13.0 otherwise took 71 for chapter 5's fused_op in bfloat16; one block fewer
// where z is recomputed from x (kInput), whose activation's derivative spilled at 64.
template <typename T, typename Act, SaveKind kSource>
__global__ void __launch_bounds__(kGradThreads, kSource == SaveKind::kInput ? kGradBlocksPerSm - 1 : kGradBlocksPerSm)
    act_backward_span_kernel(const T* dy, const T* saved, const uint32_t* mask, const T* bias,
                             typename Acc<T>::type scale, T* dx, typename Acc<T>::type* partials, T* dbias,
                             int64_t rows, int64_t n, int tx, int phases, unsigned int* counters,
                             bool batched_finish) {
  using A = typename Acc<T>::type;
  constexpr int L = Vec16<T>::kLanes;
  __shared__ __align__(16) A tile_sums[kTileSumsSize<L>];
  const Pow2 x_split = pow2(tx);
  const int ty = kGradThreads >> x_split.shift;
  const int W = tx * L;
  const int row_in_tile = threadIdx.x >> x_split.shift;
  const int c = threadIdx.x & x_split.mask;
  const int64_t S = static_cast<int64_t>(blockIdx.x) * W;  // the span's first column
  const int64_t first_row = static_cast<int64_t>(blockIdx.y) * ty + row_in_tile;
  // Where this thread's rows start their vectors: every row it visits is first_row plus a
  // multiple of ty, itself a multiple of the phases (dy, dx and saved sit equally far from a
  // 16-byte boundary: fused_backward_tiling checked). Only the address is formed, nothing read.
  const int head = head_elements(dy + (first_row & (phases - 1)) * n);  // phases: a power of two
  // Thread 0's pack wraps (its lanes below head are the span's first columns) where head > 0.
  const int wrapped = c == 0 ? head : 0;
  const int back = W - L;
  const int64_t e = c == 0 ? S + back : S + head + int64_t{c - 1} * L;
  // The last span may hang over the row's end: its extra threads sum nothing but still reach
  // the block's barrier below. (A wrapped pack always has its first column: S < n.)
  const bool col_ok = wrapped > 0 || e < n;
  // Every pack whole but the wrapped one and the row's last.
  const bool whole = wrapped == 0 && e + L <= n;
  // Its lanes inside the row: at column e + l (high), or e + l - back below wrapped (low).
  uint32_t high = 0;
  uint32_t low = 0;
#pragma unroll
  for (int l = 0; l < L; ++l) {
    if (l < wrapped) {
      low |= (e + l - back < n ? 1u : 0u) << l;
    } else {
      high |= (e + l < n ? 1u : 0u) << l;
    }
  }
  // The bias (kInput) is one row, read once a thread in the first step after that step's loads,
  // as in the tile kernel: element by element where the pack is not whole or the bias does not
  // sit at dy's offset from a 16-byte boundary.
  A b[L];
#pragma unroll
  for (int l = 0; l < L; ++l) b[l] = A(0);
  bool bias_due = kSource == SaveKind::kInput && bias != nullptr;
  A sum[L];
#pragma unroll
  for (int l = 0; l < L; ++l) sum[l] = A(0);
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * ty;
  const int64_t words_per_row = mask_words_per_row(n);
  const int64_t row_end = rows > 0 ? rows : 0;  // as in the tile kernel: a bound not negative
  for (int64_t r = first_row; col_ok && r < row_end; r += row_step) {
    static_assert(kSpanRowsInFlight == 1, "the loop below takes one row a step");
    const Pack<T, L> dyv = load_owned<T, L>(dy + r * n + e, whole, high, low, back);
    Pack<T, L> sv;
    uint32_t bits = 0;
    if constexpr (kSource == SaveKind::kMask) {
      const uint32_t* words = mask + r * words_per_row;
      bits = high != 0 ? mask_bits_at(words, e, words_per_row) : 0u;
      // The wrapped lanes' bits are those of the span's first columns.
      const uint32_t below = (1u << wrapped) - 1u;
      if (wrapped > 0) bits = (mask_bits_at(words, S, words_per_row) & below) | (bits & ~below);
    } else {
      sv = load_owned<T, L>(saved + r * n + e, whole, high, low, back);
    }
    if (bias_due) {  // the first step only
      bias_due = false;
      const bool bias_whole = whole && reinterpret_cast<uintptr_t>(bias + e) % 16 == 0;
      const Pack<T, L> bv = load_owned<T, L>(bias + e, bias_whole, high, low, back);
#pragma unroll
      for (int l = 0; l < L; ++l) b[l] = to_acc(bv.v[l]);
    }
    store_owned<T, L>(dx + r * n + e, whole, high, low, back, grad_pack<T, Act, kSource, L>(dyv, sv, bits, b, scale, sum));
  }
  // The tile's rows meet in shared memory by column: lane l of this thread is column e + l
  // (e + l - back below `wrapped`), its place in the span plus l.
  const int place = static_cast<int>(e - S);
#pragma unroll
  for (int l = 0; l < L; ++l) tile_sums[row_in_tile * tile_sums_stride(W) + place + l - (l < wrapped ? back : 0)] = sum[l];
  __syncthreads();  // every row's sums are in shared memory before any column's are added
  write_tile_sums<T>(tile_sums, W, ty, S, n, dbias, partials);
  if (counters != nullptr && gridDim.y > 1) finish_tile_column<T>(partials, counters, W, S, n, dbias, batched_finish);
}

// How the backward moves a row: whole 16-byte packs (every row starts on a 16-byte boundary),
// phased packs (rows start mid-vector, but dy, dx and saved all sit equally far from a boundary,
// as freshly allocated tensors do: course::row_phases of them), or single elements (anything
// else: views at other offsets).
enum class GradPacks { kVectors, kPhased, kSingle };

// Where the rows start mid-vector and both kernels can take them (phased packs possible),
// single (course::odd_rows_take_single's choice, bias_act.h) sends them to single elements.
template <typename T>
inline GradPacks grad_packs(const BiasActGrad<T>& p, bool single) {
  if (vectorizable<T>(p.n, {p.dy, p.saved, p.bias, p.dx})) return GradPacks::kVectors;
  if (single) return GradPacks::kSingle;
  const uintptr_t offset = reinterpret_cast<uintptr_t>(p.dy) % 16;
  const bool same = reinterpret_cast<uintptr_t>(p.dx) % 16 == offset &&
                    (p.saved == nullptr || reinterpret_cast<uintptr_t>(p.saved) % 16 == offset);
  // A row of fewer than two vectors has no whole vector between its head and its tail.
  return same && p.n >= 2 * Vec16<T>::kLanes ? GradPacks::kPhased : GradPacks::kSingle;
}

// The backward's tiling (grad_tiling on this GPU's SM count, at blocks_per_sm blocks an SM) and
// scratch: the partial rows in the accumulation type, none when one row tile writes dbias. Phased
// packs: the same tiles over the row's columns, one row in flight a thread, and tiles no wider
// than keeps their rows a multiple of the phases. few: the few-rows rule (course::few_rows_width),
// COURSE_BIAS_GRAD_FEW's at launch.
template <typename T>
cudaError_t fused_backward_tiling(const BiasActGrad<T>& p, bool single, int blocks_per_sm, Tiling* t,
                                  GradPacks* packs, int* phases, FewRows few = FewRows::kFill) {
  *packs = grad_packs(p, single);
  const bool phased = *packs == GradPacks::kPhased;
  const int lanes = *packs == GradPacks::kSingle ? 1 : Vec16<T>::kLanes;
  *phases = phased ? row_phases(p.n, static_cast<int>(sizeof(T))) : 1;
  int sms = 0;
  COURSE_CUDA_TRY(sm_count(&sms));
  const GradTiling g = grad_tiling(p.rows, ceil_div<int64_t>(p.n, lanes), lanes * static_cast<int>(sizeof(T)),
                                   grad_rows_in_flight(lanes, phased), sms, *phases, blocks_per_sm, few);
  t->tx = g.tx;
  t->grid = dim3(static_cast<unsigned>(std::min<int64_t>(g.column_tiles, INT_MAX)), static_cast<unsigned>(g.row_tiles));
  t->slots = g.row_tiles > 1 ? g.row_tiles : 0;
  return cudaSuccess;
}

// The scratch's first part: slots partial rows of n accumulators, rounded up to 16 bytes so that
// the finish's counters after it start aligned.
template <typename T>
constexpr int64_t partial_rows_bytes(int64_t slots, int64_t n) {
  return (slots * n * static_cast<int64_t>(sizeof(typename Acc<T>::type)) + 15) / 16 * 16;
}

// The scratch is asked before the kernel (and so its occupancy) is known, by callers that name
// only the dtype: the most partial rows that either kernel of rows that start mid-vector
// (course::odd_rows_take_single picks at launch) could ask for at any occupancy. grad_tiling
// counts an occupancy above kGradBlocksPerSm as kGradBlocksPerSm, so 1 to kGradBlocksPerSm
// blocks an SM cover them all. Where there are partial rows, kFinishCounters counters follow
// them (the in-kernel finish's, finish_tile_column: at most that many column tiles take it).
// Every few-rows rule too: it widens only tiles of one row tile (no partial rows), so it changes
// nothing here, but the scratch then covers whatever COURSE_BIAS_GRAD_FEW says at launch by
// construction, not by that argument.
template <typename T>
cudaError_t fused_backward_workspace(const BiasActGrad<T>& p, int64_t* bytes) {
  int64_t slots = 0;
  for (const bool single : {false, true}) {
    for (int blocks = 1; blocks <= kGradBlocksPerSm; ++blocks) {
      for (const FewRows few : {FewRows::kFill, FewRows::kNarrow, FewRows::kWave}) {
        Tiling t;
        GradPacks packs = GradPacks::kSingle;
        int phases = 1;
        COURSE_CUDA_TRY(fused_backward_tiling<T>(p, single, blocks, &t, &packs, &phases, few));
        slots = std::max(slots, t.slots);
      }
    }
  }
  *bytes = slots == 0 ? 0 : partial_rows_bytes<T>(slots, p.n) + kFinishCounters * int64_t{sizeof(unsigned int)};
  return cudaSuccess;
}

// The finish's counters for a launch of `t` (nullptr where column_sum adds the partial rows, or
// one row tile writes dbias): the call's own, after the partial rows in its workspace, zeroed on
// the call's stream before the kernel that counts on them, so that calls on different streams,
// and every replay of a captured graph (the memset is a node of it), start from zero.
template <typename T>
cudaError_t finish_counters(const BiasActGrad<T>& p, const Tiling& t, bool finish, cudaStream_t stream,
                            unsigned int** counters) {
  *counters = nullptr;
  if (!finish) return cudaSuccess;
  *counters = reinterpret_cast<unsigned int*>(static_cast<char*>(p.workspace) + partial_rows_bytes<T>(t.slots, p.n));
  return cudaMemsetAsync(*counters, 0, t.grid.x * sizeof(unsigned int), stream);
}

// Blocks of `kernel` an SM holds (its registers and shared memory decide): the wave the grid is
// sized to.
template <typename Kernel>
cudaError_t grad_blocks_per_sm(Kernel kernel, int* blocks) {
  COURSE_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, kGradThreads, 0));
  *blocks = std::max(*blocks, 1);
  return cudaSuccess;
}

template <typename T, typename Act, SaveKind kSource>
cudaError_t launch_fused_backward(const BiasActGrad<T>& p, cudaStream_t stream) {
  using A = typename Acc<T>::type;
  constexpr int kLanes = Vec16<T>::kLanes;
  const GradVariant variant = grad_variant();
  // Rows that start mid-vector where the span kernel could take them: each kernel's occupancy
  // (its registers and shared memory), and course::odd_rows_take_single's choice between them.
  bool single = variant.odd == OddRows::kSingle;
  if (grad_packs(p, /*single=*/false) == GradPacks::kPhased && variant.odd == OddRows::kRule) {
    int span_blocks = 1;
    int single_blocks = 1;
    COURSE_CUDA_TRY(grad_blocks_per_sm(act_backward_span_kernel<T, Act, kSource>, &span_blocks));
    COURSE_CUDA_TRY(grad_blocks_per_sm(act_backward_tile_kernel<T, Act, 1, kSource>, &single_blocks));
    single = odd_rows_take_single(kSource, span_blocks, single_blocks);
  }
  const GradPacks packs = grad_packs(p, single);
  // The kernel first, so that the grid is sized to its own occupancy.
  const auto kernel = packs == GradPacks::kVectors  ? act_backward_tile_kernel<T, Act, kLanes, kSource>
                      : packs == GradPacks::kPhased ? act_backward_span_kernel<T, Act, kSource>
                                                    : act_backward_tile_kernel<T, Act, 1, kSource>;
  int blocks_per_sm = 1;
  COURSE_CUDA_TRY(grad_blocks_per_sm(kernel, &blocks_per_sm));
  Tiling t;
  GradPacks tiled = GradPacks::kSingle;
  int phases = 1;
  COURSE_CUDA_TRY(fused_backward_tiling<T>(p, single, blocks_per_sm, &t, &tiled, &phases, variant.few));
  A* partials = static_cast<A*>(p.workspace);
  const int lanes = tiled == GradPacks::kSingle ? 1 : kLanes;
  const bool finish = grad_finishes_in_kernel(t.grid.x, t.grid.y, t.tx, lanes);
  unsigned int* counters = nullptr;
  COURSE_CUDA_TRY(finish_counters(p, t, finish, stream, &counters));
  kernel<<<t.grid, kGradThreads, 0, stream>>>(p.dy, p.saved, p.mask, p.bias, p.scale, p.dx, partials, p.dbias,
                                              p.rows, p.n, t.tx, phases, counters, variant.batched_finish);
  COURSE_CUDA_TRY(cudaGetLastError());
  // One row tile: the kernel wrote dbias; several, it added the partial rows itself (finish), or
  // column_sum adds them.
  if (t.slots == 0 || finish) return cudaSuccess;
  return column_sum<A, T>(partials, t.slots, p.n, p.dbias, stream);
}

}  // namespace course
