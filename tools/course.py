"""The course's three jobs. Run through the wrappers at the repository root, which first make
the virtualenv (scripts/env.sh) and install what is missing (tools/ensure_env.py):

    ./run_course.sh   main: build every chapter, run its example and benchmark, write results
                      and plots, print a summary (CPU path on a machine without a CUDA GPU)
    ./run_tests.sh    test: build every chapter (pip and JIT), run every test suite, execute
                      every notebook, compile every .cu with nvcc for each target whose device
                      code differs (sweep_archs), beside the other steps
    ./gpu_pass.sh     gpu-pass: on a CUDA machine, both builds, all tests with CUDA on both
                      routes, compute-sanitizer (4 tools), benchmarks and results, the ncu
                      profiles, the notebooks executed in place, the README tables
"""
import argparse
import os
import re
import runpy
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "common"))
LOG_DIR = Path(os.environ.get("COURSE_LOG_DIR", ROOT / "build" / "logs"))
NVCC_ARCHS = ("75", "80", "90")
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# Every pytest run of the jobs. No cache (a fresh run each time) and no logging plugin: nothing
# in the course logs through `logging`, and the plugin attaches its handlers to every
# non-propagating logger (torch registers ~40) around each phase of each test, ~0.6 ms a test
# over the ~20,000 tests of a run; a warning a library logs still reaches stderr, which pytest
# captures and shows with a failure.
PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging"]


# COURSE_CHAPTERS=chapter2_memory (comma-separated name prefixes) narrows every job to those
# chapters and their notebooks (notebooks/NN_*.ipynb belongs to chapterN); unset: all.
SELECTED = [c for c in os.environ.get("COURSE_CHAPTERS", "").split(",") if c]


def chapters():
    found = sorted(p.parent for p in ROOT.glob("chapter*/setup.py"))
    return [c for c in found if not SELECTED or any(c.name.startswith(s) for s in SELECTED)]


def notebooks():
    numbers = {c.name.split("_")[0].removeprefix("chapter").zfill(2) for c in chapters()}
    # 06b_inference.ipynb is chapter 6's too: the number is the name's leading digits.
    return sorted(nb for nb in (ROOT / "notebooks").glob("*.ipynb")
                  if re.match(r"\d*", nb.name).group().zfill(2) in numbers)


class Steps:
    """Runs commands, logs each to LOG_DIR, and keeps a pass/fail table for the summary.

    brief=True (the main job): one line per step while it runs, its output only in its log
    unless it fails; the summary is what a newcomer reads, not hundreds of lines of tables."""

    def __init__(self, brief=False):
        self.table = []
        self.tests = {"passed": 0, "failed": 0, "skipped": 0}
        self.brief = brief
        LOG_DIR.mkdir(parents=True, exist_ok=True)

    def run(self, name, cmd, cwd=ROOT, env=None, junit=None, echo=False):
        log = LOG_DIR / (name.replace(" ", "_").replace("/", "-") + ".log")
        echo = echo and not self.brief
        if self.brief:
            print(f"{name} ...", end=" ", flush=True)
        else:
            print(f"\n=== {name}\n$ {' '.join(map(str, cmd))}", flush=True)
        if junit:
            Path(junit).unlink(missing_ok=True)  # a crashed run must not report an old file
        start = time.perf_counter()
        with open(log, "w") as fh:
            proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env={**os.environ, **(env or {})},
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            tail = []
            for line in proc.stdout:
                fh.write(line)
                tail = (tail + [line])[-25:]
                if echo:
                    print(line, end="", flush=True)
            rc = proc.wait()
        seconds = time.perf_counter() - start
        if self.brief:
            print(f"{'ok' if rc == 0 else f'FAILED ({rc})'} in {seconds:.0f} s (log: {display(log)})", flush=True)
            if rc:
                print("".join(tail), end="", flush=True)
        elif not echo:
            print("".join(tail[-(25 if rc else 3):]), end="", flush=True)
        if rc != 0:
            first_error = next((ln for ln in open(log) if "error:" in ln or "Error:" in ln), None)
            if first_error:
                print(f"--- first error line in {log}:\n{first_error}", end="")
        detail = ""
        if junit and Path(junit).exists():
            suite = ET.parse(junit).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            failed = counts["failures"] + counts["errors"]
            self.tests["passed"] += counts["tests"] - failed - counts["skipped"]
            self.tests["failed"] += failed
            self.tests["skipped"] += counts["skipped"]
            detail = f"{counts['tests'] - failed - counts['skipped']} passed, {failed} failed, " \
                     f"{counts['skipped']} skipped"
        self.table.append((name, "ok" if rc == 0 else f"FAILED ({rc})", f"{seconds:.1f}s", detail))
        return rc == 0

    def summary(self):
        width = max([58] + [len(row[0]) + 2 for row in self.table])
        print("\n" + "=" * (width + 34))
        for name, status, secs, detail in self.table:
            print(f"{name:<{width}}{status:<12}{secs:>8}  {detail}")
        failed_steps = sum(1 for row in self.table if row[1] != "ok")
        print(f"steps: {len(self.table) - failed_steps} passed, {failed_steps} failed")
        t = self.tests
        if sum(t.values()):
            # The last line is what CI reads: every test of every suite, plus failed steps.
            print(f"tests: {t['passed']} passed, {t['failed'] + failed_steps} failed, "
                  f"{t['skipped']} skipped")
        return failed_steps == 0 and t["failed"] == 0


def display(path):
    """A path as the summary prints it: relative to the repository root when inside it."""
    path = Path(path)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def extensions(chapter):
    """The chapter's extension projects: the chapter itself, then any sub-project with its own
    setup.py (chapter 5's stable_abi/, the same kernels built against the LibTorch stable ABI),
    whose tests the chapter's pytest collects too."""
    return [chapter] + sorted(p.parent for p in chapter.glob("*/setup.py"))


def label(chapter, project):
    return chapter.name if project == chapter else f"{chapter.name}/{project.name}"


def pip_install(steps, chapter):
    ok = True
    for project in extensions(chapter):
        ok &= steps.run(f"{label(chapter, project)} pip install", [sys.executable, "-m", "pip",
                        "install", "--no-build-isolation", "--no-deps",
                        "--disable-pip-version-check", "."], cwd=project)
    return ok


def jit_build(steps, chapter):
    for project in extensions(chapter):
        steps.run(f"{label(chapter, project)} JIT build", [sys.executable, "load_jit.py"], cwd=project)


def package_check(steps, chapter, record=False):
    """A chapter that ships as a wheel (chapter 5's labs/package_check.py): build it, install it
    into a fresh virtualenv, run the chapter's standalone tests there and list its device code.
    Runs after pip_install, whose build/ the wheel build reuses. record=True (the GPU pass) keeps
    its findings (arch lists, sizes, PTX JIT) in results/<device>/ for the lesson."""
    script = Path("labs") / "package_check.py"
    if not (chapter / script).exists():
        return
    cmd = [sys.executable, script]
    if record:
        from coursekit import results
        out = results.RESULTS_DIR / results.device_slug()
        out.mkdir(parents=True, exist_ok=True)
        cmd += ["--json", out / f"{chapter.name}_packaging.json"]
    steps.run(f"{chapter.name} wheel in a fresh venv", cmd, cwd=chapter)


def pytest(steps, chapter, route):
    junit = LOG_DIR / f"{chapter.name}-{route}.xml"
    return steps.run(f"{chapter.name} pytest ({route})",
                     [sys.executable, *PYTEST, f"--junitxml={junit}"], cwd=chapter,
                     env={"COURSE_EXT_ROUTE": route}, junit=junit)


def execute_notebooks(steps, inplace):
    for nb in notebooks():
        steps.run(f"notebook {nb.name}", [sys.executable, str(ROOT / "tools" / "run_notebook.py"),
                  str(nb)] + (["--inplace"] if inplace else []))


def cuda_files(chapter):
    """Every .cu of a chapter, in any folder (chapter 6's csrc/ parts, the experiments, chapter 5's
    labs), but none under a build folder."""
    return sorted(cu for cu in chapter.rglob("*.cu") if "build" not in cu.relative_to(chapter).parts)


def include_dirs(chapter):
    """What both build routes put on a chapter's include path (coursekit.build.include_dirs, with
    the folders its sources.py names in INCLUDE_DIRS): the sweep compiles each .cu as they do."""
    from coursekit import build
    names = runpy.run_path(str(chapter / "sources.py")) if (chapter / "sources.py").exists() else {}
    return build.include_dirs(chapter, names.get("INCLUDE_DIRS", ()))


def is_hopper_file(cu):
    return "hopper" in cu.parent.name or cu.name.startswith("hopper")


INCLUDE_LINE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
ARCH_TEST = re.compile(r"__CUDA_ARCH__\s*(>=|<=|==|!=|>|<)\s*(\d+)")


def course_sources(cu, includes):
    """The .cu and every file of the repository it includes, directly or through another (the
    quoted includes, looked up as the compiler does: beside the including file, then on -I)."""
    seen, todo = set(), [cu.resolve()]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in INCLUDE_LINE.findall(path.read_text()):
            found = next((d / name for d in (path.parent, *map(Path, includes)) if (d / name).is_file()), None)
            if found is not None and found.resolve().is_relative_to(ROOT):
                todo.append(found.resolve())
    return seen


def sweep_archs(cu, includes, hopper_chapter=False):
    """The targets the sweep compiles cu for. Two targets compile the course's code alike unless
    some test of __CUDA_ARCH__ in it falls between them: every guard in the course sits at 800
    (cp.async and mma.sync), and Hopper's at 900 with its feature macro. So sm_75 always, and each
    further arch of NVCC_ARCHS only where a test in cu's sources separates it from the one before
    (sm_80 by the 800 guards; sm_90 by a test at 900, hopper.cuh's); where none does, it would
    compile what the arch before it compiled, and the GPU pass builds it for the card anyway.
    In a chapter with Hopper files (hopper_chapter) the builds compile every file for 9.0a in
    place of 9.0 (coursekit.build.hopper_arch_list), so there sm_90 is never a target and the
    sweep compiles sm_90a instead; the Hopper files always build for it, the only target where
    their wgmma and setmaxnreg exist."""
    bounds = set()
    for path in course_sources(cu, includes):
        for op, value in ARCH_TEST.findall(path.read_text()):
            value = int(value)
            # The first arch value on the other side of the test: >= and < change at value,
            # > and <= at value + 1, == and != at both.
            bounds |= {value} if op in (">=", "<") else {value + 1} if op in (">", "<=") else {value, value + 1}
    archs = [NVCC_ARCHS[0]]
    for before, arch in zip(NVCC_ARCHS, NVCC_ARCHS[1:]):
        if any(int(before) * 10 < b <= int(arch) * 10 for b in bounds):
            archs.append(arch)
    if hopper_chapter or is_hopper_file(cu):
        archs = ["90a" if a == "90" else a for a in archs]  # 9.0 is built as 9.0a there
    if is_hopper_file(cu) and "90a" not in archs:
        archs.append("90a")
    return archs


# The sweep's device flags per target. What the sweep asks of a target is whether the code
# compiles for it (the front end, the target's instructions and inline PTX, its shared-memory
# limits, static_asserts), which the device optimizer does not decide; optimizing is most of a
# file's time, and the sweep was most of the test command's time. So sm_75 and sm_80 compile
# with cicc and ptxas at -O0: a third to a half of the time (chapter 4's elementwise_kernels.cu
# at sm_75: 65 s -> 25 s on a 2-core machine, nvcc 13.0). sm_90a compiles with cicc at -O1 (at
# -O0 it stops with a segmentation fault on the wgmma kernels, nvcc 13.0) and ptxas at -O0: the
# 30 Hopper compiles took 111 s on 2 cores against some 440 s with the builds' -O3, every one
# passing. The builds themselves, and so the GPU pass, compile every target optimized.
NO_DEVICE_OPTIMIZER = ["-Xcicc", "-O0", "-Xptxas", "-O0"]
SWEEP_DEVICE_FLAGS = {"75": NO_DEVICE_OPTIMIZER, "80": NO_DEVICE_OPTIMIZER, "90a": ["-Xcicc", "-O1", "-Xptxas", "-O0"]}


def nvcc_jobs():
    """One command per file and target: the file's first target with `nvcc -c` (the host side is
    compiled once), each further one with `nvcc -cubin` (that target's device code alone); each
    target's device flags from SWEEP_DEVICE_FLAGS."""
    jobs = []
    for chapter in chapters():
        includes = [str(d) for d in include_dirs(chapter)]
        flags = [flag for d in includes for flag in ("-I", d)]
        files = cuda_files(chapter)
        hopper_chapter = any(is_hopper_file(cu) for cu in files)
        for cu in files:
            archs = sweep_archs(cu, includes + [str(cu.parent)], hopper_chapter)
            for i, arch in enumerate(archs):
                # The file's own folder too: an experiment or a lab includes the header beside it.
                jobs.append((cu, arch, [shutil.which("nvcc"), "-c" if i == 0 else "-cubin", "-std=c++17",
                                        f"-gencode=arch=compute_{arch},code=sm_{arch}",
                                        *SWEEP_DEVICE_FLAGS.get(arch, []), *flags, "-I", cu.parent,
                                        "-o", os.devnull, cu]))
    return jobs


class NvccSweep:
    """Compiles every .cu of the course for the targets sweep_archs names, on a pool of threads
    that each run one nvcc at a time, beside the job's other steps; its rows join the summary in
    finish(), one a file, with its compiles' summed seconds. The steps are the job's critical path
    (they run one after another, mostly one process at a time), so the compiles run at the lowest
    CPU priority (`nice -n 19`) on every core from the start: a step takes the CPU whenever it can
    use it, and the sweep fills every cycle the steps leave (a step waiting on a process start or on
    a notebook's kernel, the cores a single-threaded pytest leaves). Without `nice` the sweep takes
    half the cores until the steps are done and every core after. Compiling one target per nvcc,
    not all in one call, keeps every core busy: one call's targets finish unevenly (sm_90a's Hopper
    code takes ten times a plain target's)."""

    def __init__(self):
        import threading
        self.nvcc = shutil.which("nvcc")
        nice = shutil.which("nice")
        self.prefix = [nice, "-n", "19"] if nice else []
        self.jobs = nvcc_jobs() if self.nvcc else []
        self.results = {}
        self.lock = threading.Lock()
        self.all_cores = threading.Event()
        cores = os.cpu_count() or 1
        self.threads = [threading.Thread(target=self.work, args=(not nice and i >= max(1, cores // 2),), daemon=True)
                        for i in range(cores)]

    def start(self):
        if self.nvcc is None:
            return
        self.started = time.perf_counter()
        self.pending = list(reversed(self.jobs))
        for thread in self.threads:
            thread.start()

    def work(self, waits):
        if waits:
            self.all_cores.wait()
        while True:
            with self.lock:
                if not self.pending:
                    return
                cu, arch, cmd = self.pending.pop()
            log = LOG_DIR / f"nvcc_{cu.relative_to(ROOT)}_sm_{arch}.log".replace("/", "-")
            start = time.perf_counter()
            with open(log, "w") as fh:
                rc = subprocess.run([str(c) for c in self.prefix + cmd], stdout=fh, stderr=subprocess.STDOUT).returncode
            self.results[cu, arch] = (rc, time.perf_counter() - start, log)

    def finish(self, steps):
        if self.nvcc is None:
            print("\nnvcc not found: skipping the compile check of every .cu")
            return
        self.all_cores.set()
        for thread in self.threads:
            thread.join()
        print(f"\nnvcc sweep: {len(self.jobs)} compiles in {time.perf_counter() - self.started:.0f} s "
              f"on {len(self.threads)} threads, beside the steps above until they were done")
        for cu in dict.fromkeys(job[0] for job in self.jobs):
            done = {arch: self.results[c, arch] for c, arch, _ in self.jobs if c == cu}
            failed = [(arch, r) for arch, r in done.items() if r[0] != 0]
            for arch, (rc, _, log) in failed:
                print(f"nvcc {cu.relative_to(ROOT)} sm_{arch} FAILED ({rc}) (log: {display(log)})")
                print("".join(open(log).readlines()[-25:]), end="")
            steps.table.append((f"nvcc {cu.relative_to(ROOT)} {','.join(f'sm_{a}' for a in done)}",
                                "ok" if not failed else f"FAILED ({failed[0][1][0]})",
                                f"{sum(r[1] for r in done.values()):.1f}s", ""))


def tree_status():
    """`git status --porcelain` of the checkout, untracked files listed one by one (what git
    ignores, build/ and results/cpu-*/ among them, left out): a set of lines, or None where the
    tree has no git (copied without its .git)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return set(out.splitlines())


def check_tree_unchanged(steps, before):
    """A step that fails when the job left files in the checkout that git would show (a wheel
    built into a source folder, say): the test command must leave `git status` as it found it."""
    after = tree_status()
    if before is None or after is None:
        return
    new = sorted(after - before)
    for line in new:
        print(f"left in the tree: {line}")
    steps.table.append(("git status unchanged by the tests", "ok" if not new else f"FAILED ({len(new)} new)",
                        "-", ", ".join(line[3:] for line in new[:3]) + (" ..." if len(new) > 3 else "")))


def job_test(args):
    steps = Steps()
    status_before = tree_status()
    sweep = NvccSweep()
    sweep.start()
    junit = LOG_DIR / "common.xml"
    steps.run("common helpers pytest", [sys.executable, *PYTEST, f"--junitxml={junit}",
              "common/tests"], junit=junit)
    for chapter in chapters():
        if pip_install(steps, chapter):
            pytest(steps, chapter, "installed")
            package_check(steps, chapter)
        jit_build(steps, chapter)
    execute_notebooks(steps, inplace=False)
    sweep.finish(steps)
    check_tree_unchanged(steps, status_before)
    return steps.summary()


def run_benchmarks(steps, chapter):
    """The chapter's benchmark, its launch-shape tuning script if it has one (tune_*.py: the
    measurements a version=None dispatch table was read from), its build lab if it has one
    (labs/build_lab.py, chapter 5: the extension built under each build configuration) and its
    training run if it has one (train_*.py, chapter 6: a model trained on the chapter's op and
    on PyTorch's, curves compared; --quick without a GPU, where the full run would take hours)
    and its generator if it has one (generate_*.py, chapter 6's serving half: greedy decoding
    over the paged cache against SDPA's). Every bench_*.py runs (chapter 6 has one per half)."""
    import torch
    scripts = sorted(chapter.glob("tune_*.py")) + sorted(chapter.glob("labs/build_lab.py"))
    benches = sorted(chapter.glob("bench_*.py"))
    for script in scripts + benches + sorted(chapter.glob("train_*.py")) + sorted(chapter.glob("generate_*.py")):
        kind = {"tune": "tuning", "build": "build lab", "train": "training",
                "generate": "generator"}.get(script.name.split("_")[0], "benchmark")
        if kind == "benchmark" and len(benches) > 1:
            kind = f"benchmark {script.stem.removeprefix('bench_')}"
        quick = kind in ("training", "generator") and not torch.cuda.is_available()
        steps.run(f"{chapter.name} {kind}",
                  [sys.executable, script.relative_to(chapter), *(["--quick"] if quick else [])],
                  cwd=chapter, echo=True)


def job_main(args):
    import torch
    steps = Steps(brief=True)
    started = time.time()
    if not torch.cuda.is_available():
        print("No CUDA GPU here: running every chapter's CPU path; plots show the recorded "
              "GPU results beside it.")
    print(f"Each step's output (examples, benchmark tables) goes to its log in {display(LOG_DIR)}/.\n")
    for chapter in chapters():
        pip_install(steps, chapter)
        steps.run(f"{chapter.name} example", [sys.executable, "example_usage.py"], cwd=chapter,
                  echo=True)
        run_benchmarks(steps, chapter)
    steps.run("report", [sys.executable, str(ROOT / "tools" / "report.py")], echo=True)
    ok = steps.summary()
    print_written(started)
    return ok


def print_written(since):
    """What the main job wrote under results/: each results file with its rows and how many of
    them the benchmark harness could not trust (other load on the machine), then the figures."""
    import json
    written = sorted(p for p in (ROOT / "results").glob("*/*") if p.stat().st_mtime >= since)
    for folder in sorted({p.parent for p in written}):
        here = [p for p in written if p.parent == folder]
        print(f"\nwritten to {display(folder)}/:")
        for path in (p for p in here if p.suffix == ".json"):
            try:
                rows = json.loads(path.read_text()).get("benchmarks", [])
            except (ValueError, AttributeError):
                rows = []
            untrusted = sum(1 for r in rows if isinstance(r, dict) and r.get("untrusted"))
            print(f"  {path.name}: {len(rows)} rows" +
                  (f", {untrusted} not trusted (their reasons are in the benchmark's log)" if untrusted else ""))
        figures = [p.name for p in here if p.suffix == ".png"]
        compared = [name for name in figures if name.endswith("_cpu_vs_recorded.png")]
        if figures:
            print(f"  {len(figures)} figures (.png)" + (f", {len(compared)} of them *_cpu_vs_recorded.png: the CPU "
                                                        "run beside the recorded GPU run" if compared else ""))


GPU_STAGES = ("build", "test", "sanitize", "bench", "profile", "notebooks")


def job_gpu_pass(args):
    import torch
    if not torch.cuda.is_available():
        print("gpu-pass needs a CUDA GPU; none is visible", file=sys.stderr)
        return False
    stages = args.stages.split(",")
    unknown = set(stages) - set(GPU_STAGES)
    if unknown:
        print(f"unknown stages {sorted(unknown)}; choose from {','.join(GPU_STAGES)}")
        return False
    subprocess.run(["nvidia-smi"], check=False)
    steps = Steps()
    sanitizer = shutil.which("compute-sanitizer")
    for chapter in chapters():
        if "build" in stages:
            pip_install(steps, chapter)
            jit_build(steps, chapter)
        if "test" in stages:
            pytest(steps, chapter, "installed")
            pytest(steps, chapter, "jit")
            package_check(steps, chapter, record=True)
            steps.run(f"{chapter.name} example", [sys.executable, "example_usage.py"],
                      cwd=chapter)
        for tool in SANITIZER_TOOLS if sanitizer and "sanitize" in stages else ():
            junit = LOG_DIR / f"{chapter.name}-sanitize-{tool}.xml"
            steps.run(f"{chapter.name} compute-sanitizer {tool}",
                      [sanitizer, "--tool", tool, "--error-exitcode", "1", sys.executable, *PYTEST,
                       "-m", "sanitize",
                       f"--junitxml={junit}"], cwd=chapter, junit=junit,
                      env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1", "COURSE_EXT_ROUTE": "installed"})
        if "bench" in stages:
            run_benchmarks(steps, chapter)
        profile = next(chapter.glob("profile_*.py"), None)
        if "profile" in stages and profile is not None:
            steps.run(f"{chapter.name} ncu profile", [sys.executable, profile.name], cwd=chapter,
                      echo=True)
    if "sanitize" in stages and not sanitizer:
        steps.table.append(("compute-sanitizer", "FAILED (not found)", "-", ""))
    if "notebooks" in stages:
        execute_notebooks(steps, inplace=True)
        steps.run("report", [sys.executable, str(ROOT / "tools" / "report.py")])
    return steps.summary()


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", choices=["main", "test", "gpu-pass"])
    parser.add_argument("--stages", default=",".join(GPU_STAGES),
                        help="gpu-pass only: comma-separated subset of " + ",".join(GPU_STAGES))
    args = parser.parse_args()
    job = {"main": job_main, "test": job_test, "gpu-pass": job_gpu_pass}[args.job]
    return 0 if job(args) else 1


if __name__ == "__main__":
    sys.exit(main())
