// Plain C++ interface of chapter 6's serving half: the paged KV cache, decode attention over it,
// and the radix-tree prefix lookup. Between the glue (serving_ops.cpp), the CPU reference
// (serving_cpu.cpp) and the CUDA kernels (paged_*.cu), as attention/attention.h is for the training
// half: no torch, no CUDA types in the declarations every side compiles.
//
// The KV cache (vLLM's PagedAttention): key_cache and value_cache are each
// (num_blocks, block_size, heads_kv, head_dim), contiguous. Token t of sequence b lives in
// physical block block_tables[b][t / block_size], at row t % block_size of it. A "slot" is
// block * block_size + row: reshape_and_cache writes token i's K and V at slot_mapping[i].
// One block holds block_size tokens of every kv head, so a block id is the unit of allocation,
// sharing and copy-on-write; within a block a token's heads_kv * head_dim values are contiguous
// (the layout the cache is written in, one token at a time).
//
// Decode attention: one query token per sequence, query (batch, heads, head_dim); sequence b sees
// context_lens[b] cached tokens (its own new token included: reshape_and_cache runs first). With
// grouped-query attention query head h reads kv head h / (heads / heads_kv).
//   s_j   = scale * q . k_j          over j < context_lens[b]
//   out   = sum_j softmax(s)_j v_j   (a sequence with context 0 gets out = 0)
//
// Memory safety does not depend on the inputs being valid: every kernel skips a block id outside
// [0, num_blocks) (its tokens count as absent: they add nothing) and reads at most
// max_blocks * block_size tokens of a sequence whatever context_lens says; a slot outside the
// cache is skipped like the padding slot -1. The glue raises a clear error for those inputs
// first, on the host where that costs nothing (shapes, dtypes) and, for the values in device
// tensors, only when asked to (reading them back is a device sync; serving_ops.cpp says more).
#pragma once

#include "hopper/tile_schedule.h"  // paged_prefill_hopper_block_size, hopper_block_n (plain C++)

#include <course/dtype.h>
#include <course/static_switch.h>  // is_listed

#include <cstdint>

namespace flash_attention {

// attention/attention.h's alias too (a repeated alias of the same type is allowed): this header is
// complete on its own, whichever of the two a file includes first.
using DType = ::course::DType;

// Block sizes the CUDA kernels are instantiated for (the CPU reference takes any >= 1).
inline constexpr int kPagedBlockSizes[] = {16, 32};
// Head dims of the decode kernels (the CPU reference takes any >= 1).
inline constexpr int kPagedHeadDims[] = {64, 128};

struct KVCacheLayout {
  DType dtype;
  int64_t num_blocks, block_size, heads_kv, head_dim;
  // Elements per block and per slot, the cache being contiguous.
  int64_t slot_elems() const { return heads_kv * head_dim; }
  int64_t block_elems() const { return block_size * heads_kv * head_dim; }
};

// reshape_and_cache: key and value (tokens, heads_kv, head_dim), any strides with the last dim
// contiguous, written to the cache at slot_mapping[i] (int64, -1 = a padding token: skipped).
struct ReshapeAndCacheParams {
  KVCacheLayout cache;
  const void* key;
  const void* value;
  void* key_cache;
  void* value_cache;
  const int64_t* slot_mapping;
  int64_t tokens;
  int64_t key_token_stride, key_head_stride;
  int64_t value_token_stride, value_head_stride;
};

// copy_blocks: for each pair i, block block_mapping[2i + 1] of both caches becomes a copy of
// block block_mapping[2i] (int64 (pairs, 2): src, dst; copy-on-write of a shared block before a
// sequence appends to it). No destination appears twice, nor as any pair's source (the glue
// checks both): the copies are then independent, and any order gives the same cache ((0, 1) and
// (1, 2) together would leave block 2 holding old block 1 or old block 0 depending on the order).
// A pair with an id outside the cache is skipped.
struct CopyBlocksParams {
  KVCacheLayout cache;
  void* key_cache;
  void* value_cache;
  const int64_t* block_mapping;
  int64_t pairs;
};

// paged_attention: query (batch, heads, head_dim) with strides (last dim contiguous), out
// (batch, heads, head_dim) contiguous, block_tables int32 (batch, max_blocks) with row stride
// block_table_stride, context_lens int32 (batch,).
struct PagedAttentionParams {
  KVCacheLayout cache;
  const void* q;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* context_lens;
  void* out;
  int64_t batch, heads, max_blocks;
  int64_t q_batch_stride, q_head_stride;
  int64_t block_table_stride;
  double scale;
};
// The most context ranges split_kv cuts a (sequence, kv head) into: the combine keeps one float
// weight per range in shared memory, and past a GPU's worth of blocks more ranges only add partials.
constexpr int64_t kPagedMaxSplits = 128;

// paged_prefill_attention (chunked prefill): the new tokens of several sequences, packed. query is
// (total_q, heads, head_dim) with strides (last dim contiguous); sequence b's query tokens are rows
// [cu_seqlens_q[b], cu_seqlens_q[b + 1]) (int32, batch + 1 entries), and they are the LAST q_len
// tokens of its context_lens[b] cached ones (reshape_and_cache wrote them first). The mask is
// causal and bottom-right aligned, as attention.h's: query row i of a chunk of q_len tokens sees
// the cached tokens j <= i + context - q_len. A decode token is a chunk of 1 (it sees everything);
// a chunk of 0 tokens computes nothing. A row that sees no token (a chunk longer than its context,
// which the glue refuses when it checks the tables) gets out = 0, attention.h's empty softmax.
// out is (total_q, heads, head_dim) contiguous; rows that belong to no sequence are not written.
// max_seqlen_q bounds every chunk: the grid has ceil(max_seqlen_q / rows per tile) query tiles per
// (sequence, head), the host's bound (it cannot read cu_seqlens_q on the device without a sync).
struct PagedPrefillParams {
  KVCacheLayout cache;
  const void* q;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* cu_seqlens_q;
  const int32_t* context_lens;
  void* out;
  int64_t batch, heads, max_blocks, total_q, max_seqlen_q;
  int64_t q_token_stride, q_head_stride;
  int64_t block_table_stride;
  double scale;
};

// The tokens sequence b can see: its context length, clamped to what its table row covers and
// to 0 from below. Host and device alike, so that the reference and the kernels agree on the
// inputs the glue was not asked to check.
#if defined(__CUDACC__)
#define FLASH_ATTENTION_PAGED_HD __host__ __device__ __forceinline__
#else
#define FLASH_ATTENTION_PAGED_HD inline
#endif
FLASH_ATTENTION_PAGED_HD int64_t paged_context(int32_t context_len, int64_t max_blocks, int64_t block_size) {
  const int64_t covered = max_blocks * block_size;
  const int64_t len = context_len < 0 ? 0 : static_cast<int64_t>(context_len);
  return len < covered ? len : covered;
}

// Sequence b's query rows in the packed query, [begin, end): cu_seqlens_q[b] and [b + 1] clamped
// into [0, total_q] and end to at least begin, so that no kernel reads or writes a row outside the
// query or the output whatever the offsets say (the glue checks them when asked: serving_ops.cpp).
struct PrefillRows {
  int64_t begin, end;
};
FLASH_ATTENTION_PAGED_HD PrefillRows prefill_rows(const int32_t* cu_seqlens_q, int64_t b, int64_t total_q) {
  const int64_t lo = cu_seqlens_q[b] < 0 ? 0 : (cu_seqlens_q[b] < total_q ? cu_seqlens_q[b] : total_q);
  const int64_t hi = cu_seqlens_q[b + 1] < lo ? lo : (cu_seqlens_q[b + 1] < total_q ? cu_seqlens_q[b + 1] : total_q);
  return {lo, hi};
}

// The radix tree's flat mirror (flash_attention/radix.py builds it from its Python trie). The
// tree works in whole KV blocks (vLLM's and SGLang's prefix caches share only full blocks: a
// partly filled block is still being written by its owner): every edge is a run of whole blocks,
// node n holding span_blocks[n] blocks, i.e. span_blocks[n] * block_size token ids starting at
// tokens[token_start[n]], and the KV block ids of those blocks at block_ids[block_start[n]].
// Node 0 is the root (an empty span). The children of node n are
// child_index[child_start[n] .. child_start[n] + child_count[n]), sorted by their first token
// id; two children may share a first token when their first blocks differ later.
//
// match_prefix: request r is queries[r * query_stride ..][0 .. query_lens[r]). Its match is the
// longest path from the root whose blocks equal the request's leading blocks, compared block by
// block (a block matches only whole). Outputs: matched_tokens[r] (a multiple of block_size) and,
// for i < matched_tokens[r] / block_size, matched_blocks[r * max_match_blocks + i], the KV block
// holding the request's block i (at most max_match_blocks are written; matched_tokens is capped
// to what was written).
struct RadixTreeView {
  int64_t num_nodes, block_size;
  const int32_t* tokens;
  const int64_t* token_start;
  const int32_t* span_blocks;
  const int64_t* block_start;
  const int32_t* block_ids;
  const int64_t* child_start;
  const int32_t* child_count;
  const int32_t* child_index;
};

struct MatchPrefixParams {
  RadixTreeView tree;
  const int32_t* queries;
  const int32_t* query_lens;
  int64_t requests, query_stride;
  int32_t* matched_tokens;
  int32_t* matched_blocks;
  int64_t max_match_blocks;
};

// The decode ladder: v1 one block per (sequence, query head); v2 one block per (sequence, kv
// head), its group of query heads served from one read of K and V; v3 = v2 split along the
// context into `splits` parts (flash-decoding), each writing a float32 partial output and its
// log-sum-exp to the workspace, merged by the split-KV combine of attention.h. Plain C++, out of
// the CUDA-only section: the glue's version table names the rungs in CPU-only builds too.
enum class PagedVersion { kPerHead, kPerKvHead, kSplitKv };

// The chunked-prefill ladder (paged_prefill_attention). A chunk's row i is a decode query over the
// first context - q_len + i + 1 tokens of its sequence (bottom-right causal), so
//   v1 decode_rows: runs the decode kernel (per_kv_head) with one "sequence" per query row, its
//     table row and its own context length built by the glue with torch ops on the device. Any
//     dtype, any GPU; but every row reads its whole visible context: q_len times the K/V bytes of
//     one pass, and no tensor cores.
//   v2 mma: FlashAttention 2's tiles (paged_prefill_kernels.cu): each 64-row query tile reads the
//     context once, S and P V on tensor cores. float16/bfloat16, compute capability 8.0+.
//   v3 persistent: part 3's Hopper forward (csrc/hopper/flash_fwd_hopper_persistent.cuh, its packed
//     instantiation): wgmma, warp-specialized, a persistent grid over (sequence, head, query tile)
//     items, and a producer that copies each key tile page by page through the block table: one TMA
//     box per page from 64 rows up, a cp.async gather by its 128 threads below (tile_schedule.h's
//     paged_prefill_hopper_gathers; AttentionParams' block_tables). float16/bfloat16, head_dim 64 and 128, block
//     sizes paged_prefill_hopper_block_size (tile_schedule.h: 16, 32, 64, 128, 256, ...), a build with
//     the sm_90a kernels and a GPU of compute capability 9.0. The consumers are the training
//     forward's, unchanged: a token in a block outside the cache (check_tables=False) reads as zeros
//     there (a score of 0 and a value of 0) instead of being left out as the other rungs leave it,
//     and with TMA boxes the slots of a context's last block past its end are read as the cache holds
//     them (masked, their values times P = 0: finite in a cache made with zeros or written before,
//     where mma and the gather copy zeros instead).
// version=None: persistent where it runs (on an H200 it ran the 8 x (4096 cached + 512) chunk at
// the speed of the course's contiguous attention_varlen on the same keys gathered: README, chunked
// prefill) unless every chunk is one token and decode_rows takes the block size; else mma where it
// runs and some chunk is longer than one token (max_seqlen_q, the host's bound: 0 stands for
// total_q); decode_rows otherwise, where the tensor-core rungs would pad each one-row tile to 64 or
// 128 rows of work. Plain C++, so any GPU can be asked about from anywhere.
enum class PagedPrefillVersion { kDecodeRows, kMma, kPersistent };
// Head dims of the persistent rung (attention.h's kHopperVarlenHeadDims: its packed instantiations).
inline constexpr int kPagedPrefillHopperHeadDims[] = {64, 128};
inline bool paged_prefill_hopper_takes(int64_t head_dim, int64_t block_size) {
  return ::course::is_listed(kPagedPrefillHopperHeadDims, head_dim) &&
         paged_prefill_hopper_block_size(block_size, hopper_block_n(head_dim));
}
struct PagedPrefillFacts {
  bool cuda = false, half = false;
  int cc_major = 0, cc_minor = 0;
  bool hopper_built = false;  // the build has the sm_90a kernels (COURSE_HOPPER)
};
inline PagedPrefillVersion paged_prefill_default(const PagedPrefillFacts& f, int64_t head_dim, int64_t block_size,
                                                 double scale, int64_t max_seqlen_q) {
  const bool hopper = f.cuda && f.half && f.hopper_built && f.cc_major == 9 && f.cc_minor == 0 && scale > 0.0 &&
                      paged_prefill_hopper_takes(head_dim, block_size);
  if (hopper && (max_seqlen_q != 1 || !::course::is_listed(kPagedBlockSizes, block_size))) {
    return PagedPrefillVersion::kPersistent;
  }
  return f.cuda && f.half && f.cc_major >= 8 && max_seqlen_q != 1 ? PagedPrefillVersion::kMma
                                                                  : PagedPrefillVersion::kDecodeRows;
}

// The CPU reference (serving_cpu.cpp): every function in float32 and float64 where it touches
// values, and the 16-bit types as well for the cache writes and copies (bytes, not arithmetic).
void reshape_and_cache_cpu(const ReshapeAndCacheParams& params);
void copy_blocks_cpu(const CopyBlocksParams& params);
void paged_attention_cpu(const PagedAttentionParams& params);
void match_prefix_cpu(const MatchPrefixParams& params);
void paged_prefill_attention_cpu(const PagedPrefillParams& params);

}  // namespace flash_attention

#if defined(__CUDACC__) || defined(WITH_CUDA)
#include <cuda_runtime_api.h>
namespace flash_attention {
// The CUDA side (paged_*.cu). Each launcher runs on `stream`, returns the first launch
// error, never synchronizes or allocates.
cudaError_t launch_reshape_and_cache(const ReshapeAndCacheParams& params, cudaStream_t stream);
cudaError_t launch_copy_blocks(const CopyBlocksParams& params, cudaStream_t stream);
cudaError_t launch_match_prefix(const MatchPrefixParams& params, cudaStream_t stream);

// The splits v3 uses for these inputs on a GPU with `sms` multiprocessors (1: v3 is v2), from the
// table's width, known on the host, not from context_lens, which lives on the device. A caller
// that knows more (a server's scheduler knows every length on the host) names its own count,
// 1 to kPagedMaxSplits (paged_attention's num_splits).
int64_t paged_attention_splits(const PagedAttentionParams& params, int sms);
// Workspace bytes (float32 partial outputs and lse) for `splits` splits; 0 when splits == 1.
inline int64_t paged_attention_workspace(const PagedAttentionParams& p, int64_t splits) {
  return splits > 1 ? splits * p.batch * p.heads * (p.cache.head_dim + 1) * 4 : 0;
}
cudaError_t launch_paged_attention(const PagedAttentionParams& params, PagedVersion version, int64_t splits,
                                   void* workspace, cudaStream_t stream);
// Chunked prefill on tensor cores (paged_prefill_kernels.cu): float16 and bfloat16, kPagedHeadDims,
// kPagedBlockSizes, compute capability 8.0 or newer (the glue checks each by name first).
cudaError_t launch_paged_prefill_attention(const PagedPrefillParams& params, cudaStream_t stream);
}  // namespace flash_attention
#endif
