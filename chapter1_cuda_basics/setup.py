"""pip install . builds cuda_basics with its C++/CUDA extension (cuda_basics._C).

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

import_torch("cuda_basics")
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension  # noqa: E402

setup(
    name="cuda_basics",
    version="0.1.0",
    description="Chapter 1 of the CUDA course: coalesced elementwise kernels as a PyTorch extension",
    packages=["cuda_basics"],
    ext_modules=[make_extension("cuda_basics._C", HERE, CPP_SOURCES, CUDA_SOURCES, "cuda_basics")],
    cmdclass={"build_ext": BuildExtension, "build_py": build_py_with_loader("cuda_basics")},
    python_requires=">=3.9",
)
