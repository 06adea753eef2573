// Plain C++ interface between the torch glue (memory_ops.cpp) and the CUDA kernels
// (memory_kernels.cu). No torch and no CUDA types here: the glue must also compile on a
// machine without the CUDA toolkit, and the kernels with a bare `nvcc -c`.
//
// Every op of this chapter only moves data, so the kernels never look at values: they are
// instantiated per element *size* (2, 4 or 8 bytes), not per dtype. float16 and bfloat16 run
// the same 2-byte kernels, float64 the 8-byte ones.
#pragma once

#include <course/index_math.h>

#include <cstdint>

namespace memory_ops {

// copy's ladder (memory_kernels.cu): one element per thread per grid-stride step, then
// 16 bytes per access with several accesses in flight.
enum class CopyVersion { kScalar, kVectorized };

// transpose's ladder, in teaching order (memory_kernels.cu says what each one fixes).
enum class TransposeVersion { kNaive, kTiled, kTiledPadded, kWideTiles, kWideTilesAnyAlignment };

struct CopyParams {
  CopyVersion version;
  int elem_bytes;   // 2, 4 or 8
  const void* src;  // n contiguous elements
  void* dst;        // n contiguous elements, written exactly once each
  int64_t n;        // may exceed 2^31: indices are 64-bit
};

// dst[i] = src[i * stride] for i < n_out: the elements a strided view would see.
struct StridedCopyParams {
  int elem_bytes;
  const void* src;  // contiguous, at least (n_out - 1) * stride + 1 elements
  void* dst;        // n_out contiguous elements
  int64_t n_out;
  int64_t stride;   // >= 1
};

// dst[b][c][r] = src[b * batch_stride + r * row_stride + c * col_stride]: the last two dims
// of a (batch, rows, cols) tensor swapped into a contiguous (batch, cols, rows) one. The
// source strides are read as they are, so a non-contiguous input needs no copy first.
struct TransposeParams {
  TransposeVersion version;
  int elem_bytes;
  const void* src;
  void* dst;
  int64_t batch, rows, cols;
  int64_t batch_stride, row_stride, col_stride;  // source strides, in elements (>= 0)
};

// v4's 16-byte accesses need every source and destination row to start on a 16-byte
// boundary: cols and rows multiples of the vector, a unit column stride, aligned pointers and
// strides. (v5 needs only the unit column stride.)
inline bool wide_tiles_apply(const TransposeParams& p) {
  const int64_t vec = 16 / p.elem_bytes;
  return p.col_stride == 1 && p.cols % vec == 0 && p.rows % vec == 0 && p.row_stride % vec == 0 &&
         (p.batch == 1 || p.batch_stride % vec == 0) && course::is_aligned(p.src, 16) &&
         course::is_aligned(p.dst, 16);
}

// x whose memory already holds the transpose, in order: x.t() of a contiguous matrix (or
// x.transpose(-2, -1) of a contiguous batch). Its "transpose" is a plain copy.
inline bool stored_transposed(const TransposeParams& p) {
  return p.row_stride == 1 && p.col_stride == p.rows &&
         (p.batch == 1 || p.batch_stride == p.rows * p.cols);
}

// A thin matrix: one of the two transposed dims holds at most kThinMaxShort elements (3 x
// 1000003, 32 x 1000003, a batch of (n, 4) tensors). The tile rungs cut both dims into tiles
// of a fixed size: v4 and v5 own 128 rows of 128 bytes of columns, v1-v3 32 x 32 elements, so
// a short dim leaves most of each tile empty and the time per tile barely changes (3 valid
// rows idle 98% of v5's tile; 17 rows, 87%). The thin kernels (memory_kernels.cu) cut the long
// dim instead: a block takes a strip of it, all of the short dim, and stages it in shared memory
// so that the side that is one contiguous run of memory (the destination for short rows, the
// source for short columns) moves in 16-byte vectors, and the other side in one segment per
// short index.
// Why 64, by construction, from what each kind of block moves:
//   - the thin strip is 8 KiB of the run, and its long extent is the largest power of two that
//     fits: at most 64 short indices leave every segment at least 8192 / 64 = 128 bytes, one
//     whole cache line (4 sectors) per short index, whatever the element size; above 64 the
//     segments drop to 64 bytes and below;
//   - v5's tile is at least half full from 64 short rows on: 64 fill half of its 128 rows, 65
//     to 128 more than half, fewer than 64 less than half.
// So at 64 the two meet: a strip whose segments are whole lines against a tile at least half
// full; above it the strip's segments split lines. (The H200 probe measured v5 at 0.22-0.53x
// PyTorch at 17 and 32 short rows, 1.06-1.08x at 64.) Short columns fill S x size bytes of the
// tile's 128-byte line of columns, so there v5's waste depends on the dtype (none at 32 float32
// columns, three quarters at 17 bfloat16 ones) and the thin kernels' does not: one bound serves
// both orientations.
constexpr int64_t kThinMaxShort = 64;

inline bool thin_applies(const TransposeParams& p) {
  return p.rows <= kThinMaxShort || p.cols <= kThinMaxShort;
}

// Whether the thin kernels move a 2-byte matrix's segments as pairs, two elements to a 4-byte
// word (memory_kernels.cu, thin_pair_first): only where the segments are stores, short columns
// (thin_cols writes each destination row's elements, always contiguous; rows > cols >= 1 puts
// at least 2 of them in a tile). Measured on the H100 (bfloat16 and float16 alike), the pairs
// won as stores, 1000003 x 3 from 0.81x to 1.04x PyTorch and 1000003 x 17 to 48 by 5-10%, and
// lost as the loads of short rows, 3, 17, 24, 32 and 48 x 1000003 from 0.80-1.19x to
// 0.65-0.85x. The likely reading (not profiled): a warp's single 2-byte loads already fill
// whole 32-byte sectors, so pairs there halve only the load instructions, while each item then
// makes two scattered 2-byte tile stores and pays the pair's head and guard arithmetic, in the
// phase that must finish before the tile's barrier.
inline bool thin_pairs_apply(const TransposeParams& p) {
  return p.elem_bytes == 2 && p.rows > p.cols;
}

// ---------------------------------------------------------------------------------------
// version=None for transpose: the one place where the chapter decides (measured on the H100;
// the README's "version=None" section shows the numbers).
//   - memory already in transposed order: a copy (copy v2), at the copy ceiling;
//   - one transposed dim of at most kThinMaxShort (thin_applies): the thin kernels, whatever
//     the strides and alignment (the H200 shapes sweep measured v5 at 0.04-0.17x PyTorch on
//     3 x 1000003 and 1000003 x 3, in every dtype: its 128-row tile was 98% empty; the H200
//     probe, 0.22-0.53x at 17 and 32 short rows);
//   - rows 16-byte aligned on both sides: v4, the fastest rung at every aligned size measured,
//     from 256^2 up (v5 does the same work plus the per-segment alignment arithmetic);
//   - any other unit-stride input (odd shapes, x[:, 1:]): v5;
//   - columns not adjacent in memory (x[:, ::2]): v3, the padded tile, which gathers single
//     elements anyway.
// ---------------------------------------------------------------------------------------
enum class TransposeRoute { kCopy, kThin, kRung };
struct TransposeChoice {
  TransposeRoute route;
  TransposeVersion version;  // when route == kRung
};

inline TransposeChoice default_transpose(const TransposeParams& p) {
  if (stored_transposed(p)) return {TransposeRoute::kCopy, TransposeVersion::kWideTiles};
  if (thin_applies(p)) return {TransposeRoute::kThin, TransposeVersion::kWideTiles};
  if (wide_tiles_apply(p)) return {TransposeRoute::kRung, TransposeVersion::kWideTiles};
  if (p.col_stride == 1) return {TransposeRoute::kRung, TransposeVersion::kWideTilesAnyAlignment};
  return {TransposeRoute::kRung, TransposeVersion::kTiledPadded};
}

// The CPU implementations (memory_cpu.cpp): the reference semantics in C++, taking the same
// params as the CUDA launchers. `version` is ignored there: the ladder is a set of GPU thread
// mappings, and the CPU has one loop.
void copy_cpu(const CopyParams& params);
void strided_copy_cpu(const StridedCopyParams& params);
void transpose_cpu(const TransposeParams& params);

// Calls f(T{}) with T the unsigned integer of `elem_bytes` bytes, and returns what f returns;
// any other size calls unsupported(). Shared by the CUDA launchers and the CPU loops.
template <typename F, typename Unsupported>
auto with_element_type(int elem_bytes, F&& f, Unsupported&& unsupported) {
  switch (elem_bytes) {
    case 2: return f(uint16_t{});
    case 4: return f(uint32_t{});
    case 8: return f(uint64_t{});
    default: return unsupported();
  }
}

}  // namespace memory_ops

#if defined(__CUDACC__) || defined(WITH_CUDA)
#include <cuda_runtime_api.h>
namespace memory_ops {
// Each launcher runs on `stream`, returns the launch error (or cudaSuccess) and never
// synchronizes. Empty problems launch nothing.
cudaError_t launch_copy(const CopyParams& params, cudaStream_t stream);
cudaError_t launch_strided_copy(const StridedCopyParams& params, cudaStream_t stream);
cudaError_t launch_transpose(const TransposeParams& params, cudaStream_t stream);
// The thin kernels; params.version is ignored. Only for thin_applies(params): anything else
// returns cudaErrorInvalidValue and launches nothing.
cudaError_t launch_transpose_thin(const TransposeParams& params, cudaStream_t stream);
}  // namespace memory_ops
#endif
