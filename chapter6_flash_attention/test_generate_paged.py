"""Tests of generate_paged.py, in seconds on the CPU (and on a GPU when one is visible): greedy
tokens over the paged cache equal SDPA's over a contiguous one, prefix sharing saves blocks and
skips exactly the cached part of the prefill, every block comes back and none is held by two owners,
and a deliberately broken kernel call makes the match fail."""
import functools
import json

import pytest
import torch
import torch.nn.functional as F

import flash_attention
import generate_paged as G
from coursekit.pytest_plugin import require_cuda


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def quick_config(device="cpu", **overrides):
    return G.make_config(quick=True, device=device, **overrides)


@functools.lru_cache(maxsize=None)
def quick_run(device):
    """One quick generation per device (both backends, every dtype of the preset), shared by the
    tests that read it. No warm-up: these tests read tokens and bookkeeping, not speed."""
    config = quick_config(device, checks=True)  # the value checks on, on CUDA too: a bad table is an error
    runs, comparisons = G.generate_all(config, warmup=False)
    return config, runs, comparisons


def expected_cached(config, requests):
    """The prompt tokens each request should find cached, worked out from how the requests were
    built rather than from the tree: the waves are admitted in order; a request whose group was in
    an earlier wave finds the whole prefix, one whose group was not finds the common blocks if any
    earlier wave ran, else nothing; never more whole blocks than its first len - 1 tokens hold."""
    bs, seen, out = config.block_size, set(), []
    for start in range(0, len(requests), config.prefill_batch):
        wave = requests[start:start + config.prefill_batch]
        for r in wave:
            if r.group in seen:
                shared = config.common_blocks + config.group_blocks
            else:
                shared = config.common_blocks if seen else 0
            out.append(min(shared, (len(r.prompt) - 1) // bs) * bs)
        seen |= {r.group for r in wave}
    return out


def test_requests_share_their_group_prefix():
    config = quick_config()
    requests = G.make_requests(config)
    assert len(requests) == config.groups * config.per_group
    prefix = config.prefix_tokens
    common = config.common_blocks * config.block_size
    for r in requests:
        assert r.group == r.rid % config.groups
        assert r.prompt[:common] == requests[0].prompt[:common]
        assert r.prompt[:prefix] == requests[r.group].prompt[:prefix]
    # The groups' own blocks differ, the suffixes have the preset's lengths and the two edge cases.
    assert requests[0].prompt[common:prefix] != requests[1].prompt[common:prefix]
    suffixes = [len(r.prompt) - prefix for r in requests]
    assert suffixes[-1] == 0 and suffixes[-2] == config.block_size
    assert all(config.suffix_min <= n <= config.suffix_max for n in suffixes[:-2])
    # Seeded: the same requests again, other ones for another seed.
    assert [r.prompt for r in G.make_requests(config)] == [r.prompt for r in requests]
    assert G.make_requests(quick_config(seed=1))[0].prompt != requests[0].prompt


def test_paged_tokens_match_sdpa(device):
    config, runs, comparisons = quick_run(device)
    cmp = comparisons["float64"]
    paged, ref = runs["float64"]["paged"]["choices"], runs["float64"]["sdpa"]["choices"]
    assert paged["tokens"].shape == (config.requests, config.new_tokens)
    assert torch.equal(paged["tokens"], ref["tokens"]), cmp["diverged"]
    assert cmp["match"] and cmp["identical_requests"] == config.requests
    assert cmp["verdict"] == "identical" and cmp["passed"] is True
    assert cmp["agreeing_tokens"] == config.requests * config.new_tokens
    # The match means something only if no choice was a near tie: the smallest top-1 - top-2
    # margin must dwarf the backends' rounding difference (~1e-14 of logits ~10 in float64).
    assert cmp["max_top_logit_diff"] < 1e-9
    assert cmp["min_reference_margin"] > 100 * cmp["max_top_logit_diff"], cmp
    # Not a degenerate model that repeats one token: the requests continue differently.
    assert len({tuple(t) for t in ref["tokens"].tolist()}) == config.requests


@pytest.mark.cuda
def test_cuda_low_precision_run_is_reported():
    require_cuda()
    config, runs, comparisons = quick_run("cuda")
    for dtype in config.dtypes[1:]:
        cmp = comparisons[dtype]
        # Reported, not required to match (generate_paged.py's docstring says why); but the tokens
        # are the model's: most of the first tokens, from prompts alone, must agree.
        assert 0 <= cmp["agreeing_tokens"] <= cmp["tokens"]
        first = runs[dtype]["paged"]["choices"]["tokens"][:, 0] == runs[dtype]["sdpa"]["choices"]["tokens"][:, 0]
        assert first.float().mean() >= 0.5, dtype


def test_reference_equals_recomputing_from_scratch():
    """The reference's own cache is right: each token it picks is the greedy choice of the whole
    sequence so far run again from position 0, no cache at all."""
    config, runs, _ = quick_run("cpu")
    ref = runs["float64"]["sdpa"]["choices"]["tokens"]
    model = G.Decoder(config, "cpu", torch.float64)

    def attend(layer, q, k, v):  # (n, heads, d) -> one causal attention over the n tokens
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1)

    with torch.inference_mode():
        for r in G.make_requests(config):
            tokens = list(r.prompt)
            for _ in range(config.new_tokens):
                logits = model.forward(torch.tensor(tokens), torch.arange(len(tokens)), attend, last_only=True)
                tokens.append(int(logits.argmax()))
            assert tokens[len(r.prompt):] == ref[r.rid].tolist(), r.rid


def test_sharing_saves_blocks_and_skips_the_cached_prefill(device):
    config, runs, _ = quick_run(device)
    run = runs["float64"]["paged"]
    cache = run["cache"]
    requests = G.make_requests(config)
    expected = expected_cached(config, requests)
    assert cache["cached_per_request"] == expected
    assert cache["prefix_tokens_skipped"] == sum(expected) > 0
    assert run["computed_tokens"] == run["prompt_tokens"] - sum(expected)
    assert runs["float64"]["sdpa"]["computed_tokens"] == run["prompt_tokens"]
    without = sum(G.blocks_for(len(r.prompt) + config.new_tokens - 1, config.block_size) for r in requests)
    assert cache["blocks_without_sharing"] == without
    assert 0 < cache["blocks_with_sharing"] < without
    # The first wave held two cold requests of one group: the second's prefix blocks were
    # duplicates, freed after its insert.
    assert cache["duplicate_blocks_freed"] > 0


def test_every_block_comes_back_and_none_is_held_twice(device):
    config, runs, _ = quick_run(device)
    cache = runs["float64"]["paged"]["cache"]
    # At the end of decode (audit() raised on any violation): free + private + tree = the pool,
    # and some tree blocks were in several tables (shared prefixes).
    state = cache["at_end"]
    assert state["free"] + state["private"] + state["tree"] == cache["pool_blocks"]
    # Counted from the requests alone: the tree holds every distinct whole prompt block (the
    # common ones once, each group's once, each request's own whole suffix blocks); each request
    # privately its partly filled prompt block and its decode blocks.
    bs, requests = config.block_size, G.make_requests(config)
    prefix_blocks = config.common_blocks + config.group_blocks
    tree = config.common_blocks + config.groups * config.group_blocks + sum(
        len(r.prompt) // bs - prefix_blocks for r in requests)
    private = sum(G.blocks_for(len(r.prompt) + config.new_tokens - 1, bs) - len(r.prompt) // bs for r in requests)
    assert (state["tree"], state["private"]) == (tree, private)
    assert cache["blocks_with_sharing"] >= tree + private
    assert state["shared"] >= config.common_blocks + config.group_blocks
    # After every request ended and the tree was evicted: all blocks free again, the tree empty.
    assert cache["free_after"] == cache["pool_blocks"]
    assert cache["tree_blocks_after"] == 0


def test_sharing_summary_counts_bytes():
    config, runs, _ = quick_run("cpu")
    share = G.sharing_summary(config, runs)
    saved = share["blocks_without_sharing"] - share["blocks_with_sharing"]
    per_block = config.block_size * config.heads_kv * config.head_dim * 2 * 8 * config.layers  # float64
    assert share["blocks_saved"] == saved and share["bytes_saved"]["float64"] == saved * per_block
    assert share["leaked_blocks"] == 0


def broken_context_lens(query, key_cache, value_cache, block_tables, context_lens, **kw):
    # Off by one: each request's newest token (its own key) is left out of decode attention.
    return flash_attention.paged_attention(query, key_cache, value_cache, block_tables, context_lens - 1, **kw)


def forgetful_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens, **kw):
    # The suffix attends to its own keys only: the cached prefix (whole blocks before the chunk) is
    # skipped *and* forgotten, its table entries made ids outside the cache (absent tokens).
    block_size = key_cache.shape[1]
    cached_blocks = (context_lens - (cu_seqlens_q[1:] - cu_seqlens_q[:-1])) // block_size
    columns = torch.arange(block_tables.shape[1], device=block_tables.device)
    tables = block_tables.masked_fill(columns[None] < cached_blocks[:, None], -1)
    return flash_attention.paged_prefill_attention(query, key_cache, value_cache, tables, cu_seqlens_q, context_lens,
                                                   **dict(kw, check_tables=False))


@pytest.mark.parametrize("op, broken", [("paged_attention", broken_context_lens),
                                        ("paged_prefill_attention", forgetful_prefill)],
                         ids=["context_lens_minus_one", "prefill_forgets_prefix"])
def test_broken_kernel_call_is_caught(monkeypatch, op, broken):
    """The exact-match check can fail: a wrong context in either phase changes the tokens."""
    config = quick_config(dtypes=("float64",))
    monkeypatch.setitem(G.OPS, op, broken)
    _, comparisons = G.generate_all(config, warmup=False)
    cmp = comparisons["float64"]
    assert not cmp["match"] and cmp["verdict"] == "different" and cmp["passed"] is False
    assert cmp["identical_requests"] < config.requests
    # Every divergence is at a clear margin: even float32's near-tie rule could not excuse it.
    assert min(max(d["reference_margin"], d["run_margin"]) for d in cmp["diverged"]) > 10 * G.TIE_BOUND["float32"]
    if op == "paged_prefill_attention":
        # Only the requests that found a cached prefix lose it; the cold ones stay identical.
        cached = expected_cached(config, G.make_requests(config))
        assert {d["request"] for d in cmp["diverged"]} <= {i for i, n in enumerate(cached) if n}


@pytest.mark.parametrize("chunk", (1, 5))
def test_chunked_prefill_matches_sdpa(device, chunk):
    """--prefill-chunk N: the suffixes prefilled N tokens a round, each chunk reading the earlier
    ones from the cache, give SDPA's tokens exactly (float64), and compute what the whole-suffix
    prefill computes, no more."""
    config = quick_config(device, dtypes=("float64",), prefill_chunk=chunk, checks=True)
    runs, comparisons = G.generate_all(config, warmup=False)
    cmp = comparisons["float64"]
    assert cmp["verdict"] == "identical" and cmp["passed"] is True, cmp["diverged"]
    whole = quick_run(device)[1]["float64"]["paged"]
    assert runs["float64"]["paged"]["computed_tokens"] == whole["computed_tokens"]
    assert torch.equal(runs["float64"]["paged"]["choices"]["tokens"], whole["choices"]["tokens"])


def choices(tokens, margins):
    tokens = torch.tensor(tokens)
    margin = torch.tensor(margins, dtype=torch.float32)
    return {"choices": {"tokens": tokens, "top": 10 + margin, "margin": margin}}


def test_compare_tells_near_ties_from_divergences():
    ref = choices([[1, 2, 3], [4, 5, 6]], [[1.0, 1.0, 1.0], [1.0, 5e-4, 1.0]])
    same = G.compare(choices([[1, 2, 3], [4, 5, 6]], [[1.0] * 3, [1.0, 6e-4, 1.0]]), ref, 1e-3)
    assert same["verdict"] == "identical" and same["passed"] and same["agreeing_tokens"] == 6
    assert same["near_ties"] == 1 and same["min_reference_margin"] == pytest.approx(5e-4)
    # Request 1 flips at its near tie (both margins below the bound): excused, and named.
    tie = G.compare(choices([[1, 2, 3], [4, 7, 6]], [[1.0] * 3, [1.0, 4e-4, 1.0]]), ref, 1e-3)
    assert tie["verdict"] == "identical but for near ties" and tie["passed"] and not tie["match"]
    assert [(d["request"], d["at_token"]) for d in tie["diverged"]] == [(1, 1)] and tie["agreeing_tokens"] == 4
    # Request 0 flips at a clear margin: different, whatever else happened.
    clear = G.compare(choices([[1, 9, 3], [4, 7, 6]], [[1.0] * 3, [1.0, 4e-4, 1.0]]), ref, 1e-3)
    assert clear["verdict"] == "different" and clear["passed"] is False
    # Without a bound (bf16): reported, not gated.
    assert G.compare(choices([[1, 9, 3], [4, 5, 6]], [[1.0] * 3] * 2), ref)["passed"] is None


def test_allocator_refuses_double_free_and_overdraft():
    alloc = G.BlockAllocator(4)
    ids = alloc.allocate(3)
    assert ids == [0, 1, 2] and alloc.used == 3 and alloc.peak_used == 3
    alloc.release([1])
    with pytest.raises(RuntimeError, match="block 1 freed twice"):
        alloc.release([1])
    with pytest.raises(MemoryError, match="3 blocks wanted, 2 of 4 free"):
        alloc.allocate(3)
    assert sorted(alloc.allocate(2)) == [1, 3] and alloc.peak_used == 4


def test_writes_into_shared_blocks_are_refused():
    s = G.Sequence(G.Request(0, 0, list(range(12))), table=[5, 7], private={7})
    assert G.check_writes(s, [8, 11], 8) == [7 * 8, 7 * 8 + 3]
    with pytest.raises(RuntimeError, match="position 3 into block 5, which it shares"):
        G.check_writes(s, [3], 8)


def test_audit_catches_a_block_held_twice():
    radix = flash_attention.RadixCache(2)
    alloc = G.BlockAllocator(6)
    shared, own_a, own_b = alloc.allocate(3)
    radix.insert([1, 2], [shared])
    a = G.Sequence(G.Request(0, 0, [1, 2, 3]), table=[shared, own_a], private={own_a})
    b = G.Sequence(G.Request(1, 0, [1, 2, 4]), table=[shared, own_b], private={own_b})
    assert G.audit([a, b], alloc, radix) == {"free": 3, "private": 2, "tree": 1, "shared": 1}
    b.table = [shared, own_a]  # b reads a's private block
    with pytest.raises(RuntimeError, match="neither its own nor the tree's"):
        G.audit([a, b], alloc, radix)
    b.table, b.private = [shared, own_a], {own_a}  # both claim it
    with pytest.raises(RuntimeError, match="private to requests 0 and 1"):
        G.audit([a, b], alloc, radix)
    b.table, b.private = [shared, own_b], {own_b}
    alloc.release([own_b])  # freed while b still holds it
    with pytest.raises(RuntimeError, match="free and in use"):
        G.audit([a, b], alloc, radix)


@pytest.mark.parametrize("overrides, message", [
    (dict(head_dim=16), r"head_dim=16 is not supported by paged_attention on CUDA; pick one of \(64, 128\)"),
    (dict(block_size=8), r"block_size=8 .*one of \(16, 32\)"),
])
def test_unsupported_cuda_shapes_are_refused(overrides, message):
    # Checked before the GPU's presence, so this runs on any machine.
    with pytest.raises(ValueError, match=message):
        G.check_config(G.make_config(quick=True, device="cuda", **overrides))


def test_cpu_config_checks():
    G.check_config(quick_config(head_dim=10, block_size=3))  # the CPU reference takes any
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        G.check_config(quick_config(heads=6, heads_kv=4))
    with pytest.raises(ValueError, match="CPU reference computes float32"):
        G.check_config(quick_config(dtypes=("float64", "bfloat16")))
    with pytest.raises(ValueError, match="dtypes must start with float64 or float32"):
        G.check_config(quick_config(dtypes=("bfloat16",)))
    G.check_config(quick_config(dtypes=("float64", "float32")))
    with pytest.raises(ValueError, match="new_tokens must be >= 2"):
        G.check_config(quick_config(new_tokens=1))
    with pytest.raises(ValueError, match="at least one whole block"):
        G.check_config(quick_config(common_blocks=0, group_blocks=0))


def test_results_file(tmp_path, monkeypatch, capsys):
    config, runs, comparisons = quick_run("cpu")
    monkeypatch.setattr(G.results, "RESULTS_DIR", tmp_path)
    G.save(config, runs, comparisons, wall_s=1.0)
    [path] = tmp_path.glob(f"*/{G.NAME}.json")
    record = json.loads(path.read_text())
    for key in ("chapter", "device", "torch", "commit", "date", "benchmarks", "sharing", "comparison"):
        assert key in record, key
    assert {(r["op"], r["variant"]) for r in record["benchmarks"]} == {
        (op, v) for op in ("generate_prefill", "generate_decode") for v in ("default", "sdpa")}
    assert all(r["tokens_per_s"] > 0 for r in record["benchmarks"])
    assert record["comparison"]["float64"]["match"] is True and record["comparison"]["float64"]["passed"] is True
    assert record["sharing"]["blocks_saved"] > 0
    assert "decode tok/s" in capsys.readouterr().out


def test_command_line_exit_status(monkeypatch, capsys):
    assert G.main(["--quick", "--device", "cpu", "--no-save"]) == 0
    assert "IDENTICAL (no allowance): PASS" in capsys.readouterr().out
    # A second dtype is compared and reported, not gated (as bf16 on CUDA).
    assert G.main(["--quick", "--device", "cpu", "--no-save", "--dtypes", "float64,float32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    [line] = [x for x in lines if x.startswith("float32: ")]
    assert "PASS" not in line and "FAIL" not in line
    monkeypatch.setitem(G.OPS, "paged_attention", broken_context_lens)
    assert G.main(["--quick", "--device", "cpu", "--no-save"]) == 1
    assert "FAIL" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="layers must be >= 1"):
        G.main(["--quick", "--device", "cpu", "--layers", "0"])
