"""JIT-build chapter 5's extension from these sources, without pip.

    python load_jit.py            build (or reuse the cached build), run fused_op_forward, report
    python load_jit.py --clean    delete the build folder first: a cold build
    python load_jit.py --json     print the build record as JSON

The same sources as setup.py, compiled by torch.utils.cpp_extension.load through the course's
JIT helper (common/coursekit/jit.py: ninja, pinned CUDA arch, a persistent build folder, ccache).
The result is one library that is both a Python module (route 1's pybind11 functions, imported
here as `custom_ops_jit`) and a library of dispatcher ops (route 2, torch.ops.custom_ops.*).

The tests, the example and test_custom_ops.py use this route when custom_ops is not
installed, or always with COURSE_EXT_ROUTE=jit.
"""
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "common"))
from coursekit import jit  # noqa: E402

from sources import CPP_SOURCES, CUDA_SOURCES  # noqa: E402

# The module name of the library: torch's JIT build compiles it with TORCH_EXTENSION_NAME set to
# this, so its pybind11 init function is PyInit_custom_ops_jit. custom_ops/__init__.py looks for
# a module of this name.
NAME = "custom_ops_jit"


def import_bindings(so_path):
    """The built library imported as a Python module (its pybind11 functions, route 1).

    The course's JIT helper loads the library with torch.ops.load_library, which runs its op
    registrations but not its Python module init; importing the same file runs that too (the
    library is loaded once: the second dlopen of a path returns the same handle)."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    spec = importlib.util.spec_from_file_location(NAME, so_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[NAME] = module
    return module


def build(verbose=None, quiet=False):
    record = jit.load_chapter(NAME, HERE, CPP_SOURCES, CUDA_SOURCES, verbose=verbose, quiet=quiet)
    import_bindings(record["so_path"])
    return record


def smoke_check(device):
    import torch
    sys.path.insert(0, str(HERE))
    import custom_ops  # finds the library this process just loaded
    x = torch.randn(32, 64, device=device)
    bias = torch.randn(64, device=device)
    expected = torch.relu(x * 2.0 + bias)
    for route, fn in custom_ops.ROUTES.items():
        # One fused multiply-add against eager's multiply then add: a rounding apart at most.
        torch.testing.assert_close(fn(x, bias, 2.0), expected, msg=lambda m: f"route {route}: {m}")
    return f"fused_op_forward on {device} matches torch.relu(x * 2.0 + bias) by every route ({', '.join(custom_ops.ROUTES)})"


if __name__ == "__main__":
    jit.main(__doc__, NAME, HERE, build, smoke_check)
    if "--json" not in sys.argv[1:]:
        print("JIT compilation successful!")
