"""LayerNorm, RMSNorm and fused_add_rms_norm: a row reduction fused with the map that needs it.

Every op normalizes over the last dim of x (any leading shape, 1-D included) with weight (and
bias) 1-D of that size, of x's dtype and device, or None (no scale, no shift: what
torch.nn.functional.layer_norm and rms_norm do without them); float32, float16 and bfloat16 (float64 too, on
the CPU and for gradcheck); 16-bit inputs compute in float32. Differentiable through C++
autograd Functions whose backward is this chapter's own kernel; dweight and dbias are
per-block partial column sums reduced in a fixed order (course::column_sum), so they are
bitwise deterministic run to run. eps must be >= 0 (a negative eps raises).

The ladders (norm_kernels.cu and norm_backward_kernels.cu say what each rung changes and why):
  forward  v1  two-pass statistics, a block per row: the row read three times (RMSNorm twice)
           v2  Welford's one-pass mean and variance: the row read twice (RMSNorm: same as v1)
           v3  the row held in registers, 16-byte loads, a warp or a block per row by hidden
               size: read once, written once; rows longer than the registers hold (32768
               2-byte or 16384 4-byte elements, and float64 always) run v2's kernel
  backward v1  streamed, a block per row, x and dy read twice, dweight partials in memory
           v2  x and dy held in registers, one pass, dweight partials in registers; rows
               longer than 8192 elements (and float64) run v1's kernel
  fused_add_rms_norm v1  an add kernel, then rms_norm (v3); v2 one fused kernel
version=None picks v3 forward, v2 backward and fused v2 at every shape (norm_default_choice
reports it). On the CPU there is one C++ implementation and the version is only validated.
"""
import torch

from . import check_arguments  # the shared loader's type checks, imported by the package first

__all__ = ["layer_norm", "rms_norm", "fused_add_rms_norm", "layer_norm_forward", "rms_norm_forward",
           "fused_add_rms_norm_forward", "layer_norm_backward", "rms_norm_backward",
           "norm_default_choice"]

_FORWARD = ("v1", "v2", "v3")
_BACKWARD = ("v1", "v2")
# test_norms.py holds this table against the versions the extension dispatches.
VERSIONS = {
    "layer_norm": _FORWARD,
    "rms_norm": _FORWARD,
    "layer_norm_backward": _BACKWARD,
    "rms_norm_backward": _BACKWARD,
    "fused_add_rms_norm": ("v1", "v2"),
}


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, version=None):
    """torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps). Differentiable in
    x, weight and bias; weight and bias may be None."""
    check_arguments("layer_norm", x=(x, torch.Tensor), weight=(weight, (torch.Tensor, None)),
                    bias=(bias, (torch.Tensor, None)), eps=(eps, float))
    return torch.ops.fusion.layer_norm(x, weight, bias, eps, version)


def rms_norm(x, weight=None, eps=1e-6, *, version=None):
    """torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps). Differentiable in x and
    weight; weight may be None. A row holding inf gives NaN where the inf is and 0 elsewhere,
    as F.rms_norm's: mean(x^2) is inf, so rstd is 0, and inf * 0 is NaN."""
    check_arguments("rms_norm", x=(x, torch.Tensor), weight=(weight, (torch.Tensor, None)), eps=(eps, float))
    return torch.ops.fusion.rms_norm(x, weight, eps, version)


def fused_add_rms_norm(x, residual, weight=None, eps=1e-6, *, version=None):
    """(rms_norm(h, weight, eps), h) with h = x + residual rounded to x's dtype: the residual
    add and the norm of an LLM decoder layer in one pass. Differentiable in x, residual and
    weight (and through both outputs)."""
    check_arguments("fused_add_rms_norm", x=(x, torch.Tensor), residual=(residual, torch.Tensor),
                    weight=(weight, (torch.Tensor, None)), eps=(eps, float))
    return torch.ops.fusion.fused_add_rms_norm(x, residual, weight, eps, version)


def layer_norm_forward(x, weight=None, bias=None, eps=1e-5, *, version=None):
    """layer_norm that also returns the saved statistics: (y, mean, rstd), mean and rstd of
    shape x.shape[:-1] in float32 (float64 for float64 x)."""
    check_arguments("layer_norm_forward", x=(x, torch.Tensor), weight=(weight, (torch.Tensor, None)),
                    bias=(bias, (torch.Tensor, None)), eps=(eps, float))
    return torch.ops.fusion.layer_norm_forward(x, weight, bias, eps, version)


def rms_norm_forward(x, weight=None, eps=1e-6, *, version=None):
    """rms_norm that also returns rstd: (y, rstd)."""
    check_arguments("rms_norm_forward", x=(x, torch.Tensor), weight=(weight, (torch.Tensor, None)), eps=(eps, float))
    return torch.ops.fusion.rms_norm_forward(x, weight, eps, version)


def fused_add_rms_norm_forward(x, residual, weight=None, eps=1e-6, *, version=None):
    """fused_add_rms_norm that also returns rstd: (y, x + residual, rstd)."""
    check_arguments("fused_add_rms_norm_forward", x=(x, torch.Tensor), residual=(residual, torch.Tensor),
                    weight=(weight, (torch.Tensor, None)), eps=(eps, float))
    return torch.ops.fusion.fused_add_rms_norm_forward(x, residual, weight, eps, version)


def layer_norm_backward(dy, x, weight, mean, rstd, *, version=None):
    """The backward kernel alone: (dx, dweight, dbias) from layer_norm_forward's mean and rstd."""
    check_arguments("layer_norm_backward", dy=(dy, torch.Tensor), x=(x, torch.Tensor),
                    weight=(weight, (torch.Tensor, None)), mean=(mean, torch.Tensor), rstd=(rstd, torch.Tensor))
    return torch.ops.fusion.layer_norm_backward(dy, x, weight, mean, rstd, version)


def rms_norm_backward(dy, x, weight, rstd, *, version=None, dsum=None):
    """The backward kernel alone: (dx, dweight) from rms_norm_forward's rstd. For
    fused_add_rms_norm, x is the saved sum x + residual, dsum the gradient of that sum (its
    second output), and dx = the norm's dx + dsum, added before dx is rounded."""
    check_arguments("rms_norm_backward", dy=(dy, torch.Tensor), x=(x, torch.Tensor),
                    weight=(weight, (torch.Tensor, None)), rstd=(rstd, torch.Tensor),
                    dsum=(dsum, (torch.Tensor, None)))
    return torch.ops.fusion.rms_norm_backward(dy, x, weight, rstd, version, dsum)


def norm_default_choice(op, x):
    """The rung version=None runs for op on x (layer_norm, rms_norm, fused_add_rms_norm,
    layer_norm_backward, rms_norm_backward); the benchmark records it."""
    check_arguments("norm_default_choice", op=(op, str), x=(x, torch.Tensor))
    return torch.ops.fusion.norm_default_choice(op, x)
