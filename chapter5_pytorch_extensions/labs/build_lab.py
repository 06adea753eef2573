"""Chapter 5 build lab: how long this chapter's extension takes to build, one configuration at a time.

Build-speed advice for extensions often comes with figures like these, for one kernel: 180 s
with no optimization, 35 s with ninja, 12 s with TORCH_CUDA_ARCH_LIST pinned, 8 s with MAX_JOBS,
under 1 s on a ccache hit (the "claims" below).
This lab builds the chapter's real extension (the files of sources.py, with coursekit.build's
include dirs, flags and CUDA decision) under each configuration and records what it took, so
the lesson's table is generated from measurements instead of copied from the claims.

Method. Every build runs in a fresh Python process, so no in-process cache (torch's extension
versioner, an already loaded library) can help it, and into a fresh temporary build folder,
never the chapter's build/. The sources are built from a temporary copy, so touching a file
touches the copy. Each row has two times: `seconds`, the build call alone (load() or setup()),
timed inside the child, and `process_s`, the child's whole life, `import torch` included,
timed by this script. Ninja builds also record how long each file took (from ninja's own log),
which shows what a build waits for. ccache is kept out of every configuration but the two
ccache ones: torch >= 2.10 puts a ccache found on PATH in front of every compiler by itself,
which would turn "cold" builds into cache hits; TORCH_NO_COMPILER_WRAPPER=1 and
CCACHE_DISABLE=1 in the child's environment stop that.

`--list` prints the configurations in the order they run: cheap ones first, so a run cut short
by its time budget (--budget-s) loses only the slowest rows. The slowest of all, the claimed "no
optimization" (setup.py without ninja, every arch, one file after another), is estimated from
the per-file times measured before it and, if it would not fit the budget, built for the pinned
arch instead; its row says so. A configuration that needs CUDA is recorded as skipped, with the
reason, where torch or the toolkit cannot build CUDA; the others then build the CPU-only
extension, so the lab runs end to end on a laptop too.

    python labs/build_lab.py                   every configuration (the default)
    python labs/build_lab.py --list            the configurations, their targets and claims
    python labs/build_lab.py --configs jit_default,jit_reload_unchanged
    python labs/build_lab.py --repeat 3        each configuration 3 times, the median reported
    python labs/build_lab.py --budget-s 1800   more time before expensive rows are capped/skipped
    python labs/build_lab.py --keep            keep the temporary folder (sources, builds, logs)

Writes results/<device-slug>/chapter5_pytorch_extensions_build.json, the bar chart
chapter5_pytorch_extensions_build.png beside it, and prints the table last.
"""
import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# A side lab of the chapter (labs/): the extension it builds is the chapter's, one folder up.
CHAPTER_DIR = Path(__file__).resolve().parents[1]
COMMON = CHAPTER_DIR.parent / "common"
sys.path[:0] = [str(CHAPTER_DIR), str(COMMON)]

CHAPTER = "chapter5_pytorch_extensions_build"
NAME = "custom_ops_jit"  # load_jit.py's module name, so the JIT builds compile what it compiles
TOUCHED_CPP = "kernel_glue.cpp"  # the glue: the .cpp a learner edits when an op changes
TORCH_HEADER_COPY = "custom_kernels_with_torch_h.cu"
MARKER = "BUILD_LAB_RESULT "
CU_OBJECT = "custom_kernels.cuda.o"  # torch's name for the .cu's object in a ninja build
# The default set must finish well inside 8 minutes on the 16-core H100 host: no configuration
# starts after the budget, and the longest one that can still start is the capped serial build.
DEFAULT_BUDGET_S = 360
DEFAULT_TIMEOUT_S = 240


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    route: str                  # "jit" (load), "setuptools" (setup.py build_ext) or "nvcc"
    what: str
    cuda_only: bool = False
    arch: str = "pinned"        # "pinned" (the visible GPU), "all" (every arch torch was built
    #                             for) or None: chosen at run time for both (Lab.setuptools_arch)
    max_jobs: object = "cores"  # "cores" or a number
    folder: str = "fresh"       # "fresh" or "persistent" (kept between configurations)
    touch: str = None           # a source whose mtime is bumped before the build
    ccache: str = None          # "cold" or "hot"
    nvcc_threads: bool = False
    use_ninja: bool = True
    hide_ninja: bool = False
    torch_header: bool = False
    target_s: float = None      # this chapter's target
    claim_s: float = None       # the claimed number for this configuration
    claim: str = None           # the claim's words
    claim_cuda: bool = False    # the claim is about the CUDA build (an arch choice is part of it)


CONFIGS = [
    Config("jit_no_ninja", "jit", "load() with ninja hidden from PATH (the claim: it falls back "
           "to setuptools)", hide_ninja=True),
    Config("jit_default", "jit", "the course's JIT route (load_jit.py) from cold: ninja, pinned "
           "arch, MAX_JOBS = cores, a persistent folder", folder="persistent", target_s=30,
           claim_s=8, claim="+ MAX_JOBS (ninja, one arch, all cores): 8 s", claim_cuda=True),
    Config("jit_reload_unchanged", "jit", "jit_default's folder again, nothing changed, a fresh "
           "process", folder="persistent", target_s=1, claim_s=1,
           claim="second compilation (cached): < 1 s"),
    Config("jit_touched_cu", "jit", "custom_kernels.cu touched, then reloaded into jit_default's "
           "folder", cuda_only=True, folder="persistent", touch="custom_kernels.cu", target_s=10),
    Config("jit_touched_cpp", "jit", f"{TOUCHED_CPP} (ATen headers) touched, then reloaded into "
           "jit_default's folder", folder="persistent", touch=TOUCHED_CPP),
    Config("nvcc_cu_torch_free", "nvcc", "nvcc -c custom_kernels.cu alone, with torch's flags and "
           "the pinned arch", cuda_only=True),
    Config("jit_ccache_cold", "jit", "ccache with an empty cache (coursekit.jit.use_ccache), fresh "
           "folder", ccache="cold"),
    Config("jit_ccache_hot", "jit", "ccache with the cache jit_ccache_cold filled, fresh folder",
           ccache="hot", claim_s=1, claim="+ ccache (cache hit): < 1 s"),
    Config("jit_all_arches_threads", "jit", "every arch torch was built for, nvcc --threads = cores",
           cuda_only=True, arch="all", nvcc_threads=True),
    Config("jit_all_arches", "jit", "every arch torch was built for (what a distributable build "
           "compiles)", cuda_only=True, arch="all", claim_s=35,
           claim="+ Ninja (ninja, every arch): 35 s"),
    Config("nvcc_cu_with_torch_h", "nvcc", "the same nvcc compile with #include "
           "<torch/extension.h> prepended", cuda_only=True, torch_header=True),
    Config("jit_max_jobs_1", "jit", "ninja, pinned arch, MAX_JOBS = 1", max_jobs=1),
    Config("setuptools_ninja", "setuptools", "setup.py build_ext with ninja, MAX_JOBS = cores",
           arch=None),
    Config("setuptools_no_ninja", "setuptools", "setup.py build_ext without ninja: one file after "
           "another (with every arch: the claimed 'no optimization')", arch=None, use_ninja=False,
           claim_s=180,
           claim="Baseline (no optimization): 180 s", claim_cuda=True),
]
BY_NAME = {c.name: c for c in CONFIGS}

# (name, baseline, faster, the claimed speedup (low, high) or None, the claim's words)
COMPARISONS = [
    ("ninja", "setuptools_no_ninja", "setuptools_ninja", (5, 10), "Ninja: 5-10x faster builds"),
    ("arch pinned", "jit_all_arches", "jit_default", (2, 3), "TORCH_CUDA_ARCH_LIST: 2-3x faster"),
    ("MAX_JOBS", "jit_max_jobs_1", "jit_default", (1.5, 2), "MAX_JOBS: 1.5-2x faster"),
    ("nvcc --threads", "jit_all_arches", "jit_all_arches_threads", (1.2, 1.5),
     "--threads: 1.2-1.5x faster for large kernels"),
    ("torch-free .cu", "nvcc_cu_with_torch_h", "nvcc_cu_torch_free", None,
     "course convention: no torch headers in kernel files"),
    ("ccache hit", "jit_ccache_cold", "jit_ccache_hot", (2, 3), "ccache: 2-3x faster on cache hits"),
    ("persistent folder", "jit_default", "jit_reload_unchanged", None,
     "persistent build cache: instant builds for unchanged kernels"),
    ("touched .cu", "jit_default", "jit_touched_cu", None, None),
    ("touched .cpp", "jit_default", "jit_touched_cpp", None, None),
]


class Skip(Exception):
    """A configuration that cannot run here: status ("skipped" or "unavailable") and reason."""

    def __init__(self, status, reason):
        super().__init__(reason)
        self.status = status
        self.reason = reason


# ---------------------------------------------------------------------------------------------
# The child: one build in a fresh process
# ---------------------------------------------------------------------------------------------
def child(spec):
    """Build once as the spec says and print MARKER + {"seconds": the build call}."""
    from coursekit import build
    from sources import CPP_SOURCES, CUDA_SOURCES

    src = Path(spec["src"])
    with_cuda = spec["cuda"]
    if spec.get("ccache"):
        from coursekit import jit
        jit.use_ccache()
    if spec["route"] == "setuptools":
        from setuptools import setup
        from torch.utils.cpp_extension import BuildExtension
        os.chdir(src)  # make_extension lists the sources relative to the chapter, as setup.py does
        ext = build.make_extension("custom_ops._C", src, CPP_SOURCES, CUDA_SOURCES, "custom_ops")
        command = BuildExtension.with_options(use_ninja=spec["use_ninja"])
        start = time.perf_counter()
        setup(name="custom_ops", ext_modules=[ext], cmdclass={"build_ext": command},
              script_args=["build_ext", "--build-temp", spec["build_temp"],
                           "--build-lib", spec["build_lib"]])
        seconds = time.perf_counter() - start
        if not list(Path(spec["build_lib"]).rglob("*.so")):
            raise RuntimeError("setup() returned without building a library")
    else:
        import torch
        import torch.utils.cpp_extension as cpp
        flags = build.compile_flags(with_cuda)
        names = CPP_SOURCES + (CUDA_SOURCES if with_cuda else [])
        # The arguments coursekit.jit.load_chapter passes (what load_jit.py runs), with the
        # configuration's nvcc flags added.
        start = time.perf_counter()
        cpp.load(name=NAME, sources=[str(src / n) for n in names], extra_cflags=flags["cxx"],
                 extra_cuda_cflags=flags["nvcc"] + spec["extra_nvcc"] if with_cuda else None,
                 extra_include_paths=build.include_dirs(src), build_directory=spec["build_dir"],
                 with_cuda=with_cuda, is_python_module=False, verbose=False)
        seconds = time.perf_counter() - start
        if not hasattr(torch.ops.custom_ops, "fused_op"):  # built, but would not work
            raise RuntimeError("the library loaded without registering custom_ops::fused_op")
    print(MARKER + json.dumps({"seconds": seconds}), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# The parent: what each configuration needs, and the rows
# ---------------------------------------------------------------------------------------------
def arch_list_from_torch(names):
    """torch.cuda.get_arch_list() (['sm_80', 'sm_90', ..., 'compute_120']) in the form of
    TORCH_CUDA_ARCH_LIST ('8.0;9.0;...;12.0+PTX'); a compute_XY entry (PTX kept for GPUs newer
    than the list) becomes +PTX."""
    ptx = {}
    for name in names:
        m = re.fullmatch(r"(sm|compute)_(\d+)([a-z]?)", name)
        if m:  # sm_90a -> 9.0a, sm_100 -> 10.0
            kind, digits, suffix = m.groups()
            arch = f"{digits[:-1]}.{digits[-1]}{suffix}"
            ptx[arch] = ptx.get(arch, False) or kind == "compute"
    ordered = sorted(ptx, key=lambda a: [int(n) for n in re.findall(r"\d+", a)] + [a])
    return ";".join(a + ("+PTX" if ptx[a] else "") for a in ordered)


def accepted_by_torch(arch_list):
    """(the entries torch's cpp_extension accepts, the ones it rejects): torch's list of valid
    arches is not the list it was built for, and one rejected entry fails every build."""
    try:
        from torch.utils.cpp_extension import _get_cuda_arch_flags
    except ImportError:
        return arch_list, []
    kept, dropped = [], []
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    try:
        for arch in arch_list.split(";"):
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch
            try:
                _get_cuda_arch_flags()
                kept.append(arch)
            except ValueError:
                dropped.append(arch)
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved
    return ";".join(kept), dropped


def cuda_arch_lists():
    """The two arch lists the lab compares: {"pinned", "all", notes}.

    "pinned" is what coursekit.build.pin_cuda_arch chooses (the visible GPUs' archs, so one on
    the H100: 9.0). "all" is every arch this torch was built for, as a distributable wheel
    compiles. Torch's own default is neither: with TORCH_CUDA_ARCH_LIST unset and a GPU
    visible, cpp_extension already compiles for the visible GPU only (plus its PTX), so "all
    arches by default" in the claims is what a build machine without a GPU, or a build that
    sets the full list on purpose, pays; the slow case is measured with the full list, set
    explicitly."""
    import torch

    from coursekit import build
    notes = []
    if torch.cuda.is_available():
        pinned = ";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i)
                                  for i in range(torch.cuda.device_count())}))
        names = torch.cuda.get_arch_list()
    else:
        pinned = build.SUPPORTED_ARCHS
        notes.append(f"no GPU visible: 'pinned' is the course's supported list {pinned}")
        # get_arch_list() answers [] without a GPU; the list torch was built for is still known.
        names = torch._C._cuda_getArchFlags().split() if hasattr(torch._C, "_cuda_getArchFlags") else []
    every, dropped = accepted_by_torch(arch_list_from_torch(names)) if names else ("", [])
    if dropped:
        notes.append(f"torch's cpp_extension rejects {dropped} of its own arch list; left out")
    return {"pinned": pinned, "all": every or pinned, "torch_arch_list": names, "notes": notes}


def first_line(cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
        return lines[0].strip() if lines else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def tool_versions():
    import setuptools
    import torch.utils.cpp_extension as cpp
    nvcc = Path(cpp.CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc"
    nvcc_release = None
    if nvcc.exists():
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout
        nvcc_release = next((ln for ln in out.splitlines() if "release" in ln), out.strip() or None)
    ccache = shutil.which("ccache")
    import sysconfig
    # setup.py builds compile with Python's own CFLAGS as well (often -g), the JIT does not.
    return {"python": sys.version.split()[0], "python_cflags": sysconfig.get_config_var("CFLAGS"),
            "setuptools": setuptools.__version__,
            "ninja": first_line(["ninja", "--version"]), "nvcc": nvcc_release,
            "cxx": first_line([os.environ.get("CXX", "c++"), "--version"]),
            "ccache": first_line([ccache, "--version"]) if ccache else None}


def host_info():
    from coursekit.bench import host_cpu
    info = {"cpu": host_cpu(), "cores": os.cpu_count()}
    if hasattr(os, "sched_getaffinity"):
        info["usable_cores"] = len(os.sched_getaffinity(0))
    try:
        info["memory_GiB"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return info


def ninja_log_lines(folder):
    lines = set()
    for log in Path(folder).rglob(".ninja_log"):
        lines.update(ln for ln in log.read_text().splitlines() if ln and not ln.startswith("#"))
    return lines


def ninja_steps(folder, before):
    """Seconds per output of the edges ninja ran since `before` was read (ninja appends one log
    line per finished edge, with its start and end in ms): which file the build waited for."""
    steps = {}
    for line in ninja_log_lines(folder) - before:
        fields = line.split("\t")
        if len(fields) >= 4 and fields[0].isdigit() and fields[1].isdigit():
            steps[Path(fields[3]).name] = round((int(fields[1]) - int(fields[0])) / 1000, 3)
    return dict(sorted(steps.items(), key=lambda kv: -kv[1]))


def is_masquerade(folder):
    """A folder of compiler names linked to ccache (Debian's /usr/lib/ccache)."""
    for name in ("c++", "g++", "gcc", "cc", "nvcc"):
        path = Path(folder) / name
        if path.is_symlink() and Path(os.path.realpath(path)).name == "ccache":
            return True
    return False


def proc_stat(pid):
    """(parent pid, start time) of a running process, or None."""
    try:
        # The command name sits in parentheses and may hold spaces: split after it.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid):
    """{pid: start time} of the processes started by pid, directly or not; the start time
    tells a process from a later one that reuses its pid."""
    children = {}
    for entry in Path("/proc").glob("[0-9]*"):
        stat = proc_stat(entry.name)
        if stat:
            children.setdefault(stat[0], []).append((int(entry.name), stat[1]))
    found, todo = {}, [pid]
    while todo:
        for child_pid, started in children.get(todo.pop(), []):
            found[child_pid] = started
            todo.append(child_pid)
    return found


def end_tree(proc):
    """Stop a child and every compiler under it. Ninja starts each command in a process group
    of its own, so killing the child's group would leave the compilers running (and timing the
    next configuration); SIGTERM first lets ninja stop them itself, then whatever is left of
    the tree, collected beforehand, is killed by pid."""
    tree = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
    for pid, started in tree.items():
        stat = proc_stat(pid)
        if stat and stat[1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def tail(text, lines=15):
    return "\n".join(text.strip().splitlines()[-lines:])


class Lab:
    """What the configurations share: the copy of the sources, jit_default's persistent folder,
    the ccache folder, the arch lists, the clock and budget, and what was measured so far (the
    serial build's estimate reads it)."""

    def __init__(self, root, selected, budget_s, timeout_s, repeat, keep):
        from coursekit import build

        self.root = root
        self.selected = selected
        self.budget_s = budget_s
        self.timeout_s = timeout_s
        self.repeat = repeat
        self.keep = keep
        self.cores = os.cpu_count() or 1
        self.started = time.perf_counter()
        self.with_cuda, self.cuda_reason = build.cuda_decision("build_lab")
        self.arches = cuda_arch_lists() if self.with_cuda else None
        self.src = root / "src"
        self.src.mkdir(parents=True)
        from sources import CPP_SOURCES, CUDA_SOURCES
        for name in CPP_SOURCES + CUDA_SOURCES + [p.name for p in CHAPTER_DIR.glob("*.h")] + \
                [p.name for p in CHAPTER_DIR.glob("*.cuh")]:
            shutil.copy2(CHAPTER_DIR / name, self.src / name)
        (root / "logs").mkdir()
        self.persistent_dir = None
        self.persistent_error = None
        self.ccache_dir = None
        self.setuptools_plan = None
        self.measured = {}  # name -> the last good outcome, for later estimates
        self.done = set()
        self.folders = 0

    def elapsed(self):
        return time.perf_counter() - self.started

    def fresh_dir(self, name):
        self.folders += 1
        path = self.root / f"{self.folders:02d}-{name}"
        path.mkdir()
        return path

    def child_env(self, arch=None, max_jobs=None, ccache_dir=None, hide_ninja=False):
        env = dict(os.environ)
        for key in ("PYTORCH_NVCC", "TORCH_CUDA_ARCH_LIST", "MAX_JOBS", "CCACHE_DIR",
                    "CCACHE_DISABLE", "TORCH_NO_COMPILER_WRAPPER", "COURSE_NO_CCACHE", "DEBUG"):
            env.pop(key, None)
        # A masquerade directory (/usr/lib/ccache) on PATH would cache every compile.
        path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not is_masquerade(p)]
        if ccache_dir:
            env["CCACHE_DIR"] = str(ccache_dir)
        else:
            env.update(CCACHE_DISABLE="1", TORCH_NO_COMPILER_WRAPPER="1", COURSE_NO_CCACHE="1")
        if hide_ninja:
            path = [p for p in path if not (Path(p) / "ninja").exists()]
        env["PATH"] = os.pathsep.join(path)
        if arch:
            env["TORCH_CUDA_ARCH_LIST"] = arch
        if max_jobs:
            env["MAX_JOBS"] = str(max_jobs)
        return env

    def launch(self, cmd, env, cwd, label, shell=False):
        """Run one child in its own process group (so a timeout also ends the compilers it
        started); returns (wall seconds, return code or "timeout", stdout, stderr)."""
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, shell=shell, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=self.timeout_s)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            end_tree(proc)
            out, err = proc.communicate()
            rc = "timeout"
        except BaseException:
            end_tree(proc)
            proc.wait()
            raise
        wall = time.perf_counter() - start
        (self.root / "logs" / f"{label}.log").write_text(
            f"$ {cmd if shell else ' '.join(map(str, cmd))}\n--- stdout\n{out}\n--- stderr\n{err}")
        return wall, rc, out, err

    def run_child(self, spec, env, cwd, label):
        wall, rc, out, err = self.launch([sys.executable, str(Path(__file__).resolve()), "--child",
                                          json.dumps(spec)], env, cwd, label)
        found = [ln for ln in out.splitlines() if ln.startswith(MARKER)]
        if rc == 0 and found:
            return {"status": "ok", "process_s": wall, **json.loads(found[-1][len(MARKER):])}
        return self.failure(rc, wall, out, err)

    def failure(self, rc, wall, out, err):
        if rc == "timeout":
            detail = f"timeout: still building after {self.timeout_s:.0f} s (--timeout-s)"
        else:
            # The last line (the exception, the compiler's verdict) first: tables show only it.
            last = tail(err, 1) or tail(out, 1)
            detail = f"exit {rc}: {last}\n" + (tail(err) or tail(out))
        return {"status": "failed", "process_s": wall, "seconds": None, "detail": detail,
                "stderr": err, "stdout": out}

    # -- what some configurations need first ------------------------------------------------
    def ensure_persistent(self):
        """jit_default's folder: reloads and touches rebuild in it, the nvcc rows take torch's
        exact nvcc command from its build.ninja. Built (unrecorded) when jit_default was not
        selected."""
        if self.persistent_dir is not None:
            return self.persistent_dir
        if self.persistent_error is None:
            print("[build_lab] preparing jit_default's persistent folder (a cold build, not recorded)",
                  flush=True)
            outcome = self.run_jit(BY_NAME["jit_default"], "prep-jit_default")
            if outcome["status"] != "ok":
                self.persistent_error = outcome.get("detail", "failed")
        if self.persistent_dir is None:
            raise Skip("skipped", "jit_default's folder could not be built: "
                                  + (self.persistent_error or "unknown").splitlines()[0])
        return self.persistent_dir

    def ccache_binary(self):
        ccache = shutil.which("ccache")
        if ccache is None:
            raise Skip("unavailable", "ccache is not installed on this machine (not on PATH); "
                       "install it (apt-get install ccache, or conda install ccache) and rerun "
                       "with --configs jit_ccache_cold,jit_ccache_hot")
        return ccache

    def ccache_stats(self, ccache):
        """ccache's nonzero counters for this configuration (zeroed before it): hits, misses and
        why a compile could not be cached (an option ccache does not support, say)."""
        env = {**os.environ, "CCACHE_DIR": str(self.ccache_dir)}
        out = subprocess.run([ccache, "--print-stats"], capture_output=True, text=True, env=env)
        if out.returncode == 0:
            stats = {}
            for ln in out.stdout.splitlines():
                key, _, value = ln.partition("\t")
                if value.strip().isdigit() and int(value) and "timestamp" not in key:
                    stats[key] = int(value)
            return stats
        text = subprocess.run([ccache, "-s"], capture_output=True, text=True, env=env).stdout
        return {"summary": [ln.strip() for ln in text.splitlines() if ln.strip()]}

    def nvcc_command(self):
        """The exact command torch's build.ninja runs for custom_kernels.cu (ninja -t commands),
        and the source path in it."""
        folder = self.ensure_persistent()
        ninja_file = (folder / "build.ninja").read_text()
        m = re.search(r"^build (\S+): cuda_compile (\S+)", ninja_file, re.M)
        if m is None:
            raise RuntimeError(f"no cuda_compile edge in {folder / 'build.ninja'}")
        out = subprocess.run(["ninja", "-C", str(folder), "-t", "commands", m.group(1)],
                             capture_output=True, text=True, check=True).stdout
        return out.strip().splitlines()[-1], m.group(2)

    def estimate(self, use_ninja, arch_key):
        """Predicted child seconds of a setuptools build from this run's measurements, or None.
        A serial build takes the sum of its files (per-file times from MAX_JOBS=1, else from
        jit_default; the .cu's from the build with the same arch list) plus the link."""
        startup = [o["process_s"] - o["seconds"] for o in self.measured.values() if o.get("seconds")]
        startup = statistics.median(startup) if startup else 5.0
        same_arch = "jit_all_arches" if arch_key == "all" else "jit_default"
        if use_ninja:
            known = self.measured.get(same_arch if self.with_cuda else "jit_default")
            return known["process_s"] if known else None
        base = (self.measured.get("jit_max_jobs_1") or self.measured.get("jit_default") or {}).get("steps")
        if not base:
            return None
        total = sum(s for out, s in base.items() if not out.endswith(".cuda.o"))
        if self.with_cuda:
            cu = [s for out, s in (self.measured.get(same_arch) or {}).get("steps", {}).items()
                  if out.endswith(".cuda.o")]
            if not cu:
                return None
            total += cu[0]
        return total + startup

    def setuptools_arch(self):
        """The arch list of the setuptools pair, chosen once so both build the same thing: every
        arch (the claimed 'no optimization') unless the estimate says the pair would overrun the
        time budget or the serial build the per-child timeout; then the pinned arch, and the
        rows say so (the serial row is then a lower bound of the claimed baseline)."""
        if self.setuptools_plan is None:
            pending = [c for c in self.selected if c.route == "setuptools" and c.name not in self.done]
            guesses = [self.estimate(c.use_ninja, "all") for c in pending]
            serial = self.estimate(False, "all")
            remaining = self.budget_s - self.elapsed()
            if None in guesses:
                self.setuptools_plan = ("all", False, "every arch (no estimate from this run to "
                                        "check it against the budget)")
            elif sum(guesses) <= remaining and (serial is None or serial <= 0.9 * self.timeout_s):
                self.setuptools_plan = ("all", False, f"every arch (estimated {sum(guesses):.0f} s "
                                        f"for the pair, {remaining:.0f} s of budget left)")
            else:
                serial_note = f" (the serial build {serial:.0f} s)" if serial else ""
                self.setuptools_plan = ("pinned", True, f"capped to the pinned arch: with every "
                                        f"arch the pair was estimated at {sum(guesses):.0f} s"
                                        f"{serial_note} against {remaining:.0f} s of budget left "
                                        f"and a {self.timeout_s:.0f} s timeout per build; the "
                                        "serial row is then a lower bound of the claimed "
                                        "'no optimization'")
        return self.setuptools_plan

    # -- the three routes ---------------------------------------------------------------------
    def run_jit(self, cfg, label):
        with_cuda = self.with_cuda
        arch = self.arches[cfg.arch] if with_cuda else None
        max_jobs = self.cores if cfg.max_jobs == "cores" else cfg.max_jobs
        ccache = None
        if cfg.ccache:
            ccache = self.ccache_binary()
            if cfg.ccache == "cold":
                self.ccache_dir = self.fresh_dir("ccache")
            elif self.ccache_dir is None:
                print("[build_lab] filling the ccache first (a jit_ccache_cold build, not "
                      "recorded)", flush=True)
                self.run_jit(BY_NAME["jit_ccache_cold"], f"prep-{label}")
                if self.ccache_dir is None:
                    raise Skip("skipped", "the ccache could not be filled")
            subprocess.run([ccache, "-z"], env={**os.environ, "CCACHE_DIR": str(self.ccache_dir)},
                           capture_output=True)
        if cfg.name == "jit_default":
            folder = self.fresh_dir("persistent")
        elif cfg.folder == "persistent":
            folder = self.ensure_persistent()
        else:
            folder = self.fresh_dir(cfg.name)
        if cfg.touch:
            os.utime(self.src / cfg.touch)  # mtime now: ninja sees it newer than its object
        spec = {"route": "jit", "src": str(self.src), "build_dir": str(folder), "cuda": with_cuda,
                "extra_nvcc": ["--threads", str(self.cores)] if cfg.nvcc_threads else [],
                "ccache": bool(cfg.ccache)}
        env = self.child_env(arch, max_jobs, self.ccache_dir if cfg.ccache else None, cfg.hide_ninja)
        before = ninja_log_lines(folder)
        outcome = self.run_child(spec, env, self.root, label)
        # The child has exited or been killed: a lock it left would make the next build in
        # this folder wait on it until its own timeout.
        (folder / "lock").unlink(missing_ok=True)
        outcome.update(arch_list=arch, max_jobs=max_jobs, steps=ninja_steps(folder, before),
                       build_folder="persistent" if cfg.folder == "persistent" else "fresh")
        if ccache:
            outcome["ccache_stats"] = self.ccache_stats(ccache)
        refusal = [ln for ln in outcome.get("stderr", "").splitlines() if "Ninja is required" in ln]
        if cfg.hide_ninja and outcome["status"] == "failed" and refusal:
            outcome.update(status="unavailable", reason="torch.utils.cpp_extension.load refuses "
                           f"to build without ninja (no setuptools fallback): {refusal[-1].strip()}")
            outcome.pop("detail")
        if cfg.name == "jit_default":
            if outcome["status"] == "ok":
                self.persistent_dir = folder
            elif self.persistent_dir is None:
                self.persistent_error = outcome.get("detail")
        elif cfg.folder == "fresh" and not self.keep:
            shutil.rmtree(folder, ignore_errors=True)
        if cfg.ccache == "cold" and outcome["status"] != "ok":
            self.ccache_dir = None
        return outcome

    def run_setuptools(self, cfg, label):
        arch, capped, note = self.setuptools_arch() if self.with_cuda else (None, False, None)
        folder = self.fresh_dir(cfg.name)
        spec = {"route": "setuptools", "src": str(self.src), "cuda": self.with_cuda,
                "use_ninja": cfg.use_ninja, "build_temp": str(folder / "temp"),
                "build_lib": str(folder / "lib")}
        env = self.child_env(self.arches[arch] if arch else None, self.cores)
        # The child's make_extension decides CUDA again; the lab has decided already.
        env["USE_CUDA"] = "1" if self.with_cuda else "0"
        before = ninja_log_lines(folder)
        outcome = self.run_child(spec, env, self.src, label)
        outcome.update(arch_list=self.arches[arch] if arch else None,
                       max_jobs=self.cores if cfg.use_ninja else 1, build_folder="fresh",
                       steps=ninja_steps(folder, before) if cfg.use_ninja else {})
        if note:
            outcome["arch_choice"] = note
        if capped:
            outcome["capped"] = True
        if not self.keep:
            shutil.rmtree(folder, ignore_errors=True)
        return outcome

    def run_nvcc(self, cfg, label):
        command, source = self.nvcc_command()
        if cfg.torch_header:
            copy = Path(source).with_name(TORCH_HEADER_COPY)  # beside it: its quoted includes resolve
            copy.write_text("#include <torch/extension.h>\n" + Path(source).read_text())
            command = command.replace(source, str(copy))
        folder = self.fresh_dir(cfg.name)
        wall, rc, out, err = self.launch(command, self.child_env(), folder, label, shell=True)
        if not self.keep:
            shutil.rmtree(folder, ignore_errors=True)
        outcome = ({"status": "ok", "seconds": wall, "process_s": wall} if rc == 0
                   else self.failure(rc, wall, out, err))
        outcome.update(arch_list=self.arches["pinned"], max_jobs=None, build_folder="fresh",
                       flags_from="torch's build.ninja for jit_default (ninja -t commands)")
        return outcome

    # -- one configuration, one row -----------------------------------------------------------
    def measure(self, cfg):
        row = {"op": "build", "variant": cfg.name, "seconds": None, "process_s": None,
               "status": None, "route": cfg.route, "cuda": self.with_cuda, "arch_list": None,
               "max_jobs": None, "cores": self.cores,
               "target_s": cfg.target_s, "claim_s": cfg.claim_s, "claim": cfg.claim,
               "what": cfg.what}
        try:
            if cfg.cuda_only and not self.with_cuda:
                raise Skip("skipped", f"needs a CUDA build: {self.cuda_reason}")
            if self.elapsed() > self.budget_s:
                raise Skip("skipped", f"the lab's time budget ({self.budget_s:.0f} s, --budget-s) "
                           f"was spent before this configuration; run it alone with --configs {cfg.name}")
            runner = {"jit": self.run_jit, "setuptools": self.run_setuptools, "nvcc": self.run_nvcc}[cfg.route]
            outcomes = []
            for rep in range(self.repeat):
                outcome = runner(cfg, f"{cfg.name}-{rep}")
                outcomes.append(outcome)
                if outcome["status"] != "ok":
                    break
            row.update(self.summarize(cfg, outcomes))
        except Skip as skip:
            row.update(status=skip.status, reason=skip.reason)
        except Exception as e:  # noqa: BLE001  (one broken configuration must not end the lab)
            row.update(status="failed", detail=f"{type(e).__name__}: {e}")
        if row.get("capped") or (cfg.claim_cuda and not self.with_cuda):
            row["claim_s"] = None  # not the configuration the claim timed
        self.done.add(cfg.name)
        self.report(row)
        return row

    def summarize(self, cfg, outcomes):
        last = outcomes[-1]
        keep = {k: v for k, v in last.items() if k not in ("stdout", "stderr", "seconds", "process_s")}
        if last["status"] != "ok":
            return {**keep, "seconds": None, "process_s": round(last["process_s"], 3)}
        self.measured[cfg.name] = last
        seconds = [o["seconds"] for o in outcomes]
        process = [o["process_s"] for o in outcomes]
        return {**keep, "seconds": round(statistics.median(seconds), 3),
                "process_s": round(statistics.median(process), 3),
                "samples": [round(s, 3) for s in seconds],
                "process_samples": [round(s, 3) for s in process], "repeat": len(outcomes)}

    def report(self, row):
        if row["status"] == "ok":
            rebuilt = ", ".join(f"{k} {v:.1f}" for k, v in list(row.get("steps", {}).items())[:3])
            print(f"[build_lab] {row['variant']:<24} {row['seconds']:8.2f} s build call, "
                  f"{row['process_s']:7.2f} s process" + (f"  (slowest steps: {rebuilt})" if rebuilt else "")
                  + (f"\n            {row['arch_choice']}" if row.get("arch_choice") else ""),
                  flush=True)
        else:
            why = row.get("reason") or row.get("detail", "")
            print(f"[build_lab] {row['variant']:<24} {row['status']}: {why}", flush=True)


def comparisons(rows):
    by = {r["variant"]: r for r in rows}
    found = []
    for name, slow, fast, claimed, words in COMPARISONS:
        a, b = by.get(slow), by.get(fast)
        if a and b and a["status"] == b["status"] == "ok" and b["seconds"]:
            found.append({"name": name, "baseline": slow, "optimized": fast,
                          "measured_speedup": round(a["seconds"] / b["seconds"], 2),
                          "claim_speedup": list(claimed) if claimed else None, "claim": words,
                          "baseline_capped": bool(a.get("capped"))})
            # Arch choices and --threads act on the .cu alone; in a parallel build the .cpp
            # files that include torch may hide that, so the .cu's own time is compared too.
            cu_a = a.get("steps", {}).get(CU_OBJECT)
            cu_b = b.get("steps", {}).get(CU_OBJECT)
            if cu_a and cu_b and name in ("arch pinned", "nvcc --threads"):
                found[-1]["cu_step_speedup"] = round(cu_a / cu_b, 2)
    return found


# ---------------------------------------------------------------------------------------------
# The figure and the table, drawn from the results file
# ---------------------------------------------------------------------------------------------
ROUTE_COLORS = {"jit": "tab:blue", "setuptools": "tab:orange", "nvcc": "tab:green"}


def plot_build_times(ax, record):
    """Seconds of the build call per configuration, in run order, with the child process's
    whole time (import torch included) as a pale bar behind it, the chapter's target as a red
    bar end and the claim as a black diamond. Log scale: an unchanged reload and a
    serial build are three orders of magnitude apart."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = record["benchmarks"]
    measured = [v for r in rows for v in (r.get("seconds"), r.get("process_s"), r.get("target_s"),
                                          r.get("claim_s")) if v]
    floor = min([0.01] + [v / 2 for v in measured])
    for i, r in enumerate(rows):
        if r["status"] == "ok":
            ax.barh(i, max(r["process_s"], floor) - floor, left=floor, height=0.8,
                    color="lightgrey", zorder=1)
            ax.barh(i, max(r["seconds"], floor) - floor, left=floor, height=0.5,
                    color=ROUTE_COLORS.get(r["route"], "grey"), zorder=2)
            ax.annotate(f" {r['seconds']:.2f} s", (max(r["process_s"], r["seconds"]), i),
                        va="center", fontsize=7)
        else:
            why = (r.get("reason") or r.get("detail") or "").splitlines()[0][:70]
            ax.annotate(f" {r['status']}: {why}", (floor, i), va="center", fontsize=7,
                        color="dimgrey")
        if r.get("target_s"):
            ax.plot(r["target_s"], i, marker="|", markersize=16, mew=2.5, color="tab:red", zorder=3)
        if r.get("claim_s"):
            ax.plot(r["claim_s"], i, marker="D", markersize=5, color="black", zorder=3)
    ax.set_yticks(range(len(rows)), [r["variant"] for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # run order top to bottom, the first row not on the frame
    ax.set_xscale("log")
    ax.set_xlim(floor, max(measured + [1]) * 3)
    ax.set_xlabel("seconds (log scale)")
    ax.grid(axis="x", alpha=0.3)
    host = record.get("host", {})
    ax.set_title(f"Chapter 5 extension build times: {host.get('cpu', '?')}, {host.get('cores', '?')} "
                 f"cores\n{record['device']['name']}, torch {record['torch']}, {record['date'][:10]}",
                 fontsize=9)
    handles = [Patch(color=c, label=f"build call ({route})") for route, c in ROUTE_COLORS.items()
               if any(r["route"] == route and r["status"] == "ok" for r in rows)]
    handles += [Patch(color="lightgrey", label="child process (import torch included)"),
                Line2D([], [], marker="|", ms=12, mew=2.5, ls="", color="tab:red", label="target"),
                Line2D([], [], marker="D", ms=5, ls="", color="black", label="claim")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))


def make_figures(record, out_dir):
    import matplotlib.pyplot as plt

    from coursekit import plots
    fig, ax = plt.subplots(figsize=(13, 1.8 + 0.42 * len(record["benchmarks"])))
    plot_build_times(ax, record)
    return [plots.save(fig, out_dir / f"{CHAPTER}.png")]


def print_table(record):
    from coursekit import results

    def fmt(v, spec="8.2f"):
        return format(v, spec) if isinstance(v, (int, float)) else f"{'-':>{spec.split('.')[0]}}"

    host = record.get("host", {})
    found = record.get("comparisons", [])
    if found:
        print(f"\n{'comparison':<20}{'baseline -> optimized':<50}{'measured':>9}{'claimed':>10}")
        for c in found:
            claimed = "-" if not c["claim_speedup"] else "-".join(f"{x:g}" for x in c["claim_speedup"]) + "x"
            print(f"{c['name']:<20}{c['baseline'] + ' -> ' + c['optimized']:<50}"
                  f"{c['measured_speedup']:>8.2f}x{claimed:>10}"
                  + (f"  (.cu alone {c['cu_step_speedup']:.2f}x)" if c.get("cu_step_speedup") else "")
                  + ("  (baseline capped)" if c["baseline_capped"] else ""))
    print(f"\n{CHAPTER} on {host.get('cpu', '?')} ({host.get('cores', '?')} cores), "
          f"{results.label(record)}; seconds of the build call (process incl. import torch)")
    print(f"{'config':<24}{'seconds':>9}{'process':>9}{'target':>8}{'claim':>8}  status")
    for r in record["benchmarks"]:
        missed = r["status"] == "ok" and r.get("target_s") and r["seconds"] > r["target_s"]
        status = r["status"] + (" MISSED TARGET" if missed else "") + (" (capped)" if r.get("capped") else "")
        why = r.get("reason") or (r.get("detail") if r["status"] != "ok" else "")
        print(f"{r['variant']:<24}{fmt(r['seconds'], '9.2f')}{fmt(r['process_s'], '9.2f')}"
              f"{fmt(r.get('target_s'), '8.0f')}{fmt(r.get('claim_s'), '8.0f')}  {status}"
              + (f": {why.splitlines()[0][:90]}" if why else ""))


# ---------------------------------------------------------------------------------------------
def print_configs():
    print(f"{'config':<24}{'route':<12}{'needs':<7}{'target':>8}{'claim':>7}  what")
    for c in CONFIGS:
        print(f"{c.name:<24}{c.route:<12}{'CUDA' if c.cuda_only else '-':<7}"
              f"{c.target_s if c.target_s else '-':>8}{c.claim_s if c.claim_s else '-':>7}  {c.what}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the configurations and exit")
    parser.add_argument("--configs", help="comma-separated configuration names (default: all); "
                        "they run in --list's order whatever the order given")
    parser.add_argument("--repeat", type=int, default=1, help="builds per configuration (median)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"time for the whole lab (default {DEFAULT_BUDGET_S} s x --repeat): "
                        "the serial setuptools build is capped to the pinned arch when it would "
                        "not fit, and configurations starting after it is spent are skipped")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                        help="per build (one child process); a build still running is recorded "
                        "as failed (timeout)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if args.list:
        print_configs()
        return 0
    names = [n.strip() for n in (args.configs or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; --list shows them")
    selected = [c for c in CONFIGS if not names or c.name in names]
    budget = args.budget_s or DEFAULT_BUDGET_S * args.repeat
    here_bin = Path(sys.executable).parent
    if shutil.which("ninja") is None and (here_bin / "ninja").exists():
        # torch looks for the ninja binary on PATH only; pip's ninja sits beside this python.
        os.environ["PATH"] = f"{here_bin}{os.pathsep}{os.environ.get('PATH', '')}"
        print(f"[build_lab] ninja found beside {sys.executable}, not on PATH: added {here_bin}")

    # Children import this file too: they should not pay for matplotlib, nor the parent's setup.
    import matplotlib
    matplotlib.use("Agg")
    import torch
    from coursekit import results

    root = Path(tempfile.mkdtemp(prefix="chapter5_build_lab_"))
    try:
        lab = Lab(root, selected, budget, args.timeout_s, args.repeat, args.keep)
        kind = (f"CUDA + CPU extension, pinned arch {lab.arches['pinned']}, every arch "
                f"{lab.arches['all']}" if lab.with_cuda else f"CPU-only extension ({lab.cuda_reason})")
        print(f"[build_lab] {len(selected)} configurations, {kind}; {lab.cores} cores, budget "
              f"{budget:.0f} s, timeout {args.timeout_s:.0f} s per build; work folder {root}",
              flush=True)
        rows = []
        for cfg in selected:
            rows.append(lab.measure(cfg))
        total = lab.elapsed()
    finally:
        if args.keep:
            print(f"[build_lab] kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    extra = {"host": host_info(), "tools": tool_versions(), "cuda_build": lab.with_cuda,
             "cuda_reason": lab.cuda_reason, "arch_lists": lab.arches, "budget_s": budget,
             "timeout_s": args.timeout_s, "repeat": args.repeat, "total_s": round(total, 1),
             "configs": [c.name for c in selected], "comparisons": comparisons(rows),
             "method": "each build in a fresh python process (sys.executable) into a fresh "
                       "temporary folder from a temporary copy of the sources; seconds = the "
                       "build call timed inside the child, process_s = the child's wall time; "
                       "ccache disabled (CCACHE_DISABLE=1, TORCH_NO_COMPILER_WRAPPER=1) except "
                       "in the ccache rows; steps = per-output seconds from ninja's log",
             "torch_cuda": torch.version.cuda}
    print(f"[build_lab] {len(rows)} configurations in {total:.0f} s")
    late = [r["variant"] for r in rows if "time budget" in (r.get("reason") or "")]
    if late:
        print(f"[build_lab] out of budget: {', '.join(late)}; run them with a larger --budget-s")
    results.publish(CHAPTER, rows, {}, extra, make_figures, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
