"""The extension's sources, listed once for both build routes (setup.py and load_jit.py)."""
CPP_SOURCES = ["elementwise_ops.cpp", "elementwise_cpu.cpp"]
CUDA_SOURCES = ["elementwise_kernels.cu"]
