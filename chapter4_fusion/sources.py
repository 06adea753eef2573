"""The extension's sources, listed once for both build routes (setup.py and load_jit.py)."""
# One glue file per op family (each registers its own ops into the `fusion` library), one CPU
# file per family, and the kernels split so that the families compile in parallel.
CPP_SOURCES = ["fusion_ops.cpp", "elementwise_ops.cpp", "elementwise_cpu.cpp", "norm_ops.cpp",
               "norm_cpu.cpp"]
CUDA_SOURCES = ["elementwise_kernels.cu", "linear_epilogue_kernels.cu", "norm_kernels.cu",
                "norm_backward_kernels.cu"]
