"""Chapter 4 benchmark: every fused op against PyTorch eager, torch.compile and the memory ceiling.

Napkin math. Every op here but linear_activation is memory-bound: its floor is the minimum
traffic (each input read once, each output written once) over the copy bandwidth. Eager
PyTorch runs one kernel per op of the chain, each a full trip through memory, so a chain of
three elementwise ops moves ~3x the minimum; a fused kernel moves it once. torch.compile fuses
the same chain by itself: the question each row answers is whether the hand-written kernel
still wins, and by how much. The bytes below are that minimum for every variant of a row, so
GB/s compares times: a rung that moves more than the minimum shows as a lower GB/s.

linear_activation is a GEMM (2 M N K FLOPs) plus an epilogue over the M x N output: its rows
are TFLOP/s against a plain bf16 matmul measured in the same run.

    python bench_fusion.py           full run on a GPU
    python bench_fusion.py --quick   small sizes: CPU machines, smoke runs
    python bench_fusion.py --shapes  only the shapes sweep (tokens x hidden sizes of real models)

Writes results/<device-slug>/chapter4_fusion.json and the plots beside it.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from coursekit import bench, plots, results, shapes  # noqa: E402
from coursekit.results import subset  # noqa: E402  (the notebooks reach it as B.subset)

import fusion  # noqa: E402

CHAPTER = "chapter4_fusion"
SCALE = 0.5
EPS = 1e-5
ACTIVATIONS = {  # name -> (ours, eager reference of act(x + bias))
    "bias_gelu": (lambda x, b, **kw: fusion.bias_gelu(x, b, **kw), lambda x, b: F.gelu(x + b)),
    "bias_gelu_tanh": (lambda x, b, **kw: fusion.bias_gelu(x, b, approximate="tanh", **kw),
                       lambda x, b: F.gelu(x + b, approximate="tanh")),
    "bias_silu": (lambda x, b, **kw: fusion.bias_silu(x, b, **kw), lambda x, b: F.silu(x + b)),
}


def sizes_for(device, quick):
    if device == "cuda" and not quick:
        return {"bsr": [16384, 16384], "act": [16384, 8192], "swiglu": [16384, 16384],
                "norm_total": 2**26, "norm_hidden": [1024, 4096, 8192], "add_norm_hidden": [4096, 8192],
                "linear_m": [1, 16, 128, 1024, 8192], "linear_k": 4096, "linear_n": 16384}
    return {"bsr": [256, 512], "act": [256, 512], "swiglu": [256, 512], "norm_total": 2**16,
            "norm_hidden": [1024], "add_norm_hidden": [1024], "linear_m": [1, 64], "linear_k": 256,
            "linear_n": 512}


def element_size(dtype):
    return torch.empty((), dtype=dtype).element_size()


def with_baselines(device, key, eager, args, ours):
    """torch (eager), torch.compile of the same function (GPU only), then ours."""
    out = [("torch", lambda: eager(*args), {})]
    if device == "cuda":
        c = bench.compiled(key, eager)
        out.append(("torch.compile", (lambda: c(*args)) if c else None, {}))
    return out + ours


def bandwidth(device, ceiling, op, dtype, shape, nbytes, variants, **extra):
    def row(variant, t, t_torch, **fields):
        return bench.bandwidth_row(op, variant, dtype, shape, nbytes, t, ceiling, t_torch, **fields)
    return bench.measure(device, row, variants, **extra)


def rungs(device, op, call, choice_x=None):
    """Every rung of op's ladder (on the GPU) and version=None, with the rung it dispatched to."""
    if device != "cuda":
        return [("cpu", lambda: call(None), {})]
    out = [(v, (lambda v=v: call(v)), {}) for v in fusion.VERSIONS[op]]
    return out + [("default", lambda: call(None), {"dispatch": fusion.default_choice(op, choice_x)})]


# ---------------------------------------------------------------------------------------------
# fused_bias_scale_relu: the ladder, its backward ladder, and what to save
# ---------------------------------------------------------------------------------------------
def bench_bias_scale_relu(device, ceiling, s):
    rows = []
    shape = s["bsr"]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(shape, device=device, dtype=dtype)
        bias = torch.randn(shape[-1], device=device, dtype=dtype)
        n, size = x.numel(), element_size(dtype)
        eager = lambda x, b: torch.relu(x * SCALE + b)  # noqa: E731
        variants = with_baselines(device, ("bsr", dtype), eager, (x, bias),
                                  rungs(device, "fused_bias_scale_relu",
                                        lambda v: fusion.fused_bias_scale_relu(x, bias, SCALE, version=v), x))
        rows += bandwidth(device, ceiling, "fused_bias_scale_relu", dtype, shape, 2 * n * size, variants,
                          **{"pass": "forward", "save": "mask"})
        # What the forward saves: each choice's extra bytes written and the forward's time.
        for save in fusion.SAVE_CHOICES:
            variants = [("torch", lambda: eager(x, bias), {}),
                        ("default", lambda save=save: fusion.fused_bias_scale_relu(x, bias, SCALE, save=save), {})]
            rows += bandwidth(device, ceiling, "fused_bias_scale_relu", dtype, shape, 2 * n * size, variants,
                              **{"pass": "forward", "save": save, "sweep": True,
                                 "saved_bytes": fusion.saved_bytes(x, save)})
        # Backward: dx and dbias from dy and the saved tensor. Bytes: read dy and y, write dx.
        dy = torch.randn_like(x)
        y = eager(x, bias)

        def eager_bwd(dy, y):
            g = torch.ops.aten.threshold_backward(dy, y, 0)
            return g * SCALE, g.sum(0)
        for save in fusion.SAVE_CHOICES:
            saved = fusion.fused_bias_scale_relu_saved(x, bias, SCALE, save)
            ours = rungs(device, "fused_bias_scale_relu_backward",
                         lambda v, saved=saved, save=save: fusion.fused_bias_scale_relu_backward(
                             dy, saved, bias, SCALE, save, version=v), x)
            variants = with_baselines(device, ("bsr_bwd", dtype), eager_bwd, (dy, y), ours)
            rows += bandwidth(device, ceiling, "fused_bias_scale_relu", dtype, shape, 3 * n * size, variants,
                              **{"pass": "backward", "save": save})
        del x, dy, y
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# Activation functors: bias + GELU / GELU-tanh / SiLU, and SwiGLU
# ---------------------------------------------------------------------------------------------
def bench_activations(device, ceiling, s):
    rows = []
    dtype = torch.bfloat16
    size = element_size(dtype)
    shape = s["act"]
    x = torch.randn(shape, device=device, dtype=dtype)
    bias = torch.randn(shape[-1], device=device, dtype=dtype)
    n = x.numel()
    for name, (ours, eager) in ACTIVATIONS.items():
        op = "bias_gelu" if name.startswith("bias_gelu") else name
        extra = {"activation": name}
        variants = with_baselines(device, (name, "fwd"), eager, (x, bias),
                                  rungs(device, op, lambda v, ours=ours: ours(x, bias, version=v), x))
        rows += bandwidth(device, ceiling, op, dtype, shape, 2 * n * size, variants, **extra, **{"pass": "forward"})
        # Backward through autograd for every variant: the saved input and dy in, dx and dbias out.
        xg = x.detach().requires_grad_()
        bg = bias.detach().requires_grad_()
        dy = torch.randn_like(x)

        def backward_of(f):
            return bench.backward_call(f, (xg, bg), dy)
        variants = [("torch", backward_of(eager), {})]
        if device == "cuda":
            c = bench.compiled((name, "bwd"), eager)
            variants.append(("torch.compile", backward_of(c) if c else None, {}))
            variants += [(v, backward_of(lambda a, b, v=v, ours=ours: ours(a, b, version=v)), {})
                         for v in fusion.VERSIONS[op]]
        variants.append(("default" if device == "cuda" else "cpu", backward_of(lambda a, b, ours=ours: ours(a, b)), {}))
        rows += bandwidth(device, ceiling, op, dtype, shape, 3 * n * size, variants, **extra, **{"pass": "backward"})
        del xg, bg, dy
    del x, bias
    shape = s["swiglu"]
    x = torch.randn(shape, device=device, dtype=dtype)
    n = x.numel()

    def eager_swiglu(x):
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b
    variants = with_baselines(device, ("swiglu", "fwd"), eager_swiglu, (x,),
                              rungs(device, "swiglu", lambda v: fusion.swiglu(x, version=v), x))
    # Read x (n), write y (n / 2).
    rows += bandwidth(device, ceiling, "swiglu", dtype, shape, (n + n // 2) * size, variants, **{"pass": "forward"})
    xg = x.detach().requires_grad_()
    dy = torch.randn(shape[0], shape[1] // 2, device=device, dtype=dtype)

    def backward_of(f):
        return bench.backward_call(f, (xg,), dy)
    variants = [("torch", backward_of(eager_swiglu), {})]
    if device == "cuda":
        c = bench.compiled(("swiglu", "bwd"), eager_swiglu)
        variants.append(("torch.compile", backward_of(c) if c else None, {}))
        variants += [(v, backward_of(lambda a, v=v: fusion.swiglu(a, version=v)), {}) for v in fusion.VERSIONS["swiglu"]]
    variants.append(("default" if device == "cuda" else "cpu", backward_of(fusion.swiglu), {}))
    # Read dy (n / 2) and x (n), write dx (n).
    rows += bandwidth(device, ceiling, "swiglu", dtype, shape, (n // 2 + 2 * n) * size, variants, **{"pass": "backward"})
    return rows


# ---------------------------------------------------------------------------------------------
# LayerNorm, RMSNorm, fused add + RMSNorm
# ---------------------------------------------------------------------------------------------
NORMS = {
    "layer_norm": (lambda x, w, b, **kw: fusion.layer_norm(x, w, b, EPS, **kw),
                   lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, EPS)),
    "rms_norm": (lambda x, w, b, **kw: fusion.rms_norm(x, w, EPS, **kw),
                 lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w, EPS)),
}


def backward_rungs(op, x, w, b, dy):
    """Each backward rung alone, and version=None: the backward op on the statistics its
    forward saved."""
    if op == "layer_norm":
        _, mean, rstd = fusion.layer_norm_forward(x, w, b, EPS)
        call = lambda v: fusion.layer_norm_backward(dy, x, w, mean, rstd, version=v)  # noqa: E731
    else:
        _, rstd = fusion.rms_norm_forward(x, w, EPS)
        call = lambda v: fusion.rms_norm_backward(dy, x, w, rstd, version=v)  # noqa: E731
    rungs = [(v, (lambda v=v: call(v)), {}) for v in fusion.VERSIONS[f"{op}_backward"]]
    return rungs + [("default", lambda: call(None), {"dispatch": fusion.default_choice(f"{op}_backward", x)})]


def bench_norms(device, ceiling, s):
    rows = []
    dtype = torch.bfloat16
    size = element_size(dtype)
    for hidden in s["norm_hidden"]:
        shape = [s["norm_total"] // hidden, hidden]
        x = torch.randn(shape, device=device, dtype=dtype)
        w = torch.randn(hidden, device=device, dtype=dtype)
        b = torch.randn(hidden, device=device, dtype=dtype)
        n = x.numel()
        for op, (ours, eager) in NORMS.items():
            variants = with_baselines(device, (op, hidden, "fwd"), eager, (x, w, b),
                                      rungs(device, op, lambda v, ours=ours: ours(x, w, b, version=v), x))
            rows += bandwidth(device, ceiling, op, dtype, shape, 2 * n * size, variants,
                              **{"pass": "forward", "sweep": True})
            # Backward through autograd: x, dy in; dx, dweight (and dbias) out.
            params = (w, b) if op == "layer_norm" else (w,)
            xg = x.detach().requires_grad_()
            pg = [p.detach().requires_grad_() for p in params]
            dy = torch.randn_like(x)

            def backward_of(f, op=op):
                out = f(xg, *pg) if op == "layer_norm" else f(xg, pg[0], None)
                return lambda: torch.autograd.grad(out, (xg, *pg), dy, retain_graph=True)
            variants = [("torch", backward_of(eager), {})]
            if device == "cuda":
                c = bench.compiled((op, hidden, "bwd"), eager)
                variants.append(("torch.compile", backward_of(c) if c else None, {}))
                variants += backward_rungs(op, x, w, b, dy)
            # Ours through autograd, timed as torch's rows are; the rungs and `default` time
            # the backward op alone, so that the dispatch compares with its rungs like for like.
            variants.append(("default" if device == "cuda" else "cpu",
                             backward_of(lambda a, p, q, ours=ours: ours(a, p, q)),
                             {"call": "autograd"}))
            rows += bandwidth(device, ceiling, op, dtype, shape, 3 * n * size, variants,
                              **{"pass": "backward", "sweep": True})
            del xg, pg, dy
        del x
        if device == "cuda":
            torch.cuda.empty_cache()
    for hidden in s["add_norm_hidden"]:
        shape = [s["norm_total"] // hidden, hidden]
        x = torch.randn(shape, device=device, dtype=dtype)
        res = torch.randn_like(x)
        w = torch.randn(hidden, device=device, dtype=dtype)

        def eager_add_norm(x, res, w):
            h = x + res
            return F.rms_norm(h, (h.shape[-1],), w, EPS), h
        variants = with_baselines(device, ("add_rms", hidden), eager_add_norm, (x, res, w),
                                  rungs(device, "fused_add_rms_norm",
                                        lambda v: fusion.fused_add_rms_norm(x, res, w, EPS, version=v), x))
        # Read x and the residual, write the normed output and the new residual.
        rows += bandwidth(device, ceiling, "fused_add_rms_norm", dtype, shape, 4 * x.numel() * size, variants,
                          **{"pass": "forward", "sweep": True})
        del x, res
    return rows


# ---------------------------------------------------------------------------------------------
# linear_activation: a cuBLAS GEMM and a fused bias + activation epilogue
# ---------------------------------------------------------------------------------------------
def bench_linear(device, mm, s):
    rows = []
    dtype = torch.bfloat16
    k, n = s["linear_k"], s["linear_n"]
    w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    b = torch.randn(n, device=device, dtype=dtype)
    for m in s["linear_m"]:
        x = torch.randn(m, k, device=device, dtype=dtype)
        eager = lambda x, w, b: F.gelu(F.linear(x, w, b))  # noqa: E731
        variants = with_baselines(device, ("linear", m), eager, (x, w, b), [])
        # Parts of the eager chain, as torch rows with a `call` field (CONTRIBUTING.md, section 5).
        variants.insert(1, ("torch", lambda: F.linear(x, w, b), {"call": "F.linear"}))
        # The GEMM our op runs (no bias: the epilogue adds it), to split our time into GEMM and
        # epilogue and to see whether cuBLAS picks another kernel without the bias.
        variants.insert(2, ("torch", lambda: torch.mm(x, w.t()), {"call": "torch.mm"}))
        if device == "cuda":
            variants.insert(2, ("torch", lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True),
                                {"call": "torch._addmm_activation"}))
        variants += rungs(device, "linear_activation",
                          lambda v: fusion.linear_activation(x, w, b, "gelu", version=v),
                          torch.empty(m, n, dtype=dtype, device="meta"))  # the dispatch sees the GEMM's output

        def row(variant, t, t_torch, **fields):
            return bench.flops_row("linear_activation", variant, dtype, [m, k, n], 2 * m * n * k, t,
                                   mm["mm_TFLOPs"], t_torch, **fields)
        rows += bench.measure(device, row, variants, **{"pass": "forward", "activation": "gelu", "sweep": True})
        del x
    return rows


# ---------------------------------------------------------------------------------------------
# The shapes sweep (coursekit/shapes.py): every op at tokens x hidden sizes of real models and at
# odd hidden sizes, forward and backward, bf16, fp16 and fp32, against eager and torch.compile.
# linear_activation is left to its own rows: a GEMM decides its time.
# ---------------------------------------------------------------------------------------------
def _add_rms_norm_eager(x, res, w):
    h = x + res
    return F.rms_norm(h, (h.shape[-1],), w, EPS), h


def _swiglu_eager(x):
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


# op: (ours, eager, operands of x's shape beside x, parameters of hidden, grads, bytes per
# element of x's shape: forward, backward)
SHAPE_OPS = {
    "fused_bias_scale_relu": (lambda x, b: fusion.fused_bias_scale_relu(x, b, SCALE),
                              lambda x, b: torch.relu(x * SCALE + b), 0, 1, (0, 1), 2, 3),
    "bias_gelu": (lambda x, b: fusion.bias_gelu(x, b), lambda x, b: F.gelu(x + b), 0, 1, (0, 1), 2, 3),
    "layer_norm": (lambda x, w, b: fusion.layer_norm(x, w, b, EPS),
                   lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, EPS), 0, 2, (0, 1, 2), 2, 3),
    "rms_norm": (lambda x, w: fusion.rms_norm(x, w, EPS), lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS),
                 0, 1, (0, 1), 2, 3),
    "fused_add_rms_norm": (lambda x, r, w: fusion.fused_add_rms_norm(x, r, w, EPS), _add_rms_norm_eager, 1, 1,
                           (0, 1, 2), 4, 4),
}


def shape_cases(device, quick):
    cases = []
    for dtype in shapes.dtypes(quick):
        size = element_size(dtype)
        for tokens, hidden in shapes.token_shapes(quick):
            meta = torch.empty(tokens, hidden, dtype=dtype, device="meta")
            n = tokens * hidden
            for op, (ours, eager, rows_like, params, grads, fwd, bwd) in SHAPE_OPS.items():
                def make(tokens=tokens, hidden=hidden, dtype=dtype, rows_like=rows_like, params=params):
                    like = [torch.randn(tokens, hidden, dtype=dtype, device=device) for _ in range(1 + rows_like)]
                    return (*like, *[torch.randn(hidden, dtype=dtype, device=device) for _ in range(params)])
                choice = "rms_norm" if op == "fused_add_rms_norm" else op
                # The norms' forward rungs beside the default, to read the dispatch from.
                rungs = {}
                if op in ("layer_norm", "rms_norm") and device == "cuda":
                    rungs = {v: (lambda *a, v=v, op=op: NORMS[op][0](*a, version=v) if op == "layer_norm"
                                 else fusion.rms_norm(*a, EPS, version=v)) for v in fusion.VERSIONS[op]}
                cases.append(shapes.Case(op, dtype, (tokens, hidden), fwd * n * size, make, ours, eager,
                                         dispatch=fusion.default_choice(op, meta), rungs=rungs))
                cases.append(shapes.Case(op, dtype, (tokens, hidden), bwd * n * size, make, ours, eager,
                                         backward=True, grads=grads,
                                         dispatch=fusion.default_choice(f"{choice}_backward" if op != "bias_gelu"
                                                                        else "fused_bias_scale_relu_backward", meta)))
            # swiglu: x is [tokens, 2 * hidden], y [tokens, hidden]: read 2n, write n; the
            # backward reads dy (n) and x (2n) and writes dx (2n).
            wide = torch.empty(tokens, 2 * hidden, dtype=dtype, device="meta")

            def make_wide(tokens=tokens, hidden=hidden, dtype=dtype):
                return (torch.randn(tokens, 2 * hidden, dtype=dtype, device=device),)
            cases.append(shapes.Case("swiglu", dtype, (tokens, 2 * hidden), 3 * n * size, make_wide, fusion.swiglu,
                                     _swiglu_eager, dispatch=fusion.default_choice("swiglu", wide)))
            cases.append(shapes.Case("swiglu", dtype, (tokens, 2 * hidden), 5 * n * size, make_wide, fusion.swiglu,
                                     _swiglu_eager, backward=True, grads=(0,)))
    return cases


def shapes_figures(record, out_dir):
    ops = list(SHAPE_OPS) + ["swiglu"]
    fig, axes = plt.subplots(2, len(ops), figsize=(6 * len(ops), 9))
    for col, op in enumerate(ops):
        for row, p in enumerate(("forward", "backward")):
            shapes.plot(axes[row, col], record, op, p, x=lambda r: r["shape"][-1], xlabel="hidden size")
    return [plots.save(fig, out_dir / f"{CHAPTER}_shapes.png")]


# ---------------------------------------------------------------------------------------------
def make_figures(record, out_dir):
    s = record["sizes"]
    figures = []
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    for col, dtype in enumerate(("float32", "bfloat16")):
        for row, p in enumerate(("forward", "backward")):
            plots.plot_bars(axes[row, col], subset(record, **{"pass": p, "save": "mask"}),
                            "fused_bias_scale_relu", dtype, s["bsr"],
                            title=f"relu(x * s + bias) {p}, {dtype} {results.format_shape(s['bsr'])}\n"
                                  f"{results.label(record)}")
    figures.append(plots.save(fig, out_dir / f"{CHAPTER}_bias_scale_relu.png"))

    panels = [(op, p) for op in ("bias_gelu", "bias_silu", "swiglu") for p in ("forward", "backward")]
    fig, axes = plt.subplots(2, 3, figsize=(21, 9))
    for ax, (op, p) in zip(axes.T.flat, panels):
        shape = s["swiglu"] if op == "swiglu" else s["act"]
        match = {"pass": p} if op == "swiglu" else {"pass": p, "activation": op}
        plots.plot_bars(ax, subset(record, **match), op, "bfloat16", shape,
                        title=f"{op} {p}, bfloat16 {results.format_shape(shape)}\n{results.label(record)}")
    figures.append(plots.save(fig, out_dir / f"{CHAPTER}_activations.png"))

    fig, axes = plt.subplots(1, 5, figsize=(32, 4.8))
    for ax, (op, p) in zip(axes, [("layer_norm", "forward"), ("layer_norm", "backward"), ("rms_norm", "forward"),
                                  ("rms_norm", "backward"), ("fused_add_rms_norm", "forward")]):
        plots.plot_sweep(ax, subset(record, **{"pass": p}), op, "bfloat16", x=lambda r: r["shape"][1],
                         xlabel=f"hidden size ({s['norm_total']} elements in all)",
                         title=f"{op} {p}, bfloat16: {results.label(record)}")
    figures.append(plots.save(fig, out_dir / f"{CHAPTER}_norms.png"))

    fig, ax = plt.subplots(figsize=(8, 5))
    lin = [r for r in record["benchmarks"] if r["op"] == "linear_activation"]
    for variant in dict.fromkeys(results.column(r) for r in lin):
        pts = sorted((r["shape"][0], r["TFLOPs"]) for r in lin if results.column(r) == variant)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"M (rows of x); K = {s['linear_k']}, N = {s['linear_n']}, bfloat16")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"gelu(x @ W.T + b): {results.label(record)}")
    ax.legend(fontsize=8)
    figures.append(plots.save(fig, out_dir / f"{CHAPTER}_linear.png"))
    return figures + plots.cpu_vs_recorded(record, out_dir, CHAPTER, plot_comparison)


def plot_comparison(ax, record):
    """The panel a CPU run is drawn beside the recorded GPU run with: relu(x * s + bias)
    forward, float32."""
    plots.plot_bars(ax, subset(record, **{"pass": "forward", "save": "mask"}), "fused_bias_scale_relu",
                    "float32", record["sizes"]["bsr"])


def print_table(record):
    print(f"\n{CHAPTER} on {results.label(record)}; copy {record['ceilings']['copy_GBps']:.0f} GB/s, "
          f"bf16 matmul {record['ceilings'].get('mm_TFLOPs', 0):.0f} TFLOP/s")
    print(f"{'op':<24}{'pass':<9}{'dtype':<9}{'shape':<16}{'variant':<24}{'ms':>9}{'rate':>8}{'%ceil':>7}{'x torch':>8}")
    for r in record["benchmarks"]:
        rate, pct = (r["GBps"], r.get("pct_of_copy", 0)) if "GBps" in r else (r["TFLOPs"], r.get("pct_of_mm", 0))
        tag = " ".join(str(r[k]) for k in ("save", "activation") if k in r)
        print(f"{r['op']:<24}{r.get('pass', ''):<9}{r['dtype']:<9}{results.format_shape(r['shape']):<16}"
              f"{results.column(r)[:23]:<24}{r['median_ms']:>9.3f}{rate:>8.0f}{pct:>7.1f}{r.get('speedup_vs_torch', 1):>8.2f}"
              f"  {tag} {r.get('dispatch', '')}")


def main():
    device, quick, args = shapes.start(__doc__)
    if args.shapes:
        shapes.main(CHAPTER, shape_cases, __file__, shapes_figures, quick, args.ops, args.dtypes)
        return
    torch._dynamo.config.cache_size_limit = 256
    s = sizes_for(device, quick)
    ceilings = bench.copy_ceiling(device, n=2**28 if device == "cuda" and not quick else 2**20)
    mm = bench.matmul_ceiling(device, n=8192 if device == "cuda" and not quick else 256)
    ceilings.update(mm)
    ceiling = ceilings["copy_GBps"]
    rows = (bench_bias_scale_relu(device, ceiling, s) + bench_activations(device, ceiling, s)
            + bench_norms(device, ceiling, s) + bench_linear(device, mm, s))
    for r in rows:
        r.setdefault("sweep", False)
    extra = {"sizes": s, "headline_op": "fused_bias_scale_relu",
             "timing": {"statistic": "median", "reps": bench.MIN_REPS,
                        "method": "perf_counter" if device == "cpu" else
                        "CUDA graphs of 8 calls, CUDA events around each replay; every "
                        "memory-bound problem far above the L2 (2^26-2^28 elements); backward "
                        "rows of torch, torch.compile and the rows with "
                        "call=autograd time autograd.grad over a retained graph; the norms' "
                        "backward rungs and their default time the backward op alone"}}
    results.publish(CHAPTER, rows, ceilings, extra, make_figures, print_table)
    if not args.no_shapes:
        shapes.main(CHAPTER, shape_cases, __file__, shapes_figures, quick, args.ops, args.dtypes)


if __name__ == "__main__":
    main()
