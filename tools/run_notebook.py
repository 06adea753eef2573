"""Execute a notebook top to bottom with nbclient; fail on the first cell that raises.

    python tools/run_notebook.py notebooks/01_cuda_basics.ipynb            check only
    python tools/run_notebook.py notebooks/01_cuda_basics.ipynb --inplace  also save outputs

Needs nbformat, nbclient and ipykernel, which `python tools/ensure_env.py test` installs where
they are missing (./run_tests.sh does; ./run_course.sh does not).
"""
import argparse
import importlib.util
import sys
import time
from pathlib import Path

try:
    import nbformat
    from nbclient import NotebookClient
    if importlib.util.find_spec("ipykernel") is None:  # the kernel the cells run in
        raise ModuleNotFoundError("No module named 'ipykernel'")
except ModuleNotFoundError as e:
    sys.exit(f"run_notebook.py: {e}. Install what running notebooks needs with "
             "`python tools/ensure_env.py test` (in the repository root, after `source scripts/env.sh`)")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--inplace", action="store_true", help="write the executed notebook back")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per cell")
    args = parser.parse_args()
    nb = nbformat.read(args.notebook, as_version=4)
    start = time.perf_counter()
    # Cells run with the notebook's folder as working directory, as in Jupyter.
    NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(args.notebook.parent.resolve())}}).execute()
    print(f"{args.notebook.name}: {len(nb.cells)} cells ran in {time.perf_counter() - start:.1f} s")
    if args.inplace:
        nbformat.write(nb, args.notebook)
        print(f"saved outputs to {args.notebook}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
