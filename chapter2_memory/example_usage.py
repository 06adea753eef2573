"""A five-minute tour of chapter 2. Runs on a GPU, or on the CPU path without one.

    python example_usage.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_ops  # noqa: E402  (builds the extension by JIT if it is not installed)

device = "cuda" if torch.cuda.is_available() else "cpu"
print(f"torch {torch.__version__} on {device}; extension loaded via the "
      f"{memory_ops.EXTENSION['route']} route")

# 1. The three ops against PyTorch on an irregular shape. Data movement is exact: equal bits.
x = torch.randn(1823, 781, device=device)
assert torch.equal(memory_ops.copy(x), x)
assert torch.equal(memory_ops.strided_copy(x, 7), x.flatten()[::7])
assert torch.equal(memory_ops.transpose(x), x.t().contiguous())
print("copy, strided_copy and transpose match PyTorch bit for bit on a 1823x781 tensor")

# 2. Every rung of the transpose ladder moves the same data; only the access pattern differs.
for version in memory_ops.VERSIONS["transpose"]:
    same = torch.equal(memory_ops.transpose(x, version=version), x.t().contiguous())
    print(f"  transpose {version}: {'identical' if same else 'WRONG'}")

# 3. Batched, low precision, non-contiguous: the kernels read the input's strides directly.
batch = torch.randn(8, 96, 200, device=device, dtype=torch.bfloat16).transpose(1, 2)
print(f"a transposed bfloat16 batch view, strides {batch.stride()}: transpose gives back "
      f"the original layout -> {torch.equal(memory_ops.transpose(batch), batch.transpose(1, 2).contiguous())}")

# 4. Autograd: the backward of a transpose is a transpose.
w = torch.randn(64, 48, device=device, requires_grad=True)
(memory_ops.transpose(w) * torch.arange(64.0, device=device)).sum().backward()
assert torch.equal(w.grad, torch.arange(64.0, device=device)[:, None].expand(64, 48))
print("gradient of sum(transpose(w) * arange) is arange along w's rows, as expected")

# 5. version=None looks at strides and alignment, never at values, and picks a kernel.
base = torch.randn(256, 513, device=device)
for name, x in (("aligned rows", torch.randn(256, 512, device=device)), ("odd columns", base),
                ("x[:, 1:] (every row shifted)", torch.randn(256, 512, device=device)[:, 1:]),
                ("x.t() of a contiguous matrix", base.t().contiguous().t()),
                ("every other column", base[:, ::2])):
    print(f"  transpose of {name:<29} -> version=None runs {memory_ops.default_choice('transpose', x)}")

# 6. A first timing, to see why this chapter exists (rough: use bench_memory_ops.py for numbers).
if device == "cuda":
    big = torch.randn(8192, 8192, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for version in (*memory_ops.VERSIONS["transpose"], "torch"):
        fn = (lambda: big.t().contiguous()) if version == "torch" else \
            (lambda: memory_ops.transpose(big, version=version))
        fn()
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 10
        print(f"  8192^2 float32 transpose {version:<6} {ms:6.3f} ms  "
              f"{2 * big.numel() * 4 / ms / 1e6:6.0f} GB/s")
else:
    print("(no GPU: run bench_memory_ops.py on one, or open notebooks/02_memory.ipynb for the "
          "recorded numbers)")
