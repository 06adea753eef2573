"""scripts/env.sh: after sourcing it, the commands the READMEs print run in the course's venv,
with the packages (torch above all) of the Python that made it."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pip_pytest_and_python_are_the_venvs_after_sourcing(tmp_path):
    venv = tmp_path / "venv"
    probe = tmp_path / "test_probe.py"
    probe.write_text("import sys\n\nimport torch  # the creating Python's torch, borrowed\n\n\n"
                     f"def test_runs_in_the_course_venv():\n    assert sys.prefix == {str(venv)!r}\n")
    script = (f'source "{ROOT}/scripts/env.sh" && for c in python pip pytest jupyter; do command -v $c; done'
              f' && pip --version && pytest -q -p no:cacheprovider "{probe}"')
    env = {**os.environ, "COURSE_VENV": str(venv), "PYTHON": sys.executable}
    result = subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    lines = out.splitlines()
    assert lines[1:5] == [str(venv / "bin" / c) for c in ("python", "pip", "pytest", "jupyter")], out
    assert any(line.startswith("pip ") for line in lines), out
    assert "1 passed" in out, out
    # Sourced again (a new shell), nothing is rebuilt and the wrappers stay.
    again = subprocess.run(["bash", "-c", f'source "{ROOT}/scripts/env.sh" && command -v pytest'], env=env,
                           capture_output=True, text=True)
    assert again.stdout.strip() == str(venv / "bin" / "pytest") and "creating" not in again.stdout
