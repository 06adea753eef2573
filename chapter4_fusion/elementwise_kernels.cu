// Chapter 4's elementwise fusions: fused_bias_scale_relu (forward ladder v1-v3, backward
// ladder v1-v2), bias_gelu / bias_silu (v1-v2) and swiglu (v1-v2), with their backward kernels.
//
// Napkin math. relu(x * scale + bias) on a [rows, n] tensor of b-byte elements must read x and
// write y: 2 b bytes per element, plus n^-1 of that for the bias; the mask for the backward
// adds 1/8 byte per element. Eager PyTorch runs three ops, each a read and a write: 6 b bytes,
// three times the minimum, and the fused kernels' whole game is to reach the minimum at the
// speed of a copy. The backward reads dy and the saved tensor (b bytes for y or x, 1/8 byte for
// the mask) and writes dx: 2 b + 1/8 bytes with the mask against 3 b with y or x.
//
// The kernel templates live in activation_kernels.cuh and common/include/course/bias_act.cuh
// (shared with linear_epilogue_kernels.cu and chapter 5); this file strings them into the rungs
// and says what each changes.
#include "activation_kernels.cuh"
#include "elementwise.h"

#include <course/column_reduce.cuh>
#include <course/cuda_utils.h>
#include <course/numeric.cuh>

namespace fusion {
namespace elementwise {
namespace {

using course::Acc;
using course::from_acc;
using course::kFastMath;
using course::to_acc;
using course::Vec16;

// ---------------------------------------------------------------------------------------
// SwiGLU: y = silu(a) * b with a, b the two halves of each row of x.
// ---------------------------------------------------------------------------------------
// v1: eager's two kernels, silu(a) into y, then y * b in place: y makes a round trip and the
// column of every element costs a division.
template <typename T>
__global__ void silu_half_kernel(const T* x, T* y, int64_t rows, int64_t half) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * half;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / half;
    y[i] = from_acc<T>(Silu::forward(to_acc(x[r * 2 * half + (i - r * half)])));
  }
}

template <typename T>
__global__ void mul_half_kernel(const T* x, T* y, int64_t rows, int64_t half) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * half;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / half;
    y[i] = from_acc<T>(to_acc(y[i]) * to_acc(x[r * 2 * half + half + (i - r * half)]));
  }
}

// v2: one kernel over the output's elements as a flat array, a 16-byte vector of y a thread, on a
// grid sized from the vector count and the SM count (swiglu_grid, elementwise.h). Flat, not in
// column tiles: a row of y is `half` elements, and whatever half is, every lane has a whole
// vector (tiles round a row up to a power of two of packs: half 768 in bf16 is 96 packs in a tile
// of 128, a quarter of the lanes idle) and a few rows still cover every SM.
//
// When half is no whole number of vectors (777, 4099) the rows of x start at every distance
// from a 16-byte boundary, and a, b and y at different ones: y's vectors stay aligned (the
// flat walk), and a and b are read as the two aligned vectors around them, shifted into place
// (course::load16_realigned). The forward's vector that straddles two rows of y is realigned
// loads too (swiglu_flat_kernel says how); only the few elements before y's first boundary and
// after its last whole vector, and vectors whose aligned loads would leave x, are single elements.
//
// The forward's SiLU takes the fast exp and division (kFastMath, as the bias activations') in
// 16-bit dtypes, whose rounding of the output is far coarser than their error: float32's
// correctly rounded division has a slow-path branch per element, and at a few rows (64 tokens:
// every warp's loads land at about once, then every warp computes) the arithmetic after the
// loads is on the kernel's critical path, not hidden behind other warps' loads.
// ---------------------------------------------------------------------------------------

// L elements to q: one 16-byte store where q is on a boundary, else one element at a time (the
// backward's da and db where dy is off a boundary and x's rows are on them, swiglu_backward_kernel:
// dy's vectors and dx's then sit at different distances from one; the warp's single stores are
// still adjacent, and L2 merges them into whole sectors).
template <typename T>
__device__ __forceinline__ void store16_at(T* q, const Vec16<T>& v) {
  if (reinterpret_cast<uintptr_t>(q) % 16 == 0) {
    course::store16(reinterpret_cast<Vec16<T>*>(q), v);
  } else {
#pragma unroll
    for (int l = 0; l < Vec16<T>::kLanes; ++l) q[l] = v.v[l];
  }
}

// Element i of the half-width array (y, or dy in the backward), alone: row i / half.
template <typename T, bool kBackward>
__device__ __forceinline__ void swiglu_element(const T* x, const T* dy, T* out, int64_t half, int64_t i) {
  using A = typename Acc<T>::type;
  const int64_t r = i / half;
  const int64_t c = i - r * half;
  const A a = to_acc(x[r * 2 * half + c]);
  const A b = to_acc(x[r * 2 * half + half + c]);
  if constexpr (kBackward) {
    const A g = to_acc(dy[i]);
    out[r * 2 * half + c] = from_acc<T>(g * b * Silu::derivative(a));
    out[r * 2 * half + half + c] = from_acc<T>(g * Silu::forward(a));
  } else {
    out[i] = from_acc<T>(Silu::forward<A, kFastMath<T>>(a) * b);  // as the vectors' (swiglu_flat_kernel)
  }
}

// The L elements first ... first + L - 1 of the half-width array (row r, column c on) one at a
// time: the backward's vector that straddles rows, a vector of rows shorter than it, or one whose
// realigned loads would leave x. Every load is issued before any arithmetic or store, so the
// thread waits one memory round trip, not L of them. Rows advance by a running column, without
// a division; half < L wraps more than once.
template <typename T, bool kBackward>
__device__ __forceinline__ void swiglu_elements(const T* x, const T* dy, T* out, int64_t half, int64_t first,
                                                int64_t r, int64_t c) {
  using A = typename Acc<T>::type;
  constexpr int L = Vec16<T>::kLanes;
  int64_t at[L];  // element l's a in x (and da in dx); its b (db) is `half` further
  T av[L];
  T bv[L];
  T gv[L];
#pragma unroll
  for (int l = 0; l < L; ++l) {
    at[l] = r * 2 * half + c;
    av[l] = x[at[l]];
    bv[l] = x[at[l] + half];
    if constexpr (kBackward) gv[l] = dy[first + l];
    if (++c == half) {
      c = 0;
      ++r;
    }
  }
#pragma unroll
  for (int l = 0; l < L; ++l) {
    const A a = to_acc(av[l]);
    if constexpr (kBackward) {
      const A g = to_acc(gv[l]);
      out[at[l]] = from_acc<T>(g * to_acc(bv[l]) * Silu::derivative(a));
      out[at[l] + half] = from_acc<T>(g * Silu::forward(a));
    } else {
      out[first + l] = from_acc<T>(Silu::forward<A, kFastMath<T>>(a) * to_acc(bv[l]));
    }
  }
}

// The forward (kBackward false: out = y, [rows, half]) and the backward (out = dx, [rows, 2 half],
// from dy, [rows, half]; only where x's rows start on 16-byte boundaries, swiglu_backward_kernel)
// on the same walk: thread v takes elements head + v L ... + L - 1 of the
// half-width array, whose first `head` elements lie before its first 16-byte boundary (0 for a
// fresh y). kShifted false: half a whole number of vectors and every pointer aligned, so a, b
// and dx are aligned wherever y is and every vector lies inside one row: plain 16-byte accesses.
//
// edge_first: the flat thread index that takes the first element outside whole vectors
// (course::flat_edge_first: a warp past the last vector's in the uniform form, thread 0
// otherwise). kUniform (the forward's shifted loads only; course::FlatOdd in bias_act.h says why):
// a straddling lane issues its third realigned load with the other two, and a lane of single
// elements issues its loads beside the other lanes' in the same straight run, so that a warp waits
// for memory once.
template <typename T, bool kBackward, bool kShifted, bool kUniform = false>
__global__ void __launch_bounds__(kSwigluMaxThreads)
    swiglu_flat_kernel(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ out, int64_t rows,
                       int64_t half, int head, int64_t edge_first) {
  static_assert(!kUniform || (kShifted && !kBackward), "the uniform form is the forward's shifted loads");
  using A = typename Acc<T>::type;
  constexpr int L = Vec16<T>::kLanes;
  const int64_t total = rows * half;
  const int64_t vectors = (total - head) / L;
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // The elements outside whole vectors (fewer than L before the first boundary, fewer than L
  // after the last whole vector): one thread each from edge_first on.
  {
    const int64_t tail = head + vectors * L;
    const int64_t k = v - edge_first;
    if (k >= 0 && k < head + (total - tail)) {
      const int64_t i = k < head ? k : tail + (k - head);
      swiglu_element<T, kBackward>(x, dy, out, half, i);
    }
  }
  if (v >= vectors) return;  // past the last whole vector; no barrier or shuffle below
  const int64_t first = head + v * L;
  // One division a thread, in 32 bits where the array allows (the hardware has no 64-bit divide).
  const int64_t r = total <= static_cast<int64_t>(UINT32_MAX)
                        ? static_cast<int64_t>(static_cast<uint32_t>(first) / static_cast<uint32_t>(half))
                        : first / half;
  const int64_t c = first - r * half;
  const T* a = x + r * 2 * half + c;
  const T* b = a + half;
  Vec16<T> av;
  Vec16<T> bv;
  if constexpr (!kShifted) {
    av = course::load16(reinterpret_cast<const Vec16<T>*>(a));
    bv = course::load16(reinterpret_cast<const Vec16<T>*>(b));
  } else {
    // Realigned loads (course::load16_realigned). `here` of the L elements are row r's, the rest
    // row r + 1's from its column 0: the rest's a are then at b + l (row r's b runs on into row
    // r + 1's a in x) and their b at b + half + l. So in the forward a vector that straddles two
    // rows takes one more realigned load (b + half) and a select per element, and its lane stays
    // on its warp's path. Before, such a lane read single elements (swiglu_elements) in a branch
    // of its own, and its warp waited for memory twice, that lane's loads and then the rest's: at
    // 64 x 4099 bfloat16 one warp a row (a row is ~512 vectors, 16 warps), and a kernel this short
    // lasts as long as its slowest warps (3.7 us, where 64 x 4096, no straddles, took 2.8). The
    // third load still waits for the first two to land (it sits in the branch after their
    // shifts; hoisted, three pairs' 24 words would not fit the 32 registers ptxas keeps this
    // kernel at), so a straddling lane's warp waits for memory twice and the others once (a and
    // b's four loads issue together): the branching form, kept past a wave; the uniform form
    // (kUniform, below) issues all three, and the single elements' loads, before any use. The backward stores da and db where a and b are, so its
    // straddling vectors keep the single elements; so do rows shorter than a vector (a vector
    // over several rows) and vectors whose aligned loads would read outside x (the first and
    // last rows: bytes that are not x's, which compute-sanitizer reports).
    const T* const x_end = x + 2 * total;
    const int here = c + L > half ? static_cast<int>(half - c) : L;
    const bool straddles = here < L;
    const bool elements = half < L || (kBackward && straddles) || !course::realigned_reads_inside(a, here, x, x_end) ||
                          !course::realigned_reads_inside(b, L, x, x_end) ||
                          (straddles && !course::realigned_reads_inside(b + half, L, x, x_end));
    if constexpr (kUniform) {
      // Every lane's loads first, each kind in a branch that only loads (no use, so no wait
      // inside it): the realigned vectors, a straddling lane's third among them, or the single
      // elements of swiglu_elements' walk (the vectors whose aligned loads would leave x: the
      // first and last rows). Then the shifts and the selects, once.
      course::Realigned ra{};
      course::Realigned rb{};
      course::Realigned rn{};
      T ea[L];
      T eb[L];
      if (!elements) {
        ra = course::realigned_issue(a, here);
        rb = course::realigned_issue(b);
        if (straddles) rn = course::realigned_issue(b + half);  // row r + 1's b from column 0 on
      } else {
        int64_t rr = r;
        int64_t cc = c;
#pragma unroll
        for (int l = 0; l < L; ++l) {
          const T* at = x + rr * 2 * half + cc;
          ea[l] = at[0];
          eb[l] = at[half];
          if (++cc == half) {  // rows advance by a running column, as in swiglu_elements
            cc = 0;
            ++rr;
          }
        }
      }
      av = course::realigned_finish<T>(ra);
      bv = course::realigned_finish<T>(rb);
      const Vec16<T> next_b = course::realigned_finish<T>(rn);
#pragma unroll
      for (int l = 0; l < L; ++l) {
        if (elements) {
          av.v[l] = ea[l];
          bv.v[l] = eb[l];
        } else if (l >= here) {  // a straddling vector's lanes in row r + 1 (see below)
          av.v[l] = bv.v[l];
          bv.v[l] = next_b.v[l];
        }
      }
    } else if (elements) {
      swiglu_elements<T, kBackward>(x, dy, out, half, first, r, c);
      return;
    }
    if constexpr (!kUniform) {
      av = course::load16_realigned(a, here);
      bv = course::load16_realigned(b);
      if (!kBackward && straddles) {
        const Vec16<T> next_b = course::load16_realigned(b + half);  // row r + 1's b from column 0 on
#pragma unroll
        for (int l = 0; l < L; ++l) {
          if (l >= here) {
            av.v[l] = bv.v[l];
            bv.v[l] = next_b.v[l];
          }
        }
      }
    }
  }
  if constexpr (kBackward) {
    const Vec16<T> gv = course::load16(reinterpret_cast<const Vec16<T>*>(dy + first));  // aligned: head is dy's
    Vec16<T> dav;
    Vec16<T> dbv;
#pragma unroll
    for (int l = 0; l < L; ++l) {
      const A av_l = to_acc(av.v[l]);
      const A g = to_acc(gv.v[l]);
      dav.v[l] = from_acc<T>(g * to_acc(bv.v[l]) * Silu::derivative(av_l));
      dbv.v[l] = from_acc<T>(g * Silu::forward(av_l));
    }
    T* da = out + r * 2 * half + c;
    store16_at(da, dav);
    store16_at(da + half, dbv);
  } else {
    Vec16<T> yv;
#pragma unroll
    for (int l = 0; l < L; ++l) {
      yv.v[l] = from_acc<T>(Silu::forward<A, kFastMath<T>>(to_acc(av.v[l])) * to_acc(bv.v[l]));
    }
    course::store16(reinterpret_cast<Vec16<T>*>(out + first), yv);  // aligned: head is y's
  }
}

// The backward where rows of x are off 16-byte boundaries (swiglu_backward_kernel, elementwise.h):
// course/bias_act.cuh's column tiling of single elements, da = dy * b * silu'(a) and db = dy *
// silu(a) written into the two halves of dx; x and dy read once. A warp reads 32 adjacent
// elements of a, of b and of dy a row: whole sectors, whatever the row's alignment.
template <typename T>
__global__ void __launch_bounds__(kTileThreads)
    swiglu_backward_tile_kernel(const T* dy, const T* x, T* dx, int64_t rows, int64_t half, int tx) {
  using A = typename Acc<T>::type;
  const int ty = kTileThreads / tx;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * tx + threadIdx.x % tx;
  if (e >= half) return;  // past the row's end; no barrier or shuffle below
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * ty;
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * ty + threadIdx.x / tx; r < rows; r += row_step) {
    const A a = to_acc(x[r * 2 * half + e]);
    const A b = to_acc(x[r * 2 * half + half + e]);
    const A g = to_acc(dy[r * half + e]);
    dx[r * 2 * half + e] = from_acc<T>(g * b * Silu::derivative(a));
    dx[r * 2 * half + half + e] = from_acc<T>(g * Silu::forward(a));
  }
}

// Elements of `flat` (y, or dy in the backward) before its first 16-byte boundary.
template <typename T>
int swiglu_head_of(const T* flat, int64_t total) {
  const uintptr_t misaligned = reinterpret_cast<uintptr_t>(flat) % 16;
  const int64_t head = misaligned ? (16 - static_cast<int64_t>(misaligned)) / static_cast<int64_t>(sizeof(T)) : 0;
  return static_cast<int>(std::min(head, total));
}

template <typename T, bool kBackward>
cudaError_t launch_swiglu_flat(const T* x, const T* dy, T* out, int64_t rows, int64_t half, cudaStream_t stream) {
  constexpr int L = course::Vec16<T>::kLanes;
  const int head = swiglu_head_of<T>(kBackward ? dy : out, rows * half);
  int sms = 0;
  COURSE_CUDA_TRY(course::sm_count(&sms));
  const SwigluGrid g = swiglu_grid(rows, half, static_cast<int>(sizeof(T)), head, sms);
  const bool aligned = half % L == 0 && course::is_aligned(x, 16) && course::is_aligned(out, 16) &&
                       (!kBackward || course::is_aligned(dy, 16));
  // The uniform form (course::flat_uniform: a grid of one wave or less, counted in blocks of 256
  // threads as the bias kernels' are) wherever something is not whole aligned vectors: its edge
  // elements on a warp of their own, and the forward's shifted loads all issued before any use.
  const bool uniform =
      !aligned && course::flat_uniform(course::ceil_div<int64_t>(g.vectors, 256), sms, course::flat_odd_variant());
  const int64_t edges = rows * half - g.vectors * L;  // head plus the tail after the last whole vector
  const int64_t edge_first = course::flat_edge_first(g.vectors, uniform);
  const dim3 grid(static_cast<unsigned>(
      std::max<int64_t>(g.blocks, course::flat_edge_blocks(g.vectors, edges, edge_first, g.threads))));
  if (aligned) {
    swiglu_flat_kernel<T, kBackward, false><<<grid, g.threads, 0, stream>>>(x, dy, out, rows, half, head, edge_first);
  } else if (uniform && !kBackward) {
    swiglu_flat_kernel<T, false, true, true><<<grid, g.threads, 0, stream>>>(x, dy, out, rows, half, head, edge_first);
  } else {
    swiglu_flat_kernel<T, kBackward, true><<<grid, g.threads, 0, stream>>>(x, dy, out, rows, half, head, edge_first);
  }
  return cudaGetLastError();
}

}  // namespace

// ---------------------------------------------------------------------------------------
// fused_bias_scale_relu's forward ladder:
//   v1  three kernels, scale, add bias, relu (+ mask): eager's 6 b bytes per element, and each
//       intermediate rounded to the dtype as eager rounds it;
//   v2  one kernel (bias_act_warp_kernel): 2 b bytes, scalar accesses, a warp per mask word;
//   v3  one kernel with 16-byte accesses: the column tiles (bias_act_tile_kernel, the bias held
//       in registers across rows: the copy kernel's access pattern) while rows are whole vectors
//       that fill the tiles, else the flat kernel (bias_act_flat_kernel: one 16-byte vector per
//       thread over the flat array, the bias gathered by column: every lane busy at any hidden
//       size, whole vectors at any row length).
// ---------------------------------------------------------------------------------------
cudaError_t launch_bias_scale_relu(const BiasActParams& p, BsrVersion version, cudaStream_t stream) {
  return with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    const auto* x = static_cast<const T*>(p.x);
    const auto* bias = static_cast<const T*>(p.bias);
    auto* y = static_cast<T*>(p.y);
    const bool mask = p.mask != nullptr;
    switch (version) {
      case BsrVersion::kThreeKernels:
        COURSE_CUDA_TRY(launch_scale<T>(x, p.scale, y, p.rows * p.n, stream));
        COURSE_CUDA_TRY(launch_add_bias<T>(y, bias, y, p.rows, p.n, stream));
        return mask ? launch_bias_act_warps<T, Relu, true>(y, nullptr, 1.0, y, p.mask, p.rows, p.n, stream)
                    : launch_bias_act_warps<T, Relu, false>(y, nullptr, 1.0, y, nullptr, p.rows, p.n, stream);
      case BsrVersion::kFused:
        return mask ? launch_bias_act_warps<T, Relu, true>(x, bias, p.scale, y, p.mask, p.rows, p.n, stream)
                    : launch_bias_act_warps<T, Relu, false>(x, bias, p.scale, y, nullptr, p.rows, p.n, stream);
      case BsrVersion::kVectorized:
        break;
    }
    return mask ? launch_bias_act_fused<T, Relu, true>(p, stream) : launch_bias_act_fused<T, Relu, false>(p, stream);
  });
}

// bias_gelu and bias_silu (any activation): v1 a bias kernel then an activation kernel, v2 the
// tile kernel. scale is 1 for them.
cudaError_t launch_bias_activation(const BiasActParams& p, ActVersion version, cudaStream_t stream) {
  return with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    return with_activation(p.act, [&](auto act) -> cudaError_t {
      using Act = decltype(act);
      if (version == ActVersion::kUnfused) {
        auto* y = static_cast<T*>(p.y);
        COURSE_CUDA_TRY(launch_add_bias<T>(static_cast<const T*>(p.x), static_cast<const T*>(p.bias), y, p.rows,
                                           p.n, stream));
        return launch_bias_act_warps<T, Act, false>(y, nullptr, 1.0, y, nullptr, p.rows, p.n, stream);
      }
      return launch_bias_act_fused<T, Act, false>(p, stream);
    });
  });
}

// ---------------------------------------------------------------------------------------
// The backward ladder (fused_bias_scale_relu's; bias_gelu and bias_silu use v2):
//   v1  masked_grad_kernel writes g = dy * act'(z), scale_kernel dx = g * scale, column_sum
//       reduces g: g written and read twice more, and column_sum walks all the rows with one
//       block per column tile;
//   v2  act_backward_tile_kernel: dy and the saved tensor read once, dx written once, g summed
//       in registers and across each tile's rows in shared memory; one row tile writes dbias
//       itself, more write partial rows that the last block of each column tile adds in the
//       same launch, or column_sum where they are many (course::grad_tiling,
//       course::grad_finishes_in_kernel).
// ---------------------------------------------------------------------------------------
cudaError_t act_backward_workspace(const ActBackwardParams& p, BackwardVersion version, int64_t* bytes) {
  return with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    if (version == BackwardVersion::kSeparate) {
      *bytes = p.rows * p.n * static_cast<int64_t>(sizeof(T));
      return cudaSuccess;
    }
    return fused_backward_workspace<T>(p, bytes);
  });
}

cudaError_t launch_act_backward(const ActBackwardParams& p, BackwardVersion version, cudaStream_t stream) {
  return with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    return with_activation(p.act, [&](auto act) -> cudaError_t {
      using Act = decltype(act);
      return with_source(p.source, [&](auto source) -> cudaError_t {
        constexpr SaveKind kSource = decltype(source)::value;
        // Only relu's derivative is a sign, which y or a mask can stand in for; the glue never
        // asks for other combinations, and they are not instantiated.
        if constexpr (kSource != SaveKind::kInput && !std::is_same_v<Act, Relu>) {
          return cudaErrorInvalidValue;
        } else {
          if (version == BackwardVersion::kFused) return launch_fused_backward<T, Act, kSource>(p, stream);
          auto* g = static_cast<T*>(p.workspace);
          unsigned blocks = 0;
          COURSE_CUDA_TRY(flat_blocks(p.rows * p.n, kFlatThreads, &blocks));
          masked_grad_kernel<T, Act, kSource><<<blocks, kFlatThreads, 0, stream>>>(
              static_cast<const T*>(p.dy), static_cast<const T*>(p.saved), p.mask, static_cast<const T*>(p.bias),
              static_cast<typename Acc<T>::type>(p.scale), g, p.rows, p.n);
          COURSE_CUDA_TRY(cudaGetLastError());
          COURSE_CUDA_TRY(launch_scale<T>(g, p.scale, static_cast<T*>(p.dx), p.rows * p.n, stream));
          return course::column_sum<T, T>(g, p.rows, p.n, static_cast<T*>(p.dbias), stream);
        }
      });
    });
  });
}

// swiglu: v1 two kernels (silu(a), then the product), v2 one flat kernel (swiglu_flat_kernel).
cudaError_t launch_swiglu(const SwigluParams& p, ActVersion version, cudaStream_t stream) {
  return with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    const auto* x = static_cast<const T*>(p.x);
    auto* y = static_cast<T*>(p.y);
    if (version == ActVersion::kUnfused) {
      unsigned blocks = 0;
      COURSE_CUDA_TRY(flat_blocks(p.rows * p.half, kFlatThreads, &blocks));
      silu_half_kernel<T><<<blocks, kFlatThreads, 0, stream>>>(x, y, p.rows, p.half);
      COURSE_CUDA_TRY(cudaGetLastError());
      mul_half_kernel<T><<<blocks, kFlatThreads, 0, stream>>>(x, y, p.rows, p.half);
      return cudaGetLastError();
    }
    return launch_swiglu_flat<T, false>(x, nullptr, y, p.rows, p.half, stream);
  });
}

cudaError_t launch_swiglu_backward(const SwigluBackwardParams& p, cudaStream_t stream) {
  return with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    const auto* dy = static_cast<const T*>(p.dy);
    const auto* x = static_cast<const T*>(p.x);
    auto* dx = static_cast<T*>(p.dx);
    const bool x_aligned = course::is_aligned(x, 16) && course::is_aligned(dx, 16);
    if (swiglu_backward_kernel(p.half, static_cast<int>(sizeof(T)), x_aligned) == SwigluBackwardKernel::kFlat) {
      return launch_swiglu_flat<T, true>(x, dy, dx, p.rows, p.half, stream);
    }
    Tiling t;
    COURSE_CUDA_TRY(make_tiling(p.rows, p.half, 1, &t));
    swiglu_backward_tile_kernel<T><<<t.grid, kTileThreads, 0, stream>>>(dy, x, dx, p.rows, p.half, t.tx);
    return cudaGetLastError();
  });
}

}  // namespace elementwise
}  // namespace fusion
