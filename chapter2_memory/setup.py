"""pip install . builds memory_ops with its C++/CUDA extension (memory_ops._C).

CUDAExtension when CUDA is usable (torch built with CUDA and a toolkit found), else a CPU-only
CppExtension with the reason printed. USE_CUDA=1 fails loudly when CUDA is impossible,
USE_CUDA=0 forces CPU, DEBUG=1 builds -O0 -g (and -lineinfo), TORCH_CUDA_ARCH_LIST is honoured.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]
from coursekit.build import build_py_with_loader, import_torch, make_extension  # noqa: E402

from sources import CPP_SOURCES, CUDA_SOURCES  # noqa: E402

import_torch("memory_ops")
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension  # noqa: E402

setup(
    name="memory_ops",
    version="0.1.0",
    description="Chapter 2 of the CUDA course: memory access, strides, shared-memory tiling as a PyTorch extension",
    packages=["memory_ops"],
    ext_modules=[make_extension("memory_ops._C", HERE, CPP_SOURCES, CUDA_SOURCES, "memory_ops")],
    cmdclass={"build_ext": BuildExtension, "build_py": build_py_with_loader("memory_ops")},
    python_requires=">=3.9",
)
