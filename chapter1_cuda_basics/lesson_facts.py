"""Measured numbers quoted in this chapter's README, computed from the results file.

tools/report.py fills each <!-- results:NAME:begin -->...<!-- results:NAME:end --> block of
README.md with FACTS[NAME](record), so the prose always matches results/ (no typed numbers).
"""


def _row(record, variant, op="vector_add", dtype="float32"):
    big = record["sizes"]["big"]
    for r in record["benchmarks"]:
        if (r["op"], r["dtype"], r["variant"], r["shape"], r.get("sweep"), r.get("view")) == (
                op, dtype, variant, [big], False, None):
            return r
    raise KeyError((op, dtype, variant))


def _bw(r):
    return f"{r['GBps']:.0f} GB/s ({r['pct_of_copy']:.1f}% of copy)"


def _where(record):
    return f"{record['device']['name']}, {record['date'][:10]}"


def ceiling(record):
    c = record["ceilings"]
    return f"{c['copy_GBps']:.0f} GB/s ({_where(record)})"


def uncoalesced(record):
    foil, v1 = _row(record, "uncoalesced"), _row(record, "v1")
    return (f"{_bw(foil)}, {foil['median_ms'] / v1['median_ms']:.1f}x slower than v1 "
            f"({foil['median_ms']:.2f} ms against {v1['median_ms']:.2f} ms)")


def v1(record):
    f32, b16 = _row(record, "v1"), _row(record, "v1", dtype="bfloat16")
    return f"{_bw(f32)} in float32 but only {_bw(b16)} in bfloat16"


def _step(record, before, after, pct=False):
    """GB/s of `before` -> `after` in both dtypes: what one rung of the ladder bought."""
    parts = []
    for dtype in ("float32", "bfloat16"):
        a, b = _row(record, before, dtype=dtype), _row(record, after, dtype=dtype)
        tail = f" ({b['pct_of_copy']:.1f}% of copy)" if pct else ""
        parts.append(f"{dtype} {a['GBps']:.0f} -> {b['GBps']:.0f} GB/s{tail}")
    return "; ".join(parts)


def _against_torch(record, op, torch_name, variant="v4"):
    """A rung (v4 unless named) in both dtypes, against PyTorch's own op."""
    parts = []
    for dtype in ("float32", "bfloat16"):
        r = _row(record, variant, op=op, dtype=dtype)
        parts.append(f"{dtype} {_bw(r)}, {r['speedup_vs_torch']:.3f}x {torch_name}")
    return "; ".join(parts)


def v2(record):
    return _step(record, "v1", "v2")


def v3(record):
    return _step(record, "v2", "v3", pct=True)


def v4(record):
    return _against_torch(record, "vector_add", "torch.add")


def torch_add(record):
    return _bw(_row(record, "torch"))


def relu(record):
    return _against_torch(record, "relu", "torch.relu")


def build(record):
    b = record["build"]
    return (f"cold {b['cold_s']:.1f} s, reload with nothing changed {b['cached_s']:.2f} s, "
            f"after touching the .cu {b['touched_cu_s']:.1f} s (ninja, MAX_JOBS={b['max_jobs']}, "
            f"TORCH_CUDA_ARCH_LIST={b['arch_list']}, {_where(record)})")


def _prof(record, variant, dtype="float32"):
    profile = record.get("profile")
    if not profile:
        return None
    return next(r for r in profile["benchmarks"]
                if (r["op"], r["variant"], r["dtype"]) == ("vector_add", variant, dtype))


def _no_profile(record):
    return "(no ncu profile recorded yet: run python profile_cuda_basics.py on a GPU)"


def sectors(record):
    if _prof(record, "v1") is None:
        return _no_profile(record)
    foil, v1 = _prof(record, "uncoalesced"), _prof(record, "v1")
    return (f"v1 fetches {v1['sectors_per_request']:.1f} sectors per warp-wide load and moves "
            f"{v1['dram_bytes_over_minimum']:.2f}x the minimum bytes through DRAM; the foil "
            f"fetches {foil['sectors_per_request']:.1f} sectors per load and moves "
            f"{foil['dram_bytes_over_minimum']:.2f}x the minimum (ncu, float32, 2^24 elements, "
            f"{_where(record['profile'])})")


def load_instructions(record):
    if _prof(record, "v1") is None:
        return _no_profile(record)
    parts = []
    for dtype in ("float32", "bfloat16"):
        a, b = _prof(record, "v1", dtype), _prof(record, "v3", dtype)
        parts.append(f"{dtype}: {a['load_instructions']:.0f} warp-level load instructions for "
                     f"v1, {b['load_instructions']:.0f} for v3 "
                     f"({a['load_instructions'] / b['load_instructions']:.1f}x fewer)")
    return "; ".join(parts)


def occupancy(record):
    if _prof(record, "v1") is None:
        return _no_profile(record)
    return ", ".join(f"{v} {_prof(record, v)['achieved_occupancy_pct']:.0f}%"
                     for v in ("v1", "v2", "v3", "v4"))


def _sweep(record, view=None):
    """{(dtype, n): {variant: row}} of the vector_add sweep, aligned (view None) or x[1:]."""
    out = {}
    for r in record["benchmarks"]:
        if r["op"] == "vector_add" and r.get("sweep") and r.get("view") == view:
            out.setdefault((r["dtype"], r["shape"][0]), {})[r["variant"]] = r
    return out


def _pow(n):
    return f"2^{n.bit_length() - 1}"


def _rungs(by):
    return [r for v, r in by.items() if v not in ("torch", "default")]


def sweep_bar(record):
    """This chapter's bar: at every sweep size, the best rung and the default against torch.add."""
    parts = []
    for dtype in ("float32", "bfloat16"):
        at = {n: by for (d, n), by in _sweep(record).items() if d == dtype}
        best = {n: max(r["speedup_vs_torch"] for r in _rungs(by)) for n, by in at.items()}
        default = {n: by["default"]["speedup_vs_torch"] for n, by in at.items()}
        nb, nd = min(best, key=best.get), min(default, key=default.get)
        parts.append(f"{dtype}: the best rung at least {best[nb]:.3f}x (at {_pow(nb)}), the default "
                     f"at least {default[nd]:.3f}x (at {_pow(nd)})")
    sizes = sorted({n for _, n in _sweep(record)})
    return (f"{'; '.join(parts)}, over every size from {_pow(sizes[0])} to {_pow(sizes[-1])} "
            f"({_where(record)})")


def v4_small(record):
    """v4 against torch.add at the smallest sweep size, both dtypes."""
    sweep = _sweep(record)
    n = min(n for _, n in sweep)
    return "; ".join(f"{d} {sweep[(d, n)]['v4']['speedup_vs_torch']:.2f}x" for d in ("float32", "bfloat16"))


def v5(record):
    return _against_torch(record, "vector_add", "torch.add", "v5")


def _tuning(record):
    tuning = record.get("tuning")
    if not tuning:
        return None
    table = {}
    for r in tuning["benchmarks"]:
        if "threads" in r:
            table.setdefault((r["dtype"], r["shape"][0]), {})[(r["threads"], r["vectors"])] = r["median_ms"]
    return tuning, table


def tuning(record):
    found = _tuning(record)
    if found is None:
        return "(no tuning results recorded yet: run python tune_cuda_basics.py on a GPU)"
    tuning, table = found
    parts = []
    for shape in ((256, 1), (256, 4)):
        worst = max(((by[shape] / min(by.values()), n, d) for (d, n), by in table.items()))
        parts.append(f"{shape[0]} x {shape[1]} at most {worst[0]:.2f}x the fastest shape "
                     f"(worst: {worst[2]} at {_pow(worst[1])})")
    sizes = sorted({n for _, n in table})
    return (f"{parts[0]}, where v4's {parts[1]}, over {len(next(iter(table.values())))} shapes x "
            f"{len(sizes)} sizes ({_pow(sizes[0])} to {_pow(sizes[-1])}) x 2 dtypes "
            f"({_where(tuning)})")


def torch_launch(record):
    profile = record.get("profile")
    rows = [] if not profile else [r for r in profile["benchmarks"] if r["op"] == "vector_add_launch"]
    if not rows:
        return _no_profile(record)
    n = min(r["shape"][0] for r in rows)
    at = {(r["dtype"], r["variant"]): r for r in rows if r["shape"][0] == n}
    parts = []
    for d in ("float32", "bfloat16"):
        t = at[(d, "torch")]
        vec = t["kernel"].split("vectorized_elementwise_kernel<")[1].split(",")[0]
        parts.append(f"{d}: torch.add {t['grid_blocks']:.0f} blocks of {t['block_threads']:.0f} "
                     f"threads, {t['elements_per_thread']:.0f} elements per thread (vector width "
                     f"{vec}), {t['registers_per_thread']:.0f} registers; v4 "
                     f"{at[(d, 'v4')]['grid_blocks']:.0f} blocks of "
                     f"{at[(d, 'v4')]['block_threads']:.0f}; v5 {at[(d, 'v5')]['grid_blocks']:.0f} "
                     f"blocks of {at[(d, 'v5')]['block_threads']:.0f}")
    return f"at {_pow(n)} elements, {'; '.join(parts)} (ncu, {_where(profile)})"


def misaligned(record):
    sweep = _sweep(record, view="x[1:]")
    big = max(n for _, n in sweep)
    parts = []
    for d in ("float32", "bfloat16"):
        by = sweep[(d, big)]
        parts.append(f"{d} {_pow(big)}: the default ({by['default']['dispatch']}, scalar form) "
                     f"{by['default']['speedup_vs_torch']:.2f}x torch.add, v2 "
                     f"{by['v2']['speedup_vs_torch']:.2f}x, v1 {by['v1']['speedup_vs_torch']:.2f}x")
    small = min(n for _, n in sweep)
    by = sweep[("bfloat16", small)]
    parts.append(f"bfloat16 {_pow(small)}: v1 {by['v1']['median_ms'] * 1e3:.2f} us against v5's "
                 f"scalar form {by['v5']['median_ms'] * 1e3:.2f} us")
    worst = min(((by["default"]["speedup_vs_torch"], n, d) for (d, n), by in sweep.items()))
    return "; ".join(parts) + (f". Lowest default against torch.add on x[1:]: {worst[0]:.2f}x "
                               f"({worst[2]} {_pow(worst[1])})")


def torch_header(_record):
    """What one #include <torch/extension.h> costs a .cu file's compile: chapter 5's build lab
    times the same kernel file with and without it (nvcc -c, one arch)."""
    from coursekit import results
    lab = results.load_recorded_gpu("chapter5_pytorch_extensions_build")
    by = {r["variant"]: r for r in lab["benchmarks"]} if lab else {}
    free, with_h = by.get("nvcc_cu_torch_free"), by.get("nvcc_cu_with_torch_h")
    if not (free and with_h and free.get("seconds") and with_h.get("seconds")):
        return "(not measured yet: chapter 5's build_lab.py on a GPU machine measures it)"
    return (f"{with_h['seconds']:.0f} s with the include against {free['seconds']:.1f} s without "
            f"({with_h['seconds'] / free['seconds']:.0f}x; nvcc -c, TORCH_CUDA_ARCH_LIST="
            f"{free['arch_list']}, chapter 5's build lab, {_where(lab)})")


FACTS = {name: fn for name, fn in list(globals().items())
         if callable(fn) and not name.startswith("_")}


# The shapes sweep (bench_*.py --shapes; coursekit/shapes.py): its own results file.
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from coursekit import shapes as _shapes  # noqa: E402


def _shapes_sweep(record):
    return _shapes.lesson_block("chapter1_cuda_basics")


FACTS["shapes_sweep"] = _shapes_sweep
