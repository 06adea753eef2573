// The FP8 forward's dispatch: the runtime head dim and the launcher's candidate (Fp8Forward,
// flash_fwd_hopper_fp8.cuh) become the template arguments of one of the instantiations in
// flash_fwd_hopper_fp8_hdim<d>.cu (128-key tiles) and flash_fwd_hopper_fp8_n192_hdim128.cu (192-key
// tiles, at head dim 128 only: the d = 64 instantiation spilled, was never the default and never
// ahead when timed, so it was taken out; the chapter's NOTES.md).
#include "hopper/flash_fwd_hopper.h"
#include "hopper/flash_fwd_hopper_fp8.cuh"

#include <cstdlib>
#include <cstring>
#include <string>

namespace flash_attention {

// Built in their own files (flash_fwd_hopper_fp8_hdim<d>.cu, ..._n192_hdim128.cu). This file includes
// their definition for the traits' shared-memory sizes, so without `extern template` each call
// below would compile its kernel here a second time.
extern template cudaError_t run_flash_fwd_hopper_fp8<64, 128>(const AttentionFp8Params&, Fp8Forward, cudaStream_t);
extern template cudaError_t run_flash_fwd_hopper_fp8<128, 128>(const AttentionFp8Params&, Fp8Forward, cudaStream_t);
extern template cudaError_t run_flash_fwd_hopper_fp8<128, 192>(const AttentionFp8Params&, Fp8Forward, cudaStream_t);

// FLASH_ATTENTION_FP8_FORWARD, read at every call (a bench-only knob: getenv is a scan of a few
// dozen strings, against a launch's microseconds).
Fp8Forward fp8_forward_candidate() {
  const char* name = std::getenv("FLASH_ATTENTION_FP8_FORWARD");
  if (name == nullptr || *name == '\0') return Fp8Forward::kDefault;
  if (std::strcmp(name, "longest_first") == 0) return Fp8Forward::kLongestFirst;
  if (std::strcmp(name, "head_order") == 0) return Fp8Forward::kHeadOrder;
  if (std::strcmp(name, "n192") == 0) return Fp8Forward::kBlockN192;
  if (std::strcmp(name, "n192_full") == 0) return Fp8Forward::kBlockN192Full;
  return Fp8Forward::kUnknown;
}

// A candidate of 192-key tiles at head dim 64, which has none (above).
bool fp8_missing_n192(Fp8Forward candidate, int64_t head_dim) {
  return head_dim == 64 && (candidate == Fp8Forward::kBlockN192 || candidate == Fp8Forward::kBlockN192Full);
}

std::string attention_fp8_candidate_refusal(int64_t head_dim) {
  if (!fp8_missing_n192(fp8_forward_candidate(), head_dim)) return {};
  // n192_full too, even causal (where it would run longest_first): a bench row under its name at
  // d = 64 would time a kernel it does not name.
  return std::string("FLASH_ATTENTION_FP8_FORWARD=") + std::getenv("FLASH_ATTENTION_FP8_FORWARD") +
         " has no kernel at head_dim " + std::to_string(head_dim) +
         ": the 192-key tiles (n192, n192_full) are built at head_dim 128 only; unset it, or pick longest_first "
         "or head_order";
}

// The most any candidate takes at the head dim (the glue's check against the GPU's limit).
int64_t attention_fp8_smem_bytes(int64_t head_dim) {
  switch (head_dim) {
    case 64: return HopperFp8Traits<64, 128>::kSmemBytes;
    case 128: return HopperFp8Traits<128, 192>::kSmemBytes;
    default: return 0;
  }
}

cudaError_t launch_attention_fp8_hopper(const AttentionFp8Params& p, cudaStream_t stream) {
  if (p.attn.batch * p.attn.heads * p.attn.seqlen_q == 0) return cudaSuccess;
  Fp8Forward candidate = fp8_forward_candidate();
  // An unknown name, or 192-key tiles at d = 64 (the glue has refused those by name already).
  if (candidate == Fp8Forward::kUnknown || fp8_missing_n192(candidate, p.attn.head_dim)) return cudaErrorInvalidValue;
  if (candidate == Fp8Forward::kDefault) {  // Fp8Forward's comment says why d = 128 only
    candidate = p.attn.head_dim == 128 ? Fp8Forward::kBlockN192Full : Fp8Forward::kLongestFirst;
  }
  const bool n192 = candidate == Fp8Forward::kBlockN192 || (candidate == Fp8Forward::kBlockN192Full && !p.attn.causal);
  switch (p.attn.head_dim) {
    case 64: return run_flash_fwd_hopper_fp8<64, 128>(p, candidate, stream);  // never n192 (above)
    case 128: return n192 ? run_flash_fwd_hopper_fp8<128, 192>(p, candidate, stream)
                          : run_flash_fwd_hopper_fp8<128, 128>(p, candidate, stream);
    default: return cudaErrorInvalidValue;  // the glue checks attention_fp8_head_dim first
  }
}

}  // namespace flash_attention
