"""Results files: results/<device-slug>/<chapter>.json, written only by benchmark code.
The contract (CONTRIBUTING.md, section 5): chapter, device, torch, cuda, commit, date,
ceilings, benchmarks; anything else is extra."""
import datetime
import json
import os
import re
import subprocess
import time

import torch

from . import REPO_ROOT
from .bench import device_info

RESULTS_DIR = REPO_ROOT / "results"


def device_slug(info=None):
    info = info or device_info()
    slug = re.sub(r"[^a-z0-9]+", "-", info["name"].lower()).strip("-")
    # CPU names start with "cpu": results/cpu-*/ is a learner's own run, kept out of git.
    return slug


def git_commit():
    """HEAD (with -dirty for uncommitted changes to tracked files); COURSE_GIT_COMMIT when the
    tree was copied without its .git (as on a remote GPU machine)."""
    if os.environ.get("COURSE_GIT_COMMIT"):
        return os.environ["COURSE_GIT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_results(chapter, benchmarks, ceilings, **extra):
    info = device_info()
    record = {
        "chapter": chapter,
        "device": info,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ceilings": ceilings,
        "benchmarks": benchmarks,
        **extra,
    }
    out_dir = RESULTS_DIR / device_slug(info)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{chapter}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def publish(chapter, rows, ceilings, extra, make_figures, print_table):
    """The end of every benchmark: the results file, the figures drawn from it (from the file,
    as the notebooks draw them), the table printed (with no figure for a row the harness could
    not trust), and where it all went."""
    path = write_results(chapter, rows, ceilings, **extra)
    record = json.loads(path.read_text())
    figures = make_figures(record, path.parent)
    print_table(for_print(record))
    print_untrusted(record)
    print("wrote", path, *figures, sep="\n  ")
    return record


# A row's figures: what for_print blanks out when bench.untrusted gave a reason (the last three:
# chapter 5's call-overhead rows).
FIGURES = ("median_ms", "min_ms", "max_ms", "p10_ms", "p90_ms", "GBps", "pct_of_copy", "TFLOPs",
           "pct_of_mm", "speedup_vs_torch", "us_per_call", "us_over_native", "gpu_us_per_call")


def for_print(record):
    """The record as a table should show it: every row marked `untrusted` with its figures set to
    NaN, which any number format prints as `nan`, where a number would mislead. The results file
    keeps the measured numbers and the reason."""
    blank = {k: float("nan") for k in FIGURES}
    return {**record, "benchmarks": [{**r, **{k: v for k, v in blank.items() if k in r}}
                                     if r.get("untrusted") else r for r in record["benchmarks"]]}


def print_untrusted(record, show=8):
    """Say which rows a table printed as `nan`, and why (the first `show` of them)."""
    for key, reason in record.get("ceilings", {}).items():
        if key.endswith("_untrusted"):
            print(f"\nthe {key.removesuffix('_untrusted')} ceiling cannot be trusted: {reason}; every "
                  "% of it printed is suspect")
    flagged = [r for r in record["benchmarks"] if r.get("untrusted")]
    if not flagged:
        return
    print(f"\n{len(flagged)} of {len(record['benchmarks'])} rows printed as nan: the harness cannot trust "
          "their figures (the results file keeps them, with the reason in `untrusted`):")
    for r in flagged[:show]:
        print(f"  {r['op']} {r['dtype']} {format_shape(r['shape'])} {column(r)}: {r['untrusted']}")
    if len(flagged) > show:
        print(f"  ... and {len(flagged) - show} more")


def publish_or_print(chapter, rows, extra, make_figures, print_table, write=True):
    """publish() for the end-to-end scripts (a training run, a generator): no ceilings, and a
    results folder that cannot be written (or write=False, their --no-save) is reported, not
    raised, so that the run's verdict and exit status stand; the table is printed either way."""
    if write:
        try:
            return publish(chapter, rows, {}, extra, make_figures, print_table)
        except OSError as e:
            print(f"could not write results under {RESULTS_DIR}: {e}")
    record = {"device": device_info(), "date": time.strftime("%Y-%m-%d"), "benchmarks": rows, **extra}
    print_table(record)
    return record


def load_all(chapter, include_cpu=False):
    """Every recorded results file of a chapter, newest first: [(slug, record)]."""
    found = []
    for path in sorted(RESULTS_DIR.glob(f"*/{chapter}.json")):
        slug = path.parent.name
        if slug.startswith("cpu-") and not include_cpu:
            continue
        found.append((slug, json.loads(path.read_text())))
    return sorted(found, key=lambda sr: sr[1]["date"], reverse=True)


def load_recorded_gpu(chapter):
    """The newest GPU results of a chapter (what a CPU-only machine plots), or None."""
    found = load_all(chapter)
    return found[0][1] if found else None


def rows(record, **match):
    return [r for r in record["benchmarks"] if all(r.get(k) == v for k, v in match.items())]


def subset(record, **match):
    """A copy of the record with only the rows matching every field: what a plot of one panel
    is given."""
    return {**record, "benchmarks": rows(record, **match)}


def format_shape(shape):
    """[268435456] -> "2^28", [1823, 781] -> "1823x781"."""
    return "x".join(f"2^{n.bit_length() - 1}" if n > 1 and n & (n - 1) == 0 else str(n)
                    for n in shape)


def label(record):
    return f"{record['device']['name']}, {record['date'][:10]}"


# Fields of a row that are figures or bookkeeping, not part of what was measured: two rows
# that differ only in these (and the variant) measured the same thing (CONTRIBUTING.md, section 5).
FIGURE_FIELDS = {"variant", "dispatch", "median_ms", "min_ms", "max_ms", "p10_ms", "p90_ms",
                 "reps", "GBps", "pct_of_copy", "speedup_vs_torch", "calls_per_replay",
                 "input_sets", "TFLOPs", "pct_of_mm", "repeat", "other_median_ms", "timer",
                 "untrusted"}


def column(row):
    """A row's name in a table or legend: its variant, and the call it timed when the row
    times another entry point than the variant's usual one ("default (autograd)",
    "torch (F.linear)"); `call` is a measurement field, so such rows have groups of their own."""
    return row["variant"] + (f" ({row['call']})" if row.get("call") else "")


def measurement_key(row):
    """What a row measured (op, dtype, shape, pass, view, sweep, ...), without its figures."""
    return tuple(sorted((k, repr(v)) for k, v in row.items() if k not in FIGURE_FIELDS))


def default_gaps(record, rungs, ratio=0.95, ops=None):
    """Where version=None falls short: every measurement of `rungs` (of the ops named in
    `ops`, default all) with no "default" row beside it (stale results), or whose default ran
    another rung than the fastest and is slower than `ratio` x it. Returns a list of human-readable problems; empty
    means the dispatch held everywhere."""
    groups = {}
    for r in record["benchmarks"]:
        if ops is None or r["op"] in ops:
            groups.setdefault(measurement_key(r), []).append(r)
    problems = []
    for rows in groups.values():
        measured = [r for r in rows if r["variant"] in rungs]
        if not measured:
            continue
        first = measured[0]
        where = f"{first['op']} {first['dtype']} {format_shape(first['shape'])}" + (
            f" ({first['view']} of {format_shape(first.get('base_shape', first['shape']))})"
            if first.get("view") else "") + (
            f" {first['pass']}" if first.get("pass") else "") + (" sweep" if first.get("sweep") else "")
        default = next((r for r in rows if r["variant"] == "default"), None)
        if default is None:
            problems.append(f"{where}: no default row (results older than the dispatch?)")
            continue
        best = min(measured, key=lambda r: r["median_ms"])
        # A default that ran the best rung itself chose right; a gap between the two rows is
        # the spread of one kernel timed twice (a power-limited GEMM's clock, for one).
        if default.get("dispatch") == best["variant"]:
            continue
        if best["median_ms"] / default["median_ms"] < ratio:
            problems.append(f"{where}: default ({default.get('dispatch', '?')}) "
                            f"{default['median_ms'] * 1e3:.2f} us is "
                            f"{best['median_ms'] / default['median_ms']:.3f}x the best rung "
                            f"({best['variant']}, {best['median_ms'] * 1e3:.2f} us)")
    return problems
