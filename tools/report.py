"""Regenerate the tables in README.md and each chapter README from results/ and print them.

Tables live between marker comments (<!-- results:... -->); everything between the markers is
overwritten, so no number in them is ever typed by hand.
"""
import ast
import dataclasses
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
    """PyTorch's own rows (CONTRIBUTING.md, section 5): eager ("torch", or "torch.<call>" where a
    chapter times another PyTorch entry point), torch.compile, the SDPA backends; not chapter 5's
    "torch_library" route, which is the course's."""
    return variant == "torch" or variant.startswith(("torch.", "sdpa"))


@dataclasses.dataclass(frozen=True)
class Headline:
    """One measurement the top README quotes for a chapter: the results file it is in, how the
    table names it, the fields that pick its rows out of the file (a field set to None must be
    absent), and which variant is the course's: version=None ("default") wherever the chapter
    has a dispatch."""
    results: str
    what: str
    match: dict
    ours: str = "default"


# Each chapter's headline, chosen on purpose: its most representative large shape, forward pass,
# every dtype measured there. Chapter 5 has no dispatch (its three routes run one kernel): its
# headline is the TORCH_LIBRARY route, the one the course recommends. Chapter 6 quotes both
# halves, training attention and serving decode.
HEADLINES = {
    "chapter1_cuda_basics": [Headline(
        "chapter1_cuda_basics", "`vector_add`, 2^28 elements",
        {"op": "vector_add", "shape": [2**28], "pass": "forward", "sweep": False, "view": None})],
    "chapter2_memory": [Headline(
        "chapter2_memory", "`transpose`, 16384 x 16384",
        {"op": "transpose", "shape": [16384, 16384], "pass": "forward", "sweep": False, "view": None})],
    "chapter3_shared_reduction": [Headline(
        "chapter3_shared_reduction", "`softmax`, 65536 rows of 4096",
        {"op": "softmax", "shape": [65536, 4096], "pass": "forward", "dim": -1})],
    "chapter4_fusion": [Headline(
        "chapter4_fusion", "`fused_bias_scale_relu` forward, 16384 x 16384",
        {"op": "fused_bias_scale_relu", "shape": [16384, 16384], "pass": "forward", "save": "mask",
         "sweep": False})],
    "chapter5_pytorch_extensions": [Headline(
        "chapter5_pytorch_extensions", "`fused_op` forward, 16384 x 16384",
        {"op": "fused_op", "shape": [16384, 16384], "pass": "forward"}, ours="torch_library")],
    "chapter6_flash_attention": [
        Headline("chapter6_flash_attention",
                 "`attention` forward, batch 4 x 16 heads x seqlen 4096 x head_dim 128",
                 {"op": "attention", "shape": [4, 16, 4096, 128], "pass": "forward", "causal": False}),
        Headline("chapter6_paged_attention",
                 "`paged_attention` decode, batch 64 x context 4096, 32/8 heads, head_dim 128",
                 {"op": "paged_attention", "sweep": "targets", "config": "a"})],
}


def headline_rows(record, headline):
    """{dtype: (the course's row, PyTorch's fastest row there or None)} for one headline."""
    found = {}
    for r in results.rows(record, **headline.match):
        found.setdefault(r["dtype"], []).append(r)
    out = {}
    for dtype, rows in found.items():
        ours = next((r for r in rows if r["variant"] == headline.ours and not r.get("call")), None)
        baselines = [r for r in rows if is_baseline(r["variant"])]
        if ours:
            out[dtype] = (ours, min(baselines, key=lambda r: r["median_ms"]) if baselines else None)
    return out


def headline_text(record, headline):
    """"what: dtype variant rate (share of the ceiling, x the fastest baseline); ..." """
    parts = []
    for dtype, (ours, base) in headline_rows(record, headline).items():
        if "TFLOPs" in ours:  # compute-bound rows (attention): against the matmul ceiling
            rate = f"{ours['TFLOPs']:.0f} TFLOP/s ({ours['pct_of_mm']:.0f}% of matmul"
        else:
            rate = f"{ours['GBps']:.0f} GB/s ({ours['pct_of_copy']:.0f}% of copy"
        against = f", {base['median_ms'] / ours['median_ms']:.2f}x {results.column(base)}" if base else ""
        parts.append(f"{dtype} {ours['variant']} {rate}{against})")
    return f"{headline.what}: " + "; ".join(parts) + f" ({results.label(record)})"


def course_table():
    lines = ["| chapter | what you learn | headline: the course's kernel against PyTorch's fastest there (GPU, date) |",
             "|---|---|---|"]
    for chapter in sorted(p.parent for p in ROOT.glob("chapter*/setup.py")):
        quoted = []
        for headline in HEADLINES.get(chapter.name, []):
            record = results.load_recorded_gpu(headline.results)
            if record and headline_rows(record, headline):
                quoted.append(headline_text(record, headline))
        lines.append(f"| [{chapter.name}]({chapter.name}/README.md) | {chapter_summary(chapter)} | "
                     f"{'<br>'.join(quoted) or 'not measured yet'} |")
    return "\n".join(lines)


def speedup(row):
    # A baseline timed before the row it divides by (chapter 6's sdpa_flash, before sdpa_cudnn)
    # has no speedup of its own.
    return f"{row['speedup_vs_torch']:.3f}" if "speedup_vs_torch" in row else "-"


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
                     f"{r['pct_of_copy']:.1f} | {speedup(r)} |")
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
