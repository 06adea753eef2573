"""The extension's sources, listed once for both build routes (setup.py and load_jit.py)."""
CPP_SOURCES = ["reduction_ops.cpp", "reduction_cpu.cpp"]
# Three .cu files so that the two slow-to-compile softmax families build in parallel.
CUDA_SOURCES = ["reduce_kernels.cu", "softmax_kernels.cu", "softmax_backward_kernels.cu"]
