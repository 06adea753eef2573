"""Chapter 6, part 2 benchmark: decode attention over the paged KV cache, the cache's writes and
copies, and the radix tree's prefix lookup, against PyTorch doing the same in the same run.

Napkin math (the README's "Why decode is memory-bound"): a decode step of sequence b reads its
context_lens[b] cached tokens of K and V once,
    unique bytes = sum_b context_lens[b] * heads_kv * head_dim * 2 * itemsize  (+ q and out)
for 2 FLOPs per element and query head it serves: heads / heads_kv / itemsize FLOPs per byte,
2 in bf16 at 4 query heads per kv head, far below any GPU's ridge point. So the rows are GB/s
over those unique bytes and `pct_of_copy` against device copy measured in the same run. A
kernel that reads a kv head once per query head (per_head, repeat_kv) is still credited the
unique bytes only: its extra traffic shows as a lower share, which is the point of the GQA bars.

Rows (op, then variant):
- paged_attention at the issue's target configurations (bf16, head_dim 128, block_size 16, 32
  query heads): batch 64 x 4096 with 8 kv heads, 16 x 32768, 1 x 131072 (split-KV), 64 x 4096
  with 32 kv heads (no GQA), 64 sequences of uniform random length in [1, 8192]; and the first
  one again with block_size 32, in fp16, and at head_dim 64. Field "target" names them.
  Variants: every rung of flash_attention.VERSIONS["paged_attention"], `default` (version=None),
  and PyTorch: `sdpa_contiguous` (F.scaled_dot_product_attention with enable_gqa=True on an
  unpaged (batch, heads_kv, context, head_dim) cache: the ideal paging must approach; the
  speedup baseline), `sdpa_gathered` (gather each sequence's pages into that layout, then the
  same SDPA call, timed together), `repeat_kv` (K and V repeated to every query head, then SDPA
  without GQA: what a GQA-unaware attention costs). Mixed lengths give SDPA a key-padding mask.
- the same op with field sweep "gqa" (batch 64 x 4096, kv heads 32, 16, 8, 4) and sweep
  "split_kv" (batch 1-64 x context 1K-128K, 32/8 heads): the GQA bars and the split-KV crossover.
- reshape_and_cache (65536 tokens and a decode step's 64) and copy_blocks (2048 pairs), bytes
  read + written, against PyTorch's index_copy_ / index assignment doing the same.
- match_prefix: 4096 requests x 2048 tokens against a RadixCache of ~100k nodes, the CUDA kernel
  against the C++ CPU reference on the same flat tree; requests per second, results compared.

Every timed paged_attention variant is first compared with sdpa_contiguous (max_abs_err in the
row; a mismatch raises: a wrong kernel is never timed). The ops run with check_tables=False and
check_slots=False, as a server calls them (paged_ops.cpp: a checked call reads the tables back,
a device sync, and cannot be captured in a CUDA graph).

Timing as bench_attention.py: CUDA graphs of as many calls as last >= 2 ms, CUDA events around
each replay, median of 20; input sets rotated when one set would fit in L2 (bench.rotation_sets).
Run time on an H100: ~4 GB of caches per large configuration, ~20 timed configurations at ~2-3 s
each, plus building the 100k-node tree in Python (~10 s) and the CPU reference's lookup
(~1 s per call): about two minutes, recorded as wall_s.

    python bench_paged.py           full run on a GPU
    python bench_paged.py --quick   small sizes: CPU machines (the reference, variant "cpu"), smoke runs

Writes results/<device-slug>/chapter6_paged_attention.json and its plots beside it.
"""
import math
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_attention import Notes, attempt, calls_per_replay, first_line, probe  # noqa: E402
from coursekit import bench, plots, results  # noqa: E402

import flash_attention  # noqa: E402

CHAPTER = "chapter6_paged_attention"
BASELINE = "sdpa_contiguous"
RUNGS = flash_attention.VERSIONS["paged_attention"]
KV_CAP_GiB = 8.0      # sweep points whose K+V cache is larger are left out (the baselines double it)
ATOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}

# The targets: name -> (configuration, least % of copy, least x sdpa_contiguous or None)
TARGET_CONFIGS = {
    "b64_ctx4k_gqa4": dict(batch=64, context=4096, heads=32, heads_kv=8),
    "b16_ctx32k_gqa4": dict(batch=16, context=32768, heads=32, heads_kv=8),
    "b1_ctx128k_gqa4": dict(batch=1, context=131072, heads=32, heads_kv=8),
    "b64_ctx4k_mha": dict(batch=64, context=4096, heads=32, heads_kv=32),
    "b64_mixed_8k_gqa4": dict(batch=64, context=8192, heads=32, heads_kv=8, mixed=True),
}
TARGETS = {"b64_ctx4k_gqa4": (90, 0.95), "b16_ctx32k_gqa4": (90, 0.95), "b1_ctx128k_gqa4": (85, None),
           "b64_ctx4k_mha": (90, None), "b64_mixed_8k_gqa4": (80, None)}
CACHE_OP_TARGET = 85  # reshape_and_cache and copy_blocks: % of copy
# Variants of the first target configuration under other settings (no target of their own).
VARIATIONS = {"b64_ctx4k_gqa4_bs32": dict(block_size=32), "b64_ctx4k_gqa4_fp16": dict(dtype="float16"),
              "b64_ctx4k_gqa4_d64": dict(head_dim=64)}


# ---------------------------------------------------------------------------------------------
# Napkin math and the grid: pure functions (test_bench_paged.py holds them)
# ---------------------------------------------------------------------------------------------
def decode_bytes(context_lens, heads, heads_kv, head_dim, itemsize):
    """The least a decode step moves: every cached K and V element once, q read and out written."""
    batch = len(context_lens)
    return (sum(context_lens) * heads_kv * 2 + batch * heads * 2) * head_dim * itemsize


def kv_cache_bytes(batch, context, heads_kv, head_dim, itemsize):
    return batch * context * heads_kv * head_dim * 2 * itemsize


def config(batch, context, heads, heads_kv, head_dim=128, block_size=16, dtype="bfloat16", mixed=False, **extra):
    return dict(batch=batch, context=context, heads=heads, heads_kv=heads_kv, head_dim=head_dim,
                block_size=block_size, dtype=dtype, mixed=mixed, **extra)


def sizes_for(device, quick):
    """Every configuration of the run. The GPU's is the issue's; --quick and the CPU shrink the
    contexts and batches so the CPU reference (float32, one query row at a time) takes seconds."""
    if device == "cuda" and not quick:
        targets = {name: config(**c, target=name) for name, c in TARGET_CONFIGS.items()}
        first = TARGET_CONFIGS["b64_ctx4k_gqa4"]
        targets.update({name: config(**{**first, **change}, target=name) for name, change in VARIATIONS.items()})
        gqa = [config(64, 4096, 32, hkv, sweep="gqa") for hkv in (32, 16, 8, 4)]
        split = [config(b, n, 32, 8, sweep="split_kv") for b in (1, 4, 16, 64)
                 for n in (1024, 4096, 16384, 65536, 131072)]
        split = [c for c in split if kv_cache_bytes(c["batch"], c["context"], 8, 128, 2) <= KV_CAP_GiB * 2**30]
        return {"paged": list(targets.values()), "gqa": gqa, "split": split,
                "cache_ops": {"tokens": [65536, 64], "pairs": 2048, "num_blocks": 16384, "heads_kv": 8,
                              "head_dim": 128, "block_size": 16, "dtype": "bfloat16"},
                "match": {"requests": 4096, "tokens": 2048, "nodes": 100_000, "block_size": 16, "vocab": 32000}}
    small = "bfloat16" if device == "cuda" else "float32"
    return {"paged": [config(4, 300, 4, 2, head_dim=64, dtype=small, target="quick_gqa2"),
                      config(4, 200, 4, 2, head_dim=64, dtype=small, mixed=True, target="quick_mixed")],
            "gqa": [config(4, 256, 8, hkv, head_dim=64, dtype=small, sweep="gqa") for hkv in (8, 2)],
            "split": [config(b, n, 4, 2, head_dim=64, dtype=small, sweep="split_kv") for b in (1, 4)
                      for n in (64, 512)],
            "cache_ops": {"tokens": [512, 8], "pairs": 16, "num_blocks": 128, "heads_kv": 2, "head_dim": 64,
                          "block_size": 16, "dtype": small},
            "match": {"requests": 64, "tokens": 256, "nodes": 2000, "block_size": 16, "vocab": 1000}}


def context_lengths(c, seed=0):
    """Each sequence's context: all c["context"], or uniform in [1, context] when mixed."""
    if not c["mixed"]:
        return [c["context"]] * c["batch"]
    g = random.Random(seed)
    return [g.randint(1, c["context"]) for _ in range(c["batch"])]


def random_tables(context_lens, block_size, seed=0):
    """Block tables over a pool of exactly the blocks the sequences need, handed out in a random
    order: every sequence's blocks are scattered over the pool, none adjacent on purpose.
    Returns (tables as lists, num_blocks); entries past a sequence's blocks are 0, never read."""
    counts = [-(-n // block_size) for n in context_lens]
    pool = list(range(sum(counts)))
    random.Random(seed).shuffle(pool)
    width = max(counts + [1])
    tables, at = [], 0
    for n in counts:
        tables.append(pool[at:at + n] + [0] * (width - n))
        at += n
    return tables, max(len(pool), 1)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def timed_sets(device, fns, est_ms):
    """The median time of one call, rotating over len(fns) input sets (each its own callable):
    a CUDA graph on the GPU (events if the capture fails), the wall clock on the CPU."""
    if device != "cuda":
        return bench.time_cpu(fns[0], warmup=0)  # probe() was the warm-up
    try:
        calls = max(len(fns), calls_per_replay(est_ms))
        return bench.time_cuda_graph(lambda i: fns[i](), len(fns), min_calls=calls)
    except RuntimeError as e:
        print(f"  graph capture failed ({first_line(e)[:120]}); timing with events")
        torch.cuda.synchronize()
        return {**bench.time_cuda(fns[0]), "timer": "events (graph capture failed)"}


def input_sets(device, nbytes):
    return bench.rotation_sets(nbytes) if device == "cuda" else 1


# ---------------------------------------------------------------------------------------------
# Decode attention
# ---------------------------------------------------------------------------------------------
class DecodeInputs:
    """One configuration's tensors: the paged cache (shuffled tables), the query, and the same
    K/V gathered into SDPA's contiguous (batch, heads_kv, context, head_dim) layout."""

    def __init__(self, c, device, seed=0):
        dtype = getattr(torch, c["dtype"])
        g = torch.Generator(device=device).manual_seed(seed)
        self.lens = context_lengths(c, seed)
        tables, num_blocks = random_tables(self.lens, c["block_size"], seed)
        shape = (num_blocks, c["block_size"], c["heads_kv"], c["head_dim"])
        self.key_cache = torch.randn(shape, generator=g, device=device, dtype=dtype)
        self.value_cache = torch.randn(shape, generator=g, device=device, dtype=dtype)
        self.query = torch.randn(c["batch"], c["heads"], c["head_dim"], generator=g, device=device, dtype=dtype)
        self.tables = torch.tensor(tables, dtype=torch.int32, device=device)
        self.context_lens = torch.tensor(self.lens, dtype=torch.int32, device=device)
        self.max_len = max(self.lens)
        self.width = -(-self.max_len // c["block_size"])
        self.index = self.tables[:, :self.width].long()
        self.k, self.v = self.gather()
        # Mixed lengths: key j of sequence b is visible iff j < context_lens[b].
        self.mask = None
        if c["mixed"]:
            self.mask = (torch.arange(self.max_len, device=device)[None, :] < self.context_lens[:, None].long())
            self.mask = self.mask[:, None, None, :]
        self.group = c["heads"] // c["heads_kv"]

    def gather(self):
        """Each sequence's pages, in order, as (batch, heads_kv, max_len, head_dim) views."""
        batch = self.index.shape[0]

        def one(cache):
            pages = cache[self.index]  # (batch, width, block_size, heads_kv, head_dim)
            return pages.reshape(batch, -1, *cache.shape[2:])[:, :self.max_len].transpose(1, 2)
        return one(self.key_cache), one(self.value_cache)

    def sdpa(self, k, v, gqa=True):
        out = F.scaled_dot_product_attention(self.query.unsqueeze(2), k, v, attn_mask=self.mask, enable_gqa=gqa)
        return out.squeeze(2)

    def calls(self, device):
        """(variant, f()) for every variant of a decode row."""
        paged = lambda version: lambda: flash_attention.paged_attention(  # noqa: E731
            self.query, self.key_cache, self.value_cache, self.tables, self.context_lens, version=version,
            check_tables=False)
        k_contig, v_contig = self.k.contiguous(), self.v.contiguous()
        ours = [("cpu", paged(None))] if device != "cuda" else (
            [(ver, paged(ver)) for ver in RUNGS] + [("default", paged(None))])
        return ours + [
            (BASELINE, lambda: self.sdpa(k_contig, v_contig)),
            ("sdpa_gathered", lambda: self.sdpa(*self.gather())),
            ("repeat_kv", lambda: self.sdpa(k_contig.repeat_interleave(self.group, 1),
                                            v_contig.repeat_interleave(self.group, 1), gqa=False)),
        ]


def bench_decode(device, configs, ceilings, notes):
    rows = []
    for c in configs:
        where = c.get("target") or f"{c['sweep']} b={c['batch']} ctx={c['context']} hkv={c['heads_kv']}"
        x = attempt(notes, "inputs", where, lambda: DecodeInputs(c, device))
        if x is None:
            continue
        dtype = x.query.dtype
        nbytes = decode_bytes(x.lens, c["heads"], c["heads_kv"], c["head_dim"], x.query.element_size())
        # More input sets (other caches of the same shape) when one would stay in L2 between calls.
        others = [DecodeInputs(c, device, seed=i) for i in range(1, input_sets(device, nbytes))]
        calls = [dict(inputs.calls(device)) for inputs in [x] + others]
        reference = x.sdpa(x.k.contiguous(), x.v.contiguous()).float()
        timed_rows = []
        for variant, fn in calls[0].items():
            out = attempt(notes, variant, where, fn)
            if out is None:
                continue
            err = (out.float() - reference).abs().max().item()
            if not err <= ATOL.get(dtype, 1e-4):
                raise AssertionError(f"{variant} at {where}: max |out - {BASELINE}| = {err:.3g} "
                                     f"(tolerance {ATOL.get(dtype, 1e-4):.0e}); not timing a wrong kernel")
            fns = [set_calls[variant] for set_calls in calls]
            est = attempt(notes, variant, where, lambda: probe(fn, device))
            t = est is not None and attempt(notes, variant, where, lambda: timed_sets(device, fns, est))
            if not t:
                continue
            timed_rows.append(bench.bandwidth_row(
                "paged_attention", variant, dtype, [c["batch"], c["heads"], c["heads_kv"], c["context"], c["head_dim"]],
                nbytes, t, ceilings["copy_GBps"], None, batch=c["batch"], context=c["context"], heads=c["heads"],
                heads_kv=c["heads_kv"], head_dim=c["head_dim"], block_size=c["block_size"], mixed=c["mixed"],
                total_context=sum(x.lens), max_abs_err=err, baseline=BASELINE, input_sets=len(calls),
                **{k: c[k] for k in ("target", "sweep") if k in c}))
        base = next((r["median_ms"] for r in timed_rows if r["variant"] == BASELINE), None)
        for r in timed_rows:
            if base is not None:
                r["speedup_vs_torch"] = base / r["median_ms"]
        rows += timed_rows
        del x, others, calls, reference
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# Cache writes and copies
# ---------------------------------------------------------------------------------------------
def bench_cache_ops(device, s, ceilings, notes):
    dtype = getattr(torch, s["dtype"])
    hkv, d, bs, nb = s["heads_kv"], s["head_dim"], s["block_size"], s["num_blocks"]
    g = torch.Generator(device=device).manual_seed(3)
    rows = []
    key_cache = torch.zeros(nb, bs, hkv, d, device=device, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    slots_total = nb * bs
    for tokens in s["tokens"]:
        key = torch.randn(tokens, hkv, d, generator=g, device=device, dtype=dtype)
        value = torch.randn(tokens, hkv, d, generator=g, device=device, dtype=dtype)
        slots = torch.randperm(slots_total, generator=g, device=device)[:tokens]
        slots[::97] = -1  # a few padding tokens, as a batch padded to a fixed size has
        live = slots >= 0
        written = int(live.sum())
        nbytes = 2 * 2 * written * hkv * d * key.element_size()  # K and V, each read once and written once
        live_slots, live_key, live_value = slots[live], key[live], value[live]
        flat_k, flat_v = key_cache.view(-1, hkv, d), value_cache.view(-1, hkv, d)

        def torch_write():
            flat_k.index_copy_(0, live_slots, live_key)
            flat_v.index_copy_(0, live_slots, live_value)
        calls = [("cuda" if device == "cuda" else "cpu",
                  lambda: flash_attention.reshape_and_cache(key, value, key_cache, value_cache, slots, check_slots=False)),
                 ("torch_index_copy", torch_write)]
        rows += time_rows(device, "reshape_and_cache", calls, dtype, [tokens, hkv, d], nbytes, ceilings, notes,
                          "torch_index_copy", tokens=tokens, block_size=bs)
        # both wrote the same bytes: the op's result is checked against PyTorch's
        mine = key_cache.view(-1, hkv, d)[live_slots].clone()
        if not torch.equal(mine, live_key):
            raise AssertionError("reshape_and_cache: the cache does not hold the keys written")
    pairs = s["pairs"]
    order = torch.randperm(nb, generator=g, device=device)
    mapping = torch.stack([order[:pairs], order[pairs:2 * pairs]], dim=1).contiguous()
    block_bytes = bs * hkv * d * key_cache.element_size()
    nbytes = 2 * 2 * pairs * block_bytes
    src, dst = mapping[:, 0], mapping[:, 1]

    def torch_copy():
        key_cache[dst] = key_cache[src]
        value_cache[dst] = value_cache[src]
    key_cache.normal_(generator=g)
    value_cache.normal_(generator=g)
    calls = [("cuda" if device == "cuda" else "cpu",
              lambda: flash_attention.copy_blocks(key_cache, value_cache, mapping)),
             ("torch_index", torch_copy)]
    rows += time_rows(device, "copy_blocks", calls, dtype, [pairs, bs, hkv, d], nbytes, ceilings, notes,
                      "torch_index", pairs=pairs, block_size=bs)
    if not torch.equal(key_cache[dst], key_cache[src]):
        raise AssertionError("copy_blocks: a destination block differs from its source")
    return rows


def time_rows(device, op, calls, dtype, shape, nbytes, ceilings, notes, base, **extra):
    timings = {}
    for variant, fn in calls:
        est = attempt(notes, variant, op, lambda: probe(fn, device))
        t = est is not None and attempt(notes, variant, op, lambda: timed_sets(device, [fn], est))
        if t:
            timings[variant] = t
    t_base = timings.get(base, {}).get("median_ms")
    return [bench.bandwidth_row(op, v, dtype, shape, nbytes, t, ceilings["copy_GBps"], t_base, baseline=base, **extra)
            for v, t in timings.items()]


# ---------------------------------------------------------------------------------------------
# The prefix lookup
# ---------------------------------------------------------------------------------------------
def build_tree(s, seed=0):
    """A RadixCache of about s["nodes"] nodes and a pool of the sequences inserted into it. Each
    new sequence copies an earlier one, whole (the next turn of a chat) or up to a random block
    (another request after the same system prompt), then adds a tail of 1-8 blocks of its own:
    one node for the tail, and one more where it branches inside an edge and splits it. The
    pool keeps a bounded sample of the sequences (the bases of new ones and of the lookups), so
    the build stays within a few hundred MB of Python lists."""
    rng = random.Random(seed)
    bs, n, vocab = s["block_size"], s["tokens"], range(s["vocab"])
    tree = flash_attention.RadixCache(bs)
    pool, pool_size, next_block, nodes, inserts = [], 8192, 0, 1, 0
    check_every = max(100, s["nodes"] // 50)
    while nodes < s["nodes"]:
        base = rng.choice(pool) if pool else []
        # half continue a whole earlier sequence (the next turn of a chat), half branch inside it
        keep = (len(base) // bs if rng.random() < 0.5 else rng.randrange(0, len(base) // bs + 1)) * bs
        tail = min(n - keep, rng.randint(1, 8) * bs)
        seq = base[:keep] + rng.choices(vocab, k=tail)
        whole = len(seq) // bs
        tree.insert(seq, list(range(next_block, next_block + whole)))
        next_block += whole
        if len(pool) < pool_size:
            pool.append(seq)
        else:
            pool[rng.randrange(pool_size)] = seq
        inserts += 1
        if inserts % check_every == 0:
            nodes = sum(1 for _ in tree._nodes())
    return tree, pool


def lookup_batch(pool, s, seed=1):
    """Requests of s["tokens"] tokens: a third start with a whole cached sequence (the match
    covers it), a third branch from one at a random token (a partial match, ending inside a
    block or an edge), a third are new; each is filled up to the width with random tokens."""
    rng = random.Random(seed)
    n, vocab = s["tokens"], range(s["vocab"])
    rows = []
    for r in range(s["requests"]):
        base = rng.choice(pool)
        keep = len(base) if r % 3 == 0 else rng.randrange(len(base) + 1) if r % 3 == 1 else 0
        rows.append(base[:keep] + rng.choices(vocab, k=n - keep))
    return torch.tensor(rows, dtype=torch.int32)


def bench_match(device, s, notes):
    started = time.perf_counter()
    tree, pool = build_tree(s)
    build_s = time.perf_counter() - started
    flat = tree.flat_tree("cpu")
    nodes = int(flat[1].numel())
    queries = lookup_batch(pool, s)
    lens = torch.full((queries.shape[0],), queries.shape[1], dtype=torch.int32)
    cap = queries.shape[1] // s["block_size"]
    print(f"  radix tree: {nodes} nodes, {int(flat[0].numel())} tokens, built in {build_s:.1f} s")
    op = torch.ops.flash_attention.match_prefix
    cpu_call = lambda: op(*flat, s["block_size"], queries, lens, cap)  # noqa: E731
    expected = cpu_call()
    timings = {"cpu": bench.time_cpu(cpu_call, reps=5, warmup=0)}
    matches_cpu = None
    upload_ms = None
    if device == "cuda":
        t0 = time.perf_counter()
        flat_gpu = tree.flat_tree("cuda")
        torch.cuda.synchronize()
        upload_ms = (time.perf_counter() - t0) * 1e3
        q_gpu, lens_gpu = queries.cuda(), lens.cuda()
        gpu_call = lambda: op(*flat_gpu, s["block_size"], q_gpu, lens_gpu, cap)  # noqa: E731
        got = gpu_call()
        matches_cpu = all(torch.equal(a.cpu(), b) for a, b in zip(got, expected))
        if not matches_cpu:
            raise AssertionError("match_prefix: the CUDA lookup differs from the CPU reference")
        est = attempt(notes, "cuda", "match_prefix", lambda: probe(gpu_call, device))
        t = est is not None and attempt(notes, "cuda", "match_prefix", lambda: timed_sets(device, [gpu_call], est))
        if t:
            timings["cuda"] = t
    matched = expected[0].float()
    rows = []
    for variant, t in timings.items():
        rows.append({"op": "match_prefix", "variant": variant, "dtype": "int32", "shape": list(queries.shape),
                     **t, "requests_per_s": queries.shape[0] / (t["median_ms"] * 1e-3), "nodes": nodes,
                     "block_size": s["block_size"], "tree_build_s": build_s, "mirror_upload_ms": upload_ms,
                     "matches_cpu": matches_cpu, "mean_matched_tokens": matched.mean().item(),
                     "full_matches": int((matched == queries.shape[1]).sum()),
                     "speedup_vs_cpu": timings["cpu"]["median_ms"] / t["median_ms"], "baseline": "cpu"})
    return rows


# ---------------------------------------------------------------------------------------------
# Plots and the table
# ---------------------------------------------------------------------------------------------
ORDER = list(RUNGS) + ["default", "cpu", BASELINE, "sdpa_gathered", "repeat_kv"]
COLORS = {"per_head": "tab:blue", "per_kv_head": "tab:green", "split_kv": "tab:purple", "default": "tab:orange",
          "cpu": "tab:blue", BASELINE: "black", "sdpa_gathered": "grey", "repeat_kv": "tab:red"}


def bar_style(variant):
    return dict(color=COLORS.get(variant), hatch="//" if variant in ("sdpa_gathered", "repeat_kv") else None)


def line_style(variant):
    """PyTorch dashed, the default dispatch a wide pale band under the rungs (as plots._style)."""
    if variant == "default":
        return dict(color=COLORS["default"], linewidth=7, alpha=0.35, zorder=0, marker=None)
    return dict(color=COLORS.get(variant), linestyle="--" if variant in (BASELINE, "sdpa_gathered", "repeat_kv")
                else "-", marker="o", ms=3)


def config_label(r):
    ctx = f"ctx<={r['context']}" if r.get("mixed") else f"ctx {r['context']}"
    return f"b{r['batch']} {ctx} {r['heads']}/{r['heads_kv']} d{r['head_dim']} bs{r['block_size']} {r['dtype']}"


def plot_targets(ax, record):
    rows = [r for r in results.rows(record, op="paged_attention") if r.get("target")]
    names = list(dict.fromkeys(r["target"] for r in rows))
    variants = [v for v in ORDER if any(r["variant"] == v for r in rows)]
    width = 0.8 / max(len(variants), 1)
    for i, v in enumerate(variants):
        ys = [next((r["pct_of_copy"] for r in rows if r["target"] == n and r["variant"] == v), 0) for n in names]
        ax.bar([j + i * width for j in range(len(names))], ys, width, label=v, **bar_style(v))
    for j, n in enumerate(names):
        if n in record.get("targets", {}):
            ax.hlines(record["targets"][n]["pct_of_copy"], j - 0.1, j + 0.8, color="red", lw=1.5, ls=":")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
    ax.set_xticklabels([config_label(next(r for r in rows if r["target"] == n)) for n in names], rotation=20,
                       ha="right", fontsize=7)
    ax.set_ylabel("% of copy (unique K/V bytes)")
    ax.set_title("decode at the issue's configurations (red: target)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)


def plot_gqa(ax, record):
    rows = [r for r in results.rows(record, op="paged_attention") if r.get("sweep") == "gqa"]
    kvs = sorted({r["heads_kv"] for r in rows}, reverse=True)
    variants = [v for v in ORDER if any(r["variant"] == v for r in rows)]
    width = 0.8 / max(len(variants), 1)
    for i, v in enumerate(variants):
        ys = [next((r["pct_of_copy"] for r in rows if r["heads_kv"] == k and r["variant"] == v), 0) for k in kvs]
        ax.bar([j + i * width for j in range(len(kvs))], ys, width, label=v, **bar_style(v))
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kvs))])
    heads = rows[0]["heads"] if rows else 0
    ax.set_xticklabels([f"{heads}/{k} (group {heads // k})" for k in kvs], fontsize=8)
    ax.set_xlabel("query heads / kv heads")
    ax.set_ylabel("% of copy (unique K/V bytes)")
    ax.set_title("GQA: each kv head read once (per_kv_head) or once per query head", fontsize=9)
    ax.legend(fontsize=7, ncol=2)


def plot_split(axes, record):
    rows = [r for r in results.rows(record, op="paged_attention") if r.get("sweep") == "split_kv"]
    batches = sorted({r["batch"] for r in rows})
    for ax, b in zip(axes, batches):
        for v in ORDER:
            pts = sorted((r["context"], r["pct_of_copy"]) for r in rows if r["batch"] == b and r["variant"] == v)
            if pts:
                ax.plot(*zip(*pts), label=v, **line_style(v))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(f"batch {b}", fontsize=9)
        ax.grid(alpha=0.3)
    if batches:
        axes[0].set_ylabel("% of copy (unique K/V bytes)")
        axes[0].legend(fontsize=7)


def make_figures(record, out_dir):
    paths = []
    fig, (ax, ax_gqa) = plt.subplots(1, 2, figsize=(15, 5))
    plot_targets(ax, record)
    plot_gqa(ax_gqa, record)
    fig.suptitle(results.label(record), fontsize=10)
    fig.tight_layout()
    paths.append(plots.save(fig, out_dir / f"{CHAPTER}_targets.png"))
    batches = sorted({r["batch"] for r in results.rows(record, op="paged_attention") if r.get("sweep") == "split_kv"})
    if batches:
        fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 4), sharey=True, squeeze=False)
        plot_split(list(axes.flat), record)
        fig.suptitle(f"split-KV crossover, 32/8 heads: {results.label(record)}", fontsize=10)
        fig.tight_layout()
        paths.append(plots.save(fig, out_dir / f"{CHAPTER}_split_kv.png"))
    return paths


def target_lines(record):
    """(name, configuration, best course variant, % of copy, x sdpa_contiguous, target text, met)."""
    out = []
    for name, t in record.get("targets", {}).items():
        rows = [r for r in results.rows(record, op="paged_attention") if r.get("target") == name]
        ours = [r for r in rows if r["variant"] not in (BASELINE, "sdpa_gathered", "repeat_kv")]
        if not ours:
            continue
        best = max(ours, key=lambda r: r["pct_of_copy"])
        speed = best.get("speedup_vs_torch")
        met = best["pct_of_copy"] >= t["pct_of_copy"] and (t["vs_sdpa_contiguous"] is None or
                                                           (speed is not None and speed >= t["vs_sdpa_contiguous"]))
        want = f">= {t['pct_of_copy']}% of copy" + (
            f", >= {t['vs_sdpa_contiguous']}x {BASELINE}" if t["vs_sdpa_contiguous"] else "")
        out.append((name, config_label(best), best["variant"], best["pct_of_copy"], speed, want, met))
    for op in ("reshape_and_cache", "copy_blocks"):
        for r in results.rows(record, op=op):
            if r["variant"] in ("cuda",):
                out.append((op, results.format_shape(r["shape"]), r["variant"], r["pct_of_copy"],
                            r.get("speedup_vs_torch"), f">= {CACHE_OP_TARGET}% of copy",
                            r["pct_of_copy"] >= CACHE_OP_TARGET))
    return out


def print_table(record):
    print(f"\n{results.label(record)}; copy {record['ceilings']['copy_GBps']:.0f} GB/s")
    print(f"{'config':<44}{'variant':<17}{'us':>9}{'GB/s':>8}{'% copy':>8}{'x base':>8}")
    for r in record["benchmarks"]:
        if r["op"] == "match_prefix":
            continue
        label = config_label(r) if r["op"] == "paged_attention" else f"{r['op']} {results.format_shape(r['shape'])}"
        if r.get("sweep"):
            label = f"[{r['sweep']}] {label}"
        x = f"{r['speedup_vs_torch']:.2f}" if r.get("speedup_vs_torch") else "-"
        print(f"{label[:43]:<44}{r['variant']:<17}{r['median_ms'] * 1e3:>9.1f}{r['GBps']:>8.0f}"
              f"{r['pct_of_copy']:>8.1f}{x:>8}")
    for r in results.rows(record, op="match_prefix"):
        print(f"match_prefix {results.format_shape(r['shape'])} vs {r['nodes']} nodes: {r['variant']:<5} "
              f"{r['median_ms']:.2f} ms, {r['requests_per_s']:,.0f} requests/s, x cpu {r['speedup_vs_cpu']:.1f}"
              + (f", same as cpu: {r['matches_cpu']}" if r["matches_cpu"] is not None else ""))
    print("\ntargets:")
    for name, label, variant, pct, speed, want, met in target_lines(record):
        x = f"{speed:.2f}x" if speed else "-"
        print(f"  {name:<20}{label[:40]:<41}{variant:<12}{pct:>6.1f}% {x:>7}  {want:<42} {'met' if met else 'MISSED'}")


def main():
    started = time.perf_counter()
    device, quick = bench.start(__doc__)
    s = sizes_for(device, quick)
    full = device == "cuda" and not quick
    ceilings = bench.copy_ceiling(device, n=2**28 if full else 2**20)
    notes = Notes()
    rows = bench_decode(device, s["paged"] + s["gqa"] + s["split"], ceilings, notes)
    rows += bench_cache_ops(device, s["cache_ops"], ceilings, notes)
    rows += bench_match(device, s["match"], notes)
    targets = {name: {"pct_of_copy": pct, "vs_sdpa_contiguous": vs} for name, (pct, vs) in TARGETS.items()}
    extra = {"sizes": s, "headline_op": "paged_attention", "baseline": BASELINE, "skipped": notes.skipped,
             "targets": targets if full else {}, "cache_op_target_pct": CACHE_OP_TARGET,
             "extension": flash_attention.EXTENSION, "versions": {"paged_attention": list(RUNGS)},
             "timing": {"statistic": "median", "reps": bench.MIN_REPS,
                        "method": "perf_counter" if device == "cpu" else
                        "CUDA graph of the calls that make a replay last >= 2 ms, CUDA events around each "
                        "replay; input sets rotated past twice the L2 (bench.rotation_sets)",
                        "check_tables": False},
             "wall_s": time.perf_counter() - started}
    results.publish(CHAPTER, rows, ceilings, extra, make_figures, print_table)


if __name__ == "__main__":
    main()
