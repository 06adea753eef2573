"""Load a chapter's compiled ops library into torch.ops, once per process.

Every chapter package calls load_extension() at import. This file is self-contained (nothing
but the standard library and torch) because setup.py also ships it inside each installed
package as `<package>/_loader.py` (coursekit.build.build_py_with_loader): an installed chapter
must import without the course checkout beside it.

Routes, chosen by COURSE_EXT_ROUTE=installed|jit|auto (default auto):
- installed: the `_C` library that `pip install .` put next to the package, or into the
  installed distribution when a source tree shadows it (pytest run inside the chapter);
- jit: the chapter's load_jit.py builds (or reuses) the same sources with ninja;
- auto: installed if there is one, else jit.
"""
import importlib.util
import numbers
import os
from pathlib import Path

import torch

ROUTES = ("auto", "installed", "jit")


def _ops_registered(namespace):
    try:
        getattr(torch.ops, namespace).versions.default
        return True
    except (AttributeError, RuntimeError):
        return False


def installed_library(package, package_dir):
    """Path of the package's compiled `_C` library, or None."""
    found = sorted(package_dir.glob("_C*.so")) + sorted(package_dir.glob("_C*.pyd"))
    if found:
        return found[0]
    from importlib.metadata import distributions
    # Several may match: the build leaves a <package>.egg-info in the source tree too.
    for dist in distributions(name=package):
        for f in dist.files or ():
            if f.name.startswith("_C") and f.suffix in (".so", ".pyd"):
                return Path(dist.locate_file(f))
    return None


def load_extension(package, namespace, package_file):
    """Load the ops library of `package` (ops in torch.ops.<namespace>) and say how.

    package_file is the package's __init__.py; its chapter folder (one up) holds load_jit.py
    when the package is used from the course checkout. Every op library defines a
    `versions` op, which is how an already-loaded library is recognised."""
    if _ops_registered(namespace):  # loaded already, e.g. by load_jit.py in this process
        return {"route": "preloaded"}
    route = os.environ.get("COURSE_EXT_ROUTE", "auto")
    if route not in ROUTES:
        raise ImportError(f"{package}: COURSE_EXT_ROUTE={route!r}; use installed, jit or auto")
    package_dir = Path(package_file).resolve().parent
    chapter = package_dir.parent
    if route != "jit":
        library = installed_library(package, package_dir)
        if library is not None:
            torch.ops.load_library(str(library))
            return {"route": "installed", "so_path": str(library)}
        if route == "installed":
            raise ImportError(f"{package}: no installed extension found; run "
                              f"`python -m pip install --no-build-isolation .` in the chapter folder")
    if not (chapter / "load_jit.py").exists():
        raise ImportError(f"{package}: no compiled extension and no sources at {chapter} to "
                          "JIT-build from")
    spec = importlib.util.spec_from_file_location(f"{package}_load_jit", chapter / "load_jit.py")
    load_jit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load_jit)
    return {"route": "jit", **load_jit.build()}


# The dtypes every chapter's kernels take.
FLOATING = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_tensor_args(op, **tensors):
    """The C++ glue's dtype and device checks (course/checks.h), for fake implementations
    written in Python (register_fake): tracing must reject what the kernel would, with the same
    words, before anything runs. The first tensor named is the one the others must match."""
    (first_name, first), *rest = tensors.items()
    for name, t in tensors.items():
        if t.dtype not in FLOATING:
            raise RuntimeError(f"{op}: {name} has dtype {t.dtype}, which is not supported "
                               "(supported: float32, float16, bfloat16, float64)")
    for name, t in rest:
        if t.device != first.device:
            raise RuntimeError(f"{op}: {first_name} is on {first.device} but {name} is on {t.device}")
        if t.dtype != first.dtype:
            raise RuntimeError(f"{op}: {first_name} is {first.dtype} but {name} is {t.dtype} "
                               "(no implicit type promotion)")


def describe(value):
    """What an argument is, for an error message: a tensor's dtype, shape and device (never its
    values, which could be millions of numbers), or another object's type."""
    if isinstance(value, torch.Tensor):
        return (f"a tensor of dtype {str(value.dtype).removeprefix('torch.')} and shape "
                f"{list(value.shape)} on {value.device}")
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _fits(value, kind):
    if kind is None:
        return value is None
    if kind in (torch.Tensor, str, bool, torch.dtype):
        return isinstance(value, kind)
    # A number: a Python (or NumPy) one, or torch.compile's symbolic stand-in for one. Never a
    # tensor, not even a one-element tensor that float() would accept: its value lives on the
    # tensor's device, and reading it there is a sync the caller should see themselves (.item()).
    if isinstance(value, torch.Tensor):
        return False
    if kind is int:
        return isinstance(value, (numbers.Integral, torch.SymInt))
    return isinstance(value, (numbers.Real, torch.SymInt, torch.SymFloat))


_KIND_NAMES = {torch.Tensor: "a tensor", float: "a number (float)", int: "an integer", str: "a str",
               bool: "a bool", torch.dtype: "a torch.dtype", None: "None"}


def check_arguments(op, /, **arguments):
    """Raise a TypeError naming the op and the argument where a tensor was passed for a number,
    or anything but a tensor for a tensor. arguments: name=(value, kind) in the op's order, kind
    torch.Tensor, float, int (a number), str, bool or torch.dtype, or a tuple of them with None
    for an optional argument.

    Without this, the same misuse fails three ways, none of them saying which argument was
    wrong: float(tensor) raises "only one element tensors can be converted to Python scalars",
    the dispatcher raises a RuntimeError, and a pybind11 function prints every argument's
    values."""
    for name, (value, kind) in arguments.items():
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not any(_fits(value, k) for k in kinds):
            wanted = " or ".join(_KIND_NAMES[k] for k in kinds)
            raise TypeError(f"{op}: {name} must be {wanted}, got {describe(value)} "
                            f"(the arguments, in order: {', '.join(arguments)})")


# The H100's SM count: what a dispatch that depends on the GPU's size reports for a tensor that
# is not on a GPU, on a machine without one (the glue's course::kReferenceSms, on_cuda.h).
REFERENCE_SMS = 132


def device_sms(x):
    """The SM count version=None decides for on x: x's GPU, else the current GPU, else the
    H100's (REFERENCE_SMS), the GPU the course's results were measured on."""
    if x.is_cuda:
        return torch.cuda.get_device_properties(x.device).multi_processor_count
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return REFERENCE_SMS
