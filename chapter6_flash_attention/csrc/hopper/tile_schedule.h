// Chapter 6, part 3: the persistent rung's tile schedule, plain C++ without CUDA types, so that the
// kernel (flash_fwd_hopper_persistent.cuh), its launcher and the glue's hopper_tile_order op (which
// the CPU tests ask) all follow the one rule, in any build.
#pragma once

#include "attention/attention.h"

#include <cstdint>

namespace flash_attention {

// Query rows per block (two consumer warpgroups of wgmma's 64 rows), every Hopper rung.
inline constexpr int kHopperBlockM = 128;
// Keys per key tile: 128, and 64 at head_dim 256, where O alone takes 128 registers a thread
// (flash_fwd_hopper_kernel.cuh's HopperFwdTraits reads it from here, and so does the schedule).
FLASH_ATTENTION_HD constexpr int hopper_block_n(int64_t head_dim) { return head_dim == 256 ? 64 : 128; }

// Block sizes of a paged KV cache whose pages the persistent rung's packed instantiation loads
// through the block table (AttentionParams' block_tables; flash_fwd_hopper_persistent.cuh's
// load_kv): one TMA box per page of a key tile of block_n keys, so a page must divide the tile or
// be a multiple of it (the boxes then tile it exactly, all of one size, the tensor map's), and hold
// at least 8 rows, the 128-byte swizzle's period (8 rows of 128 bytes), so that every page lands on
// a 1024-byte boundary of the tile where the swizzle's pattern starts over. 16, 32, 64, 128, 256 ...
// at block_n 128; any other size runs on the other rungs of paged_prefill_attention (serving.h).
FLASH_ATTENTION_HD constexpr bool paged_prefill_hopper_block_size(int64_t block_size, int block_n) {
  return block_size >= 8 && (block_n % block_size == 0 || block_size % block_n == 0);
}

// How that producer loads a key tile of such pages. A TMA box costs the copy engine about the same
// whatever its size, ~100 ns (the H100 measurement at 16-row pages: 912 us for the prefix config
// against 496 us contiguous, 3.4 us per key tile for its 32 boxes), and a key tile's products take
// ~1.9 us (128 x 128 keys x d128 x 4 flop at ~590 TFLOP/s over 132 SMs): one box per page of r rows
// is 2 (K, V) x 2 (64-column halves) x 128 / r boxes per tile, 3.4 us at r = 16, 1.7 us at 32 (the
// whole budget), 0.85 us at 64. Below kPagedPrefillTmaRows rows the producer warpgroup gathers
// the tile itself with cp.async instead (16 bytes a thread and instruction, 32 per thread and tile
// at d128, each page's slot resolved once per group of tiles: PagedGatherEntries below), which
// costs no box at all; its pace is then the instructions in front of each copy: with the page size
// a compile-time constant there, one address per row for both of its 64-column chunks, and no
// bound to check on the tiles wholly inside the context, about three a copy
// (flash_fwd_hopper_persistent.cuh's gather_tile).
inline constexpr int kPagedPrefillTmaRows = 64;
FLASH_ATTENTION_HD constexpr bool paged_prefill_hopper_gathers(int64_t block_size, int block_n) {
  return paged_prefill_hopper_block_size(block_size, block_n) && block_size < kPagedPrefillTmaRows;
}

// Where the gathering producer's four warps get a key tile's table entries (a bench-only knob, read
// by the launcher at every call from the environment variable FLASH_ATTENTION_PAGED_GATHER, so
// that one build times both): kByGroup (the default: unset, empty, "group" or anything else), each
// warp loads the entries of a group of 32 / (block_n / block_size) tiles at once, one per lane, a
// group ahead, and resolves them (the slots and a ballot of the whole pages) once per group; a tile
// then takes its pages with one shuffle. kByTile ("tile", the gather before it): each warp loads
// the next tile's entries per tile, prefetches the one after's into L1, and resolves and votes per
// tile. Bits are the same either way (the same bytes to the same slots).
enum class PagedGatherEntries { kByGroup, kByTile };
inline constexpr const char* kPagedGatherEnv = "FLASH_ATTENTION_PAGED_GATHER";
inline PagedGatherEntries paged_gather_entries(const char* value) {
  if (value != nullptr && value[0] == 't' && value[1] == 'i' && value[2] == 'l' && value[3] == 'e' && value[4] == '\0')
    return PagedGatherEntries::kByTile;
  return PagedGatherEntries::kByGroup;
}

// The key tiles of query tile m0 .. m0 + kHopperBlockM - 1 under a window or a softcap (the
// persistent rung's kWindowSoftcap instantiation): from the tile holding the first row's first
// visible key to the one holding the last valid row's last, [key_begin(m0), key_end(last row)) in
// attention.h's bottom-right aligned rule, the range part 1's kernel walks (flash_fwd_kernel.cuh).
// Both ends only grow with the row, so no row of the tile sees a key outside it. One difference:
// where the range is empty (every row of the tile sees no key) it is no tile at all, where part 1
// walks the one tile holding key_begin fully masked; the rows get o = 0 and lse = -inf either way.
struct HopperKeyTiles {
  int first;  // the first key tile
  int count;  // key tiles from there
};
// The tiles of `block` holding [begin, end): none where the range is empty.
FLASH_ATTENTION_HD HopperKeyTiles hopper_tiles_of_range(int64_t begin, int64_t end, int block) {
  if (begin >= end) return {0, 0};
  const int first = static_cast<int>(begin / block);
  return {first, static_cast<int>((end + block - 1) / block) - first};
}
FLASH_ATTENTION_HD HopperKeyTiles hopper_window_key_tiles(const AttentionParams& p, int64_t m0, int block_n) {
  const int64_t last_row = (m0 + kHopperBlockM < p.seqlen_q ? m0 + kHopperBlockM : p.seqlen_q) - 1;
  return hopper_tiles_of_range(key_begin(m0, p), key_end(last_row, p), block_n);
}
// The transpose, for the backward (rung "wgmma"'s kWindowSoftcap instantiation): the query tiles of
// block_m rows that see any key of key tile n0 .. n0 + block_n - 1, from the tile holding the first
// row that sees its first key to the one holding the last row that sees its last valid key,
// [row_begin(n0), row_end(last key)) in the same bottom-right rule (attention.h). Both ends only
// grow with the key, so no row outside sees a key of the tile; none where no row sees any.
FLASH_ATTENTION_HD HopperKeyTiles hopper_window_query_tiles(const AttentionParams& p, int64_t n0, int block_n,
                                                            int block_m) {
  const int64_t last_key = (n0 + block_n < p.seqlen_k ? n0 + block_n : p.seqlen_k) - 1;
  return hopper_tiles_of_range(row_begin(n0, p), row_end(last_key, p), block_m);
}

// The persistent rung's tile schedule: the order in which the blocks take the (batch, head, query
// tile) work items. Plain C++, so that the kernel, its launcher and the CPU tests (the
// hopper_tile_order op) follow the one rule.
//
// The order (an index 0 .. tiles - 1):
//   - L2 sections: the (batch, head) pairs are cut into sections of `section` consecutive pairs,
//     whole groups of query heads that share a K/V head (GQA), as many K/V heads as fit in half the
//     L2; a section's tiles all come before the next section's, so the blocks running together
//     read the K and V of a few heads, which stay in L2 while every query tile of those heads
//     streams over them (the other half of the L2 holds Q, O and the rest in flight). When the
//     pairs do not divide into whole sections, the narrower one comes first, where its tiles mix
//     with the next section's instead of running alone at the end.
//   - inside a section the query tile is the outer index and the pair the inner one, and causal
//     query tiles go longest first (the last tile of a head sees every key, the first one tile of
//     them): the tiles taken at any time have about the same length, and the walk ends on the
//     shortest ones.
// The assignment is dynamic, FlashAttention 3's way: block c starts with index c, and each block
// that starts a tile takes the next index from a counter in global memory (atomicAdd), which the
// launcher clears before every launch. A block that drew short tiles takes more of them, so with
// the longest first every block finishes within about one short tile of the others. A static
// assignment (block c takes c, c + grid, c + 2 grid, ...) needs no counter, but where a section is
// a few rounds of the grid long, a round mixes one section's shortest tiles with the next one's
// longest, and the blocks that draw the long ones fall behind for good: replayed on the CPU with a
// tile's key tiles as its cost, the busiest block had 1.2x the average's work at b2 h16 s8192
// causal (test_attention.py replays both).
//
// With a window or a softcap (the kWindowSoftcap instantiation; attention.h's
// uses_window_or_softcap), a query tile's walk is its window's key tiles (hopper_window_key_tiles),
// and these grow with the query tile, stay level, then shrink: both ends of the range only grow
// with the row, each by at most one key tile per query tile (128 rows, 128 keys: the rows' ranges
// move by one whole key tile where no clamp bites), so the walk can rise by one tile per query tile
// (the start clamped at key 0, the end moving), stay level (both moving, or both clamped), then fall
// (the end clamped at seqlen_k, the start moving). A sliding window (w, 0) over a long sequence is a
// short rise over its first w / 128 query tiles, then level. Longest first is then: the level query
// tiles (the longest, peak_lo .. peak_hi, found on the host once per launch) from the top, then the
// two slopes taken alternately from the peak outwards (one tile shorter per step on either side).
// The order is a permutation of the query tiles whatever the walks' shape (the decode below never
// looks at the walks), so a walk that broke the shape would cost balance, never a tile.
struct HopperTileSchedule {
  int q_tiles;   // kHopperBlockM-row query tiles per (batch, head)
  int pairs;     // batch x heads
  int section;   // (batch, head) pairs per L2 section: a multiple of heads / heads_kv
  int first;     // pairs in the first section (the narrower one, when they do not divide)
  int tiles;     // q_tiles x pairs
  bool longest_first;  // causal
  bool windowed;       // a window or a softcap: the query tiles go by peak_lo and peak_hi
  int peak_lo, peak_hi;  // windowed: the first and the last query tile with the longest walk
  bool entries_by_tile;  // paged and gathering: PagedGatherEntries::kByTile (the launcher sets it)
};

// The schedule of a problem with `l2_bytes` of L2 (the launcher passes the GPU's). Callers keep
// q_tiles x batch x heads within an int (the launcher refuses larger).
inline HopperTileSchedule hopper_tile_schedule(const AttentionParams& p, int64_t l2_bytes) {
  HopperTileSchedule s{};
  s.q_tiles = static_cast<int>((p.seqlen_q + kHopperBlockM - 1) / kHopperBlockM);
  s.pairs = static_cast<int>(p.batch * p.heads);
  s.tiles = s.q_tiles * s.pairs;
  s.longest_first = p.causal;
  const int64_t group = p.heads_kv > 0 ? p.heads / p.heads_kv : 1;  // query heads per K/V head
  const int64_t kv_bytes = 2 * p.seqlen_k * p.head_dim * 2;       // K and V of one head, 16-bit
  int64_t kv_heads = kv_bytes > 0 ? (l2_bytes / 2) / kv_bytes : s.pairs;
  if (kv_heads < 1) kv_heads = 1;
  const int64_t section = kv_heads * group;
  s.section = static_cast<int>(section < s.pairs ? section : s.pairs);
  if (s.section < 1) s.section = 1;
  const int rest = s.pairs % s.section;
  s.first = rest > 0 ? rest : s.section;
  s.windowed = uses_window_or_softcap(p);
  s.peak_lo = s.peak_hi = s.q_tiles - 1;
  if (s.windowed) {
    // The walks of every query tile, once per launch on the host: O(seqlen_q / 128) steps.
    const int block_n = hopper_block_n(p.head_dim);
    int longest = -1;
    for (int q = 0; q < s.q_tiles; ++q) {
      const int count = hopper_window_key_tiles(p, static_cast<int64_t>(q) * kHopperBlockM, block_n).count;
      if (count > longest) longest = count, s.peak_lo = q;
      if (count == longest) s.peak_hi = q;
    }
  }
  return s;
}

// The pair (batch x heads + head) of the tile at `index` of the order (0 <= index < tiles), and its
// rank: the place of its query tile in the longest-first order of the query tiles (below).
FLASH_ATTENTION_HD void hopper_tile_pair_rank(const HopperTileSchedule& s, int index, int* pair, int* rank) {
  int first_pair = 0, width = s.first, in_section = index;
  const int first_tiles = s.first * s.q_tiles;
  if (index >= first_tiles) {  // one of the full sections after the first
    const int sec = (index - first_tiles) / (s.section * s.q_tiles);
    first_pair = s.first + sec * s.section;
    width = s.section;
    in_section = index - first_tiles - sec * s.section * s.q_tiles;
  }
  *rank = in_section / width;
  *pair = first_pair + in_section % width;
}

// The tile at `index` of the order: its pair and query tile, without a window or a softcap.
FLASH_ATTENTION_HD void hopper_tile_at(const HopperTileSchedule& s, int index, int* pair, int* q_tile) {
  int rank = 0;
  hopper_tile_pair_rank(s, index, pair, &rank);
  *q_tile = s.longest_first ? s.q_tiles - 1 - rank : rank;
}

// With a window or a softcap (s.windowed): the query tile of rank `rank` (0 .. q_tiles - 1), the
// level tiles from peak_hi down, then alternately one to the right of the peak and one to its left,
// going outwards, and the longer slope's rest once the shorter one has run out.
FLASH_ATTENTION_HD int hopper_window_q_tile(const HopperTileSchedule& s, int rank) {
  const int level = s.peak_hi - s.peak_lo + 1;
  if (rank < level) return s.peak_hi - rank;
  const int d = rank - level;
  const int right = s.q_tiles - 1 - s.peak_hi, left = s.peak_lo;
  const int both = right < left ? right : left;
  if (d < 2 * both) return (d & 1) == 0 ? s.peak_hi + 1 + d / 2 : s.peak_lo - 1 - d / 2;
  return right > left ? s.peak_hi + 1 + d - both : s.peak_lo - 1 - (d - both);
}
FLASH_ATTENTION_HD void hopper_window_tile_at(const HopperTileSchedule& s, int index, int* pair, int* q_tile) {
  int rank = 0;
  hopper_tile_pair_rank(s, index, pair, &rank);
  *q_tile = hopper_window_q_tile(s, rank);
}

// The packed (varlen) layout's order (attention.h's cu_seqlens_q): the work items are (sequence,
// head, query tile) over the sequences' own tiles only, none past a sequence's end, so that no block
// draws an empty item. The host knows only max_seqlen_q (reading cu_seqlens there would be a
// device-to-host sync), so a small kernel before the forward (flash_fwd_hopper_persistent.cuh) reads
// the lengths on the device and writes two arrays into the workspace, with these functions:
//   - order: the sequences by their number of query tiles, most first (ties in batch order);
//   - rank_start[r], r = 0 .. q_tiles: the items before rank r, where rank r holds query tile
//     q_tiles - 1 - r of every sequence that has it, in `order`, each with its heads (inner, so that
//     the query heads of a GQA group sit side by side, as in the padded order).
// So the items go by query tile from the top: the last tiles of the longest sequences first, down to
// the first tile of every sequence. Causal, a tile's walk is its query tile's index plus one key
// tiles (same lengths on both sides), so this is longest first, over sequences of any lengths, as
// the padded order's is over one length; full, the long sequences' tiles come first. There are no L2
// sections here: a sequence's K and V are read by the query tiles of that sequence, which the order
// keeps close in time (at most a rank apart), and a long sequence's tiles run first, together.
// q_tiles is the padded one, ceil(max_seqlen_q / kHopperBlockM): a sequence longer than max_seqlen_q
// (trusted on CUDA) gets the tiles that fit, as the one-tile rungs' padded grid gives it.
FLASH_ATTENTION_HD int hopper_varlen_tiles(int64_t len_q, int q_tiles) {
  const int64_t tiles = len_q > 0 ? (len_q + kHopperBlockM - 1) / kHopperBlockM : 0;
  return static_cast<int>(tiles < q_tiles ? tiles : q_tiles);
}
// Whether sequence a comes before sequence b in `order` (a != b): more tiles, or as many and first.
FLASH_ATTENTION_HD bool hopper_varlen_before(int tiles_a, int a, int tiles_b, int b) {
  return tiles_a > tiles_b || (tiles_a == tiles_b && a < b);
}
// The items one sequence of `tiles` query tiles has before rank r (its tiles q_tiles - r and up).
FLASH_ATTENTION_HD int64_t hopper_varlen_items_before(int tiles, int q_tiles, int rank) {
  const int64_t n = static_cast<int64_t>(tiles) - (q_tiles - rank);
  return n > 0 ? n : 0;
}
// The item at `index` (< rank_start[q_tiles]), with `rank` the rank of an index drawn before it (or
// 0): the draws of one block only grow, so its rank cursor only moves forward, q_tiles steps at most
// over the whole walk. Returns the item as the padded order's encoding, pair x q_tiles + query tile
// (pair = sequence x heads + head), which is what the producer hands to the consumers.
FLASH_ATTENTION_HD int hopper_varlen_item(int index, int* rank, int q_tiles, int heads, const int* rank_start,
                                          const int* order) {
  while (*rank + 1 < q_tiles && index >= rank_start[*rank + 1]) ++*rank;
  const int k = index - rank_start[*rank];
  const int b = order[k / heads], h = k % heads;
  return (b * heads + h) * q_tiles + (q_tiles - 1 - *rank);
}

// The FP8 forward's grid order (flash_fwd_hopper_fp8.cuh: one block per query tile, block i taking
// the tile at index i of this order, the hardware starting blocks in index order as SMs come free).
// The same rule as the persistent rung's, over K and V of one byte an element: a head's K and V take
// half the 16-bit bytes, so twice as many heads make an L2 section, which is the 16-bit rule on
// twice the L2. Causal, the longest query tiles first in each section: a grid taken head by head
// (each head's tiles longest first, then the next head's) ends with a head's longest tile starting
// about when the average block finishes, ~6% past the average at b2 h16 s8192 on 132 SMs against
// ~0.5% this way (the replay in test_attention_fp8.py).
inline HopperTileSchedule hopper_fp8_tile_schedule(const AttentionParams& p, int64_t l2_bytes) {
  return hopper_tile_schedule(p, 2 * l2_bytes);
}

}  // namespace flash_attention
