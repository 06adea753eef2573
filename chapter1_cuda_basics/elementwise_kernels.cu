// Chapter 1 kernels: the elementwise ladder for vector_add, saxpy and relu.
//
// One memory-bound pattern, five ways. Every version computes out[i] = f(a[i], b[i]) over n
// contiguous elements, so the only thing that changes from rung to rung is how threads are
// mapped onto memory. Napkin math for vector_add at n = 2^28 fp32: 3 * 4 B * 2^28 = 3.2 GB must
// cross HBM (read a, read b, write out); at the ~3 TB/s an H100 copies at, that is ~1.07 ms.
// Nothing here can beat that; the ladder is about how close each mapping gets.
//
// No torch headers: this file builds with a bare `nvcc -c` and reads like plain CUDA.
#include "elementwise.h"

#include <course/cuda_utils.h>
#include <course/numeric.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>
#include <cstring>

namespace cuda_basics {
namespace {

// 256 threads = 8 warps: a multiple of the 32-thread warp, and small enough that 8 blocks fit
// on an SM (2048 resident threads on sm_80/sm_90, 1024 on sm_75), so occupancy is not limited
// by block granularity.
constexpr int kBlockThreads = 256;

// Arithmetic: fp16 and bf16 are widened to fp32 and rounded once at the store (course::Acc,
// to_acc and from_acc in course/numeric.cuh, shared with the later chapters).
using course::Acc;
using course::from_acc;
using course::to_acc;

template <typename A> struct AddFn {
  __device__ A operator()(A a, A b) const { return a + b; }
};
template <typename A> struct SaxpyFn {
  A alpha;
  __device__ A operator()(A x, A y) const { return alpha * x + y; }
};
template <typename A> struct ReluFn {
  // `x < 0 ? 0 : x` rather than `x > 0 ? x : 0` so that NaN propagates, as torch.relu does.
  __device__ A operator()(A x, A) const { return x < A(0) ? A(0) : x; }
};

// out[i] for one element. Unary ops never touch b (it is nullptr for them).
template <bool kBinary, typename T, typename Fn>
__device__ __forceinline__ T apply(const Fn& fn, const T* __restrict__ a, const T* __restrict__ b,
                                   int64_t i) {
  using A = typename Acc<T>::type;
  const A x = to_acc(a[i]);
  A y = A(0);
  if constexpr (kBinary) y = to_acc(b[i]);
  return from_acc<T>(fn(x, y));
}

// ---------------------------------------------------------------------------------------------
// Teaching foil: uncoalesced. Each thread owns one contiguous chunk of `chunk` elements, the
// layout a CPU programmer would pick. On a GPU it is the worst one: at every step the 32 lanes
// of a warp touch 32 addresses `chunk` elements apart, so one warp-wide load needs 32 separate
// 32-byte sectors instead of 4 (fp32) and uses 4 of every 32 bytes it fetches; the rest must
// survive in L1/L2 until the lane comes back for its next element, and mostly does not.
// ---------------------------------------------------------------------------------------------
template <bool kBinary, typename T, typename Fn>
__global__ void elementwise_uncoalesced(Fn fn, const T* __restrict__ a, const T* __restrict__ b,
                                        T* __restrict__ out, int64_t n, int64_t chunk) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t begin = thread * chunk;
  // The last busy thread's chunk is cut short at n; threads past it get an empty range.
  const int64_t end = begin + chunk < n ? begin + chunk : n;
  for (int64_t i = begin; i < end; ++i) out[i] = apply<kBinary>(fn, a, b, i);
}

// ---------------------------------------------------------------------------------------------
// v1: one thread per element. Lane k of a warp touches element base + k, so a warp's 32 loads
// coalesce into one 128-byte request (fp32): every fetched byte is used. Costs: a grid of
// n / 256 blocks (a million at 2^28), and each thread keeps one 4-byte load in flight.
// ---------------------------------------------------------------------------------------------
template <bool kBinary, typename T, typename Fn>
__global__ void elementwise_thread_per_element(Fn fn, const T* __restrict__ a,
                                               const T* __restrict__ b, T* __restrict__ out,
                                               int64_t n) {
  // 64-bit: blockIdx.x * blockDim.x overflows int once n passes 2^31.
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // The last block overhangs n unless n is a multiple of kBlockThreads.
  if (i < n) out[i] = apply<kBinary>(fn, a, b, i);
}

// ---------------------------------------------------------------------------------------------
// v2: grid-stride loop. The grid is sized from the SM count (just enough blocks to fill every
// SM once) and each thread strides through the array by the grid's width, so accesses stay
// coalesced while block scheduling and index setup are paid once per thread instead of once
// per element. Any n works with any grid; this is also the fallback when v3/v4 cannot
// vectorize a misaligned view.
// ---------------------------------------------------------------------------------------------
template <bool kBinary, typename T, typename Fn>
__global__ void elementwise_grid_stride(Fn fn, const T* __restrict__ a, const T* __restrict__ b,
                                        T* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = apply<kBinary>(fn, a, b, i);
  }
}

// 16-byte vectors and their explicit 128-bit accesses: course/numeric.cuh.
using course::load16;
using course::store16;
using course::Vec16;

// The three arrays seen as whole 16-byte vectors; `n` counts vectors, the tail is left over.
template <typename T> struct VecArrays {
  const Vec16<T>* a;
  const Vec16<T>* b;
  Vec16<T>* out;
  int64_t n;
  __device__ VecArrays(const T* a_, const T* b_, T* out_, int64_t elements)
      : a(reinterpret_cast<const Vec16<T>*>(a_)), b(reinterpret_cast<const Vec16<T>*>(b_)),
        out(reinterpret_cast<Vec16<T>*>(out_)), n(elements / Vec16<T>::kLanes) {}
};

template <bool kBinary, typename T, typename Fn>
__device__ __forceinline__ Vec16<T> apply_vec(const Fn& fn, const Vec16<T>& x, const Vec16<T>& y) {
  Vec16<T> r;
#pragma unroll
  for (int k = 0; k < Vec16<T>::kLanes; ++k) {
    typename Acc<T>::type yk = 0;
    if constexpr (kBinary) yk = to_acc(y.v[k]);
    r.v[k] = from_acc<T>(fn(to_acc(x.v[k]), yk));
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// v3: 128-bit vectorized grid-stride loop. Each thread moves 16 bytes per load instead of 4
// (fp32) or 2 (fp16/bf16): a quarter (an eighth) of the load/store instructions for the same
// bytes, and four (eight) times the bytes in flight per thread, which is what a memory-bound
// kernel needs to cover HBM latency. The last n % kLanes elements do not fill a vector and are
// done by a scalar tail.
// ---------------------------------------------------------------------------------------------
template <bool kBinary, typename T, typename Fn>
__global__ void elementwise_vectorized(Fn fn, const T* __restrict__ a, const T* __restrict__ b,
                                       T* __restrict__ out, int64_t n) {
  const VecArrays<T> vec(a, b, out, n);
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = tid; v < vec.n; v += stride) {
    Vec16<T> y;  // unary ops never read it
    if constexpr (kBinary) y = load16(vec.b + v);
    store16(vec.out + v, apply_vec<kBinary>(fn, load16(vec.a + v), y));
  }
  // Scalar tail: fewer than kLanes (<= 8) elements, so the first few threads of block 0 suffice.
  const int64_t i = vec.n * Vec16<T>::kLanes + tid;
  if (i < n) out[i] = apply<kBinary>(fn, a, b, i);
}

// ---------------------------------------------------------------------------------------------
// v4: vectorized + instruction-level parallelism. Each thread first issues kVectors independent
// 16-byte loads per input, then computes, then stores: kVectors times the bytes in flight per
// thread compared with v3, where each iteration's loads wait for the previous iteration's.
// Consecutive lanes still take consecutive vectors (stride blockDim.x between a thread's
// vectors), so every warp-wide access is 512 contiguous bytes. The grid is one pass over the
// data (no stride loop), the shape PyTorch's own vectorized elementwise kernel uses. v4
// launches it as 256 threads x 4 vectors at every size.
//
// v5: the same kernel, one 16-byte vector per thread (kV5Launch in elementwise.h). v4's 4
// vectors per thread and 256 threads make 1024 vectors per block, so a 2^16-element float32
// add gets 16 blocks for 132 SMs: most of the GPU idles, and the kernel takes one DRAM round
// trip however little it moves. One vector per thread gives 4x the blocks at every size, and
// the tuning sweep (tune_cuda_basics.py) found it as fast as v4 at 2^28 too: with a one-pass
// grid, blocks that finish are replaced at once, so the SMs hold as many loads in flight as
// v4's unrolled threads do. PyTorch's kernel sits between the two: 128 threads x 8 elements.
// ---------------------------------------------------------------------------------------------
template <int kVectors, bool kBinary, typename T, typename Fn>
__global__ void elementwise_vectorized_ilp(Fn fn, const T* __restrict__ a, const T* __restrict__ b,
                                           T* __restrict__ out, int64_t n) {
  const VecArrays<T> vec(a, b, out, n);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x * kVectors + threadIdx.x;

  Vec16<T> x[kVectors];
  Vec16<T> y[kVectors];
#pragma unroll
  for (int u = 0; u < kVectors; ++u) {
    const int64_t v = first + static_cast<int64_t>(u) * blockDim.x;
    // The last block runs past n_vec unless n_vec is a multiple of blockDim.x * kVectors.
    if (v < vec.n) {
      x[u] = load16(vec.a + v);
      if constexpr (kBinary) y[u] = load16(vec.b + v);
    }
  }
#pragma unroll
  for (int u = 0; u < kVectors; ++u) {
    const int64_t v = first + static_cast<int64_t>(u) * blockDim.x;
    if (v < vec.n) store16(vec.out + v, apply_vec<kBinary>(fn, x[u], y[u]));
  }
  // Scalar tail (< kLanes elements): block 0's first threads, as in v3 (every launch shape has
  // at least 64 threads, more than the 8 lanes a tail can need).
  const int64_t i = vec.n * Vec16<T>::kLanes + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = apply<kBinary>(fn, a, b, i);
}

// ---------------------------------------------------------------------------------------------
// v5 on a misaligned view (x[1:]: pointers 2-8 bytes past a 16-byte boundary). No 16-byte
// access is possible, so v3 and v4 fall back to v2, one element per thread in flight. v5 keeps
// its shape instead: each thread loads the kLanes elements a vector would hold, one by one
// but all before the first is used (lane k of the warp takes element base + u * blockDim + k,
// so each of the kLanes loads is coalesced), which puts the same 16 bytes per thread in
// flight as the vector does. PyTorch's kernel for unaligned inputs does the same (its
// "unrolled" loop: several scalar loads per thread, issued together).
// ---------------------------------------------------------------------------------------------
template <bool kBinary, typename T, typename Fn>
__global__ void elementwise_scalar_ilp(Fn fn, const T* __restrict__ a, const T* __restrict__ b,
                                       T* __restrict__ out, int64_t n) {
  constexpr int kPerThread = Vec16<T>::kLanes;
  const int64_t first =
      static_cast<int64_t>(blockIdx.x) * blockDim.x * kPerThread + threadIdx.x;
  T x[kPerThread];
  T y[kPerThread];
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int64_t i = first + static_cast<int64_t>(u) * blockDim.x;
    if (i < n) {  // the last block runs past n unless n is a multiple of its elements
      x[u] = a[i];
      if constexpr (kBinary) y[u] = b[i];
    }
  }
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int64_t i = first + static_cast<int64_t>(u) * blockDim.x;
    if (i < n) {
      typename Acc<T>::type yu = 0;
      if constexpr (kBinary) yu = to_acc(y[u]);
      out[i] = from_acc<T>(fn(to_acc(x[u]), yu));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launch configuration, from n and the device.
// ---------------------------------------------------------------------------------------------
template <typename Kernel>
cudaError_t launch_checked(Kernel kernel, int64_t blocks, cudaStream_t stream,
                           const void* const* args, int threads = kBlockThreads) {
  // gridDim.x is at most 2^31 - 1; only v1 (one thread per element) could ask for more, past
  // 5 * 10^11 elements, and it cannot shrink its grid without becoming v2.
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  return cudaLaunchKernel(reinterpret_cast<const void*>(kernel), dim3(static_cast<unsigned>(blocks)),
                          dim3(threads), const_cast<void**>(args), 0, stream);
}

// The one-pass vectorized kernel in a given shape: one pass over n / kLanes vectors, at least
// one block (for the scalar tail when n < kLanes).
template <bool kBinary, typename T, typename Fn>
cudaError_t launch_vectorized_ilp(const Fn& fn, const T* a, const T* b, T* out, int64_t n,
                                  VectorLaunch shape, cudaStream_t stream) {
  // The tail needs kLanes threads in block 0, and a block is at most 1024 threads.
  if (shape.threads < 64 || shape.threads > 1024 || shape.threads % 32 != 0) {
    return cudaErrorInvalidConfiguration;
  }
  const int64_t needed = course::ceil_div<int64_t>(n / Vec16<T>::kLanes,
                                                   int64_t{shape.threads} * shape.vectors);
  const void* args[] = {&fn, &a, &b, &out, &n};
  const int64_t blocks = needed < 1 ? 1 : needed;
  switch (shape.vectors) {
    case 1:
      return launch_checked(elementwise_vectorized_ilp<1, kBinary, T, Fn>, blocks, stream, args,
                            shape.threads);
    case 2:
      return launch_checked(elementwise_vectorized_ilp<2, kBinary, T, Fn>, blocks, stream, args,
                            shape.threads);
    case 4:
      return launch_checked(elementwise_vectorized_ilp<4, kBinary, T, Fn>, blocks, stream, args,
                            shape.threads);
  }
  return cudaErrorInvalidConfiguration;
}

template <bool kBinary, typename T, typename Fn>
cudaError_t launch_typed(const Fn& fn, const ElementwiseParams& p, cudaStream_t stream) {
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  T* out = static_cast<T*>(p.out);
  int64_t n = p.n;
  const int64_t per_element_blocks = course::ceil_div<int64_t>(n, kBlockThreads);

  KernelVersion version = p.version;
  const bool vector_ok = course::is_aligned(a, 16) && course::is_aligned(out, 16) &&
                         (!kBinary || course::is_aligned(b, 16));
  // A view that starts mid-vector (x[1:]) cannot use 16-byte accesses: v3 and v4 fall back
  // to v2; v5 runs its scalar form (elementwise_scalar_ilp).
  if ((version == KernelVersion::kV3 || version == KernelVersion::kV4) && !vector_ok) {
    version = KernelVersion::kV2;
  }

  switch (version) {
    case KernelVersion::kUncoalesced: {
      auto kernel = elementwise_uncoalesced<kBinary, T, Fn>;
      int64_t blocks = 0;
      COURSE_CUDA_TRY(course::resident_grid(kernel, kBlockThreads, &blocks));
      int64_t chunk = course::ceil_div<int64_t>(n, blocks * kBlockThreads);
      const void* args[] = {&fn, &a, &b, &out, &n, &chunk};
      return launch_checked(kernel, blocks, stream, args);
    }
    case KernelVersion::kV1: {
      const void* args[] = {&fn, &a, &b, &out, &n};
      return launch_checked(elementwise_thread_per_element<kBinary, T, Fn>, per_element_blocks,
                            stream, args);
    }
    case KernelVersion::kV2: {
      auto kernel = elementwise_grid_stride<kBinary, T, Fn>;
      int64_t blocks = 0;
      COURSE_CUDA_TRY(course::resident_grid(kernel, kBlockThreads, &blocks));
      const void* args[] = {&fn, &a, &b, &out, &n};
      return launch_checked(kernel, blocks < per_element_blocks ? blocks : per_element_blocks,
                            stream, args);
    }
    case KernelVersion::kV3: {
      auto kernel = elementwise_vectorized<kBinary, T, Fn>;
      int64_t blocks = 0;
      COURSE_CUDA_TRY(course::resident_grid(kernel, kBlockThreads, &blocks));
      const int64_t needed = course::ceil_div<int64_t>(n / Vec16<T>::kLanes, kBlockThreads);
      const void* args[] = {&fn, &a, &b, &out, &n};
      // At least one block, for the scalar tail when n < kLanes.
      return launch_checked(kernel, needed < 1 ? 1 : (needed < blocks ? needed : blocks), stream,
                            args);
    }
    case KernelVersion::kV4:
      return launch_vectorized_ilp<kBinary>(fn, a, b, out, n, {kBlockThreads, 4}, stream);
    case KernelVersion::kV5: {
      const VectorLaunch shape = p.launch.threads ? p.launch : kV5Launch;
      if (vector_ok) return launch_vectorized_ilp<kBinary>(fn, a, b, out, n, shape, stream);
      const void* args[] = {&fn, &a, &b, &out, &n};
      return launch_checked(elementwise_scalar_ilp<kBinary, T, Fn>,
                            course::ceil_div<int64_t>(n, int64_t{shape.threads} * Vec16<T>::kLanes),
                            stream, args, shape.threads);
    }
  }
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch_op(const ElementwiseParams& p, cudaStream_t stream) {
  using A = typename Acc<T>::type;
  switch (p.op) {
    case ElementwiseOp::kAdd:
      return launch_typed<true, T>(AddFn<A>{}, p, stream);
    case ElementwiseOp::kSaxpy:
      return launch_typed<true, T>(SaxpyFn<A>{static_cast<A>(p.alpha)}, p, stream);
    case ElementwiseOp::kRelu:
      return launch_typed<false, T>(ReluFn<A>{}, p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_elementwise(const ElementwiseParams& params, cudaStream_t stream) {
  if (params.n == 0) return cudaSuccess;  // a grid of zero blocks is an invalid launch
  switch (params.dtype) {
    case DType::kFloat32: return launch_op<float>(params, stream);
    case DType::kFloat16: return launch_op<__half>(params, stream);
    case DType::kBFloat16: return launch_op<__nv_bfloat16>(params, stream);
    case DType::kFloat64: return launch_op<double>(params, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda_basics
