# Sourced by run_course.sh, run_tests.sh and gpu_pass.sh: makes .venv/ and puts it first on PATH.
#
# The virtualenv reuses whatever the creating python3 already has (torch above all: on a GPU
# machine it is preinstalled and must not be downloaded again). `python -m venv
# --system-site-packages` does not do that when python3 is itself a virtualenv (it links the
# *base* interpreter's site-packages), so we write a .pth file that appends the creating
# interpreter's site directories instead. The venv is made --without-pip and borrows the parent's
# pip through the same .pth, which also works where ensurepip is missing (Debian/Ubuntu).
COURSE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
COURSE_VENV="${COURSE_VENV:-$COURSE_ROOT/.venv}"
COURSE_PYTHON_BASE="${PYTHON:-python3}"

if [ ! -x "$COURSE_VENV/bin/python" ]; then
  echo "[env] creating $COURSE_VENV (reusing the packages of $(command -v "$COURSE_PYTHON_BASE"))"
  "$COURSE_PYTHON_BASE" -m venv --without-pip "$COURSE_VENV" || return 1
  venv_site="$("$COURSE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$COURSE_PYTHON_BASE" -c 'import site, sys
dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
print("\n".join(d for d in dirs))' > "$venv_site/_course_parent_site.pth" || return 1
fi
export PATH="$COURSE_VENV/bin:$PATH"
export COURSE_ROOT
