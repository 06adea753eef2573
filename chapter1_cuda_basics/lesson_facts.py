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


def _against_torch(record, op, torch_name):
    """The best rung (v4) in both dtypes, against PyTorch's own op."""
    parts = []
    for dtype in ("float32", "bfloat16"):
        r = _row(record, "v4", op=op, dtype=dtype)
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


FACTS = {name: fn for name, fn in list(globals().items())
         if callable(fn) and not name.startswith("_")}
