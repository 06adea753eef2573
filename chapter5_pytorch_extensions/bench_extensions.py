"""Chapter 5 benchmark: what each way of binding a kernel costs, and what the fused kernel gains.

Three measurements, each with the napkin math that says what to expect.

1. fused_op at 16384^2: relu(x * scale + bias) is memory-bound. Its floor is one read of x and
   one write of y (the bias is 16384 elements, nothing); eager PyTorch runs three kernels
   (mul, add, relu), each a full trip through memory, ~3x the traffic, so ~3x the time. Every
   route runs the same kernel, so at this size they must all tie: a binding's cost is
   microseconds on the host, the kernel's is hundreds of microseconds on the GPU.
2. call_overhead: the other end, where the kernel is nothing (1 element) or a few
   microseconds (2^20 elements, 4 MiB, in the L2). What a call costs the host (Python, the
   binding, the dispatcher, the checks, the launch) is timed with a CPU clock around many
   calls and one synchronize, per route, against a native one-kernel op with the same inputs
   (torch.add(x, bias, alpha=scale)); with and without autograd recording.
3. timing: a naive benchmark, as it is often written (time.time() around 100 calls after a
   warm-up, one synchronize), against the course's harness, at that snippet's size (1024x2048, 8 MiB: it
   fits in the 50 MB L2 of an H100) and at 16384^2. The harness times a CUDA graph of calls
   over input sets that together exceed the L2, so neither the host's launch rate nor a warm
   cache decides the number.

    python bench_extensions.py           full run on a GPU
    python bench_extensions.py --quick   small sizes: CPU machines, smoke runs
    python bench_extensions.py --shapes  only the shapes sweep: fused_op at tokens x hidden
                                         sizes of real models, forward and backward

Writes results/<device-slug>/chapter5_pytorch_extensions.json and the plots beside it.
labs/build_lab.py measures the build side (chapter5_pytorch_extensions_build.json).
"""
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from coursekit import bench, plots, results, shapes  # noqa: E402
from coursekit.results import subset  # noqa: E402  (the notebook reaches it as B.subset)

import custom_ops  # noqa: E402

CHAPTER = "chapter5_pytorch_extensions"
SCALE = 2.0
ROUTES = list(custom_ops.ROUTES)
OVERHEAD_SIZES = (1, 2**20)


def sizes_for(device, quick):
    if device == "cuda" and not quick:
        return {"fused": [16384, 16384], "timing": [[1024, 2048], [16384, 16384]],
                "overhead_calls": {1: 2000, 2**20: 2000}}
    # The CPU path's kernels are plain loops: at 2^20 elements a call is milliseconds of
    # arithmetic, and a few calls show the binding's share as well as thousands.
    return {"fused": [512, 1024], "timing": [[1024, 2048]], "overhead_calls": {1: 200, 2**20: 3}}


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def eager_fused(x, bias):
    return torch.relu(x * SCALE + bias)


def route_calls(x, bias):
    return [(route, (lambda fn=fn: fn(x, bias, SCALE)), {}) for route, fn in custom_ops.ROUTES.items()]


# ---------------------------------------------------------------------------------------------
# 0. What each route does under PyTorch's tools (test_routes.py asserts the same cells)
# ---------------------------------------------------------------------------------------------
def _first_line(e):
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}" if str(e).strip() else type(e).__name__


def _attempt(fn):
    """("yes", detail) if fn() ran, else ("no", the first line of the error)."""
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Dynamo's long warning about an untraceable builtin
            return "yes", fn()
    except Exception as e:  # noqa: BLE001  (what fails, and how, is the measurement)
        return "no", _first_line(e)


# A capture that fails can leave the process's CUDA state unusable for later captures (the
# RNG's capture bookkeeping, an invalidated capture stream), and every later number here is
# graph-timed: so the capture is tried in a fresh process, as a learner's script would try it.
_CAPTURE_CHILD = """
import json, sys, torch, custom_ops
fn, scale = custom_ops.ROUTES[sys.argv[1]], float(sys.argv[2])
x, bias = torch.randn(8, 40, device="cuda"), torch.randn(40, device="cuda")
fn(x, bias, scale)
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = fn(x, bias, scale)
graph.replay()
torch.cuda.synchronize()
print(json.dumps(torch.equal(out, fn(x, bias, scale))))
"""


def _capture_in_child(route):
    import subprocess
    try:
        done = subprocess.run([sys.executable, "-c", _CAPTURE_CHILD, route, str(SCALE)], cwd=HERE,
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "fails (no answer in 300 s)"
    if done.returncode != 0:
        lines = [l for l in done.stderr.strip().splitlines() if l.strip()]
        return f"fails ({lines[-1][:160] if lines else f'exit {done.returncode}'})"
    same = done.stdout.split()[-1:] == ["true"]
    return "captures, replay matches eager" if same else "captures, replay differs"


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, bias):
        return self.fn(x, bias, SCALE)


def probe_routes(device):
    """For every route: does torch.compile(fullgraph=True) take it, how many graph breaks does
    torch._dynamo.explain count (with work before and after the op, so that a break shows),
    does torch.library.opcheck pass, do meta and fake tensors propagate shapes, does a CUDA
    graph capture it, does torch.export keep it as a node. Each cell is what happened here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(8, 40, device=device)
    bias = torch.randn(40, device=device)
    table = {}
    for route, fn in custom_ops.ROUTES.items():
        def model(x, bias, fn=fn):
            return fn(x * 1.5, bias, SCALE) * 2.0
        cells = {}
        torch._dynamo.reset()
        ok, detail = _attempt(lambda: torch.compile(model, backend="aot_eager", fullgraph=True)(x, bias))
        cells["compile_fullgraph"] = "compiles" if ok == "yes" else f"fails ({detail})"
        torch._dynamo.reset()
        ok, explained = _attempt(lambda: torch._dynamo.explain(model)(x, bias))
        cells["graph_breaks"] = explained.graph_break_count if ok == "yes" else f"explain failed ({explained})"
        torch._dynamo.reset()
        op = getattr(fn, "_opoverload", fn)
        if isinstance(op, torch._ops.OpOverload):
            ok, detail = _attempt(lambda: torch.library.opcheck(
                op, (x, bias, SCALE)))
            cells["opcheck"] = "passes" if ok == "yes" else f"fails ({detail})"
        else:
            cells["opcheck"] = "not applicable (no operator to check)"
        ok, out = _attempt(lambda: fn(torch.empty(3, 7, 40, device="meta"), torch.empty(40, device="meta"), SCALE))
        cells["meta"] = f"shape {tuple(out.shape)}" if ok == "yes" else f"fails ({out})"

        def fake():
            with FakeTensorMode() as mode:
                return tuple(fn(mode.from_tensor(x), mode.from_tensor(bias), SCALE).shape)
        ok, out = _attempt(fake)
        cells["fake"] = f"shape {out}" if ok == "yes" else f"fails ({out})"
        cells["cuda_graph"] = _capture_in_child(route) if device == "cuda" else "not measured (no GPU)"
        def export():
            program = torch.export.export(_Call(fn), (x, bias), strict=False)
            return [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
        ok, nodes = _attempt(export)
        cells["export"] = f"nodes {nodes}" if ok == "yes" else f"fails ({nodes})"
        table[route] = cells
    torch._dynamo.reset()
    return table


# ---------------------------------------------------------------------------------------------
# 1. fused_op, forward and backward, against eager and torch.compile
# ---------------------------------------------------------------------------------------------
def bench_fused_op(device, ceiling, s):
    rows = []
    shape = s["fused"]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(shape, device=device, dtype=dtype)
        bias = torch.randn(shape[-1], device=device, dtype=dtype)
        size = x.element_size()

        def row(variant, t, t_torch, **fields):
            return bench.bandwidth_row("fused_op", variant, dtype, shape, nbytes, t, ceiling,
                                       t_torch, **fields)
        variants = [("torch", lambda: eager_fused(x, bias), {})]
        if device == "cuda":
            c = bench.compiled(("fused", dtype), eager_fused)
            variants.append(("torch.compile", (lambda: c(x, bias)) if c else None, {}))
        # Read x, write y; the bias (one row) is noise at this size.
        nbytes = 2 * x.numel() * size
        rows += bench.measure(device, row, variants + route_calls(x, bias), **{"pass": "forward"})

        # Backward through autograd from y: read dy and y, write dx, plus the column sums for
        # dbias (eager's relu backward, then mul, then a reduction over rows for the bias).
        xg, bg = x.detach().requires_grad_(), bias.detach().requires_grad_()
        dy = torch.randn_like(x)

        variants = [("torch", bench.backward_call(eager_fused, (xg, bg), dy), {})]
        if device == "cuda":
            c = bench.compiled(("fused", dtype, "bwd"), eager_fused)
            variants.append(("torch.compile", bench.backward_call(c, (xg, bg), dy) if c else None, {}))
        variants += [(route, bench.backward_call(lambda a, b, fn=fn: fn(a, b, SCALE), (xg, bg), dy), {})
                     for route, fn in custom_ops.ROUTES.items()]
        nbytes = 3 * x.numel() * size
        rows += bench.measure(device, row, variants, **{"pass": "backward"})
        del x, xg, dy
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# 1b. The shapes sweep (coursekit/shapes.py): fused_op (the public op, route 2) at tokens x
# hidden sizes of real models and odd hidden sizes, forward and backward, against eager and
# torch.compile.
# ---------------------------------------------------------------------------------------------
def shape_cases(device, quick):
    cases = []
    for dtype in shapes.dtypes(quick):
        size = torch.empty((), dtype=dtype).element_size()
        for tokens, hidden in shapes.token_shapes(quick):
            def make(tokens=tokens, hidden=hidden, dtype=dtype):
                return (torch.randn(tokens, hidden, dtype=dtype, device=device),
                        torch.randn(hidden, dtype=dtype, device=device))

            def ours(x, b):
                return custom_ops.fused_op_forward(x, b, SCALE)
            n = tokens * hidden
            cases.append(shapes.Case("fused_op", dtype, (tokens, hidden), 2 * n * size, make, ours, eager_fused))
            cases.append(shapes.Case("fused_op", dtype, (tokens, hidden), 3 * n * size, make, ours, eager_fused,
                                     backward=True, grads=(0, 1)))
    return cases


def shapes_figures(record, out_dir):
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    for ax, p in zip(axes, ("forward", "backward")):
        shapes.plot(ax, record, "fused_op", p, x=lambda r: r["shape"][-1], xlabel="hidden size")
    return [plots.save(fig, out_dir / f"{CHAPTER}_shapes.png")]


# ---------------------------------------------------------------------------------------------
# 2. Per-call overhead on the host
# ---------------------------------------------------------------------------------------------
def host_times_per_call(fns, device, calls, reps=bench.MIN_REPS):
    """Host milliseconds per call of each fn: a CPU clock around `calls` back-to-back calls and
    one synchronize. While the host takes longer per call than the GPU per kernel, the queue of
    launches never fills and this is the host's cost of a call. The variants take turns within
    every repeat (round robin), so a drift of the host's speed during the measurement (on the
    H100 machine torch.add moved from 13.6 to 8.2 us between two runs) lands on all of them
    alike; returns each fn's samples, repeat by repeat."""
    for fn in fns:
        for _ in range(max(3, calls // 10)):
            fn()
    sync(device)
    samples = [[] for _ in fns]
    for _ in range(reps):
        for fn, mine in zip(fns, samples):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync(device)
            mine.append((time.perf_counter() - start) * 1e3 / calls)
    return samples


def bench_call_overhead(device, s):
    rows = []
    for numel in OVERHEAD_SIZES:
        shape = [numel] if numel == 1 else [1024, numel // 1024]
        for grad in (False, True):
            x = torch.randn(shape, device=device).requires_grad_(grad)
            bias = torch.randn(shape[-1], device=device).requires_grad_(grad)
            variants = [("torch", lambda: torch.add(x, bias, alpha=SCALE), {"call": "torch.add"}),
                        ("torch", lambda: eager_fused(x, bias), {"call": "relu(x*s+b)"})]
            variants += route_calls(x, bias)
            calls = s["overhead_calls"][numel]
            samples = host_times_per_call([fn for _, fn, _ in variants], device, calls)
            for (variant, fn, more), mine in zip(variants, samples):
                t = bench.summarize(mine)
                # Over the native op: the median of the per-repeat differences (paired, so the
                # host's drift between repeats cancels).
                over = statistics.median(a - b for a, b in zip(mine, samples[0]))
                row = {"op": "call_overhead", "variant": variant, "dtype": "float32",
                       "shape": shape, "numel": numel, "pass": "forward", "grad": grad, **more, **t,
                       "calls": calls, "timer": f"host clock, {calls} calls + one synchronize, variants in turn",
                       "us_per_call": t["median_ms"] * 1e3, "us_over_native": over * 1e3}
                if device == "cuda" and not grad:
                    # What the GPU spends per call, from a graph (no host in the loop): the
                    # floor under the host's number.
                    row["gpu_us_per_call"] = bench.time_cuda_graph(lambda i: fn(), 1)["median_ms"] * 1e3
                if bench.untrusted(t):
                    row["untrusted"] = bench.untrusted(t)
                rows.append(row)
            del x, bias
    return rows


# ---------------------------------------------------------------------------------------------
# 3. The naive time.time() benchmark against the harness
# ---------------------------------------------------------------------------------------------
def naive_timing_ms(fn, device, num_iters=100):
    """The naive snippet as it is written (the README quotes it): warm-up, time.time() around num_iters calls,
    one synchronize, the mean."""
    for _ in range(10):
        fn()
    sync(device)
    start = time.time()
    for _ in range(num_iters):
        fn()
    sync(device)
    return (time.time() - start) / num_iters * 1000


def bench_timing_methods(device, s, repeats=5):
    rows = []
    for shape in s["timing"]:
        x = torch.randn(shape, device=device)
        bias = torch.randn(shape[-1], device=device)
        calls = {"torch": eager_fused,
                 "torch_library": lambda x, b: custom_ops.fused_op_forward(x, b, SCALE)}
        nbytes = 2 * x.numel() * x.element_size()
        if device == "cuda":
            # Enough input sets that a pass through them all is twice the L2: each call finds
            # its input in DRAM, as a layer in a real network does.
            sets = bench.rotation_sets(nbytes // 2)
            xs = [x] + [torch.randn_like(x) for _ in range(sets - 1)]
        per_method = {}
        for variant, fn in calls.items():
            naive = [naive_timing_ms(lambda: fn(x, bias), device) for _ in range(repeats)]
            per_method.setdefault("time.time (naive loop)", {})[variant] = {
                "median_ms": statistics.median(naive), "min_ms": min(naive), "max_ms": max(naive),
                "runs_ms": naive, "reps": repeats}
            if device == "cuda":
                per_method.setdefault("harness (CUDA graph, cold L2)", {})[variant] = \
                    bench.time_cuda_graph(lambda i: fn(xs[i], bias), len(xs))
                per_method.setdefault("harness (events, same input)", {})[variant] = \
                    bench.time_cuda(lambda: fn(x, bias))
            else:
                per_method.setdefault("harness (CPU clock)", {})[variant] = bench.time_cpu(lambda: fn(x, bias))
        for method, by_variant in per_method.items():
            t_torch = by_variant["torch"]["median_ms"]
            for variant, t in by_variant.items():
                rows.append({**bench.bandwidth_row("timing", variant, "float32", shape, nbytes, t, None,
                                                   t_torch, **{"pass": "forward"}),
                             "method": method, "timed": "fused_op_forward"})
        del x
        if device == "cuda":
            del xs
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# Figures and the table
# ---------------------------------------------------------------------------------------------
def plot_overhead(ax, record, numel, grad=False):
    """Host microseconds per call of every route against the native ops, at one size."""
    picked = results.rows(record, op="call_overhead", grad=grad, numel=numel)
    names = [results.column(r) for r in picked]
    bars = ax.barh(range(len(picked)), [r["us_per_call"] for r in picked],
                   color=["black" if r["variant"] == "torch" else "tab:blue" for r in picked])
    if any("gpu_us_per_call" in r for r in picked):
        ax.scatter([r.get("gpu_us_per_call", float("nan")) for r in picked], range(len(picked)),
                   color="tab:orange", zorder=3, label="GPU time per call (graph)")
        ax.legend(fontsize=7)
    for bar, r in zip(bars, picked):
        ax.annotate(f" {r['us_per_call']:.1f}", (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                    va="center", fontsize=7)
    ax.set_yticks(range(len(picked)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("host us per call (median)")
    grad_text = "inputs require grad" if grad else "no grad"
    ax.set_title(f"call overhead, {results.format_shape([numel])} float32 elements, {grad_text}\n"
                 f"{results.label(record)}", fontsize=9)
    ax.grid(axis="x", alpha=0.3)


def plot_timing(ax, record):
    """The speedup each timing method reports for the fused op, at each size."""
    timing = results.rows(record, op="timing", variant="torch_library")
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in timing))
    methods = list(dict.fromkeys(r["method"] for r in timing))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        values = [next((r["speedup_vs_torch"] for r in timing if r["method"] == method
                        and tuple(r["shape"]) == shape), 0.0) for shape in shapes]
        ax.bar([j + i * width for j in range(len(shapes))], values, width, label=method)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(shapes))],
                  [results.format_shape(shape) for shape in shapes])
    ax.axhline(1.0, color="grey", linestyle=":")
    ax.set_ylabel("fused op speedup over eager (x)")
    ax.set_title(f"the same comparison, timed three ways\n{results.label(record)}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def make_figures(record, out_dir):
    figures = []
    fused = results.rows(record, op="fused_op")
    if fused:
        shape = fused[0]["shape"]
        dtypes = list(dict.fromkeys(r["dtype"] for r in fused))
        fig, axes = plt.subplots(2, len(dtypes), figsize=(5.5 * len(dtypes), 8), squeeze=False)
        for j, dtype in enumerate(dtypes):
            for i, pass_ in enumerate(("forward", "backward")):
                plots.plot_bars(axes[i][j], subset(record, **{"pass": pass_}), "fused_op", dtype, shape,
                                title=f"fused_op {pass_} {dtype} {results.format_shape(shape)}\n"
                                      f"{results.label(record)}")
        figures.append(plots.save(fig, out_dir / f"{CHAPTER}_fused_op.png"))
    if results.rows(record, op="call_overhead"):
        fig, axes = plt.subplots(2, len(OVERHEAD_SIZES), figsize=(11, 7), squeeze=False)
        for j, numel in enumerate(OVERHEAD_SIZES):
            for i, grad in enumerate((False, True)):
                plot_overhead(axes[i][j], record, numel, grad)
        figures.append(plots.save(fig, out_dir / f"{CHAPTER}_overhead.png"))
    if results.rows(record, op="timing"):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        plot_timing(ax, record)
        figures.append(plots.save(fig, out_dir / f"{CHAPTER}_timing.png"))
    return figures + plots.cpu_vs_recorded(record, out_dir, CHAPTER, plot_comparison)


def plot_comparison(ax, record):
    """The panel a CPU run is drawn beside the recorded GPU run with: the fused op's forward in
    float32, every route."""
    shape = results.rows(record, op="fused_op")[0]["shape"]
    plots.plot_bars(ax, subset(record, **{"pass": "forward"}), "fused_op", "float32", shape)


def print_table(record):
    for route, cells in record.get("bindings", {}).items():
        print(f"{route:<14}" + "; ".join(f"{k}: {v}" for k, v in cells.items())[:400])
    print(f"\n{results.label(record)}; copy {record['ceilings']['copy_GBps']:.0f} GB/s")
    print(f"{'op':<14}{'pass':<10}{'dtype':<10}{'variant':<16}{'ms':>10}{'GB/s':>9}{'%copy':>7}{'x torch':>9}")
    for r in results.rows(record, op="fused_op"):
        print(f"{r['op']:<14}{r['pass']:<10}{r['dtype']:<10}{r['variant']:<16}{r['median_ms']:10.4f}"
              f"{r['GBps']:9.0f}{r.get('pct_of_copy', 0):7.1f}{r['speedup_vs_torch']:9.2f}")
    # Columns as wide as their widest cell, two spaces apart: on a busy CPU a call can take
    # tens of milliseconds, whose microseconds would otherwise run into the next column.
    cells = [[results.format_shape([r["numel"]]), str(r["grad"]), results.column(r), f"{r['us_per_call']:.2f}",
              f"{r['us_over_native']:.2f}", f"{r['gpu_us_per_call']:.2f}" if "gpu_us_per_call" in r else "-"]
             for r in results.rows(record, op="call_overhead")]
    head = ["elements", "grad", "variant", "us/call", "+us", "gpu us"]
    widths = [max(len(row[i]) for row in cells + [head]) for i in range(len(head))]
    print("\ncall_overhead")
    for row in [head] + cells:
        print("  " + "  ".join(cell.ljust(w) if i == 2 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))))
    print(f"\n{'timing':<14}{'shape':>12}  {'method':<32}{'torch ms':>10}{'ours ms':>10}{'x torch':>9}")
    for r in results.rows(record, op="timing", variant="torch_library"):
        t = next(q for q in results.rows(record, op="timing", variant="torch", method=r["method"])
                 if q["shape"] == r["shape"])
        print(f"{'':<14}{results.format_shape(r['shape']):>12}  {r['method']:<32}{t['median_ms']:10.4f}"
              f"{r['median_ms']:10.4f}{r['speedup_vs_torch']:9.2f}")


def main():
    device, quick, args = shapes.start(__doc__)
    if args.shapes:
        shapes.main(CHAPTER, shape_cases, __file__, shapes_figures, quick, args.ops, args.dtypes)
        return
    torch.manual_seed(0)
    s = sizes_for(device, quick)
    bindings = probe_routes(device)
    ceilings = bench.copy_ceiling(device)
    copy = ceilings["copy_GBps"]
    rows = bench_fused_op(device, copy, s)
    rows += bench_call_overhead(device, s)
    rows += bench_timing_methods(device, s)
    # Host costs depend on the host: its CPU goes in the record beside the GPU.
    extra = {"headline_op": "fused_op", "routes": ROUTES, "extension": custom_ops.EXTENSION["route"],
             "host_cpu": bench.host_cpu(), "bindings": bindings}
    results.publish(CHAPTER, rows, ceilings, extra, make_figures, print_table)
    if not args.no_shapes:
        shapes.main(CHAPTER, shape_cases, __file__, shapes_figures, quick, args.ops, args.dtypes)


if __name__ == "__main__":
    main()
