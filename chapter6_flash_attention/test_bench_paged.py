"""Tests of bench_paged.py's arithmetic and of its CPU path at tiny sizes: the unique bytes every
decode GB/s rests on, the shuffled block tables, the grid (the issue's configurations, the memory
cap of the sweeps), the guard that refuses to time a wrong kernel, the prefix tree it builds, and
rows that carry the fields the results contract asks for."""
import math

import pytest
import torch

import bench_paged as B


def test_decode_bytes_count_each_cached_element_once():
    # 3 + 5 tokens x 2 kv heads x 4 dims, K and V, plus q and out (2 sequences x 6 heads x 4 dims)
    assert B.decode_bytes([3, 5], 6, 2, 4, 2) == ((3 + 5) * 2 * 2 + 2 * 6 * 2) * 4 * 2
    # the query heads do not multiply the cache's bytes: that is the GQA lesson
    assert B.decode_bytes([100], 32, 8, 128, 2) - B.decode_bytes([100], 8, 8, 128, 2) == 2 * 24 * 128 * 2


def test_random_tables_scatter_a_pool_without_reuse():
    lens = [1, 16, 17, 40]
    tables, num_blocks = B.random_tables(lens, 16, seed=3)
    used = [b for row, n in zip(tables, lens) for b in row[:-(-n // 16)]]
    assert sorted(used) == list(range(num_blocks))        # every block once: no sharing, no gaps
    assert {len(row) for row in tables} == {3}            # padded to the widest row
    assert used != sorted(used)                           # shuffled: not the contiguous layout


def test_grid_is_the_issues():
    s = B.sizes_for("cuda", quick=False)
    targets = {c["target"]: c for c in s["paged"]}
    assert set(B.TARGETS) <= set(targets)
    for name, c in B.TARGET_CONFIGS.items():
        assert {k: targets[name][k] for k in c} == c
        assert (targets[name]["dtype"], targets[name]["head_dim"], targets[name]["block_size"]) == ("bfloat16", 128, 16)
    assert [c["heads_kv"] for c in s["gqa"]] == [32, 16, 8, 4]
    # the split-KV sweep keeps only what fits the cap, and keeps the batch-1 long context
    for c in s["split"]:
        assert B.kv_cache_bytes(c["batch"], c["context"], c["heads_kv"], c["head_dim"], 2) <= B.KV_CAP_GiB * 2**30
    assert any(c["batch"] == 1 and c["context"] == 131072 for c in s["split"])
    assert not any(c["batch"] == 64 and c["context"] == 131072 for c in s["split"])
    assert (s["match"]["requests"], s["match"]["tokens"], s["match"]["nodes"]) == (4096, 2048, 100_000)


def test_mixed_lengths_are_seeded_and_in_range():
    c = B.config(64, 8192, 32, 8, mixed=True)
    lens = B.context_lengths(c, seed=0)
    assert lens == B.context_lengths(c, seed=0) and len(lens) == 64
    assert min(lens) >= 1 and max(lens) <= 8192 and len(set(lens)) > 32


def test_decode_inputs_gather_the_pages_in_order():
    c = B.config(3, 40, 4, 2, head_dim=8, dtype="float32", mixed=True)
    x = B.DecodeInputs(c, "cpu")
    for b, n in enumerate(x.lens):
        for t in range(n):
            block, row = x.tables[b, t // 16].item(), t % 16
            assert torch.equal(x.k[b, :, t], x.key_cache[block, row]), (b, t)
            assert torch.equal(x.v[b, :, t], x.value_cache[block, row]), (b, t)


def test_a_wrong_kernel_is_not_timed(monkeypatch):
    c = B.config(2, 50, 4, 2, head_dim=8, dtype="float32", target="t")
    real = B.flash_attention.paged_attention
    monkeypatch.setattr(B.flash_attention, "paged_attention", lambda *a, **k: real(*a, **k) + 1)
    with pytest.raises(AssertionError, match="not timing a wrong kernel"):
        B.bench_decode("cpu", [c], {"copy_GBps": 1.0}, B.Notes())


def test_cpu_decode_rows_follow_the_contract():
    configs = [B.config(2, 37, 4, 2, head_dim=8, dtype="float32", target="t"),
               B.config(3, 20, 4, 1, head_dim=8, dtype="float32", mixed=True, sweep="split_kv")]
    rows = B.bench_decode("cpu", configs, {"copy_GBps": 10.0}, B.Notes())
    assert {r["variant"] for r in rows} == {"cpu", B.BASELINE, "sdpa_gathered", "repeat_kv"}
    for r in rows:
        assert r["op"] == "paged_attention" and r["shape"] == [r["batch"], r["heads"], r["heads_kv"], r["context"],
                                                               r["head_dim"]]
        assert r["bytes"] == B.decode_bytes([r["context"]] * r["batch"], r["heads"], r["heads_kv"], r["head_dim"], 4) \
            if not r["mixed"] else r["bytes"] > 0
        assert math.isfinite(r["pct_of_copy"]) and r["pct_of_copy"] > 0 and r["reps"] >= 20
        assert r["max_abs_err"] < 1e-4
        base = next(x for x in rows if x["variant"] == B.BASELINE and x["shape"] == r["shape"])
        assert math.isclose(r["speedup_vs_torch"], base["median_ms"] / r["median_ms"])


def test_cpu_cache_op_rows_check_what_they_wrote():
    s = B.sizes_for("cpu", quick=True)["cache_ops"]
    rows = B.bench_cache_ops("cpu", s, {"copy_GBps": 10.0}, B.Notes())
    assert {(r["op"], r["variant"]) for r in rows} == {("reshape_and_cache", "cpu"), ("reshape_and_cache", "torch_index_copy"),
                                                       ("copy_blocks", "cpu"), ("copy_blocks", "torch_index")}
    for r in rows:
        assert r["bytes"] > 0 and r["pct_of_copy"] > 0 and "speedup_vs_torch" in r


def test_tree_grows_to_its_size_and_lookups_match():
    s = {"requests": 30, "tokens": 96, "nodes": 300, "block_size": 16, "vocab": 50}
    tree, pool = B.build_tree(s)
    nodes = tree.flat_tree("cpu")[1].numel()
    assert 300 <= nodes < 300 + 2 * max(100, 300 // 50) + 2
    queries = B.lookup_batch(pool, s)
    assert queries.shape == (30, 96) and queries.dtype == torch.int32
    tokens, blocks = tree.match_prefix(queries)
    for r in range(30):
        n, ids = tree.match_prefix_reference(queries[r])
        assert tokens[r].item() == n and blocks[r, :len(ids)].tolist() == ids
    # the full-match third reaches at least its whole cached blocks
    assert (tokens[::3] > 0).all()


def test_quick_run_writes_a_complete_record(tmp_path, monkeypatch):
    from coursekit import results
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr("sys.argv", ["bench_paged.py", "--quick"])
    B.main()
    path = next(tmp_path.glob("*/chapter6_paged_attention.json"))
    import json
    record = json.loads(path.read_text())
    ops = {r["op"] for r in record["benchmarks"]}
    assert ops == {"paged_attention", "reshape_and_cache", "copy_blocks", "match_prefix"}
    assert {r.get("sweep") for r in record["benchmarks"] if r["op"] == "paged_attention"} == {None, "gqa", "split_kv"}
    for key in ("device", "torch", "commit", "date", "ceilings", "wall_s", "baseline"):
        assert key in record
    match = results.rows(record, op="match_prefix")
    assert match and all(r["requests_per_s"] > 0 for r in match)
    assert (path.parent / "chapter6_paged_attention_targets.png").exists()
