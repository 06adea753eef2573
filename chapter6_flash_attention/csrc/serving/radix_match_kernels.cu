// Chapter 6, serving half: the radix-tree prefix lookup on the GPU (serving.h's match_prefix over
// the flat RadixTreeView that flash_attention/radix.py mirrors its trie into).
//
// Every scheduling step of a server looks up the prompts of the requests it admits, to reuse the
// KV blocks of the longest prefix already cached. On the GPU the lookup reads the tree where the
// cache lives and needs no copy of the requests back to the host.
//
// One warp per request. The walk is sequential (a node's children are known only once the node
// is), but each step compares a whole block of block_size tokens, and that comparison is parallel:
// lane j compares tokens j, j + 32, ... and __all_sync folds the answers, one round for block
// sizes up to 32. At a node the warp bisects the children (sorted by first token) for the
// request's next token, then tries the run of children that share it, block against block (two
// children may share a first token and differ later in their first block). The matching child's
// edge is then followed block by block; a block that differs ends the match inside the edge (the
// tree shares only whole blocks: serving.h). All lanes take the same branches: every value they
// branch on is loaded by all of them from the same address.
//
// The napkin math is latency, not bandwidth: a lookup is a chain of dependent loads (child list,
// first tokens, edge tokens), a few hundred nanoseconds each from L2, and a warp per request runs
// a batch's chains side by side.
//
// Bounds: a request's tokens are read only below its whole blocks, query_lens[r] / block_size *
// block_size (the glue clamps the lengths to the row first), and at most max_match_blocks block
// ids are written. The tree itself is trusted: RadixCache builds it, the CPU path checks it, and
// the view carries no array lengths to check its offsets against. What is guarded is that the
// walk ends: a child outside the tree or with an empty span is never followed, so every step
// consumes a block of the request, and there are at most max_match_blocks steps.
//
// No torch headers: this file builds with a bare `nvcc -c`.
#include "serving/serving.h"

#include <course/cuda_utils.h>

#include <climits>
#include <cstdint>

namespace flash_attention {
namespace {

constexpr int kMatchWarps = 4;

// Whether block_size tokens at a and at b agree, the lanes comparing one token each per round.
// All 32 lanes must call it (the vote takes the full mask).
__device__ __forceinline__ bool blocks_equal(const int32_t* a, const int32_t* b, int64_t block_size, int lane) {
  bool same = true;
  for (int64_t j = lane; j < block_size; j += 32) same &= a[j] == b[j];
  return __all_sync(0xffffffffu, same);
}

__global__ void __launch_bounds__(kMatchWarps * 32) match_prefix_kernel(const MatchPrefixParams p) {
  const RadixTreeView& tree = p.tree;
  const int lane = threadIdx.x % 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kMatchWarps + threadIdx.x / 32;
  // The last block's spare warps (uniform per warp, so no vote below misses a lane).
  if (r >= p.requests) return;
  const int64_t bs = tree.block_size;
  const int32_t* query = p.queries + r * p.query_stride;
  const int32_t len = p.query_lens[r];
  const int64_t whole_blocks = (len > 0 ? len : 0) / bs;
  const int64_t limit = whole_blocks < p.max_match_blocks ? whole_blocks : p.max_match_blocks;
  int32_t* blocks = p.matched_blocks + r * p.max_match_blocks;

  int64_t matched = 0;  // blocks of the request matched so far
  int64_t node = 0;     // the root
  while (matched < limit) {
    const int32_t* next = query + matched * bs;  // the request's next whole block
    const int64_t first_child = tree.child_start[node];
    const int64_t children = tree.child_count[node];
    auto first_token = [&](int64_t i) { return tree.tokens[tree.token_start[tree.child_index[first_child + i]]]; };
    // The first child whose first token is not below the request's next token.
    int64_t lo = 0;
    int64_t hi = children;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (first_token(mid) < next[0]) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    // The children that start with that token, whole first block against the request's block.
    int64_t child = -1;
    for (int64_t i = lo; i < children; ++i) {
      const int64_t c = tree.child_index[first_child + i];
      // A link outside the tree, or to the root, or to an empty span would not advance the walk.
      if (c < 1 || c >= tree.num_nodes || tree.span_blocks[c] < 1) continue;
      const int32_t* edge = tree.tokens + tree.token_start[c];
      if (edge[0] != next[0]) break;  // sorted by first token: the run is over
      if (blocks_equal(edge, next, bs, lane)) {
        child = c;
        break;
      }
    }
    if (child < 0) break;  // no child continues the request

    const int32_t* edge = tree.tokens + tree.token_start[child];
    const int32_t* ids = tree.block_ids + tree.block_start[child];
    const int64_t span = tree.span_blocks[child];
    // Block 0 of the edge was just compared.
    if (lane == 0) blocks[matched] = ids[0];
    ++matched;
    int64_t i = 1;
    for (; i < span && matched < limit; ++i, ++matched) {
      if (!blocks_equal(edge + i * bs, query + matched * bs, bs, lane)) break;
      if (lane == 0) blocks[matched] = ids[i];
    }
    if (i < span) break;  // the match ends inside this edge (a differing block, or the limit)
    node = child;
  }
  if (lane == 0) p.matched_tokens[r] = static_cast<int32_t>(matched * bs);
}

}  // namespace

cudaError_t launch_match_prefix(const MatchPrefixParams& p, cudaStream_t stream) {
  if (p.requests == 0) return cudaSuccess;  // no request: nothing to write
  if (p.tree.block_size < 1 || p.tree.num_nodes < 1) return cudaErrorInvalidValue;  // the glue checks both
  const int64_t blocks = course::ceil_div(p.requests, static_cast<int64_t>(kMatchWarps));
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  match_prefix_kernel<<<static_cast<unsigned>(blocks), kMatchWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flash_attention
