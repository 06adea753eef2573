"""Measured numbers quoted in this chapter's README, computed from the results files.

tools/report.py fills each <!-- results:NAME:begin -->...<!-- results:NAME:end --> block of
README.md with FACTS[NAME](record), so the prose always matches results/ (no typed numbers).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from coursekit import results  # noqa: E402

BASELINES = ("torch", "torch.compile")


def _where(record):
    return f"{record['device']['name']}, {record['date'][:10]}"


def _pct(r):
    return f"{r['pct_of_copy']:.0f}%"


def ceilings(record):
    c = record["ceilings"]
    return (f"copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['mm_TFLOPs']:.0f} TFLOP/s "
            f"({_where(record)})")


def _key(r):
    """The measurement a table row shows: a row's key without `call`, so that "default
    (autograd)" and "torch (F.linear)" sit in the same table row as the variants they split."""
    return results.measurement_key({k: v for k, v in r.items() if k != "call"})


def _ladder_table(record, op, match, title):
    """One row per measurement (dtype, shape, pass, ...): every variant's % of copy, and
    version=None against torch and torch.compile."""
    groups = {}
    for r in results.rows(record, op=op, **match):
        groups.setdefault(_key(r), []).append(r)
    variants = list(dict.fromkeys(results.column(r) for rs in groups.values() for r in rs))
    lines = [f"**{title}** (% of copy)", "",
             "| dtype | shape | pass | " + " | ".join(variants) + " | default x torch | default x compile |",
             "|---|---|---|" + "---|" * (len(variants) + 2)]
    for rs in groups.values():
        by = {results.column(r): r for r in rs}
        first = rs[0]
        cells = [_pct(by[v]) if v in by else "-" for v in variants]
        d, c = by.get("default"), by.get("torch.compile")
        cells.append(f"{d['speedup_vs_torch']:.2f}" if d else "-")
        cells.append(f"{c['median_ms'] / d['median_ms']:.2f}" if d and c else "-")
        shape = results.format_shape(first["shape"])
        lines.append(f"| {first['dtype']} | {shape} | {first.get('pass', '')} | " + " | ".join(cells) + " |")
    dispatch = sorted({r["dispatch"] for rs in groups.values() for r in rs if r.get("dispatch")})
    lines.append("")
    lines.append(f"`default` is version=None (it ran {', '.join(dispatch) or '-'}); {_where(record)}.")
    return "\n".join(lines)


def bsr_table(record):
    return _ladder_table(record, "fused_bias_scale_relu", {"save": "mask", "sweep": False},
                         "fused_bias_scale_relu, save='mask'")


def bsr_save(record):
    parts = []
    for dtype in ("float32", "bfloat16"):
        for save in ("y", "x", "mask"):
            f = results.rows(record, op="fused_bias_scale_relu", dtype=dtype, save=save, variant="default", sweep=True)
            b = results.rows(record, op="fused_bias_scale_relu", dtype=dtype, save=save, variant="default",
                      **{"pass": "backward"})
            if f and b:
                parts.append(f"{dtype} save={save!r}: keeps {f[0]['saved_bytes'] / 2**20:.0f} MiB, forward "
                             f"{f[0]['median_ms'] * 1e3:.0f} us, backward {b[0]['median_ms'] * 1e3:.0f} us")
    return "; ".join(parts) + f" ({_where(record)})."


def activation_table(record):
    out = []
    for act in ("bias_gelu", "bias_gelu_tanh", "bias_silu"):
        op = "bias_gelu" if act.startswith("bias_gelu") else act
        out.append(_ladder_table(record, op, {"activation": act}, act))
    out.append(_ladder_table(record, "swiglu", {}, "swiglu"))
    return "\n\n".join(out)


def norm_table(record):
    return "\n\n".join(_ladder_table(record, op, {}, op)
                       for op in ("layer_norm", "rms_norm", "fused_add_rms_norm"))


def linear_table(record):
    lin = results.rows(record, op="linear_activation")
    variants = list(dict.fromkeys(results.column(r) for r in lin))
    ms = sorted({r["shape"][0] for r in lin})
    lines = ["| M | " + " | ".join(variants) + " | default x torch | default x compile |",
             "|---|" + "---|" * (len(variants) + 2)]
    for m in ms:
        by = {results.column(r): r for r in lin if r["shape"][0] == m}
        cells = [f"{by[v]['TFLOPs']:.0f}" if v in by else "-" for v in variants]
        d, c = by.get("default"), by.get("torch.compile")
        cells.append(f"{d['speedup_vs_torch']:.2f}" if d else "-")
        cells.append(f"{c['median_ms'] / d['median_ms']:.2f}" if d and c else "-")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    k, n = lin[0]["shape"][1], lin[0]["shape"][2]
    lines.append(f"\nTFLOP/s (2 M N K / time), K = {k}, N = {n}, bfloat16, GELU; {_where(record)}.")
    return "\n".join(lines)


ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def epilogue_cost(record):
    """At the largest M of the linear_activation sweep: the GEMM alone (torch.mm), what each of
    our epilogues adds to it, and one pass over the M x N output (a read and a write) at the copy
    rate measured in the same run, as a share of the GEMM."""
    lin = results.rows(record, op="linear_activation")
    m = max(r["shape"][0] for r in lin)
    by = {results.column(r): r for r in lin if r["shape"][0] == m}
    gemm = by["torch (torch.mm)"]
    _, _, n = gemm["shape"]
    out_bytes = m * n * ELEMENT_BYTES[gemm["dtype"]]
    pass_ms = 2 * out_bytes / (record["ceilings"]["copy_GBps"] * 1e9) * 1e3
    added = ", ".join(f"`{v}` {by[v]['median_ms'] / gemm['median_ms'] - 1:+.0%}"
                      for v in ("fused_epilogue", "unfused") if v in by)
    return (f"at M = {m}: `torch.mm` alone {gemm['median_ms']:.2f} ms; over it, {added}; one pass "
            f"over the {out_bytes / 2**20:.0f} MiB output at the copy rate {pass_ms * 1e3:.0f} us, "
            f"{pass_ms / gemm['median_ms']:.0%} of the GEMM ({_where(record)})")


def profile_table(record):
    """The ncu counters of profile_fusion.py: ours against Inductor's kernel for the activation
    forwards, and the norm backward's row kernel (+ its two column sums)."""
    profile = record.get("profile")
    if not profile:
        return "(no ncu profile recorded yet)"
    lines = ["| op | shape | variant | registers | occupancy | instructions / element | issue slots busy "
             "| XU (exp, rcp) busy | DRAM busy | us under ncu | + column sums us |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in profile["benchmarks"]:
        lines.append(f"| {r['op']} {r['pass']} | {results.format_shape(r['shape'])} | {r['variant']} | "
                     f"{r['registers']:.0f} | {r['achieved_occupancy_pct']:.0f}% | "
                     f"{r['instructions_per_element']:.1f} | {r['issue_busy_pct']:.0f}% | {r['xu_pipe_pct']:.0f}% | "
                     f"{r['dram_busy_pct']:.0f}% | {r['duration_ns'] / 1e3:.0f} | "
                     f"{r['other_kernels_ns'] / 1e3:.0f} |")
    lines.append(f"\nncu (`profile_fusion.py`), bfloat16, {profile['device']['name']}, {profile['date'][:10]}.")
    return "\n".join(lines)


TARGETS = [  # (op, match, floor % of copy or None, x torch, x compile): this chapter's targets
    ("fused_bias_scale_relu", {"pass": "forward", "save": "mask", "sweep": False}, 95, 3.0, 0.97),
    ("fused_bias_scale_relu", {"pass": "backward", "save": "mask"}, None, 2.0, 0.95),
    ("bias_gelu", {}, None, 2.0, 0.97),
    ("bias_silu", {}, None, 2.0, 0.97),
    ("swiglu", {}, None, 2.0, 0.97),
    ("layer_norm", {"pass": "forward"}, 90, 1.1, 1.1),
    ("rms_norm", {"pass": "forward"}, 90, 1.1, 1.1),
    ("layer_norm", {"pass": "backward"}, 80, 1.5, 1.5),
    ("rms_norm", {"pass": "backward"}, 80, 1.5, 1.5),
    ("fused_add_rms_norm", {}, 90, None, 1.0),
    # "within 3% of torch.compile": a time at most 1.03x compile's
    ("linear_activation", {}, None, 1.0, 1 / 1.03),
]


def target_misses(record):
    """Every measurement where version=None misses this chapter's target for its op."""
    misses, checked = [], 0
    for op, match, floor, vs_torch, vs_compile in TARGETS:
        for d in results.rows(record, op=op, variant="default", call=None, **match):
            same = [r for r in record["benchmarks"] if results.measurement_key(r) == results.measurement_key(d)]
            c = next((r for r in same if r["variant"] == "torch.compile"), None)
            why = []
            if floor is not None and d["pct_of_copy"] < floor:
                why.append(f"{_pct(d)} of copy (target {floor}%)")
            if vs_torch is not None and d["speedup_vs_torch"] < vs_torch:
                why.append(f"{d['speedup_vs_torch']:.2f}x torch (target {vs_torch})")
            if vs_compile is not None and c and c["median_ms"] / d["median_ms"] < vs_compile:
                why.append(f"{c['median_ms'] / d['median_ms']:.2f}x torch.compile (target {vs_compile:.3g})")
            checked += 1
            if why:
                tag = d.get("activation") or d.get("save") or ""
                misses.append(f"{op} {d.get('pass', '')} {d['dtype']} {results.format_shape(d['shape'])}"
                              f"{' ' + tag if tag else ''}: " + ", ".join(why))
    if not misses:
        return f"None of {checked} measurements misses its target ({_where(record)})."
    return (f"{len(misses)} of {checked} measurements: " + "; ".join(misses) + f" ({_where(record)}).")


def envelope(record):
    rungs = {r["variant"] for r in record["benchmarks"]} - {*BASELINES, "default", "cpu"}
    problems = results.default_gaps(record, rungs)
    if not problems:
        return "In the committed results it holds at every measured shape."
    return "Where it does not hold: " + "; ".join(problems) + "."


FACTS = {"ceilings": ceilings, "epilogue_cost": epilogue_cost, "bsr_table": bsr_table, "bsr_save": bsr_save,
         "activation_table": activation_table, "norm_table": norm_table,
         "linear_table": linear_table, "target_misses": target_misses, "envelope": envelope,
         "profile_table": profile_table}


# The shapes sweep (bench_*.py --shapes; coursekit/shapes.py): its own results file.
from coursekit import shapes as _shapes  # noqa: E402


def _shapes_sweep(record):
    return _shapes.lesson_block("chapter4_fusion")


FACTS["shapes_sweep"] = _shapes_sweep
