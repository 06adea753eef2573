# Sourced by run_course.sh, run_tests.sh and gpu_pass.sh, and by hand before the READMEs'
# commands: makes .venv/ and puts it first on PATH.
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
  # Its site directories, and those their own .pth files added: a python3 that is itself a venv
  # made this way (the course's .venv of another checkout) passes its parent's packages on too.
  "$COURSE_PYTHON_BASE" -c 'import site, sys
dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and p not in dirs]
print("\n".join(d for d in dirs))' > "$venv_site/_course_parent_site.pth" || return 1
fi

# The packages borrowed through the .pth bring no commands: the `pip` or `pytest` next on PATH
# belongs to another Python (the parent's, or one without torch), and would install into it or
# test with it. These wrappers run each as a module of the venv's python, so that `pip`,
# `pytest` and `jupyter` typed after sourcing this file use the course's environment. A real
# script that pip installs into the venv later (jupyterlab brings `jupyter`) replaces its
# wrapper, and works the same.
for course_command in pip:pip pip3:pip pytest:pytest jupyter:jupyter; do
  if [ ! -e "$COURSE_VENV/bin/${course_command%%:*}" ]; then
    printf '#!/bin/sh\n# scripts/env.sh: %s of the course venv'"'"'s python\nexec "$(dirname "$0")/python" -m %s "$@"\n' \
      "${course_command#*:}" "${course_command#*:}" > "$COURSE_VENV/bin/${course_command%%:*}" &&
      chmod +x "$COURSE_VENV/bin/${course_command%%:*}" || return 1
  fi
done
unset course_command
export PATH="$COURSE_VENV/bin:$PATH"
# A shell that ran the old `pytest` before remembers where it was; forget it.
hash -r 2>/dev/null
export COURSE_ROOT
