"""Chapter 5, debugging a kernel: compute-sanitizer, cuda-gdb, device-side asserts and DSA,
on a kernel with an off-by-one (off_by_one.cu; README.md next to this file is the walkthrough).

    python labs/debugging/debug_lab.py build         build the three variants (or, without a CUDA
                                                     build of torch, nvcc-compile the kernels)
    python labs/debugging/debug_lab.py run --broken  the broken kernel against PyTorch: it "passes"
    python labs/debugging/debug_lab.py run --fixed   the fixed one; --n N to try other sizes
    python labs/debugging/debug_lab.py sanitize      compute-sanitizer memcheck on both kernels
    python labs/debugging/debug_lab.py gdb           cuda-gdb stops inside the broken kernel
    python labs/debugging/debug_lab.py dsa           a device assert firing, its cost, and what
                                                     TORCH_USE_CUDA_DSA does in the installed torch
    python labs/debugging/debug_lab.py all --out FILE    sanitize, gdb and dsa into one transcript

Nothing here is part of the chapter's build or package: it builds only when run, into
chapter5_pytorch_extensions/build/debugging/, three times over the same two sources:
  release  the chapter's release flags (-O3 -lineinfo); assert() is live, as in any build
           without -DNDEBUG, and -lineinfo gives the sanitizer its source lines
  ndebug   the same with -DNDEBUG: every assert() compiled out
  debug    the DEBUG=1 flags with -G: unoptimized device code whose variables cuda-gdb can print
Without a CUDA GPU every subcommand says so and exits 0.
"""
import argparse
import datetime
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHAPTER = HERE.parents[1]  # labs/debugging/ -> the chapter
ROOT = CHAPTER.parent
sys.path.insert(0, str(ROOT / "common"))

import torch  # noqa: E402

from coursekit import bench  # noqa: E402
from coursekit import build as course_build  # noqa: E402
from coursekit import jit  # noqa: E402

KERNEL_FILE = HERE / "off_by_one.cu"
SOURCES = [HERE / "debug_lab_ops.cpp", KERNEL_FILE]
BUILD_ROOT = CHAPTER / "build" / "debugging"
LOG_DIR = BUILD_ROOT / "logs"
BUILDS = ("release", "ndebug", "debug")
KERNELS = ("broken", "fixed", "asserted_broken", "asserted")
ARCHS = ("75", "80", "90")  # what the course supports: T4, A100, H100

BLOCK = 256  # kThreads in off_by_one.cu
# Not a multiple of BLOCK, so the last block has spare threads and the bug has a thread to run on.
N_SMALL = 1000
# 256 MiB read and 256 MiB written per call: far beyond the H100's 50 MB L2, so the timing is of
# DRAM traffic, as for any large elementwise op.
N_TIMED = 2**26
SCALE, BIAS = 1.5, 0.25
# relu never produces a negative number, so any store into the canary's slot changes it.
CANARY = -1.0

CHILD_TIMEOUT_S = 240


# ---------------------------------------------------------------------------------------
# Reporting: everything printed is kept for the transcript of `all`.
# ---------------------------------------------------------------------------------------
def scrub(text):
    """This checkout's paths as <repo>, so a transcript reads the same from any machine."""
    home = str(Path.home())
    text = text.replace(str(ROOT), "<repo>")
    return text.replace(home, "~") if len(home) > 1 else text


class Report:
    def __init__(self):
        self.lines = []
        self.rows = []

    def say(self, text=""):
        for line in str(text).splitlines() or [""]:
            print(line, flush=True)
            self.lines.append(scrub(line))

    def block(self, text, indent="    "):
        self.say("\n".join(indent + line for line in str(text).rstrip().splitlines()) or indent + "(nothing)")

    def section(self, title):
        self.say()
        self.say(title)
        self.say("=" * len(title))

    def row(self, step, result):
        self.rows.append((step, scrub(result)))

    def summary(self):
        if not self.rows:
            return
        width = max(len(step) for step, _ in self.rows) + 2
        self.say()
        self.say("Summary")
        self.say("-" * 7)
        for step, result in self.rows:
            self.say(f"{step:<{width}}{result}")

    def write(self, path):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(self.lines) + "\n")


def gpu_or_say_why(what, report):
    if torch.cuda.is_available():
        return True
    why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
           else f"torch {torch.__version__} sees no CUDA device")
    report.say(f"{what}: needs a CUDA GPU ({why}); nothing to run here. "
               "`python labs/debugging/debug_lab.py build` still checks that the kernels compile.")
    return False


def tail(text, lines):
    return "\n".join(text.rstrip().splitlines()[-lines:])


def child(args, env_extra=None, env_drop=(), prefix=(), timeout=CHILD_TIMEOUT_S, log=None):
    """Run this script (or a tool wrapping it: prefix) in a fresh process: (output, returncode).
    returncode is None when it ran past `timeout`. The full output goes to LOG_DIR/log."""
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env.update(env_extra or {})
    cmd = [*map(str, prefix), sys.executable, str(Path(__file__).resolve()), *map(str, args)]
    # A session of its own, so that a timeout ends the whole group: a debugger killed alone
    # would leave its stopped inferior holding the GPU.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, rc = proc.communicate(timeout=timeout)[0], proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, rc = proc.communicate()[0] + f"\n[killed after {timeout} s]", None
    if log:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        (LOG_DIR / log).write_text("$ " + " ".join(cmd) + "\n" + out)
    return out, rc


def tool_version(binary):
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, str(error)
    text = (out.stdout + out.stderr).strip()
    if out.returncode != 0:
        return None, text
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "?", None
    return next((line for line in lines if re.search(r"\brelease\b|^Version", line)), lines[0]), None


def cuda_tool(name):
    """A CUDA toolkit binary: on PATH, or in the toolkit torch builds with (CUDA_HOME)."""
    found = shutil.which(name)
    if found:
        return found
    from torch.utils.cpp_extension import CUDA_HOME
    home = Path(CUDA_HOME or "/usr/local/cuda")
    for candidate in (home / "bin" / name, home / name / name):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


# ---------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------
def flags(build):
    """(cxx, nvcc) flags of a variant, from the course's one definition (coursekit.build)."""
    base = course_build.compile_flags(with_cuda=True, debug=build == "debug")
    cxx, nvcc = list(base["cxx"]), list(base["nvcc"])
    if build == "ndebug":
        cxx.append("-DNDEBUG")
        nvcc.append("-DNDEBUG")
    if build == "debug" and "-G" not in nvcc:
        # Without -G, ptxas still optimizes device code under DEBUG=1: cuda-gdb then finds most
        # locals <optimized out>. -G carries its own line table, and nvcc warns when -lineinfo
        # is given with it.
        nvcc = [flag for flag in nvcc if flag != "-lineinfo"] + ["-G"]
    return cxx, nvcc


def ext_name(build):
    return f"debug_lab_{build}"


def build_dir(build):
    return BUILD_ROOT / f"{build}-torch{torch.__version__.replace('+', '-')}"


def library_path(build):
    return build_dir(build) / f"{ext_name(build)}.so"


def op_of(build):
    return getattr(torch.ops, ext_name(build)).scale_bias_relu_into


_loaded = set()


def build_and_load(build, verbose=False):
    """Build one variant (ninja does nothing when nothing changed) and load it; its op."""
    import torch.utils.cpp_extension as cpp

    if build not in _loaded:
        if not cpp.is_ninja_available():
            raise RuntimeError("ninja is required to build the debugging lab: `python -m pip install ninja`")
        course_build.pin_cuda_arch()
        jit.use_ccache()
        out = build_dir(build)
        out.mkdir(parents=True, exist_ok=True)
        jit.clear_stale_lock(out)
        (out / jit.OWNER_FILE).write_text(str(os.getpid()))
        cxx, nvcc = flags(build)
        cpp.load(name=ext_name(build), sources=[str(s) for s in SOURCES], extra_cflags=cxx, extra_cuda_cflags=nvcc,
                 extra_include_paths=course_build.include_dirs(HERE), build_directory=str(out), with_cuda=True,
                 is_python_module=False, verbose=verbose)
        _loaded.add(build)
    return op_of(build)


def ensure_built(builds, report):
    """Build and load the variants; {build: op}. Several are built side by side, one process
    each: a build is two compiler jobs, so one at a time would leave most cores idle."""
    todo = [b for b in builds if b not in _loaded]
    fresh = [ext_name(b) for b in todo if not library_path(b).exists()]
    if fresh:
        report.say(f"[build] compiling {', '.join(fresh)} (the first time only: about a minute)")
    start = time.perf_counter()
    if len(todo) > 1:
        jobs = max(1, (os.cpu_count() or 1) // len(todo))
        procs = {b: subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "_build", b],
                                     env={**os.environ, "MAX_JOBS": str(jobs)}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True) for b in todo}
        outputs = {b: p.communicate()[0] for b, p in procs.items()}
        failed = [b for b, p in procs.items() if p.returncode != 0]
        for b in failed:
            report.say(f"building {ext_name(b)} failed:")
            report.block(tail(outputs[b], 40))
        if failed:
            raise SystemExit(1)
    ops = {b: build_and_load(b) for b in builds}
    if todo:
        seconds = time.perf_counter() - start
        report.say(f"[build] {', '.join(ext_name(b) for b in todo)}: ready in {seconds:.1f} s "
                   f"(TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')}) -> {BUILD_ROOT}")
        report.row("build", f"{', '.join(todo)} ready in {seconds:.1f} s")
    return ops


def nvcc_command(nvcc, *, archs=ARCHS, extra=(), ptx_out=None):
    """A bare nvcc compile of off_by_one.cu (no torch), as the course's nvcc check does for the
    chapters' own .cu files: every arch in one call, or PTX for one arch when ptx_out is set."""
    if ptx_out is not None:
        target = ["-ptx", f"-arch=sm_{archs[0]}", "-o", str(ptx_out)]
    else:
        target = ["-c", *[f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs],
                  "--threads", str(os.cpu_count() or 1), "-o", os.devnull]
    return [nvcc, "-std=c++17", *extra, *target, "-I", str(HERE), str(KERNEL_FILE)]


def ptx_entries(ptx_text):
    """{kernel entry name: PTX body} of a PTX file."""
    return {body.split("(", 1)[0]: body for body in re.split(r"\.entry ", ptx_text)[1:]}


def cmd_build(args, report):
    with_cuda, reason = course_build.cuda_decision("debug_lab")
    if with_cuda:
        ensure_built(BUILDS, report)
        for b in BUILDS:
            report.say(f"  {ext_name(b):<18} nvcc {' '.join(flags(b)[1])}  ->  {library_path(b)}")
        return 0
    report.say(f"No CUDA build of the extension here ({reason}); checking that the kernels compile.")
    nvcc = cuda_tool("nvcc")
    if nvcc is None:
        report.say("nvcc not found either: nothing to check.")
        return 0
    failures = 0
    for label, cmd in ((f"sm_{', sm_'.join(ARCHS)}", nvcc_command(nvcc)),
                       ("the debug variant's flags, sm_90",
                        nvcc_command(nvcc, archs=("90",), extra=flags("debug")[1]))):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        report.say(f"  nvcc off_by_one.cu for {label}: {'ok' if proc.returncode == 0 else 'FAILED'}")
        if proc.returncode != 0:
            failures += 1
            report.block(proc.stdout + proc.stderr)
    report.say("The binding (debug_lab_ops.cpp) needs torch's CUDA headers: it builds on a machine with a "
               "CUDA build of torch.")
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------
# run: the kernel against PyTorch, then against a canary
# ---------------------------------------------------------------------------------------
def reference(x):
    return torch.relu(x * SCALE + BIAS)


def matches_reference(y, x):
    # One fused multiply-add against eager's multiply then add: a rounding apart at most.
    return torch.allclose(y, reference(x), rtol=1.3e-6, atol=1e-5)


def check_kernel(op, kernel, n, *, canary):
    """Run `kernel` on n random floats: (matches PyTorch, value of the float after y's end, or
    None). With canary, y is the first n elements of a buffer of n + 1 whose last element is
    CANARY, so a store one past the end lands somewhere we can look."""
    x = torch.randn(n, device="cuda")
    if canary:
        buffer = torch.full((n + 1,), CANARY, device="cuda")
        y = buffer[:n]
    else:
        buffer, y = None, torch.empty_like(x)
    op(x, y, SCALE, BIAS, kernel)
    torch.cuda.synchronize()
    return matches_reference(y, x), (buffer[n].item() if canary else None)


def grid_line(n):
    blocks = -(-n // BLOCK)
    spare = blocks * BLOCK - n
    line = f"n = {n} floats: {blocks} blocks of {BLOCK} threads, "
    if not spare:
        return line + "every thread has an element"
    return line + f"{spare} threads of the last block have none; the first of them has i = {n} = n"


def cmd_run(args, report):
    kernel = "broken" if args.broken else "fixed"
    if not gpu_or_say_why(f"run --{kernel}", report):
        return 0
    op = ensure_built(["release"], report)["release"]
    n = args.n
    report.say(grid_line(n))
    plain, _ = check_kernel(op, kernel, n, canary=False)
    report.say(f"1. y = torch.empty(n), compared with torch.relu(x * {SCALE} + {BIAS}): "
               f"{'matches' if plain else 'DIFFERS'}")
    inside, past_end = check_kernel(op, kernel, n, canary=True)
    touched = past_end != CANARY
    report.say(f"2. y = buf[:n], buf = torch.full((n + 1,), {CANARY}): y {'matches' if inside else 'DIFFERS'}; "
               f"buf[n], the float after y, is {past_end}: {'OVERWRITTEN' if touched else 'untouched'}")
    if kernel == "broken":
        if touched:
            report.say(f"The broken kernel matched PyTorch and still wrote relu(0 * scale + bias) = {past_end} one "
                       "float past the end of y. With a fresh y that float belongs to nobody the test looks at "
                       "(the allocator's rounding slack, or another tensor): the check passes, and memory is "
                       "corrupted. `python labs/debugging/debug_lab.py sanitize` names the thread and the source line.")
        elif n % BLOCK == 0:
            report.say(f"n is a multiple of {BLOCK}: no thread has i == n, so the bug has nowhere to run. Try "
                       f"--n {n + 1}.")
        return 0
    ok = plain and inside and not touched
    report.say("fixed: " + ("correct, and nothing written past the end" if ok else "WRONG"))
    return 0 if ok else 1


def flush_c_stdout():
    """A failed device assert prints its message through C's stdout, which is block-buffered
    into a pipe and would otherwise appear after everything Python prints."""
    import ctypes
    ctypes.CDLL(None).fflush(None)


def cmd_kernel_child(args):
    """One launch in a fresh process, for the sanitizer, the debugger and the assert demos."""
    torch.ops.load_library(args.so)
    op = getattr(torch.ops, args.ns).scale_bias_relu_into
    x = torch.randn(args.n, device="cuda")
    y = torch.empty_like(x)
    try:
        op(x, y, SCALE, BIAS, args.kernel)
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001  (what was raised is the point of the demo)
        flush_c_stdout()
        here = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == str(Path(__file__).resolve())]
        where = f"line {here[-1].lineno}: {here[-1].line}" if here else "?"
        print(f"[child] raised {type(error).__name__} at {where}", flush=True)
        print("[child] message: " + str(error).strip().replace("\n", "\n[child]          "), flush=True)
        if args.probe_after_error:
            try:
                value = torch.ones(4, device="cuda").sum().item()
                print(f"[child] afterwards torch.ones(4, device='cuda').sum() = {value}: the context still works",
                      flush=True)
            except Exception as again:  # noqa: BLE001
                first = str(again).strip().splitlines()[0]
                print(f"[child] afterwards torch.ones(4, device='cuda').sum() raised too: {first}", flush=True)
        return 2
    ok = matches_reference(y, x)
    print(f"[child] {args.kernel}, n = {args.n}: result {'matches' if ok else 'DIFFERS FROM'} PyTorch", flush=True)
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------
# sanitize: compute-sanitizer memcheck
# ---------------------------------------------------------------------------------------
def source_line(number):
    return KERNEL_FILE.read_text().splitlines()[number - 1].strip()


def memcheck_findings(text):
    """The first error's block (up to the host backtrace), and the facts a reader checks."""
    lines = text.splitlines()
    start = next((k for k, line in enumerate(lines) if "Invalid __" in line), None)
    excerpt = []
    if start is not None:
        for line in lines[start:start + 14]:
            if excerpt and ("Invalid __" in line or line.strip() in ("=========", "")):
                break
            excerpt.append(line)
            if "Saved host backtrace" in line:
                excerpt.append("=========         (host frames omitted: see the full log)")
                break
    summary = re.search(r"ERROR SUMMARY: (\d+) errors?", text)
    accesses = len(re.findall(r"^=+ Invalid __", text, re.M))
    api_calls = len(re.findall(r"^=+ Program hit", text, re.M))
    kind = re.search(r"(Invalid __\w+__ \w+ of size \d+ bytes)", text)
    thread = re.search(r"by thread \((\d+),\d+,\d+\) in block \((\d+),\d+,\d+\)", text)
    where = re.search(r"(off_by_one\.cu):(\d+)", "\n".join(excerpt))
    beyond = re.search(r"is (\d+) bytes after the nearest allocation at \S+ of size (\d+) bytes", text)
    return {"excerpt": "\n".join(excerpt), "errors": int(summary.group(1)) if summary else None,
            "accesses": accesses, "api_calls": api_calls,
            "kind": kind.group(1) if kind else None,
            "thread": (int(thread.group(1)), int(thread.group(2))) if thread else None,
            "line": int(where.group(2)) if where else None,
            "beyond": (int(beyond.group(1)), int(beyond.group(2))) if beyond else None}


def cmd_sanitize(args, report):
    report.section("compute-sanitizer --tool memcheck on the exercise")
    if not gpu_or_say_why("sanitize", report):
        return 0
    sanitizer = cuda_tool("compute-sanitizer")
    if sanitizer is None:
        report.say("skipped: compute-sanitizer not found (looked on PATH and in CUDA_HOME)")
        report.row("sanitize", "skipped: compute-sanitizer not found")
        return 0
    report.say(f"{sanitizer}: {tool_version(sanitizer)[0]}")
    ensure_built(["release"], report)
    report.say(grid_line(N_SMALL))
    runs = (("broken", False), ("broken", True), ("fixed", False))
    status = 0
    for kernel, caching in runs:
        label = f"{kernel} kernel, caching allocator {'on' if caching else 'off'}"
        report.say()
        report.say(f"--- {label}")
        # compute-sanitizer knows only the allocations the CUDA runtime made. PyTorch's caching
        # allocator takes memory from cudaMalloc in large segments (2 MiB for small tensors) and
        # carves tensors out of them, so y[n] lies inside a segment: to memcheck a valid
        # address. PYTORCH_NO_CUDA_MEMORY_CACHING=1 makes every tensor its own cudaMalloc of
        # exactly its size, and the first byte after y out of bounds. The run with caching on
        # is kept to show what it hides.
        env_extra = {} if caching else {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
        cmd_args = ["_kernel", "--so", library_path("release"), "--ns", ext_name("release"), "--kernel", kernel,
                    "--n", N_SMALL]
        prefix = [sanitizer, "--tool", "memcheck", "--print-limit", "10"]
        report.say("$ " + ("PYTORCH_NO_CUDA_MEMORY_CACHING=1 " if not caching else "")
                   + " ".join(map(str, prefix)) + " python debug_lab.py " + " ".join(map(str, cmd_args)))
        log = f"sanitize-{kernel}-{'cache' if caching else 'nocache'}.log"
        out, rc = child(cmd_args, env_extra=env_extra, env_drop=("PYTORCH_NO_CUDA_MEMORY_CACHING",),
                        prefix=prefix, log=log)
        found = memcheck_findings(out)
        if found["excerpt"]:
            report.block(found["excerpt"])
        report.block("\n".join(line for line in out.splitlines() if line.startswith("[child]")
                               or "ERROR SUMMARY" in line or "killed after" in line))
        report.say(f"(full output: {LOG_DIR / log})")
        errors = found["errors"]
        if errors is None:
            result = f"no ERROR SUMMARY line (exit {rc}); see the log"
            status = 1
        elif errors == 0:
            result = "0 errors"
            if kernel == "broken":
                result += " (the overrun stays inside memory the allocator owns, so memcheck cannot see it)"
        else:
            # The summary also counts CUDA API calls that failed after the bad access (its
            # `Program hit ...` lines), so the accesses are counted apart.
            result = f"{errors} error{'s' if errors > 1 else ''}: {found['accesses']} x {found['kind']}"
            if found["line"]:
                result += f" at off_by_one.cu:{found['line']}"
            if found["api_calls"]:
                result += f", {found['api_calls']} failing API call{'s' if found['api_calls'] > 1 else ''}"
        if kernel == "broken" and found["thread"]:
            t, b = found["thread"]
            i = b * BLOCK + t
            report.say(f"Reading it: thread {t} of block {b} has i = {b} * {BLOCK} + {t} = {i}"
                       f"{' = n' if i == N_SMALL else ''}.")
            if found["line"]:
                report.say(f"  off_by_one.cu:{found['line']} is `{source_line(found['line'])}`, inside the guard "
                           "that let it through.")
            if found["beyond"]:
                off, size = found["beyond"]
                report.say(f"  The address is {off} bytes after an allocation of {size} bytes"
                           f"{f' = 4 * n: y[{N_SMALL}], one float past the end' if size == 4 * N_SMALL else ''}.")
            result += f", thread {t} block {b} (i = {i})"
        if kernel == "fixed" and errors != 0:
            status = 1
        report.row(f"sanitize: {label}", result)
    return status


# ---------------------------------------------------------------------------------------
# gdb: cuda-gdb stops inside the kernel
# ---------------------------------------------------------------------------------------
def store_line_of(kernel):
    """Line number of `y[i] = ...` in `kernel`'s body: where the debugger stops."""
    lines = KERNEL_FILE.read_text().splitlines()
    start = next(k for k, line in enumerate(lines) if re.search(rf"\b{kernel}\(", line) and "__global__" not in line)
    return next(k + 1 for k in range(start, len(lines)) if re.match(r"\s*y\[i\] = ", lines[k]))


GDB_NOISE = re.compile(r"^\[(New Thread|Thread .* exited|Detaching after|New process|Inferior \d+ \(process)")
GDB_TROUBLE = re.compile(r"fatal|error|not permitted|cannot|failed|unable|not supported", re.I)


def gdb_commands(line):
    return [
        "set pagination off",
        "set confirm off",
        # The kernel's module is loaded only when the library is, after the program starts.
        "set breakpoint pending on",
        f"break off_by_one.cu:{line} if i == n",
        "run",
        "info cuda kernels",
        "cuda kernel block thread",
        "print i",
        "print n",
        "print blockIdx",
        "print threadIdx",
        "print out",
        "print &y[i]",
        "print &y[n - 1]",
        "info locals",
        "backtrace",
        "delete breakpoints",
        "continue",
    ]


def cmd_gdb(args, report):
    report.section("cuda-gdb: stopping inside the broken kernel")
    if not gpu_or_say_why("gdb", report):
        return 0
    line = store_line_of("scale_bias_relu_broken")
    commands = gdb_commands(line)
    cmd_args = ["_kernel", "--so", library_path("debug"), "--ns", ext_name("debug"), "--kernel", "broken",
                "--n", N_SMALL]
    shown = ("$ cuda-gdb -batch -nx " + " ".join(f"-ex '{c}'" for c in commands)
             + " --args python debug_lab.py " + " ".join(map(str, cmd_args)))
    gdb = cuda_tool("cuda-gdb")
    if gdb is None:
        report.say("skipped: cuda-gdb not found (looked on PATH and in CUDA_HOME/bin). The walkthrough runs:")
        report.say(shown)
        report.row("cuda-gdb", "skipped: cuda-gdb not found")
        return 0
    version, problem = tool_version(gdb)
    if problem:
        report.say(f"skipped: `{gdb} --version` failed: {tail(problem, 5)}")
        report.row("cuda-gdb", "skipped: cuda-gdb does not start")
        return 0
    report.say(f"{gdb}: {version}")
    ensure_built(["debug"], report)
    report.say(f"Build: {ext_name('debug')} with nvcc {' '.join(flags('debug')[1])}")
    report.say(f"Breakpoint: off_by_one.cu:{line} `{source_line(line)}`, only for the thread with i == n")
    report.say(shown)
    prefix = [gdb, "-batch", "-nx"] + [part for c in commands for part in ("-ex", c)] + ["--args"]
    out, rc = child(cmd_args, prefix=prefix, log="cuda-gdb.log")
    kept = [ln for ln in out.splitlines() if not GDB_NOISE.match(ln)]
    report.block("\n".join(kept))
    report.say(f"(full output: {LOG_DIR / 'cuda-gdb.log'}; {len(out.splitlines()) - len(kept)} thread "
               "start/exit lines left out here)")
    stopped = re.search(r"hit Breakpoint", out)
    value = re.search(r"^\$1 = (\d+)", out, re.M)
    if stopped and value:
        report.row("cuda-gdb", f"stopped in scale_bias_relu_broken at off_by_one.cu:{line} with i = "
                               f"{value.group(1)} (n = {N_SMALL})")
        return 0
    trouble = [ln.strip() for ln in kept if GDB_TROUBLE.search(ln) and not ln.startswith("[child]")][:5]
    reason = "; ".join(trouble) if trouble else (f"timed out after {CHILD_TIMEOUT_S} s" if rc is None
                                                 else f"exit status {rc}, no breakpoint hit")
    report.say(f"skipped: cuda-gdb ran but did not stop in the kernel: {reason}")
    report.row("cuda-gdb", f"skipped: did not stop in the kernel ({reason[:120]})")
    return 0


# ---------------------------------------------------------------------------------------
# dsa: device-side asserts, their cost, and TORCH_USE_CUDA_DSA
# ---------------------------------------------------------------------------------------
def torch_include():
    return Path(torch.__file__).resolve().parent / "include"


def macro_text(header, name):
    """Every #define of `name` in the installed torch's header, continuation lines included
    (a macro may have one definition per #ifdef branch); None if absent."""
    path = torch_include() / header
    if not path.is_file():
        return None
    lines = path.read_text().splitlines()
    found = []
    for k, line in enumerate(lines):
        if re.match(rf"\s*#\s*define\s+{name}\b", line):
            end = k
            while lines[end].rstrip().endswith("\\") and end + 1 < len(lines):
                end += 1
            found.append("\n".join(lines[k:end + 1]))
    return "\n".join(found) or None


def struct_fields(header, struct):
    """Field names of `struct` in the installed torch's header."""
    path = torch_include() / header
    if not path.is_file():
        return []
    body = re.search(rf"struct {struct} \{{(.*?)\n\}};", path.read_text(), re.S)
    if not body:
        return []
    code = "\n".join(ln.split("//")[0] for ln in body.group(1).splitlines())
    return re.findall(r"(\w+)\s*(?:\[[^\]]*\])*\s*(?:\{\})?;", code)


def report_dsa_headers(report):
    """What the installed torch's headers say about DSA: checkable anywhere, GPU or not."""
    host_h, launch_h, assert_h = ("c10/cuda/CUDADeviceAssertionHost.h", "c10/cuda/CUDAException.h",
                                  "c10/cuda/CUDADeviceAssertion.h")
    report.say(f"From the installed torch's headers ({torch_include()}):")
    switch = torch_include() / host_h
    if switch.is_file():
        text = switch.read_text().splitlines()
        k = next((k for k, ln in enumerate(text) if re.match(r"#define TORCH_USE_CUDA_DSA\b", ln)), None)
        if k is not None:
            report.say(f"  {host_h} turns TORCH_USE_CUDA_DSA on by itself in code compiled with torch's own "
                       "USE_CUDA define (torch's build; an extension's build does not define it):")
            report.block("\n".join(text[max(0, k - 1):k + 2]), indent="      ")
    for header, name, why in (
            (host_h, "TORCH_DSA_KERNEL_ARGS", "the two parameters every DSA kernel takes"),
            (launch_h, "TORCH_DSA_KERNEL_LAUNCH", "the launch: a registry entry and the buffer pointer per launch"),
            (assert_h, "CUDA_KERNEL_ASSERT2", "the assert; without TORCH_USE_CUDA_DSA it is plain assert()")):
        text = macro_text(header, name)
        report.say(f"  {name} ({why}):" if text else f"  {name}: not in {header}")
        if text:
            report.block(text, indent="      ")
    fields = struct_fields(host_h, "DeviceAssertionData")
    launch = struct_fields(host_h, "CUDAKernelLaunchInfo")
    if fields:
        report.say(f"  recorded per failing assert (DeviceAssertionData, managed memory): {', '.join(fields)}")
    if launch:
        report.say(f"  recorded per launch (CUDAKernelLaunchInfo, host ring buffer): {', '.join(launch)}")


DSA_STRINGS = {
    b"Device-side assertion tracking was not enabled by user": "built WITH TORCH_USE_CUDA_DSA",
    b"Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions": "built WITHOUT TORCH_USE_CUDA_DSA",
    b"PYTORCH_USE_CUDA_DSA": "reads PYTORCH_USE_CUDA_DSA at run time",
    b"PYTORCH_CUDA_DSA_STACKTRACING": "reads PYTORCH_CUDA_DSA_STACKTRACING at run time",
}


def report_dsa_binary(report):
    """Which branch of c10's DSA code libc10_cuda.so was compiled with, from the strings only
    one branch contains (c10/cuda/CUDADeviceAssertionHost.cpp)."""
    lib = Path(torch.__file__).resolve().parent / "lib" / "libc10_cuda.so"
    if not lib.is_file():
        report.say(f"  {lib.name} not found next to torch: no host-side evidence")
        return "unknown"
    data = lib.read_bytes()
    found = [meaning for marker, meaning in DSA_STRINGS.items() if marker in data]
    report.say(f"  strings in {lib.name}: " + ("; ".join(found) if found else "none of the DSA messages"))
    with_dsa = "built WITH TORCH_USE_CUDA_DSA" in found
    without = "built WITHOUT TORCH_USE_CUDA_DSA" in found
    return "yes" if with_dsa and not without else "no" if without and not with_dsa else "inconclusive"


def cmd_dsa_probe(args):
    """torch's own DSA kernel (multi_margin_loss's forward is launched with
    TORCH_DSA_KERNEL_LAUNCH and checks its target with CUDA_KERNEL_ASSERT2): valid calls timed,
    then one target out of range."""
    import torch.nn.functional as F
    scores = torch.randn(4, 5, device="cuda")
    good = torch.tensor([0, 1, 2, 3], device="cuda")
    bad = torch.tensor([0, 1, 2, 7], device="cuda")  # 7 >= 5 classes
    try:
        per_call = []
        for _ in range(20):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(200):
                F.multi_margin_loss(scores, good)
            torch.cuda.synchronize()
            per_call.append((time.perf_counter() - start) / 200 * 1e6)
        print(f"[probe] valid target: {statistics.median(per_call):.2f} us per call (median of 20 x 200 calls, "
              f"launch to completion)", flush=True)
    except Exception as error:  # noqa: BLE001  (what was raised is the finding)
        first = str(error).strip().splitlines()[0]
        print(f"[probe] valid target raised {type(error).__name__}: {first}", flush=True)
        print(f"[probe] outcome: a valid call raised {type(error).__name__}: {first[:100]}", flush=True)
        return 2
    try:
        value = F.multi_margin_loss(scores, bad).item()
        print(f"[probe] target out of range: returned {value!r} with no error", flush=True)
        outcome = f"no error, returned {value:.4g}"
    except Exception as error:  # noqa: BLE001
        message = str(error).strip()
        print(f"[probe] target out of range: raised {type(error).__name__}", flush=True)
        print("[probe] message: " + message.replace("\n", "\n[probe]          "), flush=True)
        outcome = f"raised {type(error).__name__}: " + (
            "with the DSA report" if "device-side assertion failures were found" in message
            else message.splitlines()[0][:80])
    print(f"[probe] outcome: {outcome}; valid calls {statistics.median(per_call):.2f} us", flush=True)
    return 0


def cmd_dsa(args, report):
    report.section("Device-side asserts and TORCH_USE_CUDA_DSA")
    if not torch.cuda.is_available():
        report_dsa_headers(report)
        gpu_or_say_why("dsa", report)
        return 0
    ops = ensure_built(["release", "ndebug"], report)

    report.say()
    report.say("1. The assert fires. scale_bias_relu_asserted<true> has the broken guard and stores through "
               "assert(i < y_numel).")
    report.say("   In a subprocess: a failed device assert traps the kernel, and the CUDA context then reports "
               "cudaErrorAssert to every later call of the process; only a new process gets a working GPU back.")
    fired, surfaced, c10_says = None, [], set()
    for env_extra, label in (({}, "default"), ({"CUDA_LAUNCH_BLOCKING": "1"}, "CUDA_LAUNCH_BLOCKING=1")):
        report.say(f"--- {label}")
        out, rc = child(["_kernel", "--so", library_path("release"), "--ns", ext_name("release"),
                         "--kernel", "asserted_broken", "--n", N_SMALL, "--probe-after-error"],
                        env_extra=env_extra, env_drop=("CUDA_LAUNCH_BLOCKING",),
                        log=f"assert-{'blocking' if env_extra else 'async'}.log")
        report.block(out)
        device_line = re.search(r"^.*Assertion `.*` failed\.?$", out, re.M)
        if device_line and fired is None:
            fired = device_line.group(0).strip()
        c10_says.update(marker.decode() for marker in list(DSA_STRINGS)[:2] if marker.decode() in out)
        where = re.search(r"\[child\] raised \w+ at line \d+: (.*)", out)
        surfaced.append(f"{label}: `{where.group(1).strip()}`" if where else f"{label}: not raised in Python")
    report.say("   Where Python saw the error: " + "; ".join(surfaced) + ". Kernels run asynchronously, so an "
               "error inside one reaches the host at the next call that waits for the GPU; "
               "CUDA_LAUNCH_BLOCKING=1 makes every launch wait.")
    if fired:
        parts = re.search(r"(off_by_one\.cu:\d+):.*?(block: .*)", fired)
        report.row("device assert", "fired: " + (" ".join(parts.groups()) if parts else fired[-110:]))
    else:
        report.row("device assert", "DID NOT FIRE (see the log)")

    report.say()
    report.say(f"2. What the assert costs: scale_bias_relu_asserted<false> (the correct guard, every store checked) "
               f"on {N_TIMED} floats, with the assert compiled in and with -DNDEBUG.")
    nvcc = cuda_tool("nvcc")
    if nvcc:
        report.say("   The check is really in the code: __assertfail calls in the PTX of "
                   "scale_bias_relu_asserted<false>:")
        BUILD_ROOT.mkdir(parents=True, exist_ok=True)
        for label, extra in (("compiled in", ()), ("-DNDEBUG", ("-DNDEBUG",))):
            ptx = BUILD_ROOT / f"asserted{'-ndebug' if extra else ''}.ptx"
            proc = subprocess.run(nvcc_command(nvcc, archs=("90",), extra=extra, ptx_out=ptx), capture_output=True,
                                  text=True)
            if proc.returncode:
                report.say(f"     {label}: nvcc -ptx failed: {tail(proc.stderr, 3)}")
                continue
            body = next((b for name, b in ptx_entries(ptx.read_text()).items() if "assertedILb0" in name), "")
            report.say(f"     {label}: {body.count('__assertfail')}")
    x = torch.randn(N_TIMED, device="cuda")
    y = torch.empty_like(x)
    contenders = (("fixed (no assert written)", ops["release"], "fixed"),
                  ("asserted, assert compiled in", ops["release"], "asserted"),
                  ("asserted, -DNDEBUG", ops["ndebug"], "asserted"))
    for label, op, kernel in contenders:
        y.fill_(float("nan"))
        op(x, y, SCALE, BIAS, kernel)
        if not matches_reference(y, x):
            report.say(f"   {label}: WRONG RESULT, not timed")
            report.row("assert cost", "not measured: a kernel gave a wrong result")
            return 1
    bench.warm_up_gpu()
    medians = {label: [] for label, _, _ in contenders}
    # Two rounds, interleaved: a difference smaller than the change between rounds is noise.
    for _ in range(2):
        for label, op, kernel in contenders:
            timing = bench.time_cuda(lambda: op(x, y, SCALE, BIAS, kernel), reps=30)
            medians[label].append(timing["median_ms"])
    nbytes = 8 * N_TIMED  # read x, write y: 4 bytes each per element
    for label, values in medians.items():
        report.say(f"   {label:<30} median {values[0]:.4f} / {values[1]:.4f} ms (round 1 / 2), "
                   f"{bench.gbps(nbytes, statistics.median(values)):.0f} GB/s")
    on = statistics.median(medians["asserted, assert compiled in"])
    off = statistics.median(medians["asserted, -DNDEBUG"])
    change = 100.0 * (on - off) / off
    report.say(f"   assert compiled in vs -DNDEBUG: {on:.4f} vs {off:.4f} ms, {change:+.1f}% "
               "(CUDA events, median of 30 after warm-up, per round; the two rounds show the noise)")
    report.row("assert cost", f"{on:.4f} ms with vs {off:.4f} ms without ({change:+.1f}%), {N_TIMED} floats")

    report.say()
    report.say("3. TORCH_USE_CUDA_DSA is a compile-time switch of torch itself, not of this extension and not an "
               "environment variable of a run. A kernel that opts in is written with TORCH_DSA_KERNEL_ARGS, "
               "asserts with CUDA_KERNEL_ASSERT2 and is launched with TORCH_DSA_KERNEL_LAUNCH; in a torch built "
               "with it, a failing assert is recorded (the fields below) instead of trapping, and the next CUDA "
               "error check reports it with the launch's record. c10 switches the recording on at run time "
               "with PYTORCH_USE_CUDA_DSA=1 (c10/cuda/CUDADeviceAssertionHost.cpp; the strings check below "
               "shows whether this torch's library holds that name). This extension's own assert() is not DSA: "
               "it traps, as part 1 showed.")
    report_dsa_headers(report)
    host = report_dsa_binary(report)
    report.say("  c10's error message in part 1 said: " + ("; ".join(f"'{m}'" for m in sorted(c10_says))
                                                          if c10_says else "neither DSA sentence"))
    report.say("   torch's own DSA kernel in action: F.multi_margin_loss on CUDA with a target out of range, in a "
               "fresh process per setting:")
    outcomes = {}
    for env_extra, label in (({}, "no variable"), ({"TORCH_USE_CUDA_DSA": "1"}, "TORCH_USE_CUDA_DSA=1"),
                             ({"PYTORCH_USE_CUDA_DSA": "1"}, "PYTORCH_USE_CUDA_DSA=1")):
        report.say(f"--- {label}")
        out, rc = child(["_dsa_probe"], env_extra=env_extra, env_drop=("TORCH_USE_CUDA_DSA", "PYTORCH_USE_CUDA_DSA"),
                        log=f"dsa-probe-{label.split('=')[0].lower().replace(' ', '-')}.log")
        report.block(out)
        outcome = re.search(r"\[probe\] outcome: (.*)", out)
        outcomes[label] = outcome.group(1) if outcome else f"no outcome line (exit {rc}), see the log"
        if re.search(r"Assertion `.*` failed", out):
            outcomes[label] += "; the device printed its own assert message"
    said = ("compile with it" if any(m.startswith("Compile") for m in c10_says)
            else "tracking not enabled" if c10_says else "nothing")
    report.row("TORCH_USE_CUDA_DSA", f"libc10_cuda built with it: {host}; c10's message says: {said}; "
               "bad target in multi_margin_loss: "
               + "; ".join(f"{k}: {v}" for k, v in outcomes.items()))
    report.say("   What DSA costs, from the macros above: two extra kernel arguments (a pointer to the assertion "
               "buffer and a 32-bit launch id) and, per launch, a registry insert on the host into a ring buffer "
               "of launch records; the buffer itself is managed memory, allocated on the first launch per device. "
               "The per-call times above compare the settings on the same op.")
    return 0


# ---------------------------------------------------------------------------------------
# all: one transcript
# ---------------------------------------------------------------------------------------
def header(report):
    from coursekit.results import git_commit
    info = bench.device_info()
    report.say("Chapter 5, debugging a kernel: transcript of `python labs/debugging/debug_lab.py all`")
    report.say(f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    report.say(f"commit: {git_commit()}")
    report.say(f"device: {info['name']} (capability {info['capability']}, {info['sms']} SMs)")
    smi = shutil.which("nvidia-smi")
    if smi:
        driver = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                text=True).stdout.strip().splitlines()
        report.say(f"driver: {driver[0] if driver else '?'}")
    report.say(f"torch: {torch.__version__} (CUDA {torch.version.cuda})")
    for tool in ("nvcc", "compute-sanitizer", "cuda-gdb"):
        path = cuda_tool(tool)
        version = tool_version(path) if path else (None, "not found")
        report.say(f"{tool}: {version[0] or 'unavailable: ' + tail(version[1], 1)}")


def cmd_all(args, report):
    if not gpu_or_say_why("all", report):
        return 0
    header(report)
    ensure_built(BUILDS, report)
    status = 0
    for step in (cmd_sanitize, cmd_gdb, cmd_dsa):
        status |= step(args, report)
    report.summary()
    if args.out:
        report.write(args.out)
        print(f"transcript written to {args.out}")
    return status


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{build,run,sanitize,gdb,dsa,all}")
    sub.add_parser("build", help="build the three variants (or nvcc-check the kernels without CUDA torch)")
    run = sub.add_parser("run", help="run the broken or the fixed kernel against PyTorch")
    which = run.add_mutually_exclusive_group(required=True)
    which.add_argument("--broken", action="store_true")
    which.add_argument("--fixed", action="store_true")
    run.add_argument("--n", type=int, default=N_SMALL, help=f"elements (default {N_SMALL})")
    sub.add_parser("sanitize", help="compute-sanitizer memcheck on both kernels")
    sub.add_parser("gdb", help="cuda-gdb stopping inside the broken kernel")
    sub.add_parser("dsa", help="device asserts: firing, cost, TORCH_USE_CUDA_DSA")
    every = sub.add_parser("all", help="sanitize, gdb and dsa, with a transcript")
    every.add_argument("--out", help="write the transcript here")
    # Internal: the processes the subcommands above start.
    internal = sub.add_parser("_kernel")
    internal.add_argument("--so", required=True)
    internal.add_argument("--ns", required=True)
    internal.add_argument("--kernel", choices=KERNELS, required=True)
    internal.add_argument("--n", type=int, required=True)
    internal.add_argument("--probe-after-error", action="store_true")
    built = sub.add_parser("_build")
    built.add_argument("build", choices=BUILDS)
    sub.add_parser("_dsa_probe")
    args = parser.parse_args()

    if args.command == "_kernel":
        return cmd_kernel_child(args)
    if args.command == "_build":
        build_and_load(args.build)
        return 0
    if args.command == "_dsa_probe":
        return cmd_dsa_probe(args)
    report = Report()
    commands = {"build": cmd_build, "run": cmd_run, "sanitize": cmd_sanitize, "gdb": cmd_gdb, "dsa": cmd_dsa,
                "all": cmd_all}
    status = commands[args.command](args, report)
    if args.command in ("sanitize", "gdb", "dsa"):
        report.summary()
    return status


if __name__ == "__main__":
    sys.exit(main())
