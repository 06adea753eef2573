"""pip install . builds custom_ops with its C++/CUDA extension (custom_ops._C).

CUDAExtension when CUDA is usable (torch built with CUDA and a toolkit found), else a CPU-only
CppExtension with the reason printed. USE_CUDA=1 fails loudly when CUDA is impossible,
USE_CUDA=0 forces CPU, DEBUG=1 builds -O0 -g (and -lineinfo), TORCH_CUDA_ARCH_LIST is honoured.

The one library is both a Python module (the pybind11 functions of route 1, imported as
custom_ops._C) and a library of dispatcher ops (route 2, torch.ops.custom_ops.*).
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]
from coursekit.build import chapter_setup  # noqa: E402

from sources import CPP_SOURCES, CUDA_SOURCES  # noqa: E402

chapter_setup("custom_ops", "Chapter 5 of the CUDA course: one CUDA kernel bound to PyTorch three "
              "ways (pybind11, TORCH_LIBRARY, torch.library.custom_op)", HERE, CPP_SOURCES,
              CUDA_SOURCES)
