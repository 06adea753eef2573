"""Threads and grids, coalescing, grid-stride loops, 128-bit vectorized access: vector_add, saxpy, relu.

Chapter 1 of the course: elementwise CUDA kernels as PyTorch ops.

Every op takes CPU or CUDA tensors of float32, float16, bfloat16 or float64, of any shape
(inputs of a binary op must match exactly: no broadcasting, no type promotion), contiguous or
not, and is differentiable. `version=` picks a rung of the kernel ladder (see VERSIONS and the
chapter README); None picks the best one. On the CPU there is one C++ implementation and the
version is only validated.
"""
import os
from pathlib import Path

import torch

__all__ = ["vector_add", "saxpy", "relu", "VERSIONS", "BEST_VERSION", "EXTENSION"]

# Each op's ladder in teaching order: "uncoalesced" is the deliberately bad foil, v1..v4 the
# rungs (one thread per element, grid-stride loop, 128-bit vectorized, vectorized + ILP).
# test_cuda_basics.py holds this table against the versions the extension dispatches.
_LADDER = ("uncoalesced", "v1", "v2", "v3", "v4")
VERSIONS = {"vector_add": _LADDER, "saxpy": _LADDER, "relu": _LADDER}
BEST_VERSION = "v4"  # what version=None runs on CUDA (the fastest on the H100, see results/)


def _ops_registered():
    try:
        torch.ops.cuda_basics.versions.default
        return True
    except (AttributeError, RuntimeError):
        return False


def _installed_library():
    """The compiled extension of `pip install .`: next to this file, or, when this source
    tree shadows the installed package (pytest run inside the chapter), in the installed
    distribution."""
    here = Path(__file__).resolve().parent
    found = sorted(here.glob("_C*.so")) + sorted(here.glob("_C*.pyd"))
    if found:
        return found[0]
    from importlib.metadata import distributions
    # Several may match: the build leaves a cuda_basics.egg-info in the source tree too.
    for dist in distributions(name="cuda_basics"):
        for f in dist.files or ():
            if f.name.startswith("_C") and f.suffix in (".so", ".pyd"):
                return Path(dist.locate_file(f))
    return None


def _load_extension():
    """Load the ops library once. COURSE_EXT_ROUTE=installed|jit|auto (default auto: the
    installed build if there is one, else a JIT build of the chapter sources)."""
    if _ops_registered():  # loaded already, e.g. by load_jit.py in this process
        return {"route": "preloaded"}
    route = os.environ.get("COURSE_EXT_ROUTE", "auto")
    if route not in ("auto", "installed", "jit"):
        raise ImportError(f"cuda_basics: COURSE_EXT_ROUTE={route!r}; use installed, jit or auto")
    if route != "jit":
        library = _installed_library()
        if library is not None:
            torch.ops.load_library(str(library))
            return {"route": "installed", "so_path": str(library)}
        if route == "installed":
            raise ImportError("cuda_basics: no installed extension found; run "
                              "`pip install --no-build-isolation .` in chapter1_cuda_basics")
    chapter = Path(__file__).resolve().parents[1]
    if not (chapter / "load_jit.py").exists():
        raise ImportError(f"cuda_basics: no compiled extension and no sources at {chapter} to "
                          "JIT-build from")
    import importlib.util
    spec = importlib.util.spec_from_file_location("cuda_basics_load_jit", chapter / "load_jit.py")
    load_jit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load_jit)
    return {"route": "jit", **load_jit.build()}


EXTENSION = _load_extension()


def vector_add(a, b, *, version=None):
    """a + b for two tensors of the same shape, dtype and device."""
    return torch.ops.cuda_basics.vector_add(a, b, version)


def saxpy(alpha, x, y, *, version=None):
    """alpha * x + y ("single-precision a x plus y", BLAS level 1) for a Python float alpha."""
    return torch.ops.cuda_basics.saxpy(float(alpha), x, y, version)


def relu(x, *, version=None):
    """max(x, 0) elementwise; NaN stays NaN, as in torch.relu."""
    return torch.ops.cuda_basics.relu(x, version)
