"""Shared Python helpers of the course: build (setup.py and JIT), benchmark harness, results
files, plots and reports. Chapters reach it with `sys.path.insert(0, <repo>/common)`."""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMON_INCLUDE = REPO_ROOT / "common" / "include"
