"""Chapter 6, part 2 benchmark: decode attention over the paged KV cache, the writes and copies
that keep the cache, and the radix tree's prefix lookup, each against PyTorch doing the same job
in the same run.

Napkin math. A decode step gives each sequence one new query token, q (batch, heads, head_dim),
which attends over the context_lens[b] tokens the sequence has cached. Each cached K and V element
is needed once per step, whatever the number of query heads that share it (grouped-query
attention: heads / heads_kv query heads per kv head), so the least a step moves is

    unique bytes = sum_b context_lens[b] * heads_kv * head_dim * 2 (K and V) * itemsize
                   + 2 * batch * heads * head_dim * itemsize            (q read, out written)

for 2 FLOPs per cached element and query head it serves (a multiply-add in q.k for a K element, one
in p v for a V element): with 32 query heads over 8 kv heads in bf16, 2 * 4 / 2 = 4 FLOPs per byte,
against the H100's ~300 (990 TFLOP/s over 3.35 TB/s). Decode is memory-bound by a factor of ~70, so
every row is GB/s over the unique bytes and `pct_of_copy` against device-to-device copy measured
in the same run (bench.copy_ceiling). A variant that reads a kv head once per query head
(per_head; repeat_kv, which first writes K and V out again at every query head) is still credited
the unique bytes only: its extra traffic shows as a lower share, which is what the GQA bars are
for. Batch 64 x 4096 tokens x 8 kv heads x 128 in bf16 is 1 GiB of K and V: 0.33 ms at 3.2 TB/s,
so 90% of copy is ~0.37 ms.

Rows (op, then variant):
- paged_attention, field sweep "targets": the lesson's configurations, field config "a" to "h"
  (bf16, head_dim 128, block_size 16, 32 query heads unless said): a batch 64 x context 4096 over
  8 kv heads; b 16 x 32768; c 1 x 131072 (the split-KV case); d 64 x 4096 over 32 kv heads (no
  GQA); e 64 sequences of uniform random length in [1, 8192] (seeded); f = a with block_size 32;
  g = a in fp16; h = a at head_dim 64. Targets (extra["targets"], printed last): a and b >= 90% of
  copy and >= 0.95x sdpa_contiguous, c >= 85%, d >= 90%, e >= 80%, held to `default`.
  Variants: every rung of flash_attention.VERSIONS["paged_attention"] (per_head, per_kv_head,
  split_kv), `default` (version=None), and PyTorch on the same data:
    sdpa_contiguous  F.scaled_dot_product_attention(q (batch, heads, 1, d), k, v (batch, heads_kv,
                     context, d) contiguous, enable_gqa=True) on an unpaged cache: the ideal that
                     paging must approach, and what speedup_vs_torch divides by;
    sdpa_gathered    each sequence's pages gathered from the paged cache into that layout (one
                     index_select by block_tables), then the same SDPA call, timed together;
    repeat_kv        K and V repeated to every query head (repeat_interleave), then SDPA without
                     GQA, timed together: what attention that knows nothing of GQA costs.
  Config e has sequences of different lengths: its SDPA rows run over the padded max-length cache
  with a boolean key-padding mask, which SDPA's flash backend refuses, so they run on another
  backend (efficient or math, SDPA's choice; extra["notes"] says so), and repeat_kv is left out.
- paged_attention, sweep "gqa": batch 64 x 4096, 32 query heads over 32, 16, 8 and 4 kv heads,
  d 128, bf16: per_head, per_kv_head, default, sdpa_contiguous, repeat_kv. Fewer kv heads means
  fewer unique bytes, so each bar is a share of its own copy time.
- paged_attention, sweep "split_kv": 32/8 heads, d 128, bf16, batch 1, 4, 16, 64 x context 1K to
  128K, without the points whose K+V cache passes 8 GiB (batch 64 at 64K and 128K): per_kv_head,
  split_kv, default, sdpa_contiguous. Where splitting starts to pay, and whether default follows.
- paged_attention, sweep "num_splits": configs a, b and e, and a at 4 kv heads (config "group 8"),
  with split_kv at num_splits = SPLIT_COUNTS (rows: variant split_kv, field num_splits), default
  and sdpa_contiguous. default picks its count from what the host knows (batch, heads, the table's
  width); a server also knows every context length on the host, and this sweep shows what a
  count chosen with them would buy, mixed lengths above all (config e: one wave of blocks whose
  lengths differ 8000-fold).
- paged_prefill (pass "forward", causal bottom-right), field config: chunked prefill over the paged
  cache (paged_prefill_attention), bf16, 32/8 heads, d 128, block_size 16: "prefix" 8 sequences,
  each a chunk of 512 new tokens after a cached prefix of 4096 (the suffix after a radix match);
  "mixed" 4 chunks of 512 after 3584 and 60 decode tokens (one each, contexts 4096) in one batch;
  "cold" 8 prompts of 2048, chunk = context (no cache hit: the whole causal triangle). Compute-bound, so
  TFLOP/s over the visible (query, key) pairs, 4 x head_dim FLOPs each per query head, and
  pct_of_mm against a bf16 matmul measured in the same run (bench.matmul_ceiling). Variants: the
  rungs of VERSIONS["paged_prefill_attention"] (decode_rows, mma, persistent), default
  (version=None, its rung in the row's dispatch field), the course's own contiguous forward, and
  PyTorch on the same keys gathered contiguous per sequence, the gather outside the timed region:
    attention_varlen  flash_attention.attention_varlen (version=None: on a Hopper GPU the persistent
                    rung's packed kernel, which rung persistent runs over the table) on every
                    sequence's gathered K/V packed end to end: what reading through the block table
                    costs against the same kernel on contiguous keys (the summary's default /
                    attention_varlen);
    sdpa_flash      one F.scaled_dot_product_attention per sequence (SDPA has no varlen entry
                    point) with the bottom-right causal mask (torch.nn.attention.bias
                    .causal_lower_right, which runs FlashAttention 2's kernel) and enable_gqa, under
                    sdpa_kernel(FLASH_ATTENTION); the baseline of speedup_vs_torch;
    flex_attention  torch.compile(flex_attention) once over the batch, every sequence's gathered
                    K/V packed end to end (a "document" mask: same sequence and key position <=
                    the query's), its BlockMask built once outside the timed region: the
                    varlen-by-mask pattern flex is written for, and PyTorch's fair analogue of a
                    kernel whose grid skips other sequences' tiles. (flex can also read a page
                    table through torch.nn.attention.experimental's PagedAttention, a private API.)
  Each output is checked against a float32 reference of the same keys before it is timed.
- paged_prefill, field sweep "block_size": the "prefix" configuration again at block_size 8, 16, 32,
  64, 128 and 256 (PREFILL_BLOCK_SIZES), variants attention_varlen (on the gathered keys, as above)
  and default; on the CPU the reference alone. What paging costs as a function of the page size:
  the Hopper producer gathers pages under 64 rows with cp.async and copies larger ones as one TMA
  box each (the default row's producer field), and the contiguous kernel does not see pages at all,
  so its row is the same work at every block size. The summary prints default / attention_varlen
  per block size, and the figure beside the prefill one plots it against block_size.
  --prefill-only runs the paged_prefill rows alone (and writes results/<device-slug>/chapter6_paged_prefill.json,
  leaving the full record alone).
- reshape_and_cache: 65536 tokens (a prefill's worth) and 256 (a decode step's), 8 kv heads, d 128,
  bf16, block_size 16, every 97th slot -1 (padding); bytes = K and V of the real tokens read and
  written, plus the slots. Baseline torch (eager PyTorch): the real tokens picked out (index_select)
  and index_copy_'d into the cache viewed as (slots, heads_kv, head_dim), K and V.
- copy_blocks: 2048 (src, dst) pairs of distinct blocks of a 16384-block cache; bytes = 2 caches x
  pairs x block bytes x 2 (read + write), plus the mapping. Baseline torch: kc[dst] = kc[src]
  for both caches.
- match_prefix: 4096 requests x 2048 tokens against a RadixCache of ~100k nodes (block_size 16),
  built by inserting 2048-token sequences that branch from random earlier ones (each branching
  insert adds a leaf, and splits an edge when it branches inside one: ~2 nodes), a third of the
  requests inserted sequences (full matches), a third a prefix of one then fresh tokens (partial),
  a third fresh tokens (no match). Variants: default (the op on the GPU; inputs and the tree's mirror
  already there: the lookup alone; the mirror's one-time upload is the row's mirror_upload_ms) and
  cpu (the C++ reference on the CPU, wall clock; it validates the tree on every call). Requests per
  second; the CUDA result must equal the CPU result (matches_cpu), and the CPU result the Python
  tree walk (matches_reference). This chapter's target: CUDA faster than the CPU reference.

Correctness guard: before a paged_attention variant is timed, its output is compared with
sdpa_contiguous's (and every output with a float32 reference computed from the same cache):
|out - ref| <= atol + rtol |ref|, atol = rtol = 2e-2 in bf16, 1e-2 in fp16. The rows carry
max_abs_err (against sdpa_contiguous) and max_abs_err_fp32; a mismatch raises, so a wrong kernel
is never timed. q is drawn with std 3 (scores of std ~3), so that each output is dominated by a
few tokens: with near-uniform weights over thousands of random keys every output is ~0 and a
kernel that reads the wrong block would still pass. The cache ops are checked exactly (bytes) on
slots and blocks filled with NaN first. The block tables are random permutations of the pool:
no sequence's pages are contiguous or in order.

The course's ops are timed as a server calls them: paged_attention with check_tables=False,
reshape_and_cache with check_slots=False and copy_blocks with check_mapping=False
(csrc/serving/serving_ops.cpp: a checked call reads the tables, slots or mapping back, a device sync
per call, which a CUDA graph cannot capture; the guard's one call per variant is checked).

Timing: as bench_attention.py, CUDA graphs (bench.time_probed) of as many calls as make a
replay last >= 2 ms (1 to 8), CUDA events around each replay, median of 20 replays; one input set,
since every paged configuration moves >= 256 MiB (the H100's L2 is 50 MB); the 256-token
reshape_and_cache (1 MiB of K and V) rotates bench.rotation_sets(...) = ~100 input sets instead.
A call slower than 100 ms is skipped with a note rather than timed.

Run time on an H100: 8 target configurations (6-7 variants each), 4 GQA points (4-5) and 18
split-KV points (4): ~145 paged_attention rows. A row is ~30 calls (guard, 2 probe, 1 warm-up, a
first replay, 20 replays of 1-8 calls) of 0.1-9 ms: ~10 s of kernels in all, but ~0.15 s of Python,
capture and syncs around each: ~25 s; building each configuration's caches (randn and the paged
scatter, at most 16 GiB, at batch 16 x 128K) and its float32 witness adds ~10 s. The cache ops
(~100 input sets for the small write) take ~3 s. The ~100k-node tree is built in Python: 64k
inserts of ~2048 tokens, each walking its ~120 shared blocks (~250 us), measured at 16 s on a
2-core EPYC dev box, then flattened (1.5 s); the Python walk that checks the CPU op takes 0.7 s and
the CPU reference's 22 timed lookups ~0.8 s (35 ms each). Copy ceiling and warm-up ~2 s: about
70 s in all, under the 150 s budget; wall_s records it. The paged_prefill block-size sweep adds 12
rows of ~1 ms calls over six caches of 8 x 4608 tokens (144 MiB of K and V each): ~5 s by the rate
above, with its caches and witnesses. The --quick CPU run takes ~4 s.

Rows of paged_attention have shape [batch, heads, heads_kv, context, head_dim], context the
longest sequence's (config e: field context_range is the draw's [1, 8192], context_tokens the
sum); reshape_and_cache [tokens, heads_kv, head_dim]; copy_blocks [pairs, block_size, heads_kv,
head_dim]; match_prefix [requests, tokens].

    python bench_paged.py           full run on a GPU
    python bench_paged.py --quick   small sizes: CPU machines (the CPU reference, variant "cpu",
                                    float32, against SDPA on the CPU), GPU smoke runs
    python bench_paged.py --prefill-only   the paged_prefill rows alone (with --quick: small sizes)

Writes results/<device-slug>/chapter6_paged_attention.json and the plots beside it.
"""
import itertools
import math
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from coursekit import bench, plots, results  # noqa: E402

import flash_attention  # noqa: E402

CHAPTER = "chapter6_paged_attention"
PREFILL_CHAPTER = "chapter6_paged_prefill"  # --prefill-only's record
BASELINE = "sdpa_contiguous"  # what speedup_vs_torch divides by: SDPA on an unpaged cache
RUNGS = tuple(flash_attention.VERSIONS["paged_attention"])
TORCH_DECODE = ("sdpa_contiguous", "sdpa_gathered", "repeat_kv")
PREFILL_RUNGS = tuple(flash_attention.VERSIONS["paged_prefill_attention"])
PREFILL_BASELINE = "sdpa_flash"  # paged_prefill's speedup_vs_torch divides by it
TORCH_PREFILL = ("sdpa_flash", "flex_attention")
CONTIGUOUS_PREFILL = "attention_varlen"  # the course's forward on the gathered keys (see the top)
PREFILL_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)  # the "prefix" row's page-size sweep (see the top)
PREFILL_CONTIGUOUS_TARGET = 0.9  # the prefix row's target: default within 10% of attention_varlen's speed
MAX_CALL_MS = 100.0   # a call slower than this is skipped, not timed
Q_STD = 3.0           # scores of std ~3: outputs dominated by a few tokens (see the docstring)
PAD_EVERY = 97        # reshape_and_cache: every 97th token is padding (slot -1)
SHORT_TAIL = 8        # match_prefix's tree: most inserts branch within the last 8 blocks ...
LONG_TAILS = 0.1      # ... and this share anywhere along the sequence
# |out - ref| <= atol + rtol * |ref| per dtype: two correct decodes differ by the rounding of
# out (half an ulp: 2^-9 relative in bf16) and of the probabilities SDPA keeps in 16 bits.
TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (1e-2, 1e-2),
             torch.float32: (1e-4, 1e-4), torch.float64: (1e-9, 1e-9)}
# This chapter's targets, held to `default` (to `cpu` on a CPU run, where they are only a record).
TARGETS = {"a": {"pct_of_copy": 90, "speedup": 0.95}, "b": {"pct_of_copy": 90, "speedup": 0.95},
           "c": {"pct_of_copy": 85}, "d": {"pct_of_copy": 90}, "e": {"pct_of_copy": 80}}
SPLIT_COUNTS = (1, 2, 3, 4, 6, 8, 16)  # the num_splits sweep: split_kv with the count named
MATCH_TARGET = 1.0    # match_prefix: default (the op on the GPU) at least this many times faster than the CPU reference


# ---------------------------------------------------------------------------------------------
# Napkin math and the grid: pure functions (test_bench_paged.py holds them)
# ---------------------------------------------------------------------------------------------
def decode_bytes(context_lens, heads, heads_kv, head_dim, itemsize):
    """Bytes a decode step cannot avoid: each sequence's cached K and V read once (not once per
    query head), plus q read and out written."""
    return (sum(context_lens) * heads_kv * 2 + len(context_lens) * heads * 2) * head_dim * itemsize


def kv_cache_bytes(batch, context, heads_kv, head_dim, itemsize):
    """K and V of batch sequences of `context` tokens."""
    return batch * context * heads_kv * head_dim * 2 * itemsize


def itemsize(dtype_name):
    return torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


def within_cap(c, cap_GiB):
    """A configuration whose K+V cache is at most cap_GiB (the baselines hold it twice more)."""
    size = kv_cache_bytes(c["batch"], c["context"], c["heads_kv"], c["head_dim"], itemsize(c["dtype"]))
    return size <= cap_GiB * 2**30


def decode_config(batch, context, heads, heads_kv, head_dim=128, block_size=16, dtype="bfloat16",
                  mixed=False, sweep="targets", config=None):
    """One paged_attention measurement. mixed: context_lens uniform in [1, context], else all
    `context`."""
    c = {"sweep": sweep, "batch": batch, "context": context, "heads": heads, "heads_kv": heads_kv,
         "head_dim": head_dim, "block_size": block_size, "dtype": dtype, "mixed": mixed}
    return {**c, "config": config} if config else c


def target_configs(base, mixed_context, big):
    """a to h from the first configuration `base` (batch, context, heads, heads_kv), the long ones
    `big` ({"b": (batch, context), "c": ...}) and the mixed lengths' upper bound."""
    b, n, h, hkv = base
    return [decode_config(b, n, h, hkv, config="a"),
            decode_config(*big["b"], h, hkv, config="b"),
            decode_config(*big["c"], h, hkv, config="c"),
            decode_config(b, n, h, h, config="d"),
            decode_config(b, mixed_context, h, hkv, mixed=True, config="e"),
            decode_config(b, n, h, hkv, block_size=32, config="f"),
            decode_config(b, n, h, hkv, dtype="float16", config="g"),
            decode_config(b, n, h, hkv, head_dim=64, config="h")]


def sizes_for(device, quick):
    """Every measurement of the run. The GPU's is the lesson's; --quick on a GPU is a smoke run at
    small sizes; the CPU runs the float32 reference at sizes it does in seconds (its split-KV cap
    is 8 MiB, so that the cap leaves points out there too)."""
    if device == "cuda" and not quick:
        cap = 8.0
        split = [decode_config(b, n, 32, 8, sweep="split_kv") for b in (1, 4, 16, 64)
                 for n in (1024, 4096, 16384, 65536, 131072)]
        return {"dtype": "bfloat16", "kv_cap_GiB": cap,
                "targets": target_configs((64, 4096, 32, 8), 8192, {"b": (16, 32768), "c": (1, 131072)}),
                "gqa": [decode_config(64, 4096, 32, hkv, sweep="gqa") for hkv in (32, 16, 8, 4)],
                "split": [c for c in split if within_cap(c, cap)],
                "num_splits": [decode_config(64, 4096, 32, 8, sweep="num_splits", config="a"),
                               decode_config(16, 32768, 32, 8, sweep="num_splits", config="b"),
                               decode_config(64, 8192, 32, 8, mixed=True, sweep="num_splits", config="e"),
                               decode_config(64, 4096, 32, 4, sweep="num_splits", config="group 8")],
                "cache_ops": {"tokens": [65536, 256], "num_blocks": 16384, "pairs": 2048, "heads_kv": 8,
                              "head_dim": 128, "block_size": 16, "dtype": "bfloat16"},
                "match": {"requests": 4096, "tokens": 2048, "nodes": 100_000, "roots": 64,
                          "block_size": 16, "vocab": 32000},
                # prefix: the chapter's target, 8 sequences x (4096 cached + a chunk of 512)
                "prefill": prefill_configs(512, 4096, 2048, prefix=(8, 4096)),
                "prefill_block_size": block_size_sweep(prefill_configs(512, 4096, 2048, prefix=(8, 4096))[0])}
    if device == "cuda":
        cap = 0.25
        split = [decode_config(b, n, 32, 8, sweep="split_kv") for b in (1, 8) for n in (1024, 16384, 65536)]
        return {"dtype": "bfloat16", "kv_cap_GiB": cap,
                "targets": target_configs((8, 1024, 32, 8), 2048, {"b": (2, 8192), "c": (1, 16384)}),
                "gqa": [decode_config(8, 1024, 32, hkv, sweep="gqa") for hkv in (32, 16, 8, 4)],
                "split": [c for c in split if within_cap(c, cap)],
                "num_splits": [decode_config(8, 1024, 32, 8, sweep="num_splits", config="a"),
                               decode_config(8, 2048, 32, 8, mixed=True, sweep="num_splits", config="e")],
                "cache_ops": {"tokens": [4096, 256], "num_blocks": 2048, "pairs": 256, "heads_kv": 8,
                              "head_dim": 128, "block_size": 16, "dtype": "bfloat16"},
                "match": {"requests": 512, "tokens": 512, "nodes": 5000, "roots": 16,
                          "block_size": 16, "vocab": 32000},
                "prefill": prefill_configs(129, 1000, 300, batch=4, decodes=12),
                "prefill_block_size": block_size_sweep(prefill_configs(129, 1000, 300, batch=4, decodes=12)[0])}
    cap = 8 / 1024
    targets = [dict(c, dtype="float32") for c in
               target_configs((4, 256, 8, 2), 512, {"b": (2, 1024), "c": (1, 2048)})]
    split = [decode_config(b, n, 8, 2, dtype="float32", sweep="split_kv") for b in (1, 4) for n in (256, 1024, 4096)]
    return {"dtype": "float32", "kv_cap_GiB": cap,
            # g is config a in fp16: the CPU reference computes in float32 and float64 only.
            "targets": [c for c in targets if c["config"] != "g"],
            "gqa": [decode_config(4, 256, 8, hkv, dtype="float32", sweep="gqa") for hkv in (8, 4, 2, 1)],
            "split": [c for c in split if within_cap(c, cap)],
            "num_splits": [],  # the CPU reference does not split
            "cache_ops": {"tokens": [512, 16], "num_blocks": 256, "pairs": 32, "heads_kv": 2, "head_dim": 64,
                          "block_size": 16, "dtype": "float32"},
            "match": {"requests": 64, "tokens": 256, "nodes": 2000, "roots": 8, "block_size": 16, "vocab": 32000},
            "prefill": prefill_configs(17, 100, 33, batch=4, decodes=6, heads=8, heads_kv=2, head_dim=64,
                                       dtype="float32"),
            # the reference's rows at three page sizes: a smaller page, the cache's, one past the context
            "prefill_block_size": block_size_sweep(
                prefill_configs(17, 100, 33, batch=4, decodes=6, heads=8, heads_kv=2, head_dim=64,
                                dtype="float32")[0], block_sizes=(8, 16, 128))}


def prefill_config(config, chunks, contexts, heads=32, heads_kv=8, head_dim=128, block_size=16, dtype="bfloat16"):
    """One paged_prefill measurement: sequence b has chunks[b] new tokens, the last of its
    contexts[b] cached ones."""
    return {"config": config, "chunks": list(chunks), "contexts": list(contexts), "heads": heads,
            "heads_kv": heads_kv, "head_dim": head_dim, "block_size": block_size, "dtype": dtype}


def prefill_configs(chunk, context, cold, batch=16, decodes=60, prefix=None, **kw):
    """prefix: `batch` chunks of `chunk` at `context`, or prefix = (sequences, cached tokens): that
    many chunks of `chunk` after that many cached tokens; mixed: batch / 4 chunks of `chunk` at
    `context` and `decodes` decode tokens at `context`; cold: batch / 2 prompts of `cold` tokens,
    nothing cached."""
    n, ctx = (batch, context) if prefix is None else (prefix[0], prefix[1] + chunk)
    return [prefill_config("prefix", [chunk] * n, [ctx] * n, **kw),
            prefill_config("mixed", [chunk] * (batch // 4) + [1] * decodes, [context] * (batch // 4 + decodes), **kw),
            prefill_config("cold", [cold] * (batch // 2), [cold] * (batch // 2), **kw)]


def block_size_sweep(c, block_sizes=None):
    """Configuration c (the "prefix" one) at each block size, PREFILL_BLOCK_SIZES unless given: its
    rows carry sweep "block_size"."""
    return [dict(c, block_size=bs, sweep="block_size") for bs in block_sizes or PREFILL_BLOCK_SIZES]


def prefill_flops(chunks, contexts, heads, head_dim):
    """FLOPs over the (query, key) pairs the bottom-right causal mask leaves visible: row i of a
    chunk of q over a context of n sees n - q + i + 1 keys, so a chunk sees q (n - q) + q (q + 1) / 2
    pairs; each costs a multiply-add in q.k and one in p v per element of head_dim, per query head."""
    pairs = sum(q * (n - q) + q * (q + 1) // 2 for q, n in zip(chunks, contexts))
    return 4 * heads * head_dim * pairs


def prefill_variants(device, sweep=None):
    """PyTorch's two first (sdpa_flash the reference of speedup_vs_torch), the course's contiguous
    attention_varlen, then the ladder and default; the block-size sweep attention_varlen and default
    alone (the other rungs take pages of 16 and 32 rows only); on the CPU the course's reference
    alone, one row "cpu"."""
    if device != "cuda":
        return ("cpu",)
    if sweep == "block_size":
        return (CONTIGUOUS_PREFILL, "default")
    return TORCH_PREFILL + (CONTIGUOUS_PREFILL,) + PREFILL_RUNGS + ("default",)


def variants_of(c, device):
    """The variants one configuration is measured with, sdpa_contiguous first (the reference of
    the guard and of speedup_vs_torch). On the CPU the course's op is the reference, one row "cpu"."""
    ours = {"targets": RUNGS + ("default",), "gqa": ("per_head", "per_kv_head", "default"),
            "split_kv": ("per_kv_head", "split_kv", "default"),
            "num_splits": ("default",) + tuple(f"split_kv:{n}" for n in SPLIT_COUNTS)}[c["sweep"]]
    torch_ = {"targets": TORCH_DECODE, "gqa": ("sdpa_contiguous", "repeat_kv"),
              "split_kv": ("sdpa_contiguous",), "num_splits": ("sdpa_contiguous",)}[c["sweep"]]
    if c["heads"] == c["heads_kv"] or c["mixed"]:
        torch_ = tuple(v for v in torch_ if v != "repeat_kv")
    return torch_ + (ours if device == "cuda" else ("cpu",))


def context_lens_for(c, seed=0):
    """Every sequence's context length: `context` each, or uniform in [1, context] (seeded)."""
    if not c["mixed"]:
        return [c["context"]] * c["batch"]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, c["context"] + 1, (c["batch"],), generator=g).tolist()


def block_tables_for(context_lens, block_size, seed=0):
    """(block_tables int32 (batch, max_blocks), pool size): sequence b owns ceil(len_b /
    block_size) blocks of a pool of exactly their sum, dealt from a random permutation, so no
    sequence's pages are contiguous or in order. Unused entries (shorter sequences) are 0."""
    blocks = [-(-n // block_size) for n in context_lens]
    total, width = sum(blocks), max(blocks + [1])
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    tables = torch.zeros(len(blocks), width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = perm[at:at + n]
        at += n
    return tables, total


def free(device):
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Decode: the paged cache, its unpaged twin, and every variant over them
# ---------------------------------------------------------------------------------------------
def reference_decode(q, k, v, context_lens, scale=None):
    """float32 softmax(scale q k^T) v for every sequence over its first context_lens[b] tokens:
    q (batch, heads, d), k and v (batch, heads_kv, n, d), query head h reading kv head
    h // (heads // heads_kv). One sequence at a time, so the float32 copies stay small."""
    batch, heads, d = q.shape
    heads_kv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty(batch, heads, d, dtype=torch.float32, device=q.device)
    for b, n in enumerate(context_lens):
        qb = q[b].float().view(heads_kv, heads // heads_kv, d)
        kb, vb = k[b, :, :n].float(), v[b, :, :n].float()
        p = torch.softmax(qb @ kb.transpose(-1, -2) * scale, dim=-1)  # (heads_kv, group, n)
        out[b] = (p @ vb).reshape(heads, d)
    return out


def check_close(out, ref, dtype, what):
    """max |out - ref|, or an AssertionError when any element is outside atol + rtol |ref| (NaN
    included): a wrong kernel stops the run instead of being timed."""
    atol, rtol = TOLERANCE[dtype]
    out, ref = out.float(), ref.float()
    diff = (out - ref).abs()
    bad = ~(diff <= atol + rtol * ref.abs())
    if bool(bad.any()):
        at = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} outputs outside {atol:g} + {rtol:g} |ref|; "
                             f"first at {at}: {out[at].item()!r} against {ref[at].item()!r}. A wrong result is "
                             "not timed.")
    return diff.max().item() if diff.numel() else 0.0


def make_case(c, device, seed=0):
    """The inputs of one configuration: q; the paged cache (key_cache, value_cache,
    block_tables, context_lens) and the same K and V unpaged, (batch, heads_kv, n, d) contiguous,
    for SDPA, n the context (all equal) or the padded width with a key-padding mask (mixed)."""
    dtype = getattr(torch, c["dtype"])
    b, h, hkv, d, bs = c["batch"], c["heads"], c["heads_kv"], c["head_dim"], c["block_size"]
    lens = context_lens_for(c, seed)
    tables, pool = block_tables_for(lens, bs, seed)
    width = tables.shape[1]
    n_pad = width * bs
    n = n_pad if c["mixed"] else max(lens)
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, h, d, generator=g, device=device, dtype=dtype) * Q_STD
    case = {"q": q, "lens": lens, "n": n, "width": width, "pool": pool}
    used = torch.arange(width)[None, :] < torch.tensor([-(-x // bs) for x in lens])[:, None]
    ids = tables[used].to(device=device, dtype=torch.int64)
    used = used.to(device)
    for name in ("k", "v"):
        dense = torch.randn(b, hkv, n, d, generator=g, device=device, dtype=dtype)
        padded = dense if n == n_pad else F.pad(dense, (0, 0, 0, n_pad - n))
        pages = padded.view(b, hkv, width, bs, d).permute(0, 2, 3, 1, 4)  # (b, width, bs, hkv, d)
        cache = torch.empty(pool, bs, hkv, d, device=device, dtype=dtype)
        cache[ids] = pages[used]
        case[name], case[name + "_cache"] = dense, cache
        del padded, pages
    case["block_tables"] = tables.to(device)
    case["table_ids"] = tables.flatten().to(device=device, dtype=torch.int64)
    case["context_lens"] = torch.tensor(lens, dtype=torch.int32, device=device)
    case["mask"] = (torch.arange(n, device=device)[None, :] < case["context_lens"][:, None])[:, None, None, :] \
        if c["mixed"] else None
    return case


def decode_calls(c, case, device):
    """[(variant, fn, check)]: fn the timed call, check the guard's call (the same, or the
    course's op with its tables checked). Outputs are (batch, heads, d) or SDPA's (batch, heads,
    1, d)."""
    b, h, hkv, d, bs = c["batch"], c["heads"], c["heads_kv"], c["head_dim"], c["block_size"]
    q, mask, gqa = case["q"], case["mask"], h != hkv
    q4 = q.unsqueeze(2)
    kc, vc, tables, lens = case["k_cache"], case["v_cache"], case["block_tables"], case["context_lens"]

    def sdpa(k, v, group=gqa):
        return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, enable_gqa=group)

    def gathered():
        # (batch * width, bs, hkv, d) -> (batch, width * bs, hkv, d) is a view; its transpose is
        # SDPA's (batch, hkv, n, d) with the (b, s, h, d) strides its flash backend reads as is.
        # Cut to the unpaged cache's n (the tables cover whole blocks).
        n = case["width"] * bs
        k = kc.index_select(0, case["table_ids"]).view(b, n, hkv, d).transpose(1, 2)[:, :, :case["n"]]
        v = vc.index_select(0, case["table_ids"]).view(b, n, hkv, d).transpose(1, 2)[:, :, :case["n"]]
        return sdpa(k, v)

    def repeated():
        g = h // hkv
        return sdpa(case["k"].repeat_interleave(g, dim=1), case["v"].repeat_interleave(g, dim=1), False)

    def ours(version, check, num_splits=0):
        return lambda: flash_attention.paged_attention(q, kc, vc, tables, lens, version=version, check_tables=check,
                                                       num_splits=num_splits)

    out = []
    for variant in variants_of(c, device):
        if variant == "sdpa_contiguous":
            fn = (lambda: sdpa(case["k"], case["v"]))
        elif variant == "sdpa_gathered":
            fn = gathered
        elif variant == "repeat_kv":
            fn = repeated
        elif ":" in variant:  # split_kv:n, the num_splits sweep
            n = int(variant.partition(":")[2])
            out.append((variant, ours("split_kv", False, n), ours("split_kv", True, n)))
            continue
        else:
            version = None if variant in ("default", "cpu") else variant
            out.append((variant, ours(version, False), ours(version, True)))
            continue
        out.append((variant, fn, fn))
    return out


def config_fields(c, case):
    fields = {k: c[k] for k in ("sweep", "batch", "heads", "heads_kv", "head_dim", "block_size", "mixed")}
    fields.update({"context": max(case["lens"]), "context_tokens": sum(case["lens"])})
    if c["mixed"]:
        fields["context_range"] = [1, c["context"]]
    if c.get("config"):
        fields["config"] = c["config"]
    return fields


def where_of(c):
    what = f"{c['sweep']} {c.get('config', '')} b={c['batch']} n={'<=' if c['mixed'] else ''}{c['context']}"
    return f"{what} {c['heads']}/{c['heads_kv']} d={c['head_dim']} bs={c['block_size']} {c['dtype']}".replace("  ", " ")


def check_then_time(notes, variant, where, device, fn, check, ref32, ref, baseline, dtype):
    """One variant of a row: run `check` and compare its output with the float32 witness always and
    with the baseline's output where the baseline ran (`ref`; both comparisons raise on a
    mismatch), then time `fn`. Returns (the baseline's output, which this call is when `variant` is
    the baseline; err32; err; the timing, None where the call was too slow to time), or None where
    the call refused. The output is dropped before the timing, so that it does not sit in memory
    beside the timed calls."""
    got = bench.attempt(notes, variant, where, check)
    if got is None:
        return None
    got = got.reshape(ref32.shape)
    if variant == baseline:
        ref = got
    err32 = check_close(got, ref32, dtype, f"{where} {variant} vs float32 reference")
    err = check_close(got, ref, dtype, f"{where} {variant} vs {baseline}") if ref is not None else None
    del got
    t = bench.probe_and_time(notes, variant, where, device, fn, max_call_ms=MAX_CALL_MS)
    return ref, err32, err, t


def decode_rows(device, c, ceilings, notes):
    """The rows of one configuration. Its own frame: the caches, and the closures over them that
    the loop leaves bound, go when it returns, before the next configuration is built."""
    dtype = getattr(torch, c["dtype"])
    where = where_of(c)
    case = make_case(c, device)
    ref32 = reference_decode(case["q"], case["k"], case["v"], case["lens"])
    nbytes = decode_bytes(case["lens"], c["heads"], c["heads_kv"], c["head_dim"], case["q"].element_size())
    shape = [c["batch"], c["heads"], c["heads_kv"], max(case["lens"]), c["head_dim"]]
    fields = config_fields(c, case)
    rows, ref, t_base = [], None, None
    for variant, fn, check in decode_calls(c, case, device):
        checked = check_then_time(notes, variant, where, device, fn, check, ref32, ref, BASELINE, dtype)
        if checked is None:
            continue
        ref, err32, err, t = checked
        if t is None:
            continue
        if variant == BASELINE:
            t_base = t["median_ms"]
        name, _, n = variant.partition(":")  # split_kv:n is variant split_kv with num_splits n
        rows.append(bench.bandwidth_row(
            "paged_attention", name, dtype, shape, nbytes, t, ceilings["copy_GBps"], t_base, **fields,
            **({"num_splits": int(n)} if n else {}),
            max_abs_err=err, max_abs_err_fp32=err32,
            checked_against=BASELINE if ref is not None else "float32 reference"))
    return rows


def bench_decode(device, configs, ceilings, notes):
    rows = []
    for c in configs:
        rows += decode_rows(device, c, ceilings, notes)
        free(device)
    return rows


# ---------------------------------------------------------------------------------------------
# Chunked prefill: the paged cache, each sequence's keys gathered, and every variant over them
# ---------------------------------------------------------------------------------------------
_flex = {}


def compiled_flex():
    """torch.compile(flex_attention), compiled once per process (and per shape, by torch)."""
    if "fn" not in _flex:
        from torch.nn.attention.flex_attention import flex_attention
        _flex["fn"] = torch.compile(flex_attention, dynamic=False)
    return _flex["fn"]


def make_prefill_case(c, device, seed=0):
    """q (total_q, heads, d), packed; the paged cache, its tables, cu_seqlens_q and context_lens;
    and each sequence's K and V gathered back from the cache, (context, heads_kv, d)."""
    dtype = getattr(torch, c["dtype"])
    h, hkv, d, bs = c["heads"], c["heads_kv"], c["head_dim"], c["block_size"]
    chunks, lens = c["chunks"], c["contexts"]
    tables, pool = block_tables_for(lens, bs, seed)
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(sum(chunks), h, d, generator=g, device=device, dtype=dtype) * Q_STD
    case = {"q": q, "block_tables": tables.to(device)}
    for name in ("k", "v"):
        cache = torch.zeros(pool, bs, hkv, d, device=device, dtype=dtype)
        for b, n in enumerate(lens):
            blocks = -(-n // bs)
            pages = torch.randn(blocks * bs, hkv, d, generator=g, device=device, dtype=dtype)
            cache[tables[b, :blocks].to(device=device, dtype=torch.int64)] = pages.view(blocks, bs, hkv, d)
        case[name + "_cache"] = cache
        # What a PyTorch kernel without a page table needs: each sequence's pages gathered in order.
        case[name] = [cache[tables[b, :-(-n // bs)].to(device=device, dtype=torch.int64)].flatten(0, 1)[:n]
                      for b, n in enumerate(lens)]
    offsets = [0]
    for n in chunks:
        offsets.append(offsets[-1] + n)
    case["offsets"] = offsets
    case["cu_seqlens_q"] = torch.tensor(offsets, dtype=torch.int32, device=device)
    case["context_lens"] = torch.tensor(lens, dtype=torch.int32, device=device)
    return case


def reference_prefill(c, case):
    """float32 softmax(scale q k^T + bottom-right causal mask) v, one sequence at a time."""
    q, h, hkv = case["q"], c["heads"], c["heads_kv"]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(c["head_dim"])
    for b, (n_q, n) in enumerate(zip(c["chunks"], c["contexts"])):
        if n_q == 0:
            continue
        lo = case["offsets"][b]
        qb = q[lo:lo + n_q].float().transpose(0, 1)                               # (h, n_q, d)
        kb = case["k"][b].float().transpose(0, 1).repeat_interleave(h // hkv, 0)  # (h, n, d)
        vb = case["v"][b].float().transpose(0, 1).repeat_interleave(h // hkv, 0)
        s = qb @ kb.transpose(-1, -2) * scale
        visible = torch.arange(n, device=q.device)[None] <= torch.arange(n_q, device=q.device)[:, None] + n - n_q
        out[lo:lo + n_q] = (torch.softmax(s.masked_fill(~visible, -math.inf), -1) @ vb).transpose(0, 1)
    return out


def prefill_calls(c, case, device):
    """[(variant, fn, check)] as decode_calls: outputs (total_q, heads, d)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    q, kc, vc = case["q"], case["k_cache"], case["v_cache"]
    tables, cu, lens = case["block_tables"], case["cu_seqlens_q"], case["context_lens"]
    chunks, contexts, offsets = c["chunks"], c["contexts"], case["offsets"]
    gqa = c["heads"] != c["heads_kv"]
    # SDPA's layouts, built outside the timed region: (1, heads, n_q, d) views of q, and
    # (1, heads_kv, n, d) of each gathered K and V.
    per_seq = [(b, q[offsets[b]:offsets[b + 1]].transpose(0, 1)[None], case["k"][b].transpose(0, 1)[None],
                case["v"][b].transpose(0, 1)[None]) for b in range(len(chunks)) if chunks[b] > 0]

    def sdpa_flash():
        out = torch.empty_like(q)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for b, qb, kb, vb in per_seq:
                o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=causal_lower_right(qb.shape[2], kb.shape[2]),
                                                   enable_gqa=gqa)
                out[offsets[b]:offsets[b + 1]] = o[0].transpose(0, 1)
        return out

    def sdpa_flash_setup():
        """sdpa_flash itself where the bottom-right mask's flash path takes GQA; else K and V
        repeated to every query head first, outside the timed region (the row says so)."""
        nonlocal per_seq, gqa
        try:
            sdpa_flash()
        except RuntimeError:
            if not gqa:
                raise
            group = c["heads"] // c["heads_kv"]
            per_seq = [(b, qb, kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1))
                       for b, qb, kb, vb in per_seq]
            gqa = False
            case["kv_repeated"] = True
        return sdpa_flash

    def flex_setup():
        from torch.nn.attention.flex_attention import create_block_mask
        doc_q = torch.repeat_interleave(torch.arange(len(chunks), device=device),
                                        torch.tensor(chunks, device=device))
        # a query's position in its sequence: the chunk is the last of the context
        pos_q = torch.cat([torch.arange(n - n_q, n, device=device) for n_q, n in zip(chunks, contexts)])
        doc_k = torch.repeat_interleave(torch.arange(len(contexts), device=device),
                                        torch.tensor(contexts, device=device))
        pos_k = torch.cat([torch.arange(n, device=device) for n in contexts])

        def mask_mod(b, h, qi, kj):
            return (doc_q[qi] == doc_k[kj]) & (pos_k[kj] <= pos_q[qi])

        mask = create_block_mask(mask_mod, None, None, q.shape[0], int(doc_k.shape[0]), device=device)
        qf = q.transpose(0, 1)[None].contiguous()
        kf = torch.cat(case["k"]).transpose(0, 1)[None].contiguous()
        vf = torch.cat(case["v"]).transpose(0, 1)[None].contiguous()
        fn = compiled_flex()
        return lambda: fn(qf, kf, vf, block_mask=mask, enable_gqa=gqa)[0].transpose(0, 1)

    def varlen_setup():
        """attention_varlen over every sequence's gathered K/V packed end to end (the gather and
        the offsets built here, outside the timed region)."""
        kf, vf = torch.cat(case["k"]).contiguous(), torch.cat(case["v"]).contiguous()
        cu_k = torch.tensor([0, *itertools.accumulate(contexts)], dtype=torch.int32, device=device)
        return lambda: flash_attention.attention_varlen(q, kf, vf, cu, cu_k, max(chunks), max(contexts), causal=True)

    def ours(version, check):
        return lambda: flash_attention.paged_prefill_attention(q, kc, vc, tables, cu, lens, version=version,
                                                               max_seqlen_q=max(chunks), check_tables=check)

    out = []
    for variant in prefill_variants(device, c.get("sweep")):
        if variant == "sdpa_flash":
            out.append((variant, None, sdpa_flash_setup))  # the setup returns the timed call
        elif variant == "flex_attention":
            out.append((variant, None, flex_setup))  # the setup returns the timed call
        elif variant == CONTIGUOUS_PREFILL:
            out.append((variant, None, varlen_setup))  # the setup returns the timed call
        else:
            version = None if variant in ("default", "cpu") else variant
            out.append((variant, ours(version, False), ours(version, True)))
    return out


def prefill_rows(device, c, ceilings, notes):
    dtype = getattr(torch, c["dtype"])
    chunks, contexts = c["chunks"], c["contexts"]
    where = (f"paged_prefill {c['config']} {c['heads']}/{c['heads_kv']} d={c['head_dim']} {c['dtype']}"
             + (f" bs={c['block_size']}" if c.get("sweep") else ""))
    case = make_prefill_case(c, device)
    ref32 = reference_prefill(c, case)
    flops = prefill_flops(chunks, contexts, c["heads"], c["head_dim"])
    shape = [len(chunks), c["heads"], c["heads_kv"], sum(chunks), max(contexts), c["head_dim"]]
    fields = {"pass": "forward", "causal": True, "config": c["config"], "batch": len(chunks),
              "heads": c["heads"], "heads_kv": c["heads_kv"], "head_dim": c["head_dim"],
              "block_size": c["block_size"], "total_q": sum(chunks), "max_seqlen_q": max(chunks),
              "context": max(contexts), "context_tokens": sum(contexts),
              "prefill_chunks": sum(1 for n in chunks if n > 1), "decode_tokens": sum(1 for n in chunks if n == 1),
              **({"sweep": c["sweep"]} if c.get("sweep") else {})}
    rows, ref, t_base = [], None, None
    for variant, fn, check in prefill_calls(c, case, device):
        if fn is None:  # the setup (flex's block mask, sdpa_flash's GQA probe, the gather) returns the call
            fn = bench.attempt(notes, variant, where, check)
            if fn is None:
                continue
            check = fn
        checked = check_then_time(notes, variant, where, device, fn, check, ref32, ref, PREFILL_BASELINE, dtype)
        if checked is None:
            continue
        ref, err32, err, t = checked
        if t is None:
            continue
        if variant == PREFILL_BASELINE:
            t_base = t["median_ms"]
        extra = {"kv_repeated": True} if variant == "sdpa_flash" and case.get("kv_repeated") else {}
        if variant == "default":
            extra["dispatch"] = flash_attention.default_choice("paged_prefill_attention", case["q"],
                                                               max_seqlen_q=max(chunks), block_size=c["block_size"])
            if extra["dispatch"] == "persistent":  # how its producer loads the pages: cp.async or TMA boxes
                extra["producer"] = torch.ops.flash_attention.paged_prefill_hopper_producer(c["head_dim"],
                                                                                           c["block_size"])
        rows.append(bench.flops_row("paged_prefill", variant, dtype, shape, flops, t, ceilings["mm_TFLOPs"], t_base,
                                    **fields, **extra, max_abs_err=err, max_abs_err_fp32=err32,
                                    checked_against=PREFILL_BASELINE if ref is not None else "float32 reference"))
    return rows


def bench_prefill(device, configs, ceilings, notes):
    rows = []
    for c in configs:
        rows += prefill_rows(device, c, ceilings, notes)
        free(device)
    return rows


# ---------------------------------------------------------------------------------------------
# Cache writes and copies
# ---------------------------------------------------------------------------------------------
def slot_mapping_for(tokens, num_slots, generator):
    """Distinct random slots, every PAD_EVERY-th token padding (-1)."""
    slots = torch.randperm(num_slots, generator=generator)[:tokens]
    slots[::PAD_EVERY] = -1
    return slots


def cache_op_bytes(tokens, padding, row_bytes):
    """reshape_and_cache: the real tokens' K and V read and written (padding moves nothing),
    and the int64 slots read."""
    return (tokens - padding) * row_bytes * 2 * 2 + tokens * 8


def copy_blocks_bytes(pairs, block_bytes):
    """copy_blocks: a block of each cache read and written per pair, and the int64 pairs read."""
    return 2 * pairs * block_bytes * 2 + pairs * 16


def bench_cache_ops(device, co, ceilings, notes):
    dtype = getattr(torch, co["dtype"])
    nb, bs, hkv, d = co["num_blocks"], co["block_size"], co["heads_kv"], co["head_dim"]
    g = torch.Generator(device=device).manual_seed(2)
    cpu_g = torch.Generator().manual_seed(2)
    kc = torch.randn(nb, bs, hkv, d, generator=g, device=device, dtype=dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g, device=device, dtype=dtype)
    kflat, vflat = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    row_bytes = hkv * d * kc.element_size()
    ours_name = "default" if device == "cuda" else "cpu"
    common = {"heads_kv": hkv, "head_dim": d, "block_size": bs, "num_blocks": nb}
    rows = []
    for tokens in co["tokens"]:
        where = f"reshape_and_cache tokens={tokens}"
        # Each input set's K and V are far below the L2 at a decode step's 256 tokens: rotate
        # enough sets that a pass through them reads twice the L2.
        sets = bench.rotation_sets(2 * tokens * row_bytes) if device == "cuda" else 1
        data = []
        for _ in range(sets):
            slots = slot_mapping_for(tokens, nb * bs, cpu_g)
            keep = (slots >= 0).nonzero().squeeze(1)
            data.append({"key": torch.randn(tokens, hkv, d, generator=g, device=device, dtype=dtype),
                         "value": torch.randn(tokens, hkv, d, generator=g, device=device, dtype=dtype),
                         "slots": slots.to(device), "keep": keep.to(device), "dst": slots[keep].to(device)})
        padding = tokens - int(data[0]["keep"].numel())

        def ours(i, check=False):
            x = data[i]
            flash_attention.reshape_and_cache(x["key"], x["value"], kc, vc, x["slots"], check_slots=check)

        def torch_index_copy(i):
            # PyTorch has to drop the padding tokens first: index_copy_ takes one row per index.
            x = data[i]
            kflat.index_copy_(0, x["dst"], x["key"].index_select(0, x["keep"]))
            vflat.index_copy_(0, x["dst"], x["value"].index_select(0, x["keep"]))

        # The guard: the slots to be written hold NaN, one checked call, then every slot must
        # hold its token's K and V bit for bit (the op moves bytes).
        x0 = data[0]
        kflat.index_fill_(0, x0["dst"], float("nan"))
        vflat.index_fill_(0, x0["dst"], float("nan"))
        ran = bench.attempt(notes, ours_name, where, lambda: ours(0, check=True) or True)
        if ran and not (torch.equal(kflat[x0["dst"]], x0["key"][x0["keep"]]) and
                        torch.equal(vflat[x0["dst"]], x0["value"][x0["keep"]])):
            raise AssertionError(f"{where}: the cache does not hold the tokens at their slots after one call; "
                                 "a wrong result is not timed")
        nbytes = cache_op_bytes(tokens, padding, row_bytes)
        t_base = None
        for variant, call in (("torch", torch_index_copy), (ours_name, ours) if ran else (None, None)):
            if variant is None:
                continue
            t = bench.probe_and_time(notes, variant, where, device, lambda call=call: call(0), sets=sets, call=call,
                                     max_call_ms=MAX_CALL_MS)
            if t is None:
                continue
            t_base = t_base or (t["median_ms"] if variant == "torch" else None)
            rows.append(bench.bandwidth_row("reshape_and_cache", variant, dtype, [tokens, hkv, d], nbytes, t,
                                            ceilings["copy_GBps"], t_base, tokens=tokens, padding=padding, **common))
        data.clear()  # this size's input sets, before the next size's
    pairs = co["pairs"]
    where = f"copy_blocks pairs={pairs}"
    perm = torch.randperm(nb, generator=cpu_g)[:2 * pairs]
    src, dst = perm[:pairs].to(device), perm[pairs:].to(device)
    mapping = torch.stack([src, dst], dim=1)

    def copy_ours(check=False):
        flash_attention.copy_blocks(kc, vc, mapping, check_mapping=check)

    def torch_index():
        kc[dst] = kc[src]
        vc[dst] = vc[src]

    kc[dst], vc[dst] = float("nan"), float("nan")
    ran = bench.attempt(notes, ours_name, where, lambda: copy_ours(check=True) or True)
    if ran and not (torch.equal(kc[dst], kc[src]) and torch.equal(vc[dst], vc[src])):
        raise AssertionError(f"{where}: the destination blocks are not copies of their sources after one call; "
                             "a wrong result is not timed")
    nbytes = copy_blocks_bytes(pairs, bs * row_bytes)
    t_base = None
    for variant, call in (("torch", torch_index), (ours_name, copy_ours) if ran else (None, None)):
        if variant is None:
            continue
        t = bench.probe_and_time(notes, variant, where, device, call, max_call_ms=MAX_CALL_MS)
        if t is None:
            continue
        t_base = t_base or (t["median_ms"] if variant == "torch" else None)
        rows.append(bench.bandwidth_row("copy_blocks", variant, dtype, [pairs, bs, hkv, d], nbytes, t,
                                        ceilings["copy_GBps"], t_base, pairs=pairs, **common))
    return rows


# ---------------------------------------------------------------------------------------------
# The prefix lookup
# ---------------------------------------------------------------------------------------------
def count_nodes(cache):
    """Nodes of the tree, the root included: a walk over cache.root, cheap next to a flatten."""
    stack, n = [cache.root], 0
    while stack:
        node = stack.pop()
        n += 1
        stack.extend(node.children.values())
    return n


def tail_blocks(rng, blocks):
    """How many trailing blocks of its parent a new sequence replaces: mostly a few (many
    continuations of a long shared context), sometimes any number (a branch high in the tree)."""
    if rng.random() < LONG_TAILS:
        return rng.randint(1, blocks - 1)
    return rng.randint(1, min(SHORT_TAIL, blocks - 1))


def build_tree(m, seed=0):
    """A RadixCache of about m["nodes"] nodes: m["roots"] random sequences of m["tokens"] tokens,
    then sequences that keep a random earlier one's leading blocks and draw the rest afresh, each
    insert adding a leaf and, when it branches inside an edge, splitting it. Inserted in rounds
    sized from the nodes per insert seen so far, until the tree has its nodes. Returns (cache,
    the inserted sequences, facts of the build)."""
    bs, width, vocab = m["block_size"], m["tokens"], m["vocab"]
    blocks = width // bs
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cache = flash_attention.RadixCache(bs)
    seqs = []
    started = time.perf_counter()

    def add(tokens):
        # Fresh KV block ids for every block; the tree keeps its own for a prefix it has. Both
        # as tensors: insert turns a tensor into a list in one call, a range element by element.
        cache.insert(tokens, torch.arange(len(seqs) * blocks, (len(seqs) + 1) * blocks))
        seqs.append(tokens)

    for _ in range(m["roots"]):
        add(torch.randint(vocab, (width,), generator=g, dtype=torch.int32))
    nodes = first = count_nodes(cache)
    inserted, per_insert = 0, 2.0
    while nodes < m["nodes"]:
        for _ in range(max(1, math.ceil((m["nodes"] - nodes) / per_insert))):
            keep = (blocks - tail_blocks(rng, blocks)) * bs
            new = torch.empty(width, dtype=torch.int32)
            new[:keep] = seqs[rng.randrange(len(seqs))][:keep]
            new[keep:] = torch.randint(vocab, (width - keep,), generator=g, dtype=torch.int32)
            add(new)
            inserted += 1
        nodes = count_nodes(cache)
        per_insert = max(1.0, (nodes - first) / inserted)
    build_s = time.perf_counter() - started
    started = time.perf_counter()
    flat = cache.flat_tree("cpu")
    flatten_s = time.perf_counter() - started
    if len(flat[2]) != nodes:
        raise AssertionError(f"the flat tree has {len(flat[2])} nodes, the walk counted {nodes}")
    return cache, seqs, {"nodes": nodes, "inserts": len(seqs), "build_s": build_s, "flatten_s": flatten_s,
                         "tree_tokens": len(flat[0]), "tree_blocks": len(flat[4])}


def make_requests(seqs, m, seed=0):
    """(queries int32 (requests, tokens), lengths int32): a third inserted sequences, a third an
    inserted sequence's first tokens up to a random point then fresh ones, a third fresh tokens,
    shuffled; one request in 8 cut to a random length."""
    rng = random.Random(seed + 1)
    g = torch.Generator().manual_seed(seed + 1)
    requests, width, bs = m["requests"], m["tokens"], m["block_size"]
    queries = torch.randint(m["vocab"], (requests, width), generator=g, dtype=torch.int32)
    kinds = [r % 3 for r in range(requests)]
    rng.shuffle(kinds)
    for r, kind in enumerate(kinds):
        if kind == 0:
            queries[r] = seqs[rng.randrange(len(seqs))]
        elif kind == 1:
            cut = rng.randint(1, width // bs - 1) * bs + rng.randrange(bs)
            queries[r, :cut] = seqs[rng.randrange(len(seqs))][:cut]
    lengths = torch.full((requests,), width, dtype=torch.int32)
    for r in range(requests):
        if rng.random() < 1 / 8:
            lengths[r] = rng.randint(1, width)
    return queries, lengths


def expected_matches(cache, queries, lengths, max_blocks):
    """The Python tree walk's answer (RadixCache.match_prefix_reference), in the op's layout."""
    tokens = torch.zeros(len(queries), dtype=torch.int32)
    blocks = torch.full((len(queries), max_blocks), -1, dtype=torch.int32)
    for r, (row, n) in enumerate(zip(queries, lengths.tolist())):
        matched, ids = cache.match_prefix_reference(row, n, max_blocks)
        tokens[r] = matched
        blocks[r, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return tokens, blocks


def same_matches(a, b):
    return torch.equal(a[0].cpu(), b[0].cpu()) and torch.equal(a[1].cpu(), b[1].cpu())


def bench_match(device, m, notes):
    cache, seqs, info = build_tree(m)
    print(f"  radix tree: {info['nodes']} nodes ({info['tree_tokens']} tokens) from {info['inserts']} inserts, "
          f"built in {info['build_s']:.1f} s, flattened in {info['flatten_s']:.2f} s")
    queries, lengths = make_requests(seqs, m)
    del seqs
    bs, max_blocks = m["block_size"], m["tokens"] // m["block_size"]
    where = f"match_prefix {m['requests']}x{m['tokens']}, {info['nodes']} nodes"
    tree = cache.flat_tree("cpu")

    def on_cpu():
        return torch.ops.flash_attention.match_prefix(*tree, bs, queries, lengths, max_blocks)

    got_cpu = on_cpu()
    if not same_matches(got_cpu, expected_matches(cache, queries, lengths, max_blocks)):
        raise AssertionError(f"{where}: the CPU op disagrees with RadixCache.match_prefix_reference")
    matched = got_cpu[0]
    whole = lengths // bs * bs
    mix = {"full_matches": int(((matched == whole) & (matched > 0)).sum()), "no_matches": int((matched == 0).sum())}
    mix["partial_matches"] = m["requests"] - mix["full_matches"] - mix["no_matches"]
    fields = {"requests": m["requests"], "tokens": m["tokens"], "block_size": bs, "nodes": info["nodes"],
              "max_match_blocks": max_blocks, **mix, "matches_reference": True}
    rows = []

    def row(variant, t, **more):
        return {"op": "match_prefix", "variant": variant, "dtype": "int32", "shape": [m["requests"], m["tokens"]],
                **t, "requests_per_s": m["requests"] / (t["median_ms"] * 1e-3), **fields, **more}

    t_cpu = bench.probe_and_time(notes, "cpu", where, "cpu", on_cpu, max_call_ms=MAX_CALL_MS)
    if t_cpu is not None:
        rows.append(row("cpu", t_cpu))
    if device != "cuda":
        notes.skip("default", "no CUDA device: the lookup on the GPU is not measured", where)
        return rows, info
    q_dev, len_dev = queries.to(device), lengths.to(device)
    torch.cuda.synchronize()
    started = time.perf_counter()
    tree_dev = cache.flat_tree(device)  # the one-time copy of the mirror; every lookup reuses it
    torch.cuda.synchronize()
    upload_ms = (time.perf_counter() - started) * 1e3

    def on_gpu():
        return torch.ops.flash_attention.match_prefix(*tree_dev, bs, q_dev, len_dev, max_blocks)

    got = bench.attempt(notes, "default", where, on_gpu)
    if got is None:
        return rows, info
    if not same_matches(got, got_cpu):
        raise AssertionError(f"{where}: the CUDA lookup disagrees with the CPU reference")
    t = bench.probe_and_time(notes, "default", where, device, on_gpu, max_call_ms=MAX_CALL_MS)
    if t is not None:
        more = {"speedup_vs_cpu": t_cpu["median_ms"] / t["median_ms"]} if t_cpu else {}
        rows.append(row("default", t, matches_cpu=True, mirror_upload_ms=upload_ms,
                        mirror_MiB=sum(a.numel() * a.element_size() for a in tree_dev) / 2**20, **more))
    return rows, info


# ---------------------------------------------------------------------------------------------
# Targets: this chapter's numbers against the record
# ---------------------------------------------------------------------------------------------
def evaluate_targets(rows, variant):
    """One entry per target: its bounds, what `variant` measured, and whether it met them (a
    missing row meets nothing)."""
    out = []
    for config, t in TARGETS.items():
        r = next((r for r in rows if r["op"] == "paged_attention" and r.get("sweep") == "targets"
                  and r.get("config") == config and r["variant"] == variant), None)
        pct = r["pct_of_copy"] if r else None
        speedup = r.get("speedup_vs_torch") if r else None
        met = pct is not None and pct >= t["pct_of_copy"] and (
            "speedup" not in t or (speedup is not None and speedup >= t["speedup"]))
        out.append({"target": config, "op": "paged_attention", "variant": variant,
                    "min_pct_of_copy": t["pct_of_copy"], "min_speedup_vs_sdpa_contiguous": t.get("speedup"),
                    "pct_of_copy": pct, "speedup_vs_sdpa_contiguous": speedup, "met": met})
    r = next((r for r in rows if r["op"] == "match_prefix" and r["variant"] == "default"), None)
    speedup = r.get("speedup_vs_cpu") if r else None
    out.append({"target": "match_prefix", "op": "match_prefix", "variant": "default", "min_speedup_vs_cpu": MATCH_TARGET,
                "speedup_vs_cpu": speedup, "met": speedup is not None and speedup > MATCH_TARGET})
    return out


# ---------------------------------------------------------------------------------------------
# Figures and the table, drawn from the results record
# ---------------------------------------------------------------------------------------------
def style(variant):
    """PyTorch dashed (sdpa_contiguous, the baseline, black); default a wide pale band under the
    rungs, so the envelope it follows shows through; rungs plain lines."""
    if variant in TORCH_DECODE or variant.startswith("torch"):
        return dict(linestyle="--", marker="o", ms=3, color="black" if variant == BASELINE else None)
    if variant == "default":
        return dict(color="tab:orange", linewidth=7, alpha=0.35, zorder=0, marker="o", ms=3)
    return dict(marker="o", ms=3)


COLORS = {"sdpa_contiguous": "black", "sdpa_gathered": "dimgrey", "repeat_kv": "silver", "default": "tab:orange",
          "per_head": "tab:blue", "per_kv_head": "tab:green", "split_kv": "tab:purple", "cpu": "tab:blue",
          "sdpa_flash": "black", "flex_attention": "dimgrey", "decode_rows": "tab:green", "mma": "tab:red"}
ORDER = TORCH_DECODE + TORCH_PREFILL + (CONTIGUOUS_PREFILL,) + RUNGS + PREFILL_RUNGS + ("default", "cpu")


def ordered(variants):
    """PyTorch first, then the ladder, then default: the same order in every figure and table."""
    variants = list(dict.fromkeys(variants))
    return sorted(variants, key=lambda v: ORDER.index(v) if v in ORDER else len(ORDER))


def config_label(r):
    n = f"<={r['context_range'][1]} mixed" if r.get("mixed") else str(r["context"])
    return (f"b{r['batch']} n{n} {r['heads']}/{r['heads_kv']}"
            f"{'' if r['head_dim'] == 128 else ' d' + str(r['head_dim'])}"
            f"{'' if r['block_size'] == 16 else ' bs' + str(r['block_size'])}"
            f"{'' if r['dtype'] == 'bfloat16' else ' ' + r['dtype']}")


def grouped_bars(ax, groups, rows_of, value="pct_of_copy"):
    """Bars of `value` for every variant in each group (rows_of(group) -> its rows)."""
    variants = ordered(r["variant"] for g in groups for r in rows_of(g))
    width = 0.8 / max(len(variants), 1)
    for i, v in enumerate(variants):
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(groups))]
        vals = [next((r[value] for r in rows_of(g) if r["variant"] == v), 0) for g in groups]
        ax.bar(xs, vals, width, label=v, color=COLORS.get(v))
    return variants


def plot_targets(ax, record):
    rs = results.rows(record, op="paged_attention", sweep="targets")
    configs = list(dict.fromkeys(r["config"] for r in rs))
    grouped_bars(ax, configs, lambda c: [r for r in rs if r["config"] == c])
    for j, c in enumerate(configs):
        if c in TARGETS:
            ax.hlines(TARGETS[c]["pct_of_copy"], j - 0.45, j + 0.45, color="red", linewidth=1.5,
                      label="target" if j == 0 else None)
    labels = [f"{c}\n" + config_label(next(r for r in rs if r["config"] == c)).replace(" ", "\n", 1) for c in configs]
    ax.set_xticks(range(len(configs)), labels, fontsize=7)
    ax.axhline(100, color="grey", linestyle=":")
    ax.set_ylabel("% of copy over the unique K/V bytes")
    ax.set_title(f"decode at the lesson's configurations: {results.label(record)}", fontsize=9)
    ax.legend(fontsize=7, ncol=4)
    ax.grid(axis="y", alpha=0.3)


def plot_gqa(ax, record):
    rs = results.rows(record, op="paged_attention", sweep="gqa")
    kv = sorted(dict.fromkeys(r["heads_kv"] for r in rs), reverse=True)
    grouped_bars(ax, kv, lambda n: [r for r in rs if r["heads_kv"] == n])
    r0 = rs[0]
    ax.set_xticks(range(len(kv)), [f"{r0['heads']}/{n} (group {r0['heads'] // n})" for n in kv])
    ax.axhline(100, color="grey", linestyle=":")
    ax.set_xlabel("query heads / kv heads")
    ax.set_ylabel("% of copy over the unique K/V bytes")
    ax.set_title(f"GQA: batch {r0['batch']} x {r0['context']}, d {r0['head_dim']}, {r0['dtype']}: "
                 f"{results.label(record)}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def plot_split(axes, record, batches):
    rs = results.rows(record, op="paged_attention", sweep="split_kv")
    for ax, b in zip(axes, batches):
        mine = [r for r in rs if r["batch"] == b]
        for v in ordered(r["variant"] for r in mine):
            pts = sorted((r["context"], r["pct_of_copy"]) for r in mine if r["variant"] == v)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=v, **style(v))
        ax.set_xscale("log", base=2)
        ax.axhline(100, color="grey", linestyle=":")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("% of copy")
        r0 = mine[0]
        ax.set_title(f"batch {b}, {r0['heads']}/{r0['heads_kv']} heads, d {r0['head_dim']}, {r0['dtype']}",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def plot_num_splits(ax, record):
    """% of copy against the count named, one line per configuration; its default and SDPA as
    markers at the right."""
    rs = results.rows(record, op="paged_attention", sweep="num_splits")
    for i, c in enumerate(dict.fromkeys(r["config"] for r in rs)):
        mine = [r for r in rs if r["config"] == c]
        pts = sorted((r["num_splits"], r["pct_of_copy"]) for r in mine if "num_splits" in r)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                        label=f"{c}: {config_label(mine[0])}")
        for r in mine:
            if r["variant"] == "default":
                ax.axhline(r["pct_of_copy"], color=line.get_color(), linewidth=5, alpha=0.25)
            elif r["variant"] == BASELINE:
                ax.axhline(r["pct_of_copy"], color=line.get_color(), linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.axhline(100, color="grey", linestyle=":")
    ax.set_xlabel("num_splits (split_kv)")
    ax.set_ylabel("% of copy over the unique K/V bytes")
    ax.set_title(f"split count named by the caller (band: default, dashed: sdpa_contiguous): {results.label(record)}",
                 fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def plot_cache_ops(ax, record):
    """Two bars per measurement: PyTorch's index ops, then the course's op."""
    rs = [r for r in record["benchmarks"] if r["op"] in ("reshape_and_cache", "copy_blocks")]
    groups = list(dict.fromkeys((r["op"], r["shape"][0]) for r in rs))
    for i, (torch_side, label, color) in enumerate(((True, "PyTorch index ops", "grey"),
                                                    (False, "the course's op", "tab:orange"))):
        vals = [next((r["pct_of_copy"] for r in rs if (r["op"], r["shape"][0]) == g
                      and r["variant"].startswith("torch") == torch_side), 0) for g in groups]
        ax.bar([j + (i - 0.5) * 0.4 for j in range(len(groups))], vals, 0.4, label=label, color=color)
    ax.set_xticks(range(len(groups)), [f"{op}\n{n} {'tokens' if op == 'reshape_and_cache' else 'pairs'}"
                                       for op, n in groups], fontsize=8)
    ax.axhline(100, color="grey", linestyle=":")
    ax.set_ylabel("% of copy")
    ax.set_title("cache writes and copies", fontsize=9)
    ax.legend(fontsize=7)


def plot_match(ax, record):
    rs = results.rows(record, op="match_prefix")
    ax.bar(range(len(rs)), [r["requests_per_s"] for r in rs],
           color=["tab:orange" if r["variant"] == "default" else "grey" for r in rs])
    ax.set_xticks(range(len(rs)), [r["variant"] for r in rs])
    for i, r in enumerate(rs):
        ax.annotate(f"{r['requests_per_s']:.3g}/s\n{r['median_ms']:.3g} ms", (i, r["requests_per_s"]),
                    ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("requests per second")
    r0 = rs[0]
    ax.set_title(f"match_prefix: {r0['requests']} x {r0['tokens']} tokens, {r0['nodes']} nodes", fontsize=9)


def plot_prefill(ax, record):
    rs = results.rows(record, op="paged_prefill", sweep=None)  # the block-size sweep has its own figure
    configs = list(dict.fromkeys(r["config"] for r in rs))
    grouped_bars(ax, configs, lambda c: [r for r in rs if r["config"] == c], value="pct_of_mm")
    labels = [f"{c}\n" + prefill_label(next(r for r in rs if r["config"] == c)) for c in configs]
    ax.set_xticks(range(len(configs)), labels, fontsize=7)
    ax.set_ylabel("% of a bf16 matmul's TFLOP/s (visible pairs only)")
    ax.set_title(f"chunked prefill over the paged cache: {results.label(record)}", fontsize=9)
    ax.legend(fontsize=7, ncol=3)
    ax.grid(axis="y", alpha=0.3)


def plot_prefill_block_size(axes, record):
    """The block-size sweep of the "prefix" configuration, block_size on a log2 axis. Left: default's
    speed over attention_varlen's on the same keys gathered contiguous (1: paging costs nothing; the
    red line is the chapter's target), each point named by how the producer loaded its pages (gather:
    cp.async by the producer warpgroup, tma: one box a page). Right: each variant's time, where the
    contiguous call should be flat (it sees no pages). A CPU record has the reference's times alone."""
    rs = results.rows(record, op="paged_prefill", sweep="block_size")
    ax_ratio, ax_time = axes
    sizes = sorted(dict.fromkeys(r["block_size"] for r in rs))
    ratios = {bs: x for bs, x in contiguous_ratios(rs, key="block_size").items() if x is not None}
    xs = sorted(ratios)
    if xs:
        ax_ratio.plot(xs, [ratios[x] for x in xs], marker="o", color=COLORS["default"],
                      label=f"default / {CONTIGUOUS_PREFILL}")
        for x in xs:
            producer = next((r.get("producer") for r in rs if r["block_size"] == x and r["variant"] == "default"), None)
            if producer:
                ax_ratio.annotate(producer, (x, ratios[x]), textcoords="offset points", xytext=(0, 6), ha="center",
                                  fontsize=7)
    else:
        ax_ratio.text(0.5, 0.5, f"no {CONTIGUOUS_PREFILL} rows here (a CPU run times the reference alone)",
                      ha="center", va="center", transform=ax_ratio.transAxes, fontsize=8)
    ax_ratio.axhline(1.0, color="grey", linestyle=":")
    ax_ratio.axhline(PREFILL_CONTIGUOUS_TARGET, color="red", linestyle="--", linewidth=1,
                     label=f"target {PREFILL_CONTIGUOUS_TARGET:g}x")
    ax_ratio.set_ylabel(f"default's speed / {CONTIGUOUS_PREFILL}'s (same keys)")
    for v in ordered(r["variant"] for r in rs):
        pts = sorted((r["block_size"], r["median_ms"] * 1e3) for r in rs if r["variant"] == v)
        ax_time.plot([p[0] for p in pts], [p[1] for p in pts], label=v, color=COLORS.get(v), marker="o", ms=3)
    ax_ratio.set_ylim(0, max([1.1, *(x * 1.1 for x in ratios.values())]))
    ax_time.set_ylim(0, max([r["median_ms"] * 1e3 for r in rs], default=1) * 1.15)
    ax_time.set_ylabel("us per call")
    for ax in axes:
        ax.set_xscale("log", base=2)
        if sizes:
            ax.set_xlim(sizes[0] / 1.5, sizes[-1] * 1.5)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel("block_size (rows per page)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    r0 = rs[0] if rs else None
    if r0:
        ax_ratio.set_title(f"{r0['config']}: {prefill_label(r0)}", fontsize=9)
    ax_time.set_title(f"chunked prefill by page size: {results.label(record)}", fontsize=9)


def make_prefill_figures(record, out_dir):
    if not results.rows(record, op="paged_prefill"):
        return []
    fig, ax = plt.subplots(figsize=(9, 4.5))
    plot_prefill(ax, record)
    stem = f"{CHAPTER}_prefill" if record["chapter"] == CHAPTER else record["chapter"]
    figures = [plots.save(fig, out_dir / f"{stem}.png")]
    if results.rows(record, op="paged_prefill", sweep="block_size"):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        plot_prefill_block_size(axes, record)
        figures.append(plots.save(fig, out_dir / f"{stem}_block_size.png"))
    return figures


def make_figures(record, out_dir):
    figures = make_prefill_figures(record, out_dir)
    if results.rows(record, op="paged_attention", sweep="targets"):
        fig, ax = plt.subplots(figsize=(12, 5))
        plot_targets(ax, record)
        figures.append(plots.save(fig, out_dir / f"{CHAPTER}_targets.png"))
    batches = list(dict.fromkeys(r["batch"] for r in results.rows(record, op="paged_attention", sweep="split_kv")))
    if batches:
        fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 4.2), squeeze=False)
        plot_split(axes[0], record, batches)
        fig.suptitle(f"split-KV crossover: {results.label(record)}", fontsize=10)
        figures.append(plots.save(fig, out_dir / f"{CHAPTER}_split_kv.png"))
    if results.rows(record, op="paged_attention", sweep="num_splits"):
        fig, ax = plt.subplots(figsize=(9, 4.5))
        plot_num_splits(ax, record)
        figures.append(plots.save(fig, out_dir / f"{CHAPTER}_num_splits.png"))
    if results.rows(record, op="paged_attention", sweep="gqa"):
        fig, ax = plt.subplots(figsize=(9, 4.5))
        plot_gqa(ax, record)
        figures.append(plots.save(fig, out_dir / f"{CHAPTER}_gqa.png"))
    has_ops = any(r["op"] in ("reshape_and_cache", "copy_blocks") for r in record["benchmarks"])
    has_match = bool(results.rows(record, op="match_prefix"))
    if has_ops or has_match:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        if has_ops:
            plot_cache_ops(axes[0], record)
        if has_match:
            plot_match(axes[1], record)
        fig.suptitle(results.label(record), fontsize=10)
        figures.append(plots.save(fig, out_dir / f"{CHAPTER}_cache_ops_match_prefix.png"))
    return figures + plots.cpu_vs_recorded(record, out_dir, CHAPTER, plot_targets, figsize=(18, 5))


def fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def prefill_label(r):
    return (f"b{r['batch']} q{r['total_q']} (<= {r['max_seqlen_q']}) n<={r['context']} {r['heads']}/{r['heads_kv']}"
            f"{'' if r['head_dim'] == 128 else ' d' + str(r['head_dim'])}"
            f"{'' if r['dtype'] == 'bfloat16' else ' ' + r['dtype']}")


def print_prefill_rows(record):
    rows = results.rows(record, op="paged_prefill", sweep=None)
    if not rows:
        print_block_size_rows(record)
        return
    mm = record["ceilings"].get("mm_TFLOPs")
    print(f"\npaged_prefill (forward, causal bottom-right); matmul {fmt(mm, '.0f')} TFLOP/s; x {PREFILL_BASELINE} = its "
          "time / ours")
    print(f"{'config':<48}{'variant':<16}{'us':>10}{'TFLOP/s':>9}{'% mm':>7}{'x sdpa':>8}  dispatch")
    for r in rows:
        print(f"{r['config'] + ' ' + prefill_label(r):<48}{r['variant']:<16}{r['median_ms'] * 1e3:>10.1f}"
              f"{r['TFLOPs']:>9.1f}{r['pct_of_mm']:>7.1f}{fmt(r.get('speedup_vs_torch'), '8.2f', '       -')}"
              f"  {r.get('dispatch', '')}")
    print(f"\ndefault / {CONTIGUOUS_PREFILL}: the paged op's speed over the same keys gathered contiguous")
    for config, ratio in contiguous_ratios(rows).items():
        print(f"  {config:<10}{fmt(ratio, '.2f')}x")
    print_block_size_rows(record)


def print_block_size_rows(record):
    """The block-size sweep: each variant's time per block size, and default / attention_varlen."""
    rows = results.rows(record, op="paged_prefill", sweep="block_size")
    if not rows:
        return
    variants = ordered(r["variant"] for r in rows)
    print(f"\nby block size, {rows[0]['config']} {prefill_label(rows[0])}: us per call, and default / "
          f"{CONTIGUOUS_PREFILL} (target >= {PREFILL_CONTIGUOUS_TARGET:g}x)")
    print(f"{'block_size':>10}{'producer':>10}" + "".join(f"{v:>18}" for v in variants) + f"{'ratio':>8}")
    ratios = contiguous_ratios(rows, key="block_size")
    for bs in sorted(ratios):
        got = {r["variant"]: r for r in rows if r["block_size"] == bs}
        producer = got.get("default", {}).get("producer") or "-"
        print(f"{bs:>10}{producer:>10}"
              + "".join(fmt(got[v]["median_ms"] * 1e3 if v in got else None, "18.1f", f"{'-':>18}") for v in variants)
              + fmt(ratios[bs], "7.2f", f"{'-':>7}") + ("x" if ratios[bs] is not None else ""))


def contiguous_ratios(rows, key="config"):
    """{config (or the rows' `key` field): default's speed / attention_varlen's} (time over time,
    inverted), None where a row is missing."""
    out = {}
    for value in dict.fromkeys(r[key] for r in rows):
        got = {r["variant"]: r["median_ms"] for r in rows if r[key] == value}
        mine, theirs = got.get("default"), got.get(CONTIGUOUS_PREFILL)
        out[value] = theirs / mine if mine and theirs else None
    return out


def print_prefill_table(record):
    for note in record.get("skipped", []):
        print(f"skipped {note['variant']} (first at {note['first_at']}): {note['reason'][:160]}")
    print(f"\n{record['chapter']} on {results.label(record)}; run {record.get('wall_s', 0):.0f} s")
    print_prefill_rows(record)


def print_table(record):
    c = record["ceilings"]
    for note in record.get("skipped", []):
        print(f"skipped {note['variant']} (first at {note['first_at']}): {note['reason'][:160]}")
    print(f"\n{CHAPTER} on {results.label(record)}; copy {c['copy_GBps']:.0f} GB/s; x {BASELINE} = its time / "
          f"ours; % copy over the unique K/V bytes; run {record.get('wall_s', 0):.0f} s")
    head = f"{'config':<34}{'variant':<18}{'us':>10}{'GB/s':>9}{'% copy':>8}{'x sdpa':>8}"
    print(head)
    for r in results.rows(record, op="paged_attention", sweep="targets"):
        print(f"{r['config'] + ' ' + config_label(r):<34}{r['variant']:<18}{r['median_ms'] * 1e3:>10.1f}"
              f"{r['GBps']:>9.0f}{r['pct_of_copy']:>8.1f}{fmt(r.get('speedup_vs_torch'), '8.2f', '       -')}")
    gqa = results.rows(record, op="paged_attention", sweep="gqa")
    if gqa:
        kv = sorted(dict.fromkeys(r["heads_kv"] for r in gqa), reverse=True)
        r0 = gqa[0]
        print(f"\nGQA, batch {r0['batch']} x {r0['context']}, {r0['heads']} query heads: % copy by kv heads")
        print(f"{'variant':<18}" + "".join(f"{n:>8}" for n in kv))
        for v in ordered(r["variant"] for r in gqa):
            got = {r["heads_kv"]: r["pct_of_copy"] for r in gqa if r["variant"] == v}
            print(f"{v:<18}" + "".join(f"{fmt(got.get(n), '8.1f', '       -')}" for n in kv))
    split = results.rows(record, op="paged_attention", sweep="split_kv")
    if split:
        ctx = sorted(dict.fromkeys(r["context"] for r in split))
        print(f"\nsplit-KV, {split[0]['heads']}/{split[0]['heads_kv']} heads: % copy by context")
        print(f"{'batch':>5}  {'variant':<18}" + "".join(f"{n:>8}" for n in ctx))
        for b, v in ((b, v) for b in dict.fromkeys(r["batch"] for r in split)
                     for v in ordered(r["variant"] for r in split if r["batch"] == b)):
            got = {r["context"]: r["pct_of_copy"] for r in split if (r["batch"], r["variant"]) == (b, v)}
            print(f"{b:>5}  {v:<18}" + "".join(f"{fmt(got.get(n), '8.1f', '       -')}" for n in ctx))
    by_count = results.rows(record, op="paged_attention", sweep="num_splits")
    if by_count:
        counts = sorted(dict.fromkeys(r["num_splits"] for r in by_count if "num_splits" in r))
        print("\nnum_splits: % copy of split_kv with the count named, against default and sdpa_contiguous")
        print(f"{'config':<34}" + "".join(f"{n:>7}" for n in counts) + f"{'default':>9}{'sdpa':>7}")
        for c in dict.fromkeys(r["config"] for r in by_count):
            mine = [r for r in by_count if r["config"] == c]
            got = {r["num_splits"]: r["pct_of_copy"] for r in mine if "num_splits" in r}
            other = {r["variant"]: r["pct_of_copy"] for r in mine if "num_splits" not in r}
            print(f"{c + ' ' + config_label(mine[0]):<34}" + "".join(fmt(got.get(n), '7.1f', '      -') for n in counts)
                  + fmt(other.get("default"), "9.1f", "        -") + fmt(other.get(BASELINE), "7.1f", "      -"))
    ops = [r for r in record["benchmarks"] if r["op"] in ("reshape_and_cache", "copy_blocks")]
    if ops:
        print(f"\n{'cache op':<34}{'variant':<18}{'us':>10}{'GB/s':>9}{'% copy':>8}{'x torch':>8}")
        for r in ops:
            what = f"{r['op']} {r['shape'][0]} {'tokens' if r['op'] == 'reshape_and_cache' else 'pairs'}"
            print(f"{what:<34}{r['variant']:<18}{r['median_ms'] * 1e3:>10.1f}{r['GBps']:>9.0f}"
                  f"{r['pct_of_copy']:>8.1f}{fmt(r.get('speedup_vs_torch'), '8.2f', '       -')}")
    match = results.rows(record, op="match_prefix")
    if match:
        r0 = match[0]
        print(f"\nmatch_prefix, {r0['requests']} x {r0['tokens']} tokens, {r0['nodes']} nodes (full/partial/none "
              f"{r0['full_matches']}/{r0['partial_matches']}/{r0['no_matches']})")
        for r in match:
            extra = (f", {r['speedup_vs_cpu']:.1f}x cpu, mirror upload {r['mirror_upload_ms']:.1f} ms"
                     if "speedup_vs_cpu" in r else "")
            print(f"  {r['variant']:<6}{r['median_ms']:>10.3f} ms {r['requests_per_s']:>12.3g} requests/s{extra}")
    print_prefill_rows(record)
    ours = record["targets"][0]["variant"] if record.get("targets") else "default"
    aside = "" if ours == "default" else " (a CPU run: a record, not a goal)"
    print(f"\nthis chapter's targets, held to {ours}{aside}")
    for t in record.get("targets", []):
        if t["op"] == "match_prefix":
            print(f"  match_prefix: default (CUDA) > {t['min_speedup_vs_cpu']:g}x the CPU reference; measured "
                  f"{fmt(t['speedup_vs_cpu'], '.2f')}x: {'met' if t['met'] else 'NOT met'}")
            continue
        want = f">= {t['min_pct_of_copy']}% of copy" + (
            f", >= {t['min_speedup_vs_sdpa_contiguous']}x {BASELINE}" if t["min_speedup_vs_sdpa_contiguous"] else "")
        got = f"{fmt(t['pct_of_copy'], '.1f')}%" + (
            f", {fmt(t['speedup_vs_sdpa_contiguous'], '.2f')}x" if t["min_speedup_vs_sdpa_contiguous"] else "")
        print(f"  {t['target']} ({t['variant']}): {want}; measured {got}: {'met' if t['met'] else 'NOT met'}")


def prefill_extra(device):
    return {"prefill_baseline": PREFILL_BASELINE,
            "prefill_notes": ["paged_prefill: sdpa_flash and flex_attention run over each sequence's K/V gathered "
                              "from the cache outside the timed region (flex's block mask too); the course's op "
                              "reads the cache through the block table, check_tables=False",
                              "sdpa_flash: one SDPA call per sequence with causal_lower_right, FLASH_ATTENTION only"]}


def measure_prefill(device, quick):
    """--prefill-only: the paged_prefill rows alone, with the ceilings they are read against."""
    started = time.perf_counter()
    s = sizes_for(device, quick)
    full = device == "cuda" and not quick
    ceilings = bench.copy_ceiling(device, n=2**28 if full else 2**20)
    ceilings.update(bench.matmul_ceiling(device, n=8192 if full else 1024 if device == "cuda" else 256))
    notes = bench.Notes()
    rows = bench_prefill(device, s["prefill"] + s["prefill_block_size"], ceilings, notes)
    extra = {"sizes": {k: s[k] for k in ("prefill", "prefill_block_size")}, "headline_op": "paged_prefill",
             **prefill_extra(device),
             "skipped": notes.skipped, "extension": flash_attention.EXTENSION, "targets": [],
             "versions": {"paged_prefill_attention": list(PREFILL_RUNGS)},
             "wall_s": time.perf_counter() - started}
    return rows, ceilings, extra


def measure_all(device, quick):
    """Every measurement of a run: (rows, ceilings, extra), what main() writes and the notebook
    (notebooks/06b_inference.ipynb) keeps in memory."""
    started = time.perf_counter()
    s = sizes_for(device, quick)
    full = device == "cuda" and not quick
    # copy_ceiling warms the GPU up first (an idle H100 sits at a low clock).
    ceilings = bench.copy_ceiling(device, n=2**28 if full else 2**20)
    # paged_prefill is compute-bound: its rows are read against a matmul.
    ceilings.update(bench.matmul_ceiling(device, n=8192 if full else 1024 if device == "cuda" else 256))
    notes = bench.Notes()
    rows = []
    for name in ("targets", "gqa", "split", "num_splits"):
        print(f"paged_attention, {name}: {len(s[name])} configurations")
        rows += bench_decode(device, s[name], ceilings, notes)
    print("reshape_and_cache, copy_blocks")
    rows += bench_cache_ops(device, s["cache_ops"], ceilings, notes)
    free(device)  # the caches went with bench_cache_ops's frame
    print("match_prefix")
    match_rows, tree = bench_match(device, s["match"], notes)
    rows += match_rows
    print(f"paged_prefill: {len(s['prefill'])} configurations, then the prefix one at "
          f"{len(s['prefill_block_size'])} block sizes")
    rows += bench_prefill(device, s["prefill"] + s["prefill_block_size"], ceilings, notes)
    ours = "default" if device == "cuda" else "cpu"
    extra = {"sizes": s, "headline_op": "paged_attention", "baseline": BASELINE,
             "targets": evaluate_targets(rows, ours), "match_prefix_tree": tree,
             "skipped": notes.skipped, "extension": flash_attention.EXTENSION,
             "versions": {"paged_attention": list(RUNGS), "paged_prefill_attention": list(PREFILL_RUNGS)},
             **prefill_extra(device),
             "check": {"q_std": Q_STD, "tolerance": {str(k).replace("torch.", ""): v for k, v in TOLERANCE.items()},
                       "rule": "|out - ref| <= atol + rtol |ref| against sdpa_contiguous and a float32 reference; "
                               "a mismatch raises"},
             "notes": ["block tables are random permutations of the block pool (no sequence's pages in order)",
                       "paged_attention timed with check_tables=False, reshape_and_cache with check_slots=False, "
                       "copy_blocks with check_mapping=False (a checked call syncs and cannot be captured)",
                       "config e (mixed lengths): SDPA runs over the padded cache with a boolean key-padding mask, "
                       "so not on its flash backend (efficient or math, SDPA's choice); repeat_kv is left out",
                       "targets are held to " + ours + ("" if device == "cuda" else
                                                        ": on the CPU they are a record, not a goal")],
             "timing": {"statistic": "median", "reps": bench.MIN_REPS,
                        "method": "perf_counter" if device == "cpu" else
                        "CUDA graph of the calls that make a replay last >= 2 ms (1 to 8), CUDA events around "
                        "each replay; one input set (every paged configuration moves >= 256 MiB), rotating sets "
                        "for the 256-token reshape_and_cache",
                        "max_call_ms": MAX_CALL_MS},
             "wall_s": time.perf_counter() - started}
    return rows, ceilings, extra


def main():
    parser = bench.arguments(__doc__)
    parser.add_argument("--prefill-only", action="store_true",
                        help=f"only the paged_prefill rows, written to {PREFILL_CHAPTER}.json")
    args = parser.parse_args()
    device, quick = bench.setup(args), args.quick
    if args.prefill_only:
        rows, ceilings, extra = measure_prefill(device, quick)
        return results.publish(PREFILL_CHAPTER, rows, ceilings, extra, make_prefill_figures, print_prefill_table)
    rows, ceilings, extra = measure_all(device, quick)
    return results.publish(CHAPTER, rows, ceilings, extra, make_figures, print_table)


if __name__ == "__main__":
    main()
