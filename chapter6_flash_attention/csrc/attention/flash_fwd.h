// The tensor-core forward's tile shapes and entry points, without the kernel: what the dispatch
// (flash_fwd_dispatch.cu) sees. CUDA-only (included by .cu files). run_flash_fwd is defined in
// flash_fwd_kernel.cuh and explicitly instantiated once per dtype and head dim
// (instantiations/flash_fwd_<dtype>_hdim<d>.cu), so no file but those compiles a kernel, and they
// compile in parallel.
#pragma once

#include "attention/attention.h"

#include <cuda_runtime_api.h>

namespace flash_attention {

// ------------------------------------------------------------------------------------------
// Kernel traits: the tile shape per head dim and rung, FlashAttention 2's Flash_fwd_kernel_traits
// in miniature. A warp owns kWarpRows query rows (kWarpMTiles m16 tiles), so
// kBlockM = kWarpRows * kNWarps. Registers per thread are the limit that picks these: the output
// accumulators (d / 8 n8 tiles of 4 floats per m16 tile: 64 at d = 128) and the scores of one
// key tile (kBlockN / 8 tiles of 4 per m16 tile: 32 at 64 keys).
//
// Rungs "mma" and "pipelined": 16 rows per warp, the simplest split.
//   d <= 64:  8 warps x 16 = 128 rows, 128 keys per tile (S: 64 registers, O: 16-32)
//   d = 96, 128: 128 rows, 64 keys (S: 32, O: 48-64)
//   d = 256: 4 warps, 64 rows, 64 keys (O: 128 registers; 8 warps would not leave room for two
//            blocks' shared memory either)
// Rung "tuned": 32 rows per warp (two m16 tiles) and 4 warps, FlashAttention 2's shapes for these
// head dims. Every K and V fragment a warp reads from shared memory now feeds two mma
// instructions, which halves shared-memory traffic per FLOP; the price is twice the registers per
// thread (d = 128: S 64 + O 128), so a block has 4 warps and an SM holds two blocks. d = 256 keeps
// the pipelined shape: two m16 tiles of its O would need 256 registers.
//
// Rung "split_kv": the pipelined shape, 4 warps x 16 = 64 rows. It runs when the grid is small,
// typically a few query rows against a long context (decoding): a 128-row tile would multiply
// mostly zero rows of Q, and at one real row the mma work per byte of K and V read would make the
// kernel compute bound on padding; 64 rows halve that, and double the blocks to split.
// ------------------------------------------------------------------------------------------
template <int kHeadDim_, MmaForward kRung_>
struct FwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr MmaForward kRung = kRung_;
  static constexpr bool kPipelined = kRung != MmaForward::kMma;
  static constexpr bool kSplit = kRung == MmaForward::kSplitKv;  // writes partials (attention.h)
  static constexpr bool kTuned = kRung == MmaForward::kTuned && kHeadDim <= 128;
  // The rungs that compute a window and a softcap (attention_ops.cpp's takes_window_or_softcap):
  // they alone have a kWindowSoftcap instantiation (flash_fwd_kernel.cuh).
  static constexpr bool kWindowSoftcap = kRung == MmaForward::kTuned || kRung == MmaForward::kSplitKv;
  static constexpr int kWarpMTiles = kTuned ? 2 : 1;
  static constexpr int kWarpRows = 16 * kWarpMTiles;
  static constexpr int kNWarps = kTuned || kSplit || kHeadDim == 256 ? 4 : 8;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kBlockM = kWarpRows * kNWarps;
  static constexpr int kBlockN = kHeadDim <= 64 ? 128 : 64;
  static constexpr int kStages = kPipelined ? 2 : 1;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  static constexpr bool kSwizzle = kPipelined && kChunks % 8 == 0;
  static constexpr int kRowStride = kSwizzle ? kHeadDim : kHeadDim + 8;  // elements
  static constexpr int kQElems = kBlockM * kRowStride;
  static constexpr int kKVElems = kBlockN * kRowStride;
  static constexpr int kSmemBytes = (kQElems + 2 * kStages * kKVElems) * 2;
  static_assert(kHeadDim % 16 == 0, "head_dim must be a whole number of k16 steps");

  // The element offset of (row, col) in a tile; col is a multiple of 8 wherever a 16-byte access
  // (ldmatrix row, copy chunk) starts, and then the whole chunk is contiguous.
  __device__ static __forceinline__ int offset(int row, int col) {
    if constexpr (kSwizzle) {
      return row * kHeadDim + (((col >> 3) ^ (row & 7)) << 3) + (col & 7);
    } else {
      return row * kRowStride + col;
    }
  }
};

// Split-KV (rung "split_kv", attention.h): `splits` key ranges per query tile, their float32
// partials in `workspace` (attention_forward_split_workspace bytes), merged by
// launch_split_combine. Only the kSplitKv instantiation takes splits > 1; the others ignore it.
struct FwdSplit {
  int64_t splits = 1;
  float* workspace = nullptr;
};

template <typename T, int D, MmaForward kRung>
cudaError_t run_flash_fwd(const AttentionParams& p, const FwdSplit& split, cudaStream_t stream);

}  // namespace flash_attention
