"""What both build routes (setup.py and the JIT helper) share: whether to build CUDA, and the
compiler flags. One home, so `pip install .` and `python load_jit.py` build the same thing."""
import os
import site
import sys
import sysconfig
from pathlib import Path

from . import COMMON_INCLUDE


def import_torch(package):
    """Import torch for a build, explaining pip's build isolation when it hides torch.

    `pip install .` builds in an isolated environment that has setuptools but not the torch of
    the environment pip runs in. An extension must be compiled against the very torch it will
    load into, so we add that environment's site-packages back (with a note) rather than let
    pip fetch a second, different torch. `pip install --no-build-isolation .` skips all this.
    """
    try:
        import torch
        return torch
    except ModuleNotFoundError:
        pass
    for key in ("purelib", "platlib"):
        site.addsitedir(sysconfig.get_paths()[key])
    try:
        import torch
    except ModuleNotFoundError:
        sys.exit(f"[{package}] No module named 'torch': install torch into this environment first "
                 "(the README's prerequisites; in the course's checkout, `source scripts/env.sh` and "
                 "`python tools/ensure_env.py main` in the repository root make the course's environment, "
                 "with torch), then `python -m pip install --no-build-isolation .`")
    print(f"[{package}] pip's build isolation hid torch; building against the environment's "
          f"torch {torch.__version__} at {torch.__file__}. Use `python -m pip install --no-build-isolation .` "
          "to skip the isolated environment.", file=sys.stderr)
    return torch


def cuda_decision(package):
    """(build_cuda, reason). USE_CUDA=1 demands CUDA and fails loudly; USE_CUDA=0 forces CPU;
    unset builds CUDA when torch has CUDA and a toolkit (nvcc) is found. No GPU is needed to
    build, only to run."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    wanted = os.environ.get("USE_CUDA", "").strip()
    if wanted == "0":
        return False, "USE_CUDA=0 forces the CPU-only build"
    problems = []
    if torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is a CPU-only build")
    if CUDA_HOME is None:
        problems.append("no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)")
    if problems:
        if wanted == "1":
            raise RuntimeError(f"[{package}] USE_CUDA=1 but a CUDA build is impossible: "
                               + "; ".join(problems))
        return False, "; ".join(problems)
    return True, f"torch {torch.__version__} (CUDA {torch.version.cuda}), toolkit at {CUDA_HOME}"


# What the course supports (T4, A100, H100): the arch list when no GPU is there to ask.
SUPPORTED_ARCHS = "7.5;8.0;9.0"


def pin_cuda_arch():
    """Set TORCH_CUDA_ARCH_LIST unless the user chose one: the visible GPUs' archs (one arch to
    compile instead of many), or SUPPORTED_ARCHS when building on a machine without a GPU."""
    import torch
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    if torch.cuda.is_available():
        archs = sorted({"%d.%d" % torch.cuda.get_device_capability(i)
                        for i in range(torch.cuda.device_count())})
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
    else:
        os.environ["TORCH_CUDA_ARCH_LIST"] = SUPPORTED_ARCHS
    return os.environ["TORCH_CUDA_ARCH_LIST"]


def hopper_arch_list(arch_list):
    """(arch list with Hopper's 9.0 written 9.0a, whether it names Hopper at all).

    wgmma and setmaxnreg exist only in the sm_90a target ("a": architecture-specific, not
    forward-compatible), and code built for it runs only on compute capability 9.0, which is all
    a 9.0 entry ever ran on: so a chapter with Hopper kernels builds every file for 9.0a in place
    of 9.0, and other GPUs lose nothing."""
    archs, hopper = [], False
    for arch in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        if not arch:
            continue
        base, ptx = (arch[:-4], "+PTX") if arch.endswith("+PTX") else (arch, "")
        if base in ("9.0", "9.0a"):
            base, hopper = "9.0a", True
        archs.append(base + ptx)
    return ";".join(archs), hopper


def hopper_build(with_cuda, hopper_sources, package):
    """Whether this build compiles the chapter's Hopper sources (sm_90a kernels): only a CUDA
    build whose arch list has 9.0, which it then rewrites to 9.0a (hopper_arch_list). Other builds
    leave the files out; the glue then refuses the Hopper rungs by name (COURSE_HOPPER unset)."""
    if not (with_cuda and hopper_sources):
        return False
    archs, hopper = hopper_arch_list(pin_cuda_arch())
    if hopper:
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    else:
        print(f"[{package}] TORCH_CUDA_ARCH_LIST={archs} has no 9.0: the Hopper kernels are left out",
              file=sys.stderr)
    return hopper


def compile_flags(with_cuda, debug=None, hopper=False):
    """extra_compile_args for both routes. DEBUG=1: -O0 -g, and -G for device code (without
    it ptxas still optimizes the kernels and cuda-gdb shows their locals as optimized out)."""
    if debug is None:
        debug = os.environ.get("DEBUG", "0") == "1"
    # -g0: setuptools puts Python's own CFLAGS first, and they carry -g; the last -g flag wins.
    # Debug info of torch's headers makes a binding file's object ~14 MB and its compile half as
    # long again; a learner who wants it builds with DEBUG=1.
    cxx = ["-O0", "-g"] if debug else ["-O3", "-g0"]
    # COURSE_HOPPER: the Hopper kernels are compiled in (hopper_build), for the glue to know.
    defines = (["-DWITH_CUDA"] if with_cuda else []) + (["-DCOURSE_HOPPER"] if hopper else [])
    flags = {"cxx": cxx + defines}
    if with_cuda:
        # -lineinfo maps SASS back to source lines for ncu and compute-sanitizer at no runtime
        # cost, so release builds keep it too. No --use_fast_math: it would change results.
        # -G carries its own line table (nvcc warns when -lineinfo is given beside it).
        flags["nvcc"] = (["-O0", "-g", "-G"] if debug else ["-O3", "-lineinfo"]) + defines
    return flags


def include_dirs(chapter_dir, source_roots=()):
    """The include path of a chapter's build: the course's shared headers, the chapter folder, and
    the folders the chapter's sources.py names in INCLUDE_DIRS (chapter 6: csrc/, so that every
    file includes "attention/attention.h" the same way, and no include climbs out of its folder).
    The nvcc sweep of tools/course.py compiles each .cu with this same path."""
    return [str(COMMON_INCLUDE), str(chapter_dir)] + [str(Path(chapter_dir) / d) for d in source_roots]


def make_extension(name, chapter_dir, cpp_sources, cuda_sources, package, source_roots=(), hopper_sources=()):
    """A CUDAExtension when CUDA is usable, else a CppExtension (with the reason printed).
    hopper_sources: compiled only where the arch list has 9.0 (hopper_build)."""
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    with_cuda, reason = cuda_decision(package)
    kind = "CUDA + CPU" if with_cuda else "CPU-only"
    hopper = hopper_build(with_cuda, hopper_sources, package)
    if with_cuda:
        reason += f"; TORCH_CUDA_ARCH_LIST={pin_cuda_arch()}"
    print(f"[{package}] building the {kind} extension: {reason}", file=sys.stderr)
    cls = CUDAExtension if with_cuda else CppExtension
    sources = list(cpp_sources) + (list(cuda_sources) if with_cuda else []) + (list(hopper_sources) if hopper else [])
    return cls(name, sources=sources, include_dirs=include_dirs(chapter_dir, source_roots),
               extra_compile_args=compile_flags(with_cuda, hopper=hopper))


def build_py_with_loader(package):
    """A build_py command that also ships coursekit/loader.py as `<package>/_loader.py`.

    The loader has one home (common/coursekit/loader.py); an installed chapter package needs
    it without the course checkout on sys.path, so the build copies it in rather than every
    chapter keeping its own copy."""
    from pathlib import Path

    from setuptools.command.build_py import build_py

    source = Path(__file__).resolve().parent / "loader.py"

    class BuildPyWithLoader(build_py):
        def run(self):
            super().run()
            target = Path(self.build_lib) / package / "_loader.py"
            target.parent.mkdir(parents=True, exist_ok=True)
            self.copy_file(str(source), str(target))

    return BuildPyWithLoader


def chapter_setup(package, description, chapter_dir, cpp_sources, cuda_sources, source_roots=(), hopper_sources=()):
    """The whole of every chapter's setup.py: the package, its `_C` extension (CUDA or
    CPU-only, see make_extension) and the shared loader shipped inside it. source_roots: the
    folders of sources.py's INCLUDE_DIRS (see include_dirs)."""
    torch = import_torch(package)
    from setuptools import find_packages, setup
    from torch.utils.cpp_extension import BuildExtension

    setup(
        name=package,
        version="0.1.0",
        description=description,
        # The package and its subpackages (chapter 6's flash_attention.integrations).
        packages=find_packages(where=str(chapter_dir), include=[package, f"{package}.*"]),
        ext_modules=[make_extension(f"{package}._C", chapter_dir, cpp_sources, cuda_sources,
                                    package, source_roots, hopper_sources)],
        cmdclass={"build_ext": BuildExtension, "build_py": build_py_with_loader(package)},
        # _C links against this torch's C++ ABI (mangled names, class layouts), which changes
        # between releases: the wheel works only beside the torch it was compiled against. The
        # public version (2.11.0, not 2.11.0+cu130) matches every build of that release.
        install_requires=[f"torch=={torch.__version__.split('+')[0]}"],
        python_requires=">=3.9",
    )
