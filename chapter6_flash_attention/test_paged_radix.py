"""Tests of the prefix lookup: flash_attention.RadixCache (insert, lock, evict, the flat mirror)
and the match_prefix op over the mirror, against RadixCache.match_prefix_reference (a walk over
the Python tree, independent of the mirror); opcheck, every documented misuse, and (marked cuda,
skipped without a GPU) the GPU lookup against the CPU op.

Run against the installed extension (pip install .) or the JIT build (COURSE_EXT_ROUTE=jit).
"""
import pytest
import torch

import flash_attention
from coursekit.pytest_plugin import require_cuda
from paged_testing import OPS, assert_matches_reference, lookup_requests, random_radix

# Python's random drives the tables and trees: seeded per test like torch (conftest.py).
pytestmark = pytest.mark.usefixtures("seeded_python_random")


# ---------------------------------------------------------------------------------------------
# 1. match_prefix and RadixCache
# ---------------------------------------------------------------------------------------------
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
# 2. opcheck and misuse
# ---------------------------------------------------------------------------------------------
def _opcheck_args(device="cpu"):
    radix, inserted, _ = random_radix(4, 10, 2, 24)
    queries, query_lens = radix._batch(lookup_requests(inserted, 2, 4, 6), None)
    return (*radix.flat_tree(device), 4, queries.to(device), query_lens.to(device), 5)


def test_opcheck():
    torch.library.opcheck(OPS.match_prefix.default, _opcheck_args())


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


def test_valid_misuse_baseline():
    """The misuse cases below each change one thing in this call, which must succeed."""
    assert _match()()[0].tolist() == [4]


MISUSES = {
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


def test_radix_cache_misuse():
    with pytest.raises(ValueError, match=r"RadixCache: block_size is 0; it must be at least 1"):
        flash_attention.RadixCache(0)
    with pytest.raises(ValueError, match=r"match_prefix: token_ids_batch must be 2-D"):
        flash_attention.RadixCache(2).match_prefix(torch.zeros(4, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# 3. CUDA: the GPU lookup against the CPU op
# ---------------------------------------------------------------------------------------------
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
def test_cuda_opcheck():
    require_cuda()
    torch.library.opcheck(OPS.match_prefix.default, _opcheck_args("cuda"))
