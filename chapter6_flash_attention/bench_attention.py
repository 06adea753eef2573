"""Chapter 6 benchmark: attention forward and backward, the course's kernels against every SDPA
backend and the bf16 matmul ceiling, plus the memory each one needs and the error each one makes.

Napkin math, for q (batch, heads, s_q, head_dim) against k, v (batch, heads, s_k, head_dim):

- FLOPs of the forward: 4 * batch * heads * s_q * s_k * head_dim (S = Q K^T and O = P V, two
  FLOPs per multiply-add each); halved for causal when s_q == s_k, since only the lower
  triangle is computed (the FlashAttention papers' convention, so TFLOP/s compare across them).
- FLOPs of the backward: 2.5x the forward (five matmuls against the forward's two: Q K^T again
  to rebuild P, then dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q).
- The naive version materialises the scores: batch * heads * s_q * s_k elements, written and
  read back, four bytes each when PyTorch's math backend upcasts 16-bit inputs to float32 (it
  does, by default). At s = 16384, 16 heads, that is 16 GiB for S alone, against 64 MiB for
  each of Q, K, V and O: the seqlen^2 term this chapter removes. attention_memory rows measure it.
- The ceiling: a plain bf16 n x n matmul measured in the same run (bench.matmul_ceiling). A
  flash forward is two such matmuls plus a softmax between them, so it reaches a large fraction
  of the ceiling at long sequences (causal less, for its half-empty diagonal tiles) and little
  at short ones; fp16 rows are held to the same bf16 ceiling (one tensor-core rate for both).

The grid (the lesson's): seqlen 512 ... 16384 with batch * seqlen = 16384 tokens and
heads * head_dim = 2048, so every row does the same projection-sized work and only the
attention shape changes; head_dim 64 and 128; causal and not; bf16 and fp16; forward and
backward. Variants: sdpa_flash, sdpa_cudnn, sdpa_efficient, sdpa_math (SDPA pinned to one
backend by torch.nn.attention.sdpa_kernel; a backend that refuses a shape is skipped and why is
recorded once; sdpa_math is skipped where its float32 score matrices would pass 20 GiB), then
every rung of flash_attention.VERSIONS and `default` (version=None). speedup_vs_torch is against
sdpa_flash at the same row (the record's "baseline" field says so).

Split-KV rows (op attention_split_kv, CUDA only): 1, 16 and 128 query rows of 16 heads against
4K-128K keys, where one (batch, head, query tile) block per head leaves 116 of 132 SMs idle; the
rows give GB/s over q, k, v and o, the bytes such a call cannot avoid, and TFLOP/s beside them.

Timing: CUDA graphs, CUDA events around each replay, median of 20 replays; a graph that fails
to capture falls back to events and the row says so. The sweep and the window, softcap and FP8
sections replay all the variants of a row in 20 rounds, one replay of each a round in an order
shuffled each round (bench.time_interleaved), so that a drift over the run falls on every
variant alike; the other sections time each variant's replays back to back (bench.time_probed). Backward rows
of SDPA, and the row of ours marked call=autograd, time torch.autograd.grad of the output over a
retained graph (bench.backward_call); the backward rungs and `default` time the backward op
alone, so that the dispatch compares with its rungs like for like (as chapter 4 does).

Run time on an H100: every input set is >= 64 MiB per tensor (far above the 50 MB L2), so one
set is replayed. A replay holds as many calls as make it last >= 2 ms (at most 8, bench's
default) and one call at the long sequences, so a row costs ~24 calls (2 probe, 1 warm-up, 1
first replay, 20 timed) where default_timer's fixed 8 calls per replay would cost ~170. The grid
is ~91 TFLOP per variant (both dtypes and head dims, causal and not, forward and backward), so
~24 x 91 TFLOP at 250-400 TFLOP/s is 6-9 s of kernels per fast variant plus ~0.1 s per short
row (96 of them): ~20 s per SDPA backend (the efficient one ~30 s, math only where it fits),
~20 s per course rung near SDPA's speed, and any call over 100 ms (a naive rung at a long
sequence) is skipped with a note rather than timed. Baselines, ceilings, memory and accuracy
rows come to ~2 minutes; with five rungs and the default the whole run is ~4 minutes, and the
wall time is recorded in the results (wall_s) to check this against.

Packed rows (op attention_varlen, CUDA only, `--ops attention_varlen`): 16 sequences of 128 to
8192 tokens (VARLEN_LENGTHS, 33024 in all) packed along one dim, 16 heads of d = 128, bfloat16,
causal, forward and backward. Variants: default (attention_varlen, version=None) and its rungs
("tuned", "split_kv", and "persistent" where the Hopper kernels run; "mma", "mma_dqpass", and
"wgmma" where the Hopper kernels run),
flex_attention (torch.compile'd, with a document mask over the packed tokens, its block mask built
before the timing), and sdpa_cudnn and sdpa_flash on the padded
batch (16 x 8192, the padding computed and thrown away), and this chapter's own "tuned" and
"mma_dqpass" on that padded batch (the same kernels: what the packed layout saves, everything else
equal). TFLOP/s counts the useful work alone, each
sequence's own causal triangle, so the padded baselines pay for their padding in time. These rows
go to their own file, results/<device-slug>/chapter6_flash_attention_varlen.json, so that a run of
them alone leaves the main results as they were.

    python bench_attention.py           full run on a GPU
    python bench_attention.py --quick   small sizes: CPU machines (the CPU reference, variant
                                        "cpu", against SDPA on the CPU), GPU smoke runs
    python bench_attention.py --ops attention_fp8   the FP8 rows and their accuracy alone (below)
    python bench_attention.py --ops attention_overlap   the bf16 forward's overlap candidate (below)
    python bench_attention.py --ops attention_varlen   the packed rows alone (a GPU)
    python bench_attention.py --ops attention_window attention_softcap   the masked rows (below)
    python bench_attention.py --ops transformers_model   a Hugging Face model on the chapter's attention
                                        against its SDPA path (bench_transformers_model says how)

Masked rows (`--ops attention_window`, `--ops attention_softcap`): the kernels' compile-time
window-and-softcap instantiations. attention_window: b1 h16 s32768 d128 bf16 causal with
window=(4095, 0), 4096 keys per row at most; attention_softcap: b2 h16 s8192 d128 bf16 causal with
softcap=30. Forward and backward; variants default and each rung that takes the mask, flex_attention
(torch.compile'd, the same mask as a block mask built before the timing, the softcap as a score_mod),
and the dense causal call of the same shape by default (and sdpa_cudnn for the window): what the
mask saves or costs. Every row is credited the masked call's useful work, counted pair by pair
(masked_flops); speedup_vs_torch is against flex_attention. Each section writes its own file,
results/<device-slug>/chapter6_flash_attention_window.json and ..._softcap.json, so that either can
be run again alone. On the CPU they run at small sizes with the C++ reference (variant cpu); there
flex_attention has a forward only.

FP8 rows (Hopper with the sm_90a kernels only): attention_fp8 on e4m3 inputs, op attention, dtype
float8_e4m3fn, variant default (the one FP8 forward), at three shapes of the sweep -- b2 h16 s8192
d128 full and causal, b8 h32 s2048 d64 causal -- beside the bf16 rows of the same shapes; inputs
quantized outside the timed call, and a second row (call "quantize_fp8 + attention_fp8") with the
three quantizations inside it. FLOPs are the forward's count whatever the dtype, so TFLOP/s compare
times; pct_of_mm is against the bf16 matmul ceiling (FP8's tensor-core rate is twice it on Hopper:
100% of it is half of what FP8 can reach), and speedup_vs_torch against sdpa_cudnn in bf16.
Accuracy rows (op attention_rmse, on the CPU too): FlashAttention 3's experiment, q, k, v ~ N(0, 1)
plus a rare N(0, 100) term (FP8_OUTLIERS), the RMSE of the output against float64 for
attention_fp8 with per-tensor scales, without and with rotate_qk, and for the bf16 forward.

Overlap rows (`--ops attention_overlap`, Hopper with the sm_90a kernels only): rung "pingpong" with
FLASH_ATTENTION_HOPPER_OVERLAP=1 (FlashAttention 3's intra-warpgroup overlap in its turns; read at
each call; rung "persistent" too), variants pingpong_overlap and persistent_overlap, beside
sdpa_cudnn, persistent and pingpong (the joint schedule), at OVERLAP_SHAPES (b2 h16 s8192, b4 h16 s4096, b32 h16 s512 at d = 128; b8 h32 s2048, b2
h32 s8192, b32 h32 s512 at d = 64; full and causal), to results/<device-slug>/chapter6_flash_attention_overlap.json.

Writes results/<device-slug>/chapter6_flash_attention.json and the plots beside it.
`--ops attention_fp8` writes the FP8 rows, sdpa_cudnn and pingpong in bf16 timed beside them, and
the accuracy rows to results/<device-slug>/chapter6_flash_attention_fp8.json instead, leaving the
main results as they were. With `--fp8-candidates NAME ...` it also times the FP8 launcher's
candidates (the environment variable FLASH_ATTENTION_FP8_FORWARD, read at each call; unset is the
default, n192_full at d = 128 and longest_first at 64: longest_first; head_order; n192; n192_full;
csrc/hopper/flash_fwd_hopper_fp8.cuh says what each is) at each FP8 shape, right after its default
row: rows with call "attention_fp8, NAME". n192 and n192_full exist at d = 128 only: at d = 64 the
call refuses them by name, and the row is noted skipped.
"""
import contextlib
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from coursekit import bench, plots, results  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flash_attention  # noqa: E402
from lesson_facts import FP8_DTYPE, fp8_rows_beside  # noqa: E402  (the lesson's grouping, once)

CHAPTER = "chapter6_flash_attention"
# What speedup_vs_torch divides by: the strongest SDPA backend, cuDNN's on a GPU (on Hopper its
# kernels use wgmma and TMA, FlashAttention 3's machinery, which the part 3 rungs are held to); on
# the CPU, where cuDNN does not run, the flash backend's CPU kernel. The accuracy rows are held to
# the flash backend's error on every device (twice it at most).
ERROR_BASELINE = "sdpa_flash"


def speed_baseline(device):
    return "sdpa_cudnn" if device == "cuda" else "sdpa_flash"

SDPA_BACKENDS = {  # convention names (CONTRIBUTING.md, section 5) -> the backend pinned
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}
MATH_BUDGET_GiB = 20  # the math backend's score matrices above this are not run (H100: 80 GB)
MAX_CALL_MS = 100.0   # a call slower than this is skipped, not timed (keeps the run in minutes)


# ---------------------------------------------------------------------------------------------
# Napkin math and the grid: pure functions (test_bench_attention.py holds them)
# ---------------------------------------------------------------------------------------------
def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal, pass_="forward"):
    """FLOPs credited to one call: 4 b h s_q s_k d forward, halved for a square causal mask,
    2.5x that for the backward. Every variant of a row gets the same count, so TFLOP/s compare
    times, and a kernel that computes the masked half anyway shows as slower, not as busier."""
    flops = 4 * batch * heads * seqlen_q * seqlen_k * head_dim
    if causal and seqlen_q == seqlen_k:
        flops //= 2
    return flops * 5 // 2 if pass_ == "backward" else flops


def math_bytes(batch, heads, seqlen_q, seqlen_k, pass_="forward"):
    """What SDPA's math backend holds at once, estimated: it upcasts 16-bit inputs to float32 and
    keeps the scores and the probabilities (two float32 s_q x s_k matrices per head); the
    backward adds the gradient of each (two more)."""
    matrices = 4 if pass_ == "backward" else 2
    return matrices * 4 * batch * heads * seqlen_q * seqlen_k


def sizes_for(device, quick):
    """The sweep, and the shapes of the memory and accuracy rows. The GPU grid is the lesson's;
    the CPU one runs the reference (float32, one query row at a time) in seconds."""
    if device == "cuda" and not quick:
        return {"seqlens": [512, 1024, 2048, 4096, 8192, 16384], "tokens": 16384, "hidden": 2048,
                "head_dims": [64, 128], "dtypes": ["bfloat16", "float16"],
                "memory": {"batch": 1, "heads": 16, "seqlen": 8192, "head_dim": 128, "dtype": "bfloat16"},
                "error": {"batch": 2, "heads": 8, "seqlen": 1000, "head_dim": 128,
                          "dtypes": ["bfloat16", "float16"]}}
    if device == "cuda":
        return {"seqlens": [512, 2048], "tokens": 4096, "hidden": 1024, "head_dims": [64, 128],
                "dtypes": ["bfloat16"],
                "memory": {"batch": 1, "heads": 16, "seqlen": 2048, "head_dim": 128, "dtype": "bfloat16"},
                "error": {"batch": 2, "heads": 8, "seqlen": 1000, "head_dim": 128, "dtypes": ["bfloat16"]}}
    return {"seqlens": [64, 128, 256], "tokens": 512, "hidden": 256, "head_dims": [64],
            "dtypes": ["float32"], "memory": None,
            "error": {"batch": 1, "heads": 2, "seqlen": 100, "head_dim": 64, "dtypes": ["float32"]}}


def configs(s):
    """Every (dtype, head_dim, causal, seqlen) of the sweep, with the batch and heads that keep
    batch * seqlen and heads * head_dim at the grid's totals."""
    return [{"dtype": dtype, "head_dim": d, "causal": causal, "seqlen": n,
             "batch": max(1, s["tokens"] // n), "heads": s["hidden"] // d}
            for dtype in s["dtypes"] for d in s["head_dims"] for causal in (False, True)
            for n in s["seqlens"]]


# ---------------------------------------------------------------------------------------------
# The sweep: every variant of every row, probed, then timed (bench.probe, bench.time_probed)
# ---------------------------------------------------------------------------------------------
def sdpa_call(backend, causal):
    """F.scaled_dot_product_attention pinned to one backend. The context is entered inside the
    call, so a graph captures the pinned kernel and a backward sees the forward's choice."""
    def call(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


def dispatch_of(op, q, causal):
    """The rung version=None runs for q with this mask, where the package says (chapter 4's
    default_choice(op, x)); nothing until the chapter's CUDA dispatch exists. The mask is asked
    too: the rule reads it (a causal row sees about half the keys)."""
    choose = getattr(flash_attention, "default_choice", None)
    if choose is None or q.device.type != "cuda":
        return {}
    try:
        return {"dispatch": choose(op, q, causal=causal)}
    except Exception:  # noqa: BLE001  (a dispatch that cannot say leaves the field out)
        return {}


def make_inputs(batch, heads, seqlen, head_dim, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, heads, seqlen, head_dim)
    return tuple(torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(4))


def variants_for(device, c, q, k, v, dy, pass_):
    """[(variant, make, fields)] of one row, sdpa_flash first. make() builds the callable (for a
    backward, it runs the forward that the timed grad walks back through), so a variant's saved
    tensors live only while it is timed."""
    causal, scale = c["causal"], 1.0 / math.sqrt(c["head_dim"])
    out = []
    for name, backend in SDPA_BACKENDS.items():
        f = sdpa_call(backend, causal)
        if pass_ == "forward":
            out.append((name, lambda f=f: (lambda: f(q, k, v)), {}))
        else:
            out.append((name, lambda f=f: bench.backward_call(f, grad_leaves(q, k, v), dy), {}))
    course = (lambda q, k, v: flash_attention.attention(q, k, v, causal=causal))
    if device != "cuda":  # the CPU reference is not a rung: one row, named cpu
        if pass_ == "forward":
            return out + [("cpu", lambda: (lambda: course(q, k, v)), {})]
        return out + [("cpu", lambda: bench.backward_call(course, grad_leaves(q, k, v), dy), {})]
    if pass_ == "forward":
        for ver in flash_attention.VERSIONS.get("attention_forward", ()):
            out.append((ver, lambda ver=ver: (lambda: flash_attention.attention(
                q, k, v, causal=causal, version=ver)), {}))
        return out + [("default", lambda: (lambda: course(q, k, v)), dispatch_of("attention_forward", q, causal))]

    def backward_op(ver):
        def make():
            o, lse = flash_attention.attention_forward(q, k, v, scale, causal)
            return lambda: flash_attention.attention_backward(dy, q, k, v, o, lse, scale, causal, version=ver)
        return make
    for ver in flash_attention.VERSIONS.get("attention_backward", ()):
        out.append((ver, backward_op(ver), {}))
    return out + [("default", backward_op(None), dispatch_of("attention_backward", q, causal)),
                  ("default", lambda: bench.backward_call(course, grad_leaves(q, k, v), dy), {"call": "autograd"})]


def grad_leaves(q, k, v):
    # Leaves sharing the inputs' storage: the forward rows time q, k, v without autograd.
    return tuple(t.detach().requires_grad_() for t in (q, k, v))


def bench_timing(device, mm, s, notes):
    rows = []
    # (variant, call, pass, dtype, head_dim, causal) found too slow at some seqlen: the larger
    # ones (configs() runs seqlen upwards) are skipped without the probe, which alone would
    # cost a slow rung seconds per call there.
    too_slow = set()
    for c in configs(s):
        b, h, n, d = c["batch"], c["heads"], c["seqlen"], c["head_dim"]
        dtype = getattr(torch, c["dtype"])
        q, k, v, dy = make_inputs(b, h, n, d, dtype, device)
        for pass_ in ("forward", "backward"):
            where = f"{c['dtype']} d={d} {'causal' if c['causal'] else 'full'} s={n} {pass_}"
            flops = attention_flops(b, h, n, n, d, c["causal"], pass_)
            # Every variant of the row probed first, then all timed in shuffled rounds
            # (bench.time_interleaved): a row's variants are compared with each other (x sdpa_cudnn,
            # the default against its own rung), so whatever drifts over the run, the clock at the
            # power cap above all, must fall on all of them alike. Timed one after another, the
            # default and its rung, the same kernel, came out up to 6% apart in one run.
            probed, fields_of = [], []
            for variant, make, more in variants_for(device, c, q, k, v, dy, pass_):
                slow_key = (variant, more.get("call"), pass_, c["dtype"], d, c["causal"])
                if slow_key in too_slow:
                    continue
                need = math_bytes(b, h, n, n, pass_) / 2**30
                if variant == "sdpa_math" and need > MATH_BUDGET_GiB:
                    notes.skip(variant, f"its float32 score matrices would need > {MATH_BUDGET_GiB} GiB",
                               f"{where}, estimated {need:.0f} GiB")
                    continue
                fn = bench.attempt(notes, variant, where, make)
                est = fn and bench.attempt(notes, variant, where, lambda: bench.probe(fn, device))
                if est is None:
                    continue
                if est > MAX_CALL_MS:
                    too_slow.add(slow_key)
                    notes.skip(variant, f"one call took over {MAX_CALL_MS:.0f} ms (here {est:.0f} ms); "
                                        "not timed at this and larger sizes", where)
                    continue
                probed.append((variant, fn, est))
                fields_of.append(more)
            times = bench.time_interleaved(notes, where, device, probed)
            timed = [(variant, more, t) for (variant, _, _), more, t in zip(probed, fields_of, times) if t]
            del probed
            base = next((t["median_ms"] for variant, more, t in timed
                         if variant == speed_baseline(device) and not more.get("call")), None)
            for variant, more, t in timed:
                rows.append(bench.flops_row("attention", variant, dtype, [b, h, n, d], flops, t, mm, base,
                                            **{"pass": pass_, "causal": c["causal"], "head_dim": d,
                                               "seqlen": n, "batch": b, "heads": h, "sweep": True, **more}))
        del q, k, v, dy
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# Split-KV: a few query rows against a long context
# ---------------------------------------------------------------------------------------------
SPLIT_KV = {"batch": 1, "heads": 16, "head_dim": 128, "dtype": "bfloat16",
            "seqlen_q": [1, 16, 128], "seqlen_k": [4096, 16384, 65536, 131072]}


def attention_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, itemsize):
    """The least a forward moves: q and o once, k and v once (heads_kv == heads here). With few
    query rows it is all k and v: the row is memory bound, and bandwidth is its measure."""
    return (2 * seqlen_q + 2 * seqlen_k) * batch * heads * head_dim * itemsize


def bench_split_kv(device, ceilings, notes):
    """Rung "split_kv" where it exists for: batch 1, 16 heads, 1 to 128 query rows (one query
    tile or less: 16 blocks for 132 SMs without splitting) against 4K-128K keys, not causal
    (SDPA aligns a causal mask top-left, this chapter bottom-right, and the two differ when
    s_q != s_k). "tuned" is the same kernel unsplit; sdpa_flash is the baseline."""
    if device != "cuda":
        notes.skip("attention_split_kv", "split-KV rows run on CUDA only (the rung is a CUDA kernel)", device)
        return []
    c = SPLIT_KV
    b, h, d = c["batch"], c["heads"], c["head_dim"]
    dtype = getattr(torch, c["dtype"])
    rows = []
    for n_k in c["seqlen_k"]:
        g = torch.Generator(device=device).manual_seed(1)
        k, v = (torch.randn(b, h, n_k, d, generator=g, device=device, dtype=dtype) for _ in range(2))
        for n_q in c["seqlen_q"]:
            q = torch.randn(b, h, n_q, d, generator=g, device=device, dtype=dtype)
            where = f"split_kv s_q={n_q} s_k={n_k}"
            calls = [("sdpa_flash", lambda: sdpa_call(SDPBackend.FLASH_ATTENTION, False)(q, k, v)),
                     ("sdpa_cudnn", lambda: sdpa_call(SDPBackend.CUDNN_ATTENTION, False)(q, k, v))]
            calls += [(ver, lambda ver=ver: flash_attention.attention(q, k, v, version=ver))
                      for ver in ("tuned", "split_kv", None)]
            nbytes = attention_bytes(b, h, n_q, n_k, d, q.element_size())
            flops = attention_flops(b, h, n_q, n_k, d, False)
            t_base = None
            for variant, fn in calls:
                variant = variant or "default"
                t = bench.probe_and_time(notes, variant, where, device, fn)
                if not t:
                    continue
                if variant == speed_baseline(device):
                    t_base = t["median_ms"]
                rows.append(bench.bandwidth_row(
                    "attention_split_kv", variant, dtype, [b, h, n_q, n_k, d], nbytes, t, ceilings["copy_GBps"],
                    t_base, **{"pass": "forward", "causal": False, "head_dim": d, "batch": b, "heads": h,
                               "seqlen_q": n_q, "seqlen_k": n_k, "flops": flops,
                               "TFLOPs": bench.tflops(flops, t["median_ms"])}))
            del q
        del k, v
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# FP8: attention_fp8 beside the bfloat16 forward, and its error with outliers
# ---------------------------------------------------------------------------------------------
# (batch, heads, seqlen, head_dim, causal): shapes of the GPU sweep (configs()), so that each FP8 row
# sits beside the bf16 rows of its shape; d = 64 both ways, since the launcher's 192-key candidates
# run only without a causal mask there.
FP8_SHAPES = [(2, 16, 8192, 128, False), (2, 16, 8192, 128, True), (8, 32, 2048, 64, False),
              (8, 32, 2048, 64, True)]


def fp8_runnable(device):
    """Why the FP8 rows cannot run here, or None."""
    if device != "cuda":
        return "attention_fp8 runs on CUDA only"
    if torch.cuda.get_device_capability() != (9, 0) or not flash_attention.hopper_kernels_built():
        return "attention_fp8 needs a Hopper GPU (compute capability 9.0) and the sm_90a kernels built"
    return None


def fp8_fields(b, h, n, d, causal):
    """What an FP8 row shares with the bf16 sweep rows of its shape (op attention, variant default:
    attention_fp8 is the chapter's one FP8 forward, so there is no rung to choose)."""
    return {"pass": "forward", "causal": causal, "head_dim": d, "seqlen": n, "batch": b, "heads": h}


# The FP8 launcher's bench-only knob (flash_fwd_hopper_fp8.cuh's Fp8Forward), read at each call, and
# the candidates `--ops attention_fp8 --fp8-candidates NAME ...` times beside the default (main_ops).
FP8_KNOB = "FLASH_ATTENTION_FP8_FORWARD"
FP8_BENCH_CANDIDATES = []


@contextlib.contextmanager
def env_knob(knob, value):
    """A launcher's environment knob (read at each call) set to `value` for the calls inside (a
    graph captured inside keeps what they launched), restored after."""
    old = os.environ.get(knob)
    os.environ[knob] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[knob]
        else:
            os.environ[knob] = old


def fp8_candidate(name):
    """The FP8 launcher's candidate `name` for the calls inside."""
    return env_knob(FP8_KNOB, name)


def bench_fp8(device, mm, notes, beside=None, candidates=()):
    """The FP8 forward's rows: op attention, dtype float8_e4m3fn, variant default, on e4m3 inputs
    quantized outside the timed call, and (call "quantize_fp8 + attention_fp8") with the three
    quantizations inside it. `beside`: the rows already measured in this run (the sweep), whose
    sdpa_cudnn row of the shape is speedup_vs_torch's baseline; None (`--ops attention_fp8`, no
    sweep) times sdpa_cudnn and pingpong in bf16 here, in the same shuffled rounds as the FP8 rows of
    each shape.
    `candidates`: the FP8 launcher's candidates to time as well (call "attention_fp8, NAME")."""
    why = fp8_runnable(device)
    if why:
        notes.skip("attention_fp8", why, device)
        return []
    rows = []
    for b, h, n, d, causal in FP8_SHAPES:
        fields = fp8_fields(b, h, n, d, causal)
        q, k, v, _ = make_inputs(b, h, n, d, torch.bfloat16, device)
        q8, dq = flash_attention.quantize_fp8(q)
        k8, dk = flash_attention.quantize_fp8(k)
        v8t, dv = flash_attention.quantize_fp8(v, transpose=True)

        def quantized_call(q=q, k=k, v=v, causal=causal):
            q8_, dq_ = flash_attention.quantize_fp8(q)
            k8_, dk_ = flash_attention.quantize_fp8(k)
            v8t_, dv_ = flash_attention.quantize_fp8(v, transpose=True)
            return flash_attention.attention_fp8(q8_, k8_, v8t_, dq_, dk_, dv_, causal=causal)
        calls = [  # (variant, dtype of its inputs, fields, call)
            ("default", torch.float8_e4m3fn, {},
             lambda: flash_attention.attention_fp8(q8, k8, v8t, dq, dk, dv, causal=causal)),
            ("default", torch.float8_e4m3fn, {"call": "quantize_fp8 + attention_fp8"}, quantized_call),
        ]
        for name in candidates:
            def candidate_call(name=name, causal=causal):
                with fp8_candidate(name):
                    return flash_attention.attention_fp8(q8, k8, v8t, dq, dk, dv, causal=causal)
            calls.insert(-1, ("default", torch.float8_e4m3fn, {"call": f"attention_fp8, {name}"}, candidate_call))
        t_base = None
        if beside is None:
            calls[:0] = [
                ("sdpa_cudnn", torch.bfloat16, {}, lambda: sdpa_call(SDPBackend.CUDNN_ATTENTION, causal)(q, k, v)),
                ("pingpong", torch.bfloat16, {},
                 lambda: flash_attention.attention(q, k, v, causal=causal, version="pingpong"))]
        else:
            base = [r for r in beside if r["op"] == "attention" and r["variant"] == "sdpa_cudnn"
                    and r["dtype"] == "bfloat16" and not r.get("call")
                    and all(r.get(f) == x for f, x in fields.items())]
            t_base = base[0]["median_ms"] if base else None
        flops = attention_flops(b, h, n, n, d, causal)
        where = f"fp8 b{b} h{h} s{n} d{d} {'causal' if causal else 'full'}"
        # The shape's calls probed, then timed in shuffled rounds, as the sweep's variants are: the
        # FP8 rows' ratio to the bf16 ones is what they are for.
        timed = bench.time_calls_interleaved(notes, where, device,
                                             [(variant, fn, (dtype, more)) for variant, dtype, more, fn in calls])
        t_base = next((t["median_ms"] for variant, _, t in timed if variant == "sdpa_cudnn"), t_base)
        for variant, (dtype, more), t in timed:
            rows.append(bench.flops_row("attention", variant, dtype, [b, h, n, d], flops, t, mm, t_base,
                                        **fields, **more))
        del q, k, v, q8, k8, v8t
        torch.cuda.empty_cache()
    return rows


# The bf16 forward's overlap candidate (`--ops attention_overlap`): FLASH_ATTENTION_HOPPER_OVERLAP=1
# (flash_fwd_hopper.h, read at each call) runs rungs "pingpong" and "persistent" (the default's rung
# at d = 64 and 128) with FlashAttention 3's intra-warpgroup overlap in their turns, instead of the
# joint schedule. Timed per shape beside sdpa_cudnn, each rung's two schedules back to back (an
# H200's clocks drift down through a run). The shapes: the sweep's long
# rows and its short ones (s = 512), at the two head dims.
OVERLAP_KNOB = "FLASH_ATTENTION_HOPPER_OVERLAP"
OVERLAP_SHAPES = [(b, h, n, d, causal) for b, h, n, d in ((2, 16, 8192, 128), (4, 16, 4096, 128), (32, 16, 512, 128),
                                                          (8, 32, 2048, 64), (2, 32, 8192, 64), (32, 32, 512, 64))
                  for causal in (False, True)]


def overlap_calls(q, k, v, causal):
    """[(variant, fields, call)] of one overlap row: the baselines, then the two schedules of
    "pingpong"; every call of ours with the knob set, so that a knob in the caller's environment
    changes nothing here."""
    def ours(version, knob):
        def call():
            with env_knob(OVERLAP_KNOB, knob):
                return flash_attention.attention(q, k, v, causal=causal, version=version)
        return call
    knob = {"schedule": "overlap", "knob": f"{OVERLAP_KNOB}=1"}
    return [("sdpa_cudnn", {}, lambda: sdpa_call(SDPBackend.CUDNN_ATTENTION, causal)(q, k, v)),
            ("persistent", {"schedule": "joint"}, ours("persistent", "0")),
            ("persistent_overlap", knob, ours("persistent", "1")),
            ("pingpong", {"schedule": "joint"}, ours("pingpong", "0")),
            ("pingpong_overlap", knob, ours("pingpong", "1"))]


def bench_overlap(device, mm, notes, shapes=None):
    """Rows op attention, dtype bfloat16, pass forward, at OVERLAP_SHAPES: variants persistent_overlap
    and pingpong_overlap (the knob on) beside sdpa_cudnn (speedup_vs_torch's baseline), persistent
    and pingpong."""
    why = fp8_runnable(device)  # the same condition: a Hopper GPU and the sm_90a kernels
    if why:
        notes.skip("attention_overlap", why.replace("attention_fp8", "the overlap candidate"), device)
        return []
    rows = []
    for b, h, n, d, causal in shapes or OVERLAP_SHAPES:
        fields = {"pass": "forward", "causal": causal, "head_dim": d, "seqlen": n, "batch": b, "heads": h}
        q, k, v, _ = make_inputs(b, h, n, d, torch.bfloat16, device)
        flops = attention_flops(b, h, n, n, d, causal)
        where = f"overlap b{b} h{h} s{n} d{d} {'causal' if causal else 'full'}"
        t_base = None
        for variant, more, fn in overlap_calls(q, k, v, causal):
            t = bench.probe_and_time(notes, variant, where, device, fn)
            if not t:
                continue
            if variant == "sdpa_cudnn":
                t_base = t["median_ms"]
            rows.append(bench.flops_row("attention", variant, torch.bfloat16, [b, h, n, d], flops, t, mm, t_base,
                                        **fields, **more))
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def print_overlap_table(record):
    rows = [r for r in results.rows(record, op="attention") if r.get("pass") == "forward"]
    if not rows:
        return
    print("\nThe overlap candidate: TFLOP/s (x joint = the rung's joint time / its overlap's; x cudnn the same)")
    shapes = {}
    for r in rows:
        shapes.setdefault((r["batch"], r["heads"], r["seqlen"], r["head_dim"], r["causal"]), {})[r["variant"]] = r
    for (b, h, n, d, causal), got in shapes.items():
        cells = "  ".join(f"{name} {r['TFLOPs']:.0f}" for name, r in got.items())
        ratio = ""
        for rung in ("pingpong", "persistent"):
            ov, joint, cu = got.get(f"{rung}_overlap"), got.get(rung), got.get("sdpa_cudnn")
            ratio += (f"  {rung} x joint {joint['median_ms'] / ov['median_ms']:.3f}" if ov and joint else "") + (
                f" x cudnn {cu['median_ms'] / ov['median_ms']:.3f}" if ov and cu else "")
        print(f"  b{b} h{h} s{n} d{d} {'causal' if causal else 'full':<6}  {cells}{ratio}")


# The accuracy with outliers, FlashAttention 3's experiment (arXiv 2407.08608, its Table 3): each
# entry of q, k and v is N(0, 1) plus, with probability 0.001, an independent N(0, 100) term (std
# 10). Rare large entries are what a per-tensor scale handles worst: max|x| (~50 here, ~5 without
# them) sets the scale, so every ordinary entry keeps fewer of e4m3's levels. The paper's RMSEs
# against float64 (H100): FP8 with per-tensor scales 2.4e-2; with block scales and the Hadamard
# rotation 9.1e-3; the rotation alone 9.3e-3. This chapter's op takes per-tensor scales only, so the
# rotation is the part it shows.
FP8_OUTLIERS = {"fraction": 0.001, "std": 10.0}


def fp8_accuracy_config(device):
    if device == "cuda":
        return {"batch": 1, "heads": 16, "seqlen": 4096, "head_dim": 128, "causal": False, "dtype": "bfloat16"}
    # The CPU: the references (float64 of the dequantized inputs for attention_fp8), in seconds.
    return {"batch": 1, "heads": 2, "seqlen": 128, "head_dim": 64, "causal": False, "dtype": "float32"}


def outlier_inputs(shape, device, seed, fraction=FP8_OUTLIERS["fraction"], std=FP8_OUTLIERS["std"]):
    """q, k, v (float32): N(0, 1) entries, each with an N(0, std^2) term added with probability
    `fraction`."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(3):
        x = torch.randn(shape, generator=g, device=device)
        hit = torch.rand(shape, generator=g, device=device) < fraction
        out.append(x + hit * std * torch.randn(shape, generator=g, device=device))
    return tuple(out)


def rmse(x, ref):
    """sqrt(mean((x - ref)^2)) over every element, in float64."""
    return (x.double() - ref).square().mean().sqrt().item()


# The error histogram of an accuracy row (notebook 06's FP8 figure): |out - ref| per element in
# log-spaced bins, four a decade from 1e-7 to 10; errors below the first edge (exact ones
# included) and at or above the last are counted apart, so the counts add up to every element.
ERROR_EDGES = [10.0 ** (e / 4) for e in range(-28, 5)]


def error_histogram(x, ref):
    err = (x.double() - ref).abs().flatten()
    edges = torch.tensor(ERROR_EDGES, dtype=torch.float64, device=err.device)
    # bucketize(right=True): 0 below edges[0], i for edges[i-1] <= err < edges[i], len(edges) above
    counts = torch.bincount(torch.bucketize(err, edges, right=True), minlength=len(ERROR_EDGES) + 1).tolist()
    return {"edges": ERROR_EDGES, "below": counts[0], "counts": counts[1:-1], "above": counts[-1]}


def fp8_forward(q, k, v, causal, rotate):
    """attention_fp8 on q, k, v quantized per tensor, after rotate_qk when `rotate` (which leaves
    every score as it was, so the reference is the same)."""
    if rotate:
        q, k = flash_attention.rotate_qk(q, k)
    q8, dq = flash_attention.quantize_fp8(q)
    k8, dk = flash_attention.quantize_fp8(k)
    v8t, dv = flash_attention.quantize_fp8(v, transpose=True)
    return flash_attention.attention_fp8(q8, k8, v8t, dq, dk, dv, causal=causal)


def bench_fp8_accuracy(device, a, notes):
    """op attention_rmse: the RMSE of the forward's output against the float64 attention of the
    float32 inputs (outlier_inputs), for attention_fp8 (per-tensor descale) without and with
    rotate_qk, and for the 16-bit forward (a["dtype"]: bfloat16 on a GPU; float32 on the CPU, whose
    reference refuses 16-bit) on the same inputs rounded to it. Variant default on CUDA, cpu on the
    CPU, where the FP8 rows are the op's definition (the float64 attention of the dequantized
    inputs): the error of quantizing the inputs alone, with P kept exact."""
    b, h, n, d, causal = a["batch"], a["heads"], a["seqlen"], a["head_dim"], a["causal"]
    why = fp8_runnable(device) if device == "cuda" else None
    if why:
        notes.skip("attention_rmse", why, device)
        return []
    q, k, v = outlier_inputs((b, h, n, d), device, seed=2)
    ref = reference64(q, k, v, causal)[0].detach()
    variant = "default" if device == "cuda" else "cpu"
    where = f"rmse b{b} h{h} s{n} d{d}"
    half = getattr(torch, a["dtype"])
    calls = [(FP8_DTYPE, {"rotate": False, "descale": "per_tensor"}, lambda: fp8_forward(q, k, v, causal, False)),
             (FP8_DTYPE, {"rotate": True, "descale": "per_tensor"}, lambda: fp8_forward(q, k, v, causal, True)),
             (a["dtype"], {}, lambda: flash_attention.attention(q.to(half), k.to(half), v.to(half), causal=causal))]
    inputs = f"N(0,1) + N(0,{FP8_OUTLIERS['std'] ** 2:g}) x Bernoulli({FP8_OUTLIERS['fraction']:g})"
    rows = []
    for dtype, more, fn in calls:
        out = bench.attempt(notes, variant, f"{where} {dtype}", fn)
        if out is None:
            continue
        rows.append({"op": "attention_rmse", "variant": variant, "pass": "forward", "dtype": dtype,
                     "shape": [b, h, n, d], "batch": b, "heads": h, "seqlen": n, "head_dim": d, "causal": causal,
                     "inputs": inputs, **more, "rmse": rmse(out, ref), "max_abs_err": max_abs_err(out, ref),
                     "abs_err_histogram": error_histogram(out, ref)})
    del q, k, v, ref
    return rows


def print_fp8_table(record):
    shapes = fp8_rows_beside(record)
    if shapes:
        print("\nFP8 forward (e4m3 in, bf16 out): TFLOP/s beside bf16 sdpa_cudnn and pingpong "
              "(x pingpong = its time / the FP8 row's)")
        for (b, h, n, d, causal), got in shapes.items():
            pp = got.get("pingpong")
            cells = "  ".join(f"{name} {r['TFLOPs']:.0f}" + (f" (x{pp['median_ms'] / r['median_ms']:.2f})"
                                                            if pp and r["dtype"] == FP8_DTYPE else "")
                              for name, r in got.items())
            print(f"  b{b} h{h} s{n} d{d} {'causal' if causal else 'full':<6}  {cells}")
    acc = results.rows(record, op="attention_rmse")
    if acc:
        print(f"\nRMSE vs float64, {shape_text(acc[0]['shape'])}, inputs {acc[0]['inputs']}")
        for r in acc:
            how = f"rotate_qk={r['rotate']}" if "rotate" in r else ""
            print(f"  {r['variant']:<8}{r['dtype']:<15}{how:<17}{r['rmse']:>10.2e}  (max abs {r['max_abs_err']:.2e})")


# ---------------------------------------------------------------------------------------------
# Part 3's experiments: the Hopper GEMM against torch.mm, the forward's configurations
# ---------------------------------------------------------------------------------------------
EXPERIMENTS = HERE / "experiments"
GEMM_N = 8192


def hopper_experiments_runnable(device):
    """Why the experiments cannot run here, or None: they are torch-free CUDA programs that this
    benchmark compiles with nvcc for sm_90a and runs on a Hopper GPU."""
    if device != "cuda":
        return "the Hopper experiments run on CUDA only"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"the Hopper experiments need compute capability 9.0 (this GPU: {torch.cuda.get_device_capability()})"
    if shutil.which("nvcc") is None:
        return "nvcc is not on PATH (the experiments are compiled by this benchmark)"
    return None


def build_experiments(out_dir):
    """nvcc the GEMM program and the forward's check (with the Hopper kernels it links), every
    translation unit in parallel; returns {name: executable}."""
    from coursekit.build import include_dirs
    import sources
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = ["-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a"] + [
        f"-I{d}" for d in include_dirs(HERE, sources.INCLUDE_DIRS)]
    units = {"hopper_gemm": [EXPERIMENTS / "hopper_gemm.cu"],
             "hopper_forward_check": [EXPERIMENTS / "hopper_forward_check.cu"]
             + [HERE / s for s in sources.HOPPER_SOURCES if "flash_fwd_" in s]}  # the forward's kernels alone
    jobs = []
    for name, files in units.items():
        for f in files:
            obj = out_dir / f"{name}-{f.stem}.o"
            jobs.append((name, obj, subprocess.Popen(["nvcc", *flags, "-c", "-o", str(obj), str(f)],
                                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for name, obj, job in jobs:
        log, _ = job.communicate()
        if job.returncode != 0:
            raise RuntimeError(f"nvcc failed on {obj.name}: {log[-2000:]}")
    exes = {}
    for name in units:
        exes[name] = out_dir / name
        objs = [str(obj) for n, obj, _ in jobs if n == name]
        subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-o", str(exes[name]), *objs], check=True)
    return exes


def bench_hopper_experiments(device, mm, notes):
    """Rung 0 of part 3, experiments/hopper_gemm.cu: its checks, then its 8192^3 time against
    torch.mm (cuBLAS) at the same size, measured here beside it (op gemm_hopper; the program times
    itself with CUDA events, median of 30). And experiments/hopper_forward_check.cu: every rung
    against its float64 reference, then --variants, the forward's configurations beside the rungs
    (op attention_hopper_config, timed by the program: every configuration of a head dim on the same
    inputs, in 5 rotated rounds of 20 calls each, the median of its 100); what the rungs' tile,
    stage and schedule choices were measured from."""
    why = hopper_experiments_runnable(device)
    if why:
        notes.skip("hopper experiments", why, device)
        return []
    rows = []
    exes = bench.attempt(notes, "hopper experiments", "nvcc", lambda: build_experiments(HERE / "build" / "experiments"))
    if not exes:
        return rows
    gemm = subprocess.run([str(exes["hopper_gemm"]), "30"], capture_output=True, text=True, timeout=300)
    checked = gemm.returncode == 0 and "MISMATCH" not in gemm.stdout
    a, b = (torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cublas = {"A B^T": bench.time_fn(lambda: a @ b.t(), device), "A B": bench.time_fn(lambda: a @ b, device)}
    flops = 2 * GEMM_N**3
    for line in gemm.stdout.splitlines():
        m = re.match(r"time 8192\^3 B (K-major|MN-major): ([0-9.]+) ms", line)
        if not m:
            continue
        layout = "A B^T" if m.group(1) == "K-major" else "A B"
        ours = {"median_ms": float(m.group(2)), "timer": "CUDA events in the program, median of 30"}
        base = cublas[layout]
        common = {"layout": layout, "b_major": m.group(1), "checked": checked}
        rows.append(bench.flops_row("gemm_hopper", "torch.mm", torch.bfloat16, [GEMM_N] * 3, flops, base, mm,
                                    base["median_ms"], **common))
        rows.append(bench.flops_row("gemm_hopper", "hopper_gemm", torch.bfloat16, [GEMM_N] * 3, flops, ours, mm,
                                    base["median_ms"], **common))
    if not checked:
        notes.skip("hopper_gemm", "its checks failed: " + gemm.stdout[-500:], "experiments/hopper_gemm.cu")
    check = subprocess.run([str(exes["hopper_forward_check"]), "--variants"], capture_output=True, text=True,
                           timeout=600)
    for line in check.stdout.splitlines():
        m = re.match(r"variant (.+?)\s+d(\d+)\s+b(\d+) h(\d+) s(\d+)\s*/(\d+)\s+(full|causal)\s+rel ([0-9.e+-]+)"
                     r".*?(ok|MISMATCH)(?:\s+([0-9.]+) ms)?", line)
        if not m or m.group(10) is None:
            continue
        name, d, b, h, n = m.group(1).strip(), *(int(m.group(i)) for i in (2, 3, 4, 5))
        causal = m.group(7) == "causal"
        t = {"median_ms": float(m.group(10)), "timer": "CUDA events in the program, median of 100 in 5 rotated rounds"}
        rows.append(bench.flops_row("attention_hopper_config", name, torch.bfloat16, [b, h, n, d],
                                    attention_flops(b, h, n, n, d, causal), t, mm, None,
                                    **{"pass": "forward", "causal": causal, "head_dim": d, "seqlen": n,
                                       "rel_err": float(m.group(8)), "checked": m.group(9) == "ok"}))
    if check.returncode != 0:
        notes.skip("attention_hopper_config", "a configuration failed its check: " + check.stdout[-500:],
                   "experiments/hopper_forward_check.cu --variants")
    return rows


# ---------------------------------------------------------------------------------------------
# Memory: what each forward allocates beyond its inputs
# ---------------------------------------------------------------------------------------------
def forward_calls(device, causal):
    """(variant, f(q, k, v)) for every forward the memory and accuracy rows compare."""
    calls = [(name, sdpa_call(backend, causal)) for name, backend in SDPA_BACKENDS.items()]
    if device != "cuda":
        return calls + [("cpu", lambda q, k, v: flash_attention.attention(q, k, v, causal=causal))]
    for ver in flash_attention.VERSIONS.get("attention_forward", ()):
        calls.append((ver, lambda q, k, v, ver=ver: flash_attention.attention(q, k, v, causal=causal, version=ver)))
    return calls + [("default", lambda q, k, v: flash_attention.attention(q, k, v, causal=causal))]


def bench_memory(device, m, notes):
    """Peak bytes over the inputs during one forward (torch.cuda.max_memory_allocated after
    reset_peak_memory_stats), without and with autograd: grad=True also shows what the forward
    keeps for the backward (kept_MiB: held after it returns, output included)."""
    if device != "cuda" or m is None:
        return []
    b, h, n, d = m["batch"], m["heads"], m["seqlen"], m["head_dim"]
    dtype = getattr(torch, m["dtype"])
    rows = []
    for grad in (False, True):
        for variant, f in forward_calls(device, False):
            where = f"memory {m['dtype']} s={n} grad={grad}"
            need = math_bytes(b, h, n, n) / 2**30
            if variant == "sdpa_math" and need > MATH_BUDGET_GiB:
                notes.skip(variant, f"its float32 score matrices would need > {MATH_BUDGET_GiB} GiB",
                           f"{where}, estimated {need:.0f} GiB")
                continue
            q, k, v, _ = make_inputs(b, h, n, d, dtype, device)
            q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
            # A first call outside the measurement: workspaces that a library allocates once
            # per process (cuBLAS's, cuDNN's plan) are not what one more forward costs.
            if bench.attempt(notes, variant, where, lambda: f(q, k, v)) is None:
                continue
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = f(q, k, v)
            torch.cuda.synchronize()
            peak, kept = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
            del out
            size = torch.empty((), dtype=dtype).element_size()
            rows.append({"op": "attention_memory", "variant": variant, "dtype": m["dtype"], "shape": [b, h, n, d],
                         "pass": "forward", "causal": False, "grad": grad, "seqlen": n, "batch": b, "heads": h,
                         "head_dim": d, "extra_MiB": peak / 2**20, "kept_MiB": kept / 2**20,
                         "inputs_MiB": 3 * b * h * n * d * size / 2**20,
                         "scores_MiB": b * h * n * n * size / 2**20})
            del q, k, v
    torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# Accuracy: max abs error against float64, this chapter's criterion (ours <= 2x sdpa_flash's)
# ---------------------------------------------------------------------------------------------
def reference64(q, k, v, causal):
    """softmax(scale q k^T) v in float64 with the bottom-right causal mask (top-left too here:
    s_q == s_k), differentiable: the witness every variant's error is measured against."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = q.shape[-2], k.shape[-2]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + sk - sq, -math.inf)
    return torch.softmax(scores, dim=-1) @ v, (q, k, v)


def max_abs_err(x, ref):
    return (x.double() - ref).abs().max().item()


def error_row(variant, pass_, errs, base, e, dtype, causal):
    """One accuracy row: each tensor's error, their max, and the worst ratio to sdpa_flash's."""
    row = {"op": "attention_error", "variant": variant, "pass": pass_, "dtype": dtype,
           "shape": [e["batch"], e["heads"], e["seqlen"], e["head_dim"]], "causal": causal,
           "seqlen": e["seqlen"], "batch": e["batch"], "heads": e["heads"], "head_dim": e["head_dim"],
           **{f"{t}_max_abs_err": err for t, err in errs.items()}, "max_abs_err": max(errs.values())}
    if base:
        ratio = max(err / max(base[t], 1e-30) for t, err in errs.items())
        row.update({"ratio_vs_sdpa_flash": ratio, "within_2x_sdpa_flash": ratio <= 2.0})
    return row


def bench_error(device, e, notes):
    rows = []
    b, h, n, d = e["batch"], e["heads"], e["seqlen"], e["head_dim"]
    for dtype_name in e["dtypes"]:
        dtype = getattr(torch, dtype_name)
        for causal in (False, True):
            q, k, v, dy = make_inputs(b, h, n, d, dtype, device, seed=1)
            ref, leaves = reference64(q, k, v, causal)
            ref_grads = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(ref, leaves, dy.double())))
            ref = ref.detach()
            where = f"error {dtype_name} {'causal' if causal else 'full'}"
            found = {}  # variant -> {"forward": errs, "backward": errs}
            for variant, f in forward_calls(device, causal):
                def run(f=f):
                    lq, lk, lv = grad_leaves(q, k, v)
                    out = f(lq, lk, lv)
                    grads = torch.autograd.grad(out, (lq, lk, lv), dy)
                    return ({"out": max_abs_err(out, ref)},
                            {t: max_abs_err(g, ref_grads[t]) for t, g in zip(("dq", "dk", "dv"), grads)})
                # A forward rung's gradient comes from the default backward: only its output
                # error is its own; the backward rungs below are measured one by one.
                got = bench.attempt(notes, variant, where, run)
                if got is not None:
                    found[variant] = {"forward": got[0]}
                    if variant not in flash_attention.VERSIONS.get("attention_forward", ()):
                        found[variant]["backward"] = got[1]
            if device == "cuda":
                scale = 1.0 / math.sqrt(d)
                for ver in flash_attention.VERSIONS.get("attention_backward", ()):
                    def run_bwd(ver=ver):
                        o, lse = flash_attention.attention_forward(q, k, v, scale, causal)
                        grads = flash_attention.attention_backward(dy, q, k, v, o, lse, scale, causal, version=ver)
                        return {t: max_abs_err(g, ref_grads[t]) for t, g in zip(("dq", "dk", "dv"), grads)}
                    got = bench.attempt(notes, ver, where, run_bwd)
                    if got is not None:
                        found.setdefault(ver, {})["backward"] = got
            base = found.get(ERROR_BASELINE, {})
            for variant, passes in found.items():
                for pass_, errs in passes.items():
                    rows.append(error_row(variant, pass_, errs, base.get(pass_), e, dtype_name, causal))
            del q, k, v, dy, ref, leaves, ref_grads
    return rows


# ---------------------------------------------------------------------------------------------
# Figures and the table, drawn from the results record
# ---------------------------------------------------------------------------------------------
def style(variant, baseline):
    """SDPA dashed (the record's baseline black); the default dispatch a wide pale band under the
    rungs, so the envelope it follows shows through; rungs plain lines."""
    if variant.startswith("sdpa_"):
        return dict(linestyle="--", marker="o", ms=3, color="black" if variant == baseline else None)
    if variant.startswith("default"):
        return dict(color="tab:orange", linewidth=7, alpha=0.35, zorder=0, marker="o", ms=3)
    return dict(marker="o", ms=3)


def shape_text(shape):
    # [b, h, s, d] as written in the lesson: format_shape's 2^k form suits element counts only.
    return "x".join(map(str, shape))


def sweep_dtype(record):
    return record["sizes"]["dtypes"][0]  # bf16 on the GPU, float32 on the CPU


def plot_tflops(ax, record, pass_, head_dim, causal):
    dtype = sweep_dtype(record)
    rs = results.rows(record, op="attention", dtype=dtype, head_dim=head_dim, causal=causal, **{"pass": pass_})
    for variant in dict.fromkeys(results.column(r) for r in rs):
        pts = sorted((r["seqlen"], r["TFLOPs"]) for r in rs if results.column(r) == variant)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=variant, **style(variant, record.get("baseline")))
    mm = record["ceilings"].get("mm_TFLOPs")
    if mm:
        ax.axhline(mm, color="grey", linestyle=":", label=f"{record['ceilings']['mm_dtype']} matmul {mm:.3g}")
    s = record["sizes"]
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"seqlen (batch x seqlen = {s['tokens']}, heads x head_dim = {s['hidden']})")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"{pass_}, head_dim {head_dim}, {'causal' if causal else 'not causal'}, {dtype}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)


def plot_memory(ax, record):
    rs = results.rows(record, op="attention_memory")
    names = list(dict.fromkeys(r["variant"] for r in rs))
    width = 0.4
    for i, grad in enumerate((False, True)):
        vals = [next((r["extra_MiB"] for r in rs if r["variant"] == v and r["grad"] == grad), 0) for v in names]
        bars = ax.bar([x + (i - 0.5) * width for x in range(len(names))], vals, width,
                      label="inference" if not grad else "inputs require grad")
        for bar, val in zip(bars, vals):
            if val:
                ax.annotate(f"{val:.0f}", (bar.get_x() + bar.get_width() / 2, val), ha="center",
                            va="bottom", fontsize=6)
    r0 = rs[0]
    ax.axhline(r0["scores_MiB"], color="grey", linestyle=":",
               label=f"one {r0['dtype']} score matrix, all heads ({r0['scores_MiB']:.0f} MiB)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("peak MiB over the inputs")
    ax.set_title(f"forward memory, {r0['dtype']} {shape_text(r0['shape'])}\n{results.label(record)}",
                 fontsize=9)
    ax.legend(fontsize=7)


def plot_error(ax, record, pass_):
    rs = [r for r in results.rows(record, op="attention_error", dtype=sweep_dtype(record)) if r["pass"] == pass_]
    labels = [f"{r['variant']}{' causal' if r['causal'] else ''}" for r in rs]
    colors = ["black" if r["variant"] == ERROR_BASELINE else "tab:orange" if r["variant"] == "default"
              else "tab:blue" for r in rs]
    ax.bar(range(len(rs)), [r["max_abs_err"] for r in rs], color=colors)
    ax.set_xticks(range(len(rs)), labels, rotation=30, ha="right", fontsize=7)
    ax.set_yscale("log")
    what = "out" if pass_ == "forward" else "max of dq, dk, dv"
    shape = shape_text(rs[0]["shape"]) if rs else ""
    ax.set_title(f"{pass_} max abs error vs float64 ({what}), {sweep_dtype(record)} {shape}", fontsize=9)


def make_figures(record, out_dir):
    figures = []
    s = record["sizes"]
    panels = [(p, d, c) for p in ("forward", "backward") for d in s["head_dims"] for c in (False, True)]
    cols = len(panels) // 2
    fig, axes = plt.subplots(2, cols, figsize=(5.5 * cols, 9), squeeze=False)
    for ax, (p, d, c) in zip(axes.flat, panels):
        plot_tflops(ax, record, p, d, c)
    fig.suptitle(f"attention TFLOP/s: {results.label(record)}", fontsize=10)
    figures.append(plots.save(fig, out_dir / f"{CHAPTER}_tflops.png"))
    if results.rows(record, op="attention_memory"):
        fig, ax = plt.subplots(figsize=(8, 5))
        plot_memory(ax, record)
        figures.append(plots.save(fig, out_dir / f"{CHAPTER}_memory.png"))
    if results.rows(record, op="attention_error"):
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        for ax, p in zip(axes, ("forward", "backward")):
            plot_error(ax, record, p)
        figures.append(plots.save(fig, out_dir / f"{CHAPTER}_error.png"))
    return figures + plots.cpu_vs_recorded(record, out_dir, CHAPTER, plot_comparison)


def plot_comparison(ax, record):
    """The panel a CPU run is drawn beside the recorded GPU run with: the forward, not causal,
    at the first head dim the record measured."""
    plot_tflops(ax, record, "forward", record["sizes"]["head_dims"][0], False)
    ax.set_title(f"{ax.get_title()}\n{results.label(record)}", fontsize=9)


def print_table(record):
    c = record["ceilings"]
    s = record["sizes"]
    dtype = sweep_dtype(record)
    for note in record.get("skipped", []):
        print(f"skipped {note['variant']} (first at {note['first_at']}): {note['reason'][:160]}")
    print(f"\n{CHAPTER} on {results.label(record)}; {c['mm_dtype']} matmul {c['mm_TFLOPs']:.1f} TFLOP/s, "
          f"copy {c['copy_GBps']:.0f} GB/s; x {record['baseline']} = its time / ours; run {record.get('wall_s', 0):.0f} s")
    print(f"TFLOP/s, {dtype}, batch x seqlen = {s['tokens']}, heads x head_dim = {s['hidden']}")
    print(f"{'pass':<9}{'causal':<7}{'d':>4}  {'variant':<20}" + "".join(f" {n:>8}" for n in s["seqlens"])
          + f"  x {record['baseline']} at {s['seqlens'][-1]}")
    timing = results.rows(record, op="attention", dtype=dtype)
    keys = dict.fromkeys((r["pass"], r["causal"], r["head_dim"], results.column(r)) for r in timing)
    for p, causal, d, variant in keys:
        mine = {r["seqlen"]: r for r in timing if (r["pass"], r["causal"], r["head_dim"], results.column(r))
                == (p, causal, d, variant)}
        cells = "".join(f" {mine[n]['TFLOPs']:>8.3g}" if n in mine else f" {'-':>8}" for n in s["seqlens"])
        last = mine.get(s["seqlens"][-1], {}).get("speedup_vs_torch")
        print(f"{p:<9}{str(causal):<7}{d:>4}  {variant[:19]:<20}{cells}  {'' if last is None else f'{last:.2f}'}")
    split = results.rows(record, op="attention_split_kv")
    if split:
        variants = list(dict.fromkeys(results.column(r) for r in split))
        print(f"\nsplit-KV: {split[0]['dtype']}, batch {split[0]['batch']}, {split[0]['heads']} heads, "
              f"d {split[0]['head_dim']}, not causal; GB/s of q, k, v and o (% of copy)")
        print(f"{'s_q':>5}{'s_k':>8}" + "".join(f" {v[:14]:>16}" for v in variants))
        for n_q, n_k in dict.fromkeys((r["seqlen_q"], r["seqlen_k"]) for r in split):
            got = {results.column(r): r for r in split if (r["seqlen_q"], r["seqlen_k"]) == (n_q, n_k)}
            print(f"{n_q:>5}{n_k:>8}" + "".join(
                f" {got[v]['GBps']:>8.0f} ({got[v]['pct_of_copy']:>3.0f}%)" if v in got else f" {'-':>16}"
                for v in variants))
    mem = results.rows(record, op="attention_memory")
    if mem:
        print(f"\nforward memory over the inputs, {mem[0]['dtype']} {shape_text(mem[0]['shape'])} "
              f"(one score matrix of all heads: {mem[0]['scores_MiB']:.0f} MiB): MiB, inference / with grad")
        for v in dict.fromkeys(r["variant"] for r in mem):
            got = {r["grad"]: r["extra_MiB"] for r in mem if r["variant"] == v}
            print(f"  {v:<20}" + " / ".join(f"{got[g]:.0f}" if g in got else "-" for g in (False, True)))
    print_fp8_table(record)
    err = results.rows(record, op="attention_error")
    if err:
        print(f"\nmax abs error vs float64, {shape_text(err[0]['shape'])} "
              f"(this chapter's criterion: ours <= 2x {ERROR_BASELINE}'s)")
        for r in err:
            ratio = f"{r['ratio_vs_sdpa_flash']:.2f}x" if "ratio_vs_sdpa_flash" in r else "-"
            print(f"  {r['dtype']:<9}{r['pass']:<9}{'causal' if r['causal'] else 'full':<7}{r['variant']:<20}"
                  f"{r['max_abs_err']:>10.2e}  {ratio}")


# ---------------------------------------------------------------------------------------------
# The packed layout: sequences of different lengths, attention_varlen against the padded batch
# ---------------------------------------------------------------------------------------------
# 16 lengths from 128 to 8192 in a fixed, shuffled order (the grid does not see them sorted).
VARLEN_LENGTHS = [128, 8192, 256, 4096, 512, 2048, 1024, 3072, 384, 1536, 640, 2560, 768, 5120, 896, 1792]
VARLEN = {"heads": 16, "head_dim": 128, "dtype": "bfloat16", "causal": True}


def varlen_flops(lengths, heads, head_dim, causal, pass_="forward"):
    """The useful work of a packed call: each sequence's own attention_flops, summed (what the padded
    batch computes beyond that is padding)."""
    return sum(attention_flops(1, heads, n, n, head_dim, causal, pass_) for n in lengths)


def bench_varlen(device, mm, notes):
    if device != "cuda":
        notes.skip("attention_varlen", "packed rows run on CUDA only", device)
        return []
    c = VARLEN
    h, d, causal, dtype = c["heads"], c["head_dim"], c["causal"], getattr(torch, c["dtype"])
    lens = VARLEN_LENGTHS
    total, longest, batch = sum(lens), max(lens), len(lens)
    g = torch.Generator(device=device).manual_seed(2)
    q, k, v, dy = (torch.randn(total, h, d, generator=g, device=device, dtype=dtype) for _ in range(4))
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    cu = torch.tensor(starts, dtype=torch.int32, device=device)
    scale = 1 / math.sqrt(d)
    ops = torch.ops.flash_attention

    def padded(t):  # right padding to (batch, h, longest, d): each sequence's causal square is its own
        out = t.new_zeros(batch, longest, h, d)
        for i, n in enumerate(lens):
            out[i, :n] = t[starts[i]:starts[i] + n]
        return out.transpose(1, 2)

    def batch_of_one(t):  # packed (total, h, d) as flex_attention's (1, h, total, d)
        return t.transpose(0, 1).unsqueeze(0)
    qp, kp, vp, dyp = (padded(t) for t in (q, k, v, dy))
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    padded_leaves = tuple(t.detach().requires_grad_() for t in (qp, kp, vp))
    out, lse = ops.attention_varlen_forward(q, k, v, cu, cu, longest, longest, scale, causal)

    # (variant, make): make() returns the call to time. Ours: the forward op, and the backward op
    # alone from a saved forward (as the padded rows time the backward rungs); the baselines'
    # backward through autograd (bench.backward_call: their forward runs once, in make()).
    def ours_forward(version):
        return lambda: lambda: ops.attention_varlen_forward(q, k, v, cu, cu, longest, longest, scale, causal,
                                                            [-1, -1], 0.0, version)

    def ours_backward(version):
        return lambda: lambda: ops.attention_varlen_backward(dy, q, k, v, out, lse, cu, cu, longest, longest, scale,
                                                             causal, [-1, -1], 0.0, version)
    calls = {"forward": [("tuned", ours_forward("tuned")), ("split_kv", ours_forward("split_kv")),
                         ("default", ours_forward(None))],
             "backward": [("mma", ours_backward("mma")), ("mma_dqpass", ours_backward("mma_dqpass")),
                          ("default", ours_backward(None))]}
    # Part 3's "persistent" and "wgmma", where this build and GPU have them (their packed kernels).
    if flash_attention.hopper_kernels_built() and torch.cuda.get_device_capability(device) == (9, 0):
        calls["forward"].insert(2, ("persistent", ours_forward("persistent")))
        calls["backward"].insert(2, ("wgmma", ours_backward("wgmma")))  # its kVarlen instantiation
    flex = bench.attempt(notes, "flex_attention", "attention_varlen", lambda: flex_document_attention(lens, h, device))
    if flex is not None:
        calls["forward"].append(("flex_attention", lambda: lambda: flex(*(batch_of_one(t) for t in (q, k, v)))))
        calls["backward"].append(("flex_attention", lambda: bench.backward_call(
            lambda a, b_, c_: flex(*(batch_of_one(t) for t in (a, b_, c_))), leaves, batch_of_one(dy))))
    for variant in ("sdpa_cudnn", "sdpa_flash"):
        call = sdpa_call(SDPA_BACKENDS[variant], causal)
        calls["forward"].append((variant, lambda call=call: lambda: call(qp, kp, vp)))
        calls["backward"].append((variant, lambda call=call: bench.backward_call(call, padded_leaves, dyp)))
    # The same kernels on the padded batch ("tuned", "mma_dqpass"): what the packed layout saves
    # with everything else equal.
    out_p, lse_p = flash_attention.attention_forward(qp, kp, vp, scale, causal, version="tuned")
    calls["forward"].append(("tuned", lambda: lambda: flash_attention.attention_forward(qp, kp, vp, scale, causal,
                                                                                        version="tuned"), "padded"))
    calls["backward"].append(("mma_dqpass", lambda: lambda: flash_attention.attention_backward(
        dyp, qp, kp, vp, out_p, lse_p, scale, causal, version="mma_dqpass"), "padded"))
    rows = []
    for pass_ in ("forward", "backward"):
        where = f"attention_varlen {pass_}"
        flops = varlen_flops(lens, h, d, causal, pass_)
        timed = []
        for variant, make, *layout in calls[pass_]:
            layout = layout[0] if layout else "padded" if variant.startswith("sdpa") else "packed"
            fn = bench.attempt(notes, variant, f"{where} {layout}", make)
            t = fn and bench.probe_and_time(notes, variant, f"{where} {layout}", device, fn, max_call_ms=MAX_CALL_MS)
            if t:
                timed.append((variant, layout, t))
            del fn
        base = {v: t for v, _, t in timed}.get(speed_baseline(device))
        for variant, layout, t in timed:
            extra = {"pass": pass_, "causal": causal, "head_dim": d, "heads": h, "sequences": batch,
                     "total_tokens": total, "max_seqlen": longest, "layout": layout}
            if variant == "default":
                op = "attention_varlen_backward" if pass_ == "backward" else "attention_varlen_forward"
                extra["dispatch"] = flash_attention.default_choice(op, q, scale=scale, causal=causal, batch=batch,
                                                                   max_seqlen_q=longest, max_seqlen_k=longest)
            rows.append(bench.flops_row("attention_varlen", variant, dtype, [total, h, d], flops, t, mm,
                                        base and base["median_ms"], **extra))
    del q, k, v, dy, qp, kp, vp, dyp, leaves, padded_leaves, out, lse, out_p, lse_p
    torch.cuda.empty_cache()
    return rows


def compiled_flex_attention():
    """torch.compile'd flex_attention for the timed baselines. Their backward rows time
    autograd.grad over a retained graph (bench.backward_call), and AOTAutograd by default donates
    the forward's saved buffers to the backward, which a retained graph forbids: in one process
    that ran the window, softcap and packed sections in turn, the softcap's and the packed batch's
    flex_attention backward refused with "compiled with non-empty donated buffers". Donating is a
    memory saving, not a speed one, so it is turned off before compiling."""
    import torch._functorch.config
    from torch.nn.attention.flex_attention import flex_attention
    torch._functorch.config.donated_buffer = False
    return torch.compile(flex_attention, fullgraph=True)


def flex_document_attention(lengths, heads, device):
    """torch.compile'd flex_attention with a causal document mask over the packed tokens: key j is
    visible to query i iff both are of one sequence and j <= i. The block mask (which 128 x 128 tiles
    hold a visible key: the tiles flex_attention visits) is built here, once, outside any timing."""
    from torch.nn.attention.flex_attention import create_block_mask
    total = sum(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
    # _compile: the mask evaluated tile by tile, not as a dense total x total grid (10^9 entries here).
    block_mask = create_block_mask(document_causal, None, None, total, total, device=device, _compile=True)
    compiled = compiled_flex_attention()
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


# ---------------------------------------------------------------------------------------------
# Sliding windows and softcapping: the compile-time kWindowSoftcap instantiations, against
# flex_attention with the same mask or score_mod, and against the dense causal call they vary
# ---------------------------------------------------------------------------------------------
# The rungs that compute a window or a softcap (README, "The API"); every other rung refuses them.
# "persistent" runs on a Hopper GPU only (elsewhere its refusal is noted and the row skipped).
MASKED_RUNGS = {"forward": ("tuned", "split_kv", "persistent"), "backward": ("mma", "mma_dqpass", "wgmma")}
# A 4096-key causal band over 32K tokens (Mistral's and Gemma 2's local layers: window=(4095, 0) is
# sliding_window 4096), and Gemma 2's attn_logit_softcapping of 30 at a training length.
WINDOW = {"batch": 1, "heads": 16, "seqlen": 32768, "head_dim": 128, "dtype": "bfloat16", "causal": True,
          "window": [4095, 0], "softcap": 0.0}
SOFTCAP = {"batch": 2, "heads": 16, "seqlen": 8192, "head_dim": 128, "dtype": "bfloat16", "causal": True,
           "window": [-1, -1], "softcap": 30.0}
# This environment variable picked the softcap's reciprocal ("rcp" on the special-function unit, or
# "fma" on the FMA pipe) until the FMA form was measured slower and taken out (NOTES.md, "The
# softcap's tanh"). The kernels no longer read it; the softcap section refuses it set, so that a
# command from before does not time the one form left under the other's name.
REMOVED_SOFTCAP_TANH_ENV = "COURSE_SOFTCAP_TANH"


def refuse_removed_softcap_tanh():
    """A ValueError naming the removed variable when it is set (empty counts as unset, as it did)."""
    value = os.environ.get(REMOVED_SOFTCAP_TANH_ENV)
    if value:
        raise ValueError(f"{REMOVED_SOFTCAP_TANH_ENV}={value!r}: the variable was removed with the softcap's FMA "
                         "tanh (the kernels take the MUFU reciprocal only, and no longer read it); unset it")


# The CPU's: the C++ reference (float32) at sizes it runs in milliseconds, the same masks.
WINDOW_CPU = {**WINDOW, "heads": 2, "seqlen": 256, "head_dim": 64, "dtype": "float32", "window": [63, 0]}
SOFTCAP_CPU = {**SOFTCAP, "batch": 1, "heads": 2, "seqlen": 128, "head_dim": 64, "dtype": "float32"}


def masked_config(op, device):
    """The shape and mask of a section's rows on this device."""
    if op == "attention_window":
        return WINDOW if device == "cuda" else WINDOW_CPU
    return SOFTCAP if device == "cuda" else SOFTCAP_CPU


def visible_pairs(seqlen_q, seqlen_k, causal=False, window=(-1, -1)):
    """The (query, key) pairs of one (batch, head) the mask leaves visible, counted row by row: row
    i keeps key j iff i + s_k - s_q - left <= j <= i + s_k - s_q + right (-1: that side unbounded;
    causal is right = 0), the README's rule. A band's work is not a triangle's fraction, so it is
    counted exactly rather than estimated (attention_flops' halving is the dense convention)."""
    left, right = window
    if causal:
        right = 0
    shift, total = seqlen_k - seqlen_q, 0
    for i in range(seqlen_q):
        lo = 0 if left < 0 else max(0, i + shift - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, i + shift + right)
        total += max(0, hi - lo + 1)
    return total


def masked_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal, window, pass_="forward"):
    """The useful work of a call with this mask: 4 d FLOPs per visible pair (S = Q K^T and O = P V),
    2.5x that for the backward, as attention_flops counts a dense call."""
    flops = 4 * batch * heads * head_dim * visible_pairs(seqlen_q, seqlen_k, causal, window)
    return flops * 5 // 2 if pass_ == "backward" else flops


def flex_masked_attention(c, device, compile=True):
    """torch.compile'd flex_attention with the section's mask: a causal block mask, cut to
    q - k <= left for a window (key j visible to row i iff i - left <= j <= i), and for a softcap
    the score_mod softcap * tanh(score / softcap). The block mask is built here, once, outside any
    timing. compile=False: flex_attention's eager path, for the CPU test that holds the mask to ours."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    left, cap, n = c["window"][0], c["softcap"], c["seqlen"]

    def mask(b, h, q_idx, kv_idx):
        visible = kv_idx <= q_idx
        return visible & (q_idx - kv_idx <= left) if left >= 0 else visible

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    block_mask = create_block_mask(mask, None, None, n, n, device=device, _compile=device == "cuda")
    compiled = compiled_flex_attention() if compile else flex_attention
    score_mod = softcap if cap > 0 else None
    return lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)


def masked_calls(op, c, device, q, k, v, dy, notes):
    """{pass: [(variant, make, fields)]} of a section: version=None and each rung that takes the
    mask (the CPU reference, "cpu", on the CPU), flex_attention with the same mask, then the dense
    causal call of the same shape (the fields say so: window (-1, -1), softcap 0) by version=None and,
    for the window, by the strongest SDPA backend: what the mask saves or costs. Ours time the
    backward op alone from a saved forward, the baselines autograd.grad (bench.backward_call)."""
    causal, scale = c["causal"], 1.0 / math.sqrt(c["head_dim"])
    masked = {"window": list(c["window"]), "softcap": c["softcap"]}
    dense = {"window": [-1, -1], "softcap": 0.0}

    def forward(ver, m):
        return lambda: lambda: flash_attention.attention_forward(q, k, v, scale, causal, version=ver, **m)

    def backward(ver, m):
        def make():
            o, lse = flash_attention.attention_forward(q, k, v, scale, causal, **m)
            return lambda: flash_attention.attention_backward(dy, q, k, v, o, lse, scale, causal, version=ver, **m)
        return make
    timed = {"forward": forward, "backward": backward}
    calls = {}
    for pass_, make in timed.items():
        fn_op = f"attention_{pass_}"
        if device == "cuda":
            out = [(ver, make(ver, masked), masked) for ver in MASKED_RUNGS[pass_]]
            choice = {"dispatch": flash_attention.default_choice(fn_op, q, causal=causal, **masked)}
            out.append(("default", make(None, masked), {**masked, **choice}))
        else:  # the CPU reference is not a rung: one row, named cpu
            out = [("cpu", make(None, masked), masked)]
        calls[pass_] = out
    flex = bench.attempt(notes, "flex_attention", op, lambda: flex_masked_attention(c, device))
    if flex is not None:
        calls["forward"].append(("flex_attention", lambda: lambda: flex(q, k, v), masked))
        if device == "cuda":
            calls["backward"].append(("flex_attention", lambda: bench.backward_call(flex, grad_leaves(q, k, v), dy),
                                      masked))
        else:
            notes.skip("flex_attention", "flex_attention has no backward on the CPU (it refuses inputs that need "
                       "a gradient)", f"{op} backward")
    for pass_, make in timed.items():
        if device == "cuda":
            choice = dispatch_of(f"attention_{pass_}", q, causal)
            calls[pass_].append(("default", make(None, dense), {**dense, **choice}))
        else:
            calls[pass_].append(("cpu", make(None, dense), dense))
    if op == "attention_window":
        base = speed_baseline(device)
        sdpa = sdpa_call(SDPA_BACKENDS[base], causal)
        calls["forward"].append((base, lambda: lambda: sdpa(q, k, v), dense))
        calls["backward"].append((base, lambda: bench.backward_call(sdpa, grad_leaves(q, k, v), dy), dense))
    return calls


def bench_masked(op, device, mm, notes):
    """The rows of `--ops attention_window` or `--ops attention_softcap`. Every row of a pass is
    credited the masked call's useful work (masked_flops), the dense rows too, so TFLOP/s compare
    times as the packed rows do; visible_pairs says what each call itself computes.
    speedup_vs_torch is against flex_attention with the same mask."""
    if op == "attention_softcap":
        refuse_removed_softcap_tanh()  # before any call is timed
    c = masked_config(op, device)
    b, h, n, d = c["batch"], c["heads"], c["seqlen"], c["head_dim"]
    dtype = getattr(torch, c["dtype"])
    q, k, v, dy = make_inputs(b, h, n, d, dtype, device, seed=3)
    calls = masked_calls(op, c, device, q, k, v, dy, notes)
    rows = []
    for pass_ in ("forward", "backward"):
        flops = masked_flops(b, h, n, n, d, c["causal"], c["window"], pass_)
        # Every call probed first, then all timed in shuffled rounds (bench.time_calls_interleaved):
        # the rows of a pass are compared with each other (x flex_attention, x the dense call, the
        # default against its own rung), so a drift over the run must fall on all of them alike.
        def where_of(fields, pass_=pass_):
            return f"{op} {pass_} window={fields['window']} softcap={fields['softcap']}"
        made = [(variant, bench.attempt(notes, variant, where_of(fields), make), fields)
                for variant, make, fields in calls[pass_]]
        timed = bench.time_calls_interleaved(notes, f"{op} {pass_}", device,
                                             [m for m in made if m[1] is not None],  # make() refused: noted
                                             max_call_ms=MAX_CALL_MS, where_of=where_of)
        del made
        base = next((t for v, _, t in timed if v == "flex_attention"), None)
        for variant, fields, t in timed:
            extra = {"pass": pass_, "causal": c["causal"], "batch": b, "heads": h, "seqlen": n, "head_dim": d,
                     **fields, "visible_pairs": visible_pairs(n, n, c["causal"], fields["window"])}
            rows.append(bench.flops_row(op, variant, dtype, [b, h, n, d], flops, t, mm,
                                        base and base["median_ms"], **extra))
    del q, k, v, dy, calls
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_masked_table(record):
    for op, what in (("attention_window", "a causal sliding window"), ("attention_softcap", "softcapped scores")):
        rows = results.rows(record, op=op)
        if not rows:
            continue
        r0 = rows[0]
        print(f"\n{op}: {what}, {r0['dtype']} b{r0['batch']} h{r0['heads']} s{r0['seqlen']} d{r0['head_dim']} causal"
              f" (TFLOP/s of the masked call's useful work; x flex_attention)")
        for r in rows:
            mask = f"window={r['window']}" if op == "attention_window" else f"softcap={r['softcap']:g}"
            speed = f"{r['speedup_vs_torch']:.2f}x" if "speedup_vs_torch" in r else "-"
            print(f"  {r['pass']:<9}{r['variant']:<16}{mask:<20}{r['median_ms']:>9.3f} ms {r['TFLOPs']:>7.3g} "
                  f"TFLOP/s {speed:>7}" + (f"  dispatch={r['dispatch']}" if "dispatch" in r else ""))



# ---------------------------------------------------------------------------------------------
# A Hugging Face model on the chapter's attention (--ops transformers_model)
# ---------------------------------------------------------------------------------------------
# A Llama-style decoder built from a config with random weights (nothing is downloaded): 2048 wide,
# 16 query heads of 128 and 8 KV heads (grouped-query), a 5632-wide MLP, a 32000-token vocabulary,
# 4 layers -- a 1B-class model's layer shape, cut to 4 layers so the run stays short while every
# layer's attention-to-matmul ratio is the real one -- in bfloat16, 4 sequences of 4096 tokens, the
# forward alone (inference, no cache), as in prefill. The CPU's is a toy of the same shape in float32.
HF_MODEL = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 8, "intermediate_size": 5632,
            "num_hidden_layers": 4, "vocab_size": 32000, "batch": 4, "seqlen": 4096, "dtype": "bfloat16"}
HF_MODEL_CPU = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                "num_hidden_layers": 2, "vocab_size": 256, "batch": 2, "seqlen": 33, "dtype": "float32"}


def hf_model_flops(model, c):
    """The forward's useful FLOPs: 2 per weight of every Linear per token (projections, MLP, the
    output head) plus each layer's causal attention (attention_flops)."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    tokens = c["batch"] * c["seqlen"]
    attn = attention_flops(c["batch"], c["num_attention_heads"], c["seqlen"], c["seqlen"], head_dim, True)
    return 2 * linear * tokens + c["num_hidden_layers"] * attn


def bench_transformers_model(device, mm, notes):
    """`--ops transformers_model`: the model's forward on attn_implementation "course_attention"
    (flash_attention.integrations.transformers; version=None inside) against the same weights on
    transformers' "sdpa" path, where PyTorch picks the backend, and on that path with the backend
    pinned (sdpa_flash, sdpa_cudnn). Every row carries its logits' difference from the "sdpa" row
    (largest and root-mean-square over all logits): sdpa_flash's and sdpa_cudnn's differences are
    what bfloat16 rounding alone moves them by, the yardstick for ours. speedup_vs_torch is against
    "sdpa"."""
    try:
        import transformers
        from flash_attention.integrations import transformers as course_hf
    except ImportError as e:
        notes.skip("all", f"needs the transformers library ({e})", "transformers_model")
        return []
    c = HF_MODEL if device == "cuda" else HF_MODEL_CPU
    dtype = getattr(torch, c["dtype"])
    name = course_hf.register()
    layer = {k: c[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                               "num_hidden_layers", "vocab_size")}
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**layer, max_position_embeddings=c["seqlen"])
    # Two models with one set of weights: a model keeps its attention implementation in its config.
    sdpa = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    ours = transformers.AutoModelForCausalLM.from_config(type(config)(**config.to_dict()), attn_implementation=name,
                                                         dtype=dtype)
    ours.load_state_dict(sdpa.state_dict())
    sdpa, ours = sdpa.to(device).eval(), ours.to(device).eval()
    ids = torch.randint(0, c["vocab_size"], (c["batch"], c["seqlen"]), device=device,
                        generator=torch.Generator(device=device).manual_seed(1))

    def forward(model, backend=None):
        def call():
            # The "sdpa" and "default" rows pin no backend.
            with torch.inference_mode(), (sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()):
                return model(input_ids=ids, use_cache=False).logits
        return call
    calls = [("sdpa", forward(sdpa)), ("default", forward(ours))]
    if device == "cuda":
        calls += [(v, forward(sdpa, SDPA_BACKENDS[v])) for v in ("sdpa_flash", "sdpa_cudnn")]
    flops = hf_model_flops(sdpa, c)
    reference, rows, timed = None, [], []
    for variant, call in calls:
        where = f"transformers_model {variant}"
        logits = bench.attempt(notes, variant, where, lambda call=call: call())
        if logits is None:
            continue
        if reference is None:
            reference = logits.float()
        diff = (logits.float() - reference)
        fields = {"logits_max_abs_diff": diff.abs().max().item(), "logits_rms_diff": diff.pow(2).mean().sqrt().item()}
        del logits, diff
        timed.append((variant, fields, bench.time_fn(call, device)))
    fields_all = {"pass": "forward", "causal": True, **{k: c[k] for k in c if k != "dtype"},
                  "logits_rms": reference.pow(2).mean().sqrt().item() if reference is not None else None,
                  "transformers": transformers.__version__}
    base = next((t for v, _, t in timed if v == "sdpa"), None)
    for variant, fields, t in timed:
        rows.append(bench.flops_row("transformers_model", variant, dtype, [c["batch"], c["seqlen"], c["hidden_size"]],
                                    flops, t, mm, base and base["median_ms"], **fields_all, **fields))
    del sdpa, ours, reference
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_transformers_table(record):
    rows = results.rows(record, op="transformers_model")
    if not rows:
        return
    r0 = rows[0]
    print(f"\ntransformers_model: Llama-style, {r0['num_hidden_layers']} layers of {r0['hidden_size']} "
          f"({r0['num_attention_heads']}/{r0['num_key_value_heads']} heads), {r0['dtype']} {r0['batch']} x "
          f"{r0['seqlen']} tokens, forward; logits rms {r0['logits_rms']:.3g}")
    for r in rows:
        speed = f"{r['speedup_vs_torch']:.2f}x" if "speedup_vs_torch" in r else "-"
        print(f"  {r['variant']:<12}{r['median_ms']:>9.3f} ms {r['TFLOPs']:>7.3g} TFLOP/s {speed:>7} x sdpa   "
              f"logits vs sdpa: max {r['logits_max_abs_diff']:.3g}, rms {r['logits_rms_diff']:.3g}")

# `--ops NAME`: a section alone, into its own results file, so that a run of one leaves the main
# results and the other sections' as they were: (rows(device, mm, notes), file suffix, the
# record's extra fields, table printer).
SECTIONS = {
    "attention_varlen": (lambda device, mm, notes: bench_varlen(device, mm, notes), "_varlen",
                         lambda device: {"sizes": {"varlen": {**VARLEN, "lengths": VARLEN_LENGTHS}},
                                         "baseline": speed_baseline(device)},
                         lambda record: print_varlen_table(record)),
    "attention_window": (lambda device, mm, notes: bench_masked("attention_window", device, mm, notes), "_window",
                         lambda device: {"sizes": {"window": masked_config("attention_window", device)},
                                         "baseline": "flex_attention"},
                         lambda record: print_masked_table(record)),
    "attention_fp8": (lambda device, mm, notes: bench_fp8(device, mm, notes, candidates=FP8_BENCH_CANDIDATES)
                      + bench_fp8_accuracy(device, fp8_accuracy_config(device), notes), "_fp8",
                      lambda device: {"sizes": {"fp8": FP8_SHAPES, "fp8_accuracy": fp8_accuracy_config(device),
                                                "fp8_outliers": FP8_OUTLIERS},
                                      "baseline": speed_baseline(device)},
                      lambda record: print_fp8_table(record)),
    "attention_overlap": (lambda device, mm, notes: bench_overlap(device, mm, notes), "_overlap",
                          lambda device: {"sizes": {"overlap": OVERLAP_SHAPES}, "baseline": speed_baseline(device),
                                          "knob": OVERLAP_KNOB},
                          lambda record: print_overlap_table(record)),
    "attention_softcap": (lambda device, mm, notes: bench_masked("attention_softcap", device, mm, notes),
                          "_softcap",
                          lambda device: {"sizes": {"softcap": masked_config("attention_softcap", device)},
                                          "baseline": "flex_attention"},
                          lambda record: print_masked_table(record)),
    "transformers_model": (lambda device, mm, notes: bench_transformers_model(device, mm, notes), "_transformers",
                           lambda device: {"sizes": {"transformers_model": HF_MODEL if device == "cuda"
                                                     else HF_MODEL_CPU},
                                           "baseline": "sdpa"},
                           lambda record: print_transformers_table(record)),
}


def main_ops():
    """`--ops NAME ...`: those sections' rows alone, each written to its own results file."""
    parser = bench.arguments(__doc__)
    parser.add_argument("--ops", nargs="+", choices=list(SECTIONS), required=True,
                        help="run only these ops' rows (attention_varlen: the packed layout; attention_window, "
                             "attention_softcap: the masked instantiations against flex_attention; attention_fp8: "
                             "the FP8 forward beside bf16, and its accuracy with outliers; attention_overlap: the bf16 "
                             "forward's overlap candidate beside pingpong; transformers_model: a "
                             "Hugging Face Llama-style model's forward on the chapter's attention against its SDPA path)")
    parser.add_argument("--fp8-candidates", nargs="+", default=[], metavar="NAME",
                        help="with attention_fp8: also time these candidates of the FP8 launcher "
                             f"({FP8_KNOB}: longest_first, head_order, n192, n192_full) at each FP8 shape "
                             "(n192 and n192_full: head dim 128 only; at 64 the call is refused, the row noted skipped)")
    args = parser.parse_args()
    FP8_BENCH_CANDIDATES[:] = args.fp8_candidates
    device = bench.setup(args)
    ceilings = bench.copy_ceiling(device, n=2**28 if device == "cuda" else 2**20)
    ceilings.update(bench.matmul_ceiling(device, n=8192 if device == "cuda" else 256,
                                         dtype=torch.bfloat16 if device == "cuda" else torch.float32))
    for op in dict.fromkeys(args.ops):
        started = time.perf_counter()
        measure, suffix, fields, print_rows = SECTIONS[op]
        notes = bench.Notes()
        rows = measure(device, ceilings["mm_TFLOPs"], notes)
        extra = {**fields(device), "skipped": notes.skipped, "extension": flash_attention.EXTENSION,
                 "timing": {"statistic": "median", "reps": bench.MIN_REPS,
                            "method": "CUDA graph of the calls that make a replay last >= 2 ms (1 to 8), CUDA "
                                      "events around each replay; backward rows of ours time the backward op alone, "
                                      "the baselines' autograd.grad over a retained graph; the window, softcap and "
                                      "FP8 sections replay all the rows of a pass (a shape) in rounds, one replay of each in an "
                                      "order shuffled each round (rows with timer 'graph, shuffled rounds'; "
                                      "'graph, interleaved rounds': the same order every round)"},
                 "wall_s": time.perf_counter() - started}
        results.publish(CHAPTER + suffix, rows, ceilings, extra, lambda record, out_dir: [], print_rows)


def print_varlen_table(record):
    rows = results.rows(record, op="attention_varlen")
    print(f"\nattention_varlen: {len(VARLEN_LENGTHS)} sequences of 128-8192 tokens, d=128 bf16 causal "
          "(TFLOP/s of useful work)")
    for r in rows:
        print(f"  {r['pass']:<9}{r['variant']:<16}{r['median_ms']:>9.3f} ms {r['TFLOPs']:>7.1f} TFLOP/s"
              + (f"  dispatch={r['dispatch']}" if "dispatch" in r else ""))


def main():
    started = time.perf_counter()
    if "--ops" in sys.argv:  # a section alone (its own flags and results file)
        return main_ops()
    parser = bench.arguments(__doc__)
    args = parser.parse_args()
    device, quick = bench.setup(args), args.quick
    s = sizes_for(device, quick)
    full = device == "cuda" and not quick
    # copy_ceiling warms the GPU up first (an idle H100 sits at a low clock).
    ceilings = bench.copy_ceiling(device, n=2**28 if full else 2**20)
    # The CPU rows are float32 (the reference refuses 16-bit), so their ceiling is a float32
    # matmul; on the GPU the bf16 tensor-core rate, which fp16 shares.
    mm_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ceilings.update(bench.matmul_ceiling(device, n=8192 if full else 4096 if device == "cuda" else 256,
                                         dtype=mm_dtype))
    notes = bench.Notes()
    tensor_MiB = s["tokens"] * s["hidden"] * torch.empty((), dtype=getattr(torch, s["dtypes"][0])).element_size() / 2**20
    # Part 3's experiments first: they compile for a minute, and a failure shows before the sweep.
    rows = bench.attempt(notes, "hopper experiments", "experiments/", lambda: bench_hopper_experiments(
        device if not quick else "quick", ceilings["mm_TFLOPs"], notes)) or []
    rows += bench_timing(device, ceilings["mm_TFLOPs"], s, notes)
    rows += bench_split_kv(device if not quick else "quick", ceilings, notes)
    rows += bench_fp8(device if not quick else "quick", ceilings["mm_TFLOPs"], notes, beside=rows)
    rows += bench_fp8_accuracy(device, fp8_accuracy_config(device), notes)
    rows += bench_memory(device, s["memory"], notes)
    if device != "cuda":
        notes.skip("attention_memory", "memory rows need CUDA (torch.cuda.max_memory_allocated)", "cpu")
    rows += bench_error(device, s["error"], notes)
    extra = {"sizes": s, "headline_op": "attention", "baseline": speed_baseline(device),
             "skipped": notes.skipped, "extension": flash_attention.EXTENSION,
             "versions": {op: list(vs) for op, vs in flash_attention.VERSIONS.items()},
             "timing": {"statistic": "median", "reps": bench.MIN_REPS,
                        "method": "perf_counter" if device == "cpu" else
                        "CUDA graph of the calls that make a replay last >= 2 ms (1 to 8), CUDA "
                        "events around each replay; the sweep's variants of a row replayed in rounds, one replay "
                        "of each in an order shuffled each round (rows with timer 'graph, shuffled rounds'); "
                        f"one input set of {tensor_MiB:.0f} MiB per tensor "
                        "(the H100's L2 is 50 MB); SDPA backward rows and call=autograd time autograd.grad over a "
                        "retained graph; backward rungs and default time the backward op alone",
                        "max_call_ms": MAX_CALL_MS, "math_budget_GiB": MATH_BUDGET_GiB},
             "wall_s": time.perf_counter() - started}
    results.publish(CHAPTER, rows, ceilings, extra, make_figures, print_table)


if __name__ == "__main__":
    main()
