"""Tests for chapter 6's serving half: the paged KV cache writes and copies (reshape_and_cache,
copy_blocks), decode attention over the cache (paged_attention), the radix-tree prefix lookup
(match_prefix and flash_attention.RadixCache), every documented misuse, opcheck on each op, and
(marked cuda, skipped without a GPU) every CUDA rung against the CPU reference of the same inputs.

The attention reference is written here in plain PyTorch in float64: it gathers each sequence's
pages by hand (skipping, as paged.h says, the tokens of a block id outside the cache) and takes an
explicit softmax per sequence. The prefix lookup's reference is RadixCache.match_prefix_reference,
a walk over the Python tree, independent of the flat mirror the op reads.

Run against the installed extension (pip install .) or the JIT build (COURSE_EXT_ROUTE=jit).
"""
import math
import random

import pytest
import torch

import flash_attention
from coursekit.pytest_plugin import DTYPES, capture_and_replay, dtype_id, poison_allocator, require_cuda

OPS = torch.ops.flash_attention
CPU_DTYPES = (torch.float32, torch.float64)
HALF_DTYPES = (torch.float16, torch.bfloat16)
# The decode ladder as the package lists it (test_versions_table_lists_the_paged_ladder holds the
# list to the extension's own table).
PAGED_VERSIONS = flash_attention.VERSIONS.get("paged_attention", ())

# CPU tolerances (rtol, atol) against the float64 reference of the same inputs. float32 computes
# in float32: each score is a dot product of up to 128 terms of magnitude ~1, the output a convex
# combination of up to 3000 value rows of |v| ~ 1-4, the softmax's sums each a few ulps per term
# on average (1.2e-7 each): 2e-5 / 5e-5 is a wide margin, while a wrong block, row, head or scale
# errs by O(0.1). float64 is the same computation in double.
CPU_TOL = {torch.float32: (2e-5, 5e-5), torch.float64: (1e-10, 1e-10)}


@pytest.fixture(autouse=True)
def _seed_python_random(_seed):
    # The tables and trees are drawn with Python's random as well: seeded per test like torch.
    random.seed(torch.initial_seed())


# ---------------------------------------------------------------------------------------------
# Inputs and the references
# ---------------------------------------------------------------------------------------------
def make_cache(num_blocks, block_size, heads_kv, head_dim, dtype=torch.float32, device="cpu"):
    k = torch.randn(num_blocks, block_size, heads_kv, head_dim, dtype=torch.float64)
    v = torch.randn(num_blocks, block_size, heads_kv, head_dim, dtype=torch.float64) * 2 + 0.5
    return k.to(dtype).to(device), v.to(dtype).to(device)


def blocks_needed(context, block_size):
    return -(-context // block_size)


def make_tables(context_lens, block_size, num_blocks=None, width=None, junk=True):
    """(block_tables int32, context_lens int32, num_blocks): each sequence's blocks drawn from a
    shuffled pool, so that a sequence's pages are scattered over the cache in no order. The
    entries past a sequence's context hold junk (ids far outside the cache, negative ones): no
    check and no kernel may look at them."""
    needed = [blocks_needed(c, block_size) for c in context_lens]
    width = max(needed, default=0) if width is None else width
    num_blocks = sum(needed) + 3 if num_blocks is None else num_blocks
    pool = torch.randperm(num_blocks).tolist()
    rows = []
    for n in needed:
        row, pool = pool[:n], pool[n:]
        filler = [random.choice((-1, -(2 ** 31), num_blocks, 2 ** 31 - 1)) if junk else 0 for _ in range(width - n)]
        rows.append(row + filler)
    tables = torch.tensor(rows, dtype=torch.int32).reshape(len(context_lens), width)
    return tables, torch.tensor(context_lens, dtype=torch.int32), num_blocks


def reference_paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale=None):
    """out (batch, heads, head_dim) in float64, on the CPU: per sequence, its tokens gathered from
    the pages its table names, then softmax(scale q k^T) v. paged.h's rules for inputs nobody
    checked: the context is clamped to [0, what the row covers], and the tokens of a block id
    outside the cache are left out."""
    query, key_cache, value_cache = (t.detach().cpu().double() for t in (query, key_cache, value_cache))
    block_tables, context_lens = block_tables.cpu().long(), context_lens.cpu().long()
    num_blocks, block_size, heads_kv, head_dim = key_cache.shape
    batch, heads, _ = query.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(batch, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        context = min(max(int(context_lens[b]), 0), block_tables.shape[1] * block_size)
        j = torch.arange(context)
        block, row = block_tables[b, j // block_size], j % block_size
        present = (block >= 0) & (block < num_blocks)
        if not bool(present.any()):
            continue
        k = key_cache[block[present], row[present]].repeat_interleave(heads // heads_kv, dim=1)  # (n, heads, d)
        v = value_cache[block[present], row[present]].repeat_interleave(heads // heads_kv, dim=1)
        probs = torch.softmax(scale * torch.einsum("hd,nhd->hn", query[b], k), dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, v)
    return out


def assert_paged(out, ref, dtype, what=""):
    rtol, atol = CPU_TOL[dtype]
    assert out.dtype == dtype and out.shape == ref.shape, (what, out.dtype, out.shape)
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def edge_lengths(block_size):
    """The context lengths around a page boundary, and none at all."""
    return [1, block_size - 1, block_size, block_size + 1, 0]


# (batch's context lengths, heads, heads_kv, head_dim, block_size): one page, a page +- 1, many
# pages, a prime head_dim and block_size, GQA 4:1 and multi-query 8:1, a long context.
CPU_SHAPES = [
    ([1, 15, 16, 17, 0], 2, 2, 64, 16),
    ([5, 1, 40, 33], 8, 2, 32, 8),
    ([7, 13, 3, 29, 31], 4, 4, 7, 5),
    ([300, 129], 8, 1, 128, 32),
    ([3000], 4, 2, 64, 16),
    ([2, 1], 6, 3, 1, 1),
]


def shape_id(shape):
    lens, heads, heads_kv, head_dim, block_size = shape
    return f"ctx{'-'.join(map(str, lens))}h{heads}kv{heads_kv}d{head_dim}bs{block_size}"


# ---------------------------------------------------------------------------------------------
# 1. paged_attention against the reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=shape_id)
def test_paged_attention_matches_reference(shape, dtype):
    lens, heads, heads_kv, head_dim, block_size = shape
    tables, context_lens, num_blocks = make_tables(lens, block_size)
    key_cache, value_cache = make_cache(num_blocks, block_size, heads_kv, head_dim, dtype)
    query = torch.randn(len(lens), heads, head_dim, dtype=torch.float64).to(dtype)
    ref = reference_paged_attention(query, key_cache, value_cache, tables, context_lens)
    poison_allocator(ref.to(dtype))
    out = flash_attention.paged_attention(query, key_cache, value_cache, tables, context_lens)
    assert_paged(out, ref, dtype, shape_id(shape))
    assert torch.all(out[context_lens == 0] == 0), "a sequence with context 0 gets zeros"


def test_paged_attention_matches_contiguous_attention():
    """The same sequence laid out contiguously and read by the training half's attention (one
    query row at the end of the keys, bottom-right causal = sees them all): a second witness."""
    block_size, context, heads, heads_kv, head_dim = 16, 77, 4, 2, 32
    tables, context_lens, num_blocks = make_tables([context], block_size)
    key_cache, value_cache = make_cache(num_blocks, block_size, heads_kv, head_dim, torch.float64)
    query = torch.randn(1, heads, head_dim, dtype=torch.float64)
    pages = tables[0, :blocks_needed(context, block_size)].long()
    k = key_cache[pages].flatten(0, 1)[:context].transpose(0, 1)[None]  # (1, heads_kv, context, d)
    v = value_cache[pages].flatten(0, 1)[:context].transpose(0, 1)[None]
    expected = flash_attention.attention(query[:, :, None], k, v, causal=True)[:, :, 0]
    out = flash_attention.paged_attention(query, key_cache, value_cache, tables, context_lens)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scale", (0.05, 1.0, 3.0))
def test_scale_is_used(scale):
    tables, lens, num_blocks = make_tables([19, 4], 8)
    key_cache, value_cache = make_cache(num_blocks, 8, 2, 16, torch.float64)
    query = torch.randn(2, 4, 16, dtype=torch.float64)
    out = flash_attention.paged_attention(query, key_cache, value_cache, tables, lens, scale=scale)
    assert_paged(out, reference_paged_attention(query, key_cache, value_cache, tables, lens, scale), torch.float64)


def strided_query(batch, heads, head_dim, dtype=torch.float32, device="cpu"):
    """query as the middle third of a fused (batch, 3 * heads, head_dim) projection that starts
    one element into its buffer: strided, and misaligned by one element (heads * head_dim even)."""
    buffer = torch.randn(batch * 3 * heads * head_dim + 1, device=device).to(dtype)
    query = buffer[1:].view(batch, 3 * heads, head_dim)[:, heads:2 * heads]
    assert not query.is_contiguous() and query.storage_offset() % 2 == 1
    return query


def test_strided_query_and_tables():
    """A strided, misaligned query and a table that is a column slice of a wider one are read in
    place: the same bits as contiguous copies."""
    batch, heads, heads_kv, head_dim, block_size = 3, 4, 2, 16, 8
    tables, lens, num_blocks = make_tables([9, 30, 1], block_size, width=6)
    wide = torch.cat([torch.full((batch, 2), -5, dtype=torch.int32), tables], dim=1)
    strided_tables = wide[:, 2:]
    query = strided_query(batch, heads, head_dim)
    col_major = tables.t().contiguous().t()  # column stride 3: copied to rows by the glue
    assert not strided_tables.is_contiguous() and col_major.stride(1) != 1
    key_cache, value_cache = make_cache(num_blocks, block_size, heads_kv, head_dim)
    expected = flash_attention.paged_attention(query.contiguous(), key_cache, value_cache, tables, lens)
    for t in (strided_tables, col_major):
        assert torch.equal(flash_attention.paged_attention(query, key_cache, value_cache, t, lens), expected)
    assert_paged(expected, reference_paged_attention(query, key_cache, value_cache, tables, lens), torch.float32)


def test_shared_blocks():
    """Two sequences that share their prefix's pages (a cached prompt) and the same query see the
    same scores over it; the reference and the op agree on both."""
    block_size = 4
    key_cache, value_cache = make_cache(10, block_size, 1, 8, torch.float64)
    tables = torch.tensor([[3, 7, 1], [3, 7, 2]], dtype=torch.int32)
    lens = torch.tensor([10, 12], dtype=torch.int32)
    query = torch.randn(2, 2, 8, dtype=torch.float64)
    out = flash_attention.paged_attention(query, key_cache, value_cache, tables, lens)
    assert_paged(out, reference_paged_attention(query, key_cache, value_cache, tables, lens), torch.float64)
    lens_prefix = torch.tensor([8, 8], dtype=torch.int32)
    same_query = query[:1].expand(2, 2, 8)
    out = flash_attention.paged_attention(same_query, key_cache, value_cache, tables, lens_prefix)
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("batch,heads", [(0, 4), (3, 0)])
def test_empty(batch, heads):
    key_cache, value_cache = make_cache(4, 8, 2, 16)
    query = torch.randn(batch, heads, 16)
    tables = torch.zeros(batch, 2, dtype=torch.int32)
    lens = torch.full((batch,), 5, dtype=torch.int32)
    assert flash_attention.paged_attention(query, key_cache, value_cache, tables, lens).shape == (batch, heads, 16)


def test_empty_cache_and_table():
    """No blocks at all and tables of width 0: every context must be 0, and gives zeros."""
    key_cache, value_cache = make_cache(0, 16, 2, 8)
    query = torch.randn(2, 2, 8)
    out = flash_attention.paged_attention(query, key_cache, value_cache, torch.zeros(2, 0, dtype=torch.int32),
                                          torch.zeros(2, dtype=torch.int32))
    assert torch.equal(out, torch.zeros_like(out))


def test_unchecked_tables_follow_the_memory_safety_rules():
    """check_tables=False with every kind of bad value: the op must not fail or read outside the
    cache, and must give paged.h's answer (blocks outside the cache add no tokens, the context
    is clamped to [0, what the row covers]): what the CUDA kernels are held to as well."""
    block_size, num_blocks = 4, 6
    key_cache, value_cache = make_cache(num_blocks, block_size, 2, 8, torch.float64)
    tables = torch.tensor([[0, 9, 2], [1, -3, 4], [5, 2, 3], [3, 2, 1], [2 ** 31 - 1, -(2 ** 31), 0]],
                          dtype=torch.int32)
    lens = torch.tensor([11, 12, 500, -7, 9], dtype=torch.int32)
    query = torch.randn(5, 4, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"paged_attention: context_lens\[2\] is 500 but its block_tables row"):
        flash_attention.paged_attention(query, key_cache, value_cache, tables, lens)
    out = flash_attention.paged_attention(query, key_cache, value_cache, tables, lens, check_tables=False)
    ref = reference_paged_attention(query, key_cache, value_cache, tables, lens)
    assert_paged(out, ref, torch.float64)
    assert torch.equal(out[3], torch.zeros(4, 8, dtype=torch.float64))  # negative context: nothing visible


def test_unused_table_entries_are_not_checked():
    """Junk past a sequence's context (make_tables puts ids far outside the cache there) passes
    check_tables=True: only the entries a context uses must be blocks of the cache."""
    tables, lens, num_blocks = make_tables([3, 20, 0], 8, width=5)
    assert bool(((tables < 0) | (tables >= num_blocks)).any())
    key_cache, value_cache = make_cache(num_blocks, 8, 1, 4, torch.float64)
    query = torch.randn(3, 2, 4, dtype=torch.float64)
    out = flash_attention.paged_attention(query, key_cache, value_cache, tables, lens)
    assert_paged(out, reference_paged_attention(query, key_cache, value_cache, tables, lens), torch.float64)


def test_default_scale():
    tables, lens, num_blocks = make_tables([10], 4)
    key_cache, value_cache = make_cache(num_blocks, 4, 1, 9, torch.float64)
    query = torch.randn(1, 1, 9, dtype=torch.float64)
    assert torch.equal(flash_attention.paged_attention(query, key_cache, value_cache, tables, lens),
                       flash_attention.paged_attention(query, key_cache, value_cache, tables, lens, scale=1 / 3))


@pytest.mark.parametrize("version", PAGED_VERSIONS)
def test_cpu_accepts_every_version_name(version):
    """version= names a CUDA rung; on the CPU every name runs the reference (a typo still fails:
    the misuse cases below)."""
    tables, lens, num_blocks = make_tables([9, 2], 4)
    key_cache, value_cache = make_cache(num_blocks, 4, 2, 8, torch.float64)
    query = torch.randn(2, 4, 8, dtype=torch.float64)
    out = flash_attention.paged_attention(query, key_cache, value_cache, tables, lens, version=version)
    assert torch.equal(out, flash_attention.paged_attention(query, key_cache, value_cache, tables, lens))


def test_cpu_takes_num_splits_and_does_not_split():
    """num_splits is checked on the CPU as on CUDA, then ignored: the reference never splits."""
    tables, lens, num_blocks = make_tables([9, 2], 4)
    key_cache, value_cache = make_cache(num_blocks, 4, 2, 8, torch.float64)
    query = torch.randn(2, 4, 8, dtype=torch.float64)
    out = flash_attention.paged_attention(query, key_cache, value_cache, tables, lens, num_splits=5)
    assert torch.equal(out, flash_attention.paged_attention(query, key_cache, value_cache, tables, lens))


def test_versions_table_lists_the_paged_ladder():
    assert "paged_attention" in flash_attention.VERSIONS, "flash_attention.VERSIONS has no paged_attention entry"
    assert list(flash_attention.VERSIONS["paged_attention"]) == OPS.versions("paged_attention")


def test_meta_tensors_give_shapes():
    query = torch.empty(3, 8, 128, device="meta", dtype=torch.bfloat16)
    key_cache = torch.empty(50, 16, 2, 128, device="meta", dtype=torch.bfloat16)
    tables = torch.empty(3, 7, device="meta", dtype=torch.int32)
    lens = torch.empty(3, device="meta", dtype=torch.int32)
    out = flash_attention.paged_attention(query, key_cache, key_cache, tables, lens)
    assert out.shape == query.shape and out.dtype == torch.bfloat16 and out.device.type == "meta"
    with pytest.raises(RuntimeError, match=r"paged_attention: unknown version 'v3'"):
        flash_attention.paged_attention(query, key_cache, key_cache, tables, lens, version="v3")


# ---------------------------------------------------------------------------------------------
# 2. reshape_and_cache and copy_blocks (all four dtypes: they move bytes)
# ---------------------------------------------------------------------------------------------
def nan_cache(num_blocks, block_size, heads_kv, head_dim, dtype, device="cpu"):
    return tuple(torch.full((num_blocks, block_size, heads_kv, head_dim), math.nan, dtype=dtype, device=device)
                 for _ in range(2))


def random_slots(tokens, num_slots, padding=0):
    """Distinct slots scattered over the cache, `padding` of them -1 at random places."""
    slots = torch.randperm(num_slots)[:tokens]
    slots[torch.randperm(tokens)[:padding]] = -1
    return slots


def expected_after_write(cache, rows, slots):
    expected = cache.clone()
    keep = slots >= 0
    expected.view(-1, *cache.shape[2:])[slots[keep]] = rows[keep]
    return expected


def assert_same_bits(out, expected, what=""):
    """Equal element for element, NaN where NaN is expected (the slots nobody wrote)."""
    assert out.dtype == expected.dtype and out.shape == expected.shape, what
    assert torch.equal(out.isnan(), expected.isnan()), f"{what}: written where it must not be, or not written"
    assert torch.equal(out.nan_to_num(0.0), expected.nan_to_num(0.0)), f"{what}: wrong values"


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_reshape_and_cache(dtype):
    num_blocks, block_size, heads_kv, head_dim, tokens = 9, 4, 3, 8, 23
    key_cache, value_cache = nan_cache(num_blocks, block_size, heads_kv, head_dim, dtype)
    # key and value as slices of fused projections, one element off
    key, value = strided_query(tokens, heads_kv, head_dim, dtype), strided_query(tokens, heads_kv, head_dim, dtype)
    slots = random_slots(tokens, num_blocks * block_size, padding=5)
    expected_k = expected_after_write(key_cache, key, slots)
    expected_v = expected_after_write(value_cache, value, slots)
    flash_attention.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert_same_bits(key_cache, expected_k, "key_cache")
    assert_same_bits(value_cache, expected_v, "value_cache")


def test_reshape_and_cache_unchecked_slots_are_skipped():
    """check_slots=False: a slot outside the cache is skipped like -1 (paged.h), never written."""
    key_cache, value_cache = nan_cache(2, 4, 1, 4, torch.float32)
    key, value = torch.randn(4, 1, 4), torch.randn(4, 1, 4)
    slots = torch.tensor([8, 3, -9, 2 ** 40])
    flash_attention.reshape_and_cache(key, value, key_cache, value_cache, slots, check_slots=False)
    written = torch.tensor([-1, 3, -1, -1])
    assert_same_bits(key_cache, expected_after_write(nan_cache(2, 4, 1, 4, torch.float32)[0], key, written))


def test_reshape_and_cache_no_tokens():
    key_cache, value_cache = nan_cache(2, 4, 1, 4, torch.float32)
    flash_attention.reshape_and_cache(torch.randn(0, 1, 4), torch.randn(0, 1, 4), key_cache, value_cache,
                                      torch.zeros(0, dtype=torch.int64))
    assert key_cache.isnan().all() and value_cache.isnan().all()


def random_mapping(num_blocks, pairs, repeat_sources=True):
    """(pairs, 2) of (src, dst): distinct destinations, none of them a source; a source may be
    copied to several destinations (one shared block, forked by several sequences)."""
    perm = torch.randperm(num_blocks)
    dst = perm[:pairs]
    sources = perm[pairs:]
    src = sources[torch.randint(len(sources), (pairs,))] if repeat_sources else sources[:pairs]
    return torch.stack([src, dst], dim=1)


def expected_after_copy(cache, mapping):
    expected = cache.clone()
    expected[mapping[:, 1]] = cache[mapping[:, 0]]
    return expected


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_copy_blocks(dtype):
    key_cache, value_cache = make_cache(20, 3, 2, 5, dtype)
    mapping = random_mapping(20, 7)
    expected_k, expected_v = expected_after_copy(key_cache, mapping), expected_after_copy(value_cache, mapping)
    flash_attention.copy_blocks(key_cache, value_cache, mapping)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_copy_blocks_unchecked_mapping_skips_outside_pairs():
    """check_mapping=False: a pair naming a block outside the cache is skipped (paged.h), never
    read or written; the valid pairs still copy."""
    key_cache, value_cache = make_cache(10, 3, 2, 5)
    mapping = torch.tensor([[1, 4], [2, 10], [-3, 5], [7, 6]])
    good = mapping[[0, 3]]
    expected_k, expected_v = expected_after_copy(key_cache, good), expected_after_copy(value_cache, good)
    flash_attention.copy_blocks(key_cache, value_cache, mapping, check_mapping=False)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_copy_blocks_empty_mapping():
    key_cache, value_cache = make_cache(4, 3, 2, 5)
    before = key_cache.clone(), value_cache.clone()
    flash_attention.copy_blocks(key_cache, value_cache, torch.zeros(0, 2, dtype=torch.int64))
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])


def test_decode_step_end_to_end():
    """A decode step as a server runs it: append each sequence's new token (one of them forking a
    shared last block first: copy-on-write), then attend. Against attention over the sequences
    kept as plain tensors."""
    block_size, heads, heads_kv, head_dim = 4, 4, 2, 8
    num_blocks = 16
    key_cache, value_cache = make_cache(num_blocks, block_size, heads_kv, head_dim, torch.float64)
    # sequence 1 forked from sequence 0 after 6 tokens: blocks 5 (full) and 9 (half) shared
    tables = torch.tensor([[5, 9, -1], [5, 9, -1]], dtype=torch.int32)
    lens = [6, 6]
    flash_attention.copy_blocks(key_cache, value_cache, torch.tensor([[9, 2]]))  # sequence 1 appends: fork 9
    tables[1, 1] = 2
    new_k = torch.randn(2, heads_kv, head_dim, dtype=torch.float64)
    new_v = torch.randn(2, heads_kv, head_dim, dtype=torch.float64)
    slots = torch.tensor([9 * block_size + 2, 2 * block_size + 2])
    flash_attention.reshape_and_cache(new_k, new_v, key_cache, value_cache, slots)
    lens = torch.tensor([7, 7], dtype=torch.int32)
    query = torch.randn(2, heads, head_dim, dtype=torch.float64)
    out = flash_attention.paged_attention(query, key_cache, value_cache, tables, lens)
    for b in range(2):
        k = torch.cat([key_cache[5], key_cache[int(tables[b, 1])]])[:7].transpose(0, 1)[None]
        v = torch.cat([value_cache[5], value_cache[int(tables[b, 1])]])[:7].transpose(0, 1)[None]
        assert torch.equal(k[0, :, 6], new_k[b]) and torch.equal(v[0, :, 6], new_v[b])
        expected = flash_attention.attention(query[b:b + 1, :, None], k, v)[:, :, 0]
        torch.testing.assert_close(out[b:b + 1], expected, rtol=1e-10, atol=1e-10)
    assert not torch.equal(out[0], out[1])


# ---------------------------------------------------------------------------------------------
# 3. The prefix lookup: match_prefix and RadixCache
# ---------------------------------------------------------------------------------------------
def random_radix(block_size, sequences, vocab, max_len, seed_tokens=()):
    """A RadixCache from random insertions over a tiny vocabulary (so that branches share
    prefixes and siblings share first tokens), the token lists inserted, and the next free id."""
    cache = flash_attention.RadixCache(block_size)
    inserted, next_id = [], 100
    for i in range(sequences):
        base = list(random.choice(inserted)) if inserted and random.random() < 0.6 else list(seed_tokens)
        keep = random.randint(0, len(base))
        tokens = base[:keep] + [random.randrange(vocab) for _ in range(random.randint(0, max_len - keep))]
        whole = len(tokens) // block_size
        cached = cache.insert(tokens, list(range(next_id, next_id + whole)))
        assert 0 <= cached <= whole
        next_id += whole
        inserted.append(tokens)
    return cache, inserted, next_id


def lookup_requests(inserted, vocab, block_size, count):
    """Requests that follow a cached sequence for a while and then diverge, whole cached
    sequences, random ones, short ones and empty ones."""
    requests = []
    for i in range(count):
        kind = i % 5
        if kind == 0 and inserted:
            base = random.choice(inserted)
            cut = random.randint(0, len(base))
            requests.append(base[:cut] + [random.randrange(vocab) for _ in range(random.randint(0, 3 * block_size))])
        elif kind == 1 and inserted:
            requests.append(list(random.choice(inserted)))
        elif kind == 2:
            requests.append([random.randrange(vocab) for _ in range(random.randint(0, 6 * block_size))])
        elif kind == 3:
            requests.append([random.randrange(vocab) for _ in range(random.randint(0, block_size))])
        else:
            requests.append([])
    return requests


def assert_matches_reference(cache, requests, tokens, blocks, max_match_blocks=None, what=""):
    width = blocks.shape[1]
    for r, request in enumerate(requests):
        ref_tokens, ref_blocks = cache.match_prefix_reference(request, max_match_blocks=max_match_blocks)
        assert int(tokens[r]) == ref_tokens, (what, r, request, int(tokens[r]), ref_tokens)
        assert blocks[r].tolist() == ref_blocks + [-1] * (width - len(ref_blocks)), (what, r, request)


@pytest.mark.parametrize("block_size,vocab", [(1, 3), (2, 2), (4, 3), (16, 2)])
def test_match_prefix_random_trees(block_size, vocab):
    cache, inserted, _ = random_radix(block_size, 40, vocab, 8 * block_size)
    requests = lookup_requests(inserted, vocab, block_size, 60)
    tokens, blocks = cache.match_prefix(requests)
    assert tokens.dtype == torch.int32 and blocks.dtype == torch.int32
    assert_matches_reference(cache, requests, tokens, blocks)
    # whole cached sequences match all their whole blocks
    for seq in inserted[:10]:
        assert cache.match_prefix_reference(seq)[0] == len(seq) // block_size * block_size


def test_match_prefix_empty_tree():
    cache = flash_attention.RadixCache(4)
    tokens, blocks = cache.match_prefix([[1, 2, 3, 4, 5], [], [7] * 9])
    assert tokens.tolist() == [0, 0, 0] and torch.all(blocks == -1) and blocks.shape == (3, 2)
    assert [t.numel() for t in cache.flat_tree()] == [0, 1, 1, 1, 0, 1, 1, 0]


def test_match_prefix_full_partial_and_no_match():
    cache = flash_attention.RadixCache(2)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7], [10, 11, 12]) == 0  # 7 tokens: 3 whole blocks
    requests = [[1, 2, 3, 4, 5, 6, 7],   # full match: the whole blocks
                [1, 2, 3, 4, 5, 9],      # diverges in block 2: blocks 0-1
                [1, 2, 3],               # a partial block never matches
                [2, 1, 3, 4],            # no match in the first block
                [1, 9, 3, 4]]            # first token agrees, the block does not
    tokens, blocks = cache.match_prefix(requests)
    assert tokens.tolist() == [6, 4, 2, 0, 0]
    assert blocks.tolist() == [[10, 11, 12], [10, 11, -1], [10, -1, -1], [-1, -1, -1], [-1, -1, -1]]


def test_match_prefix_siblings_share_a_first_token():
    """Children that start with the same token and differ later in their first block: the
    mirror sorts them by first token, and the lookup must compare whole blocks to choose."""
    cache = flash_attention.RadixCache(3)
    cache.insert([5, 1, 1, 8, 8, 8], [1, 2])
    cache.insert([5, 1, 2, 9, 9, 9], [3, 4])
    cache.insert([5, 0, 7], [5])
    cache.insert([4, 4, 4], [6])
    tokens, token_start, span_blocks, _, _, child_start, child_count, child_index = cache.flat_tree()
    root_children = child_index[int(child_start[0]):int(child_start[0]) + int(child_count[0])].long()
    firsts = tokens[token_start[root_children]].tolist()
    assert firsts == sorted(firsts) and firsts.count(5) == 3
    requests = [[5, 1, 2, 9, 9, 9], [5, 1, 1, 8, 8, 0], [5, 0, 7, 1], [5, 1, 3, 9, 9, 9], [4, 4, 4, 4]]
    matched, blocks = cache.match_prefix(requests)
    assert matched.tolist() == [6, 3, 3, 0, 3]
    assert blocks.tolist() == [[3, 4], [1, -1], [5, -1], [-1, -1], [6, -1]]


def test_match_prefix_lengths_and_cap():
    """lengths cut each request short (the rest of its row is padding); max_match_blocks caps
    how many blocks are reported, and matched_tokens with them."""
    cache = flash_attention.RadixCache(2)
    cache.insert(list(range(10)), list(range(100, 105)))
    queries = torch.tensor([list(range(10))] * 4, dtype=torch.int64)  # any integer dtype goes in
    tokens, blocks = cache.match_prefix(queries, [10, 5, 0, 1])
    assert tokens.tolist() == [10, 4, 0, 0] and blocks.shape == (4, 5)
    tokens, blocks = cache.match_prefix(queries, [10, 5, 0, 1], max_match_blocks=1)
    assert tokens.tolist() == [2, 2, 0, 0] and blocks.tolist() == [[100], [100], [-1], [-1]]
    tokens, blocks = cache.match_prefix(queries, max_match_blocks=0)
    assert tokens.tolist() == [0] * 4 and blocks.shape == (4, 0)


def test_insert_splits_edges_and_counts_cached_blocks():
    cache = flash_attention.RadixCache(2)
    assert cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == 0
    assert cache.insert([1, 2, 3, 4, 5, 6, 7], [20, 21, 22, 23]) == 3    # all cached (7 is a partial block)
    assert cache.insert([1, 2, 3, 4, 9, 9], [30, 31, 32]) == 2          # splits the edge after two blocks
    assert cache.insert([1, 2, 7, 7], [40, 41]) == 1                      # splits again, after one
    assert cache.num_blocks == 5  # 10 11 12, 32, 41: the cached blocks keep the tree's own ids
    assert cache.match_prefix_reference([1, 2, 3, 4, 9, 9]) == (6, [10, 11, 32])
    assert cache.match_prefix_reference([1, 2, 7, 7, 7]) == (4, [10, 41])
    with pytest.raises(ValueError, match=r"insert: 6 tokens make 3 whole blocks of 2 but only 2 block ids"):
        cache.insert([1, 2, 3, 4, 5, 6], [1, 2])


def test_mirror_is_rebuilt_only_after_a_change():
    cache = flash_attention.RadixCache(2)
    cache.insert([1, 2, 3, 4], [7, 8])
    first = cache.flat_tree()
    assert cache.flat_tree() is first
    cache.insert([1, 2, 3, 4], [9, 9])  # nothing new: the mirror stands
    assert cache.flat_tree() is first
    cache.insert([1, 2, 5, 5], [9, 10])
    assert cache.flat_tree() is not first
    assert cache.match_prefix([[1, 2, 5, 5]])[0].tolist() == [4]
    cache.evict(10)
    assert cache.match_prefix([[1, 2, 5, 5]])[0].tolist() == [0]


def test_evict_lru_leaves_and_locks():
    cache = flash_attention.RadixCache(1)
    cache.insert([1, 2, 3], [10, 11, 12])    # oldest
    cache.insert([1, 2, 4], [10, 11, 13])    # splits [1 2 3] after two blocks
    cache.insert([5, 6], [14, 15])
    cache.insert([1, 2, 4, 7], [0, 0, 0, 16])  # touches 1 2 4 again: most recent
    handle = cache.lock([5, 6, 9])
    assert handle.block_ids == [14, 15] and handle.num_tokens == 2
    # leaves by age: [3] (12), then [7] (16); [5 6] is locked; [4] becomes a leaf after [7]
    assert cache.evict(1) == [12]
    assert cache.evict(2) == [16, 13]
    assert cache.evict(10) == [10, 11]       # the shared prefix, once nothing hangs below it
    assert cache.num_blocks == 2             # only the locked [5 6]
    cache.unlock(handle)
    with pytest.raises(ValueError, match=r"unlock: this PrefixLock was released already"):
        cache.unlock(handle)
    assert cache.evict(1) == [14, 15] and cache.num_blocks == 0


def test_lock_survives_a_split():
    """A lock on a node whose edge a later insert splits still pins the whole path."""
    cache = flash_attention.RadixCache(2)
    cache.insert([1, 1, 2, 2, 3, 3], [10, 11, 12])
    handle = cache.lock([1, 1, 2, 2, 3, 3])
    cache.insert([1, 1, 9, 9], [0, 20])      # splits the locked edge after one block
    assert sorted(cache.evict(100)) == [20]  # the locked path stays whole
    assert cache.match_prefix_reference([1, 1, 2, 2, 3, 3]) == (6, [10, 11, 12])
    cache.unlock(handle)
    assert sorted(cache.evict(100)) == [10, 11, 12]


def test_evict_conserves_blocks():
    """Random inserts, locks and evictions: every block id the tree adopted comes back from
    evict exactly once, and locked blocks never do while locked."""
    cache, inserted, _ = random_radix(2, 30, 3, 16)
    adopted = sorted(b for node in cache._nodes() for b in node.blocks)
    handles = [cache.lock(seq) for seq in inserted[:5]]
    locked = {b for h in handles for b in h.block_ids}
    freed = cache.evict(10 ** 6)
    assert not locked & set(freed)
    for h in handles:
        cache.unlock(h)
    freed += cache.evict(10 ** 6)
    assert sorted(freed) == adopted and cache.num_blocks == 0


# ---------------------------------------------------------------------------------------------
# 4. opcheck
# ---------------------------------------------------------------------------------------------
def _opcheck_calls(device="cpu"):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    block_size, head_dim = 16, 64
    tables, lens, num_blocks = make_tables([1, 17, 40], block_size, junk=False)
    key_cache, value_cache = make_cache(num_blocks, block_size, 2, head_dim, dtype, device)
    query = torch.randn(3, 4, head_dim, device=device).to(dtype)
    key = torch.randn(5, 2, head_dim, device=device).to(dtype)
    slots = random_slots(5, num_blocks * block_size, padding=1).to(device)
    radix, inserted, _ = random_radix(4, 10, 2, 24)
    queries, query_lens = radix._batch(lookup_requests(inserted, 2, 4, 6), None)
    tree = radix.flat_tree(device)
    tables, lens = tables.to(device), lens.to(device)
    return {
        "paged_attention": (OPS.paged_attention.default,
                            (query, key_cache, value_cache, tables, lens, 0.125, None, True, 0)),
        "paged_attention_unchecked": (OPS.paged_attention.default,
                                      (query, key_cache, value_cache, tables, lens, 0.125, "per_kv_head", False, 0)),
        "paged_attention_num_splits": (OPS.paged_attention.default,
                                       (query, key_cache, value_cache, tables, lens, 0.125, "split_kv", False, 3)),
        "reshape_and_cache": (OPS.reshape_and_cache.default, (key, key * 2, key_cache, value_cache, slots, True)),
        "copy_blocks": (OPS.copy_blocks.default,
                        (key_cache, value_cache, random_mapping(num_blocks, 3).to(device), True)),
        "copy_blocks_unchecked": (OPS.copy_blocks.default,
                                  (key_cache, value_cache, random_mapping(num_blocks, 3).to(device), False)),
        "match_prefix": (OPS.match_prefix.default, (*tree, 4, queries.to(device), query_lens.to(device), 5)),
    }


OPCHECK_CALLS = ["paged_attention", "paged_attention_unchecked", "paged_attention_num_splits", "reshape_and_cache",
                 "copy_blocks",
                 "copy_blocks_unchecked", "match_prefix"]


@pytest.mark.parametrize("call", OPCHECK_CALLS)
def test_opcheck(call):
    fn, args = _opcheck_calls()[call]
    torch.library.opcheck(fn, args)


def test_torch_compile_decode_step():
    """Dynamo traces a decode step without a graph break: the cache write (a mutating op,
    functionalized by AOTAutograd) followed by the attention that reads the written cache."""
    torch._dynamo.reset()
    tables, lens, num_blocks = make_tables([5, 12], 4, junk=False)
    key_cache, value_cache = make_cache(num_blocks, 4, 2, 8)

    def step(key_cache, value_cache, new_k, new_v, slots, query):
        flash_attention.reshape_and_cache(new_k, new_v, key_cache, value_cache, slots)
        return flash_attention.paged_attention(query, key_cache, value_cache, tables, lens) * 2

    args = (torch.randn(2, 2, 8), torch.randn(2, 2, 8),
            torch.tensor([int(tables[0, 1]) * 4, int(tables[1, 2]) * 4 + 3]), torch.randn(2, 4, 8))
    caches = key_cache.clone(), value_cache.clone()
    expected = step(key_cache, value_cache, *args)
    out = torch.compile(step, backend="aot_eager", fullgraph=True)(*caches, *args)
    torch.testing.assert_close(out, expected)
    assert torch.equal(caches[0], key_cache) and torch.equal(caches[1], value_cache)


# ---------------------------------------------------------------------------------------------
# 5. Misuse
# ---------------------------------------------------------------------------------------------
def _attn_args(**change):
    """Valid paged_attention arguments (batch 2, heads 4, heads_kv 2, head_dim 8, block_size 4,
    6 blocks), with some replaced."""
    args = dict(query=torch.randn(2, 4, 8), key_cache=torch.randn(6, 4, 2, 8), value_cache=torch.randn(6, 4, 2, 8),
                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                context_lens=torch.tensor([5, 8], dtype=torch.int32))
    args.update(change)
    return args


def _attn(version=None, check_tables=True, num_splits=0, **change):
    return lambda: flash_attention.paged_attention(**_attn_args(**change), version=version, check_tables=check_tables,
                                                   num_splits=num_splits)


def _cache_args(**change):
    args = dict(key=torch.randn(3, 2, 8), value=torch.randn(3, 2, 8), key_cache=torch.randn(6, 4, 2, 8),
                value_cache=torch.randn(6, 4, 2, 8), slot_mapping=torch.tensor([0, 5, -1]))
    args.update(change)
    return args


def _write(**change):
    return lambda: flash_attention.reshape_and_cache(**_cache_args(**change))


def _copy(mapping, **change):
    caches = dict(key_cache=torch.randn(6, 4, 2, 8), value_cache=torch.randn(6, 4, 2, 8))
    caches.update(change)
    return lambda: flash_attention.copy_blocks(caches["key_cache"], caches["value_cache"], mapping)


def _tree(**change):
    """A valid flat tree of block_size 2 (root -> [1 2] -> {[3 4], [3 5]}), with arrays replaced."""
    arrays = dict(tokens=[1, 2, 3, 4, 3, 5], token_start=[0, 0, 2, 4], span_blocks=[0, 1, 1, 1],
                  block_start=[0, 0, 1, 2], block_ids=[7, 8, 9], child_start=[0, 1, 3, 3],
                  child_count=[1, 2, 0, 0], child_index=[1, 2, 3])
    dtypes = dict(token_start=torch.int64, block_start=torch.int64, child_start=torch.int64)
    arrays.update(change)
    return [v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=dtypes.get(k, torch.int32))
            for k, v in arrays.items()]


def _match(block_size=2, queries=None, query_lens=None, max_match_blocks=2, **change):
    queries = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32) if queries is None else queries
    query_lens = torch.tensor([4], dtype=torch.int32) if query_lens is None else query_lens
    return lambda: OPS.match_prefix(*_tree(**change), block_size, queries, query_lens, max_match_blocks)


def test_valid_misuse_baselines():
    """The misuse cases below each change one thing in these calls, which must succeed."""
    _attn()()
    _write()()
    _copy(torch.tensor([[0, 1], [0, 2]]))()
    assert _match()()[0].tolist() == [4]


MISUSES = {
    # paged_attention: shapes, dtypes, devices
    "query 4-D": (_attn(query=torch.randn(2, 4, 1, 8)),
                  r"paged_attention: query has shape \[2, 4, 1, 8\] \(4 dims\); it must have 3: \(batch, heads, "
                  r"head_dim\)"),
    "cache 3-D": (_attn(key_cache=torch.randn(6, 4, 16)),
                  r"paged_attention: key_cache has shape \[6, 4, 16\] \(3 dims\); it must have 4: \(num_blocks, "
                  r"block_size, heads_kv, head_dim\)"),
    "float16 on cpu": (_attn(query=torch.randn(2, 4, 8).half(), key_cache=torch.randn(6, 4, 2, 8).half(),
                             value_cache=torch.randn(6, 4, 2, 8).half()),
                       r"paged_attention: query has dtype Half, which is not supported \(supported: Float, Double\)"),
    "integer cache": (_attn(key_cache=torch.ones(6, 4, 2, 8, dtype=torch.int32)),
                      r"paged_attention: key_cache has dtype Int, which is not supported"),
    "query/cache dtype mix": (_attn(query=torch.randn(2, 4, 8, dtype=torch.float64)),
                              r"paged_attention: key_cache is Float but query is Double \(no implicit type "
                              r"promotion\)"),
    "key/value cache dtype mix": (_attn(value_cache=torch.randn(6, 4, 2, 8, dtype=torch.float64)),
                                  r"paged_attention: value_cache is Double but key_cache is Float"),
    "key/value cache shapes": (_attn(value_cache=torch.randn(7, 4, 2, 8)),
                               r"paged_attention: key_cache has shape \[6, 4, 2, 8\] but value_cache has shape "
                               r"\[7, 4, 2, 8\]"),
    "cache not contiguous": (_attn(key_cache=torch.randn(6, 2, 4, 8).transpose(1, 2)),
                             r"paged_attention: key_cache is not contiguous; the cache is addressed as one"),
    "block_size 0": (_attn(key_cache=torch.randn(6, 0, 2, 8), value_cache=torch.randn(6, 0, 2, 8)),
                     r"paged_attention: key_cache has shape \[6, 0, 2, 8\]; block_size, heads_kv and head_dim must be "
                     r"at least 1"),
    "head_dim mismatch": (_attn(query=torch.randn(2, 4, 16)),
                          r"paged_attention: query has head_dim 16 but key_cache and value_cache have head_dim 8"),
    "heads not a multiple": (_attn(query=torch.randn(2, 3, 8)),
                             r"paged_attention: query has 3 heads and the cache has 2 kv heads; the query heads must "
                             r"be a whole multiple of the kv heads"),
    "query last dim strided": (_attn(query=torch.randn(2, 8, 4).transpose(1, 2)),
                               r"paged_attention: query's last dim \(head_dim\) is not contiguous \(stride 4\)"),
    "block_tables int64": (_attn(block_tables=torch.tensor([[0, 1], [2, 3]])),
                           r"paged_attention: block_tables has dtype Long, which is not supported \(supported: Int\)"),
    "context_lens int64": (_attn(context_lens=torch.tensor([5, 8])),
                           r"paged_attention: context_lens has dtype Long, which is not supported \(supported: Int\)"),
    "block_tables 1-D": (_attn(block_tables=torch.tensor([0, 1], dtype=torch.int32)),
                         r"paged_attention: block_tables has shape \[2\] \(1 dims\); it must have 2: \(batch, "
                         r"max_blocks\)"),
    "block_tables rows": (_attn(block_tables=torch.tensor([[0, 1]], dtype=torch.int32)),
                          r"paged_attention: block_tables has 1 rows for a batch of 2"),
    "context_lens length": (_attn(context_lens=torch.tensor([5, 8, 1], dtype=torch.int32)),
                            r"paged_attention: context_lens has 3 lengths for a batch of 2"),
    "device mix": (_attn(block_tables=torch.zeros(2, 2, dtype=torch.int32, device="meta")),
                   r"paged_attention: block_tables is on meta but query is on cpu"),
    "num_splits negative": (_attn(num_splits=-1),
                            r"paged_attention: num_splits is -1; it must be 0 \(chosen from the shapes\) or 1 to 128"),
    "num_splits too many": (_attn(num_splits=129), r"paged_attention: num_splits is 129; it must be 0"),
    "num_splits unsplit rung": (_attn(version="per_kv_head", num_splits=4),
                                r"paged_attention: num_splits is 4 but version 'per_kv_head' does not split the "
                                r"context \(use version='split_kv' or None\)"),
    "unknown version": (_attn(version="v2"),
                        r"paged_attention: unknown version 'v2'; expected one of per_head, per_kv_head, split_kv "
                        r"\(or None"),
    # paged_attention: values (check_tables=True)
    "context too long": (_attn(context_lens=torch.tensor([5, 9], dtype=torch.int32)),
                         r"paged_attention: context_lens\[1\] is 9 but its block_tables row covers 2 blocks x "
                         r"block_size 4 = 8 tokens"),
    "negative context": (_attn(context_lens=torch.tensor([-1, 8], dtype=torch.int32)),
                         r"paged_attention: context_lens\[0\] is -1; a context length cannot be negative"),
    "block id past the cache": (_attn(block_tables=torch.tensor([[0, 1], [2, 6]], dtype=torch.int32)),
                                r"paged_attention: block_tables\[1\]\[1\] is 6, not a block of the cache \(num_blocks "
                                r"6\), and context_lens\[1\] = 8 uses it"),
    "negative block id": (_attn(block_tables=torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)),
                          r"paged_attention: block_tables\[0\]\[1\] is -1, not a block of the cache"),
    # reshape_and_cache
    "slot_mapping int32": (_write(slot_mapping=torch.tensor([0, 5, -1], dtype=torch.int32)),
                           r"reshape_and_cache: slot_mapping has dtype Int, which is not supported \(supported: "
                           r"Long\)"),
    "slot count": (_write(slot_mapping=torch.tensor([0, 5])),
                   r"reshape_and_cache: slot_mapping has 2 slots for 3 tokens"),
    "key heads vs cache": (_write(key=torch.randn(3, 1, 8), value=torch.randn(3, 1, 8)),
                           r"reshape_and_cache: key has shape \[3, 1, 8\] but the cache \[6, 4, 2, 8\] holds "
                           r"\(heads_kv, head_dim\) = \(2, 8\) per token"),
    "key/value shapes": (_write(value=torch.randn(4, 2, 8)),
                         r"reshape_and_cache: key has shape \[3, 2, 8\] but value has shape \[4, 2, 8\]"),
    "key dtype": (_write(key=torch.randn(3, 2, 8).half()), r"reshape_and_cache: key is Half but key_cache is Float"),
    "key 2-D": (_write(key=torch.randn(3, 16)), r"reshape_and_cache: key has shape \[3, 16\] \(2 dims\); it must "
                                                r"have 3: \(tokens, heads_kv, head_dim\)"),
    "write to a strided cache": (_write(value_cache=torch.randn(6, 2, 4, 8).transpose(1, 2)),
                                 r"reshape_and_cache: value_cache is not contiguous"),
    "slot past the cache": (_write(slot_mapping=torch.tensor([0, 24, -1])),
                            r"reshape_and_cache: slot_mapping\[1\] is 24, outside the cache's 24 slots"),
    "slot below -1": (_write(slot_mapping=torch.tensor([0, -2, -1])),
                      r"reshape_and_cache: slot_mapping\[1\] is -2, outside the cache's 24 slots"),
    "slot twice": (_write(slot_mapping=torch.tensor([7, 3, 7])),
                   r"reshape_and_cache: slot_mapping writes slot 7 twice"),
    # copy_blocks
    "mapping (pairs, 3)": (_copy(torch.tensor([[0, 1, 2]])),
                           r"copy_blocks: block_mapping has shape \[1, 3\]; it must be \(pairs, 2\)"),
    "mapping int32": (_copy(torch.tensor([[0, 1]], dtype=torch.int32)),
                      r"copy_blocks: block_mapping has dtype Int, which is not supported \(supported: Long\)"),
    "mapping past the cache": (_copy(torch.tensor([[0, 1], [2, 6]])),
                               r"copy_blocks: block_mapping\[1\] = \(2, 6\) names a block outside the cache "
                               r"\(num_blocks 6\)"),
    "destination twice": (_copy(torch.tensor([[0, 4], [2, 4]])),
                          r"copy_blocks: block 4 is the destination of two pairs of block_mapping"),
    "destination also a source": (_copy(torch.tensor([[0, 1], [1, 2]])),
                                  r"copy_blocks: block_mapping\[0\] = \(0, 1\) copies into a block that is also a "
                                  r"source"),
    "copy onto itself": (_copy(torch.tensor([[3, 3]])), r"copy_blocks: block_mapping\[0\] = \(3, 3\) copies into a "
                                                        r"block that is also a source"),
    "copy between dtypes": (_copy(torch.tensor([[0, 1]]), value_cache=torch.randn(6, 4, 2, 8).double()),
                            r"copy_blocks: value_cache is Double but key_cache is Float"),
    # match_prefix
    "queries int64": (_match(queries=torch.tensor([[1, 2, 3, 4]])),
                      r"match_prefix: queries has dtype Long, which is not supported \(supported: Int\)"),
    "query_lens past the row": (_match(query_lens=torch.tensor([5], dtype=torch.int32)),
                                r"match_prefix: query_lens\[0\] is 5 but the rows of queries hold 4 tokens"),
    "negative query_lens": (_match(query_lens=torch.tensor([-1], dtype=torch.int32)),
                            r"match_prefix: query_lens\[0\] is -1"),
    "query_lens count": (_match(query_lens=torch.tensor([4, 4], dtype=torch.int32)),
                         r"match_prefix: query_lens has 2 lengths for 1 requests"),
    "token_start int32": (_match(token_start=torch.tensor([0, 0, 2, 4], dtype=torch.int32)),
                          r"match_prefix: token_start has dtype Int, which is not supported \(supported: Long\)"),
    "per-node lengths": (_match(span_blocks=[0, 1, 1]),
                         r"match_prefix: span_blocks has 3 entries but token_start has 4; every per-node array has "
                         r"one entry per node"),
    "no root": (_match(token_start=torch.zeros(0, dtype=torch.int64), span_blocks=[], block_start=torch.zeros(
        0, dtype=torch.int64), child_start=torch.zeros(0, dtype=torch.int64), child_count=[]),
        r"match_prefix: the tree has no nodes; even an empty tree has its root"),
    "block_size 0": (_match(block_size=0), r"match_prefix: block_size is 0; it must be at least 1"),
    "negative max_match_blocks": (_match(max_match_blocks=-1), r"match_prefix: max_match_blocks is -1"),
    "root with a span": (_match(span_blocks=[1, 1, 1, 1]),
                         r"match_prefix: node 0 \(the root\) has span_blocks 1; the root's span is empty"),
    "empty edge": (_match(span_blocks=[0, 1, 0, 1]),
                   r"match_prefix: node 2 has span_blocks 0; every node but the root holds at least one block"),
    "tokens out of range": (_match(token_start=torch.tensor([0, 0, 2, 5])),
                            r"match_prefix: node 3's tokens \[5, \+2\) fall outside tokens \(6 ids\)"),
    "blocks out of range": (_match(block_start=torch.tensor([0, 0, 1, 3])),
                            r"match_prefix: node 3's blocks \[3, \+1\) fall outside block_ids \(3 ids\)"),
    "children out of range": (_match(child_count=[1, 3, 0, 0]),
                              r"match_prefix: node 1's children \[1, \+3\) fall outside child_index \(3 entries\)"),
    "child is the root": (_match(child_index=[1, 0, 3]),
                          r"match_prefix: node 1's child 0 is 0, not a node of the tree other than the root "
                          r"\(1 to 3\)"),
    "child past the nodes": (_match(child_index=[1, 2, 4]),
                             r"match_prefix: node 1's child 1 is 4, not a node of the tree"),
    "children unsorted": (_match(tokens=[1, 2, 3, 4, 2, 5]),
                          r"match_prefix: node 1's children are not sorted by first token \(3 before 2\)"),
    "children share a first block": (_match(tokens=[1, 2, 3, 4, 3, 4]),
                                     r"match_prefix: node 1's children 0 and 1 start with the same block"),
}


@pytest.mark.parametrize("misuse", list(MISUSES))
def test_misuse_raises_clear_error(misuse):
    call, message = MISUSES[misuse]
    with pytest.raises(RuntimeError, match=message):
        call()


def test_misuse_leaves_the_cache_alone():
    """A refused write or copy changes nothing: the checks run before the first byte moves."""
    args = _cache_args(slot_mapping=torch.tensor([0, 5, 99]))
    before = args["key_cache"].clone()
    with pytest.raises(RuntimeError, match=r"reshape_and_cache: slot_mapping\[2\] is 99"):
        flash_attention.reshape_and_cache(**args)
    assert torch.equal(args["key_cache"], before)
    key_cache, value_cache = make_cache(6, 4, 2, 8)
    before = key_cache.clone()
    with pytest.raises(RuntimeError, match=r"copy_blocks: block 4 is the destination of two pairs"):
        flash_attention.copy_blocks(key_cache, value_cache, torch.tensor([[0, 4], [1, 4]]))
    assert torch.equal(key_cache, before)


def test_radix_cache_misuse():
    with pytest.raises(ValueError, match=r"RadixCache: block_size is 0; it must be at least 1"):
        flash_attention.RadixCache(0)
    with pytest.raises(ValueError, match=r"match_prefix: token_ids_batch must be 2-D"):
        flash_attention.RadixCache(2).match_prefix(torch.zeros(4, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# 6. CUDA: every rung against the CPU reference of the same inputs
# ---------------------------------------------------------------------------------------------
CUDA_HEAD_DIMS = (64, 128)
CUDA_BLOCK_SIZES = (16, 32)
CUDA_GQA = ((8, 8), (8, 2), (8, 1))  # (heads, heads_kv): MHA, 4:1, multi-query
# CUDA tolerances (rtol, atol) against the float64 reference of the same (already rounded)
# inputs. Every rung computes in float32 (float64 for float64) and rounds once, at the store of
# out: half an ulp, 2^-11 relative for float16 and 2^-8 for bfloat16; rtol at twice that, with an
# atol for outputs near 0, where float32 sums over up to 3000 tokens of |p v| <= 8 leave ~1e-6.
# split_kv also rounds nothing more: its partials and lse are float32. float32 itself: a few
# float32 ulps per softmax sum and rescale, as on the CPU.
CUDA_TOL = {torch.float16: (2 ** -10, 1e-4), torch.bfloat16: (2 ** -7, 1e-3), torch.float32: (2e-5, 5e-5),
            torch.float64: (1e-10, 1e-10)}
# A rung may also round p to the input type before p v (as the tensor-core rungs of the training
# half do, to feed 16-bit mma operands): each p_j then carries a relative error up to u (2^-11
# float16, 2^-8 bfloat16), moving out by at most u * max|v|, which the 16-bit bounds add to atol.
UNIT_ROUNDOFF = {torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8}


def cuda_tol(dtype, value_cache):
    rtol, atol = CUDA_TOL[dtype]
    if dtype in UNIT_ROUNDOFF:
        atol += UNIT_ROUNDOFF[dtype] * value_cache.abs().max().item()
    return rtol, atol


def check_cuda_paged(lens, heads, heads_kv, head_dim, block_size, dtype, version, what, check_tables=True,
                     tables=None, num_splits=0):
    if tables is None:
        tables, context_lens, num_blocks = make_tables(lens, block_size)
    else:
        context_lens, num_blocks = torch.tensor(lens, dtype=torch.int32), 40
    key_cache, value_cache = make_cache(num_blocks, block_size, heads_kv, head_dim, dtype, "cuda")
    query = torch.randn(len(lens), heads, head_dim, device="cuda").to(dtype)
    ref = reference_paged_attention(query, key_cache, value_cache, tables, context_lens)
    poison_allocator(torch.empty(query.shape, dtype=dtype, device="cuda"))
    out = flash_attention.paged_attention(query, key_cache, value_cache, tables.cuda(), context_lens.cuda(),
                                          version=version, check_tables=check_tables, num_splits=num_splits)
    assert out.device.type == "cuda" and out.dtype == dtype and out.shape == ref.shape, what
    rtol, atol = cuda_tol(dtype, value_cache)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    empty = (context_lens <= 0).cuda()
    assert torch.all(out[empty] == 0), f"{what}: a sequence with context 0 is not 0"
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("block_size", CUDA_BLOCK_SIZES)
@pytest.mark.parametrize("gqa", CUDA_GQA, ids=lambda g: f"h{g[0]}kv{g[1]}")
@pytest.mark.parametrize("head_dim", CUDA_HEAD_DIMS)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", PAGED_VERSIONS)
def test_cuda_paged_attention_matches_reference(version, dtype, head_dim, gqa, block_size):
    """Each rung, dtype, head_dim, GQA ratio and page size, over a mixed batch (the lengths around
    a page boundary, a long context, none at all) and a small batch of long contexts (where
    split_kv splits)."""
    require_cuda()
    heads, heads_kv = gqa
    for lens in (edge_lengths(block_size) + [3000, 777], [3000, 2047]):
        check_cuda_paged(lens, heads, heads_kv, head_dim, block_size, dtype, version,
                         f"{version} {dtype_id(dtype)} d{head_dim} h{heads}/{heads_kv} bs{block_size} {lens}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=dtype_id)
@pytest.mark.parametrize("version", PAGED_VERSIONS)
def test_cuda_paged_attention_wide_dtypes(version, dtype):
    require_cuda()
    for head_dim, block_size in ((64, 16), (128, 32)):
        check_cuda_paged(edge_lengths(block_size) + [1000], 8, 2, head_dim, block_size, dtype, version,
                         f"{version} {dtype_id(dtype)} d{head_dim} bs{block_size}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_split_kv_matches_unsplit(dtype):
    """split_kv against per_kv_head on the same inputs: the same softmax cut into parts and merged
    through float32 partials and their lse. Not bitwise (the sums are taken in another order),
    but within a rounding of the output: one 16-bit ulp (2^-10 / 2^-7 relative) plus float32
    noise near 0."""
    require_cuda()
    for lens, heads, heads_kv in (([5000], 8, 1), ([3000, 4096], 8, 2), ([1, 2900, 16, 31], 8, 8)):
        tables, context_lens, num_blocks = make_tables(lens, 16)
        key_cache, value_cache = make_cache(num_blocks, 16, heads_kv, 128, dtype, "cuda")
        query = torch.randn(len(lens), heads, 128, device="cuda").to(dtype)
        args = (query, key_cache, value_cache, tables.cuda(), context_lens.cuda())
        split = flash_attention.paged_attention(*args, version="split_kv")
        unsplit = flash_attention.paged_attention(*args, version="per_kv_head")
        rtol = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
        torch.testing.assert_close(split, unsplit, rtol=rtol, atol=1e-3, msg=lambda m: f"{lens}: {m}")
        default = flash_attention.paged_attention(*args)
        assert torch.equal(default, split) or torch.equal(default, unsplit), f"{lens}: version=None is neither rung"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_num_splits(dtype):
    """num_splits=n cuts every context into n ranges whatever the shapes: more ranges than a short
    context has blocks (empty ranges, lse -inf), more than the table has, mixed lengths, context
    0. Each count against the reference, and 1 is per_kv_head bit for bit (no combine)."""
    require_cuda()
    for lens in ([0, 1, 15, 16, 17, 300, 2047, 5000], [0, 3, 20]):  # the second: 2 blocks wide
        tables, context_lens, num_blocks = make_tables(lens, 16)
        key_cache, value_cache = make_cache(num_blocks, 16, 2, 128, dtype, "cuda")
        query = torch.randn(len(lens), 8, 128, device="cuda").to(dtype)
        args = (query, key_cache, value_cache, tables.cuda(), context_lens.cuda())
        ref = reference_paged_attention(query, key_cache, value_cache, tables, context_lens)
        rtol, atol = cuda_tol(dtype, value_cache)
        unsplit = flash_attention.paged_attention(*args, version="per_kv_head")
        assert torch.equal(flash_attention.paged_attention(*args, version="split_kv", num_splits=1), unsplit)
        for n in (2, 3, 7, 64, 128):
            for version in ("split_kv", None):
                out = flash_attention.paged_attention(*args, version=version, num_splits=n)
                torch.testing.assert_close(out.cpu().double(), ref, rtol=rtol, atol=atol,
                                           msg=lambda m: f"{lens} {n}: {m}")
                assert torch.all(out[0] == 0), (lens, n)


@pytest.mark.cuda
def test_cuda_default_dispatch():
    """version=None: split_kv (with its combine kernel) for one sequence of one kv head over a
    long table, which cannot fill the GPU unsplit; per_kv_head, no combine, for a full batch."""
    require_cuda()
    from coursekit.pytest_plugin import launched_kernels
    for lens, heads_kv, splits in (([8192], 1, True), ([64] * 256, 8, False)):
        tables, context_lens, num_blocks = make_tables(lens, 16)
        key_cache, value_cache = make_cache(num_blocks, 16, heads_kv, 128, torch.bfloat16, "cuda")
        query = torch.randn(len(lens), 8, 128, device="cuda").to(torch.bfloat16)
        _, names = launched_kernels(lambda: flash_attention.paged_attention(
            query, key_cache, value_cache, tables.cuda(), context_lens.cuda(), check_tables=False), "flash_attention")
        assert any("split_combine_kernel" in n for n in names) == splits, (lens, names)


@pytest.mark.cuda
@pytest.mark.parametrize("version", PAGED_VERSIONS)
def test_cuda_unchecked_tables_follow_the_memory_safety_rules(version):
    """check_tables=False with block ids outside the cache and contexts past the table or below 0:
    no fault, and the CPU reference's answer (blocks outside the cache add nothing)."""
    require_cuda()
    tables = torch.tensor([[0, 99, 2], [1, -3, 4], [5, 2, 3], [3, 2, 1], [2 ** 31 - 1, -(2 ** 31), 0]],
                          dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        check_cuda_paged([40, 48, 5000, -7, 33], 8, 2, 64, 16, dtype, version, f"{version} {dtype_id(dtype)}",
                         check_tables=False, tables=tables)
    torch.cuda.synchronize()  # a fault would surface here at the latest


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_cuda_reshape_and_cache(dtype):
    """Against the CPU op on the same inputs, bit for bit: padding slots (-1), NaN-poisoned caches
    (only the written slots change), strided key/value, both block sizes."""
    require_cuda()
    for block_size, head_dim in ((16, 64), (32, 128)):
        num_blocks, heads_kv, tokens = 37, 2, 300
        key = strided_query(tokens, heads_kv, head_dim, dtype)
        value = strided_query(tokens, heads_kv, head_dim, dtype)
        slots = random_slots(tokens, num_blocks * block_size, padding=40)
        cpu = nan_cache(num_blocks, block_size, heads_kv, head_dim, dtype)
        flash_attention.reshape_and_cache(key, value, *cpu, slots)
        gpu = nan_cache(num_blocks, block_size, heads_kv, head_dim, dtype, "cuda")
        flash_attention.reshape_and_cache(key.cuda(), value.cuda(), *gpu, slots.cuda())
        for name, c, g in zip(("key_cache", "value_cache"), cpu, gpu):
            assert_same_bits(g.cpu(), c, f"{dtype_id(dtype)} bs{block_size} {name}")
        assert_same_bits(cpu[0], expected_after_write(nan_cache(num_blocks, block_size, heads_kv, head_dim,
                                                                dtype)[0], key, slots))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_cuda_misaligned_views(dtype):
    """paged.h promises any strides with the last dim contiguous, not alignment: a query and new
    keys one element off (vector loads would fault or misread) give the contiguous copies' bits."""
    require_cuda()
    tables, lens, num_blocks = make_tables([1, 17, 300], 16)
    key_cache, value_cache = make_cache(num_blocks, 16, 2, 64, dtype, "cuda")
    tables, lens = tables.cuda(), lens.cuda()
    query = strided_query(3, 8, 64, dtype, "cuda")
    for version in PAGED_VERSIONS:
        out = flash_attention.paged_attention(query, key_cache, value_cache, tables, lens, version=version)
        assert torch.equal(out, flash_attention.paged_attention(query.contiguous(), key_cache, value_cache, tables,
                                                                lens, version=version)), version
    new_k = strided_query(5, 2, 64, dtype, "cuda")  # (5, 2, 64), one element off
    slots = random_slots(5, num_blocks * 16).cuda()
    caches = key_cache.clone(), value_cache.clone()
    flash_attention.reshape_and_cache(new_k, new_k, key_cache, value_cache, slots)
    flash_attention.reshape_and_cache(new_k.contiguous(), new_k.contiguous(), *caches, slots)
    assert torch.equal(key_cache, caches[0]) and torch.equal(value_cache, caches[1])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_cuda_copy_blocks(dtype):
    require_cuda()
    for pairs in (1, 7, 40):
        key_cache, value_cache = make_cache(100, 16, 2, 64, dtype)
        mapping = random_mapping(100, pairs)
        gpu = key_cache.cuda(), value_cache.cuda()
        flash_attention.copy_blocks(key_cache, value_cache, mapping)
        flash_attention.copy_blocks(*gpu, mapping.cuda())
        assert torch.equal(gpu[0].cpu(), key_cache) and torch.equal(gpu[1].cpu(), value_cache), pairs
    # unchecked, with pairs outside the cache among them: skipped on the GPU as on the CPU
    key_cache, value_cache = make_cache(100, 16, 2, 64, dtype)
    gpu = key_cache.cuda(), value_cache.cuda()
    mapping = torch.cat([random_mapping(100, 9), torch.tensor([[3, 100], [-1, 50], [1 << 40, 60]])])
    flash_attention.copy_blocks(key_cache, value_cache, mapping, check_mapping=False)
    flash_attention.copy_blocks(*gpu, mapping.cuda(), check_mapping=False)
    assert torch.equal(gpu[0].cpu(), key_cache) and torch.equal(gpu[1].cpu(), value_cache)


@pytest.mark.cuda
@pytest.mark.parametrize("block_size,vocab", [(1, 3), (2, 2), (4, 3), (16, 2)])
def test_cuda_match_prefix(block_size, vocab):
    """The GPU lookup against the CPU op (and so the Python walk) on random trees, the empty tree
    included, with lengths past the rows (clamped on the GPU) and a cap on the blocks."""
    require_cuda()
    for sequences in (0, 1, 60):
        cache, inserted, _ = random_radix(block_size, sequences, vocab, 8 * block_size)
        requests = lookup_requests(inserted, vocab, block_size, 100)
        for cap in (None, 2):
            cpu = cache.match_prefix(requests, max_match_blocks=cap)
            gpu = cache.match_prefix(requests, device="cuda", max_match_blocks=cap)
            assert gpu[0].device.type == "cuda"
            assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1]), (sequences, cap)
            assert_matches_reference(cache, requests, *cpu, max_match_blocks=cap)
    queries, lens = cache._batch(requests, None)
    over = cache.match_prefix(queries.cuda(), (lens + 1000).cuda())  # clamped to the row on the GPU
    assert torch.equal(over[0].cpu(), cache.match_prefix(queries)[0])


@pytest.mark.cuda
def test_cuda_misuse():
    require_cuda()
    args = _attn_args()
    cuda = {k: v.cuda() for k, v in args.items()}
    with pytest.raises(RuntimeError, match=r"paged_attention: head_dim 8 is not supported on CUDA \(supported: "
                                           r"64, 128\)"):
        flash_attention.paged_attention(**cuda)
    q = torch.randn(2, 4, 64, device="cuda")
    key_cache = torch.randn(6, 8, 2, 64, device="cuda")
    with pytest.raises(RuntimeError, match=r"paged_attention: block_size 8 is not supported on CUDA \(supported: "
                                           r"16, 32\)"):
        flash_attention.paged_attention(q, key_cache, key_cache, cuda["block_tables"], cuda["context_lens"])
    key_cache = torch.randn(6, 16, 2, 64, device="cuda")
    with pytest.raises(RuntimeError, match=r"paged_attention: key_cache is on cuda:0 but query is on cpu"):
        flash_attention.paged_attention(q.cpu(), key_cache, key_cache, args["block_tables"], args["context_lens"])
    # contiguous but starting 4 bytes into its storage: the kernel's 16-byte loads would fault
    shifted = torch.zeros(key_cache.numel() + 1, device="cuda")[1:].view(key_cache.shape)
    with pytest.raises(RuntimeError, match=r"paged_attention: key_cache does not start at a 16-byte aligned address"):
        flash_attention.paged_attention(q, shifted, key_cache, cuda["block_tables"], cuda["context_lens"])
    # the value checks on the GPU (each a sync)
    with pytest.raises(RuntimeError, match=r"paged_attention: context_lens\[1\] is 40 but its block_tables row "
                                           r"covers 2 blocks x block_size 16 = 32 tokens"):
        flash_attention.paged_attention(q, key_cache, key_cache, cuda["block_tables"],
                                        torch.tensor([5, 40], dtype=torch.int32, device="cuda"))
    with pytest.raises(RuntimeError, match=r"paged_attention: block_tables\[0\]\[0\] is 6, not a block"):
        flash_attention.paged_attention(q, key_cache, key_cache, torch.tensor([[6, 0], [1, 2]], dtype=torch.int32,
                                                                              device="cuda"), cuda["context_lens"])
    with pytest.raises(RuntimeError, match=r"paged_attention: num_splits is 2 but query is Float; on CUDA only "
                                           r"float16 and bfloat16 split"):
        flash_attention.paged_attention(q, key_cache, key_cache, cuda["block_tables"], cuda["context_lens"],
                                        num_splits=2)
    with pytest.raises(RuntimeError, match=r"reshape_and_cache: slot_mapping writes slot 7 twice"):
        flash_attention.reshape_and_cache(torch.randn(2, 2, 64, device="cuda"), torch.randn(2, 2, 64, device="cuda"),
                                          key_cache, key_cache.clone(), torch.tensor([7, 7], device="cuda"))
    with pytest.raises(RuntimeError, match=r"copy_blocks: block 4 is the destination of two pairs"):
        flash_attention.copy_blocks(key_cache, key_cache.clone(), torch.tensor([[0, 4], [1, 4]], device="cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("call", OPCHECK_CALLS)
def test_cuda_opcheck(call):
    require_cuda()
    fn, args = _opcheck_calls("cuda")[call]
    torch.library.opcheck(fn, args)


@pytest.mark.cuda
def test_cuda_graph_capture():
    """A decode step replays inside a CUDA graph once the value checks are off (each would be a
    sync, illegal while capturing): cache write, attention by every rung, and the lookup."""
    require_cuda()
    tables, lens, num_blocks = make_tables([100, 3000, 17], 16)
    key_cache, value_cache = make_cache(num_blocks, 16, 2, 128, torch.bfloat16, "cuda")
    tables, lens = tables.cuda(), lens.cuda()
    new_k = torch.randn(3, 2, 128, device="cuda").to(torch.bfloat16)
    slots = torch.tensor([int(tables[0, 6]) * 16 + 3, -1, int(tables[2, 1]) * 16], device="cuda")
    query = torch.randn(3, 8, 128, device="cuda").to(torch.bfloat16)
    radix, inserted, _ = random_radix(4, 20, 2, 32)
    queries, query_lens = radix._batch(lookup_requests(inserted, 2, 4, 16), None)
    queries, query_lens = queries.cuda(), query_lens.cuda()
    radix.flat_tree("cuda")  # the mirror's copy to the GPU happens before the capture

    def step():
        flash_attention.reshape_and_cache(new_k, new_k, key_cache, value_cache, slots, check_slots=False)
        outs = [flash_attention.paged_attention(query, key_cache, value_cache, tables, lens, version=v,
                                                check_tables=False) for v in PAGED_VERSIONS + (None,)]
        return outs + list(radix.match_prefix(queries, query_lens, device="cuda"))

    captured, expected = capture_and_replay(step)
    for a, e in zip(captured, expected):
        assert torch.equal(a, e)


@pytest.mark.cuda
@pytest.mark.sanitize
def test_sanitizer_small_paged():
    """The small run compute-sanitizer takes: every rung over page edges, a context split into
    parts, unchecked bad tables, cache writes with padding, copies, and a lookup."""
    require_cuda()
    for version in PAGED_VERSIONS:
        check_cuda_paged(edge_lengths(16) + [700], 8, 2, 64, 16, torch.bfloat16, version, f"{version}")
        check_cuda_paged([40, 5000, -7], 8, 1, 128, 32, torch.float16, version, f"{version} unchecked",
                         check_tables=False, tables=torch.tensor([[0, 99], [1, 2], [-5, 3]], dtype=torch.int32))
    check_cuda_paged([0, 3, 40, 700], 8, 2, 64, 16, torch.bfloat16, "split_kv", "num_splits 9", num_splits=9)
    key_cache, value_cache = nan_cache(8, 16, 2, 64, torch.bfloat16, "cuda")
    key = torch.randn(20, 2, 64, device="cuda").to(torch.bfloat16)
    flash_attention.reshape_and_cache(key, key, key_cache, value_cache, random_slots(20, 128, padding=3).cuda())
    flash_attention.copy_blocks(key_cache, value_cache, random_mapping(8, 3).cuda())
    flash_attention.copy_blocks(key_cache, value_cache, torch.tensor([[1, 9], [-2, 3], [2, 5]]).cuda(),
                                check_mapping=False)
    cache, inserted, _ = random_radix(4, 10, 2, 24)
    cache.match_prefix(lookup_requests(inserted, 2, 4, 8), device="cuda")
    torch.cuda.synchronize()
