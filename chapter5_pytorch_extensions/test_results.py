"""The committed GPU results against today's code. Chapter 5 has no ladder and no version=: its
one kernel per op is what every route runs, so what the results must hold is the target of the
shapes sweep (bench_extensions.py --shapes): fused_op (the public op, route 2), forward and
backward, at least 0.95x the faster of eager and torch.compile at every shape that moves at
least 1 MiB, and every route within 0.95x of the fastest at the benchmark's own size."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
from coursekit import results, shapes  # noqa: E402

import custom_ops  # noqa: E402


def test_recorded_results_hold_the_dispatch():
    """Every binding route runs the same kernel: at the benchmark's fused_op size, none may be
    slower than 0.95x the fastest of them (a route that is, pays for something besides the
    kernel), in every dtype and pass."""
    record = results.load_recorded_gpu("chapter5_pytorch_extensions")
    assert record is not None, "no recorded GPU results: run bench_extensions.py on a GPU"
    routes = set(custom_ops.ROUTES)
    fused = [r for r in record["benchmarks"] if r["op"] == "fused_op" and r["variant"] in routes]
    assert {r["variant"] for r in fused} == routes, "a route is missing: stale results"
    groups = {}
    for r in fused:
        groups.setdefault((r["dtype"], r.get("pass"), tuple(r["shape"])), []).append(r)
    for key, rows in groups.items():
        best = min(r["median_ms"] for r in rows)
        slow = [(r["variant"], best / r["median_ms"]) for r in rows if best / r["median_ms"] < 0.95]
        assert slow == [], (key, slow)


def test_recorded_shapes_sweep_holds_the_target():
    record = shapes.load("chapter5_pytorch_extensions")
    shapes.expect_target(record, "bench_extensions.py --shapes")
