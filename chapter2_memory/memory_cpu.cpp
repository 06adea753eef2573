// CPU implementations of chapter 2's ops: the reference semantics in C++, on the same params
// as the CUDA launchers, parallelised over the machine's cores with at::parallel_for.
#include "memory.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

namespace memory_ops {
namespace {

// The glue only passes 2, 4 or 8 bytes.
void unsupported_size() { TORCH_CHECK(false, "memory_ops: unsupported element size"); }

// Below this many elements per task, thread start-up costs more than the loop.
constexpr int64_t kGrain = 1 << 15;

// The CPU has caches too: a transpose that walks whole source rows writes its destination
// columns one cache line per element. Blocks of kCpuTile x kCpuTile keep both a source and a
// destination block (2 x 32 lines) in L1, the CPU version of the GPU's shared-memory tile.
constexpr int64_t kCpuTile = 32;

}  // namespace

void copy_cpu(const CopyParams& p) {
  at::parallel_for(0, p.n, kGrain, [&](int64_t begin, int64_t end) {
    std::memcpy(static_cast<char*>(p.dst) + begin * p.elem_bytes,
                static_cast<const char*>(p.src) + begin * p.elem_bytes,
                static_cast<size_t>(end - begin) * p.elem_bytes);
  });
}

void strided_copy_cpu(const StridedCopyParams& p) {
  with_element_type(p.elem_bytes, [&](auto tag) {
    using T = decltype(tag);
    const T* src = static_cast<const T*>(p.src);
    T* dst = static_cast<T*>(p.dst);
    at::parallel_for(0, p.n_out, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) dst[i] = src[i * p.stride];
    });
  }, unsupported_size);
}

void transpose_cpu(const TransposeParams& p) {
  if (p.batch == 0 || p.rows == 0 || p.cols == 0) return;
  with_element_type(p.elem_bytes, [&](auto tag) {
    using T = decltype(tag);
    const T* src = static_cast<const T*>(p.src);
    T* dst = static_cast<T*>(p.dst);
    const int64_t tiles_r = (p.rows + kCpuTile - 1) / kCpuTile;
    const int64_t tiles_c = (p.cols + kCpuTile - 1) / kCpuTile;
    const int64_t grain = std::max<int64_t>(1, kGrain / (kCpuTile * kCpuTile));
    at::parallel_for(0, p.batch * tiles_r * tiles_c, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b = t / (tiles_r * tiles_c);
        const int64_t r0 = (t / tiles_c) % tiles_r * kCpuTile;
        const int64_t c0 = t % tiles_c * kCpuTile;
        const int64_t r1 = std::min(r0 + kCpuTile, p.rows);
        const int64_t c1 = std::min(c0 + kCpuTile, p.cols);
        const T* s = src + b * p.batch_stride;
        T* d = dst + b * p.rows * p.cols;
        for (int64_t c = c0; c < c1; ++c) {
          for (int64_t r = r0; r < r1; ++r) d[c * p.rows + r] = s[r * p.row_stride + c * p.col_stride];
        }
      }
    });
  }, unsupported_size);
}

}  // namespace memory_ops
