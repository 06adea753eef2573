"""A guided tour of chapter 6: flash_attention.attention next to F.scaled_dot_product_attention.
Runs on the CPU in a few seconds (the chapter's reference), and on a GPU as well when there is
one and the build has CUDA kernels.

    python example_usage.py

1. the same numbers as SDPA (CPU, and CUDA when it can)
2. causal, aligned bottom-right: what seqlen_q != seqlen_k means, and why a KV cache wants it
3. grouped-query attention: fewer kv heads, no copies
4. return_lse: the one number per row that lets two halves of the keys be merged
5. gradients
6. the sdpa drop-in: one line of a module changes
7. torch.compile traces it whole
8. serving: a paged KV cache, decode attention over it, prefixes shared through the radix tree
9. a Hugging Face model on this attention (when transformers is installed)
"""
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flash_attention  # noqa: E402

NO_KERNELS = "no CUDA kernels in this build yet"


def qkv(batch, heads, seqlen_q, seqlen_k, head_dim, heads_kv=None, dtype=torch.float32, device="cpu"):
    heads_kv = heads_kv or heads
    return (torch.randn(batch, heads, seqlen_q, head_dim, dtype=dtype, device=device),
            torch.randn(batch, heads_kv, seqlen_k, head_dim, dtype=dtype, device=device),
            torch.randn(batch, heads_kv, seqlen_k, head_dim, dtype=dtype, device=device))


def same_as_sdpa():
    print("1. attention(q, k, v) against F.scaled_dot_product_attention")
    q, k, v = qkv(2, 4, 100, 100, 64)
    for causal in (False, True):
        ours = flash_attention.attention(q, k, v, causal=causal)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        # float32 both, summed in different orders: a few ulps of |v| ~ 1-4 apart.
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=2e-5)
        print(f"   cpu float32, causal={causal}: max |ours - sdpa| = {(ours - theirs).abs().max():.1e}")
    if not torch.cuda.is_available():
        print("   (no CUDA GPU here: the GPU half of this step is skipped)")
        return False
    q, k, v = qkv(2, 8, 1000, 1000, 128, dtype=torch.bfloat16, device="cuda")
    try:
        ours = flash_attention.attention(q, k, v, causal=True)
    except RuntimeError as e:
        if NO_KERNELS not in str(e):
            raise
        print(f"   cuda: {str(e).splitlines()[0]}\n   (the CPU reference is all this build has; "
              "the tour goes on on the CPU)")
        return False
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    print(f"   cuda bf16, causal: max |ours - float64| = {(ours.double() - exact).abs().max():.1e}, "
          f"sdpa's = {(theirs.double() - exact).abs().max():.1e}")
    return True


def bottom_right_causal():
    print("\n2. causal=True is aligned to the bottom-right corner")
    # Row i sees key j iff j <= i + seqlen_k - seqlen_q: with 3 new queries after 4 cached keys,
    # the last query sees all 7 keys, as the newest token of a decoder should. SDPA's is_causal
    # is aligned top-left instead (row i sees j <= i): for square masks the two are the same.
    seqlen_q, seqlen_k = 3, 7
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    bottom_right, top_left = j <= i + seqlen_k - seqlen_q, j <= i
    for name, m in (("ours (bottom-right)", bottom_right), ("SDPA is_causal (top-left)", top_left)):
        print(f"   {name}:")
        for row in m.int().tolist():
            print("     " + " ".join("x" if x else "." for x in row))
    # Decoding with a KV cache: the last 3 rows of causal attention over 7 tokens are what the 3
    # newest queries compute against all 7 keys. Bottom-right gives exactly those rows.
    q, k, v = qkv(1, 2, seqlen_k, seqlen_k, 16)
    full = flash_attention.attention(q, k, v, causal=True)
    new_rows = flash_attention.attention(q[:, :, -seqlen_q:], k, v, causal=True)
    torch.testing.assert_close(new_rows, full[:, :, -seqlen_q:])
    # The same mask given to SDPA explicitly agrees; its is_causal would not.
    sdpa = F.scaled_dot_product_attention(q[:, :, -seqlen_q:], k, v, attn_mask=bottom_right)
    torch.testing.assert_close(new_rows, sdpa, rtol=1e-5, atol=2e-5)
    print("   the 3 newest queries against the 7-key cache give the last 3 rows of full causal attention")
    try:
        flash_attention.sdpa(q[:, :, -seqlen_q:], k, v, is_causal=True)
    except NotImplementedError as e:
        print(f"   and the drop-in refuses the ambiguous case: {str(e)[:96]}...")


def grouped_query():
    print("\n3. grouped-query attention: 8 query heads share 2 kv heads")
    q, k, v = qkv(2, 8, 50, 50, 32, heads_kv=2)
    ours = flash_attention.attention(q, k, v, causal=True)
    # Query head h reads kv head h // 4; repeat_interleave states that with copies we never make.
    copied = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    torch.testing.assert_close(ours, copied, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                               rtol=1e-5, atol=2e-5)
    print(f"   k, v hold {k.shape[1]} heads ({k.numel() * 4 // 1024} KiB each), not {q.shape[1]}: "
          "same output as repeating them")


def log_sum_exp():
    print("\n4. return_lse: merging attention over two halves of the keys")
    q, k, v = qkv(1, 2, 40, 60, 32)
    out, lse = flash_attention.attention(q, k, v, return_lse=True)
    scale = 1 / math.sqrt(q.shape[-1])
    torch.testing.assert_close(lse, torch.logsumexp(scale * q @ k.transpose(-1, -2), dim=-1))
    # Each half's output is normalised by its own sum; lse says how big that sum was, so the two
    # reweigh to the whole: the step that split-KV decoding and ring attention are built on.
    o1, l1 = flash_attention.attention(q, k[:, :, :25], v[:, :, :25], return_lse=True)
    o2, l2 = flash_attention.attention(q, k[:, :, 25:], v[:, :, 25:], return_lse=True)
    merged = (l1 - lse).exp()[..., None] * o1 + (l2 - lse).exp()[..., None] * o2
    torch.testing.assert_close(merged, out, rtol=1e-5, atol=2e-5)
    print(f"   lse is {tuple(lse.shape)} {lse.dtype}: one number per query row, "
          "and exp(lse_half - lse) x out_half summed over the halves is the whole output")


def gradients():
    print("\n5. gradients through autograd (float64 against SDPA's)")
    q, k, v = (t.double().requires_grad_() for t in qkv(2, 4, 33, 33, 16))
    dy = torch.randn_like(q)
    ours = torch.autograd.grad(flash_attention.attention(q, k, v, causal=True), (q, k, v), dy)
    theirs = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), dy)
    for name, a, b in zip(("dq", "dk", "dv"), ours, theirs):
        torch.testing.assert_close(a, b)
        print(f"   {name}: max |ours - sdpa| = {(a - b).abs().max():.1e}")
    # The backward rebuilds P from q, k and the saved lse: nothing seqlen^2 was kept.
    small = tuple(t.detach()[:1, :1, :6].requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attention.attention(q, k, v, causal=True), small)
    print("   gradcheck passes (float64, finite differences)")


class SelfAttention(torch.nn.Module):
    """A transformer's attention sublayer. attn is the one line that picks the kernel."""

    def __init__(self, dim, heads, attn=F.scaled_dot_product_attention):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.attn = attn

    def forward(self, x):
        b, s, _ = x.shape
        # (b, s, 3 * h * d) -> three (b, h, s, d) views: transposes, not copies; the kernel reads
        # any strides whose last dim is contiguous.
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        y = self.attn(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(2))


def drop_in():
    print("\n6. the sdpa drop-in: swap one line of a module")
    torch.manual_seed(1)
    plain = SelfAttention(128, 4)  # head_dim 32: the smallest the CUDA kernels take (section 7 runs it there)
    ours = SelfAttention(128, 4, attn=flash_attention.sdpa)  # the swapped line
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(2, 30, 128)
    torch.testing.assert_close(ours(x), plain(x), rtol=1e-5, atol=2e-5)
    ours(x).square().mean().backward()
    plain(x).square().mean().backward()
    torch.testing.assert_close(ours.qkv.weight.grad, plain.qkv.weight.grad, rtol=1e-4, atol=1e-5)
    print("   same output and same weight gradients as F.scaled_dot_product_attention")
    try:
        flash_attention.sdpa(*qkv(1, 1, 4, 4, 8), attn_mask=torch.ones(4, 4, dtype=torch.bool))
    except NotImplementedError as e:
        print(f"   what it does not compute it says so: {str(e)[:70]}...")
    return ours, x


def compiled(module, x, on_cuda):
    print("\n7. torch.compile")
    torch._dynamo.reset()
    # fullgraph=True fails loudly on a graph break: the ops' Meta kernels give Dynamo the shapes
    # and the registered autograd the backward. On the CPU aot_eager traces without generating
    # code (seconds, no C++ compiler); on a GPU with kernels, inductor compiles around our op, in
    # bf16, the dtype the tensor-core kernels are for.
    backend = "inductor" if on_cuda else "aot_eager"
    tol = dict(rtol=1e-5, atol=2e-5)
    if on_cuda:
        module, x = module.to("cuda", torch.bfloat16), x.to("cuda", torch.bfloat16)
        # Inductor may fuse the linears' bias adds and round at other points than eager: a few
        # bf16 ulps (2^-8 relative each) of outputs ~1.
        tol = dict(rtol=2e-2, atol=2e-2)
    fast = torch.compile(module, backend=backend, fullgraph=True)
    torch.testing.assert_close(fast(x), module(x), **tol)
    fast(x).sum().backward()
    print(f"   backend={backend}, fullgraph=True: one graph, forward and backward, same output")


def serving(on_cuda):
    print("\n8. serving: decode attention over a paged KV cache")
    device = "cuda" if on_cuda else "cpu"
    dtype = torch.bfloat16 if on_cuda else torch.float32  # CUDA: the serving dtype; CPU: the reference's
    block_size, heads, heads_kv, d = 16, 8, 2, 64
    lens = [5, 40, 16]                                    # three sequences, three lengths
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 4
    key_cache = torch.zeros(num_blocks, block_size, heads_kv, d, dtype=dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    # The allocator hands out blocks in any order: sequence b's token t sits at slot
    # table[b][t // block_size] * block_size + t % block_size.
    pool = torch.randperm(num_blocks).tolist()
    tables = torch.full((len(lens), max(blocks)), -1, dtype=torch.int32)
    slots, keys, values = [], [], []
    for b, n in enumerate(lens):
        tables[b, :blocks[b]] = torch.tensor(pool[:blocks[b]], dtype=torch.int32)
        pool = pool[blocks[b]:]
        slots += [int(tables[b, t // block_size]) * block_size + t % block_size for t in range(n)]
        keys.append(torch.randn(n, heads_kv, d, dtype=dtype, device=device))
        values.append(torch.randn(n, heads_kv, d, dtype=dtype, device=device))
    # The prefill's K and V of all sequences go into their slots in one call.
    flash_attention.reshape_and_cache(torch.cat(keys), torch.cat(values), key_cache, value_cache,
                                      torch.tensor(slots, device=device))
    query = torch.randn(len(lens), heads, d, dtype=dtype, device=device)
    out = flash_attention.paged_attention(query, key_cache, value_cache, tables.to(device),
                                          torch.tensor(lens, dtype=torch.int32, device=device))
    for b, n in enumerate(lens):
        # Each sequence alone, contiguous, through SDPA with GQA: what the paged op must equal.
        ref = F.scaled_dot_product_attention(query[b, :, None].float(), keys[b].transpose(0, 1).float(),
                                             values[b].transpose(0, 1).float(), enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[b].float(), ref, rtol=2e-2, atol=2e-2)
    print(f"   paged_attention over {lens} cached tokens in shuffled blocks of {block_size} ({device}, "
          f"{str(dtype).removeprefix('torch.')}): the same as SDPA over each sequence's contiguous K/V")
    cache = flash_attention.RadixCache(block_size)
    system = list(range(100, 132))                        # a 32-token system prompt: 2 blocks
    cache.insert(system + [7] * 16, [10, 11, 12])
    matched, ids = cache.match_prefix([system + [9] * 20, [1, 2, 3] * 10], device=device)
    print(f"   RadixCache: a new request with the same system prompt matches {int(matched[0])} tokens in "
          f"blocks {[i for i in ids[0].tolist() if i >= 0]}, an unrelated one {int(matched[1])}: its "
          "prefill can skip them and share the blocks")


def hugging_face():
    print("\n9. a Hugging Face model on this attention")
    try:
        import transformers
        from flash_attention.integrations import transformers as course_hf
    except ImportError:
        print("   (transformers is not installed: python tools/ensure_env.py test installs it)")
        return
    # A tiny random Llama (2 layers, 4 query heads, 2 KV heads), nothing downloaded; the same
    # weights on PyTorch's SDPA and on the chapter's attention (a padded prompt goes through
    # attention_varlen, on the CPU).
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
    models = [transformers.AutoModelForCausalLM.from_config(config.__class__(**config.to_dict()),
                                                            attn_implementation=name).eval()
              for name in ("sdpa", course_hf.register())]
    models[1].load_state_dict(models[0].state_dict())
    ids, mask = torch.randint(3, 128, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    mask[0, :5] = 0                                       # left padding, as generate() wants it
    with torch.no_grad():
        sdpa_tokens, ours_tokens = (m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                               pad_token_id=0)[:, 12:] for m in models)
    assert torch.equal(sdpa_tokens, ours_tokens), (sdpa_tokens, ours_tokens)
    print(f"   greedy generation with a KV cache on attn_implementation={models[1].config._attn_implementation!r}: "
          f"{ours_tokens[0].tolist()}, token for token what sdpa generates")


def main():
    torch.manual_seed(0)
    print(f"flash_attention from the {flash_attention.EXTENSION['route']} build; "
          f"kernel versions: {dict(flash_attention.VERSIONS)}\n")
    on_cuda = same_as_sdpa()
    bottom_right_causal()
    grouped_query()
    log_sum_exp()
    gradients()
    module, x = drop_in()
    compiled(module, x, on_cuda)
    serving(on_cuda)
    hugging_face()
    print("\nThe tour ran to the end.")


if __name__ == "__main__":
    main()
