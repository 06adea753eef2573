"""Benchmark harness: CUDA-event timing with warm-up, median and spread of >= 20 runs; for
problems small enough to sit in L2 or to be dominated by launch time, CUDA-graph replays over
rotating input sets; the copy ceiling measured in the same run; for sweeps whose variants may
refuse a shape (chapter 6), notes of what was skipped and why, and a probe that sizes each graph.
Bandwidth rows follow the results contract of CONTRIBUTING.md, section 5."""
import argparse
import math
import random
import statistics
import time
import warnings

import torch

MIN_REPS = 20


def device_info(device=None):
    if not torch.cuda.is_available():
        import platform
        return {"name": f"CPU {platform.processor() or platform.machine()}", "capability": None,
                "sms": None, "cpu_threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count, "l2_MB": props.L2_cache_size / 2**20,
            "memory_GiB": round(props.total_memory / 2**30, 1)}


def host_cpu():
    """The host's CPU model: host-side costs (launch overhead, build times) depend on it, so
    records that measure them carry it beside the GPU."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        return platform.processor() or platform.machine()


def summarize(samples_ms):
    s = sorted(samples_ms)
    q = statistics.quantiles(s, n=10) if len(s) >= 10 else [s[0]] * 9
    return {"median_ms": statistics.median(s), "min_ms": s[0], "max_ms": s[-1],
            "p10_ms": q[0], "p90_ms": q[-1], "reps": len(s)}


def time_cuda(fn, *, reps=30, warmup=5):
    """Median (and spread) of `reps` runs of fn(), each timed alone with CUDA events, launched
    back to back. Right for kernels long enough (>~0.1 ms) that the GPU, not the host's launch
    path, is the bottleneck, on working sets far above the L2."""
    reps = max(reps, MIN_REPS)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) for s, e in zip(starts, ends)])


def rotation_sets(input_bytes, device=None):
    """How many distinct input sets make a pass through all of them read more than twice the
    L2, so no call finds its inputs still cached by an earlier one."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, -(-2 * l2 // max(input_bytes, 1)))


_graph_timed = False


_capture_stream = None


def capture_stream():
    """The one stream every graph here is captured on. Autograd runs each backward op on the
    stream its forward op ran on: a forward run on the default stream makes the captured
    backward launch there, outside the capture. On the H100 (torch 2.11) the backward of eager
    relu(x * 2 + b) failed to capture that way ("operation failed due to a previous error
    during capture") and left the RNG unusable ("Offset increment outside graph capture"),
    and captured once its forward ran on this stream. backward_call runs its forward here."""
    global _capture_stream
    if _capture_stream is None:
        _capture_stream = torch.cuda.Stream()
    return _capture_stream


def capture_graph(call, sets, calls):
    """A CUDA graph of `calls` calls of call(i), i rotating over the `sets` input sets, captured on
    capture_stream() after a warm-up there (off the default stream, as torch.cuda.graph asks)."""
    side = capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(sets, 3)):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for i in range(calls):
            call(i % sets)
    return graph


def time_cuda_graph(call, sets, *, reps=MIN_REPS, min_calls=8):
    """Median time of one call(i) (i = input set), measured on a CUDA graph that replays
    max(sets, min_calls) calls rotating over the sets.

    For small problems an eager loop with an L2 flush measures the wrong thing: after the
    flush the GPU idles while the host launches the next kernel, so tens of microseconds of
    Python, dispatcher and checks land between the events (and on the H100 the first kernel
    after an idle spin ran erratically slow; chapter1_cuda_basics/NOTES.md). A graph launches
    all calls back to back from the GPU itself; rotating inputs keep the L2 cold for inputs,
    as a stream of different tensors would find it.

    The first such measurement of a process is made twice and the first discarded: on the
    H100 it came out 6-20% faster than any repeat of the same call, with a tight spread, for
    whatever was measured first (chapter1_cuda_basics/NOTES.md)."""
    global _graph_timed
    if not _graph_timed:
        _graph_timed = True
        time_cuda_graph(call, sets, reps=reps, min_calls=min_calls)
    calls = max(sets, min_calls)
    graph = capture_graph(call, sets, calls)
    graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    timing = summarize([s.elapsed_time(e) / calls for s, e in zip(starts, ends)])
    del graph
    return {**timing, "calls_per_replay": calls, "input_sets": sets}


def time_cpu(fn, *, reps=20, warmup=2):
    reps = max(reps, MIN_REPS)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return summarize(samples)


def time_fn(fn, device):
    return time_cuda(fn) if str(device).startswith("cuda") else time_cpu(fn)


def warm_up_gpu(seconds=1.0):
    """Keep the GPU busy for a while before anything is timed: an idle H100 sits at a low clock
    (345 MHz read by nvidia-smi before the chapter 1 tuning run) and takes a moment to settle."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


class Stopwatch:
    """Wall time of the intervals between start() and stop(), summed in .seconds; on CUDA the
    queue is drained at each edge, so the time is the GPU's work and not only the host's
    launching of it. For end-to-end runs (a training loop, a generator), not for one kernel."""

    def __init__(self, device):
        self.device, self.seconds, self.t0 = device, 0.0, None

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def start(self):
        self._sync()
        self.t0 = time.perf_counter()

    def stop(self):
        if self.t0 is not None:
            self._sync()
            self.seconds += time.perf_counter() - self.t0
            self.t0 = None


def copy_ceiling(device, n=2**28, dtype=torch.float32):
    """Device-to-device copy bandwidth (bytes read + bytes written): the memory ceiling.
    Measured first in every benchmark, after warming the GPU up."""
    if str(device).startswith("cuda"):
        warm_up_gpu()
    src = torch.randn(n, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), device)
    nbytes = 2 * n * src.element_size()
    return {"copy_GBps": gbps(nbytes, timing["median_ms"]), "copy_elements": n,
            "copy_dtype": str(dtype).replace("torch.", ""), "copy_median_ms": timing["median_ms"],
            **_flag("copy", timing)}


def matmul_ceiling(device, n=8192, dtype=torch.bfloat16):
    """What a plain n^3 matmul reaches (TFLOP/s): the compute ceiling that GEMM-bound rows are
    compared with, measured in the same run."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    timing = time_fn(lambda: a @ b, device)
    return {"mm_TFLOPs": tflops(2 * n**3, timing["median_ms"]), "mm_n": n,
            "mm_dtype": str(dtype).replace("torch.", ""), "mm_median_ms": timing["median_ms"],
            **_flag("mm", timing)}


def _flag(ceiling, timing):
    """{"<ceiling>_untrusted": reason} for a ceiling whose repeats spread too wide, else {}."""
    reason = untrusted(timing)
    return {f"{ceiling}_untrusted": reason} if reason else {}


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


# When a measurement cannot be trusted. A row more than CEILING_MARGIN times the ceiling
# measured in the same run did not measure what the ceiling did: its data sat in a cache (the
# GPU sweeps rotate their inputs so that it cannot; a CPU's caches hold a small sweep point), or
# other load slowed the ceiling. On the H100 the highest rows were 1.5x the copy (chapter 2's
# working-set rows, inside the 50 MB L2 on purpose). A median more than SPREAD_LIMIT times the
# fastest tenth of its repeats (p10) says that most repeats were slowed by something else: on
# the H100 no row's median was more than 1.34x its p10 (chapter 5's host-timed call overhead;
# kernels 1.21x), while on a 2-core machine under a load average of 7 a 2^22-element torch.add
# ran 1.8 ms in its p10 and 18 ms in its p90, and chapter 1's own vector_add, 1.7 ms in its
# p10, had a median of 6.5 ms.
CEILING_MARGIN = 2.0
SPREAD_LIMIT = 1.5


def untrusted(timing, pct_of_ceiling=None):
    """Why a measurement's figures cannot be trusted, or None: the ceiling check above, and the
    spread of its repeats. Rows carry the reason as `untrusted`, the ceilings as
    `copy_untrusted` / `mm_untrusted`; tables print no figure for such a row
    (results.for_print) and list the reasons instead."""
    reasons = []
    if pct_of_ceiling is not None and pct_of_ceiling > 100.0 * CEILING_MARGIN:
        reasons.append(f"{pct_of_ceiling / 100:.1f}x the ceiling measured in the same run (the data "
                       "sat in a cache, or other load slowed the ceiling)")
    if timing.get("p10_ms") and timing["median_ms"] / timing["p10_ms"] > SPREAD_LIMIT:
        reasons.append(f"the median is {timing['median_ms'] / timing['p10_ms']:.1f}x the fastest tenth of "
                       f"{timing['reps']} repeats (other load on the machine?)")
    return "; ".join(reasons) or None


def _row(op, variant, dtype, shape, timing, torch_ms, extra, work, rate, pct, ceiling):
    """A results row (CONTRIBUTING.md, section 5): `work` (bytes or flops) at `rate` per second,
    as `pct` of the ceiling measured in the same run, and the speedup over torch's time."""
    row = {"op": op, "variant": variant, "dtype": str(dtype).replace("torch.", ""),
           "shape": list(shape), **work, **timing, **rate}
    if ceiling:
        row[pct] = 100.0 * next(iter(rate.values())) / ceiling
    if torch_ms is not None:
        row["speedup_vs_torch"] = torch_ms / timing["median_ms"]
    row.update(extra)
    reason = untrusted(timing, row.get(pct))
    if reason:
        row["untrusted"] = reason
    return row


def flops_row(op, variant, dtype, shape, flops, timing, mm_TFLOPs, torch_ms=None, **extra):
    """One results row of a compute-bound op: TFLOP/s and % of the measured matmul rate."""
    return _row(op, variant, dtype, shape, timing, torch_ms, extra, {"flops": flops},
                {"TFLOPs": tflops(flops, timing["median_ms"])}, "pct_of_mm", mm_TFLOPs)


def gbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e9


def bandwidth_row(op, variant, dtype, shape, nbytes, timing, ceiling_GBps, torch_ms=None, **extra):
    """One results row. nbytes is the napkin-math minimum: each input read once, each output
    written once."""
    return _row(op, variant, dtype, shape, timing, torch_ms, extra, {"bytes": nbytes},
                {"GBps": gbps(nbytes, timing["median_ms"])}, "pct_of_copy", ceiling_GBps)


_compiled = {}


def compiled(key, fn):
    """torch.compile(fn) once per key; None where compilation is unavailable (no Triton here),
    so the benchmark goes on without the row."""
    if key not in _compiled:
        try:
            _compiled[key] = torch.compile(fn, dynamic=False)
        except Exception as e:  # noqa: BLE001
            print(f"torch.compile unavailable for {key}: {e}")
            _compiled[key] = None
    return _compiled[key]


def default_timer(device):
    """The timer of a benchmark's rows: on CUDA, a CUDA graph of 8 calls of one input set (for
    problems far above the L2; smaller ones need time_cuda_graph's rotating sets). Back-to-back
    events put the host's per-call path inside the GPU's time wherever that path is as long as
    the kernels: backward rows (autograd.grad walks the graph and launches several kernels),
    and on the H100 machine's CPU even chapter 4's norm backward, a fraction of a millisecond,
    came out slower through autograd.grad than alone, by an amount that changed from run to
    run. On the CPU, wall-clock time."""
    if device != "cuda":
        return lambda fn: time_fn(fn, device)

    def timer(fn):
        try:
            return time_cuda_graph(lambda i: fn(), 1)
        except RuntimeError as e:
            # A call that cannot be captured falls back to events and says so in its row. On the
            # H100 chapter 4's GELU-erf backward rows did, every variant, eager's too, with the
            # error a default-stream forward gives (capture_stream() above); whether that was
            # their cause, their next run will show.
            print(f"  graph capture failed ({str(e).splitlines()[0][:120]}); timing with events")
            torch.cuda.synchronize()
            return {**time_cuda(fn), "timer": "events (graph capture failed)"}
    return timer


def measure(device, row_fn, variants, **extra):
    """Rows for every (variant, callable, extra fields); the first variant is the torch
    baseline. row_fn(variant, timing, torch_ms, **fields) builds the row; default_timer times
    each variant."""
    rows, t_torch, timer = [], None, default_timer(device)
    for variant, fn, more in variants:
        if fn is None:
            continue
        try:
            t = timer(fn)
        except Exception as e:  # noqa: BLE001  (a torch.compile failure at its first call)
            print(f"  {variant} failed: {str(e).splitlines()[0][:200]}")
            continue
        t_torch = t_torch or t["median_ms"]
        rows.append(row_fn(variant, t, t_torch, **extra, **more))
    return rows


def backward_call(f, inputs, dy):
    """A callable that runs only the backward of f(*inputs), from dy, through autograd (the
    forward runs once, here): what a backward row times, graph and all kept for the repeats."""
    if dy.is_cuda:
        stream = capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = f(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
    else:
        out = f(*inputs)
    return lambda: torch.autograd.grad(out, inputs, dy, retain_graph=True)


# ---------------------------------------------------------------------------------------------
# Sweeps over variants that may refuse or take too long (chapter 6's benchmarks and profile): a
# refusal is noted once with where it first happened, never a crash of the run; each call is
# probed once before it is timed, and the probe sizes its graph.
# ---------------------------------------------------------------------------------------------
REPLAY_MS = 2.0  # a graph replay this long makes the replay's own launch cost negligible
GRAPH_CALLS = 8  # time_cuda_graph's default calls per replay: the most a probed call asks for
NO_KERNELS = "no CUDA kernels in this build yet"  # what a CPU-only build says to a CUDA tensor


def first_line(e):
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def refusal(e, caught):
    """Why a call refused, in one line: its exception's first line, then the UserWarnings it
    gave first. SDPA says why it refused a backend in warnings ("Flash attention requires ...")
    before it raises "No available kernel", so the warnings are the reason when there are any."""
    told = [first_line(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return first_line(e) + (" [" + "; ".join(dict.fromkeys(told)) + "]" if told else "")


class Notes:
    """The variants a sweep skipped: each reason recorded once, with the first place it happened
    (`skipped`, a list the results file keeps)."""

    def __init__(self):
        self.skipped = []
        self._seen = set()

    def skip(self, variant, reason, where):
        # "no CUDA kernels" names the op and device after the phrase: one note for all of them.
        key = (variant, NO_KERNELS if NO_KERNELS in reason else reason)
        if key in self._seen:
            return
        self._seen.add(key)
        self.skipped.append({"variant": variant, "reason": reason, "first_at": where})
        print(f"  {variant} skipped ({where}): {reason}")


def attempt(notes, variant, where, make):
    """make() under a record of warnings: its value, or None with the reason noted."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return make()
        except Exception as e:  # noqa: BLE001  (any refusal or failure skips the row, not the run)
            notes.skip(variant, refusal(e, caught), where)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return None


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def probe(fn, device):
    """One call to warm up (cuDNN builds its plan, the caching allocator fills), one timed by
    the wall clock, in ms: the estimate that sizes the graph and skips what is too slow to time."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def calls_per_replay(est_ms, target_ms=REPLAY_MS, most=GRAPH_CALLS):
    """How many calls one graph replay holds: enough to last target_ms (so the replay's launch,
    a few microseconds, is noise), at most `most`, at least one."""
    return max(1, min(most, math.ceil(target_ms / max(est_ms, 1e-3))))


def time_probed(device, fn, est_ms, *, sets=1, call=None):
    """default_timer with the calls per replay sized by the probe's est_ms: on the GPU a CUDA
    graph of max(sets, calls_per_replay) calls of call(i) over `sets` input sets (fn() when call
    is None; CUDA events if the capture fails, as default_timer does); on the CPU the wall clock,
    without a warm-up (the probe's two calls were one)."""
    if device != "cuda":
        return time_cpu(fn, warmup=0)
    try:
        return time_cuda_graph(call or (lambda i: fn()), sets, min_calls=calls_per_replay(est_ms))
    except RuntimeError as e:
        print(f"  graph capture failed ({first_line(e)[:120]}); timing with events")
        torch.cuda.synchronize()
        return {**time_cuda(fn), "timer": "events (graph capture failed)"}


def probe_noted(notes, variant, where, device, fn, *, max_call_ms=math.inf):
    """probe, or None with the reason noted: a refusal, or one call slower than max_call_ms, which
    is skipped rather than timed."""
    est = attempt(notes, variant, where, lambda: probe(fn, device))
    if est is not None and est > max_call_ms:
        notes.skip(variant, f"one call took over {max_call_ms:.0f} ms (here {est:.0f} ms); not timed", where)
        return None
    return est


def probe_and_time(notes, variant, where, device, fn, *, max_call_ms=math.inf, **how):
    """probe_noted, then time_probed (`how`: its sets and call), or None with the reason noted."""
    est = probe_noted(notes, variant, where, device, fn, max_call_ms=max_call_ms)
    if est is None:
        return None
    return attempt(notes, variant, where, lambda: time_probed(device, fn, est, **how))


def round_orders(n, reps, seed=0):
    """time_interleaved's orders: `reps` permutations of range(n), each round's drawn afresh from a
    seeded generator, so that every entry follows the others in turn, and runs repeat."""
    rng = random.Random(seed)
    orders = []
    for _ in range(reps):
        order = list(range(n))
        rng.shuffle(order)
        orders.append(order)
    return orders


def time_interleaved(notes, where, device, probed, *, reps=MIN_REPS):
    """The timings of [(variant, fn, est_ms)] (est from probe_noted), a list in the same order
    (None where a call failed, with the reason noted; two entries may share a variant's name),
    timed in rounds: each round replays every entry's CUDA graph once (calls_per_replay(est) calls
    of fn), in an order shuffled afresh each round (seeded: the same orders every run). Timed one
    after another, two timings of the same kernel in one run came out up to 10% apart on an H200
    (chapter 6's default row and its own rung's row): whatever drifts over a run, the clock above
    all, fell on whichever variant was timed then. In rounds it falls on all of them alike, and the
    ratios between rows are what the rows are for. Shuffled, because a kernel's time also depends
    on the one before it: in a fixed order flex_attention's window forward, always run after ours,
    took 10% longer than when its replays ran back to back, ours 4% (chapter 6's NOTES, "Timing in
    rounds"). On the CPU,
    rounds of one call each by the wall clock. An entry whose graph cannot be captured is timed
    alone afterwards with events, and its row says so (as time_probed's)."""
    orders = round_orders(len(probed), reps)
    if device != "cuda":
        samples = [[] for _ in probed]
        for order in orders:
            for i in order:
                t0 = time.perf_counter()
                probed[i][1]()
                samples[i].append((time.perf_counter() - t0) * 1e3)
        return [summarize(ms) for ms in samples]
    graphs, timed = {}, [None] * len(probed)
    for i, (variant, fn, est) in enumerate(probed):
        try:
            calls = calls_per_replay(est)
            graphs[i] = (capture_graph(lambda _: fn(), 1, calls), calls)
        except RuntimeError as e:
            print(f"  {variant}: graph capture failed ({first_line(e)[:120]}); timing with events")
            torch.cuda.synchronize()
    for graph, _ in graphs.values():  # one round untimed: the first replay of a graph pays its upload
        graph.replay()
    torch.cuda.synchronize()
    events = {i: [] for i in graphs}
    for order in orders:
        for i in (i for i in order if i in graphs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[i][0].replay()
            end.record()
            events[i].append((start, end))
    torch.cuda.synchronize()
    for i, pairs in events.items():
        calls = graphs[i][1]
        timed[i] = {**summarize([s.elapsed_time(e) / calls for s, e in pairs]), "calls_per_replay": calls,
                    "input_sets": 1, "timer": "graph, shuffled rounds"}
    del graphs
    for i, (variant, fn, _) in enumerate(probed):
        if timed[i] is None:
            timed[i] = attempt(notes, variant, where, lambda: {**time_cuda(fn), "timer": "events (graph capture failed)"})
    return timed


def time_calls_interleaved(notes, where, device, calls, *, max_call_ms=math.inf, where_of=None):
    """[(variant, fn, tag)]: each call probed (probe_noted: a refused or too slow call is noted and
    left out), then all timed together in shuffled rounds (time_interleaved). Returns [(variant, tag,
    timing)] of the calls timed, in their order; tag rides along (a row's fields). where_of(tag), if
    given, says where a call's probe note points (two calls may share a variant's name)."""
    probed, tags = [], []
    for variant, fn, tag in calls:
        est = probe_noted(notes, variant, where_of(tag) if where_of else where, device, fn, max_call_ms=max_call_ms)
        if est is not None:
            probed.append((variant, fn, est))
            tags.append(tag)
    times = time_interleaved(notes, where, device, probed)
    return [(variant, tag, t) for (variant, _, _), tag, t in zip(probed, tags, times) if t]


# torch's CPU threads for a benchmark on a machine without a GPU. One, as the end-to-end scripts'
# quick runs take (chapter6_flash_attention/train_tiny_gpt.py): on a 2-core machine shared with
# other work, torch's pool of two fought that work and itself for the cores, and the copy
# ceiling of chapter 1's benchmark came out at 1.1 GB/s in one run and 124 GB/s in the next,
# its rows at up to 65x "% of copy". One thread does not make a loaded machine quiet (the checks
# above still flag most rows there), but it is what every row, the ceiling's too, can count on.
CPU_THREADS = 1


def arguments(doc):
    """The command line every benchmark shares: --quick and --threads. A benchmark with flags of
    its own adds them to this parser and hands the parsed arguments to setup()."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU, smoke runs)")
    parser.add_argument("--threads", type=int, default=CPU_THREADS,
                        help=f"torch CPU threads when there is no GPU (default {CPU_THREADS}; 0: torch's own choice)")
    return parser


def setup(args):
    """The device a benchmark runs on; without a GPU, torch's CPU threads pinned to --threads."""
    if torch.cuda.is_available():
        return "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    print("No CUDA GPU: benchmarking the CPU path at small sizes on "
          f"{torch.get_num_threads()} torch thread(s); GPU numbers come from the recorded results.")
    return "cpu"


def start(doc):
    """The command line of a chapter's benchmark (`--quick`: small sizes, for CPU machines and
    smoke runs; `--threads`) and the device it runs on: (device, quick)."""
    args = arguments(doc).parse_args()
    return setup(args), args.quick
