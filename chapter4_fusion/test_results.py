"""The committed GPU results against today's code: version=None must still choose what the
benchmark recorded, and never run slower than 0.95x the fastest rung measured beside it."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
from coursekit import results, shapes  # noqa: E402

import fusion  # noqa: E402


def test_recorded_results_hold_the_dispatch():
    record = results.load_recorded_gpu("chapter4_fusion")
    assert record is not None, "no recorded GPU results: run bench_fusion.py on a GPU"
    checked = 0
    for r in record["benchmarks"]:
        if r["variant"] != "default" or "dispatch" not in r:
            continue
        op = r["op"] + ("_backward" if r.get("pass") == "backward" else "")
        # A meta tensor of the measured shape stands in for the GPU one (2^28 elements would be
        # a GiB on the CPU); shape and dtype decide the dispatch.
        # linear_activation's dispatch sees the GEMM's output, [M, N] of the row's [M, K, N].
        x = torch.empty(r["shape"][::2] if op == "linear_activation" else r["shape"],
                        dtype=getattr(torch, r["dtype"]), device="meta")
        assert r["dispatch"] == fusion.default_choice(op, x), r
        checked += 1
    assert checked > 0, "no default rows with a dispatch: results older than the dispatch?"
    rungs = {v for ladder in fusion.VERSIONS.values() for v in ladder}
    assert results.default_gaps(record, rungs) == []


def test_recorded_shapes_sweep_holds_the_target():
    """The shapes sweep (bench_fusion.py --shapes): at every shape that moves at least 1 MiB,
    version=None at least 0.95x the faster of eager and torch.compile, forward and backward,
    with the choice the dispatch makes today recorded beside it."""
    record = shapes.load("chapter4_fusion")

    def choice(r):
        if r["pass"] != "backward":
            return fusion.default_choice(r["op"], shapes.meta_like(r))
        op = {"bias_gelu": "fused_bias_scale_relu", "fused_add_rms_norm": "rms_norm"}.get(r["op"], r["op"])
        return fusion.default_choice(op + "_backward", shapes.meta_like(r))
    assert shapes.stale_dispatch(record, choice) == []
    shapes.expect_target(record, "bench_fusion.py --shapes")
