"""Coalescing, strides, shared-memory tiling and bank conflicts, wide accesses: copy, strided_copy, transpose.

Chapter 2 of the course: what moving data costs on a GPU, as PyTorch ops.

Every op takes CPU or CUDA tensors of float32, float16, bfloat16 or float64, contiguous or
not, and is differentiable. `version=` picks a rung of an op's kernel ladder (see VERSIONS and
the chapter README); None lets the dispatch pick from the input's sizes, strides and alignment
(default_choice says what it picks). On the CPU there is one C++ implementation and the version
is only validated.
"""
from pathlib import Path

import torch

__all__ = ["copy", "strided_copy", "transpose", "default_choice", "VERSIONS", "EXTENSION"]

# Each ladder in teaching order (memory_kernels.cu says what every rung fixes):
#   copy:      v1 one element per thread, v2 16-byte vectors with 4 in flight per thread;
#   transpose: v1 naive (scattered writes), v2 32x32 shared-memory tile, v3 the tile padded
#              against bank conflicts, v4 wide tiles (16-byte accesses, 4 per thread), v5 wide
#              tiles at any alignment (each row segment aligned on its own).
# test_memory_ops.py holds this table against the versions the extension dispatches.
VERSIONS = {"copy": ("v1", "v2"), "transpose": ("v1", "v2", "v3", "v4", "v5")}

try:  # installed: setup.py ships the shared loader inside the package
    from ._loader import check_arguments, load_extension
except ImportError:  # the course checkout: the loader's one home, common/coursekit
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "common"))
    from coursekit.loader import check_arguments, load_extension

# How the ops library was loaded: route (installed, jit or preloaded) and where from.
EXTENSION = load_extension("memory_ops", "memory_ops", __file__)


def copy(x, *, version=None):
    """A new contiguous tensor with x's values: device-to-device copy, the bandwidth ceiling."""
    check_arguments("copy", x=(x, torch.Tensor))
    return torch.ops.memory_ops.copy(x, version)


def strided_copy(x, stride):
    """x.flatten()[::stride] as a new contiguous 1-D tensor: reads every stride-th element."""
    check_arguments("strided_copy", x=(x, torch.Tensor), stride=(stride, int))
    return torch.ops.memory_ops.strided_copy(x, int(stride))


def default_choice(op, x):
    """What `op(x, version=None)` runs: the rung's name, "copy" for a transpose whose input
    already holds the transpose in memory order (x.t() of a contiguous matrix), or "thin" for a
    transpose with one of its two dims at most 64 long (a strip of the long dim per block,
    staged in shared memory; no tile of the ladder). The rules live in memory.h
    (default_transpose)."""
    check_arguments("default_choice", op=(op, str), x=(x, torch.Tensor))
    return torch.ops.memory_ops.default_choice(op, x)


def transpose(x, *, version=None):
    """A 2-D (rows, cols) tensor as a contiguous (cols, rows) one; a 3-D (batch, rows, cols)
    tensor as a contiguous (batch, cols, rows) one: x.transpose(-2, -1).contiguous()."""
    check_arguments("transpose", x=(x, torch.Tensor))
    return torch.ops.memory_ops.transpose(x, version)
