"""The extension's sources, listed once for both build routes (setup.py and load_jit.py).

The C++ and CUDA live under csrc/, one folder per part of the chapter, each with its own
torch-free header, CPU reference, glue and kernels; csrc/flash_attention_ops.cpp defines the
`flash_attention` library that both parts register their ops into. Every file includes by its
path under csrc/ ("attention/attention.h"), which INCLUDE_DIRS puts on the include path of both
routes and of the test command's nvcc sweep. A part is one more list here and one more line in
CUDA_SOURCES; part 3's Hopper kernels are HOPPER_SOURCES, which the build compiles only when its
arch list has 9.0.
"""
from pathlib import Path

HERE = Path(__file__).resolve().parent
INCLUDE_DIRS = ["csrc"]

LIBRARY_SOURCES = ["csrc/flash_attention_ops.cpp"]

# Part 1, training (csrc/attention/): the forward and backward ladders. The scalar rungs one file
# per rung family (the naive forward and backward share their simple kernels; the tiled forward
# is its own file, so the two compile in parallel and a learner reads one rung at a time); the
# tensor-core rungs' dispatch, and their instantiations one file per pass, dtype and head dim, as
# FlashAttention 2 splits its own, so that ninja compiles them side by side
# (csrc/attention/generate_instantiations.py writes them from attention.h's head-dim lists).
ATTENTION_CPP = ["csrc/attention/attention_ops.cpp", "csrc/attention/attention_cpu.cpp", "csrc/attention/fp8_ops.cpp"]
ATTENTION_CUDA = ["csrc/attention/attention_naive_kernels.cu", "csrc/attention/attention_tiled_kernels.cu",
                  "csrc/attention/flash_fwd_dispatch.cu", "csrc/attention/flash_bwd_dispatch.cu",
                  "csrc/attention/split_combine.cu", "csrc/attention/fp8_quantize_kernels.cu"] + sorted(
    str(p.relative_to(HERE)) for p in (HERE / "csrc" / "attention" / "instantiations").glob("*.cu"))

# Part 2, serving (csrc/serving/): cache writes and copies, the decode ladder, chunked prefill,
# the prefix lookup.
SERVING_CPP = ["csrc/serving/serving_ops.cpp", "csrc/serving/serving_cpu.cpp"]
SERVING_CUDA = ["csrc/serving/paged_cache_kernels.cu", "csrc/serving/paged_attention_kernels.cu",
                "csrc/serving/paged_prefill_kernels.cu", "csrc/serving/radix_match_kernels.cu"]

# Part 3, Hopper (csrc/hopper/): the forward and the backward on TMA, mbarriers, wgmma and warp
# specialization, and the FP8 forward. The build compiles these only when the arch list has 9.0,
# and then for sm_90a (coursekit.build hopper_build); the attention glue learns it from
# COURSE_HOPPER. One instantiation file per pass, dtype and head dim, as in part 1 (the FP8
# forward's are flash_fwd_hopper_fp8_hdim<d>.cu); the FP8 quantize kernels are part 1's sources,
# since they run on any GPU.
HOPPER_SOURCES = ["csrc/hopper/flash_fwd_hopper_dispatch.cu", "csrc/hopper/flash_bwd_hopper_dispatch.cu",
                  "csrc/hopper/flash_fwd_hopper_fp8_dispatch.cu"] + sorted(
    str(p.relative_to(HERE)) for pattern in ("flash_fwd_hopper_*_hdim*.cu", "flash_bwd_hopper_*_hdim*.cu")
    for p in (HERE / "csrc" / "hopper").glob(pattern))

CPP_SOURCES = LIBRARY_SOURCES + ATTENTION_CPP + SERVING_CPP
CUDA_SOURCES = ATTENTION_CUDA + SERVING_CUDA
