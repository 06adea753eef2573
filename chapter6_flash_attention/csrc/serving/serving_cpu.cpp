// The CPU reference of the serving half (serving.h): the cache writes and copies, decode attention
// and chunked prefill over the paged cache, and the radix-tree prefix lookup, in the plainest C++
// that computes them, on the same params as the CUDA launchers. Like attention/attention_cpu.cpp it
// favours being obviously right over being fast: serial, one sequence and head at a time, a
// two-pass softmax.
//
// It follows serving.h's memory-safety rules to the letter, because it is also what the kernels'
// behaviour on unchecked inputs is tested against: a block id outside [0, num_blocks) adds no
// tokens, a context is clamped by paged_context, a slot outside the cache is skipped as -1 is, a
// copy naming a block outside the cache is skipped.
//
// Torch-free (only header-only types from course/cpu_dtype.h), as attention/attention_cpu.cpp. The
// cache writes and copies move bytes, so they serve every dtype without a template; attention
// computes in the input's own type (course::CpuAcc), the error profile of the float32 kernels.
#include "serving/serving.h"

#include <course/cpu_dtype.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace flash_attention {
namespace {

using ::course::CpuAcc;
using ::course::with_cpu_type;

int64_t element_bytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat32: return 4;
    case DType::kFloat64: break;
  }
  return 8;
}

bool block_in_cache(int64_t block, const KVCacheLayout& cache) { return block >= 0 && block < cache.num_blocks; }

// The byte address of element `index` of a type-erased array.
template <typename Void>
auto byte_at(Void* base, int64_t index, int64_t elem_bytes) {
  using Byte = std::conditional_t<std::is_const_v<Void>, const char, char>;
  return static_cast<Byte*>(base) + index * elem_bytes;
}

template <typename A, typename T>
A dot(const T* a, const T* b, int64_t n) {
  A sum = A(0);
  for (int64_t d = 0; d < n; ++d) sum += static_cast<A>(a[d]) * static_cast<A>(b[d]);
  return sum;
}

// A sequence's visible tokens as slots (block * block_size + row), in order, and, where asked,
// each one's position in the sequence: the tokens of blocks outside the cache are left out, so
// they add nothing to the softmax (serving.h). `table` is the sequence's row of block ids.
void visible_slots(const KVCacheLayout& cache, const int32_t* table, int32_t context_len, int64_t max_blocks,
                   std::vector<int64_t>* slots, std::vector<int64_t>* positions = nullptr) {
  const int64_t context = paged_context(context_len, max_blocks, cache.block_size);
  slots->clear();
  if (positions != nullptr) positions->clear();
  for (int64_t j = 0; j < context; ++j) {
    const int64_t block = table[j / cache.block_size];
    if (!block_in_cache(block, cache)) continue;
    slots->push_back(block * cache.block_size + j % cache.block_size);
    if (positions != nullptr) positions->push_back(j);
  }
}

// One query row's attention over the given slots of the cache: out = softmax(scale q k^T) v,
// two passes (the max, then the sums), in the accumulation type A; no slot: out = 0 (the empty
// softmax of attention.h). probs and acc are scratch, resized here.
template <typename T, typename A>
void attend_row(const KVCacheLayout& cache, const T* key_cache, const T* value_cache, int64_t hk, const T* q_row,
                const int64_t* slots, int64_t n, A scale, T* out, std::vector<A>* probs, std::vector<A>* acc) {
  const int64_t d = cache.head_dim;
  if (n == 0) {
    std::fill(out, out + d, T(0));
    return;
  }
  probs->resize(static_cast<size_t>(n));
  acc->assign(static_cast<size_t>(d), A(0));
  A row_max = -std::numeric_limits<A>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    const T* k_row = key_cache + slots[j] * cache.slot_elems() + hk * d;
    (*probs)[j] = scale * dot<A>(q_row, k_row, d);
    row_max = std::max(row_max, (*probs)[j]);
  }
  // Subtracting the row max keeps exp() in range whatever the scores are.
  A denom = A(0);
  for (A& prob : *probs) {
    prob = std::exp(prob - row_max);
    denom += prob;
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* v_row = value_cache + slots[j] * cache.slot_elems() + hk * d;
    for (int64_t c = 0; c < d; ++c) (*acc)[c] += (*probs)[j] * static_cast<A>(v_row[c]);
  }
  for (int64_t c = 0; c < d; ++c) out[c] = static_cast<T>((*acc)[c] / denom);
}

template <typename T>
void paged_attention(const PagedAttentionParams& p) {
  using A = typename CpuAcc<T>::type;
  const KVCacheLayout& cache = p.cache;
  const int64_t group = p.heads / cache.heads_kv;
  const int64_t d = cache.head_dim;
  std::vector<int64_t> slots;
  std::vector<A> probs, acc;
  for (int64_t b = 0; b < p.batch; ++b) {
    visible_slots(cache, p.block_tables + b * p.block_table_stride, p.context_lens[b], p.max_blocks, &slots);
    for (int64_t h = 0; h < p.heads; ++h) {
      const T* q_row = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
      T* out = static_cast<T*>(p.out) + (b * p.heads + h) * d;
      attend_row<T, A>(cache, static_cast<const T*>(p.key_cache), static_cast<const T*>(p.value_cache), h / group,
                       q_row, slots.data(), static_cast<int64_t>(slots.size()), static_cast<A>(p.scale), out, &probs,
                       &acc);
    }
  }
}

// Chunked prefill: row i of sequence b's chunk of q_len tokens is its token context - q_len + i,
// and sees the tokens at positions up to that one (serving.h). The visible slots are sorted by
// position, so each row's are a prefix of the sequence's: one list per sequence, cut per row.
template <typename T>
void paged_prefill_attention(const PagedPrefillParams& p) {
  using A = typename CpuAcc<T>::type;
  const KVCacheLayout& cache = p.cache;
  const int64_t group = p.heads / cache.heads_kv;
  const int64_t d = cache.head_dim;
  std::vector<int64_t> slots, positions;
  std::vector<A> probs, acc;
  for (int64_t b = 0; b < p.batch; ++b) {
    const PrefillRows rows = prefill_rows(p.cu_seqlens_q, b, p.total_q);
    const int64_t q_len = rows.end - rows.begin;
    const int64_t context = paged_context(p.context_lens[b], p.max_blocks, cache.block_size);
    visible_slots(cache, p.block_tables + b * p.block_table_stride, p.context_lens[b], p.max_blocks, &slots,
                  &positions);
    for (int64_t i = 0; i < q_len; ++i) {
      // visible_keys of attention.h: the positions j <= i + context - q_len
      const int64_t last = i + context - q_len;
      const int64_t n = std::upper_bound(positions.begin(), positions.end(), last) - positions.begin();
      for (int64_t h = 0; h < p.heads; ++h) {
        const int64_t token = rows.begin + i;
        const T* q_row = static_cast<const T*>(p.q) + token * p.q_token_stride + h * p.q_head_stride;
        T* out = static_cast<T*>(p.out) + (token * p.heads + h) * d;
        attend_row<T, A>(cache, static_cast<const T*>(p.key_cache), static_cast<const T*>(p.value_cache), h / group,
                         q_row, slots.data(), n, static_cast<A>(p.scale), out, &probs, &acc);
      }
    }
  }
}

// The child of `node` whose first block equals the block at `query`, or -1. A linear scan: the
// children are sorted by first token so that a kernel can bisect, but scanning them all needs no
// such promise, and no two children share a whole first block (the glue checks the CPU tree).
int64_t child_matching(const RadixTreeView& tree, int64_t node, const int32_t* query) {
  for (int64_t i = 0; i < tree.child_count[node]; ++i) {
    const int64_t child = tree.child_index[tree.child_start[node] + i];
    const int32_t* first = tree.tokens + tree.token_start[child];
    if (std::equal(first, first + tree.block_size, query)) return child;
  }
  return -1;
}

}  // namespace

void reshape_and_cache_cpu(const ReshapeAndCacheParams& p) {
  const KVCacheLayout& cache = p.cache;
  const int64_t elem = element_bytes(cache.dtype);
  const int64_t row_bytes = cache.head_dim * elem;
  const int64_t slots = cache.num_blocks * cache.block_size;
  for (int64_t i = 0; i < p.tokens; ++i) {
    const int64_t slot = p.slot_mapping[i];
    if (slot < 0 || slot >= slots) continue;  // -1 pads a batch; any other slot outside the cache likewise
    for (int64_t h = 0; h < cache.heads_kv; ++h) {
      const int64_t dst = slot * cache.slot_elems() + h * cache.head_dim;
      std::memcpy(byte_at(p.key_cache, dst, elem),
                  byte_at(p.key, i * p.key_token_stride + h * p.key_head_stride, elem), row_bytes);
      std::memcpy(byte_at(p.value_cache, dst, elem),
                  byte_at(p.value, i * p.value_token_stride + h * p.value_head_stride, elem), row_bytes);
    }
  }
}

void copy_blocks_cpu(const CopyBlocksParams& p) {
  const KVCacheLayout& cache = p.cache;
  const int64_t elem = element_bytes(cache.dtype);
  const int64_t block_bytes = cache.block_elems() * elem;
  for (int64_t i = 0; i < p.pairs; ++i) {
    const int64_t src = p.block_mapping[2 * i];
    const int64_t dst = p.block_mapping[2 * i + 1];
    // src == dst copies nothing (and memcpy's ranges must not overlap)
    if (!block_in_cache(src, cache) || !block_in_cache(dst, cache) || src == dst) continue;
    for (void* base : {p.key_cache, p.value_cache}) {
      std::memcpy(byte_at(base, dst * cache.block_elems(), elem), byte_at(base, src * cache.block_elems(), elem),
                  block_bytes);
    }
  }
}

void paged_attention_cpu(const PagedAttentionParams& p) {
  with_cpu_type(p.cache.dtype, [&](auto tag) { paged_attention<decltype(tag)>(p); });
}

void paged_prefill_attention_cpu(const PagedPrefillParams& p) {
  with_cpu_type(p.cache.dtype, [&](auto tag) { paged_prefill_attention<decltype(tag)>(p); });
}

// Block by block from the root: find the child whose first block is the request's next block,
// follow its edge while the blocks agree, descend when the whole edge matched, stop at the first
// disagreement, at the end of the request's whole blocks, or at max_match_blocks.
void match_prefix_cpu(const MatchPrefixParams& p) {
  const RadixTreeView& tree = p.tree;
  const int64_t block_size = tree.block_size;
  for (int64_t r = 0; r < p.requests; ++r) {
    const int32_t* query = p.queries + r * p.query_stride;
    const int64_t whole_blocks = std::max<int64_t>(p.query_lens[r], 0) / block_size;
    const int64_t limit = std::min(whole_blocks, p.max_match_blocks);
    int32_t* blocks = p.matched_blocks + r * p.max_match_blocks;
    int64_t matched = 0;
    int64_t node = 0;
    while (matched < limit) {
      const int64_t child = child_matching(tree, node, query + matched * block_size);
      if (child < 0) break;
      int64_t i = 0;
      for (; i < tree.span_blocks[child] && matched < limit; ++i, ++matched) {
        const int32_t* edge = tree.tokens + tree.token_start[child] + i * block_size;
        if (!std::equal(edge, edge + block_size, query + matched * block_size)) break;
        blocks[matched] = tree.block_ids[tree.block_start[child] + i];
      }
      if (i < tree.span_blocks[child]) break;  // the match ends inside this edge
      node = child;
    }
    p.matched_tokens[r] = static_cast<int32_t>(matched * block_size);
  }
}

}  // namespace flash_attention
