"""Tests for chapter 3: every op x rung x dtype x irregular shape, CPU and CUDA.

Reductions round: the kernels accumulate float16/bfloat16 in float32 and float64 in float64,
in an order of their own, and round once to the output dtype. The references below are
computed in float64 and compared element by element against a bound derived from the
magnitudes involved (written next to each bound with its reason), so that a bound is tight
where the arithmetic is exact and loose only where rounding really accumulates. Where an
exact answer exists, it is demanded bit for bit: amax (a max never rounds), sums of
small integers (every partial sum is an integer below 2^24, so float32 accumulates them
exactly in any order), and the gradient of sum (a broadcast).

Run against the installed extension (pip install .) or the JIT build (COURSE_EXT_ROUTE=jit);
the header line says which one was loaded.
"""
import math

import pytest
import torch

import shared_reduction
from coursekit import results, shapes
from coursekit.pytest_plugin import (DTYPES, assert_misplaced, dtype_id, floor, launched_kernels,
                                     poison_allocator, require_cuda, shape_id)
from shared_reduction import LADDERS, VERSIONS

REDUCE_OPS = ("sum", "amax")
SOFTMAX_OPS = ("softmax", "log_softmax")
LOW_PRECISION = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def acc_dtype(dtype):
    """The dtype the kernels accumulate in (module docstring of shared_reduction)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def eps_out(dtype):
    """One rounding of the output: two roundings of nearly equal values differ by at most the
    difference of the values plus one ulp, and one ulp <= eps * |value|."""
    return torch.finfo(dtype).eps


def eps_acc(dtype):
    return torch.finfo(acc_dtype(dtype)).eps


def assert_within(out, expected, bound, what=""):
    """|out - expected| <= bound element by element (assert_close's |a - e| <= atol + rtol |e|
    with a per-element atol). Non-finite expected values must be matched exactly: NaN where
    the reference has NaN, the same infinity where it has one, or where its finite value lies
    beyond the output dtype's range (float16's 65504) and so rounds to an infinity."""
    out64, exp64 = out.double(), expected.double()
    rounded = expected.to(out.dtype).double()
    exp64 = torch.where(rounded.isinf() & exp64.isfinite(), rounded, exp64)
    bound = torch.broadcast_to(torch.as_tensor(bound, dtype=torch.float64, device=out.device),
                               exp64.shape)
    same = (out64 == exp64) | (out64.isnan() & exp64.isnan())
    close = exp64.isfinite() & out64.isfinite() & ((out64 - exp64).abs() <= bound)
    ok = same | close
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0]
        at = tuple(bad.tolist())
        raise AssertionError(
            f"{what}: {int((~ok).sum())} of {ok.numel()} elements out of bounds; first at {at}: "
            f"got {out64[at].item()!r}, expected {exp64[at].item()!r}, "
            f"allowed error {bound[at].item():.3g}")


def assert_like(out, expected_shape, dtype, device):
    assert tuple(out.shape) == tuple(expected_shape), (tuple(out.shape), tuple(expected_shape))
    assert out.dtype == dtype and out.device.type == torch.device(device).type
    assert out.is_contiguous()


def layout(shape, dim):
    """The ladder a call runs on (shared_reduction.LADDERS): dim=None -> the whole tensor; an
    int dim views x as (outer, n, inner) with inner = the product of the sizes after dim:
    inner == 1 -> rows, inner > 1 -> columns. None when inner == 0 (no element to reduce,
    no rung asked for)."""
    if dim is None:
        return "whole"
    inner = math.prod(shape[dim % len(shape) + 1:])
    return "rows" if inner == 1 else "columns" if inner > 1 else None


def reduced_size(shape, dim):
    return math.prod(shape) if dim is None else shape[dim]


def run_reduce(op, x, dim=None, keepdim=False, version=None):
    return getattr(shared_reduction, op)(x, dim, keepdim, version=version)


# ---------------------------------------------------------------------------------------------
# Plain-PyTorch references
# ---------------------------------------------------------------------------------------------
def reference_sum(x, dim=None, keepdim=False):
    """The sum in float64 (not rounded to x's dtype: the bound below accounts for that)."""
    x64 = x.double()
    return x64.sum() if dim is None else x64.sum(dim, keepdim)


def reference_amax(x, dim=None, keepdim=False):
    x64 = x.double()
    return (x64.amax() if dim is None else x64.amax(dim, keepdim)).to(x.dtype)


def sum_bound(x, dim, keepdim, exact):
    """What a correct sum may be off by: one rounding of the output (eps_out * |sum|) plus the
    accumulation's rounding. Any order of additions (tree, blocked, a loop per thread, a
    combine over blocks) errs by at most depth * eps_acc * sum|x|, depth the longest chain of
    additions; with random signs the errors are a random walk far below that, so
    (2 log2(n) + 8) * eps_acc * sum|x| holds for every rung with a wide margin on inputs of
    random sign (the callers' inputs; a row of equal values is chosen to sum exactly) while still
    failing a sum that rounded its partials to float16/bfloat16 (2^16 times coarser).
    Dropped or doubled elements are caught exactly by the integer-valued inputs instead."""
    n = max(reduced_size(tuple(x.shape), dim), 1)
    magnitude = reference_sum(x.abs(), dim, keepdim)
    return (eps_out(x.dtype) * exact.abs() + (2 * math.log2(n + 1) + 8) * eps_acc(x.dtype)
            * magnitude + floor(x.dtype))


def integer_valued(shape, dtype, device, high=8):
    """Random integers in [-high, high], exact in every dtype here; with at most 2^20 + 3
    elements per sum, every partial sum is an integer below 8 * (2^20 + 3) < 2^24, so float32
    (and float64) accumulate it exactly in any order, and the sum rounds once: bitwise equal
    to the float64 sum rounded to the dtype."""
    return torch.randint(-high, high + 1, shape, device=device).to(dtype)


def check_reduction(op, x, dim, keepdim, version, what=""):
    """Run op on x and compare with the reference; returns the result."""
    if op == "amax":
        expected = reference_amax(x, dim, keepdim)
        poison_allocator(expected)
        out = run_reduce(op, x, dim, keepdim, version)
        assert_like(out, expected.shape, x.dtype, x.device)
        # A max never rounds: exact, NaN propagating as torch.amax.
        torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True, msg=what or None)
        return out
    exact = reference_sum(x, dim, keepdim)
    poison_allocator(exact.to(x.dtype))
    out = run_reduce(op, x, dim, keepdim, version)
    assert_like(out, exact.shape, x.dtype, x.device)
    assert_within(out, exact, sum_bound(x, dim, keepdim, exact), what)
    return out


def softmax_reference(x, dim, log):
    return (torch.log_softmax if log else torch.softmax)(x.double(), dim)


def softmax_bound(x, dim, ref, log):
    """Allowed |ours - exact| for softmax (log=False) and log_softmax (log=True) of x over dim.

    softmax, relative to the output: one rounding of the output (eps_out); the row sum of
    exponentials, a sum of positive terms whose relative error is at most ~0.25 eps_acc
    sqrt(n) even when added one by one (a random walk of n roundings), bounded here by
    eps_acc (16 + sqrt(n)), 16 for the division and the ulps of exp; and exp's own error,
    which grows with its argument d = x - max (__expf: 2 + 1.16 |d| ulp): 2 eps_acc |d|.
    On a row of 2^20 float32 elements this is ~1.3e-4 relative: still far tighter than a lost
    block (1/64 of the row sum) or a missed rescale.

    log_softmax = (x - max) - log(sum): absolute error eps_acc (16 + sqrt(n)) from the row
    sum's relative error (log turns it into an absolute one), plus rounding of |y| =
    |x - max| + log(sum) in the compute and output dtypes: (eps_out + 4 eps_acc) |y|."""
    n = x.shape[dim] if x.dim() else 1
    e_o, e_a = eps_out(x.dtype), eps_acc(x.dtype)
    if log:
        return (e_o + 4 * e_a) * ref.abs() + e_a * (16 + math.sqrt(n)) + floor(x.dtype)
    x64 = x.double()
    d = (x64 - x64.amax(dim, keepdim=True)).abs() if x.numel() else x64
    return (e_o + e_a * (16 + math.sqrt(n) + 2 * d)) * ref.abs() + floor(x.dtype)


def check_softmax(op, x, dim, version, what=""):
    log = op == "log_softmax"
    ref = softmax_reference(x, dim, log)
    poison_allocator(ref.to(x.dtype))
    out = getattr(shared_reduction, op)(x, dim, version=version)
    # (any memory layout, as torch.softmax's output keeps the input's)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    assert_within(out, ref, softmax_bound(x, dim, ref, log), what)
    return out


def softmax_backward_reference(grad, y, dim, log):
    """torch's own backward formulas (what autograd runs for torch.softmax/log_softmax),
    applied in float64 to the same y and grad."""
    g, y = grad.double(), y.double()
    if log:
        return torch._log_softmax_backward_data(g, y, dim, torch.float64)
    return torch._softmax_backward_data(g, y, dim, torch.float64)


def softmax_backward_bound(grad, y, dim, ref, log, dtype):
    """Allowed |ours - exact| for dx. y is taken as carrying the forward's error (its own
    rounding to dtype and the forward bound above, |d| <= ~12 for the random normal inputs
    used with it): relative y_rel = eps_out + eps_acc (40 + sqrt(n)).

    softmax, dx = p (g - c) with c = sum(g p): g - c may cancel, so the errors scale with
    p (|g| + |c| + sum|g p|): y's error, the row sum's accumulation (inside y_rel's sqrt(n)
    term) and 4 roundings of the products and the difference; plus one output rounding. A y
    below the smallest normal (float16 rows longer than ~16000) is off by up to floor(dtype)
    absolutely, not relatively: floor (|g| + |c|) more, and floor sum|g| p through c.
    log_softmax, dx = g - exp(y) S with S = sum(g): exp(y) is off by y's absolute error
    ((eps_out + 8 eps_acc) |y| + eps_acc (20 + sqrt(n))) plus exp's own (2 |y| ulp, in the 8);
    S by eps_acc (16 + sqrt(n)) sum|g|; and one rounding of g - p S (4 eps_acc |g|)."""
    n = y.shape[dim] if y.dim() else 1
    e_o, e_a = eps_out(dtype), eps_acc(dtype)
    g, y = grad.double(), y.double()
    base = e_o * ref.abs() + floor(dtype)
    if log:
        p, s = y.exp(), g.sum(dim, keepdim=True)
        y_err = (e_o + 8 * e_a) * y.abs() + e_a * (20 + math.sqrt(n))
        return (base + 4 * e_a * g.abs() + p * s.abs() * y_err
                + p * e_a * (16 + math.sqrt(n)) * g.abs().sum(dim, keepdim=True))
    c = (g * y).sum(dim, keepdim=True)
    y_rel = e_o + e_a * (40 + math.sqrt(n))
    spread = g.abs() + c.abs()
    return (base + (y_rel + 4 * e_a) * y * (spread + (g * y).abs().sum(dim, keepdim=True))
            + floor(dtype) * (spread + y * g.abs().sum(dim, keepdim=True)))


# ---------------------------------------------------------------------------------------------
# 1. sum and amax: every rung x dtype x irregular shape
# ---------------------------------------------------------------------------------------------
# (shape, dim, keepdim). Row and element counts: 1, one off a warp either way (31, 33), not a
# multiple of any block or vector width (1000), one past a power of two (4097, 2^20 + 3), and
# 0; few rows where rows are long, to keep the CPU half fast.
REDUCE_CASES = [
    # the whole tensor (dim=None): 0-d, empty, 1-D, and 3-D tensors seen as one flat array
    ((), None, False), ((0,), None, False), ((1,), None, False), ((31,), None, False),
    ((33,), None, False), ((1000,), None, False), ((4097,), None, False),
    ((2**20 + 3,), None, False), ((5, 33, 31), None, False), ((3, 0, 7), None, False),
    # rows (inner == 1)
    ((5, 1), -1, False), ((5, 31), -1, False), ((5, 33), 1, False), ((7, 1000), -1, True),
    ((3, 4097), -1, False), ((2, 2**20 + 3), -1, False),
    ((600, 31), -1, False),  # many short rows: several rows per warp, the last warp partial
    ((0, 33), -1, False),  # no rows
    ((1,), 0, False), ((1000,), 0, True), ((4097,), -1, False),  # 1-D: one row
    ((5, 33, 31), 2, False), ((5, 33, 31), -1, True),
    ((7, 33, 1), 1, False),  # inner == 1 because the dims after dim are all 1: still rows
    ((3, 0), -1, False),  # rows of no element: sum 0, amax raises
    # columns (inner > 1)
    ((33, 5), 0, False), ((1000, 3), 0, True), ((4097, 2), 0, False), ((2**20 + 3, 2), 0, False),
    ((2, 100003), 0, False),  # n = 2 and many columns
    # single elements split into ranges, 16 row groups in flight, and a remainder past them
    ((100003, 3), 0, False), ((8191, 37), 0, True),
    ((1, 257), 0, False),  # n = 1
    ((0, 5), 0, False),  # columns of no element: sum 0, amax raises
    ((5, 33, 31), 0, False), ((5, 33, 31), 1, True), ((5, 33, 31), -2, False),
    ((5, 33, 31), -3, True),
    # nothing to reduce at all and inner == 0: only version=None
    ((3, 4, 0), 1, False), ((0, 4, 3), 1, False),
]


def case_id(case):
    shape, dim, keepdim = case
    return f"{shape_id(shape) or 'scalar'}-dim{dim}" + ("-keep" if keepdim else "")


# Every rung only on calls where its ladder applies, and version=None on every call.
REDUCE_PARAMS = [pytest.param(version, case, id=f"{version}-{case_id(case)}")
                 for case in REDUCE_CASES
                 for version in (*LADDERS.get(layout(case[0], case[1]), ()), None)]


@pytest.mark.parametrize("version,case", REDUCE_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_matches_reference(op, dtype, version, case, device):
    shape, dim, keepdim = case
    x = torch.randn(shape, dtype=dtype, device=device)
    if op == "amax" and reduced_size(shape, dim) == 0:
        with pytest.raises(RuntimeError, match="amax: cannot reduce over zero elements"):
            run_reduce(op, x, dim, keepdim, version)
        return
    check_reduction(op, x, dim, keepdim, version)
    if op == "sum":
        # Small integers: the exact sum, bit for bit (integer_valued's docstring says why):
        # a dropped, doubled or misplaced element cannot hide in the tolerance.
        x = integer_valued(shape, dtype, device)
        expected = reference_sum(x, dim, keepdim).to(dtype)
        torch.testing.assert_close(run_reduce(op, x, dim, keepdim, version), expected, rtol=0,
                                   atol=0)


# ---------------------------------------------------------------------------------------------
# 2. Non-contiguous and offset views (the glue makes them contiguous; an offset view is
#    contiguous already, so the kernels see a data pointer one element past 16-byte alignment)
# ---------------------------------------------------------------------------------------------
VIEWS = {
    "transposed": lambda t: t.t(),
    "column_offset": lambda t: t[:, 1:],
    # contiguous, one row (1031 elements, odd) in: every row starts at a different alignment.
    "row_offset": lambda t: t[1:],
    # 1-D, contiguous, one element past an aligned start.
    "flat_offset": lambda t: t.flatten()[1:],
    # 2-D, contiguous, the whole matrix shifted by one element.
    "offset_matrix": lambda t: t.flatten()[1:1 + 64 * 1031].view(64, 1031),
    "every_other_row": lambda t: t[::2],
    "expanded": lambda t: t[:1].expand(65, -1),
}


def dims_for(ladder, ndim):
    """The dims of a 1-D or 2-D tensor whose calls run on `ladder`."""
    return {"whole": [None], "rows": [-1], "columns": [0] if ndim == 2 else []}[ladder]


def ladder_of(version):
    return next(name for name, rungs in LADDERS.items() if version in rungs)


VIEW_PARAMS = [pytest.param(version, view, id=f"{version}-{view}")
               for view in VIEWS for version in (*VERSIONS["sum"], None)
               if version is None
               or dims_for(ladder_of(version), 1 if view == "flat_offset" else 2)]


@pytest.mark.parametrize("version,view", VIEW_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_reduce_views(dtype, version, view, device):
    base = torch.randn(65, 1031, dtype=dtype, device=device)
    x = VIEWS[view](base)
    ladders = LADDERS if version is None else [ladder_of(version)]
    for op in REDUCE_OPS:
        for ladder in ladders:
            for dim in dims_for(ladder, x.dim()):
                check_reduction(op, x, dim, False, version, f"{op} {view} dim={dim}")


# ---------------------------------------------------------------------------------------------
# 3. Special values
# ---------------------------------------------------------------------------------------------
def special_rows(n, dtype, device):
    """Nine rows of n elements (n >= 8), each a special case, with the reason:"""
    x = torch.randn(9, n, dtype=torch.float64, device=device)
    inf, nan = float("inf"), float("nan")
    x[0, n // 2] = nan              # NaN propagates (fmaxf would drop it: a classic amax bug)
    x[1, 3] = inf                   # +inf
    x[2, n - 1] = -inf              # -inf in the last element (a ragged tail)
    x[3, 0], x[3, n - 2] = inf, -inf  # inf + -inf = NaN
    # all equal: every element ties for the max. A value with an 8-bit significand (bfloat16's):
    # n copies add up exactly in float32 in any order, which a row of equal values needs, as
    # its rounding errors would not be random (a loop adding c to n c errs systematically).
    x[4] = x[4, 0].to(torch.bfloat16).double()
    x[5] = -inf                     # all -inf
    # large magnitudes: 1e4 overflows a naive exp; clamped so float16 (max 65504) holds them
    x[6] = x[6].clamp(-6, 6) * 1e4
    x[7, 0], x[7, -1] = nan, inf    # NaN and inf together: NaN
    return x.to(dtype)              # row 8: ordinary


SPECIAL_PARAMS = [pytest.param(version, dim, id=f"{version}-dim{dim}")
                  for dim in (None, -1, 0)
                  for version in (*LADDERS[layout((9, 1000), dim)], None)]


@pytest.mark.parametrize("version,dim", SPECIAL_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_special_values(op, dtype, version, dim, device):
    x = special_rows(1000, dtype, device)
    check_reduction(op, x, dim, False, version, f"dim={dim}")
    # Subsets of the rows, so that a dim=None result is more than one NaN: +inf wins (sum and
    # amax inf), -inf wins (sum -inf), finite with large magnitudes (float16's sum overflows to
    # an infinity like the reference's), all -inf.
    for rows in ([1, 4, 6, 8], [2, 4, 8], [4, 6, 8], [5]):
        check_reduction(op, x[rows], dim, False, version, f"rows {rows}, dim={dim}")


# ---------------------------------------------------------------------------------------------
# 4. softmax and log_softmax: every version x dtype x row length
# ---------------------------------------------------------------------------------------------
# (shape, dim). Lengths on both sides of the resident shapes' capacities (reduction.h:
# kResidentShapes, shape_fits: 128 ... 16384 elements in float32, 256 ... 16384 in 2-byte
# dtypes): 129, 1025, 4097 and 8193 land in different shapes; 16385 is one past what one
# block holds, so v4 falls back and v5 splits (in 2 blocks; 32769 in 3); 2^20 + 3 splits
# over 65 blocks.
SOFTMAX_CASES = [
    ((7, 1), -1), ((7, 31), -1), ((7, 33), -1), ((7, 129), -1), ((5, 777), -1), ((5, 1000), -1),
    ((5, 1025), -1), ((3, 4097), -1), ((3, 8193), -1), ((2, 16385), -1), ((2, 32769), -1),
    ((2, 2**20 + 3), -1),
    ((140, 20001), -1),  # 2-byte rows for every SM, too long for registers: parked in shared memory
    ((300, 33), -1),  # many rows: several warps per block, the last block partial
    ((0, 33), -1),  # no rows
    ((), -1), ((), 0),  # 0-d, as torch allows
    ((1000,), 0),  # 1-D
    ((4, 7, 33), 0), ((4, 7, 33), 1), ((4, 7, 33), 2), ((4, 7, 33), -1), ((4, 7, 33), -3),
]


@pytest.mark.parametrize("case", SOFTMAX_CASES,
                         ids=[f"{shape_id(s) or 'scalar'}-dim{d}" for s, d in SOFTMAX_CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", (*VERSIONS["softmax"], None), ids=str)
@pytest.mark.parametrize("op", SOFTMAX_OPS)
def test_softmax_matches_reference(op, version, dtype, case, device):
    """On the CPU a rung runs what version=None runs (reduction_cpu.cpp never reads it; the
    glue only parses it): there the rungs are checked on the cases of up to 2^14 elements, and
    version=None takes every case."""
    shape, dim = case
    if device == "cpu" and version is not None and math.prod(shape) > 2**14:
        pytest.skip("the CPU path ignores the rung: version=None covers this case")
    check_softmax(op, torch.randn(shape, dtype=dtype, device=device), dim, version)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
@pytest.mark.parametrize("version", (*VERSIONS["softmax"], None), ids=str)
@pytest.mark.parametrize("op", SOFTMAX_OPS)
def test_softmax_longest_rows(op, version, dtype, device):
    """One row of 2^21 + 1 elements: 257 blocks of v5's split shape in float32, 129 in 2-byte
    dtypes: split on a GPU whose SMs hold them all at once, streamed on one that does not.
    On the CPU, version=None alone: the CPU path never reads the rung."""
    if device == "cpu" and version is not None:
        pytest.skip("the CPU path ignores the rung: version=None covers this case")
    check_softmax(op, torch.randn(1, 2**21 + 1, dtype=dtype, device=device), -1, version)


SOFTMAX_VIEWS = {k: v for k, v in VIEWS.items() if k != "expanded"}


@pytest.mark.parametrize("view", list(SOFTMAX_VIEWS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", (*VERSIONS["softmax"], None), ids=str)
def test_softmax_views(version, dtype, view, device):
    x = SOFTMAX_VIEWS[view](torch.randn(65, 1031, dtype=dtype, device=device))
    for op in SOFTMAX_OPS:
        for dim in (-1, 0) if x.dim() == 2 else (0,):
            check_softmax(op, x, dim, version, f"{op} {view} dim={dim}")


def softmax_special_rows(n, dtype, device):
    """Eight rows of n elements, each a special case (the reason beside it); NaN and -inf
    follow torch.softmax."""
    x = torch.randn(8, n, dtype=torch.float64, device=device)
    inf, nan = float("inf"), float("nan")
    x[1, n // 2] = nan               # a NaN: the whole row NaN
    x[2] = -inf                      # all -inf: NaN (-inf - -inf), like torch
    x[3, : n // 2] = -inf            # the first half -inf: a whole split block of -inf, and an
    #                                  online max that starts at -inf (exp(-inf - -inf) = NaN)
    x[4, ::3] = -inf                 # scattered -inf, the first element among them
    x[5] = x[5, 0]                   # all equal: 1/n each
    x[6] = x[6].clamp(-6, 6) * 1e4   # large magnitudes: a naive exp overflows (float16 holds 6e4)
    x[7, :-1] = -inf                 # one finite element, the last: 1 there, 0 elsewhere
    return x.to(dtype)               # row 0: ordinary


@pytest.mark.parametrize("n", (8, 1000, 40000))  # 40000: split in every dtype that splits
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", (*VERSIONS["softmax"], None), ids=str)
@pytest.mark.parametrize("op", SOFTMAX_OPS)
def test_softmax_special_values(op, version, dtype, n, device):
    x = softmax_special_rows(n, dtype, device)
    out = check_softmax(op, x, -1, version)
    # Spelled out, in case the reference ever changes its mind: these rows are NaN.
    assert out[[1, 2]].isnan().all()
    assert not out[[0, 3, 4, 5, 6, 7]].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", (*VERSIONS["softmax"], None), ids=str)
def test_softmax_rows_sum_to_one(version, dtype, device):
    """A property check independent of the reference: rows of softmax sum to 1, and so do the
    exponentials of log_softmax. softmax: the outputs' relative errors (softmax_bound) weighted
    by the outputs themselves: eps_out + eps_acc (16 + sqrt(n) + 2 E|d|) <= eps_out + 150
    eps_acc for n = 3001 and |d| <= ~25. log_softmax: an absolute error of (eps_out + 8
    eps_acc) |y| in y is a relative one in exp(y), weighted by exp(y): at most (eps_out + 8
    eps_acc) times the entropy (<= log n), plus the row sum's eps_acc (40 + sqrt(n))."""
    n = 3001
    x = torch.randn(6, n, dtype=dtype, device=device) * 3
    e_o, e_a = eps_out(dtype), eps_acc(dtype)
    rows = shared_reduction.softmax(x, version=version).double().sum(-1)
    torch.testing.assert_close(rows, torch.ones_like(rows), rtol=0, atol=e_o + 150 * e_a)
    rows = shared_reduction.log_softmax(x, version=version).double().exp().sum(-1)
    torch.testing.assert_close(rows, torch.ones_like(rows), rtol=0,
                               atol=(e_o + 8 * e_a) * (2 + math.log(n)) + e_a * (40 + math.sqrt(n)))


# ---------------------------------------------------------------------------------------------
# 5. softmax_backward against torch's backward formulas
# ---------------------------------------------------------------------------------------------
BACKWARD_CASES = [((7, 1), -1), ((7, 31), -1), ((7, 33), -1), ((5, 1000), -1), ((3, 4097), -1),
                  ((3, 8193), -1), ((2, 16385), -1), ((2, 40000), -1), ((2, 2**20 + 3), -1), ((140, 20001), -1),
                  ((0, 33), -1), ((), -1), ((4, 7, 33), 1), ((4, 7, 33), 0)]


@pytest.mark.parametrize("case", BACKWARD_CASES,
                         ids=[f"{shape_id(s) or 'scalar'}-dim{d}" for s, d in BACKWARD_CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("log", (False, True), ids=("softmax", "log_softmax"))
def test_softmax_backward_matches_reference(log, dtype, case, device):
    shape, dim = case
    x = torch.randn(shape, dtype=torch.float64, device=device)
    y = softmax_reference(x, dim, log).to(dtype)  # what the forward stored
    grad = torch.randn(shape, dtype=dtype, device=device)
    ref = softmax_backward_reference(grad, y, dim, log)
    poison_allocator(ref.to(dtype))
    out = shared_reduction.softmax_backward(grad, y, dim, log)
    assert out.shape == shape and out.dtype == dtype and out.device == y.device
    assert_within(out, ref, softmax_backward_bound(grad, y, dim, ref, log, dtype))


# log_softmax's dx takes exp(y) from __expf in 2-byte dtypes (softmax_backward_kernels.cu,
# exp_of_y), whose error grows with |y|: outputs y down to about -150 (x of spread 20), in rows
# held in registers, parked in shared memory (140 rows: the shared path from 132 SMs down) and
# split over blocks.
@pytest.mark.parametrize("shape", ((5, 1000), (140, 20001), (3, 40000)), ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_log_softmax_backward_wide_range(dtype, shape, device):
    if device == "cpu" and shape[0] > 5:
        pytest.skip("the CPU path has one plan: the short rows cover it")
    x = 20 * torch.randn(shape, dtype=torch.float64, device=device)
    y = softmax_reference(x, -1, True).to(dtype)
    grad = torch.randn(shape, dtype=dtype, device=device)
    ref = softmax_backward_reference(grad, y, -1, True)
    out = shared_reduction.softmax_backward(grad, y, -1, True)
    assert_within(out, ref, softmax_backward_bound(grad, y, -1, ref, True, dtype))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=dtype_id)
@pytest.mark.parametrize("log", (False, True), ids=("softmax", "log_softmax"))
def test_softmax_backward_views(log, dtype, device):
    """grad and y non-contiguous or offset (what autograd hands over after a transpose): true
    softmax outputs and random gradients written into views of larger buffers."""
    for name in ("transposed", "column_offset", "row_offset", "offset_matrix", "every_other_row"):
        view = VIEWS[name]
        y = view(torch.empty(65, 1031, dtype=dtype, device=device))
        grad = view(torch.empty(65, 1031, dtype=dtype, device=device))
        for dim in (-1, 0):
            y.copy_(softmax_reference(torch.randn(y.shape, dtype=torch.float64, device=device),
                                      dim, log))
            grad.copy_(torch.randn(y.shape, device=device))
            ref = softmax_backward_reference(grad, y, dim, log)
            out = shared_reduction.softmax_backward(grad, y, dim, log)
            assert out.shape == y.shape and out.dtype == dtype
            assert_within(out, ref, softmax_backward_bound(grad, y, dim, ref, log, dtype),
                          f"{name} dim={dim}")


# ---------------------------------------------------------------------------------------------
# 6. Gradients: gradcheck in float64, low precision against PyTorch
# ---------------------------------------------------------------------------------------------
GRAD_PARAMS = [pytest.param(version, dim, id=f"{version}-dim{dim}")
               for dim in (None, 0, 1, -1)
               for version in (*LADDERS[layout((3, 4, 5), dim)], None)]


@pytest.mark.parametrize("version,dim", GRAD_PARAMS)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_gradcheck(op, version, dim, device):
    # A random permutation of multiples of 0.1: no ties and no near-ties, so amax's finite
    # differences never cross to another maximum.
    x = (torch.randperm(60, device=device).double() * 0.1 - 3).reshape(3, 4, 5)
    x.requires_grad_()
    for keepdim in (False,) if dim is None else (False, True):
        fn = lambda t: run_reduce(op, t, dim, keepdim, version)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x,))


@pytest.mark.parametrize("shape,dim", [((4, 37), -1), ((3, 5, 7), 1), ((2, 3), 0)],
                         ids=["4x37", "3x5x7-dim1", "2x3-dim0"])
@pytest.mark.parametrize("version", (*VERSIONS["softmax"], None), ids=str)
@pytest.mark.parametrize("op", SOFTMAX_OPS)
def test_softmax_gradcheck(op, version, shape, dim, device):
    x = torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True)
    fn = lambda t: getattr(shared_reduction, op)(t, dim, version=version)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))


@pytest.mark.parametrize("log", (False, True), ids=("softmax", "log_softmax"))
def test_softmax_gradient_of_long_rows_float64(log, device):
    """Rows longer than one block holds (the split path in float32; float64 streams them):
    too long for gradcheck's finite differences, so the autograd gradient against torch's in
    float64, where the bound is ~1e-12."""
    x = torch.randn(2, 17000, dtype=torch.float64, device=device, requires_grad=True)
    op = shared_reduction.log_softmax if log else shared_reduction.softmax
    w = torch.randn(2, 17000, dtype=torch.float64, device=device)
    ours, = torch.autograd.grad((op(x) * w).sum(), x)
    ref = softmax_backward_reference(w, softmax_reference(x.detach(), -1, log), -1, log)
    assert_within(ours, ref, softmax_backward_bound(w, softmax_reference(x.detach(), -1, log),
                                                    -1, ref, log, torch.float64))


@pytest.mark.parametrize("dim", (None, -1, 0, 1), ids=lambda d: f"dim{d}")
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
def test_sum_low_precision_gradients(dtype, dim, device):
    """The gradient of a sum is the output gradient broadcast: bit for bit torch's."""
    x = torch.randn(33, 257, 3, dtype=dtype, device=device, requires_grad=True)
    for keepdim in (False,) if dim is None else (False, True):
        out = shared_reduction.sum(x, dim, keepdim)
        grad = torch.randn(out.shape, dtype=dtype, device=device)
        ours, = torch.autograd.grad(out, x, grad)
        theirs, = torch.autograd.grad(x.sum() if dim is None else x.sum(dim, keepdim), x, grad)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("dim", (None, -1, 0), ids=lambda d: f"dim{d}")
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
def test_amax_low_precision_gradients(dtype, dim, device):
    """Ties on purpose (integers in [-3, 3]: ~140 tied maxima per row): the gradient is shared
    evenly among them, as torch.amax's. The float64 gradient g / count, against ours in the
    dtype: g / count (or g * (1 / count)) in float32, rounded to the dtype: at most two ulps,
    2 eps_out |g / count|, or one subnormal step where g / count falls below float16's
    smallest normal (|g| < ~0.56 with ~9000 tied maxima)."""
    x = torch.randint(-3, 4, (64, 1000), device=device).to(dtype).requires_grad_()
    out = shared_reduction.amax(x, dim)
    grad = torch.randn(out.shape, dtype=dtype, device=device)
    ours, = torch.autograd.grad(out, x, grad)
    x64 = x.detach().double().requires_grad_()
    theirs, = torch.autograd.grad(x64.amax() if dim is None else x64.amax(dim), x64,
                                  grad.double())
    assert_within(ours, theirs, 2 * eps_out(dtype) * theirs.abs() + floor(dtype))
    assert bool(((ours != 0) == (theirs != 0)).all()), "gradient reached a non-maximum"


@pytest.mark.parametrize("shape,dim", [((64, 1000), -1), ((3, 20000), -1), ((33, 4, 65), 0)],
                         ids=["64x1000", "3x20000", "33x4x65-dim0"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
@pytest.mark.parametrize("op", SOFTMAX_OPS)
def test_softmax_low_precision_gradients(op, dtype, shape, dim, device):
    """The whole chain (our forward, our backward) against torch's autograd in float64."""
    log = op == "log_softmax"
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(shape, dtype=dtype, device=device)
    ours, = torch.autograd.grad(getattr(shared_reduction, op)(x, dim), x, grad)
    x64 = x.detach().double().requires_grad_()
    y64 = softmax_reference(x64, dim, log)
    theirs, = torch.autograd.grad(y64, x64, grad.double())
    assert ours.dtype == dtype
    assert_within(ours, theirs, softmax_backward_bound(grad, y64.detach(), dim, theirs, log, dtype))


# ---------------------------------------------------------------------------------------------
# 7. The VERSIONS table, the dispatch and the ladders
# ---------------------------------------------------------------------------------------------
def test_versions_table_matches_dispatch():
    assert set(VERSIONS) == {"sum", "amax", "softmax", "log_softmax"}
    ladders = LADDERS["whole"] + LADDERS["rows"] + LADDERS["columns"]
    assert VERSIONS["sum"] == VERSIONS["amax"] == ladders
    assert len(set(ladders)) == len(ladders), "a rung name in two ladders"
    assert VERSIONS["softmax"] == VERSIONS["log_softmax"] == ("v1", "v2", "v3", "v4", "v5")
    for op in VERSIONS:
        assert list(VERSIONS[op]) == torch.ops.shared_reduction.versions(op), op
    with pytest.raises(RuntimeError, match="versions: unknown op 'xyz'"):
        torch.ops.shared_reduction.versions("xyz")


# A call of each layout: (x shape, dim).
LAYOUT_CALLS = {"whole": ((40, 24), None), "rows": ((40, 24), -1), "columns": ((40, 24), 0)}
WHAT_IT_REDUCES = {"whole": "the whole tensor", "rows": "rows", "columns": "columns"}
LADDER_NAME = {"whole": "whole-tensor", "rows": "rows", "columns": "columns"}


def test_every_listed_version_dispatches_and_others_do_not(device):
    for op in REDUCE_OPS:
        for version in (*VERSIONS[op], None):
            for ladder in LADDERS if version is None else [ladder_of(version)]:
                shape, dim = LAYOUT_CALLS[ladder]
                check_reduction(op, torch.randn(shape, device=device), dim, False, version)
        for bad in ("v0", "v11", "V1", "", "best", "block_per_rows", "v5 "):
            with pytest.raises(RuntimeError,
                               match=f"{op}: unknown version '{bad}'; expected one of v1, v2, v3"):
                run_reduce(op, torch.randn(40, 24, device=device), -1, False, bad)
    for op in SOFTMAX_OPS:
        for version in (*VERSIONS[op], None):
            check_softmax(op, torch.randn(40, 24, device=device), -1, version)
        for bad in ("v0", "v6", "V1", "", "best", "v10"):
            with pytest.raises(RuntimeError,
                               match=f"{op}: unknown version '{bad}'; expected one of v1, v2, v3"):
                getattr(shared_reduction, op)(torch.randn(40, 24, device=device), version=bad)


@pytest.mark.parametrize("version", VERSIONS["sum"])
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_rung_of_another_ladder_raises(op, version, device):
    ladder = ladder_of(version)
    for other in LADDERS:
        if other == ladder:
            continue
        shape, dim = LAYOUT_CALLS[other]
        message = (f"{op}: version '{version}' is a rung of the {LADDER_NAME[ladder]} ladder, "
                   f"but this call reduces {WHAT_IT_REDUCES[other]}")
        with pytest.raises(RuntimeError, match=message):
            run_reduce(op, torch.randn(shape, device=device), dim, False, version)


# ---------------------------------------------------------------------------------------------
# 8. Misuse
# ---------------------------------------------------------------------------------------------
# Every misuse raises a RuntimeError naming the op and the problem.
MISUSES = {
    "sum dim out of range": (lambda d: shared_reduction.sum(torch.randn(3, 4, device=d), 2),
                             r"sum: dim 2 is out of range for a 2-D tensor"),
    "amax negative dim out of range": (lambda d: shared_reduction.amax(torch.randn(3, 4, device=d),
                                                                       -3),
                                       r"amax: dim -3 is out of range for a 2-D tensor"),
    "sum integer": (lambda d: shared_reduction.sum(torch.ones(3, 4, dtype=torch.int32, device=d)),
                    r"sum: x has dtype Int, which is not supported"),
    "amax integer": (lambda d: shared_reduction.amax(torch.arange(5, device=d), 0),
                     r"amax: x has dtype Long, which is not supported"),
    "sum bool": (lambda d: shared_reduction.sum(torch.ones(5, dtype=torch.bool, device=d), 0),
                 r"sum: x has dtype Bool, which is not supported"),
    "amax empty": (lambda d: shared_reduction.amax(torch.randn(0, device=d)),
                   r"amax: cannot reduce over zero elements"),
    "amax empty dim": (lambda d: shared_reduction.amax(torch.randn(3, 0, device=d), -1),
                       r"amax: cannot reduce over zero elements"),
    "softmax dim out of range": (lambda d: shared_reduction.softmax(torch.randn(3, 4, device=d), 3),
                                 r"softmax: dim 3 is out of range"),
    "log_softmax dim out of range": (lambda d: shared_reduction.log_softmax(
        torch.randn(3, 4, device=d), -3), r"log_softmax: dim -3 is out of range"),
    "softmax integer": (lambda d: shared_reduction.softmax(torch.arange(6, device=d)),
                        r"softmax: x has dtype Long, which is not supported"),
    "softmax_backward shape mismatch": (
        lambda d: shared_reduction.softmax_backward(torch.randn(3, 4, device=d),
                                                    torch.randn(3, 5, device=d)),
        r"softmax_backward: grad has shape \[3, 4\] but y has shape \[3, 5\]"),
    "atomic_sum half": (lambda d: shared_reduction.atomic_sum(torch.randn(5, device=d).half()),
                        r"atomic_sum: x has dtype Half, which is not supported \(supported: Float\) "
                        r"for a tensor on (the CPU|CUDA)"),  # the device named beside the dtype
    "atomic_sum double": (lambda d: shared_reduction.atomic_sum(torch.randn(5, device=d).double()),
                          r"atomic_sum: x has dtype Double, which is not supported"),
    "unknown version": (lambda d: shared_reduction.sum(torch.randn(3, 3, device=d), version="v11"),
                        r"sum: unknown version 'v11'; expected one of v1, v2"),
    "softmax unknown version": (lambda d: shared_reduction.softmax(torch.randn(3, 3, device=d),
                                                                   version="v6"),
                                r"softmax: unknown version 'v6'"),
    "whole rung on rows": (lambda d: shared_reduction.sum(torch.randn(3, 3, device=d), -1,
                                                          version="v3"),
                           r"sum: version 'v3' is a rung of the whole-tensor ladder, but this "
                           r"call reduces rows"),
    "whole rung on columns": (lambda d: shared_reduction.amax(torch.randn(3, 3, device=d), 0,
                                                              version="v10"),
                              r"amax: version 'v10' is a rung of the whole-tensor ladder, but "
                              r"this call reduces columns"),
    "row rung on the whole tensor": (lambda d: shared_reduction.sum(torch.randn(3, 3, device=d),
                                                                    version="split_row"),
                                     r"sum: version 'split_row' is a rung of the rows ladder, but "
                                     r"this call reduces the whole tensor"),
}


@pytest.mark.parametrize("misuse", list(MISUSES))
def test_misuse_raises_clear_error(misuse, device):
    call, message = MISUSES[misuse]
    with pytest.raises(RuntimeError, match=message):
        call(device)


def test_sum_of_nothing_is_zero(device):
    """Like torch: an empty sum is 0, of the input's dtype, in every ladder."""
    for shape, dim in (((0,), None), ((3, 0), -1), ((0, 3), 0), ((2, 0, 3), 1)):
        x = torch.randn(shape, device=device, dtype=torch.bfloat16)
        out = shared_reduction.sum(x, dim)
        expected = x.sum() if dim is None else x.sum(dim)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        assert not out.isnan().any() and bool((out == 0).all())


# ---------------------------------------------------------------------------------------------
# 9. opcheck and torch.compile
# ---------------------------------------------------------------------------------------------
OPS = torch.ops.shared_reduction
OPCHECK_CALLS = {
    "sum_whole": lambda x: (OPS.sum.default, (x, None, False, None)),
    "sum_rows": lambda x: (OPS.sum.default, (x, -1, True, None)),
    "sum_columns": lambda x: (OPS.sum.default, (x, 0, False, "column_loop")),
    "sum_rung": lambda x: (OPS.sum.default, (x, None, False, "v7")),
    "amax_whole": lambda x: (OPS.amax.default, (x, None, False, None)),
    "amax_rows": lambda x: (OPS.amax.default, (x, 1, False, "warp_per_row")),
    "amax_columns": lambda x: (OPS.amax.default, (x, 0, True, None)),
    "softmax": lambda x: (OPS.softmax.default, (x, -1, None)),
    "softmax_dim0": lambda x: (OPS.softmax.default, (x, 0, "v3")),
    "log_softmax": lambda x: (OPS.log_softmax.default, (x, -1, None)),
    "log_softmax_v5": lambda x: (OPS.log_softmax.default, (x, 0, "v5")),
    "softmax_backward": lambda x: (OPS.softmax_backward.default,
                                   (x * 0.5, torch.softmax(x.detach(), -1).requires_grad_(), -1,
                                    False)),
    "log_softmax_backward": lambda x: (OPS.softmax_backward.default,
                                       (x * 0.5, torch.log_softmax(x.detach(), 0)
                                        .requires_grad_(), 0, True)),
}


@pytest.mark.parametrize("op", list(OPCHECK_CALLS))
def test_opcheck(op, device):
    x = torch.randn(33, 17, device=device, requires_grad=True)  # no ties: amax is smooth
    fn, args = OPCHECK_CALLS[op](x)
    torch.library.opcheck(fn, args)


def test_torch_compile_traces_the_ops(device):
    """Dynamo and AOTAutograd trace through the ops without a graph break (the Meta kernels
    give shapes, the Autograd kernels the backward); aot_eager skips codegen to keep this fast.
    The same kernels run either way; only the order in which the backward adds the four
    branches' gradients may differ, hence assert_close's float32 defaults."""
    torch._dynamo.reset()

    def f(x):
        p = shared_reduction.softmax(x, -1)
        lp = shared_reduction.log_softmax(x, 0)
        return (shared_reduction.sum(p * lp, -1).sum() + shared_reduction.amax(x, 1).sum()
                + shared_reduction.sum(x) + shared_reduction.sum(x * x, 0, True).sum())

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 65, 33, device=device, requires_grad=True)
    out = compiled(x)
    grad, = torch.autograd.grad(out, x)
    expected = f(x)
    expected_grad, = torch.autograd.grad(expected, x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad, expected_grad)


# ---------------------------------------------------------------------------------------------
# 10. Determinism: bitwise equal results run to run, every rung
# ---------------------------------------------------------------------------------------------
DETERMINISM_CALLS = [pytest.param(version, dim, id=f"{version}-dim{dim}")
                     for dim in (None, -1, 0)
                     for version in (*LADDERS[layout((4096, 4097), dim)], None)]


@pytest.mark.parametrize("version,dim", DETERMINISM_CALLS)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_is_deterministic(op, version, dim, device):
    """Five runs, bitwise equal: no atomics on floats, a fixed combine order. 2^22 + 5
    elements for the whole tensor (many blocks, a ragged tail), a 4096 x 4097 matrix for rows
    and columns (split_row and column_split combine partials across blocks). On the CPU,
    version=None alone: reduce_cpu never reads the rung (the glue checks its ladder, which
    test_reduce_matches_reference covers for every rung on the CPU)."""
    if device == "cpu" and version is not None:
        pytest.skip("the CPU path ignores the rung: version=None covers this case")
    x = (torch.randn(2**22 + 5, device=device) if dim is None
         else torch.randn(4096, 4097, device=device))
    first = check_reduction(op, x, dim, False, version)
    for _ in range(4):
        assert torch.equal(run_reduce(op, x, dim, False, version), first)


@pytest.mark.parametrize("version", (*VERSIONS["softmax"], None), ids=str)
def test_softmax_is_deterministic(version, device):
    x = torch.randn(4, 100003, device=device)  # float32: 7 split blocks per row in v5
    grad = torch.randn_like(x)
    for op in SOFTMAX_OPS:
        first = check_softmax(op, x, -1, version)
        first_grad = shared_reduction.softmax_backward(grad, first, -1, op == "log_softmax")
        for _ in range(4):
            y = getattr(shared_reduction, op)(x, version=version)
            assert torch.equal(y, first)
            assert torch.equal(shared_reduction.softmax_backward(grad, y, -1, op == "log_softmax"),
                               first_grad)


# ---------------------------------------------------------------------------------------------
# 11. atomic_sum
# ---------------------------------------------------------------------------------------------
# name: (base shape, view)
ATOMIC_INPUTS = {
    "empty": ((0,), lambda t: t),
    "one": ((1,), lambda t: t),
    "1000": ((1000,), lambda t: t),
    "2^22+5": ((2**22 + 5,), lambda t: t),
    "513x1031": ((513, 1031), lambda t: t),
    "transposed": ((513, 1031), lambda t: t.t()),
    "flat_offset": ((4097,), lambda t: t[1:]),
}


@pytest.mark.parametrize("case", list(ATOMIC_INPUTS))
def test_atomic_sum_is_close_to_the_float64_sum(case, device):
    """Its last bits may change run to run on the GPU (the order in which blocks finish), so
    random normal inputs are held to sum's bound only. Integers in [-3, 3] are summed exactly
    in any order (|every partial| <= 3 (2^22 + 5) < 2^24), so there it must be the sum."""
    shape, view = ATOMIC_INPUTS[case]
    x = view(torch.randn(shape, device=device))
    out = shared_reduction.atomic_sum(x)
    assert_like(out, (), torch.float32, device)
    exact = reference_sum(x)
    assert_within(out, exact, sum_bound(x, None, False, exact))
    ints = view(integer_valued(shape, torch.float32, device, high=3))
    torch.testing.assert_close(shared_reduction.atomic_sum(ints), reference_sum(ints).float(),
                               rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# 12. version=None: default_choice's rules (reduction.h) on each side of every threshold
# ---------------------------------------------------------------------------------------------
# name: (op, shape, dtype, dim, the rung version=None must run)
DEFAULT_CASES = {
    "whole": ("sum", (1000,), torch.float32, None, "v10"),
    "whole_3d": ("amax", (3, 4, 5), torch.bfloat16, None, "v10"),
    "whole_long": ("sum", (2**20 + 3,), torch.float16, None, "v10"),
    # inner > 1: columns: column_split (whose tiles lay a warp over several rows when the tensor
    # is narrower than a warp of columns), except a short reduced dim under many outputs,
    # column_loop (one thread an output: 132 SMs x 2048 of them)
    "columns_inner_2": ("sum", (4, 2), torch.float32, 0, "column_split"),
    "columns_3d": ("amax", (3, 4, 5), torch.float32, 1, "column_split"),
    "columns_long": ("sum", (5000, 3), torch.float32, 0, "column_split"),
    "columns_64_vectors": ("sum", (1000, 64), torch.float32, 0, "column_split"),  # 16 lanes of 4
    "columns_128_vectors": ("sum", (100, 128), torch.float32, 0, "column_split"),  # 32 lanes of 4
    "columns_31_single": ("amax", (100, 31), torch.float32, 0, "column_split"),  # 31 lanes of 1
    "columns_33_single": ("sum", (100, 33), torch.bfloat16, 0, "column_split"),  # 33 lanes of 1
    "columns_loop": ("sum", (100003, 16, 3), torch.float32, 1, "column_loop"),  # 300009 outputs
    "columns_loop_n_63": ("sum", (5000, 63, 60), torch.float32, 1, "column_loop"),
    "columns_loop_n_64": ("sum", (5000, 64, 60), torch.float32, 1, "column_split"),
    # inner == 1 through trailing size-1 dims: rows
    "rows_trailing_ones": ("sum", (3, 4, 1), torch.float32, 1, "rows_per_warp"),
    # row length: < 32 rows_per_warp, up to 2048 warp_per_row
    "n_1": ("sum", (100, 1), torch.float32, -1, "rows_per_warp"),
    "n_31": ("sum", (100, 31), torch.float32, -1, "rows_per_warp"),
    "n_32": ("amax", (100, 32), torch.float32, -1, "warp_per_row"),
    "n_2048": ("sum", (100, 2048), torch.bfloat16, -1, "warp_per_row"),
    # longer rows: split while there are fewer than 528 rows, one block each from 528 on
    "n_2049_rows_100": ("sum", (100, 2049), torch.float32, -1, "split_row"),
    "n_2049_rows_527": ("sum", (527, 2049), torch.float32, -1, "split_row"),
    "n_2049_rows_528": ("amax", (528, 2049), torch.float32, -1, "block_per_row"),
    "1d_2049": ("sum", (2049,), torch.float32, 0, "split_row"),
    "1d_31": ("sum", (31,), torch.float32, 0, "rows_per_warp"),
    "3d_rows": ("sum", (528, 1, 4000), torch.float16, 2, "block_per_row"),
    # softmax: v4 while a row fits one block's registers, else v5: 16384 elements in float32
    # and in 2-byte dtypes alike (reduction.h, shape_fits: the forward keeps every element as
    # a float32, at most 32 per thread, so 2-byte dtypes stop at 512 threads x 4 vectors; their
    # 16-bit 256 x 8 shape serves split rows only)
    "softmax_f32_16384": ("softmax", (3, 16384), torch.float32, -1, "v4"),
    "softmax_f32_16385": ("softmax", (3, 16385), torch.float32, -1, "v5"),
    "softmax_bf16_16384": ("softmax", (2, 16384), torch.bfloat16, -1, "v4"),
    "softmax_bf16_16385": ("softmax", (2, 16385), torch.bfloat16, -1, "v5"),
    "softmax_f16_16384": ("softmax", (2, 16384), torch.float16, -1, "v4"),
    "softmax_f16_16385": ("softmax", (2, 16385), torch.float16, -1, "v5"),
    "softmax_short": ("softmax", (1000, 7), torch.float32, -1, "v4"),
    "softmax_dim0": ("softmax", (16385, 2), torch.float32, 0, "v5"),
    "log_softmax_f32_16384": ("log_softmax", (2, 16384), torch.float32, -1, "v4"),
    "log_softmax_f32_16385": ("log_softmax", (2, 16385), torch.float32, -1, "v5"),
}


@pytest.mark.parametrize("case", list(DEFAULT_CASES))
def test_default_choice(case, device):
    """default_choice names the rung; version=None must run exactly that rung: every rung is
    deterministic, so the two results are bitwise equal (on the CPU, where the version is only
    validated, trivially so; the reference check holds there)."""
    op, shape, dtype, dim, expected = DEFAULT_CASES[case]
    x = torch.randn(shape, dtype=dtype, device=device)
    assert shared_reduction.default_choice(op, x, dim) == expected
    if op in REDUCE_OPS:
        out = check_reduction(op, x, dim, False, None)
        assert torch.equal(out, run_reduce(op, x, dim, False, expected))
    else:
        out = check_softmax(op, x, dim, None)
        assert torch.equal(out, getattr(shared_reduction, op)(x, dim, version=expected))


# The rules that depend on the GPU's size, asked for a GPU of `sms` SMs: what a learner on a T4
# (40 SMs) or an A100 (108) gets. name: (op, shape, dtype, dim, sms, the rung or path).
SMS_CASES = {
    # rows longer than a warp's are split while there are fewer than 4 x SMs of them
    "t4_rows_159": ("sum", (159, 4096), torch.float32, -1, 40, "split_row"),
    "t4_rows_160": ("sum", (160, 4096), torch.float32, -1, 40, "block_per_row"),
    "a100_rows_431": ("amax", (431, 4096), torch.float32, -1, 108, "split_row"),
    "a100_rows_432": ("amax", (432, 4096), torch.float32, -1, 108, "block_per_row"),
    "h100_rows_527": ("sum", (527, 4096), torch.bfloat16, -1, 132, "split_row"),
    "h100_rows_528": ("sum", (528, 4096), torch.bfloat16, -1, 132, "block_per_row"),
    # a thread per output once the outputs fill every SM's 2048 threads
    "t4_loop": ("sum", (40960, 16, 2), torch.float32, 1, 40, "column_loop"),
    "t4_loop_fewer": ("sum", (40959, 16, 2), torch.float32, 1, 40, "column_split"),
    # a split row needs all its blocks resident: SMs x 2 for the 2-byte backward (256 x 4 x 8
    # = 8192 elements a block), else it is streamed: 3 blocks fit 2 SMs, 5 do not
    # a 2-byte row too long for registers is parked in one block's shared memory when there
    # is a row for every SM, else split over blocks
    "h100_shared": ("softmax_backward", (132, 32000), torch.bfloat16, -1, 132, "shared"),
    "h100_fewer_rows_split": ("softmax_backward", (131, 32000), torch.bfloat16, -1, 132, "split"),
    "two_sms_split": ("softmax_backward", (1, 16385), torch.bfloat16, -1, 2, "split"),
    "two_sms_streamed": ("softmax_backward", (1, 40000), torch.bfloat16, -1, 2, "streamed"),
}


@pytest.mark.parametrize("case", list(SMS_CASES))
def test_default_choice_reads_the_sm_count(case):
    """The thresholds are counts per SM, read off the device (sms=None) or given (a meta tensor
    and any SM count: the choice for a GPU this machine does not have)."""
    op, shape, dtype, dim, sms, expected = SMS_CASES[case]
    x = torch.empty(shape, dtype=dtype, device="meta")
    assert shared_reduction.default_choice(op, x, dim, sms=sms) == expected


@pytest.mark.cuda
def test_default_choice_uses_the_gpus_sm_count():
    """Without sms, default_choice asks x's GPU: the choice the launch makes there."""
    require_cuda()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for rows, expected in ((4 * sms - 1, "split_row"), (4 * sms, "block_per_row")):
        x = torch.randn(rows, 4096, device="cuda")
        assert shared_reduction.default_choice("sum", x, -1) == expected
        out = shared_reduction.sum(x, -1)
        assert torch.equal(out, shared_reduction.sum(x, -1, version=expected))


# (op, shape, dtype, the kernel name must contain): the new paths, launched. Odd rows take
# Access::kChunks (course/rows.cuh), a 2-byte split row the 256 x 8 shape of 16-bit values, a
# narrow column the column tiles (with lanes over rows).
LAUNCH_CASES = {
    "softmax_chunks_f32": ("softmax", (64, 777), torch.float32, "softmax_resident<float, 32, 8, false, (course::rows::Access)2>"),
    "softmax_chunks_bf16": ("log_softmax", (64, 777), torch.bfloat16, "softmax_resident<__nv_bfloat16, 32, 4, true, (course::rows::Access)2>"),
    "softmax_split_raw_bf16": ("softmax", (2, 50257), torch.bfloat16, "softmax_split<__nv_bfloat16, 9, false, (course::rows::Access)2>"),
    "softmax_split_raw_f16": ("softmax", (2, 32768), torch.float16, "softmax_split<__half, 9, false, (course::rows::Access)1>"),
    "softmax_shared_bf16": ("log_softmax", (264, 32000), torch.bfloat16, "softmax_shared<__nv_bfloat16, true, (course::rows::Access)1>"),
    "backward_shared_f16": ("softmax_backward", (264, 20001), torch.float16, "softmax_backward_shared<__half, false, (course::rows::Access)2>"),
    # log_softmax parks dy alone (softmax_backward_shared): its own instantiation, with half the
    # shared memory
    "backward_shared_log_bf16": ("log_softmax_backward", (264, 32000), torch.bfloat16, "softmax_backward_shared<__nv_bfloat16, true, (course::rows::Access)1>"),
    "backward_shared_log_f16_chunks": ("log_softmax_backward", (264, 20001), torch.float16, "softmax_backward_shared<__half, true, (course::rows::Access)2>"),
    "softmax_64_threads": ("softmax", (64, 1025), torch.bfloat16, "softmax_resident<__nv_bfloat16, 64, 4, false, (course::rows::Access)2>"),
    "backward_chunks": ("softmax_backward", (64, 4099), torch.bfloat16, "softmax_backward_resident<__nv_bfloat16, 256, 4, false, (course::rows::Access)2>"),
    "column_split": ("sum", (100003, 3), torch.float32, "column_reduce_tiles<1, float"),
    # rows that start mid-vector, a warp of vectors wide: realigned vectors, not single elements
    "column_realigned_bf16": ("sum", (1000, 4099), torch.bfloat16, "column_reduce_tiles<8, __nv_bfloat16"),
    "column_realigned_f32": ("amax", (1000, 4099), torch.float32, "column_reduce_tiles<4, float"),
}


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(LAUNCH_CASES))
def test_new_paths_launch_their_kernels(case):
    require_cuda()
    op, shape, dtype, expected = LAUNCH_CASES[case]
    x = torch.randn(shape, dtype=dtype, device="cuda")
    if op == "softmax_backward":
        y = shared_reduction.softmax(x)
        call = lambda: shared_reduction.softmax_backward(torch.randn_like(y), y)  # noqa: E731
    elif op == "log_softmax_backward":
        y = shared_reduction.log_softmax(x)
        call = lambda: shared_reduction.softmax_backward(torch.randn_like(y), y, -1, True)  # noqa: E731
    elif op in REDUCE_OPS:
        call = lambda: getattr(shared_reduction, op)(x, 0)  # noqa: E731
    else:
        call = lambda: getattr(shared_reduction, op)(x)  # noqa: E731
    # The column tiles are course::column_reduce_tiles (common/include/course), the rest this
    # chapter's own.
    _, kernels = launched_kernels(call, "course::" if expected.startswith("column_reduce") else "shared_reduction")
    assert any(expected in k for k in kernels), kernels


# A column lane's range of single 2- or 4-byte elements ends in one guarded batch of the row
# groups left after its full ones (course/column_reduce.cuh, kColumnTailBatch; vectors and
# float64 take them one at a time), and column_loop unrolls its reduced dim by 4 (reduce_kernels.cu):
# reduced lengths on each side of those batches, for the narrow single-element tile, the 32-lane
# one (split into ranges), and the vector one.
COLUMN_TAIL_CASES = [
    # 7 columns: 8 lanes of one element, 4 rows a warp, 32 a block step, 512 a batch of 16
    ((4, 511, 7), 1), ((4, 512, 7), 1), ((4, 513, 7), 1), ((64, 1000, 7), 1), ((3, 1567, 7), 1),
    # 33 and 4099 columns: 32 lanes of one element, 8 rows a block step, 128 a batch; split
    ((127, 33), 0), ((129, 33), 0), ((3001, 4099), 0),
    # 64 and 128 columns: 16-byte vectors in every dtype, 4 row groups a batch
    ((31, 64), 0), ((33, 64), 0), ((1000, 64), 0), ((4097, 128), 0),
    # the vectors' rolling loads (each refilled with the next batch's once folded): ranges of
    # exactly one, two and three batches and one row group past (64 columns: 128 rows a batch in
    # 2-byte dtypes, 64 in float32, 32 in float64; 4096 columns: 32 rows a batch, split)
    ((128, 64), 0), ((256, 64), 0), ((257, 64), 0), ((384, 64), 0), ((96, 4096), 0), ((97, 4096), 0),
    # column_loop along a reduced dim shorter than 64: lengths 1, one off its unroll of 4 and 16,
    # the longest; inner 2, 3, 5, 7 and 60 (its 32-bit indices divide by inner's magic number)
    ((4099, 1, 3), 1), ((4099, 15, 3), 1), ((4099, 16, 3), 1), ((4099, 17, 3), 1),
    ((4099, 63, 5), 1), ((4099, 7, 2), 1), ((1031, 13, 7), 1), ((257, 9, 60), 1),
]


@pytest.mark.cuda
@pytest.mark.parametrize("case", COLUMN_TAIL_CASES, ids=lambda c: f"{shape_id(c[0])}-dim{c[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_column_tails(op, dtype, case):
    """Every element of a range's last, partial batch is added once, in both column rungs and
    version=None; the gradient (a broadcast for sum, the max's positions for amax) is torch's."""
    require_cuda()
    shape, dim = case
    for version in ("column_split", "column_loop", None):
        x = torch.randn(shape, dtype=dtype, device="cuda")
        check_reduction(op, x, dim, False, version, what=f"{op} {shape} dim={dim} {version}")
        if op == "sum":
            x = integer_valued(shape, dtype, "cuda")
            expected = reference_sum(x, dim, False).to(dtype)
            torch.testing.assert_close(run_reduce(op, x, dim, False, version), expected, rtol=0, atol=0)
    # The gradient, against torch's in float64 (amax's shared among tied maxima: within two
    # ulps of g / count, as test_amax_low_precision_gradients says).
    x = torch.randn(shape, dtype=dtype, device="cuda", requires_grad=True)
    grad = torch.randn(shape[:dim] + shape[dim + 1:], dtype=dtype, device="cuda")
    ours, = torch.autograd.grad(run_reduce(op, x, dim), x, grad)
    x64 = x.detach().double().requires_grad_()
    theirs, = torch.autograd.grad(getattr(torch, op)(x64, dim), x64, grad.double())
    assert_within(ours, theirs, 2 * eps_out(dtype) * theirs.abs() + floor(dtype), f"{op} gradient")


# column_loop finds output c's slice and column by dividing c by inner: with inner's magic number
# (course::FastDivmod) and 32-bit indices while the tensor has fewer than 2^31 elements, with the
# compiler's 64-bit division beyond (column_loop_fits_32_bits, reduction.h). (outer, n, inner),
# reduced over dim 1: odd and short reduced dims, inner 2, 3, 7, 60 and one past 2^16.
COLUMN_LOOP_SHAPES = [(100003, 16, 3), (40961, 16, 2), (4099, 5, 7), (1031, 63, 60), (3, 3, 65537)]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", COLUMN_LOOP_SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_column_loop_reads_its_own_column(op, dtype, shape):
    """Each output adds exactly the n elements of its own column: NaN, +inf and -inf planted at
    random places must come out in the outputs of their columns and nowhere else (a slice or
    column off by one moves them), and small integers sum exactly. The 32-bit path: the 64-bit
    one needs 2^31 elements (test_column_loop_beyond_int32_elements)."""
    require_cuda()
    assert torch.ops.shared_reduction.column_loop_index_bits(torch.empty(shape, device="meta"), 1) == 32
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, dtype=dtype, device="cuda")
    flat = x.view(-1)
    planted = torch.randperm(x.numel(), device="cuda", generator=gen)[:max(3, x.numel() // 1000)]
    third = planted.numel() // 3
    flat[planted[:third]] = float("nan")
    flat[planted[third:2 * third]] = float("inf")
    flat[planted[2 * third:]] = float("-inf")
    check_reduction(op, x, 1, False, "column_loop", what=f"{op} {shape} column_loop")
    if op == "sum":
        x = integer_valued(shape, dtype, "cuda")
        expected = reference_sum(x, 1, False).to(dtype)
        torch.testing.assert_close(run_reduce(op, x, 1, False, "column_loop"), expected, rtol=0, atol=0)


# The index width on each side of 2^31 elements, from the shape alone (meta tensors, no memory):
# (shape, dim, bits).
INDEX_BITS_CASES = [
    ((2**30 - 1, 1, 2), 1, 32), ((2**30, 1, 2), 1, 64),  # 2^31 - 2 and 2^31 elements
    ((44739242, 16, 3), 1, 32), ((44739243, 16, 3), 1, 64),  # 2^31 - 32 and 2^31 + 16
    ((2**31 - 1, 1), 0, 32), ((2**31, 1), 0, 64),
    ((100003, 16, 3), 1, 32), ((8, 63, 65536), 1, 32),
]


@pytest.mark.parametrize("shape,dim,bits", INDEX_BITS_CASES, ids=[f"{shape_id(c[0])}-dim{c[1]}" for c in INDEX_BITS_CASES])
def test_column_loop_index_bits(shape, dim, bits):
    """column_loop indexes in 32 bits while the tensor has fewer than 2^31 elements (so every
    element index, output index and the grid loop's next index fit 32 bits), in 64 from 2^31 on."""
    x = torch.empty(shape, device="meta")
    assert torch.ops.shared_reduction.column_loop_index_bits(x, dim) == bits


# column_split reads rows that start mid-vector as realigned 16-byte vectors (course/
# numeric.cuh, load16_realigned) once a row is a warp of vectors wide: 256 elements in
# 2-byte dtypes, 128 in float32 (float64 keeps single elements). Widths on both sides of each
# threshold, odd and prime ones (the lane at a row's end adds only its first columns: 1 to 7 of
# its vector's), views whose every row, or the whole tensor, starts 1 to 7 elements past a
# boundary, each of them (the first and last rows, whose vectors would reach outside the tensor,
# read element by element; the last row ends at the allocation's end), a middle dim with outer 1
# and many slices, reduced lengths below one batch (the one-at-a-time tail), across one and split
# into ranges. The inner sizes 1, 3, 7, 8, 9 of a middle dim (column_loop or single elements)
# beside.
def _offset(shape, shift):
    """A contiguous tensor of `shape` starting `shift` elements into its storage."""
    return lambda dtype: torch.randn(math.prod(shape) + shift, dtype=dtype, device="cuda")[shift:].view(shape)


COLUMN_REALIGNED_CASES = {
    **{f"{n}x{w}": (lambda dtype, n=n, w=w: torch.randn(n, w, dtype=dtype, device="cuda"), 0)
       for n, w in ((3, 63), (5, 65), (33, 127), (33, 129), (65, 255), (65, 257), (1, 263), (3, 263),
                    (1000, 263), (8191, 4099))},
    **{f"offset{k}-300x512": (_offset((300, 512), k), 0) for k in range(1, 8)},
    **{f"offset{k}-129x1031": (_offset((129, 1031), k), 0) for k in (1, 2, 4, 6)},
    "outer1-1x1000x263": (lambda dtype: torch.randn(1, 1000, 263, dtype=dtype, device="cuda"), 1),
    "outer2000-2000x5x263": (lambda dtype: torch.randn(2000, 5, 263, dtype=dtype, device="cuda"), 1),
    "7x33x257": (lambda dtype: torch.randn(7, 33, 257, dtype=dtype, device="cuda"), 1),
    **{f"1000x17x{i}": (lambda dtype, i=i: torch.randn(1000, 17, i, dtype=dtype, device="cuda"), 1)
       for i in (1, 3, 7, 8, 9)},
}


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(COLUMN_REALIGNED_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_column_realigned_rows(op, dtype, case):
    """Every column's sum and max, exact on integer-valued inputs, with torch's gradient."""
    require_cuda()
    make, dim = COLUMN_REALIGNED_CASES[case]
    x = make(dtype)
    # inner 1 is a row reduction: version=None only
    for version in ("column_split", None) if layout(tuple(x.shape), dim) == "columns" else (None,):
        x = make(dtype)
        check_reduction(op, x, dim, False, version, what=f"{op} {case} {version}")
        if op == "sum":
            x.copy_(integer_valued(tuple(x.shape), dtype, "cuda"))
            expected = reference_sum(x, dim, False).to(dtype)
            torch.testing.assert_close(run_reduce(op, x, dim, False, version), expected, rtol=0, atol=0)
    x = make(dtype).requires_grad_()
    shape = tuple(x.shape)
    grad = torch.randn(shape[:dim] + shape[dim + 1:], dtype=dtype, device="cuda")
    ours, = torch.autograd.grad(run_reduce(op, x, dim), x, grad)
    x64 = x.detach().double().requires_grad_()
    theirs, = torch.autograd.grad(getattr(torch, op)(x64, dim), x64, grad.double())
    assert_within(ours, theirs, 2 * eps_out(dtype) * theirs.abs() + floor(dtype), f"{op} gradient")


def test_default_choice_accepts_meta_tensors():
    """Shape and dtype alone decide, so a meta tensor (no memory) stands in for a real one: what
    test_recorded_results_hold_the_dispatch relies on for shapes of 2^28 elements."""
    for case, (op, shape, dtype, dim, expected) in DEFAULT_CASES.items():
        x = torch.empty(shape, dtype=dtype, device="meta")
        assert shared_reduction.default_choice(op, x, dim) == expected, case


@pytest.mark.cuda
def test_default_launches_kernels_of_the_extension():
    require_cuda()
    x = torch.randn(64, 1000, device="cuda")
    out, kernels = launched_kernels(lambda: shared_reduction.sum(x, -1), "shared_reduction")
    assert len(kernels) >= 1, kernels
    exact = reference_sum(x, -1)
    assert_within(out, exact, sum_bound(x, -1, False, exact))
    out, kernels = launched_kernels(lambda: shared_reduction.softmax(x), "shared_reduction")
    assert len(kernels) >= 1, kernels
    ref = softmax_reference(x, -1, False)
    assert_within(out, ref, softmax_bound(x, -1, ref, False))


# ---------------------------------------------------------------------------------------------
# 13. The recorded GPU results
# ---------------------------------------------------------------------------------------------
def test_recorded_results_hold_the_dispatch():
    """The committed GPU results (bench_shared_reduction.py) must show version=None at every
    measured shape, with the choice the dispatch makes today, never slower than 0.95x the
    fastest rung there. Fails on results older than the dispatch and on a regression."""
    record = results.load_recorded_gpu("chapter3_shared_reduction")
    assert record is not None, "no recorded GPU results: run bench_shared_reduction.py on a GPU"
    sms = record["device"]["sms"]
    checked = 0
    for r in record["benchmarks"]:
        if r["variant"] != "default" or r["op"] not in VERSIONS:
            continue
        if r.get("pass", "forward") == "backward":
            if r["op"] not in SOFTMAX_OPS or "dispatch" not in r:
                continue  # sum/amax's backward is a broadcast: no rung to choose
            choice_op = "softmax_backward"
        else:
            choice_op = r["op"]
        # Shape and dtype decide: a meta tensor of the measured shape (2^28 elements would be
        # a GiB on the CPU) stands in for the GPU one.
        x = torch.empty(r["shape"], dtype=getattr(torch, r["dtype"]), device="meta")
        assert r["dispatch"] == shared_reduction.default_choice(choice_op, x, r["dim"], sms=sms), r
        checked += 1
    assert checked > 0, "no default rows: results older than the dispatch?"
    for op in VERSIONS:
        assert results.default_gaps(record, VERSIONS[op], ops=(op,)) == [], op


def test_recorded_shapes_sweep_holds_the_target():
    """The shapes sweep (bench_shared_reduction.py --shapes): at every shape that moves at least
    1 MiB, version=None at least 0.95x the faster of eager and torch.compile, with the choice the
    dispatch makes today recorded beside it."""
    record = shapes.load("chapter3_shared_reduction")
    sms = record["device"]["sms"] if record else 0

    def choice(r):
        op = "softmax_backward" if r["pass"] == "backward" else r["op"]
        return shared_reduction.default_choice(op, shapes.meta_like(r), r.get("dim", -1), sms=sms)
    assert shapes.stale_dispatch(record, choice) == []
    shapes.expect_target(record, "bench_shared_reduction.py --shapes")


# ---------------------------------------------------------------------------------------------
# 14. Beyond 2^31 elements
# ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.large
@pytest.mark.parametrize("version", (None, "v9", "v10"), ids=str)
def test_sum_beyond_int32_elements(version):
    """2^31 + 1001 bfloat16 elements (4 GiB): every index must be 64-bit. Random values in
    {-1, 0, 1} (every partial sum an integer far below 2^24: exact in float32) and the 1001
    elements past 2^31 set to 64, the last to 100: a kernel that stops at 2^31 (or wraps
    around) misses 64064, which bfloat16 (8 bits) still shows; amax finds the 100."""
    require_cuda()
    n = 2**31 + 1001
    if torch.cuda.mem_get_info()[0] < 12 * 2**30:
        pytest.skip("needs 12 GiB of free GPU memory")
    x = torch.randint(-1, 2, (n,), device="cuda", dtype=torch.int8).to(torch.bfloat16)
    x[2**31:] = 64
    x[-1] = 100
    exact = sum(chunk.double().sum() for chunk in x.split(2**28))  # the builtin sum
    out = shared_reduction.sum(x, version=version)
    assert out.dtype == torch.bfloat16 and out.shape == ()
    assert torch.equal(out, exact.to(torch.bfloat16)), (out.item(), exact.item())
    # and torch.sum, which also accumulates bfloat16 in float32: within one bfloat16 rounding
    torch.testing.assert_close(out, torch.sum(x), rtol=eps_out(torch.bfloat16), atol=0)
    assert shared_reduction.amax(x, version=version).item() == 100
    del x
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.large
@pytest.mark.parametrize("outer", (44739242, 44739243), ids=("int32", "int64"))
def test_column_loop_beyond_int32_elements(outer):
    """column_loop on either side of 2^31 bfloat16 elements (4 GiB), (outer, 16, 3) over dim 1:
    2^31 - 32 elements take the 32-bit indices, their last columns at the top of the range;
    2^31 + 16 the 64-bit ones (test_column_loop_index_bits). Values in {-1, 0, 1}: every sum an
    integer of at most 16, exact in bfloat16, so torch's sum and ours agree bit for bit; the
    last slice's elements are set apart (2, and a 100 in its last column: sums 32, 32 and 130,
    exact in bfloat16's 8 bits) so that an output written from the wrong place shows."""
    require_cuda()
    shape = (outer, 16, 3)
    bits = 32 if outer * 48 < 2**31 else 64
    assert torch.ops.shared_reduction.column_loop_index_bits(torch.empty(shape, device="meta"), 1) == bits
    if torch.cuda.mem_get_info()[0] < 12 * 2**30:
        pytest.skip("needs 12 GiB of free GPU memory")
    x = torch.randint(-1, 2, shape, device="cuda", dtype=torch.int8).to(torch.bfloat16)
    x[-1] = 2
    x[-1, 5, 2] = 100
    out = shared_reduction.sum(x, 1, version="column_loop")
    assert torch.equal(out, torch.sum(x, 1))
    assert out[-1].tolist() == [32, 32, 130]
    out = shared_reduction.amax(x, 1, version="column_loop")
    assert torch.equal(out, torch.amax(x, 1))
    assert out[-1].tolist() == [2, 2, 100]
    del x, out
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# 15. The small run the GPU pass puts under compute-sanitizer
# ---------------------------------------------------------------------------------------------
SANITIZE_SHAPES = {
    # ladder: [(make x from a dtype, dim)], small, irregular, one misaligned view each
    "whole": [(lambda t: torch.randn(1, dtype=t, device="cuda"), None),
              (lambda t: torch.randn(33, dtype=t, device="cuda"), None),
              (lambda t: torch.randn(3, 1373, dtype=t, device="cuda"), None),
              (lambda t: torch.randn(4100, dtype=t, device="cuda")[1:], None)],
    "rows": [(lambda t: torch.randn(3, 1, dtype=t, device="cuda"), -1),
             (lambda t: torch.randn(70, 31, dtype=t, device="cuda"), -1),
             (lambda t: torch.randn(5, 33, dtype=t, device="cuda"), -1),
             (lambda t: torch.randn(3, 4097, dtype=t, device="cuda"), -1),
             (lambda t: torch.randn(3 * 1001 + 1, dtype=t, device="cuda")[1:].view(3, 1001), -1)],
    "columns": [(lambda t: torch.randn(33, 5, dtype=t, device="cuda"), 0),
                (lambda t: torch.randn(1000, 3, dtype=t, device="cuda"), 0),
                (lambda t: torch.randn(3, 7, 9, dtype=t, device="cuda"), 1),
                (lambda t: torch.randn(33 * 65 + 1, dtype=t, device="cuda")[1:].view(33, 65), 0),
                # a lane's guarded last batch: a narrow tile and a 32-lane one
                (lambda t: torch.randn(4, 513, 7, dtype=t, device="cuda"), 1),
                (lambda t: torch.randn(129, 33, dtype=t, device="cuda"), 0),
                # aligned vectors' rolling loads: whole batches, then a tail
                (lambda t: torch.randn(300, 64, dtype=t, device="cuda"), 0),
                # realigned vectors: an odd width, every row 3 elements past a boundary, and an odd
                # width 7 past one whose last row ends at the allocation's end
                (lambda t: torch.randn(40, 263, dtype=t, device="cuda"), 0),
                (lambda t: torch.randn(65 * 512 + 3, dtype=t, device="cuda")[3:].view(65, 512), 0),
                (lambda t: torch.randn(33 * 263 + 7, dtype=t, device="cuda")[7:].view(33, 263), 0)],
}


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("version", VERSIONS["sum"])
def test_sanitizer_small_reduce(version):
    require_cuda()
    for dtype in (torch.float32, torch.bfloat16):
        for make, dim in SANITIZE_SHAPES[ladder_of(version)]:
            x = make(dtype)
            for op in REDUCE_OPS:
                check_reduction(op, x, dim, False, version, f"{op} {tuple(x.shape)} dim={dim}")


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("version", VERSIONS["softmax"])
def test_sanitizer_small_softmax(version):
    require_cuda()
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 33, 1000, 40000):  # 40000: more than one block holds (v5 splits)
            x = torch.randn(3, n, dtype=dtype, device="cuda")
            for op in SOFTMAX_OPS:
                check_softmax(op, x, -1, version, f"{op} n={n}")
        x = torch.randn(3 * 1001 + 1, dtype=dtype, device="cuda")[1:].view(3, 1001)  # misaligned
        for op in SOFTMAX_OPS:
            check_softmax(op, x, -1, version, f"{op} misaligned")


@pytest.mark.cuda
@pytest.mark.sanitize
def test_sanitizer_small_softmax_backward_and_atomic_sum():
    require_cuda()
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 33, 1000, 40000):
            x = torch.randn(3, n, dtype=torch.float64, device="cuda")
            grad = torch.randn(3, n, dtype=dtype, device="cuda")
            for log in (False, True):
                y = softmax_reference(x, -1, log).to(dtype)
                ref = softmax_backward_reference(grad, y, -1, log)
                out = shared_reduction.softmax_backward(grad, y, -1, log)
                assert_within(out, ref, softmax_backward_bound(grad, y, -1, ref, log, dtype),
                              f"log={log} n={n}")
    # rows parked in shared memory (one row per SM or more): log_softmax parks dy alone
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(sms, 20001, dtype=torch.float64, device="cuda")
    grad = torch.randn(sms, 20001, dtype=torch.bfloat16, device="cuda")
    for log in (False, True):
        y = softmax_reference(x, -1, log).to(torch.bfloat16)
        assert shared_reduction.default_choice("softmax_backward", y, -1) == "shared"
        ref = softmax_backward_reference(grad, y, -1, log)
        out = shared_reduction.softmax_backward(grad, y, -1, log)
        assert_within(out, ref, softmax_backward_bound(grad, y, -1, ref, log, torch.bfloat16), f"shared log={log}")
    for n in (1, 1000, 70001):
        x = torch.randn(n + 1, device="cuda")[1:]
        exact = reference_sum(x)
        assert_within(shared_reduction.atomic_sum(x), exact, sum_bound(x, None, False, exact))


# A tensor where a number goes and the other way round: a TypeError naming the op and the argument.
MISPLACED = {
    "sum(x, tensor)": (lambda x: shared_reduction.sum(x, x), r"^sum: dim must be an integer or None, got a tensor"),
    "amax(2.0)": (lambda x: shared_reduction.amax(2.0), r"^amax: x must be a tensor, got a float"),
    "softmax(x, 1.0)": (lambda x: shared_reduction.softmax(x, 1.0), r"^softmax: dim must be an integer, got a float"),
    "log_softmax(-1, x)": (lambda x: shared_reduction.log_softmax(-1, x), r"^log_softmax: x must be a tensor, got an int"),
    "softmax_backward(x, -1, x)": (lambda x: shared_reduction.softmax_backward(x, -1, x),
                                   r"^softmax_backward: y must be a tensor, got an int"),
    "atomic_sum(1.0)": (lambda x: shared_reduction.atomic_sum(1.0), r"^atomic_sum: x must be a tensor, got a float"),
    "default_choice(x, op)": (lambda x: shared_reduction.default_choice(x, "sum"), r"^default_choice: op must be a str, got a tensor"),
}


@pytest.mark.parametrize("call", list(MISPLACED))
def test_misplaced_arguments_raise_type_error(call, device):
    assert_misplaced(*MISPLACED[call], torch.randn(4, 4, device=device))
