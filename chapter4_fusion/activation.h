// The activations of chapter 4 as functors, each a forward and a derivative written once and
// used by the CPU implementation (elementwise_cpu.cpp, host code) and by every CUDA kernel of
// the family: one templated kernel per memory pattern, instantiated per activation, instead of
// one hand-written kernel per activation (what PyTorch's own epilogues and CUTLASS do).
//
// The second half of this header, compiled only by nvcc, holds those kernel templates and their
// launch helpers, shared by elementwise_kernels.cu and linear_epilogue_kernels.cu. It stays
// torch-free like every kernel file of the course.
#pragma once

#include "elementwise.h"

#include <course/index_math.h>

#include <math.h>

#include <cstdint>
#include <type_traits>

namespace fusion {
namespace elementwise {

// The float and double overloads of the math functions the functors need, callable from host
// and device code alike (C's erff, expf and tanhf exist on both sides).
COURSE_HOST_DEVICE inline float erf_of(float v) { return erff(v); }
COURSE_HOST_DEVICE inline double erf_of(double v) { return erf(v); }
COURSE_HOST_DEVICE inline float exp_of(float v) { return expf(v); }
COURSE_HOST_DEVICE inline double exp_of(double v) { return exp(v); }
COURSE_HOST_DEVICE inline float tanh_of(float v) { return tanhf(v); }
COURSE_HOST_DEVICE inline double tanh_of(double v) { return tanh(v); }

// kFast: the hardware's approximate exp (ex2.approx) and a reciprocal instead of a division,
// for kernels whose outputs are 16-bit (kFastMath below). Rounding to bfloat16 (8 significant
// bits) or float16 (11) hides their few-ulp float error. The motive is the instruction budget
// of a kernel at copy speed (about 40 per element for a bfloat16 map on an H100); measured, it
// bought the backward kernels a few percent and the forward ones nothing (the README's
// activation section). float32 and float64 results, and the CPU, keep the exact forms.
template <bool kFast, typename A>
COURSE_HOST_DEVICE inline A exp_maybe_fast(A v) {
#if defined(__CUDA_ARCH__)
  if constexpr (kFast && std::is_same_v<A, float>) return __expf(v);
#endif
  return exp_of(v);
}
template <bool kFast, typename A>
COURSE_HOST_DEVICE inline A reciprocal_maybe_fast(A v) {
#if defined(__CUDA_ARCH__)
  if constexpr (kFast && std::is_same_v<A, float>) return __fdividef(A(1), v);
#endif
  return A(1) / v;
}

// relu(z) = max(z, 0). NaN propagates, as in torch.relu. The derivative at 0 is 0, as autograd's.
struct Relu {
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A forward(A z) {
    return (z > A(0) || z != z) ? z : A(0);
  }
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A derivative(A z) {
    return z > A(0) ? A(1) : A(0);
  }
};

// gelu(z) = z * Phi(z), Phi the standard normal CDF (torch.nn.functional.gelu, approximate="none").
struct GeluErf {
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A forward(A z) {
    return A(0.5) * z * (A(1) + erf_of(z * A(0.70710678118654752440)));  // 1 / sqrt(2)
  }
  // Phi(z) + z * phi(z), phi the normal density.
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A derivative(A z) {
    const A cdf = A(0.5) * (A(1) + erf_of(z * A(0.70710678118654752440)));
    const A pdf = exp_maybe_fast<kFast>(A(-0.5) * z * z) * A(0.39894228040143267794);  // 1 / sqrt(2 pi)
    return cdf + z * pdf;
  }
};

// gelu's tanh approximation (approximate="tanh"): 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))),
// its derivative written as torch's GeluBackward writes it.
struct GeluTanh {
  static constexpr double kBeta = 0.79788456080286535588;  // sqrt(2 / pi)
  static constexpr double kKappa = 0.044715;
  // kFast uses 0.5 (1 + tanh(u)) = sigmoid(2u), exact algebra: one approximate exp and one
  // reciprocal instead of tanhf, and no cancellation in 1 + tanh(u) where tanh(u) nears -1.
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A forward(A z) {
    const A inner = A(kBeta) * (z + A(kKappa) * z * z * z);
    if constexpr (kFast) return z * reciprocal_maybe_fast<kFast>(A(1) + exp_maybe_fast<kFast>(A(-2) * inner));
    return A(0.5) * z * (A(1) + tanh_of(inner));
  }
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A derivative(A z) {
    const A inner = A(kBeta) * (z + A(kKappa) * z * z * z);
    const A inner_derivative = A(kBeta) * (A(1) + A(3 * kKappa) * z * z);
    if constexpr (kFast) {  // s = sigmoid(2u) = 0.5 (1 + t), and 1 - t^2 = 4 s (1 - s)
      const A s = reciprocal_maybe_fast<kFast>(A(1) + exp_maybe_fast<kFast>(A(-2) * inner));
      return s + A(2) * z * s * (A(1) - s) * inner_derivative;
    }
    const A t = tanh_of(inner);
    return A(0.5) * (A(1) + t) + A(0.5) * z * (A(1) - t * t) * inner_derivative;
  }
};

// silu(z) = z * sigmoid(z). For z -> -inf, exp(-z) overflows to inf and sigmoid to 0: the limits
// are right without a branch.
struct Silu {
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A sigmoid(A z) {
    return reciprocal_maybe_fast<kFast>(A(1) + exp_maybe_fast<kFast>(-z));
  }
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A forward(A z) {
    return z * sigmoid<A, kFast>(z);
  }
  template <typename A, bool kFast = false> COURSE_HOST_DEVICE static A derivative(A z) {
    const A s = sigmoid<A, kFast>(z);
    return s * (A(1) + z * (A(1) - s));
  }
};

// Calls f(Functor{}) for the activation `act` names: the one switch from the runtime enum to the
// compile-time functor that every launcher (and the CPU code) goes through.
template <typename F>
decltype(auto) with_activation(Activation act, F&& f) {
  switch (act) {
    case Activation::kRelu: return f(Relu{});
    case Activation::kGeluErf: return f(GeluErf{});
    case Activation::kGeluTanh: return f(GeluTanh{});
    case Activation::kSilu: break;
  }
  return f(Silu{});
}

}  // namespace elementwise
}  // namespace fusion

#if defined(__CUDACC__)
// ===========================================================================================
// The kernel templates (nvcc only).
// ===========================================================================================
#include <course/column_reduce.cuh>
#include <course/cuda_utils.h>
#include <course/numeric.cuh>

#include <algorithm>
#include <climits>
#include <initializer_list>
#include <type_traits>

namespace fusion {
namespace elementwise {

// The functors' approximate exp and reciprocal (exp_maybe_fast) where results are 16-bit.
template <typename T>
constexpr bool kFastMath = sizeof(T) == 2;

using ::course::with_dtype;

template <typename F>
cudaError_t with_source(SaveKind source, F&& f) {
  switch (source) {
    case SaveKind::kOutput: return f(std::integral_constant<SaveKind, SaveKind::kOutput>{});
    case SaveKind::kInput: return f(std::integral_constant<SaveKind, SaveKind::kInput>{});
    case SaveKind::kMask: break;
  }
  return f(std::integral_constant<SaveKind, SaveKind::kMask>{});
}

// Every kernel's z = x * scale + bias is one fused multiply-add, written out so that the
// forward's mask and the backward's recomputation from x (save="x") round z identically.
__device__ __forceinline__ float fma_acc(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_acc(double a, double b, double c) { return fma(a, b, c); }

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
  if constexpr (L == course::Vec16<T>::kLanes) {
    const course::Vec16<T> v = course::load16(reinterpret_cast<const course::Vec16<T>*>(p));
#pragma unroll
    for (int l = 0; l < L; ++l) out.v[l] = v.v[l];
  } else {
    static_assert(L == 1, "a pack is one element or one 16-byte vector");
    out.v[0] = *p;
  }
  return out;
}

template <typename T, int L>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, L>& in) {
  if constexpr (L == course::Vec16<T>::kLanes) {
    course::Vec16<T> v;
#pragma unroll
    for (int l = 0; l < L; ++l) v.v[l] = in.v[l];
    course::store16(reinterpret_cast<course::Vec16<T>*>(p), v);
  } else {
    static_assert(L == 1, "a pack is one element or one 16-byte vector");
    *p = in.v[0];
  }
}

// The vector path needs every row to start on a 16-byte boundary: every pointer aligned and the
// row length a whole number of vectors. Null pointers (absent operands) do not count.
template <typename T>
inline bool vectorizable(int64_t n, std::initializer_list<const void*> pointers) {
  if (n % course::Vec16<T>::kLanes != 0) return false;
  for (const void* p : pointers) {
    if (p != nullptr && !course::is_aligned(p, 16)) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------
// The column tiling of the fused kernels. A block of kTileThreads threads is a tile of tx
// adjacent packs (columns) by ty = kTileThreads / tx rows; it walks down the rows with a
// stride of gridDim.y * ty (make_tiling: kForwardRows<Act> rows per thread in the forward, many in
// the backward). A thread keeps the same columns for its whole life, so it loads the bias of its
// columns once and keeps it in registers for every row it visits (and, in the backward, sums its
// columns' gradient over those rows in registers). Consecutive threads take
// consecutive packs of one row: a warp reads 32 * 16 = 512 contiguous bytes per instruction.
// ---------------------------------------------------------------------------------------
constexpr int kTileThreads = 256;
// Rows a backward thread loads before it computes any: two independent 16-byte loads of dy
// (and two of what the forward saved) in flight per thread, to cover DRAM latency at the
// occupancy its per-column sums leave.
constexpr int kRowsInFlight = 2;
// The forward's shape: one 16-byte pack per thread and 8 blocks of 256 threads per SM (32
// registers), the shape of a copy kernel. Measured on the H100 with
// experiments/activation_tile_shapes.cu (results/<gpu>/chapter4_activation_tile_shapes.txt;
// rows in flight x blocks per SM, bias_silu and
// GELU-tanh on 16384 x 8192 bfloat16): two rows
// per thread at 62-70 registers (4 blocks per SM) ran at 86-90% of cudaMemcpy, one row at 32
// registers at 98-99%; with __frcp_rn's correctly rounded reciprocal (a slow path for
// denormals that holds registers) in place of the approximate one, no shape passed 90%.
// erff's polynomial does not fit 32 registers (ptxas: 52-60 bytes of spills in 16-bit types,
// and the run at one row and 8 blocks was the slowest of the experiment's GELU-erf shapes): it
// takes four rows in flight at 64 registers (4 blocks per SM), the experiment's best for it.
template <typename Act>
constexpr int kForwardRows = std::is_same_v<Act, GeluErf> ? 4 : 1;
template <typename Act>
constexpr int kForwardMinBlocks = 2048 / kTileThreads / (std::is_same_v<Act, GeluErf> ? 2 : 1);
// The backward's per-slot partial sums are reduced by course::column_sum, one block per column
// tile that reads every slot: a few thousand slots at most keep that pass short.
constexpr int64_t kMaxSlots = 4096;

struct Tiling {
  int tx;          // packs per row in a tile: a power of two, >= min_tx
  dim3 grid;       // x: column tiles, y: row tiles of the first sweep
  int64_t slots;   // gridDim.y * ty: the distinct first rows, one partial row each
};

inline cudaError_t make_tiling(int64_t rows, int64_t packs_per_row, int min_tx, int64_t max_slots,
                               Tiling* t, int rows_per_thread = kRowsInFlight) {
  int tx = min_tx;
  while (tx < kTileThreads && tx < packs_per_row) tx *= 2;
  const int ty = kTileThreads / tx;
  const int64_t column_tiles = course::ceil_div(packs_per_row, static_cast<int64_t>(tx));
  int64_t row_tiles = 0;
  if (max_slots == INT64_MAX) {
    // No per-slot state (the forward kernels, swiglu's backward): one sweep of `rows_per_thread`
    // rows per thread and as many blocks as that takes, the grid of a copy kernel. A grid sized
    // to one resident wave ran well below copy on the H100: it counted 2048 threads per SM,
    // while these kernels' 40-68 registers (ptxas -v) fit 768-1536, so the "one wave" ran as
    // one and a fraction waves with the SMs idle in the last. Many short blocks leave no such
    // tail; the bias, reloaded per thread, is an L1/L2 hit.
    row_tiles = course::ceil_div(std::max<int64_t>(rows, 1), static_cast<int64_t>(ty) * rows_per_thread);
  } else {
    // Per-slot partial sums (the backward's bias gradient): as many row tiles as fill the GPU
    // once with the column tiles, at most max_slots / ty, and a grid-stride loop over the rest,
    // so each slot sums many rows in registers.
    int64_t resident = 0;
    COURSE_CUDA_TRY(course::resident_threads(&resident));
    row_tiles = std::max<int64_t>(1, resident / kTileThreads / std::max<int64_t>(column_tiles, 1));
    row_tiles = std::min(row_tiles, course::ceil_div(std::max<int64_t>(rows, 1), static_cast<int64_t>(ty)));
    row_tiles = std::min(row_tiles, std::max<int64_t>(1, max_slots / ty));
  }
  row_tiles = std::min<int64_t>(row_tiles, 65535);  // gridDim.y's limit
  t->tx = tx;
  t->grid = dim3(static_cast<unsigned>(std::min<int64_t>(column_tiles, INT_MAX)), static_cast<unsigned>(row_tiles));
  t->slots = row_tiles * ty;
  return cudaSuccess;
}

// Blocks of `threads` for a grid-stride loop over `work` items: one resident wave at most.
inline cudaError_t flat_blocks(int64_t work, int threads, unsigned* blocks) {
  int64_t resident = 0;
  COURSE_CUDA_TRY(course::resident_threads(&resident));
  const int64_t wanted = course::ceil_div(std::max<int64_t>(work, 1), static_cast<int64_t>(threads));
  *blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min(wanted, resident / threads)));
  return cudaSuccess;
}

constexpr int kFlatThreads = 256;

// ---------------------------------------------------------------------------------------
// Forward, unfused pieces (v1 of every ladder): what eager runs, one op per kernel, each a
// trip through memory that rounds its result to the dtype.
// ---------------------------------------------------------------------------------------
// out = in * scale (may be in place).
template <typename T>
__global__ void scale_kernel(const T* in, typename course::Acc<T>::type scale, T* out, int64_t numel) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = course::from_acc<T>(course::to_acc(in[i]) * scale);
  }
}

// out = in + bias broadcast over rows of n (may be in place). The column of every element costs
// a 64-bit division, as in eager's broadcasting TensorIterator.
template <typename T>
__global__ void add_bias_kernel(const T* in, const T* bias, T* out, int64_t numel, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = course::from_acc<T>(course::to_acc(in[i]) + course::to_acc(bias[i % n]));
  }
}

// ---------------------------------------------------------------------------------------
// v2 of fused_bias_scale_relu (and the activation kernel of the unfused rungs, bias == null):
// one kernel, so x is read once and y written once. A warp takes 32 adjacent columns of one
// row per step, which is exactly one word of the mask: __ballot_sync gathers the 32 signs and
// lane 0 stores the word, with no shared memory. Scalar loads, and the bias re-read (from L1)
// for every element.
// ---------------------------------------------------------------------------------------
template <typename T, typename Act, bool kMask>
__global__ void bias_act_warp_kernel(const T* x, const T* bias, typename course::Acc<T>::type scale, T* y,
                                     uint32_t* mask, int64_t rows, int64_t n) {
  using A = typename course::Acc<T>::type;
  const int lane = threadIdx.x % 32;
  const int64_t words_per_row = mask_words_per_row(n);
  const int64_t tiles = rows * words_per_row;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  // t is the same in every lane of a warp, so all 32 lanes reach the ballot together.
  for (int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; t < tiles; t += warps) {
    const int64_t r = t / words_per_row;
    const int64_t c = (t - r * words_per_row) * 32 + lane;
    // The row's last word may be partial: lanes past its end compute nothing and vote 0.
    const bool active = c < n;
    A z = A(0);
    if (active) {
      z = course::to_acc(x[r * n + c]) * scale;
      if (bias != nullptr) z += course::to_acc(bias[c]);
      y[r * n + c] = course::from_acc<T>(Act::template forward<A, kFastMath<T>>(z));
    }
    if constexpr (kMask) {
      const uint32_t bits = __ballot_sync(0xffffffffu, active && z > A(0));
      if (lane == 0) mask[t] = bits;
    }
  }
}

// ---------------------------------------------------------------------------------------
// v3 of fused_bias_scale_relu, v2 of bias_gelu / bias_silu, linear's fused epilogue: the
// column tiling above. Against v2: 16-byte loads and stores (a quarter to an eighth of the
// memory instructions), the bias loaded once per thread instead of once per element, no
// division per element, and two rows in flight per thread. The mask: a pack of L elements gives
// L bits; the 32 / L lanes whose packs make one 32-bit word OR their bits together with
// shuffles, and the first of them stores the word.
// ---------------------------------------------------------------------------------------
// kRows and kMinBlocks are parameters for experiments/activation_tile_shapes.cu; the launcher
// always takes the defaults. kMinBlocks counts for sm_80/sm_90 (2048 threads per SM); sm_75
// holds 1024, so its device pass asks for half (the template arguments, and so the kernel's
// name, stay the same in every pass).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define FUSION_MIN_BLOCKS(blocks) ((blocks) > 1 ? (blocks) / 2 : 1)
#else
#define FUSION_MIN_BLOCKS(blocks) (blocks)
#endif
template <typename T, typename Act, int L, bool kMask, int kRows = kForwardRows<Act>,
          int kMinBlocks = kForwardMinBlocks<Act>>
__global__ void __launch_bounds__(kTileThreads, FUSION_MIN_BLOCKS(kMinBlocks))
    bias_act_tile_kernel(const T* x, const T* bias, typename course::Acc<T>::type scale, T* y, T* pre,
                         uint32_t* mask, int64_t rows, int64_t n, int tx) {
  using A = typename course::Acc<T>::type;
  const int ty = kTileThreads / tx;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * tx + threadIdx.x % tx;  // pack index in a row
  const int64_t e = col * L;                                                     // its first element
  // The last column tile may hang over the row's end; its extra threads only join the shuffles.
  const bool col_ok = e < n;
  A b[L];
#pragma unroll
  for (int l = 0; l < L; ++l) b[l] = A(0);
  if (col_ok && bias != nullptr) {
    const Pack<T, L> bv = load_pack<T, L>(bias + e);
#pragma unroll
    for (int l = 0; l < L; ++l) b[l] = course::to_acc(bv.v[l]);
  }
  const int64_t row_in_tile = threadIdx.x / tx;
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
          const A z = fma_acc(course::to_acc(xv[u].v[l]), scale, b[l]);
          yv.v[l] = course::from_acc<T>(Act::template forward<A, kFastMath<T>>(z));
          zv.v[l] = course::from_acc<T>(z);
          bits |= static_cast<uint32_t>(z > A(0)) << l;
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

template <typename T, typename Act, bool kMask, int L>
cudaError_t launch_bias_act_tiles_l(const BiasActParams& p, cudaStream_t stream) {
  Tiling t;
  COURSE_CUDA_TRY(make_tiling(p.rows, p.n / L, kMask ? 32 / L : 1, INT64_MAX, &t, kForwardRows<Act>));
  bias_act_tile_kernel<T, Act, L, kMask><<<t.grid, kTileThreads, 0, stream>>>(
      static_cast<const T*>(p.x), static_cast<const T*>(p.bias), static_cast<typename course::Acc<T>::type>(p.scale),
      static_cast<T*>(p.y), static_cast<T*>(p.pre), p.mask, p.rows, p.n, t.tx);
  return cudaGetLastError();
}

template <typename T, typename Act, bool kMask>
cudaError_t launch_bias_act_tiles(const BiasActParams& p, cudaStream_t stream) {
  if (vectorizable<T>(p.n, {p.x, p.bias, p.y, p.pre})) {
    return launch_bias_act_tiles_l<T, Act, kMask, course::Vec16<T>::kLanes>(p, stream);
  }
  return launch_bias_act_tiles_l<T, Act, kMask, 1>(p, stream);
}

template <typename T, typename Act, bool kMask>
cudaError_t launch_bias_act_warps(const T* x, const T* bias, double scale, T* y, uint32_t* mask, int64_t rows,
                                  int64_t n, cudaStream_t stream) {
  unsigned blocks = 0;
  COURSE_CUDA_TRY(flat_blocks(rows * mask_words_per_row(n) * 32, kFlatThreads, &blocks));
  bias_act_warp_kernel<T, Act, kMask><<<blocks, kFlatThreads, 0, stream>>>(
      x, bias, static_cast<typename course::Acc<T>::type>(scale), y, mask, rows, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_scale(const T* in, double scale, T* out, int64_t numel, cudaStream_t stream) {
  unsigned blocks = 0;
  COURSE_CUDA_TRY(flat_blocks(numel, kFlatThreads, &blocks));
  scale_kernel<T><<<blocks, kFlatThreads, 0, stream>>>(in, static_cast<typename course::Acc<T>::type>(scale), out,
                                                       numel);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_add_bias(const T* in, const T* bias, T* out, int64_t rows, int64_t n, cudaStream_t stream) {
  unsigned blocks = 0;
  COURSE_CUDA_TRY(flat_blocks(rows * n, kFlatThreads, &blocks));
  add_bias_kernel<T><<<blocks, kFlatThreads, 0, stream>>>(in, bias, out, rows * n, n);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------
// Backward v1: g = dy * act'(z) written out in the dtype, as eager's `dy * (y > 0)` is; then
// dx = g * scale (scale_kernel) and dbias = the column sum of g (course::column_sum): three
// kernels and g's round trip through memory.
// ---------------------------------------------------------------------------------------
// act'(z) for element (r, c) of a row of n, from what the forward kept.
template <typename Act, SaveKind kSource, typename T, typename A>
__device__ __forceinline__ A derivative_at(const T* saved, const uint32_t* mask, A bias_c, A scale, int64_t r,
                                           int64_t c, int64_t n) {
  if constexpr (kSource == SaveKind::kInput) {
    return Act::template derivative<A, kFastMath<T>>(fma_acc(course::to_acc(saved[r * n + c]), scale, bias_c));
  } else if constexpr (kSource == SaveKind::kOutput) {
    return course::to_acc(saved[r * n + c]) > A(0) ? A(1) : A(0);
  } else {
    return ((mask[r * mask_words_per_row(n) + c / 32] >> (c % 32)) & 1u) ? A(1) : A(0);
  }
}

template <typename T, typename Act, SaveKind kSource>
__global__ void masked_grad_kernel(const T* dy, const T* saved, const uint32_t* mask, const T* bias,
                                   typename course::Acc<T>::type scale, T* g, int64_t rows, int64_t n) {
  using A = typename course::Acc<T>::type;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / n;
    const int64_t c = i - r * n;
    const A bias_c = bias != nullptr ? course::to_acc(bias[c]) : A(0);
    const A d = derivative_at<Act, kSource>(saved, mask, bias_c, scale, r, c, n);
    g[i] = course::from_acc<T>(course::to_acc(dy[i]) * d);
  }
}

// ---------------------------------------------------------------------------------------
// Backward v2: one pass. Each thread keeps its columns for life (the tiling above): it reads dy
// and what the forward saved, writes dx, and adds g into per-column float accumulators in
// registers over every row it visits. At the end it writes them as one row of a [slots, n]
// array of partial sums (every slot row written once: no zero fill, no atomics), which
// course::column_sum then reduces in a fixed order: deterministic, and g never goes to memory.
// ---------------------------------------------------------------------------------------
template <typename T, typename Act, int L, SaveKind kSource>
__global__ void __launch_bounds__(kTileThreads)
    act_backward_tile_kernel(const T* dy, const T* saved, const uint32_t* mask, const T* bias,
                             typename course::Acc<T>::type scale, T* dx, typename course::Acc<T>::type* partials,
                             int64_t rows, int64_t n, int tx) {
  using A = typename course::Acc<T>::type;
  const int ty = kTileThreads / tx;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * tx + threadIdx.x % tx;
  const int64_t e = col * L;
  // Threads past the row's end have no column; no shuffles here, so they may leave at once.
  if (e >= n) return;
  A b[L];
#pragma unroll
  for (int l = 0; l < L; ++l) b[l] = A(0);
  if (kSource == SaveKind::kInput && bias != nullptr) {
    const Pack<T, L> bv = load_pack<T, L>(bias + e);
#pragma unroll
    for (int l = 0; l < L; ++l) b[l] = course::to_acc(bv.v[l]);
  }
  A sum[L];
#pragma unroll
  for (int l = 0; l < L; ++l) sum[l] = A(0);
  const int64_t slot = static_cast<int64_t>(blockIdx.y) * ty + threadIdx.x / tx;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * ty;
  const int64_t words_per_row = mask_words_per_row(n);
  // Slots without a row (more slots than rows) still write their zero partials below.
  for (int64_t base = slot; base < rows; base += kRowsInFlight * row_step) {
    Pack<T, L> dyv[kRowsInFlight];
    Pack<T, L> sv[kRowsInFlight];
    uint32_t bits[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const int64_t r = base + u * row_step;
      if (r < rows) {  // the sweep's second row may lie past the last
        dyv[u] = load_pack<T, L>(dy + r * n + e);
        if constexpr (kSource == SaveKind::kMask) {
          // L divides 32 and e is a multiple of L, so the pack's L bits sit in one word.
          bits[u] = mask[r * words_per_row + e / 32] >> (e % 32);
        } else {
          sv[u] = load_pack<T, L>(saved + r * n + e);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const int64_t r = base + u * row_step;
      if (r < rows) {
        Pack<T, L> dxv;
#pragma unroll
        for (int l = 0; l < L; ++l) {
          A d;
          if constexpr (kSource == SaveKind::kInput) {
            d = Act::template derivative<A, kFastMath<T>>(fma_acc(course::to_acc(sv[u].v[l]), scale, b[l]));
          } else if constexpr (kSource == SaveKind::kOutput) {
            d = course::to_acc(sv[u].v[l]) > A(0) ? A(1) : A(0);
          } else {
            d = ((bits[u] >> l) & 1u) ? A(1) : A(0);
          }
          const A g = course::to_acc(dyv[u].v[l]) * d;
          dxv.v[l] = course::from_acc<T>(g * scale);
          sum[l] += g;
        }
        store_pack<T, L>(dx + r * n + e, dxv);
      }
    }
  }
#pragma unroll
  for (int l = 0; l < L; ++l) partials[slot * n + e + l] = sum[l];
}

// Scratch of the fused backward: the [slots, n] partial sums in the accumulation type.
template <typename T>
cudaError_t fused_backward_tiling(const ActBackwardParams& p, Tiling* t, bool* vector) {
  *vector = vectorizable<T>(p.n, {p.dy, p.saved, p.bias, p.dx});
  const int lanes = *vector ? course::Vec16<T>::kLanes : 1;
  return make_tiling(p.rows, p.n / lanes, 1, kMaxSlots, t);
}

template <typename T>
cudaError_t fused_backward_workspace(const ActBackwardParams& p, int64_t* bytes) {
  Tiling t;
  bool vector = false;
  COURSE_CUDA_TRY(fused_backward_tiling<T>(p, &t, &vector));
  *bytes = t.slots * p.n * static_cast<int64_t>(sizeof(typename course::Acc<T>::type));
  return cudaSuccess;
}

template <typename T, typename Act, SaveKind kSource>
cudaError_t launch_fused_backward(const ActBackwardParams& p, cudaStream_t stream) {
  using A = typename course::Acc<T>::type;
  Tiling t;
  bool vector = false;
  COURSE_CUDA_TRY(fused_backward_tiling<T>(p, &t, &vector));
  A* partials = static_cast<A*>(p.workspace);
  const auto* dy = static_cast<const T*>(p.dy);
  const auto* saved = static_cast<const T*>(p.saved);
  const auto* bias = static_cast<const T*>(p.bias);
  auto* dx = static_cast<T*>(p.dx);
  const A scale = static_cast<A>(p.scale);
  if (vector) {
    act_backward_tile_kernel<T, Act, course::Vec16<T>::kLanes, kSource><<<t.grid, kTileThreads, 0, stream>>>(
        dy, saved, p.mask, bias, scale, dx, partials, p.rows, p.n, t.tx);
  } else {
    act_backward_tile_kernel<T, Act, 1, kSource><<<t.grid, kTileThreads, 0, stream>>>(
        dy, saved, p.mask, bias, scale, dx, partials, p.rows, p.n, t.tx);
  }
  COURSE_CUDA_TRY(cudaGetLastError());
  return course::column_sum<A, T>(partials, t.slots, p.n, static_cast<T*>(p.dbias), stream);
}

}  // namespace elementwise
}  // namespace fusion
#endif  // __CUDACC__
