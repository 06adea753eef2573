"""Tests of bench_paged.py: the napkin math every GB/s rests on, the grid and its memory cap, the
block tables and the paged cache built from them, the float32 witness and the guard that stops a
wrong kernel from being timed, the targets' arithmetic, the prefix tree's build, and one whole
--quick run (the CPU path at tiny sizes on a CPU machine, a smoke run on a GPU), whose record must
hold every section with the fields the results contract asks for."""
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F

import bench_paged as B
import flash_attention
from coursekit import bench, results

GiB = 2**30


# ---------------------------------------------------------------------------------------------
# Napkin math and the grid
# ---------------------------------------------------------------------------------------------
def test_decode_bytes_counts_unique_kv_once_plus_q_and_out():
    # Two sequences of 3 and 5 tokens, 4 query heads over 2 kv heads, d 8, 2 bytes an element:
    # K and V of 8 tokens x 2 kv heads, then q and out of 2 x 4 heads, all of 8 elements.
    assert B.decode_bytes([3, 5], 4, 2, 8, 2) == (8 * 2 * 2 + 2 * 4 * 2) * 8 * 2
    # More query heads over the same kv heads add only q and out, never K/V traffic.
    more_heads = B.decode_bytes([4096] * 64, 32, 8, 128, 2) - B.decode_bytes([4096] * 64, 8, 8, 128, 2)
    assert more_heads == 2 * 64 * (32 - 8) * 128 * 2


def test_decode_bytes_at_the_first_target_is_one_gib_of_kv():
    kv = B.kv_cache_bytes(64, 4096, 8, 128, 2)
    assert kv == GiB
    assert B.decode_bytes([4096] * 64, 32, 8, 128, 2) == kv + 2 * 64 * 32 * 128 * 2


def test_memory_cap_keeps_8_gib_and_drops_more():
    c = B.decode_config(16, 131072, 32, 8)
    assert B.kv_cache_bytes(16, 131072, 8, 128, 2) == 8 * GiB and B.within_cap(c, 8.0)
    assert not B.within_cap(B.decode_config(64, 65536, 32, 8), 8.0)
    assert B.within_cap(B.decode_config(64, 65536, 32, 8, dtype="float16"), 16.0)
    assert not B.within_cap(B.decode_config(1, 1024, 8, 2, dtype="float32"), 1 / 1024)


def test_split_sweep_is_the_lessons_without_points_over_the_cap():
    s = B.sizes_for("cuda", quick=False)
    points = {(c["batch"], c["context"]) for c in s["split"]}
    grid = {(b, n) for b in (1, 4, 16, 64) for n in (1024, 4096, 16384, 65536, 131072)}
    assert points == grid - {(64, 65536), (64, 131072)}
    for c in s["split"]:
        assert (c["heads"], c["heads_kv"], c["head_dim"], c["dtype"]) == (32, 8, 128, "bfloat16")
        assert c["sweep"] == "split_kv"


def test_target_configurations_are_the_lessons():
    t = {c["config"]: c for c in B.sizes_for("cuda", quick=False)["targets"]}
    assert list(t) == list("abcdefgh")
    base = dict(heads=32, heads_kv=8, head_dim=128, block_size=16, dtype="bfloat16", mixed=False)
    want = {"a": dict(batch=64, context=4096), "b": dict(batch=16, context=32768),
            "c": dict(batch=1, context=131072), "d": dict(batch=64, context=4096, heads_kv=32),
            "e": dict(batch=64, context=8192, mixed=True), "f": dict(batch=64, context=4096, block_size=32),
            "g": dict(batch=64, context=4096, dtype="float16"), "h": dict(batch=64, context=4096, head_dim=64)}
    for name, fields in want.items():
        expected = {**base, **fields}
        assert {k: t[name][k] for k in expected} == expected, name
    assert set(B.TARGETS) == set("abcde")
    assert B.TARGETS["a"] == B.TARGETS["b"] == {"pct_of_copy": 90, "speedup": 0.95}


def test_gqa_bars_sweep_kv_heads():
    gqa = B.sizes_for("cuda", quick=False)["gqa"]
    assert [c["heads_kv"] for c in gqa] == [32, 16, 8, 4]
    assert {(c["batch"], c["context"], c["heads"]) for c in gqa} == {(64, 4096, 32)}


def test_variants():
    a, d, e = (next(c for c in B.sizes_for("cuda", quick=False)["targets"] if c["config"] == x) for x in "ade")
    assert B.variants_of(a, "cuda") == ("sdpa_contiguous", "sdpa_gathered", "repeat_kv", *B.RUNGS, "default")
    # No GQA: repeat_kv would be sdpa_contiguous plus a copy; mixed lengths: left out (docstring).
    assert "repeat_kv" not in B.variants_of(d, "cuda") and "repeat_kv" not in B.variants_of(e, "cuda")
    assert B.variants_of(a, "cpu") == ("sdpa_contiguous", "sdpa_gathered", "repeat_kv", "cpu")
    for c in B.sizes_for("cuda", quick=False)["split"]:
        assert B.variants_of(c, "cuda") == ("sdpa_contiguous", "per_kv_head", "split_kv", "default")
    counts = tuple(f"split_kv:{n}" for n in B.SPLIT_COUNTS)
    for c in B.sizes_for("cuda", quick=False)["num_splits"]:
        assert B.variants_of(c, "cuda") == ("sdpa_contiguous", "default", *counts)
    assert {c["config"] for c in B.sizes_for("cuda", quick=False)["num_splits"]} == {"a", "b", "e", "group 8"}
    assert B.sizes_for("cpu", quick=True)["num_splits"] == []  # the CPU reference ignores num_splits


def test_mixed_lengths_are_seeded_and_in_range():
    c = B.decode_config(64, 8192, 32, 8, mixed=True)
    lens = B.context_lens_for(c, seed=0)
    assert lens == B.context_lens_for(c, seed=0) and len(lens) == 64
    assert min(lens) >= 1 and max(lens) <= 8192 and len(set(lens)) > 32


# ---------------------------------------------------------------------------------------------
# The paged cache
# ---------------------------------------------------------------------------------------------
def test_block_tables_deal_every_block_once_out_of_order():
    lens = [1, 16, 17, 100, 0, 33]
    tables, pool = B.block_tables_for(lens, 16, seed=3)
    blocks = [-(-n // 16) for n in lens]
    assert tables.dtype == torch.int32 and tables.shape == (len(lens), max(blocks))
    assert pool == sum(blocks)
    used = [tables[b, :n] for b, n in enumerate(blocks)]
    assert sorted(torch.cat(used).tolist()) == list(range(pool))
    assert all(int(tables[b, n:].abs().sum()) == 0 for b, n in enumerate(blocks))
    # Shuffled: a sequence's pages are not the next blocks of the pool in order.
    long, _ = B.block_tables_for([4096], 16, seed=0)
    assert not torch.equal(long[0], torch.arange(256, dtype=torch.int32))


@pytest.mark.parametrize("mixed, context", [(False, 96), (True, 70)])
def test_paged_cache_holds_the_unpaged_kv(mixed, context):
    """Reading the pages back through the tables gives the unpaged K and V, token for token."""
    c = B.decode_config(3, context, 4, 2, head_dim=16, dtype="float64", mixed=mixed)
    case = B.make_case(c, "cpu", seed=1)
    hkv, d = c["heads_kv"], c["head_dim"]
    for name in ("k", "v"):
        for b, n in enumerate(case["lens"]):
            pages = case[name + "_cache"][case["block_tables"][b].long()]          # (width, bs, hkv, d)
            tokens = pages.reshape(-1, hkv, d)[:n].transpose(0, 1)                 # (hkv, n, d)
            torch.testing.assert_close(tokens, case[name][b, :, :n], rtol=0, atol=0)
    if mixed:
        assert case["mask"].shape == (3, 1, 1, case["n"]) and int(case["mask"].sum()) == sum(case["lens"])
    else:
        assert case["mask"] is None and case["n"] == context


def test_reference_decode_matches_sdpa_with_gqa_and_lengths():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 40, 16, generator=g, dtype=torch.float64) for _ in range(2))
    lens = [40, 7, 1]
    got = B.reference_decode(q, k, v, lens)
    mask = (torch.arange(40)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    want = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, enable_gqa=True).squeeze(2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_check_close_raises_on_a_wrong_or_nan_output():
    ref = torch.randn(4, 8, 16)
    assert B.check_close(ref + 1e-3, ref.bfloat16(), torch.bfloat16, "ok") < 2e-2
    with pytest.raises(AssertionError, match="outside"):
        B.check_close(ref + 0.5, ref, torch.bfloat16, "shifted")
    nan = ref.clone()
    nan[1, 2, 3] = float("nan")
    with pytest.raises(AssertionError, match=r"first at \(1, 2, 3\)"):
        B.check_close(nan, ref, torch.float32, "nan")


def test_the_guard_stops_a_wrong_kernel_before_it_is_timed(monkeypatch):
    real = flash_attention.paged_attention
    monkeypatch.setattr(flash_attention, "paged_attention", lambda *a, **kw: real(*a, **kw) * 1.5)
    timed = []
    monkeypatch.setattr(bench, "probe_and_time", lambda *a, **kw: timed.append(a[1]) or None)
    c = B.decode_config(2, 64, 4, 2, head_dim=16, dtype="float32")
    with pytest.raises(AssertionError, match="cpu vs float32 reference"):
        B.bench_decode("cpu", [c], {"copy_GBps": 1.0}, bench.Notes())
    assert "cpu" not in timed and timed  # the SDPA rows before it were timed, the wrong one was not


def test_the_cache_ops_guard_catches_a_write_that_does_nothing(monkeypatch):
    monkeypatch.setattr(flash_attention, "reshape_and_cache", lambda *a, **kw: None)
    co = {"tokens": [32], "num_blocks": 8, "pairs": 2, "heads_kv": 2, "head_dim": 8, "block_size": 16,
          "dtype": "float32"}
    with pytest.raises(AssertionError, match="reshape_and_cache"):
        B.bench_cache_ops("cpu", co, {"copy_GBps": 1.0}, bench.Notes())


def test_cache_op_bytes():
    # 100 tokens, 2 of them padding, rows of 4 KiB: K and V read and written, then the slots.
    assert B.cache_op_bytes(100, 2, 4096) == 98 * 4096 * 4 + 800
    assert B.copy_blocks_bytes(2048, 32768) == 2 * 2048 * 32768 * 2 + 2048 * 16
    slots = B.slot_mapping_for(200, 1000, torch.Generator().manual_seed(0))
    real = slots[slots >= 0]
    assert int((slots == -1).sum()) == len(range(0, 200, B.PAD_EVERY)) and len(set(real.tolist())) == len(real)


# ---------------------------------------------------------------------------------------------
# Targets and the prefix tree
# ---------------------------------------------------------------------------------------------
def _row(config, variant, pct, speedup):
    return {"op": "paged_attention", "sweep": "targets", "config": config, "variant": variant,
            "pct_of_copy": pct, "speedup_vs_torch": speedup}


def test_targets_need_both_bounds_and_a_row():
    rows = [_row("a", "default", 91.0, 0.94), _row("b", "default", 95.0, 1.2), _row("c", "default", 85.0, 3.0),
            _row("d", "per_kv_head", 99.0, 1.0), _row("e", "default", 79.9, 2.0),
            {"op": "match_prefix", "variant": "default", "speedup_vs_cpu": 12.0}]
    got = {t["target"]: t for t in B.evaluate_targets(rows, "default")}
    assert {k: t["met"] for k, t in got.items()} == {"a": False, "b": True, "c": True, "d": False, "e": False,
                                                     "match_prefix": True}
    assert got["d"]["pct_of_copy"] is None  # only another variant's row: the target is not met
    assert not B.evaluate_targets(rows[:1], "default")[-1]["met"]  # no cuda lookup row


def test_tree_build_reaches_its_nodes_and_requests_mix_their_kinds():
    m = {"requests": 60, "tokens": 128, "nodes": 300, "roots": 4, "block_size": 16, "vocab": 1000}
    cache, seqs, info = B.build_tree(m, seed=5)
    assert info["nodes"] >= 300 and info["nodes"] == len(cache.flat_tree("cpu")[1]) == B.count_nodes(cache)
    assert info["inserts"] == len(seqs) and all(len(s) == 128 for s in seqs)
    queries, lengths = B.make_requests(seqs, m, seed=5)
    assert queries.shape == (60, 128) and queries.dtype == torch.int32 and lengths.dtype == torch.int32
    got = torch.ops.flash_attention.match_prefix(*cache.flat_tree("cpu"), 16, queries, lengths, 8)
    assert B.same_matches(got, B.expected_matches(cache, queries, lengths, 8))
    matched, whole = got[0], lengths // 16 * 16
    assert int(((matched == whole) & (matched > 0)).sum()) > 0 and int((matched == 0).sum()) > 0
    assert int(((matched > 0) & (matched < whole)).sum()) > 0


# ---------------------------------------------------------------------------------------------
# One whole --quick run
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_record(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(results, "RESULTS_DIR", out)
        mp.setattr(sys, "argv", ["bench_paged.py", "--quick"])
        record = B.main()
    files = list(out.glob(f"*/{B.CHAPTER}.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text()) == record
    return record, files[0].parent


def test_quick_record_follows_the_contract(quick_record):
    record, _ = quick_record
    for key in ("chapter", "device", "torch", "cuda", "commit", "date", "ceilings", "benchmarks"):
        assert key in record, key
    assert record["chapter"] == "chapter6_paged_attention" and record["ceilings"]["copy_GBps"] > 0
    assert record["baseline"] == "sdpa_contiguous" and record["wall_s"] > 0
    for r in record["benchmarks"]:
        for key in ("op", "variant", "dtype", "shape", "median_ms"):
            assert key in r, (key, r)
        assert r["median_ms"] > 0 and r["reps"] >= 20


def test_quick_record_has_every_section(quick_record):
    record, _ = quick_record
    rows = record["benchmarks"]
    ours = "default" if record["device"]["capability"] else "cpu"
    for sweep in ("targets", "gqa", "split_kv"):
        got = results.rows(record, op="paged_attention", sweep=sweep)
        assert {r["variant"] for r in got} >= {"sdpa_contiguous", ours}, sweep
    assert {r["variant"] for r in results.rows(record, op="reshape_and_cache")} == {"torch", ours}
    assert {r["variant"] for r in results.rows(record, op="copy_blocks")} == {"torch", ours}
    assert len({r["shape"][0] for r in results.rows(record, op="reshape_and_cache")}) == 2
    targets = {r["config"] for r in results.rows(record, op="paged_attention", sweep="targets")}
    assert targets >= set("abcdefh")
    assert results.rows(record, op="match_prefix", variant="cpu")
    assert any(r["op"] == "paged_attention" and r["variant"] == "sdpa_gathered" for r in rows)


def test_quick_rows_carry_their_fields(quick_record):
    record, _ = quick_record
    fields = ("batch", "context", "heads", "heads_kv", "head_dim", "block_size", "dtype", "variant", "sweep",
              "bytes", "GBps", "pct_of_copy", "max_abs_err_fp32", "context_tokens")
    for r in results.rows(record, op="paged_attention"):
        for f in fields:
            assert f in r, (f, r)
        assert math.isfinite(r["pct_of_copy"]) and r["pct_of_copy"] > 0
        assert r["bytes"] == B.decode_bytes([r["context"]] * r["batch"], r["heads"], r["heads_kv"], r["head_dim"],
                                            B.itemsize(r["dtype"])) or r["mixed"]
        atol = B.TOLERANCE[getattr(torch, r["dtype"])][0]
        assert r["checked_against"] == "sdpa_contiguous" and r["max_abs_err"] < atol
        assert math.isclose(r["speedup_vs_torch"], next(
            x for x in results.rows(record, op="paged_attention", variant="sdpa_contiguous")
            if all(x[k] == r[k] for k in ("sweep", "batch", "context", "heads_kv", "head_dim", "block_size",
                                          "dtype"))
        )["median_ms"] / r["median_ms"])
    for r in record["benchmarks"]:
        if r["op"] in ("reshape_and_cache", "copy_blocks"):
            assert math.isfinite(r["pct_of_copy"]) and r["pct_of_copy"] > 0 and r["bytes"] > 0


def test_quick_match_prefix_agrees(quick_record):
    record, _ = quick_record
    match = results.rows(record, op="match_prefix")
    assert match and all(r["matches_reference"] is True and r["requests_per_s"] > 0 for r in match)
    assert all(r["full_matches"] > 0 and r["partial_matches"] > 0 and r["no_matches"] > 0 for r in match)
    for r in match:
        if r["variant"] == "default":
            assert r["matches_cpu"] is True and r["speedup_vs_cpu"] > 0 and r["mirror_upload_ms"] > 0
    tree = record["match_prefix_tree"]
    assert tree["nodes"] >= record["sizes"]["match"]["nodes"] and tree["build_s"] > 0


def test_quick_targets_and_figures(quick_record):
    record, out_dir = quick_record
    targets = record["targets"]
    assert [t["target"] for t in targets] == [*B.TARGETS, "match_prefix"]
    for t in targets:
        assert isinstance(t["met"], bool)
        if t["op"] == "paged_attention":
            assert t["pct_of_copy"] is not None and t["pct_of_copy"] > 0, t
    for name in ("targets", "split_kv", "gqa", "cache_ops_match_prefix"):
        assert (out_dir / f"{B.CHAPTER}_{name}.png").stat().st_size > 0, name


def test_num_splits_table_and_figure(quick_record, tmp_path, capsys):
    """The num_splits section from its rows (on a CPU machine the sweep does not run: rows made
    from the record's own targets rows stand in)."""
    record, _ = quick_record
    record = json.loads(json.dumps(record))
    if not results.rows(record, op="paged_attention", sweep="num_splits"):
        base = [r for r in results.rows(record, op="paged_attention", sweep="targets") if r["config"] in "ae"]
        for r in base:
            extra = {"num_splits": 2} if r["variant"] not in ("sdpa_contiguous", "default") else {}
            record["benchmarks"].append({**r, "sweep": "num_splits", **extra})
    B.print_table(record)
    out = capsys.readouterr().out
    assert "num_splits: % copy of split_kv" in out
    B.make_figures(record, tmp_path)
    assert (tmp_path / f"{B.CHAPTER}_num_splits.png").stat().st_size > 0


# ---------------------------------------------------------------------------------------------
# paged_prefill rows
# ---------------------------------------------------------------------------------------------
def test_prefill_flops_count_the_visible_pairs():
    """The formula against a count of the bottom-right causal mask's true entries."""
    chunks, contexts, heads, head_dim = [1, 17, 5, 0], [40, 17, 9, 3], 4, 8
    pairs = 0
    for q, n in zip(chunks, contexts):
        rows = torch.arange(q)[:, None] + n - q
        pairs += int((torch.arange(n)[None] <= rows).sum())
    assert B.prefill_flops(chunks, contexts, heads, head_dim) == 4 * heads * head_dim * pairs


def test_prefill_configs_are_the_lessons():
    got = {c["config"]: c for c in B.sizes_for("cuda", quick=False)["prefill"]}
    assert set(got) == {"prefix", "mixed", "cold"}
    assert got["prefix"]["chunks"] == [512] * 8 and got["prefix"]["contexts"] == [4096 + 512] * 8  # the target
    assert sorted(set(got["mixed"]["chunks"])) == [1, 512] and got["mixed"]["chunks"].count(1) == 60
    assert got["cold"]["chunks"] == got["cold"]["contexts"] == [2048] * 8
    for c in got.values():
        assert (c["heads"], c["heads_kv"], c["head_dim"], c["block_size"], c["dtype"]) == (32, 8, 128, 16, "bfloat16")
    assert B.prefill_variants("cuda") == ("sdpa_flash", "flex_attention", "attention_varlen", *B.PREFILL_RUNGS,
                                          "default")
    assert B.prefill_variants("cpu") == ("cpu",)


def test_contiguous_ratios():
    """default / attention_varlen per config: the contiguous kernel's time over the paged op's."""
    rows = [{"config": "prefix", "variant": "default", "median_ms": 2.0},
            {"config": "prefix", "variant": "attention_varlen", "median_ms": 1.5},
            {"config": "cold", "variant": "default", "median_ms": 1.0}]
    assert B.contiguous_ratios(rows) == {"prefix": 0.75, "cold": None}


def test_prefill_reference_matches_the_ops_reference():
    """bench_paged's float32 witness and the op's CPU reference agree on one case (so the guard
    that stops a wrong kernel compares with the right thing)."""
    c = B.prefill_config("t", [5, 1, 0, 9], [20, 7, 4, 9], heads=4, heads_kv=2, head_dim=16, block_size=4,
                         dtype="float32")
    case = B.make_prefill_case(c, "cpu")
    out = flash_attention.paged_prefill_attention(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                                                  case["cu_seqlens_q"], case["context_lens"])
    B.check_close(out, B.reference_prefill(c, case), torch.float32, "prefill reference")
    with pytest.raises(AssertionError, match="A wrong result is not timed"):
        B.check_close(out.roll(1, 0), B.reference_prefill(c, case), torch.float32, "rolled rows")


def test_quick_record_has_prefill_rows(quick_record):
    record, _ = quick_record
    rows = results.rows(record, op="paged_prefill")
    ours = "default" if record["device"]["capability"] else "cpu"
    assert {r["config"] for r in rows} == {"prefix", "mixed", "cold"}
    assert {r["variant"] for r in rows} >= {ours}
    for r in rows:
        assert r["pass"] == "forward" and r["causal"] is True and r["flops"] > 0 and r["TFLOPs"] > 0
        assert r["max_abs_err_fp32"] < B.TOLERANCE[getattr(torch, r["dtype"])][0]
        if r["variant"] == "default":
            assert r["dispatch"] in B.PREFILL_RUNGS
    assert record["ceilings"]["mm_TFLOPs"] > 0


# ---------------------------------------------------------------------------------------------
# paged_prefill by block size
# ---------------------------------------------------------------------------------------------
def test_block_size_sweep_is_the_prefix_row_at_each_page_size():
    s = B.sizes_for("cuda", quick=False)
    prefix = next(c for c in s["prefill"] if c["config"] == "prefix")
    sweep = s["prefill_block_size"]
    assert [c["block_size"] for c in sweep] == list(B.PREFILL_BLOCK_SIZES) == [8, 16, 32, 64, 128, 256]
    for c in sweep:
        assert c["sweep"] == "block_size" and "sweep" not in prefix
        assert {k: v for k, v in c.items() if k != "sweep"} == {**prefix, "block_size": c["block_size"]}
    assert B.prefill_variants("cuda", "block_size") == ("attention_varlen", "default")
    assert B.prefill_variants("cpu", "block_size") == ("cpu",)
    for device in ("cuda", "cpu"):  # every run has the sweep: the quick ones at their own prefix row
        quick = B.sizes_for(device, quick=True)
        assert {c["sweep"] for c in quick["prefill_block_size"]} == {"block_size"}
        assert quick["prefill_block_size"][0]["chunks"] == quick["prefill"][0]["chunks"]


def test_contiguous_ratios_by_block_size():
    rows = [{"block_size": 16, "variant": "default", "median_ms": 2.0},
            {"block_size": 16, "variant": "attention_varlen", "median_ms": 1.0},
            {"block_size": 64, "variant": "attention_varlen", "median_ms": 1.0},
            {"block_size": 64, "variant": "default", "median_ms": 0.8}, {"block_size": 8, "variant": "default",
                                                                         "median_ms": 1.0}]
    assert B.contiguous_ratios(rows, key="block_size") == {16: 0.5, 64: 1.25, 8: None}


def test_quick_record_has_the_block_size_sweep(quick_record):
    record, _ = quick_record
    sweep = results.rows(record, op="paged_prefill", sweep="block_size")
    want = [c["block_size"] for c in record["sizes"]["prefill_block_size"]]
    ours = "default" if record["device"]["capability"] else "cpu"
    if ours == "default" and not (record["device"]["capability"].startswith("9.")
                                  and flash_attention.hopper_kernels_built()):
        want = [bs for bs in want if bs in (16, 32)]  # the other sizes run on the Hopper rung alone (a note)
    assert sorted({r["block_size"] for r in sweep if r["variant"] == ours}) == sorted(want)
    main = next(r for r in results.rows(record, op="paged_prefill", sweep=None, config="prefix")
                if r["variant"] == ours)
    for r in sweep:
        assert r["config"] == "prefix" and r["variant"] in (ours, "attention_varlen")
        assert r["max_abs_err_fp32"] < B.TOLERANCE[getattr(torch, r["dtype"])][0]
        assert r["checked_against"] == "float32 reference" and r["TFLOPs"] > 0 and r["median_ms"] > 0
        # the same work as the prefix row; only the page size (and so the measurement key) differs
        for k in ("shape", "flops", "total_q", "context_tokens", "heads", "heads_kv", "head_dim", "dtype"):
            assert r[k] == main[k], k
        if r["variant"] == "default":
            assert r["dispatch"] in B.PREFILL_RUNGS
    for v in {r["variant"] for r in sweep}:  # each page size a measurement of its own
        mine = [r for r in sweep if r["variant"] == v]
        assert len({results.measurement_key(r) for r in mine}) == len(mine), v


def _prefill_row(variant, ms, block_size=16, sweep=None, **extra):
    r = {"op": "paged_prefill", "variant": variant, "dtype": "bfloat16", "median_ms": ms, "config": "prefix",
         "batch": 8, "total_q": 4096, "max_seqlen_q": 512, "context": 4608, "heads": 32, "heads_kv": 8,
         "head_dim": 128, "block_size": block_size, "prefill_chunks": 8, "decode_tokens": 0, "TFLOPs": 100 / ms,
         "pct_of_mm": 10 / ms, **extra}
    return {**r, "sweep": sweep} if sweep else r


def _synthetic_prefill_record():
    """A GPU-like record: the prefix row (block 16: default 0.75 ms, attention_varlen 0.5) and the
    sweep, attention_varlen at 0.5 ms at every page size, default at 1.0 ms below 64 rows (gather)
    and 0.5 ms from 64 (tma)."""
    rows = [_prefill_row("attention_varlen", 0.5), _prefill_row("default", 0.75, dispatch="persistent",
                                                                producer="gather")]
    for bs in B.PREFILL_BLOCK_SIZES:
        producer = "gather" if bs < 64 else "tma"
        rows += [_prefill_row("attention_varlen", 0.5, bs, "block_size"),
                 _prefill_row("default", 1.0 if bs < 64 else 0.5, bs, "block_size", dispatch="persistent",
                              producer=producer)]
    return {"chapter": B.PREFILL_CHAPTER, "device": {"name": "Test GPU", "capability": [9, 0]},
            "date": "2026-01-01T00:00:00+00:00", "commit": "0123456789abcdef", "ceilings": {"mm_TFLOPs": 600.0},
            "wall_s": 1.0, "benchmarks": rows}


def test_block_size_figure_and_table_from_a_synthetic_record(tmp_path, capsys):
    record = _synthetic_prefill_record()
    figures = B.make_prefill_figures(record, tmp_path)
    assert [p.name for p in figures] == [f"{B.PREFILL_CHAPTER}.png", f"{B.PREFILL_CHAPTER}_block_size.png"]
    assert all(p.stat().st_size > 0 for p in figures)
    B.print_prefill_table(record)
    out = capsys.readouterr().out
    main, _, by_size = out.partition("by block size")
    assert sum(line.startswith("prefix ") for line in main.splitlines()) == 2  # its two rows, no sweep row
    assert "  prefix    0.67x" in main  # the prefix row alone: 0.5 ms / 0.75
    lines = {int(line.split()[0]): line.split() for line in by_size.splitlines()[2:] if line.strip()}
    assert sorted(lines) == list(B.PREFILL_BLOCK_SIZES)
    assert lines[16][1] == "gather" and lines[16][-1] == "0.50x" and lines[128][1:] == ["tma", "500.0", "500.0",
                                                                                         "1.00x"]
    # a record without the sweep draws the one figure, as before
    record["benchmarks"] = results.rows(record, sweep=None)
    bare = tmp_path / "bare"
    bare.mkdir()
    assert [p.name for p in B.make_prefill_figures(record, bare)] == [f"{B.PREFILL_CHAPTER}.png"]


def test_block_size_axes_from_a_synthetic_record():
    """The panels the lesson draws: the ratio per block size on a log2 axis, one point per size."""
    fig, axes = B.plt.subplots(1, 2)
    B.plot_prefill_block_size(axes, _synthetic_prefill_record())
    ratio_line = axes[0].get_lines()[0]
    assert list(ratio_line.get_xdata()) == list(B.PREFILL_BLOCK_SIZES)
    assert list(ratio_line.get_ydata()) == [0.5, 0.5, 0.5, 1.0, 1.0, 1.0]
    assert axes[0].get_xscale() == axes[1].get_xscale() == "log"
    assert [t.get_text() for t in axes[0].texts] == ["gather"] * 3 + ["tma"] * 3
    B.plt.close(fig)


def test_lesson_tables_keep_the_sweep_apart(monkeypatch):
    import lesson_facts as L
    record = _synthetic_prefill_record()
    monkeypatch.setattr(L, "_prefill_record", lambda **match: record if results.rows(record, **match) else None)
    table = L.paged_prefill_block_size(None).splitlines()
    assert [line.split(" | ")[0] for line in table[2:8]] == [f"| {bs}" for bs in B.PREFILL_BLOCK_SIZES]
    assert table[3] == "| 16 | gather | 1000 | 500 | 0.50x |" and table[6] == "| 128 | tma | 500 | 500 | 1.00x |"
    main = [line for line in L.paged_prefill(None).splitlines() if line.startswith("| prefix")]
    assert len(main) == 1 and "| 0.67x |" in main[0]  # the prefix row's 0.75 ms, not a sweep row's


def test_prefill_only_quick_run_writes_the_sweep_and_both_figures(tmp_path, monkeypatch):
    """--prefill-only: its own record (what the GPU pass runs for this section), the sweep in it."""
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(sys, "argv", ["bench_paged.py", "--quick", "--prefill-only"])
    record = B.main()
    assert record["chapter"] == B.PREFILL_CHAPTER and set(record["sizes"]) == {"prefill", "prefill_block_size"}
    assert {r["block_size"] for r in results.rows(record, op="paged_prefill", sweep="block_size")} == {
        c["block_size"] for c in record["sizes"]["prefill_block_size"]}
    out = next(tmp_path.glob(f"*/{B.PREFILL_CHAPTER}.json")).parent
    for name in (f"{B.PREFILL_CHAPTER}.png", f"{B.PREFILL_CHAPTER}_block_size.png"):
        assert (out / name).stat().st_size > 0, name
