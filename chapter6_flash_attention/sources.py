"""The extension's sources, listed once for both build routes (setup.py and load_jit.py)."""
# The CPU reference and the glue. The CUDA kernels (the forward and backward ladders) are the
# next step of the chapter; until then a CUDA build compiles the same two files.
CPP_SOURCES = ["attention_ops.cpp", "attention_cpu.cpp"]
CUDA_SOURCES = []
