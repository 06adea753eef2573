"""Tests for chapter 2: every op x version x dtype x irregular shape, CPU and CUDA.

Every op here only moves data, so every comparison is exact (rtol = atol = 0, NaN never
expected): a transposed or copied element either is the source's bits or it is wrong.

Run against the installed extension (pip install .) or the JIT build (COURSE_EXT_ROUTE=jit);
the header line says which one was loaded.
"""
import pytest
import torch

import memory_ops
from coursekit import results, shapes
from coursekit.pytest_plugin import (DTYPES, assert_misplaced, dtype_id, launched_kernels, poison_allocator,
                                     ptx_kernels, require_cuda, shape_id)
from memory_ops import VERSIONS


def assert_same(out, expected):
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert out.device == expected.device and out.is_contiguous()
    assert not out.isnan().any(), "some output element was never written"
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# Plain-PyTorch references.
def reference_transpose(x):
    return x.transpose(-2, -1).contiguous()


def reference_copy(x):
    return x.clone(memory_format=torch.contiguous_format)


def reference_strided_copy(x, stride):
    return x.flatten()[::stride].contiguous()


# Shapes: empty either way, single row / column / element, one off the 32-element tile either
# way, exact tiles, 1823 x 781 (multiple of nothing: v4 falls back to the padded tile, v5 aligns
# every row on its own), a prime pair, shapes whose rows are 16-byte aligned for every dtype but
# not multiples of v4's 128-row x 128-byte tile, so v4's fast path runs with partial tiles on
# both edges, and odd shapes a little larger than one wide tile (every row shifted differently).
SHAPES_2D = [(0, 5), (5, 0), (1, 1), (1, 777), (777, 1), (31, 33), (33, 31), (32, 32), (64, 96),
             (1823, 781), (251, 97), (200, 136), (136, 1032), (131, 67), (259, 133)]
SHAPES_3D = [(0, 4, 4), (4, 0, 3), (1, 1, 1), (3, 33, 65), (2, 200, 136), (5, 64, 8), (7, 9, 1),
             (3, 131, 67)]


@pytest.mark.parametrize("shape", SHAPES_2D + SHAPES_3D, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", VERSIONS["transpose"])
def test_transpose_matches_reference(version, dtype, shape, device):
    x = torch.randn(shape, dtype=dtype, device=device)
    expected = reference_transpose(x)
    poison_allocator(expected)
    assert_same(memory_ops.transpose(x, version=version), expected)


# Non-contiguous inputs: the kernels read x through its strides. Each view is described with
# what it does to v4's fast-path conditions.
TRANSPOSE_VIEWS = {
    # strides (1, rows): already a transpose; no unit column stride, so v4 falls back.
    "transposed": lambda t: t.t(),
    # one element in: every row starts misaligned (fallback).
    "column_offset": lambda t: t[:, 1:],
    # row stride doubled but still 16-byte aligned: the fast path reads through it.
    "every_other_row": lambda t: t[::2],
    # cols shrunk by 8 (still a multiple of every vector width), row stride unchanged.
    "column_slice": lambda t: t[:, :-8],
    # every column twice as far apart: no unit stride (fallback).
    "every_other_column": lambda t: t[:, ::2],
    # row stride 0: one source row repeated.
    "expanded": lambda t: t[:1].expand(t.shape[0], -1),
}


@pytest.mark.parametrize("view", list(TRANSPOSE_VIEWS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", VERSIONS["transpose"])
def test_transpose_views(version, dtype, view, device):
    x = TRANSPOSE_VIEWS[view](torch.randn(264, 144, dtype=dtype, device=device))
    assert_same(memory_ops.transpose(x, version=version), reference_transpose(x))


@pytest.mark.parametrize("offset", range(8))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", ("v4", "v5", None), ids=str)
def test_transpose_every_alignment(version, dtype, offset, device):
    """Views that start `offset` elements past a 16-byte boundary, of a matrix whose rows are
    not 16-byte multiples either: across rows, and across the destination's rows, every
    possible misalignment of a segment start (0 to 7 elements for 2-byte dtypes) appears, so
    v5's split into aligned vectors and ragged ends is exercised on both sides, edges
    included. x[offset:] shifts whole rows, x[:, offset:] every row start."""
    base = torch.randn(259, 269, dtype=dtype, device=device)
    for x in (base[:, offset:], base[offset:], base[offset:, offset:]):
        expected = reference_transpose(x)
        poison_allocator(expected)
        assert_same(memory_ops.transpose(x, version=version), expected)


BATCHED_VIEWS = {
    # (batch, rows, cols) made from a (rows, batch, cols) tensor: batch stride = cols.
    "batch_from_permute": lambda t: t.permute(1, 0, 2),
    # a batch of already-transposed matrices.
    "transposed_batch": lambda t: t.transpose(1, 2),
    # every other matrix of the batch.
    "every_other_matrix": lambda t: t[::2],
    # batch stride 0.
    "expanded_batch": lambda t: t[:1].expand(5, -1, -1),
}


@pytest.mark.parametrize("view", list(BATCHED_VIEWS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", VERSIONS["transpose"])
def test_transpose_batched_views(version, dtype, view, device):
    x = BATCHED_VIEWS[view](torch.randn(6, 40, 136, dtype=dtype, device=device))
    assert_same(memory_ops.transpose(x, version=version), reference_transpose(x))


COPY_SHAPES = [(0,), (1,), (3,), (7,), (9,), (31,), (33,), (255,), (257,), (1823, 781),
               (2**20 + 17,)]


@pytest.mark.parametrize("shape", COPY_SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", VERSIONS["copy"])
def test_copy_matches_reference(version, dtype, shape, device):
    x = torch.randn(shape, dtype=dtype, device=device)
    expected = reference_copy(x)
    poison_allocator(expected)
    out = memory_ops.copy(x, version=version)
    assert x.numel() == 0 or out.data_ptr() != x.data_ptr(), "copy must return new memory"
    assert_same(out, expected)


COPY_VIEWS = {
    # contiguous, but starting 1 element past a 16-byte boundary: v2 must take the scalar path.
    "offset_by_one": lambda t: t.flatten()[1:],
    "transposed": lambda t: t.t(),
    "every_other": lambda t: t.flatten()[::2],
}


@pytest.mark.parametrize("view", list(COPY_VIEWS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", VERSIONS["copy"])
def test_copy_views(version, dtype, view, device):
    x = COPY_VIEWS[view](torch.randn(257, 129, dtype=dtype, device=device))
    assert_same(memory_ops.copy(x, version=version), reference_copy(x))


# Input lengths that strides 1..64 mostly do not divide (and 0, and shorter than the stride).
STRIDED_SIZES = (0, 1, 5, 63, 1000, 4099, 65537)


@pytest.mark.parametrize("stride", range(1, 65))
def test_strided_copy_every_stride(stride, device):
    for n in STRIDED_SIZES:
        x = torch.randn(n, device=device)
        expected = reference_strided_copy(x, stride)
        poison_allocator(expected)
        assert_same(memory_ops.strided_copy(x, stride), expected)


@pytest.mark.parametrize("stride", (1, 2, 3, 8, 33))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_strided_copy_dtypes_and_views(stride, dtype, device):
    base = torch.randn(129, 67, dtype=dtype, device=device)
    for x in (base, base.t(), base[:, 1:], base[3:]):  # flatten() copies the strided views
        assert_same(memory_ops.strided_copy(x, stride), reference_strided_copy(x, stride))


# Gradients. float64 gradcheck per version; the backward of a transpose is a transpose.
@pytest.mark.parametrize("version", VERSIONS["transpose"])
@pytest.mark.parametrize("shape", [(7, 13), (3, 5, 4)], ids=shape_id)
def test_transpose_gradcheck(version, shape, device):
    x = torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True)
    fn = lambda t: memory_ops.transpose(t, version=version)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


@pytest.mark.parametrize("version", VERSIONS["copy"])
def test_copy_gradcheck(version, device):
    x = torch.randn(7, 13, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: memory_ops.copy(t, version=version), (x,))


@pytest.mark.parametrize("stride", (1, 3, 7))
def test_strided_copy_gradcheck(stride, device):
    x = torch.randn(5, 9, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: memory_ops.strided_copy(t, stride), (x,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("shape", [(1823, 781), (4, 264, 136), (3, 4099)], ids=shape_id)
def test_low_precision_gradients(shape, dtype, device):
    """Gradients are moved, never computed: they must equal PyTorch's bit for bit."""
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(reference_transpose(x).shape, dtype=dtype, device=device)
    ours, = torch.autograd.grad(memory_ops.transpose(x), x, grad)
    theirs, = torch.autograd.grad(reference_transpose(x), x, grad)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    ours, = torch.autograd.grad(memory_ops.strided_copy(x, 3), x, grad.flatten()[::3])
    theirs, = torch.autograd.grad(reference_strided_copy(x, 3), x, grad.flatten()[::3])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_versions_table_matches_dispatch():
    for op in VERSIONS:
        assert list(VERSIONS[op]) == torch.ops.memory_ops.versions(op), op
    with pytest.raises(RuntimeError, match="versions: unknown op 'strided_copy'"):
        torch.ops.memory_ops.versions("strided_copy")


def test_every_listed_version_dispatches_and_others_do_not(device):
    x = torch.randn(40, 24, device=device)
    for op, reference in (("copy", reference_copy), ("transpose", reference_transpose)):
        fn = getattr(memory_ops, op)
        for version in (*VERSIONS[op], None):
            assert_same(fn(x, version=version), reference(x))
        for bad in ("v0", "v6", "V1", "", "best"):
            with pytest.raises(RuntimeError, match=f"{op}: unknown version '{bad}'"):
                fn(x, version=bad)


# transpose's version=None (memory.h, default_transpose), on each side of every rule:
# (make x, dtype, what it must run).
DISPATCH_CASES = {
    # rows of 96 float32 = 384 bytes and 72 rows: every row 16-byte aligned on both sides (both
    # dims above the thin kernels' 64).
    "aligned": (lambda d, t: torch.randn(72, 96, dtype=t, device=d), torch.float32, "v4"),
    # 100 columns: 400 bytes in float32 (aligned, v4), 200 in bfloat16 (not: v5).
    "aligned_fp32_cols": (lambda d, t: torch.randn(72, 100, dtype=t, device=d), torch.float32, "v4"),
    "unaligned_bf16_cols": (lambda d, t: torch.randn(72, 100, dtype=t, device=d), torch.bfloat16,
                            "v5"),
    "odd_cols": (lambda d, t: torch.randn(72, 97, dtype=t, device=d), torch.float32, "v5"),
    # 65 rows: the destination's rows (65 elements) are not 16-byte multiples.
    "odd_rows": (lambda d, t: torch.randn(65, 96, dtype=t, device=d), torch.float32, "v5"),
    "column_offset": (lambda d, t: torch.randn(72, 97, dtype=t, device=d)[:, 1:], torch.float32,
                      "v5"),
    # whole rows dropped: still aligned.
    "row_offset": (lambda d, t: torch.randn(73, 96, dtype=t, device=d)[1:], torch.float32, "v4"),
    "expanded": (lambda d, t: torch.randn(1, 96, dtype=t, device=d).expand(72, -1), torch.float32,
                 "v4"),
    # memory already in transposed order: a copy.
    "transposed": (lambda d, t: torch.randn(96, 72, dtype=t, device=d).t(), torch.float32, "copy"),
    "transposed_slice": (lambda d, t: torch.randn(96, 72, dtype=t, device=d).t()[:, 1:],
                         torch.float32, "copy"),
    "transposed_batch": (lambda d, t: torch.randn(3, 96, 72, dtype=t, device=d).transpose(1, 2),
                         torch.bfloat16, "copy"),
    # a transposed view with a gap between matrices is not one block of memory: a rung.
    "transposed_batch_gap": (lambda d, t: torch.randn(6, 96, 72, dtype=t, device=d)[::2]
                             .transpose(1, 2), torch.float32, "v3"),
    # columns not adjacent in memory: v3's padded tile.
    "every_other_column": (lambda d, t: torch.randn(72, 192, dtype=t, device=d)[:, ::2],
                           torch.float32, "v3"),
    # one dim at most 64 (kThinMaxShort): the thin kernels, whatever the alignment and strides.
    "thin_rows": (lambda d, t: torch.randn(3, 4099, dtype=t, device=d), torch.float32, "thin"),
    "thin_cols": (lambda d, t: torch.randn(4099, 3, dtype=t, device=d), torch.bfloat16, "thin"),
    "thin_rows_17": (lambda d, t: torch.randn(17, 4096, dtype=t, device=d), torch.float32, "thin"),
    "thin_cols_17": (lambda d, t: torch.randn(4096, 17, dtype=t, device=d), torch.float32, "thin"),
    # aligned for v4, but thin: the short side decides first.
    "thin_rows_24_aligned": (lambda d, t: torch.randn(24, 4096, dtype=t, device=d),
                             torch.float32, "thin"),
    "thin_rows_64": (lambda d, t: torch.randn(64, 4096, dtype=t, device=d), torch.float32, "thin"),
    "thin_cols_64": (lambda d, t: torch.randn(4096, 64, dtype=t, device=d), torch.float16, "thin"),
    # one past the bound: the tile rungs again (odd: v5; aligned: v4).
    "rows_65": (lambda d, t: torch.randn(65, 4096, dtype=t, device=d), torch.float32, "v5"),
    "cols_65": (lambda d, t: torch.randn(4096, 65, dtype=t, device=d), torch.float32, "v5"),
    "rows_72_aligned": (lambda d, t: torch.randn(72, 4096, dtype=t, device=d), torch.float32,
                        "v4"),
    "thin_batch": (lambda d, t: torch.randn(5, 4099, 7, dtype=t, device=d), torch.float32, "thin"),
    "thin_every_other_column": (lambda d, t: torch.randn(4, 8198, dtype=t, device=d)[:, ::2],
                                torch.float32, "thin"),
    # a thin matrix whose memory already holds the transpose: still the copy.
    "thin_transposed": (lambda d, t: torch.randn(4099, 3, dtype=t, device=d).t(), torch.float32,
                        "copy"),
}


@pytest.mark.parametrize("case", list(DISPATCH_CASES))
def test_transpose_default_choice(case, device):
    make, dtype, expected = DISPATCH_CASES[case]
    x = make(device, dtype)
    assert memory_ops.default_choice("transpose", x) == expected
    assert_same(memory_ops.transpose(x), reference_transpose(x))


# The kernel each choice launches, as the profiler names it.
KERNEL_OF = {"v3": "transpose_tiled<", "v4": "transpose_wide_tiles<",
             "v5": "transpose_wide_tiles_any_alignment<", "copy": "copy_vectorized<",
             "thin": "transpose_thin_"}


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(DISPATCH_CASES))
def test_transpose_default_launches_its_choice(case):
    require_cuda()
    make, dtype, expected = DISPATCH_CASES[case]
    x = make("cuda", dtype)
    out, kernels = launched_kernels(lambda: memory_ops.transpose(x), "memory_ops")
    assert len(kernels) == 1 and KERNEL_OF[expected] in kernels[0], kernels
    assert_same(out, reference_transpose(x))


# Thin matrices (version=None's thin kernels): every short length up to 17, then the edges of
# the pad rule and of the bound (64): 31 and 62 take the other pad interval (thin_log2_pad),
# 32 and 64 the shortest segments of their power of two, 65 the tile rungs again. Against odd
# long lengths (1 and 3 past a multiple of every vector width), both ways round, batched, and
# through views.
THIN_SHORT = (*range(1, 18), 24, 31, 32, 33, 48, 62, 63, 64, 65)
THIN_LONG = (1001, 4099)
THIN_VIEWS = {
    "contiguous": lambda t: t,
    # every row one element past a 16-byte boundary.
    "column_offset": lambda t: t[..., 1:],
    # columns two apart: the short side of one orientation, the long side of the other.
    "every_other_column": lambda t: t[..., ::2],
    # rows two apart.
    "every_other_row": lambda t: t[..., ::2, :],
}


def thin_shapes(short, batch=None):
    lead = () if batch is None else (batch,)
    # From 24 on a strip spans at most 64 of the long dim: 1001 already makes 16 strips and a
    # partial last one, so the longer length would only slow the CPU run.
    longs = THIN_LONG if short <= 17 else THIN_LONG[:1]
    return [lead + s for long in longs for s in ((short, long), (long, short))]


@pytest.mark.parametrize("view", list(THIN_VIEWS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_thin_transpose_matches_reference(dtype, view, device):
    """version=None on a thin matrix runs the thin kernels up to 64 and a tile rung from 65 on
    (test_thin_transpose_launches_its_kernel checks which); every element must land."""
    for short in THIN_SHORT:
        for shape in thin_shapes(short) + thin_shapes(short, batch=3):
            x = THIN_VIEWS[view](torch.randn(shape, dtype=dtype, device=device))
            expected = reference_transpose(x)
            poison_allocator(expected)
            assert_same(memory_ops.transpose(x), expected)


@pytest.mark.cuda
def test_thin_transpose_launches_its_kernel():
    """The tile's run lies along the longer dim: thin_rows for short rows, thin_cols for short
    columns; one past the bound, the tile rungs (test_transpose_default_choice)."""
    require_cuda()
    for short in (1, 3, 16, 17, 31, 32, 33, 63, 64, 65):
        for shape in thin_shapes(short) + thin_shapes(short, batch=2):
            x = torch.randn(shape, device="cuda")
            out, kernels = launched_kernels(lambda: memory_ops.transpose(x), "memory_ops")
            rows, cols = shape[-2:]
            expected = ("transpose_wide_tiles" if short > 64 else
                        "transpose_thin_rows<" if rows <= cols else "transpose_thin_cols<")
            assert len(kernels) == 1 and expected in kernels[0], (shape, kernels)
            assert_same(out, reference_transpose(x))


def expects_pairs(x):
    """memory.h's thin_pairs_apply: 2-byte segments move as pairs only where they are stores,
    thin_cols' destination rows (short columns)."""
    rows, cols = x.shape[-2:]
    return x.element_size() == 2 and rows > cols


@pytest.mark.cuda
@pytest.mark.parametrize("view", list(THIN_VIEWS))
def test_thin_transpose_moves_2_byte_segments_as_pairs(view):
    """2-byte thin matrices take the pair kernels where thin_pairs_apply says so (odd long
    lengths, whose rows alternate between word-aligned and mid-word starts, a long dim of 1 and
    2, views); every element lands, in both 2-byte dtypes."""
    require_cuda()
    for dtype in (torch.bfloat16, torch.float16):
        for short in (1, 2, 3, 17, 64):
            for long in (1, 2, 3, 1001, 4099):
                for shape in ((short, long), (long, short), (2, short, long)):
                    x = THIN_VIEWS[view](torch.randn(shape, device="cuda").to(dtype))
                    rows, cols = x.shape[-2:]
                    if x.numel() == 0 or memory_ops.default_choice("transpose", x) != "thin":
                        continue
                    out, kernels = launched_kernels(lambda: memory_ops.transpose(x), "memory_ops")
                    expected = ("transpose_thin_rows<unsigned short>" if rows <= cols else
                                f"transpose_thin_cols<unsigned short, {'true' if expects_pairs(x) else 'false'}>")
                    assert len(kernels) == 1 and expected in kernels[0], (shape, view, kernels)
                    assert_same(out, reference_transpose(x))


@pytest.mark.parametrize("shape", [(3, 37), (37, 3), (2, 5, 37), (2, 37, 16), (1, 9), (31, 40),
                                   (40, 33)], ids=shape_id)
def test_thin_transpose_gradcheck(shape, device):
    """The backward of a thin transpose is a thin transpose the other way round."""
    x = torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True)
    assert memory_ops.default_choice("transpose", x) == "thin"
    assert torch.autograd.gradcheck(memory_ops.transpose, (x,))
    assert torch.autograd.gradgradcheck(memory_ops.transpose, (x,))


def test_thin_pad_rule_keeps_the_segment_side_nearly_conflict_free():
    """The bank count memory_kernels.cu's comment quotes (bank_model.thin_segment, the thin
    kernels' segment-side walk with thin_log2_pad's rule): at every short side up to the bound
    and every element size, at most 4 times the fewest wavefronts; the pad after every 32 alone
    would take 16 times or more at 31 and 62."""
    import bank_model

    for size in (2, 4, 8):
        assert max(bank_model.thin_segment(size, s) for s in range(1, 65)) <= 4, size
        for short in (31, 62):
            assert bank_model.thin_segment(size, short, log2_pad=5) >= 16, (size, short)
    # 2-byte segments moved as pairs: lane to lane the tile slots are 2 x short apart.
    for heads in ("aligned", "odd", "alternating"):
        assert max(bank_model.thin_pairs(s, heads) for s in range(1, 65)) <= 4, heads


def test_thin_kernels_keep_registers_and_move_the_run_in_16_bytes(tmp_path):
    """The thin kernels stage each tile in shared memory so that one side is a single run of
    memory: the run must move with 128-bit accesses (stores for thin_rows, loads for
    thin_cols; scalar accesses only for its head and tail), and the elements each thread holds
    between its loads and its shared-memory writes must stay in registers (every index into
    them a compile-time constant after unrolling): a local array is a DRAM round trip each."""
    import re
    from pathlib import Path

    bodies = {name: body for name, body in
              ptx_kernels(Path(__file__).parent / "memory_kernels.cu", tmp_path).items()
              if "transpose_thin_" in name}
    # rows and cols, for 2-, 4- and 8-byte elements, and the 2-byte cols again with pairs
    # (mangled: <unsigned short, true> is ItLb1E)
    assert len(bodies) == 7, list(bodies)
    pair_kernels = [name for name in bodies if "Lb1E" in name]
    assert len(pair_kernels) == 1 and "transpose_thin_cols" in pair_kernels[0] and "ItLb1E" in pair_kernels[0], \
        pair_kernels
    for name, body in bodies.items():
        assert "__local_depot" not in body and "ld.local" not in body, name
        wide_loads = len(re.findall(r"ld\.global(?:\.nc)?\.v4\.", body))
        wide_stores = len(re.findall(r"st\.global(?:\.wb)?\.v4\.", body))
        if "transpose_thin_rows" in name:
            assert wide_stores >= 1 and wide_loads == 0, (name, wide_loads, wide_stores)
        else:
            assert wide_loads >= 1 and wide_stores == 0, (name, wide_loads, wide_stores)
        # The pair kernels' segment side moves 4-byte words: loads for thin_rows, stores for
        # thin_cols (thin_pair_first).
        words = len(re.findall(r"ld\.global(?:\.nc)?\.[ub]32" if "transpose_thin_rows" in name
                               else r"st\.global(?:\.wb)?\.[ub]32", body))
        if name in pair_kernels:
            assert words >= 1, (name, words)


def test_copy_default_choice():
    assert memory_ops.default_choice("copy", torch.randn(3)) == "v2"
    with pytest.raises(RuntimeError, match="default_choice: unknown op 'strided_copy'"):
        memory_ops.default_choice("strided_copy", torch.randn(3))


def test_recorded_results_hold_the_dispatch():
    """The committed GPU results (bench_memory_ops.py) must show version=None at every
    measured shape and view, with the choice the dispatch makes today, never slower than 0.95x
    the fastest rung there. Fails on results older than the dispatch and on a regression."""
    import bench_memory_ops

    record = results.load_recorded_gpu("chapter2_memory")
    assert record is not None, "no recorded GPU results: run bench_memory_ops.py on a GPU"
    transposes = [r for r in record["benchmarks"] if r["op"] == "transpose"]
    assert {*VERSIONS["transpose"], "default"} <= {r["variant"] for r in transposes}, "stale"
    for r in transposes:
        if r["variant"] == "default":
            # Strides and alignment decide, so an uninitialized CPU tensor of the same shape
            # (no memory is touched) stands in for the GPU one.
            x = torch.empty(r.get("base_shape", r["shape"]), dtype=getattr(torch, r["dtype"]))
            if r.get("view"):
                x = bench_memory_ops.VIEWS[r["view"]](x)
            assert r.get("dispatch") == memory_ops.default_choice("transpose", x), r["shape"]
    # copy's ladder is measured as a plain copy and as the L2 working-set sweep.
    for op, ops in (("copy", ("copy", "copy_working_set")), ("transpose", ("transpose",))):
        assert results.default_gaps(record, VERSIONS[op], ops=ops) == []


def test_recorded_shapes_sweep_holds_the_target():
    """The shapes sweep (bench_memory_ops.py --shapes): at every layout change that moves at
    least 1 MiB, version=None at least 0.95x eager PyTorch (the sweep compares with eager alone),
    with the choice the dispatch makes today recorded beside it."""
    record = shapes.load("chapter2_memory")
    # Strides and alignment decide: an uninitialized CPU tensor of the shape (fresh: aligned).
    choice = lambda r: memory_ops.default_choice("transpose", torch.empty(r["shape"], dtype=getattr(torch, r["dtype"])))  # noqa: E731
    assert shapes.stale_dispatch(record, choice) == []
    shapes.expect_target(record, "bench_memory_ops.py --shapes")


def test_bank_model_predicts_the_recorded_wavefronts():
    """bank_model.py's arithmetic against what ncu counted (profile_memory_ops.py, committed):
    the tile column reads of v2/v3, v4's gathers, and v5's gathers on aligned and odd shapes.
    Within 10%: the measured counts also include edge tiles the model does not simulate."""
    import bank_model

    profile = results.load_recorded_gpu("chapter2_memory_profile")
    assert profile is not None, "no recorded ncu profile: run profile_memory_ops.py on a GPU"
    size_of = {"float32": 4, "bfloat16": 2, "float64": 8}
    checked = 0
    for r in profile["benchmarks"]:
        size = size_of[r["dtype"]]
        if r["op"] == "transpose" and r["variant"] in ("v2", "v3"):
            pitch = 32 + (0 if r["variant"] == "v2" else max(1, 4 // size))
            predicted, measured = bank_model.tile_column_read(size, pitch), r["smem_wavefronts_per_load"]
        elif r["op"] == "transpose" and r["variant"] == "v4":
            predicted = bank_model.wide_gather(size, bank_model.V4_PITCH[size])
            measured = r["smem_wavefronts_per_load"]
        elif r["op"] == "transpose_alignment" and r["variant"] == "v5" and r["case"] != "sliced":
            vec = 16 // size
            rows, cols = r["shape"]
            predicted = bank_model.wide_gather(size, bank_model.V5_PITCH[size], rows % vec,
                                               cols % vec)
            measured = r["smem_load_wavefronts_per_instruction"]
        else:
            continue
        assert abs(predicted - measured) <= 0.1 * measured, (r["op"], r["variant"], r["dtype"],
                                                             r.get("case"), predicted, measured)
        checked += 1
    assert checked == 3 * 3 + 2 * 2  # v2-v4 in 3 dtypes; v5 aligned and odd in 2


# Every misuse raises a RuntimeError naming the op and the problem.# Every misuse raises a RuntimeError naming the op and the problem.
MISUSES = {
    "transpose 1-D": (lambda d: memory_ops.transpose(torch.randn(5, device=d)),
                      r"transpose: x must be 2-D \(rows, cols\) or 3-D \(batch, rows, cols\), "
                      r"got 1-D with shape \[5\]"),
    "transpose 4-D": (lambda d: memory_ops.transpose(torch.randn(2, 3, 4, 5, device=d)),
                      r"transpose: x must be 2-D .* got 4-D with shape \[2, 3, 4, 5\]"),
    "transpose integer": (lambda d: memory_ops.transpose(torch.ones(3, 4, dtype=torch.int32,
                                                                    device=d)),
                          r"transpose: x has dtype Int, which is not supported"),
    "copy integer": (lambda d: memory_ops.copy(torch.arange(5, device=d)),
                     r"copy: x has dtype Long, which is not supported"),
    "copy bool": (lambda d: memory_ops.copy(torch.ones(5, dtype=torch.bool, device=d)),
                  r"copy: x has dtype Bool, which is not supported"),
    "strided_copy zero stride": (lambda d: memory_ops.strided_copy(torch.randn(5, device=d), 0),
                                 r"strided_copy: stride must be >= 1, got 0"),
    "strided_copy negative stride": (lambda d: memory_ops.strided_copy(torch.randn(5, device=d),
                                                                       -2),
                                     r"strided_copy: stride must be >= 1, got -2"),
    "strided_copy complex": (lambda d: memory_ops.strided_copy(torch.randn(5, dtype=torch.cfloat,
                                                                           device=d), 2),
                             r"strided_copy: x has dtype ComplexFloat, which is not supported"),
    "unknown version": (lambda d: memory_ops.transpose(torch.randn(3, 3, device=d), version="v9"),
                        r"transpose: unknown version 'v9'; expected one of v1, v2, v3, v4"),
    "copy unknown version": (lambda d: memory_ops.copy(torch.randn(3, device=d), version="v3"),
                             r"copy: unknown version 'v3'; expected one of v1, v2"),
}


@pytest.mark.parametrize("misuse", list(MISUSES))
def test_misuse_raises_clear_error(misuse, device):
    call, message = MISUSES[misuse]
    with pytest.raises(RuntimeError, match=message):
        call(device)


OPCHECK_CALLS = {
    "copy": lambda x: (torch.ops.memory_ops.copy.default, (x, None)),
    "strided_copy": lambda x: (torch.ops.memory_ops.strided_copy.default, (x, 3)),
    "transpose": lambda x: (torch.ops.memory_ops.transpose.default, (x, None)),
    "transpose_batched": lambda x: (torch.ops.memory_ops.transpose.default,
                                    (x.reshape(3, 11, 17), None)),
}


@pytest.mark.parametrize("op", list(OPCHECK_CALLS))
def test_opcheck(op, device):
    x = torch.randn(33, 17, device=device, requires_grad=True)
    fn, args = OPCHECK_CALLS[op](x)
    torch.library.opcheck(fn, args)


def test_torch_compile_traces_the_ops(device):
    """Dynamo and AOTAutograd trace through the ops without a graph break (the Meta kernel gives
    shapes, the Autograd kernel the backward); aot_eager skips codegen to keep this fast."""
    torch._dynamo.reset()

    def f(x):
        y = memory_ops.transpose(memory_ops.copy(x)) * 2
        return memory_ops.strided_copy(y, 3).sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 65, 33, device=device, requires_grad=True)
    out = compiled(x)
    grad, = torch.autograd.grad(out, x)
    expected_grad, = torch.autograd.grad(f(x), x)
    torch.testing.assert_close(out, f(x))
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.large
@pytest.mark.parametrize("version", VERSIONS["transpose"])
def test_transpose_beyond_int32_elements(version):
    """46344^2 > 2^31 float16 elements (4 GiB): every index must be 64-bit. 46344 is a multiple
    of 8, so v4 takes its wide-tile path."""
    require_cuda()
    side = 46344
    need = 3 * side * side * 2  # x, out and the reference
    if torch.cuda.mem_get_info()[0] < need * 1.2:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory")
    x = torch.randn(side, side, dtype=torch.float16, device="cuda")
    assert torch.equal(memory_ops.transpose(x, version=version), x.t().contiguous())
    del x
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.large
def test_copy_and_strided_copy_beyond_int32_elements():
    require_cuda()
    n = 2**31 + 1001
    if torch.cuda.mem_get_info()[0] < 3 * n * 2 * 1.2:
        pytest.skip("needs 15 GiB of free GPU memory")
    x = torch.randn(n, dtype=torch.float16, device="cuda")
    for version in VERSIONS["copy"]:
        assert torch.equal(memory_ops.copy(x, version=version), x)
    assert torch.equal(memory_ops.strided_copy(x, 2), x[::2])
    del x
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("version", VERSIONS["transpose"])
def test_sanitizer_small_transpose(version):
    """The small run the GPU pass executes under compute-sanitizer: every transpose kernel
    instantiation (element size x version, v4's fast path and its fallback), ragged edges,
    batches, a misaligned and a strided view."""
    require_cuda()
    for dtype in DTYPES:
        for shape in ((33, 65), (136, 200), (3, 40, 72), (1, 1)):
            x = torch.randn(shape, dtype=dtype, device="cuda")
            assert_same(memory_ops.transpose(x, version=version), reference_transpose(x))
        x = torch.randn(40, 73, dtype=dtype, device="cuda")[:, 1:]
        assert_same(memory_ops.transpose(x, version=version), reference_transpose(x))
        # Every shift of v5's chunks on both sides, and the rows before the first boundary.
        base = torch.randn(141, 139, dtype=dtype, device="cuda")
        for offset in (1, 3, 7):
            x = base[offset:, offset:]
            assert_same(memory_ops.transpose(x, version=version), reference_transpose(x))


@pytest.mark.cuda
@pytest.mark.sanitize
def test_sanitizer_small_thin_transpose():
    """The thin kernels (version=None only) under compute-sanitizer: both mappings, every
    element size, both pad intervals (31, 62), the bound, a batch, a misaligned and a strided
    view."""
    require_cuda()
    for dtype in DTYPES:
        for shape in ((1, 1), (3, 257), (257, 3), (16, 129), (129, 16), (2, 5, 131), (2, 131, 5),
                      (31, 129), (129, 62), (64, 131), (2, 131, 33),
                      # 2-byte pairs: rows of odd length (both heads), a long dim of 2 and 3
                      (17, 1001), (1001, 17), (2, 3), (3, 2)):
            x = torch.randn(shape, dtype=dtype, device="cuda")
            # a dim of 1 makes the transpose a copy, which the copy route takes first
            assert memory_ops.default_choice("transpose", x) == ("copy" if 1 in shape else "thin"), shape
            assert_same(memory_ops.transpose(x), reference_transpose(x))
        base = torch.randn(3, 260, dtype=dtype, device="cuda")
        for x in (base[:, 1:], base[:, ::2], base.t()[1:]):
            assert_same(memory_ops.transpose(x), reference_transpose(x))


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("version", VERSIONS["copy"])
def test_sanitizer_small_copy(version):
    require_cuda()
    for dtype in DTYPES:
        for n in (1, 33, 4099):
            x = torch.randn(n + 1, dtype=dtype, device="cuda")
            assert_same(memory_ops.copy(x, version=version), x)
            assert_same(memory_ops.copy(x[1:], version=version), x[1:])  # misaligned view
            assert_same(memory_ops.strided_copy(x, 3), x[::3])


def test_wide_kernels_use_128bit_accesses(tmp_path):
    """copy v2 and transpose v4/v5 must move their data with 128-bit global loads and stores.
    Scalar global accesses are allowed only for copy v2's one-element tail (one load, one
    store) and for v5's chunks that cross the matrix edge: kVec elements per chunk a thread
    loads (5) or stores (4), plus one store (in a loop) per destination vector for the rows
    before a destination row's first 16-byte boundary. v5 keeps one 16-byte access per chunk."""
    import re
    from pathlib import Path

    vec = {"t": 8, "j": 4, "m": 2}  # 16 bytes of uint16_t, uint32_t, uint64_t (mangled t, j, m)
    checked = {"copy_vectorized": 0, "transpose_wide_tiles_any_alignment": 0,
               "transpose_wide_tiles": 0}
    for name, body in ptx_kernels(Path(__file__).parent / "memory_kernels.cu", tmp_path).items():
        kind = next((k for k in checked if k in name), None)
        if kind is None:
            continue
        wide_loads = len(re.findall(r"ld\.global(?:\.nc)?\.v4\.", body))
        wide_stores = len(re.findall(r"st\.global(?:\.wb)?\.v4\.", body))
        scalar_loads = len(re.findall(r"ld\.global(?:\.nc)?\.[buf]\d+", body))
        scalar_stores = len(re.findall(r"st\.global(?:\.wb)?\.[buf]\d+", body))
        assert wide_loads >= 1 and wide_stores >= 1, name
        if kind == "transpose_wide_tiles_any_alignment":
            k_vec = vec[re.search(r"I([tjm])E", name).group(1)]
            assert wide_loads == 5 and wide_stores == 4, (name, wide_loads, wide_stores)
            allowed_loads, allowed_stores = 5 * k_vec, 4 * (k_vec + 1)
        else:
            allowed_loads = allowed_stores = 1 if kind == "copy_vectorized" else 0
        assert scalar_loads <= allowed_loads and scalar_stores <= allowed_stores, (
            name, scalar_loads, scalar_stores)
        checked[kind] += 1
    # one instantiation per element size
    assert checked == {"copy_vectorized": 3, "transpose_wide_tiles_any_alignment": 3,
                       "transpose_wide_tiles": 3}


# A tensor where a number goes and the other way round: a TypeError naming the op and the argument.
MISPLACED = {
    "strided_copy(x, tensor)": (lambda x: memory_ops.strided_copy(x, x), r"^strided_copy: stride must be an integer, got a tensor"),
    "strided_copy(2, x)": (lambda x: memory_ops.strided_copy(2, x), r"^strided_copy: x must be a tensor, got an int"),
    "transpose(2.0)": (lambda x: memory_ops.transpose(2.0), r"^transpose: x must be a tensor, got a float"),
    "copy([x])": (lambda x: memory_ops.copy([x]), r"^copy: x must be a tensor, got a list"),
    "default_choice(x, op)": (lambda x: memory_ops.default_choice(x, "transpose"), r"^default_choice: op must be a str, got a tensor"),
}


@pytest.mark.parametrize("call", list(MISPLACED))
def test_misplaced_arguments_raise_type_error(call, device):
    assert_misplaced(*MISPLACED[call], torch.randn(4, 4, device=device))
