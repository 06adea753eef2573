"""JIT-build chapter 4's extension from these sources, without pip.

    python load_jit.py            build (or reuse the cached build), smoke-check, print the time
    python load_jit.py --clean    delete the build folder first: a cold build
    python load_jit.py --json     print the build record as JSON

The tests, the example and the notebook use this route when fusion is not
installed, or always with COURSE_EXT_ROUTE=jit.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "common"))
from coursekit import jit  # noqa: E402

from sources import CPP_SOURCES, CUDA_SOURCES  # noqa: E402

NAME = "fusion_jit"


def build(verbose=None, quiet=False):
    return jit.load_chapter(NAME, HERE, CPP_SOURCES, CUDA_SOURCES, verbose=verbose, quiet=quiet)


def smoke_check(device):
    import torch
    sys.path.insert(0, str(HERE))
    import fusion  # finds the library this process just loaded
    x = torch.randn(33, 1000, device=device)
    bias = torch.randn(1000, device=device)
    w = torch.randn(1000, device=device)
    torch.testing.assert_close(fusion.fused_bias_scale_relu(x, bias, 0.5), torch.relu(x * 0.5 + bias))
    torch.testing.assert_close(fusion.rms_norm(x, w), torch.nn.functional.rms_norm(x, (1000,), w, 1e-6))
    return f"fused_bias_scale_relu and rms_norm on {device}: ok"


if __name__ == "__main__":
    jit.main(__doc__, NAME, HERE, build, smoke_check)
