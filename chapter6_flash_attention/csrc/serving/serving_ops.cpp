// Torch glue for the serving half (serving.h): the schemas of reshape_and_cache, copy_blocks,
// paged_attention, paged_prefill_attention and match_prefix, their checks, and one implementation
// per op that serves the CPU, CUDA and Meta keys and picks the backend from the (already checked)
// device, as attention/attention_ops.cpp does for training. The `flash_attention` library is defined in
// flash_attention_ops.cpp; these ops join it with TORCH_LIBRARY_FRAGMENT.
//
// Two kinds of checks:
// - what the host knows for free (ranks, shapes, dtypes, devices, strides): always;
// - what lives in the tensors' values (block ids in the tables, context lengths, slots): reading
//   those back from a GPU is a device-to-host copy, which waits for every kernel queued before it
//   (a sync per call, and illegal while a CUDA graph is being captured). paged_attention and
//   reshape_and_cache make them when check_tables / check_slots is true, the default, so that a
//   learner's bad table is a clear error and not a silently wrong answer. The kernels are
//   memory-safe without them (serving.h), so a server passes false: its scheduler built the tables
//   and slot mappings on the host, from its own block allocator, and checked them there before
//   the one copy to the GPU; vLLM and SGLang read nothing back for this reason. On the CPU the
//   checks read host memory and cost next to nothing. paged_prefill_attention's check_tables
//   covers cu_seqlens_q as well.
//   copy_blocks does the same with check_mapping (a destination named twice, or also a source,
//   makes the result depend on the order of the copies): it runs at copy-on-write only, rarely
//   enough that a learner's checked call costs little, and a server's unchecked one can sit in a
//   CUDA graph. match_prefix checks its tree and lengths on the CPU; on CUDA see
//   match_prefix_impl.
#include "flash_attention_ops.h"
#include "serving/serving.h"

#include <ATen/ATen.h>
#include <course/checks.h>
#include <course/on_cuda.h>
#include <course/static_switch.h>
#include <course/versions.h>
#include <torch/library.h>

#ifdef WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>
#endif
#if defined(WITH_CUDA) && defined(COURSE_HOPPER)
#include "hopper/flash_fwd_hopper.h"  // rung persistent: the Hopper forward's launcher
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace flash_attention {
namespace {

using at::Tensor;
using ::course::is_listed;
using ::course::list_text;
using ::course::OptVersion;
using ::course::shape_of;

constexpr const char* kPackage = "flash_attention";
constexpr const char* kReshapeAndCache = "reshape_and_cache";
constexpr const char* kCopyBlocks = "copy_blocks";
constexpr const char* kPagedAttention = "paged_attention";
constexpr const char* kMatchPrefix = "match_prefix";
constexpr const char* kPagedPrefill = "paged_prefill_attention";

// The decode ladder (serving.h). The CPU reference is not a rung: it runs whatever version= names,
// and the names are parsed on every device, so a typo fails on the CPU as it would on CUDA.
constexpr ::course::NamedVersion<PagedVersion> kPagedVersions[] = {{"per_head", PagedVersion::kPerHead},
                                                                  {"per_kv_head", PagedVersion::kPerKvHead},
                                                                  {"split_kv", PagedVersion::kSplitKv}};
// The chunked-prefill ladder (serving.h), parsed the same way.
constexpr ::course::NamedVersion<PagedPrefillVersion> kPrefillVersions[] = {
    {"decode_rows", PagedPrefillVersion::kDecodeRows},
    {"mma", PagedPrefillVersion::kMma},
    {"persistent", PagedPrefillVersion::kPersistent}};  // part 3's Hopper forward over the table

// A size or stride for a message: "?" where torch.compile's dynamic shapes made it symbolic.
std::string str(const c10::SymInt& v) {
  const auto known = v.maybe_as_int();
  return known ? std::to_string(*known) : std::string("?");
}

// Every tensor argument: defined, on a device the ops serve, of rank `rank` (named by `dims`).
void check_rank(const char* op, const char* name, const Tensor& t, int64_t rank, const char* dims) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
  ::course::check_device_supported(op, name, t);
  TORCH_CHECK(t.dim() == rank, op, ": ", name, " has shape ", shape_of(t), " (", std::to_string(t.dim()),
              " dims); it must have ", std::to_string(rank), ": ", dims);
}

// An integer argument (tables, lengths, slots, the tree's arrays): exactly `dtype`, on ref's device.
void check_index(const char* op, const char* name, const Tensor& t, int64_t rank, const char* dims,
                 at::ScalarType dtype, const char* ref_name, const Tensor& ref) {
  check_rank(op, name, t, rank, dims);
  ::course::check_dtype_in(op, name, t, {dtype});
  ::course::check_same_device(op, name, t, ref_name, ref);
}

// Values go in by strides, but their rows (head_dim) are read as runs of contiguous elements.
void check_last_dim_contiguous(const char* op, const char* name, const Tensor& t) {
  const int64_t last = t.dim() - 1;
  TORCH_CHECK(t.sym_stride(last) == 1 || t.sym_size(last) == 1, op, ": ", name,
              "'s last dim (head_dim) is not contiguous (stride ", str(t.sym_stride(last)),
              "); other dims may be strided, the last must not: pass ", name, ".contiguous()");
}

// Index arrays are small next to the cache: any layout is copied to the one the kernels index
// (rows of contiguous ids) rather than refused.
Tensor rows_contiguous(const Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous(); }

// key_cache and value_cache: one (num_blocks, block_size, heads_kv, head_dim) layout, any of the
// four floating dtypes. Contiguous, because the kernels compute every address from a block id
// (serving.h), and refused rather than copied, because two of the ops write the cache in place.
void check_caches(const char* op, const Tensor& key_cache, const Tensor& value_cache) {
  constexpr const char* dims = "(num_blocks, block_size, heads_kv, head_dim)";
  check_rank(op, "key_cache", key_cache, 4, dims);
  check_rank(op, "value_cache", value_cache, 4, dims);
  ::course::check_floating(op, "key_cache", key_cache);
  ::course::check_same_device(op, "value_cache", value_cache, "key_cache", key_cache);
  ::course::check_same_dtype(op, "value_cache", value_cache, "key_cache", key_cache);
  TORCH_CHECK(key_cache.sym_sizes() == value_cache.sym_sizes(), op, ": key_cache has shape ", shape_of(key_cache),
              " but value_cache has shape ", shape_of(value_cache), " (one value per key: they must match)");
  for (const auto& [name, cache] : {std::pair<const char*, const Tensor&>{"key_cache", key_cache},
                                    std::pair<const char*, const Tensor&>{"value_cache", value_cache}}) {
    TORCH_CHECK(cache.is_contiguous(), op, ": ", name, " is not contiguous; the cache is addressed as one ", dims,
                " array from its block ids (and written in place, so a contiguous copy would not do)");
  }
  TORCH_CHECK(key_cache.sym_size(1) >= 1 && key_cache.sym_size(2) >= 1 && key_cache.sym_size(3) >= 1, op,
              ": key_cache has shape ", shape_of(key_cache), "; block_size, heads_kv and head_dim must be at least 1");
}

KVCacheLayout layout_of(const Tensor& key_cache) {
  return {::course::to_dtype(key_cache.scalar_type()), key_cache.size(0), key_cache.size(1), key_cache.size(2),
          key_cache.size(3)};
}

// ---------------------------------------------------------------------------------------
// Value checks. Each computes its verdicts on the data's device with torch ops and reads them
// back in one copy (on CUDA the one sync the check costs); only a failing check reads more, to
// name the first offending element.
// ---------------------------------------------------------------------------------------
std::vector<bool> read_flags(std::initializer_list<Tensor> flags) {
  const Tensor host = at::stack(std::vector<Tensor>(flags)).to(at::kCPU);
  const bool* values = host.const_data_ptr<bool>();
  return std::vector<bool>(values, values + host.numel());
}

// The index of the first true element of a 1-D mask that has one.
int64_t first_true(const Tensor& mask) { return mask.nonzero().select(0, 0).select(0, 0).item<int64_t>(); }

int64_t value_at(const Tensor& t, int64_t i) { return t.select(0, i).item<int64_t>(); }

// The first value of `sorted` (ascending) that `repeats` marks as equal to the one before it.
int64_t repeated_value(const Tensor& sorted, const Tensor& repeats) {
  return value_at(sorted.slice(0, 1), first_true(repeats));
}

// The table entries a sequence's context uses are ids of the cache's blocks, and no context is
// negative or longer than its row covers.
void check_table_values(const char* op, const Tensor& tables, const Tensor& context_lens, const KVCacheLayout& cache) {
  const int64_t max_blocks = tables.size(1);
  const int64_t covered = max_blocks * cache.block_size;
  const Tensor lens = context_lens.to(at::kLong);
  const Tensor bad_len = (lens < 0) | (lens > covered);
  const Tensor used = at::arange(max_blocks, lens.options()).mul(cache.block_size).unsqueeze(0) < lens.unsqueeze(1);
  const Tensor bad_id = used & ((tables < 0) | (tables >= cache.num_blocks));
  const std::vector<bool> fails = read_flags({bad_len.any(), bad_id.any()});
  if (fails[0]) {
    const int64_t b = first_true(bad_len);
    const int64_t len = value_at(lens, b);
    TORCH_CHECK(len >= 0, op, ": context_lens[", std::to_string(b), "] is ", std::to_string(len),
                "; a context length cannot be negative");
    TORCH_CHECK(false, op, ": context_lens[", std::to_string(b), "] is ", std::to_string(len),
                " but its block_tables row covers ", std::to_string(max_blocks), " blocks x block_size ",
                std::to_string(cache.block_size), " = ", std::to_string(covered), " tokens");
  }
  if (fails[1]) {
    const int64_t b = first_true(bad_id.any(1));
    const int64_t column = first_true(bad_id.select(0, b));
    TORCH_CHECK(false, op, ": block_tables[", std::to_string(b), "][", std::to_string(column), "] is ",
                std::to_string(value_at(tables.select(0, b), column)), ", not a block of the cache (num_blocks ",
                std::to_string(cache.num_blocks), "), and context_lens[", std::to_string(b), "] = ",
                std::to_string(value_at(lens, b)), " uses it");
  }
}

// Every slot is -1 (a padding token) or a slot of the cache, and no slot is written twice (two
// tokens racing for one slot would leave whichever the GPU wrote last).
void check_slot_values(const char* op, const Tensor& slots, int64_t num_slots) {
  const Tensor outside = (slots < -1) | (slots >= num_slots);
  const Tensor sorted = std::get<0>(slots.sort());
  const Tensor next = sorted.slice(0, 1);
  const Tensor repeats = (next == sorted.slice(0, 0, -1)) & (next >= 0);
  const std::vector<bool> fails = read_flags({outside.any(), repeats.any()});
  if (fails[0]) {
    const int64_t i = first_true(outside);
    TORCH_CHECK(false, op, ": slot_mapping[", std::to_string(i), "] is ", std::to_string(value_at(slots, i)),
                ", outside the cache's ", std::to_string(num_slots),
                " slots (num_blocks x block_size); -1 marks a padding token");
  }
  TORCH_CHECK(!fails[1], op, ": slot_mapping writes slot ", std::to_string(repeated_value(sorted, repeats)),
              " twice; each token needs a slot of its own");
}

// Every pair names blocks of the cache, no destination appears twice, and none is also a source:
// then the copies are independent and their order cannot matter (serving.h).
void check_mapping_values(const char* op, const Tensor& mapping, int64_t num_blocks) {
  const Tensor src = mapping.select(1, 0);
  const Tensor dst = mapping.select(1, 1);
  const Tensor outside = ((mapping < 0) | (mapping >= num_blocks)).any(1);
  const Tensor sorted = std::get<0>(dst.sort());
  const Tensor repeats = sorted.slice(0, 1) == sorted.slice(0, 0, -1);
  const Tensor also_source = at::isin(dst, src);
  const std::vector<bool> fails = read_flags({outside.any(), repeats.any(), also_source.any()});
  auto pair = [&](int64_t i) {
    return "block_mapping[" + std::to_string(i) + "] = (" + std::to_string(value_at(src, i)) + ", " +
           std::to_string(value_at(dst, i)) + ")";
  };
  TORCH_CHECK(!fails[0], op, ": ", pair(first_true(outside)), " names a block outside the cache (num_blocks ",
              std::to_string(num_blocks), ")");
  TORCH_CHECK(!fails[1], op, ": block ", std::to_string(repeated_value(sorted, repeats)),
              " is the destination of two pairs of block_mapping; each destination may appear once");
  TORCH_CHECK(!fails[2], op, ": ", pair(first_true(also_source)),
              " copies into a block that is also a source in block_mapping; the result would depend on the order "
              "of the copies (make such chains separate calls)");
}

// ---------------------------------------------------------------------------------------
// reshape_and_cache: key and value (tokens, heads_kv, head_dim) into the caches at slot_mapping.
// ---------------------------------------------------------------------------------------
void reshape_and_cache_impl(const Tensor& key, const Tensor& value, const Tensor& key_cache, const Tensor& value_cache,
                            const Tensor& slot_mapping, bool check_slots) {
  const char* op = kReshapeAndCache;
  check_caches(op, key_cache, value_cache);
  for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"key", key},
                                std::pair<const char*, const Tensor&>{"value", value}}) {
    check_rank(op, name, t, 3, "(tokens, heads_kv, head_dim)");
    ::course::check_same_device(op, name, t, "key_cache", key_cache);
    ::course::check_same_dtype(op, name, t, "key_cache", key_cache);
    check_last_dim_contiguous(op, name, t);
  }
  TORCH_CHECK(key.sym_sizes() == value.sym_sizes(), op, ": key has shape ", shape_of(key), " but value has shape ",
              shape_of(value), " (they must match: one value per key)");
  TORCH_CHECK(key.sym_size(1) == key_cache.sym_size(2) && key.sym_size(2) == key_cache.sym_size(3), op,
              ": key has shape ", shape_of(key), " but the cache ", shape_of(key_cache),
              " holds (heads_kv, head_dim) = (", str(key_cache.sym_size(2)), ", ", str(key_cache.sym_size(3)),
              ") per token");
  check_index(op, "slot_mapping", slot_mapping, 1, "(tokens,)", at::kLong, "key_cache", key_cache);
  TORCH_CHECK(slot_mapping.sym_size(0) == key.sym_size(0), op, ": slot_mapping has ", str(slot_mapping.sym_size(0)),
              " slots for ", str(key.sym_size(0)), " tokens (one slot per token; -1 skips a token)");
  if (key_cache.is_meta()) return;
  const KVCacheLayout cache = layout_of(key_cache);
  const Tensor slots = slot_mapping.contiguous();
  if (check_slots) check_slot_values(op, slots, cache.num_blocks * cache.block_size);
  if (key.size(0) == 0) return;
  ReshapeAndCacheParams p{};
  p.cache = cache;
  p.key = key.const_data_ptr();
  p.value = value.const_data_ptr();
  p.key_cache = key_cache.mutable_data_ptr();
  p.value_cache = value_cache.mutable_data_ptr();
  p.slot_mapping = slots.const_data_ptr<int64_t>();
  p.tokens = key.size(0);
  p.key_token_stride = key.stride(0), p.key_head_stride = key.stride(1);
  p.value_token_stride = value.stride(0), p.value_head_stride = value.stride(1);
  if (key_cache.is_cuda()) {
    COURSE_ON_CUDA(op, kPackage, key_cache, C10_CUDA_CHECK(launch_reshape_and_cache(p, stream)));
  } else {
    reshape_and_cache_cpu(p);
  }
}

// ---------------------------------------------------------------------------------------
// copy_blocks: block_mapping (pairs, 2) of (src, dst) block ids, both caches.
// ---------------------------------------------------------------------------------------
void copy_blocks_impl(const Tensor& key_cache, const Tensor& value_cache, const Tensor& block_mapping,
                      bool check_mapping) {
  const char* op = kCopyBlocks;
  check_caches(op, key_cache, value_cache);
  check_index(op, "block_mapping", block_mapping, 2, "(pairs, 2), a (src, dst) pair of block ids per row", at::kLong,
              "key_cache", key_cache);
  TORCH_CHECK(block_mapping.sym_size(1) == 2, op, ": block_mapping has shape ", shape_of(block_mapping),
              "; it must be (pairs, 2), a (src, dst) pair of block ids per row");
  if (key_cache.is_meta()) return;
  const Tensor mapping = block_mapping.contiguous();
  if (mapping.size(0) == 0) return;
  const KVCacheLayout cache = layout_of(key_cache);
  if (check_mapping) check_mapping_values(op, mapping, cache.num_blocks);  // a sync on CUDA: see the top of the file
  CopyBlocksParams p{};
  p.cache = cache;
  p.key_cache = key_cache.mutable_data_ptr();
  p.value_cache = value_cache.mutable_data_ptr();
  p.block_mapping = mapping.const_data_ptr<int64_t>();
  p.pairs = mapping.size(0);
  if (key_cache.is_cuda()) {
    COURSE_ON_CUDA(op, kPackage, key_cache, C10_CUDA_CHECK(launch_copy_blocks(p, stream)));
  } else {
    copy_blocks_cpu(p);
  }
}

// ---------------------------------------------------------------------------------------
// paged_attention: out (batch, heads, head_dim), contiguous, query's dtype.
// ---------------------------------------------------------------------------------------
#ifdef WITH_CUDA
// version=None: per_kv_head, which reads each K/V row once for its whole group of query heads
// where per_head reads it once per query head, unless the (sequence, kv head) grid is too small
// to fill the GPU and the tables are long enough to cut: paged_attention_splits, from the table
// width known on the host, says how many splits (1: no split, and split_kv would be per_kv_head
// plus a workspace). per_head is the ladder's first rung, never the default. num_splits > 0
// replaces the count (the glue has checked it against the version and the dtype).
void paged_attention_cuda(std::optional<PagedVersion> named, const PagedAttentionParams& p, const Tensor& query,
                          int64_t num_splits, cudaStream_t stream) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, query.device().index()));
  const int64_t splits = num_splits > 0 ? num_splits : paged_attention_splits(p, sms);
  const PagedVersion version = named.value_or(splits > 1 ? PagedVersion::kSplitKv : PagedVersion::kPerKvHead);
  const int64_t used_splits = version == PagedVersion::kSplitKv ? splits : 1;
  // The partials come from torch's caching allocator, never from the launcher: stream-ordered,
  // freed at the end of this scope once the stream has passed it, and from the graph's pool
  // inside a CUDA graph capture (attention/attention_ops.cpp's workspaces likewise).
  const Tensor partials = at::empty({paged_attention_workspace(p, used_splits)}, query.options().dtype(at::kByte));
  C10_CUDA_CHECK(launch_paged_attention(p, version, used_splits, partials.mutable_data_ptr(), stream));
}
#endif

// What a query (rank 3: tokens, heads, head_dim) must be against the cache and its block table, for
// the decode and the prefill ops alike. The reference computes in the input's type, float32 and
// float64 only (attention/attention_ops.cpp says why); the CUDA kernels take more (each op checks
// its rung's own). Meta tensors carry no device of their own: any passes.
void check_query_against_cache(const char* op, const Tensor& query, const Tensor& key_cache,
                               const Tensor& block_tables) {
  if (query.device().is_cpu()) {
    ::course::check_dtype_in(op, "query", query, {at::kFloat, at::kDouble});
  } else {
    ::course::check_floating(op, "query", query);
  }
  ::course::check_same_device(op, "key_cache", key_cache, "query", query);
  ::course::check_same_dtype(op, "key_cache", key_cache, "query", query);
  check_last_dim_contiguous(op, "query", query);
  TORCH_CHECK(query.sym_size(2) == key_cache.sym_size(3), op, ": query has head_dim ", str(query.sym_size(2)),
              " but key_cache and value_cache have head_dim ", str(key_cache.sym_size(3)), " (they must be equal)");
  TORCH_CHECK(query.sym_size(1) % key_cache.sym_size(2) == 0, op, ": query has ", str(query.sym_size(1)),
              " heads and the cache has ", str(key_cache.sym_size(2)), " kv heads; the query heads must be a whole ",
              "multiple of the kv heads (grouped-query attention: each kv head serves heads / heads_kv query heads)");
  check_index(op, "block_tables", block_tables, 2, "(batch, max_blocks)", at::kInt, "query", query);
}

Tensor paged_attention_impl(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                            const Tensor& block_tables, const Tensor& context_lens, double scale, OptVersion version,
                            bool check_tables, int64_t num_splits) {
  const char* op = kPagedAttention;
  check_rank(op, "query", query, 3, "(batch, heads, head_dim), one decode token per sequence");
  check_caches(op, key_cache, value_cache);
  check_query_against_cache(op, query, key_cache, block_tables);
  check_index(op, "context_lens", context_lens, 1, "(batch,)", at::kInt, "query", query);
  TORCH_CHECK(block_tables.sym_size(0) == query.sym_size(0), op, ": block_tables has ", str(block_tables.sym_size(0)),
              " rows for a batch of ", str(query.sym_size(0)), " (one row of block ids per sequence)");
  TORCH_CHECK(context_lens.sym_size(0) == query.sym_size(0), op, ": context_lens has ",
              str(context_lens.sym_size(0)), " lengths for a batch of ", str(query.sym_size(0)));
  if (query.is_cuda()) {
    TORCH_CHECK(is_listed(kPagedHeadDims, query.size(2)), op, ": head_dim ", std::to_string(query.size(2)),
                " is not supported on CUDA (supported: ", list_text(kPagedHeadDims), ")");
    TORCH_CHECK(is_listed(kPagedBlockSizes, key_cache.size(1)), op, ": block_size ",
                std::to_string(key_cache.size(1)), " is not supported on CUDA (supported: ", list_text(kPagedBlockSizes),
                ")");
    // The kernel reads K/V rows with 16-byte cp.async; a contiguous cache from torch is aligned,
    // a view starting mid-allocation (cache[1:] of an odd-sized pool, say) may not be.
    for (const auto& [name, cache] : {std::pair<const char*, const Tensor&>{"key_cache", key_cache},
                                      std::pair<const char*, const Tensor&>{"value_cache", value_cache}}) {
      TORCH_CHECK(reinterpret_cast<std::uintptr_t>(cache.const_data_ptr()) % 16 == 0, op, ": ", name,
                  " does not start at a 16-byte aligned address; the CUDA kernel reads it in 16-byte pieces ",
                  "(pass a cache that owns its storage, or .clone() the view)");
    }
  }
  const auto named = ::course::parse_version(op, version, kPagedVersions);  // a typo fails on Meta too
  // num_splits: 0 lets the shapes decide; n > 0 cuts every context into n ranges (split_kv only,
  // and on CUDA only the 16-bit types, the combine's). The CPU reference never splits: it takes
  // the same values and ignores them, so a call moves between devices unchanged.
  TORCH_CHECK(num_splits >= 0 && num_splits <= kPagedMaxSplits, op, ": num_splits is ", std::to_string(num_splits),
              "; it must be 0 (chosen from the shapes) or 1 to ", std::to_string(kPagedMaxSplits));
  TORCH_CHECK(num_splits <= 1 || !named.has_value() || *named == PagedVersion::kSplitKv, op, ": num_splits is ",
              std::to_string(num_splits), " but version '", std::string(version->data(), version->size()),
              "' does not split the context (use version='split_kv' or None)");
  TORCH_CHECK(num_splits <= 1 || !query.is_cuda() || query.scalar_type() == at::kHalf ||
                  query.scalar_type() == at::kBFloat16,
              op, ": num_splits is ", std::to_string(num_splits), " but query is ", query.scalar_type(),
              "; on CUDA only float16 and bfloat16 split (the combine writes those)");
  Tensor out = at::empty_symint(query.sym_sizes(), query.options());
  if (query.is_meta()) return out;
  const KVCacheLayout cache = layout_of(key_cache);
  const Tensor tables = rows_contiguous(block_tables);
  const Tensor lens = context_lens.contiguous();
  if (check_tables) check_table_values(op, tables, lens, cache);  // a sync on CUDA: see the top of the file
  if (out.numel() == 0) return out;
  PagedAttentionParams p{};
  p.cache = cache;
  p.q = query.const_data_ptr();
  p.key_cache = key_cache.const_data_ptr();
  p.value_cache = value_cache.const_data_ptr();
  p.block_tables = tables.const_data_ptr<int32_t>();
  p.context_lens = lens.const_data_ptr<int32_t>();
  p.out = out.mutable_data_ptr();
  p.batch = query.size(0);
  p.heads = query.size(1);
  p.max_blocks = tables.size(1);
  p.q_batch_stride = query.stride(0), p.q_head_stride = query.stride(1);
  p.block_table_stride = tables.stride(0);
  p.scale = scale;
  if (query.is_cuda()) {
    COURSE_ON_CUDA(op, kPackage, query, paged_attention_cuda(named, p, query, num_splits, stream));
  } else {
    paged_attention_cpu(p);
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// paged_prefill_attention: out (total_q, heads, head_dim), contiguous, query's dtype.
// ---------------------------------------------------------------------------------------

// cu_seqlens_q's values (serving.h's PagedPrefillParams): offsets from 0 to total_q that never
// decrease, and no chunk longer than its context (the chunk's tokens are in the cache: a longer
// one means reshape_and_cache did not run first) or than max_seqlen_q (the grid's bound: rows past
// it would not be written). One read back for all of them, as check_table_values.
void check_prefill_values(const char* op, const Tensor& cu, const Tensor& context_lens, int64_t total_q,
                          int64_t max_seqlen_q) {
  const Tensor offsets = cu.to(at::kLong);
  const Tensor chunks = offsets.slice(0, 1) - offsets.slice(0, 0, -1);
  const Tensor lens = context_lens.to(at::kLong);
  const Tensor too_long = (chunks > lens) | (chunks > max_seqlen_q);
  const std::vector<bool> fails =
      read_flags({offsets.select(0, 0) != 0, offsets.select(0, -1) != total_q, (chunks < 0).any(), too_long.any()});
  TORCH_CHECK(!fails[0], op, ": cu_seqlens_q[0] is ", std::to_string(value_at(offsets, 0)),
              "; the offsets start at 0");
  TORCH_CHECK(!fails[1], op, ": cu_seqlens_q ends at ", std::to_string(value_at(offsets, offsets.size(0) - 1)),
              " but query has ", std::to_string(total_q), " tokens; the last offset is the total");
  if (fails[2]) {
    const int64_t b = first_true(chunks < 0);
    TORCH_CHECK(false, op, ": cu_seqlens_q decreases from ", std::to_string(value_at(offsets, b)), " to ",
                std::to_string(value_at(offsets, b + 1)), " at sequence ", std::to_string(b),
                "; the offsets never decrease");
  }
  if (fails[3]) {
    const int64_t b = first_true(too_long);
    const int64_t chunk = value_at(chunks, b);
    TORCH_CHECK(chunk <= max_seqlen_q, op, ": sequence ", std::to_string(b), " has ", std::to_string(chunk),
                " query tokens but max_seqlen_q is ", std::to_string(max_seqlen_q));
    TORCH_CHECK(false, op, ": sequence ", std::to_string(b), " has ", std::to_string(chunk),
                " query tokens but context_lens[", std::to_string(b), "] is ", std::to_string(value_at(lens, b)),
                "; the new tokens are the last of the context (write them with reshape_and_cache first and count "
                "them in context_lens)");
  }
}

#ifdef WITH_CUDA
int capability_major(const Tensor& t) {
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, t.device().index()));
  return major;
}

// What rung mma needs beyond the checks every rung makes, each refused with the way out.
void check_prefill_mma(const char* op, const Tensor& query) {
  TORCH_CHECK(query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16, op,
              ": version 'mma' runs on tensor cores and takes float16 and bfloat16; query is ", query.scalar_type(),
              " (use version='decode_rows' or None)");
  const int major = capability_major(query);
  TORCH_CHECK(major >= 8, op, ": version 'mma' needs compute capability 8.0 or newer (mma.sync m16n8k16 in ",
              "16-bit types and cp.async); this GPU is ", std::to_string(major),
              ".x (use version='decode_rows' or None)");
}

// What rung persistent needs beyond the checks every rung makes, each refused with the way out: the
// 16-bit types, a build with the sm_90a kernels, a Hopper GPU, its head dims and block sizes, and a
// positive scale (its softmax keeps the unscaled scores' maximum, as the training forward's).
void check_prefill_persistent(const char* op, const Tensor& query, int64_t block_size, double scale) {
  TORCH_CHECK(query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16, op,
              ": version 'persistent' runs on tensor cores and takes float16 and bfloat16; query is ",
              query.scalar_type(), " (use version='decode_rows' or None)");
#ifndef COURSE_HOPPER
  TORCH_CHECK(false, op, ": version 'persistent' is a Hopper kernel (sm_90a), and this build of flash_attention ",
              "has none: it was compiled for a TORCH_CUDA_ARCH_LIST without 9.0. Rebuild with 9.0 in the list ",
              "(the default on a Hopper GPU), or use version='mma' or None");
#endif
  int minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, query.device().index()));
  const int major = capability_major(query);
  TORCH_CHECK(major == 9 && minor == 0, op, ": version 'persistent' needs a Hopper GPU, compute capability 9.0 ",
              "(wgmma, TMA and setmaxnreg; sm_90a code runs on no other); this GPU is ", std::to_string(major), ".",
              std::to_string(minor), " (use version='mma' or None)");
  const int64_t d = query.size(2);
  TORCH_CHECK(is_listed(kPagedPrefillHopperHeadDims, d), op, ": version 'persistent' takes head_dim ",
              list_text(kPagedPrefillHopperHeadDims), "; head_dim is ", std::to_string(d),
              " (use version='mma' or None)");
  TORCH_CHECK(paged_prefill_hopper_block_size(block_size, hopper_block_n(d)), op,
              ": version 'persistent' loads a ", std::to_string(hopper_block_n(d)),
              "-key tile page by page and takes block sizes of at least 8 that divide it or are multiples of it; "
              "block_size is ",
              std::to_string(block_size), " (use version='mma' or None)");
  TORCH_CHECK(scale > 0.0, op, ": version 'persistent' takes scale > 0 (its softmax keeps each row's maximum of ",
              "the unscaled scores); scale is ", std::to_string(scale), " (use version='mma' or None)");
}

// Rung persistent: the Hopper forward's packed instantiation with the keys read through the table
// (attention.h's AttentionParams, its paged fields). Its lse (heads, total_q) and its workspace (the
// tile counter and the packed schedule) come from the caching allocator and are dropped. Without
// the sm_90a kernels check_prefill_persistent has refused the call before it gets here.
void prefill_persistent_cuda([[maybe_unused]] const PagedPrefillParams& p, [[maybe_unused]] const Tensor& q,
                             [[maybe_unused]] cudaStream_t stream) {
#ifdef COURSE_HOPPER
  AttentionParams a{};
  a.dtype = p.cache.dtype;
  a.q = p.q;
  a.k = p.key_cache;
  a.v = p.value_cache;
  a.o = p.out;
  a.batch = p.batch;
  a.heads = p.heads;
  a.heads_kv = p.cache.heads_kv;
  a.seqlen_q = p.max_seqlen_q;                        // the grid's bound, as max_seqlen_q of attention_varlen
  a.seqlen_k = p.max_blocks * p.cache.block_size;     // every key a table row reaches
  a.head_dim = p.cache.head_dim;
  a.q_seq_stride = p.q_token_stride, a.q_head_stride = p.q_head_stride;
  a.o_seq_stride = p.heads * p.cache.head_dim, a.o_head_stride = p.cache.head_dim;  // out is contiguous
  a.scale = p.scale;
  a.causal = true;  // bottom-right: chunk row i sees keys <= i + context - q_len (serving.h)
  a.cu_seqlens_q = p.cu_seqlens_q;
  a.total_q = p.total_q;
  a.block_tables = p.block_tables;
  a.context_lens = p.context_lens;
  a.block_table_stride = p.block_table_stride;
  a.block_size = p.cache.block_size;
  a.num_blocks = p.cache.num_blocks;
  a.max_blocks = p.max_blocks;
  const Tensor lse = at::empty({p.heads * p.total_q}, q.options().dtype(at::kFloat));
  a.lse = lse.mutable_data_ptr();
  const Tensor scratch = at::empty({attention_forward_hopper_workspace(a, HopperForward::kPersistent)},
                                   q.options().dtype(at::kByte));
  C10_CUDA_CHECK(launch_attention_forward_hopper(a, HopperForward::kPersistent, stream, scratch.mutable_data_ptr()));
#endif
}

// The facts version=None reads about q's device (serving.h's PagedPrefillFacts).
PagedPrefillFacts prefill_facts(const Tensor& query) {
  PagedPrefillFacts f;
  f.cuda = true;
  f.half = query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16;
  f.cc_major = capability_major(query);
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.cc_minor, cudaDevAttrComputeCapabilityMinor, query.device().index()));
#ifdef COURSE_HOPPER
  f.hopper_built = true;
#endif
  return f;
}

// Rung decode_rows: every query row becomes a decode query of paged_attention (serving.h). Its
// sequence s is the chunk that holds it (a search of the offsets), its table row is s's, and its
// context is the tokens up to its own position: context_lens[s] (clamped to the row, as
// paged_context does) - (cu_seqlens_q[s + 1] - row) + 1. All of it torch ops on the device: no
// sync, and a CUDA graph captures it. Rows in no chunk (offsets the checks refuse) get some
// sequence's table and a context inside it: memory-safe, their values unspecified.
void prefill_decode_rows_cuda(const PagedPrefillParams& p, const Tensor& q, const Tensor& tables, const Tensor& cu,
                              const Tensor& lens, cudaStream_t stream) {
  if (p.batch == 0) return;  // no sequence, no row to serve (offsets the checks refuse: see above)
  const Tensor ends = cu.slice(0, 1).to(at::kLong);
  const Tensor rows = at::arange(p.total_q, ends.options());
  const Tensor seq = at::searchsorted(ends, rows, /*out_int32=*/false, /*right=*/true).clamp_max(p.batch - 1);
  const Tensor context = lens.to(at::kLong).clamp(0, p.max_blocks * p.cache.block_size).index_select(0, seq);
  const Tensor row_lens = (context - (ends.index_select(0, seq) - rows) + 1).clamp_min(0).to(at::kInt);
  const Tensor row_tables = tables.index_select(0, seq);  // (total_q, max_blocks), contiguous
  PagedAttentionParams d{};
  d.cache = p.cache;
  d.q = p.q;
  d.key_cache = p.key_cache;
  d.value_cache = p.value_cache;
  d.block_tables = row_tables.const_data_ptr<int32_t>();
  d.context_lens = row_lens.const_data_ptr<int32_t>();
  d.out = p.out;
  d.batch = p.total_q;
  d.heads = p.heads;
  d.max_blocks = p.max_blocks;
  d.q_batch_stride = q.stride(0), d.q_head_stride = q.stride(1);
  d.block_table_stride = row_tables.stride(0);
  d.scale = p.scale;
  // per_kv_head: each K/V row read once for the row's group of query heads; never split (the
  // grid already has a block per query row and kv head).
  C10_CUDA_CHECK(launch_paged_attention(d, PagedVersion::kPerKvHead, 1, nullptr, stream));
}
#endif

// The kernel copies Q rows with 16-byte cp.async: a query whose start or token stride is not a
// multiple of 16 bytes (a view one element into its buffer) is copied to an aligned one first.
Tensor aligned_query(const Tensor& query) {
  const int64_t elem = query.element_size();
  const bool aligned = reinterpret_cast<std::uintptr_t>(query.const_data_ptr()) % 16 == 0 &&
                       (query.size(0) <= 1 || query.stride(0) * elem % 16 == 0) &&
                       (query.size(1) <= 1 || query.stride(1) * elem % 16 == 0);
  return aligned ? query : query.clone(at::MemoryFormat::Contiguous);
}

Tensor paged_prefill_attention_impl(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                                    const Tensor& block_tables, const Tensor& cu_seqlens_q, const Tensor& context_lens,
                                    double scale, int64_t max_seqlen_q, OptVersion version, bool check_tables) {
  const char* op = kPagedPrefill;
  check_rank(op, "query", query, 3, "(total_q, heads, head_dim), the chunks' tokens packed");
  check_caches(op, key_cache, value_cache);
  // decode_rows takes what paged_attention takes, mma the 16-bit types (check_prefill_mma)
  check_query_against_cache(op, query, key_cache, block_tables);
  check_index(op, "cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,), the offsets of the chunks in query", at::kInt,
              "query", query);
  check_index(op, "context_lens", context_lens, 1, "(batch,)", at::kInt, "query", query);
  TORCH_CHECK(cu_seqlens_q.sym_size(0) == block_tables.sym_size(0) + 1, op, ": cu_seqlens_q has ",
              str(cu_seqlens_q.sym_size(0)), " offsets for a batch of ", str(block_tables.sym_size(0)),
              " sequences (block_tables' rows); it needs batch + 1");
  TORCH_CHECK(context_lens.sym_size(0) == block_tables.sym_size(0), op, ": context_lens has ",
              str(context_lens.sym_size(0)), " lengths for a batch of ", str(block_tables.sym_size(0)),
              " sequences (block_tables' rows)");
  TORCH_CHECK(max_seqlen_q >= 0, op, ": max_seqlen_q is ", std::to_string(max_seqlen_q),
              "; it must be 0 (bounded by query's tokens) or the longest chunk's length");
  const auto named = ::course::parse_version(op, version, kPrefillVersions);  // a typo fails on Meta too
  // The rung a CUDA call runs (version=None's rule needs the GPU's facts: serving.h); unread elsewhere.
  PagedPrefillVersion rung = named.value_or(PagedPrefillVersion::kDecodeRows);
  if (query.is_cuda()) {
    TORCH_CHECK(is_listed(kPagedHeadDims, query.size(2)), op, ": head_dim ", std::to_string(query.size(2)),
                " is not supported on CUDA (supported: ", list_text(kPagedHeadDims), ")");
#ifdef WITH_CUDA
    const int64_t longest = max_seqlen_q > 0 ? max_seqlen_q : query.size(0);  // a CUDA tensor: concrete sizes
    rung = named.value_or(paged_prefill_default(prefill_facts(query), query.size(2), key_cache.size(1), scale, longest));
    if (rung == PagedPrefillVersion::kMma) check_prefill_mma(op, query);
    if (rung == PagedPrefillVersion::kPersistent) check_prefill_persistent(op, query, key_cache.size(1), scale);
#endif
    // The other rungs' kernels are compiled for kPagedBlockSizes; persistent checked its own above.
    TORCH_CHECK(rung == PagedPrefillVersion::kPersistent || is_listed(kPagedBlockSizes, key_cache.size(1)), op,
                ": block_size ", std::to_string(key_cache.size(1)), " is not supported on CUDA (supported: ",
                list_text(kPagedBlockSizes), "; version 'persistent', on a Hopper GPU, takes more)");
    // The kernel copies K/V rows with 16-byte cp.async, as paged_attention's does.
    for (const auto& [name, cache] : {std::pair<const char*, const Tensor&>{"key_cache", key_cache},
                                      std::pair<const char*, const Tensor&>{"value_cache", value_cache}}) {
      TORCH_CHECK(reinterpret_cast<std::uintptr_t>(cache.const_data_ptr()) % 16 == 0, op, ": ", name,
                  " does not start at a 16-byte aligned address; the CUDA kernel reads it in 16-byte pieces ",
                  "(pass a cache that owns its storage, or .clone() the view)");
    }
  }
  Tensor out = at::empty_symint(query.sym_sizes(), query.options());
  if (query.is_meta()) return out;
  const int64_t total_q = query.size(0);
  const int64_t bound = max_seqlen_q > 0 ? max_seqlen_q : total_q;  // the longest chunk's length, at most
  const KVCacheLayout cache = layout_of(key_cache);
  const Tensor tables = rows_contiguous(block_tables);
  const Tensor cu = cu_seqlens_q.contiguous();
  const Tensor lens = context_lens.contiguous();
  if (check_tables) {  // syncs on CUDA: see the top of the file
    check_table_values(op, tables, lens, cache);
    check_prefill_values(op, cu, lens, total_q, bound);
  }
  if (out.numel() == 0) return out;
  // mma copies Q rows with cp.async and persistent with TMA (16-byte aligned start and strides);
  // decode_rows reads q element by element and takes any view.
  const Tensor q = query.is_cuda() && rung != PagedPrefillVersion::kDecodeRows ? aligned_query(query) : query;
  PagedPrefillParams p{};
  p.cache = cache;
  p.q = q.const_data_ptr();
  p.key_cache = key_cache.const_data_ptr();
  p.value_cache = value_cache.const_data_ptr();
  p.block_tables = tables.const_data_ptr<int32_t>();
  p.cu_seqlens_q = cu.const_data_ptr<int32_t>();
  p.context_lens = lens.const_data_ptr<int32_t>();
  p.out = out.mutable_data_ptr();
  p.batch = tables.size(0);
  p.heads = q.size(1);
  p.max_blocks = tables.size(1);
  p.total_q = total_q;
  p.max_seqlen_q = bound;
  p.q_token_stride = q.stride(0), p.q_head_stride = q.stride(1);
  p.block_table_stride = tables.stride(0);
  p.scale = scale;
  if (query.is_cuda()) {
    COURSE_ON_CUDA(op, kPackage, query, if (rung == PagedPrefillVersion::kMma) {
      C10_CUDA_CHECK(launch_paged_prefill_attention(p, stream));
    } else if (rung == PagedPrefillVersion::kPersistent) {
      prefill_persistent_cuda(p, q, stream);
    } else {
      prefill_decode_rows_cuda(p, q, tables, cu, lens, stream);
    });
  } else {
    paged_prefill_attention_cpu(p);
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// match_prefix: (matched_tokens (requests,), matched_blocks (requests, max_match_blocks)), int32;
// the entries of matched_blocks past a request's match are -1.
// ---------------------------------------------------------------------------------------

// The tree's values (RadixTreeView's rules, serving.h), on the CPU: every span inside `tokens` and
// `block_ids`, every node but the root at least one block long (so each step of the walk
// consumes a block and the walk ends, whatever the links), every child list inside child_index
// and naming nodes other than the root, sorted by first token, and no two children of a node
// with the same first block (the lookup could not choose).
void check_tree_values(const char* op, const RadixTreeView& t, int64_t tokens, int64_t block_ids, int64_t links) {
  auto node_str = [](int64_t n) { return "node " + std::to_string(n); };
  TORCH_CHECK(t.span_blocks[0] == 0, op, ": node 0 (the root) has span_blocks ", std::to_string(t.span_blocks[0]),
              "; the root's span is empty");
  for (int64_t n = 0; n < t.num_nodes; ++n) {
    const int64_t span = t.span_blocks[n];
    TORCH_CHECK(n == 0 || span >= 1, op, ": ", node_str(n), " has span_blocks ", std::to_string(span),
                "; every node but the root holds at least one block");
    TORCH_CHECK(t.token_start[n] >= 0 && t.token_start[n] + span * t.block_size <= tokens, op, ": ", node_str(n),
                "'s tokens [", std::to_string(t.token_start[n]), ", +", std::to_string(span * t.block_size),
                ") fall outside tokens (", std::to_string(tokens), " ids)");
    TORCH_CHECK(t.block_start[n] >= 0 && t.block_start[n] + span <= block_ids, op, ": ", node_str(n),
                "'s blocks [", std::to_string(t.block_start[n]), ", +", std::to_string(span),
                ") fall outside block_ids (", std::to_string(block_ids), " ids)");
    const int64_t first = t.child_start[n];
    const int64_t count = t.child_count[n];
    TORCH_CHECK(first >= 0 && count >= 0 && first + count <= links, op, ": ", node_str(n), "'s children [",
                std::to_string(first), ", +", std::to_string(count), ") fall outside child_index (",
                std::to_string(links), " entries)");
    for (int64_t i = 0; i < count; ++i) {
      const int64_t child = t.child_index[first + i];
      TORCH_CHECK(child >= 1 && child < t.num_nodes, op, ": ", node_str(n), "'s child ", std::to_string(i), " is ",
                  std::to_string(child), ", not a node of the tree other than the root (1 to ",
                  std::to_string(t.num_nodes - 1), ")");
    }
  }
  // Every child's first block is now known to lie inside tokens.
  for (int64_t n = 0; n < t.num_nodes; ++n) {
    const int64_t first = t.child_start[n];
    const int64_t count = t.child_count[n];
    for (int64_t i = 1; i < count; ++i) {
      const int32_t* block = t.tokens + t.token_start[t.child_index[first + i]];
      for (int64_t j = i - 1; j >= 0; --j) {
        const int32_t* earlier = t.tokens + t.token_start[t.child_index[first + j]];
        if (earlier[0] != block[0]) {
          TORCH_CHECK(earlier[0] < block[0], op, ": ", node_str(n), "'s children are not sorted by first token (",
                      std::to_string(earlier[0]), " before ", std::to_string(block[0]), ")");
          break;  // sorted: the earlier children start with smaller tokens still
        }
        TORCH_CHECK(!std::equal(block, block + t.block_size, earlier), op, ": ", node_str(n),
                    "'s children ", std::to_string(j), " and ", std::to_string(i),
                    " start with the same block; a node's children must differ in their first block");
      }
    }
  }
}

std::tuple<Tensor, Tensor> match_prefix_impl(const Tensor& tokens, const Tensor& token_start,
                                             const Tensor& span_blocks, const Tensor& block_start,
                                             const Tensor& block_ids, const Tensor& child_start,
                                             const Tensor& child_count, const Tensor& child_index, int64_t block_size,
                                             const Tensor& queries, const Tensor& query_lens,
                                             int64_t max_match_blocks) {
  const char* op = kMatchPrefix;
  check_rank(op, "queries", queries, 2, "(requests, max_query_len) token ids");
  ::course::check_dtype_in(op, "queries", queries, {at::kInt});
  check_index(op, "query_lens", query_lens, 1, "(requests,)", at::kInt, "queries", queries);
  TORCH_CHECK(query_lens.sym_size(0) == queries.sym_size(0), op, ": query_lens has ", str(query_lens.sym_size(0)),
              " lengths for ", str(queries.sym_size(0)), " requests");
  // The flat tree (serving.h's RadixTreeView): per-node arrays of num_nodes entries, the others flat.
  const struct {
    const char* name;
    const Tensor& t;
    at::ScalarType dtype;
    bool per_node;
  } tree[] = {{"tokens", tokens, at::kInt, false},         {"token_start", token_start, at::kLong, true},
              {"span_blocks", span_blocks, at::kInt, true}, {"block_start", block_start, at::kLong, true},
              {"block_ids", block_ids, at::kInt, false},    {"child_start", child_start, at::kLong, true},
              {"child_count", child_count, at::kInt, true}, {"child_index", child_index, at::kInt, false}};
  for (const auto& a : tree) {
    check_index(op, a.name, a.t, 1, a.per_node ? "(num_nodes,)" : "a flat array", a.dtype, "queries", queries);
    TORCH_CHECK(!a.per_node || a.t.sym_size(0) == token_start.sym_size(0), op, ": ", a.name, " has ",
                str(a.t.sym_size(0)), " entries but token_start has ", str(token_start.sym_size(0)),
                "; every per-node array has one entry per node");
  }
  TORCH_CHECK(token_start.sym_size(0) >= 1, op, ": the tree has no nodes; even an empty tree has its root, node 0");
  TORCH_CHECK(block_size >= 1, op, ": block_size is ", std::to_string(block_size), "; it must be at least 1");
  TORCH_CHECK(max_match_blocks >= 0, op, ": max_match_blocks is ", std::to_string(max_match_blocks),
              "; it cannot be negative");
  const auto int32 = queries.options().dtype(at::kInt);
  Tensor matched_tokens = at::empty_symint({queries.sym_size(0)}, int32);
  Tensor matched_blocks = at::full_symint({queries.sym_size(0), max_match_blocks}, -1, int32);
  if (queries.is_meta()) return {matched_tokens, matched_blocks};
  const Tensor rows = rows_contiguous(queries);
  Tensor lens = query_lens.contiguous();
  std::vector<Tensor> flat;  // contiguous copies where needed, alive until the launch is queued
  for (const auto& a : tree) flat.push_back(a.t.contiguous());
  MatchPrefixParams p{};
  p.tree.num_nodes = token_start.size(0);
  p.tree.block_size = block_size;
  p.tree.tokens = flat[0].const_data_ptr<int32_t>();
  p.tree.token_start = flat[1].const_data_ptr<int64_t>();
  p.tree.span_blocks = flat[2].const_data_ptr<int32_t>();
  p.tree.block_start = flat[3].const_data_ptr<int64_t>();
  p.tree.block_ids = flat[4].const_data_ptr<int32_t>();
  p.tree.child_start = flat[5].const_data_ptr<int64_t>();
  p.tree.child_count = flat[6].const_data_ptr<int32_t>();
  p.tree.child_index = flat[7].const_data_ptr<int32_t>();
  p.queries = rows.const_data_ptr<int32_t>();
  p.requests = rows.size(0);
  p.query_stride = rows.stride(0);
  p.matched_tokens = matched_tokens.mutable_data_ptr<int32_t>();
  p.matched_blocks = matched_blocks.mutable_data_ptr<int32_t>();
  p.max_match_blocks = max_match_blocks;
  if (queries.is_cuda()) {
    // On the GPU neither the tree nor the lengths are read back: the lookup is the hot, batched
    // part of serving, and a sync per lookup would undo the point of running it there. The tree
    // is RadixCache's mirror, right by construction and checked on the CPU by the tests; a
    // length past its row is clamped on the device (one small kernel, no sync), so that the
    // kernel never reads beyond a row whatever the lengths say.
    lens = lens.clamp(0, rows.size(1));
    p.query_lens = lens.const_data_ptr<int32_t>();
    COURSE_ON_CUDA(op, kPackage, queries, C10_CUDA_CHECK(launch_match_prefix(p, stream)));
  } else {
    check_tree_values(op, p.tree, tokens.size(0), block_ids.size(0), child_index.size(0));
    const int32_t* len = lens.const_data_ptr<int32_t>();
    for (int64_t r = 0; r < p.requests; ++r) {
      TORCH_CHECK(len[r] >= 0 && len[r] <= rows.size(1), op, ": query_lens[", std::to_string(r), "] is ",
                  std::to_string(len[r]), " but the rows of queries hold ", std::to_string(rows.size(1)), " tokens");
    }
    p.query_lens = len;
    match_prefix_cpu(p);
  }
  return {matched_tokens, matched_blocks};
}

std::string paged_prefill_rule(bool cuda, bool half, int64_t capability_major, int64_t capability_minor,
                               bool hopper_built, int64_t head_dim, int64_t block_size, double scale,
                               int64_t max_seqlen_q) {
  PagedPrefillFacts f;
  f.cuda = cuda, f.half = half, f.hopper_built = hopper_built;
  f.cc_major = static_cast<int>(capability_major), f.cc_minor = static_cast<int>(capability_minor);
  return ::course::version_name(kPrefillVersions, paged_prefill_default(f, head_dim, block_size, scale, max_seqlen_q));
}

std::string paged_prefill_hopper_producer(int64_t head_dim, int64_t block_size) {
  if (!paged_prefill_hopper_takes(head_dim, block_size)) return "";
  if (!paged_prefill_hopper_gathers(block_size, hopper_block_n(head_dim))) return "tma";
  // The gather's table entries as the launcher reads its knob now (tile_schedule.h): by group
  // ("gather", the default) or by tile ("gather_by_tile", FLASH_ATTENTION_PAGED_GATHER=tile).
  const bool by_tile = paged_gather_entries(std::getenv(kPagedGatherEnv)) == PagedGatherEntries::kByTile;
  return by_tile ? "gather_by_tile" : "gather";
}

void register_backend_kernels(torch::Library& m) {
  m.impl(kReshapeAndCache, &reshape_and_cache_impl);
  m.impl(kCopyBlocks, &copy_blocks_impl);
  m.impl(kPagedAttention, &paged_attention_impl);
  m.impl(kMatchPrefix, &match_prefix_impl);
  m.impl(kPagedPrefill, &paged_prefill_attention_impl);
}

}  // namespace

// For the library's one `versions` op (flash_attention_ops.cpp).
std::optional<std::vector<std::string>> serving_versions(std::string_view op) {
  if (op == kPagedAttention) return ::course::version_names(kPagedVersions);
  if (op == kPagedPrefill) return ::course::version_names(kPrefillVersions);
  return std::nullopt;
}

}  // namespace flash_attention

// The schemas tell the truth about aliasing: reshape_and_cache and copy_blocks write the caches in
// place (Tensor(a!)), return nothing, and torch.compile functionalizes them; pt2_compliant_tag
// promises that, with the Meta kernels, and the test_paged_*.py files hold each op to it with
// opcheck.
TORCH_LIBRARY_FRAGMENT(flash_attention, m) {
  const std::vector<at::Tag> pt2 = {at::Tag::pt2_compliant_tag};
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, bool check_slots=True) -> ()",
        pt2);
  m.def("copy_blocks(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor block_mapping, bool check_mapping=True) -> ()",
        pt2);
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, str? version=None, bool check_tables=True, int num_splits=0) -> Tensor",
        pt2);
  m.def("match_prefix(Tensor tokens, Tensor token_start, Tensor span_blocks, Tensor block_start, Tensor block_ids, "
        "Tensor child_start, Tensor child_count, Tensor child_index, int block_size, Tensor queries, "
        "Tensor query_lens, int max_match_blocks) -> (Tensor matched_tokens, Tensor matched_blocks)",
        pt2);
  m.def("paged_prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor cu_seqlens_q, Tensor context_lens, float scale, int max_seqlen_q=0, str? version=None, "
        "bool check_tables=True) -> Tensor",
        pt2);
  // version=None's rule for paged_prefill_attention (serving.h), for any device: what
  // flash_attention.dispatch_rule asks, and the benchmark records.
  m.def("paged_prefill_rule(bool cuda, bool half, int capability_major, int capability_minor, bool hopper_built, "
        "int head_dim, int block_size, float scale, int max_seqlen_q) -> str",
        &flash_attention::paged_prefill_rule);
  // How rung persistent's producer loads a key tile of this cache (tile_schedule.h): "gather" (cp.async
  // by its 128 threads, pages under kPagedPrefillTmaRows rows; "gather_by_tile" under the table-entry
  // knob FLASH_ATTENTION_PAGED_GATHER=tile), "tma" (one box per page), or "" where
  // the rung does not take the block size. For the tests and the benchmark's records.
  m.def("paged_prefill_hopper_producer(int head_dim, int block_size) -> str",
        &flash_attention::paged_prefill_hopper_producer);
}

// CUDA is registered in every build, as in attention/attention_ops.cpp: a CUDA tensor meets the
// checks and then a clear error in a CPU-only build, not the dispatcher's "no kernel for CUDA".
TORCH_LIBRARY_IMPL(flash_attention, CPU, m) { flash_attention::register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(flash_attention, CUDA, m) { flash_attention::register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(flash_attention, Meta, m) { flash_attention::register_backend_kernels(m); }
