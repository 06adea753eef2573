"""Tests of chunked prefill over the paged KV cache (paged_prefill_attention): the CPU reference
against a dense float64 computation (paged_testing.py) and two other witnesses (the training
half's causal attention over the gathered keys, and paged_attention for decode tokens), chunked
against whole prefill, the version=None rule, opcheck, every documented misuse, and (marked cuda,
skipped without a GPU) both rungs against the CPU reference of the same inputs, the dispatch, the
memory-safety rules of unchecked inputs, a misaligned query and a CUDA graph capture.

Run against the installed extension (pip install .) or the JIT build (COURSE_EXT_ROUTE=jit).
"""
import itertools

import pytest
import torch

import flash_attention
from coursekit.pytest_plugin import DTYPES, dtype_id, poison_allocator, require_cuda
from paged_testing import (CPU_DTYPES, HALF_DTYPES, OPS, assert_paged, blocks_needed, cuda_tol, make_cache,
                           make_prefill, reference_paged_prefill)

pytestmark = pytest.mark.usefixtures("seeded_python_random")

PREFILL_VERSIONS = flash_attention.VERSIONS.get("paged_prefill_attention", ())

# (chunks, contexts, heads, heads_kv, head_dim, block_size): chunk lengths 1, 17, 128, 129 and 0
# mixed, contexts that are not multiples of the block size (and one that is), a chunk that is its
# whole context (a cold prompt), GQA 4:1 and multi-query, a prime head_dim and block size.
CPU_SHAPES = [
    ([17, 1, 0, 129, 128], [40, 33, 16, 129, 300], 4, 1, 16, 16),
    ([1, 1, 1], [1, 15, 17], 8, 2, 32, 8),
    ([5, 0, 13], [31, 7, 13], 6, 3, 7, 5),
    ([64], [1000], 4, 2, 64, 32),
]


def shape_id(shape):
    chunks, contexts, heads, heads_kv, head_dim, block_size = shape
    return (f"q{'-'.join(map(str, chunks))}ctx{'-'.join(map(str, contexts))}h{heads}kv{heads_kv}d{head_dim}"
            f"bs{block_size}")


def prefill(query, key_cache, value_cache, tables, cu, lens, **kw):
    return flash_attention.paged_prefill_attention(query, key_cache, value_cache, tables, cu, lens, **kw)


# ---------------------------------------------------------------------------------------------
# 1. The CPU reference against a dense computation, and two more witnesses
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=shape_id)
def test_prefill_matches_dense_reference(shape, dtype):
    chunks, contexts, heads, heads_kv, head_dim, block_size = shape
    inputs = make_prefill(chunks, contexts, block_size, heads, heads_kv, head_dim, dtype)
    ref = reference_paged_prefill(*inputs)
    poison_allocator(ref.to(dtype))
    out = prefill(*inputs)
    assert_paged(out, ref, dtype, shape_id(shape))


def test_prefill_matches_contiguous_causal_attention():
    """One sequence, its context laid out contiguously and read by the training half's attention
    with causal=True, whose mask is aligned bottom-right as the prefill's: the same rows."""
    block_size, chunk, context, heads, heads_kv, head_dim = 16, 23, 77, 4, 2, 32
    query, key_cache, value_cache, tables, cu, lens = make_prefill([chunk], [context], block_size, heads, heads_kv,
                                                                   head_dim, torch.float64)
    pages = tables[0, :blocks_needed(context, block_size)].long()
    k = key_cache[pages].flatten(0, 1)[:context].transpose(0, 1)[None]  # (1, heads_kv, context, d)
    v = value_cache[pages].flatten(0, 1)[:context].transpose(0, 1)[None]
    expected = flash_attention.attention(query.transpose(0, 1)[None], k, v, causal=True)[0].transpose(0, 1)
    torch.testing.assert_close(prefill(query, key_cache, value_cache, tables, cu, lens), expected, rtol=1e-10,
                               atol=1e-10)


def test_decode_tokens_are_paged_attention():
    """A batch of chunks of one token is a decode step: the same bits as paged_attention (the CPU
    reference computes both with one function, in one order)."""
    contexts = [1, 16, 17, 90]
    query, key_cache, value_cache, tables, cu, lens = make_prefill([1] * 4, contexts, 16, 8, 2, 64)
    out = prefill(query, key_cache, value_cache, tables, cu, lens)
    assert torch.equal(out, flash_attention.paged_attention(query, key_cache, value_cache, tables, lens))


@pytest.mark.parametrize("chunk", (1, 17, 128))
def test_chunked_prefill_equals_whole_prefill(chunk):
    """A prompt prefilled in chunks of N (each chunk's context = the tokens before it plus itself)
    gives the rows of the whole prompt prefilled at once."""
    prompt, block_size = 301, 16
    query, key_cache, value_cache, tables, cu, lens = make_prefill([prompt], [prompt], block_size, 4, 2, 32,
                                                                   torch.float64)
    whole = prefill(query, key_cache, value_cache, tables, cu, lens)
    for start in range(0, prompt, chunk):
        end = min(start + chunk, prompt)
        part = prefill(query[start:end], key_cache, value_cache, tables,
                       torch.tensor([0, end - start], dtype=torch.int32), torch.tensor([end], dtype=torch.int32))
        torch.testing.assert_close(part, whole[start:end], rtol=1e-12, atol=1e-12, msg=lambda m: f"{start}: {m}")


@pytest.mark.parametrize("scale", (0.05, 3.0))
def test_scale_is_used(scale):
    inputs = make_prefill([3, 9], [10, 9], 8, 4, 2, 16, torch.float64)
    assert_paged(prefill(*inputs, scale=scale), reference_paged_prefill(*inputs, scale=scale), torch.float64)


def test_default_scale():
    inputs = make_prefill([3], [10], 8, 2, 2, 16, torch.float64)
    assert torch.equal(prefill(*inputs), prefill(*inputs, scale=0.25))


def test_strided_query_and_tables():
    """A query that is a strided, misaligned view of a fused projection, and a column slice of a
    wider table, are read in place: the bits of contiguous copies."""
    query, key_cache, value_cache, tables, cu, lens = make_prefill([4, 7], [9, 30], 8, 4, 2, 16)
    buffer = torch.randn(11 * 3 * 4 * 16 + 1)
    fused = buffer[1:].view(11, 12, 16)[:, 4:8]
    fused.copy_(query)
    wide = torch.cat([torch.full((2, 3), -5, dtype=torch.int32), tables], dim=1)[:, 3:]
    assert not fused.is_contiguous() and not wide.is_contiguous()
    expected = prefill(query, key_cache, value_cache, tables, cu, lens)
    assert torch.equal(prefill(fused, key_cache, value_cache, wide, cu, lens), expected)


def test_empty_chunks_and_batches():
    query, key_cache, value_cache, tables, cu, lens = make_prefill([0, 0], [5, 0], 4, 2, 2, 8)
    assert prefill(query, key_cache, value_cache, tables, cu, lens).shape == (0, 2, 8)
    empty = torch.zeros(0, 2, dtype=torch.int32)
    out = prefill(torch.randn(0, 2, 8), key_cache, value_cache, empty, torch.zeros(1, dtype=torch.int32),
                  torch.zeros(0, dtype=torch.int32))
    assert out.shape == (0, 2, 8)


def test_unchecked_inputs_follow_the_memory_safety_rules():
    """check_tables=False: a block id outside the cache adds nothing (its tokens are absent, as in
    paged_attention), a context longer than the row is clamped to it, and a chunk longer than its
    context has rows that see nothing: 0."""
    key_cache, value_cache = make_cache(6, 4, 2, 8, torch.float64)
    tables = torch.tensor([[0, 99, 2], [1, -3, 4], [5, 3, 2]], dtype=torch.int32)
    lens = torch.tensor([10, 12, 40], dtype=torch.int32)
    cu = torch.tensor([0, 3, 8, 14], dtype=torch.int32)
    query = torch.randn(14, 4, 8, dtype=torch.float64)
    out = prefill(query, key_cache, value_cache, tables, cu, lens, check_tables=False)
    assert_paged(out, reference_paged_prefill(query, key_cache, value_cache, tables, cu, lens), torch.float64)
    short = torch.tensor([0, 5], dtype=torch.int32)
    out = prefill(query[:5], key_cache, value_cache, tables[:1], short, torch.tensor([3], dtype=torch.int32),
                  check_tables=False)
    assert torch.all(out[:2] == 0) and torch.all(out[2:] != 0), "rows before the context's start see nothing"


@pytest.mark.parametrize("version", PREFILL_VERSIONS)
def test_cpu_accepts_every_version_name(version):
    inputs = make_prefill([3, 1], [7, 4], 4, 2, 2, 8, torch.float64)
    assert torch.equal(prefill(*inputs, version=version), prefill(*inputs))


def test_versions_table_lists_the_prefill_ladder():
    assert list(PREFILL_VERSIONS) == OPS.versions("paged_prefill_attention")


def test_meta_tensors_give_shapes():
    query = torch.empty(300, 8, 128, device="meta", dtype=torch.bfloat16)
    key_cache = torch.empty(50, 16, 2, 128, device="meta", dtype=torch.bfloat16)
    tables = torch.empty(3, 7, device="meta", dtype=torch.int32)
    cu = torch.empty(4, device="meta", dtype=torch.int32)
    lens = torch.empty(3, device="meta", dtype=torch.int32)
    out = prefill(query, key_cache, key_cache, tables, cu, lens)
    assert out.shape == query.shape and out.dtype == torch.bfloat16 and out.device.type == "meta"
    with pytest.raises(RuntimeError, match=r"paged_prefill_attention: unknown version 'v3'"):
        prefill(query, key_cache, key_cache, tables, cu, lens, version="v3")


# ---------------------------------------------------------------------------------------------
# 2. version=None's rule, asked for any GPU
# ---------------------------------------------------------------------------------------------
RULE_CASES = [
    # (dtype, cuda, capability, hopper_built, total_q, max_seqlen_q, head_dim, block_size, scale): the rung
    ((torch.bfloat16, True, (9, 0), False, 300, 0, 128, 16, None), "mma"),  # a build without the sm_90a kernels
    ((torch.float16, True, (8, 0), True, 300, 129, 128, 16, None), "mma"),  # not a Hopper GPU
    ((torch.bfloat16, True, (10, 0), True, 300, 0, 128, 16, None), "mma"),  # sm_90a code runs on 9.0 alone
    ((torch.bfloat16, True, (9, 0), True, 300, 0, 128, 16, None), "persistent"),
    ((torch.float16, True, (9, 0), True, 300, 129, 64, 256, None), "persistent"),
    ((torch.bfloat16, True, (9, 0), True, 300, 0, 256, 16, None), "mma"),  # no packed d256 instantiation
    ((torch.bfloat16, True, (9, 0), True, 300, 0, 128, 48, None), "mma"),   # 48 neither divides 128 nor is a multiple
    ((torch.bfloat16, True, (9, 0), True, 300, 0, 128, 4, None), "mma"),    # under the swizzle's 8 rows
    ((torch.bfloat16, True, (9, 0), True, 300, 0, 128, 16, -1.0), "mma"),  # persistent takes scale > 0
    ((torch.bfloat16, True, (9, 0), True, 64, 1, 128, 16, None), "decode_rows"),  # all decode tokens
    ((torch.bfloat16, True, (9, 0), True, 64, 1, 128, 64, None), "persistent"),   # ... at a size decode_rows lacks
    ((torch.bfloat16, True, (9, 0), False, 64, 1, 128, 16, None), "decode_rows"),  # no 64-row tiles
    ((torch.bfloat16, True, (9, 0), False, 1, 0, 128, 16, None), "decode_rows"),   # one token: total_q bounds it
    ((torch.float32, True, (9, 0), True, 300, 0, 128, 16, None), "decode_rows"),   # no tensor cores in float32
    ((torch.float64, True, (9, 0), True, 300, 0, 128, 16, None), "decode_rows"),
    ((torch.bfloat16, True, (7, 5), False, 300, 0, 128, 16, None), "decode_rows"),  # no bf16 mma.sync before sm_80
    ((torch.float32, False, (0, 0), False, 300, 0, 128, 16, None), "decode_rows"),  # the CPU: the name is validated
]


def prefill_rule(dtype, cuda, capability, hopper_built, total_q, max_seqlen_q, head_dim, block_size, scale):
    return flash_attention.dispatch_rule("paged_prefill_attention", (total_q, 8, head_dim), dtype=dtype, cuda=cuda,
                                         capability=capability, hopper_built=hopper_built, scale=scale,
                                         max_seqlen_q=max_seqlen_q, block_size=block_size)


@pytest.mark.parametrize("case,rung", RULE_CASES, ids=["-".join(map(str, c)) for c, _ in RULE_CASES])
def test_default_rule(case, rung):
    assert prefill_rule(*case) == rung


def test_persistent_block_sizes_by_construction():
    """The Hopper rung loads a key tile (128 keys at head_dim 64 and 128) as one TMA box per page: it
    takes exactly the block sizes of at least 8 rows (the 128-byte swizzle's period) that divide the
    tile or are multiples of it, and every other size keeps the tensor-core rung of part 1."""
    for head_dim in (64, 128):
        for block_size in range(1, 1025):
            whole_pages = block_size >= 8 and (128 % block_size == 0 or block_size % 128 == 0)
            rung = prefill_rule(torch.bfloat16, True, (9, 0), True, 300, 0, head_dim, block_size, None)
            assert rung == ("persistent" if whole_pages else "mma"), (head_dim, block_size, rung)


def test_persistent_producer_by_construction():
    """How rung persistent's producer loads a key tile: pages under 64 rows (8, 16 and 32: 16 to 64
    boxes per tile, each as dear to the copy engine as a large one) gathered with cp.async by its 128
    threads, larger pages one TMA box each, and nothing for the block sizes the rung refuses."""
    producer = torch.ops.flash_attention.paged_prefill_hopper_producer
    for head_dim in (64, 128, 256):
        for block_size in range(1, 1025):
            taken = head_dim != 256 and block_size >= 8 and (128 % block_size == 0 or block_size % 128 == 0)
            expected = ("gather" if block_size < 64 else "tma") if taken else ""
            assert producer(head_dim, block_size) == expected, (head_dim, block_size)


@pytest.mark.parametrize("knob,expected", [(None, "gather"), ("", "gather"), ("group", "gather"),
                                            ("tile", "gather_by_tile"), ("tiles", "gather"), ("TILE", "gather")])
def test_persistent_gather_entries_knob(knob, expected, monkeypatch):
    """FLASH_ATTENTION_PAGED_GATHER as the launcher reads it (tile_schedule.h's paged_gather_entries):
    "tile" alone picks the per-tile table entries; unset, empty or anything else the default, by
    group. Pages of 64 rows and up are TMA boxes whatever the knob says."""
    if knob is None:
        monkeypatch.delenv("FLASH_ATTENTION_PAGED_GATHER", raising=False)
    else:
        monkeypatch.setenv("FLASH_ATTENTION_PAGED_GATHER", knob)
    producer = torch.ops.flash_attention.paged_prefill_hopper_producer
    for block_size in (8, 16, 32):
        assert producer(128, block_size) == expected, block_size
    assert producer(128, 64) == "tma"


# ---------------------------------------------------------------------------------------------
# 3. opcheck and misuse
# ---------------------------------------------------------------------------------------------
def _opcheck_calls(device="cpu"):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    inputs = make_prefill([17, 1, 0], [40, 5, 3], 16, 4, 2, 64, dtype, device, junk=False)
    return {
        "prefill": (OPS.paged_prefill_attention.default, (*inputs, 0.125, 0, None, True)),
        "prefill_unchecked_mma": (OPS.paged_prefill_attention.default, (*inputs, 0.125, 17, "mma", False)),
        "prefill_decode_rows": (OPS.paged_prefill_attention.default, (*inputs, 0.125, 0, "decode_rows", False)),
    }


@pytest.mark.parametrize("call", ["prefill", "prefill_unchecked_mma", "prefill_decode_rows"])
def test_opcheck(call):
    fn, args = _opcheck_calls()[call]
    torch.library.opcheck(fn, args)


def _args(**change):
    """Valid arguments (2 sequences, chunks 2 and 3, contexts 5 and 8, heads 4, heads_kv 2,
    head_dim 8, block_size 4, 6 blocks), with some replaced."""
    args = dict(query=torch.randn(5, 4, 8), key_cache=torch.randn(6, 4, 2, 8), value_cache=torch.randn(6, 4, 2, 8),
                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
                context_lens=torch.tensor([5, 8], dtype=torch.int32))
    args.update(change)
    return args


def _call(version=None, max_seqlen_q=0, check_tables=True, **change):
    return lambda: flash_attention.paged_prefill_attention(**_args(**change), version=version,
                                                           max_seqlen_q=max_seqlen_q, check_tables=check_tables)


def test_valid_misuse_baseline():
    """The misuse cases below each change one thing in this call, which must succeed."""
    _call()()
    _call(max_seqlen_q=3)()


OP = "paged_prefill_attention"
MISUSES = {
    "query 4-D": (_call(query=torch.randn(5, 4, 1, 8)),
                  rf"{OP}: query has shape \[5, 4, 1, 8\] \(4 dims\); it must have 3: \(total_q, heads, head_dim\)"),
    "float16 on cpu": (_call(query=torch.randn(5, 4, 8).half(), key_cache=torch.randn(6, 4, 2, 8).half(),
                             value_cache=torch.randn(6, 4, 2, 8).half()),
                       rf"{OP}: query has dtype Half, which is not supported \(supported: Float, Double\)"),
    "query/cache dtype mix": (_call(query=torch.randn(5, 4, 8, dtype=torch.float64)),
                              rf"{OP}: key_cache is Float but query is Double"),
    "head_dim mismatch": (_call(query=torch.randn(5, 4, 16)),
                          rf"{OP}: query has head_dim 16 but key_cache and value_cache have head_dim 8"),
    "heads not a multiple": (_call(query=torch.randn(5, 3, 8)),
                             rf"{OP}: query has 3 heads and the cache has 2 kv heads"),
    "cache not contiguous": (_call(key_cache=torch.randn(6, 2, 4, 8).transpose(1, 2)),
                             rf"{OP}: key_cache is not contiguous"),
    "cu_seqlens_q int64": (_call(cu_seqlens_q=torch.tensor([0, 2, 5])),
                           rf"{OP}: cu_seqlens_q has dtype Long, which is not supported \(supported: Int\)"),
    "block_tables int64": (_call(block_tables=torch.tensor([[0, 1], [2, 3]])),
                           rf"{OP}: block_tables has dtype Long, which is not supported \(supported: Int\)"),
    "cu_seqlens_q length": (_call(cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32)),
                            rf"{OP}: cu_seqlens_q has 2 offsets for a batch of 2 sequences \(block_tables' rows\); "
                            r"it needs batch \+ 1"),
    "context_lens length": (_call(context_lens=torch.tensor([5, 8, 1], dtype=torch.int32)),
                            rf"{OP}: context_lens has 3 lengths for a batch of 2 sequences"),
    "device mix": (_call(cu_seqlens_q=torch.zeros(3, dtype=torch.int32, device="meta")),
                   rf"{OP}: cu_seqlens_q is on meta but query is on cpu"),
    "max_seqlen_q negative": (_call(max_seqlen_q=-1), rf"{OP}: max_seqlen_q is -1; it must be 0"),
    "unknown version": (_call(version="v2"),
                        rf"{OP}: unknown version 'v2'; expected one of decode_rows, mma, persistent \(or None"),
    # values (check_tables=True)
    "table too short for the context": (_call(context_lens=torch.tensor([5, 9], dtype=torch.int32)),
                                        rf"{OP}: context_lens\[1\] is 9 but its block_tables row covers 2 blocks x "
                                        r"block_size 4 = 8 tokens"),
    "block id past the cache": (_call(block_tables=torch.tensor([[0, 1], [2, 6]], dtype=torch.int32)),
                                rf"{OP}: block_tables\[1\]\[1\] is 6, not a block of the cache"),
    "offsets start past 0": (_call(cu_seqlens_q=torch.tensor([1, 2, 5], dtype=torch.int32)),
                             rf"{OP}: cu_seqlens_q\[0\] is 1; the offsets start at 0"),
    "offsets end short": (_call(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32)),
                          rf"{OP}: cu_seqlens_q ends at 4 but query has 5 tokens"),
    "offsets decrease": (_call(query=torch.randn(2, 4, 8), cu_seqlens_q=torch.tensor([0, 3, 2], dtype=torch.int32)),
                         rf"{OP}: cu_seqlens_q decreases from 3 to 2 at sequence 1"),
    "chunk longer than its context": (_call(context_lens=torch.tensor([1, 8], dtype=torch.int32)),
                                      rf"{OP}: sequence 0 has 2 query tokens but context_lens\[0\] is 1; the new "
                                      r"tokens are the last of the context"),
    "chunk longer than max_seqlen_q": (_call(max_seqlen_q=2),
                                       rf"{OP}: sequence 1 has 3 query tokens but max_seqlen_q is 2"),
}


@pytest.mark.parametrize("misuse", list(MISUSES))
def test_misuse_raises_clear_error(misuse):
    call, message = MISUSES[misuse]
    with pytest.raises(RuntimeError, match=message):
        call()


# ---------------------------------------------------------------------------------------------
# 4. CUDA: both rungs against the CPU reference of the same inputs
# ---------------------------------------------------------------------------------------------
# Chunks 1, 17, 128, 129 and 0 with decode tokens among them, contexts off the block size, one
# chunk that is its whole context (a cold prompt: the full causal triangle), one long context.
CUDA_CHUNKS = ([1, 17, 128, 1, 0, 129, 1], [50, 17, 300, 1, 9, 1000, 2049])
CUDA_GQA = ((8, 8), (8, 2), (8, 1))


def hopper_runs():
    """Whether rung persistent runs here: a build with the sm_90a kernels on a GPU of capability 9.0."""
    return torch.cuda.get_device_capability() == (9, 0) and flash_attention.hopper_kernels_built()


def require_hopper():
    require_cuda()
    if not hopper_runs():
        pytest.skip("rung persistent needs a Hopper GPU (9.0) and a build with the sm_90a kernels")


def rungs_for(dtype):
    """The rungs that run here for dtype at block_size 16 (every rung's)."""
    return [v for v in PREFILL_VERSIONS
            if v == "decode_rows" or (dtype in HALF_DTYPES and (v == "mma" or hopper_runs()))]


def check_cuda_prefill(chunks, contexts, heads, heads_kv, head_dim, block_size, dtype, version, what,
                       check_tables=True, max_seqlen_q=0, inputs=None):
    if inputs is None:
        inputs = make_prefill(chunks, contexts, block_size, heads, heads_kv, head_dim, dtype, "cuda")
    ref = reference_paged_prefill(*inputs, device="cuda")  # float64 on the GPU: the long contexts' reference
    poison_allocator(torch.empty(inputs[0].shape, dtype=dtype, device="cuda"))
    out = prefill(*inputs, version=version, check_tables=check_tables, max_seqlen_q=max_seqlen_q)
    assert out.device.type == "cuda" and out.dtype == dtype and out.shape == ref.shape, what
    rtol, atol = cuda_tol(dtype, inputs[2])
    torch.testing.assert_close(out.cpu().double(), ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("block_size", (16, 32))
@pytest.mark.parametrize("gqa", CUDA_GQA, ids=lambda g: f"h{g[0]}kv{g[1]}")
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_cuda_prefill_matches_reference(dtype, head_dim, gqa, block_size):
    require_cuda()
    heads, heads_kv = gqa
    for version in rungs_for(dtype):
        check_cuda_prefill(*CUDA_CHUNKS, heads, heads_kv, head_dim, block_size, dtype, version,
                           f"{version} {dtype_id(dtype)} d{head_dim} h{heads}kv{heads_kv} bs{block_size}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_rungs_agree_with_max_seqlen_q(dtype):
    """max_seqlen_q sizes mma's grid: the exact bound, and the default (total_q, most tiles leave
    at once), give the same bits."""
    require_cuda()
    inputs = make_prefill([129, 1, 17], [200, 80, 17], 16, 8, 2, 128, dtype, "cuda")
    exact = prefill(*inputs, version="mma", max_seqlen_q=129)
    assert torch.equal(exact, prefill(*inputs, version="mma"))


PREFILL_KERNELS = {"decode_rows": "paged_attention_kernel", "mma": "paged_prefill_kernel",
                   "persistent": "flash_fwd_hopper_persistent_kernel"}


@pytest.mark.cuda
def test_cuda_default_dispatch():
    """version=None: the Hopper kernel (on a Hopper GPU, at any block size it takes) or else the
    tensor-core kernel for a batch with a chunk, the decode kernel for a batch of decode tokens
    (max_seqlen_q = 1) at the block sizes it takes and for float32 (flash_attention.default_choice
    agrees)."""
    require_cuda()
    from coursekit.pytest_plugin import launched_kernels
    chunk_rung = "persistent" if hopper_runs() else "mma"
    cases = [([17, 1], torch.bfloat16, 0, 16, chunk_rung),
             ([1, 1], torch.bfloat16, 1, 16, "decode_rows"),
             ([17, 1], torch.float32, 0, 16, "decode_rows")]
    if hopper_runs():
        cases += [([17, 1], torch.float16, 0, 128, "persistent"), ([1, 1], torch.bfloat16, 1, 64, "persistent")]
    for chunks, dtype, max_q, block_size, rung in cases:
        inputs = make_prefill(chunks, [40, 40], block_size, 8, 2, 64, dtype, "cuda")
        _, names = launched_kernels(lambda: prefill(*inputs, max_seqlen_q=max_q, check_tables=False),
                                    "flash_attention")
        assert any(PREFILL_KERNELS[rung] in n for n in names), (chunks, dtype, block_size, names)
        assert flash_attention.default_choice("paged_prefill_attention", inputs[0], max_seqlen_q=max_q,
                                              block_size=block_size) == rung


# Rung persistent: chunks of 1, 17, 127, 128, 129 and 512 (one off the 128-row tile either way, and
# the target's) after prefixes of 0, 5, 4095 and 4096 tokens (a cold prompt, a prefix inside one
# page, one off a key tile and whole tiles), decode tokens and empty chunks among them, every block
# size class (pages the producer gathers with cp.async: 8, 16 and 32 rows, the smallest a swizzle
# period; pages of one TMA box that split the key tile, one page a tile, pages of two tiles) and GQA
# 4:1, 8:1 and 1:1 across them.
PERSISTENT_CHUNKS = (1, 17, 127, 128, 129, 512)
PERSISTENT_PREFIXES = (0, 5, 4095, 4096)
PERSISTENT_GQA = {8: 1, 16: 2, 32: 8, 64: 1, 128: 8, 256: 2}  # block size: kv heads of 8 query heads


def contiguous_persistent(query, key_cache, value_cache, tables, cu, chunks, contexts, block_size):
    """What the paged prefill must give, bit for bit: rung "persistent" of attention_varlen on each
    sequence's context gathered contiguous through its table (the same consumers on the same keys)."""
    pages = [tables[b, :blocks_needed(n, block_size)].long() for b, n in enumerate(contexts)]
    k = torch.cat([key_cache[p].flatten(0, 1)[:n] for p, n in zip(pages, contexts)])
    v = torch.cat([value_cache[p].flatten(0, 1)[:n] for p, n in zip(pages, contexts)])
    cu_k = torch.tensor([0, *itertools.accumulate(contexts)], dtype=torch.int32, device=query.device)
    return flash_attention.attention_varlen(query, k, v, cu, cu_k, max(chunks), max(contexts), causal=True,
                                            version="persistent")


def persistent_batch():
    chunks = [c for c in PERSISTENT_CHUNKS for _ in PERSISTENT_PREFIXES] + [1, 1, 1, 0, 0]
    contexts = [c + p for c in PERSISTENT_CHUNKS for p in PERSISTENT_PREFIXES] + [1, 300, 4097, 0, 9]
    return chunks, contexts


@pytest.mark.cuda
@pytest.mark.parametrize("block_size", tuple(PERSISTENT_GQA))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_persistent_matches_reference(dtype, head_dim, block_size):
    """Rung persistent against the float64 reference, into a NaN-poisoned output (check_cuda_prefill),
    with max_seqlen_q exact at two block sizes and 0 (total_q) at the others."""
    require_hopper()
    chunks, contexts = persistent_batch()
    max_q = max(chunks) if block_size in (64, 256) else 0
    check_cuda_prefill(chunks, contexts, 8, PERSISTENT_GQA[block_size], head_dim, block_size, dtype, "persistent",
                       f"persistent {dtype_id(dtype)} d{head_dim} bs{block_size}", max_seqlen_q=max_q)


@pytest.mark.cuda
@pytest.mark.parametrize("block_size,heads_kv,head_dim", [(8, 2, 128), (8, 1, 64), (16, 2, 128), (16, 8, 64),
                                                          (32, 1, 64), (32, 2, 128), (64, 4, 128), (128, 2, 64),
                                                          (256, 2, 128)])
def test_cuda_persistent_is_attention_varlen(block_size, heads_kv, head_dim):
    """Rung persistent is attention_varlen's persistent kernel with the keys read through the table:
    the same consumers on the same keys in the same order (the rows past a context are zeros or the
    cache's bytes here and the next sequence's there, masked either way), so the same bits as
    attention_varlen on the keys gathered contiguous, whichever way the producer loads the pages
    (cp.async at 8, 16 and 32 rows, each at both head dims: one 64-column chunk a row or two; TMA
    boxes from 64 up). The batch's contexts hold key tiles wholly inside the context (the gather's
    unchecked copies) and partial last tiles (its checked ones), at multiples of 128 and off them."""
    require_hopper()
    chunks, contexts = persistent_batch()
    query, key_cache, value_cache, tables, cu, lens = make_prefill(chunks, contexts, block_size, 8, heads_kv,
                                                                   head_dim, torch.bfloat16, "cuda")
    expected = contiguous_persistent(query, key_cache, value_cache, tables, cu, chunks, contexts, block_size)
    assert torch.equal(prefill(query, key_cache, value_cache, tables, cu, lens, version="persistent"), expected)


# Block ids a server's unchecked table may hold for a page below the context: past the cache, -1,
# and the int32 extremes.
OUT_OF_CACHE_IDS = (-1, -(2 ** 31), 2 ** 31 - 1)


@pytest.mark.cuda
@pytest.mark.parametrize("block_size", (8, 16, 32, 64))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_persistent_blocks_outside_the_cache_read_as_zeros(dtype, head_dim, block_size):
    """check_tables=False on rung persistent, pages the producer gathers (8, 16, 32 rows: each
    page's slot resolved once per tile, -1 for one outside the cache) and one TMA box a page (64):
    a block id outside the cache, below the context, reads as a block of zeros (serving.h). The
    witness is the same call over the cache with one zero block appended and those ids pointing at
    it: the same bits, and the float64 reference's answer there. Chunks of 1, 17, 127 and 129 tokens
    after contexts off the page size, the tables shuffled (make_tables) with junk past every context,
    GQA 4:1. Sequences 0 and 3 hold their bad id in a key tile that is not their last: the gather
    copies such a tile with its rows checked, as it does a partial last tile."""
    require_hopper()
    chunks, contexts = [1, 17, 127, 129, 17], [300, 17 + 45, 127 + 3 * block_size + 1, 129 + 200, 40]
    query, key_cache, value_cache, tables, cu, lens = make_prefill(chunks, contexts, block_size, 8, 2, head_dim,
                                                                   dtype, "cuda")
    num_blocks = key_cache.shape[0]
    junk = tables.clone()
    # Pages inside the context (the first of sequence 0, the last valid one of sequence 1, a middle one
    # of sequence 3), and past the cache by one.
    spots = [(0, 0), (1, blocks_needed(contexts[1], block_size) - 1), (3, 2), (2, 1)]
    for (b, j), bad in zip(spots, (*OUT_OF_CACHE_IDS, num_blocks)):
        junk[b, j] = bad
    zero_block = torch.zeros_like(key_cache[:1])
    key_zero, value_zero = torch.cat([key_cache, zero_block]), torch.cat([value_cache, zero_block])
    inside = torch.where((junk >= 0) & (junk < num_blocks), junk, torch.full_like(junk, num_blocks))
    out = prefill(query, key_cache, value_cache, junk, cu, lens, version="persistent", check_tables=False)
    witness = prefill(query, key_zero, value_zero, inside, cu, lens, version="persistent", check_tables=False)
    what = f"persistent {dtype_id(dtype)} d{head_dim} bs{block_size}"
    assert torch.equal(out, witness), what
    ref = reference_paged_prefill(query, key_zero, value_zero, inside, cu, lens, device="cuda")
    rtol, atol = cuda_tol(dtype, value_cache)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# The gather's table entries (tile_schedule.h's PagedGatherEntries), by the launcher's knob.
PAGED_GATHER_KNOB = "FLASH_ATTENTION_PAGED_GATHER"


@pytest.mark.cuda
@pytest.mark.parametrize("block_size", (8, 16, 32))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_cuda_persistent_gather_entries_by_group_or_tile(head_dim, block_size, monkeypatch):
    """The gather reads a key tile's table entries by group (each warp 32 pages at once: 2, 4, 8 tiles
    at 8, 16, 32 rows; the default) or by tile (FLASH_ATTENTION_PAGED_GATHER=tile): the same bytes to
    the same slots, so the same bits, and attention_varlen's on the keys gathered contiguous. The
    contexts (1 to 17 groups) end at a group's edge, one page past it, and mid-group; with
    check_tables=False, ids outside the cache in group 1's first tile, in its last tile, and in a
    later group's tile that is not the item's last (each then copied with its rows checked)."""
    require_hopper()
    chunks, contexts = [128, 1, 129, 64, 17], [2048, 1024 + block_size, 2500, 4096 + 64, 300]
    query, key_cache, value_cache, tables, cu, lens = make_prefill(chunks, contexts, block_size, 8, 2, head_dim,
                                                                   torch.bfloat16, "cuda")
    group = 32 * block_size  # keys a group of entries covers
    junk = tables.clone()
    for b, key in ((0, group), (2, 2 * group - 1), (3, (contexts[3] // group) * group - 200)):
        junk[b, key // block_size] = key_cache.shape[0] + 3  # past the cache: read as a block of zeros

    def run(knob, table):
        if knob is None:
            monkeypatch.delenv(PAGED_GATHER_KNOB, raising=False)
        else:
            monkeypatch.setenv(PAGED_GATHER_KNOB, knob)
        return prefill(query, key_cache, value_cache, table, cu, lens, version="persistent", check_tables=False)

    expected = contiguous_persistent(query, key_cache, value_cache, tables, cu, chunks, contexts, block_size)
    for knob in (None, "group", "tile"):
        assert torch.equal(run(knob, tables), expected), knob
    by_tile = run("tile", junk)
    assert bool(by_tile.isfinite().all())
    for knob in (None, "group"):
        assert torch.equal(run(knob, junk), by_tile), knob


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_cuda_unchecked_inputs_follow_the_memory_safety_rules(dtype):
    """check_tables=False with block ids outside the cache (mma's masked slow path), a context past
    its row, and a chunk longer than its context: no fault, and the CPU reference's answer."""
    require_cuda()
    key_cache, value_cache = make_cache(12, 16, 2, 64, dtype, "cuda")
    tables = torch.tensor([[0, 99, 2, 7], [1, -3, 4, 8], [5, 3, 2, 11], [2 ** 31 - 1, 6, -(2 ** 31), 9]],
                          dtype=torch.int32, device="cuda")
    lens = torch.tensor([40, 60, 5000, 50], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 17, 18, 18 + 70, 18 + 70 + 64], dtype=torch.int32, device="cuda")
    query = torch.randn(152, 8, 64, device="cuda").to(dtype)
    inputs = (query, key_cache, value_cache, tables, cu, lens)
    for version in rungs_for(dtype):
        if version == "persistent":
            # Reads a block outside the cache as zeros (serving.h), not as absent: only sequence 2, whose
            # blocks are all in the cache, is the reference's; the rest must be finite (no fault, no junk).
            out = prefill(*inputs, version=version, check_tables=False)
            ref = reference_paged_prefill(*inputs)
            rtol, atol = cuda_tol(dtype, value_cache)
            torch.testing.assert_close(out[18:88].cpu().double(), ref[18:88], rtol=rtol, atol=atol)
            assert bool(out.isfinite().all()), "persistent: a block outside the cache gave a non-finite row"
            continue
        check_cuda_prefill(None, None, 8, 2, 64, 16, dtype, version, f"{version} {dtype_id(dtype)}",
                           check_tables=False, inputs=inputs)
    torch.cuda.synchronize()  # a fault would surface here at the latest


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_misaligned_query(dtype):
    """A query one element into its buffer and strided (a slice of a fused projection) gives the
    contiguous copy's bits: mma copies it to an aligned one, decode_rows reads it in place."""
    require_cuda()
    query, key_cache, value_cache, tables, cu, lens = make_prefill([17, 1, 40], [17, 30, 300], 16, 8, 2, 64, dtype,
                                                                   "cuda")
    buffer = torch.zeros(58 * 3 * 8 * 64 + 1, device="cuda", dtype=dtype)
    view = buffer[1:].view(58, 24, 64)[:, 8:16]
    view.copy_(query)
    for version in rungs_for(dtype):
        expected = prefill(query, key_cache, value_cache, tables, cu, lens, version=version)
        assert torch.equal(prefill(view, key_cache, value_cache, tables, cu, lens, version=version), expected), version


@pytest.mark.cuda
@pytest.mark.sanitize
def test_cuda_prefill_small():
    """The small run compute-sanitizer checks: both rungs, a chunk, a decode token, an empty chunk,
    a block outside the cache."""
    require_cuda()
    key_cache, value_cache = make_cache(8, 16, 2, 64, torch.bfloat16, "cuda")
    tables = torch.tensor([[0, 1, 2], [3, 99, 4], [5, 6, 7]], dtype=torch.int32, device="cuda")
    inputs = (torch.randn(20, 4, 64, device="cuda").to(torch.bfloat16), key_cache, value_cache, tables,
              torch.tensor([0, 19, 20, 20], dtype=torch.int32, device="cuda"),
              torch.tensor([40, 37, 3], dtype=torch.int32, device="cuda"))
    for version in rungs_for(torch.bfloat16):
        if version != "persistent":  # a block outside the cache is not absent there: the next test
            check_cuda_prefill(None, None, 4, 2, 64, 16, torch.bfloat16, version, version, check_tables=False,
                               inputs=inputs)


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("block_size", (8, 16, 32, 256))
def test_cuda_persistent_small(block_size):
    """The small run compute-sanitizer checks on rung persistent: pages the producer gathers
    (cp.async, 8, 16 and 32 rows: each of the gather's page sizes), a page of two tiles (one TMA box), a chunk over two query tiles,
    decode tokens, an empty chunk, a context off the block size, junk table entries past every
    context."""
    require_hopper()
    check_cuda_prefill([130, 1, 0, 17, 1], [300, 37, 3, 17, 1], 4, 2, 64, block_size, torch.bfloat16, "persistent",
                       f"persistent bs{block_size}", check_tables=False)


@pytest.mark.cuda
@pytest.mark.parametrize("version", [None, *PREFILL_VERSIONS])
def test_cuda_graph_capture(version):
    """A server replays its step from a CUDA graph: with check_tables=False nothing syncs, the
    work goes to the current stream, and decode_rows' index tensors (persistent's lse and schedule)
    come from the graph's pool."""
    require_hopper() if version == "persistent" else require_cuda()
    from coursekit.pytest_plugin import capture_and_replay
    inputs = make_prefill([17, 1, 128], [40, 33, 200], 16, 8, 2, 128, torch.bfloat16, "cuda")
    captured, expected = capture_and_replay(lambda: prefill(*inputs, version=version, max_seqlen_q=128,
                                                            check_tables=False))
    assert torch.equal(captured, expected), version


@pytest.mark.cuda
def test_cuda_misuse():
    require_cuda()
    cuda = {k: v.cuda() for k, v in _args().items()}
    with pytest.raises(RuntimeError, match=rf"{OP}: head_dim 8 is not supported on CUDA \(supported: 64, 128\)"):
        flash_attention.paged_prefill_attention(**cuda)
    inputs = make_prefill([3], [7], 16, 4, 2, 64, torch.float32, "cuda")
    with pytest.raises(RuntimeError, match=rf"{OP}: version 'mma' runs on tensor cores and takes float16 and "
                                           r"bfloat16; query is Float \(use version='decode_rows' or None\)"):
        prefill(*inputs, version="mma")
    with pytest.raises(RuntimeError, match=rf"{OP}: version 'persistent' runs on tensor cores and takes float16 "
                                           r"and bfloat16; query is Float \(use version='decode_rows' or None\)"):
        prefill(*inputs, version="persistent")
    with pytest.raises(RuntimeError, match=rf"{OP}: block_size 48 is not supported on CUDA \(supported: 16, 32; "
                                           r"version 'persistent', on a Hopper GPU, takes more\)"):
        prefill(*make_prefill([3], [7], 48, 4, 2, 64, torch.bfloat16, "cuda"), version="mma")
    if hopper_runs():
        with pytest.raises(RuntimeError, match=rf"{OP}: version 'persistent' loads a 128-key tile page by page and "
                                               r"takes block sizes of at least 8 that divide it or are "
                                               r"multiples of it; block_size is 48"):
            prefill(*make_prefill([3], [7], 48, 4, 2, 64, torch.bfloat16, "cuda"), version="persistent")
    else:
        with pytest.raises(RuntimeError, match=rf"{OP}: version 'persistent' (is a Hopper kernel|needs a Hopper GPU)"):
            prefill(*make_prefill([3], [7], 16, 4, 2, 64, torch.bfloat16, "cuda"), version="persistent")
    query, key_cache, value_cache, tables, cu, lens = make_prefill([3], [7], 16, 4, 2, 64, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match=rf"{OP}: cu_seqlens_q is on cpu but query is on cuda"):
        prefill(query, key_cache, value_cache, tables, cu.cpu(), lens)
    with pytest.raises(RuntimeError, match=rf"{OP}: context_lens\[0\] is 40 but its block_tables row covers 1 "
                                           r"blocks x block_size 16 = 16 tokens"):
        prefill(query, key_cache, value_cache, tables, cu, torch.tensor([40], dtype=torch.int32, device="cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("call", ["prefill", "prefill_unchecked_mma", "prefill_decode_rows"])
def test_cuda_opcheck(call):
    require_cuda()
    fn, args = _opcheck_calls("cuda")[call]
    torch.library.opcheck(fn, args)
