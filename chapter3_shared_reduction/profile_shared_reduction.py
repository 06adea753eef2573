"""Hardware-counter evidence for the lesson, read with Nsight Compute (ncu).

    python profile_shared_reduction.py             run ncu over this script's --workload, write
                                                   results/<device-slug>/chapter3_shared_reduction_profile.json
    python profile_shared_reduction.py --workload  what ncu profiles: every whole-tensor sum rung
                                                   once on 2^24 float32, then every softmax rung
                                                   on rows of 65536 float32 (256 rows, 64 MiB),
                                                   then v5 on the same rows in bfloat16

Per kernel: instructions and shared-memory traffic per element (what Harris's steps remove),
shared-memory bank conflicts (v2's strided tree), the warps' branch efficiency (v1's divergent
modulo), achieved occupancy, DRAM bytes against the napkin-math minimum (how many times
each softmax rung reads its input), and how busy DRAM was over the kernel's whole duration
(a split row that reads its input once but waits between rounds shows as idle DRAM). ncu flushes the caches before each kernel, so every read
of an input comes from DRAM.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]

SUM_N = 2**24
SOFTMAX_SHAPE = (256, 65536)
METRICS = {
    "smsp__inst_executed.sum": "instructions",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum": "smem_wavefronts",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum": "smem_bank_conflicts",
    "smsp__thread_inst_executed_per_inst_executed.ratio": "threads_per_instruction",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_busy_pct",
    "gpu__time_duration.sum": "duration_ns",
}
# The softmax runs: (dtype, bytes per element, rungs); every rung in float32, v5 in bfloat16
SOFTMAX_RUNS = (("float32", 4, None), ("bfloat16", 2, ("v5",)))


def workload():
    import torch

    import shared_reduction as sr
    x = torch.randn(SUM_N, device="cuda")
    for version in sr.LADDERS["whole"]:
        sr.sum(x, version=version)
    for dtype, _, versions in SOFTMAX_RUNS:
        x = torch.randn(SOFTMAX_SHAPE, device="cuda", dtype=getattr(torch, dtype))
        for version in versions or sr.VERSIONS["softmax"]:
            sr.softmax(x, version=version)
    torch.cuda.synchronize()


def main():
    from coursekit import ncu, results
    profile = ncu.workload_or_profile(__doc__, __file__, workload, "shared_reduction::", METRICS)
    if profile is None:
        return
    kernels = profile.kernels
    import shared_reduction as sr
    # Every launch of a rung is one row: v1-v6 launch once per level, v7-v9 twice, v1 of
    # softmax three kernels. They come back in launch order; the kernel names say which is which.
    rows, k = [], 0
    plan = [("sum", v, "float32", SUM_N * 4) for v in sr.LADDERS["whole"]]
    plan += [("softmax", v, dtype, 2 * SOFTMAX_SHAPE[0] * SOFTMAX_SHAPE[1] * size)
             for dtype, size, versions in SOFTMAX_RUNS for v in versions or sr.VERSIONS["softmax"]]
    launches = {}
    for op, version, dtype, minimum in plan:
        first = True
        # A rung's launches: the first kernel always; then every following kernel whose name
        # is a later level of the same rung (same kernel template, or v7-v9's second stage).
        while k < len(kernels) and (first or _same_rung(kernels[k - 1]["kernel"], kernels[k]["kernel"])):
            kern = kernels[k]
            launches.setdefault((op, version, dtype), []).append(kern)
            k += 1
            first = False
    if k != len(kernels):
        sys.exit(f"matched {k} of {len(kernels)} profiled kernels to the ladder")
    for (op, version, dtype, minimum) in plan:
        ks = launches[(op, version, dtype)]
        total = {m: sum(kk.get(m) or 0 for kk in ks) for m in METRICS.values()}
        elements = SUM_N if op == "sum" else SOFTMAX_SHAPE[0] * SOFTMAX_SHAPE[1]
        rows.append({"op": op, "variant": version, "dtype": dtype,
                     "shape": [SUM_N] if op == "sum" else list(SOFTMAX_SHAPE),
                     "kernels": [kk["kernel"] for kk in ks], "launches": len(ks), **total,
                     "instructions_per_element": total["instructions"] * 32 / elements,
                     "smem_wavefronts_per_element": total["smem_wavefronts"] / elements,
                     "threads_per_instruction": ks[0]["threads_per_instruction"],
                     "achieved_occupancy_pct": ks[0]["achieved_occupancy_pct"],
                     "dram_busy_pct": ks[0]["dram_busy_pct"],
                     "dram_bytes_over_minimum": (total["dram_read_bytes"] + total["dram_write_bytes"]) / minimum,
                     "GBps_under_ncu": minimum / total["duration_ns"]})
    path = results.write_results("chapter3_shared_reduction_profile", rows, {}, **profile.provenance())
    print(f"{'op':<8}{'dtype':<9}{'rung':<6}{'launches':>9}{'instr/elem':>11}{'smem wf/elem':>13}{'conflicts':>10}"
          f"{'thr/instr':>10}{'occup%':>8}{'DRAM/min':>9}{'DRAM%':>7}{'us':>9}")
    for r in rows:
        print(f"{r['op']:<8}{r['dtype']:<9}{r['variant']:<6}{r['launches']:>9}{r['instructions_per_element']:>11.2f}"
              f"{r['smem_wavefronts_per_element']:>13.3f}{r['smem_bank_conflicts']:>10.0f}"
              f"{r['threads_per_instruction']:>10.1f}{r['achieved_occupancy_pct']:>8.0f}"
              f"{r['dram_bytes_over_minimum']:>9.2f}{r['dram_busy_pct']:>7.0f}{r['duration_ns'] / 1e3:>9.1f}")
    print("wrote", path)


def _same_rung(previous, current):
    """Whether `current` continues the rung `previous` started: a further level of v1-v6 (the
    same kernel template), v7-v9's second stage, or softmax v1's next kernel."""
    def stem(name):
        return name.split("<", 1)[0]
    if stem(previous) == stem(current):
        return "softmax" not in previous or "statistic" in previous
    return "softmax_row_statistic" in previous and "softmax_normalize" in current


if __name__ == "__main__":
    main()
