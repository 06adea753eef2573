"""Regenerate the tables in README.md and each chapter README from results/ and print them.

Tables live between marker comments (<!-- results:... -->); everything between the markers is
overwritten, so no number in them is ever typed by hand.
"""
import ast
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "common"))
from coursekit import results  # noqa: E402


def chapter_summary(chapter_dir):
    """First docstring line of the chapter's Python package: what the chapter teaches."""
    for init in sorted(chapter_dir.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if doc:
            return doc.splitlines()[0]
    return ""


def course_rows(record):
    """The rows of the chapter's table: bandwidth against the copy ceiling. Sweeps go to the
    plots; rows of another kind (chapter 5's host-side call overhead and timing methods) to the
    lesson's own tables."""
    return [r for r in record["benchmarks"] if not r.get("sweep") and "pct_of_copy" in r]


def is_baseline(variant):
    """PyTorch's own rows (CONTRIBUTING.md, section 5): eager, torch.compile, the SDPA backends."""
    return variant.startswith("torch") or variant.startswith("sdpa_")


def best_rows(rows):
    """For each (op, dtype, shape, view) of `rows`: the fastest rung of the ladder (not the
    default dispatch, which runs one of them), and the torch baseline."""
    groups = {}
    for r in rows:
        groups.setdefault((r["op"], r["dtype"], tuple(r["shape"]), r.get("view")), []).append(r)
    out = []
    for key, rs in groups.items():
        ours = [r for r in rs if not is_baseline(r["variant"]) and r["variant"] != "default"]
        base = next((r for r in rs if r["variant"] == "torch" and not r.get("call")), None)
        if ours:
            out.append((key, max(ours, key=lambda r: r.get("GBps", r.get("TFLOPs", 0))), base))
    return out


def headline(record):
    """The chapter's headline op (record["headline_op"], else the first op) at its first
    measured shape, every dtype, forward pass: best course version against PyTorch. A headline
    op measured only in sweeps (chapter 3's softmax) takes its sweep rows."""
    forward = [r for r in record["benchmarks"] if r.get("pass", "forward") == "forward"]
    rows = [r for r in forward if not r.get("sweep")]
    op = record.get("headline_op", rows[0]["op"])
    if not any(r["op"] == op for r in rows):
        rows = [r for r in forward if r["op"] == op]
    best = best_rows(rows)
    shape = next(key[2] for key, _, _ in best if key[0] == op and key[3] is None)
    baseline = record.get("baseline", "PyTorch")

    def figure(r):
        if "TFLOPs" in r:  # compute-bound rows (chapter 6): against the matmul ceiling
            return (f"{r['TFLOPs']:.0f} TFLOP/s ({r['pct_of_mm']:.0f}% of matmul, "
                    f"{r['speedup_vs_torch']:.2f}x {baseline})")
        return (f"{r['GBps']:.0f} GB/s ({r['pct_of_copy']:.0f}% of copy, "
                f"{r['speedup_vs_torch']:.2f}x {baseline})")
    parts = [f"{key[1]} {r['variant']} {figure(r)}"
             for key, r, _ in best if key[0] == op and key[2] == shape and key[3] is None]
    return f"`{op}` {results.format_shape(shape)}: " + "; ".join(parts)


def course_table():
    lines = ["| chapter | what you learn | best kernel vs PyTorch (GPU, date) |", "|---|---|---|"]
    for chapter in sorted(p.parent for p in ROOT.glob("chapter*/setup.py")):
        record = results.load_recorded_gpu(chapter.name)
        best = f"{headline(record)} ({results.label(record)})" if record else "not measured yet"
        lines.append(f"| [{chapter.name}]({chapter.name}/README.md) | "
                     f"{chapter_summary(chapter)} | {best} |")
    return "\n".join(lines)


def chapter_table(record):
    lines = [f"Measured on {results.label(record)}, torch {record['torch']}, CUDA "
             f"{record['cuda']}, commit `{record['commit'][:12]}`; copy ceiling measured in the "
             f"same run: **{record['ceilings']['copy_GBps']:.0f} GB/s**.", "",
             "| op | dtype | size | variant | median ms | GB/s | % of copy | x PyTorch |",
             "|---|---|---|---|---|---|---|---|"]
    for r in course_rows(record):
        bold = "**" if r["variant"].startswith("torch") else ""
        size = results.format_shape(r["shape"]) + (
            f" ({r['view']} of {results.format_shape(r.get('base_shape', r['shape']))})"
            if r.get("view") else "")
        variant = r["variant"] + (f" -> {r['dispatch']}" if r.get("dispatch") else "")
        # What tells apart rows of one op, dtype and size: the pass, what was saved for it,
        # the activation when it is not the op's own name.
        details = [d for d in (r.get("pass") if r.get("pass") == "backward" else None,
                               f"save={r['save']}" if "save" in r else None,
                               r.get("activation") if r.get("activation", r["op"]) != r["op"] else None) if d]
        op = r["op"] + (f" ({', '.join(details)})" if details else "")
        lines.append(f"| {op} | {r['dtype']} | {size} | "
                     f"{bold}{variant}{bold} | {r['median_ms']:.3f} | {r['GBps']:.0f} | "
                     f"{r['pct_of_copy']:.1f} | {r['speedup_vs_torch']:.3f} |")
    if "build" in record:
        b = record["build"]
        lines += ["", f"JIT build of the chapter (ninja, MAX_JOBS={b['max_jobs']}, "
                  f"TORCH_CUDA_ARCH_LIST={b['arch_list']}, no ccache): cold **{b['cold_s']:.1f} s**, "
                  f"reload with nothing changed **{b['cached_s']:.2f} s**, after touching the "
                  f"`.cu` **{b['touched_cu_s']:.1f} s**."]
    return "\n".join(lines)


def replace_block(path, name, text):
    """Fill a marker block. A block on one line (inside a sentence) stays on one line."""
    begin, end = f"<!-- results:{name}:begin -->", f"<!-- results:{name}:end -->"
    if not path.exists():
        return False
    src = path.read_text()
    pattern = re.compile(re.escape(begin) + r"(.*?)" + re.escape(end), re.S)
    match = pattern.search(src)
    if not match:
        return False
    sep = "\n" if "\n" in match.group(1) or "\n" in text else ""
    path.write_text(pattern.sub(lambda _: f"{begin}{sep}{text}{sep}{end}", src))
    return True


def lesson_facts(chapter):
    """The chapter's FACTS table (lesson_facts.py), if it has one."""
    path = chapter / "lesson_facts.py"
    if not path.exists():
        return {}
    spec = importlib.util.spec_from_file_location(f"{chapter.name}_lesson_facts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FACTS


def main():
    table = course_table()
    print(table)
    replace_block(ROOT / "README.md", "chapters", table)
    for chapter in sorted(p.parent for p in ROOT.glob("chapter*/setup.py")):
        record = results.load_recorded_gpu(chapter.name)
        if record:
            text = chapter_table(record)
            replace_block(chapter / "README.md", "table", text)
            # Facts may also quote the chapter's hardware-counter profile, its launch-shape
            # tuning, its build lab and its packaging check, when there are such results.
            record = {**record, "profile": results.load_recorded_gpu(f"{chapter.name}_profile"),
                      "tuning": results.load_recorded_gpu(f"{chapter.name}_tuning"),
                      "build_lab": results.load_recorded_gpu(f"{chapter.name}_build"),
                      "packaging": results.load_recorded_gpu(f"{chapter.name}_packaging")}
            for name, fact in lesson_facts(chapter).items():
                replace_block(chapter / "README.md", name, fact(record))
            print(f"\n{chapter.name}\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
