"""A guided tour of chapter 4: a transformer-style MLP block built from the fused ops, trained
for a few steps next to its plain-PyTorch twin. Runs on a GPU if there is one, else on the CPU.

    python example_usage.py

The block:  h = gelu(x @ W1.T + b1)           linear_activation (GEMM + fused epilogue)
            u = bias_gelu(h @ W2.T, b2)        a bias + activation functor kernel
            out, r = fused_add_rms_norm(u, x, g)     r = u + x, out = rms_norm(r) * g, one pass
            loss = mse(layer_norm(out), target)
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fusion  # noqa: E402


class Block(torch.nn.Module):
    """The MLP block. fused=True runs the chapter's ops, False the PyTorch ops they replace."""

    def __init__(self, d, hidden, fused):
        super().__init__()
        self.fused = fused
        self.w1 = torch.nn.Parameter(torch.randn(hidden, d) / d**0.5)
        self.b1 = torch.nn.Parameter(torch.zeros(hidden))
        self.w2 = torch.nn.Parameter(torch.randn(d, hidden) / hidden**0.5)
        self.b2 = torch.nn.Parameter(torch.zeros(d))
        self.g = torch.nn.Parameter(torch.ones(d))
        self.ln_w = torch.nn.Parameter(torch.ones(d))
        self.ln_b = torch.nn.Parameter(torch.zeros(d))

    def forward(self, x):
        if self.fused:
            h = fusion.linear_activation(x, self.w1, self.b1, "gelu")
            u = fusion.bias_gelu(h @ self.w2.T, self.b2)
            out, _ = fusion.fused_add_rms_norm(u, x, self.g, 1e-6)
            return fusion.layer_norm(out, self.ln_w, self.ln_b, 1e-5)
        h = F.gelu(F.linear(x, self.w1, self.b1))
        u = F.gelu(h @ self.w2.T + self.b2)
        out = F.rms_norm(u + x, (x.shape[-1],), self.g, 1e-6)
        return F.layer_norm(out, (x.shape[-1],), self.ln_w, self.ln_b, 1e-5)


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"fusion ops from {fusion.EXTENSION['route']} build; running on {device}")
    torch.manual_seed(0)

    # 1. One op, three ways of saving for backward.
    x = torch.randn(64, 1000, device=device)
    bias = torch.randn(1000, device=device)
    y = fusion.fused_bias_scale_relu(x, bias, 0.5)
    torch.testing.assert_close(y, torch.relu(x * 0.5 + bias))
    for save in fusion.SAVE_CHOICES:
        print(f"fused_bias_scale_relu, save={save!r}: keeps {fusion.saved_bytes(x, save)} bytes for "
              f"backward (x is {x.numel() * x.element_size()} bytes)")
    if device == "cuda":
        for op in ("fused_bias_scale_relu", "layer_norm", "rms_norm"):
            print(f"version=None for {op} at {tuple(x.shape)} float32 runs {fusion.default_choice(op, x)}")

    # 2. The block and its twin, the same weights, a few steps of SGD on the same batches.
    d, hidden, tokens = 256, 1024, 512
    fused, plain = Block(d, hidden, True).to(device), Block(d, hidden, False).to(device)
    plain.load_state_dict(fused.state_dict())
    opt_f = torch.optim.SGD(fused.parameters(), lr=0.05)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.05)
    print(f"\nMLP block d={d}, hidden={hidden}, {tokens} tokens, float32:")
    print(f"{'step':>4} {'fused loss':>12} {'PyTorch loss':>13}")
    for step in range(5):
        x = torch.randn(tokens, d, device=device)
        target = torch.randn(tokens, d, device=device)
        losses = []
        for model, opt in ((fused, opt_f), (plain, opt_p)):
            opt.zero_grad()
            loss = F.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        print(f"{step:>4} {losses[0]:>12.6f} {losses[1]:>13.6f}")
        # float32 kernels that sum in another order than PyTorch's differ in the last bits;
        # five steps of SGD keep that far below this tolerance.
        assert abs(losses[0] - losses[1]) <= 1e-4 * abs(losses[1]) + 1e-6, losses
    print("the fused block trains like its PyTorch twin")


if __name__ == "__main__":
    main()
