"""The extension's sources, listed once for both build routes (setup.py and load_jit.py)."""
CPP_SOURCES = ["memory_ops.cpp", "memory_cpu.cpp"]
CUDA_SOURCES = ["memory_kernels.cu"]
