// Glue (ATen) shared by the attention ops: an AttentionParams filled from tensors, once, for the
// 16-bit ops (attention_ops.cpp) and the FP8 forward (fp8_ops.cpp) alike. Not torch-free, so not in
// attention.h, which the kernels include.
#pragma once

#include "attention/attention.h"

#include <ATen/ATen.h>
#include <course/checks.h>

namespace flash_attention {

// window and softcap as checked by check_window_softcap; causal is the window's right = 0.
// `dtype` is the kernel's element type: q's for the 16-bit ops (the overload below); the FP8 forward
// names out's instead (bfloat16), since its e4m3 inputs are the FP8 kernel's by construction and
// the CPU reference's float64 are the dequantized copies.
inline AttentionParams make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& out, const at::Tensor& lse, double scale, bool causal,
                                   at::IntArrayRef window, double softcap, DType dtype) {
  AttentionParams p{};
  p.dtype = dtype;
  p.q = q.const_data_ptr();
  p.k = k.const_data_ptr();
  p.v = v.const_data_ptr();
  // the backward reads o and lse through the same struct: const_cast only restores the type
  p.o = const_cast<void*>(out.const_data_ptr());
  p.lse = const_cast<void*>(lse.const_data_ptr());
  p.batch = q.size(0);
  p.heads = q.size(1);
  p.heads_kv = k.size(1);
  p.seqlen_q = q.size(2);
  p.seqlen_k = k.size(2);
  p.head_dim = q.size(3);
  p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1), p.q_seq_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(1), p.k_seq_stride = k.stride(2);
  // For the FP8 forward v is V^T: v_seq_stride steps from one head_dim row of keys to the next
  // (flash_fwd_hopper.h).
  p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(1), p.v_seq_stride = v.stride(2);
  p.o_batch_stride = out.stride(0), p.o_head_stride = out.stride(1), p.o_seq_stride = out.stride(2);
  p.scale = scale;
  p.causal = causal;
  p.window_left = window[0];
  p.window_right = causal ? 0 : window[1];
  p.softcap = softcap;
  return p;
}

inline AttentionParams make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& out, const at::Tensor& lse, double scale, bool causal,
                                   at::IntArrayRef window, double softcap) {
  return make_params(q, k, v, out, lse, scale, causal, window, softcap, ::course::to_dtype(q.scalar_type()));
}

}  // namespace flash_attention
