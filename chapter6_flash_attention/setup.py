"""pip install . builds flash_attention with its C++/CUDA extension (flash_attention._C).

CUDAExtension when CUDA is usable (torch built with CUDA and a toolkit found), else a CPU-only
CppExtension with the reason printed. USE_CUDA=1 fails loudly when CUDA is impossible,
USE_CUDA=0 forces CPU, DEBUG=1 builds -O0 -g (and -lineinfo), TORCH_CUDA_ARCH_LIST is honoured.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "common")]
from coursekit.build import chapter_setup  # noqa: E402

from sources import CPP_SOURCES, CUDA_SOURCES, HOPPER_SOURCES, INCLUDE_DIRS  # noqa: E402

chapter_setup("flash_attention", "Chapter 6 of the CUDA course: FlashAttention (forward and "
              "backward, causal, grouped-query) as a PyTorch extension", HERE, CPP_SOURCES,
              CUDA_SOURCES, source_roots=INCLUDE_DIRS, hopper_sources=HOPPER_SOURCES)
