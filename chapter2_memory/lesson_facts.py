"""Measured numbers quoted in this chapter's README, computed from the results files.

tools/report.py fills each <!-- results:NAME:begin -->...<!-- results:NAME:end --> block of
README.md with FACTS[NAME](record), so the prose always matches results/ (no typed numbers).
record["profile"] is the chapter's ncu profile (profile_memory_ops.py), when there is one.
"""
DTYPES = ("float32", "bfloat16", "float64")


def _square(record):
    side = record["sizes"]["square"]
    return [side, side]


def _row(record, variant, op="transpose", dtype="float32", shape=None, view=None, sweep=False):
    shape = shape or _square(record)
    for r in record["benchmarks"]:
        if (r["op"], r["dtype"], r["variant"], r["shape"], r["sweep"], r.get("view")) == (
                op, dtype, variant, shape, sweep, view):
            return r
    raise KeyError((op, dtype, variant, shape, view))


def _bw(r):
    return f"{r['GBps']:.0f} GB/s ({r['pct_of_copy']:.1f}% of copy)"


def _where(record):
    return f"{record['device']['name']}, {record['date'][:10]}"


def ceiling(record):
    return f"{record['ceilings']['copy_GBps']:.0f} GB/s ({_where(record)})"


def torch_transpose(record):
    return "; ".join(f"{d} {_bw(_row(record, 'torch', dtype=d))}" for d in DTYPES)


def v1(record):
    f32, v3 = _row(record, "v1"), _row(record, "v3")
    return (f"{_bw(f32)} in float32, {v3['GBps'] / f32['GBps']:.1f}x slower than the padded "
            f"tile; bfloat16 {_bw(_row(record, 'v1', dtype='bfloat16'))}")


def v2_v3(record):
    parts = []
    for d in DTYPES:
        a, b = _row(record, "v2", dtype=d), _row(record, "v3", dtype=d)
        parts.append(f"{d} v2 {a['GBps']:.0f} -> v3 {b['GBps']:.0f} GB/s "
                     f"({b['GBps'] / a['GBps']:.2f}x)")
    return "; ".join(parts)


def v4(record):
    parts = []
    for d in DTYPES:
        r = _row(record, "v4", dtype=d)
        parts.append(f"{d} {_bw(r)}, {r['speedup_vs_torch']:.2f}x PyTorch's copy of `x.t()`")
    return "; ".join(parts)


def v4_over_v3(record):
    return ", ".join(f"{d} {_row(record, 'v4', dtype=d)['GBps'] / _row(record, 'v3', dtype=d)['GBps']:.1f}x"
                     for d in DTYPES)


def batched(record):
    shape = record["sizes"]["batched"]
    parts = []
    for d in ("float32", "bfloat16"):
        r = _row(record, "v4", dtype=d, shape=shape)
        parts.append(f"{d} {_bw(r)}, {r['speedup_vs_torch']:.2f}x "
                     f"`x.transpose(-2, -1).contiguous()`")
    return "; ".join(parts)


def copy(record):
    parts = []
    for d in ("float32", "bfloat16"):
        n = record["sizes"]["copy_bytes"] // (4 if d == "float32" else 2)
        a, b = (_row(record, v, op="copy", dtype=d, shape=[n]) for v in ("v1", "v2"))
        parts.append(f"{d}: v1 {_bw(a)}, v2 {_bw(b)} = {b['speedup_vs_torch']:.3f}x `clone()`")
    return "; ".join(parts)


def _strided(record):
    return {r["stride"]: r for r in record["benchmarks"]
            if r["op"] == "strided_copy" and r["variant"] == "v1"}


def strided_table(record):
    rows = _strided(record)
    torch_rows = {r["stride"]: r for r in record["benchmarks"]
                  if r["op"] == "strided_copy" and r["variant"] == "torch"}
    lines = ["| stride | useful GB/s | 32-byte model | 64-byte model | PyTorch `x[::s]` copy |",
             "|---|---|---|---|---|"]
    for s in (1, 2, 4, 8, 16, 32, 64):
        if s in rows:
            r = rows[s]
            lines.append(f"| {s} | {r['GBps']:.0f} | {r['predicted_GBps']:.0f} | "
                         f"{r['predicted_64B_GBps']:.0f} | {torch_rows[s]['GBps']:.0f} |")
    return "\n".join(lines) + f"\n\n(float32, {record['sizes']['strided_elements']} input elements, {_where(record)})"


def _cliff(record):
    return sorted((r for r in record["benchmarks"]
                   if r["op"] == "copy_working_set" and r["variant"] == "v2"),
                  key=lambda r: r["working_set_bytes"])


def cliff(record):
    rows = _cliff(record)
    peak = max(rows, key=lambda r: r["GBps"])
    last = rows[-1]
    return (f"{peak['GBps']:.0f} GB/s with a {peak['working_set_bytes'] / 2**20:.0f} MiB working "
            f"set ({peak['GBps'] / record['ceilings']['copy_GBps']:.2f}x the HBM copy rate), "
            f"{last['GBps']:.0f} GB/s at {last['working_set_bytes'] / 2**20:.0f} MiB; the "
            f"smallest, {rows[0]['working_set_bytes'] / 2**10:.0f} KiB, takes "
            f"{rows[0]['median_ms'] * 1e3:.1f} us per copy ({_where(record)})")


def host_to_device(record):
    rows = [r for r in record["benchmarks"] if r["op"] == "host_to_device"]
    sizes = sorted({r["bytes"] for r in rows})
    parts = []
    for size in sizes:
        by = {r["variant"]: r for r in rows if r["bytes"] == size}
        parts.append(f"{size / 2**20:.0f} MiB: pageable {by['pageable']['GBps']:.1f} GB/s, "
                     f"pinned {by['pinned']['GBps']:.1f} GB/s")
    return "; ".join(parts) + f" ({_where(record)})"


def sweep(record):
    rows = {(r["shape"][0], r["variant"]): r for r in record["benchmarks"]
            if r["op"] == "transpose" and r["sweep"] and r["dtype"] == "float32"
            and r["shape"][0] == r["shape"][1]}
    sides = sorted({s for s, _ in rows})
    return ", ".join(f"{s}: {rows[(s, 'v4')]['GBps']:.0f} GB/s "
                     f"(PyTorch {rows[(s, 'torch')]['GBps']:.0f})" for s in sides)


def _prof(record, variant, dtype="float32"):
    profile = record.get("profile")
    if not profile:
        return None
    return next(r for r in profile["benchmarks"]
                if (r["op"], r["variant"], r["dtype"]) == ("transpose", variant, dtype))


def _no_profile(record):
    return "(no ncu profile recorded yet: run python profile_memory_ops.py on a GPU)"


def _profile_where(record):
    side = _prof(record, "v1")["shape"][0]
    return f"ncu, {side}^2, {_where(record['profile'])}"


def bank_conflicts(record):
    if _prof(record, "v2") is None:
        return _no_profile(record)
    parts = []
    for d in DTYPES:
        a, b = _prof(record, "v2", d), _prof(record, "v3", d)
        parts.append(f"{d} {a['smem_wavefronts_per_load']:.2f} -> "
                     f"{b['smem_wavefronts_per_load']:.2f}")
    return "; ".join(parts) + f" ({_profile_where(record)})"


def v4_wavefronts(record):
    if _prof(record, "v4") is None:
        return _no_profile(record)
    return ", ".join(f"{d} {_prof(record, 'v4', d)['smem_wavefronts_per_load']:.2f}"
                     for d in DTYPES)


def store_sectors(record):
    if _prof(record, "v1") is None:
        return _no_profile(record)
    return "; ".join(f"{d}: v1 {_prof(record, 'v1', d)['store_sectors_per_request']:.0f}, "
                     f"v2 {_prof(record, 'v2', d)['store_sectors_per_request']:.0f}, "
                     f"v4 {_prof(record, 'v4', d)['store_sectors_per_request']:.0f}"
                     for d in DTYPES) + f" ({_profile_where(record)})"


def strided_dram(record):
    profile = record.get("profile")
    if not profile:
        return _no_profile(record)
    rows = [r for r in profile["benchmarks"] if r["op"] == "strided_copy"]
    return ", ".join(f"stride {r['stride']}: {r['dram_read_bytes_per_kept_element']:.0f} B"
                     for r in rows) + f" (ncu, {_where(profile)})"


def _transposes(record):
    """{(dtype, shape, view, sweep): {variant: row}} of every transpose measurement."""
    out = {}
    for r in record["benchmarks"]:
        if r["op"] == "transpose":
            key = (r["dtype"], tuple(r["shape"]), r.get("view"), r["sweep"])
            out.setdefault(key, {})[r["variant"]] = r
    return out


def _pct(r):
    return f"{r['pct_of_copy']:.1f}%"


def v5_odd(record):
    shape = record["sizes"]["odd"]
    parts = []
    for d in ("float32", "bfloat16"):
        by = _transposes(record)[(d, tuple(shape), None, False)]
        parts.append(f"{d} v5 {by['v5']['GBps']:.0f} GB/s ({_pct(by['v5'])} of copy, "
                     f"{by['v5']['speedup_vs_torch']:.2f}x PyTorch), where v4 falls back to "
                     f"{_pct(by['v4'])}")
    return f"{'; '.join(parts)} ({shape[0]} x {shape[1]}, {_where(record)})"


def v5_sliced(record):
    side = record["sizes"]["square"]
    parts = []
    for d in ("float32", "bfloat16"):
        by = _transposes(record)[(d, (side, side - 1), "x[:, 1:]", False)]
        parts.append(f"{d} v5 {_pct(by['v5'])} of copy ({by['v5']['speedup_vs_torch']:.2f}x "
                     f"PyTorch), v4 {_pct(by['v4'])}")
    return "; ".join(parts)


def v5_aligned(record):
    side = record["sizes"]["square"]
    return "; ".join(
        f"{d} v5 {_pct(by['v5'])}, v4 {_pct(by['v4'])}"
        for d in ("float32", "bfloat16")
        for by in [_transposes(record)[(d, (side, side), None, False)]])


def odd_table(record):
    """Every odd shape and view measured: PyTorch, v3, v4, v5 and the default, % of copy."""
    lines = ["| shape | dtype | PyTorch | v3 | v4 | v5 | default (runs) |", "|---|---|---|---|---|---|---|"]
    for (d, shape, view, sweep), by in sorted(_transposes(record).items(), key=lambda kv: (
            kv[0][2] or "", kv[0][1], kv[0][0])):
        if not (view or shape[-1] % 8 or shape[-2] % 8):
            continue
        name = "x".join(map(str, shape)) + (f" ({view})" if view else "")
        lines.append(f"| {name} | {d} | {_pct(by['torch'])} | {_pct(by['v3'])} | {_pct(by['v4'])} "
                     f"| {_pct(by['v5'])} | {_pct(by['default'])} ({by['default']['dispatch']}) |")
    return "\n".join(lines) + f"\n\n(% of the copy ceiling; {_where(record)})"


def default_envelope(record):
    rungs = ("v1", "v2", "v3", "v4", "v5")
    worst = min((min(by[v]["median_ms"] for v in rungs) / by["default"]["median_ms"], key)
                for key, by in _transposes(record).items())
    d, shape, view, _ = worst[1]
    return (f"{worst[0]:.3f}x the fastest rung at its worst ({d} {'x'.join(map(str, shape))}"
            f"{' ' + view if view else ''}), over {len(_transposes(record))} measured transposes")


def transposed_view(record):
    side = record["sizes"]["square"]
    parts = []
    for d in ("float32", "bfloat16"):
        by = _transposes(record)[(d, (side, side), "x.t()", False)]
        best = max((by[v] for v in ("v1", "v2", "v3", "v4", "v5")), key=lambda r: r["GBps"])
        parts.append(f"{d}: the default ({by['default']['dispatch']}) {_pct(by['default'])} of "
                     f"copy, the best rung ({best['variant']}) {_pct(best)}")
    return "; ".join(parts)


def _alignment(record, dtype, variant, case):
    profile = record.get("profile")
    return next(r for r in profile["benchmarks"] if r["op"] == "transpose_alignment" and
                (r["dtype"], r["variant"], r["case"]) == (dtype, variant, case))


def v5_counters(record):
    profile = record.get("profile")
    if not profile or not any(r["op"] == "transpose_alignment" for r in profile["benchmarks"]):
        return _no_profile(record)
    parts = []
    for d in ("float32", "bfloat16"):
        v4, al, odd = (_alignment(record, d, "v4", "aligned"), _alignment(record, d, "v5", "aligned"),
                       _alignment(record, d, "v5", "odd"))
        parts.append(
            f"{d}: instructions per element v4 {v4['instructions_per_element']:.0f}, v5 "
            f"{al['instructions_per_element']:.0f} (aligned) and {odd['instructions_per_element']:.0f} "
            f"(odd); achieved occupancy v4 {v4['achieved_occupancy_pct']:.0f}%, v5 "
            f"{odd['achieved_occupancy_pct']:.0f}%; L2 reads over the minimum v4 "
            f"{v4['l2_read_bytes_over_minimum']:.2f}, v5 odd {odd['l2_read_bytes_over_minimum']:.2f}; "
            f"shared-memory wavefronts per load v5 aligned "
            f"{al['smem_load_wavefronts_per_instruction']:.2f}, odd "
            f"{odd['smem_load_wavefronts_per_instruction']:.2f}")
    side = _alignment(record, "float32", "v4", "aligned")["shape"][0]
    return (f"{'; '.join(parts)} (ncu at {side} x {side} and {side - 1} x {side + 1}, "
            f"{_where(profile)})")


FACTS = {name: fn for name, fn in list(globals().items())
         if callable(fn) and not name.startswith("_")}


# The shapes sweep (bench_*.py --shapes; coursekit/shapes.py): its own results file.
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from coursekit import shapes as _shapes  # noqa: E402


def _shapes_sweep(record):
    return _shapes.lesson_block("chapter2_memory")


FACTS["shapes_sweep"] = _shapes_sweep


def _thin_shapes(record):
    """The sweep's thin transposes (those version=None ran on the thin kernels: one swapped dim
    at most 64): version=None against eager PyTorch, with the copy ceiling's time for the same
    bytes."""
    sweep = _shapes.load("chapter2_memory")
    if sweep is None:
        return "not measured yet: run the chapter's benchmark with --shapes on a GPU"
    thin = {(r["dtype"], tuple(r["shape"])) for r in sweep["benchmarks"]
            if r["op"] == "transpose" and r["variant"] == "default" and r.get("dispatch") == "thin"}
    rows = [r for r in sweep["benchmarks"]
            if r["op"] == "transpose" and (r["dtype"], tuple(r["shape"])) in thin]
    torch_of = {(r["dtype"], tuple(r["shape"])): r for r in rows if r["variant"] == "torch"}
    copy_GBps = sweep["ceilings"]["copy_GBps"]
    lines = []
    for d in sorted((r for r in rows if r["variant"] == "default"),
                    key=lambda r: (r["dtype"], min(r["shape"][-2:]), r["shape"][-1])):
        t = torch_of.get((d["dtype"], tuple(d["shape"])))
        if t is None:
            continue
        lines.append(f"| {d['dtype']} | {_shapes.fmt_shape(d['shape'])} | {d['median_ms'] * 1e3:.1f} | "
                     f"{t['median_ms'] * 1e3:.1f} | {t['median_ms'] / d['median_ms']:.2f}x | "
                     f"{d['bytes'] / copy_GBps / 1e3:.1f} |")
    if not lines:
        return "no thin shape in the recorded sweep"
    return "\n".join(["| dtype | shape | thin us | PyTorch us | PyTorch / thin | copy ceiling us |",
                      "|---|---|---|---|---|---|", *lines, "", f"({_where(sweep)})"])


FACTS["thin_shapes"] = _thin_shapes
