// linear_activation's epilogue: y = act(x @ weight.T + bias). The GEMM is cuBLAS (at::mm in the
// glue); what follows it is memory-bound and is this file's subject.
//
// Napkin math for the GEMM output h of [rows, n] b-byte elements: the unfused epilogue reads
// and writes h for the bias (2 b bytes per element), then reads it and writes y for the
// activation (2 b more); the fused epilogue reads h once and writes y once (2 b), in place on
// h when no backward needs z, or z and y both (3 b) when one does. Against the GEMM's 2 k FLOPs
// per output element the epilogue is not small: at k = 1024 in bf16 on an H100 (~800 TFLOP/s
// dense, ~3.3 TB/s) the GEMM costs ~2.6 ps per output element, the unfused epilogue ~2.4 ps
// more and the fused one ~1.2 ps: fusing it saves up to a quarter of the layer's time.
//
// The kernel templates come from activation_kernels.cuh, instantiated here per activation.
#include "activation_kernels.cuh"
#include "elementwise.h"

#include <course/column_reduce.cuh>
#include <course/cuda_utils.h>

namespace fusion {
namespace elementwise {

// The rungs:
//   unfused         add_bias_kernel writes z = h + bias into h, then bias_act_warp_kernel reads
//                   z and writes y = act(z): two trips through memory after the GEMM;
//   fused_epilogue  bias_act_tile_kernel reads h once and writes y (and z, when params.pre is
//                   set), 16-byte accesses, the bias held in registers across rows (the flat
//                   kernel when rows are not whole vectors: launch_bias_act_fused).
cudaError_t launch_linear_epilogue(const BiasActParams& p, LinearVersion version, cudaStream_t stream) {
  return with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    return with_activation(p.act, [&](auto act) -> cudaError_t {
      using Act = decltype(act);
      if (version == LinearVersion::kUnfused) {
        // z lands where the caller wants it kept (pre), else in y, which the activation then
        // overwrites in place.
        T* z = static_cast<T*>(p.pre != nullptr ? p.pre : p.y);
        COURSE_CUDA_TRY(launch_add_bias<T>(static_cast<const T*>(p.x), static_cast<const T*>(p.bias), z, p.rows, p.n,
                                           stream));
        return launch_bias_act_warps<T, Act, false>(z, nullptr, 1.0, static_cast<T*>(p.y), nullptr, p.rows, p.n,
                                                    stream);
      }
      return launch_bias_act_fused<T, Act, false>(p, stream);
    });
  });
}

// The backward's elementwise part, dz = dy * act'(z) and db = the column sum of dz, in one pass
// (activation.h's act_backward_tile_kernel with the saved z as its input, no bias, scale 1) and
// a column sum of its per-slot partials. dx = dz @ weight and dweight = dz.T @ x are GEMMs in
// the glue.
cudaError_t linear_epilogue_backward_workspace(const ActBackwardParams& p, int64_t* bytes) {
  return with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    return fused_backward_workspace<decltype(tag)>(p, bytes);
  });
}

cudaError_t launch_linear_epilogue_backward(const ActBackwardParams& p, cudaStream_t stream) {
  return with_dtype(p.dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    return with_activation(p.act, [&](auto act) -> cudaError_t {
      return launch_fused_backward<T, decltype(act), SaveKind::kInput>(p, stream);
    });
  });
}

}  // namespace elementwise
}  // namespace fusion
