#!/usr/bin/env bash
# The GPU verification pass (CONTRIBUTING.md, section 6); needs a CUDA GPU.
# Makes .venv/ on first use (reusing an installed torch) and installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/env.sh
python tools/ensure_env.py main test
exec python tools/course.py gpu-pass "$@"
