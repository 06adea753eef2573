"""JIT-build a chapter's extension with torch.utils.cpp_extension.load, the fast way.

Build-speed practices applied here (chapter 5 explains them at length):
- ninja is required: torch's load() refuses to build without it (setup.py's BuildExtension
  instead falls back, silently, to a serial build that starts from scratch every time);
- TORCH_CUDA_ARCH_LIST is pinned to the visible GPU unless the user set it (one arch to
  compile instead of every arch torch was built for; sm_75/80/90 without a GPU);
- MAX_JOBS defaults to the core count;
- a persistent per-chapter build folder (chapterN/build/jit-...), so an unchanged reload only
  asks ninja "anything to do?" and a touched file recompiles alone;
- ccache is used when installed;
- a stale lock file left by a killed build is detected and explained instead of waiting
  forever (torch's FileBaton would spin on it);
- the build time is printed, and a verbose switch (COURSE_VERBOSE_BUILD=1) shows every command.
"""
import os
import shutil
import sys
import time
from pathlib import Path

from . import build

OWNER_FILE = "course_build_owner.pid"


def use_ccache():
    """Route host and device compiles through ccache when it is installed."""
    ccache = shutil.which("ccache")
    if os.environ.get("COURSE_NO_CCACHE") == "1":
        # torch >= 2.10 puts a ccache found on PATH in front of the compilers by itself; this
        # switch turns that off too.
        os.environ.setdefault("TORCH_NO_COMPILER_WRAPPER", "1")
        return False
    if ccache is None:
        return False
    masquerade = Path("/usr/lib/ccache")  # Debian/Ubuntu: c++ -> ccache c++
    if masquerade.is_dir() and str(masquerade) not in os.environ.get("PATH", ""):
        os.environ["PATH"] = f"{masquerade}{os.pathsep}{os.environ.get('PATH', '')}"
    if "PYTORCH_NVCC" not in os.environ:
        from torch.utils.cpp_extension import CUDA_HOME
        if CUDA_HOME:
            os.environ["PYTORCH_NVCC"] = f"{ccache} {Path(CUDA_HOME) / 'bin' / 'nvcc'}"
    return True


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clear_stale_lock(build_dir):
    """torch waits forever on build_dir/lock if a build was killed mid-way. Our builds record
    their pid next to the lock; a lock whose owner is gone is removed with an explanation."""
    lock = build_dir / "lock"
    if not lock.exists():
        return
    owner = build_dir / OWNER_FILE
    pid = int(owner.read_text().strip() or 0) if owner.exists() else 0
    if pid and _pid_alive(pid) and pid != os.getpid():
        print(f"[jit] another build (pid {pid}) holds {lock}; waiting for it", file=sys.stderr)
        return
    age = time.time() - lock.stat().st_mtime
    who = f"pid {pid}, no longer running" if pid else "no recorded owner"
    print(f"[jit] removing stale lock {lock} ({who}, {age:.0f} s old): a build was killed "
          "before it could release it, and torch would otherwise wait on it forever",
          file=sys.stderr)
    lock.unlink()


def build_dir_for(chapter_dir, with_cuda):
    import torch
    tag = f"jit-torch{torch.__version__.replace('+', '-')}-{'cuda' if with_cuda else 'cpu'}"
    return Path(chapter_dir) / "build" / tag


def load_chapter(name, chapter_dir, cpp_sources, cuda_sources, *, source_roots=(), hopper_sources=(),
                 verbose=None, quiet=False):
    """Build (if needed) and load the chapter's extension into this process. source_roots: the
    folders of sources.py's INCLUDE_DIRS (build.include_dirs); hopper_sources: sm_90a files,
    compiled only where the arch list has 9.0 (build.hopper_build).

    Returns a dict: so_path, seconds, rebuilt (did ninja do any work), with_cuda, build_dir.
    The library registers its ops with the dispatcher (TORCH_LIBRARY), so nothing is imported
    as a Python module: the ops appear under torch.ops.<namespace>.
    """
    import torch.utils.cpp_extension as cpp

    if not cpp.is_ninja_available():
        raise RuntimeError("Ninja is required to load C++ extensions: `python -m pip install ninja` (torch "
                           "shells out to the ninja binary; without it every build is serial "
                           "and starts from scratch)")
    if verbose is None:
        verbose = os.environ.get("COURSE_VERBOSE_BUILD", "0") == "1"
    chapter_dir = Path(chapter_dir).resolve()
    with_cuda, reason = build.cuda_decision(name)
    hopper = build.hopper_build(with_cuda, hopper_sources, name)
    arch = build.pin_cuda_arch() if with_cuda else None
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    ccache = use_ccache()
    out_dir = build_dir_for(chapter_dir, with_cuda)
    out_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(out_dir)
    (out_dir / OWNER_FILE).write_text(str(os.getpid()))

    sources = [str(chapter_dir / s) for s in cpp_sources]
    if with_cuda:
        sources += [str(chapter_dir / s) for s in cuda_sources]
    if hopper:
        sources += [str(chapter_dir / s) for s in hopper_sources]
    so_path = out_dir / f"{name}.so"
    before = so_path.stat().st_mtime_ns if so_path.exists() else None
    flags = build.compile_flags(with_cuda, hopper=hopper)
    start = time.perf_counter()
    cpp.load(name=name, sources=sources, extra_cflags=flags["cxx"], extra_cuda_cflags=flags.get("nvcc"),
             extra_include_paths=build.include_dirs(chapter_dir, source_roots),
             build_directory=str(out_dir), with_cuda=with_cuda, is_python_module=False,
             verbose=verbose)
    seconds = time.perf_counter() - start
    rebuilt = before is None or so_path.stat().st_mtime_ns != before
    if not quiet:
        what = "built" if rebuilt else "cached, nothing to rebuild"
        target = f"CUDA arch {arch or 'torch default'}" if with_cuda else f"CPU only ({reason})"
        print(f"[jit] {name}: {what} in {seconds:.2f} s ({target}, MAX_JOBS="
              f"{os.environ['MAX_JOBS']}{', ccache' if ccache else ''}) -> {out_dir}")
    return {"so_path": str(so_path), "seconds": seconds, "rebuilt": rebuilt,
            "with_cuda": with_cuda, "build_dir": str(out_dir)}


def main(doc, name, chapter_dir, build_fn, smoke_check):
    """The command line of every chapter's load_jit.py: --clean, --verbose, --json.

    build_fn(verbose=, quiet=) builds and loads the chapter's extension; smoke_check(device)
    runs one op against PyTorch and returns a line saying so."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clean", action="store_true", help="remove the build folder first")
    parser.add_argument("--verbose", action="store_true", help="show every compiler command")
    parser.add_argument("--json", action="store_true", help="print the build record as JSON")
    args = parser.parse_args()
    import torch
    if args.clean:
        shutil.rmtree(build_dir_for(chapter_dir, build.cuda_decision(name)[0]), ignore_errors=True)
    record = build_fn(verbose=args.verbose or None, quiet=args.json)
    record["smoke_check"] = smoke_check("cuda" if torch.cuda.is_available() else "cpu")
    if args.json:
        print(json.dumps(record))
    else:
        print(f"[jit] smoke check: {record['smoke_check']}")
