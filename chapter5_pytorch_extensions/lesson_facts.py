"""Measured numbers quoted in this chapter's README, computed from the results files.

tools/report.py fills each <!-- results:NAME:begin -->...<!-- results:NAME:end --> block of
README.md with FACTS[NAME](record), so the prose always matches results/ (no typed numbers).
record is the newest GPU record of bench_extensions.py, with the build lab's record
(labs/build_lab.py) under record["build_lab"] and the GPU pass's labs/package_check.py findings
under record["packaging"].
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from coursekit import results  # noqa: E402

ROUTES = ("pybind11", "torch_library", "custom_op")


def _where(record):
    return f"{record['device']['name']}, {record['date'][:10]}"


BINDING_CELLS = {
    "compile_fullgraph": "`torch.compile(fullgraph=True)`",
    "graph_breaks": "graph breaks (`torch._dynamo.explain`, work before and after the op)",
    "opcheck": "`torch.library.opcheck`",
    "meta": "meta tensors ([3, 7, 40] in)",
    "fake": "fake tensors (`FakeTensorMode`)",
    "cuda_graph": "CUDA graph capture",
    "export": "`torch.export`",
}


def bindings_table(record):
    """What each route did under PyTorch's tools, as the benchmark recorded it."""
    table = record["bindings"]
    routes = list(table)
    lines = ["| | " + " | ".join(routes) + " |", "|---|" + "---|" * len(routes)]
    for key, name in BINDING_CELLS.items():
        cells = [str(table[r].get(key, "-")).replace("|", "/") for r in routes]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Recorded by `bench_extensions.py` on {_where(record)}, torch {record['torch']}."]
    return "\n".join(lines)


def fused_table(record):
    """fused_op at the benchmark's size: every route against eager and torch.compile."""
    rows = results.rows(record, op="fused_op")
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    lines = ["| dtype | pass | " + " | ".join(variants) + " | torch_library x torch | x compile |",
             "|---|---|" + "---|" * (len(variants) + 2)]
    groups = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["pass"]), {})[r["variant"]] = r
    for (dtype, pass_), by in groups.items():
        cells = [f"{by[v]['median_ms'] * 1e3:.0f} us ({by[v]['pct_of_copy']:.0f}%)" if v in by else "-"
                 for v in variants]
        ours, compiled = by.get("torch_library"), by.get("torch.compile")
        cells.append(f"{ours['speedup_vs_torch']:.2f}" if ours else "-")
        cells.append(f"{compiled['median_ms'] / ours['median_ms']:.2f}" if ours and compiled else "-")
        lines.append(f"| {dtype} | {pass_} | " + " | ".join(cells) + " |")
    shape = results.format_shape(rows[0]["shape"])
    lines += ["", f"{shape} elements; time per call and % of the copy bandwidth "
              f"({record['ceilings']['copy_GBps']:.0f} GB/s) measured in the same run; {_where(record)}."]
    return "\n".join(lines)


def overhead_table(record):
    """Host microseconds per call, per route, at 1 and 2^20 elements, with and without grad."""
    rows = results.rows(record, op="call_overhead")
    columns = list(dict.fromkeys(results.column(r) for r in rows))
    lines = ["| elements | inputs require grad | " + " | ".join(columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    groups = {}
    for r in rows:
        groups.setdefault((r["numel"], r["grad"]), {})[results.column(r)] = r
    for (numel, grad), by in groups.items():
        cells = []
        for c in columns:
            r = by.get(c)
            if r is None:
                cells.append("-")
                continue
            over = f" ({r['us_over_native']:+.1f})" if r["variant"] != "torch" else ""
            gpu = f", GPU {r['gpu_us_per_call']:.1f}" if "gpu_us_per_call" in r else ""
            cells.append(f"{r['us_per_call']:.1f}{over}{gpu}")
        lines.append(f"| {results.format_shape([numel])} | {'yes' if grad else 'no'} | " + " | ".join(cells) + " |")
    calls = sorted({r["calls"] for r in rows})
    paired = "variants in turn" in rows[0].get("timer", "")
    lines += ["", f"Host microseconds per call (median of {rows[0]['reps']} runs of "
              f"{'/'.join(map(str, calls))} calls and one synchronize"
              f"{', the variants taking turns within each run' if paired else ''}); in brackets, over "
              f"`torch.add(x, bias, alpha=scale)`{' (the median of the per-run differences)' if paired else ''}; "
              f"GPU: the same call's GPU time per call on a "
              f"CUDA graph. Host CPU: {record.get('host_cpu', 'not recorded')}; {_where(record)}."]
    return "\n".join(lines)


def overhead_sentence(record):
    """The target's two numbers: the C++ routes' extra microseconds at 1 element, no grad."""
    by = {r["variant"]: r for r in results.rows(record, op="call_overhead", grad=False)
          if r["numel"] == 1 and r["variant"] in ROUTES}
    return ", ".join(f"{v} {by[v]['us_over_native']:+.1f} us" for v in ROUTES if v in by) + \
        f" over `torch.add` per call ({_where(record)})"


def _method(name):
    """A timing method's name in the table: every time.time() variant is the naive loop."""
    return "time.time (naive loop)" if name.startswith("time.time") else name


def timing_table(record):
    """The naive time.time() loop against the harness, for eager and the fused op."""
    rows = results.rows(record, op="timing")
    lines = ["| size | method | eager ms | fused op ms | speedup |", "|---|---|---|---|---|"]
    for r in (r for r in rows if r["variant"] == "torch_library"):
        t = next(q for q in rows if q["variant"] == "torch" and q["method"] == r["method"]
                 and q["shape"] == r["shape"])
        spread = ""
        if "runs_ms" in r:
            spread = (f" ({len(r['runs_ms'])} runs: {min(t['runs_ms']):.3f}-{max(t['runs_ms']):.3f} and "
                      f"{min(r['runs_ms']):.3f}-{max(r['runs_ms']):.3f})")
        lines.append(f"| {results.format_shape(r['shape'])} | {_method(r['method'])}{spread} | "
                     f"{t['median_ms']:.4f} | {r['median_ms']:.4f} | {r['speedup_vs_torch']:.2f}x |")
    lines += ["", f"float32; {_where(record)}."]
    return "\n".join(lines)


def build_table(record):
    """Every build-lab configuration: seconds, against this chapter's target and the commonly quoted claim."""
    lab = record.get("build_lab")
    if not lab:
        return "(no build-lab results recorded yet: run labs/build_lab.py on the GPU machine)"
    lines = ["| configuration | route | seconds | target | claimed | slowest step | status |",
             "|---|---|---|---|---|---|---|"]
    for r in lab["benchmarks"]:
        seconds = f"{r['seconds']:.2f}" if r.get("seconds") is not None else "-"
        target = f"<= {r['target_s']:g}" if r.get("target_s") is not None else ""
        claim = f"{r['claim_s']:g}" if r.get("claim_s") is not None else ""
        steps = r.get("steps") or {}
        slowest = max(steps, key=steps.get) if steps else None
        slowest = f"`{slowest}` {steps[slowest]:.1f} s" if slowest else ""
        status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        if r.get("seconds") is not None and r.get("target_s") is not None and r["seconds"] > r["target_s"]:
            status += ", over the target"
        lines.append(f"| {r['variant']} | {r.get('route', '')} | {seconds} | {target} | {claim} | {slowest} | {status} |")
    lines += ["", f"{lab['device']['name']}, {lab['date'][:10]}, {lab['benchmarks'][0].get('cores', '?')} "
              f"cores, torch {lab['torch']}."]
    return "\n".join(lines)


def packaging_table(record):
    """What each wheel carries (cuobjdump) and whether it ran from PTX alone, from the GPU
    pass's labs/package_check.py findings."""
    found = record.get("packaging")
    if not found or not found.get("archs"):
        return "_(no CUDA wheel inspected yet: the GPU pass runs labs/package_check.py)_"
    sizes = {"default": (found.get("wheel") or {}).get("bytes"), "arch_list": found.get("arch_wheel_bytes")}
    lines = ["| build | TORCH_CUDA_ARCH_LIST | SASS | PTX | wheel | under CUDA_FORCE_PTX_JIT=1 |",
             "|---|---|---|---|---|---|"]
    for label, archs in found["archs"].items():
        jit = (found.get("ptx_jit") or {}).get(label)
        ran = "-" if jit is None else ("ran" if jit["ran"] else f"failed ({jit['error']})")
        size = f"{sizes[label] / 1e6:.1f} MB" if sizes.get(label) else "-"
        lines.append(f"| {label} | `{archs['TORCH_CUDA_ARCH_LIST']}` | {', '.join(archs['sass']) or 'none'} | "
                     f"{', '.join(archs['ptx']) or 'none'} | {size} | {ran} |")
    torch_ = found["torch"]
    lines += ["", f"{torch_.get('device')}, torch {torch_['version']}, {found['date'][:10]}."]
    return "\n".join(lines)


FACTS = {"bindings_table": bindings_table, "fused_table": fused_table, "overhead_table": overhead_table,
         "overhead_sentence": overhead_sentence, "timing_table": timing_table,
         "build_table": build_table, "packaging_table": packaging_table}


# The shapes sweep (bench_*.py --shapes; coursekit/shapes.py): its own results file.
from coursekit import shapes as _shapes  # noqa: E402


def _shapes_sweep(record):
    return _shapes.lesson_block("chapter5_pytorch_extensions")


FACTS["shapes_sweep"] = _shapes_sweep
