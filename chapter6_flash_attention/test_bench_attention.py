"""Tests of bench_attention.py's own arithmetic and of its CPU path at tiny sizes: the FLOP
count every TFLOP/s rests on, the math backend's memory estimate that decides what is skipped,
the calls per graph replay, the grid's invariants, the accuracy rows, and rows that carry the
fields the results contract asks for."""
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import bench_attention as B
from coursekit import bench


def test_forward_flops_are_two_matmuls():
    # S = Q K^T and O = P V: 2 * s_q * s_k * d FLOPs each, per (batch, head).
    assert B.attention_flops(2, 3, 5, 7, 11, causal=False) == 4 * 2 * 3 * 5 * 7 * 11


def test_causal_halves_only_square_masks():
    full = B.attention_flops(2, 3, 8, 8, 16, causal=False)
    assert B.attention_flops(2, 3, 8, 8, 16, causal=True) == full // 2
    # A rectangular causal mask is not a triangle: credited in full rather than guessed.
    assert B.attention_flops(2, 3, 4, 8, 16, causal=True) == B.attention_flops(2, 3, 4, 8, 16, causal=False)


@pytest.mark.parametrize("causal", (False, True))
def test_backward_is_two_and_a_half_forwards(causal):
    fwd = B.attention_flops(4, 16, 512, 512, 128, causal)
    assert B.attention_flops(4, 16, 512, 512, 128, causal, "backward") == fwd * 5 // 2


def test_math_estimate_counts_float32_matrices():
    # Two float32 s x s matrices per head forward (scores, probabilities), four backward.
    assert B.math_bytes(1, 1, 10, 20) == 2 * 4 * 200
    assert B.math_bytes(2, 3, 10, 20, "backward") == 4 * 4 * 2 * 3 * 200


def test_math_budget_keeps_short_and_drops_long_sequences():
    """On the lesson's grid the math backend runs at every seqlen up to 2048 (forward and
    backward, both head dims) and never at 16384, where one score matrix alone is 8+ GiB."""
    for c in B.configs(B.sizes_for("cuda", quick=False)):
        for p in ("forward", "backward"):
            fits = B.math_bytes(c["batch"], c["heads"], c["seqlen"], c["seqlen"], p) / 2**30 <= B.MATH_BUDGET_GiB
            if c["seqlen"] <= 2048:
                assert fits, c
            if c["seqlen"] == 16384:
                assert not fits, c


def test_grid_is_the_lessons():
    s = B.sizes_for("cuda", quick=False)
    grid = B.configs(s)
    assert s["seqlens"] == [512, 1024, 2048, 4096, 8192, 16384]
    assert len(grid) == 6 * 2 * 2 * 2  # seqlens x head dims x causal x dtypes
    assert {c["dtype"] for c in grid} == {"bfloat16", "float16"}
    for c in grid:
        assert c["batch"] * c["seqlen"] == 16384 and c["heads"] * c["head_dim"] == 2048, c


@pytest.mark.parametrize("causal", (False, True))
def test_reference64_matches_sdpa(causal):
    q, k, v = (torch.randn(1, 2, 9, 8, dtype=torch.float64) for _ in range(3))
    out, leaves = B.reference64(q, k, v, causal)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    assert all(t.requires_grad for t in leaves)


def test_error_row_ratio_and_criterion():
    e = {"batch": 2, "heads": 8, "seqlen": 1000, "head_dim": 128}
    base = {"dq": 1e-3, "dk": 2e-3, "dv": 1e-3}
    row = B.error_row("v1", "backward", {"dq": 1e-3, "dk": 5e-3, "dv": 1e-3}, base, e, "bfloat16", True)
    assert row["max_abs_err"] == 5e-3 and row["dk_max_abs_err"] == 5e-3
    assert math.isclose(row["ratio_vs_sdpa_flash"], 2.5) and row["within_2x_sdpa_flash"] is False
    assert "ratio_vs_sdpa_flash" not in B.error_row("v1", "forward", {"out": 1e-3}, None, e, "bfloat16", False)


TINY = {"seqlens": [16, 32], "tokens": 64, "hidden": 32, "head_dims": [16], "dtypes": ["float32"], "memory": None,
        "error": {"batch": 1, "heads": 2, "seqlen": 20, "head_dim": 16, "dtypes": ["float32"]}}


def test_cpu_timing_rows_follow_the_contract():
    notes = bench.Notes()
    rows = B.bench_timing("cpu", 0.1, TINY, notes)
    # sdpa_cudnn and sdpa_efficient have no CPU kernel: skipped, with a reason, once each.
    assert {n["variant"] for n in notes.skipped} == {"sdpa_cudnn", "sdpa_efficient"}
    assert {r["variant"] for r in rows} == {"sdpa_flash", "sdpa_math", "cpu"}
    assert len(rows) == 2 * 2 * 2 * 3  # seqlens x causal x passes x variants
    for r in rows:
        b, h, s, d = r["shape"]
        assert (r["op"], r["batch"], r["heads"], r["seqlen"], r["head_dim"]) == ("attention", b, h, s, d)
        assert r["flops"] == B.attention_flops(b, h, s, s, d, r["causal"], r["pass"])
        assert r["TFLOPs"] > 0 and "pct_of_mm" in r and r["reps"] >= 20
        flash = next(x for x in rows if x["variant"] == "sdpa_flash" and
                     all(x[k] == r[k] for k in ("pass", "causal", "seqlen")))
        assert math.isclose(r["speedup_vs_torch"], flash["median_ms"] / r["median_ms"])


def test_cpu_error_rows():
    rows = B.bench_error("cpu", TINY["error"], bench.Notes())
    ours = [r for r in rows if r["variant"] == "cpu"]
    assert {(r["pass"], r["causal"]) for r in ours} == {(p, c) for p in ("forward", "backward") for c in (False, True)}
    for r in ours:
        # float32 against float64 on 20 keys: a few float32 ulps of values ~1-10.
        assert 0 < r["max_abs_err"] < 1e-5 and "ratio_vs_sdpa_flash" in r, r


def test_a_slow_variant_is_not_probed_again_at_longer_sequences(monkeypatch):
    monkeypatch.setattr(B, "MAX_CALL_MS", 0.0)  # every call is "too slow"
    notes = bench.Notes()
    probed = []
    real_probe = bench.probe
    # Counted when the probe returns: SDPA's refusals of cudnn and efficient on the CPU raise
    # inside it, at every size (a refusal costs nothing, a slow call does).
    def counting_probe(fn, device):
        ms = real_probe(fn, device)
        probed.append(ms)
        return ms
    monkeypatch.setattr(bench, "probe", counting_probe)
    assert B.bench_timing("cpu", 0.1, TINY, notes) == []
    # Three variants run on the CPU, in 2 causal x 2 passes, probed at the first seqlen only.
    assert len(probed) == 3 * 2 * 2
    assert all("s=16" in n["first_at"] for n in notes.skipped if "ms" in n["reason"])


def test_bench_asks_the_dispatch_with_the_rows_mask(monkeypatch):
    """The default row's dispatch field is the rule asked with the row's mask (the forward rule reads
    it: a causal row's walks are uneven): a field asked without it named a rung the call did not run."""
    from types import SimpleNamespace
    asked = []
    monkeypatch.setattr(B.flash_attention, "default_choice",
                        lambda op, q, **kw: asked.append((op, kw)) or "some_rung", raising=False)
    cuda_like = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    for causal in (False, True):
        assert B.dispatch_of("attention_forward", cuda_like, causal) == {"dispatch": "some_rung"}
    assert asked == [("attention_forward", {"causal": False}), ("attention_forward", {"causal": True})]


def test_recorded_results_hold_the_dispatch():
    """version=None is never meaningfully slower than the best rung in the committed GPU results.
    Every rung is timed at every shape of the sweep, so today's rule (flash_attention.dispatch_rule,
    asked with the record's device) is held to the recorded rung rows, whichever rule the record was
    made under: the rung it names, timed beside the others, is held to 0.95x the fastest rung of the
    shape. The default row ran the rung the benchmark's dispatch field names (the rule of the
    record's commit, which the benchmark asked with the row's own mask): it is held to 0.9x that
    rung's row. At an H200's power cap two timings of one kernel in one run differed by up to 6%
    when timed one after the other (the sweep times a row's variants in shuffled rounds since), so
    this catches a dispatch path that adds work, not the clock's drift. Rows whose recorded dispatch differs from today's rule are counted and printed:
    the shapes a new run of the benchmark would time under the new rule."""
    import flash_attention
    from coursekit import results
    record = results.load_recorded_gpu("chapter6_flash_attention")
    assert record is not None, "no recorded GPU results: run bench_attention.py on a GPU"
    device = record["device"]
    facts = dict(cuda=True, capability=tuple(int(x) for x in device["capability"].split(".")), sms=device["sms"],
                 hopper_built="pingpong" in record["versions"]["attention_forward"])
    rungs = {v for op in ("attention_forward", "attention_backward") for v in flash_attention.VERSIONS[op]}
    groups = {}
    for r in record["benchmarks"]:
        # The FP8 rows (dtype float8_e4m3fn) have no rungs: attention_fp8 is one kernel, no dispatch.
        if r["op"] in ("attention", "attention_split_kv") and not r.get("call") and r["dtype"] != B.FP8_DTYPE:
            groups.setdefault(results.measurement_key(r), {})[r["variant"]] = r
    problems, changed, checked = [], [], 0
    for rows in groups.values():
        default = rows.get("default")
        if default is None:
            continue
        b, h = default["shape"][:2]
        d = default["head_dim"]
        q_shape = (b, h, default.get("seqlen_q", default.get("seqlen")), d)
        k_shape = (b, h, default.get("seqlen_k", default.get("seqlen")), d)
        op = "attention_forward" if default["pass"] == "forward" else "attention_backward"
        rung = flash_attention.dispatch_rule(op, q_shape, k_shape, dtype=getattr(torch, default["dtype"]),
                                             causal=default["causal"], **facts)
        ran = default.get("dispatch", rung)
        if ran != rung:
            changed.append(f"{default['dtype']} {default['shape']} {default['pass']} causal={default['causal']}: "
                           f"recorded {ran}, today {rung}")
        where = f"{default['op']} {default['dtype']} {default['shape']} {default['pass']} causal={default['causal']}"
        measured = {v: r["median_ms"] for v, r in rows.items() if v in rungs}
        if rung not in measured:
            problems.append(f"{where}: the rung version=None runs, {rung}, has no row")
            continue
        best = min(measured, key=measured.get)
        if measured[best] / measured[rung] < 0.95:
            problems.append(f"{where}: version=None runs {rung}, {measured[best] / measured[rung]:.3f}x {best}")
        if ran not in measured:
            problems.append(f"{where}: the rung the default row ran, {ran}, has no row")
        elif measured[ran] / default["median_ms"] < 0.9:
            problems.append(f"{where}: the default row is {measured[ran] / default['median_ms']:.3f}x its rung {ran}")
        checked += 1
    if changed:
        print(f"{len(changed)} default rows ran another rung than today's rule names:\n  " + "\n  ".join(changed))
    assert checked > 0
    assert problems == []


def test_varlen_rows_count_useful_work():
    """The packed rows' lengths are the ones the docstring promises (16 sequences of 128 to 8192,
    about 32K tokens, not sorted), and their FLOPs are each sequence's own causal triangle: the
    padded batch's extra work is not credited to anyone."""
    lens = B.VARLEN_LENGTHS
    assert len(lens) == 16 and min(lens) == 128 and max(lens) == 8192 and lens != sorted(lens)
    assert 30_000 <= sum(lens) <= 34_000
    h, d = B.VARLEN["heads"], B.VARLEN["head_dim"]
    assert B.varlen_flops(lens, h, d, True) == sum(B.attention_flops(1, h, n, n, d, True) for n in lens)
    # the lesson's "more than seven times": the padded batch's causal work over the sequences' own
    assert 7 * B.varlen_flops(lens, h, d, True) < B.attention_flops(len(lens), h, max(lens), max(lens), d, True)
    assert B.varlen_flops([5, 7], 2, 8, False, "backward") == B.attention_flops(1, 2, 5, 5, 8, False, "backward") + \
        B.attention_flops(1, 2, 7, 7, 8, False, "backward")


def test_recorded_varlen_results_hold_the_dispatch():
    """The packed rows (bench_attention.py --ops attention_varlen, their own results file): each
    default row ran the rung the extension's varlen rule names on the recorded GPU (asked with the
    record's sequence count and max lengths), that rung was
    timed beside it, and it is within 0.95x the fastest packed rung, as
    test_recorded_results_hold_the_dispatch holds the padded rows."""
    import flash_attention
    from coursekit import results
    record = results.load_recorded_gpu("chapter6_flash_attention_varlen")
    if record is None:
        pytest.skip("no recorded packed rows yet: run `python bench_attention.py --ops attention_varlen` on a GPU")
    device = record["device"]
    rows = results.rows(record, op="attention_varlen")
    # The recorded build took the packed layout on the Hopper forward iff it timed that rung packed:
    # a record from before rung "persistent" took it has no such row, and its rule had no such choice.
    # Likewise the backward's "wgmma" (its kVarlen instantiation) iff it timed that rung packed.
    hopper = {pass_: any(r["variant"] == rung and r["layout"] == "packed" and r["pass"] == pass_ for r in rows)
              for pass_, rung in (("forward", "persistent"), ("backward", "wgmma"))}
    problems = []
    for pass_, rungs in (("forward", ("tuned", "split_kv", "persistent")),
                         ("backward", ("mma", "mma_dqpass", "wgmma"))):
        facts = dict(cuda=True, capability=tuple(int(x) for x in device["capability"].split(".")), sms=device["sms"],
                     hopper_built=hopper[pass_])
        got = {r["variant"]: r for r in rows if r["pass"] == pass_ and r["layout"] == "packed"}
        assert "default" in got, f"no default row for the packed {pass_}"
        default = got["default"]
        op = f"attention_varlen_{pass_}"
        rung = flash_attention.dispatch_rule(op, tuple(default["shape"]), dtype=getattr(torch, default["dtype"]),
                                             causal=default["causal"], batch=default["sequences"],
                                             max_seqlen_q=default["max_seqlen"], max_seqlen_k=default["max_seqlen"],
                                             **facts)
        assert default["dispatch"] == rung, default
        measured = {v: got[v]["median_ms"] for v in rungs if v in got}
        if rung not in measured:
            problems.append(f"{pass_}: the rung version=None runs, {rung}, has no row")
            continue
        best = min(measured, key=measured.get)
        if measured[best] / measured[rung] < 0.95:
            problems.append(f"{pass_}: version=None runs {rung}, {measured[best] / measured[rung]:.3f}x {best}")
    assert problems == []


# ---------------------------------------------------------------------------------------------
# The masked sections (--ops attention_window, --ops attention_softcap)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", (False, True))
def test_visible_pairs_are_the_references_own_mask(causal):
    """visible_pairs counts what the extension's mask keeps: with q = 0 every visible score is 0, so
    the C++ reference's lse of a row is log(its visible keys) (-inf for none), whatever the rule's
    edge cases (rectangular, bottom-right, a bound of 0, an unbounded side)."""
    import flash_attention
    for s_q, s_k in ((7, 7), (5, 9), (9, 5), (33, 33)):
        q, k, v = torch.zeros(1, 1, s_q, 8, dtype=torch.float64), *(torch.randn(1, 1, s_k, 8, dtype=torch.float64)
                                                                     for _ in range(2))
        for window in ((-1, -1), (3, 0), (2, 4), (0, -1), (-1, 2), (0, 0)):
            _, lse = flash_attention.attention(q, k, v, causal=causal, window=window, return_lse=True)
            keys = int(lse.exp().round().sum())
            assert B.visible_pairs(s_q, s_k, causal, window) == keys, (s_q, s_k, window)


def test_masked_flops_count_the_band():
    """The window section's shape: row i of 32768 sees min(i + 1, 4096) keys; the dense causal call
    the whole triangle; 4 d FLOPs a pair forward, 2.5x backward."""
    c = B.WINDOW
    b, h, n, d, left = c["batch"], c["heads"], c["seqlen"], c["head_dim"], c["window"][0]
    band = (left + 1) * (left + 2) // 2 + (n - left - 1) * (left + 1)
    assert left + 1 == 4096 and B.visible_pairs(n, n, True, c["window"]) == band
    assert B.visible_pairs(n, n, True) == n * (n + 1) // 2
    assert B.masked_flops(b, h, n, n, d, True, c["window"]) == 4 * b * h * d * band
    assert B.masked_flops(b, h, n, n, d, True, c["window"], "backward") == 10 * b * h * d * band


def test_masked_sections_are_the_lessons():
    import flash_attention
    w, s = B.WINDOW, B.SOFTCAP
    assert (w["batch"], w["heads"], w["seqlen"], w["head_dim"], w["dtype"], w["causal"], w["window"], w["softcap"]) \
        == (1, 16, 32768, 128, "bfloat16", True, [4095, 0], 0.0)
    assert (s["batch"], s["heads"], s["seqlen"], s["head_dim"], s["dtype"], s["causal"], s["window"], s["softcap"]) \
        == (2, 16, 8192, 128, "bfloat16", True, [-1, -1], 30.0)
    for pass_, rungs in B.MASKED_RUNGS.items():
        assert set(rungs) <= set(flash_attention.VERSIONS[f"attention_{pass_}"]), pass_
    # each section its own results file, and `--ops` offers every section
    assert {op: B.SECTIONS[op][1] for op in B.SECTIONS} == {
        "attention_varlen": "_varlen", "attention_window": "_window", "attention_softcap": "_softcap",
        "attention_fp8": "_fp8", "attention_overlap": "_overlap", "transformers_model": "_transformers"}


def test_softcap_tanh_knob_removed(monkeypatch):
    """COURSE_SOFTCAP_TANH went with the softcap's FMA tanh: softcap.cuh no longer reads it, and the
    softcap section refuses it set, by name, before timing anything (unset or empty: it runs); the
    section's record no longer carries a mode."""
    assert B.REMOVED_SOFTCAP_TANH_ENV == "COURSE_SOFTCAP_TANH"
    header = (Path(__file__).parent / "csrc" / "attention" / "softcap.cuh").read_text()
    assert "COURSE_SOFTCAP_TANH" not in header and "getenv" not in header and "kFma" not in header
    for value in ("fma", "rcp"):
        monkeypatch.setenv(B.REMOVED_SOFTCAP_TANH_ENV, value)
        with pytest.raises(ValueError, match=rf"COURSE_SOFTCAP_TANH='{value}': the variable was removed"):
            B.bench_masked("attention_softcap", "cpu", 1.0, None)
    monkeypatch.setenv(B.REMOVED_SOFTCAP_TANH_ENV, "")
    B.refuse_removed_softcap_tanh()
    monkeypatch.delenv(B.REMOVED_SOFTCAP_TANH_ENV)
    B.refuse_removed_softcap_tanh()
    assert "softcap_tanh" not in B.SECTIONS["attention_softcap"][2]("cpu")


def test_transformers_model_rows_on_the_cpu(monkeypatch, one_thread):
    """--ops transformers_model at a toy size on the CPU: an "sdpa" row and a "default" row (the
    chapter's attention inside the same weights), both credited the model's FLOPs, ours carrying its
    logits' distance from the sdpa path's: float32 roundoff (~1e-7 of logits ~0.2), far below what
    a wrong mask, head mapping or scale moves them by (O(0.1): the integration's tests)."""
    pytest.importorskip("transformers")
    toy = {**B.HF_MODEL_CPU, "seqlen": 17}
    monkeypatch.setattr(B, "HF_MODEL_CPU", toy)
    rows = B.bench_transformers_model("cpu", 0.1, bench.Notes())
    assert [r["variant"] for r in rows] == ["sdpa", "default"]
    for r in rows:
        assert r["op"] == "transformers_model" and r["shape"] == [toy["batch"], toy["seqlen"], toy["hidden_size"]]
        assert r["flops"] == rows[0]["flops"] > 0 and r["TFLOPs"] > 0 and r["reps"] >= 20
    assert rows[0]["logits_max_abs_diff"] == 0.0
    assert rows[1]["logits_max_abs_diff"] < 1e-5 and rows[1]["logits_rms"] > 0.01


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("op", ("attention_window", "attention_softcap"))
def test_flex_baseline_computes_our_mask(op):
    """flex_attention's block mask and score_mod are the same attention as ours: its eager path
    against the C++ reference at 200 tokens, float32 both (a few float32 ulps of outputs ~1)."""
    import flash_attention
    c = {**B.masked_config(op, "cpu"), "seqlen": 200}
    if op == "attention_window":
        c["window"] = [37, 0]
    q, k, v, _ = B.make_inputs(1, 2, 200, 64, torch.float32, "cpu")
    flex = B.flex_masked_attention(c, "cpu", compile=False)
    ours = flash_attention.attention(q, k, v, causal=True, window=c["window"], softcap=c["softcap"])
    torch.testing.assert_close(flex(q, k, v), ours, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", ("attention_window", "attention_softcap"))
def test_masked_rows_on_the_cpu(monkeypatch, op):
    """A section's rows at a tiny size: the masked call and the dense one (fields window, softcap),
    every row credited the masked call's work and carrying the pairs its own call computes, and
    flex_attention's refusal noted, not a crash (compiling it takes 15 s on the CPU: replaced here)."""
    small = {**B.masked_config(op, "cpu"), "seqlen": 48}
    if op == "attention_window":
        small["window"] = [15, 0]
    monkeypatch.setattr(B, "masked_config", lambda op_, device: small)

    def no_flex(c, device, compile=True):
        raise RuntimeError("flex_attention is not compiled in this test")
    monkeypatch.setattr(B, "flex_masked_attention", no_flex)
    notes = bench.Notes()
    rows = B.bench_masked(op, "cpu", 0.1, notes)
    assert any(n["variant"] == "flex_attention" for n in notes.skipped)
    dense_sdpa = {"sdpa_flash"} if op == "attention_window" else set()
    b, h, n, d = small["batch"], small["heads"], small["seqlen"], small["head_dim"]
    for pass_ in ("forward", "backward"):
        got = [r for r in rows if r["pass"] == pass_]
        masked = [r for r in got if (r["window"], r["softcap"]) == (small["window"], small["softcap"])]
        dense = [r for r in got if (r["window"], r["softcap"]) == ([-1, -1], 0.0)]
        assert [r["variant"] for r in masked] == ["cpu"]
        assert {r["variant"] for r in dense} == {"cpu"} | dense_sdpa
        assert len(masked) + len(dense) == len(got)
        for r in got:
            assert r["op"] == op and r["shape"] == [b, h, n, d] and r["causal"] is True
            assert r["flops"] == B.masked_flops(b, h, n, n, d, True, small["window"], pass_)
            assert r["visible_pairs"] == B.visible_pairs(n, n, True, r["window"])
            assert r["TFLOPs"] > 0 and r["reps"] >= 20 and "speedup_vs_torch" not in r


def test_recorded_masked_results_hold_the_dispatch():
    """The masked rows (bench_attention.py --ops attention_window / attention_softcap, their own
    files): each masked default row ran the rung the extension's rule names for that mask on the
    recorded GPU, that rung was timed beside it, and it is within 0.95x the fastest rung that takes
    the mask."""
    import flash_attention
    from coursekit import results
    checked = 0
    for op in ("attention_window", "attention_softcap"):
        record = results.load_recorded_gpu(f"{B.CHAPTER}_{op.removeprefix('attention_')}")
        if record is None:
            continue
        device = record["device"]
        # The recorded build took a window or a softcap on the Hopper forward iff it timed rung
        # "persistent" with the mask: a record from before that rung took them has no such row, and
        # its rule had no such choice.
        # Likewise the backward's "wgmma" (its kWindowSoftcap instantiation) iff it timed that rung.
        for pass_, rungs in B.MASKED_RUNGS.items():
            hopper = any(r["variant"] == ("persistent" if pass_ == "forward" else "wgmma")
                         and (r["window"], r["softcap"]) != ([-1, -1], 0.0)
                         for r in results.rows(record, op=op, **{"pass": pass_}))
            facts = dict(cuda=True, capability=tuple(int(x) for x in device["capability"].split(".")),
                         sms=device["sms"], hopper_built=hopper)
            got = {r["variant"]: r for r in results.rows(record, op=op, **{"pass": pass_})
                   if (r["window"], r["softcap"]) != ([-1, -1], 0.0)}
            default = got.get("default")
            assert default is not None, f"{op}: no masked default row for the {pass_}"
            b, h, n, d = default["shape"]
            rung = flash_attention.dispatch_rule(f"attention_{pass_}", (b, h, n, d), dtype=getattr(torch, default["dtype"]),
                                                 causal=default["causal"], window=default["window"],
                                                 softcap=default["softcap"], **facts)
            assert default["dispatch"] == rung, (op, pass_, default["dispatch"], rung)
            measured = {v: got[v]["median_ms"] for v in rungs if v in got}
            assert rung in measured, f"{op} {pass_}: the rung version=None runs, {rung}, has no row"
            best = min(measured, key=measured.get)
            assert measured[best] / measured[rung] >= 0.95, (op, pass_, rung, best)
            checked += 1
    if not checked:
        pytest.skip("no recorded masked rows yet: run `python bench_attention.py --ops attention_window` and "
                    "`--ops attention_softcap` on a GPU")


# ---------------------------------------------------------------------------------------------
# The FP8 rows: shapes of the sweep, and the accuracy with outliers
# ---------------------------------------------------------------------------------------------
def test_fp8_shapes_are_sweep_shapes():
    """Each FP8 row has bf16 rows of its shape in the main results: its shape is one of the GPU
    sweep's (configs()), forward."""
    s = B.sizes_for("cuda", quick=False)
    sweep = {(c["batch"], c["heads"], c["seqlen"], c["head_dim"], c["causal"]) for c in B.configs(s)}
    assert set(B.FP8_SHAPES) <= sweep


def test_outlier_inputs_are_the_papers():
    """N(0, 1) with an N(0, 100) term added to a 0.1% of the entries: the entries the term hit are
    the ones that differ from the same generator's draws without it (fraction 0)."""
    shape = (4, 8, 256, 64)
    plain = B.outlier_inputs(shape, "cpu", seed=5, fraction=0.0)
    with_outliers = B.outlier_inputs(shape, "cpu", seed=5)
    for x0, x in zip(plain, with_outliers):
        hit = x != x0
        assert x0.std().item() == pytest.approx(1.0, rel=0.02)
        n = x.numel()
        # binomial(n, 0.001): within 5 standard deviations of its mean
        assert abs(hit.sum().item() - n * 0.001) < 5 * math.sqrt(n * 0.001)
        assert (x - x0)[hit].std().item() == pytest.approx(B.FP8_OUTLIERS["std"], rel=0.15)


def test_rmse_is_the_root_mean_square():
    ref = torch.zeros(2, 3, dtype=torch.float64)
    x = torch.tensor([[3.0, 0, 0], [0, 4.0, 0]])
    assert B.rmse(x, ref) == pytest.approx(math.sqrt(25 / 6))
    assert B.rmse(ref, ref) == 0.0


def test_error_histogram_bins():
    """|x - ref| lands in [edge i, edge i+1): an edge itself in the bin it opens; below the first edge
    (exact zeros too) and at or above the last counted apart."""
    ref = torch.zeros(8, dtype=torch.float64)
    x = torch.tensor([0.0, 1e-8, 1e-7, 2e-7, -0.5, 0.5, 10.0, 20.0])
    h = B.error_histogram(x, ref)
    assert h["edges"][0] == pytest.approx(1e-7) and h["edges"][-1] == pytest.approx(10.0)
    assert (h["below"], h["above"]) == (2, 2)
    bins = {i: c for i, c in enumerate(h["counts"]) if c}
    assert bins == {0: 1, 1: 1, 26: 2}  # 1e-7 opens bin 0; 2e-7 in [1.78e-7, 3.16e-7); 0.5 in [0.316, 0.562)


def test_cpu_fp8_accuracy_rows():
    """The accuracy rows at a tiny size on the CPU, each rmse recomputed here from its own pieces:
    the float64 softmax attention of the float32 inputs, and attention_fp8's CPU definition (the
    float64 attention of descale * e4m3, quantized per tensor after the rotation or not), with no
    call to the functions under test."""
    import flash_attention
    a = {"batch": 1, "heads": 2, "seqlen": 48, "head_dim": 64, "causal": False, "dtype": "float32"}
    rows = B.bench_fp8_accuracy("cpu", a, bench.Notes())
    assert [(r["dtype"], r.get("rotate")) for r in rows] == [
        ("float8_e4m3fn", False), ("float8_e4m3fn", True), ("float32", None)]
    q, k, v = B.outlier_inputs((1, 2, 48, 64), "cpu", seed=2)

    def attention64(q, k, v):
        p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8.0, dim=-1)  # 1 / sqrt(64)
        return p @ v.double()
    ref = attention64(q, k, v)

    def dequantized(x):
        amax = x.abs().max()
        return (x * (448.0 / amax)).to(torch.float8_e4m3fn).double() * (amax.double() / 448.0)
    r = flash_attention.hadamard_rotation(64, dtype=torch.float64)
    expected = {
        ("float8_e4m3fn", False): attention64(dequantized(q), dequantized(k), dequantized(v)),
        ("float8_e4m3fn", True): attention64(dequantized((q.double() @ r).float()),
                                             dequantized((k.double() @ r).float()), dequantized(v)),
        ("float32", None): ref}
    for row in rows:
        assert row["op"] == "attention_rmse" and row["variant"] == "cpu" and row["shape"] == [1, 2, 48, 64]
        out = expected[(row["dtype"], row.get("rotate"))].to(torch.bfloat16 if row["dtype"] != "float32"
                                                              else torch.float32)
        want = (out.double() - ref).square().mean().sqrt().item()
        assert row["rmse"] == pytest.approx(want, rel=0.05, abs=1e-7), row
        hist = row["abs_err_histogram"]  # every element in one bin, the bins' edges as declared
        assert hist["below"] + sum(hist["counts"]) + hist["above"] == 1 * 2 * 48 * 64
        assert len(hist["counts"]) == len(hist["edges"]) - 1 == 32
    # the rows' point: quantizing loses more than float32, and the outliers make it worse
    fp8 = {row["rotate"]: row["rmse"] for row in rows if row["dtype"] == "float8_e4m3fn"}
    assert min(fp8.values()) > 10 * rows[-1]["rmse"]


def test_fp8_rows_sit_beside_the_bf16_rows_of_their_shape():
    """The table's grouping: an FP8 row (op attention, dtype float8_e4m3fn) with the bf16 forward rows
    of sdpa_cudnn and pingpong of its shape, and nothing of another shape, pass or dtype."""
    def row(variant, dtype, seqlen=8192, pass_="forward", **more):
        return {"op": "attention", "variant": variant, "dtype": dtype, "batch": 2, "heads": 16, "seqlen": seqlen,
                "head_dim": 128, "causal": False, "pass": pass_, **more}
    record = {"benchmarks": [
        row("sdpa_cudnn", "bfloat16", sweep=True), row("pingpong", "bfloat16", sweep=True),
        row("pingpong", "float16", sweep=True), row("pingpong", "bfloat16", pass_="backward"),
        row("pingpong", "bfloat16", seqlen=4096), row("default", "bfloat16"),
        row("default", B.FP8_DTYPE), row("default", B.FP8_DTYPE, call="quantize_fp8 + attention_fp8")]}
    got = B.fp8_rows_beside(record)
    assert list(got) == [(2, 16, 8192, 128, False)]
    shape = got[(2, 16, 8192, 128, False)]
    assert set(shape) == {"sdpa_cudnn", "pingpong", "default", "default (quantize_fp8 + attention_fp8)"}
    assert shape["pingpong"]["dtype"] == "bfloat16" and shape["default"]["dtype"] == B.FP8_DTYPE


def test_overlap_calls_set_the_knob_per_call(monkeypatch):
    """The overlap rows: each call of ours runs with FLASH_ATTENTION_HOPPER_OVERLAP set for it alone
    (1 for the _overlap rows, 0 for the joint ones, whatever the caller's environment holds) and
    restored after; each rung's two schedules are timed back to back."""
    seen = []
    monkeypatch.setattr(B.flash_attention, "attention",
                        lambda q, k, v, causal, version: seen.append((version, B.os.environ.get(B.OVERLAP_KNOB))))
    monkeypatch.setenv(B.OVERLAP_KNOB, "caller's")
    calls = B.overlap_calls(None, None, None, True)
    names = [name for name, _, _ in calls]
    assert names == ["sdpa_cudnn", "persistent", "persistent_overlap", "pingpong", "pingpong_overlap"]
    for _, _, call in calls[1:]:
        call()
    assert seen == [("persistent", "0"), ("persistent", "1"), ("pingpong", "0"), ("pingpong", "1")]
    assert B.os.environ[B.OVERLAP_KNOB] == "caller's"
    assert calls[4][1]["knob"] == f"{B.OVERLAP_KNOB}=1" and calls[2][1]["schedule"] == "overlap"
    assert {(b, h, n, d) for b, h, n, d, _ in B.OVERLAP_SHAPES} == {
        (2, 16, 8192, 128), (4, 16, 4096, 128), (32, 16, 512, 128), (8, 32, 2048, 64), (2, 32, 8192, 64),
        (32, 32, 512, 64)}
