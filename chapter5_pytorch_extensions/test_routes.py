"""The three binding routes of chapter 5, tested side by side.

Every route (custom_ops.ROUTES: pybind11, torch_library, custom_op) runs the same kernels, so
each must give the same answers on every device and dtype; what differs is how PyTorch sees
them. This file holds each route to what it promises:

- all three: forward and gradients against a float64 reference on irregular shapes, every
  dtype (float32, float16, bfloat16, float64), empty and non-contiguous inputs, gradcheck,
  misuse raising a RuntimeError that names the op;
- torch_library and custom_op (dispatcher ops): torch.library.opcheck, torch.compile with
  fullgraph=True and 0 graph breaks, torch.export, fake tensors;
- pybind11: none of those apply, and the tests record what happens instead (a graph break,
  opcheck refusing it, fake tensors refused with a clear error rather than a crash).

Bounds: inputs keep |x * scale + bias| >= 0.25 (bias_inputs), so no rounding can flip the
sign of an element and the ReLU's mask is that of the exact values. The kernels compute in
float32 (float64 for float64) and round once to the dtype; each bound is written next to its
comparison with the reason.
"""
import warnings

import pytest
import torch

import custom_ops
from coursekit.pytest_plugin import (DTYPES, assert_misplaced, assert_within, dtype_id, floor, offset_copy,
                                      replayed_outputs, require_cuda, shape_id)
from custom_ops import _C

ROUTES = custom_ops.ROUTES
ROUTE_NAMES = list(ROUTES)
DISPATCHER_ROUTES = ("torch_library", "custom_op")
OPS = torch.ops.custom_ops
PY_OPS = torch.ops.custom_ops_py
SCALE = 0.75  # not a power of two: x * scale rounds

# Each route's backward entry point: (grad, output, scale) -> (grad_input, grad_bias).
BACKWARDS = {
    "pybind11": _C.fused_op_backward_raw,
    "torch_library": OPS.fused_op_backward.default,
    "custom_op": PY_OPS.fused_op_backward.default,
}
# custom_relu and reduce_sum have two routes: pybind11 and the public (TORCH_LIBRARY) ops.
RELU_ROUTES = {"pybind11": _C.custom_relu, "torch_library": custom_ops.custom_relu}
SUM_ROUTES = {"pybind11": _C.reduce_sum, "torch_library": custom_ops.reduce_sum}

# Odd row lengths take the CUDA forward's one-element path; rows a whole number of 16-byte
# vectors in every dtype (n % 8 == 0), its vector path: a row shorter than one tile (8, 16),
# several column tiles (4096), many row tiles (70000 x 8).
SHAPES = [(1,), (3,), (1, 1), (31, 33), (33, 31), (255, 257), (2, 3, 33), (97, 13), (1823, 781),
          (8,), (4, 8), (3, 2, 16), (129, 264), (2, 4096), (70_000, 8)]
EMPTY_SHAPES = [(0,), (0, 7), (5, 0), (2, 0, 3)]


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def eps(dtype):
    return torch.finfo(dtype).eps


def eps_acc(dtype):
    """eps of the type the kernels compute in: float32 for every dtype but float64."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def bias_inputs(shape, dtype, device, scale=SCALE, margin=0.25):
    """x and bias with |x * scale + bias| >= margin everywhere. Rounding x (|x| < 12) and bias
    (|bias| < 5) to bfloat16 moves x * scale + bias by < 0.05, so no sign flips."""
    n = shape[-1] if len(shape) else 1
    bias = torch.randn(n, dtype=torch.float64, device=device)
    z = torch.randn(shape, dtype=torch.float64, device=device)
    z = z + margin * z.sign()
    return ((z - bias) / scale).to(dtype), bias.to(dtype)


def reference(x, bias, scale=SCALE):
    """relu(x * scale + bias) in float64 from the inputs as given (already rounded)."""
    return torch.relu(x.double() * scale + bias.double())


def forward_bound(expected, dtype, x, scale=SCALE):
    """The kernel's z = x * scale + bias is one float32 (float64) rounding from exact (a fused
    multiply-add), and the store one rounding to the dtype: eps_acc + eps of |expected|, plus
    the slack near zero. The float64 reference rounds x * scale before adding: eps64 of
    |x * scale| more, which only float64's own bound notices (where x * scale and bias nearly
    cancel, that rounding is larger than an ulp of the result)."""
    return ((eps(dtype) + eps_acc(dtype)) * expected.abs() + eps(torch.float64) * (x.double() * scale).abs()
            + floor(dtype))


def grad_reference(x, bias, dy, scale=SCALE):
    """(dx, dbias) in float64: g = dy where x * scale + bias > 0; dx = g * scale, dbias its
    column sum over every leading dim."""
    g = torch.where(x.double() * scale + bias.double() > 0, dy.double(), 0.0)
    return g * scale, g.reshape(-1, g.shape[-1]).sum(0)


def rows_of(t):
    return t.reshape(-1, t.shape[-1])


# ---------------------------------------------------------------------------------------------
# 1. The package: three routes, one kernel
# ---------------------------------------------------------------------------------------------
def test_routes_table():
    assert set(ROUTES) == {"pybind11", "torch_library", "custom_op"}
    assert all(callable(fn) for fn in ROUTES.values())
    # The public op is route 2, the course's route.
    x, bias = bias_inputs((4, 9), torch.float32, "cpu")
    assert torch.equal(custom_ops.fused_op_forward(x, bias, SCALE), OPS.fused_op(x, bias, SCALE))


def test_versions_op_is_the_loaders_handle():
    """coursekit.loader recognises a loaded course library by its `versions` op. This chapter
    has no kernel ladder: each op lists no versions, and an unknown name is an error."""
    for op in ("fused_op", "fused_op_backward", "custom_relu", "custom_relu_backward", "reduce_sum"):
        assert OPS.versions(op) == []
    with pytest.raises(RuntimeError, match="versions: unknown op 'nope'"):
        OPS.versions("nope")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_routes_agree_bitwise(dtype, device):
    """The same kernel behind every route: the same bits, forward and backward."""
    x, bias = bias_inputs((37, 129), dtype, device)
    dy = torch.randn(37, 129, device=device).to(dtype)
    outs = {name: fn(x, bias, SCALE) for name, fn in ROUTES.items()}
    grads = {name: BACKWARDS[name](dy, outs[name], SCALE) for name in ROUTES}
    for name in ROUTE_NAMES[1:]:
        assert torch.equal(outs[name], outs["pybind11"]), name
        assert all(torch.equal(a, b) for a, b in zip(grads[name], grads["pybind11"])), name


# ---------------------------------------------------------------------------------------------
# 2. Forward and backward against the reference, every route x dtype x shape
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_forward(route, dtype, device):
    fn = ROUTES[route]
    for shape in SHAPES:
        x, bias = bias_inputs(shape, dtype, device)
        out = fn(x, bias, SCALE)
        assert out.dtype == dtype and out.device == x.device and out.is_contiguous()
        expected = reference(x, bias)
        assert_within(out, expected, forward_bound(expected, dtype, x), f"{route} {shape_id(shape)}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_backward(route, dtype, device):
    fn = ROUTES[route]
    for shape in SHAPES:
        x, bias = bias_inputs(shape, dtype, device)
        x.requires_grad_()
        bias.requires_grad_()
        dy = torch.randn(shape, device=device).to(dtype)
        dx, dbias = torch.autograd.grad(fn(x, bias, SCALE), (x, bias), dy)
        ex, ebias = grad_reference(x.detach(), bias.detach(), dy)
        assert dx.dtype == dtype and dbias.dtype == dtype and dbias.shape == bias.shape
        # dx = dy * scale: one float32 product, rounded once to the dtype.
        assert_within(dx, ex, (eps(dtype) + eps_acc(dtype)) * ex.abs() + floor(dtype), f"{route} dx {shape_id(shape)}")
        # dbias adds `rows` values in float32 (float64) in some fixed order: at most one rounding
        # of the running sum per addition, bounded by rows * eps_acc * sum |g|; then one
        # rounding to the dtype.
        g_abs = rows_of(torch.where(ex != 0, dy.double(), 0.0)).abs().sum(0)
        rows = rows_of(dy).shape[0]
        bound = rows * eps_acc(dtype) * g_abs + eps(dtype) * ebias.abs() + floor(dtype)
        assert_within(dbias, ebias, bound, f"{route} dbias {shape_id(shape)}")


@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_empty_inputs(route, device):
    for shape in EMPTY_SHAPES:
        x, bias = bias_inputs(shape, torch.float32, device)
        x.requires_grad_()
        bias.requires_grad_()
        out = ROUTES[route](x, bias, SCALE)
        assert out.shape == x.shape
        dx, dbias = torch.autograd.grad(out, (x, bias), torch.ones_like(out))
        assert dx.shape == x.shape
        # No rows: no gradient reaches the bias, which must be 0, not uninitialized memory.
        assert torch.equal(dbias, torch.zeros_like(bias)), shape


@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_non_contiguous_and_offset_inputs(route, device):
    """Transposed, strided and misaligned (offset by one element) views of x and bias."""
    fn = ROUTES[route]
    x_full, bias_full = bias_inputs((33, 62), torch.float32, device)
    views = {
        "transposed x": x_full[:, :31].t(),  # [31, 33], strides (1, 62)
        "strided x": x_full[:, ::2],  # [33, 31]
        "offset x": x_full.flatten()[1:1 + 31 * 33].view(31, 33),  # starts one element in
        # Rows a whole number of vectors, but the first not on a 16-byte boundary: the CUDA
        # forward must fall back to one-element accesses.
        "offset x, n = 32": x_full.flatten()[1:1 + 31 * 32].view(31, 32),
    }
    for what, x in views.items():
        bias = torch.randn(x.shape[-1] * 2, device=device)[::2]  # a strided bias too
        assert not bias.is_contiguous()
        x = x.detach().requires_grad_()
        bias.requires_grad_()
        out = fn(x, bias, SCALE)
        assert out.is_contiguous()
        expected = reference(x.detach(), bias.detach())
        assert_within(out, expected, forward_bound(expected, torch.float32, x.detach()), f"{route} {what}")
        dy = torch.randn(x.shape, device=device).t().contiguous().t()  # a non-contiguous gradient
        dx, dbias = torch.autograd.grad(out, (x, bias), dy)
        ex, ebias = grad_reference(x.detach(), bias.detach(), dy)
        torch.testing.assert_close(dx, ex.float())
        torch.testing.assert_close(dbias, ebias.float(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_gradcheck(route, device):
    """Finite differences against the backward, in float64. Inputs keep away from relu's kink
    (bias_inputs' margin, far beyond gradcheck's step of 1e-6)."""
    fn = ROUTES[route]
    for shape in ((5, 7), (3, 2, 4), (6,)):
        x, bias = bias_inputs(shape, torch.float64, device)
        x.requires_grad_()
        bias.requires_grad_()
        assert torch.autograd.gradcheck(lambda a, b: fn(a, b, SCALE), (x, bias))


def test_backward_saves_the_output_not_a_copy(device):
    """The saved tensor is the output itself: modifying the output in place must make the
    backward refuse (autograd's version counter), not silently use changed values."""
    for route, fn in ROUTES.items():
        x, bias = bias_inputs((4, 6), torch.float32, device)
        x.requires_grad_()
        out = fn(x, bias, SCALE)
        out.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


# ---------------------------------------------------------------------------------------------
# 3. custom_relu and reduce_sum (pybind11 and TORCH_LIBRARY routes)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("route", list(RELU_ROUTES))
def test_custom_relu(route, dtype, device):
    fn = RELU_ROUTES[route]
    for shape in [(0,), (1,), (31, 33), (2, 3, 257), (1823, 781)]:
        x = torch.randn(shape, device=device).to(dtype).requires_grad_()
        out = fn(x)
        # relu only selects: bitwise equal to torch.relu, and the gradient is dy or 0 exactly.
        assert torch.equal(out, torch.relu(x)), shape
        dy = torch.randn(shape, device=device).to(dtype)
        (dx,) = torch.autograd.grad(out, x, dy)
        assert torch.equal(dx, torch.where(x > 0, dy, torch.zeros_like(dy))), shape
    x = torch.tensor([float("nan"), -0.5, 0.0, 2.0], device=device, dtype=dtype)
    torch.testing.assert_close(fn(x), torch.relu(x), equal_nan=True)
    strided = torch.randn(40, 66, device=device).to(dtype)[:, 1::2]
    assert torch.equal(fn(strided), torch.relu(strided))


@pytest.mark.parametrize("route", list(RELU_ROUTES))
def test_custom_relu_gradcheck(route, device):
    x = torch.randn(7, 5, dtype=torch.float64, device=device)
    x = (x + 0.1 * x.sign()).requires_grad_()  # away from the kink at 0
    assert torch.autograd.gradcheck(RELU_ROUTES[route], (x,))


SUM_SIZES = [0, 1, 3, 31, 33, 255, 257, 4095, 4096, 4097, 1823 * 781, 1_000_003]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("route", list(SUM_ROUTES))
def test_reduce_sum(route, dtype, device):
    fn = SUM_ROUTES[route]
    for n in SUM_SIZES:
        x = torch.randn(n, device=device).to(dtype)
        out = fn(x)
        assert out.shape == () and out.dtype == dtype and out.device == x.device
        expected = x.double().sum()
        # Every addition rounds the running sum by at most eps_acc of it; the longest chain of
        # additions, on the GPU (a thread's share, the 8-level tree, then the same again over
        # the partials) and on the CPU (a 4096-element chunk, then the chunks), is shorter
        # than 4096 + n / 256 + 64. Then one rounding to the dtype. A rigorous bound, hence
        # loose; test_reduce_sum_exact_on_integers is the sharp check.
        chain = 4096 + n / 256 + 64
        bound = chain * eps_acc(dtype) * x.double().abs().sum().item() + eps(dtype) * abs(expected.item())
        assert abs(out.double().item() - expected.item()) <= bound, (n, out.item(), expected.item(), bound)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("route", list(SUM_ROUTES))
def test_reduce_sum_exact_on_integers(route, dtype, device):
    """Integer-valued inputs whose partial sums stay below 2^24 add exactly in float32 (and
    float64) in any order, and the result is rounded once to the dtype: it must equal the
    exact sum rounded to the dtype, bit for bit, so a lost or doubled element cannot hide in
    the rounding. Sizes straddle the one-block/two-stage switch (4096) and reach many blocks."""
    fn = SUM_ROUTES[route]
    for n in (1, 255, 4096, 4097, 262_145, 1_000_003):
        for x in (torch.randint(-8, 9, (n,), device=device).to(dtype), torch.ones(n, device=device, dtype=dtype)):
            exact = torch.tensor(x.double().sum().item(), dtype=torch.float64).to(dtype)
            assert fn(x).item() == exact.item(), (n, fn(x).item(), exact.item())


@pytest.mark.parametrize("route", list(SUM_ROUTES))
def test_reduce_sum_shapes_views_and_determinism(route, device):
    fn = SUM_ROUTES[route]
    x = torch.randn(33, 257, device=device)
    for view in (x, x.t(), x[:, 1:], x.flatten()[1:], x[::2, ::3], torch.tensor(2.5, device=device)):
        torch.testing.assert_close(fn(view), view.double().sum().float(), rtol=1e-5, atol=1e-4)
    big = torch.randn(1_000_003, device=device)
    assert torch.equal(fn(big), fn(big)), "no atomics: the same input gives the same bits"
    assert fn(torch.empty(0, 3, device=device)).item() == 0.0


@pytest.mark.parametrize("route", list(SUM_ROUTES))
def test_reduce_sum_backward(route, device):
    fn = SUM_ROUTES[route]
    for shape in ((0,), (5,), (3, 4, 5)):
        x = torch.randn(shape, device=device, requires_grad=True)
        (dx,) = torch.autograd.grad(fn(x), x, torch.tensor(-1.5, device=device))
        assert dx.shape == x.shape and bool((dx == -1.5).all())
    x = torch.randn(4, 3, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(fn, (x,))


# ---------------------------------------------------------------------------------------------
# 4. Misuse: a RuntimeError naming the op, on every route, never a crash
# ---------------------------------------------------------------------------------------------
def misuse_cases(device):
    x, bias = bias_inputs((4, 6), torch.float32, device)
    return {
        # The C++ checks name dtypes as c10 does (Int, Float), route 3's Python fake as torch
        # does (torch.int32): either way the op, the argument and the dtype.
        "int input": ((x.int(), bias.int()), r"fused_op: input has dtype (Int|torch\.int32), which is not supported"),
        "bias too short": ((x, bias[:5]), r"fused_op: bias has shape \[5\] but input has shape \[4, 6\]"),
        "2-D bias": ((x, bias.view(2, 3)), r"fused_op: bias has shape \[2, 3\].*1-D"),
        "0-d input": ((x[0, 0], bias[:1]), r"fused_op: input is 0-d"),
        "mixed dtypes": ((x, bias.double()), r"fused_op: input is (Float|torch\.float32) but bias is "
                                              r"(Double|torch\.float64)"),
    }


@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_misuse_raises_naming_the_op(route, device):
    for what, (args, message) in misuse_cases(device).items():
        with pytest.raises(RuntimeError, match=message):
            ROUTES[route](*args, SCALE)


@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_misuse_raises_on_meta_tensors_too(route):
    """Shape-only tracing must reject what the kernel rejects: route 1 and 2 reach the same
    C++ checks with meta tensors, route 3 its Python fake implementation."""
    for what, (args, message) in misuse_cases("meta").items():
        with pytest.raises(RuntimeError, match=message):
            ROUTES[route](*args, SCALE)


@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_backward_misuse(route, device):
    backward = BACKWARDS[route]
    grad = torch.randn(4, 6, device=device)
    with pytest.raises(RuntimeError, match=r"fused_op_backward: grad has shape \[4, 6\] but output has shape \[4, 5\]"):
        backward(grad, torch.randn(4, 5, device=device), SCALE)
    with pytest.raises(RuntimeError, match=r"fused_op_backward: grad is .*[Ff]loat.* but output is .*[Dd]ouble"):
        backward(grad, grad.double(), SCALE)


def test_relu_and_sum_misuse(device):
    for fn in RELU_ROUTES.values():
        with pytest.raises(RuntimeError, match="custom_relu: x has dtype Long"):
            fn(torch.arange(4, device=device))
    for fn in SUM_ROUTES.values():
        with pytest.raises(RuntimeError, match="reduce_sum: x has dtype Int"):
            fn(torch.arange(4, device=device, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"custom_relu_backward: grad has shape \[3\] but output has shape \[4\]"):
        OPS.custom_relu_backward(torch.randn(3, device=device), torch.randn(4, device=device))


# The edges of course/bias_act.cuh's paths that fused_op runs: rows around the narrow tile's 64 and
# around 256, widths of one element, of less than a vector, that start rows mid-vector (777, 4099:
# the span kernel, and the forward's bias in aligned windows) and a wide one.
EDGE_ROWS = (1, 7, 63, 64, 65, 255, 257)
EDGE_WIDTHS = (1, 7, 777, 4099, 16384)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=dtype_id)
def test_fused_op_at_edge_rows_and_widths(dtype):
    """fused_op's forward and gradients (the CUDA kernels' flat forward, the backward's tile and
    span kernels with their sums added in shared memory) against float64 at every edge row count
    and width, with x and the bias also as views one element into their storage (not on a 16-byte
    boundary); and a CUDA graph of forward and backward at few rows and odd widths, replayed twice,
    equal to the eager run bitwise."""
    require_cuda()
    fn = ROUTES["torch_library"]
    for rows in EDGE_ROWS:
        for hidden in EDGE_WIDTHS:
            for offset in (0, 1):
                shape = (rows, hidden)
                x0, b0 = bias_inputs(shape, dtype, "cuda")
                x, bias = offset_copy(x0, offset), offset_copy(b0, offset)
                where = f"{shape_id(shape)} offset {offset}"
                xg, bg = x.detach().requires_grad_(), bias.detach().requires_grad_()
                out = fn(xg, bg, SCALE)
                expected = reference(x, bias)
                assert_within(out, expected, forward_bound(expected, dtype, x), f"forward {where}")
                dy = torch.randn(shape, device="cuda").to(dtype)
                dx, dbias = torch.autograd.grad(out, (xg, bg), dy)
                ex, ebias = grad_reference(x, bias, dy)
                assert_within(dx, ex, (eps(dtype) + eps_acc(dtype)) * ex.abs() + floor(dtype), f"dx {where}")
                g_abs = torch.where(ex != 0, dy.double(), 0.0).abs().sum(0)
                bound = rows * eps_acc(dtype) * g_abs + eps(dtype) * ebias.abs() + floor(dtype)
                assert_within(dbias, ebias, bound, f"dbias {where}")
    for shape in ((64, 4099), (7, 777), (65, 4099), (257, 16384), (2048, 777)):
        x, bias = bias_inputs(shape, dtype, "cuda")
        dy = torch.randn(shape, device="cuda").to(dtype)

        def step():
            xg, bg = x.detach().requires_grad_(), bias.detach().requires_grad_()
            out = fn(xg, bg, SCALE)
            return (out.detach(), *torch.autograd.grad(out, (xg, bg), dy))

        eager = step()
        replays = replayed_outputs(step, 2)
        for replay, captured in enumerate(replays):
            assert all(torch.equal(c, e) for c, e in zip(captured, eager)), (shape, replay)


@pytest.mark.cuda
@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_device_mismatch(route):
    require_cuda()
    x, bias = bias_inputs((4, 6), torch.float32, "cuda")
    with pytest.raises(RuntimeError, match=r"fused_op: input is on cuda:0 but bias is on cpu"):
        ROUTES[route](x, bias.cpu(), SCALE)
    with pytest.raises(RuntimeError, match=r"fused_op: input is on cpu but bias is on cuda:0"):
        ROUTES[route](x.cpu(), bias, SCALE)


# ---------------------------------------------------------------------------------------------
# 5. What PyTorch's tooling sees: opcheck, fake tensors, torch.compile, torch.export
# ---------------------------------------------------------------------------------------------
def _opcheck_calls(device):
    x, bias = bias_inputs((9, 40), torch.float32, device)
    xt = bias_inputs((40, 9), torch.float32, device)[0].t()  # non-contiguous: the fake must match
    y = OPS.fused_op(x, bias, SCALE)
    dy = torch.randn(9, 40, device=device)
    xr, br = (t.clone().requires_grad_() for t in (x, bias))
    return {
        "fused_op": (OPS.fused_op.default, (xr, br, SCALE)),
        "fused_op_no_grad": (OPS.fused_op.default, (x, bias, SCALE)),
        "fused_op_non_contiguous": (OPS.fused_op.default, (xt, torch.randn(40, device=device), SCALE)),
        "fused_op_3d": (OPS.fused_op.default, (x.view(3, 3, 40).clone().requires_grad_(), br, SCALE)),
        "fused_op_backward": (OPS.fused_op_backward.default, (dy, y, SCALE)),
        "custom_relu": (OPS.custom_relu.default, (xr,)),
        "custom_relu_backward": (OPS.custom_relu_backward.default, (dy, y)),
        "reduce_sum": (OPS.reduce_sum.default, (xr,)),
        "reduce_sum_3d": (OPS.reduce_sum.default, (torch.randn(3, 5, 7, device=device, requires_grad=True),)),
        "py_fused_op": (PY_OPS.fused_op.default, (xr, br, SCALE)),
        "py_fused_op_non_contiguous": (PY_OPS.fused_op.default, (xt, torch.randn(40, device=device), SCALE)),
        "py_fused_op_backward": (PY_OPS.fused_op_backward.default, (dy, y, SCALE)),
    }


@pytest.mark.parametrize("name", list(_opcheck_calls("cpu")))
def test_opcheck(name, device):
    """Schema, fake/meta kernels, autograd registration and AOT dispatch (with dynamic shapes)
    checked against the real kernels: routes 2 and 3 pass."""
    fn, args = _opcheck_calls(device)[name]
    torch.library.opcheck(fn, args)


def test_opcheck_cannot_take_the_pybind_route():
    """Route 1 is a pybind11 builtin, not a registered op: there is no schema, fake kernel or
    autograd registration for opcheck to check, and it says so."""
    x, bias = bias_inputs((4, 6), torch.float32, "cpu")
    with pytest.raises(ValueError, match="op must be instance of torch._ops.OpOverload"):
        torch.library.opcheck(_C.fused_op_forward, (x, bias, SCALE))


@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_meta_tensors(route):
    """Shapes without data: every route answers on meta tensors (route 1 too: its C++ glue
    handles meta itself), with the kernel's output shape and a contiguous layout."""
    x = torch.empty(7, 3, 33, device="meta").transpose(0, 1)
    bias = torch.empty(33, device="meta")
    out = ROUTES[route](x, bias, SCALE)
    assert out.device.type == "meta" and out.shape == (3, 7, 33) and out.is_contiguous()


@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_fake_tensors(route):
    """FakeTensorMode (what torch.compile and torch.export trace with): the dispatcher routes
    find the Meta kernel or the registered fake; route 1 has none, and refuses with a clear
    error instead of reading memory that is not there (which crashed the process before the
    glue checked for it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, bias = bias_inputs((6, 10), torch.float32, "cpu")
    with FakeTensorMode() as mode:
        fx, fbias = mode.from_tensor(x), mode.from_tensor(bias)
        if route in DISPATCHER_ROUTES:
            out = ROUTES[route](fx, fbias, SCALE)
            assert out.shape == (6, 10) and out.dtype == torch.float32
        else:
            with pytest.raises(RuntimeError, match="fused_op: input is a tensor without data"):
                ROUTES[route](fx, fbias, SCALE)


def _model_for(fn):
    def model(x, bias):
        # Work before and after the op, so that a graph break shows as two graphs.
        return fn(x * 1.5, bias, SCALE) * 2.0
    return model


@pytest.mark.parametrize("route", ROUTE_NAMES)
def test_graph_breaks(route):
    """torch._dynamo.explain: routes 2 and 3 are one graph with the op inside it; route 1 is
    a builtin Dynamo cannot trace, so it breaks the graph in two and runs between them."""
    x, bias = bias_inputs((8, 40), torch.float32, "cpu")
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dynamo's long warning about the pybind11 builtin
        explained = torch._dynamo.explain(_model_for(ROUTES[route]))(x, bias)
    torch._dynamo.reset()
    ops = [str(op) for graph_ops in explained.ops_per_graph for op in graph_ops]
    if route in DISPATCHER_ROUTES:
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained
        namespace = "custom_ops_py" if route == "custom_op" else "custom_ops"
        assert any(f"{namespace}.fused_op" in op for op in ops), ops
    else:
        assert (explained.graph_count, explained.graph_break_count) == (2, 1), explained
        assert not any("fused_op" in op for op in ops), ops
        assert "skipped" in str(explained.break_reasons[0].reason)


@pytest.mark.parametrize("route", DISPATCHER_ROUTES)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_forward_and_backward(route, dynamic, device):
    """fullgraph=True: any graph break would raise. aot_eager runs AOTAutograd (the joint
    forward/backward graph, traced through the Meta/fake and autograd registrations) without
    code generation, so the kernels that run are the same as in eager: the same bits."""
    torch._dynamo.reset()
    model = _model_for(ROUTES[route])
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for shape in ((8, 40), (13, 40)):  # a second shape: recompiled, or reused symbolically
        x, bias = bias_inputs(shape, torch.float32, device)
        x.requires_grad_()
        bias.requires_grad_()
        out = compiled(x, bias)
        expected = model(x, bias)
        assert torch.equal(out, expected)
        grads = torch.autograd.grad(out.sum(), (x, bias))
        expected_grads = torch.autograd.grad(expected.sum(), (x, bias))
        for g, e in zip(grads, expected_grads):
            assert torch.equal(g, e)
    torch._dynamo.reset()


@pytest.mark.parametrize("route", DISPATCHER_ROUTES)
def test_compile_inductor(route, device):
    """The default backend: Inductor generates code around the op and calls the kernel as an
    extern kernel. x * 1.5 may be fused differently from eager's: compare with tolerances."""
    torch._dynamo.reset()
    model = _model_for(ROUTES[route])
    x, bias = bias_inputs((8, 40), torch.float32, device)
    torch.testing.assert_close(torch.compile(model, fullgraph=True)(x, bias), model(x, bias))
    torch._dynamo.reset()


def test_compile_fullgraph_fails_for_pybind():
    torch._dynamo.reset()
    x, bias = bias_inputs((8, 40), torch.float32, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(torch._dynamo.exc.Unsupported, match="skipped"):
            torch.compile(_model_for(ROUTES["pybind11"]), backend="eager", fullgraph=True)(x, bias)
        # Without fullgraph it still runs, correctly: eager in between the two graphs.
        torch._dynamo.reset()
        out = torch.compile(_model_for(ROUTES["pybind11"]), backend="eager")(x, bias)
    torch.testing.assert_close(out, _model_for(ROUTES["pybind11"])(x, bias))
    torch._dynamo.reset()


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, bias):
        return self.fn(x, bias, SCALE)


@pytest.mark.parametrize("route", DISPATCHER_ROUTES)
def test_export(route, device):
    """torch.export keeps the op as one node of the exported graph, with a symbolic row count,
    and the exported program runs at a row count it was not traced with."""
    x, bias = bias_inputs((8, 40), torch.float32, device)
    rows = torch.export.Dim("rows")
    program = torch.export.export(_Wrap(ROUTES[route]), (x, bias), dynamic_shapes={"x": {0: rows}, "bias": None})
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    namespace = "custom_ops_py" if route == "custom_op" else "custom_ops"
    assert targets == [f"{namespace}.fused_op.default"], targets
    x2, _ = bias_inputs((21, 40), torch.float32, device)
    assert torch.equal(program.module()(x2, bias), ROUTES[route](x2, bias, SCALE))


def test_export_fails_for_pybind():
    """torch.export traces with fake tensors, which route 1 cannot take (test_fake_tensors)."""
    x, bias = bias_inputs((8, 40), torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="fused_op: input is a tensor without data"):
        torch.export.export(_Wrap(ROUTES["pybind11"]), (x, bias), strict=False)


def test_layer_compiles_in_a_network(device):
    """FusedOpLayer inside nn.Sequential compiles whole (fullgraph) and trains like eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 16), custom_ops.FusedOpLayer(16, scale=2.0),
                                torch.nn.Linear(16, 3)).to(device)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(5, 24, device=device)
    out = compiled(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    out.sum().backward()
    assert model[1].bias.grad is not None and model[1].bias.grad.shape == (16,)
    torch._dynamo.reset()


def test_layer_module_api():
    layer = custom_ops.FusedOpLayer(7, scale=3)
    assert layer.scale == 3.0 and torch.equal(layer.bias.detach(), torch.zeros(7))
    assert [name for name, _ in layer.named_parameters()] == ["bias"]
    assert "features=7, scale=3.0" in repr(layer)
    layer = layer.double()
    x = torch.randn(2, 7, dtype=torch.float64)
    torch.testing.assert_close(layer(x), torch.relu(x * 3.0))


# ---------------------------------------------------------------------------------------------
# 6. CUDA only: streams, graph capture, several GPUs, the sanitizer's small run
# ---------------------------------------------------------------------------------------------
def _every_op(x, bias, dy, long):
    """Every kernel once; `long` is long enough for reduce_sum's two-stage path."""
    outs = [fn(x, bias, SCALE) for fn in ROUTES.values()]
    for backward in BACKWARDS.values():
        outs += list(backward(dy, outs[0], SCALE))
    outs += [fn(x) for fn in RELU_ROUTES.values()]
    outs.append(OPS.custom_relu_backward(dy, outs[-1]))
    outs += [fn(x) for fn in SUM_ROUTES.values()]
    outs.append(custom_ops.reduce_sum(long))
    return outs


@pytest.mark.cuda
def test_cuda_graph_capture():
    """Every kernel launches on the current stream, and the launchers never allocate (scratch
    comes from PyTorch's caching allocator, which capture supports): a CUDA graph captures all
    of them, and a replay on new inputs matches eager."""
    require_cuda()
    x, bias = bias_inputs((257, 129), torch.float32, "cuda")
    dy = torch.randn(257, 129, device="cuda")
    long = torch.randn(300_007, device="cuda")
    static = [t.clone() for t in (x, bias, dy, long)]
    _every_op(*static)  # warm-up: lazy initialisation happens outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outs = _every_op(*static)
    # New inputs copied into the captured buffers; the replay must compute on them.
    x2, bias2 = bias_inputs((257, 129), torch.float32, "cuda")
    fresh = [x2, bias2, torch.randn_like(dy), torch.randn_like(long)]
    for buffer, value in zip(static, fresh):
        buffer.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    # The kernels are deterministic: a replay gives eager's bits.
    for got, want in zip(static_outs, _every_op(*fresh)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.cuda
def test_side_stream():
    """Work queued on a side stream is ordered on it: the result is right when read after that
    stream (and only that stream) is synchronized."""
    require_cuda()
    x, bias = bias_inputs((1823, 781), torch.float32, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        outs = {name: fn(x, bias, SCALE) for name, fn in ROUTES.items()}
        total = custom_ops.reduce_sum(x)
    stream.synchronize()
    expected = reference(x, bias)
    for name, out in outs.items():
        assert_within(out, expected, forward_bound(expected, torch.float32, x), name)
    torch.testing.assert_close(total.double(), x.double().sum(), rtol=1e-5, atol=1e-2)


@pytest.mark.cuda
def test_second_gpu():
    """The device guard: tensors on cuda:1 run on cuda:1 whatever the current device is."""
    require_cuda()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    x, bias = bias_inputs((33, 65), torch.float32, "cuda:1")
    with torch.cuda.device(0):
        for fn in ROUTES.values():
            out = fn(x, bias, SCALE)
            assert out.device == x.device
            expected = reference(x, bias)
            assert_within(out, expected, forward_bound(expected, torch.float32, x))
        torch.testing.assert_close(custom_ops.reduce_sum(x).double(), x.double().sum(), rtol=1e-5, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_sanitizer_small(dtype):
    """The small run the GPU pass puts under compute-sanitizer (memcheck, racecheck,
    synccheck, initcheck): every kernel on small, irregular shapes, both reduce_sum paths."""
    require_cuda()
    for shape in ((1, 1), (3, 33), (37, 65), (5, 72), (300, 16)):  # the last two: 16-byte accesses
        x, bias = bias_inputs(shape, dtype, "cuda")
        dy = torch.randn(shape, device="cuda").to(dtype)
        outs = [fn(x, bias, SCALE) for fn in ROUTES.values()]
        dx, dbias = OPS.fused_op_backward(dy, outs[1], SCALE)
        y = custom_ops.custom_relu(x)
        OPS.custom_relu_backward(dy, y)
        expected = reference(x, bias)
        assert_within(outs[1], expected, forward_bound(expected, dtype, x))
    for n in (0, 5, 4097, 70_001):
        x = torch.randn(n, device="cuda").to(dtype)
        torch.testing.assert_close(custom_ops.reduce_sum(x).double(), x.double().sum(), rtol=2e-2, atol=2e-1)
    torch.cuda.synchronize()


# A tensor where a number goes and the other way round. The public API checks in Python; the
# pybind11 functions have an overload for it (custom_ops.cpp), so that the TypeError names the
# function and the argument and describes a tensor by its dtype and shape, never its values.
MISPLACED = {
    "fused_op_forward(x, bias, x)": (lambda x, b: custom_ops.fused_op_forward(x, b, x),
                                     r"^fused_op_forward: scale must be a number \(float\), got a tensor of dtype "
                                     r"float32 and shape \[64, 40\] on \w+(:\d+)? \(the arguments, in order: input, bias, scale\)$"),
    "custom_relu(2.0)": (lambda x, b: custom_ops.custom_relu(2.0), r"^custom_relu: x must be a tensor, got a float"),
    "reduce_sum([x])": (lambda x, b: custom_ops.reduce_sum([x]), r"^reduce_sum: x must be a tensor, got a list"),
    "FusedOpLayer(40, x)": (lambda x, b: custom_ops.FusedOpLayer(40, x), r"^FusedOpLayer: scale must be a number"),
    "pybind11 fused_op_forward(x, bias, x)": (lambda x, b: _C.fused_op_forward(x, b, x),
                                              r"^fused_op_forward: scale must be a number \(float\), got a tensor of "
                                              r"dtype Float and shape \[64, 40\] on \w+(:\d+)? \(the arguments, in order: "
                                              r"input, bias, scale\)$"),
    "pybind11 fused_op_forward(x, 2.0, bias)": (lambda x, b: _C.fused_op_forward(x, 2.0, b),
                                                r"^fused_op_forward: bias must be a tensor, got a float"),
    "pybind11 custom_relu('x')": (lambda x, b: _C.custom_relu("x"), r"^custom_relu: x must be a tensor, got a str"),
    "pybind11 reduce_sum(1)": (lambda x, b: _C.reduce_sum(1), r"^reduce_sum: x must be a tensor, got an int"),
    "pybind11 fused_op_raw(x, bias, None)": (lambda x, b: _C.fused_op_raw(x, b, None),
                                             r"^fused_op_raw: scale must be a number \(float\), got a NoneType"),
    "pybind11 fused_op_backward_raw(x, 1.0, 1.0)": (lambda x, b: _C.fused_op_backward_raw(x, 1.0, 1.0),
                                                    r"^fused_op_backward_raw: output must be a tensor, got a float"),
}


@pytest.mark.parametrize("call", list(MISPLACED))
def test_misplaced_arguments_raise_type_error(call, device):
    assert_misplaced(*MISPLACED[call], torch.randn(64, 40, device=device), torch.randn(40, device=device))


def test_pybind11_takes_what_converts_to_a_float(device):
    # The misuse overload runs only after the typed function failed with conversions too: an
    # int, a NumPy float or a one-element tensor still reaches the kernel as the scale.
    import numpy as np
    x, bias = torch.randn(8, 40, device=device), torch.randn(40, device=device)
    expected = _C.fused_op_forward(x, bias, 2.0)
    for scale in (2, np.float32(2.0), torch.tensor(2.0)):
        assert torch.equal(_C.fused_op_forward(x, bias, scale), expected), type(scale)
    assert torch.equal(_C.fused_op_forward(input=x, bias=bias, scale=2), expected)
