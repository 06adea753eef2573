"""Tests of profile_attention.py on the CPU: how it gives each call its kernels, names the
binding occupancy limit and the top stall, derives TFLOP/s from the chapter's FLOP count, and
writes its record (main() end to end with ncu faked), and that it exits 0 with a message where
there is no ncu. coursekit.ncu's own tests (common/tests/test_ncu.py) hold the parsing, the
retries without a rejected metric and the no-GPU path of every chapter's profile script. The ncu
text here is written by hand in the format `ncu --csv --print-units base --metrics ...` prints
(the details page: one line per kernel and metric)."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest

import profile_attention as P
from coursekit.pytest_plugin import FakeNcu

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')
MARKER_NAME = "at::cuda::<unnamed>::spin_kernel(long)"
FWD = ("void flash_attention::flash_fwd_kernel<__nv_bfloat16, flash_attention::FwdTraits<128, true>>"
       "(flash_attention::AttentionParams, unsigned int, float)")
BWD_PRE = "void flash_attention::flash_bwd_preprocess_kernel<__nv_bfloat16, 64>(flash_attention::AttentionBackwardParams)"
BWD_MAIN = ("void flash_attention::flash_bwd_kernel<__nv_bfloat16, flash_attention::BwdTraits<64>>"
            "(flash_attention::AttentionBackwardParams, float *, const float *, unsigned int, float)")
BWD_DQ = "void flash_attention::flash_bwd_convert_dq_kernel<__nv_bfloat16, 64>(flash_attention::AttentionBackwardParams)"

def csv_line(kid, kernel, metric, unit, value):
    return (f'"{kid}","4242","python3.12","127.0.0.1","{kernel}","1","7","(128, 1, 1)","(32, 64, 1)","0",'
            f'"9.0","Command line profiler metrics","{metric}","{unit}","{value}"\n')


def ncu_text(kernels):
    """ncu's CSV for [(name, {metric: value})], IDs in launch order, base units."""
    lines = ["==PROF== Connected to process 4242\n", HEADER]
    for kid, (name, values) in enumerate(kernels):
        for metric, value in values.items():
            lines.append(csv_line(kid, name, metric, "", value))
    return "".join(lines) + "==PROF== Disconnected from process 4242\n"


def k(name, **fields):
    return {"kernel": name, **fields}


@pytest.mark.parametrize("limits,expected", [
    ({"occ_limit_registers": 2, "occ_limit_shared_mem": 1, "occ_limit_warps": 4, "occ_limit_blocks": 32},
     ("shared_mem", 1)),
    ({"occ_limit_registers": 1, "occ_limit_shared_mem": 2, "occ_limit_warps": 2, "occ_limit_blocks": 32},
     ("registers", 1)),
    ({"occ_limit_registers": 2, "occ_limit_shared_mem": 2, "occ_limit_warps": 8, "occ_limit_blocks": 32},
     ("registers+shared_mem", 2)),
    ({"occ_limit_registers": None, "occ_limit_shared_mem": 3, "occ_limit_warps": 8}, ("shared_mem", 3)),
    ({"occ_limit_registers": None}, (None, None)),
])
def test_the_smallest_occupancy_limit_binds(limits, expected):
    assert P.binding_limit(k(FWD, **limits)) == expected


def test_top_stall_is_a_wait_not_spare_parallelism():
    kern = k(FWD, stall_not_selected=9.0, stall_barrier=1.5, stall_short_scoreboard=2.5,
             stall_long_scoreboard=None)
    assert P.top_stall(kern) == ("short_scoreboard", 2.5)
    assert P.top_stall(k(FWD, stall_not_selected=3.0)) == (None, None)


def test_flops_are_the_chapters_formula():
    b, h, s = P.BATCH, P.HEADS, P.SEQLEN
    causal_fwd = {"pass": "forward", "variant": "pipelined", "head_dim": 128, "causal": True}
    full_bwd = {"pass": "backward", "variant": "mma", "head_dim": 64, "causal": False}
    assert P.run_flops(causal_fwd) == 4 * b * h * s * s * 128 // 2
    assert P.run_flops(full_bwd) == 4 * b * h * s * s * 64 * 5 // 2
    # 2e12 FLOPs in one millisecond: 2000 TFLOP/s.
    assert P.tflops(2e12, 1e6) == pytest.approx(2000.0)
    assert P.tflops(1e12, 0) is None


def test_a_call_row_sums_its_kernels_and_reads_its_longest():
    run = {"pass": "backward", "variant": "mma", "head_dim": 64, "causal": False}
    kernels = [
        k(BWD_PRE, id=1, duration_ns=20_000.0, registers=32.0, block=256.0),
        k(BWD_MAIN, id=2, duration_ns=900_000.0, registers=168.0, block=128.0, smem_static_bytes=0.0,
          smem_dynamic_bytes=45_568.0, occ_limit_registers=2.0, occ_limit_shared_mem=4.0,
          occ_limit_warps=16.0, occ_limit_blocks=32.0, achieved_occupancy_pct=11.9, tensor_pipe_pct=41.0,
          smem_ld_bank_conflicts=0.0, smem_st_bank_conflicts=262_144.0, smem_ld_wavefronts=3_000.0,
          smem_ld_instructions=500.0, ldsm_instructions=1_000.0, stall_barrier=0.8,
          stall_long_scoreboard=0.3, stall_not_selected=5.0),
        k(BWD_DQ, id=3, duration_ns=80_000.0, registers=24.0, block=256.0),
    ]
    flops = 1e12
    row = P.summarize_call(run, kernels, flops)
    assert row["label"] == "backward.mma.d64.full"
    assert (row["op"], row["variant"], row["pass"], row["dtype"]) == ("attention", "mma", "backward", "bfloat16")
    assert row["shape"] == [P.BATCH, P.HEADS, P.SEQLEN, 64] and row["head_dim"] == 64 and row["causal"] is False
    assert row["launches"] == 3
    assert row["duration_ns"] == 1_000_000.0 and row["main_duration_ns"] == 900_000.0
    assert row["main_kernel"] == BWD_MAIN and row["registers"] == 168.0
    assert row["TFLOPs_under_ncu"] == pytest.approx(1000.0)  # 1e12 FLOPs in the call's 1 ms
    assert row["smem_per_block_KiB"] == pytest.approx(44.5)
    assert (row["occupancy_bound_by"], row["blocks_per_sm"]) == ("registers", 2.0)
    assert row["resident_warps_per_sm"] == 8.0                 # 2 blocks of 4 warps
    assert row["smem_ld_wavefronts_per_request"] == pytest.approx(2.0)  # 3000 / (500 + 1000)
    assert (row["top_stall"], row["top_stall_ratio"]) == ("barrier", 0.8)
    assert [kk["kernel"] for kk in row["kernels"]] == [BWD_PRE, BWD_MAIN, BWD_DQ]
    assert all("id" not in kk for kk in row["kernels"])
    json.dumps(row)  # a results row


def test_a_row_tolerates_counters_ncu_did_not_give():
    row = P.summarize_call({"pass": "forward", "variant": "naive", "head_dim": 64, "causal": False},
                           [k(FWD, duration_ns=None)], 1e9)
    assert row["duration_ns"] == 0 and row["TFLOPs_under_ncu"] is None
    assert row["smem_per_block_KiB"] is None and row["blocks_per_sm"] is None and row["top_stall"] is None
    assert "naive" in P.format_table([row])


def test_the_table_tells_a_softcapped_call_from_the_plain_one():
    plain = {"pass": "forward", "variant": "persistent", "head_dim": 128, "causal": True}
    rows = [P.summarize_call(run, [k(FWD)], 1e9) for run in (plain, {**plain, "softcap": 30.0})]
    lines = P.format_table(rows).splitlines()[1:]
    assert not lines[0].endswith("softcap30") and lines[1].endswith("  softcap30")
    assert lines[1].startswith(lines[0].rstrip()[:40])  # the columns before are the plain call's


def test_the_plan_covers_every_rung_and_the_causal_runs():
    plan = P.runs(("naive", "tiled", "mma", "pipelined", "tuned"), ("naive", "mma", "mma_dqpass"))
    labels = [P.label(r) for r in plan]
    assert len(labels) == len(set(labels)) == 2 * (5 + 2 + 1) + 4 + 2 + 2 * (3 + 1)
    assert "forward.attention_fp8.d128.full" in labels and "forward.attention_fp8.d64.full" in labels
    assert "forward.sdpa_cudnn.d64.full" in labels and "backward.sdpa_flash.d128.full" in labels
    assert "backward.mma_dqpass.d64.full" in labels
    causal = [P.label(r) for r in plan if r["causal"]]
    assert causal == ["forward.tuned.d128.causal", "forward.pingpong.d128.causal", "forward.sdpa_flash.d128.causal",
                      "forward.sdpa_cudnn.d128.causal", "forward.persistent.d128.causal",
                      "forward.persistent.d128.causal.softcap30"]


GMMA = "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
PLAN = {"runs": [{"pass": "forward", "variant": "pipelined", "head_dim": 128, "causal": True},
                 {"pass": "backward", "variant": "mma", "head_dim": 64, "causal": False}],
        "skipped": [{"label": "forward.sdpa_cudnn.d64.full", "pass": "forward", "variant": "sdpa_cudnn",
                     "head_dim": 64, "causal": False, "reason": "No available kernel"}]}
PROFILE = ncu_text([
    (MARKER_NAME, {"gpu__time_duration.sum": "1,984"}),
    (FWD, {"gpu__time_duration.sum": "500,000", "launch__registers_per_thread": "255",
           "launch__occupancy_limit_registers": "1", "launch__occupancy_limit_shared_mem": "2",
           "launch__occupancy_limit_warps": "8", "launch__occupancy_limit_blocks": "32",
           "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "61.5"}),
    (MARKER_NAME, {"gpu__time_duration.sum": "1,984"}),
    (BWD_PRE, {"gpu__time_duration.sum": "10,000"}),
    (BWD_MAIN, {"gpu__time_duration.sum": "2,000,000", "launch__registers_per_thread": "168"}),
    (BWD_DQ, {"gpu__time_duration.sum": "40,000"}),
])


def test_the_gpu_path_writes_one_row_per_call(monkeypatch, capsys):
    """main() end to end with ncu faked: the record it writes and the table it prints."""
    import torch
    from coursekit import results
    fake = FakeNcu(PROFILE, PLAN, rejects={GMMA})
    written = {}

    def write_results(chapter, rows, ceilings, **extra):
        written.update(chapter=chapter, rows=rows, ceilings=ceilings, **extra)
        return Path("results/fake/chapter6_flash_attention_profile.json")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(shutil, "which", lambda name: "/opt/ncu/ncu" if name == "ncu" else None)
    monkeypatch.setattr(subprocess, "run", fake)
    monkeypatch.setattr(results, "write_results", write_results)
    assert P.main([]) == 0
    assert written["chapter"] == "chapter6_flash_attention_profile"
    assert written["ncu_version"] == "Version 2025.3.0.0 (build 1)"
    assert written["command"].startswith("/opt/ncu/ncu --csv --print-units base")
    assert written["metrics_dropped"] == [GMMA] and GMMA not in written["metrics"]
    assert written["skipped"] == PLAN["skipped"]
    fwd, bwd = written["rows"]
    assert (fwd["label"], fwd["launches"], fwd["duration_ns"]) == ("forward.pipelined.d128.causal", 1, 500_000.0)
    assert (fwd["occupancy_bound_by"], fwd["blocks_per_sm"], fwd["tensor_pipe_pct"]) == ("registers", 1.0, 61.5)
    assert fwd["TFLOPs_under_ncu"] == pytest.approx(P.run_flops(PLAN["runs"][0]) / 500_000 / 1e3)
    assert (bwd["label"], bwd["launches"], bwd["duration_ns"]) == ("backward.mma.d64.full", 3, 2_050_000.0)
    assert bwd["main_kernel"] == BWD_MAIN and bwd["registers"] == 168.0
    out = capsys.readouterr().out
    assert "skipped forward.sdpa_cudnn.d64.full" in out and "1 registers" in out and "wrote" in out


def test_another_shape_is_profiled_at_its_own_size_and_writes_nothing(monkeypatch, capsys):
    """--shape: the workload gets the shape, the rows and TFLOP/s are of it, and no record is
    written over the default shape's."""
    import torch
    from coursekit import results
    fake = FakeNcu(PROFILE, PLAN, rejects={GMMA})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(shutil, "which", lambda name: "/opt/ncu/ncu" if name == "ncu" else None)
    monkeypatch.setattr(subprocess, "run", fake)
    monkeypatch.setattr(results, "write_results", lambda *a, **k: pytest.fail("a --shape run wrote a record"))
    rows = []
    summarize = P.summarize_call
    monkeypatch.setattr(P, "summarize_call", lambda *a: rows.append(summarize(*a)) or rows[-1])
    assert P.main(["--shape", "32,16,512"]) == 0
    assert any(" --shape 32,16,512" in " ".join(map(str, cmd)) for cmd in fake.commands)  # passed to the workload
    fwd = rows[0]
    assert (fwd["shape"], fwd["seqlen"], fwd["batch"]) == ([32, 16, 512, 128], 512, 32)
    assert fwd["flops"] == 4 * 32 * 16 * 512 * 512 * 128 // 2  # the causal forward at the new shape
    out = capsys.readouterr().out
    assert "bfloat16 32x16x512" in out and "nothing written" in out
    for bad in ("32,16", "0,16,512", "a,b,c"):
        with pytest.raises(SystemExit):
            P.parse_args(["--shape", bad])


def test_the_source_view_profiles_one_call_and_prints_its_hot_instructions(monkeypatch, capsys, tmp_path):
    """--source samples the --only call's kernel into a report, exports its source page and prints
    the instructions with the most stall samples; --source-csv reads an export on any machine."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    page = ('"Kernel Name","void flash_bwd_hopper_kernel<128>()"\n'
            '"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier","stall_wait"\n'
            '"0x10","  WARPGROUP.DEPBAR.LE gsb0, 0x0","90","88","2"\n"0x20","  FFMA R1, R2, R3, R4","10","0","10"\n')
    commands = []

    def fake_run(cmd, **kw):
        commands.append([str(c) for c in cmd])
        return subprocess.CompletedProcess(cmd, 0, page if "--import" in cmd else "", "")
    monkeypatch.setattr(subprocess, "run", fake_run)
    assert P.main(["--only", "backward\\.wgmma\\.d128\\.full", "--source", "flash_bwd_hopper",
                   "--shape", "8,16,2048"]) == 0
    sample, export = commands
    assert "SourceCounters" in sample and "regex:flash_bwd_hopper" in sample
    assert sample[-5:] == ["--workload", "--only", "backward\\.wgmma\\.d128\\.full", "--shape", "8,16,2048"]
    assert export[export.index("--page") + 1] == "source"
    out = capsys.readouterr().out
    assert "90.0%" in out and "WARPGROUP.DEPBAR.LE gsb0, 0x0" in out
    csv_file = tmp_path / "page.csv"
    csv_file.write_text(page)
    assert P.main(["--source-csv", str(csv_file)]) == 0
    assert "flash_bwd_hopper_kernel<128>" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        P.parse_args(["--source", "flash_bwd_hopper"])  # which call: --only is required


def test_no_ncu_is_a_message_not_a_failure(monkeypatch, capsys):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(shutil, "which", lambda name: None)

    def no_run(*a, **kw):
        raise AssertionError("nothing should run without ncu")
    monkeypatch.setattr(subprocess, "run", no_run)
    assert P.main([]) == 0
    assert "ncu (Nsight Compute) is not on PATH; nothing written" in capsys.readouterr().out


