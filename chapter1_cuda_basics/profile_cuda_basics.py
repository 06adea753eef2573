"""Hardware-counter evidence for the lesson, read with Nsight Compute (ncu).

    python profile_cuda_basics.py          run ncu over this script's --workload, write
                                           results/<device-slug>/chapter1_cuda_basics_profile.json
    python profile_cuda_basics.py --workload   what ncu profiles: each version of vector_add
                                               once at 2^24 elements, float32 then bfloat16

Per kernel: global-load sectors per request (4 for a coalesced fp32 warp, 32 when every lane
hits its own sector), load instructions, DRAM bytes against the napkin-math minimum, DRAM
throughput and achieved occupancy. Counters, not timings: ncu replays each kernel.
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
}
# Kernel template name -> version, most specific first.
KERNELS = [("elementwise_vectorized_ilp", "v4"), ("elementwise_vectorized", "v3"),
           ("elementwise_grid_stride", "v2"), ("elementwise_thread_per_element", "v1"),
           ("elementwise_uncoalesced", "uncoalesced")]


def workload():
    import torch
    import cuda_basics
    for dtype in DTYPES:
        a = torch.randn(N, device="cuda", dtype=getattr(torch, dtype))
        b = torch.randn(N, device="cuda", dtype=getattr(torch, dtype))
        for version in cuda_basics.VERSIONS["vector_add"]:
            cuda_basics.vector_add(a, b, version=version)
    torch.cuda.synchronize()


def main():
    from coursekit import ncu, results
    # Match our namespace, not "elementwise_": torch's randn runs a kernel named
    # distribution_elementwise_grid_stride_kernel.
    kernels = ncu.workload_or_profile(__doc__, __file__, workload, "cuda_basics::", METRICS)
    if kernels is None:
        return
    rows = []
    expected = [(d, v) for d in DTYPES for _, v in reversed(KERNELS)]
    if len(kernels) != len(expected):
        sys.exit(f"expected {len(expected)} profiled kernels, got {len(kernels)}")
    for (dtype, version), k in zip(expected, kernels):
        found = next(v for name, v in KERNELS if name in k["kernel"])
        assert found == version, (found, version, k["kernel"])
        size = 4 if dtype == "float32" else 2
        rows.append({"op": "vector_add", "variant": version, "dtype": dtype, "shape": [N],
                     **{m: k.get(m) for m in METRICS.values()},
                     "sectors_per_request": k["load_sectors"] / k["load_requests"],
                     "dram_bytes_over_minimum": (k["dram_read_bytes"] + k["dram_write_bytes"])
                     / (3 * N * size)})
    path = results.write_results("chapter1_cuda_basics_profile", rows, {},
                                 tool="ncu --clock-control none", metrics=list(METRICS))
    print(f"{'dtype':<10}{'version':<13}{'sectors/req':>12}{'ld instr':>11}{'DRAM/min':>9}"
          f"{'DRAM %':>8}{'occup %':>8}")
    for r in rows:
        print(f"{r['dtype']:<10}{r['variant']:<13}{r['sectors_per_request']:>12.2f}"
              f"{r['load_instructions']:>11.0f}{r['dram_bytes_over_minimum']:>9.2f}"
              f"{r['dram_pct_of_peak']:>8.1f}{r['achieved_occupancy_pct']:>8.1f}")
    print("wrote", path)


if __name__ == "__main__":
    main()
