"""Hardware-counter evidence for the lesson, read with Nsight Compute (ncu).

    python profile_memory_ops.py             run ncu over this script's --workload, write
                                             results/<device-slug>/chapter2_memory_profile.json
    python profile_memory_ops.py --workload  what ncu profiles: every transpose version once
                                             at 4096 x 4096 in float32, bfloat16 and float64,
                                             then strided_copy of 2^26 float32 at strides 1..64,
                                             then v4 and v5 on aligned, odd and sliced shapes

Per kernel: shared-memory bank conflicts on loads and stores (the v2 -> v3 story, and how it
changes with the element size), global store sectors per request (v1's scattered writes),
DRAM bytes against the napkin-math minimum, and the kernel's duration under ncu; for
strided_copy, the DRAM bytes actually read per kept element (the sector model says
min(stride * 4, 32)). ncu flushes the caches before each kernel, so every read comes from
DRAM; writes still dirty in the 50 MB L2 when a kernel ends are not counted. For v5 (wide
tiles at any alignment): what its chunks cost against v4 on an aligned matrix, on an odd one
(4095 x 4097, every row shifted differently on both sides) and on a slice (x[:, 1:] of
4096 x 4097: every source row shifted the same): L2 read traffic, bank conflicts, instructions
and occupancy.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]

SIDE = 4096
STRIDED_N = 2**26  # 256 MB of float32: five times the L2
STRIDES = (1, 2, 4, 8, 16, 32, 64)
DTYPES = ("float32", "bfloat16", "float64")
METRICS = {
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": "smem_load_bank_conflicts",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": "smem_store_bank_conflicts",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": "smem_load_wavefronts",
    "smsp__inst_executed_op_shared_ld.sum": "smem_load_instructions",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum": "store_sectors",
    "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum": "store_requests",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "gpu__time_duration.sum": "duration_ns",
    "lts__t_sectors_srcunit_tex_op_read.sum": "l2_read_sectors",
    "smsp__inst_executed.sum": "instructions",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum": "smem_store_wavefronts",
}
# v4 and v5 beside each other: (case, shape before the view, view), in float32 and bfloat16.
ALIGNMENT_CASES = (("aligned", (SIDE, SIDE), None), ("odd", (SIDE - 1, SIDE + 1), None),
                   ("sliced", (SIDE, SIDE + 1), "x[:, 1:]"))
ALIGNMENT_DTYPES = ("float32", "bfloat16")
# Demangled kernel name -> version, most specific first.
def version_of(kernel):
    """The ladder version of a demangled kernel name. v2 is transpose_tiled<T, 0>; v3 is the
    same template with any nonzero pad (one 4-byte bank, or whatever an exercise tries)."""
    if "transpose_wide_tiles_any_alignment" in kernel:
        return "v5"
    if "transpose_wide_tiles" in kernel:
        return "v4"
    if "transpose_tiled" in kernel:
        return "v2" if ", 0>(" in kernel else "v3"
    return "v1" if "transpose_naive" in kernel else None


def workload():
    import torch

    import memory_ops
    for dtype in DTYPES:
        x = torch.randn(SIDE, SIDE, device="cuda", dtype=getattr(torch, dtype))
        for version in memory_ops.VERSIONS["transpose"]:
            memory_ops.transpose(x, version=version)
    x = torch.randn(STRIDED_N, device="cuda")
    for stride in STRIDES:
        memory_ops.strided_copy(x, stride)
    for dtype, (_, shape, view), version in alignment_runs():
        x = torch.randn(shape, device="cuda", dtype=getattr(torch, dtype))
        memory_ops.transpose(x[:, 1:] if view else x, version=version)
    torch.cuda.synchronize()


def alignment_runs():
    """(dtype, case, version) of the v4-vs-v5 section: v4 only where it applies (aligned)."""
    return [(d, case, v) for d in ALIGNMENT_DTYPES for case in ALIGNMENT_CASES
            for v in (("v4", "v5") if case[0] == "aligned" else ("v5",))]


def main():
    from coursekit import ncu, results
    profile = ncu.workload_or_profile(__doc__, __file__, workload, "memory_ops::", METRICS)
    if profile is None:
        return
    kernels = profile.kernels
    import memory_ops
    expected = [(d, v) for d in DTYPES for v in memory_ops.VERSIONS["transpose"]]
    runs = alignment_runs()
    if len(kernels) != len(expected) + len(STRIDES) + len(runs):
        sys.exit(f"expected {len(expected) + len(STRIDES) + len(runs)} profiled kernels, got "
                 f"{len(kernels)}")
    rows = []
    for (dtype, (case, shape, view), version), k in zip(runs, kernels[len(expected) + len(STRIDES):]):
        assert version_of(k["kernel"]) == version, (version, k["kernel"])
        size = {"float32": 4, "bfloat16": 2}[dtype]
        elements = shape[0] * (shape[1] - 1 if view else shape[1])
        rows.append({"op": "transpose_alignment", "variant": version, "dtype": dtype,
                     "shape": list(shape), "view": view, "case": case, "kernel": k["kernel"],
                     **{m: k.get(m) for m in METRICS.values()},
                     "l2_read_bytes_over_minimum": k["l2_read_sectors"] * 32 / (elements * size),
                     "dram_bytes_over_minimum": (k["dram_read_bytes"] + k["dram_write_bytes"])
                     / (2 * elements * size),
                     "smem_load_wavefronts_per_instruction":
                     k["smem_load_wavefronts"] / k["smem_load_instructions"],
                     "instructions_per_element": k["instructions"] * 32 / elements,
                     "GBps_under_ncu": 2 * elements * size / k["duration_ns"]})
    for stride, k in zip(STRIDES, kernels[len(expected):]):
        assert "strided_gather" in k["kernel"], k["kernel"]
        kept = -(-STRIDED_N // stride)
        rows.append({"op": "strided_copy", "variant": "v1", "dtype": "float32",
                     "shape": [STRIDED_N], "stride": stride, "kernel": k["kernel"],
                     **{m: k.get(m) for m in METRICS.values()},
                     "dram_read_bytes_per_kept_element": k["dram_read_bytes"] / kept,
                     "sector_model_bytes_per_kept_element": min(stride * 4, 32)})
    for (dtype, version), k in zip(expected, kernels):
        assert version_of(k["kernel"]) == version, (version, k["kernel"])
        size = {"float32": 4, "bfloat16": 2, "float64": 8}[dtype]
        loads = k["smem_load_instructions"]
        rows.append({"op": "transpose", "variant": version, "dtype": dtype, "shape": [SIDE, SIDE],
                     "kernel": k["kernel"], **{m: k.get(m) for m in METRICS.values()},
                     # 1.0 = every shared load served in one pass; 32 = a 32-way conflict.
                     "smem_wavefronts_per_load": k["smem_load_wavefronts"] / loads if loads else None,
                     "store_sectors_per_request": k["store_sectors"] / k["store_requests"],
                     "dram_bytes_over_minimum": (k["dram_read_bytes"] + k["dram_write_bytes"])
                     / (2 * SIDE * SIDE * size)})
    path = results.write_results("chapter2_memory_profile", rows, {}, **profile.provenance())
    print(f"{'dtype':<10}{'version':<9}{'smem ld conflicts':>18}{'smem st conflicts':>18}"
          f"{'wavefr/ld':>10}{'st sect/req':>12}{'DRAM/min':>9}{'us':>9}")
    for r in rows:
        if r["op"] == "transpose_alignment":
            print(f"{r['dtype']:<10}{r['variant']} {r['case']:<8} L2 reads/min "
                  f"{r['l2_read_bytes_over_minimum']:.2f}, DRAM/min {r['dram_bytes_over_minimum']:.2f}, "
                  f"smem wavefronts/ld {r['smem_load_wavefronts_per_instruction']:.2f}, st conflicts "
                  f"{r['smem_store_bank_conflicts']:.0f}, instr/element "
                  f"{r['instructions_per_element']:.2f}, occupancy {r['achieved_occupancy_pct']:.0f}%, "
                  f"{r['GBps_under_ncu']:.0f} GB/s under ncu")
            continue
        if r["op"] == "strided_copy":
            print(f"strided_copy stride {r['stride']:>2}: DRAM reads "
                  f"{r['dram_read_bytes_per_kept_element']:.1f} bytes per kept element (sector "
                  f"model {r['sector_model_bytes_per_kept_element']})")
            continue
        per_load = r["smem_wavefronts_per_load"]
        print(f"{r['dtype']:<10}{r['variant']:<9}{r['smem_load_bank_conflicts']:>18.0f}"
              f"{r['smem_store_bank_conflicts']:>18.0f}"
              f"{per_load if per_load is not None else float('nan'):>10.2f}"
              f"{r['store_sectors_per_request']:>12.2f}{r['dram_bytes_over_minimum']:>9.2f}"
              f"{r['duration_ns'] / 1e3:>9.1f}")
    print("wrote", path)


if __name__ == "__main__":
    main()
