"""The extension's sources, listed once for both build routes (setup.py and load_jit.py)."""
# One library, custom_ops._C, holds all three routes' C++: the pybind11 module (route 1,
# custom_ops.cpp) and the TORCH_LIBRARY registrations (route 2, library_ops.cpp) over the one
# glue file they share (kernel_glue.cpp) and the kernels; route 3 is Python
# (custom_ops/_python_op.py) over route 1's raw entry points.
CPP_SOURCES = ["custom_ops.cpp", "library_ops.cpp", "kernel_glue.cpp", "custom_kernels_cpu.cpp"]
CUDA_SOURCES = ["custom_kernels.cu"]
