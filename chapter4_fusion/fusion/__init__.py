"""Kernel fusion: bias-scale-ReLU, activation functors, linear epilogues, LayerNorm and RMSNorm.

Chapter 4 of the course: a memory-bound chain of ops costs one trip through memory per op;
fused into one kernel it costs one. Every op has a forward and a backward kernel (C++ autograd),
a CPU implementation, and is measured against PyTorch eager (one trip per op) and
torch.compile (which fuses by itself).

Every op takes float32, float16 and bfloat16 (and float64 on the CPU and for gradcheck) and
returns the input's dtype; 16-bit inputs compute in float32. Results are bitwise deterministic
run to run: parameter gradients are per-block partial column sums combined in a fixed order
(chapter 3's column reduction, from the shared code), never floating-point atomics.
`version=` picks a rung of an op's ladder (VERSIONS and the chapter README); None lets the
dispatch pick from the shape and dtype. On the CPU there is one C++ implementation per op and
the version is only validated.
"""
from pathlib import Path

try:  # installed: setup.py ships the shared loader inside the package
    from ._loader import check_arguments, load_extension
except ImportError:  # the course checkout: the loader's one home, common/coursekit
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "common"))
    from coursekit.loader import check_arguments, load_extension

# How the ops library was loaded: route (installed, jit or preloaded) and where from.
EXTENSION = load_extension("fusion", "fusion", __file__)

from ._elementwise import *  # noqa: E402,F401,F403  (bias_scale_relu, activations, linear)
from ._elementwise import __all__ as _elementwise_all, VERSIONS as _ELEMENTWISE_VERSIONS  # noqa: E402
from ._norms import *  # noqa: E402,F401,F403  (layer_norm, rms_norm, fused_add_rms_norm)
from ._norms import __all__ as _norms_all, VERSIONS as _NORM_VERSIONS  # noqa: E402

import torch  # noqa: E402

# Every op's ladder, forward and backward; test_*.py hold it against the extension's tables.
VERSIONS = {**_ELEMENTWISE_VERSIONS, **_NORM_VERSIONS}


def default_choice(op, x):
    """The rung version=None runs for `op` (a key of VERSIONS) on a tensor like x: its shape,
    dtype and alignment decide. The benchmark records it beside every `default` row."""
    check_arguments("default_choice", op=(op, str), x=(x, torch.Tensor))
    if op in _NORM_VERSIONS:
        return torch.ops.fusion.norm_default_choice(op, x)
    return torch.ops.fusion.elementwise_default_choice(op, x)


__all__ = [*_elementwise_all, *_norms_all, "VERSIONS", "EXTENSION", "default_choice"]
