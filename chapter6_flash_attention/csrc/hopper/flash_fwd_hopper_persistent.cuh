// Chapter 6, part 3, rung "persistent": the forward of flash_fwd_hopper_kernel.cuh in a grid of one
// block per SM slot, each walking a list of (batch, head, query tile) work items.
//
// Why. A block of the other rungs computes one 128-row tile and exits. Before its first product it
// waits for Q and the first K/V stage to arrive (the copies' latency, with nothing else to do),
// and after its last one it normalizes O and stores it with the tensor cores idle; at 512 keys a
// tile is four key tiles, and that prologue and epilogue are a large share of it. And the grid's
// last wave runs on part of the GPU. Here the block stays: the producer warp loads tile i + 1's Q
// and first K/V stages while the consumers finish tile i and store its output, so the prologue of
// every tile but the first hides under the epilogue of the one before, and the schedule
// (HopperTileSchedule, tile_schedule.h: longest tiles first, the blocks drawing the next tile from
// a counter) ends the grid on the shortest tiles.
//
// What carries across tiles, and why each is correct:
//   - the work items: the producer thread draws them (atomicAdd on the launch's counter) and hands
//     each to the consumers through a two-slot ring in shared memory (tile_full: the slot is
//     written; tile_empty: all 256 consumer threads have read it, each arriving for itself: one
//     arrive per warp after a __syncwarp leaves the other lanes' reads of the slot unordered with
//     the producer's next write for compute-sanitizer's racecheck, which reported it), so it can
//     publish tile i + 1 while the consumers are on tile i. The index past the last tile ends both
//     loops.
//   - the K/V ring: producer and consumers count key tiles over the whole walk (kv_trips), not per
//     work item, so stage (trip % kStages) and parity ((trip / kStages) & 1) continue where the last
//     tile left them: each mbarrier completes its phases in the same order in which they are waited
//     for, whichever tile a trip belongs to.
//   - Q: one buffer, now two barriers each way, one per consumer warpgroup (its 64 rows are one TMA
//     box of their own). A warpgroup releases its half (q_empty) once its last Q K^T of the tile has
//     completed, before its last P V and the epilogue, and the producer refills that half for the
//     next tile at once: the copy runs under the last P V and the stores (under the stores alone
//     at d = 256, whose warp_specialized schedule has no product in flight to overlap before its
//     last P V is done). q_trips counts the tiles that loaded a Q (a tile whose rows see no key
//     loads nothing), on both sides alike.
//   - the next tile's copies, in the order their buffers come free: its first K/V stage first (free
//     once the consumers are done with the trip kStages back, two key tiles before this tile's end
//     at three stages), then Q's halves (free with each warpgroup's last Q K^T), then the rest of
//     its stages. And as soon as the producer draws a tile (a few key tiles ahead of the consumers),
//     it asks the copy engine to bring that tile's Q and first K/V stage into L2 (a prefetch with
//     no destination in shared memory, so nothing waits for a buffer): the copies into shared
//     memory, issued later, then find them there instead of in device memory. Where a tile walks
//     four key tiles (512 keys), waiting for Q before the first K/V copy and fetching both from
//     device memory had left the tensor cores idle at every tile's start (README, part 3).
//   - the ping-pong turns: one turn sequence over the whole walk, not per tile. Warpgroup 1 gives
//     warpgroup 0 the first turn once, every turn is passed on (the last turn of a tile hands the
//     tensor cores to the other warpgroup's next tile), and warpgroup 0 takes one last, empty turn
//     at the end, so each named barrier sees as many arrivals as syncs.
// The consumers' math per key tile is the other rungs' (hopper_fwd::issue_qk, online_softmax, ...),
// so the output is the same bits as theirs: rung "pingpong" at d = 64 and 128, "warp_specialized" at
// d = 256 (the tests hold it to that).
//
// The packed (varlen) layout (kVarlen, a template parameter: the padded kernel is compiled without
// any of it), FlashAttention 3's way. The tensor maps describe the packed tensors, every token of
// every sequence as one batch of (total_tokens, heads, head_dim); a work item is (sequence, head,
// query tile) in tile_schedule.h's varlen order, which a one-block kernel before this one writes
// into the workspace from cu_seqlens (the host never reads the lengths); its Q rows start at
// cu_seqlens_q[b] + m0 and its K/V tiles at cu_seqlens_k[b] + n0. Then the item is its sequence as a
// batch of one: that sequence's lengths in place of seqlen_q and seqlen_k (its own bottom-right
// causal mask), the output and lse at its first token. TMA zero-fills only past the end of the whole
// tensor, so a partial tile brings in the next sequence's rows: as keys they are past the
// sequence's seqlen_k and the last key tile's mask (the padded kernel's, for keys past the end)
// gives them -inf, so P is 0 there and P V adds exact zeros (the values are finite); as query rows
// they are past its seqlen_q, computed and not stored (store_o_lse's guard, as for the padded last
// tile's zero rows). So each sequence's output is the bits of the padded rung on that sequence alone.
//
// Local attention and softcapping (attention.h's window and softcap; kWindowSoftcap, a template
// parameter as part 1's is, so that the plain instantiations compile without any of it, and one
// flag for both: flash_fwd_kernel.cuh says why). A work item walks only the key tiles its rows'
// windows reach, hopper_window_key_tiles (tile_schedule.h): part 1's range [key_begin(first row),
// key_end(last row)), bottom-right aligned, so that a window of w keys costs about (128 + w) / 128
// key tiles per item instead of seqlen_k / 128; the producer loads key tile first + i on trip i,
// and the consumers mask the window's edges (online_softmax's kWindow) only on the tiles they cross
// for some row of the warpgroup: those before the first tile every row sees whole, and those from
// the first one some row's right edge (or seqlen_k) cuts. The softcap replaces the scaling: the
// scores are capped in log2 units (softcap.cuh's helper, part 1's), and the softmax then runs with
// a scale of 1, so lse = max ln 2 + log(l) is of the capped scores, in natural units, as part 1's
// forward writes it and the backward (rung "mma_dqpass", which rebuilds P from lse) expects. A row
// whose window holds no key ends with l = 0: o = 0 and lse = -inf, as in part 1; an item none of
// whose rows sees a key loads nothing. The schedule (tile_schedule.h) orders the query tiles by
// their window's walk, longest first. Padded layout, head dims kHopperWindowHeadDims only: the
// packed layout with a window runs on "split_kv".
#pragma once

#include "attention/mma.cuh"  // cp_async_16: the paged producer's gather
#include "attention/softcap.cuh"
#include "hopper/flash_fwd_hopper_kernel.cuh"

#include <cstdlib>  // std::getenv: the gather's table-entry knob (the launcher's)

namespace flash_attention {

// The packed layout's schedule (tile_schedule.h): one block reads every sequence's length from
// cu_seqlens_q and writes `order` and `rank_start` into the workspace, and clears the tile counter
// (workspace[0]) for the forward that follows it on the stream. O(batch^2 + q_tiles x batch) steps
// over all threads, the lengths staged through shared memory a chunk at a time: microseconds at a
// few hundred sequences, against a forward that reads every token. A template (of its block size)
// so that every instantiation file may include its definition.
inline constexpr int kVarlenScheduleThreads = 1024;
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    hopper_varlen_schedule_kernel(const int32_t* cu_seqlens_q, int batch, int heads, int q_tiles, int* workspace) {
  int* rank_start = workspace + 1;            // q_tiles + 1 entries
  int* order = workspace + 2 + q_tiles;       // batch entries
  __shared__ int chunk[kThreads];  // the tiles of sequences c0 .. c0 + kThreads - 1
  auto tiles_of = [&](int b) {
    return hopper_varlen_tiles(static_cast<int64_t>(cu_seqlens_q[b + 1]) - cu_seqlens_q[b], q_tiles);
  };
  // Both loops below walk every chunk of sequences with the whole block (their bounds are the same
  // for every thread), so the barriers inside are reached by all.
  auto each_chunk = [&](auto&& visit) {
    for (int c0 = 0; c0 < batch; c0 += kThreads) {
      __syncthreads();  // everyone is done reading the previous chunk before it is overwritten
      if (c0 + static_cast<int>(threadIdx.x) < batch) chunk[threadIdx.x] = tiles_of(c0 + threadIdx.x);
      __syncthreads();  // the chunk is written before anyone reads it
      const int n = min(kThreads, batch - c0);
      visit(c0, n);
    }
  };
  if (threadIdx.x == 0) *workspace = 0;  // the forward's tile counter
  // order: sequence b's place is the number of sequences before it.
  for (int base = 0; base < batch; base += kThreads) {
    const int b = base + threadIdx.x;
    const int tiles = b < batch ? tiles_of(b) : 0;
    int place = 0;
    each_chunk([&](int c0, int n) {
      for (int j = 0; j < n; ++j) place += hopper_varlen_before(chunk[j], c0 + j, tiles, b) ? 1 : 0;
    });
    if (b < batch) order[place] = b;
  }
  // rank_start: the items before each rank, every sequence's share.
  for (int base = 0; base <= q_tiles; base += kThreads) {
    const int rank = base + threadIdx.x;
    int64_t items = 0;
    each_chunk([&](int, int n) {
      for (int j = 0; j < n; ++j) items += hopper_varlen_items_before(chunk[j], q_tiles, rank);
    });
    if (rank <= q_tiles) rank_start[rank] = static_cast<int>(items * heads);  // <= tiles: the launcher's bound
  }
}

// kWindowSoftcap: this instantiation computes a window and a softcap (`cap`, unread otherwise; it
// comes last so that the other arguments sit where they did before it existed).
template <typename T, typename K, bool kVarlen, bool kWindowSoftcap>
__global__ void __launch_bounds__(K::kThreads, 1)
    flash_fwd_hopper_persistent_kernel(const __grid_constant__ CUtensorMap map_q,
                                       const __grid_constant__ CUtensorMap map_k,
                                       const __grid_constant__ CUtensorMap map_v, const AttentionParams p,
                                       const HopperTileSchedule schedule, int* tile_counter, float scale_log2,
                                       const Softcap cap) {
#if COURSE_HOPPER_DEVICE
  using namespace hopper;
  using namespace hopper_fwd;
  static_assert(K::kPersistent, "the persistent schedule's traits");
  static_assert(!(kVarlen && kWindowSoftcap), "the packed layout with a window runs on part 1's kernel");
  constexpr int kBN = K::kBlockN, kBM = K::kBlockM, kStages = K::kStages;
  constexpr int kHalfQBytes = K::kQBytes / 2;  // one consumer warpgroup's 64 rows of Q
  extern __shared__ unsigned char smem_raw[];
  // The swizzle pattern repeats every 1024 bytes and the descriptors assume atoms there.
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  unsigned char* q_s = smem;                          // [chunk][kBlockM rows][64]: warpgroup w's rows at 64 w
  unsigned char* k_s = q_s + K::kQBytes;              // [stage][chunk][kBlockN rows][64]
  unsigned char* v_s = k_s + kStages * K::kKVBytes;   // same
  __shared__ uint64_t q_full[2], q_empty[2], k_full[kStages], v_full[kStages], kv_empty[kStages];
  __shared__ uint64_t tile_full[2], tile_empty[2];
  __shared__ int tile_slot[2];  // the work items handed from the producer to the consumers
  __shared__ int producer_slot[2];  // the same, from the producer's first thread to the others (gather)

  // Paged K/V (AttentionParams' block_tables; packed only): the producer loads each key tile page by
  // page through the table (load_kv below), and the items read their key counts from context_lens.
  // Pages of fewer than kPagedPrefillTmaRows rows (tile_schedule.h's paged_prefill_hopper_gathers,
  // the launcher's rule too) are gathered by the whole producer warpgroup with cp.async, larger ones
  // copied by its first thread with one TMA box per page.
  const bool paged = kVarlen && p.block_tables != nullptr;
  const bool gather = paged && paged_prefill_hopper_gathers(p.block_size, kBN);

  if (threadIdx.x == 0) {
    prefetch_tensor_map(&map_q);
    prefetch_tensor_map(&map_k);
    prefetch_tensor_map(&map_v);
    for (int w = 0; w < 2; ++w) {
      mbarrier_init(&q_full[w], 1);   // the producer's arrive, with the half's bytes
      mbarrier_init(&q_empty[w], 4);  // one arrive per warp of warpgroup w, its last Q K^T done
      mbarrier_init(&tile_full[w], 1);                    // the producer wrote slot w
      mbarrier_init(&tile_empty[w], K::kConsumerThreads);  // every consumer thread read it
    }
    for (int s = 0; s < kStages; ++s) {
      // The producer's arrive with the tile's bytes (TMA), or gathering, one cp.async arrival per
      // producer thread (each fires once that thread's copies of the tile have landed).
      const uint32_t arrivals = gather ? K::kProducerThreads : 1;
      mbarrier_init(&k_full[s], arrivals);
      mbarrier_init(&v_full[s], arrivals);
      mbarrier_init(&kv_empty[s], 8);  // one arrive per consumer warp once it is done with the stage
    }
    fence_barrier_init();
  }
  __syncthreads();  // the barriers are initialised before anyone waits on them

  // A work item, as both roles decode it from the value in the slot: padded, its index in the
  // schedule's order; packed, the (pair, query tile) the producer decoded (tile_schedule.h).
  // q_row, k_row and map_b are the coordinates its copies start at: padded (m0, 0, b), packed
  // (cu_seqlens_q[b] + m0, cu_seqlens_k[b], 0) in the maps of one batch of every token.
  struct Item {
    int b, h, hk, n_tiles, map_b;
    int first_tile;  // the walk's first key tile: 0 but under a window (kWindowSoftcap)
    int64_t m0, pair, q_row, k_row;
    int64_t seqlen_q, seqlen_k;  // the item's sequence's: padded p's, packed its own
  };
  auto item_at = [&](int value) {
    Item it;
    int pair, q_tile;
    if constexpr (kVarlen) {
      pair = value / schedule.q_tiles;
      q_tile = value % schedule.q_tiles;
    } else if constexpr (kWindowSoftcap) {
      hopper_window_tile_at(schedule, value, &pair, &q_tile);  // longest window walk first
    } else {
      hopper_tile_at(schedule, value, &pair, &q_tile);
    }
    it.pair = pair;
    it.b = static_cast<int>(pair / p.heads);
    it.h = static_cast<int>(pair % p.heads);
    it.hk = static_cast<int>(it.h / (p.heads / p.heads_kv));  // GQA
    it.m0 = static_cast<int64_t>(q_tile) * kBM;
    if constexpr (kVarlen) {
      if (paged) {
        // Paged (a runtime choice: the consumers read only seqlen_q and seqlen_k, the same either way):
        // the rows clamped into [0, total_q] and the keys to the table row (serving.h's prefill_rows
        // and paged_context), since a server's unchecked offsets and lengths must not move a store
        // outside the output or a table read outside the row. The keys' copies go through the table
        // (load_kv below), so there is no k_row.
        const int64_t q0 = min(max(int64_t{p.cu_seqlens_q[it.b]}, int64_t{0}), p.total_q);
        const int64_t q1 = min(max(int64_t{p.cu_seqlens_q[it.b + 1]}, q0), p.total_q);
        it.seqlen_q = q1 - q0;
        it.seqlen_k = min(max(int64_t{p.context_lens[it.b]}, int64_t{0}), p.max_blocks * p.block_size);
        it.q_row = q0 + it.m0;
        it.k_row = it.b * p.block_table_stride;  // paged: where its table row starts (load_kv)
      } else {
        // A pair of offsets that decreases (cu_seqlens the host never read) is an empty sequence, as in
        // varlen.cuh; the order has no item of it then, and the keys clamp alike.
        const int64_t q0 = p.cu_seqlens_q[it.b], k0 = p.cu_seqlens_k[it.b];
        it.seqlen_q = max(int64_t{0}, p.cu_seqlens_q[it.b + 1] - q0);
        it.seqlen_k = max(int64_t{0}, p.cu_seqlens_k[it.b + 1] - k0);
        it.q_row = q0 + it.m0;
        it.k_row = k0;
      }
      it.map_b = 0;
    } else {
      it.seqlen_q = p.seqlen_q;
      it.seqlen_k = p.seqlen_k;
      it.q_row = it.m0;
      it.k_row = 0;
      it.map_b = it.b;
    }
    if constexpr (kWindowSoftcap) {
      const HopperKeyTiles keys = hopper_window_key_tiles(p, it.m0, kBN);
      it.first_tile = keys.first;
      it.n_tiles = keys.count;
    } else {
      const int64_t last_row = (it.m0 + kBM < it.seqlen_q ? it.m0 + kBM : it.seqlen_q) - 1;
      it.first_tile = 0;
      it.n_tiles = static_cast<int>((visible_keys(last_row, it.seqlen_q, it.seqlen_k, p.causal) + kBN - 1) / kBN);
    }
    return it;
  };
  // The value handed to the consumers for the index drawn: padded the index itself, packed the item
  // it names in the varlen order (tile_schedule.h), or `tiles` (the end) past the last one. The
  // rank cursor is the producer's, moving forward with its draws.
  const int* rank_start = tile_counter + 1;
  const int* order = tile_counter + 2 + schedule.q_tiles;
  int rank = 0;
  auto value_of = [&](int index) {
    if constexpr (kVarlen) {
      if (index >= rank_start[schedule.q_tiles]) return schedule.tiles;  // every sequence's tiles drawn
      return hopper_varlen_item(index, &rank, schedule.q_tiles, static_cast<int>(p.heads), rank_start, order);
    } else {
      return index;
    }
  };

  if (threadIdx.x < K::kProducerThreads) {
    // The producer: one thread walks the same items as the consumers and issues every copy, as far
    // ahead as the barriers let it: into item i + 1 while the consumers are still on item i.
    // Gathering small pages, the whole warpgroup walks them: the first thread (the leader) still
    // draws the items, hands them to the consumers and copies Q, and shares each item it draws with
    // the other 127 through producer_slot, and all 128 copy K and V.
    setmaxnreg_dec<K::kProducerRegs>();
    if (threadIdx.x == 0 || gather) {
      const bool leader = threadIdx.x == 0;
      uint32_t q_trips = 0, kv_trips = 0, draws = 0;
      // The leader's draw, as every producer thread sees it. Slot draws % 2 is written, then hardware
      // barrier 3 (1 and 2 are the consumers' ping-pong) of the producer's 128 threads publishes it;
      // the slot is written again two draws later, after the next draw's barrier, which every
      // thread passes only once done reading this one.
      auto share = [&](int drawn) {
        if (!gather) return drawn;
        const int slot = draws++ & 1;
        if (leader) producer_slot[slot] = drawn;
        named_barrier_sync(3, K::kProducerThreads);
        return producer_slot[slot];
      };
      // The first round is the grid itself; the counter hands out the rest.
      int value = share(leader ? value_of(blockIdx.x) : 0);
      Item it{};  // the item `value` names, decoded once it is drawn (none past the end)
      if (value < schedule.tiles) it = item_at(value);
      // Gathering: the table entries that load_kv resolves next, as tile_pages (by tile: the next
      // tile's) or group_pages (by group: the next group's) loads them. By group, the current group's
      // resolved entries too: lane l's page's first slot or -1 (`group_firsts`), and the ballot of its
      // pages that are whole (every row below the context, the id in the cache: `group_whole`).
      int32_t pages = -1, group_firsts = -1;
      uint32_t group_whole = 0;
      // Trip kv_trips of the walk: key tile it.first_tile + i of the item. Its stage is free once the
      // 8 consumer warps are done with trip kv_trips - kStages (of this item or of an earlier one).
      // Paged: key tile i of the item as boxes of page_rows rows, one per page (a page of at least
      // kBN rows: one box, the tile's kBN rows at their offset in the page), each handed to
      // box(first row in the tile, row in the page, block id). The maps describe the cache as
      // (head_dim, heads_kv, block_size, num_blocks), a box (64 columns, 1 head, page_rows rows,
      // 1 block) (the launcher). A page none of whose rows is below the context (its table entry may
      // be junk: serving.h), or whose id is outside the cache (check_tables=False), is named by
      // block num_blocks, one past the map's end: TMA reads nothing there and fills the box with
      // zeros, and still counts its bytes, so every tile completes with the same expect-tx. Those
      // rows are past the context (masked by the consumers, their zero values adding 0 x 0) or in
      // an absent block (zeros: a score of 0, not serving.h's "absent"; flash_attention/paged.py
      // says so). The rows of the last page past the context are the cache's bytes there: masked
      // alike, their values multiplied by P = 0 (finite in a cache made with zeros or written before;
      // a NaN there would survive 0 x NaN: serving.h).
      auto paged_boxes = [&](int i, auto&& box) {
        // In ints: the launcher keeps num_blocks and max_blocks x block_size (every key) below INT_MAX.
        // Read from the parameters here, not held across the walk: the producer has 56 registers (and
        // for the same reason its table row's offset rides in it.k_row, unused when paged).
        const int block_size = static_cast<int>(p.block_size), num_blocks = static_cast<int>(p.num_blocks);
        const int page_rows = block_size < kBN ? block_size : kBN;
        const int n0 = (it.first_tile + i) * kBN;
        // One division per tile: the tile's first page and its row there. A page of at most kBN rows
        // starts at row 0 and the next box is the next page; a longer page holds the whole tile
        // (one box, from row n0 mod block_size).
        int page = n0 / block_size;
        const int row = n0 - page * block_size;
        const int32_t* table = p.block_tables + it.k_row;
        for (int r0 = 0; r0 < kBN; r0 += page_rows, ++page) {
          int id = num_blocks;  // one past the map's end: a box of zeros
          if (n0 + r0 < static_cast<int>(it.seqlen_k)) {  // a row below the context: the entry is valid
            const int32_t entry = table[page];
            if (entry >= 0 && entry < num_blocks) id = entry;
          }
          box(r0, row, id);
        }
      };
      // Gathering: the table entries of key tile i's pages (kBN / block_size of them, at most 16), one
      // per lane of every producer warp: lane l holds page l of the tile, one coalesced load per warp
      // instead of one per copied row. The raw entry, or -1 for a page with no row below the context
      // (its entry may be junk: serving.h): nothing here reads the loaded value, so the load stays in
      // flight until gather_tile's shuffles need it, and the walk issues it a tile ahead (`pages`).
      auto tile_pages = [&](int i) {
        const int lane = static_cast<int>(threadIdx.x % 32), shift = __ffs(static_cast<int>(p.block_size)) - 1;
        const int page = (((it.first_tile + i) * kBN) >> shift) + lane;
        int32_t entry = -1;
        if (lane < (kBN >> shift) && (page << shift) < static_cast<int>(it.seqlen_k))
          entry = p.block_tables[it.k_row + page];
        return entry;
      };
      // Gathering: key tile i's table entries into L1, a tile before tile_pages loads them (the
      // first producer warp, one prefetch per lane and page, under tile_pages' guard, so every
      // address is in the table row). The load then hits L1 however the row's 128-byte lines fall
      // (a line holds 4 tiles' entries at 16 rows, 2 at 8, 8 at 32): an L2 round trip the producer
      // would otherwise wait for once per line, at the top of a tile, when it is behind.
      auto prefetch_pages = [&](int i) {
        const int lane = static_cast<int>(threadIdx.x % 32), shift = __ffs(static_cast<int>(p.block_size)) - 1;
        const int page = (((it.first_tile + i) * kBN) >> shift) + lane;
        if (threadIdx.x < 32 && lane < (kBN >> shift) && (page << shift) < static_cast<int>(it.seqlen_k))
          prefetch_global_l1(p.block_tables + it.k_row + page);
      };
      // Gathering, by group (tile_schedule.h's PagedGatherEntries::kByGroup): the entries of group g,
      // the item's key tiles g T .. g T + T - 1 (T = 32 / (kBN / block_size): 2, 4, 8 at 8, 16, 32
      // rows and kBN 128), one page per lane, the whole warp's 32 lanes; -1 for a page with no row
      // below the context, as tile_pages. Loaded a group ahead (load_kv), so at least two tiles of
      // copies hide it, and no L1 prefetch is needed. Every address is in the table row (the guard:
      // a page with a row below the context, seqlen_k <= max_blocks x block_size).
      auto group_pages = [&](int g) {
        const int lane = static_cast<int>(threadIdx.x % 32), shift = __ffs(static_cast<int>(p.block_size)) - 1;
        const int page = ((it.first_tile * kBN) >> shift) + (g << 5) + lane;
        int32_t entry = -1;
        if ((page << shift) < static_cast<int>(it.seqlen_k)) entry = p.block_tables[it.k_row + page];
        return entry;
      };
      // Gathering: key tile i of the item, K or V, by the 128 producer threads with cp.async, 16 bytes
      // a copy, completing on `full`. Thread t copies 16-byte piece c = t % 8 of every 64-column
      // chunk (K::kChunks: 1 at d64, 2 at d128) of rows r0 + kRowStep k, r0 = t / 8, kRowStep = 16:
      // 8 consecutive lanes read a chunk's 128 contiguous bytes of a row, and a piece's place is
      // fixed: piece c of row r lands in its chunk, row r, at 16-byte slot c ^ (r % 8), the 128-byte
      // swizzle that TMA writes (its pattern by the shared-memory address, the rows 128 bytes apart
      // from a 1024-byte-aligned stage) and the consumers' descriptors read; kRowStep is a multiple of
      // 8, so r % 8 is the thread's for every row. A row at or past the context or in a block
      // outside the cache is copied with a source size of 0: 16 zero bytes, nothing read (the TMA
      // path's rows past the context in the last page are the cache's bytes; zeros here, masked
      // alike).
      //
      // The copies are the producer's whole cost: a thread issues kBN / kRowStep x kChunks of them
      // per tile for K and as many for V (32 at d128), one producer warp per scheduler, so the
      // instructions in front of each copy, not the bytes, set the tile's pace. `firsts` holds, in
      // lane j, page j of the tile's first slot in the cache (block id x block_size), or -1 for a
      // page with no valid rows (load_kv resolves it once per tile for K and V both). The page size
      // is a template parameter (kShift = log2 block_size: 8, 16, 32 rows, the only sizes that
      // gather), so every row's page and its row there are constants of the unrolled loop plus the
      // thread's r0: a page's slot is one shuffle for all of the thread's rows in it (on whole tiles
      // one for K and V both: `slots`, from load_kv; nullptr otherwise). A row's chunks
      // are 128 bytes apart in the cache and kBN x 128 in the stage, both immediate offsets of the
      // copy, so one address serves a row's kChunks copies. Whole tiles (every row below the
      // context, every page in the cache: all of an item's tiles but a last partial one) skip the
      // bounds: a page is a shuffle and a multiply-add, its other rows an add each, and a copy
      // needs nothing more (3-4 SASS instructions a copy at d128, shuffles included). (Before: a
      // thread per piece of a row, 16 a row at d128, so one address a copy, each behind its own
      // compare and select: 9 instructions a copy, the producer's tile longer than the consumers'
      // products at 8-32 rows; and before that, with the page size a runtime value, ~24 in one
      // dependent chain: NOTES.md, paged prefill.)
      auto gather_tile = [&](auto shift_tag, auto whole_tag, unsigned char* dst, const void* cache, int i,
                             int32_t firsts, const uint32_t* slots, uint64_t* full) {
        constexpr int kShift = decltype(shift_tag)::value, kPageRows = 1 << kShift;
        constexpr bool kWhole = decltype(whole_tag)::value;
        constexpr int kChunks = K::kChunks;
        constexpr int kRowStep = K::kProducerThreads / 8;  // 8 threads a row
        static_assert(!kVarlen || (kRowStep % 8 == 0 && kBN % kRowStep == 0), "whole swizzle periods per pass");
        static_assert(kBN % kPageRows == 0 && kPageRows >= 8, "pages that divide the tile (the rule's)");
        static_assert(kPageRows % 4 == 0, "a warp's 4 rows (32 lanes, 8 a row) in one page: page0 is the warp's");
        // The thread's rows in one page (kRowStep apart), and the page of its first row: a page of at
        // most kRowStep rows holds one of them (page (r0 + kRowStep k) >> kShift), a longer one
        // kPageRows / kRowStep, consecutive k (its first row's r0 < kRowStep then adds no page).
        constexpr int kRowsPerPage = kPageRows > kRowStep ? kPageRows / kRowStep : 1;
        constexpr int kRows = kBN / kRowStep;
        const int piece = threadIdx.x % 8, r0 = threadIdx.x / 8;
        const int page0 = kPageRows >= kRowStep ? 0 : r0 >> kShift;  // r0 < kRowStep: a constant 0 there
        const int in_page0 = r0 & (kPageRows - 1);
        const uint32_t row_bytes = static_cast<uint32_t>(p.heads_kv) * K::kHeadDim * 2;  // a token, every kv head
        // The piece's address in slot 0, as an integer: each row's address is then one multiply-add.
        const uint64_t src0 = reinterpret_cast<uintptr_t>(cache) + it.hk * K::kHeadDim * 2 + piece * 16;
        const uint32_t dst0 = smem_addr(dst) + r0 * 128 + ((piece ^ (r0 % 8)) << 4);
        // Row k's copies, one per chunk, from the address of the thread's piece in the row's first chunk.
        auto copy_row = [&](int k, uint64_t src, bool valid) {
#pragma unroll
          for (int c = 0; c < kChunks; ++c) {
            mma::cp_async_16(dst0 + c * kBN * 128 + k * kRowStep * 128, reinterpret_cast<const void*>(src + c * 128),
                             valid);
          }
        };
        if constexpr (kWhole) {
          // Every row below the context and every page in the cache (load_kv's test, once per tile):
          // no bound to check and nothing zero-filled. A page's first row of the thread is one
          // multiply-add of the page's slot onto the piece's address at row in_page0, its other rows
          // (kRowStep apart) one constant step each from there (a 64-bit add in the SASS). The pages'
          // slots come shuffled already (`slots`, load_kv's, once for K and V both), so no shuffle
          // stands in front of a copy, and ptxas keeps both caches' slot x row_bytes products for V.
          // (Before: each call shuffled its own; ptxas built K's rows one at a time through one
          // register pair, each shuffle waiting for the last copy to read it, at twice V's stall
          // samples an instruction in the H100 profile at 16 rows: NOTES.md, paged prefill.)
          const uint64_t at0 = mad_wide_u32(static_cast<uint32_t>(in_page0), row_bytes, src0);
          uint64_t rows[kRows];
#pragma unroll
          for (int j = 0; j < kRows / kRowsPerPage; ++j) {
            rows[j * kRowsPerPage] = mad_wide_u32(slots[j], row_bytes, at0);
#pragma unroll
            for (int q = 1; q < kRowsPerPage; ++q)
              rows[j * kRowsPerPage + q] = mad_wide_u32(row_bytes, q * kRowStep, rows[j * kRowsPerPage]);
          }
#pragma unroll
          for (int k = 0; k < kRows; ++k) copy_row(k, rows[k], true);
        } else {
          // The item's last tile, or a page outside the cache: each row checked. Rows below the
          // context, less r0: row r0 + kRowStep k is copied iff kRowStep k < left.
          const int left = static_cast<int>(it.seqlen_k) - (it.first_tile + i) * kBN - r0;
#pragma unroll
          for (int j = 0; j < kRows / kRowsPerPage; ++j) {
            const int first =
                __shfl_sync(0xffffffffu, firsts, page0 + ((j * kRowsPerPage * kRowStep) >> kShift));
#pragma unroll
            for (int q = 0; q < kRowsPerPage; ++q) {
              const int k = j * kRowsPerPage + q;
              const bool valid = k * kRowStep < left && first >= 0;
              // Slot first + the row's place in its page (in_page0 + (kRowStep k mod kPageRows): r0 <
              // kRowStep, so no carry), below num_blocks x block_size <= INT_MAX (the launcher): the
              // unsigned 32 x 32 + 64-bit multiply-add of one instruction.
              const uint32_t slot =
                  valid ? static_cast<uint32_t>(first + in_page0 + ((k * kRowStep) & (kPageRows - 1))) : 0u;
              copy_row(k, src0 + static_cast<uint64_t>(slot) * row_bytes, valid);
            }
          }
        }
        cp_async_mbarrier_arrive_noinc(full);
      };
      // Key tile i of the item. shift_tag: log2 of the page size where the warpgroup gathers (3, 4, 5:
      // 8, 16, 32 rows), 0 otherwise (TMA: boxes a page, or the contiguous tile). The walk picks it
      // once per item (walk_item below), so a tile's copies take no page-size branch.
      auto load_kv = [&](auto shift_tag, int i) {
        constexpr int kShift = decltype(shift_tag)::value;
        const int stage = kv_trips % kStages;
        if (kv_trips >= kStages) mbarrier_wait(&kv_empty[stage], ((kv_trips / kStages) - 1) & 1);
        unsigned char* k_dst = k_s + stage * K::kKVBytes;
        unsigned char* v_dst = v_s + stage * K::kKVBytes;
        if constexpr (kShift != 0) {
          // Every producer thread waited above; K's arrivals first, so S = Q K^T starts before V lands.
          // The consumers' wait on the barrier is all that orders these copies before their wgmma reads,
          // as for TMA's bytes: the arrival fires only once the copies are in shared memory, and no
          // thread writes the stage with ordinary stores (hopper.cuh's fence_proxy_async_shared is for those).
          // One set of table entries for both (the caches share the table): lane j's page's first
          // slot, or -1 for a page past the context (tile_pages' -1) or outside the cache.
          constexpr int shift = kShift;
          const int lane = static_cast<int>(threadIdx.x % 32);
          int32_t firsts;
          bool whole;
          if (!schedule.entries_by_tile) {
            // By group: tile i is tile `sub` of group g, its pages lanes sub P .. sub P + P - 1 of the
            // group's (P = kBN / block_size pages a tile, T = 32 / P tiles a group). At a group's first
            // tile the entries loaded a group before are resolved (once for T tiles: the bounds, the
            // slots, the ballot of whole pages) and the next group's load is issued; every tile then
            // takes its pages' slots with one shuffle (lane j: page j of the tile; the lanes past P
            // read another tile's, unused) and its wholeness from P bits of the ballot (every page
            // whole: every row of the tile below the context, every id in the cache, the by-tile vote's
            // condition, as a page ends within the context iff its rows do).
            static_assert(kBN == 128 || kBN == 64, "log2 kBN below");
            constexpr int log2_pages = (kBN == 128 ? 7 : 6) - shift, log2_tiles = 5 - log2_pages;
            const int g = i >> log2_tiles, sub = i & ((1 << log2_tiles) - 1);
            if (sub == 0) {
              const int num_blocks = static_cast<int>(p.num_blocks);
              const int page = ((it.first_tile * kBN) >> shift) + (g << 5) + lane;
              group_firsts = pages >= 0 && pages < num_blocks ? pages << shift : -1;
              group_whole = __ballot_sync(0xffffffffu,
                                          group_firsts >= 0 && ((page + 1) << shift) <= static_cast<int>(it.seqlen_k));
              // The next group's entries, a group ahead (its first tile's copies then T tiles away);
              // the item's last group: the next item's first, loaded once it is drawn.
              if (((g + 1) << log2_tiles) < it.n_tiles) pages = group_pages(g + 1);
            }
            firsts = __shfl_sync(0xffffffffu, group_firsts, (sub << log2_pages) + lane);
            constexpr uint32_t mask = (1u << (1 << log2_pages)) - 1u;
            whole = ((group_whole >> (sub << log2_pages)) & mask) == mask;
          } else {
            const int num_blocks = static_cast<int>(p.num_blocks);
            firsts = pages >= 0 && pages < num_blocks ? pages << shift : -1;
            // The next tile's entries, issued now, before this tile's copies, and the one after's
            // prefetched into L1: the copies' issue (32 cp.async a thread at d128) hides an L1 hit,
            // which the next tile uses right after its stage's wait. Loaded after the copies (before),
            // a producer that never waits for room (the consumers starved) stalled on them at the top
            // of every tile: an L1 hit, or an L2 round trip once per 128-byte line of the table row.
            // The item's last tile: the next item's first, loaded once it is drawn.
            if (i + 1 < it.n_tiles) pages = tile_pages(i + 1);
            if (i + 2 < it.n_tiles) prefetch_pages(i + 2);
            // Whole: every row of the tile below the context and every page's id in the cache (a vote
            // over the lanes holding the tile's pages), the walk's every tile but an item's last one
            // (of a context that is not a multiple of kBN) in a well-formed table.
            whole = (it.first_tile + i + 1) * kBN <= static_cast<int>(it.seqlen_k) &&
                    __all_sync(0xffffffffu, firsts >= 0 || lane >= (kBN >> shift));
          }
          auto both = [&](auto shift_tag) {
            if (whole) {
              // The thread's pages' first slots, shuffled once for K and V both (the same lanes).
              // Pages of fewer than kRowStep rows (8): the thread's pages are page0 + 2 j, and page0
              // is the warp's (its 32 lanes are 4 consecutive rows, in one page), so one shuffle down
              // by page0 lets every later shuffle name its lane as a constant (a lane index held in a
              // register per page otherwise).
              constexpr int kShift = decltype(shift_tag)::value, kPageRows = 1 << kShift;
              constexpr int kRowStep = K::kProducerThreads / 8;
              constexpr int kRowsPerPage = kPageRows > kRowStep ? kPageRows / kRowStep : 1;
              constexpr int kPages = kBN / kRowStep / kRowsPerPage;
              const int page0 = kPageRows >= kRowStep ? 0 : static_cast<int>(threadIdx.x / 8) >> kShift;
              const int32_t mine = kPageRows >= kRowStep ? firsts : __shfl_down_sync(0xffffffffu, firsts, page0);
              uint32_t slots[kPages];
#pragma unroll
              for (int j = 0; j < kPages; ++j)  // every lane is here (the producer walks the same tiles)
                slots[j] = static_cast<uint32_t>(
                    __shfl_sync(0xffffffffu, mine, (j * kRowsPerPage * kRowStep) >> kShift));
              gather_tile(shift_tag, std::true_type{}, k_dst, p.k, i, firsts, slots, &k_full[stage]);
              gather_tile(shift_tag, std::true_type{}, v_dst, p.v, i, firsts, slots, &v_full[stage]);
            } else {
              gather_tile(shift_tag, std::false_type{}, k_dst, p.k, i, firsts, nullptr, &k_full[stage]);
              gather_tile(shift_tag, std::false_type{}, v_dst, p.v, i, firsts, nullptr, &v_full[stage]);
            }
          };
          both(shift_tag);
          ++kv_trips;
          return;
        }
        if (paged) {
          // One expect-tx per barrier for the whole tile (the pages' boxes add up to kKVBytes), then
          // each page's rows at their offset in every 64-column chunk. A page of r rows lands at byte
          // r0 x 128 of a chunk (r0 a multiple of r, r >= 8: a multiple of 1024 bytes), where the
          // 128-byte swizzle's pattern (16-byte pieces XORed by the row's index mod 8, repeating every
          // 8 rows = 1024 bytes) starts over: TMA swizzles by the shared-memory address, so the page's
          // rows come out exactly as the same rows of one 128-row box would, the layout the
          // consumers' descriptors read. A page of fewer than 8 rows would break that (the glue
          // keeps such caches off this rung: paged_prefill_hopper_block_size, serving.h).
          // K's pages, then V's (the table entries again, from L1): K completes first, as below.
          mbarrier_arrive_expect_tx(&k_full[stage], K::kKVBytes);
          paged_boxes(i, [&](int r0, int row, int id) {
#pragma unroll
            for (int c = 0; c < K::kChunks; ++c) {
              tma_load_4d(k_dst + c * kBN * 128 + r0 * 128, &map_k, &k_full[stage], c * 64, it.hk, row, id);
            }
          });
          mbarrier_arrive_expect_tx(&v_full[stage], K::kKVBytes);
          paged_boxes(i, [&](int r0, int row, int id) {
#pragma unroll
            for (int c = 0; c < K::kChunks; ++c) {
              tma_load_4d(v_dst + c * kBN * 128 + r0 * 128, &map_v, &v_full[stage], c * 64, it.hk, row, id);
            }
          });
          ++kv_trips;
          return;
        }
        const int row = static_cast<int>(it.k_row) + (it.first_tile + i) * kBN;
        // K and V complete on separate barriers, so that S = Q K^T starts before V lands.
        mbarrier_arrive_expect_tx(&k_full[stage], K::kKVBytes);
#pragma unroll
        for (int c = 0; c < K::kChunks; ++c) {
          tma_load_4d(k_dst + c * kBN * 128, &map_k, &k_full[stage], c * 64, row, it.hk, it.map_b);
        }
        mbarrier_arrive_expect_tx(&v_full[stage], K::kKVBytes);
#pragma unroll
        for (int c = 0; c < K::kChunks; ++c) {
          tma_load_4d(v_dst + c * kBN * 128, &map_v, &v_full[stage], c * 64, row, it.hk, it.map_b);
        }
        ++kv_trips;
      };
      if (gather && value < schedule.tiles) {
        if (schedule.entries_by_tile) {
          pages = tile_pages(0);
          prefetch_pages(1);  // load_kv(0) loads tile 1's entries (prefetch_pages' guard: none past the keys)
        } else {
          pages = group_pages(0);  // load_kv(0) resolves it and loads group 1's
        }
      }
      for (uint32_t trip = 0;; ++trip) {
        if (leader) {
          // Hand the item to the consumers: slot trip % 2 is free once they all read trip - 2's.
          const int slot = trip & 1;
          if (trip >= 2) mbarrier_wait(&tile_empty[slot], ((trip >> 1) - 1) & 1);
          tile_slot[slot] = value;
          mbarrier_arrive(&tile_full[slot]);  // release: the consumers' wait sees the write above
        }
        if (value >= schedule.tiles) break;  // the end, now published
        if (it.n_tiles > 0) {  // else rows that see no key: the consumers store zeros, nothing to load
          // The first key tile before Q: its stage was freed by a trip kStages back, two key tiles
          // before the end of the last item at 3 stages, while Q's halves come free only with each
          // warpgroup's last Q K^T of it. Loaded after Q, K would wait for that release too and
          // land as the consumers finish their epilogue, with the tensor cores idle meanwhile.
          // The item's walk, its page size a constant of each (walk_item's shift_tag: load_kv's).
          auto walk_item = [&](auto shift_tag) {
            load_kv(shift_tag, 0);
            for (int w = 0; w < 2 && leader; ++w) {
              // Warpgroup w's half of Q is free once its 4 warps' last Q K^T of the previous item is done.
              if (q_trips > 0) mbarrier_wait(&q_empty[w], (q_trips - 1) & 1);
              mbarrier_arrive_expect_tx(&q_full[w], kHalfQBytes);
#pragma unroll
              for (int c = 0; c < K::kChunks; ++c) {
                // Rows past seqlen_q (the whole half, for an item of up to 64 rows) arrive as zeros.
                tma_load_4d(q_s + c * kBM * 128 + w * 64 * 128, &map_q, &q_full[w], c * 64,
                            static_cast<int>(it.q_row) + 64 * w, it.h, it.map_b);
              }
            }
            ++q_trips;
            for (int i = 1; i < it.n_tiles; ++i) load_kv(shift_tag, i);
          };
          // The three page sizes that gather (8, 16, 32 rows: tile_schedule.h's rule at kBN 64 or 128),
          // picked once per item. (Before: once per tile, in load_kv, with the group's shifts and masks
          // worked out from the page size at run time: ~8 instructions of each tile's top.)
          const int shift = __ffs(static_cast<int>(p.block_size)) - 1;
          if (!gather) {
            walk_item(std::integral_constant<int, 0>{});
          } else if (shift == 3) {
            walk_item(std::integral_constant<int, 3>{});
          } else if (shift == 4) {
            walk_item(std::integral_constant<int, 4>{});
          } else {
            walk_item(std::integral_constant<int, 5>{});
          }
        }
        // The next item, drawn once this one's copies are all issued: as late as the producer can
        // (the block is a couple of key tiles from done, and the others have drawn meanwhile) with
        // time to spare. Its Q and first key tile go into L2 at once: the copies into shared memory
        // wait for this item's buffers to come free, a key tile or two before its end, and then find
        // them in L2 instead of device memory (Q is read by no one else, and a head's K and V are
        // not in L2 yet when its first item starts).
        value = share(leader ? value_of(atomicAdd(tile_counter, 1) + static_cast<int>(gridDim.x)) : 0);
        if (value < schedule.tiles) {
          it = item_at(value);
          if (gather && schedule.entries_by_tile) {
            pages = tile_pages(0);  // the new item's first key tile, for its load_kv(0)
            prefetch_pages(1);
          } else if (gather) {
            pages = group_pages(0);  // the new item's first group, for its load_kv(0)
          }
          if (leader && it.n_tiles > 0) {
            const int row = static_cast<int>(it.k_row) + it.first_tile * kBN;
#pragma unroll
            for (int c = 0; c < K::kChunks; ++c) {
              tma_prefetch_l2_4d(&map_q, c * 64, static_cast<int>(it.q_row), it.h, it.map_b);
              tma_prefetch_l2_4d(&map_q, c * 64, static_cast<int>(it.q_row) + 64, it.h, it.map_b);
              if (!paged) {
                tma_prefetch_l2_4d(&map_k, c * 64, row, it.hk, it.map_b);
                tma_prefetch_l2_4d(&map_v, c * 64, row, it.hk, it.map_b);
              }
            }
            if (paged) {  // the first key tile's pages, through the table as load_kv reads them
              paged_boxes(0, [&](int, int page_row, int id) {
#pragma unroll
                for (int c = 0; c < K::kChunks; ++c) {
                  tma_prefetch_l2_4d(&map_k, c * 64, it.hk, page_row, id);
                  tma_prefetch_l2_4d(&map_v, c * 64, it.hk, page_row, id);
                }
              });
            }
          }
        }
      }
    }
    return;
  }
  setmaxnreg_inc<K::kConsumerRegs>();

  // ---------------------------------------------------------------- the consumers
  const int ct = threadIdx.x - K::kProducerThreads;
  const int wg = ct / 128;  // consumer warpgroup: rows 64 wg .. 64 wg + 63 of each tile
  const int warp = (ct % 128) / 32;
  const int lane = ct % 32;
  const int g = lane / 4, t = lane % 4;
  const unsigned char* q_wg = q_s + wg * 64 * 128;

  float o[K::kHeadDim / 2];
  float s[kBN / 2];
  uint32_t pf[kBN / 16][4];  // P as wgmma's A fragments, one k16 step of keys each
  float row_max[2], row_sum[2];
  int64_t row0 = 0;  // this lane's rows of the current tile: row0 and row0 + 8
  int64_t diag = 0;  // the current item's: key j is visible to row i iff j <= i + diag
  int first_tile = 0;  // the current item's first key tile (a window's; else 0)
  uint32_t q_trips = 0, kv_trips = 0;  // the producer's counts, kept in step
  // The parameters the per-tile math reads its lengths from: p itself padded; packed, a copy with the
  // current item's sequence's lengths (the sequence as a batch of one).
  AttentionParams seq_p = p;
  const AttentionParams& ip = kVarlen ? seq_p : p;

  auto issue_qk = [&](int stage) { hopper_fwd::issue_qk<T, K>(s, q_wg, k_s + stage * K::kKVBytes); };
  auto issue_pv = [&](int stage) { hopper_fwd::issue_pv<T, K>(o, pf, v_s + stage * K::kKVBytes); };
  // Trip i of the walk is key tile first_tile + i. With a softcap, the scores are capped into log2
  // units first (scale_log2 is then 1: the launcher's), before the mask and the running maximum, as
  // in part 1; a uniform branch, taken after the wait for S (no product in flight across it).
  auto softmax = [&](auto mask_tag, int i, float (&corr)[2]) {
    if constexpr (kWindowSoftcap) {
      if (cap.in != 0.f) {
        with_softcap_tanh(cap, [&](auto mode) {  // one loop per softcap mode (softcap.cuh)
#pragma unroll
          for (int j = 0; j < kBN / 2; ++j) s[j] = softcap_score<decltype(mode)::value>(s[j], cap);
        });
      }
    }
    online_softmax<K, 0, kWindowSoftcap>(mask_tag, s, row_max, row_sum, corr, ip, row0, diag, first_tile + i, t,
                                         scale_log2);
  };
  auto rescale_o = [&](const float (&corr)[2]) {
#pragma unroll
    for (int j = 0; j < K::kHeadDim / 2; ++j) o[j] *= corr[(j >> 1) & 1];
  };
  auto pack_p = [&] { hopper_fwd::pack_p<T, K>(pf, s); };
  // A consumer warp is done with a stage (its products completed): one arrive per warp.
  auto release = [&](int stage) {
    if (lane == 0) mbarrier_arrive(&kv_empty[stage]);
  };
  // Trip i of the current tile: its stage and the parity its barriers complete with.
  auto stage_of = [&](int i) { return static_cast<int>((kv_trips + i) % kStages); };
  auto parity_of = [&](int i) { return ((kv_trips + i) / kStages) & 1; };

  // Ping-pong turns (the one-tile kernel's, carried over the walk: see the top of the file).
  auto take_turn = [&] {
    if constexpr (K::kPingpong) named_barrier_sync(1 + wg, 256);
  };
  auto pass_turn = [&] {
    if constexpr (K::kPingpong) named_barrier_arrive(2 - wg, 256);
  };
  if constexpr (K::kPingpong) {
    if (wg == 1) named_barrier_arrive(1, 256);
  }
  const std::false_type unmasked;
  const std::true_type masked;

  for (uint32_t trip = 0;; ++trip) {
    const int slot = trip & 1;
    mbarrier_wait(&tile_full[slot], (trip >> 1) & 1);
    const int value = tile_slot[slot];
    mbarrier_arrive(&tile_empty[slot]);  // this thread is done with the slot
    if (value >= schedule.tiles) break;  // the walk is over, as for the producer
    const Item it = item_at(value);
    const int n_tiles = it.n_tiles;
    row0 = it.m0 + wg * 64 + warp * 16 + g;
    diag = it.seqlen_k - it.seqlen_q;
    if constexpr (kWindowSoftcap) first_tile = it.first_tile;
    if constexpr (kVarlen) {
      seq_p.seqlen_q = it.seqlen_q;
      seq_p.seqlen_k = it.seqlen_k;
    }
#pragma unroll
    for (int j = 0; j < K::kHeadDim / 2; ++j) o[j] = 0.f;
    row_max[0] = row_max[1] = -INFINITY;  // raw scores (not scaled): scale > 0
    row_sum[0] = row_sum[1] = 0.f;        // this lane's share; the row's four lanes add at the end

    if (n_tiles > 0) {
      mbarrier_wait(&q_full[wg], q_trips & 1);
      ++q_trips;
      // Trips lead_end .. full_end - 1 need no mask for any row of the warpgroup, the others do.
      // Plain: lead_end is 0 and tiles 0 .. n_full - 1 are whole for every row of the block (as in the
      // one-tile kernel). Window: the tiles left of the last row's first key are cut by the window's
      // left edge for some row, and those from the first row's last key on (key_end clamps to
      // seqlen_k) by its right edge or the end.
      int lead_end = 0, full_end = 0;
      if constexpr (kWindowSoftcap) {
        const int64_t wg_row = it.m0 + wg * 64;
        const int64_t lead = (key_begin(wg_row + 63, p) + kBN - 1) / kBN - first_tile;
        const int64_t full = key_end(wg_row, p) / kBN - first_tile;
        lead_end = static_cast<int>(max(int64_t{0}, min(lead, static_cast<int64_t>(n_tiles))));
        full_end = static_cast<int>(max(static_cast<int64_t>(lead_end), min(full, static_cast<int64_t>(n_tiles))));
      } else {
        int64_t full_tiles = it.seqlen_k / kBN;
        if (p.causal) full_tiles = min(full_tiles, max(int64_t{0}, it.m0 + diag + 1) / kBN);
        full_end = static_cast<int>(min(full_tiles, static_cast<int64_t>(n_tiles)));
      }
      const int n_full = full_end;
      // This warpgroup's half of Q is read for the last time: the producer may load the next tile's.
      auto release_q = [&] {
        if (lane == 0) mbarrier_arrive(&q_empty[wg]);
      };

      if constexpr (!K::kJoint && !K::kOverlap) {
        // warp_specialized's schedule (d = 256): each key tile in order, product, softmax, product.
        auto step = [&](auto mask_tag, int i) {
          const int stage = stage_of(i);
          mbarrier_wait(&k_full[stage], parity_of(i));
          issue_qk(stage);
          wgmma_wait<0>();
          fence_operands(s);
          float corr[2];
          softmax(mask_tag, i, corr);
          rescale_o(corr);
          pack_p();
          mbarrier_wait(&v_full[stage], parity_of(i));
          issue_pv(stage);
          wgmma_wait<0>();
          fence_operands(o);
          fence_operands(pf);
          release(stage);
        };
        if constexpr (kWindowSoftcap) {
          for (int i = 0; i < lead_end; ++i) step(masked, i);
        }
        for (int i = lead_end; i < n_full; ++i) step(unmasked, i);
        for (int i = n_full; i < n_tiles; ++i) step(masked, i);
        release_q();  // after the last P V here: no product is in flight to overlap with anyway
      } else if constexpr (K::kOverlap) {
        // FlashAttention 3's intra-warpgroup overlap (HopperFwdPersistentOverlapTraits): the one-tile
        // kernel's kOverlap walk, hopper_fwd::overlap_walk (flash_fwd_hopper_kernel.cuh says why each
        // piece is where it is), with this walk's stages and parities: tile i's Q K^T, O rescaled,
        // tile i - 1's P V in one turn; tile i's softmax while that P V runs; its wait at the top of
        // the next step, behind the mbarrier waits; P in two arrays, the steps two at a time; trip
        // i - 2's stage freed there. The stages a walk holds are all freed by its end (the last two
        // after the loops), so the next item's trips find the ring as the joint schedule leaves it.
        static_assert(!kWindowSoftcap && !kVarlen, "the overlap runs on the padded layout without a window");
        uint32_t pf2[2][kBN / 16][4];
        float corr[2];
        // Tile 0 opens the walk: its Q K^T (on the walk's descriptors) and softmax, in a turn of its own.
        auto open = [&](auto issue_qk_at) {
          mbarrier_wait(&k_full[stage_of(0)], parity_of(0));
          take_turn();
          issue_qk_at(stage_of(0));
          pass_turn();
          wgmma_wait<0>();
          fence_operands(s);
          if (n_full > 0) {
            softmax(unmasked, 0, corr);  // O is still 0: nothing to rescale
          } else {
            softmax(masked, 0, corr);
          }
        };
        auto wait_k = [&](int stage, uint32_t parity) { mbarrier_wait(&k_full[stage], parity); };
        auto wait_v = [&](int stage, uint32_t parity) { mbarrier_wait(&v_full[stage], parity); };
        // Every hand-over goes, the last one too: the other warpgroup's next turn may be its next
        // tile's first Q K^T.
        auto pass_every_turn = [&](bool) { pass_turn(); };
        // The walk's stages and parities from a copy of kv_trips (which moves only after the walk): with
        // stage_of's reference, the inlined walk computed its last stage apart from kv_trips += n_tiles
        // below, one instruction more than this schedule written inline (the SASS, nvcc 13.0).
        const uint32_t trips = kv_trips;
        auto stage_at = [trips](int i) { return static_cast<int>((trips + i) % kStages); };
        auto parity_at = [trips](int i) { return ((trips + i) / kStages) & 1; };
        // The last Q K^T has completed when the walk calls release_q: Q goes back before the last P V.
        hopper_fwd::overlap_walk<T, K>(s, o, pf2, corr, q_wg, k_s, v_s, n_tiles, n_full, stage_at, parity_at,
                                       wait_k, wait_v, release, take_turn, pass_every_turn, open, release_q,
                                       softmax, rescale_o);
      } else {
        // pingpong's schedule (d = 64, 128): tile i - 1's P V and tile i's Q K^T in one turn.
        mbarrier_wait(&k_full[stage_of(0)], parity_of(0));
        take_turn();
        issue_qk(stage_of(0));
        pass_turn();
        wgmma_wait<0>();
        fence_operands(s);
        float corr[2];
        if (lead_end == 0 && n_full > 0) {
          softmax(unmasked, 0, corr);  // O is still 0: nothing to rescale
        } else {
          softmax(masked, 0, corr);
        }
        pack_p();
        auto step = [&](auto mask_tag, int i) {
          const int stage = stage_of(i), prev = stage_of(i - 1);
          mbarrier_wait(&v_full[prev], parity_of(i - 1));
          mbarrier_wait(&k_full[stage], parity_of(i));
          take_turn();
          issue_pv(prev);
          issue_qk(stage);
          pass_turn();
          wgmma_wait<0>();
          fence_operands(o);
          fence_operands(pf);
          fence_operands(s);
          release(prev);
          softmax(mask_tag, i, corr);
          rescale_o(corr);
          pack_p();
        };
        if constexpr (kWindowSoftcap) {
          for (int i = 1; i < lead_end; ++i) step(masked, i);
        }
        for (int i = lead_end > 1 ? lead_end : 1; i < n_full; ++i) step(unmasked, i);
        for (int i = n_full > 1 ? n_full : 1; i < n_tiles; ++i) step(masked, i);
        // The last Q K^T has completed (the wait above): Q goes back before the last P V, so the
        // next tile's Q arrives under that product and the stores below.
        release_q();
        const int last = stage_of(n_tiles - 1);
        mbarrier_wait(&v_full[last], parity_of(n_tiles - 1));
        take_turn();
        issue_pv(last);
        pass_turn();  // the other warpgroup's next turn may be its next tile's first Q K^T
        wgmma_wait<0>();
        fence_operands(o);
        fence_operands(pf);
        release(last);
      }
      kv_trips += n_tiles;
    }

    // The epilogue, while the producer's copies for the next tile are in flight.
    // Packed: the sequence's first token (every batch stride is 0), its lse row h * total_q + q0.
    if constexpr (kVarlen) {
      const int64_t q0 = it.q_row - it.m0;
      T* out = static_cast<T*>(p.o) + q0 * p.o_seq_stride + static_cast<int64_t>(it.h) * p.o_head_stride;
      store_o_lse<T, K>(o, row_sum, row_max, out, static_cast<float*>(p.lse) + it.h * p.total_q + q0, row0, ip, t,
                        scale_log2);
    } else {
      T* out = static_cast<T*>(p.o) + static_cast<int64_t>(it.b) * p.o_batch_stride +
               static_cast<int64_t>(it.h) * p.o_head_stride;
      store_o_lse<T, K>(o, row_sum, row_max, out, static_cast<float*>(p.lse) + it.pair * p.seqlen_q, row0, p, t,
                        scale_log2);
    }
  }
  if constexpr (K::kPingpong) {
    // The last turn warpgroup 1 passed (or its opening one, if no tile had keys) is taken here, so
    // that barrier 1 ends with as many arrivals as syncs.
    if (wg == 0) named_barrier_sync(1, 256);
  }
#endif  // COURSE_HOPPER_DEVICE: other targets compile an empty kernel the glue never launches
}

// The persistent grid: as many blocks as the GPU holds at once (its SM count times the blocks of
// this kernel an SM fits: one, with 168 registers a thread and up to 225 KiB of shared memory),
// never more than there are tiles. The device's SM count and L2 size are read here, per call
// (attribute lookups, no driver round trip), for the GPU the caller's device guard selected.
// Packed (kVarlen), the tiles are counted over max_seqlen_q (an upper bound: the host does not know
// the lengths), the maps describe the packed tensors as one batch of total_q and total_k tokens, and
// the schedule kernel runs first, on the same stream (it also clears the counter).
template <typename T, typename K, bool kVarlen, bool kWindowSoftcap = false>
cudaError_t run_flash_fwd_hopper_persistent(const AttentionParams& p, cudaStream_t stream, void* workspace) {
  const int64_t q_tiles = course::ceil_div(p.seqlen_q, static_cast<int64_t>(K::kBlockM));
  const int64_t tiles = q_tiles * p.batch * p.heads;
  if (tiles == 0) return cudaSuccess;
  // INT_MAX less a grid: the counter's draws past the last tile (one per block) stay in an int.
  if (tiles > INT_MAX / 2 || p.seqlen_q > INT_MAX || p.seqlen_k > INT_MAX) return cudaErrorInvalidConfiguration;
  // Packed, the copies' row coordinates are token indices of the whole tensor (TMA takes an int).
  if (kVarlen && (p.total_q > INT_MAX / 2 || p.total_k > INT_MAX / 2)) return cudaErrorInvalidConfiguration;
  if (workspace == nullptr) return cudaErrorInvalidValue;  // the tile counter: the glue passes it
  if (!hopper_o_store_aligned<K>(p)) return cudaErrorInvalidValue;  // a wider store of O than O's rows allow
  CUtensorMap map_q, map_k, map_v;
  const int64_t map_batch = kVarlen ? 1 : p.batch;  // packed: every token of every sequence, one batch
  const int64_t rows_q = kVarlen ? p.total_q : p.seqlen_q, rows_k = kVarlen ? p.total_k : p.seqlen_k;
  // Q in boxes of 64 rows: each consumer warpgroup's half has its own barriers.
  COURSE_CUDA_TRY(make_bhsd_map(&map_q, p.q, map_batch, p.heads, rows_q, K::kHeadDim, p.q_batch_stride,
                                p.q_head_stride, p.q_seq_stride, K::kBlockM / 2));
  if (kVarlen && p.block_tables != nullptr) {
    // Paged: the caches as (head_dim, heads_kv, block_size, num_blocks), boxes of one page's rows (at
    // most a key tile's) of one head: the producer's load_kv. Block ids and rows are TMA's int
    // coordinates, and num_blocks itself names the zero box (one past the end).
    // Gathering (small pages), the maps serve the first key tile's L2 prefetch alone, and a token's
    // slot (block id x block_size + row) is an int there.
    if (!paged_prefill_hopper_block_size(p.block_size, K::kBlockN) || p.num_blocks >= INT_MAX ||
        p.max_blocks * p.block_size > INT_MAX / 2 ||
        (paged_prefill_hopper_gathers(p.block_size, K::kBlockN) && p.num_blocks * p.block_size > INT_MAX))
      return cudaErrorInvalidValue;
    const int rows = static_cast<int>(p.block_size < K::kBlockN ? p.block_size : K::kBlockN);
    COURSE_CUDA_TRY(make_paged_map(&map_k, p.k, p.num_blocks, p.block_size, p.heads_kv, K::kHeadDim, rows));
    COURSE_CUDA_TRY(make_paged_map(&map_v, p.v, p.num_blocks, p.block_size, p.heads_kv, K::kHeadDim, rows));
  } else {
    COURSE_CUDA_TRY(make_bhsd_map(&map_k, p.k, map_batch, p.heads_kv, rows_k, K::kHeadDim, p.k_batch_stride,
                                  p.k_head_stride, p.k_seq_stride, K::kBlockN));
    COURSE_CUDA_TRY(make_bhsd_map(&map_v, p.v, map_batch, p.heads_kv, rows_k, K::kHeadDim, p.v_batch_stride,
                                  p.v_head_stride, p.v_seq_stride, K::kBlockN));
  }
  auto kernel = flash_fwd_hopper_persistent_kernel<T, K, kVarlen, kWindowSoftcap>;
  COURSE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::kSmemBytes));
  int device = 0, sms = 0, l2_bytes = 0, per_sm = 0;
  COURSE_CUDA_TRY(cudaGetDevice(&device));
  COURSE_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  COURSE_CUDA_TRY(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  COURSE_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, K::kThreads, K::kSmemBytes));
  if (per_sm < 1) return cudaErrorInvalidConfiguration;  // cannot happen for a kernel the glue let through
  const int64_t slots = static_cast<int64_t>(sms) * per_sm;
  const int ctas = static_cast<int>(tiles < slots ? tiles : slots);
  HopperTileSchedule schedule = hopper_tile_schedule(p, l2_bytes);
  // The gather's table entries by group or by tile (tile_schedule.h's knob; unused unless gathering).
  schedule.entries_by_tile = paged_gather_entries(std::getenv(kPagedGatherEnv)) == PagedGatherEntries::kByTile;
  // The counter starts at 0 every launch, in stream order (a graph capture records the memset, or
  // the schedule kernel).
  int* counter = static_cast<int*>(workspace);
  if constexpr (kVarlen) {
    hopper_varlen_schedule_kernel<kVarlenScheduleThreads><<<1, kVarlenScheduleThreads, 0, stream>>>(
        p.cu_seqlens_q, static_cast<int>(p.batch), static_cast<int>(p.heads), schedule.q_tiles, counter);
    COURSE_CUDA_TRY(cudaGetLastError());
  } else {
    COURSE_CUDA_TRY(cudaMemsetAsync(counter, 0, sizeof(int), stream));
  }
  float scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  Softcap cap{};
  if constexpr (kWindowSoftcap) {
    // The cap in log2 units (part 1's pipelined rungs'); the capped scores are the softmax's input
    // as they stand, so its scale is 1, and the epilogue's max * scale_log2 ln 2 is max ln 2.
    cap = make_softcap(p.scale, p.softcap, p.dtype == DType::kBFloat16, /*log2_units=*/true);
    if (cap.in != 0.f) scale_log2 = 1.f;
  }
  kernel<<<static_cast<unsigned>(ctas), K::kThreads, K::kSmemBytes, stream>>>(map_q, map_k, map_v, p, schedule,
                                                                              counter, scale_log2, cap);
  return cudaGetLastError();
}

// The window and softcap entry point (flash_fwd_hopper_window_<dtype>_hdim<d>.cu, the head dims of
// kHopperWindowHeadDims): the persistent rung's kWindowSoftcap instantiation, padded layout only.
template <typename T, int D>
cudaError_t run_flash_fwd_hopper_window(const AttentionParams& p, cudaStream_t stream, void* workspace) {
  static_assert(::course::is_listed(kHopperWindowHeadDims, D), "a head dim of kHopperWindowHeadDims");
  if (p.cu_seqlens_q != nullptr) return cudaErrorInvalidValue;  // the glue sends such calls to "split_kv"
  return run_flash_fwd_hopper_persistent<T, HopperFwdTraits<D, HopperForward::kPersistent>, false, true>(p, stream,
                                                                                                       workspace);
}

// The rungs' entry point (the instantiation files): the persistent rung's kernel, padded or packed
// (the packed one at the head dims of kHopperVarlenHeadDims only), or the one-tile one.
template <typename T, int D, HopperForward kRung>
cudaError_t run_flash_fwd_hopper(const AttentionParams& p, cudaStream_t stream, void* workspace) {
  if constexpr (kRung == HopperForward::kPersistent) {
    if (p.cu_seqlens_q != nullptr) {
      if constexpr (::course::is_listed(kHopperVarlenHeadDims, D)) {
        return run_flash_fwd_hopper_persistent<T, HopperFwdTraits<D, kRung>, true, false>(p, stream, workspace);
      } else {
        return cudaErrorInvalidValue;  // the glue sends no packed call at this head dim here
      }
    }
    if constexpr (hopper_pingpong_stages<D>() == 3) {
      if (hopper_forward_overlap(kRung, D)) {
        return run_flash_fwd_hopper_persistent<T, HopperFwdPersistentOverlapTraits<D>, false, false>(p, stream,
                                                                                                   workspace);
      }
    }
    return run_flash_fwd_hopper_persistent<T, HopperFwdTraits<D, kRung>, false, false>(p, stream, workspace);
  } else {
    if (p.cu_seqlens_q != nullptr) return cudaErrorInvalidValue;  // the one-tile rungs take the padded layout only
    if constexpr (kRung == HopperForward::kPingpong && hopper_pingpong_stages<D>() == 3) {
      if (hopper_forward_overlap(kRung, D)) return run_flash_fwd_hopper_config<T, HopperFwdOverlapTraits<D>>(p, stream);
    }
    return run_flash_fwd_hopper_config<T, HopperFwdTraits<D, kRung>>(p, stream);
  }
}

}  // namespace flash_attention
