"""Package the chapter as a wheel, install it into a fresh virtualenv, test it there, and show
what is inside it.

    python labs/package_check.py                   wheel, fresh venv, the six tests, inspection
    python labs/package_check.py --arch-list "8.0;9.0+PTX"   the second (distribution) build's archs
    python labs/package_check.py --arch-list ""    no second build
    python labs/package_check.py --keep DIR        keep the wheels, venvs and copies in DIR
    python labs/package_check.py --json FILE       write the findings as JSON
    python labs/package_check.py --show-isolation  also show, offline, what build isolation does

Steps:
1. `pip wheel --no-build-isolation --no-deps .` in the chapter. pip builds a local folder in
   place (pip >= 21.3), so an earlier `pip install .` left build/ and this reuses its objects.
2. The wheel's tags, files and metadata: it is bound to this Python (cpXY), this platform and,
   through libtorch's C++ ABI, to the torch it was compiled against.
3. A fresh virtualenv that sees this interpreter's packages (torch, pip) behind its own
   site-packages; the wheel is installed into it.
4. `import custom_ops` there, from an empty folder, must come from the venv's site-packages.
5. The six standalone tests (a copy of test_custom_ops.py, run outside the repo) in the venv.
6. With CUDA: `cuobjdump --list-elf --list-ptx` on the wheel's library, for the default build
   and for a rebuild with TORCH_CUDA_ARCH_LIST=--arch-list in a copy of the sources; and, with a
   GPU, CUDA_FORCE_PTX_JIT=1 to show which wheel a newer GPU could still run. On CPU these are
   skipped with the reason.
A summary table comes last; the exit status is 1 if any step FAILED.
"""
import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
import zipfile
from datetime import datetime, timezone
from importlib.metadata import version as dist_version
from pathlib import Path

# The interpreter's own search path, taken before torch and setuptools add folders of theirs
# (setuptools puts its _vendor folder on it): what the fresh venv borrows is taken from here.
START_PATH = list(sys.path)

# A side lab of the chapter (labs/): what it packages is the chapter, one folder up.
LABS = Path(__file__).resolve().parent
CHAPTER_DIR = LABS.parent
ROOT = CHAPTER_DIR.parent
sys.path.insert(1, str(ROOT / "common"))
from coursekit.results import git_commit  # noqa: E402  (COURSE_GIT_COMMIT where .git is absent)
PACKAGE = "custom_ops"
# The standalone suite: `python test_custom_ops.py` must end with this line.
EXPECTED_TOTAL = "Total: 6/6 tests passed"
# The course's GPUs (T4, A100, H100: coursekit.build.SUPPORTED_ARCHS) as SASS, plus PTX of the
# newest, which the driver can compile for any later GPU: the list a wheel for others would use.
DEFAULT_ARCH_LIST = "7.5;8.0;9.0+PTX"
# The sections nvcc's host stub puts into a library that carries device code.
CUDA_SECTIONS = {".nv_fatbin", ".nvFatBinSegment", "__nv_relfatbin", "__nv_module_id"}


class Failed(Exception):
    """A check failed; the message says what and why."""


class Skipped(Exception):
    """A step that cannot apply here; the message says why."""


# ----------------------------------------------------------------------------- running things

def run(cmd, cwd, env=None, tail=8, check=True):
    """Run cmd, print it and the last `tail` lines of its output (the last 60 when it fails
    and check is set: a failed compile's error is near the end of pip's log), and return
    (returncode, output)."""
    shown_cmd = " ".join("'<script>'" if "\n" in str(c) else str(c) for c in cmd)
    print(f"$ {shown_cmd}" + (f"    (in {cwd})" if cwd != CHAPTER_DIR else ""), flush=True)
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, encoding="utf-8", errors="replace")
    lines = proc.stdout.splitlines()
    shown = lines[-60:] if (proc.returncode and check) else lines[-tail:] if tail else []
    if shown and len(shown) < len(lines):
        print(f"  ... ({len(lines) - len(shown)} lines above)")
    for line in shown:
        print("  " + line)
    if proc.returncode and check:
        raise Failed(f"{Path(str(cmd[0])).name} {' '.join(map(str, cmd[1:3]))} ... exited "
                     f"{proc.returncode}")
    return proc.returncode, proc.stdout


def clean_env(**extra):
    """The environment for the fresh venv's interpreter: PYTHONPATH goes, because a PYTHONPATH
    that names the repo would let the source tree answer `import custom_ops`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # The tests print check marks; a C locale must not turn them into a UnicodeEncodeError.
    env["PYTHONIOENCODING"] = "utf-8"
    env.update(extra)
    return env


class Steps:
    def __init__(self):
        self.rows = []

    def run(self, name, fn, *args):
        print(f"\n=== {name}", flush=True)
        start = time.perf_counter()
        try:
            status, detail = fn(*args)
        except Skipped as e:
            status, detail = "skipped", str(e)
        except Failed as e:
            status, detail = "FAILED", str(e)
        # A bug in this script must show up as a failed step, not abort the steps after it.
        except Exception as e:
            traceback.print_exc()
            status, detail = "FAILED", f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - start
        print(f"--> {status}: {detail}", flush=True)
        self.rows.append({"step": name, "status": status, "seconds": round(seconds, 1),
                          "detail": detail})
        return status in ("ok", "warn", "info")

    def summary(self):
        width = max(len(r["step"]) for r in self.rows) + 2
        print("\n" + "=" * 78)
        print(f"{'step':<{width}}{'status':<9}{'seconds':>8}  detail")
        for r in self.rows:
            detail = r["detail"] if len(r["detail"]) <= 70 else r["detail"][:67] + "..."
            print(f"{r['step']:<{width}}{r['status']:<9}{r['seconds']:>8.1f}  {detail}")
        failed = [r["step"] for r in self.rows if r["status"] == "FAILED"]
        print(f"{len(self.rows) - len(failed)} of {len(self.rows)} steps did not fail"
              + (f"; FAILED: {', '.join(failed)}" if failed else ""))
        return not failed


# ----------------------------------------------------------------------------- building wheels

def object_times(chapter):
    return {p: p.stat().st_mtime_ns for p in (chapter / "build").glob("temp.*/**/*.o")}


def build_wheel(chapter, dist, env=None):
    """pip wheel in `chapter`; returns (wheel path, the arch list the build announced, output)."""
    dist.mkdir(parents=True, exist_ok=True)
    # -v so that setup.py's own lines reach us: coursekit prints which extension it builds and,
    # for CUDA, the TORCH_CUDA_ARCH_LIST it compiles for.
    _, out = run([sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
                  "--disable-pip-version-check", "-w", dist, "."], cwd=chapter, env=env, tail=4)
    wheels = sorted(dist.glob(f"{PACKAGE}-*.whl"))
    if len(wheels) != 1:
        raise Failed(f"expected one {PACKAGE} wheel in {dist}, found {[w.name for w in wheels]}")
    announced = [ln.strip() for ln in out.splitlines() if f"[{PACKAGE}] building the" in ln]
    if announced:
        print(f"the build said: {announced[-1]}")
    arch = re.search(r"TORCH_CUDA_ARCH_LIST=(\S+)", announced[-1]) if announced else None
    return wheels[0], (arch.group(1) if arch else None), out


def step_build(state, work):
    before = object_times(CHAPTER_DIR)
    wheel, arch_list, _ = build_wheel(CHAPTER_DIR, work / "dist")
    after = object_times(CHAPTER_DIR)
    reused = sum(1 for p, t in after.items() if before.get(p) == t)
    if not before:
        how = ("compiled from scratch: there was no build/ yet (`python -m pip install --no-build-isolation "
               "--no-deps .` first leaves one that this reuses)")
    elif reused == len(after):
        how = f"reused all {reused} objects of the in-tree build/ left by an earlier pip install"
    else:
        how = f"recompiled {len(after) - reused} of {len(after)} objects in the in-tree build/"
    print(how)
    state.update(wheel=wheel, default_arch_list=arch_list, build_reuse=how)
    return "ok", f"{wheel.name}; {how.split(':')[0]}"


def copy_sources(tree):
    """The chapter and common/ copied to `tree` without any build output: a rebuild there with
    other flags leaves the chapter's own build/ (and what `pip install .` reuses) untouched."""
    skip = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".benchmarks",
                                  ".pytest_cache", "*.so", "results", "tests")
    shutil.copytree(CHAPTER_DIR, tree / CHAPTER_DIR.name, ignore=skip)
    shutil.copytree(ROOT / "common", tree / "common", ignore=skip)
    return tree / CHAPTER_DIR.name


# ----------------------------------------------------------------------------- inspecting wheels

def wheel_tags(wheel):
    """name, version, (python, abi, platform) from a wheel's file name (PEP 427)."""
    parts = wheel.name[:-len(".whl")].split("-")
    return parts[0], parts[1], tuple(parts[-3:])


def expected_tags():
    """The tags a wheel with a C extension built here gets: this interpreter's and platform's."""
    interp = f"cp{sys.version_info.major}{sys.version_info.minor}"
    abi = interp + (sysconfig.get_config_var("abiflags") or "")
    return interp, abi, sysconfig.get_platform().replace("-", "_").replace(".", "_")


def elf_sections(data):
    """Section names of a 64-bit little-endian ELF image (enough for x86-64 and aarch64 Linux),
    read directly so that the CPU machine needs no binutils to answer 'any device code?'."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab_offset = headers[shstrndx][4]
    names = []
    for name_offset, *_ in headers:
        start = strtab_offset + name_offset
        names.append(data[start:data.index(b"\0", start)].decode())
    return names


def step_inspect(state, work):
    wheel = state["wheel"]
    name, version, tags = wheel_tags(wheel)
    want = expected_tags()
    print(f"{wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB")
    print(f"tags {'-'.join(tags)}; this interpreter and platform give {'-'.join(want)}")
    problems = []
    if tags != want:
        problems.append(f"tags {'-'.join(tags)} are not this interpreter's {'-'.join(want)}")
    with zipfile.ZipFile(wheel) as z:
        infos = z.infolist()
        dist_info = f"{name}-{version}.dist-info"
        meta = z.read(f"{dist_info}/METADATA").decode()
        wheel_meta = z.read(f"{dist_info}/WHEEL").decode()
        libs = [i for i in infos if re.fullmatch(rf"{PACKAGE}/_C\..*\.(so|pyd)", i.filename)]
        print("files:")
        for i in infos:
            print(f"  {i.file_size:>10}  {i.filename}")
        if len(libs) != 1:
            raise Failed(f"expected one {PACKAGE}/_C library in the wheel, found {len(libs)}")
        lib = work / "inspect" / Path(libs[0].filename).name
        lib.parent.mkdir(parents=True, exist_ok=True)
        lib.write_bytes(z.read(libs[0]))
    for needed in (f"{PACKAGE}/__init__.py", f"{PACKAGE}/_loader.py"):
        if needed not in {i.filename for i in infos}:
            problems.append(f"{needed} is missing (an installed package cannot import without it)")
    if "Root-Is-Purelib: false" not in wheel_meta:
        problems.append("WHEEL does not say Root-Is-Purelib: false, yet the wheel holds a binary")
    requires = [ln.split(":", 1)[1].strip() for ln in meta.splitlines()
                if ln.startswith("Requires-Dist:")]
    sections = elf_sections(lib.read_bytes()) or []
    cuda = sorted(CUDA_SECTIONS.intersection(sections))
    print(f"{lib.name}: {lib.stat().st_size / 1e6:.1f} MB, "
          + (f"device code sections {', '.join(cuda)}" if cuda else "no device code sections: "
             "a CPU-only build"))
    print(f"Requires-Dist: {', '.join(requires) if requires else '(none)'}")
    state.update(lib=lib, tags=tags, requires=requires, cuda_sections=cuda, files=[
        {"name": i.filename, "bytes": i.file_size} for i in infos])
    # Why the tags bind the wheel: the library is compiled against this Python's C API (not
    # the limited abi3 one: pybind11 and libtorch's headers need the full API), for this
    # platform; 'linux_x86_64' rather than 'manylinux_*' says nobody checked which system
    # libraries it assumes (auditwheel), which is also why PyPI would refuse it.
    print("bound to: CPython " + tags[0][2:3] + "." + tags[0][3:] + " (the C API it was compiled "
          "against), " + tags[2] + " (this machine's kind, not audited as manylinux), and torch "
          + state["torch"]["version"] + " (libtorch's C++ ABI, which no tag expresses)")
    if problems:
        raise Failed("; ".join(problems))
    return "ok", f"{'-'.join(tags)}, {len(infos)} files, {wheel.stat().st_size / 1e6:.1f} MB, " + (
        "CUDA" if cuda else "CPU-only")


def step_torch_pin(state, work):
    built = state["torch"]["version"]
    public = built.split("+")[0]
    pins = [r for r in state["requires"] if re.match(r"torch\b", r)]
    print(f"built against torch {built}. The library calls libtorch's C++ functions by their "
          "mangled names and uses its class layouts, which change between torch releases: a "
          f"different torch fails at import with 'undefined symbol', or worse, misbehaves. So the "
          f"wheel should require torch=={public}. (A +local label such as +cu130 is ignored by "
          "a `==X.Y.Z` pin; the CUDA flavour is not expressible in a portable pin.)")
    if not pins:
        return "warn", (f"no Requires-Dist on torch: the wheel installs beside any torch "
                        f"(propose torch=={public} in chapter_setup's install_requires)")
    if any(re.fullmatch(rf"torch\s*==\s*{re.escape(public)}(\+\S+)?", p) for p in pins):
        return "ok", f"pinned: {', '.join(pins)}"
    raise Failed(f"the wheel requires {', '.join(pins)} but was built against torch {built}")


# ----------------------------------------------------------------------------- the fresh venv

def outer_site_dirs(venv_python):
    """This interpreter's package folders that the venv does not already have, minus source
    trees of the repo (labs/, this script's folder, is sys.path[0] when it runs)."""
    _, out = run([venv_python, "-c", "import sys, json; print(json.dumps(sys.path))"],
                 cwd=CHAPTER_DIR, env=clean_env(), tail=0)
    have = {str(Path(p).resolve()) for p in json.loads(out.strip().splitlines()[-1]) if p}
    dirs = []
    for entry in START_PATH:
        p = Path(entry or ".").resolve()
        if not p.is_dir() or str(p) in have or p in (ROOT, LABS) or p.parent == ROOT:
            continue
        if str(p) not in dirs:
            dirs.append(str(p))
    return dirs


def make_venv(path):
    """A new virtualenv whose own site-packages comes first and this interpreter's packages
    after it, so it needs no network: torch (gigabytes, and the point here is the wheel, not
    torch), pytest and pip are borrowed, and only the wheel under test is installed.

    Not `python -m venv --system-site-packages`: when this interpreter is itself a virtualenv
    (CI's .venv), 'system' means the *base* interpreter's site-packages, which lack the torch
    installed in the .venv (import torch fails). And not the venv's own pip: venv installs it
    with ensurepip, which Debian/Ubuntu's python3 lacks without python3-venv, and creating it
    costs seconds. So: --without-pip, plus a .pth file naming this interpreter's package
    folders, which is what scripts/env.sh does for the course's .venv. pip then runs inside the
    venv (borrowed through the .pth) and installs into the venv's prefix."""
    if path.exists():
        shutil.rmtree(path)
    run([sys.executable, "-m", "venv", "--without-pip", path], cwd=CHAPTER_DIR, tail=4)
    python = path / ("Scripts" if os.name == "nt" else "bin") / "python"
    _, out = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                 cwd=CHAPTER_DIR, env=clean_env(), tail=0)
    purelib = Path(out.strip().splitlines()[-1])
    borrowed = outer_site_dirs(python)
    (purelib / "_borrowed_site.pth").write_text("".join(d + "\n" for d in borrowed))
    print(f"venv {path}: its own site-packages first, then borrowed: {', '.join(borrowed)}")
    return python, purelib


def install_wheel(python, wheel):
    # --ignore-installed: the outer environment's own custom_ops (from `pip install .`) is
    # visible through the .pth; without it pip would call the wheel installed already, and
    # --force-reinstall would try to uninstall that outer copy first.
    run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
         "--no-warn-script-location", "--disable-pip-version-check", wheel], cwd=CHAPTER_DIR,
        env=clean_env(), tail=2)


def step_venv(state, work):
    python, purelib = make_venv(work / "venv")
    install_wheel(python, state["wheel"])
    installed = sorted(p.name for p in (purelib / PACKAGE).glob("*") if p.is_file())
    print(f"installed into {purelib / PACKAGE}: {', '.join(installed)}")
    state.update(venv_python=python, venv_purelib=purelib)
    return "ok", "venv --without-pip + .pth to this interpreter's packages; wheel installed"


IMPORT_PROBE = """
import json, custom_ops, torch
print(json.dumps({"custom_ops": custom_ops.__file__, "extension": custom_ops.EXTENSION,
                  "torch": torch.__version__, "torch_file": torch.__file__}))
"""


def step_import(state, work):
    cwd = work / "empty"
    cwd.mkdir(exist_ok=True)
    # COURSE_EXT_ROUTE=installed: a missing library must fail here, not fall back to a JIT build.
    _, out = run([state["venv_python"], "-c", IMPORT_PROBE], cwd=cwd,
                 env=clean_env(COURSE_EXT_ROUTE="installed"), tail=0)
    found = json.loads(out.strip().splitlines()[-1])
    where = Path(found["custom_ops"]).resolve()
    lib = Path(found["extension"].get("so_path", "")).resolve()
    print(f"custom_ops: {where}\nlibrary:    {lib}\ntorch:      {found['torch']} from "
          f"{found['torch_file']}")
    venv = state["venv_purelib"].resolve()
    if venv not in where.parents:
        source = " (the source tree)" if CHAPTER_DIR in where.parents else ""
        raise Failed(f"custom_ops came from {where.parent}{source}, not the venv's {venv}")
    if venv not in lib.parents:
        raise Failed(f"the library came from {lib}, not the venv's {venv}")
    if found["torch"] != state["torch"]["version"]:
        raise Failed(f"the venv sees torch {found['torch']}, the wheel was built against "
                     f"{state['torch']['version']}")
    state["venv_import"] = {"custom_ops": str(where), "library": str(lib)}
    return "ok", f"from {where.parent}"


def step_tests(state, work):
    # test_custom_ops.py imports only the standard library, torch and custom_ops, so a copy of
    # it runs anywhere the package is installed; outside the repo nothing else can answer.
    run_dir = work / "run"
    run_dir.mkdir(exist_ok=True)
    shutil.copy2(CHAPTER_DIR / "test_custom_ops.py", run_dir)
    rc, out = run([state["venv_python"], "test_custom_ops.py"], cwd=run_dir,
                  env=clean_env(COURSE_EXT_ROUTE="installed"), tail=3, check=False)
    imported = next((ln for ln in out.splitlines() if "imported custom_ops" in ln), "")
    total = next((ln.strip() for ln in out.splitlines() if ln.startswith("Total:")), "no total")
    state["tests"] = {"returncode": rc, "total": total}
    if rc != 0 or total != EXPECTED_TOTAL:
        print(out)
        raise Failed(f"exit {rc}, '{total}' (want '{EXPECTED_TOTAL}')")
    if "site-packages" not in imported:
        raise Failed(f"the tests did not report the installed library: {imported.strip()}")
    return "ok", f"{total}, exit 0"


# ----------------------------------------------------------------------------- device code

def find_cuobjdump():
    from torch.utils.cpp_extension import CUDA_HOME
    found = shutil.which("cuobjdump")
    if found is None and CUDA_HOME and (Path(CUDA_HOME) / "bin" / "cuobjdump").exists():
        found = str(Path(CUDA_HOME) / "bin" / "cuobjdump")
    return found


def arch_key(arch):
    digits = re.match(r"\d+", arch).group(0)
    return int(digits), arch


def list_device_code(cuobjdump, lib):
    """(SASS archs, PTX archs) in a library, as 'sm_90' and 'compute_90' names."""
    rc, out = run([cuobjdump, "--list-elf", "--list-ptx", lib], cwd=CHAPTER_DIR, tail=20, check=False)
    if rc != 0 and "does not contain device code" not in out:
        raise Failed(f"cuobjdump exited {rc}")
    # Lines read 'ELF file    1: <name>.sm_90.cubin' and 'PTX file    1: <name>.sm_90.ptx'.
    found = {"ELF": set(), "PTX": set()}
    for kind, member in re.findall(r"^(ELF|PTX) file\s+\d+:\s*(\S+)", out, re.M):
        arch = re.findall(r"(?:sm|compute)_(\d+[a-z]?)", member)
        if arch:
            found[kind].add(arch[-1])
    sass = [f"sm_{a}" for a in sorted(found["ELF"], key=arch_key)]
    ptx = [f"compute_{a}" for a in sorted(found["PTX"], key=arch_key)]
    return sass, ptx


def expected_device_code(arch_list):
    """What torch's cpp_extension compiles for TORCH_CUDA_ARCH_LIST (one -gencode per arch,
    code=sm_XY; '+PTX' adds code=compute_XY), or None for lists this does not parse (names
    such as 'Hopper')."""
    if not arch_list:  # the build did not say which list it used: nothing to hold it to
        return None
    sass, ptx = [], []
    for item in filter(None, re.split(r"[;\s]+", arch_list)):
        m = re.fullmatch(r"(\d+)\.(\d+)([a-z]?)(\+PTX)?", item)
        if not m:
            return None
        arch = m.group(1) + m.group(2) + m.group(3)
        sass.append(f"sm_{arch}")
        if m.group(4):
            ptx.append(f"compute_{arch}")
    return sass, ptx


def check_device_code(state, label, lib, arch_list):
    cuobjdump = state["cuobjdump"]
    sass, ptx = list_device_code(cuobjdump, lib)
    print(f"{label}: SASS {', '.join(sass) or '(none)'}; PTX {', '.join(ptx) or '(none)'}")
    state["archs"][label] = {"TORCH_CUDA_ARCH_LIST": arch_list, "sass": sass, "ptx": ptx}
    want = expected_device_code(arch_list)
    if want is not None and (sorted(want[0], key=lambda a: arch_key(a[3:])) != sass
                             or sorted(want[1], key=lambda a: arch_key(a[8:])) != ptx):
        raise Failed(f"TORCH_CUDA_ARCH_LIST={arch_list} should give SASS {want[0]} and PTX "
                     f"{want[1]}; the library carries SASS {sass} and PTX {ptx}")
    if not ptx:
        note = "no PTX: a GPU newer than the newest SASS here has nothing it can run"
    else:
        note = f"PTX {ptx[-1]} lets the driver compile for GPUs newer than the SASS"
    print(note)
    return "ok", (f"SASS {' '.join(sass) or '-'}; PTX {' '.join(ptx) or '-'} "
                  f"(TORCH_CUDA_ARCH_LIST={arch_list})")


def cuda_unavailable_reason(state):
    torch_info = state["torch"]
    if torch_info["cuda"] is None:
        return f"torch {torch_info['version']} is a CPU-only build"
    if not torch_info["cuda_home"]:
        return "no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)"
    if state["cuobjdump"] is None:
        return "cuobjdump not found (it ships with the CUDA toolkit)"
    return None


def step_device_code_default(state, work):
    if not state["cuda_sections"]:
        reason = cuda_unavailable_reason(state) or "the build chose CPU-only (USE_CUDA=0?)"
        print(f"the wheel is CPU-only: {state['lib'].name} has no .nv_fatbin section, so there "
              f"is no SASS or PTX to list ({reason}); cuobjdump is skipped")
        raise Skipped(f"CPU-only wheel, no device code: {reason}")
    if state["cuobjdump"] is None:
        raise Failed("the wheel carries device code but cuobjdump was not found to list it")
    return check_device_code(state, "default", state["lib"], state["default_arch_list"])


def step_device_code_archs(state, work, arch_list):
    reason = cuda_unavailable_reason(state)
    if reason:
        print(f"no distribution build with TORCH_CUDA_ARCH_LIST={arch_list}: {reason}")
        raise Skipped(reason)
    chapter = copy_sources(work / "src")
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": arch_list, "USE_CUDA": "1"}
    wheel, announced, _ = build_wheel(chapter, work / "dist-archs", env=env)
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if re.fullmatch(rf"{PACKAGE}/_C\..*\.so", n))
        lib = work / "inspect-archs" / Path(member).name
        lib.parent.mkdir(parents=True, exist_ok=True)
        lib.write_bytes(z.read(member))
    state["arch_wheel"] = wheel
    state["arch_wheel_size"] = wheel.stat().st_size
    print(f"{wheel.name} (TORCH_CUDA_ARCH_LIST={arch_list}): {wheel.stat().st_size / 1e6:.1f} MB, "
          f"default wheel {state['wheel'].stat().st_size / 1e6:.1f} MB")
    return check_device_code(state, "arch_list", lib, announced or arch_list)


PTX_PROBE = """
import torch, custom_ops
x = torch.randn(4099)
# Only the chapter's kernel runs on the GPU: copies are not kernels, and torch's own kernels may
# carry no PTX this GPU could take, which CUDA_FORCE_PTX_JIT would then refuse too.
y = custom_ops.custom_relu(x.to("cuda")).cpu()
assert torch.equal(y, torch.relu(x)), "wrong result"
print("custom_relu ran from PTX compiled by the driver")
"""


def step_ptx_jit(state, work):
    """CUDA_FORCE_PTX_JIT=1 makes the driver ignore SASS and compile the PTX: what a GPU newer
    than every SASS in the wheel would have to do. A wheel without usable PTX cannot run then."""
    import torch
    if not state["cuda_sections"] or not torch.cuda.is_available():
        raise Skipped("needs a CUDA wheel and a visible GPU")
    major, minor = torch.cuda.get_device_capability()
    device_arch = major * 10 + minor
    wheels = [("default", state["wheel"], state["venv_python"])]
    if state.get("arch_wheel"):
        python, _ = make_venv(work / "venv-archs")
        install_wheel(python, state["arch_wheel"])
        wheels.append(("arch_list", state["arch_wheel"], python))
    (work / "empty").mkdir(exist_ok=True)
    outcomes, surprises = [], []
    for label, wheel, python in wheels:
        ptx = state["archs"].get(label, {}).get("ptx", [])
        # PTX compiles forward to any newer GPU, never backward; arch-specific 'a' PTX only to
        # its own arch.
        usable = [p for p in ptx if (p.endswith("a") and int(p[8:-1]) == device_arch)
                  or (not p.endswith("a") and int(p[8:]) <= device_arch)]
        rc, out = run([python, "-c", PTX_PROBE], cwd=work / "empty", tail=3, check=False,
                      env=clean_env(CUDA_FORCE_PTX_JIT="1", COURSE_EXT_ROUTE="installed"))
        error = next((ln.strip() for ln in reversed(out.splitlines()) if "Error" in ln), "")
        ran = rc == 0
        outcomes.append(f"{label}: {'ran' if ran else 'failed'}")
        print(f"{label}: PTX {ptx or 'none'} -> predicted {'runs' if usable else 'fails'}, "
              f"{'ran' if ran else 'failed: ' + error}")
        state.setdefault("ptx_jit", {})[label] = {"ptx": ptx, "predicted_runs": bool(usable),
                                                  "ran": ran, "error": None if ran else error}
        if ran != bool(usable):
            surprises.append(label)
    if surprises:
        return "info", f"not as predicted for {', '.join(surprises)}; " + ", ".join(outcomes)
    return "ok", "as predicted: " + ", ".join(outcomes)


# ----------------------------------------------------------------------------- build isolation

def step_isolation(state, work):
    """What `pip install .` without --no-build-isolation does, offline and without building:
    pip first installs the pyproject's build requirements into an empty environment (needs an
    index), and even with them at hand, that environment has no torch."""
    pip_version = dist_version("pip")
    if tuple(int(x) for x in pip_version.split(".")[:2]) < (22, 2):
        raise Skipped(f"pip {pip_version} has no --dry-run (22.2+)")
    # No pip configuration: a find-links or index in it (CI images have them) would change what
    # the isolated environment can fetch.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    nothing = work / "no-wheels"
    nothing.mkdir(exist_ok=True)
    base = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index",
            "--disable-pip-version-check", "-v"]
    _, out = run(base + ["--find-links", nothing, "."], cwd=CHAPTER_DIR, env=env, tail=0, check=False)
    fetch = next((ln.strip() for ln in out.splitlines() if "No matching distribution" in ln), None)
    print(f"1. no index: {fetch or 'no such error (did pip find setuptools somewhere?)'}")
    # Python <= 3.11's ensurepip carries a setuptools wheel: a local source for the build
    # requirement, so the isolated build gets as far as running setup.py.
    try:
        import ensurepip
        bundled = Path(ensurepip.__file__).parent / "_bundled"
    except ImportError:  # Debian/Ubuntu's python3 without python3-venv
        bundled = None
    hidden = None
    if bundled is not None and list(bundled.glob("setuptools-*.whl")):
        _, out = run(base + ["--find-links", bundled, "."], cwd=CHAPTER_DIR, env=env, tail=0, check=False)
        hidden = next((ln.strip() for ln in out.splitlines() if "build isolation hid torch" in ln),
                      None)
        print(f"2. setuptools from {bundled}: "
              f"{hidden or 'setup.py did not report a hidden torch'}")
    else:
        print("2. skipped: this Python's ensurepip bundles no setuptools wheel")
    state["isolation"] = {"no_index": fetch, "with_setuptools": hidden}
    if fetch is None:
        return "info", "could not reproduce the offline failure (see above)"
    return "ok", "offline: " + ("no setuptools for the isolated env; with it, torch is hidden"
                                if hidden else "no setuptools for the isolated env")


# ----------------------------------------------------------------------------- main

def torch_facts():
    import torch
    from torch.utils.cpp_extension import CUDA_HOME
    return {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_home": CUDA_HOME,
            "file": torch.__file__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def findings(state, steps):
    wheel = state.get("wheel")
    return {
        "chapter": CHAPTER_DIR.name, "commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0], "pip": dist_version("pip"),
        "torch": {k: state["torch"][k] for k in ("version", "cuda", "device")},
        "wheel": None if wheel is None else {
            "name": wheel.name, "tags": "-".join(state.get("tags", ())),
            "bytes": wheel.stat().st_size if wheel.exists() else None,
            "built_against_torch": state["torch"]["version"],
            "requires_dist": state.get("requires"), "cuda_sections": state.get("cuda_sections"),
            "build_reuse": state.get("build_reuse"), "files": state.get("files")},
        "arch_wheel_bytes": state.get("arch_wheel_size"),
        "archs": state["archs"], "ptx_jit": state.get("ptx_jit"),
        "venv_import": state.get("venv_import"), "tests": state.get("tests"),
        "isolation": state.get("isolation"), "steps": steps.rows,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch-list", default=DEFAULT_ARCH_LIST,
                        help="TORCH_CUDA_ARCH_LIST of the second, distribution build (CUDA only; "
                             f"default {DEFAULT_ARCH_LIST!r}; '' for none)")
    parser.add_argument("--keep", type=Path, help="work in DIR and keep it (default: a temporary "
                        "folder, removed at the end)")
    parser.add_argument("--json", type=Path, help="write the findings to this JSON file")
    parser.add_argument("--show-isolation", action="store_true",
                        help="also show, offline, what pip's build isolation does to this build")
    args = parser.parse_args()

    if args.keep:
        work = args.keep.resolve()
        work.mkdir(parents=True, exist_ok=True)
        for sub in ("dist", "dist-archs", "src", "venv", "venv-archs", "run", "empty", "inspect",
                    "inspect-archs", "no-wheels"):
            shutil.rmtree(work / sub, ignore_errors=True)
        cleanup = None
    else:
        cleanup = tempfile.TemporaryDirectory(prefix="package_check-")
        work = Path(cleanup.name)

    state = {"torch": torch_facts(), "archs": {}}
    state["cuobjdump"] = find_cuobjdump()
    print(f"python {sys.version.split()[0]} ({sys.executable}), torch {state['torch']['version']}"
          f" (CUDA {state['torch']['cuda']}), work folder {work}")
    steps = Steps()
    try:
        if steps.run("wheel (pip wheel --no-build-isolation)", step_build, state, work):
            steps.run("wheel tags, files, metadata", step_inspect, state, work)
            steps.run("torch pin", step_torch_pin, state, work)
            if steps.run("fresh venv + install wheel", step_venv, state, work):
                if steps.run("import custom_ops from the venv", step_import, state, work):
                    steps.run("test_custom_ops.py in the venv", step_tests, state, work)
            if "lib" in state:
                steps.run("cuobjdump: default wheel", step_device_code_default, state, work)
        if args.arch_list:
            steps.run(f"cuobjdump: TORCH_CUDA_ARCH_LIST={args.arch_list}",
                      step_device_code_archs, state, work, args.arch_list)
        if "venv_python" in state:
            steps.run("CUDA_FORCE_PTX_JIT=1 (forward compatibility)", step_ptx_jit, state, work)
        if args.show_isolation:
            steps.run("build isolation, offline", step_isolation, state, work)
        ok = steps.summary()
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(findings(state, steps), indent=2) + "\n")
            print(f"findings: {args.json}")
    finally:
        if cleanup is not None:
            cleanup.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
