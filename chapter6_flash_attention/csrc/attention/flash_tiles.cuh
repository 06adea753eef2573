// Moving tiles between global and shared memory, for the tensor-core kernels of both passes
// (flash_fwd_kernel.cuh, flash_bwd_kernel.cuh). A tile's traits K give its threads, its 16-byte
// chunks per row, its layout (K::offset: padded or swizzled) and whether copies are cp.async.
#pragma once

#include "attention/mma.cuh"

#include <cstdint>

namespace flash_attention {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

// Rows [row0, row0 + kRows) of a (seqlen, d) slice into a tile, 16 bytes per thread per step,
// consecutive threads taking consecutive chunks of a row (coalesced). Rows past `rows` become
// zeros: the tiles at a sequence's end are partial, and a zero K row gives a finite score that
// the mask then replaces, a zero V row adds 0 * 0 (garbage could be NaN, and 0 * NaN is NaN).
template <typename K, int kRows, typename T>
__device__ __forceinline__ void load_tile(T* tile, const T* __restrict__ base, int64_t seq_stride, int64_t row0,
                                          int64_t rows) {
#pragma unroll
  for (int c = threadIdx.x; c < kRows * K::kChunks; c += K::kThreads) {
    const int r = c / K::kChunks;
    const int col = (c % K::kChunks) * 8;
    const bool valid = row0 + r < rows;
    const T* src = valid ? base + (row0 + r) * seq_stride + col : base;
    T* dst = tile + K::offset(r, col);
    if constexpr (K::kPipelined) {
      mma::cp_async_16(mma::smem_address(dst), src, valid);
    } else {
      *reinterpret_cast<uint4*>(dst) = valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
    }
  }
}

#endif

}  // namespace flash_attention
