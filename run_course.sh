#!/usr/bin/env bash
# The course's main job: build every chapter, run its example and benchmark, write results and plots.
# Makes .venv/ on first use (reusing an installed torch) and installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/env.sh
python tools/ensure_env.py main
exec python tools/course.py main "$@"
