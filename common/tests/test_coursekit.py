"""Tests for the shared helpers: build decisions, the JIT helper's guards, results, reports."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "common"), str(ROOT / "tools")]
from coursekit import bench, build, jit, loader, results  # noqa: E402

import report  # noqa: E402


def test_use_cuda_1_fails_loudly_when_cuda_is_impossible(monkeypatch):
    monkeypatch.setenv("USE_CUDA", "1")
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(RuntimeError, match=r"\[pkg\] USE_CUDA=1 but a CUDA build is impossible"):
        build.cuda_decision("pkg")


def test_use_cuda_0_forces_cpu(monkeypatch):
    monkeypatch.setenv("USE_CUDA", "0")
    assert build.cuda_decision("pkg") == (False, "USE_CUDA=0 forces the CPU-only build")


def test_cpu_only_torch_builds_cpu_with_a_reason(monkeypatch):
    monkeypatch.delenv("USE_CUDA", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with_cuda, reason = build.cuda_decision("pkg")
    assert not with_cuda and "CPU-only build" in reason


@pytest.mark.parametrize("with_cuda", [False, True])
def test_debug_flags(with_cuda):
    flags = build.compile_flags(with_cuda, debug=True)
    assert flags["cxx"][:2] == ["-O0", "-g"]
    if with_cuda:
        # -G: device code unoptimized, for cuda-gdb; -G brings its own line table, and nvcc
        # warns when -lineinfo is given beside it.
        assert {"-O0", "-g", "-G", "-DWITH_CUDA"} <= set(flags["nvcc"])
        assert "-lineinfo" not in flags["nvcc"]
        assert "-lineinfo" in build.compile_flags(with_cuda, debug=False)["nvcc"]
    else:
        assert "nvcc" not in flags
    release = build.compile_flags(with_cuda, debug=False)["cxx"]
    # -g0 last among the -g flags: it overrides the -g of Python's CFLAGS, which setuptools puts first
    assert "-O3" in release and [f for f in release if f.startswith("-g")][-1:] == ["-g0"]


def test_jit_requires_ninja(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as cpp
    monkeypatch.setattr(cpp, "is_ninja_available", lambda: False)
    with pytest.raises(RuntimeError, match="Ninja is required to load C\\+\\+ extensions"):
        jit.load_chapter("x", tmp_path, [], [])


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_lock_of_a_dead_build_is_removed(tmp_path, capsys):
    (tmp_path / "lock").touch()
    (tmp_path / jit.OWNER_FILE).write_text(str(dead_pid()))
    jit.clear_stale_lock(tmp_path)
    assert not (tmp_path / "lock").exists()
    assert "removing stale lock" in capsys.readouterr().err


def test_lock_of_a_running_build_is_kept(tmp_path, capsys):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / "lock").touch()
        (tmp_path / jit.OWNER_FILE).write_text(str(sleeper.pid))
        jit.clear_stale_lock(tmp_path)
        assert (tmp_path / "lock").exists()
        assert f"another build (pid {sleeper.pid})" in capsys.readouterr().err
    finally:
        sleeper.kill()


def test_lock_without_owner_is_removed_with_explanation(tmp_path, capsys):
    (tmp_path / "lock").touch()
    jit.clear_stale_lock(tmp_path)
    assert not (tmp_path / "lock").exists()
    assert "no recorded owner" in capsys.readouterr().err


def test_pin_cuda_arch_keeps_a_user_choice(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.5;8.0")
    assert build.pin_cuda_arch() == "7.5;8.0"


def test_pin_cuda_arch_without_a_gpu_targets_the_supported_archs(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "")  # records the original value for teardown
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert build.pin_cuda_arch() == build.SUPPORTED_ARCHS == "7.5;8.0;9.0"


def test_results_file_follows_the_contract(monkeypatch, tmp_path):
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    monkeypatch.setenv("COURSE_GIT_COMMIT", "abc123")
    row = {"op": "vector_add", "variant": "v1", "dtype": "float32", "shape": [8],
           "median_ms": 1.0, "GBps": 2.0, "pct_of_copy": 50.0, "speedup_vs_torch": 0.5}
    path = results.write_results("chapterX", [row], {"copy_GBps": 4.0}, sizes={"big": 8})
    record = json.loads(path.read_text())
    for key in ("chapter", "device", "torch", "cuda", "commit", "date", "ceilings", "benchmarks"):
        assert key in record, key
    assert record["commit"] == "abc123" and record["benchmarks"] == [row]
    assert path.parent.name == results.device_slug()


def test_format_shape():
    assert results.format_shape([2**28]) == "2^28"
    assert results.format_shape([1823, 781]) == "1823x781"
    assert results.format_shape([1]) == "1"


def _row(variant, ms, **fields):
    return {"op": "vector_add", "variant": variant, "dtype": "float32", "shape": [1024],
            "sweep": True, "median_ms": ms, "GBps": 1.0 / ms, **fields}


def test_default_gaps_holds_the_default_to_the_best_rung():
    rungs = ("v1", "v2")
    record = {"benchmarks": [_row("torch", 1.0), _row("v1", 2.0), _row("v2", 1.0),
                             _row("default", 1.04, dispatch="v2"),
                             # another measurement: same op and dtype, another view
                             _row("v1", 1.0, view="x[1:]"), _row("default", 1.2, view="x[1:]",
                                                                 dispatch="v2")]}
    gaps = results.default_gaps(record, rungs)
    assert len(gaps) == 1 and "x[1:]" in gaps[0] and "0.833x the best rung (v1" in gaps[0]
    assert results.default_gaps(record, rungs, ratio=0.8) == []


def test_default_gaps_ignores_the_spread_of_the_rung_it_ran():
    record = {"benchmarks": [_row("v1", 2.0), _row("v2", 1.0), _row("default", 1.2, dispatch="v2")]}
    assert results.default_gaps(record, ("v1", "v2")) == []
    record["benchmarks"][-1]["dispatch"] = "v1"
    assert len(results.default_gaps(record, ("v1", "v2"))) == 1


def test_default_gaps_reports_results_without_a_default_as_stale():
    record = {"benchmarks": [_row("v1", 2.0), _row("v2", 1.0)]}
    assert results.default_gaps(record, ("v1", "v2")) == [
        "vector_add float32 2^10 sweep: no default row (results older than the dispatch?)"]


def test_rows_that_differ_only_in_figures_measured_the_same_thing():
    a = _row("v1", 1.0, reps=30, p10_ms=0.9)
    b = _row("default", 2.0, dispatch="v1", calls_per_replay=8)
    assert results.measurement_key(a) == results.measurement_key(b)
    assert results.measurement_key(a) != results.measurement_key(_row("v1", 1.0, view="x[1:]"))


def test_report_fills_inline_and_block_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("a <!-- results:x:begin -->old<!-- results:x:end --> b\n"
                      "<!-- results:t:begin -->\n<!-- results:t:end -->\n")
    assert report.replace_block(readme, "x", "new value")
    assert report.replace_block(readme, "t", "| table |")
    assert not report.replace_block(readme, "missing", "-")
    text = readme.read_text()
    assert "a <!-- results:x:begin -->new value<!-- results:x:end --> b" in text
    assert "<!-- results:t:begin -->\n| table |\n<!-- results:t:end -->" in text


def test_committed_readme_numbers_match_the_results_files():
    """Regenerating the README blocks from results/ must change nothing: no number in the
    READMEs was typed by hand or left stale."""
    before = {p: p.read_text() for p in ROOT.glob("**/README.md") if ".venv" not in p.parts}
    try:
        subprocess.run([sys.executable, str(ROOT / "tools" / "report.py")], check=True,
                       capture_output=True, env={**os.environ})
        changed = [str(p.relative_to(ROOT)) for p, text in before.items()
                   if p.read_text() != text]
    finally:
        for p, text in before.items():
            p.write_text(text)
    assert changed == [], f"run tools/report.py: stale numbers in {changed}"


def test_every_chapter_headline_picks_its_rows():
    """The top README's headline of each chapter is named on purpose (report.HEADLINES) and, where
    the results exist, picks exactly one row of the course's variant per dtype, with a PyTorch
    baseline measured beside it."""
    chapters = sorted(p.parent.name for p in ROOT.glob("chapter*/setup.py"))
    assert sorted(report.HEADLINES) == chapters
    for chapter, headlines in report.HEADLINES.items():
        for headline in headlines:
            record = results.load_recorded_gpu(headline.results)
            if record is None:
                continue
            picked = report.headline_rows(record, headline)
            assert picked, (chapter, headline.what)
            for dtype, (ours, base) in picked.items():
                same = [r for r in results.rows(record, **headline.match)
                        if r["dtype"] == dtype and r["variant"] == headline.ours and not r.get("call")]
                assert len(same) == 1, (chapter, headline.what, dtype, len(same))
                assert base is not None and report.is_baseline(base["variant"]), (chapter, dtype)


def test_baselines_are_pytorchs_rows_only():
    assert all(map(report.is_baseline, ("torch", "torch.compile", "torch.transpose(-2,-1)",
                                        "sdpa_flash", "sdpa_cudnn", "sdpa")))
    assert not any(map(report.is_baseline, ("torch_library", "default", "v1", "split_kv", "cpu")))


def test_loader_rejects_an_unknown_route(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_EXT_ROUTE", "pip")
    with pytest.raises(ImportError, match=r"nope: COURSE_EXT_ROUTE='pip'; use installed, jit or auto"):
        loader.load_extension("nope", "nope_namespace", tmp_path / "nope" / "__init__.py")


def test_loader_explains_a_missing_installed_build(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_EXT_ROUTE", "installed")
    (tmp_path / "nope").mkdir()
    with pytest.raises(ImportError, match=r"nope: no installed extension found; run `python -m pip install"):
        loader.load_extension("nope", "nope_namespace", tmp_path / "nope" / "__init__.py")


def test_check_arguments_names_the_op_and_the_argument():
    x = torch.randn(3, 4)
    loader.check_arguments("saxpy", alpha=(2.0, float), x=(x, torch.Tensor), y=(x, torch.Tensor))
    loader.check_arguments("sum", x=(x, torch.Tensor), dim=(None, (int, None)), keepdim=(False, bool))
    loader.check_arguments("default_choice", op=("sum", str), x=(x, torch.Tensor))  # an argument named op
    with pytest.raises(TypeError, match=r"^saxpy: alpha must be a number \(float\), got a tensor of dtype "
                                        r"float32 and shape \[3, 4\] on cpu \(the arguments, in order: alpha, x, y\)$"):
        loader.check_arguments("saxpy", alpha=(x, float), x=(x, torch.Tensor), y=(x, torch.Tensor))
    # A one-element tensor too: its value lives on its device.
    with pytest.raises(TypeError, match=r"alpha must be a number \(float\), got a tensor of dtype float32 and shape \[\]"):
        loader.check_arguments("saxpy", alpha=(torch.tensor(2.0), float))
    with pytest.raises(TypeError, match=r"^relu: x must be a tensor, got a float "):
        loader.check_arguments("relu", x=(2.0, torch.Tensor))
    with pytest.raises(TypeError, match=r"dim must be an integer or None, got a float"):
        loader.check_arguments("sum", dim=(1.0, (int, None)))


def test_untrusted_rows_are_flagged_and_printed_without_figures(capsys):
    steady = {"median_ms": 1.0, "min_ms": 0.9, "max_ms": 1.2, "p10_ms": 0.95, "p90_ms": 1.1, "reps": 20}
    slowed = {**steady, "median_ms": 6.0, "p90_ms": 18.0}
    good = bench.bandwidth_row("copy", "torch", torch.float32, [8], 8e6, steady, ceiling_GBps=10.0)
    noisy = bench.bandwidth_row("copy", "cpu", torch.float32, [8], 8e6, slowed, ceiling_GBps=10.0)
    cached = bench.bandwidth_row("copy", "v1", torch.float32, [8], 8e6, steady, ceiling_GBps=1.0)
    assert "untrusted" not in good
    assert "median is 6.3x the fastest tenth" in noisy["untrusted"]
    assert "8.0x the ceiling" in cached["untrusted"]
    assert bench.untrusted(slowed) and not bench.untrusted(steady)
    record = {"ceilings": {"copy_GBps": 10.0, "copy_untrusted": "reason"}, "benchmarks": [good, noisy, cached]}
    shown = results.for_print(record)
    assert shown["benchmarks"][0] == good and record["benchmarks"][1]["GBps"] == noisy["GBps"]
    assert all(f"{r['GBps']:8.0f}".strip() == "nan" for r in shown["benchmarks"][1:])
    results.print_untrusted(record)
    out = capsys.readouterr().out
    assert "the copy ceiling cannot be trusted: reason" in out
    assert "2 of 3 rows printed as nan" in out and "copy float32 2^3 cpu: the median" in out


def test_benchmarks_pin_torch_threads_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = torch.get_num_threads()
    try:
        args = bench.arguments("doc").parse_args([])
        assert bench.setup(args) == "cpu" and torch.get_num_threads() == bench.CPU_THREADS == 1
        torch.set_num_threads(before)
        bench.setup(bench.arguments("doc").parse_args(["--threads", "0"]))  # 0: torch's own choice
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_cpu_run_is_drawn_beside_the_recorded_gpu_run(monkeypatch, tmp_path):
    from coursekit import plots
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    row = {"op": "copy", "variant": "torch", "dtype": "float32", "shape": [8], "GBps": 1.0}

    def record(name, capability, date):
        return {"device": {"name": name, "capability": capability}, "date": date,
                "ceilings": {"copy_GBps": 2.0}, "benchmarks": [row]}

    gpu = record("NVIDIA H100", "9.0", "2026-11-01T00:00:00+00:00")
    (tmp_path / "nvidia-h100").mkdir()
    (tmp_path / "nvidia-h100" / "chapterX.json").write_text(json.dumps(gpu))
    drawn = []

    def panel(ax, shown):
        drawn.append(shown["device"]["name"])
        ax.set_title(results.label(shown))

    cpu = record("CPU x86_64", None, "2026-11-02T00:00:00+00:00")
    (path,) = plots.cpu_vs_recorded(cpu, tmp_path, "chapterX", panel)
    assert path.name == "chapterX_cpu_vs_recorded.png" and path.exists()
    assert drawn == ["CPU x86_64", "NVIDIA H100"]
    assert plots.cpu_vs_recorded(gpu, tmp_path, "chapterX", panel) == []  # a GPU run: nothing
    assert plots.cpu_vs_recorded(cpu, tmp_path, "chapterY", panel) == []  # nothing recorded


def test_every_benchmark_draws_the_cpu_run_beside_the_recorded_one():
    """The README promises <chapter>_cpu_vs_recorded.png for every chapter on a CPU run."""
    for script in sorted(ROOT.glob("chapter*/bench_*.py")):
        assert "plots.cpu_vs_recorded(" in script.read_text(), script.relative_to(ROOT)


def test_test_job_reports_files_it_left_in_the_tree(monkeypatch, tmp_path):
    import course
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    monkeypatch.setattr(course, "ROOT", tmp_path)
    monkeypatch.setattr(course, "LOG_DIR", tmp_path / "logs")
    (tmp_path / ".gitignore").write_text("logs/\n")
    (tmp_path / "mine.txt").write_text("there before\n")
    steps = course.Steps()
    before = course.tree_status()
    course.check_tree_unchanged(steps, before)
    (tmp_path / "chapter").mkdir()
    (tmp_path / "chapter" / "x-0.1-cp310-abi3-linux_x86_64.whl").write_text("")
    course.check_tree_unchanged(steps, before)
    assert steps.table[0][1] == "ok"
    assert steps.table[1][1] == "FAILED (1 new)" and "chapter/x-0.1" in steps.table[1][3]


def test_main_job_prints_a_line_per_step_and_keeps_the_output_in_the_log(monkeypatch, tmp_path, capsys):
    import course
    monkeypatch.setattr(course, "LOG_DIR", tmp_path)
    steps = course.Steps(brief=True)
    assert steps.run("table", [sys.executable, "-c", "for i in range(50): print('row', i)"], echo=True)
    out = capsys.readouterr().out
    assert out.startswith("table ... ok in ") and out.count("\n") == 1, out
    assert (tmp_path / "table.log").read_text().count("row") == 50
    assert not steps.run("broken", [sys.executable, "-c", "print('why'); raise SystemExit(3)"])
    out = capsys.readouterr().out
    assert "broken ... FAILED (3)" in out and "why" in out  # a failure shows its last lines


def test_the_nvcc_sweep_compiles_each_target_whose_code_differs(monkeypatch, tmp_path):
    """sweep_archs: sm_75 always; sm_80 and sm_90 only where a __CUDA_ARCH__ test in the file or a
    header of the repository it includes falls between them; sm_90a for the Hopper files."""
    import course
    monkeypatch.setattr(course, "ROOT", tmp_path)
    inc = tmp_path / "include"
    (inc / "hopper").mkdir(parents=True)
    (inc / "ampere.cuh").write_text("#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800\n#endif\n")
    (inc / "hopper" / "feature.cuh").write_text('#include "../ampere.cuh"\n#if __CUDA_ARCH__ == 900\n#endif\n')
    files = {
        "plain.cu": '#include <cuda_bf16.h>\n#include "missing_elsewhere.h"\n',
        "ampere.cu": '#include "ampere.cuh"\n',
        "turing.cu": "#if __CUDA_ARCH__ < 800\n#endif\n",
        "after_ampere.cu": "#if __CUDA_ARCH__ > 800\n#endif\n",
        "hopper/kernel.cu": '#include "hopper/feature.cuh"\n',
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    archs = {name: course.sweep_archs(tmp_path / name, [str(inc)]) for name in files}
    assert archs == {"plain.cu": ["75"], "ampere.cu": ["75", "80"], "turing.cu": ["75", "80"],
                     "after_ampere.cu": ["75", "90"], "hopper/kernel.cu": ["75", "80", "90a"]}
    # A chapter with Hopper files builds 9.0a in place of 9.0: sm_90 becomes sm_90a, and a file
    # that no test separates from sm_80 gets neither.
    archs = {name: course.sweep_archs(tmp_path / name, [str(inc)], hopper_chapter=True) for name in files}
    assert archs == {"plain.cu": ["75"], "ampere.cu": ["75", "80"], "turing.cu": ["75", "80"],
                     "after_ampere.cu": ["75", "90a"], "hopper/kernel.cu": ["75", "80", "90a"]}


def test_the_nvcc_sweep_reports_each_file_and_the_target_that_failed(monkeypatch, tmp_path, capsys):
    """NvccSweep with a stand-in nvcc that fails for sm_80: one row a file, the failing one named
    with its target, its log's lines printed; the host side (-c) only for a file's first target."""
    import course
    chapter = tmp_path / "chapter9_x"
    chapter.mkdir()
    (chapter / "a.cu").write_text("#if __CUDA_ARCH__ >= 800\n#endif\n")
    (chapter / "b.cu").write_text("\n")
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho \"$@\" >> " + str(tmp_path / "calls.txt") +
                    "\ncase \"$*\" in *compute_80*) echo 'ptxas error: sm_80 broke'; exit 2;; esac\n")
    fake.chmod(0o755)
    monkeypatch.setattr(course, "ROOT", tmp_path)
    monkeypatch.setattr(course, "LOG_DIR", tmp_path / "logs")
    monkeypatch.setattr(course, "chapters", lambda: [chapter])
    monkeypatch.setattr(course, "include_dirs", lambda c: [])
    monkeypatch.setattr(course.shutil, "which", lambda name: str(fake) if name == "nvcc" else None)
    steps = course.Steps()
    sweep = course.NvccSweep()
    sweep.start()
    sweep.finish(steps)
    rows = {row[0]: row[1] for row in steps.table}
    assert rows == {"nvcc chapter9_x/a.cu sm_75,sm_80": "FAILED (2)", "nvcc chapter9_x/b.cu sm_75": "ok"}
    out = capsys.readouterr().out
    assert "chapter9_x/a.cu sm_80 FAILED (2)" in out and "sm_80 broke" in out
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert sorted(c.split()[0] for c in calls) == ["-c", "-c", "-cubin"]
    # sm_75 and sm_80 with the device optimizer off; sm_90a (the wgmma kernels) with cicc at -O1,
    # the lowest level at which it compiles them, and ptxas off.
    assert all("-Xcicc -O0 -Xptxas -O0" in c for c in calls), calls
    assert course.SWEEP_DEVICE_FLAGS["90a"] == ["-Xcicc", "-O1", "-Xptxas", "-O0"]
