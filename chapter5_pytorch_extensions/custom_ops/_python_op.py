"""Route 3: the fused op as a Python custom op (torch.library.custom_op).

The kernel is route 1's raw entry point (custom_ops._C.fused_op_raw: checks and launch, no
autograd). What route 2 registers in C++, this route registers in Python:

- ``@torch.library.custom_op`` gives the function a schema, read from its type hints
  (``custom_ops_py::fused_op(Tensor input, Tensor bias, float scale) -> Tensor``), and makes it
  an op of the dispatcher, so Dynamo records a call as one graph node instead of breaking;
- ``register_fake`` says what the op returns for inputs that have shapes but no data (fake
  tensors under torch.compile and torch.export; meta tensors);
- ``register_autograd`` (with ``setup_context``) is the backward, itself a custom op so that
  AOTAutograd can trace it as well.

The namespace is custom_ops_py, not custom_ops: that one belongs to route 2's TORCH_LIBRARY
block, and a namespace has one owner.
"""
import torch
from torch import Tensor

from . import _C
from . import check_tensor_args as _check  # the glue's checks, for the fakes

@torch.library.custom_op("custom_ops_py::fused_op", mutates_args=())
def fused_op(input: Tensor, bias: Tensor, scale: float) -> Tensor:
    """relu(input * scale + bias): route 1's raw kernel as a Python custom op."""
    return _C.fused_op_raw(input, bias, scale)


@fused_op.register_fake
def _fused_op_fake(input, bias, scale):
    _check("fused_op", input=input, bias=bias)
    if input.dim() == 0:
        raise RuntimeError("fused_op: input is 0-d; it needs a last dim for the bias to run along")
    if bias.dim() != 1 or bias.shape[0] != input.shape[-1]:
        raise RuntimeError(f"fused_op: bias has shape {list(bias.shape)} but input has shape "
                           f"{list(input.shape)}; bias must be 1-D with input.size(-1) elements")
    # new_empty, not empty_like: the kernel returns a contiguous tensor whatever input's
    # strides are, and the fake must promise exactly what the kernel returns.
    return input.new_empty(input.shape)


@torch.library.custom_op("custom_ops_py::fused_op_backward", mutates_args=())
def fused_op_backward(grad: Tensor, output: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(grad_input, grad_bias) of fused_op, from the upstream grad and fused_op's output."""
    return _C.fused_op_backward_raw(grad, output, scale)


@fused_op_backward.register_fake
def _fused_op_backward_fake(grad, output, scale):
    _check("fused_op_backward", grad=grad, output=output)
    if grad.shape != output.shape:
        raise RuntimeError(f"fused_op_backward: grad has shape {list(grad.shape)} but output has shape "
                           f"{list(output.shape)} (they must match)")
    if grad.dim() == 0:
        raise RuntimeError("fused_op_backward: grad is 0-d, but fused_op's output has at least one dim")
    return grad.new_empty(grad.shape), grad.new_empty(grad.shape[-1:])


def _setup_context(ctx, inputs, output):
    # The output, not the input: y > 0 exactly where the ReLU let the gradient through
    # (custom_kernels.h says why that is the thing to keep).
    ctx.scale = inputs[2]
    ctx.save_for_backward(output)


def _backward(ctx, grad):
    (output,) = ctx.saved_tensors
    grad_input, grad_bias = fused_op_backward(grad, output, ctx.scale)
    return grad_input, grad_bias, None


fused_op.register_autograd(_backward, setup_context=_setup_context)
