// Plain C++ interface between the elementwise family's torch glue (elementwise_ops.cpp,
// elementwise_cpu.cpp) and its CUDA kernels (elementwise_kernels.cu: bias-scale-ReLU, bias-GELU,
// bias-SiLU, SwiGLU; linear_epilogue_kernels.cu: the bias + activation epilogue of a GEMM). No
// torch and no CUDA types: the glue must also compile without the CUDA toolkit, the kernels with
// a bare `nvcc -c`.
//
// Every op sees its input as a contiguous [rows, n] array: n = x.size(-1), the length of the
// bias, which broadcasts over the rows (every leading dim of x flattened into one).
#pragma once

#include <course/bias_act.h>
#include <course/dtype.h>
#include <course/index_math.h>

#include <cstdint>

namespace fusion {
namespace elementwise {

// The dtypes the kernels are instantiated for (course/dtype.h); the glue maps at::ScalarType onto it.
using DType = ::course::DType;

// The activations of activation.h, by name in the ops' arguments:
// relu, gelu (erf), gelu_tanh, silu.
enum class Activation { kRelu, kGeluErf, kGeluTanh, kSilu };

// What fused_bias_scale_relu keeps for its backward, which needs only the sign of the
// pre-activation z = x * scale + bias (course/bias_act.h, shared with chapter 5's fused_op):
//   kOutput (save="y"):   y itself (y > 0 exactly where z > 0): n elements of the dtype;
//   kInput (save="x"):    x, the sign recomputed from x * scale + bias: n elements, and the
//                         backward reads the bias again (x is often kept alive anyway);
//   kMask (save="mask"):  one bit per element, written by the forward: 4 ceil(n / 32) bytes a
//                         row, n / 8 for rows of a multiple of 32 elements.
// At a NaN z every choice lets the gradient through, as torch's threshold_backward does.
using SaveKind = ::course::SaveKind;
using ::course::mask_words_per_row;

// fused_bias_scale_relu's forward ladder (elementwise_kernels.cu says what each rung changes).
enum class BsrVersion {
  kThreeKernels,  // v1: scale, add bias, relu: eager's three trips through memory
  kFused,         // v2: one kernel, scalar loads, a warp per 32 adjacent columns of a row
  kVectorized,    // v3: 16-byte loads: the bias tile kept by every thread across rows, or the flat map
};

// The backward ladder of fused_bias_scale_relu (and the kernel every other backward here uses).
enum class BackwardVersion {
  kSeparate,  // v1: g = dy * act'(z) written out, dx = g * scale, then a column sum of g
  kFused,     // v2: one pass writes dx and per-block column partials of g; a small column sum
};

// The ladder of bias_gelu, bias_silu and swiglu.
enum class ActVersion {
  kUnfused,  // v1: bias add, then the activation (swiglu: silu(a), then the product)
  kFused,    // v2: one kernel, 16-byte loads, the bias tile reused by every row (swiglu: one flat walk)
};

// linear_activation's epilogue ladder (the GEMM is cuBLAS through ATen in both).
enum class LinearVersion {
  kUnfused,        // GEMM, a bias kernel, an activation kernel
  kFusedEpilogue,  // GEMM, one bias + activation kernel
};

// y = act(x * scale + bias), over rows of n:
//   bias  n elements, or null (no bias: linear's activation kernel after a separate bias kernel);
//   pre   null, or where z = x * scale + bias is stored as well (linear_activation keeps it for
//         its backward; it may be x itself: the epilogue then runs in place);
//   mask  null, or rows * mask_words_per_row(n) words that receive z > 0 (act must be relu);
//   y     may be x (in place).
struct BiasActParams {
  DType dtype;
  Activation act;
  const void* x;
  const void* bias;
  double scale;
  void* y;
  void* pre;
  uint32_t* mask;
  int64_t rows, n;
};

// The backward of y = act(x * scale + bias), from what the forward kept (`source`):
//   g = dy * act'(z);  dx = g * scale;  dbias[c] = sum over rows of g[r, c]
// kInput: saved is x and z = x * scale + bias is recomputed (bias may be null: linear's saved z,
// with scale 1); kOutput: saved is y and act must be relu (z > 0 iff y > 0); kMask: mask holds
// the signs and act must be relu.
struct ActBackwardParams {
  DType dtype;
  Activation act;
  SaveKind source;
  const void* dy;
  const void* saved;
  const uint32_t* mask;
  const void* bias;
  double scale;
  void* dx;
  void* dbias;  // n elements of dtype
  int64_t rows, n;
  void* workspace;  // act_backward_workspace bytes
};

// swiglu: x is [rows, 2 * half]: a = x[:, :half], b = x[:, half:]; y = silu(a) * b, [rows, half].
// The backward: da = dy * b * silu'(a), db = dy * silu(a), into dx of x's shape.
struct SwigluParams {
  DType dtype;
  const void* x;
  void* y;
  int64_t rows, half;
};
struct SwigluBackwardParams {
  DType dtype;
  const void* dy;
  const void* x;
  void* dx;
  int64_t rows, half;
};

// swiglu's v2, forward and backward, is one flat kernel over the rows * half elements of y (of dy
// in the backward, where x's rows start on 16-byte boundaries: swiglu_backward_kernel below), a
// 16-byte vector a thread (elementwise_kernels.cu). Its grid, from the vector
// count and the SM count read off the device: blocks of kSwigluMaxThreads while that still gives
// every SM kSwigluBlocksPerSm blocks, else halved, down to kSwigluMinThreads, so that a few rows
// spread over every SM (64 x 2048 in bf16 is 16384 vectors: 64 blocks of 256 would leave half of
// a 132-SM GPU idle; 256 blocks of 64 give each SM about two). Below two warps a block stops paying: an
// SM keeps at most 32 blocks, and a warp of fewer than 32 vectors would idle lanes.
constexpr int kSwigluMaxThreads = 256;
constexpr int kSwigluMinThreads = 64;
constexpr int kSwigluBlocksPerSm = 2;
struct SwigluGrid {
  int threads;      // per block
  int64_t blocks;
  int64_t vectors;  // whole 16-byte vectors after the `head` elements before the first boundary
};
inline SwigluGrid swiglu_grid(int64_t rows, int64_t half, int elem_bytes, int head, int sms) {
  const int64_t total = rows * half;
  const int64_t lanes = 16 / elem_bytes;
  const int64_t vectors = total > head ? (total - head) / lanes : 0;
  int threads = kSwigluMaxThreads;
  while (threads > kSwigluMinThreads &&
         ::course::ceil_div(vectors, static_cast<int64_t>(threads)) < static_cast<int64_t>(kSwigluBlocksPerSm) * sms) {
    threads /= 2;
  }
  const int64_t blocks = ::course::ceil_div(vectors, static_cast<int64_t>(threads));
  return {threads, blocks > 1 ? blocks : 1, vectors};  // one block at least: it also takes the single elements
}

// swiglu's backward: the flat kernel only where every row of x (and of dx) starts on a 16-byte
// boundary: half * elem_bytes a multiple of 16 and x's first element on a boundary (dx is fresh;
// dy's own alignment the flat walk handles, its first elements single ones). Elsewhere the column
// tiles of single elements (swiglu_backward_tile_kernel). Why: off a boundary the flat backward
// shifts two loads (a and b) and writes da and db element by element, as many instructions per
// byte as the tiles' single elements plus the shifts, and measured it took about twice the tiles'
// time at every odd width (NOTES.md); on a boundary it is all 16-byte accesses, as fast as the
// tiles or faster at every row count measured (a few rows fill the GPU: swiglu_grid).
enum class SwigluBackwardKernel { kFlat, kTiles };
inline SwigluBackwardKernel swiglu_backward_kernel(int64_t half, int elem_bytes, bool x_aligned) {
  return (half * elem_bytes) % 16 == 0 && x_aligned ? SwigluBackwardKernel::kFlat : SwigluBackwardKernel::kTiles;
}

// ---------------------------------------------------------------------------------------
// version=None: the top rung everywhere (test_recorded_results_hold_the_dispatch holds it within
// 0.95x of the fastest rung at every measured shape and dtype). Its launchers choose the kernel by
// themselves from the shape and the pointers: v3's between the column tiles and the flat kernel
// (course::launch_bias_act), the vectorized kernels of the other ops between 16-byte and
// single-element accesses; swiglu's v2 its block size (swiglu_grid) and between plain and
// shifted 16-byte loads, its backward between the flat walk and the column tiles
// (swiglu_backward_kernel).
// ---------------------------------------------------------------------------------------
inline BsrVersion default_bsr(int64_t /*rows*/, int64_t /*n*/, int /*elem_bytes*/) { return BsrVersion::kVectorized; }
inline BackwardVersion default_backward(int64_t /*rows*/, int64_t /*n*/, int /*elem_bytes*/) {
  return BackwardVersion::kFused;
}
inline ActVersion default_act(int64_t /*rows*/, int64_t /*n*/, int /*elem_bytes*/) { return ActVersion::kFused; }
inline LinearVersion default_linear(int64_t /*rows*/, int64_t /*n*/, int /*elem_bytes*/) {
  return LinearVersion::kFusedEpilogue;
}

// The CPU implementations (elementwise_cpu.cpp): the reference semantics in C++, on the same
// params, each rounding once to the dtype (the GPU's fused rungs do too; v1's separate kernels
// round their intermediates to the dtype as eager does). Versions are GPU thread mappings and
// are not taken. Sums over rows are split into fixed chunks combined in order: deterministic.
void bias_act_cpu(const BiasActParams& params);
void act_backward_cpu(const ActBackwardParams& params);
void swiglu_cpu(const SwigluParams& params);
void swiglu_backward_cpu(const SwigluBackwardParams& params);

}  // namespace elementwise
}  // namespace fusion

#if defined(__CUDACC__) || defined(WITH_CUDA)
#include <cuda_runtime_api.h>
namespace fusion {
namespace elementwise {
// Each launcher runs on `stream`, returns the launch error (or cudaSuccess) and never
// synchronizes. elementwise_kernels.cu:
cudaError_t launch_bias_scale_relu(const BiasActParams& params, BsrVersion version, cudaStream_t stream);
cudaError_t launch_bias_activation(const BiasActParams& params, ActVersion version, cudaStream_t stream);
// Bytes of scratch launch_act_backward needs (the caller allocates them, uninitialized).
cudaError_t act_backward_workspace(const ActBackwardParams& params, BackwardVersion version, int64_t* bytes);
cudaError_t launch_act_backward(const ActBackwardParams& params, BackwardVersion version, cudaStream_t stream);
cudaError_t launch_swiglu(const SwigluParams& params, ActVersion version, cudaStream_t stream);
cudaError_t launch_swiglu_backward(const SwigluBackwardParams& params, cudaStream_t stream);
// linear_epilogue_kernels.cu: z = h + bias and y = act(z) on the GEMM output h (params.x);
// params.pre = h keeps z for the backward, params.y = h runs in place.
cudaError_t launch_linear_epilogue(const BiasActParams& params, LinearVersion version, cudaStream_t stream);
// dz = dy * act'(z) and db, the backward's one elementwise kernel (saved = z, no bias, scale 1).
cudaError_t linear_epilogue_backward_workspace(const ActBackwardParams& params, int64_t* bytes);
cudaError_t launch_linear_epilogue_backward(const ActBackwardParams& params, cudaStream_t stream);
}  // namespace elementwise
}  // namespace fusion
#endif
