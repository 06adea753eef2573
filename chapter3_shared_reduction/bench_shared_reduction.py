"""Chapter 3 benchmark: reductions and softmax against the copy ceiling and PyTorch.

Napkin math. A reduction reads every element once and writes almost nothing, so its floor is
n * size / bandwidth; its bytes below are the bytes read, and "% of copy" compares them with
the copy ceiling (bytes read + written per second). A read-only kernel can exceed 100%: no
writes share the bus. Softmax reads and writes each element once (2 * n * size bytes, a copy's
traffic); its backward reads y and dy and writes dx (3 * n * size).

    python bench_shared_reduction.py           full run on a GPU (2^28-element problems)
    python bench_shared_reduction.py --quick   small sizes: CPU machines, smoke runs
    python bench_shared_reduction.py --shapes  only the shapes sweep (vocabularies, odd rows,
                                               narrow columns), against eager and torch.compile

Writes results/<device-slug>/chapter3_shared_reduction.json and the plots beside it.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from coursekit import bench, plots, results, shapes  # noqa: E402
from coursekit.results import subset  # noqa: E402  (the notebooks reach it as B.subset)

import shared_reduction as sr  # noqa: E402

CHAPTER = "chapter3_shared_reduction"
DTYPES = (torch.float32, torch.bfloat16)
SOFTMAX_OPS = {"softmax": (sr.softmax, torch.softmax, False),
               "log_softmax": (sr.log_softmax, torch.log_softmax, True)}


def sizes_for(device, quick):
    if device == "cuda" and not quick:
        return {"whole": 2**28, "matrix": 16384, "row_total": 2**26,
                "row_lengths": [1, 4, 16, 32, 64, 256, 1024, 2048, 4096, 16384, 65536, 2**20, 2**23],
                "column_shapes": [[2**26 // c, c] for c in (8, 64, 512, 4096, 32768)] + [[64, 2**20]],
                "softmax_total": 2**28, "softmax_lengths": [128, 1024, 4096, 16384, 65536, 262144],
                "atomic_elements": 2**24, "atomic_runs": 50}
    return {"whole": 2**20, "matrix": 512, "row_total": 2**16, "row_lengths": [1, 32, 1024, 2**14],
            "column_shapes": [[2**12, 16]], "softmax_total": 2**16, "softmax_lengths": [128, 4096],
            "atomic_elements": 2**16, "atomic_runs": 5}


def element_size(dtype):
    return torch.empty((), dtype=dtype).element_size()


def timer(device):
    if device == "cuda":
        return bench.time_cuda
    return bench.time_cpu


_compiled = {}


def compiled(key, fn):
    """torch.compile(fn) once per key (each shape compiles once); None if compilation fails
    here (no Triton, no compiler), so the benchmark goes on without the row."""
    if key not in _compiled:
        try:
            c = torch.compile(fn, dynamic=False)
            _compiled[key] = c
        except Exception as e:  # noqa: BLE001
            print(f"torch.compile unavailable for {key}: {e}")
            _compiled[key] = None
    return _compiled[key]


def measure(device, ceiling, op, dtype, shape, nbytes, variants, extra, max_ms=None):
    """Rows for every (variant name, callable) at one shape; the first variant is torch."""
    time = timer(device)
    rows, t_torch = [], None
    for variant, fn, more in variants:
        if fn is None:
            continue
        try:
            if max_ms is not None and device == "cuda":
                # One call first: skip rungs that would take too long at extreme shapes.
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                fn()
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                if start.elapsed_time(end) > max_ms:
                    print(f"  skipped {op} {variant} at {shape}: {start.elapsed_time(end):.0f} ms per call")
                    continue
            t = time(fn)
        except Exception as e:  # noqa: BLE001  (a torch.compile failure at its first call)
            print(f"  {op} {variant} at {shape} failed: {str(e).splitlines()[0][:200]}")
            continue
        t_torch = t_torch or t["median_ms"]
        rows.append(bench.bandwidth_row(op, variant, dtype, shape, nbytes, t, ceiling, t_torch, **extra, **more))
    return rows


def reduce_variants(device, op, x, dim, ladder, with_compile=False):
    """torch, torch.compile (only where asked: every shape costs a compilation), every rung of
    the ladder, and version=None."""
    torch_fn = getattr(torch, op)
    ours = getattr(sr, op)
    ref = (lambda: torch_fn(x)) if dim is None else (lambda: torch_fn(x, dim))
    out = [("torch", ref, {})]
    if device == "cuda":
        if with_compile:
            c = compiled((op, dim, tuple(x.shape), x.dtype),
                         (lambda t: torch_fn(t)) if dim is None else (lambda t: torch_fn(t, dim)))
            out.append(("torch.compile", (lambda: c(x)) if c else None, {}))
        out += [(v, (lambda v=v: ours(x, dim, version=v)), {}) for v in sr.LADDERS[ladder]]
        out.append(("default", lambda: ours(x, dim), {"dispatch": sr.default_choice(op, x, dim)}))
    else:
        out.append(("cpu", lambda: ours(x, dim), {}))
    return out


def bench_reductions(device, ceiling, s):
    rows = []
    for dtype in DTYPES:
        x = torch.randn(s["whole"], device=device, dtype=dtype)
        nbytes = x.numel() * element_size(dtype)
        variants = reduce_variants(device, "sum", x, None, "whole", with_compile=True)
        if device == "cuda" and dtype == torch.float32:
            variants.append(("atomic", lambda: sr.atomic_sum(x), {}))
        rows += measure(device, ceiling, "sum", dtype, [s["whole"]], nbytes, variants,
                        {"dim": None, "pass": "forward", "sweep": False})
        if dtype == torch.float32:
            variants = [v for v in reduce_variants(device, "amax", x, None, "whole")
                        if v[0] in ("torch", "v8", "v9", "v10", "default", "cpu")]
            rows += measure(device, ceiling, "amax", dtype, [s["whole"]], nbytes, variants,
                            {"dim": None, "pass": "forward", "sweep": False})
        del x
        side = s["matrix"]
        x = torch.randn(side, side, device=device, dtype=dtype)
        for dim, ladder in ((-1, "rows"), (0, "columns")):
            rows += measure(device, ceiling, "sum", dtype, [side, side], x.numel() * element_size(dtype),
                            reduce_variants(device, "sum", x, dim, ladder),
                            {"dim": dim, "pass": "forward", "sweep": False})
        del x
        if device == "cuda":
            torch.cuda.empty_cache()
    # Sweeps (float32): the row length, then column shapes.
    for n in s["row_lengths"]:
        x = torch.randn(s["row_total"] // n, n, device=device)
        rows += measure(device, ceiling, "sum", torch.float32, list(x.shape), x.numel() * 4,
                        reduce_variants(device, "sum", x, -1, "rows"),
                        {"dim": -1, "pass": "forward", "sweep": True}, max_ms=50)
    for shape in s["column_shapes"]:
        x = torch.randn(shape, device=device)
        rows += measure(device, ceiling, "sum", torch.float32, shape, x.numel() * 4,
                        reduce_variants(device, "sum", x, 0, "columns"),
                        {"dim": 0, "pass": "forward", "sweep": True}, max_ms=50)
    return rows


def bench_softmax(device, ceiling, s):
    rows = []
    for dtype in DTYPES:
        for n in s["softmax_lengths"]:
            x = torch.randn(s["softmax_total"] // n, n, device=device, dtype=dtype)
            shape, size = list(x.shape), element_size(dtype)
            extra = {"dim": -1, "sweep": True}
            for op, (ours, ref, log) in SOFTMAX_OPS.items():
                variants = [("torch", lambda ref=ref: ref(x, -1), {})]
                if device == "cuda":
                    c = compiled((op, tuple(shape), dtype), lambda t, ref=ref: ref(t, -1))
                    variants.append(("torch.compile", (lambda c=c: c(x)) if c else None, {}))
                    variants += [(v, (lambda v=v, ours=ours: ours(x, version=v)), {}) for v in sr.VERSIONS[op]]
                    variants.append(("default", lambda ours=ours: ours(x), {"dispatch": sr.default_choice(op, x)}))
                else:
                    variants.append(("cpu", lambda ours=ours: ours(x), {}))
                rows += measure(device, ceiling, op, dtype, shape, 2 * x.numel() * size, variants,
                                {**extra, "pass": "forward"})
                # Backward: the op's output and a random upstream gradient.
                y = ref(x, -1)
                dy = torch.randn_like(y)
                if log:
                    torch_bwd = lambda: torch._log_softmax_backward_data(dy, y, -1, y.dtype)  # noqa: E731
                    formula = lambda g, t: g - torch.exp(t) * g.sum(-1, keepdim=True)  # noqa: E731
                else:
                    torch_bwd = lambda: torch._softmax_backward_data(dy, y, -1, y.dtype)  # noqa: E731
                    formula = lambda g, t: t * (g - (g * t).sum(-1, keepdim=True))  # noqa: E731
                variants = [("torch", torch_bwd, {})]
                if device == "cuda":
                    c = compiled((op, "backward", tuple(shape), dtype), formula)
                    variants.append(("torch.compile", (lambda c=c: c(dy, y)) if c else None, {}))
                    variants.append(("default", lambda log=log: sr.softmax_backward(dy, y, -1, log),
                                     {"dispatch": sr.default_choice("softmax_backward", y, -1)}))
                else:
                    variants.append(("cpu", lambda log=log: sr.softmax_backward(dy, y, -1, log), {}))
                rows += measure(device, ceiling, op, dtype, shape, 3 * x.numel() * size, variants,
                                {**extra, "pass": "backward"})
                del y, dy
            del x
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def atomic_demo(device, s):
    """The same float32 tensor summed again and again: atomics against the deterministic sum."""
    x = torch.randn(s["atomic_elements"], device=device)
    runs = s["atomic_runs"]
    atomic = [sr.atomic_sum(x).item() for _ in range(runs)]
    ours = [sr.sum(x).item() for _ in range(runs)]
    count = lambda vals: {v.hex(): vals.count(v) for v in sorted(set(vals))}  # noqa: E731
    demo = {"elements": x.numel(), "runs": runs, "reference_float64": x.double().sum().item(),
            "atomic_values": count(atomic), "sum_values": count(ours),
            "atomic_max_abs_diff": max(atomic) - min(atomic)}
    print(f"atomics demo: {runs} runs of atomic_sum over {x.numel()} float32 gave "
          f"{len(demo['atomic_values'])} distinct results (spread {demo['atomic_max_abs_diff']:.3g}); "
          f"sum gave {len(demo['sum_values'])}")
    return demo


# ---------------------------------------------------------------------------------------------
# The shapes sweep (coursekit/shapes.py): softmax and log_softmax over the row lengths models
# have (vocabularies, lengths one past a power of two, odd and prime lengths) at 2^26 elements
# and at 64, 8 and 1 rows, forward and backward; sum and amax over a last dim, a first dim and a
# middle dim, the narrow columns (3, 7, 64) of a tall tensor among them.
# ---------------------------------------------------------------------------------------------
REDUCE_SHAPES = [  # (shape, dim)
    ((1000003, 3), 0), ((1000003, 7), 0), ((2**20, 64), 0), ((8191, 4099), 0), ((16384, 4096), 0),
    ((100003, 16, 3), 1), ((64, 1000, 7), 1), ((8, 2048, 4096), 1),
    ((4096, 4099), -1), ((86367, 777), -1), ((2048, 50257), -1), ((2**26 + 3,), None),
]
QUICK_REDUCE_SHAPES = [((1003, 3), 0), ((33, 777), -1)]


def shape_cases(device, quick):
    cases = []
    for dtype in shapes.dtypes(quick):
        size = element_size(dtype)
        for shape, dim in (QUICK_REDUCE_SHAPES if quick else REDUCE_SHAPES):
            numel = 1
            for d in shape:
                numel *= d
            meta = torch.empty(shape, dtype=dtype, device="meta")
            outputs = 1 if dim is None else numel // shape[dim]
            for op, eager in (("sum", torch.sum), ("amax", torch.amax)):
                def make(shape=shape, dtype=dtype):
                    return (torch.randn(shape, dtype=dtype, device=device),)

                def ours(x, op=op, dim=dim):
                    return getattr(sr, op)(x, dim)

                def theirs(x, eager=eager, dim=dim):
                    return eager(x) if dim is None else eager(x, dim)
                cases.append(shapes.Case(op, dtype, shape, (numel + outputs) * size, make, ours, theirs,
                                         dispatch=sr.default_choice(op, meta, dim), dynamic=(), dim=dim))
        for rows, n in shapes.row_shapes(quick):
            meta = torch.empty(rows, n, dtype=dtype, device="meta")
            for op, (ours, eager, _) in SOFTMAX_OPS.items():
                def make(rows=rows, n=n, dtype=dtype):
                    return (torch.randn(rows, n, dtype=dtype, device=device),)

                def theirs(x, eager=eager):
                    return eager(x, -1)
                cases.append(shapes.Case(op, dtype, (rows, n), 2 * rows * n * size, make, ours, theirs,
                                         dispatch=sr.default_choice(op, meta, -1)))
                cases.append(shapes.Case(op, dtype, (rows, n), 3 * rows * n * size, make, ours, theirs,
                                         backward=True, grads=(0,),
                                         dispatch=sr.default_choice("softmax_backward", meta, -1)))
    return cases


def shapes_figures(record, out_dir):
    fig, axes = plt.subplots(2, 3, figsize=(21, 9))
    panels = [("softmax", "forward"), ("softmax", "backward"), ("log_softmax", "forward"),
              ("log_softmax", "backward"), ("sum", "forward"), ("amax", "forward")]
    for ax, (op, p) in zip(axes.flat, panels):
        x = (lambda r: r["shape"][-1]) if op.endswith("softmax") else (lambda r: max(r["shape"]) // min(r["shape"]))
        shapes.plot(ax, record, op, p, x=x,
                    xlabel="row length" if op.endswith("softmax") else "longest dim / shortest dim")
    return [plots.save(fig, out_dir / f"{CHAPTER}_shapes.png")]


def make_figures(record, out_dir):
    s = record["sizes"]
    figures = []
    fig, axes = plt.subplots(1, 4, figsize=(24, 4.8))
    for ax, dtype in zip(axes[:2], ("float32", "bfloat16")):
        plots.plot_bars(ax, subset(record, dim=None), "sum", dtype, [s["whole"]],
                        title=f"sum(x), {dtype}, 2^{s['whole'].bit_length() - 1}: Harris's ladder and after\n"
                              f"{results.label(record)}")
    side = s["matrix"]
    plots.plot_bars(axes[2], subset(record, dim=-1), "sum", "float32", [side, side],
                    title=f"sum(x, -1), float32 {side}^2\n{results.label(record)}")
    plots.plot_bars(axes[3], subset(record, dim=0), "sum", "float32", [side, side],
                    title=f"sum(x, 0), float32 {side}^2\n{results.label(record)}")
    figures.append(plots.save(fig, out_dir / f"{CHAPTER}_ladder.png"))

    fig, axes = plt.subplots(2, 4, figsize=(24, 9))
    panels = [(op, dtype, p) for op in SOFTMAX_OPS for p in ("forward", "backward") for dtype in ("float32", "bfloat16")]
    for ax, (op, dtype, p) in zip(axes.flat, panels):
        plots.plot_sweep(ax, subset(record, **{"pass": p}), op, dtype, x=lambda r: r["shape"][1],
                         xlabel="row length (2^28 elements in all)",
                         title=f"{op} {p}, {dtype}: {results.label(record)}")
    figures.append(plots.save(fig, out_dir / f"{CHAPTER}_softmax.png"))

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    plots.plot_sweep(axes[0], subset(record, dim=-1), "sum", "float32", x=lambda r: r["shape"][1],
                     xlabel="row length", title=f"sum(x, -1) float32, rows of n: {results.label(record)}")
    plots.plot_sweep(axes[1], subset(record, dim=0), "sum", "float32", x=lambda r: r["shape"][1],
                     xlabel="columns (inner)", title=f"sum(x, 0) float32: {results.label(record)}")
    axes[0].set_ylabel("GB/s (bytes read)")
    axes[1].set_ylabel("GB/s (bytes read)")
    figures.append(plots.save(fig, out_dir / f"{CHAPTER}_rows.png"))
    return figures + plots.cpu_vs_recorded(record, out_dir, CHAPTER, plot_comparison)


def plot_comparison(ax, record):
    """The panel a CPU run is drawn beside the recorded GPU run with: sum(x) of the whole
    tensor, float32."""
    plots.plot_bars(ax, subset(record, dim=None), "sum", "float32", [record["sizes"]["whole"]])


def print_table(record):
    print(f"\n{CHAPTER} on {results.label(record)}; copy ceiling {record['ceilings']['copy_GBps']:.0f} GB/s")
    print(f"{'op':<6}{'dtype':<10}{'shape':<14}{'dim':<6}{'variant':<16}{'ms':>9}{'GB/s':>8}{'% copy':>8}{'x torch':>9}")
    for r in record["benchmarks"]:
        if not r["sweep"]:
            print(f"{r['op']:<6}{r['dtype']:<10}{results.format_shape(r['shape']):<14}{str(r['dim']):<6}"
                  f"{r['variant']:<16}{r['median_ms']:>9.3f}{r['GBps']:>8.0f}{r['pct_of_copy']:>8.1f}"
                  f"{r['speedup_vs_torch']:>9.3f}  {r.get('dispatch', '')}")
    print("softmax sweep: default's % of copy, x torch, x torch.compile")
    for r in record["benchmarks"]:
        if r["op"] in SOFTMAX_OPS and r["variant"] == "default":
            c = next((q for q in record["benchmarks"] if q["variant"] == "torch.compile"
                      and results.measurement_key(q) == results.measurement_key(r)), None)
            vs_compile = f"{c['median_ms'] / r['median_ms']:.2f}" if c else "-"
            print(f"  {r['op']:<12}{r['pass']:<9}{r['dtype']:<9}{r['shape'][1]:>7}  {r['pct_of_copy']:5.1f}%  "
                  f"{r['speedup_vs_torch']:.2f}x  {vs_compile}x  ({r['dispatch']})")


def main():
    device, quick, args = shapes.start(__doc__)
    if args.shapes:
        shapes.main(CHAPTER, shape_cases, __file__, shapes_figures, quick, args.ops, args.dtypes)
        return
    torch._dynamo.config.cache_size_limit = 256
    s = sizes_for(device, quick)
    ceilings = bench.copy_ceiling(device, n=s["whole"])
    ceiling = ceilings["copy_GBps"]
    rows = bench_reductions(device, ceiling, s) + bench_softmax(device, ceiling, s)
    extra = {"sizes": s, "headline_op": "softmax", "atomic_demo": atomic_demo(device, s),
             "timing": {"statistic": "median", "reps": bench.MIN_REPS if device == "cpu" else 30,
                        "method": "perf_counter" if device == "cpu" else
                        "CUDA events, eager back-to-back launches; every problem far above the L2 "
                        "(2^26-2^28 elements)"}}
    results.publish(CHAPTER, rows, ceilings, extra, make_figures, print_table)
    if not args.no_shapes:
        shapes.main(CHAPTER, shape_cases, __file__, shapes_figures, quick, args.ops, args.dtypes)


if __name__ == "__main__":
    main()
