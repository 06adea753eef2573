"""The extension's sources, listed once for both build routes (setup.py and load_jit.py)."""
# The glue and the CPU reference; the CUDA kernels one file per rung family (the naive forward
# and backward share their simple kernels; the tiled forward is its own file, so the two
# compile in parallel and a learner reads one rung at a time).
CPP_SOURCES = ["attention_ops.cpp", "attention_cpu.cpp", "paged_ops.cpp", "paged_cpu.cpp"]
# The tensor-core rungs (csrc/): one file per pass, dtype and head dim, as FlashAttention 2
# splits its instantiations, so that ninja compiles them side by side.
TENSOR_CORE_SOURCES = ["csrc/flash_fwd_dispatch.cu", "csrc/flash_bwd_dispatch.cu", "csrc/split_combine.cu"] + [
    f"csrc/flash_fwd_{dtype}_hdim{d}.cu" for dtype in ("bf16", "fp16") for d in (32, 64, 96, 128, 256)] + [
    f"csrc/flash_bwd_{dtype}_hdim{d}.cu" for dtype in ("bf16", "fp16") for d in (32, 64, 96, 128)]
# The serving half (paged.h): cache writes and copies, the decode ladder, the prefix lookup.
PAGED_SOURCES = ["csrc/paged_cache_kernels.cu", "csrc/paged_attention_kernels.cu", "csrc/radix_match_kernels.cu"]
CUDA_SOURCES = ["attention_naive_kernels.cu", "attention_tiled_kernels.cu"] + TENSOR_CORE_SOURCES + PAGED_SOURCES
