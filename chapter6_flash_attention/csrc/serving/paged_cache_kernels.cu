// Chapter 6, serving half: writing the paged KV cache (reshape_and_cache) and copying its blocks
// (copy_blocks), serving.h's layout: key_cache and value_cache (num_blocks, block_size, heads_kv,
// head_dim), contiguous.
//
// Both are copies, so they move bytes, not values: one kernel per word size serves all four
// dtypes, bit for bit. The napkin math is a copy's: every byte read once and written once,
//   reshape_and_cache: tokens * heads_kv * head_dim * sizeof(T) * 2 (K and V), read and written
//   copy_blocks:       pairs * block_size * heads_kv * head_dim * sizeof(T) * 2, read and written
// so the ceiling is device-to-device copy bandwidth, and what reaches it is many independent
// 16-byte loads in flight (an H100 needs ~3 TB/s x ~1 us = ~3 MB of them, ~24 KiB per SM): each
// thread here loads 4 words of K and 4 of V before it stores any, 128 bytes in flight per thread.
//
// The word: 16 bytes where every address allows it, else the widest power of two that divides
// every pointer, stride and row length in bytes (8, 4, down to the element size). The cache is
// contiguous and usually 16-byte aligned; the new key and value of reshape_and_cache are any view
// with a contiguous last dim (a slice of a fused QKV projection, one element off), which serving.h
// does not promise to align, so the launcher looks at the actual addresses and picks the word.
//
// Memory safety whatever the inputs (serving.h): a slot outside [0, num_blocks * block_size) is
// skipped like the padding slot -1, and a copy whose source or destination lies outside the cache
// is skipped; neither reads nor writes anything.
//
// No torch headers: this file builds with a bare `nvcc -c`.
#include "serving/serving.h"

#include <course/cuda_utils.h>
#include <course/dtype.h>

#include <climits>
#include <cstdint>

namespace flash_attention {
namespace {

constexpr int kCopyThreads = 128;
// Words of K and of V each thread loads before it stores any: 2 x 4 x 16 bytes in flight.
constexpr int kCopyUnroll = 4;

int64_t element_bytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
  }
  return 8;
}

// The widest word (16, 8, 4 or 2 bytes) that divides every value of `bits`' OR: the lowest set
// bit of the OR is the largest power of two dividing all of them.
int64_t word_bytes(uint64_t bits) {
  const uint64_t lowest = bits & (~bits + 1);
  return lowest == 0 || lowest > 16 ? 16 : static_cast<int64_t>(lowest);
}

// Calls f(Word{}) for the word size: built-in types, so that a 16-byte word is one LDG.128 /
// STG.128 (course/numeric.cuh says why not a struct).
template <typename F>
cudaError_t with_word(int64_t bytes, F&& f) {
  switch (bytes) {
    case 16: return f(uint4{});
    case 8: return f(uint2{});
    case 4: return f(uint32_t{});
    case 2: return f(uint16_t{});
    default: return cudaErrorInvalidValue;  // every dtype is at least 2 bytes
  }
}

// ------------------------------------------------------------------------------------------
// reshape_and_cache
// ------------------------------------------------------------------------------------------
// Block (tx, ty): threadIdx.x walks the words of one (token, kv head) row, threadIdx.y picks the
// token; blockIdx.y is the kv head. A block takes kCopyUnroll * ty tokens, token u * ty + y of them
// in thread (x, y) (the ty tokens of a step are neighbours). Rows wider than tx words take several
// trips of the word loop.
template <typename Word>
__global__ void __launch_bounds__(kCopyThreads) reshape_and_cache_kernel(const ReshapeAndCacheParams p,
                                                                         int64_t words_per_row, int64_t elem) {
  const KVCacheLayout& cache = p.cache;
  const int64_t head = blockIdx.y;
  const int64_t num_slots = cache.num_blocks * cache.block_size;
  const char* key_row[kCopyUnroll];
  const char* value_row[kCopyUnroll];
  char* key_slot[kCopyUnroll];
  char* value_slot[kCopyUnroll];
  bool valid[kCopyUnroll];
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int64_t token = (static_cast<int64_t>(blockIdx.x) * kCopyUnroll + u) * blockDim.y + threadIdx.y;
    // Tokens past the end (the last block's remainder) and slots outside the cache (-1 pads a
    // batch; any other is skipped the same way) copy nothing.
    const int64_t slot = token < p.tokens ? p.slot_mapping[token] : -1;
    valid[u] = slot >= 0 && slot < num_slots;
    const int64_t src_key = valid[u] ? token * p.key_token_stride + head * p.key_head_stride : 0;
    const int64_t src_value = valid[u] ? token * p.value_token_stride + head * p.value_head_stride : 0;
    const int64_t dst = valid[u] ? (slot * cache.heads_kv + head) * cache.head_dim : 0;
    key_row[u] = static_cast<const char*>(p.key) + src_key * elem;
    value_row[u] = static_cast<const char*>(p.value) + src_value * elem;
    key_slot[u] = static_cast<char*>(p.key_cache) + dst * elem;
    value_slot[u] = static_cast<char*>(p.value_cache) + dst * elem;
  }
  for (int64_t w = threadIdx.x; w < words_per_row; w += blockDim.x) {
    Word k[kCopyUnroll];
    Word v[kCopyUnroll];
    // Every load of the step before any store: 2 * kCopyUnroll words in flight per thread.
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (valid[u]) {
        k[u] = reinterpret_cast<const Word*>(key_row[u])[w];
        v[u] = reinterpret_cast<const Word*>(value_row[u])[w];
      }
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (valid[u]) {
        reinterpret_cast<Word*>(key_slot[u])[w] = k[u];
        reinterpret_cast<Word*>(value_slot[u])[w] = v[u];
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// copy_blocks
// ------------------------------------------------------------------------------------------
// A block per (pair, chunk of kCopyUnroll * kCopyThreads words of a cache block): a cache block
// is block_size * heads_kv * head_dim contiguous elements in each cache (32 KiB at 16 x 8 x 128
// bf16), so a pair is a few chunks, and many pairs fill the GPU. Each thread copies word
// chunk_start + u * kCopyThreads + threadIdx.x of K and of V for each u (coalesced).
template <typename Word>
__global__ void __launch_bounds__(kCopyThreads) copy_blocks_kernel(const CopyBlocksParams p, int64_t block_words,
                                                                   unsigned chunks) {
  const int64_t pair = blockIdx.x / chunks;
  const int64_t chunk = blockIdx.x % chunks;
  const int64_t src = p.block_mapping[2 * pair];
  const int64_t dst = p.block_mapping[2 * pair + 1];
  // An id outside the cache skips the pair (serving.h); src == dst has nothing to copy.
  if (src < 0 || src >= p.cache.num_blocks || dst < 0 || dst >= p.cache.num_blocks || src == dst) return;
  const Word* key_src = static_cast<const Word*>(p.key_cache) + src * block_words;
  const Word* value_src = static_cast<const Word*>(p.value_cache) + src * block_words;
  Word* key_dst = static_cast<Word*>(p.key_cache) + dst * block_words;
  Word* value_dst = static_cast<Word*>(p.value_cache) + dst * block_words;
  const int64_t first = chunk * (kCopyUnroll * kCopyThreads) + threadIdx.x;
  Word k[kCopyUnroll];
  Word v[kCopyUnroll];
  // Every load before any store: 2 * kCopyUnroll words in flight per thread. Words past the
  // block's end (its last chunk's remainder) are not touched.
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int64_t w = first + u * kCopyThreads;
    if (w < block_words) {
      k[u] = key_src[w];
      v[u] = value_src[w];
    }
  }
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int64_t w = first + u * kCopyThreads;
    if (w < block_words) {
      key_dst[w] = k[u];
      value_dst[w] = v[u];
    }
  }
}

uint64_t address_bits(const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

}  // namespace

cudaError_t launch_reshape_and_cache(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  const KVCacheLayout& cache = p.cache;
  if (p.tokens == 0 || cache.heads_kv == 0 || cache.head_dim == 0) return cudaSuccess;  // nothing to write
  const int64_t elem = element_bytes(cache.dtype);
  const int64_t row_bytes = cache.head_dim * elem;
  // Every address a word is read from or written to: the bases, the strides between rows, and
  // the row length. A stride that is never stepped (one token, one kv head) does not count.
  uint64_t bits = address_bits(p.key) | address_bits(p.value) | address_bits(p.key_cache) |
                  address_bits(p.value_cache) | static_cast<uint64_t>(row_bytes);
  if (p.tokens > 1) bits |= static_cast<uint64_t>((p.key_token_stride | p.value_token_stride) * elem);
  if (cache.heads_kv > 1) bits |= static_cast<uint64_t>((p.key_head_stride | p.value_head_stride) * elem);
  const int64_t word = word_bytes(bits);
  const int64_t words_per_row = row_bytes / word;
  // tx: the row's words rounded up to a power of two, at most the block; ty tokens beside them.
  int tx = 1;
  while (tx < words_per_row && tx < kCopyThreads) tx *= 2;
  const int ty = kCopyThreads / tx;
  const int64_t blocks = course::ceil_div(p.tokens, static_cast<int64_t>(kCopyUnroll) * ty);
  if (blocks > INT_MAX || cache.heads_kv > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(cache.heads_kv));
  const dim3 block(tx, ty);
  return with_word(word, [&](auto tag) {
    reshape_and_cache_kernel<decltype(tag)><<<grid, block, 0, stream>>>(p, words_per_row, elem);
    return cudaGetLastError();
  });
}

cudaError_t launch_copy_blocks(const CopyBlocksParams& p, cudaStream_t stream) {
  const KVCacheLayout& cache = p.cache;
  const int64_t block_bytes = cache.block_elems() * element_bytes(cache.dtype);
  if (p.pairs == 0 || block_bytes == 0) return cudaSuccess;  // nothing to copy
  const int64_t word = word_bytes(address_bits(p.key_cache) | address_bits(p.value_cache) |
                                  static_cast<uint64_t>(block_bytes));
  const int64_t block_words = block_bytes / word;
  const int64_t chunks = course::ceil_div(block_words, static_cast<int64_t>(kCopyUnroll) * kCopyThreads);
  const int64_t blocks = p.pairs * chunks;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  return with_word(word, [&](auto tag) {
    copy_blocks_kernel<decltype(tag)>
        <<<static_cast<unsigned>(blocks), kCopyThreads, 0, stream>>>(p, block_words, static_cast<unsigned>(chunks));
    return cudaGetLastError();
  });
}

}  // namespace flash_attention
