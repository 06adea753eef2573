"""Clocks and power while each forward runs in sustained bursts: is part 3's gap to cuDNN a clock
difference? Three rounds of 4-second bursts of sdpa_cudnn, pingpong and warp_specialized at
b2 h16 s8192 d128 bf16 (the sweep's s = 8192 shape), each timed with CUDA events (median), while
nvidia-smi logs the SM clock and the power draw beside it:

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 500 > smi.csv &
    python experiments/power_probe.py > power_probe.txt     # from the chapter folder; then stop nvidia-smi

lesson_facts.hopper_power reads both files back (results/<gpu>/chapter6_hopper_power_probe*.txt/.csv).
"""
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]
import flash_attention  # noqa: E402

B, H, S, D = 2, 16, 8192, 128
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
flops = 4 * B * H * S * S * D
calls = {"sdpa_cudnn": lambda: F.scaled_dot_product_attention(q, k, v),
         "pingpong": lambda: flash_attention.attention(q, k, v, version="pingpong"),
         "warp_specialized": lambda: flash_attention.attention(q, k, v, version="warp_specialized")}


def burst(name, seconds):
    fn = calls[name]
    fn()
    torch.cuda.synchronize()
    times, t_end = [], time.time() + seconds
    while time.time() < t_end:
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    ms = times[len(times) // 2]
    print(f"{time.strftime('%H:%M:%S')} {name:18s} {len(times):4d} calls median {ms:.3f} ms "
          f"{flops / ms / 1e9:.0f} TFLOP/s", flush=True)


with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # pins SDPA alone; the course's calls ignore it
    for _ in range(3):
        for name in ("sdpa_cudnn", "pingpong", "warp_specialized"):
            burst(name, 4.0)
