"""Hardware-counter evidence for the lesson's misses, read with Nsight Compute (ncu).

    python profile_fusion.py             run ncu over this script's --workload, write
                                         results/<device-slug>/chapter4_fusion_profile.json
    python profile_fusion.py --workload  what ncu profiles: every call runs once unprofiled
                                         (torch.compile compiles and tunes then), then once
                                         between cudaProfilerStart and cudaProfilerStop

Two questions the benchmark alone cannot answer:
1. Why do bias_silu and bias_gelu(tanh)'s forwards trail torch.compile's Triton kernel while
   swiglu's (the same SiLU, one 16-byte vector a thread) runs at the copy rate? Ours and Inductor's kernel side
   by side on the benchmark's shapes: instructions per element, how busy the issue slots and
   the FMA, ALU and XU (the special-function unit: exp, reciprocal) pipes were, occupancy,
   and how busy DRAM was over the kernel.
2. What holds the norm backward (v2) under 80% of copy at hidden 1024, 4096 and 8192:
   registers, achieved occupancy, DRAM busy, where the warps stall (waiting on memory, at
   barriers), and what the two column sums of dweight and dbias add after the row kernel.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]

ACT_SHAPE = (16384, 8192)
SWIGLU_SHAPE = (16384, 16384)
NORM_TOTAL = 2**26
NORM_HIDDEN = (1024, 4096, 8192)
METRICS = {
    "gpu__time_duration.sum": "duration_ns",
    "smsp__inst_executed.sum": "instructions",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_busy_pct",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "launch__registers_per_thread": "registers",
    "launch__block_size": "block",
    "launch__grid_size": "grid",
    "sm__inst_issued.avg.pct_of_peak_sustained_active": "issue_busy_pct",
    "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active": "fma_pipe_pct",
    "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active": "alu_pipe_pct",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active": "xu_pipe_pct",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": "stall_memory",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": "stall_barrier",
    "smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio": "stall_lsu_queue",
    "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio": "stall_math_pipe",
}
EPS = 1e-5
# (op, variant, shape) of part 1, bfloat16; the activations read x and write y (the bias is
# n elements), swiglu reads [rows, 2h] and writes [rows, h].
ACT_RUNS = [("bias_silu", "v2", ACT_SHAPE), ("bias_silu", "torch.compile", ACT_SHAPE),
            ("bias_gelu_tanh", "v2", ACT_SHAPE), ("bias_gelu_tanh", "torch.compile", ACT_SHAPE),
            ("swiglu", "v2", SWIGLU_SHAPE)]
# Part 2: LayerNorm's backward rung that holds rows in registers (v1 streams: not the question).
# Each call is three kernels: the row kernel, then course::column_sum for dweight and dbias.
NORM_BACKWARD_RUNGS = ("v2",)
NORM_RUNS = [("layer_norm", v, (NORM_TOTAL // h, h)) for h in NORM_HIDDEN for v in NORM_BACKWARD_RUNGS]
NORM_LAUNCHES = 3


def moved_bytes(op, shape):
    elements = shape[0] * shape[1]
    return {"swiglu": elements * 3 // 2, "layer_norm": 3 * elements}.get(op, 2 * elements) * 2


def calls():
    """One callable per run of ACT_RUNS + NORM_RUNS, in that order."""
    import torch
    import torch.nn.functional as F

    import fusion
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, b = torch.randn(ACT_SHAPE, **bf16), torch.randn(ACT_SHAPE[1], **bf16)
    xs = torch.randn(SWIGLU_SHAPE, **bf16)
    compiled = {"bias_silu": torch.compile(lambda x, b: F.silu(x + b)),
                "bias_gelu_tanh": torch.compile(lambda x, b: F.gelu(x + b, approximate="tanh"))}
    ours = {"bias_silu": lambda v: fusion.bias_silu(x, b, version=v),
            "bias_gelu_tanh": lambda v: fusion.bias_gelu(x, b, approximate="tanh", version=v),
            "swiglu": lambda v: fusion.swiglu(xs, version=v)}
    out = [(lambda op=op: compiled[op](x, b)) if v == "torch.compile" else (lambda op=op, v=v: ours[op](v))
           for op, v, _ in ACT_RUNS]
    inputs = {}
    for _, v, shape in NORM_RUNS:
        if shape not in inputs:
            xn, w, bn = torch.randn(shape, **bf16), torch.randn(shape[1], **bf16), torch.randn(shape[1], **bf16)
            _, mean, rstd = fusion.layer_norm_forward(xn, w, bn, EPS)
            inputs[shape] = (torch.randn_like(xn), xn, w, mean, rstd)
        out.append(lambda v=v, a=inputs[shape]: fusion.layer_norm_backward(*a, version=v))
    return out


def workload():
    import torch
    todo = calls()
    for call in todo:  # compile, tune and load everything before the profiled range
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in todo:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main():
    from coursekit import ncu, results
    profile = ncu.workload_or_profile(__doc__, __file__, workload, ".*", METRICS, from_start=False)
    if profile is None:
        return
    kernels = profile.kernels
    plan = [(run, 1) for run in ACT_RUNS] + [(run, NORM_LAUNCHES) for run in NORM_RUNS]
    if sum(n for _, n in plan) != len(kernels):
        sys.exit(f"profiled {len(kernels)} kernels, the plan has {sum(n for _, n in plan)}: "
                 + ", ".join(k["kernel"][:60] for k in kernels))
    rows, k = [], 0
    for (op, variant, shape), launches in plan:
        main_kernel, rest = kernels[k], kernels[k + 1:k + launches]
        k += launches
        nbytes = moved_bytes(op, shape)
        rows.append({"op": op, "variant": variant, "dtype": "bfloat16", "shape": list(shape),
                     "pass": "backward" if op == "layer_norm" else "forward", **main_kernel,
                     "instructions_per_element": main_kernel["instructions"] * 32 / (shape[0] * shape[1]),
                     "other_kernels_ns": sum(kk["duration_ns"] for kk in rest),
                     "dram_bytes_over_minimum": (main_kernel["dram_read_bytes"] + main_kernel["dram_write_bytes"])
                     / nbytes,
                     "GBps_under_ncu": nbytes / main_kernel["duration_ns"]})
    path = results.write_results("chapter4_fusion_profile", rows, {}, **profile.provenance())
    print(f"{'op':<15}{'shape':<12}{'var':<14}{'regs':>5}{'occ%':>6}{'instr/el':>9}{'issue%':>7}{'fma%':>6}"
          f"{'alu%':>6}{'xu%':>6}{'DRAM%':>7}{'mem':>6}{'bar':>6}{'lsuq':>6}{'us':>8}{'+us':>6}")
    for r in rows:
        print(f"{r['op']:<15}{results.format_shape(r['shape']):<12}{r['variant']:<14}{r['registers']:>5.0f}"
              f"{r['achieved_occupancy_pct']:>6.0f}{r['instructions_per_element']:>9.2f}{r['issue_busy_pct']:>7.0f}"
              f"{r['fma_pipe_pct']:>6.0f}{r['alu_pipe_pct']:>6.0f}{r['xu_pipe_pct']:>6.0f}{r['dram_busy_pct']:>7.0f}"
              f"{r['stall_memory']:>6.1f}{r['stall_barrier']:>6.1f}{r['stall_lsu_queue']:>6.1f}"
              f"{r['duration_ns'] / 1e3:>8.1f}{r['other_kernels_ns'] / 1e3:>6.1f}")
    print("wrote", path)


if __name__ == "__main__":
    main()
