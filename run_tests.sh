#!/usr/bin/env bash
# Every test: build every chapter (pip and JIT), run all test suites, execute the notebooks, nvcc-compile every .cu.
# Makes .venv/ on first use (reusing an installed torch) and installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/env.sh
python tools/ensure_env.py main test
exec python tools/course.py test "$@"
