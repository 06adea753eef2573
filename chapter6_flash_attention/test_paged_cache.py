"""Tests of the paged KV cache's writes and copies (reshape_and_cache, copy_blocks; all four
dtypes: they move bytes, not values): against the expected caches on the CPU, opcheck, every
documented misuse, and (marked cuda, skipped without a GPU) the CUDA kernels against the CPU op
of the same inputs, bit for bit.

Run against the installed extension (pip install .) or the JIT build (COURSE_EXT_ROUTE=jit).
"""
import pytest
import torch

import flash_attention
from coursekit.pytest_plugin import DTYPES, dtype_id, require_cuda
from paged_testing import (OPS, assert_same_bits, expected_after_copy, expected_after_write, make_cache, nan_cache,
                           random_mapping, random_slots, strided_query)

# Python's random drives the tables and trees: seeded per test like torch (conftest.py).
pytestmark = pytest.mark.usefixtures("seeded_python_random")


# ---------------------------------------------------------------------------------------------
# 1. reshape_and_cache and copy_blocks
# ---------------------------------------------------------------------------------------------
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
    """check_slots=False: a slot outside the cache is skipped like -1 (csrc/serving/serving.h), never written."""
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


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_copy_blocks(dtype):
    key_cache, value_cache = make_cache(20, 3, 2, 5, dtype)
    mapping = random_mapping(20, 7)
    expected_k, expected_v = expected_after_copy(key_cache, mapping), expected_after_copy(value_cache, mapping)
    flash_attention.copy_blocks(key_cache, value_cache, mapping)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_copy_blocks_unchecked_mapping_skips_outside_pairs():
    """check_mapping=False: a pair naming a block outside the cache is skipped (csrc/serving/serving.h), never
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


# ---------------------------------------------------------------------------------------------
# 2. opcheck and misuse
# ---------------------------------------------------------------------------------------------
def _opcheck_calls(device="cpu"):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    block_size, head_dim, num_blocks = 16, 64, 8
    key_cache, value_cache = make_cache(num_blocks, block_size, 2, head_dim, dtype, device)
    key = torch.randn(5, 2, head_dim, device=device).to(dtype)
    slots = random_slots(5, num_blocks * block_size, padding=1).to(device)
    return {
        "reshape_and_cache": (OPS.reshape_and_cache.default, (key, key * 2, key_cache, value_cache, slots, True)),
        "copy_blocks": (OPS.copy_blocks.default,
                        (key_cache, value_cache, random_mapping(num_blocks, 3).to(device), True)),
        "copy_blocks_unchecked": (OPS.copy_blocks.default,
                                  (key_cache, value_cache, random_mapping(num_blocks, 3).to(device), False)),
    }


OPCHECK_CALLS = ["reshape_and_cache", "copy_blocks", "copy_blocks_unchecked"]


@pytest.mark.parametrize("call", OPCHECK_CALLS)
def test_opcheck(call):
    fn, args = _opcheck_calls()[call]
    torch.library.opcheck(fn, args)


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


def test_valid_misuse_baselines():
    """The misuse cases below each change one thing in these calls, which must succeed."""
    _write()()
    _copy(torch.tensor([[0, 1], [0, 2]]))()


MISUSES = {
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


# ---------------------------------------------------------------------------------------------
# 3. CUDA: the kernels against the CPU op, bit for bit
# ---------------------------------------------------------------------------------------------
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
def test_cuda_misaligned_keys(dtype):
    """csrc/serving/serving.h promises any strides with the last dim contiguous, not alignment: new
    keys one element off (vector loads would fault or misread) are written as their contiguous
    copies are."""
    require_cuda()
    num_blocks = 40
    key_cache, value_cache = make_cache(num_blocks, 16, 2, 64, dtype, "cuda")
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
def test_cuda_misuse():
    """The value checks on the GPU (each a sync) refuse what they refuse on the CPU."""
    require_cuda()
    key_cache = torch.randn(6, 16, 2, 64, device="cuda")
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
