"""Chapter 5's fused op built against the LibTorch stable ABI.

``fused_op(input, bias, scale) = relu(input * scale + bias)``, the same kernels as the chapter's
``custom_ops`` (CPU and CUDA; float32, float16, bfloat16, float64), registered by
``stable_abi/stable_ops.cpp`` with ``STABLE_TORCH_LIBRARY`` as
``torch.ops.custom_ops_stable.fused_op`` and ``fused_op_backward``.

What the C++ side cannot register through the stable ABI, this module registers in Python:

- the fake implementations (``torch.library.register_fake``): a fake tensor's sizes may be
  symbolic (torch.compile with dynamic shapes, torch.export, opcheck), and the stable ABI has
  no symbolic sizes (SymInt), only int64 ones. A Meta kernel written against it does run, but
  reading a size pins it (a guard "rows == 8"), so a model compiled with dynamic shapes would
  recompile at every new size; a Python fake keeps the sizes symbolic;
- the autograd formula (``torch.library.register_autograd``): the stable ABI has no autograd
  API (no ``torch::autograd::Function``), so the backward is the C++ op
  ``fused_op_backward`` wired to ``fused_op`` from here.

The compiled library is found the way every chapter's is (coursekit.loader): the
``_C.abi3.so`` that ``pip install .`` put into this package, or a JIT build by
``stable_abi/load_jit.py``; ``EXTENSION`` says which. ``TARGET`` is the oldest torch (major,
minor) the library was built to load into.
"""
import sys
from pathlib import Path

import torch

try:  # installed: setup.py ships the shared loader inside the package
    from ._loader import check_tensor_args as _check, load_extension
except ImportError:  # the course checkout: the loader's one home, common/coursekit
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "common"))
    from coursekit.loader import check_tensor_args as _check, load_extension

# How the ops library was loaded: route (installed, jit or preloaded) and where from.
EXTENSION = load_extension("custom_ops_stable", "custom_ops_stable", __file__)

_ops = torch.ops.custom_ops_stable

TARGET = tuple(_ops.target_version())

def fused_op(input, bias, scale):
    """relu(input * scale + bias) in one kernel, differentiable in input and bias.

    input: a floating tensor of at least one dim (float32, float16, bfloat16, float64; cpu or
    cuda), any strides; bias: 1-D, input.size(-1) elements, same dtype and device; scale: a
    Python number. Returns a new contiguous tensor of input's shape and dtype.
    """
    return _ops.fused_op(input, bias, scale)


@torch.library.register_fake("custom_ops_stable::fused_op")
def _fused_op_fake(input, bias, scale):
    op = "custom_ops_stable::fused_op"
    _check(op, input=input, bias=bias)
    if input.dim() == 0:
        raise RuntimeError(f"{op}: input is 0-d; it needs a last dim for the bias to run along")
    if bias.dim() != 1 or bias.shape[0] != input.shape[-1]:
        raise RuntimeError(f"{op}: bias has shape {list(bias.shape)} but input has shape {list(input.shape)}; "
                           "bias must be 1-D with input.size(-1) elements")
    # new_empty, not empty_like: the kernel returns a contiguous tensor whatever input's
    # strides are, and the fake must promise exactly what the kernel returns.
    return input.new_empty(input.shape)


@torch.library.register_fake("custom_ops_stable::fused_op_backward")
def _fused_op_backward_fake(grad, output, scale):
    op = "custom_ops_stable::fused_op_backward"
    _check(op, grad=grad, output=output)
    if grad.dim() == 0:
        raise RuntimeError(f"{op}: grad is 0-d, but fused_op's output has at least one dim")
    if grad.shape != output.shape:
        raise RuntimeError(f"{op}: grad has shape {list(grad.shape)} but output has shape {list(output.shape)} "
                           "(they must match)")
    return grad.new_empty(grad.shape), grad.new_empty(grad.shape[-1:])


def _setup_context(ctx, inputs, output):
    _, _, scale = inputs
    # The output, not the input: ../custom_kernels.h (FusedOpBackwardParams) says why.
    ctx.save_for_backward(output)
    ctx.scale = scale


def _backward(ctx, grad):
    (output,) = ctx.saved_tensors
    grad_input, grad_bias = _ops.fused_op_backward(grad, output, ctx.scale)
    return grad_input, grad_bias, None


torch.library.register_autograd("custom_ops_stable::fused_op", _backward, setup_context=_setup_context)

__all__ = ["fused_op", "EXTENSION", "TARGET"]
