"""The fused op as a layer."""
import torch
from torch import nn

from . import check_arguments  # the shared loader's type checks, imported by the package first


class FusedOpLayer(nn.Module):
    """y = relu(x * scale + bias) over the last dim of x, with a learnable bias.

    features: the size of x's last dim (and of the bias); scale: a fixed Python number, not a
    parameter. The bias starts at zero, so a fresh layer is relu(x * scale). It runs the
    course's route (torch.ops.custom_ops.fused_op, as custom_ops.fused_op_forward does), so it
    works in nn.Sequential, under torch.compile and torch.export, on whatever device and dtype
    the module is moved to (.cuda(), .double(), .to(torch.bfloat16)).
    """

    def __init__(self, features, scale=1.0, *, device=None, dtype=None):
        check_arguments("FusedOpLayer", features=(features, int), scale=(scale, float))
        super().__init__()
        self.features = features
        self.scale = float(scale)
        self.bias = nn.Parameter(torch.zeros(features, device=device, dtype=dtype))

    def forward(self, x):
        # custom_ops.fused_op_forward's op, called directly: this module is imported before
        # the package's functions are defined.
        check_arguments("FusedOpLayer.forward", x=(x, torch.Tensor))
        return torch.ops.custom_ops.fused_op(x, self.bias, self.scale)

    def extra_repr(self):
        return f"features={self.features}, scale={self.scale}"
