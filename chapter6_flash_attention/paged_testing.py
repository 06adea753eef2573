"""What the serving half's tests share (test_paged_attention.py, test_paged_prefill.py,
test_paged_cache.py, test_paged_radix.py, test_paged_decode_step.py): inputs drawn as a server
holds them, the references the ops are held to, and the CUDA tolerances. Not a test file: pytest collects nothing
here, and the fixtures live in conftest.py.

The attention reference is written here in plain PyTorch in float64: it gathers each sequence's
pages by hand (skipping, as csrc/serving/serving.h says, the tokens of a block id outside the
cache) and takes an explicit softmax per sequence. The prefix lookup's reference is
RadixCache.match_prefix_reference, a walk over the Python tree, independent of the flat mirror
the op reads.
"""
import itertools
import math
import random

import torch

import flash_attention
from coursekit.pytest_plugin import poison_allocator

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


# ---------------------------------------------------------------------------------------------
# paged_attention's inputs and reference
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
    the pages its table names, then softmax(scale q k^T) v. csrc/serving/serving.h's rules for inputs nobody
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


def strided_query(batch, heads, head_dim, dtype=torch.float32, device="cpu"):
    """query as the middle third of a fused (batch, 3 * heads, head_dim) projection that starts
    one element into its buffer: strided, and misaligned by one element (heads * head_dim even)."""
    buffer = torch.randn(batch * 3 * heads * head_dim + 1, device=device).to(dtype)
    query = buffer[1:].view(batch, 3 * heads, head_dim)[:, heads:2 * heads]
    assert not query.is_contiguous() and query.storage_offset() % 2 == 1
    return query


# ---------------------------------------------------------------------------------------------
# reshape_and_cache and copy_blocks: caches, slots, mappings
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


# ---------------------------------------------------------------------------------------------
# The prefix lookup: random trees and requests
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


# ---------------------------------------------------------------------------------------------
# CUDA: tolerances against the CPU reference
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# paged_prefill_attention's inputs and reference
# ---------------------------------------------------------------------------------------------
def make_prefill(chunks, contexts, block_size, heads, heads_kv, head_dim, dtype=torch.float32, device="cpu",
                 junk=True):
    """A batch as a server holds it after reshape_and_cache: sequence b has contexts[b] tokens
    cached (its new chunk of chunks[b] tokens the last of them), its blocks scattered over the
    pool (make_tables). Returns query (total_q, heads, head_dim), key_cache, value_cache,
    block_tables, cu_seqlens_q, context_lens, all on `device`."""
    tables, lens, num_blocks = make_tables(contexts, block_size, junk=junk)
    key_cache, value_cache = make_cache(num_blocks, block_size, heads_kv, head_dim, dtype, device)
    cu = torch.tensor([0] + list(itertools.accumulate(chunks)), dtype=torch.int32)
    query = torch.randn(sum(chunks), heads, head_dim, dtype=torch.float64).to(dtype).to(device)
    return query, key_cache, value_cache, tables.to(device), cu.to(device), lens.to(device)


def reference_paged_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens, scale=None,
                            device="cpu"):
    """out (total_q, heads, head_dim) in float64, on the CPU, as a dense computation: per sequence
    its context gathered from its pages (the tokens of a block outside the cache left out, as in
    reference_paged_attention), the full score matrix of its chunk against it, the bottom-right
    causal mask (row i of a chunk of q_len sees positions j <= i + context - q_len) applied as
    -inf, and an explicit softmax; a row that sees nothing gets 0. device: where the float64 work
    runs (a GPU's float64 units take the long contexts in a fraction of the CPU's time); the
    result comes back to the CPU either way."""
    query, key_cache, value_cache = (t.detach().to(device).double() for t in (query, key_cache, value_cache))
    block_tables, context_lens = block_tables.to(device).long(), context_lens.cpu().long()
    cu = cu_seqlens_q.cpu().long()
    num_blocks, block_size, heads_kv, head_dim = key_cache.shape
    total_q, heads, _ = query.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(total_q, heads, head_dim, dtype=torch.float64, device=device)
    for b in range(block_tables.shape[0]):
        begin, end = int(cu[b]), int(cu[b + 1])
        q_len = end - begin
        context = min(max(int(context_lens[b]), 0), block_tables.shape[1] * block_size)
        j = torch.arange(context, device=device)
        block, row = block_tables[b, j // block_size], j % block_size
        present = (block >= 0) & (block < num_blocks)
        if q_len == 0 or not bool(present.any()):
            continue
        k = key_cache[block[present], row[present]].repeat_interleave(heads // heads_kv, dim=1)  # (n, heads, d)
        v = value_cache[block[present], row[present]].repeat_interleave(heads // heads_kv, dim=1)
        positions = j[present]
        scores = scale * torch.einsum("ihd,nhd->hin", query[begin:end], k)  # (heads, q_len, n)
        visible = positions[None, :] <= (torch.arange(q_len, device=device) + context - q_len)[:, None]  # (q_len, n)
        scores = scores.masked_fill(~visible, -math.inf)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing: 0, not NaN
        out[begin:end] = torch.einsum("hin,nhd->ihd", probs, v)
    return out.cpu()
