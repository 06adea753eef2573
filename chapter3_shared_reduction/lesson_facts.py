"""Measured numbers quoted in this chapter's README, computed from the results files.

tools/report.py fills each <!-- results:NAME:begin -->...<!-- results:NAME:end --> block of
README.md with FACTS[NAME](record), so the prose always matches results/ (no typed numbers).
record["profile"] is the chapter's ncu profile (profile_shared_reduction.py), when there is one.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from coursekit import results  # noqa: E402

SOFTMAX_LENGTHS = (128, 1024, 4096, 16384, 65536, 262144)
WHOLE = ("v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10")


def _where(record):
    return f"{record['device']['name']}, {record['date'][:10]}"


def _row(record, **match):
    found = results.rows(record, **match)
    if not found:
        raise KeyError(match)
    return found[0]


def _pct(r):
    return f"{r['pct_of_copy']:.0f}%"


def ceiling(record):
    return f"{record['ceilings']['copy_GBps']:.0f} GB/s ({_where(record)})"


def harris_table(record):
    n = record["sizes"]["whole"]
    lines = ["| rung | float32 GB/s | % of copy | x torch.sum | bfloat16 GB/s | % of copy | x torch.sum |",
             "|---|---|---|---|---|---|---|"]
    for variant in ("torch", *WHOLE, "default", "atomic"):
        cells = []
        for dtype in ("float32", "bfloat16"):
            found = results.rows(record, op="sum", variant=variant, dtype=dtype, shape=[n], dim=None, sweep=False)
            cells += ([f"{found[0]['GBps']:.0f}", _pct(found[0]), f"{found[0]['speedup_vs_torch']:.2f}"]
                      if found else ["-", "-", "-"])
        name = variant + (f" -> {found[0]['dispatch']}" if variant == "default" and found else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(f"\n2^{n.bit_length() - 1} elements, {_where(record)}.")
    return "\n".join(lines)


def harris_profile(record):
    profile = record.get("profile")
    if not profile:
        return "(no ncu profile recorded yet)"
    lines = ["| rung | launches | instructions / element | shared wavefronts / element | bank conflicts "
             "| threads / instruction | occupancy | us under ncu |", "|---|---|---|---|---|---|---|---|"]
    for r in profile["benchmarks"]:
        if r["op"] == "sum":
            lines.append(f"| {r['variant']} | {r['launches']} | {r['instructions_per_element']:.2f} | "
                         f"{r['smem_wavefronts_per_element']:.3f} | {r['smem_bank_conflicts']:.0f} | "
                         f"{r['threads_per_instruction']:.1f} | {r['achieved_occupancy_pct']:.0f}% | "
                         f"{r['duration_ns'] / 1e3:.0f} |")
    lines.append(f"\nncu, {profile['device']['name']}, {profile['date'][:10]}.")
    return "\n".join(lines)


def atomic(record):
    demo = record.get("atomic_demo")
    if not demo:
        return "(no atomics demo recorded yet)"
    return (f"{demo['runs']} runs of `atomic_sum` on the same {demo['elements']}-element float32 "
            f"tensor gave {len(demo['atomic_values'])} different results (largest spread "
            f"{demo['atomic_max_abs_diff']:.3g}), while `sum` gave "
            f"{len(demo['sum_values'])} ({_where(record)}).")


def whole_default(record):
    n = record["sizes"]["whole"]
    parts = []
    for dtype in ("float32", "bfloat16"):
        r = _row(record, op="sum", variant="default", dtype=dtype, shape=[n], dim=None, sweep=False)
        parts.append(f"{dtype} {r['GBps']:.0f} GB/s ({_pct(r)} of copy, {r['speedup_vs_torch']:.2f}x torch.sum)")
    return "; ".join(parts) + f" ({_where(record)})."


def rows_cols(record):
    side = record["sizes"]["matrix"]
    parts = []
    for dim, what in ((-1, "rows (dim=-1)"), (0, "columns (dim=0)")):
        for dtype in ("float32", "bfloat16"):
            r = _row(record, op="sum", variant="default", dtype=dtype, shape=[side, side], dim=dim, sweep=False)
            parts.append(f"{what} {dtype}: {r['dispatch']} {_pct(r)} of copy, "
                         f"{r['speedup_vs_torch']:.2f}x torch")
    return "; ".join(parts) + f" ({_where(record)})."


def row_sweep(record):
    parts = []
    for r in sorted(results.rows(record, op="sum", variant="default", dim=-1, sweep=True), key=lambda r: r["shape"][1]):
        parts.append(f"{r['shape'][1]}: {r['dispatch']} {r['GBps']:.0f} GB/s ({r['speedup_vs_torch']:.2f}x torch)")
    return "row length " + ", ".join(parts) + f" ({_where(record)})."


def column_sweep(record):
    parts = []
    for r in sorted(results.rows(record, op="sum", variant="default", dim=0, sweep=True), key=lambda r: r["shape"][1]):
        parts.append(f"{r['shape'][0]} x {r['shape'][1]}: {r['dispatch']} {_pct(r)} of copy "
                     f"({r['speedup_vs_torch']:.2f}x torch)")
    return ", ".join(parts) + f" ({_where(record)})."


def target_misses(record):
    """Every softmax/log_softmax measurement where version=None misses this chapter's targets:
    forward >= 90% of copy and >= 1.0x torch and torch.compile; backward >= 85% of copy."""
    misses = []
    for r in results.rows(record, variant="default", dim=-1, sweep=True):
        if r["op"] not in ("softmax", "log_softmax"):
            continue
        c = _softmax_row(record, r["op"], r["dtype"], r["shape"][-1], "torch.compile", r["pass"])
        why = []
        floor = 90 if r["pass"] == "forward" else 85
        if r["pct_of_copy"] < floor:
            why.append(f"{_pct(r)} of copy")
        if r["pass"] == "forward" and r["speedup_vs_torch"] < 1.0:
            why.append(f"{r['speedup_vs_torch']:.3f}x torch")
        if r["pass"] == "forward" and c and c["median_ms"] / r["median_ms"] < 1.0:
            why.append(f"{c['median_ms'] / r['median_ms']:.3f}x torch.compile")
        if why:
            misses.append(f"{r['op']} {r['pass']} {r['dtype']} at {r['shape'][-1]}: " + ", ".join(why))
    if not misses:
        return f"None: every target met ({_where(record)})."
    return "; ".join(misses) + f" ({_where(record)})."


def softmax_dram(record):
    profile = record.get("profile")
    if not profile:
        return "(no ncu profile recorded yet)"
    return ", ".join(f"{r['variant']} {r['dtype']} {r['dram_bytes_over_minimum']:.2f}x the minimum, "
                     f"DRAM busy {r['dram_busy_pct']:.0f}% of the kernel's time"
                     for r in profile["benchmarks"] if r["op"] == "softmax") + \
        f" (DRAM bytes read + written over 2 x n x size; ncu, {profile['date'][:10]})."


def _softmax_row(record, op, dtype, n, variant, pass_="forward"):
    found = [r for r in results.rows(record, op=op, dtype=dtype, variant=variant, dim=-1)
             if r.get("pass") == pass_ and r["shape"][-1] == n]
    return found[0] if found else None


def softmax_table(record):
    lines = []
    for op in ("softmax", "log_softmax"):
        for dtype in ("float32", "bfloat16"):
            lines += [f"**{op} forward, {dtype}** (% of copy)", "",
                      "| row length | torch | torch.compile | v1 | v2 | v3 | v4 | v5 | default | default x torch | default x compile |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            for n in SOFTMAX_LENGTHS:
                cells = []
                for v in ("torch", "torch.compile", "v1", "v2", "v3", "v4", "v5", "default"):
                    r = _softmax_row(record, op, dtype, n, v)
                    cells.append(_pct(r) if r else "-")
                d = _softmax_row(record, op, dtype, n, "default")
                c = _softmax_row(record, op, dtype, n, "torch.compile")
                cells.append(f"{d['speedup_vs_torch']:.2f}" if d else "-")
                cells.append(f"{c['median_ms'] / d['median_ms']:.2f}" if d and c else "-")
                lines.append(f"| {n} | " + " | ".join(cells) + " |")
            lines.append("")
    lines.append(f"2^28 elements per measurement, {_where(record)}.")
    return "\n".join(lines)


def split(record):
    parts = []
    for dtype in ("float32", "bfloat16"):
        for n in (65536, 262144):
            v5, v3 = _softmax_row(record, "softmax", dtype, n, "v5"), _softmax_row(record, "softmax", dtype, n, "v3")
            t = _softmax_row(record, "softmax", dtype, n, "torch")
            if v5 and v3 and t:
                parts.append(f"{dtype} at {n}: v5 {_pct(v5)} of copy (v3 {_pct(v3)}, torch {_pct(t)})")
    return "; ".join(parts) + f" ({_where(record)})."


def backward(record):
    parts = []
    for op in ("softmax", "log_softmax"):
        for dtype in ("float32", "bfloat16"):
            cells = []
            for n in SOFTMAX_LENGTHS:
                d = _softmax_row(record, op, dtype, n, "default", "backward")
                t = _softmax_row(record, op, dtype, n, "torch", "backward")
                if d and t:
                    cells.append(f"{n}: {_pct(d)} (torch {_pct(t)})")
            parts.append(f"{op} {dtype}: " + ", ".join(cells))
    return "; ".join(parts) + f" (% of copy for 3 x n x size bytes, {_where(record)})."


def envelope(record):
    # The rungs are every measured variant that is neither a baseline nor the dispatch itself.
    rungs = {r["variant"] for r in record["benchmarks"]} - {"torch", "torch.compile", "default", "atomic", "cpu"}
    problems = []
    for op in ("sum", "amax", "softmax", "log_softmax"):
        problems += results.default_gaps(record, rungs, ops=(op,))
    if not problems:
        return "In the committed results it holds at every measured shape."
    return "Where it does not hold: " + "; ".join(problems) + "."


FACTS = {"ceiling": ceiling, "harris_table": harris_table, "harris_profile": harris_profile,
         "atomic": atomic, "whole_default": whole_default, "rows_cols": rows_cols,
         "row_sweep": row_sweep, "column_sweep": column_sweep, "target_misses": target_misses,
         "softmax_dram": softmax_dram, "softmax_table": softmax_table,
         "split": split, "backward": backward, "envelope": envelope}


# The shapes sweep (bench_*.py --shapes; coursekit/shapes.py): its own results file.
from coursekit import shapes as _shapes  # noqa: E402


def _shapes_sweep(record):
    return _shapes.lesson_block("chapter3_shared_reduction")


FACTS["shapes_sweep"] = _shapes_sweep


def _column_shapes(record):
    """The sweep's column reductions (sum and amax over dim 0 or a middle dim: column_split and
    column_loop), one entry per shape with the range over ops and dtypes against the faster of
    eager and torch.compile, worst first, and the commit the sweep measured: the column_split
    changes are measured only by a sweep at or after them."""
    sweep = _shapes.load("chapter3_shared_reduction")
    if sweep is None:
        return "not measured yet: run the chapter's benchmark with --shapes on a GPU"
    by_shape = {}
    for x, d, _ in _shapes.ratios(sweep, ["sum", "amax"], _shapes.MIN_BYTES):
        if d.get("dim") is not None and d["dim"] not in (-1, len(d["shape"]) - 1):
            key = (_shapes.fmt_shape(d["shape"]), d["dim"])
            by_shape.setdefault(key, []).append((x, d.get("dispatch", "?")))
    if not by_shape:
        return "no column reduction in the recorded sweep"
    count = sum(len(v) for v in by_shape.values())
    below = sum(1 for v in by_shape.values() for x, _ in v if x < 0.95)
    parts = [f"{shape} dim={dim} ({'/'.join(sorted({k for _, k in v}))}) "
             f"{min(v)[0]:.2f}-{max(v)[0]:.2f}x"
             for (shape, dim), v in sorted(by_shape.items(), key=lambda kv: min(kv[1])[0])]
    return (f"{count} measurements (sum and amax, every dtype), {below} below 0.95x the faster of "
            f"eager and torch.compile; per shape, worst first: {'; '.join(parts)} "
            f"({sweep['device']['name']}, {sweep['date'][:10]}, commit {str(sweep.get('commit', '?'))[:7]})")


FACTS["column_shapes"] = _column_shapes
