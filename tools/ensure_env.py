"""Install what the course's commands need, and nothing that is already importable.

Run by scripts/env.sh's callers inside .venv. On a GPU machine with torch preinstalled and no
network this must download nothing, so every requirement is first looked for with an import;
only the missing ones go to pip. `COURSE_PIP_ARGS` passes extra pip options (for example
`--no-index --find-links .whl` to install carried wheels offline).
"""
import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys

# import name -> pip requirement. torch is pinned so that a CPU-only machine takes the small
# local CPU wheel instead of the newest several-GB CUDA build; override with COURSE_TORCH_SPEC.
REQUIREMENTS = {
    "main": {"torch": os.environ.get("COURSE_TORCH_SPEC", "torch==2.13.0"),
             "numpy": "numpy", "matplotlib": "matplotlib"},
    "test": {"pytest": "pytest", "nbformat": "nbformat", "nbclient": "nbclient",
             "ipykernel": "ipykernel",
             # chapter 6's test_transformers_integration.py (a tiny random model, nothing downloaded
             # but the library). 5.17 is the oldest release its tests ran against; transformers 5
             # needs Python 3.10, and without it that test file skips.
             **({"transformers": "transformers>=5.17,<6"} if sys.version_info >= (3, 10) else {})},
    # Only on request (`python tools/ensure_env.py notebook`): what opening the notebooks in a
    # browser needs. The test commands execute notebooks headless and do not need it.
    "notebook": {"jupyterlab": "jupyterlab", "ipykernel": "ipykernel", "matplotlib": "matplotlib"},
}


def missing_requirements(groups):
    wanted = {}
    for group in groups:
        wanted.update(REQUIREMENTS[group])
    missing = [spec for module, spec in wanted.items() if importlib.util.find_spec(module) is None]
    # torch's JIT builds shell out to the ninja binary, so the binary is what must exist.
    if shutil.which("ninja") is None:
        missing.append("ninja")
    return missing


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("groups", nargs="+", choices=sorted(REQUIREMENTS))
    args = parser.parse_args()
    missing = missing_requirements(args.groups)
    if not missing:
        print(f"[env] all requirements present ({sys.executable})")
        return 0
    print(f"[env] installing: {' '.join(missing)}")
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *missing,
           *shlex.split(os.environ.get("COURSE_PIP_ARGS", ""))]
    result = subprocess.run(cmd)
    if result.returncode != 0:
        print(f"[env] pip failed ({result.returncode}); offline? carry wheels and set "
              "COURSE_PIP_ARGS='--no-index --find-links DIR'", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
