"""The elementwise fusions: bias-scale-ReLU, bias + activation, SwiGLU, linear + activation.

Each op is a chain of memory-bound steps that eager PyTorch runs as one kernel per step, a trip
through memory each; here the chain is one kernel (the ladders below show the steps from
eager-like to fused and vectorized). The kernels are in elementwise_kernels.cu and
linear_epilogue_kernels.cu, the activations' formulas in activation.h.

Every op takes float32, float16, bfloat16 (and float64, for gradcheck), returns the input's
dtype, and computes 16-bit inputs in float32. A bias is 1-D with x.size(-1) elements and
broadcasts over every leading dim of x. Backward passes are C++ kernels; bias gradients are
per-block column partial sums combined in a fixed order: bitwise deterministic.
"""
import math

import torch

from . import check_arguments  # the shared loader's type checks, imported by the package first

__all__ = ["fused_bias_scale_relu", "fused_bias_scale_relu_backward", "fused_bias_scale_relu_saved", "saved_bytes",
           "bias_gelu", "bias_silu", "swiglu", "linear_activation", "elementwise_default_choice", "SAVE_CHOICES",
           "ACTIVATIONS"]

# The ladders (test_elementwise.py holds this table against the extension's dispatch):
#   fused_bias_scale_relu           v1 three kernels (scale, add bias, relu: eager's three trips
#                                   through memory), v2 one fused kernel with scalar accesses,
#                                   v3 16-byte accesses: the bias loaded once per thread and reused
#                                   by every row it visits, or (where that would leave lanes idle,
#                                   or rows are not whole vectors) one vector per thread over the
#                                   flat array with the bias gathered by column;
#   fused_bias_scale_relu_backward  v1 g = dy * (z > 0) written out, dx = g * scale, then a
#                                   column sum of g; v2 one pass writing dx and per-block column
#                                   partials of g, then a small deterministic column sum;
#   bias_gelu, bias_silu, swiglu    v1 unfused (bias add, then the activation; swiglu: silu(a),
#                                   then the product), v2 one fused, vectorized kernel;
#   linear_activation               the GEMM (cuBLAS) then either a bias kernel and an
#                                   activation kernel ("unfused") or one bias + activation
#                                   kernel ("fused_epilogue").
VERSIONS = {
    "fused_bias_scale_relu": ("v1", "v2", "v3"),
    "fused_bias_scale_relu_backward": ("v1", "v2"),
    "bias_gelu": ("v1", "v2"),
    "bias_silu": ("v1", "v2"),
    "swiglu": ("v1", "v2"),
    "linear_activation": ("unfused", "fused_epilogue"),
}

# What fused_bias_scale_relu may keep for its backward (save=), and the activations of
# linear_activation.
SAVE_CHOICES = ("y", "x", "mask")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")


def fused_bias_scale_relu(x, bias, scale, *, save="mask", version=None):
    """relu(x * scale + bias), bias (x.size(-1) elements) broadcast over the leading dims.

    Differentiable in x and bias. save picks what the forward keeps for the backward (which
    needs only the sign of x * scale + bias): "y" the output, "x" the input (the sign is
    recomputed), "mask" one bit per element written by the forward (an int32 tensor of
    [rows, ceil(n / 32)] words). Nothing is kept, and no mask written, when no gradient is needed.
    """
    check_arguments("fused_bias_scale_relu", x=(x, torch.Tensor), bias=(bias, torch.Tensor), scale=(scale, float))
    return torch.ops.fusion.fused_bias_scale_relu(x, bias, float(scale), save=save, version=version)


def fused_bias_scale_relu_backward(grad, saved, bias, scale, save="mask", version=None):
    """The backward kernels alone, for benchmarks: returns (dx, dbias) with
    dx = grad * (z > 0) * scale and dbias = the sum of grad * (z > 0) over every leading dim,
    z = x * scale + bias. saved is what the forward kept under `save`: y, x, or the mask
    (torch.ops.fusion.fused_bias_scale_relu_forward returns (y, mask))."""
    check_arguments("fused_bias_scale_relu_backward", grad=(grad, torch.Tensor), saved=(saved, torch.Tensor),
                    bias=(bias, torch.Tensor), scale=(scale, float))
    return torch.ops.fusion.fused_bias_scale_relu_backward(grad, saved, bias, float(scale), save, version)


def fused_bias_scale_relu_saved(x, bias, scale, save="mask", *, version=None):
    """What fused_bias_scale_relu's forward keeps for its backward under `save`: y, x itself,
    or the mask its forward kernel writes. The `saved` argument of
    fused_bias_scale_relu_backward."""
    check_arguments("fused_bias_scale_relu_saved", x=(x, torch.Tensor), bias=(bias, torch.Tensor), scale=(scale, float))
    y, mask = torch.ops.fusion.fused_bias_scale_relu_forward(x, bias, float(scale), save, version)
    return {"y": y, "x": x, "mask": mask}[save]


def saved_bytes(x, save):
    """Bytes fused_bias_scale_relu keeps for the backward of x under `save` (the bias aside):
    x's size for "y" and "x", 4 * ceil(n / 32) per row of n for "mask"."""
    if save in ("y", "x"):
        return x.numel() * x.element_size()
    if save == "mask":
        n = x.shape[-1]
        return math.prod(x.shape[:-1]) * 4 * ((n + 31) // 32)
    raise ValueError(f"saved_bytes: unknown save {save!r}; expected one of {', '.join(SAVE_CHOICES)}")


def bias_gelu(x, bias, approximate="none", *, version=None):
    """gelu(x + bias), as torch.nn.functional.gelu(x + bias, approximate=approximate)
    ("none": the erf form, "tanh": the tanh approximation). Differentiable in x and bias."""
    check_arguments("bias_gelu", x=(x, torch.Tensor), bias=(bias, torch.Tensor), approximate=(approximate, str))
    return torch.ops.fusion.bias_gelu(x, bias, approximate, version=version)


def bias_silu(x, bias, *, version=None):
    """silu(x + bias) = (x + bias) * sigmoid(x + bias). Differentiable in x and bias."""
    check_arguments("bias_silu", x=(x, torch.Tensor), bias=(bias, torch.Tensor))
    return torch.ops.fusion.bias_silu(x, bias, version=version)


def swiglu(x, *, version=None):
    """silu(a) * b where a, b = x.chunk(2, dim=-1): the last dim must be even; the result has
    half of it. Differentiable."""
    check_arguments("swiglu", x=(x, torch.Tensor))
    return torch.ops.fusion.swiglu(x, version=version)


def linear_activation(x, weight, bias, activation, *, version=None):
    """act(x @ weight.T + bias), activation one of "relu", "gelu", "gelu_tanh", "silu";
    weight [out_features, in_features], bias [out_features] or None (as F.linear's). The GEMM is cuBLAS (the CPU BLAS
    on the CPU) through ATen; the bias and the activation are one epilogue kernel on its
    output. Differentiable in x, weight and bias (the backward keeps x @ weight.T + bias)."""
    check_arguments("linear_activation", x=(x, torch.Tensor), weight=(weight, torch.Tensor), bias=(bias, (torch.Tensor, None)),
                    activation=(activation, str))
    return torch.ops.fusion.linear_activation(x, weight, bias, activation, version=version)


def elementwise_default_choice(op, x):
    """The rung `op(x, ..., version=None)` runs, from x's shape and dtype alone (op: a key of
    VERSIONS; for linear_activation, x stands for the GEMM's output)."""
    check_arguments("elementwise_default_choice", op=(op, str), x=(x, torch.Tensor))
    return torch.ops.fusion.elementwise_default_choice(op, x)
