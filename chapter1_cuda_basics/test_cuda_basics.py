"""Tests for chapter 1: every op x version x dtype x irregular shape, CPU and CUDA.

Run against the installed extension (pip install .) or the JIT build (COURSE_EXT_ROUTE=jit);
the header line says which one was loaded.
"""
import math

import pytest
import torch
from torch.testing import assert_close

import cuda_basics
from coursekit import results, shapes
from coursekit.pytest_plugin import (DTYPES, assert_misplaced, dtype_id, launched_kernels, poison_allocator,
                                     ptx_kernels, require_cuda)
from cuda_basics import VERSIONS

OPS = ("vector_add", "saxpy", "relu")
# Empty, single, odd, one off a warp either way, one off a block either way, a 2-D shape that
# is no multiple of anything, and one past a power of two (not a multiple of any vector width).
SHAPES = [(0,), (1,), (3,), (31,), (33,), (255,), (257,), (1823, 781), (2**20 + 17,)]


def tolerances(dtype):
    # The kernels compute fp16/bf16 in fp32 and round once; the references below are computed
    # in fp64 and rounded once, so results differ by at most one rounding of the output:
    # rtol = eps. saxpy may fuse alpha*x + y into one FMA whose product is never rounded; near
    # cancellation that leaves an absolute error of up to one ulp of |alpha * x| <= ~8
    # (|x| < 5 sigma, |alpha| <= 1.5): atol = 8 eps.
    eps = torch.finfo(dtype).eps
    return {"rtol": eps, "atol": 8 * eps}


# Plain-PyTorch references, computed in float64 and rounded once to the input dtype.
def reference_vector_add(a, b):
    return (a.double() + b.double()).to(a.dtype)


def reference_saxpy(alpha, x, y):
    return (alpha * x.double() + y.double()).to(x.dtype)


def reference_relu(x):
    return torch.relu(x.double()).to(x.dtype)


def make_inputs(op, shape, dtype, device):
    """(args for our op, reference output): random normal inputs, never zeros or ones."""
    a = torch.randn(shape, dtype=dtype, device=device)
    b = torch.randn(shape, dtype=dtype, device=device)
    if op == "vector_add":
        return (a, b), reference_vector_add(a, b)
    if op == "saxpy":
        alpha = float(torch.empty(()).uniform_(-1.5, 1.5))
        return (alpha, a, b), reference_saxpy(alpha, a, b)
    return (a,), reference_relu(a)


def run(op, args, version):
    return getattr(cuda_basics, op)(*args, version=version)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", VERSIONS["vector_add"])
@pytest.mark.parametrize("op", OPS)
def test_matches_reference(op, version, dtype, shape, device):
    """On the CPU every rung runs the same loop (elementwise_cpu.cpp never reads the version;
    the glue only parses it): there the rungs are each checked on the shapes of up to 2^14
    elements, and the two long shapes run with the first rung alone."""
    if device == "cpu" and version != VERSIONS["vector_add"][0] and math.prod(shape) > 2**14:
        pytest.skip("the CPU path ignores the rung: the first rung covers this shape")
    args, expected = make_inputs(op, shape, dtype, device)
    poison_allocator(expected)
    out = run(op, args, version)
    assert out.shape == expected.shape and out.dtype == dtype and out.device == expected.device
    assert not out.isnan().any(), "some output element was never written"
    assert_close(out, expected, **tolerances(dtype))


VIEWS = {
    # x[1:] stays contiguous but starts 1 element past a 16-byte boundary: v3/v4 must notice
    # and fall back to scalar accesses (a misaligned 128-bit load faults).
    "offset_by_one": lambda t: t.flatten()[1:],
    "transposed": lambda t: t.t(),
    "every_other": lambda t: t.flatten()[::2],
    "column": lambda t: t[:, 5],
}


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", VERSIONS["vector_add"])
@pytest.mark.parametrize("op", OPS)
def test_views(op, version, dtype, view, device):
    base_args, _ = make_inputs(op, (257, 129), dtype, device)
    take = VIEWS[view]
    args = tuple(take(x) if torch.is_tensor(x) else x for x in base_args)
    expected = {"vector_add": reference_vector_add, "saxpy": reference_saxpy,
                "relu": reference_relu}[op](*args)
    out = run(op, args, version)
    assert out.is_contiguous()
    assert_close(out, expected, **tolerances(dtype))


def test_mixed_contiguity(device):
    a = torch.randn(64, 33, device=device)
    b = torch.randn(33, 64, device=device).t()  # same shape as a, transposed strides
    assert_close(cuda_basics.vector_add(a, b), reference_vector_add(a, b))


@pytest.mark.parametrize("version", VERSIONS["vector_add"])
@pytest.mark.parametrize("op", OPS)
def test_gradcheck_float64(op, version, device):
    x = torch.randn(7, 13, dtype=torch.float64, device=device)
    # Keep relu's inputs away from its kink at 0, where finite differences are meaningless.
    x = (x + 0.1 * x.sign()).requires_grad_()
    y = torch.randn(7, 13, dtype=torch.float64, device=device, requires_grad=True)
    fn = {"vector_add": lambda x, y: cuda_basics.vector_add(x, y, version=version),
          "saxpy": lambda x, y: cuda_basics.saxpy(-0.75, x, y, version=version),
          "relu": lambda x, y: cuda_basics.relu(x, version=version) + 0 * y}[op]
    assert torch.autograd.gradcheck(fn, (x, y))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("op", OPS)
def test_low_precision_gradients(op, dtype, device):
    x = torch.randn(1823, 781, dtype=dtype, device=device, requires_grad=True)
    y = torch.randn(1823, 781, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(1823, 781, dtype=dtype, device=device)
    ours = {"vector_add": lambda: cuda_basics.vector_add(x, y),
            "saxpy": lambda: cuda_basics.saxpy(1.25, x, y),
            "relu": lambda: cuda_basics.relu(x)}[op]
    theirs = {"vector_add": lambda: x + y, "saxpy": lambda: 1.25 * x + y,
              "relu": lambda: torch.relu(x)}[op]
    ours().backward(grad)
    ours_grads = (x.grad.clone(), None if y.grad is None else y.grad.clone())
    x.grad, y.grad = None, None
    theirs().backward(grad)
    assert_close(ours_grads[0], x.grad, **tolerances(dtype))
    if y.grad is not None:
        assert_close(ours_grads[1], y.grad, **tolerances(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_relu_gradient_passes_at_nan(dtype, device):
    """torch.relu's backward (threshold_backward) zeroes the gradient where x <= 0, and NaN <= 0
    is false: at a NaN input the gradient passes. relu's backward here is that same op."""
    x = torch.tensor([float("nan"), -1.0, 0.0, 2.0], dtype=dtype, device=device)
    dy = torch.tensor([3.0, 4.0, 5.0, 6.0], dtype=dtype, device=device)
    xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(cuda_basics.relu(xg), xg, dy)
    (ex,) = torch.autograd.grad(torch.relu(xr), xr, dy)
    assert_close(dx, ex, rtol=0, atol=0)
    assert dx[0] == 3.0 and dx[1] == 0.0 and dx[2] == 0.0 and dx[3] == 6.0


def test_versions_table_matches_dispatch():
    for op in OPS:
        assert list(VERSIONS[op]) == torch.ops.cuda_basics.versions(op), op
    with pytest.raises(RuntimeError, match="versions: unknown op 'matmul'"):
        torch.ops.cuda_basics.versions("matmul")


def test_every_listed_version_dispatches_and_others_do_not(device):
    x = torch.randn(100, device=device)
    for version in VERSIONS["relu"]:
        assert_close(cuda_basics.relu(x, version=version), torch.relu(x))
    assert_close(cuda_basics.relu(x, version=None), torch.relu(x))
    for bad in ("v0", "v6", "V1", "", "best"):
        with pytest.raises(RuntimeError, match=f"relu: unknown version '{bad}'"):
            cuda_basics.relu(x, version=bad)


# version=None (elementwise.h, "version=None"): v5 at every size, its vectorized kernel on
# aligned inputs and its scalar form on misaligned views, 256 threads x 16 bytes per thread;
# except misaligned 2-byte views below kMisalignedSmallBelow = 2^19 elements, which take v1.
SMALL = 2**19
DISPATCH_CASES = [(n, dtype, aligned) for n in (0, 1, 2**16, SMALL - 1, SMALL, 2**24 + 3, 2**40)
                  for dtype in DTYPES for aligned in (True, False)]


def expected_default(n, dtype, aligned):
    size = torch.empty((), dtype=dtype).element_size()
    if not aligned and size == 2 and n < SMALL:
        return ("v1", "per_element", 256, 1)
    return ("v5", "vectorized" if aligned else "scalar", 256, 16 // size)


@pytest.mark.parametrize("n, dtype, aligned", DISPATCH_CASES,
                         ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else str(v))
def test_default_choice(n, dtype, aligned):
    assert cuda_basics.default_choice(n, dtype, aligned=aligned) == expected_default(n, dtype, aligned)


# The kernel each form launches, as the profiler names it (template arguments included).
KERNEL_OF = {"vectorized": "elementwise_vectorized_ilp<1,", "scalar": "elementwise_scalar_ilp<",
             "per_element": "elementwise_thread_per_element<"}


@pytest.mark.cuda
@pytest.mark.parametrize("n", (1, 31, 2**16 + 3, SMALL - 1, SMALL, 2**20))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("aligned", (True, False), ids=("aligned", "misaligned"))
def test_default_launches_its_choice(aligned, dtype, n):
    """version=None really runs the kernel default_choice names (read from the profiler's
    kernel names), on each side of the alignment boundary, and gets the right answer."""
    require_cuda()
    skip = 0 if aligned else 1  # x[1:]: 2 to 8 bytes past a 16-byte boundary
    a = torch.randn(n + skip, dtype=dtype, device="cuda")[skip:]
    b = torch.randn(n + skip, dtype=dtype, device="cuda")[skip:]
    kernel = cuda_basics.default_choice(n, dtype, aligned=aligned)[1]
    out, kernels = launched_kernels(lambda: cuda_basics.vector_add(a, b), "cuda_basics")
    assert len(kernels) == 1 and KERNEL_OF[kernel] in kernels[0], kernels
    assert_close(out, reference_vector_add(a, b), **tolerances(dtype))


def test_recorded_results_hold_the_dispatch():
    """The committed GPU results (bench_cuda_basics.py) must show version=None at every
    measured size, with the rung the dispatch picks today, never slower than 0.95x the fastest
    rung there. Fails on results older than the dispatch (no default rows, a rung missing,
    another choice recorded) and on a dispatch whose choice regressed."""
    record = results.load_recorded_gpu("chapter1_cuda_basics")
    assert record is not None, "no recorded GPU results: run bench_cuda_basics.py on a GPU"
    rungs = VERSIONS["vector_add"]
    sweep = [r for r in record["benchmarks"] if r.get("sweep") and not r.get("view")]
    assert {*rungs, "default"} <= {r["variant"] for r in sweep}, "a rung is missing: stale"
    for r in record["benchmarks"]:
        if r["variant"] == "default":
            expected = cuda_basics.default_choice(r["shape"][0], getattr(torch, r["dtype"]),
                                                  aligned=r.get("view") is None)[0]
            assert r.get("dispatch") == expected, (r["shape"], r["dtype"], r.get("view"))
    assert results.default_gaps(record, rungs) == []


def test_recorded_shapes_sweep_holds_the_target():
    """The shapes sweep (bench_cuda_basics.py --shapes): at every tokens x hidden shape that moves
    at least 1 MiB, version=None at least 0.95x eager PyTorch (the sweep compares with eager alone),
    with the choice the dispatch makes today recorded beside it."""
    record = shapes.load("chapter1_cuda_basics")

    def choice(r):
        return cuda_basics.default_choice(r["shape"][0] * r["shape"][1], getattr(torch, r["dtype"]), aligned=True)[0]
    assert shapes.stale_dispatch(record, choice) == []
    shapes.expect_target(record, "bench_cuda_basics.py --shapes")


# Every misuse raises a RuntimeError naming the op and the problem.
MISUSES = {
    "dtype mismatch": (lambda d: cuda_basics.vector_add(torch.randn(4, device=d),
                                                        torch.randn(4, device=d).double()),
                       r"vector_add: a is Float but b is Double"),
    "shape mismatch": (lambda d: cuda_basics.saxpy(2.0, torch.randn(4, 3, device=d),
                                                   torch.randn(3, device=d)),
                       r"saxpy: x has shape \[4, 3\] but y has shape \[3\].*no broadcasting"),
    "integer dtype": (lambda d: cuda_basics.relu(torch.arange(5, device=d)),
                      r"relu: x has dtype Long, which is not supported"),
    "integer pair": (lambda d: cuda_basics.vector_add(torch.arange(5, device=d),
                                                      torch.arange(5, device=d)),
                     r"vector_add: a has dtype Long, which is not supported"),
    "unknown version": (lambda d: cuda_basics.saxpy(1.0, torch.randn(3, device=d),
                                                    torch.randn(3, device=d), version="v9"),
                        r"saxpy: unknown version 'v9'; expected one of uncoalesced, v1"),
    "tune on cpu": (lambda d: torch.ops.cuda_basics.tune_vector_add(
        torch.randn(3), torch.randn(3), 128, 1), r"tune_vector_add: a is on cpu; launch shapes"),
    "tune bad vectors": (lambda d: torch.ops.cuda_basics.tune_vector_add(
        torch.randn(3, device=d), torch.randn(3, device=d), 128, 3),
        r"tune_vector_add: vectors must be 1, 2 or 4 \(the instantiated kernels\), got 3"),
    "tune bad threads": (lambda d: torch.ops.cuda_basics.tune_vector_add(
        torch.randn(3, device=d), torch.randn(3, device=d), 100, 1),
        r"tune_vector_add: threads must be a multiple of 32 in \[64, 1024\], got 100"),
}


@pytest.mark.parametrize("misuse", list(MISUSES))
def test_misuse_raises_clear_error(misuse, device):
    call, message = MISUSES[misuse]
    with pytest.raises(RuntimeError, match=message):
        call(device)


# A tensor where a number goes, or a number where a tensor goes (arguments in the wrong order):
# a TypeError from the Python API naming the op and the argument, before anything runs.
MISPLACED = {
    "saxpy(x, y, alpha)": (lambda x: cuda_basics.saxpy(x, x, 2.0), r"^saxpy: alpha must be a number \(float\), "
                           r"got a tensor of dtype float32 and shape \[8\] on \w+(:\d+)? \(the arguments, in order: alpha, x, y\)$"),
    "vector_add(x, 2.0)": (lambda x: cuda_basics.vector_add(x, 2.0), r"^vector_add: b must be a tensor, got a float"),
    "relu(2.0)": (lambda x: cuda_basics.relu(2.0), r"^relu: x must be a tensor, got a float"),
    "default_choice(x, dtype)": (lambda x: cuda_basics.default_choice(x, x.dtype),
                                 r"^default_choice: numel must be an integer, got a tensor"),
}


@pytest.mark.parametrize("call", list(MISPLACED))
def test_misplaced_arguments_raise_type_error(call, device):
    assert_misplaced(*MISPLACED[call], torch.randn(8, device=device))


@pytest.mark.cuda
def test_mixed_devices_raise():
    require_cuda()
    a = torch.randn(8, device="cuda")
    b = torch.randn(8)
    with pytest.raises(RuntimeError, match=r"vector_add: a is on cuda:0 but b is on cpu"):
        cuda_basics.vector_add(a, b)
    with pytest.raises(RuntimeError, match=r"saxpy: x is on cpu but y is on cuda:0"):
        cuda_basics.saxpy(1.0, b, a)


@pytest.mark.parametrize("op", OPS)
def test_opcheck(op, device):
    args, _ = make_inputs(op, (33, 17), torch.float32, device)
    args = tuple(x.requires_grad_() if torch.is_tensor(x) else x for x in args)
    torch.library.opcheck(getattr(torch.ops.cuda_basics, op).default, (*args, None))


@pytest.mark.cuda
@pytest.mark.large
@pytest.mark.parametrize("version", VERSIONS["vector_add"])
def test_beyond_int32_elements(version):
    """2^31 + 1001 float16 elements (4 GiB per tensor): every index must be 64-bit."""
    require_cuda()
    n = 2**31 + 1001
    need = 4 * n * 2  # a, b, out and the reference
    if torch.cuda.mem_get_info()[0] < need * 1.2:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory")
    a = torch.randn(n, dtype=torch.float16, device="cuda")
    b = torch.randn(n, dtype=torch.float16, device="cuda")
    out = cuda_basics.vector_add(a, b, version=version)
    assert torch.equal(out, a + b)  # torch.add computes fp16 in fp32 and rounds once, as we do
    del a, b, out
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("version", VERSIONS["vector_add"])
@pytest.mark.parametrize("op", OPS)
def test_sanitizer_small_run(op, version):
    """The small run the GPU pass executes under compute-sanitizer: every kernel instantiation
    (dtype x op x version), ragged sizes and a misaligned view, a few elements each."""
    require_cuda()
    for dtype in DTYPES:
        for n in (1, 33, 4099):
            args, expected = make_inputs(op, (n + 1,), dtype, "cuda")
            args = tuple(x[1:] if torch.is_tensor(x) else x for x in args)  # misaligned view
            assert_close(run(op, args, version), expected[1:], **tolerances(dtype))
            args, expected = make_inputs(op, (n,), dtype, "cuda")
            assert_close(run(op, args, version), expected, **tolerances(dtype))


def test_vectorized_kernels_use_128bit_accesses(tmp_path):
    """v3 and v4 must move every full vector with one 128-bit instruction; scalar accesses are
    allowed only for the tail (one load per input, one store). nvcc once split v3's loads into
    four 4-byte loads without any test failing; only the ncu load count showed it."""
    import re
    from pathlib import Path

    kernels = ptx_kernels(Path(__file__).parent / "elementwise_kernels.cu", tmp_path)
    checked = 0
    for name, body in kernels.items():
        if "elementwise_vectorized" not in name:
            continue
        inputs = 2 if "Lb1E" in name else 1  # template arg kBinary (true)
        wide_loads = len(re.findall(r"ld\.global(?:\.nc)?\.v[24]\.", body))
        scalar_loads = len(re.findall(r"ld\.global(?:\.nc)?\.[suf]\d+", body))
        wide_stores = len(re.findall(r"st\.global\.v[24]\.", body))
        scalar_stores = len(re.findall(r"st\.global\.[suf]\d+", body))
        assert wide_loads >= inputs and wide_stores >= 1, name
        assert scalar_loads <= inputs and scalar_stores <= 1, (name, scalar_loads, scalar_stores)
        checked += 1
    # (v3, and v4/v5's kernel with 1, 2 or 4 vectors per thread) x ops x dtypes
    assert checked == (1 + 3) * 3 * 4


def test_torch_compile_traces_the_ops(device):
    """Dynamo and AOTAutograd trace through the ops without a graph break (the Meta kernel gives
    shapes, the Autograd kernel the backward); aot_eager skips codegen to keep this fast."""
    torch._dynamo.reset()

    def f(x, y):
        return cuda_basics.relu(cuda_basics.saxpy(0.5, cuda_basics.vector_add(x, y), y)).sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.randn(257, 33, device=device, requires_grad=True)
    y = torch.randn(257, 33, device=device, requires_grad=True)
    out = compiled(x, y)
    gx, gy = torch.autograd.grad(out, (x, y))
    ex, ey = torch.autograd.grad(f(x, y), (x, y))
    assert_close(out, f(x, y))
    assert_close(gx, ex)
    assert_close(gy, ey)
