"""Run a chapter's workload under Nsight Compute (ncu) and read the counters back.

Each chapter's profile_*.py names its metrics and its workload; this module runs
`ncu --csv --print-units base` over `python <script> --workload`, parses the result, and says
what it could not do instead of failing: without a GPU or without ncu a profile script prints
why and writes nothing (a CPU machine runs the tests, not the profile); a metric this ncu or
GPU rejects is dropped and the run repeated, and the record says which. Counters, not timings:
ncu replays each kernel once per metric pass, with the caches flushed and the clocks left as
they are (--clock-control none).

Which kernels belong to which call of a workload: ncu reports kernels in launch order. A script
whose calls launch a fixed number of kernels counts them; one whose calls vary (chapter 6: SDPA's
backends, PyTorch's fill kernels) launches a marker before each call (marker(): torch's
one-thread spin_kernel, which no call launches) and split_by_marker gives each call the kernels
up to the next marker.
"""
import argparse
import csv
import dataclasses
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TOOL = "ncu --clock-control none"
# Units ncu may print when it scales a value (--print-units auto); the command asks for base
# units, so these are a fallback. ncu's byte prefixes are decimal (1 Kbyte = 1000 bytes).
UNIT_SCALE = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9,
              "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}
REQUIRED = {"gpu__time_duration.sum"}  # never dropped: a row without a duration is no row
MARKER = "spin_kernel"   # at::cuda::sleep's kernel: torch.cuda._sleep(cycles), one thread
MARKER_CYCLES = 1000     # about a microsecond: a marker, not a delay


# ---------------------------------------------------------------------------------------------
# Reading ncu's output: pure functions (common/tests/test_ncu.py holds them)
# ---------------------------------------------------------------------------------------------
def parse_value(text, unit=""):
    """One "Metric Value" cell -> float in the metric's base unit, or None where ncu has none
    ("n/a", empty, anything not a number)."""
    try:
        value = float((text or "").strip().replace(",", ""))
    except ValueError:
        return None
    return value * UNIT_SCALE.get((unit or "").split("/")[0].strip(), 1.0)


def parse_csv(text, metrics):
    """ncu --csv output (the details page: one line per kernel and metric) -> one dict per
    profiled kernel in launch order: {"kernel": demangled name, <short name>: value}, with
    `metrics` mapping ncu's names to the short ones. Lines before the header ("==PROF==", the
    application's own output) and lines that are not a kernel's row are skipped; a metric ncu
    did not report is absent, one it reported as n/a is None."""
    start = text.find('"ID"')
    if start < 0:
        return []
    kernels = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        kid = (row.get("ID") or "").strip()
        name = row.get("Metric Name")
        if not kid.isdigit() or name is None or row.get("Kernel Name") is None:
            continue
        k = kernels.setdefault(int(kid), {"kernel": row["Kernel Name"]})
        k[metrics.get(name, name)] = parse_value(row.get("Metric Value"), row.get("Metric Unit"))
    return [kernels[i] for i in sorted(kernels)]


def ncu_version(text):
    """`ncu --version` -> its "Version ..." line (the whole text, stripped, if there is none)."""
    for line in text.splitlines():
        if line.strip().lower().startswith("version"):
            return line.strip()
    return text.strip()


def rejected_metrics(output, metrics):
    """The metrics of `metrics` that an ncu ==ERROR== or ==WARNING== line names, by full name or
    by base name (the part before the first dot, as in "sm__pipe_tensor_op_gmma_cycles_active")."""
    found = []
    for line in output.splitlines():
        if "==ERROR==" not in line and "==WARNING==" not in line:
            continue
        for m in metrics:
            base = m.split(".")[0]
            if m not in found and re.search(rf"(?<![\w.]){re.escape(base)}(?!\w)", line):
                found.append(m)
    return found


def metric_error(output):
    """Whether ncu failed over a metric (an ==ERROR== line that speaks of metrics)."""
    return any("==ERROR==" in line and "metric" in line.lower() for line in output.splitlines())


def is_marker(kernel):
    return MARKER in kernel["kernel"]


def split_by_marker(kernels, labels):
    """The kernels of each call: a marker opens a call, every kernel up to the next marker is
    its. ValueError when the profile and the plan disagree (kernels before the first marker, a
    marker count that is not the call count, a call that launched nothing)."""
    groups = []
    for k in kernels:
        if is_marker(k):
            groups.append([])
        elif not groups:
            raise ValueError(f"kernel {k['kernel'][:80]!r} was profiled before the first marker")
        else:
            groups[-1].append(k)
    if len(groups) != len(labels):
        raise ValueError(f"the profile has {len(groups)} markers ({MARKER}) but the plan has "
                         f"{len(labels)} calls")
    for name, group in zip(labels, groups):
        if not group:
            raise ValueError(f"{name}: no kernel between its marker and the next")
    return groups


# ---------------------------------------------------------------------------------------------
# Running ncu
# ---------------------------------------------------------------------------------------------
def marker():
    """Launch the marker kernel (in the workload, before each call split_by_marker attributes)."""
    import torch
    torch.cuda._sleep(MARKER_CYCLES)


@dataclasses.dataclass
class Profile:
    """What one ncu run gave: the kernels in launch order, the plan the workload wrote (--plan;
    None unless asked for), and how they were measured."""
    kernels: list
    plan: object
    command: list
    metrics: dict   # ncu name -> short name, those collected (after any dropped)
    dropped: list   # rejected by this ncu or GPU, and not collected
    version: str

    def missing(self):
        """Collected metrics that no profiled kernel (markers aside) reported a value for."""
        measured = [k for k in self.kernels if not is_marker(k)]
        return [m for m, f in self.metrics.items() if all(k.get(f) is None for k in measured)]

    def provenance(self):
        """The fields every profile record carries beside its rows (results.write_results)."""
        return {"tool": TOOL, "metrics": list(self.metrics), "ncu_version": self.version,
                "command": shlex.join(map(str, self.command)), "metrics_dropped": self.dropped,
                "metrics_missing": self.missing()}


def unavailable(name, need_ncu=True):
    """Why `name` cannot profile here (no CUDA GPU, or no ncu on PATH when need_ncu: a workload
    alone runs without it), or None when it can."""
    import torch
    if not torch.cuda.is_available():
        return (f"{name}: no CUDA GPU is visible, so there is nothing for Nsight Compute to profile; "
                "nothing written. Run it on a GPU machine (the GPU pass's profile stage does).")
    if need_ncu and shutil.which("ncu") is None:
        return (f"{name}: ncu (Nsight Compute) is not on PATH; nothing written. Install Nsight Compute "
                "(it ships with the CUDA toolkit) or put its folder on PATH.")
    return None


def command(ncu, metrics, script, args=(), *, kernel_regex=None, from_start=True):
    """The ncu command line over `python script --workload args...`: CSV in base units, clocks
    as they are, only the kernels whose demangled name matches kernel_regex (every kernel when
    None), from the start or only between cudaProfilerStart and cudaProfilerStop."""
    names = (["--kernel-name-base", "demangled", "--kernel-name", f"regex:{kernel_regex}"]
             if kernel_regex else [])
    return [ncu, "--csv", "--print-units", "base", "--clock-control", "none", *names,
            "--profile-from-start", "on" if from_start else "off", "--metrics", ",".join(metrics),
            sys.executable, str(script), "--workload", *map(str, args)]


def run(script, metrics, *, args=(), kernel_regex=None, from_start=True, unsure=(), plan=False):
    """ncu over `script --workload`: a Profile. A metric ncu rejects by name is dropped and the
    run repeated (at most twice); when it fails over metrics without naming one, the `unsure`
    ones (names not yet collected on this course's H100) are dropped instead. With plan=True the
    workload is passed `--plan FILE` and must write there, as JSON, what it ran (Profile.plan).
    Any other failure ends the run with ncu's output."""
    ncu = shutil.which("ncu")
    version = ncu_version(subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout)
    metrics, dropped = dict(metrics), []
    for _ in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            plan_path = Path(tmp) / "plan.json"
            cmd = command(ncu, list(metrics), script, [*(["--plan", plan_path] if plan else []), *args],
                          kernel_regex=kernel_regex, from_start=from_start)
            print("running", shlex.join(map(str, cmd)), flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            written = json.loads(plan_path.read_text()) if plan and plan_path.exists() else None
        output = proc.stdout + "\n" + proc.stderr
        if proc.returncode == 0 and (written is not None or not plan):
            return Profile(parse_csv(proc.stdout, metrics), written, cmd, metrics, dropped, version)
        named = [m for m in rejected_metrics(output, metrics) if m not in REQUIRED]
        retry = named or ([m for m in metrics if m in unsure] if metric_error(output) else [])
        if proc.returncode == 0 or not retry:
            break
        print(f"ncu failed over metrics; retrying without {', '.join(retry)}", flush=True)
        for m in retry:
            metrics.pop(m)
            dropped.append(m)
    sys.exit(f"ncu failed ({proc.returncode}{'; plan not written' if plan and written is None else ''}):\n"
             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def workload_or_profile(doc, script, workload, kernel_regex, metrics, from_start=True, unsure=()):
    """The command line of chapters 1-4's profile_*.py. With --workload: run the workload (what
    ncu profiles, in this process) and return None. Without: profile `script --workload` under
    ncu and return the Profile (see run). Either way, without a GPU or without ncu: say why and
    return None, having run and written nothing."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="store_true", help="run only what ncu profiles")
    workload_only = parser.parse_args().workload
    why = unavailable(Path(script).name, need_ncu=not workload_only)
    if why is not None:
        print(why)
        return None
    if workload_only:
        workload()
        return None
    return run(script, metrics, kernel_regex=kernel_regex, from_start=from_start, unsure=unsure)


# ---------------------------------------------------------------------------------------------
# The source view: which instructions the warps stall on
# ---------------------------------------------------------------------------------------------
# The counters above say how much a kernel stalls and why, summed over it; they do not say where.
# ncu's SourceCounters section samples every warp's program counter at a fixed interval and records
# its state (issuing, or stalled and on what); `ncu --import REPORT --page source --csv
# --print-source sass` then prints one row per SASS instruction with its samples, in total and per
# reason ("stall_long_sb", "stall_wait", ...). An instruction with many samples is one the warps sit
# at: a wait on a load, a barrier or a product. The samples count warps, not time: a stall that
# another warp of the scheduler fills with its own instructions costs nothing, so a hot spot is a
# place to look, and only a timing says whether removing it pays.
SOURCE_SAMPLES = "Warp Stall Sampling (All Samples)"


def source_command(ncu, script, args, kernel_regex, report):
    """The ncu command that samples the first kernel matching kernel_regex of `script --workload
    args...` (between cudaProfilerStart and cudaProfilerStop) into `report` (.ncu-rep)."""
    return [ncu, "--profile-from-start", "off", "--clock-control", "none", "--section", "SourceCounters",
            "--section", "WarpStateStats", "--import-source", "no", "--kernel-name-base", "demangled",
            "--kernel-name", f"regex:{kernel_regex}", "--launch-count", "1", "-o", str(report),
            sys.executable, str(script), "--workload", *map(str, args)]


def source_export_command(ncu, report):
    """The ncu command that prints a report's source page, one CSV row per SASS instruction."""
    return [ncu, "--import", str(report), "--page", "source", "--csv", "--print-source", "sass"]


def source_hotspots(text, top=25):
    """The instructions of ncu's source-page CSV (source_export_command) with the most stall
    samples: {"kernel": its name (the line above the table; None without one), "total": samples
    over the kernel, "reasons": [(reason, samples)] summed over it, most first, "rows": the `top`
    instructions, most samples first, each {"index" (its place in the listing), "sass", "samples",
    "share" (of the total), "reasons": its three largest}}. Reasons are the stall_* columns
    without "(Not Issued)". ValueError when the text has no such table."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError("no source table (a line starting with \"Address\") in the text")
    table = list(csv.reader(lines[start:]))
    head, body = table[0], [r for r in table[1:] if len(r) == len(table[0])]
    if SOURCE_SAMPLES not in head or "Source" not in head:
        raise ValueError(f"the source table has no {SOURCE_SAMPLES!r} or Source column")
    samples, sass = head.index(SOURCE_SAMPLES), head.index("Source")
    reasons = [(i, name) for i, name in enumerate(head) if name.startswith("stall_") and "Not Issued" not in name]
    value = lambda row, i: parse_value(row[i]) or 0.0  # noqa: E731 (a blank cell is no sample)
    total = sum(value(r, samples) for r in body)
    summed = sorted(((name, sum(value(r, i) for r in body)) for i, name in reasons), key=lambda p: -p[1])
    ranked = sorted(range(len(body)), key=lambda k: -value(body[k], samples))[:top]
    rows = [{"index": k, "sass": body[k][sass].strip(), "samples": value(body[k], samples),
             "share": value(body[k], samples) / total if total else 0.0,
             "reasons": sorted(((name, value(body[k], i)) for i, name in reasons), key=lambda p: -p[1])[:3]}
            for k in ranked]
    kernel = next((r[1] for r in csv.reader(lines[:start]) if len(r) > 1 and r[0] == "Kernel Name"), None)
    return {"kernel": kernel, "total": total, "reasons": summed, "rows": rows}


def format_hotspots(hot):
    """source_hotspots' result as a table for a terminal or a text record."""
    out = [f"kernel: {hot['kernel']}"] if hot.get("kernel") else []
    out += [f"stall samples: {hot['total']:.0f}; by reason: "
           + ", ".join(f"{name.removeprefix('stall_')} {n / hot['total']:.1%}" for name, n in hot["reasons"][:8]
                       if hot["total"])]
    out.append(f"{'#':>5} {'samples':>8} {'share':>6}  {'top reasons':<44} instruction")
    for r in hot["rows"]:
        why = ", ".join(f"{name.removeprefix('stall_')} {n:.0f}" for name, n in r["reasons"] if n)
        out.append(f"{r['index']:>5} {r['samples']:>8.0f} {r['share']:>6.1%}  {why:<44} {r['sass']}")
    return "\n".join(out)
