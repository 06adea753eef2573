"""A guided tour of chapter 5: the fused op in use, in a network, and bound three ways.
Runs on a GPU if there is one, else on the CPU.

    python example_usage.py

1. relu(input * scale + bias) with its gradients, against PyTorch;
2. FusedOpLayer inside nn.Sequential, trained with Adam for a few steps;
3. the same kernel through the three routes side by side: the result, what torch.compile
   sees (graphs and graph breaks), whether torch.library.opcheck can take it, and the host
   time of one call on a tiny tensor (where the binding, not the kernel, is the cost).
"""
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import torch  # noqa: E402
from torch import nn  # noqa: E402

import custom_ops  # noqa: E402


def basic(device):
    print("1. The fused op and its gradients")
    batch_size, features, scale = 128, 256, 2.0
    x = torch.randn(batch_size, features, device=device, requires_grad=True)
    bias = torch.randn(features, device=device, requires_grad=True)
    output = custom_ops.fused_op_forward(x, bias, scale)
    output.sum().backward()
    print(f"   output {tuple(output.shape)}, input gradient {tuple(x.grad.shape)}, bias gradient {tuple(bias.grad.shape)}")
    expected = torch.relu(x * scale + bias)
    ex, ebias = torch.autograd.grad(expected.sum(), (x, bias))
    torch.testing.assert_close(output, expected)
    torch.testing.assert_close(x.grad, ex)
    torch.testing.assert_close(bias.grad, ebias, rtol=1e-5, atol=1e-4)  # 128 rows summed in another order
    print("   forward and both gradients match relu(x * scale + bias) in PyTorch")


def training(device):
    print("\n2. FusedOpLayer in nn.Sequential, trained with Adam")
    model = nn.Sequential(
        nn.Linear(512, 256),
        custom_ops.FusedOpLayer(256, scale=2.0),
        nn.Linear(256, 10),
    ).to(device)
    print("   " + str(model).replace("\n", "\n   "))
    inputs = torch.randn(32, 512, device=device)
    target = torch.randn(32, 10, device=device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-4)
    losses = []
    for epoch in range(10):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(f"   epoch {epoch}: loss {loss.item():.4f}")
    assert losses[-1] < losses[0], losses
    print(f"   the loss went from {losses[0]:.4f} to {losses[-1]:.4f}; the layer's bias moved by "
          f"{model[1].bias.detach().abs().max().item():.2e} at most")


def host_us_per_call(fn, x, bias, calls=2000):
    for _ in range(100):
        fn(x, bias, 2.0)
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(x, bias, 2.0)
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def routes(device):
    print("\n3. One kernel, three bindings")
    x = torch.randn(64, 100, device=device)
    bias = torch.randn(100, device=device)
    expected = torch.relu(x * 1.5 + bias)
    tiny_x, tiny_bias = torch.randn(4, 8, device=device), torch.randn(8, device=device)
    print(f"   {'route':<14}{'matches':>8}{'graphs':>8}{'breaks':>8}  {'opcheck':<10}{'us/call (4x8)':>14}")
    for name, fn in custom_ops.ROUTES.items():
        # float32's assert_close tolerances: one fused multiply-add against eager's two roundings.
        matches = torch.allclose(fn(x, bias, 1.5), expected, rtol=1.3e-6, atol=1e-5)

        def model(a, b):
            # Work before and after the op: a graph break shows as two graphs.
            return fn(a * 2.0, b, 0.75) + 1.0

        torch._dynamo.reset()
        with warnings.catch_warnings():
            # Dynamo warns at length that it cannot trace the pybind11 builtin: that is the
            # point being shown, and the table says it.
            warnings.simplefilter("ignore")
            explained = torch._dynamo.explain(model)(x, bias)
        try:
            torch.library.opcheck(fn, (x, bias, 1.5))
            opcheck = "passes"
        except ValueError:  # not a registered op: opcheck has nothing to check
            opcheck = "n/a"
        us = host_us_per_call(fn, tiny_x, tiny_bias)
        print(f"   {name:<14}{str(matches):>8}{explained.graph_count:>8}{explained.graph_break_count:>8}  "
              f"{opcheck:<10}{us:>14.1f}")
    torch._dynamo.reset()
    print("   pybind11: Dynamo cannot see into the builtin, so the graph breaks around it; the other two are")
    print("   dispatcher ops with fake (meta) implementations: one graph, and opcheck can test them.")


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"custom_ops from the {custom_ops.EXTENSION['route']} build; running on {device}\n")
    torch.manual_seed(0)
    basic(device)
    training(device)
    routes(device)


if __name__ == "__main__":
    main()
