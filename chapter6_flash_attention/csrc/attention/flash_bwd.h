// The tensor-core backward's tile shapes and entry points, without the kernel: what the dispatch
// (flash_bwd_dispatch.cu) sees. CUDA-only (included by .cu files). run_flash_bwd is defined in
// flash_bwd_kernel.cuh and explicitly instantiated once per dtype and head dim
// (instantiations/flash_bwd_<dtype>_hdim<d>.cu).
#pragma once

#include "attention/attention.h"

#include <cuda_runtime_api.h>

namespace flash_attention {

// ------------------------------------------------------------------------------------------
// The backward's work split (FlashAttention 2's): a block owns kBlockN keys of one kv head and
// walks every query tile (of every query head that reads the kv head), so dK and dV of its keys
// are summed in registers and written once, with no atomics, GQA included. Each warp owns 16 of
// the block's keys: it computes S^T, P^T, dP^T and dS^T for them (keys as the mma's m), and
// accumulates their dK and dV rows. dQ is the one sum that crosses blocks (every key tile adds
// to every query row it sees): each warp takes 16 rows of the query tile, multiplies dS (through
// shared memory) by the block's K, and adds the product into a float32 dQ with atomics; a last
// kernel scales it and rounds it to the dtype.
//
// Registers bind: dK and dV rows are 2 * d / 8 n8 tiles of 4 floats (64 each at d = 128), and
// S^T and dP^T of a 64-row query tile 32 each. That is why kBlockM is 64 and head dim 256
// (dK and dV alone would take 256 registers) stays on the naive backward.
//
// The memory pipeline (the forward's rung 4, applied to both kernels of the backward): the tiles
// a kernel walks are copied with cp.async into two stages, the next while the current computes:
// Q and dO (and their rows' lse and D) for the dK/dV kernel, K and V for the dQ kernel. So a
// block holds six tiles: at d = 128, 6 x 17 KiB plus dS^T, 112 KiB, two blocks on an H100 SM
// (228 KiB) and one on an A100's (164 KiB).
// ------------------------------------------------------------------------------------------
template <int kHeadDim_>
struct BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kPipelined = true;  // cp.async tile copies (flash_tiles.cuh)
  static constexpr int kStages = 2;
  static constexpr int kNWarps = 4;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kBlockN = 16 * kNWarps;  // keys per block: 16 per warp
  static constexpr int kBlockM = 16 * kNWarps;  // query rows per step: 16 per warp in the dQ product
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kRowStride = kHeadDim + 8;  // 16 bytes of padding: ldmatrix's 8 rows, 8 bank groups
  static_assert(kBlockM == kBlockN, "one tile size for Q, dO, K and V");
  static constexpr int kTileElems = kBlockN * kRowStride;
  static constexpr int kDsStride = kBlockM + 8;  // dS^T: kBlockN rows (keys) of kBlockM (query rows)
  // Six tiles (the walked pair in two stages, the held pair once), dS^T (16-bit), then lse and D
  // of the query tile in two stages (float32).
  static constexpr int kSmemBytes =
      ((2 * kStages + 2) * kTileElems + kBlockN * kDsStride) * 2 + 2 * kStages * kBlockM * 4;
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 128, "the tensor-core backward takes head_dim 32-128");

  __device__ static __forceinline__ int offset(int row, int col) { return row * kRowStride + col; }
};

template <typename T, int D>
cudaError_t run_flash_bwd(const AttentionBackwardParams& g, float* dq_accum, const float* d_rows,
                          cudaStream_t stream);

}  // namespace flash_attention
