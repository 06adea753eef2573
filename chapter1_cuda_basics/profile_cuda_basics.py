"""Hardware-counter evidence for the lesson, read with Nsight Compute (ncu).

    python profile_cuda_basics.py          run ncu over this script's --workload, write
                                           results/<device-slug>/chapter1_cuda_basics_profile.json
    python profile_cuda_basics.py --workload   what ncu profiles: each version of vector_add
                                               once at 2^24 elements, float32 then bfloat16;
                                               then torch.add, v4 and v5 at 2^16, 2^20, 2^28

Per kernel: global-load sectors per request (4 for a coalesced fp32 warp, 32 when every lane
hits its own sector), load instructions, DRAM bytes against the napkin-math minimum, DRAM
throughput and achieved occupancy. Counters, not timings: ncu replays each kernel. The second
part records how torch.add's own kernel is launched (grid, block, registers; its template
arguments name the vector width) beside v4 and v5, at a small, a middle and a large size.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]

N = 2**24
DTYPES = ("float32", "bfloat16")
METRICS = {
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": "load_sectors",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": "load_requests",
    "smsp__inst_executed_op_global_ld.sum": "load_instructions",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct_of_peak",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "launch__grid_size": "grid_blocks",
    "launch__block_size": "block_threads",
    "launch__registers_per_thread": "registers_per_thread",
    "gpu__time_duration.sum": "duration_ns",
}
LAUNCH_SIZES = (2**16, 2**20, 2**28)
LAUNCH_VARIANTS = ("torch", "v4", "v5")
# Kernel template name -> version, most specific first.
# v4 and v5 run one template, told apart by its vectors-per-thread argument.
KERNELS = [("elementwise_vectorized_ilp<4,", "v4"), ("elementwise_vectorized_ilp<1,", "v5"),
           ("elementwise_vectorized<", "v3"), ("elementwise_grid_stride", "v2"),
           ("elementwise_thread_per_element", "v1"), ("elementwise_uncoalesced", "uncoalesced"),
           ("vectorized_elementwise_kernel", "torch")]


def workload():
    import torch
    import cuda_basics
    for dtype in DTYPES:
        a = torch.randn(N, device="cuda", dtype=getattr(torch, dtype))
        b = torch.randn(N, device="cuda", dtype=getattr(torch, dtype))
        for version in cuda_basics.VERSIONS["vector_add"]:
            cuda_basics.vector_add(a, b, version=version)
    for dtype in DTYPES:
        for n in LAUNCH_SIZES:
            a = torch.randn(n, device="cuda", dtype=getattr(torch, dtype))
            b = torch.randn(n, device="cuda", dtype=getattr(torch, dtype))
            torch.add(a, b)
            cuda_basics.vector_add(a, b, version="v4")
            cuda_basics.vector_add(a, b, version="v5")
    torch.cuda.synchronize()


def main():
    from coursekit import ncu, results
    # Our namespace and torch.add's kernel, not just "elementwise_": torch's randn runs a kernel
    # named distribution_elementwise_grid_stride_kernel.
    profile = ncu.workload_or_profile(__doc__, __file__, workload,
                                      "cuda_basics::|vectorized_elementwise_kernel", METRICS)
    if profile is None:
        return
    kernels = profile.kernels
    import cuda_basics
    rows = []
    expected = [(d, v) for d in DTYPES for v in cuda_basics.VERSIONS["vector_add"]]
    launches = [(d, n, v) for d in DTYPES for n in LAUNCH_SIZES for v in LAUNCH_VARIANTS]
    if len(kernels) != len(expected) + len(launches):
        sys.exit(f"expected {len(expected) + len(launches)} profiled kernels, got {len(kernels)}")
    for (dtype, n, version), k in zip(launches, kernels[len(expected):]):
        assert next(v for name, v in KERNELS if name in k["kernel"]) == version, k["kernel"]
        rows.append({"op": "vector_add_launch", "variant": version, "dtype": dtype, "shape": [n],
                     "kernel": k["kernel"], **{m: k.get(m) for m in METRICS.values()},
                     "elements_per_thread": n / (k["grid_blocks"] * k["block_threads"])})
    for (dtype, version), k in zip(expected, kernels):
        found = next(v for name, v in KERNELS if name in k["kernel"])
        assert found == version, (found, version, k["kernel"])
        size = 4 if dtype == "float32" else 2
        rows.append({"op": "vector_add", "variant": version, "dtype": dtype, "shape": [N],
                     **{m: k.get(m) for m in METRICS.values()},
                     "sectors_per_request": k["load_sectors"] / k["load_requests"],
                     "dram_bytes_over_minimum": (k["dram_read_bytes"] + k["dram_write_bytes"])
                     / (3 * N * size)})
    path = results.write_results("chapter1_cuda_basics_profile", rows, {}, **profile.provenance())
    print(f"{'dtype':<10}{'version':<13}{'sectors/req':>12}{'ld instr':>11}{'DRAM/min':>9}"
          f"{'DRAM %':>8}{'occup %':>8}")
    for r in rows:
        if r["op"] == "vector_add_launch":
            continue
        print(f"{r['dtype']:<10}{r['variant']:<13}{r['sectors_per_request']:>12.2f}"
              f"{r['load_instructions']:>11.0f}{r['dram_bytes_over_minimum']:>9.2f}"
              f"{r['dram_pct_of_peak']:>8.1f}{r['achieved_occupancy_pct']:>8.1f}")
    print(f"\n{'dtype':<10}{'n':>6}{'variant':>8}{'grid':>9}{'block':>6}{'regs':>5}"
          f"{'elem/thread':>12}{'us (ncu)':>9}  kernel")
    for r in rows:
        if r["op"] == "vector_add_launch":
            print(f"{r['dtype']:<10}{'2^' + str(r['shape'][0].bit_length() - 1):>6}"
                  f"{r['variant']:>8}{r['grid_blocks']:>9.0f}{r['block_threads']:>6.0f}"
                  f"{r['registers_per_thread']:>5.0f}{r['elements_per_thread']:>12.1f}"
                  f"{r['duration_ns'] / 1e3:>9.1f}  {r['kernel'][:70]}")
    print("wrote", path)


if __name__ == "__main__":
    main()
