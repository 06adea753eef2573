"""JIT-build chapter 1's extension from these sources, without pip.

    python load_jit.py            build (or reuse the cached build), smoke-check, print the time
    python load_jit.py --clean    delete the build folder first: a cold build
    python load_jit.py --json     print the build record as JSON (used by the benchmark)

The tests, the example and the notebook use this route when cuda_basics is not installed, or
always with COURSE_EXT_ROUTE=jit.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "common"))
from coursekit import jit  # noqa: E402

from sources import CPP_SOURCES, CUDA_SOURCES  # noqa: E402

NAME = "cuda_basics_jit"


def build(verbose=None, quiet=False):
    return jit.load_chapter(NAME, HERE, CPP_SOURCES, CUDA_SOURCES, verbose=verbose, quiet=quiet)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clean", action="store_true", help="remove the build folder first")
    parser.add_argument("--verbose", action="store_true", help="show every compiler command")
    parser.add_argument("--json", action="store_true", help="print the build record as JSON")
    args = parser.parse_args()
    import torch
    if args.clean:
        shutil.rmtree(jit.build_dir_for(HERE, jit.build.cuda_decision(NAME)[0]), ignore_errors=True)
    record = build(verbose=args.verbose or None, quiet=args.json)

    sys.path.insert(0, str(HERE))
    import cuda_basics  # finds the library this process just loaded
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(1000, device=device)
    b = torch.randn(1000, device=device)
    torch.testing.assert_close(cuda_basics.vector_add(a, b), a + b)
    record["smoke_check"] = f"vector_add on {device}: ok"
    if args.json:
        print(json.dumps(record))
    else:
        print(f"[jit] smoke check: {record['smoke_check']}")


if __name__ == "__main__":
    main()
