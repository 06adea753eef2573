"""Benchmark harness: CUDA-event timing with warm-up, median and spread of >= 20 runs, an L2
flush for working sets that would otherwise sit in cache, and the copy ceiling measured in the
same run. Bandwidth rows follow the results contract of CONVENTIONS.md section 5."""
import statistics
import time

import torch

MIN_REPS = 20
SPIN_CYCLES = 200_000  # ~0.1 ms at the 1.6-2 GHz SM clocks of current GPUs


def device_info(device=None):
    if not torch.cuda.is_available():
        import platform
        return {"name": f"CPU {platform.processor() or platform.machine()}", "capability": None,
                "sms": None, "cpu_threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count, "l2_MB": props.L2_cache_size / 2**20,
            "memory_GiB": round(props.total_memory / 2**30, 1)}


class L2Flusher:
    """Reads a buffer twice the L2 size between timed runs, so each run starts from HBM.

    A read, not a write: writing the buffer would leave L2 full of dirty lines whose write-back
    to HBM then happens inside the next timed run (measured on the H100: it cost the 2^28
    bf16 vector_add ~9% of its bandwidth). Reading evicts the previous run's data cleanly."""

    def __init__(self, device=None):
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        self.buffer = torch.ones(max(2 * l2, 2**20) // 4, dtype=torch.float32, device=device)

    def __call__(self):
        self.buffer.sum()


def summarize(samples_ms):
    s = sorted(samples_ms)
    q = statistics.quantiles(s, n=10) if len(s) >= 10 else [s[0]] * 9
    return {"median_ms": statistics.median(s), "min_ms": s[0], "max_ms": s[-1],
            "p10_ms": q[0], "p90_ms": q[-1], "reps": len(s)}


def time_cuda(fn, *, reps=30, warmup=5, flush=None):
    """Median (and spread) of `reps` runs of fn(), each timed alone with CUDA events.
    `flush` (e.g. an L2Flusher) runs before every timed run, outside the events."""
    reps = max(reps, MIN_REPS)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush()
            # The flush drains the GPU's queue; without more queued work, the host's time to
            # launch fn (Python, dispatcher, checks: tens of microseconds) would land between
            # the events and be counted as kernel time. A spin of ~0.1 ms keeps the GPU busy
            # while the host enqueues the start event and fn behind it.
            torch.cuda._sleep(SPIN_CYCLES)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) for s, e in zip(starts, ends)])


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


def time_fn(fn, device, **kw):
    return time_cuda(fn, **kw) if str(device).startswith("cuda") else time_cpu(fn)


def copy_ceiling(device, n=2**28, dtype=torch.float32):
    """Device-to-device copy bandwidth (bytes read + bytes written): the memory ceiling."""
    src = torch.randn(n, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), device)
    nbytes = 2 * n * src.element_size()
    return {"copy_GBps": gbps(nbytes, timing["median_ms"]), "copy_elements": n,
            "copy_dtype": str(dtype).replace("torch.", ""), "copy_median_ms": timing["median_ms"]}


def gbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e9


def bandwidth_row(op, variant, dtype, shape, nbytes, timing, ceiling_GBps, torch_ms=None, **extra):
    """One results row. nbytes is the napkin-math minimum: each input read once, each output
    written once."""
    row = {"op": op, "variant": variant, "dtype": str(dtype).replace("torch.", ""),
           "shape": list(shape), "bytes": nbytes, **timing,
           "GBps": gbps(nbytes, timing["median_ms"])}
    if ceiling_GBps:
        row["pct_of_copy"] = 100.0 * row["GBps"] / ceiling_GBps
    if torch_ms is not None:
        row["speedup_vs_torch"] = torch_ms / timing["median_ms"]
    row.update(extra)
    return row
