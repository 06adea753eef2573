"""Chapter 2 benchmark: what an access pattern costs, against the copy ceiling and PyTorch.

Napkin math. Every op here only moves data, so its minimum traffic is each useful element
read once plus each output element written once:
  copy          2 * n * size bytes; its best version *is* the ceiling;
  strided_copy  2 * (n / stride) * size useful bytes, but DRAM moves whole 32-byte sectors:
                once stride * size >= 32 every kept element costs a sector read, so useful
                bandwidth should fall like 1 / stride and then flatten (predicted_GBps below);
  transpose     2 * rows * cols * size bytes, 2 GiB for 16384^2 float32: ~0.7 ms at 3 TB/s;
                the same bytes at every shape, so an odd shape (8191 x 8193) or a view
                (x[:, 1:], x.t()) has the same floor as an aligned square.

    python bench_memory_ops.py           full run on a GPU (16384^2 transposes, 1 GiB copies)
    python bench_memory_ops.py --quick   small sizes: CPU machines, smoke runs
    python bench_memory_ops.py --shapes  only the shapes sweep (the layout changes of models)

Writes results/<device-slug>/chapter2_memory.json and the plots beside it.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from coursekit import bench, plots, results, shapes  # noqa: E402

import memory_ops  # noqa: E402

CHAPTER = "chapter2_memory"
SECTOR_BYTES = 32  # DRAM and L2 move 32-byte sectors (every NVIDIA GPU since Maxwell)
DTYPES = (torch.float32, torch.bfloat16)
# Every op here is differentiable; the benchmark times its forward pass (CONTRIBUTING.md, section 5).
FORWARD = {"pass": "forward"}


def element_size(dtype):
    return torch.empty((), dtype=dtype).element_size()


def sizes_for(device, quick):
    """Problem sizes: the lesson's on a GPU; small enough for a 2-core CPU otherwise."""
    if device == "cuda" and not quick:
        return {"copy_bytes": 2**30, "square": 16384, "batched": [64, 1024, 1024],
                "odd": [8191, 8193], "odd_sweep": [[1823, 781], [4097, 1000], [4095, 4097]],
                "sweep_sides": [256, 512, 1024, 2048, 4096, 8192, 16384],
                "strided_elements": 2**28, "strides": list(range(1, 65)),
                "working_set_bytes": [2**k for k in range(16, 32)],
                "h2d_bytes": [2**20, 2**24, 2**28]}
    return {"copy_bytes": 2**24, "square": 1024, "batched": [8, 256, 256],
            "odd": [1023, 1025], "odd_sweep": [[131, 67], [259, 133]],
            "sweep_sides": [128, 256, 512, 1024], "strided_elements": 2**20,
            "strides": [1, 2, 3, 4, 8, 16, 32, 64], "working_set_bytes": [2**k for k in range(16, 26, 3)],
            "h2d_bytes": []}


def timer(device, graph_sets=None, min_calls=8):
    """time(fn) for one problem: eager CUDA events for the big single-size rows (far above
    the L2), CUDA-graph replays for sweeps (graph_sets input sets rotate; 1 = always the same
    buffers, i.e. whatever the L2 can keep stays hot)."""
    if device != "cuda":
        return lambda fn: bench.time_cpu(lambda: fn(0))
    if graph_sets is None:
        return lambda fn: bench.time_cuda(lambda: fn(0))
    return lambda fn: bench.time_cuda_graph(fn, graph_sets, min_calls=min_calls)


def bench_copy(device, ceiling, nbytes):
    rows = []
    for dtype in DTYPES:
        n = nbytes // element_size(dtype)
        x = torch.randn(n, dtype=dtype, device=device)
        time = timer(device)
        t_torch = time(lambda i: x.clone())
        moved = 2 * n * element_size(dtype)
        rows.append(bench.bandwidth_row("copy", "torch", dtype, [n], moved, t_torch, ceiling,
                                        t_torch["median_ms"], sweep=False, **FORWARD))
        for version in (*memory_ops.VERSIONS["copy"], "default"):
            v = None if version == "default" else version
            t = time(lambda i: memory_ops.copy(x, version=v))
            dispatch = {"dispatch": memory_ops.default_choice("copy", x)} if v is None else {}
            rows.append(bench.bandwidth_row("copy", version, dtype, [n], moved, t, ceiling,
                                            t_torch["median_ms"], sweep=False, **FORWARD,
                                            **dispatch))
    return rows


# Views of a matrix that the benchmark transposes besides whole matrices: every source row
# shifted by one element (v4 cannot vectorize it; v5 can), and a transposed view, whose memory
# already holds the result in order (version=None copies it).
VIEWS = {"x[:, 1:]": lambda t: t[:, 1:], "x.t()": lambda t: t.t()}


def bench_transpose(device, ceiling, shape, dtype, variants, sweep=False, view=None):
    """Rows for PyTorch's transposes and every variant at one shape ("default" is
    version=None, recorded with what it dispatched to). The PyTorch baseline materializes
    x.transpose(-2, -1) with clone(memory_format=contiguous_format): the same single copy
    kernel as .contiguous() for a strided view, but it cannot return x itself when the view
    happens to be contiguous already (x.t().t() is), which would time nothing."""
    take = VIEWS[view] if view else (lambda t: t)
    elements = take(torch.empty(shape, device="meta")).numel()
    nbytes = 2 * elements * element_size(dtype)
    if device == "cuda" and sweep:
        sets = bench.rotation_sets(nbytes // 2)
        xs = [take(torch.randn(shape, dtype=dtype, device=device)) for _ in range(sets)]
        time = timer(device, graph_sets=sets)
    else:
        xs = [take(torch.randn(shape, dtype=dtype, device=device))]
        time = timer(device)
    contiguous = torch.contiguous_format
    baselines = {"torch": lambda i: xs[i].transpose(-2, -1).clone(memory_format=contiguous)}
    if len(shape) == 2 and view is None and shape[0] == shape[1]:
        baselines["torch.transpose(-2,-1)"] = lambda i: xs[i].transpose(-2, -1).contiguous()
    extra = {**FORWARD, "sweep": sweep,
             **({"view": view, "base_shape": list(shape)} if view else {})}
    out_shape = list(xs[0].shape)
    rows, t_torch = [], None
    for name, fn in baselines.items():
        t = time(fn)
        t_torch = t_torch or t["median_ms"]
        rows.append(bench.bandwidth_row("transpose", name, dtype, out_shape, nbytes, t, ceiling,
                                        t_torch, **extra))
    for variant in variants:
        version = None if variant in ("cpu", "default") else variant
        t = time(lambda i: memory_ops.transpose(xs[i], version=version))
        dispatch = ({"dispatch": memory_ops.default_choice("transpose", xs[0])}
                    if variant == "default" else {})
        rows.append(bench.bandwidth_row("transpose", variant, dtype, out_shape, nbytes, t, ceiling,
                                        t_torch, **extra, **dispatch))
    return rows


def predicted_strided_GBps(stride, size, ceiling, fetch_bytes=SECTOR_BYTES):
    """Useful GB/s if DRAM moved whole fetches of fetch_bytes at the copy rate: each kept
    element costs min(stride * size, fetch_bytes) bytes of reads (below a fetch apart, all of
    the input is read anyway; from a fetch apart on, one whole fetch per kept element) plus
    its write. The napkin model uses the 32-byte sector; profile_memory_ops.py measures what
    the H100's DRAM actually reads per kept element (64 bytes from stride 16 on)."""
    read = min(stride * size, fetch_bytes)
    return ceiling * 2 * size / (read + size)


def bench_strided(device, ceiling, n, strides):
    x = torch.randn(n, device=device)
    size = x.element_size()
    time = timer(device)
    rows = []
    for stride in strides:
        n_out = -(-n // stride)
        useful = 2 * n_out * size
        # clone, not .contiguous(): x[::1] is already contiguous and would not be copied at all.
        t_torch = time(lambda i: x[::stride].clone(memory_format=torch.contiguous_format))
        t_ours = time(lambda i: memory_ops.strided_copy(x, stride))
        extra = {"stride": stride, "sweep": True, **FORWARD,
                 "predicted_GBps": predicted_strided_GBps(stride, size, ceiling),
                 "predicted_64B_GBps": predicted_strided_GBps(stride, size, ceiling, 64)}
        rows.append(bench.bandwidth_row("strided_copy", "torch", x.dtype, [n], useful, t_torch,
                                        ceiling, t_torch["median_ms"], **extra))
        rows.append(bench.bandwidth_row("strided_copy", "v1", x.dtype, [n], useful, t_ours,
                                        ceiling, t_torch["median_ms"], **extra))
    return rows


def bench_working_set(device, ceiling, working_sets):
    """Copy bandwidth against working-set size (source + destination bytes), the same buffers
    every call: while they fit the L2 they stay there, and the copy runs at L2 bandwidth."""
    rows = []
    for ws in working_sets:
        n = ws // 2 // 4
        src = torch.randn(n, device=device)
        dst = torch.empty_like(src)
        time = timer(device, graph_sets=1, min_calls=64)
        t_torch = time(lambda i: dst.copy_(src))
        t_ours = time(lambda i: memory_ops.copy(src, version="v2"))
        t_default = time(lambda i: memory_ops.copy(src))
        for variant, t in (("torch", t_torch), ("v2", t_ours), ("default", t_default)):
            dispatch = {"dispatch": memory_ops.default_choice("copy", src)} if variant == "default" else {}
            rows.append(bench.bandwidth_row("copy_working_set", variant, torch.float32, [n], ws,
                                            t, ceiling, t_torch["median_ms"], sweep=True,
                                            working_set_bytes=ws, **FORWARD, **dispatch))
    return rows


def bench_host_to_device(sizes):
    """Host-to-device copies from pageable and from pinned (page-locked) host memory, torch
    only: pageable memory is first staged by the driver through a pinned bounce buffer."""
    rows = []
    for nbytes in sizes:
        dst = torch.empty(nbytes // 4, device="cuda")
        pageable = torch.randn(nbytes // 4)
        pinned = pageable.pin_memory()
        for variant, src in (("pageable", pageable), ("pinned", pinned)):
            t = bench.time_cuda(lambda: dst.copy_(src, non_blocking=True))
            rows.append(bench.bandwidth_row("host_to_device", variant, torch.float32,
                                            [nbytes // 4], nbytes, t, None, sweep=True,
                                            host_memory=variant))
    return rows


# ---------------------------------------------------------------------------------------------
# The shapes sweep (coursekit/shapes.py). Models change layouts between attention's heads and
# its tokens: (b, s, h, d) to (b, h, s, d). transpose swaps the last two dims of a 2-D or 3-D
# tensor, so the sweep measures what it takes: the batched swap (b, s, h * d) -> (b, h * d, s)
# and the 2-D (b * s, h * d) -> (h * d, b * s), at LLM sizes, and odd shapes (an embedding's
# 50257 x 768, tall and thin tensors). The 4-D permute itself moves whole rows of d elements
# and needs no tile (each row is a contiguous copy): it is not this op's problem. The thin
# tensors have a short side of 3, 17, 24, 32 or 48 against 1000003, both ways round: all under
# the thin kernels' bound of 64 (memory.h), where v5's 128-row tile would be 2-38% full.
# ---------------------------------------------------------------------------------------------
THIN_SHORT_SIDES = (3, 17, 24, 32, 48)
TRANSPOSE_SHAPES = [
    (8, 2048, 4096), (4, 4096, 5120), (1, 8192, 8192), (32, 1024, 2048),
    (16384, 4096), (8192, 5120), (32768, 1024), (4096, 14336),
    (50257, 768), (4097, 1000), (8191, 8193), (777, 4099),
    *((1000003, s) for s in THIN_SHORT_SIDES), *((s, 1000003) for s in THIN_SHORT_SIDES),
]
QUICK_TRANSPOSE_SHAPES = [(2, 129, 64), (777, 131)]


def shape_cases(device, quick):
    cases = []
    for dtype in shapes.dtypes(quick):
        for shape in (QUICK_TRANSPOSE_SHAPES if quick else TRANSPOSE_SHAPES):
            numel = 1
            for d in shape:
                numel *= d

            def make(shape=shape, dtype=dtype):
                return (torch.randn(shape, device=device).to(dtype),)

            def eager(x):
                return x.transpose(-2, -1).contiguous()
            dispatch = memory_ops.default_choice("transpose", torch.empty(shape, dtype=dtype))
            cases.append(shapes.Case("transpose", dtype, shape, 2 * numel * element_size(dtype), make,
                                     memory_ops.transpose, eager, dispatch=dispatch, dynamic=(), compiled=False))
    return cases


def shapes_figures(record, out_dir):
    fig, ax = plt.subplots(figsize=(9, 5))
    shapes.plot(ax, record, "transpose", x=lambda r: r["shape"][-2] * r["shape"][-1],
                xlabel="rows x cols of the swapped dims")
    return [plots.save(fig, out_dir / f"{CHAPTER}_shapes.png")]


def make_figures(record, out_dir):
    s = record["sizes"]
    out_dir.mkdir(parents=True, exist_ok=True)
    square = [s["square"], s["square"]]
    fig, axes = plt.subplots(2, 4, figsize=(22, 9))
    plots.plot_bars(axes[0][0], record, "transpose", "float32", square)
    plots.plot_bars(axes[0][1], record, "transpose", "bfloat16", square)
    plots.plot_bars(axes[0][2], record, "transpose", "float64", square)
    plots.plot_bars(axes[0][3], record, "transpose", "float32", s["batched"])
    plots.plot_bars(axes[1][0], record, "transpose", "float32", s["odd"])
    plots.plot_bars(axes[1][1], record, "transpose", "bfloat16", s["odd"])
    sliced = [s["square"], s["square"] - 1]
    plots.plot_bars(axes[1][2], record, "transpose", "bfloat16", sliced, view="x[:, 1:]")
    plots.plot_bars(axes[1][3], record, "transpose", "float32", square, view="x.t()")
    figures = [plots.save(fig, out_dir / f"{CHAPTER}_ladder.png")]

    fig, axes = plt.subplots(1, 3, figsize=(17, 4))
    plot_strided(axes[0], record)
    plot_working_set(axes[1], record)
    plots.plot_sweep(axes[2], record, "transpose", "float32", x=lambda r: r["shape"][0],
                     xlabel="matrix side (square float32)")
    figures.append(plots.save(fig, out_dir / f"{CHAPTER}_memory.png"))
    return figures + plots.cpu_vs_recorded(record, out_dir, CHAPTER, plot_comparison)


def plot_comparison(ax, record):
    """The panel a CPU run is drawn beside the recorded GPU run with: transpose, square float32."""
    side = record["sizes"]["square"]
    plots.plot_bars(ax, record, "transpose", "float32", [side, side])


def plot_strided(ax, record):
    plots.plot_sweep(ax, record, "strided_copy", "float32", x=lambda r: r["stride"],
                     xlabel="stride (elements)", xscale=("linear", None))
    for key, style, name in (("predicted_GBps", ":", "32-byte sector model"),
                             ("predicted_64B_GBps", "-.", "64-byte fetch model")):
        pts = sorted({(r["stride"], r[key]) for r in record["benchmarks"]
                      if r["op"] == "strided_copy" and key in r})
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:red", linestyle=style,
                label=f"{name} (at the copy rate)")
    ax.set_ylabel("useful GB/s (kept elements read + written)")
    ax.legend(fontsize=7)


def plot_working_set(ax, record):
    plots.plot_sweep(ax, record, "copy_working_set", "float32",
                     x=lambda r: r["working_set_bytes"], xlabel="working set (bytes, src + dst)")
    l2 = record["device"].get("l2_MB")
    if l2:
        ax.axvline(l2 * 2**20, color="tab:red", linestyle=":", label=f"L2 {l2:.0f} MB")
        ax.legend(fontsize=7)


def print_table(record):
    print(f"\n{CHAPTER} on {results.label(record)}; copy ceiling "
          f"{record['ceilings']['copy_GBps']:.0f} GB/s")
    print(f"{'op':<10}{'dtype':<10}{'shape':<16}{'variant':<24}{'ms':>9}{'GB/s':>8}"
          f"{'% copy':>8}{'x torch':>9}")
    for r in record["benchmarks"]:
        if not r["sweep"]:
            shape = results.format_shape(r["shape"]) + (" view" if r.get("view") else "")
            print(f"{r['op']:<10}{r['dtype']:<10}{shape:<16}"
                  f"{r['variant']:<24}{r['median_ms']:>9.3f}{r['GBps']:>8.0f}"
                  f"{r['pct_of_copy']:>8.1f}{r['speedup_vs_torch']:>9.3f}"
                  f"  {r.get('dispatch', '')}")
    picked = [r for r in record["benchmarks"] if r["op"] == "strided_copy"
              and r["variant"] == "v1" and r["stride"] in (1, 2, 4, 8, 16, 32, 64)]
    print("strided_copy float32, useful GB/s (model): " + ", ".join(
        f"s={r['stride']} {r['GBps']:.0f} ({r['predicted_GBps']:.0f})" for r in picked))
    h2d = [r for r in record["benchmarks"] if r["op"] == "host_to_device"]
    if h2d:
        print("host to device: " + ", ".join(
            f"{r['bytes'] / 2**20:.0f} MiB {r['variant']} {r['GBps']:.1f} GB/s" for r in h2d))


def main():
    device, quick, args = shapes.start(__doc__)
    if args.shapes:
        shapes.main(CHAPTER, shape_cases, __file__, shapes_figures, quick, args.ops, args.dtypes)
        return
    s = sizes_for(device, quick)
    variants = [*memory_ops.VERSIONS["transpose"], "default"] if device == "cuda" else ["cpu"]

    ceilings = bench.copy_ceiling(device, n=s["copy_bytes"] // 4)
    ceiling = ceilings["copy_GBps"]
    rows = []
    square = [s["square"], s["square"]]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        rows += bench_transpose(device, ceiling, square, dtype, variants)
    for dtype in DTYPES:
        rows += bench_transpose(device, ceiling, s["batched"], dtype, variants)
        rows += bench_transpose(device, ceiling, s["odd"], dtype, variants)
        for view in VIEWS:
            rows += bench_transpose(device, ceiling, square, dtype, variants, view=view)
        for shape in s["odd_sweep"]:
            rows += bench_transpose(device, ceiling, shape, dtype, variants, sweep=True)
    rows += bench_copy(device, ceiling, s["copy_bytes"])
    for side in s["sweep_sides"]:
        rows += bench_transpose(device, ceiling, [side, side], torch.float32, variants, sweep=True)
    rows += bench_strided(device, ceiling, s["strided_elements"], s["strides"])
    rows += bench_working_set(device, ceiling, s["working_set_bytes"])
    if device == "cuda":
        rows += bench_host_to_device(s["h2d_bytes"])

    extra = {"sizes": s, "headline_op": "transpose",
             "timing": {"statistic": "median", "reps": bench.MIN_REPS if device == "cpu" else 30,
                        "method": "perf_counter" if device == "cpu" else
                        "CUDA events; single-size rows: eager back-to-back launches (each "
                        "problem far above the L2); transpose sweep: CUDA-graph replays over "
                        "rotating inputs (> 2x L2 per pass); working-set sweep: CUDA-graph "
                        "replays on the same buffers (hot L2 by design)"}}
    results.publish(CHAPTER, rows, ceilings, extra, make_figures, print_table)
    if not args.no_shapes:
        shapes.main(CHAPTER, shape_cases, __file__, shapes_figures, quick, args.ops, args.dtypes)


if __name__ == "__main__":
    main()
