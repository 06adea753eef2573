"""Where v5's launch shape comes from: vector_add in every launch shape, at every size.

v4 and v5 run one kernel, `elementwise_vectorized_ilp`, whose launch shape is two numbers:
threads per block, and 16-byte vectors each thread moves per input. v4 fixes them at 256 x 4.
This script times vector_add in every shape of {64, 128, 256, 512} threads x {1, 2, 4}
vectors (through the `tune_vector_add` op) at every size of the chapter's sweep, float32 and
bfloat16, next to torch.add, and prints for each size the fastest shape, v5's shape
(`kV5Launch` in elementwise.h), and how far v5 is from the fastest.

Timing is the sweep's: CUDA-graph replays over rotating input sets that together exceed twice
the L2, so every call reads from HBM and no host launch time sits between kernels. torch.add
is timed first and last at every size: the difference between the two is the noise floor
against which shapes should be compared.

    python tune_cuda_basics.py           writes results/<device-slug>/chapter1_cuda_basics_tuning.json
    python tune_cuda_basics.py --quick   three sizes only
"""
import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]
import torch  # noqa: E402
from coursekit import bench, results  # noqa: E402

import cuda_basics  # noqa: E402

CHAPTER = "chapter1_cuda_basics_tuning"
THREADS = (64, 128, 256, 512)
VECTORS = (1, 2, 4)
DTYPES = (torch.float32, torch.bfloat16)
FORWARD = {"pass": "forward"}  # vector_add is differentiable; this times its forward pass


def shape_name(threads, vectors):
    return f"{threads}x{vectors}"


def tune_size(n, dtype, ceiling):
    """Rows for torch.add (twice) and every launch shape at one size."""
    size = torch.empty((), dtype=dtype).element_size()
    sets = bench.rotation_sets(2 * n * size)
    pairs = [(torch.randn(n, dtype=dtype, device="cuda"), torch.randn(n, dtype=dtype, device="cuda"))
             for _ in range(sets)]
    nbytes = 3 * n * size

    def timed(fn):
        return bench.time_cuda_graph(lambda i: fn(*pairs[i]), sets)

    def row(variant, timing, torch_ms, **extra):
        return bench.bandwidth_row("vector_add", variant, dtype, [n], nbytes, timing, ceiling,
                                   torch_ms, sweep=True, **FORWARD, **extra)

    first = timed(torch.add)
    rows = [row("torch", first, first["median_ms"], repeat=0)]
    for threads in THREADS:
        for vectors in VECTORS:
            t = timed(lambda a, b: torch.ops.cuda_basics.tune_vector_add(a, b, threads, vectors))
            rows.append(row(shape_name(threads, vectors), t, first["median_ms"], threads=threads,
                            vectors=vectors))
    last = timed(torch.add)
    rows.append(row("torch", last, first["median_ms"], repeat=1))
    return rows


def summarize(record):
    """For each (dtype, size): the fastest shape, v5's shape, and torch."""
    table = []
    by_key = {}
    for r in record["benchmarks"]:
        by_key.setdefault((r["dtype"], r["shape"][0]), []).append(r)
    for (dtype, n), rs in sorted(by_key.items()):
        shapes = [r for r in rs if "threads" in r]
        best = min(shapes, key=lambda r: r["median_ms"])
        torch_rows = [r for r in rs if r["variant"] == "torch"]
        torch_ms = min(r["median_ms"] for r in torch_rows)
        noise = abs(torch_rows[0]["median_ms"] - torch_rows[-1]["median_ms"]) / torch_ms
        _, _, threads, per_thread = cuda_basics.default_choice(n, getattr(torch, dtype))
        vectors = per_thread * torch.empty((), dtype=getattr(torch, dtype)).element_size() // 16
        picked = next(r for r in shapes if (r["threads"], r["vectors"]) == (threads, vectors))
        table.append({"dtype": dtype, "n": n, "best": best["variant"],
                      "best_ms": best["median_ms"], "picked": picked["variant"],
                      "picked_ms": picked["median_ms"], "torch_ms": torch_ms,
                      "torch_noise": noise, "v4_ms": next(r["median_ms"] for r in shapes
                                                          if r["variant"] == "256x4")})
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="three sizes only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tune_cuda_basics.py times GPU launch shapes; no CUDA GPU is visible")
        return 0
    sizes = [2**16, 2**22, 2**28] if args.quick else [2**k for k in range(16, 29)]
    ceilings = bench.copy_ceiling("cuda")
    rows = []
    for dtype in DTYPES:
        for n in sizes:
            rows += tune_size(n, dtype, ceilings["copy_GBps"])
    path = results.write_results(CHAPTER, rows, ceilings, threads=list(THREADS),
                                 vectors=list(VECTORS), sizes=sizes)
    record = json.loads(path.read_text())
    table = summarize(record)
    print(f"\nlaunch shapes (threads x vectors per thread) on {results.label(record)}; "
          "times in us per call")
    print(f"{'dtype':<10}{'n':>6}{'torch':>9}{'noise':>7}{'v4 256x4':>10}{'best':>9}{'':>8}"
          f"{'v5':>9}{'':>8}{'v5/best':>12}{'torch/v5':>13}")
    for t in table:
        print(f"{t['dtype']:<10}{'2^' + str(t['n'].bit_length() - 1):>6}{t['torch_ms'] * 1e3:>9.2f}"
              f"{100 * t['torch_noise']:>6.1f}%{t['v4_ms'] * 1e3:>10.2f}{t['best']:>9}"
              f"{t['best_ms'] * 1e3:>8.2f}{t['picked']:>9}{t['picked_ms'] * 1e3:>8.2f}"
              f"{t['picked_ms'] / t['best_ms']:>12.3f}{t['torch_ms'] / t['picked_ms']:>13.3f}")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
