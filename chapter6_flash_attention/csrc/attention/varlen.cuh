// The packed (varlen) layout in the tensor-core kernels (attention.h's cu_seqlens_q and
// cu_seqlens_k), FlashAttention 2's way: the grid is the padded one, over the longest sequence's
// tiles (max_seqlen) x heads x sequences, and a block first reads where its sequence starts and how
// long it is from cu_seqlens (two loads, the same for every thread, so they come from one cache
// line). Then the block sees its sequence as a batch of one: its lengths in place of seqlen_q and
// seqlen_k, every pointer moved to its first token (the token stride is the packed tensor's
// seq stride; the batch strides are 0), and the rest of the kernel is the padded kernel's code.
//
// kVarlen is a template parameter of each kernel, not a runtime branch: with it false nothing here
// is compiled in, and the padded kernels are the code they were (a runtime switch would turn every
// length and pointer the kernel reads from its parameters, constant-bank operands, into values the
// block computed, which live in registers: the registers the tuned forward has none to spare of).
// Only the kernels of the rungs that take the packed layout have the kVarlen = true instantiation.
//
// No torch headers: this file builds with a bare `nvcc -c`.
#pragma once

#include "attention/attention.h"

#include <cstdint>

namespace flash_attention {

// Sequence b of a packed call as a batch of one (above). The length of a sequence whose offsets
// decrease (a cu_seqlens the host never read: reading it there would be a device-to-host sync) is
// clamped to 0, so that such a sequence computes nothing rather than a negative range.
template <typename T>
__device__ __forceinline__ AttentionParams sequence_params(const AttentionParams& packed, int64_t b) {
  const int64_t q0 = packed.cu_seqlens_q[b], k0 = packed.cu_seqlens_k[b];
  AttentionParams s = packed;
  s.seqlen_q = max(int64_t{0}, packed.cu_seqlens_q[b + 1] - q0);
  s.seqlen_k = max(int64_t{0}, packed.cu_seqlens_k[b + 1] - k0);
  s.q = static_cast<const T*>(packed.q) + q0 * packed.q_seq_stride;
  s.k = static_cast<const T*>(packed.k) + k0 * packed.k_seq_stride;
  s.v = static_cast<const T*>(packed.v) + k0 * packed.v_seq_stride;
  s.o = static_cast<T*>(packed.o) + q0 * packed.o_seq_stride;
  s.q_batch_stride = s.k_batch_stride = s.v_batch_stride = s.o_batch_stride = 0;
  return s;
}

// The same for the backward: the forward's tensors, and dO, dQ, dK and dV at the sequence's tokens.
template <typename T>
__device__ __forceinline__ AttentionBackwardParams sequence_params(const AttentionBackwardParams& packed, int64_t b) {
  const int64_t q0 = packed.fwd.cu_seqlens_q[b], k0 = packed.fwd.cu_seqlens_k[b];
  AttentionBackwardParams s = packed;
  s.fwd = sequence_params<T>(packed.fwd, b);
  s.dout = static_cast<const T*>(packed.dout) + q0 * packed.do_seq_stride;
  s.dq = static_cast<T*>(packed.dq) + q0 * packed.dq_seq_stride;
  s.dk = static_cast<T*>(packed.dk) + k0 * packed.dk_seq_stride;
  s.dv = static_cast<T*>(packed.dv) + k0 * packed.dv_seq_stride;
  s.do_batch_stride = s.dq_batch_stride = s.dk_batch_stride = s.dv_batch_stride = 0;
  return s;
}

// The first statistics row (lse, D; the atomic backward's dQ sums) of query head h of sequence b:
// (heads, total_q) packed, so h * total_q + cu_seqlens_q[b]. The padded kernels index
// (b * heads + h) * seqlen_q themselves.
__device__ __forceinline__ int64_t packed_stat_row(const AttentionParams& packed, int64_t b, int64_t h) {
  return h * packed.total_q + packed.cu_seqlens_q[b];
}

}  // namespace flash_attention
