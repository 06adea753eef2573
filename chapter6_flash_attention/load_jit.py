"""JIT-build chapter 6's extension from these sources, without pip.

    python load_jit.py            build (or reuse the cached build), smoke-check, print the time
    python load_jit.py --clean    delete the build folder first: a cold build
    python load_jit.py --json     print the build record as JSON

The tests use this route when flash_attention is not installed, or always with
COURSE_EXT_ROUTE=jit.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "common"))
from coursekit import jit  # noqa: E402

from sources import CPP_SOURCES, CUDA_SOURCES, HOPPER_SOURCES, INCLUDE_DIRS  # noqa: E402

NAME = "flash_attention_jit"


def build(verbose=None, quiet=False):
    return jit.load_chapter(NAME, HERE, CPP_SOURCES, CUDA_SOURCES, source_roots=INCLUDE_DIRS,
                            hopper_sources=HOPPER_SOURCES, verbose=verbose, quiet=quiet)


def smoke_check(device):
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(HERE))
    import flash_attention  # finds the library this process just loaded
    q, k, v = (torch.randn(2, 4, 77, 64, device=device) for _ in range(3))
    out = flash_attention.attention(q, k, v, causal=True)
    # seqlen_q == seqlen_k, where SDPA's top-left causal mask and ours (bottom-right) agree.
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    return f"causal attention (2, 4, 77, 64) on {device}: ok"


if __name__ == "__main__":
    jit.main(__doc__, NAME, HERE, build, smoke_check)
