"""Tests of decode attention over the paged KV cache (paged_attention): against the float64
reference of paged_testing.py on the CPU, opcheck, every documented misuse, and (marked cuda,
skipped without a GPU) every rung of the decode ladder against the CPU reference of the same
inputs, split-KV and num_splits, the version=None dispatch and the memory-safety rules of
unchecked tables.

Run against the installed extension (pip install .) or the JIT build (COURSE_EXT_ROUTE=jit).
"""
import pytest
import torch

import flash_attention
from coursekit.pytest_plugin import DTYPES, dtype_id, poison_allocator, require_cuda
from paged_testing import (CPU_DTYPES, HALF_DTYPES, OPS, PAGED_VERSIONS, assert_paged, blocks_needed, check_cuda_paged,
                           cuda_tol, edge_lengths, make_cache, make_tables, reference_paged_attention, strided_query)

# Python's random drives the tables and trees: seeded per test like torch (conftest.py).
pytestmark = pytest.mark.usefixtures("seeded_python_random")


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
    cache, and must give csrc/serving/serving.h's answer (blocks outside the cache add no tokens, the context
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
# 2. opcheck and misuse
# ---------------------------------------------------------------------------------------------
def _opcheck_calls(device="cpu"):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    block_size, head_dim = 16, 64
    tables, lens, num_blocks = make_tables([1, 17, 40], block_size, junk=False)
    key_cache, value_cache = make_cache(num_blocks, block_size, 2, head_dim, dtype, device)
    query = torch.randn(3, 4, head_dim, device=device).to(dtype)
    tables, lens = tables.to(device), lens.to(device)
    return {
        "paged_attention": (OPS.paged_attention.default,
                            (query, key_cache, value_cache, tables, lens, 0.125, None, True, 0)),
        "paged_attention_unchecked": (OPS.paged_attention.default,
                                      (query, key_cache, value_cache, tables, lens, 0.125, "per_kv_head", False, 0)),
        "paged_attention_num_splits": (OPS.paged_attention.default,
                                       (query, key_cache, value_cache, tables, lens, 0.125, "split_kv", False, 3)),
    }


OPCHECK_CALLS = ["paged_attention", "paged_attention_unchecked", "paged_attention_num_splits"]


@pytest.mark.parametrize("call", OPCHECK_CALLS)
def test_opcheck(call):
    fn, args = _opcheck_calls()[call]
    torch.library.opcheck(fn, args)


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


def test_valid_misuse_baseline():
    """The misuse cases below each change one thing in this call, which must succeed."""
    _attn()()


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
}


@pytest.mark.parametrize("misuse", list(MISUSES))
def test_misuse_raises_clear_error(misuse):
    call, message = MISUSES[misuse]
    with pytest.raises(RuntimeError, match=message):
        call()


# ---------------------------------------------------------------------------------------------
# 3. CUDA: every rung against the CPU reference of the same inputs
# ---------------------------------------------------------------------------------------------
CUDA_HEAD_DIMS = (64, 128)
CUDA_BLOCK_SIZES = (16, 32)
CUDA_GQA = ((8, 8), (8, 2), (8, 1))  # (heads, heads_kv): MHA, 4:1, multi-query


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
def test_cuda_misaligned_query(dtype):
    """csrc/serving/serving.h promises any strides with the last dim contiguous, not alignment: a
    query one element off (vector loads would fault or misread) gives the contiguous copy's bits."""
    require_cuda()
    tables, lens, num_blocks = make_tables([1, 17, 300], 16)
    key_cache, value_cache = make_cache(num_blocks, 16, 2, 64, dtype, "cuda")
    tables, lens = tables.cuda(), lens.cuda()
    query = strided_query(3, 8, 64, dtype, "cuda")
    for version in PAGED_VERSIONS:
        out = flash_attention.paged_attention(query, key_cache, value_cache, tables, lens, version=version)
        assert torch.equal(out, flash_attention.paged_attention(query.contiguous(), key_cache, value_cache, tables,
                                                                lens, version=version)), version


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


@pytest.mark.cuda
@pytest.mark.parametrize("call", OPCHECK_CALLS)
def test_cuda_opcheck(call):
    require_cuda()
    fn, args = _opcheck_calls("cuda")[call]
    torch.library.opcheck(fn, args)
