"""One CUDA kernel, three ways into PyTorch.

Chapter 5 of the course: ``fused_op(input, bias, scale) = relu(input * scale + bias)`` (one
kernel instead of eager's three), ``custom_relu`` and ``reduce_sum`` (a shared-memory block
reduction), each with its backward, on CPU and CUDA, in float32, float16, bfloat16 and float64
(16-bit inputs compute in float32). The kernels are the same everywhere; what the chapter
compares is how they are bound to PyTorch:

1. ``pybind11`` (custom_ops.cpp): ``PYBIND11_MODULE`` functions that Python calls directly, the
   backward a ``torch::autograd::Function`` in C++. The classic extension, as
   PyTorch's C++ extension tutorial writes it: the fewest layers between Python and the kernel, but an opaque builtin to PyTorch.
   torch.compile breaks the graph at it, fake tensors cannot pass through it, so torch.export
   and torch.library.opcheck cannot take it.
2. ``torch_library`` (library_ops.cpp), the course's route and this package's public API:
   ``TORCH_LIBRARY`` schemas with CPU, CUDA and Meta kernels and the autograd registered in
   C++. The ops are ``torch.ops.custom_ops.*``; the dispatcher knows their schema, shapes and
   derivative, so torch.compile(fullgraph=True) traces them without a graph break, torch.export
   keeps them as nodes, and they pass torch.library.opcheck.
3. ``custom_op`` (custom_ops/_python_op.py): ``torch.library.custom_op`` in Python around
   route 1's raw kernel entry point, with ``register_fake`` and ``register_autograd``. The same
   standing with the compiler as route 2 without writing the registration in C++; the price
   is some Python on every call.

The public ops (``fused_op_forward``, ``custom_relu``, ``reduce_sum``) run route 2.
``ROUTES`` maps each route's name to its fused op, a callable ``(input, bias, scale)``, for
side-by-side comparisons (test_routes.py, example_usage.py, the chapter's benchmark).
``FusedOpLayer`` is the fused op as an ``nn.Module`` with a learnable bias.

The compiled library (custom_ops._C) is found the way every chapter's is (coursekit.loader):
the one ``pip install .`` put next to the package, or a JIT build of the sources by
load_jit.py; ``EXTENSION`` says which.
"""
import importlib.util
import sys
from pathlib import Path

import torch

try:  # installed: setup.py ships the shared loader inside the package
    from ._loader import check_arguments, check_tensor_args, installed_library, load_extension
except ImportError:  # the course checkout: the loader's one home, common/coursekit
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "common"))
    from coursekit.loader import check_arguments, check_tensor_args, installed_library, load_extension

# How the ops library was loaded: route (installed, jit or preloaded) and where from.
EXTENSION = load_extension("custom_ops", "custom_ops", __file__)

# load_jit.NAME: the module name of a JIT-built library.
_JIT_MODULE = "custom_ops_jit"


def _library_path():
    """The file of the library that load_extension loaded (or found loaded)."""
    if "so_path" in EXTENSION:
        return Path(EXTENSION["so_path"])
    # Preloaded: whoever loaded it (load_jit.py, or a learner's own code) used
    # torch.ops.load_library, which remembers the path.
    for path in map(Path, torch.ops.loaded_libraries):
        if path.name.startswith(_JIT_MODULE + ".") or (path.name.startswith("_C") and path.parent.name == "custom_ops"):
            return path
    return installed_library("custom_ops", Path(__file__).resolve().parent)


def _import_bindings():
    """Route 1's module: the pybind11 half of the library whose ops were loaded above.

    The loader loads the library for its dispatcher ops (torch.ops.load_library), which does not
    run its Python module init; importing the same file does (the second dlopen of a path
    returns the handle of the first, so nothing is registered twice). The module name must be
    the TORCH_EXTENSION_NAME it was compiled with: _C from setup.py, custom_ops_jit from
    load_jit.py."""
    for name in (f"{__name__}._C", _JIT_MODULE):
        if name in sys.modules:
            return sys.modules[name]
    path = _library_path()
    if path is None:
        raise ImportError("custom_ops: the ops library is loaded but its file was not found, so its pybind11 "
                          "functions cannot be imported; import custom_ops before loading the library yourself")
    name = _JIT_MODULE if path.name.startswith(_JIT_MODULE + ".") else f"{__name__}._C"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


_C = _import_bindings()

from . import _python_op  # noqa: E402  (route 3: registers custom_ops_py::fused_op)
from .layers import FusedOpLayer  # noqa: E402

_ops = torch.ops.custom_ops


def fused_op_forward(input, bias, scale):
    """relu(input * scale + bias) in one kernel, differentiable in input and bias.

    input: a floating tensor of at least one dim (float32, float16, bfloat16, float64; cpu or
    cuda), any strides; bias: 1-D, input.size(-1) elements, same dtype and device; scale: a
    Python number. Returns a new contiguous tensor of input's shape and dtype. The backward
    keeps the output (not the input) to know where the ReLU let the gradient through.
    """
    check_arguments("fused_op_forward", input=(input, torch.Tensor), bias=(bias, torch.Tensor), scale=(scale, float))
    return _ops.fused_op(input, bias, scale)


def custom_relu(x):
    """relu(x) in one kernel, differentiable (NaN passes through, as in torch.relu)."""
    check_arguments("custom_relu", x=(x, torch.Tensor))
    return _ops.custom_relu(x)


def reduce_sum(x):
    """The sum of every element of x as a 0-d tensor of x's dtype, differentiable.

    A two-stage shared-memory block reduction on the GPU (per-block partial sums, then one
    block adds them), accumulated in float32 (float64 for float64). Deterministic: the same
    input gives the same bits every run. An empty x sums to 0.
    """
    check_arguments("reduce_sum", x=(x, torch.Tensor))
    return _ops.reduce_sum(x)


# Each route's fused op, a callable (input, bias, scale); all run the same kernels.
ROUTES = {
    "pybind11": _C.fused_op_forward,
    "torch_library": _ops.fused_op.default,
    "custom_op": _python_op.fused_op,
}

__all__ = ["fused_op_forward", "custom_relu", "reduce_sum", "FusedOpLayer", "ROUTES", "EXTENSION"]
