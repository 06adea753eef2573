"""CPU tests of wgmma_sass.py's reading of SASS, on short hand-written listings in cuobjdump's
layout: the overlap's shape passes, and each of the two faults the scan exists for (a wgmma wait
among the exponentials, a write to a running P V's A registers) fails it."""
import wgmma_sass as W


def listing(*lines):
    """cuobjdump -sass text of one function from instruction texts (addresses 0x10 apart)."""
    body = "\n".join(f"        /*{16 * i:04x}*/                   {text} ;   /* 0x000 */" for i, text in enumerate(lines))
    return f"\t\tFunction : _Z6kernelv\n{body}\n"


# One overlap step's shape: tile i's Q K^T, tile i - 1's P V from R152..R155, the 0x1 wait, the
# softmax's exponentials and P's conversion into the other buffer (R184..), then the next step's
# mbarrier loop and its 0x0 wait, then its products.
STEP = ["SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9], R4", "@!P0 BRA 0x1000", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], R24, gsb0",
        "HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR12].tnspB, R88, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x1", "SHFL.BFLY PT, R5, R6, 0x1, 0x1f", "MUFU.EX2 R24, R9",
        "MUFU.EX2 R25, R25", "F2FP.BF16.F32.PACK_AB R184, R25, R24",
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9], R4", "@!P0 BRA 0x1000", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], R24, gsb0"]


def findings(lines):
    return W.scan(listing(*lines), "kernel")["_Z6kernelv"]


def test_the_overlap_step_passes():
    f = findings(STEP)
    assert f["waits_1"] == 1 and f["waits_0"] == 2 and not f["bad"] and f["register_a_wgmma"] == 1
    assert f["a_register_writes"] == 0 and f["ex2"] == 2 and W.overlap_ok(f)


def test_a_wait_among_the_exponentials_fails():
    # ptxas's old placement: the 0x0 wait hoisted between the maximum and the exponentials
    lines = STEP[:7] + ["WARPGROUP.DEPBAR.LE gsb0, 0x0"] + STEP[7:]
    f = findings(lines)
    assert f["bad"] == [0x50] and not W.overlap_ok(f)


def test_a_write_to_the_running_p_v_operand_fails():
    # P of tile i converted into the registers P V of tile i - 1 still reads (one buffer merged)
    lines = [x.replace("PACK_AB R184", "PACK_AB R154") for x in STEP]
    f = findings(lines)
    assert f["a_register_writes"] == 1 and f["first_writes"] == ["0x40 <- 0x90 F2FP.BF16.F32.PACK_AB"]
    assert not W.overlap_ok(f)


def test_wide_writes_and_stores():
    # an LDS.64 into R153..R154 overlaps; a store reading R152 and a predicate write do not
    lines = STEP[:6] + ["STS [R3], R152", "ISETP.GE.AND P4, PT, R152, R9, PT", "LDS.64 R153, [R2]"] + STEP[6:]
    f = findings(lines)
    assert f["a_register_writes"] == 1 and "LDS.64" in f["first_writes"][0]


def test_the_joint_schedule_has_no_overlap():
    # one wait for both products, then the softmax: no 0x1 wait, which overlap_ok refuses
    lines = ["HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR12].tnspB, R88",
             "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
             "MUFU.EX2 R24, R9", "F2FP.BF16.F32.PACK_AB R152, R25, R24"]
    f = findings(lines)
    assert f["waits_1"] == 0 and f["a_register_writes"] == 0 and not W.overlap_ok(f)


def test_main_reads_a_sass_file(tmp_path, capsys):
    path = tmp_path / "k.sass"
    path.write_text(listing(*STEP))
    assert W.main([str(path), "--kernel", "kernel"]) == 0
    assert "ok " in capsys.readouterr().out
    assert W.main([str(path), "--kernel", "absent"]) == 1
