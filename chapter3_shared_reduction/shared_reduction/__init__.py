"""Shared-memory reductions and softmax: sum, amax, softmax, log_softmax.

Chapter 3 of the course: how thousands of threads combine values into one (registers, warp
shuffles, shared memory, then across blocks), and softmax, the reduction every attention
kernel is built on.

Every op takes CPU or CUDA tensors of float32, float16, bfloat16 or float64 and returns the
input's dtype; float16 and bfloat16 accumulate in float32, float64 in float64. Results are
bitwise deterministic run to run. `version=` picks a rung of a ladder (VERSIONS, LADDERS and
the chapter README); None lets the dispatch pick from the shape and dtype (default_choice says
what it picks). On the CPU there is one C++ implementation and the version is only validated.
"""
from pathlib import Path

import torch

__all__ = ["sum", "amax", "softmax", "log_softmax", "atomic_sum", "softmax_backward",
           "default_choice", "VERSIONS", "LADDERS", "EXTENSION"]

# The reduction ladders, each for one layout of the reduced elements (reduce_kernels.cu says
# what every rung changes and why):
#   whole:   dim=None, the tensor as one flat array: Harris's seven steps (v1-v7) and three
#            modern ones: warp shuffles (v8), 128-bit loads (v9), one pass (v10);
#   rows:    dim reduces adjacent elements (dim=-1 of a contiguous tensor);
#   columns: dim reduces elements `inner` apart (dim=0 of a matrix), coalesced across inner;
#            column_split lays a warp over several rows when inner is narrower than a tile.
LADDERS = {
    "whole": ("v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10"),
    "rows": ("block_per_row", "warp_per_row", "rows_per_warp", "split_row"),
    "columns": ("column_loop", "column_split"),
}
# softmax and log_softmax share one ladder: v1 three passes (three kernels), v2 one block per
# row (row read three times), v3 online softmax (read twice), v4 the row held in registers
# (read once), v5 long rows split over several blocks with a combine step.
_SOFTMAX = ("v1", "v2", "v3", "v4", "v5")
# test_shared_reduction.py holds this table against the versions the extension dispatches.
VERSIONS = {"sum": LADDERS["whole"] + LADDERS["rows"] + LADDERS["columns"],
            "amax": LADDERS["whole"] + LADDERS["rows"] + LADDERS["columns"],
            "softmax": _SOFTMAX, "log_softmax": _SOFTMAX}

try:  # installed: setup.py ships the shared loader inside the package
    from ._loader import check_arguments, device_sms, load_extension
except ImportError:  # the course checkout: the loader's one home, common/coursekit
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "common"))
    from coursekit.loader import check_arguments, device_sms, load_extension

# How the ops library was loaded: route (installed, jit or preloaded) and where from.
EXTENSION = load_extension("shared_reduction", "shared_reduction", __file__)

_sum = sum  # the builtin, before this module's sum shadows it


def sum(x, dim=None, keepdim=False, *, version=None):  # noqa: A001
    """torch.sum(x) for dim=None (a 0-d tensor), torch.sum(x, dim, keepdim) for an int dim.
    Differentiable. version names a rung of the ladder for the call's layout (LADDERS)."""
    check_arguments("sum", x=(x, torch.Tensor), dim=(dim, (int, None)), keepdim=(keepdim, bool))
    return torch.ops.shared_reduction.sum(x, dim, keepdim, version)


def amax(x, dim=None, keepdim=False, *, version=None):
    """torch.amax over every element (dim=None) or one dim; NaN propagates. Differentiable
    (the gradient is shared evenly among tied maxima, as torch.amax's)."""
    check_arguments("amax", x=(x, torch.Tensor), dim=(dim, (int, None)), keepdim=(keepdim, bool))
    return torch.ops.shared_reduction.amax(x, dim, keepdim, version)


def softmax(x, dim=-1, *, version=None):
    """torch.softmax(x, dim). Differentiable, with its own backward kernel."""
    check_arguments("softmax", x=(x, torch.Tensor), dim=(dim, int))
    return torch.ops.shared_reduction.softmax(x, dim, version)


def log_softmax(x, dim=-1, *, version=None):
    """torch.log_softmax(x, dim). Differentiable, with its own backward kernel."""
    check_arguments("log_softmax", x=(x, torch.Tensor), dim=(dim, int))
    return torch.ops.shared_reduction.log_softmax(x, dim, version)


def softmax_backward(grad, y, dim=-1, log=False):
    """The backward kernel alone: dx = y * (grad - sum(grad * y)) for softmax (y its output),
    dx = grad - exp(y) * sum(grad) for log_softmax (log=True, y its output)."""
    check_arguments("softmax_backward", grad=(grad, torch.Tensor), y=(y, torch.Tensor), dim=(dim, int),
                    log=(log, bool))
    return torch.ops.shared_reduction.softmax_backward(grad, y, dim, log)


def atomic_sum(x):
    """A float32 sum of every element in which each block adds its partial to the result with
    a floating-point atomicAdd: the demo of what atomics do to determinism. On the GPU its last
    bits vary from run to run; on the CPU it is an ordinary sum. Not differentiable."""
    check_arguments("atomic_sum", x=(x, torch.Tensor))
    return torch.ops.shared_reduction.atomic_sum(x)


def default_choice(op, x, dim=None, *, sms=None):
    """The rung `op(x, dim, version=None)` runs (op: sum, amax, softmax, log_softmax or
    softmax_backward) on a GPU of `sms` SMs, decided from shape, dtype and alignment alone; the
    rules live in reduction.h. sms=None: x's GPU (or the current one; an H100's 132 on a machine
    without a GPU). A meta tensor stands in for any tensor of its shape and dtype."""
    check_arguments("default_choice", op=(op, str), x=(x, torch.Tensor), dim=(dim, (int, None)), sms=(sms, (int, None)))
    return torch.ops.shared_reduction.default_choice(op, x, dim, device_sms(x) if sms is None else sms)
