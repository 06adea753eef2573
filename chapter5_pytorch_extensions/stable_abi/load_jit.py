"""JIT-build custom_ops_stable's library (the stable-ABI op), without pip.

    python stable_abi/load_jit.py            build (or reuse the cached build), run the op, report
    python stable_abi/load_jit.py --clean    delete the build folder first: a cold build
    python stable_abi/load_jit.py --json     print the build record as JSON

The same sources as setup.py, compiled by torch.utils.cpp_extension.load through the course's
JIT helper (common/coursekit/jit.py: ninja, pinned CUDA arch, a persistent build folder,
ccache). The library only registers ops (torch.ops.custom_ops_stable.*); it is no Python
module. custom_ops_stable/__init__.py uses this route when the package is not installed, or
always with COURSE_EXT_ROUTE=jit.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHAPTER = HERE.parent
sys.path.insert(0, str(CHAPTER.parent / "common"))
from coursekit import jit  # noqa: E402

NAME = "custom_ops_stable_jit"

# The stable glue, and the chapter's kernels it calls: its CPU twin and its CUDA launchers.
CPP_SOURCES = [str(HERE / "stable_ops.cpp"), str(CHAPTER / "custom_kernels_cpu.cpp")]
CUDA_SOURCES = [str(CHAPTER / "custom_kernels.cu")]

# The course's JIT helper keeps its build in <folder>/build/jit-<torch>-<cpu|cuda>. Given this
# folder, that is chapter5_pytorch_extensions/build/stable_abi/build/jit-..., apart from the
# chapter's own JIT build (chapter5_pytorch_extensions/build/jit-...), whose build.ninja it
# would otherwise overwrite, and each build would then redo the other's work.
BUILD_ROOT = CHAPTER / "build" / "stable_abi"


def build(verbose=None, quiet=False):
    """Build (if needed) and load the library; the build record (so_path, build_dir, ...)."""
    return jit.load_chapter(NAME, BUILD_ROOT, CPP_SOURCES, CUDA_SOURCES, verbose=verbose, quiet=quiet)


def smoke_check(device):
    import torch
    sys.path.insert(0, str(HERE))
    import custom_ops_stable  # finds the library this process just loaded
    x = torch.randn(32, 64, device=device)
    bias = torch.randn(64, device=device)
    # One fused multiply-add against eager's multiply then add: a rounding apart at most.
    torch.testing.assert_close(custom_ops_stable.fused_op(x, bias, 2.0), torch.relu(x * 2.0 + bias))
    major, minor = custom_ops_stable.TARGET
    return (f"custom_ops_stable.fused_op on {device} matches torch.relu(x * 2.0 + bias) (built against torch "
            f"{torch.__version__}'s stable ABI, for torch >= {major}.{minor})")


if __name__ == "__main__":
    jit.main(__doc__, NAME, BUILD_ROOT, build, smoke_check)
    if "--json" not in sys.argv[1:]:
        print("JIT compilation successful!")
