"""Tests of the serving ops together, as a server runs a decode step: copy-on-write of a shared
block, the new tokens' cache writes, then attention over the cache (against attention over the
sequences kept as plain tensors); the same step traced by torch.compile; and (marked cuda,
skipped without a GPU) the step captured in a CUDA graph, and the small run compute-sanitizer
takes over every kernel of the serving half.

Run against the installed extension (pip install .) or the JIT build (COURSE_EXT_ROUTE=jit).
"""
import pytest
import torch

import flash_attention
from coursekit.pytest_plugin import capture_and_replay, require_cuda
from paged_testing import (PAGED_VERSIONS, check_cuda_paged, edge_lengths, lookup_requests, make_cache, make_tables,
                           nan_cache, random_mapping, random_radix, random_slots)

# Python's random drives the tables and trees: seeded per test like torch (conftest.py).
pytestmark = pytest.mark.usefixtures("seeded_python_random")


# ---------------------------------------------------------------------------------------------
# 1. A decode step on the CPU, eager and compiled
# ---------------------------------------------------------------------------------------------
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
# 2. CUDA: graph capture and the sanitizer's run
# ---------------------------------------------------------------------------------------------
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
