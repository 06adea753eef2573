"""Rung 10 against rung 9 and cuDNN, at seven model shapes: does walking a tile schedule pay, and where?

    python experiments/persistent_probe.py > ../results/<gpu>/chapter6_persistent_probe.txt

pingpong, persistent and SDPA's cuDNN backend (bf16, forward) each captured as one CUDA graph of
several calls, the three interleaved over 7 rounds so that the clock's drift at the power cap hits
each alike; the median per call. "same bits" checks persistent's output against pingpong's. The
chapter's benchmark (bench_attention.py) times every rung at its sweep shapes; this probe answers
the narrower question the lesson asks of rung 10, on the shapes where the schedule should matter
(causal tiles of unequal length, GQA, short walks) and one where it should not (long full rows).
"""
import datetime
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]
import flash_attention  # noqa: E402

commit = os.environ.get("COURSE_GIT_COMMIT") or subprocess.run(
    ["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip() or "unknown"
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"commit {commit}, {datetime.date.today().isoformat()}")
torch.manual_seed(0)
SHAPES = [(2, 16, 16, 8192, 128, False), (2, 16, 16, 8192, 128, True), (8, 16, 16, 2048, 64, True),
          (4, 32, 8, 4096, 128, True), (16, 16, 16, 512, 64, True), (32, 16, 16, 512, 128, False),
          (64, 32, 32, 512, 64, False)]
rows = []
for b, h, hk, s, d, causal in SHAPES:
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16)
    ke, ve = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)
    calls = {"pingpong": lambda: flash_attention.attention(q, k, v, causal=causal, version="pingpong"),
             "persistent": lambda: flash_attention.attention(q, k, v, causal=causal, version="persistent"),
             "sdpa_cudnn": cudnn}
    same = torch.equal(calls["pingpong"](), calls["persistent"]())
    try:
        cudnn()
    except Exception as e:  # noqa: BLE001
        print(f"sdpa_cudnn does not run here: {type(e).__name__}: {str(e)[:120]}")
        del calls["sdpa_cudnn"]
    flops = 4 * b * h * s * s * d // (2 if causal else 1)
    reps = max(3, min(50, int(4e12 / flops)))  # about 10 ms of work per round and variant
    times = {n: [] for n in calls}
    runs = {}  # each variant's reps calls as one CUDA graph (no host time between the kernels), else eager
    for n, f in calls.items():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                f()
        torch.cuda.current_stream().wait_stream(side)
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(reps):
                    f()
            runs[n] = g.replay
        except Exception as e:  # noqa: BLE001
            print(f"{n}: no graph ({type(e).__name__}: {str(e)[:80]}), eager")
            runs[n] = lambda f=f: [f() for _ in range(reps)]
    torch.cuda.synchronize()
    for _ in range(7):  # rounds, the variants interleaved so that clock drift hits each alike
        for n, run in runs.items():
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            stop.record()
            stop.synchronize()
            times[n].append(start.elapsed_time(stop) / reps)
    del runs
    ms = {n: statistics.median(t) for n, t in times.items()}
    ms.setdefault("sdpa_cudnn", float("nan"))
    rows.append((f"b{b} h{h}/{hk} s{s} d{d} {'causal' if causal else 'full'}", ms, flops, same))
print(f"{'shape':<30}{'pingpong':>16}{'persistent':>16}{'sdpa_cudnn':>16}{'pers/ping':>11}{'pers/cudnn':>12}{'ping/cudnn':>12}  same bits")
for name, ms, flops, same in rows:
    tf = {n: flops / (t * 1e-3) / 1e12 for n, t in ms.items()}
    cells = "".join(f"{tf[n]:.0f} ({ms[n]:.3f})".rjust(16) for n in ("pingpong", "persistent", "sdpa_cudnn"))
    print(f"{name:<30}{cells}{ms['pingpong'] / ms['persistent']:>10.3f}x{ms['sdpa_cudnn'] / ms['persistent']:>11.3f}x"
          f"{ms['sdpa_cudnn'] / ms['pingpong']:>11.3f}x  {same}")
print(f"(TFLOP/s (median ms per call); x = speed ratio; {torch.cuda.get_device_name()}; bf16; cudnn gets k, v "
      "expanded to the query heads for GQA)")
