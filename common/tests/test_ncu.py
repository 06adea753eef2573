"""Tests of coursekit.ncu on the CPU, the Nsight Compute driver of every chapter's profile_*.py:
how it reads ncu's CSV, gives each call of a workload its kernels by marker, names the metrics
ncu rejects and runs again without them, and that a script without a GPU or without ncu says so
and writes nothing. The ncu text here is written by hand in the format `ncu --csv --print-units
base --metrics ...` prints (the details page: one line per kernel and metric)."""
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "common"))
from coursekit import ncu  # noqa: E402
from coursekit.pytest_plugin import FakeNcu  # noqa: E402

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')
MARKER_NAME = "at::cuda::<unnamed>::spin_kernel(long)"
KERNEL = "void chapter::tiled_kernel<__nv_bfloat16, 128>(chapter::Params)"
METRICS = {"gpu__time_duration.sum": "duration_ns",
           "launch__shared_mem_per_block_dynamic": "smem_dynamic_bytes",
           "launch__registers_per_thread": "registers",
           "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": "smem_ld_bank_conflicts",
           "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pipe_pct",
           "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor_gmma_pipe_pct",
           "smsp__inst_executed_op_ldsm.sum": "ldsm_instructions"}
GMMA = "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"


def csv_line(kid, kernel, metric, unit, value):
    return (f'"{kid}","4242","python3.12","127.0.0.1","{kernel}","1","7","(256, 1, 1)","(16, 64, 1)","0",'
            f'"9.0","Command line profiler metrics","{metric}","{unit}","{value}"\n')


# Two kernels, out of order, between ncu's and the application's own lines: a value with a
# thousands separator, one ncu could not collect (n/a), a time in microseconds and a size in
# Kbyte (as --print-units auto would print them), and a metric the script does not name.
TWO_KERNELS = ('==PROF== Connected to process 4242 (/usr/bin/python3.12)\n'
               'profile_x: something the application printed\n' + HEADER
               + csv_line(1, KERNEL, "gpu__time_duration.sum", "usecond", "1.50")
               + csv_line(1, KERNEL, "launch__shared_mem_per_block_dynamic", "Kbyte/block", "49.152")
               + csv_line(0, MARKER_NAME, "gpu__time_duration.sum", "nsecond", "2,112")
               + csv_line(0, MARKER_NAME, "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum", "", "1,024")
               + csv_line(0, MARKER_NAME, "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                          "%", "n/a")
               + csv_line(0, MARKER_NAME, "smsp__cycles_active.avg", "cycle", "17")
               + '==PROF== Disconnected from process 4242\n')


def test_csv_rows_become_kernels_in_launch_order():
    marker, kernel = ncu.parse_csv(TWO_KERNELS, METRICS)
    assert (marker["kernel"], kernel["kernel"]) == (MARKER_NAME, KERNEL)
    assert marker["duration_ns"] == 2112.0                # "2,112" nsecond
    assert marker["smem_ld_bank_conflicts"] == 1024.0     # short name, separator dropped
    assert "tensor_pipe_pct" in marker and marker["tensor_pipe_pct"] is None  # n/a
    assert marker["smsp__cycles_active.avg"] == 17.0      # unnamed metrics keep ncu's name
    assert kernel["duration_ns"] == pytest.approx(1500.0)  # 1.50 usecond
    assert kernel["smem_dynamic_bytes"] == pytest.approx(49152.0)  # 49.152 Kbyte/block, decimal
    assert "registers" not in kernel                      # never reported: absent, not None


def test_text_without_a_header_has_no_kernels():
    assert ncu.parse_csv("==PROF== Connected to process 1\n==ERROR== something\n", METRICS) == []


@pytest.mark.parametrize("text,unit,expected", [
    ("1,024", "", 1024.0), ("3.5", "%", 3.5), ("n/a", "%", None), ("", "byte", None),
    ("2", "msecond", 2e6), ("1.5", "Mbyte", 1.5e6), ("7", "register/thread", 7.0),
    ("8", "byte/block", 8.0)])
def test_values_are_read_in_base_units(text, unit, expected):
    assert ncu.parse_value(text, unit) == expected


def k(name):
    return {"kernel": name}


def test_each_call_gets_the_kernels_after_its_marker():
    m, a, b, c, d = k(MARKER_NAME), k("pre"), k("main"), k("post"), k(KERNEL)
    assert ncu.split_by_marker([m, a, b, c, m, d], ["backward", "forward"]) == [[a, b, c], [d]]


@pytest.mark.parametrize("kernels,labels,message", [
    ([k(KERNEL), k(MARKER_NAME), k(KERNEL)], ["x"], "before the first marker"),
    ([k(MARKER_NAME), k(KERNEL)], ["x", "y"], "1 markers .* 2 calls"),
    ([k(MARKER_NAME), k(KERNEL), k(MARKER_NAME)], ["x", "y"], "y: no kernel"),
])
def test_a_profile_that_disagrees_with_the_plan_is_refused(kernels, labels, message):
    with pytest.raises(ValueError, match=message):
        ncu.split_by_marker(kernels, labels)


def test_ncu_named_metrics_are_found_by_full_or_base_name():
    out = ("==PROF== Connected to process 1\n"
           f"==ERROR== Failed to find metric {GMMA}\n"
           "==WARNING== Metric smsp__inst_executed_op_ldsm is not available on this device\n"
           "launch__registers_per_thread mentioned outside an ncu message\n"
           "==ERROR== unknown metric sm__inst_executed_pipe_alu_heavy\n")
    assert ncu.rejected_metrics(out, METRICS) == [GMMA, "smsp__inst_executed_op_ldsm.sum"]
    assert ncu.metric_error(out) and not ncu.metric_error("==ERROR== ERR_NVGPUCTRPERM - no permission\n")


def test_ncu_version_line():
    text = ("NVIDIA (R) Nsight Compute Command Line Profiler\nCopyright (c) 2018-2025 NVIDIA Corporation\n"
            "Version 2025.3.0.0 (build 36273991) (public-release)\n")
    assert ncu.ncu_version(text) == "Version 2025.3.0.0 (build 36273991) (public-release)"


def test_the_command_filters_kernels_only_when_asked():
    cmd = ncu.command("/opt/ncu/ncu", ["a.sum", "b.sum"], "profile_x.py", ["--only", "fwd"], kernel_regex="x::",
                      from_start=False)
    assert cmd[:6] == ["/opt/ncu/ncu", "--csv", "--print-units", "base", "--clock-control", "none"]
    assert cmd[cmd.index("--kernel-name") + 1] == "regex:x::" and cmd[cmd.index("--profile-from-start") + 1] == "off"
    assert cmd[cmd.index("--metrics") + 1] == "a.sum,b.sum" and cmd[-4:] == ["profile_x.py", "--workload", "--only", "fwd"]
    assert "--kernel-name" not in ncu.command("/opt/ncu/ncu", ["a.sum"], "profile_x.py")


@pytest.fixture
def fake_ncu(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: "/opt/ncu/ncu" if name == "ncu" else None)

    def install(fake):
        monkeypatch.setattr(subprocess, "run", fake)
        return fake
    return install


def test_a_rejected_metric_is_dropped_and_the_run_repeated(fake_ncu):
    plan = {"runs": ["forward"], "skipped": []}
    fake = fake_ncu(FakeNcu(TWO_KERNELS, plan, rejects={GMMA}))
    profile = ncu.run("profile_x.py", METRICS, plan=True)
    cmd = profile.command
    assert len(fake.commands) == 3 and profile.dropped == [GMMA]  # --version, rejected, accepted
    assert GMMA in fake.commands[1][fake.commands[1].index("--metrics") + 1]
    assert GMMA not in cmd[cmd.index("--metrics") + 1] and GMMA not in profile.metrics
    assert profile.plan == plan and [x["kernel"] for x in profile.kernels] == [MARKER_NAME, KERNEL]
    assert cmd[-3:-1] == ["--workload", "--plan"] and profile.version == "Version 2025.3.0.0 (build 1)"
    record = profile.provenance()
    assert record["metrics_dropped"] == [GMMA] and record["command"].startswith("/opt/ncu/ncu --csv --print-units base")
    # reported by no kernel but the marker: missing
    assert "launch__registers_per_thread" in record["metrics_missing"]


def test_unsure_metrics_go_when_ncu_fails_over_metrics_without_naming_one(fake_ncu):
    class Vague(FakeNcu):
        def __call__(self, cmd, capture_output=True, text=True):
            if "--version" not in cmd and GMMA in cmd[cmd.index("--metrics") + 1]:
                self.commands.append(cmd)
                return types.SimpleNamespace(returncode=1, stdout="", stderr="==ERROR== a metric is invalid\n")
            return super().__call__(cmd, capture_output, text)
    fake_ncu(Vague(TWO_KERNELS))
    profile = ncu.run("profile_x.py", METRICS, unsure={GMMA})
    assert profile.dropped == [GMMA] and profile.plan is None


def test_a_failure_that_is_not_a_metric_is_not_retried(fake_ncu):
    fake = fake_ncu(FakeNcu(TWO_KERNELS, error="==ERROR== ERR_NVGPUCTRPERM\n"))
    with pytest.raises(SystemExit, match="ERR_NVGPUCTRPERM"):
        ncu.run("profile_x.py", METRICS, unsure={GMMA})
    assert len(fake.commands) == 2  # --version, then the one run


def test_without_a_gpu_or_ncu_a_script_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA GPU is visible" in ncu.unavailable("profile_x.py") and "nothing written" in ncu.unavailable("x")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "ncu (Nsight Compute) is not on PATH; nothing written" in ncu.unavailable("profile_x.py")
    assert ncu.unavailable("profile_x.py", need_ncu=False) is None  # the workload alone needs no ncu


@pytest.mark.parametrize("script", sorted(ROOT.glob("chapter*/profile_*.py")), ids=lambda p: p.name)
@pytest.mark.parametrize("args", [[], ["--workload"]])
def test_every_profile_script_exits_0_without_a_gpu(script, args, monkeypatch, capsys):
    """Every chapter's profile script, as if on a machine without a GPU: one line saying why,
    a clean exit, nothing written (run in this process, with torch told there is no GPU)."""
    import runpy
    before = {p: p.stat().st_mtime_ns for p in (ROOT / "results").glob("*/*_profile.json")}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts its chapter first
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), e.code
    out = capsys.readouterr().out
    assert "no CUDA GPU is visible" in out and "nothing written" in out
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "results").glob("*/*_profile.json")} == before


# ncu's source page (`ncu --import R --page source --csv --print-source sass`), cut to the columns
# source_hotspots reads and two of the rest: the kernel's name above the table, one row per SASS
# instruction, the samples in total and per stall reason, a blank cell where ncu has none.
SOURCE_PAGE = (
    '"Kernel Name","void chapter::step_kernel<128>(chapter::Params)"\n'
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
    '"Instructions Executed","stall_barrier","stall_long_sb","stall_short_sb",'
    '"stall_long_sb (Not Issued)"\n'
    '"0x10","      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT","40","20","8","","0","3","0"\n'
    '"0x20","      WARPGROUP.DEPBAR.LE gsb0, 0x0","1,200","1,190","8","1,150","0","0","0"\n'
    '"0x30","      FFMA R11, R184, UR16, -R14","300","280","8","0","20","270","900"\n'
    '"0x40","@!P0  BRA 0x7f0000001000","460","455","64","0","455","0","0"\n')


def test_source_hotspots_ranks_instructions_by_their_samples():
    hot = ncu.source_hotspots(SOURCE_PAGE, top=3)
    assert hot["kernel"] == "void chapter::step_kernel<128>(chapter::Params)"
    assert hot["total"] == 2000.0                          # "1,200": separator dropped
    assert [r["sass"] for r in hot["rows"]] == ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "@!P0  BRA 0x7f0000001000",
                                                "FFMA R11, R184, UR16, -R14"]
    assert [r["index"] for r in hot["rows"]] == [1, 3, 2]  # places in the listing
    assert hot["rows"][0]["share"] == 0.6
    # Each row's reasons, largest first; "(Not Issued)" columns are not reasons of their own.
    assert hot["rows"][2]["reasons"] == [("stall_short_sb", 270.0), ("stall_long_sb", 20.0), ("stall_barrier", 0.0)]
    assert hot["reasons"] == [("stall_barrier", 1150.0), ("stall_long_sb", 475.0), ("stall_short_sb", 273.0)]
    table = ncu.format_hotspots(hot)
    assert "barrier 57.5%" in table and "WARPGROUP.DEPBAR.LE gsb0, 0x0" in table


def test_source_hotspots_refuses_text_without_a_source_table():
    with pytest.raises(ValueError, match="no source table"):
        ncu.source_hotspots(TWO_KERNELS)
    with pytest.raises(ValueError, match="Warp Stall Sampling"):
        ncu.source_hotspots('"Address","Source","Instructions Executed"\n"0x10","NOP","1"\n')


def test_source_commands_sample_one_kernel_then_export_its_page(tmp_path):
    report = tmp_path / "r.ncu-rep"
    cmd = ncu.source_command("ncu", "profile_x.py", ["--only", "a"], "step_kernel", report)
    assert cmd[cmd.index("--section") + 1] == "SourceCounters"
    assert cmd[cmd.index("--kernel-name") + 1] == "regex:step_kernel"
    assert cmd[cmd.index("--launch-count") + 1] == "1" and cmd[cmd.index("-o") + 1] == str(report)
    assert cmd[-4:] == ["profile_x.py", "--workload", "--only", "a"]
    export = ncu.source_export_command("ncu", report)
    assert export[export.index("--page") + 1] == "source" and "--csv" in export
