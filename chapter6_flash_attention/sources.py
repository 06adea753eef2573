"""The extension's sources, listed once for both build routes (setup.py and load_jit.py)."""
# The glue and the CPU reference; the CUDA kernels one file per rung family (the naive forward
# and backward share their simple kernels; the tiled forward is its own file, so the two
# compile in parallel and a learner reads one rung at a time).
CPP_SOURCES = ["attention_ops.cpp", "attention_cpu.cpp"]
CUDA_SOURCES = ["attention_naive_kernels.cu", "attention_tiled_kernels.cu"]
