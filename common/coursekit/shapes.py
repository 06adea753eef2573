"""The shapes sweep: every chapter's ops at the shapes models run, against PyTorch eager and
torch.compile side by side in one run.

A chapter's benchmark samples a few sizes, mostly powers of two, because that is where its
ladder is easiest to read. A learner runs whatever a model has: 2048 tokens of hidden 5120,
rows of a 50257-entry vocabulary, a (1000003, 3) tensor summed over dim 0. This module is the
one driver of that sweep for chapters 1-5: each chapter's benchmark lists its cases
(shape_cases() in bench_*.py, built from the shape lists below), and run() measures them and
writes results/<device-slug>/<chapter>_shapes.json.

Every row carries "sweep": "shapes", its variant ("default": version=None, with the path it
dispatched to; "torch": eager PyTorch; "torch.compile": the same eager function compiled), its
pass for differentiable ops, and `bytes`, the napkin-math minimum (each input read once, each
output written once), so GB/s and % of copy compare variants by time.

Timing: a CUDA graph of calls rotating over input sets (bench.time_cuda_graph), so small
problems are not measured with their inputs still in the L2 from the previous call, with at
most MAX_SETS sets (inputs below ~1.6 MB then rotate through less than twice the L2: such
shapes are partly served from the L2, as in a model whose activations are that small).

torch.compile: one compile per op, pass, dtype and every size but the first (rows, tokens), which
is marked dynamic, as torch.compile itself does for a model whose batch changes from call to
call: the row length (hidden size, vocabulary) stays a constant in the generated kernel, as in
a model, and each row length gets a kernel of its own. Compiled only where a shape moves at
least MIN_BYTES (the shapes the target holds); the rows record the seconds the first call took
(`compile_s`). Chapters 1 and 2 compare with eager PyTorch alone (Case(compiled=False)): their
ops are one PyTorch kernel each, and the target there is eager's speed.
"""
import argparse
import importlib.util
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch

from . import bench, results

SWEEP = "shapes"

# Tokens (rows) by hidden size: the elementwise ops and norms of chapters 1, 4 and 5. Tokens
# largest first: the first call of a compiled function decides its kernel's size hints.
TOKENS = (8192, 2048, 64, 1)
HIDDEN = (768, 1024, 2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192, 12288, 16384)
# Not multiples of 8: every row of a 2-byte tensor then starts at another 16-byte alignment.
ODD_HIDDEN = (777, 4099)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Softmax rows (chapter 3): vocabularies (GPT-2 50257, Llama 2 32000, Llama 3 128256, Qwen 2
# 151936, Gemma 256000), lengths one past a power of two, and odd and prime lengths; each at
# ROWS_ELEMENTS elements and at few rows (decoding one to a few sequences).
ROW_LENGTHS = (1000, 1025, 4097, 32000, 50257, 128256, 151936, 256000)
ODD_ROW_LENGTHS = (777, 7919)
FEW_ROWS = (64, 8, 1)
ROWS_ELEMENTS = 2**26

# The target holds shapes that move at least this much; below it a call is a few microseconds of
# launch and latency for every variant.
MIN_BYTES = 2**20
MAX_SETS = 64


def dtypes(quick):
    return (torch.float32,) if quick else DTYPES


def token_shapes(quick):
    """(tokens, hidden) of every elementwise and norm case."""
    if quick:
        return [(t, h) for t in (64, 1) for h in (768, 777)]
    return [(t, h) for t in TOKENS for h in HIDDEN + ODD_HIDDEN]


def row_shapes(quick):
    """(rows, n) of every softmax case: ROWS_ELEMENTS elements, then few rows."""
    if quick:
        return [(8, 777), (4, 1025), (1, 4097)]
    out = []
    for n in ROW_LENGTHS + ODD_ROW_LENGTHS:
        for rows in (max(1, ROWS_ELEMENTS // n),) + FEW_ROWS:
            if (rows, n) not in out:
                out.append((rows, n))
    return out


def element_size(dtype):
    return torch.empty((), dtype=dtype).element_size()


class Case:
    """One measurement of the sweep: op at shape and dtype, one pass.

    make() returns one set of inputs (a tuple); default(*inputs) and eager(*inputs) compute the
    op (a tensor or a tuple of tensors). For pass="backward", grads names the inputs that get a
    gradient: what a row times is autograd.grad over the forward's graph. dispatch is what
    version=None runs at this shape (recorded beside the default row); dynamic lists the dims of
    the inputs that torch.compile treats as sizes that change; compiled=False leaves torch.compile
    out (chapters 1 and 2, whose ops are single PyTorch kernels: eager is the baseline, and the
    compiles were most of their sweep's time); fields go into every row."""

    def __init__(self, op, dtype, shape, nbytes, make, default, eager, *, backward=False, grads=(),
                 dispatch=None, dynamic=(0,), rungs=None, compiled=True, **fields):
        self.op, self.dtype, self.shape, self.bytes = op, dtype, list(shape), int(nbytes)
        self.make, self.default, self.eager = make, default, eager
        # rungs: {version: callable}, rows of the ladder beside the default, where a sweep should
        # show which rung a shape wants (the dispatch is then read from them)
        self.rungs = rungs or {}
        self.backward, self.grads, self.dispatch, self.dynamic = backward, tuple(grads), dispatch, tuple(dynamic)
        self.compiled = compiled
        self.fields = fields

    @property
    def pass_name(self):
        return "backward" if self.backward else "forward"

    def compile_key(self):
        """Cases that share one compiled function: the same op, pass, dtype and fields, and the
        same sizes in every dim that is not dynamic."""
        static = tuple(s for d, s in enumerate(self.shape) if d not in self.dynamic)
        return (self.op, self.pass_name, str(self.dtype), static, tuple(sorted(self.fields.items(), key=str)))


def _tensors(out):
    return tuple(t for t in (out if isinstance(out, (tuple, list)) else (out,)) if torch.is_tensor(t))


def _set_bytes(inputs):
    return sum(t.numel() * t.element_size() for t in inputs if torch.is_tensor(t))


def _mark_dynamic(inputs, dims):
    """The dynamic dims of the inputs that have rows: a 1-D parameter (a bias, a weight) is one
    row of the hidden size, which stays a constant in the kernel as in a model."""
    for t in inputs:
        if torch.is_tensor(t) and t.dim() > 1:
            for d in dims:
                if d < t.dim() and t.shape[d] > 1:  # a size of 1 is always specialized
                    torch._dynamo.mark_dynamic(t, d)


def _calls(case, fn, sets):
    """call(i) for input set i: the forward, or the backward over a forward run once here."""
    if not case.backward:
        return lambda i: fn(*sets[i])
    prepared = []
    for inputs in sets:
        leaves = tuple(t.detach().requires_grad_() if k in case.grads else t for k, t in enumerate(inputs))
        # The forward runs once, on the stream the graphs are captured on: autograd runs each
        # backward op on its forward op's stream (bench.capture_stream says why that matters).
        if leaves[0].is_cuda:
            stream = bench.capture_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                outs = _tensors(fn(*leaves))
            torch.cuda.current_stream().wait_stream(stream)
        else:
            outs = _tensors(fn(*leaves))
        outs = tuple(o for o in outs if o.requires_grad)  # statistics (mean, rstd) carry none
        prepared.append((outs, tuple(leaves[k] for k in case.grads), tuple(torch.randn_like(o) for o in outs)))
    return lambda i: torch.autograd.grad(prepared[i][0], prepared[i][1], prepared[i][2], retain_graph=True)


# Replays per measurement: each replay runs at least 8 calls, and the median of 10 replays is
# what the sweep's thousands of measurements can afford (the chapters' own rows take 20-30).
REPS = 10


def _time(device, call, sets):
    if device == "cuda":
        return bench.time_cuda_graph(call, sets, reps=REPS)
    return bench.time_cpu(lambda: call(0), reps=REPS)


_compiled = {}


def compiled(case):
    """The compiled eager function of case's compile key (one torch.compile object per key)."""
    key = case.compile_key()
    if key not in _compiled:
        _compiled[key] = torch.compile(case.eager, dynamic=None)
    return _compiled[key]


def configure_dynamo():
    """Dims are dynamic only where the sweep marks them (not after a recompile by themselves),
    and a function may be compiled for every row length without Dynamo giving up on it."""
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.cache_size_limit = 4096
    torch._dynamo.config.accumulated_cache_size_limit = 1 << 16


def measure(case, device, ceiling):
    """The rows of one case: torch, torch.compile (CUDA, shapes of at least MIN_BYTES, where the
    case compares with it), default."""
    first = case.make()
    sets_n = 1
    if device == "cuda":
        sets_n = max(1, min(MAX_SETS, bench.rotation_sets(_set_bytes(first))))
    sets = [first] + [case.make() for _ in range(sets_n - 1)]
    variants = [("torch", case.eager, {})]
    if device == "cuda" and case.bytes >= MIN_BYTES and case.compiled:
        variants.append(("torch.compile", None, {"compile": "dims " + ",".join(map(str, case.dynamic)) + " dynamic"
                                                  if case.dynamic else "static"}))
    variants.append(("default", case.default, {"dispatch": case.dispatch} if case.dispatch else {}))
    variants += [(name, fn, {}) for name, fn in case.rungs.items()]
    rows, t_torch = [], None
    for variant, fn, extra in variants:
        try:
            if variant == "torch.compile":
                fn = compiled(case)
                for inputs in sets:
                    _mark_dynamic(inputs, case.dynamic)
                start = time.perf_counter()
                call = _calls(case, fn, sets[:1])
                call(0)
                if device == "cuda":
                    torch.cuda.synchronize()
                extra = {**extra, "compile_s": round(time.perf_counter() - start, 2)}
            timing = _time(device, _calls(case, fn, sets), len(sets))
        except Exception as e:  # noqa: BLE001  (a compile that fails: the row is left out, said)
            print(f"  {case.op} {case.pass_name} {case.dtype} {case.shape} {variant} failed: "
                  f"{str(e).splitlines()[0][:200] if str(e) else type(e).__name__}")
            if device == "cuda":
                torch.cuda.synchronize()
            continue
        if variant == "torch":
            t_torch = timing["median_ms"]
        rows.append(bench.bandwidth_row(case.op, variant, case.dtype, case.shape, case.bytes, timing, ceiling,
                                        t_torch, **{"pass": case.pass_name, "sweep": SWEEP, **case.fields,
                                                    **extra}))
    del sets
    return rows


def _worker_cases(bench_file, device, quick, libraries, ops):
    """A precompile worker's copy of the chapter's cases (the chapter's ops library loaded from
    the file the main process loaded, never built again)."""
    global _worker_state
    if "_worker_state" not in globals():
        for path in libraries:
            torch.ops.load_library(path)
        spec = importlib.util.spec_from_file_location("shapes_bench", bench_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        configure_dynamo()
        # Autotuning here would run beside the other workers on one GPU: the main process
        # autotunes by itself, alone, from the kernels compiled here.
        torch._inductor.config.autotune_local_cache = False
        _worker_state = select(module.shape_cases(device, quick), *ops)
    return _worker_state


def _precompile_one(args):
    bench_file, device, quick, libraries, ops, index = args
    case = _worker_cases(bench_file, device, quick, libraries, ops)[index]
    try:
        inputs = case.make()
        _mark_dynamic(inputs, case.dynamic)
        _calls(case, compiled(case), [inputs])(0)
        if device == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001  (the main process compiles it again, and reports)
        return f"{case.op} {case.shape}: {str(e).splitlines()[0][:160] if str(e) else type(e).__name__}"


def precompile(cases, bench_file, quick, jobs, ops=("", ""), device="cuda"):
    """Compile every compile key's first case in `jobs` worker processes, so that the main
    process finds the generated kernels in Inductor's caches (on disk) instead of spending
    seconds per shape compiling them one after the other. Only compilation moves to the
    workers: every measurement is made by the main process, alone on the GPU."""
    firsts, seen = [], set()
    for i, case in enumerate(cases):
        if case.bytes >= MIN_BYTES and case.compiled and case.compile_key() not in seen:
            seen.add(case.compile_key())
            firsts.append(i)
    if jobs <= 1 or not firsts:
        return
    libraries = [str(p) for p in torch.ops.loaded_libraries]
    start = time.perf_counter()
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        failed = [m for m in pool.map(_precompile_one, [(str(bench_file), device, quick, libraries, ops, i)
                                                        for i in firsts]) if m]
    print(f"precompiled {len(firsts)} functions in {jobs} processes in {time.perf_counter() - start:.0f} s"
          + (f"; {len(failed)} failed (compiled again below): {failed[:3]}" if failed else ""))


def run(chapter, cases, device, bench_file, quick=False, jobs=None, ops=("", "")):
    """Measure every case and write results/<slug>/<chapter>_shapes.json; returns the record."""
    configure_dynamo()
    ceilings = bench.copy_ceiling(device, n=2**28 if device == "cuda" and not quick else 2**20)
    if device == "cuda":
        jobs = jobs if jobs is not None else int(os.environ.get("COURSE_COMPILE_JOBS", min(8, (os.cpu_count() or 2) // 2)))
        precompile(cases, bench_file, quick, jobs, ops)
    rows, start = [], time.perf_counter()
    # COURSE_SHAPES_DEADLINE (seconds since the epoch): stop taking new cases then and write what
    # was measured, marked incomplete (a time-boxed run on a borrowed GPU).
    deadline = float(os.environ.get("COURSE_SHAPES_DEADLINE", "inf"))
    measured = 0
    for k, case in enumerate(cases):
        if time.time() > deadline:
            print(f"deadline reached after {measured} of {len(cases)} cases")
            break
        rows += measure(case, device, ceilings["copy_GBps"])
        measured += 1
        if device == "cuda" and (k % 16 == 15 or case.bytes > 2**28):
            torch.cuda.empty_cache()
    seconds = time.perf_counter() - start
    extra = {"min_bytes": MIN_BYTES, "max_sets": MAX_SETS, "sweep_seconds": round(seconds, 1),
             "ops": sorted({c.op for c in cases}), "dtypes": sorted({str(c.dtype).replace("torch.", "") for c in cases}),
             "complete": measured == len(cases),
             "timing": {"statistic": "median", "reps": REPS,
                        "method": "perf_counter" if device != "cuda" else
                        "CUDA-graph replays of calls rotating over input sets (at most "
                        f"{MAX_SETS}); backward rows time autograd.grad over a retained graph"}}
    path = results.write_results(f"{chapter}_shapes", rows, ceilings, **extra)
    print(f"{chapter} shapes sweep: {len(cases)} cases, {len(rows)} rows in {seconds:.0f} s -> {path}")
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------
# Reading the sweep: the target, the worst and best shapes, the plot
# ---------------------------------------------------------------------------------------------
def _groups(record, ops=None):
    groups = {}
    for r in record["benchmarks"]:
        if r.get("sweep") == SWEEP and (ops is None or r["op"] in ops):
            key = results.measurement_key({k: v for k, v in r.items() if k not in ("compile", "compile_s")})
            groups.setdefault(key, {})[r["variant"]] = r
    return list(groups.values())


def ratios(record, ops=None, min_bytes=0):
    """[(ratio, default row, baseline row)]: the faster of eager and torch.compile over the
    default, at every measured shape moving at least min_bytes (above 1: the default is faster)."""
    out = []
    for by in _groups(record, ops):
        default = by.get("default")
        base = [by[v] for v in ("torch", "torch.compile") if v in by]
        if default is None or not base or default["bytes"] < min_bytes:
            continue
        best = min(base, key=lambda r: r["median_ms"])
        out.append((best["median_ms"] / default["median_ms"], default, best))
    return out


def where(row):
    """"softmax forward bfloat16 8192x777" and the fields that tell rows apart."""
    extra = "".join(f" {k}={row[k]}" for k in ("dim", "layout", "save", "activation") if k in row)
    return f"{row['op']} {row.get('pass', 'forward')} {row['dtype']} {'x'.join(map(str, row['shape']))}{extra}"


def gaps(record, ratio=0.95, ops=None, min_bytes=MIN_BYTES):
    """Where the default is slower than `ratio` x the faster of eager and torch.compile at a shape
    moving at least min_bytes, and shapes with no default row: human-readable, empty when the
    sweep holds the target everywhere."""
    problems = []
    for by in _groups(record, ops):
        any_row = next(iter(by.values()))
        if any_row["bytes"] >= min_bytes and "default" not in by:
            problems.append(f"{where(any_row)}: no default row")
    for r, default, best in ratios(record, ops, min_bytes):
        if r < ratio:
            problems.append(f"{where(default)}: default {default['median_ms'] * 1e3:.1f} us is {r:.3f}x "
                            f"{best['variant']} ({best['median_ms'] * 1e3:.1f} us)")
    return problems


def baseline(record):
    """What a sweep's default is held against: "the faster of eager and torch.compile", or "eager"
    where the sweep measured no torch.compile (chapters 1 and 2: Case(compiled=False))."""
    compiled = record is not None and any(r.get("sweep") == SWEEP and r["variant"] == "torch.compile"
                                          for r in record["benchmarks"])
    return "the faster of eager and torch.compile" if compiled else "eager"


def expect_target(record, command):
    """What a chapter's test_recorded_shapes_sweep_holds_the_target ends with: passes when the
    committed sweep holds the target everywhere; otherwise an expected failure (pytest.xfail)
    that names how many shapes miss it and the worst of them, so that the suite stays green
    while the misses stay in its report (pytest -rx) and in the chapter's lesson. No sweep
    recorded yet is such a failure too: `command` on a GPU records it."""
    import pytest

    if record is None:
        pytest.xfail(f"no recorded shapes sweep: run {command} on a GPU")
    problems = gaps(record)
    partial = "" if record.get("complete", True) else (
        f" (a partial sweep: {', '.join(record.get('ops', []))} in {', '.join(record.get('dtypes', []))})")
    if problems:
        worst = min(ratios(record, None, MIN_BYTES), key=lambda t: t[0])
        pytest.xfail(f"{len(problems)} shapes below 0.95x {baseline(record)}{partial}; "
                     f"worst {where(worst[1])} at {worst[0]:.2f}x {worst[2]['variant']}: the target is not met")
    assert partial == "", f"the sweep holds the target where it was measured, but is partial{partial}"


def stale_dispatch(record, choice):
    """Default rows whose recorded dispatch is not what choice(row) says the code picks today
    (results older than the dispatch): human-readable, empty when every one still holds (or
    no sweep is recorded)."""
    if record is None:
        return []
    return [f"{where(r)}: recorded {r['dispatch']}, today {choice(r)}" for r in record["benchmarks"]
            if r.get("sweep") == SWEEP and r["variant"] == "default" and "dispatch" in r
            and r["dispatch"] != choice(r)]


def meta_like(row):
    """A meta tensor of a row's shape and dtype: what a dispatch rule needs to answer for it."""
    return torch.empty(row["shape"], dtype=getattr(torch, row["dtype"]), device="meta")


def extremes(record, ops=None, min_bytes=MIN_BYTES):
    """(worst, best): (ratio, default row, baseline row) at the lowest and highest ratio."""
    rs = ratios(record, ops, min_bytes)
    if not rs:
        return None, None
    return min(rs, key=lambda x: x[0]), max(rs, key=lambda x: x[0])


def summary(record, ops=None, min_bytes=MIN_BYTES):
    """One sentence for a lesson: how many shapes, the worst and the best against the faster of
    eager and torch.compile (and where the target is missed, how many)."""
    if record is None:
        return "not measured yet: run the chapter's benchmark with --shapes on a GPU"
    rs = ratios(record, ops, min_bytes)
    if not rs:
        return "no shape of the sweep moved enough bytes to count"
    (lo, lo_d, lo_b), (hi, hi_d, hi_b) = extremes(record, ops, min_bytes)
    misses = sum(1 for r, _, _ in rs if r < 0.95)
    where_run = f"{record['device']['name']}, {record['date'][:10]}"
    return (f"over {len(rs)} measurements of at least {min_bytes // 2**20} MiB, the default is at worst "
            f"{lo:.2f}x {baseline(record)} ({where(lo_d)}, against {lo_b['variant']}) and at "
            f"best {hi:.2f}x ({where(hi_d)}, against {hi_b['variant']}); "
            + (f"{misses} below 0.95x" if misses else "none below 0.95x") + f" ({where_run})")


def plot(ax, record, op, pass_name="forward", title=None, x=None, xlabel=None, min_bytes=MIN_BYTES):
    """Ratio (the faster of eager and torch.compile over the default; above 1 the default is
    faster) against a size of the shape, one marker series per dtype; the worst point named."""
    x = x or (lambda r: r["shape"][-1])
    rs = [t for t in ratios(record, (op,), 0) if t[1].get("pass", "forward") == pass_name]
    markers = {"bfloat16": "o", "float16": "s", "float32": "^"}
    for dtype in ("bfloat16", "float16", "float32"):
        pts = [(x(d), r, d["bytes"] >= min_bytes) for r, d, _ in rs if d["dtype"] == dtype]
        if not pts:
            continue
        big = [(a, b) for a, b, counted in pts if counted]
        small = [(a, b) for a, b, counted in pts if not counted]
        if big:
            ax.scatter([p[0] for p in big], [p[1] for p in big], marker=markers[dtype], s=18, label=dtype)
        if small:
            ax.scatter([p[0] for p in small], [p[1] for p in small], marker=markers[dtype], s=18,
                       facecolors="none", edgecolors="grey", label=f"{dtype}, < {min_bytes // 2**20} MiB")
    counted = [t for t in rs if t[1]["bytes"] >= min_bytes]
    if counted:
        r, d, b = min(counted, key=lambda t: t[0])
        ax.annotate(f"worst: {'x'.join(map(str, d['shape']))} {d['dtype']}\n{r:.2f}x {b['variant']}",
                    (x(d), r), fontsize=7, xytext=(5, -18), textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(0.95, color="tab:red", linestyle=":", linewidth=0.8, label="0.95x (the target)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel or "row length (last dim)")
    ax.set_ylabel(("faster of eager and torch.compile" if baseline(record) != "eager" else "eager") + " / default")
    ax.set_title(title or f"{op} {pass_name}: {results.label(record)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)


def load(chapter):
    """The newest recorded GPU shapes sweep of a chapter, or None."""
    return results.load_recorded_gpu(f"{chapter}_shapes")


def lesson_block(chapter, ops=None, worst=6):
    """A chapter README's shapes-sweep paragraph (lesson_facts.py): the summary sentence, the
    worst shapes against the faster of eager and torch.compile, and the plot."""
    record = load(chapter)
    if record is None:
        return f"Shapes sweep: {summary(None)}."
    slug = results.device_slug(record["device"])
    lines = [f"Shapes sweep (`--shapes`, "
             f"{len([r for r in record['benchmarks'] if r.get('sweep') == SWEEP])} rows"
             + ("" if record.get("complete", True) else ", a partial run: " + ", ".join(record.get("ops", []))
                + " in " + ", ".join(record.get("dtypes", [])))
             + f"): {summary(record, ops)}.", ""]
    rs = sorted(ratios(record, ops, MIN_BYTES), key=lambda t: t[0])
    if rs:
        against = "faster of eager / compile" if baseline(record) != "eager" else "eager"
        lines += [f"| worst shapes | dispatch | default us | {against} us | ratio |", "|---|---|---|---|---|"]
        for r, d, b in rs[:worst]:
            lines.append(f"| {where(d)} | {d.get('dispatch', '-')} | {d['median_ms'] * 1e3:.1f} | "
                         f"{b['median_ms'] * 1e3:.1f} ({b['variant']}) | {r:.2f}x |")
        lines.append("")
    lines.append(f"![ratio against shape](../results/{slug}/{chapter}_shapes.png)")
    return "\n".join(lines)


def add_arguments(parser):
    """The sweep's switches on a chapter benchmark's command line."""
    parser.add_argument("--shapes", action="store_true", help="only the shapes sweep")
    parser.add_argument("--no-shapes", action="store_true", help="everything but the shapes sweep")
    parser.add_argument("--ops", default="", help="comma-separated ops of the shapes sweep (default: all)")
    parser.add_argument("--dtypes", default="", help="comma-separated dtypes of the shapes sweep (default: all)")


def start(doc):
    """bench.start with the sweep's switches: (device, quick, args)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU, smoke runs)")
    add_arguments(parser)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("No CUDA GPU: benchmarking the CPU path at small sizes; GPU numbers come from the "
              "recorded results.")
    return device, args.quick or device == "cpu", args


def select(cases, ops="", dtypes=""):
    """The cases of the ops and dtypes named (comma-separated; empty: all)."""
    if ops:
        cases = [c for c in cases if c.op in set(ops.split(","))]
    if dtypes:
        cases = [c for c in cases if str(c.dtype).replace("torch.", "") in set(dtypes.split(","))]
    return cases


def main(chapter, shape_cases, bench_file, make_figures=None, quick=False, ops="", dtypes=""):
    """What a chapter's `bench_*.py --shapes` runs: the sweep, its record and its figures.
    ops, dtypes: comma-separated lists to measure only those (a partial record)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    quick = quick or device == "cpu"
    cases = select(shape_cases(device, quick), ops, dtypes)
    record = run(chapter, cases, device, bench_file, quick, ops=(ops, dtypes))
    out_dir = results.RESULTS_DIR / results.device_slug(record["device"])
    figures = make_figures(record, out_dir) if make_figures else []
    problems = gaps(record)
    print(summary(record))
    for p in problems:
        print("  below target:", p)
    for f in figures:
        print("  wrote", f)
    return record


def fmt_shape(shape):
    return "x".join(map(str, shape))


def size_of(shape, dtype):
    return math.prod(shape) * element_size(dtype)
