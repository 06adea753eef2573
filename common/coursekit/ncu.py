"""Run a chapter's workload under Nsight Compute (ncu) and read the counters back.

Each chapter's profile_*.py names its metrics and its kernels; this module runs
`ncu --csv` over `python <script> --workload` and parses the result. Counters, not timings:
ncu replays each kernel once per metric pass, with clocks left as they are."""
import argparse
import csv
import io
import shutil
import subprocess
import sys
from pathlib import Path


def parse(csv_text, metrics):
    """ncu --csv output -> one dict per profiled kernel, in launch order:
    {"kernel": demangled name, <short metric name>: value, ...}."""
    start = csv_text.find('"ID"')
    kernels = {}
    for row in csv.DictReader(io.StringIO(csv_text[start:])):
        k = kernels.setdefault(int(row["ID"]), {"kernel": row["Kernel Name"]})
        value = row["Metric Value"].replace(",", "")
        k[metrics.get(row["Metric Name"], row["Metric Name"])] = float(value) if value else None
    return [kernels[i] for i in sorted(kernels)]


def profile(script, kernel_regex, metrics, from_start=True):
    """Profile every kernel whose demangled name matches kernel_regex while `script
    --workload` runs; metrics maps ncu metric names to the short names returned. With
    from_start=False only the kernels between the workload's cudaProfilerStart and
    cudaProfilerStop (torch.cuda.profiler.start/stop) are profiled: warm-up, compilation and
    autotuning stay out."""
    ncu = shutil.which("ncu")
    if ncu is None:
        sys.exit("ncu (Nsight Compute) not found on PATH")
    cmd = [ncu, "--csv", "--clock-control", "none", "--kernel-name-base", "demangled",
           "--kernel-name", f"regex:{kernel_regex}", "--metrics", ",".join(metrics),
           "--profile-from-start", "on" if from_start else "off",
           sys.executable, str(script), "--workload"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"ncu failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return parse(proc.stdout, metrics)


def workload_or_profile(doc, script, workload, kernel_regex, metrics, from_start=True):
    """The command line of every profile_*.py. With --workload: run the workload (what ncu
    profiles, in this process) and return None. Without: profile `script --workload` under
    ncu and return the kernels (see profile). Without a CUDA GPU: say so and return None, a
    message and not a failure, as chapter 6's profile_attention.py does."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="store_true", help="run only what ncu profiles")
    args = parser.parse_args()
    import torch
    if not torch.cuda.is_available():
        # Both halves launch CUDA kernels; without a GPU torch would fail deep in the workload.
        print(f"{Path(script).name} profiles CUDA kernels with Nsight Compute; no CUDA GPU is visible, "
              "nothing written")
        return None
    if args.workload:
        workload()
        return None
    return profile(script, kernel_regex, metrics, from_start)
