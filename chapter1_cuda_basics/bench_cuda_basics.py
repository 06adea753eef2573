"""Chapter 1 benchmark: every rung of the ladder against PyTorch and the copy ceiling.

Napkin math: vector_add and saxpy read two arrays and write one (3 * n * element size bytes),
relu reads one and writes one (2 * n * element size); no arithmetic worth counting, so the
ceiling is memory bandwidth, measured here as a device-to-device copy in the same run.

    python bench_cuda_basics.py                  full run (2^28 elements on a GPU)
    python bench_cuda_basics.py --quick          small sizes: CPU machines, smoke runs
    python bench_cuda_basics.py --no-build-times skip the cold/cached/touched JIT builds
    python bench_cuda_basics.py --shapes         only the shapes sweep (tokens x hidden sizes)

Writes results/<device-slug>/chapter1_cuda_basics.json and the plots beside it; on a CPU-only
machine also a figure with the recorded GPU results next to the CPU measurement.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from coursekit import bench, plots, results, shapes  # noqa: E402

import cuda_basics  # noqa: E402

CHAPTER = "chapter1_cuda_basics"
OPS = ("vector_add", "saxpy", "relu")
SAXPY_ALPHA = 1.75


def make_args(op, n, dtype, device):
    x = torch.randn(n, dtype=dtype, device=device)
    if op == "relu":
        return (x,)
    y = torch.randn(n, dtype=dtype, device=device)
    return (SAXPY_ALPHA, x, y) if op == "saxpy" else (x, y)


def torch_baseline(op, args):
    if op == "vector_add":
        return torch.add(*args)
    if op == "saxpy":
        alpha, x, y = args
        return torch.add(y, x, alpha=alpha)  # one fused kernel: y + alpha * x
    return torch.relu(*args)


def bytes_moved(op, n, dtype):
    arrays = 2 if op == "relu" else 3  # inputs read once + the output written once
    return arrays * n * torch.empty((), dtype=dtype).element_size()


# x[1:] of each input: contiguous, but 2 to 8 bytes past a 16-byte boundary, so no rung can
# use 16-byte accesses (v5 runs its scalar form there).
MISALIGNED_VIEW = "x[1:]"


def bench_op(op, dtype, n, device, variants, ceiling, sweep=False, view=None):
    """Rows for torch and every variant ("default" is version=None, recorded with the rung it
    dispatched to). sweep=True (any size): CUDA-graph replays over rotating input sets, and
    torch timed both before and after the rungs (its row keeps the faster: the first
    measurement of a run once came out 20% faster than the same one repeated, see NOTES.md);
    otherwise eager back-to-back launches on one input set, right for the 2^28 rows (32-64x the
    L2, ~0.4-1 ms per call)."""
    nbytes = bytes_moved(op, n, dtype)
    take = (lambda t: t[1:]) if view == MISALIGNED_VIEW else (lambda t: t)
    alloc = n + 1 if view == MISALIGNED_VIEW else n

    def make():
        return tuple(take(x) if torch.is_tensor(x) else x for x in make_args(op, alloc, dtype, device))

    if device == "cuda" and sweep:
        inputs = 1 if op == "relu" else 2
        sets = bench.rotation_sets(inputs * n * torch.empty((), dtype=dtype).element_size())
        arg_sets = [make() for _ in range(sets)]

        def timed(fn):
            return bench.time_cuda_graph(lambda i: fn(arg_sets[i]), sets)
    else:
        args = make()

        def timed(fn):
            return bench.time_fn(lambda: fn(args), device)

    extra = {"pass": "forward", "sweep": sweep, **({"view": view} if view else {})}
    t_torch = timed(lambda a: torch_baseline(op, a))
    fn = getattr(cuda_basics, op)
    timings = {}
    for variant in variants:
        version = None if variant in ("cpu", "default") else variant
        timings[variant] = timed(lambda a: fn(*a, version=version))
    if device == "cuda" and sweep:
        again = timed(lambda a: torch_baseline(op, a))
        if again["median_ms"] < t_torch["median_ms"]:
            t_torch, again = again, t_torch
        extra_torch = {"other_median_ms": again["median_ms"]}
    else:
        extra_torch = {}
    out = [bench.bandwidth_row(op, "torch", dtype, [n], nbytes, t_torch, ceiling,
                               t_torch["median_ms"], **extra, **extra_torch)]
    for variant, timing in timings.items():
        dispatch = {}
        if variant == "default" and device == "cuda":
            dispatch = {"dispatch": cuda_basics.default_choice(
                n, dtype, aligned=view != MISALIGNED_VIEW)[0]}
        out.append(bench.bandwidth_row(op, variant, dtype, [n], nbytes, timing, ceiling,
                                       t_torch["median_ms"], **extra, **dispatch))
    return out


# ---------------------------------------------------------------------------------------------
# The shapes sweep (coursekit/shapes.py): vector_add and relu at tokens x hidden sizes of real
# models, odd hidden sizes included, against eager and torch.compile. The kernels see a flat
# array, so a shape matters here only through its element count and its tail (n % 8 elements
# past the last 16-byte vector).
# ---------------------------------------------------------------------------------------------
def shape_cases(device, quick):
    cases = []
    for dtype in shapes.dtypes(quick):
        size = torch.empty((), dtype=dtype).element_size()
        for tokens, hidden in shapes.token_shapes(quick):
            n = tokens * hidden
            shape = (tokens, hidden)
            dispatch = cuda_basics.default_choice(n, dtype, aligned=True)[0]

            def pair(shape=shape, dtype=dtype):
                return (torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device))

            def one(shape=shape, dtype=dtype):
                return (torch.randn(shape, dtype=dtype, device=device),)
            cases.append(shapes.Case("vector_add", dtype, shape, 3 * n * size, pair, cuda_basics.vector_add,
                                     torch.add, dispatch=dispatch, compiled=False))
            cases.append(shapes.Case("relu", dtype, shape, 2 * n * size, one, cuda_basics.relu, torch.relu,
                                     dispatch=dispatch, compiled=False))
            # relu's backward reads dy and x, writes dx: threshold_backward in both.
            cases.append(shapes.Case("relu", dtype, shape, 3 * n * size, one, cuda_basics.relu, torch.relu,
                                     backward=True, grads=(0,), compiled=False))
    # On the GPU only the shapes the target holds (at least shapes.MIN_BYTES): below it a call is
    # a few microseconds of launch and latency for both variants, and the 1-token and narrow
    # 64-token cases were 167 of the 504, which a full sweep must measure in about two minutes.
    return [c for c in cases if quick or c.bytes >= shapes.MIN_BYTES]


def shapes_figures(record, out_dir):
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    for ax, (op, p) in zip(axes, (("vector_add", "forward"), ("relu", "forward"), ("relu", "backward"))):
        shapes.plot(ax, record, op, p, x=lambda r: r["shape"][0] * r["shape"][1], xlabel="elements (tokens x hidden)")
    return [plots.save(fig, out_dir / f"{CHAPTER}_shapes.png")]


def measure_build_times():
    """Cold, cached and touched-.cu JIT builds, each in a fresh process (ccache off)."""
    env = {**os.environ, "COURSE_NO_CCACHE": "1"}

    def run_jit(*flags):
        proc = subprocess.run([sys.executable, "load_jit.py", "--json", *flags], cwd=HERE,
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"load_jit.py {' '.join(flags)} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cold = run_jit("--clean")
    cached = run_jit()
    (HERE / "elementwise_kernels.cu").touch()
    touched = run_jit()
    return {"cold_s": cold["seconds"], "cached_s": cached["seconds"],
            "touched_cu_s": touched["seconds"],
            "rebuilt": [cold["rebuilt"], cached["rebuilt"], touched["rebuilt"]],
            "max_jobs": int(os.environ.get("MAX_JOBS", os.cpu_count() or 1)),
            "arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"), "ccache": False}


def aligned_sweep(record):
    """The record with only the aligned sweep rows (the misaligned ones are plotted apart)."""
    return {**record, "benchmarks": [r for r in record["benchmarks"] if not r.get("view")]}


def misaligned_sweep(record):
    return {**record, "benchmarks": [r for r in record["benchmarks"]
                                     if r.get("view") == MISALIGNED_VIEW]}


def make_figures(record, out_dir, big):
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    for ax, dtype in zip(axes, ("float32", "bfloat16")):
        plots.plot_sweep(ax, aligned_sweep(record), "vector_add", dtype)
    plots.plot_sweep(axes[2], misaligned_sweep(record), "vector_add", "bfloat16",
                     title=f"vector_add bfloat16 on {MISALIGNED_VIEW} (misaligned): "
                           f"{results.label(record)}")
    sweep_png = plots.save(fig, out_dir / f"{CHAPTER}_sweep.png")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, op in zip(axes, OPS):
        plots.plot_bars(ax, record, op, "float32", [big])
    bars_png = plots.save(fig, out_dir / f"{CHAPTER}_ladder.png")
    return [sweep_png, bars_png] + plots.cpu_vs_recorded(record, out_dir, CHAPTER, plot_comparison)


def plot_comparison(ax, record):
    """The panel a CPU run is drawn beside the recorded GPU run with: the vector_add sweep."""
    plots.plot_sweep(ax, aligned_sweep(record), "vector_add", "float32", title=results.label(record))


def print_table(record, big):
    print(f"\n{CHAPTER} on {results.label(record)}; copy ceiling "
          f"{record['ceilings']['copy_GBps']:.0f} GB/s")
    print(f"{'op':<11}{'dtype':<10}{'variant':<13}{'ms':>9}{'GB/s':>9}{'% copy':>8}{'x torch':>9}")
    for r in record["benchmarks"]:
        if r["shape"] == [big] and not r["sweep"]:
            print(f"{r['op']:<11}{r['dtype']:<10}{r['variant']:<13}{r['median_ms']:>9.3f}"
                  f"{r['GBps']:>9.0f}{r['pct_of_copy']:>8.1f}{r['speedup_vs_torch']:>9.3f}")


def print_sweep_summary(record):
    """This chapter's bar, per size: the best rung and the default against torch.add."""
    rows = [r for r in record["benchmarks"] if r.get("sweep") and r["op"] == "vector_add"]
    rungs = set(cuda_basics.VERSIONS["vector_add"])
    print(f"\nvector_add sweep: x torch.add (higher is faster) of the best rung and of the default")
    for view in (None, MISALIGNED_VIEW):
        for dtype in ("float32", "bfloat16"):
            at = {}
            for r in rows:
                if r["dtype"] == dtype and r.get("view") == view:
                    at.setdefault(r["shape"][0], {})[r["variant"]] = r
            if not at:
                continue
            parts = []
            for n, by in sorted(at.items()):
                best = min((by[v] for v in by if v in rungs), key=lambda r: r["median_ms"])
                default = by.get("default")
                parts.append(f"2^{n.bit_length() - 1} {best['speedup_vs_torch']:.2f}/"
                             f"{default['speedup_vs_torch']:.2f}" if default else "")
            print(f"  {dtype:<9}{view or 'aligned':<8} " + " ".join(parts))


def main():
    parser = bench.arguments(__doc__)
    parser.add_argument("--no-build-times", action="store_true")
    shapes.add_arguments(parser)
    args = parser.parse_args()
    if args.shapes:
        shapes.main(CHAPTER, shape_cases, __file__, shapes_figures, args.quick, args.ops, args.dtypes)
        return

    device = bench.setup(args)
    quick = args.quick or device == "cpu"
    big = 2**22 if quick else 2**28
    sweep_sizes = [2**k for k in range(12 if quick else 16, (22 if quick else 28) + 1, 2 if quick else 1)]
    variants = [*cuda_basics.VERSIONS["vector_add"], "default"] if device == "cuda" else ["cpu"]
    # On a misaligned view v3 and v4 fall back to v2 by themselves and v5 runs its scalar form:
    # v1, v2, v5 and the default are what is worth timing there.
    scalar_variants = ["v1", "v2", "v5", "default"] if device == "cuda" else ["cpu"]

    ceilings = bench.copy_ceiling(device, n=big)
    ceiling = ceilings["copy_GBps"]
    rows = []
    for op in OPS:
        for dtype in (torch.float32, torch.bfloat16):
            rows += bench_op(op, dtype, big, device, variants, ceiling)
    for dtype in (torch.float32, torch.bfloat16):
        for n in sweep_sizes:
            rows += bench_op("vector_add", dtype, n, device, variants, ceiling, sweep=True)
        for n in sweep_sizes[::2]:
            rows += bench_op("vector_add", dtype, n, device, scalar_variants, ceiling, sweep=True,
                             view=MISALIGNED_VIEW)

    extra = {"sizes": {"big": big, "sweep": sweep_sizes, "misaligned_sweep": sweep_sizes[::2]},
             "timing": {"statistic": "median", "reps": bench.MIN_REPS if device == "cpu" else 30,
                        "method": "perf_counter" if device == "cpu" else
                        "CUDA events; 2^28 rows: eager back-to-back launches (32-64x the L2); "
                        "sweep rows: CUDA-graph replays over rotating input sets (> 2x L2 per "
                        "pass), time per call; torch timed before and after the rungs, the "
                        "faster kept (the other in other_median_ms)"}}
    if not args.no_build_times and device == "cuda":
        extra["build"] = measure_build_times()
    path = results.write_results(CHAPTER, rows, ceilings, **extra)
    record = json.loads(path.read_text())
    figures = make_figures(record, path.parent, big)
    print_table(results.for_print(record), big)
    results.print_untrusted(record)
    if device == "cuda":
        print_sweep_summary(record)
    if "build" in extra:
        b = extra["build"]
        print(f"JIT build: cold {b['cold_s']:.1f} s, cached {b['cached_s']:.2f} s, "
              f"after touching the .cu {b['touched_cu_s']:.1f} s")
    print("wrote", path, *figures, sep="\n  ")
    if not args.no_shapes:
        shapes.main(CHAPTER, shape_cases, __file__, shapes_figures, quick, args.ops, args.dtypes)


if __name__ == "__main__":
    main()
