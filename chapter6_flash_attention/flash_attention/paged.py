"""Serving: the paged KV cache (vLLM's PagedAttention) and decode attention over it.

The cache is a pool of fixed-size blocks. key_cache and value_cache are each (num_blocks,
block_size, heads_kv, head_dim), contiguous; a sequence owns a list of block ids (its row of
block_tables, int32), and its token t lives in block block_tables[b][t // block_size], row
t % block_size. A "slot" is block * block_size + row. Blocks are the unit of allocation and of
sharing: two sequences with a common prefix point at the same blocks, and a shared block is
copied (copy_blocks) before one of them appends to it.

A decode step, per layer: reshape_and_cache writes the new tokens' K and V at their slots, then
paged_attention lets each sequence's one new query token attend over its context_lens[b] cached
tokens (its own included). A prefill step is the same with several new tokens per sequence:
paged_prefill_attention lets a chunk of a prompt (its next N tokens, or the suffix after a cached
prefix) attend causally over everything its sequence has cached, and a decode token may sit in the
same batch as a chunk of 1.

Checks that read tensor values (block ids, lengths, slots) are a device sync on CUDA; they run by
default (check_tables=True, check_slots=True) so a bad table is a clear error, and a server that
built and checked its tables on the host turns them off (csrc/serving/serving_ops.cpp says more).
The kernels never read or write outside the cache either way: a block id outside the cache adds no
tokens, a context is clamped to what its table row covers, a slot outside the cache is skipped like
-1.
"""
import math

import torch

__all__ = ["reshape_and_cache", "copy_blocks", "paged_attention", "paged_prefill_attention"]


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *, check_slots=True):
    """Write key[i] and value[i] (tokens, heads_kv, head_dim) into the caches at slot_mapping[i],
    in place.

    slot_mapping is int64 (tokens,); -1 marks a padding token, which is skipped. key and value may
    be strided views (a slice of a fused qkv projection) whose last dim is contiguous; their dtype
    is the caches' (any of float32, float16, bfloat16, float64). check_slots=True refuses a slot
    outside the cache or a slot written twice (a device sync on CUDA; False skips it, and a bad
    slot is then skipped like -1). Returns None.
    """
    torch.ops.flash_attention.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_slots)


def copy_blocks(key_cache, value_cache, block_mapping, *, check_mapping=True):
    """For each row (src, dst) of block_mapping (int64, (pairs, 2)), make block dst of both caches
    a copy of block src, in place: copy-on-write of a shared block before a sequence appends.

    No destination may appear twice or also as a source (then the copies are independent and
    their order cannot matter); ids must be blocks of the cache. check_mapping=True refuses a
    mapping that breaks either rule; it reads the mapping back, a device sync on CUDA. A server
    whose allocator built the mapping on the host passes False: the kernel skips a pair that
    names a block outside the cache, so it stays memory-safe either way.
    """
    torch.ops.flash_attention.copy_blocks(key_cache, value_cache, block_mapping, check_mapping)


def _default_scale(query):
    # a wrong rank or head_dim 0 is the op's to reject, with its message
    if query.dim() != 3 or query.shape[-1] == 0:
        return 1.0
    return 1.0 / math.sqrt(query.shape[-1])


def paged_attention(query, key_cache, value_cache, block_tables, context_lens, *, scale=None, version=None,
                    check_tables=True, num_splits=0):
    """Decode attention over the paged cache: out[b, h] = softmax_j(scale * query[b, h] . k_j) v_j
    over the context_lens[b] tokens sequence b has cached.

    query: (batch, heads, head_dim), its last dim contiguous; key_cache, value_cache: (num_blocks,
    block_size, heads_kv, head_dim), contiguous, query's dtype, heads a multiple of heads_kv
    (query head h reads kv head h // (heads // heads_kv)). block_tables: int32 (batch,
    max_blocks); context_lens: int32 (batch,). scale defaults to 1 / sqrt(head_dim). Returns out,
    (batch, heads, head_dim), contiguous, query's dtype; a sequence with context 0 gets zeros.

    version: "per_head" (a block per query head), "per_kv_head" (a block per kv head, its query
    heads sharing each read of K and V), "split_kv" (per_kv_head with the context cut into parts
    when the grid cannot fill the GPU, merged by a combine kernel), or None: split_kv when it
    splits, else per_kv_head. CUDA takes all four floating dtypes, head_dim 64 or 128 and
    block_size 16 or 32; the CPU runs the float32/float64 reference whatever the name.

    check_tables=True refuses a used table entry outside the cache and a context length that is
    negative or longer than its row covers (a device sync on CUDA, and impossible inside a CUDA
    graph capture: pass False there, with tables already known good).

    num_splits: 0 (split_kv picks the count from the shapes the host knows: batch, heads, the
    table's width), or 1 to 128 ranges per context for split_kv or None, as FlashAttention's
    flash_attn_with_kvcache(num_splits=...): a server that knows its lengths on the host can
    choose. On CUDA only float16 and bfloat16 split; the CPU reference ignores it.
    """
    if scale is None:
        scale = _default_scale(query)
    return torch.ops.flash_attention.paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                                                     scale, version, check_tables, num_splits)


def paged_prefill_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens, *, scale=None,
                            max_seqlen_q=0, version=None, check_tables=True):
    """Chunked prefill over the paged cache: each sequence's new tokens attend causally to its
    cached ones, the chunk being the last of its context (bottom-right aligned).

    query: (total_q, heads, head_dim), the chunks of the batch packed, sequence b's tokens at rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] (int32, batch + 1 offsets from 0 to total_q; a chunk may
    be empty, or one token: a decode step). Their K and V are already in the cache
    (reshape_and_cache), and context_lens[b] (int32) counts them: row i of a chunk of q_len tokens
    is token context_lens[b] - q_len + i and sees the tokens up to it. key_cache, value_cache and
    block_tables (int32 (batch, max_blocks)) are paged_attention's; GQA likewise. scale defaults to
    1 / sqrt(head_dim). Returns out, (total_q, heads, head_dim), contiguous, query's dtype.

    max_seqlen_q: the longest chunk, which sizes the CUDA grid (0: total_q, always enough; a server
    knows the lengths on the host and passes them). CUDA takes head_dim 64 or 128 and block_size
    16 or 32 (and on a Hopper GPU, rung persistent, 8, 64, 128, 256 and other multiples of 128 too);
    the CPU runs the float32 and float64 reference whatever the version names.

    version: "decode_rows" (each query row a decode query of paged_attention over the tokens it
    sees: any dtype and GPU, but every row reads its context), "mma" (FlashAttention 2's tiles on
    tensor cores, a 64-row tile reading the context once: float16 and bfloat16, compute capability
    8.0+), "persistent" (the Hopper forward of attention_varlen, its producer copying each key tile
    page by page through the table with TMA: float16 and bfloat16, compute capability 9.0, a build
    with the sm_90a kernels, scale > 0; with check_tables=False a token in a block outside the cache
    reads as zeros there, where the other rungs leave it out), or None: persistent where it runs,
    else mma, unless every chunk is one token (max_seqlen_q == 1, a batch of decode tokens: then
    decode_rows where the block size allows). flash_attention.default_choice says which.

    check_tables=True refuses what paged_attention's does, plus offsets that do not run from 0 to
    total_q without decreasing, a chunk longer than its context or than max_seqlen_q (a device sync
    on CUDA, impossible inside a CUDA graph capture: pass False there).
    """
    if scale is None:
        scale = _default_scale(query)
    return torch.ops.flash_attention.paged_prefill_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q,
                                                             context_lens, scale, max_seqlen_q, version, check_tables)
