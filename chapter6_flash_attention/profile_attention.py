"""Hardware-counter evidence for the lesson's ladder, read with Nsight Compute (ncu).

    python profile_attention.py              run ncu over this script's --workload, write
                                             results/<device-slug>/chapter6_flash_attention_profile.json
    python profile_attention.py --workload   what ncu profiles: every call runs once unprofiled
                                             (cuDNN builds its plan, the allocator fills), then once
                                             between cudaProfilerStart and cudaProfilerStop
    python profile_attention.py --only REGEX profile only the calls whose label matches, e.g.
                                             --only 'forward\\.(mma|pipelined)\\.d128', and print
                                             their table without writing the results file
    python profile_attention.py --shape 32,16,512
                                             the same calls at another batch, heads and seqlen
                                             (short sequences: each block's fixed cost, its
                                             prologue and epilogue, against its few key tiles);
                                             the table only, as with --only
    python profile_attention.py --only 'backward\\.wgmma\\.d128\\.full' --source flash_bwd_hopper
                                             ncu's source view of the first kernel of that call
                                             whose name matches: the SASS instructions the warps
                                             sat at most, and on what (coursekit.ncu's
                                             source_hotspots); the table only
    python profile_attention.py --source-csv FILE
                                             the same table from a source page exported before
                                             (ncu --import REPORT --page source --csv
                                             --print-source sass > FILE), on any machine

Without a CUDA GPU, or without ncu on PATH, it says so and exits 0 having written nothing (a CPU
machine runs the chapter's tests, not its profile).

Two questions the benchmark's TFLOP/s cannot answer:
1. What each rung's resources allow: its tile (the block size and grid), registers per thread,
   static and dynamic shared memory per block, and how many blocks of it an SM can hold, limited
   by registers, by shared memory, by warps or by the block slots (ncu's
   launch__occupancy_limit_*): the smallest names the limit that binds. Then the occupancy the
   kernel really reached.
2. Why each rung gains what it gains: how busy the tensor pipe was (mma.sync runs on the HMMA
   pipe, Hopper included; cuDNN's Hopper kernels use wgmma, the GMMA pipe), the FMA, ALU and XU
   (exp) pipes for the scalar rungs, shared-memory bank conflicts of loads (ldmatrix included)
   and stores, ldmatrix and shared-load instruction counts, DRAM busy, and where the warps
   stall: on global memory (long scoreboard), on shared memory or the XU (short scoreboard), at
   __syncthreads (barrier), on a full shared-memory queue (MIO throttle), on a busy math pipe,
   on fixed-latency dependencies (wait).

The workload, bfloat16, batch 4, 16 heads, seqlen 2048: the forward of every rung of
flash_attention.VERSIONS["attention_forward"] and of sdpa_flash and sdpa_cudnn (SDPA pinned to
one backend; a backend that refuses is skipped and the reason recorded) and of the FP8 forward
(attention_fp8 on the same inputs quantized to e4m3 beforehand; Hopper only), at head_dim 64 and 128,
not causal; the causal forward of "tuned", "pingpong", sdpa_flash and sdpa_cudnn at head_dim 128,
and of "persistent" with and without a softcap of 30 (Hopper only); the backward of
every rung of VERSIONS["attention_backward"] (the op alone, from the default forward's out and
lse) and of sdpa_flash (torch.autograd.grad through F.scaled_dot_product_attention, its forward
run beforehand), at both head dims. The naive rungs materialise the 4 x 16 x 2048 x 2048 float32
scores (1 GiB): slow, and kept, since the lesson compares against them.

Which kernels belong to which call: ncu reports kernels in launch order, and a call launches a
varying number of them (the naive forward 3, the tensor-core backwards 3, SDPA a few, with any
fill kernels PyTorch adds). Counting launches per call, as chapter 4's profile does, would break
the day one of them changes; instead the workload launches a marker before each profiled call,
torch.cuda._sleep's one-thread `spin_kernel`, which no call launches, and every kernel up to the
next marker is that call's. The workload records its plan (the calls it ran, in order, and the
ones it skipped) in a file the profiler reads back. Each call is also an NVTX range named by its
label (as "forward.pipelined.d128.full"), for a full report of one rung in the Nsight Compute GUI:

    ncu --profile-from-start off --nvtx --nvtx-include "forward.pipelined.d128.full/" \\
        --set full -o pipelined_d128 python profile_attention.py --workload

Counters, not timings: ncu replays each kernel once per metric pass with the caches flushed and
the clocks left as they are (--clock-control none, coursekit.ncu as for every chapter); durations
and TFLOP/s "under ncu" are of one such replay.
"""
import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]
from coursekit import ncu  # noqa: E402

CHAPTER = "chapter6_flash_attention_profile"
DTYPE = "bfloat16"
BATCH, HEADS, SEQLEN = 4, 16, 2048
HEAD_DIMS = (64, 128)
SDPA_FORWARD = ("sdpa_flash", "sdpa_cudnn")
SDPA_BACKWARD = ("sdpa_flash",)
CAUSAL_HEAD_DIM = 128
CAUSAL_FORWARD = ("tuned", "pingpong", "sdpa_flash", "sdpa_cudnn")
# The FP8 forward (Hopper only; elsewhere its call refuses and is skipped with the reason), beside
# the rungs at each head dim: its inputs quantized before the profiled range, its row's dtype e4m3.
FP8_FORWARD = "attention_fp8"
FP8_DTYPE = "float8_e4m3fn"
# The softcapped forward beside the same rung's plain causal one, d = 128: what a cap's tanh costs
# the rung that takes it on a Hopper ("persistent", its kWindowSoftcap instantiation; elsewhere
# both calls refuse and are skipped), read in its pipes and stalls. 30 takes the MUFU reciprocal.
SOFTCAP_FORWARD = "persistent"
SOFTCAPS = (0.0, 30.0)

# ncu metric name -> the short name a row carries.
METRICS = {
    "gpu__time_duration.sum": "duration_ns",
    # The launch: the tile (block), the grid, and what a block holds.
    "launch__block_size": "block",
    "launch__grid_size": "grid",
    "launch__registers_per_thread": "registers",
    "launch__shared_mem_per_block_static": "smem_static_bytes",
    "launch__shared_mem_per_block_dynamic": "smem_dynamic_bytes",
    "launch__shared_mem_config_size": "smem_config_bytes",
    "launch__waves_per_multiprocessor": "waves_per_sm",
    # Blocks per SM each resource allows; the smallest binds (binding_limit).
    "launch__occupancy_limit_registers": "occ_limit_registers",
    "launch__occupancy_limit_shared_mem": "occ_limit_shared_mem",
    "launch__occupancy_limit_warps": "occ_limit_warps",
    "launch__occupancy_limit_blocks": "occ_limit_blocks",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    # Pipes: tensor cores (mma.sync: HMMA; Hopper's wgmma: GMMA), FMA, ALU, XU (exp2).
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pipe_pct",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor_gmma_pipe_pct",
    # every tensor pipe together (HMMA and GMMA): the one figure that compares part 1 with part 3
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor_any_pipe_pct",
    "sm__inst_executed_pipe_tensor_op_gmma.sum": "gmma_instructions",
    "smsp__inst_executed_pipe_xu.sum": "xu_instructions",
    "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active": "fma_pipe_pct",
    "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active": "alu_pipe_pct",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active": "xu_pipe_pct",
    "sm__inst_issued.avg.pct_of_peak_sustained_active": "issue_busy_pct",
    "smsp__inst_executed.sum": "instructions",
    # Shared memory: bank conflicts and wavefronts of loads (ldmatrix counts as a load) and
    # stores, and the instructions that asked for them.
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum": "smem_bank_conflicts",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": "smem_ld_bank_conflicts",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": "smem_st_bank_conflicts",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": "smem_ld_wavefronts",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum": "smem_st_wavefronts",
    "smsp__inst_executed_op_shared_ld.sum": "smem_ld_instructions",
    "smsp__inst_executed_op_ldsm.sum": "ldsm_instructions",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_busy_pct",
    # Where the warps wait, per issued instruction.
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": "stall_long_scoreboard",
    "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio": "stall_short_scoreboard",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": "stall_barrier",
    "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio": "stall_mio_throttle",
    "smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio": "stall_lg_throttle",
    "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio": "stall_math_pipe_throttle",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": "stall_wait",
    "smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio": "stall_no_instruction",
    "smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio": "stall_not_selected",
}
# Names not yet collected on this course's H100 by another chapter's profile: if ncu rejects one
# (an older ncu, another GPU: the GMMA pipe exists only on sm_90), the run is retried without it.
UNSURE = {
    "launch__shared_mem_config_size", "launch__waves_per_multiprocessor",
    "sm__maximum_warps_per_active_cycle_pct",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor_op_gmma.sum", "smsp__inst_executed_pipe_xu.sum",
    "smsp__inst_executed_op_ldsm.sum",
    "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio",
}
OCCUPANCY_LIMITS = {"occ_limit_registers": "registers", "occ_limit_shared_mem": "shared_mem",
                    "occ_limit_warps": "warps", "occ_limit_blocks": "blocks"}
# "not selected" is a warp that was ready while another issued: spare parallelism, not a wait,
# so it never counts as the top stall.
NOT_A_WAIT = {"stall_not_selected"}


# ---------------------------------------------------------------------------------------------
# The plan and the arithmetic: pure functions (test_profile_attention.py holds them)
# ---------------------------------------------------------------------------------------------
def runs(forward_versions, backward_versions):
    """Every call the workload makes, in order: {"pass", "variant", "head_dim", "causal"}."""
    out = [{"pass": "forward", "variant": v, "head_dim": d, "causal": False}
           for d in HEAD_DIMS for v in (*forward_versions, *SDPA_FORWARD, FP8_FORWARD)]
    out += [{"pass": "forward", "variant": v, "head_dim": CAUSAL_HEAD_DIM, "causal": True}
            for v in CAUSAL_FORWARD]
    out += [{"pass": "forward", "variant": SOFTCAP_FORWARD, "head_dim": CAUSAL_HEAD_DIM, "causal": True, "softcap": c}
            for c in SOFTCAPS]
    out += [{"pass": "backward", "variant": v, "head_dim": d, "causal": False}
            for d in HEAD_DIMS for v in (*backward_versions, *SDPA_BACKWARD)]
    return out


def label(run):
    """A call's name, its NVTX range too: forward.pipelined.d128.causal (a softcap's call ends in
    .softcap30)."""
    cap = f".softcap{run['softcap']:g}" if run.get("softcap") else ""
    return f"{run['pass']}.{run['variant']}.d{run['head_dim']}.{'causal' if run['causal'] else 'full'}{cap}"


def binding_limit(kernel):
    """(which resource binds, blocks per SM it allows): the smallest of ncu's occupancy limits,
    every resource that ties for it named ("registers+shared_mem"); (None, None) without them."""
    known = {name: kernel.get(field) for field, name in OCCUPANCY_LIMITS.items()
             if kernel.get(field) is not None}
    if not known:
        return None, None
    low = min(known.values())
    return "+".join(name for name, v in known.items() if v == low), low


def top_stall(kernel):
    """(reason, warps stalled per issued instruction) of the largest stall, or (None, None)."""
    stalls = {f[len("stall_"):]: v for f, v in kernel.items()
              if f.startswith("stall_") and f not in NOT_A_WAIT and v is not None}
    if not stalls:
        return None, None
    reason = max(stalls, key=stalls.get)
    return reason, stalls[reason]


def main_kernel(kernels):
    """The call's longest kernel: whose resources and counters the row reports."""
    return max(kernels, key=lambda k: k.get("duration_ns") or 0.0)


def run_flops(run, shape=(BATCH, HEADS, SEQLEN)):
    """The chapter's own FLOP count for a call at (batch, heads, seqlen) (bench_attention.attention_flops)."""
    from bench_attention import attention_flops
    batch, heads, seqlen = shape
    return attention_flops(batch, heads, seqlen, seqlen, run["head_dim"], run["causal"], run["pass"])


def tflops(flops, duration_ns):
    return flops / duration_ns / 1e3 if duration_ns else None


def summarize_call(run, kernels, flops, shape=(BATCH, HEADS, SEQLEN)):
    """One results row: the call, every kernel it launched, the main kernel's counters, and what
    the lesson reads off them (TFLOP/s, shared memory in KiB, the binding limit, the top stall,
    the load conflict degree)."""
    main = main_kernel(kernels)
    total = sum(k.get("duration_ns") or 0.0 for k in kernels)
    bound, blocks = binding_limit(main)
    stall, stall_ratio = top_stall(main)
    static, dynamic = main.get("smem_static_bytes"), main.get("smem_dynamic_bytes")
    smem = None if static is None and dynamic is None else (static or 0) + (dynamic or 0)
    warps_per_block = -(-int(main["block"]) // 32) if main.get("block") else None
    # ncu's own shared-load requests (its SharedMemoryConflicts rule): shared loads + ldmatrix.
    ld_requests = (main.get("smem_ld_instructions") or 0) + (main.get("ldsm_instructions") or 0)
    row = {"op": "attention", "variant": run["variant"], "pass": run["pass"],
           "dtype": FP8_DTYPE if run["variant"] == FP8_FORWARD else DTYPE,
           "shape": [*shape, run["head_dim"]], "batch": shape[0], "heads": shape[1],
           "seqlen": shape[2], "head_dim": run["head_dim"], "causal": run["causal"], "label": label(run)}
    row.update({f: v for f, v in main.items() if f not in ("id", "kernel")})
    row.update({
        "main_kernel": main["kernel"], "main_duration_ns": main.get("duration_ns"),
        "launches": len(kernels), "duration_ns": total,
        "kernels": [{f: v for f, v in k.items() if f != "id"} for k in kernels],
        "flops": flops, "TFLOPs_under_ncu": tflops(flops, total),
        "smem_per_block_KiB": None if smem is None else smem / 1024,
        "occupancy_bound_by": bound, "blocks_per_sm": blocks,
        "resident_warps_per_sm": None if blocks is None or warps_per_block is None else blocks * warps_per_block,
        "smem_ld_wavefronts_per_request": (main["smem_ld_wavefronts"] / ld_requests
                                           if ld_requests and main.get("smem_ld_wavefronts") is not None else None),
        "top_stall": stall, "top_stall_ratio": stall_ratio,
    })
    return row


def _fmt(value, spec, width=0):
    """value formatted by spec and right-aligned in width; "-" where ncu gave none."""
    return ("-" if value is None else format(value, spec)).rjust(width)


def format_table(rows):
    """The per-rung table the lesson quotes, one line per call."""
    lines = [f"{'pass':<9}{'variant':<12}{'d':>4} {'causal':<7}{'kern':>4}{'ms':>8}{'TFLOP/s':>8}"
             f"{'regs':>5}{'smemKiB':>8}  {'blk/SM bound':<18}{'occ%':>5}{'tc%':>5}{'confl ld/st':>14}  top stall"
             "  gmma% xu%"]
    for r in rows:
        bound = "-" if r.get("blocks_per_sm") is None else f"{r['blocks_per_sm']:.0f} {r['occupancy_bound_by']}"
        conflicts = f"{_fmt(r.get('smem_ld_bank_conflicts'), '.3g')}/{_fmt(r.get('smem_st_bank_conflicts'), '.3g')}"
        stall = "-" if r.get("top_stall") is None else f"{r['top_stall']} {r['top_stall_ratio']:.2f}"
        lines.append(f"{r['pass']:<9}{r['variant'][:11]:<12}{r['head_dim']:>4} {str(r['causal']):<7}"
                     f"{r['launches']:>4}{_fmt(r['duration_ns'] / 1e6, '.3f', 8)}{_fmt(r['TFLOPs_under_ncu'], '.1f', 8)}"
                     f"{_fmt(r.get('registers'), '.0f', 5)}{_fmt(r.get('smem_per_block_KiB'), '.1f', 8)}  "
                     f"{bound[:17]:<18}{_fmt(r.get('achieved_occupancy_pct'), '.0f', 5)}"
                     f"{_fmt(r.get('tensor_pipe_pct'), '.0f', 5)}{conflicts:>14}  {stall}"
                     # last, after the stall: hopper_profile (lesson_facts) reads the columns before by place
                     f"  {_fmt(r.get('tensor_gmma_pipe_pct'), '.0f')} {_fmt(r.get('xu_pipe_pct'), '.0f')}"
                     # a softcapped call's label ends in .softcap30: said here, or its line reads as the plain one's
                     + (f"  {r['label'].rsplit('.', 1)[-1]}" if ".softcap" in r.get("label", "") else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The workload (what ncu profiles; GPU only)
# ---------------------------------------------------------------------------------------------
def make_call(run, tensors, scale):
    """The callable of one run. A backward's forward runs here, before any profiled range."""
    import torch

    import flash_attention
    from bench_attention import SDPA_BACKENDS, sdpa_call
    q, k, v, dy = tensors
    variant, causal = run["variant"], run["causal"]
    sdpa = sdpa_call(SDPA_BACKENDS[variant], causal) if variant.startswith("sdpa_") else None
    if variant == FP8_FORWARD:
        q8, dq = flash_attention.quantize_fp8(q)
        k8, dk = flash_attention.quantize_fp8(k)
        v8t, dv = flash_attention.quantize_fp8(v, transpose=True)
        return lambda: flash_attention.attention_fp8(q8, k8, v8t, dq, dk, dv, causal=causal, scale=scale)
    if run["pass"] == "forward":
        if sdpa is not None:
            return lambda: sdpa(q, k, v)
        return lambda: flash_attention.attention_forward(q, k, v, scale, causal, softcap=run.get("softcap", 0.0),
                                                         version=variant)
    if sdpa is not None:
        leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
        out = sdpa(*leaves)
        return lambda: torch.autograd.grad(out, leaves, dy, retain_graph=True)
    out, lse = flash_attention.attention_forward(q, k, v, scale, causal)
    return lambda: flash_attention.attention_backward(dy, q, k, v, out, lse, scale, causal, version=variant)


def workload(plan_path=None, only=None, shape=(BATCH, HEADS, SEQLEN)):
    import warnings

    import torch

    import flash_attention
    from bench_attention import make_inputs
    from coursekit import bench
    todo = runs(flash_attention.VERSIONS["attention_forward"], flash_attention.VERSIONS["attention_backward"])
    if only:
        todo = [r for r in todo if re.search(only, label(r))]
    inputs = {d: make_inputs(*shape, d, getattr(torch, DTYPE), "cuda", seed=0)
              for d in sorted({r["head_dim"] for r in todo})}
    calls, skipped = [], []
    for run in todo:  # build and run each call once, unprofiled; what refuses is skipped
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                call = make_call(run, inputs[run["head_dim"]], run["head_dim"] ** -0.5)
                call()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001  (a backend that refuses skips its call, not the run)
                reason = bench.refusal(e, caught)
                skipped.append({"label": label(run), **run, "reason": reason})
                print(f"profile_attention: {label(run)} skipped: {reason}", file=sys.stderr)
                torch.cuda.synchronize()
                continue
        calls.append((run, call))
    torch.cuda.synchronize()
    # Hand the warm-up's cached blocks (the naive rungs' 1 GiB score workspaces) back to the
    # driver: ncu saves and restores device memory around each replay pass, and what the
    # allocator no longer holds is memory it need not copy.
    torch.cuda.empty_cache()
    torch.cuda.profiler.start()
    for run, call in calls:
        ncu.marker()  # the kernels up to the next marker are this call's
        torch.cuda.nvtx.range_push(label(run))
        call()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    if plan_path:
        Path(plan_path).write_text(json.dumps({"runs": [run for run, _ in calls], "skipped": skipped}))


# ---------------------------------------------------------------------------------------------
# The profiler side (coursekit.ncu runs ncu and reads its CSV)
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="store_true", help="run only what ncu profiles")
    parser.add_argument("--plan", help="--workload: write the calls it ran (and skipped) here")
    parser.add_argument("--only", help="profile only the calls whose label matches this regex")
    parser.add_argument("--shape", type=lambda v: tuple(int(x) for x in v.split(",")), default=(BATCH, HEADS, SEQLEN),
                        metavar="B,H,S", help="batch, heads and seqlen of the inputs (default %(default)s); "
                        "another shape prints its table without writing the results file")
    parser.add_argument("--source", metavar="KERNEL_REGEX",
                        help="with --only: ncu's source view of the first matching kernel, its hottest instructions")
    parser.add_argument("--source-csv", metavar="FILE", help="the source view's table from an exported source page")
    parser.add_argument("--top", type=int, default=25, help="instructions the source view lists (default 25)")
    args = parser.parse_args(argv)
    if args.source and not args.only:
        parser.error("--source profiles one call: name it with --only")
    if len(args.shape) != 3 or min(args.shape) < 1:
        parser.error(f"--shape takes three positive integers B,H,S, got {args.shape}")
    return args


def source_view(args):
    """--source: sample the call's kernel under ncu into a report, export its source page and print
    the hottest instructions (coursekit.ncu.source_hotspots says what the samples mean)."""
    import shutil
    import subprocess
    import tempfile
    exe = shutil.which("ncu")
    passed = ["--only", args.only, "--shape", ",".join(map(str, args.shape))]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "source.ncu-rep"
        for cmd in (ncu.source_command(exe, Path(__file__).resolve(), passed, args.source, report),
                    ncu.source_export_command(exe, report)):
            print("running", " ".join(map(str, cmd)), flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"ncu failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def main(argv=None):
    args = parse_args(argv)
    if args.source_csv:
        print(ncu.format_hotspots(ncu.source_hotspots(Path(args.source_csv).read_text(errors="replace"), args.top)))
        return 0
    why = ncu.unavailable("profile_attention", need_ncu=not args.workload)
    if why is not None:
        print(why)
        return 0
    if args.workload:
        workload(args.plan, args.only, args.shape)
        return 0
    if args.source:
        text = source_view(args)
        print(f"{CHAPTER}: {args.only} at {'x'.join(map(str, args.shape))}, kernel /{args.source}/, under ncu")
        print(ncu.format_hotspots(ncu.source_hotspots(text, args.top)))
        return 0
    default_shape = args.shape == (BATCH, HEADS, SEQLEN)
    passed = (["--only", args.only] if args.only else []) + ([] if default_shape else ["--shape", ",".join(map(str, args.shape))])
    profile = ncu.run(Path(__file__).resolve(), METRICS, args=passed, from_start=False, unsure=UNSURE, plan=True)
    plan = profile.plan
    try:
        groups = ncu.split_by_marker(profile.kernels, [label(r) for r in plan["runs"]])
    except ValueError as e:
        sys.exit(f"{e}; profiled kernels: " + ", ".join(k["kernel"][:60] for k in profile.kernels))
    if not plan["runs"]:
        sys.exit(f"no call ran (--only {args.only!r}?); skipped: {plan['skipped']}")
    rows = [summarize_call(run, ks, run_flops(run, args.shape), args.shape) for run, ks in zip(plan["runs"], groups)]
    path = None
    if not args.only and default_shape:  # a subset or another shape would overwrite the record
        from coursekit import results
        path = results.write_results(
            CHAPTER, rows, {}, **profile.provenance(), skipped=plan["skipped"],
            attribution=f"a {ncu.MARKER} marker kernel launched before each call",
            workload={"dtype": DTYPE, "batch": BATCH, "heads": HEADS, "seqlen": SEQLEN,
                      "head_dims": list(HEAD_DIMS)})
    for note in plan["skipped"]:
        print(f"skipped {note['label']}: {note['reason'][:160]}")
    if profile.dropped or profile.missing():
        print(f"metrics ncu rejected: {profile.dropped or 'none'}; reported by no kernel: "
              f"{profile.missing() or 'none'}")
    print(f"\n{CHAPTER}, {DTYPE} {'x'.join(map(str, args.shape))}, under ncu ({profile.version}); the main (longest) "
          "kernel's counters, ms and TFLOP/s of all the call's kernels")
    print(format_table(rows))
    print(f"wrote {path}" if path else "nothing written: --only or --shape profiles a subset")
    return 0


if __name__ == "__main__":
    sys.exit(main())
