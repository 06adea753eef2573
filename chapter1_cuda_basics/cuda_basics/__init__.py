"""Threads and grids, coalescing, grid-stride loops, 128-bit vectorized access: vector_add, saxpy, relu.

Chapter 1 of the course: elementwise CUDA kernels as PyTorch ops.

Every op takes CPU or CUDA tensors of float32, float16, bfloat16 or float64, of any shape
(inputs of a binary op must match exactly: no broadcasting, no type promotion), contiguous or
not, and is differentiable. `version=` picks a rung of the kernel ladder (see VERSIONS and the
chapter README); None lets the dispatch pick by size, dtype and alignment (default_choice says
what it picks). On the CPU there is one C++ implementation and the version is only validated.
"""
from pathlib import Path

import torch

__all__ = ["vector_add", "saxpy", "relu", "default_choice", "VERSIONS", "EXTENSION"]

# Each op's ladder in teaching order: "uncoalesced" is the deliberately bad foil, v1..v5 the
# rungs (one thread per element, grid-stride loop, 128-bit vectorized, vectorized + ILP, and
# the same kernel launched in the shape the size calls for).
# test_cuda_basics.py holds this table against the versions the extension dispatches.
_LADDER = ("uncoalesced", "v1", "v2", "v3", "v4", "v5")
VERSIONS = {"vector_add": _LADDER, "saxpy": _LADDER, "relu": _LADDER}


try:  # installed: setup.py ships the shared loader inside the package
    from ._loader import check_arguments, load_extension
except ImportError:  # the course checkout: the loader's one home, common/coursekit
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "common"))
    from coursekit.loader import check_arguments, load_extension

# How the ops library was loaded: route (installed, jit or preloaded) and where from.
EXTENSION = load_extension("cuda_basics", "cuda_basics", __file__)


def vector_add(a, b, *, version=None):
    """a + b for two tensors of the same shape, dtype and device."""
    check_arguments("vector_add", a=(a, torch.Tensor), b=(b, torch.Tensor))
    return torch.ops.cuda_basics.vector_add(a, b, version)


def saxpy(alpha, x, y, *, version=None):
    """alpha * x + y ("single-precision a x plus y", BLAS level 1) for a Python float alpha."""
    check_arguments("saxpy", alpha=(alpha, float), x=(x, torch.Tensor), y=(y, torch.Tensor))
    return torch.ops.cuda_basics.saxpy(float(alpha), x, y, version)


def relu(x, *, version=None):
    """max(x, 0) elementwise; NaN stays NaN, as in torch.relu."""
    check_arguments("relu", x=(x, torch.Tensor))
    return torch.ops.cuda_basics.relu(x, version)


def default_choice(numel, dtype, *, aligned=True):
    """What version=None runs on CUDA for `numel` elements of `dtype`: (version, kernel,
    threads per block, elements per thread). kernel is "vectorized" (v5's 16-byte accesses);
    on a misaligned view (aligned=False, as for x[1:]) "scalar" (v5 loading the same elements
    one by one) or, for small 2-byte views, "per_element" (v1). The rules live in
    elementwise.h, section "version=None"."""
    check_arguments("default_choice", numel=(numel, int), dtype=(dtype, torch.dtype))
    return tuple(torch.ops.cuda_basics.default_choice(int(numel), dtype, bool(aligned)))
