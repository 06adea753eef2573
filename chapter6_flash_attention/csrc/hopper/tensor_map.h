// Host side of TMA: a CUtensorMap describes a tensor in global memory (base, sizes, strides) and
// the box one copy moves. Made on the host for every call (a few hundred nanoseconds, no GPU
// work), passed to the kernel by value as a __grid_constant__ parameter. Torch-free.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime_api.h>

#include <cstdint>

namespace hopper {

// The driver's encoder, looked up once through the runtime, so that the extension needs no
// -lcuda at link time (torch's extensions link the runtime only). Null if the driver lacks it.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encoder;
}

// A tiled map over a 16-bit tensor of `rank` dims, innermost first: dims[0] contiguous, byte
// strides of dims 1..rank-1 in strides[0..rank-2] (multiples of 16, as TMA requires), `box` the
// tile one copy brings. The 128-byte swizzle (the box's inner extent must then be 64 elements, 128
// bytes) is the layout wgmma's descriptors read without bank conflicts (hopper.cuh). Elements
// outside the tensor arrive as zeros.
inline cudaError_t make_tensor_map_16bit(CUtensorMap* map, const void* base, int rank, const uint64_t* dims,
                                         const uint64_t* strides, const uint32_t* box) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const uint32_t element_strides[5] = {1, 1, 1, 1, 1};
  const CUresult result =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, static_cast<cuuint32_t>(rank), const_cast<void*>(base), dims,
             strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The same over a tensor of one-byte elements (the FP8 forward's e4m3 Q, K and V^T), with the
// 128-byte swizzle (rows of 128 elements) or the 64-byte one (rows of 64: head_dim 64): the box's
// inner extent must be the swizzle's width in bytes, which is the row the descriptors then read.
inline cudaError_t make_tensor_map_8bit(CUtensorMap* map, const void* base, int rank, const uint64_t* dims,
                                        const uint64_t* strides, const uint32_t* box, int swizzle_bytes) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  if (swizzle_bytes != 64 && swizzle_bytes != 128) return cudaErrorInvalidValue;
  const uint32_t element_strides[5] = {1, 1, 1, 1, 1};
  const CUresult result =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, static_cast<cuuint32_t>(rank), const_cast<void*>(base), dims,
             strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             swizzle_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace hopper
