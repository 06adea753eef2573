"""JIT-build chapter 3's extension from these sources, without pip.

    python load_jit.py            build (or reuse the cached build), smoke-check, print the time
    python load_jit.py --clean    delete the build folder first: a cold build
    python load_jit.py --json     print the build record as JSON

The tests, the example and the notebook use this route when shared_reduction is not
installed, or always with COURSE_EXT_ROUTE=jit.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "common"))
from coursekit import jit  # noqa: E402

from sources import CPP_SOURCES, CUDA_SOURCES  # noqa: E402

NAME = "shared_reduction_jit"


def build(verbose=None, quiet=False):
    return jit.load_chapter(NAME, HERE, CPP_SOURCES, CUDA_SOURCES, verbose=verbose, quiet=quiet)


def smoke_check(device):
    import torch
    sys.path.insert(0, str(HERE))
    import shared_reduction  # finds the library this process just loaded
    x = torch.randn(33, 1000, device=device)
    # Two float32 sums of 1000 terms of size ~1 in different orders differ by a few ulp of ~30.
    torch.testing.assert_close(shared_reduction.sum(x, -1), x.sum(-1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(shared_reduction.softmax(x), torch.softmax(x, -1))
    return f"sum and softmax on {device}: ok"


if __name__ == "__main__":
    jit.main(__doc__, NAME, HERE, build, smoke_check)
