// The Hopper forward's dispatch: the runtime dtype, head dim and rung become the template
// arguments of one of the instantiations in flash_fwd_hopper_<dtype>_hdim<d>.cu, or, for a call
// with a window or a softcap, of flash_fwd_hopper_window_<dtype>_hdim<d>.cu.
#include "hopper/flash_fwd_hopper.h"
#include "hopper/flash_fwd_hopper_persistent.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flash_attention {

// Every launcher below is compiled in its instantiation file alone: declared extern here, so that this
// file (which includes the kernels for their traits) does not compile the kernels a second time.
#define PLAIN_INSTANCE(T, D)                                                                              \
  extern template cudaError_t run_flash_fwd_hopper<T, D, HopperForward::kWgmma>(const AttentionParams&,       \
                                                                                cudaStream_t, void*);       \
  extern template cudaError_t run_flash_fwd_hopper<T, D, HopperForward::kWarpSpecialized>(                   \
      const AttentionParams&, cudaStream_t, void*);                                                           \
  extern template cudaError_t run_flash_fwd_hopper<T, D, HopperForward::kPingpong>(const AttentionParams&,    \
                                                                                   cudaStream_t, void*);    \
  extern template cudaError_t run_flash_fwd_hopper<T, D, HopperForward::kPersistent>(const AttentionParams&,  \
                                                                                     cudaStream_t, void*);
PLAIN_INSTANCE(__nv_bfloat16, 64)
PLAIN_INSTANCE(__nv_bfloat16, 128)
PLAIN_INSTANCE(__nv_bfloat16, 256)
PLAIN_INSTANCE(__half, 64)
PLAIN_INSTANCE(__half, 128)
PLAIN_INSTANCE(__half, 256)
#undef PLAIN_INSTANCE
#define WINDOW_INSTANCE(T, D) \
  extern template cudaError_t run_flash_fwd_hopper_window<T, D>(const AttentionParams&, cudaStream_t, void*);
WINDOW_INSTANCE(__nv_bfloat16, 64)
WINDOW_INSTANCE(__nv_bfloat16, 128)
WINDOW_INSTANCE(__half, 64)
WINDOW_INSTANCE(__half, 128)
#undef WINDOW_INSTANCE

namespace {

// A window or a softcap: rung "persistent" alone, at kHopperWindowHeadDims (the glue sends no other
// such call here; this answers a launcher called from C++).
template <typename T>
cudaError_t with_window(const AttentionParams& p, HopperForward rung, cudaStream_t stream, void* workspace) {
  if (rung != HopperForward::kPersistent) return cudaErrorInvalidValue;
  switch (p.head_dim) {
    case 64: return run_flash_fwd_hopper_window<T, 64>(p, stream, workspace);
    case 128: return run_flash_fwd_hopper_window<T, 128>(p, stream, workspace);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int D>
cudaError_t with_rung(const AttentionParams& p, HopperForward rung, cudaStream_t stream, void* workspace) {
  switch (rung) {
    case HopperForward::kWgmma: return run_flash_fwd_hopper<T, D, HopperForward::kWgmma>(p, stream, workspace);
    case HopperForward::kWarpSpecialized:
      return run_flash_fwd_hopper<T, D, HopperForward::kWarpSpecialized>(p, stream, workspace);
    case HopperForward::kPingpong: return run_flash_fwd_hopper<T, D, HopperForward::kPingpong>(p, stream, workspace);
    case HopperForward::kPersistent:
      return run_flash_fwd_hopper<T, D, HopperForward::kPersistent>(p, stream, workspace);
  }
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t with_head_dim(const AttentionParams& p, HopperForward rung, cudaStream_t stream, void* workspace) {
  if (uses_window_or_softcap(p)) return with_window<T>(p, rung, stream, workspace);
  switch (p.head_dim) {
    case 64: return with_rung<T, 64>(p, rung, stream, workspace);
    case 128: return with_rung<T, 128>(p, rung, stream, workspace);
    case 256: return with_rung<T, 256>(p, rung, stream, workspace);
    default: return cudaErrorInvalidValue;  // the glue checks attention_forward_hopper_head_dim first
  }
}

template <int D>
int64_t smem_bytes(HopperForward rung) {
  switch (rung) {
    case HopperForward::kWgmma: return HopperFwdTraits<D, HopperForward::kWgmma>::kSmemBytes;
    case HopperForward::kWarpSpecialized: return HopperFwdTraits<D, HopperForward::kWarpSpecialized>::kSmemBytes;
    case HopperForward::kPingpong: return HopperFwdTraits<D, HopperForward::kPingpong>::kSmemBytes;
    case HopperForward::kPersistent: return HopperFwdTraits<D, HopperForward::kPersistent>::kSmemBytes;
  }
  return 0;
}

}  // namespace

int64_t attention_forward_hopper_smem_bytes(int64_t head_dim, HopperForward rung) {
  switch (head_dim) {
    case 64: return smem_bytes<64>(rung);
    case 128: return smem_bytes<128>(rung);
    case 256: return smem_bytes<256>(rung);
    default: return 0;
  }
}

cudaError_t launch_attention_forward_hopper(const AttentionParams& p, HopperForward rung, cudaStream_t stream,
                                            void* workspace) {
  if (p.batch * p.heads * p.seqlen_q == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kBFloat16: return with_head_dim<__nv_bfloat16>(p, rung, stream, workspace);
    case DType::kFloat16: return with_head_dim<__half>(p, rung, stream, workspace);
    default: return cudaErrorInvalidValue;  // the glue sends only the 16-bit types here
  }
}

}  // namespace flash_attention
