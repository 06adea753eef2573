"""A five-minute tour of chapter 3. Runs on a GPU, or on the CPU path without one.

    python example_usage.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shared_reduction as sr  # noqa: E402  (builds the extension by JIT if it is not installed)

device = "cuda" if torch.cuda.is_available() else "cpu"
print(f"torch {torch.__version__} on {device}; extension loaded via the "
      f"{sr.EXTENSION['route']} route")

# 1. sum and amax, against PyTorch, on an irregular shape: every element, a row dim, a column dim.
x = torch.randn(1823, 781, device=device)
for dim in (None, -1, 0):
    ours, theirs = (sr.sum(x), x.sum()) if dim is None else (sr.sum(x, dim), x.sum(dim))
    err = (ours - theirs).abs().max().item()
    print(f"sum(dim={dim}): max |ours - torch| = {err:.2e}; version=None runs "
          f"{sr.default_choice('sum', x, dim)}")
assert torch.equal(sr.amax(x, 0), x.amax(0)), "a maximum is exact"

# 2. Harris's ladder: ten kernels, one answer (to rounding), and each bit-for-bit repeatable.
for version in sr.LADDERS["whole"]:
    a, b = sr.sum(x, version=version), sr.sum(x, version=version)
    print(f"  whole-tensor sum {version:<4} {a.item():+.6f}  repeat identical: {torch.equal(a, b)}")

# 3. Softmax: the reduction inside every attention layer. Large logits would overflow a naive
#    exp (exp(1000) is inf); subtracting the row maximum keeps every exponent <= 0.
logits = 1000 * torch.randn(4, 4096, device=device)
p = sr.softmax(logits)
torch.testing.assert_close(p, torch.softmax(logits, -1))
print(f"softmax of logits up to {logits.abs().max().item():.0f}: rows sum to "
      f"{p.sum(-1).tolist()} (no inf, no NaN)")
print("a row of all -inf gives", sr.softmax(torch.full((1, 3), float("-inf"), device=device)).tolist(),
      "as torch.softmax does")

# 4. Every softmax rung agrees; version=None picks by row length and dtype.
for n in (128, 4096, 65536):
    row = torch.randn(8, n, device=device, dtype=torch.bfloat16)
    same = all(torch.allclose(sr.softmax(row, version=v).float(), torch.softmax(row.float(), -1),
                              atol=1e-2, rtol=1e-2) for v in sr.VERSIONS["softmax"])
    print(f"  softmax over rows of {n:>6}: v1..v5 all match torch: {same}; version=None runs "
          f"{sr.default_choice('softmax', row)}")

# 5. Gradients: softmax's backward is its own fused kernel, dx = y * (dy - sum(dy * y)).
w = torch.randn(16, 1000, device=device, dtype=torch.float64, requires_grad=True)
assert torch.autograd.gradcheck(lambda t: sr.softmax(t), (w[:2, :20].detach().requires_grad_(),))
loss = (sr.log_softmax(w) * torch.randn_like(w)).sum() + sr.sum(w, 0).pow(2).sum()
loss.backward()
print(f"log_softmax and sum backpropagate; gradcheck passes in float64 (grad norm "
      f"{w.grad.norm().item():.3f})")

# 6. Why the course's sums avoid floating-point atomics: same input, different answers.
big = torch.randn(2**22, device=device)
atomic = {sr.atomic_sum(big).item() for _ in range(20)}
ours = {sr.sum(big).item() for _ in range(20)}
print(f"20 runs of a 2^22-element float32 sum: atomicAdd gave {len(atomic)} distinct value(s), "
      f"the deterministic sum {len(ours)}"
      + ("" if device == "cuda" else " (on the CPU both are ordinary sums)"))
if device != "cuda":
    print("(no GPU: run bench_shared_reduction.py on one, or open notebooks/03_shared_reduction.ipynb "
          "for the recorded numbers)")
