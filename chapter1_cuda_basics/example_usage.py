"""A five-minute tour of chapter 1. Runs on a GPU, or on the CPU path without one.

    python example_usage.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cuda_basics  # noqa: E402  (builds the extension by JIT if it is not installed)

device = "cuda" if torch.cuda.is_available() else "cpu"
print(f"torch {torch.__version__} on {device}; extension loaded via the "
      f"{cuda_basics.EXTENSION['route']} route")

# 1. The three ops, checked against PyTorch on an irregular size.
a = torch.randn(1823, 781, device=device)
b = torch.randn(1823, 781, device=device)
torch.testing.assert_close(cuda_basics.vector_add(a, b), a + b)
torch.testing.assert_close(cuda_basics.saxpy(2.5, a, b), 2.5 * a + b)
torch.testing.assert_close(cuda_basics.relu(a), torch.relu(a))
print("vector_add, saxpy and relu match PyTorch on a 1823x781 float32 tensor")

# 2. Every rung of the ladder computes the same function; only the speed differs.
for version in cuda_basics.VERSIONS["vector_add"]:
    out = cuda_basics.vector_add(a, b, version=version)
    print(f"  version {version:<12} max |error| = {(out - (a + b)).abs().max().item():.1e}")

# 3. Views and low precision: a transposed view and a misaligned slice, in bfloat16.
x = torch.randn(1000, 1001, device=device, dtype=torch.bfloat16)
torch.testing.assert_close(cuda_basics.relu(x.t()), torch.relu(x.t()))
torch.testing.assert_close(cuda_basics.vector_add(x.flatten()[1:], x.flatten()[1:]),
                           x.flatten()[1:] * 2)
print("transposed and offset bfloat16 views give the right answer")

# 4. Autograd: the backward passes are C++ autograd Functions.
x = torch.randn(5, device=device, requires_grad=True)
y = torch.randn(5, device=device, requires_grad=True)
cuda_basics.saxpy(3.0, x, y).sum().backward()
print(f"d/dx sum(3x + y) = {x.grad.tolist()} (all 3), d/dy = {y.grad.tolist()} (all 1)")

# 5. Misuse gets a clear error instead of a crash or silent broadcasting.
try:
    cuda_basics.vector_add(torch.randn(3, device=device), torch.randn(4, device=device))
except RuntimeError as err:
    print(f"as expected: {err}".splitlines()[0])

# 6. version=None picks per call: by size, dtype and alignment (elementwise.h, "version=None").
for n, dtype, aligned in ((2**16, torch.float32, True), (2**16, torch.bfloat16, False),
                          (2**24, torch.bfloat16, False)):
    version, kernel, threads, per_thread = cuda_basics.default_choice(n, dtype, aligned=aligned)
    print(f"  {n:>9} {str(dtype)[6:]:<9} {'aligned' if aligned else 'x[1:]':<8} -> {version} "
          f"({kernel}, {threads} threads x {per_thread} elements)")

# 7. A quick timing against torch.add (the benchmark does this properly).
if device == "cuda":
    n = 2**26
    a, b = torch.randn(n, device=device), torch.randn(n, device=device)
    for name, fn in [("torch.add", lambda: a + b),
                     *[(v, lambda v=v: cuda_basics.vector_add(a, b, version=v))
                       for v in cuda_basics.VERSIONS["vector_add"]]]:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 10
        print(f"  {name:<12} {ms:7.3f} ms  {3 * 4 * n / ms / 1e6:7.0f} GB/s")
