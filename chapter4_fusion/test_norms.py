"""Tests for chapter 4's norms: layer_norm, rms_norm, fused_add_rms_norm, forward and backward,
every rung x dtype x hidden size (1, 3, 777, 1000, 5123, 65536), CPU and CUDA.

References are computed in float64 by PyTorch (F.layer_norm, F.rms_norm and autograd through
them) from the same inputs, and compared with tolerances per dtype written next to them.
dweight and dbias must be bitwise equal run to run (no float atomics anywhere).

Run against the installed extension (pip install .) or the JIT build (COURSE_EXT_ROUTE=jit);
the header line says which one was loaded.
"""
import re

import pytest
import torch
import torch.nn.functional as F

import fusion
from coursekit.pytest_plugin import (DTYPES, assert_misplaced, capture_and_replay, dtype_id, launched_kernels,
                                     poison_allocator, require_cuda)

VERSIONS = fusion.VERSIONS
NORM_OPS = ("layer_norm", "rms_norm")
HIDDEN = (1, 3, 777, 1000, 5123, 12288, 16001, 65536)  # 12288, 16001: the 1024-thread backward rows
OPS = torch.ops.fusion


# ---------------------------------------------------------------------------------------------
# Helpers and references
# ---------------------------------------------------------------------------------------------
# Forward tolerances (rtol, atol) against the float64 reference of the same inputs. The output
# is rounded once to its dtype: rtol is one rounding with a 2x margin (float16 eps/2 = 4.9e-4,
# bfloat16 3.9e-3). The statistics are float32 sums of up to 65536 terms (float64 for float64):
# their relative error, a random walk of roundings, stays below ~1e-5, which atol covers for
# values of magnitude |xhat * w + b| ~ 1-5; and atol also absorbs one rounding of values near
# zero. A wrong mean, variance, weight index or a missed element errs by O(1).
FORWARD_TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (1e-3, 4e-3), torch.bfloat16: (8e-3, 3e-2),
               torch.float64: (1e-10, 1e-10)}
# Gradient tolerances, relative to the largest reference gradient of the tensor: the inputs of
# the backward (x, dy, weight) are rounded to the dtype, and dx is rounded once at the end;
# dweight sums rows in float32. A few ulps of the dtype in all, times a margin.
GRAD_TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float64: 1e-10}


def make_inputs(shape, dtype, device, residual=False):
    n = shape[-1]
    x = (torch.randn(shape, dtype=torch.float64) * 2 + 0.5).to(dtype).to(device)
    w = (torch.rand(n, dtype=torch.float64) * 2 - 0.5).to(dtype).to(device)
    b = torch.randn(n, dtype=torch.float64).to(dtype).to(device)
    r = torch.randn(shape, dtype=torch.float64).to(dtype).to(device) if residual else None
    return x, w, b, r


def reference(op, x, w, b, eps):
    n = x.shape[-1]
    if op == "layer_norm":
        return F.layer_norm(x.double(), (n,), w.double(), b.double(), eps)
    return F.rms_norm(x.double(), (n,), w.double(), eps)


def run(op, x, w, b, eps, version):
    if op == "layer_norm":
        return fusion.layer_norm(x, w, b, eps, version=version)
    return fusion.rms_norm(x, w, eps, version=version)


def default_eps(op):
    return 1e-5 if op == "layer_norm" else 1e-6


def assert_forward(out, ref, dtype, what=""):
    rtol, atol = FORWARD_TOL[dtype]
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_grad(out, ref, dtype, what=""):
    assert out.dtype == dtype and out.shape == ref.shape, (what, out.dtype, out.shape, ref.shape)
    # (at least 1: a gradient that is 0 in exact arithmetic, such as LayerNorm's dx at n = 1,
    # comes out as rounding noise of the terms it cancels, which are O(1))
    scale = max(ref.abs().max().item(), 1.0) if ref.numel() else 1.0
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=GRAD_TOL[dtype] * scale,
                               msg=lambda m: f"{what}: {m}")


def rows_for(n):
    return 2 if n >= 65536 else 5


# ---------------------------------------------------------------------------------------------
# 1. Forward: every rung x dtype x hidden size
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", (*VERSIONS["layer_norm"], None), ids=str)
@pytest.mark.parametrize("op", NORM_OPS)
def test_forward_matches_reference(op, version, dtype, n, device):
    """On the CPU every rung runs the same loop (norm_cpu.cpp never reads the version; the glue
    only parses it): there the rungs are checked at the sizes up to 5123, and version=None at
    every size."""
    if device == "cpu" and version is not None and n > 5123:
        pytest.skip("the CPU path ignores the rung: version=None covers this size")
    x, w, b, _ = make_inputs((rows_for(n), n), dtype, device)
    eps = default_eps(op)
    ref = reference(op, x, w, b, eps)
    poison_allocator(ref.to(dtype))
    assert_forward(run(op, x, w, b, eps, version), ref, dtype, f"{op} {version} n={n}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", (*VERSIONS["layer_norm"], None), ids=str)
@pytest.mark.parametrize("op", NORM_OPS)
def test_forward_statistics(op, version, dtype, device):
    """mean and rstd as PyTorch saves them: shape x.shape[:-1], float32 (float64 for float64)."""
    x, w, b, _ = make_inputs((3, 4, 1000), dtype, device)
    x64 = x.double()
    if op == "layer_norm":
        y, mean, rstd = fusion.layer_norm_forward(x, w, b, 1e-5, version=version)
        var, mu = torch.var_mean(x64, -1, correction=0)
        torch.testing.assert_close(mean.double(), mu, rtol=1e-5, atol=1e-5)
    else:
        y, rstd = fusion.rms_norm_forward(x, w, 1e-6, version=version)
        var = x64.pow(2).mean(-1)
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    assert rstd.dtype == stat and rstd.shape == (3, 4)
    torch.testing.assert_close(rstd.double(), (var + default_eps(op)).rsqrt(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("shape", [(7,), (2, 3, 257), (1, 1, 1, 33)], ids=str)
@pytest.mark.parametrize("version", (*VERSIONS["layer_norm"], None), ids=str)
@pytest.mark.parametrize("op", NORM_OPS)
def test_forward_any_rank(op, version, shape, device):
    x, w, b, _ = make_inputs(shape, torch.float32, device)
    assert_forward(run(op, x, w, b, 1e-5, version), reference(op, x, w, b, 1e-5), torch.float32)


VIEWS = {
    "transposed": lambda t: t.t(),  # (n, rows) -> last dim strided
    "misaligned": lambda t: t.flatten()[1:1 + 5 * 1000].view(5, 1000),  # rows 1 element off 16 B
    "sliced": lambda t: t[:, :1000],
}


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
@pytest.mark.parametrize("version", (*VERSIONS["layer_norm"], None), ids=str)
@pytest.mark.parametrize("op", NORM_OPS)
def test_forward_views(op, version, dtype, view, device):
    base = (torch.randn(1000 if view == "transposed" else 6, 1000 if view == "transposed" else 1003,
                        dtype=torch.float64) * 2).to(dtype).to(device)
    x = VIEWS[view](base)
    assert not x.is_contiguous() or x.data_ptr() % 16 != 0
    _, w, b, _ = make_inputs((1, x.shape[-1]), dtype, device)
    assert_forward(run(op, x, w, b, 1e-5, version), reference(op, x, w, b, 1e-5), dtype, view)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("given", ("weight", "bias", "neither"))
@pytest.mark.parametrize("op", NORM_OPS)
def test_weight_and_bias_may_be_none(op, given, dtype, device):
    """weight=None and bias=None as F.layer_norm and F.rms_norm take them: no scale, no shift;
    the gradients of x and of the parameters given flow, none are made up for the others."""
    if op == "rms_norm" and given == "bias":
        pytest.skip("rms_norm has no bias")
    x, w, b, _ = make_inputs((5, 777), dtype, device)
    w = w if given == "weight" else None
    b = b if given == "bias" else None
    xg = x.detach().requires_grad_()
    params = [p.detach().requires_grad_() if p is not None else None for p in (w, b)]
    n, eps = x.shape[-1], default_eps(op)
    if op == "layer_norm":
        out = fusion.layer_norm(xg, params[0], params[1], eps)
        x64 = xg.detach().double().requires_grad_()
        p64 = [p.detach().double().requires_grad_() if p is not None else None for p in params]
        ref = F.layer_norm(x64, (n,), p64[0], p64[1], eps)
    else:
        out = fusion.rms_norm(xg, params[0], eps)
        x64 = xg.detach().double().requires_grad_()
        p64 = [p.detach().double().requires_grad_() if p is not None else None for p in params]
        ref = F.rms_norm(x64, (n,), p64[0], eps)
    assert_forward(out, ref.detach(), dtype, f"{op} with {given}")
    dy = torch.randn_like(ref)
    out.backward(dy.to(dtype))
    ref.backward(dy)
    assert_grad(xg.grad, x64.grad, dtype, f"{op} dx with {given}")
    for p, q in zip(params, p64):
        if p is not None:
            assert_grad(p.grad, q.grad, dtype, f"{op} dparam with {given}")
    if op == "rms_norm":
        h, s = fusion.fused_add_rms_norm(x, x, None, eps)
        ref = F.rms_norm((x.double() + x.double()).to(dtype).double(), (n,), None, eps)
        assert_forward(h, ref, dtype, "fused_add_rms_norm without weight")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
@pytest.mark.parametrize("version", (*VERSIONS["rms_norm"], None), ids=str)
def test_rms_norm_of_a_row_with_inf_follows_torch(version, dtype, device):
    """A row holding inf: mean(x^2) is inf, rstd 0, so y is NaN where the inf is (inf * 0) and
    0 elsewhere, as F.rms_norm gives on the CPU; a finite row beside it is untouched. The reference
    is the CPU's on every device: PyTorch's CUDA kernel answers NaN across the whole row (the
    lesson says why the course keeps the CPU's answer)."""
    x = torch.randn(3, 777, dtype=dtype, device=device)
    x[0, 5] = float("inf")
    x[1, 700] = -float("inf")
    w = torch.randn(777, dtype=dtype, device=device)
    out = fusion.rms_norm(x, w, 1e-6, version=version).cpu()
    ref = F.rms_norm(x.cpu().float(), (777,), w.cpu().float(), 1e-6)
    assert torch.equal(out[:2].float().isnan(), ref[:2].isnan())
    assert torch.equal(out[:2].float().nan_to_num(), ref[:2].nan_to_num())
    assert_forward(out[2:], F.rms_norm(x[2:].cpu().double(), (777,), w.cpu().double(), 1e-6), dtype, "finite row")


def test_eps_is_used(device):
    """A constant row has variance 0: y = bias exactly when eps is large enough to matter."""
    x = torch.full((3, 64), 2.5, device=device)
    w, b = torch.ones(64, device=device), torch.randn(64, device=device)
    for version in (*VERSIONS["layer_norm"], None):
        torch.testing.assert_close(fusion.layer_norm(x, w, b, 1e-5, version=version), b.expand(3, 64))
        y = fusion.rms_norm(x, w, 100.0, version=version)
        torch.testing.assert_close(y, torch.full_like(x, 2.5 / (2.5**2 + 100.0) ** 0.5))


# ---------------------------------------------------------------------------------------------
# 2. fused_add_rms_norm
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", (*VERSIONS["fused_add_rms_norm"], None), ids=str)
def test_fused_add_rms_norm_matches_reference(version, dtype, n, device):
    x, w, _, r = make_inputs((rows_for(n), n), dtype, device, residual=True)
    # The sum is x + residual computed in the accumulation type and rounded once: exact.
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    h_ref = (x.to(acc) + r.to(acc)).to(dtype)
    y, h = fusion.fused_add_rms_norm(x, r, w, 1e-6, version=version)
    assert torch.equal(h, h_ref)
    assert_forward(y, F.rms_norm(h_ref.double(), (n,), w.double(), 1e-6), dtype, f"n={n}")


# ---------------------------------------------------------------------------------------------
# 3. Backward kernels: every rung x dtype x hidden size, against float64 autograd
# ---------------------------------------------------------------------------------------------
def reference_grads(op, x, w, b, dy, eps):
    x64, w64 = (t.detach().double().clone().requires_grad_() for t in (x, w))
    b64 = b.detach().double().clone().requires_grad_() if b is not None else None
    y = (F.layer_norm(x64, (x.shape[-1],), w64, b64, eps) if op == "layer_norm"
         else F.rms_norm(x64, (x.shape[-1],), w64, eps))
    inputs = (x64, w64, b64) if op == "layer_norm" else (x64, w64)
    return torch.autograd.grad(y, inputs, dy.double())


def kernel_grads(op, x, w, b, dy, eps, version):
    if op == "layer_norm":
        _, mean, rstd = fusion.layer_norm_forward(x, w, b, eps)
        return fusion.layer_norm_backward(dy, x, w, mean, rstd, version=version)
    _, rstd = fusion.rms_norm_forward(x, w, eps)
    return fusion.rms_norm_backward(dy, x, w, rstd, version=version)


@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", (*VERSIONS["layer_norm_backward"], None), ids=str)
@pytest.mark.parametrize("op", NORM_OPS)
def test_backward_matches_reference(op, version, dtype, n, device):
    """On the CPU, the rungs at the sizes up to 5123 and version=None at every size, as in
    test_forward_matches_reference (norm_cpu.cpp never reads the version)."""
    if device == "cpu" and version is not None and n > 5123:
        pytest.skip("the CPU path ignores the rung: version=None covers this size")
    rows = 3 if n >= 65536 else 37  # 37 rows: several per block, one block partly padding
    x, w, b, _ = make_inputs((rows, n), dtype, device)
    dy = torch.randn(rows, n, dtype=torch.float64).to(dtype).to(device)
    eps = default_eps(op)
    refs = reference_grads(op, x, w, b, dy, eps)
    outs = kernel_grads(op, x, w, b, dy, eps, version)
    for name, out, ref in zip(("dx", "dweight", "dbias"), outs, refs):
        assert_grad(out, ref, dtype, f"{op} {version} n={n} {name}")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=dtype_id)
@pytest.mark.parametrize("shape", [(64, 1000), (3, 5, 257), (2, 20000)], ids=str)
def test_low_precision_gradients_through_autograd(shape, dtype, device):
    """The whole path: autograd Function -> default backward rung -> column sums."""
    x, w, b, r = make_inputs(shape, dtype, device, residual=True)
    dy = torch.randn(shape, dtype=torch.float64).to(dtype).to(device)
    check_grads_through_autograd(x, w, b, dy, dtype, "")
    # fused_add_rms_norm: h's gradient is rms_norm's dx plus what reaches h directly.
    xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
    dh_direct = torch.randn(shape, dtype=torch.float64).to(dtype).to(device)
    y, h = fusion.fused_add_rms_norm(xs, rs, ws)
    gx, gr, gw = torch.autograd.grad((y, h), (xs, rs, ws), (dy, dh_direct))
    acc = torch.float32
    h_ref = (x.to(acc) + r.to(acc)).to(dtype)
    dh, dw = reference_grads("rms_norm", h_ref, w, None, dy, 1e-6)
    assert_grad(gx, dh + dh_direct.double(), dtype, "fused dx")
    assert torch.equal(gx, gr)
    assert_grad(gw, dw, dtype, "fused dweight")


def fused_add_reference(x, r, w, dy, dsum):
    """fused_add_rms_norm's gradients in float64: dh = rms_norm's dx + dsum (what reaches h = x +
    residual directly), dweight rms_norm's; h is the sum the forward rounds to the dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = (x.to(acc) + r.to(acc)).to(x.dtype)
    dh, dw = reference_grads("rms_norm", h, w, None, dy, 1e-6)
    return h, dh + dsum.double(), dw


@pytest.mark.parametrize("n", (1, 777, 12288, 20000))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", (*VERSIONS["rms_norm_backward"], None), ids=str)
def test_rms_norm_backward_adds_dsum(version, dtype, n, device):
    """rms_norm_backward(dsum=...) adds dsum to dx in the kernel's own pass (fused_add_rms_norm's
    backward): every rung, against the float64 reference of dx + dsum. 1: a warp row of one
    element; 777: single elements at a mid-vector row's ends; 12288: the 1024-thread rows with
    their sums in shared memory; 20000: past the registers (streamed) in every dtype."""
    rows = 3 if n >= 12288 else 37
    x, w, _, r = make_inputs((rows, n), dtype, device, residual=True)
    dy, dsum = (torch.randn(rows, n, dtype=torch.float64).to(dtype).to(device) for _ in range(2))
    h, dh_ref, dw_ref = fused_add_reference(x, r, w, dy, dsum)
    _, rstd = fusion.rms_norm_forward(h, w, 1e-6)
    dh, dw = fusion.rms_norm_backward(dy, h, w, rstd, version=version, dsum=dsum)
    assert_grad(dh, dh_ref, dtype, f"{version} n={n} dx + dsum")
    assert_grad(dw, dw_ref, dtype, f"{version} n={n} dweight")


@pytest.mark.parametrize("used", ("both", "y", "h"))
def test_fused_add_rms_norm_gradients_of_either_output(used, device):
    """Autograd hands the backward an undefined gradient for an output nobody used (the Function
    does not materialize zeros): y alone, h alone, or both, each against the reference."""
    x, w, _, r = make_inputs((9, 777), torch.float32, device, residual=True)
    dy, dsum = (torch.randn(9, 777, dtype=torch.float64).to(device).float() for _ in range(2))
    xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
    y, h = fusion.fused_add_rms_norm(xs, rs, ws)
    outs, grads = {"both": ((y, h), (dy, dsum)), "y": ((y,), (dy,)), "h": ((h,), (dsum,))}[used]
    gx, gr, gw = torch.autograd.grad(outs, (xs, rs, ws), grads, allow_unused=True)
    zeros = torch.zeros_like(dy)
    _, dh_ref, dw_ref = fused_add_reference(x, r, w, dy if used != "h" else zeros, dsum if used != "y" else zeros)
    assert_grad(gx, dh_ref, torch.float32, f"{used}: dx")
    assert torch.equal(gx, gr)
    assert_grad(gw, dw_ref, torch.float32, f"{used}: dweight")


def dispatched_ops(call):
    """The ops call() dispatches, by name ("fusion.rms_norm_backward", "aten.zeros_like", ...), in
    order: what a backward through autograd really launches, read off the dispatcher."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Log() as log:
        call()
    return log.ops


def test_fused_add_rms_norm_backward_is_one_op(device):
    """The gradient of h is added inside rms_norm_backward (dsum), not by an add after it: the
    backward through autograd calls fusion::rms_norm_backward and no elementwise add, and never
    fills a tensor of zeros for a gradient."""
    x, w, _, r = make_inputs((5, 64), torch.float32, device, residual=True)
    xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
    y, h = fusion.fused_add_rms_norm(xs, rs, ws)
    ops = dispatched_ops(lambda: torch.autograd.grad((y, h), (xs, rs, ws), (torch.randn_like(y), torch.randn_like(h))))
    assert "fusion.rms_norm_backward" in ops, ops
    assert not [o for o in ops if o in ("aten.add", "aten.add_", "aten.zeros_like", "aten.fill_", "aten.zero_")], ops


@pytest.mark.parametrize("op", ("layer_norm", "rms_norm"))
def test_norm_backward_fills_no_zeros(op, device):
    """The statistics the forward returns beside y (mean and rstd, rstd) take no gradient, and
    the Function does not materialize zeros for them: the backward through autograd calls the op's
    backward and nothing that makes or fills a tensor of zeros (a fill kernel a statistic, each a
    launch of its own before the backward's at few rows)."""
    x, w, b, _ = make_inputs((5, 64), torch.float32, device)
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    inputs = (xs, ws, bs) if op == "layer_norm" else (xs, ws)
    y = fusion.layer_norm(xs, ws, bs) if op == "layer_norm" else fusion.rms_norm(xs, ws)
    ops = dispatched_ops(lambda: torch.autograd.grad(y, inputs, torch.randn_like(y)))
    assert f"fusion.{op}_backward" in ops, ops
    zeros = ("aten.zeros", "aten.zeros_like", "aten.new_zeros", "aten.fill_", "aten.zero_")
    assert not [o for o in ops if o in zeros], ops


# Rows and widths at the edges of the row shapes and of the launches (norm.h): one row, a warp's
# worth of 64 rows and either side of it, many rows with a ragged last block; widths of one
# element, fewer than a vector, mid-vector rows (777, 4099) and the longest model rows.
EDGE_ROWS = (1, 63, 64, 65, 2047, 8193)
EDGE_WIDTHS = (1, 7, 777, 4099, 12288, 16384)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=dtype_id)
def test_model_shape_edges(dtype):
    """The forward's row kernels (weight held in one-wave grids, the few-rows shapes at one block
    an SM, register-capped or plain past them: test_forward_variant_rule) and fused_add_rms_norm's
    backward with dsum in the kernel, through autograd, at every edge row count x width, against
    float64. The rows of one block (4099 and
    longer) at 1, 65 and 2047 rows only: 63 and 64 rows run their paths as 65 does, and 8193
    rows as 2047 (the rows a block take the edges at the warp rows, which keep every count)."""
    require_cuda()
    for rows in EDGE_ROWS:
        for n in EDGE_WIDTHS:
            if n >= 4099 and rows not in (1, 65, 2047):
                continue
            where = f"{rows}x{n}"
            x, w, b, r = make_inputs((rows, n), dtype, "cuda", residual=True)
            for op in NORM_OPS:
                eps = default_eps(op)
                assert_forward(run(op, x, w, b, eps, None), reference(op, x, w, b, eps), dtype, f"{op} {where}")
            dy, dsum = (torch.randn(rows, n, device="cuda").to(dtype) for _ in range(2))
            xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
            y, h = fusion.fused_add_rms_norm(xs, rs, ws)
            h_ref, dh_ref, dw_ref = fused_add_reference(x, r, w, dy, dsum)
            assert torch.equal(h, h_ref), where
            assert_forward(y, F.rms_norm(h_ref.double(), (n,), w.double(), 1e-6), dtype, f"fused {where}")
            gx, gr, gw = torch.autograd.grad((y, h), (xs, rs, ws), (dy, dsum))
            assert_grad(gx, dh_ref, dtype, f"fused {where} dx")
            assert torch.equal(gx, gr), where
            assert_grad(gw, dw_ref, dtype, f"fused {where} dweight")
            del x, r, dy, dsum, xs, rs, y, h, h_ref, dh_ref, gx, gr


# The third-from-last template argument of norm_resident, course::rows::ParamLoad as the profiler
# spells an enum argument (its number, or its name), and the row shape before the Access.
PARAM_LOADS = {"0": "late", "1": "prefetch", "2": "held", "kLate": "late", "kPrefetch": "prefetch", "kHeld": "held"}
RESIDENT_KERNEL = re.compile(r"norm_resident<[^,]+, (?:true|false), (?:true|false), (\d+), (\d+), [^,]+, "
                             r"\(?(?:fusion::norm::)?ParamLoad(?:\)|::)(\w+), (\d+)>")


def resident_kernel(call):
    """call()'s output and the one norm_resident kernel it launched: (threads, vectors, where
    weight came from, the minimum blocks of its bounds)."""
    out, kernels = launched_kernels(call, "norm_resident")
    found = [RESIDENT_KERNEL.search(k) for k in kernels]
    assert len(found) == 1 and found[0], kernels
    threads, vectors, load, min_blocks = found[0].groups()
    return out, (int(threads), int(vectors), PARAM_LOADS[load], int(min_blocks))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=dtype_id)
def test_forward_variants(dtype, monkeypatch):
    """The forward's resident kernels where the rule puts them (test_forward_variant_rule): rows
    of the 512-thread shape (full, and one vector into it) at one block an SM (the few-rows shape,
    weight held) and at four blocks an SM and one more (past any held kernel's wave: weight loaded
    late; capped where nvcc's count leaves one block an SM); the 1024-thread rows of 4 vectors at
    one block an SM (prefetched); every op against float64; which kernel ran, read off its
    template arguments (the profiler: bfloat16 only, the rule is the same)."""
    require_cuda()
    # The resident rung's shapes and variants: under COURSE_NORM_FORWARD_RULE=old, which holds every
    # LayerNorm row too (the rows the default streams: test_forward_stream_rule_launches).
    monkeypatch.setenv("COURSE_NORM_FORWARD_RULE", "old")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    vector = 16 // torch.empty((), dtype=dtype).element_size()
    cases = [(rows, n) for rows in (sms, 4 * sms + 1) for n in (512 * 4 * vector, 256 * 4 * vector + vector)]
    cases.append((sms, 1024 * 4 * vector))
    for rows, n in cases:
        where = f"{rows}x{n}"
        x, w, b, r = make_inputs((rows, n), dtype, "cuda", residual=True)
        calls = {op: (lambda op=op: run(op, x, w, b, default_eps(op), None)) for op in NORM_OPS}
        calls["fused_add_rms_norm"] = lambda: fusion.fused_add_rms_norm(x, r, w)
        for op, call in calls.items():
            if dtype == torch.bfloat16:
                out, (threads, vectors, load, _) = resident_kernel(call)
                assert [threads, vectors] == OPS.norm_forward_shape(x, sms), (op, where)
                if n == 1024 * 4 * vector:
                    assert load == "prefetch", (op, where, load)
                else:
                    assert load == ("held" if rows == sms else "late"), (op, where, load)
            else:
                out = call()
            if op == "fused_add_rms_norm":
                h_ref = fused_add_reference(x, r, w, torch.zeros_like(x), torch.zeros_like(x))[0]
                assert torch.equal(out[1], h_ref), (op, where)
                assert_forward(out[0], F.rms_norm(h_ref.double(), (n,), w.double(), 1e-6), dtype, f"{op} {where}")
            else:
                assert_forward(out, reference(op, x, w, b, default_eps(op)), dtype, f"{op} {where}")
        del x, r


# The forward's streamed LayerNorm rows (norm.h's forward_streams) at sm_90a, as nvcc 13.0 builds
# the kernels (ptxas -v; NOTES.md, "The norm forward by bytes in flight"): (dtype, n, op, streamed).
# bfloat16 12288: 384 x 4 at 78 registers, 2 rows an SM, 48 KB; 4099: 160 x 4 and the edge slot at
# 84, 4 rows, 32 KB; 16384: 512 x 4 at 62, 2 rows, 64 KB; 5120: 160 x 4 at 62, 6 rows, 60 KB.
# float32 4099: 320 x 4 and the edge slot at 64, 3 rows, 48 KB; 5120: 320 x 4 at 58, 3 rows, 60 KB.
# v1's LayerNorm kernel: 6 blocks an SM (34 and 48 registers), 8 where it reads single elements.
STREAM_CASES = ((torch.bfloat16, 12288, "layer_norm", True), (torch.bfloat16, 4099, "layer_norm", True),
                (torch.bfloat16, 16384, "layer_norm", False), (torch.bfloat16, 5120, "layer_norm", False),
                (torch.bfloat16, 12288, "rms_norm", False), (torch.float32, 4099, "layer_norm", True),
                (torch.float32, 5120, "layer_norm", False), (torch.float32, 12288, "layer_norm", True))


@pytest.mark.cuda
def test_forward_stream_rule_launches(monkeypatch):
    """The forward's kernel where forward_streams decides (STREAM_CASES), read off the profiler: v1's
    norm_two_pass where it streams, norm_resident where it holds, at 8 rows an SM and one more; at
    the held rows of every SM (2 x SMs at bfloat16 12288) the resident kernel; under
    COURSE_NORM_FORWARD_RULE=old the resident kernel everywhere; any other value fails the launch.
    Every output against float64. The kernel names are checked on sm_90 only (the registers, and
    so the rows an SM, are nvcc's for that target)."""
    require_cuda()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    hopper = torch.cuda.get_device_capability(0)[0] == 9

    def kernel(op, x, w, b, rule):
        if rule is None:
            monkeypatch.delenv("COURSE_NORM_FORWARD_RULE", raising=False)
        else:
            monkeypatch.setenv("COURSE_NORM_FORWARD_RULE", rule)
        out, names = launched_kernels(lambda: run(op, x, w, b, default_eps(op), None), "norm_")
        assert_forward(out, reference(op, x, w, b, default_eps(op)), x.dtype, f"{op} {rule} {tuple(x.shape)}")
        assert len(names) == 1, names
        return "two_pass" if "norm_two_pass" in names[0] else "resident" if "norm_resident" in names[0] else names[0]

    for dtype, n, op, streamed in STREAM_CASES:
        x, w, b, _ = make_inputs((8 * sms + 1, n), dtype, "cuda")
        for rule in (None, "new", "old"):
            got = kernel(op, x, w, b, rule)
            if hopper:
                assert got == ("two_pass" if streamed and rule != "old" else "resident"), (dtype, n, op, rule, got)
        del x
    x, w, b, _ = make_inputs((2 * sms + 1, 12288), torch.bfloat16, "cuda")
    got = kernel("layer_norm", x[:2 * sms], w, b, None), kernel("layer_norm", x, w, b, None)
    if hopper:
        assert got == ("resident", "two_pass"), got
    # The explicit rungs: v1 is v1; v3 takes the same rule as version=None (its rung's kernels).
    _, names = launched_kernels(lambda: fusion.layer_norm(x, w, b, version="v1"), "norm_")
    assert len(names) == 1 and "norm_two_pass" in names[0], names
    for rule in ("wide", "Old"):
        monkeypatch.setenv("COURSE_NORM_FORWARD_RULE", rule)
        with pytest.raises(RuntimeError):
            fusion.layer_norm(x, w, b)
    monkeypatch.delenv("COURSE_NORM_FORWARD_RULE", raising=False)


# Rows and widths at the edges of the few-rows shapes (norm.h's kFewRowsShapes, in 2-byte
# elements): just past a warp row (1032: 129 vectors, 256 threads), 2560 (320 vectors in 512
# threads), 4104 (one vector past 512 threads), 8200 (two vectors a thread), 16384 and 16392 (the
# last 2-vector row, and the 4-vector one, prefetched); 768 (a warp row: never the few-rows shapes)
# and 777, 4099 (not whole vectors: neither). float32 rows of the same widths take other shapes
# (or stream past 16384).
FEW_ROWS_WIDTHS = (768, 777, 1032, 2560, 4099, 4104, 8200, 16384, 16392)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=dtype_id)
def test_few_rows_forward_shapes(dtype, monkeypatch):
    """The forward at few rows (a row a block, at most one block an SM: kFewRowsShapes, weight and
    bias held in registers) at 1, 7, 63, 64 and 65 rows, the SM count and one more (the regular
    shapes again), every op and fused_add_rms_norm against float64, the gradients of x, weight and
    bias through autograd; in bfloat16 (at 64 rows, the SM count and one more), the shape that ran
    is the one norm_forward_shape names."""
    require_cuda()
    # The resident rung's shapes and variants: under COURSE_NORM_FORWARD_RULE=old, which holds every
    # LayerNorm row too (the rows the default streams: test_forward_stream_rule_launches).
    monkeypatch.setenv("COURSE_NORM_FORWARD_RULE", "old")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for rows in (1, 7, 63, 64, 65, sms, sms + 1):
        for n in FEW_ROWS_WIDTHS:
            where = f"{rows}x{n}"
            x, w, b, r = make_inputs((rows, n), dtype, "cuda", residual=True)
            for op in NORM_OPS:
                eps = default_eps(op)
                call = lambda op=op, eps=eps: run(op, x, w, b, eps, None)  # noqa: E731
                if dtype == torch.bfloat16 and rows in (64, sms, sms + 1) and OPS.norm_forward_shape(x, sms):
                    out, (threads, vectors, _, _) = resident_kernel(call)
                    assert [threads, vectors] == OPS.norm_forward_shape(x, sms), (op, where)
                else:
                    out = call()
                assert_forward(out, reference(op, x, w, b, eps), dtype, f"{op} {where}")
            y, h = fusion.fused_add_rms_norm(x, r, w)
            h_ref = fused_add_reference(x, r, w, torch.zeros_like(x), torch.zeros_like(x))[0]
            assert torch.equal(h, h_ref), where
            assert_forward(y, F.rms_norm(h_ref.double(), (n,), w.double(), 1e-6), dtype, f"fused {where}")
            if rows in (7, 64, sms):
                dy = torch.randn(rows, n, device="cuda").to(dtype)
                check_grads_through_autograd(x, w, b, dy, dtype, f"{where} ")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_few_rows_forward_views_and_none(dtype):
    """The few-rows forward where its inputs are not fresh tensors: rows that start mid-vector (an
    offset view: the regular shapes' chunked rows), a view whose rows are aligned but strided in
    a wider buffer (made contiguous by the op), and weight or bias None (ones and zeros, held
    like any weight)."""
    require_cuda()
    n = 2560
    for rows in (1, 64):
        base = torch.randn(rows * n + 1, device="cuda").to(dtype)
        wide = torch.randn(rows, 2 * n, device="cuda").to(dtype)
        _, w, b, _ = make_inputs((1, n), dtype, "cuda")
        for what, x in (("offset", base[1:].view(rows, n)), ("strided", wide[:, :n])):
            for op in NORM_OPS:
                eps = default_eps(op)
                assert_forward(run(op, x, w, b, eps, None), reference(op, x, w, b, eps), dtype, f"{op} {what} {rows}")
        x = make_inputs((rows, n), dtype, "cuda")[0]
        ones, zeros = torch.ones_like(w), torch.zeros_like(b)
        assert_forward(fusion.layer_norm(x, None, None), reference("layer_norm", x, ones, zeros, 1e-5), dtype)
        assert_forward(fusion.layer_norm(x, w, None), reference("layer_norm", x, w, zeros, 1e-5), dtype)
        assert_forward(fusion.rms_norm(x, None), reference("rms_norm", x, ones, zeros, 1e-6), dtype)


# Widths whose rows the regular shapes hold in whole warps that are not powers of two (norm.h's
# kForwardShapes, in 2-byte elements): 2560 (320 vectors in 96 x 4, 64 slots of padding), 5120,
# 6144, 7168 and 12288 (160, 192, 224 and 384 threads, none); 640, 760 and 768 warp rows of 3
# vectors a lane (80, 95 and 96 vectors: the last lanes' third vector past the row, or none), 384
# one of 2; 777 and 4099 not whole vectors (4099: 160 threads and the edge slot). float32 rows of
# the same widths take twice the vectors: 64-448 threads, 1024 at 12288, 32 x 4 at 384 (no warp
# row of 3 vectors in float32: norm.h's forward_shape_in).
WHOLE_WARP_WIDTHS = (384, 640, 760, 768, 2560, 5120, 6144, 7168, 12288, 777, 4099)


def rounded_sum(x, r):
    """fused_add_rms_norm's sum h = x + residual as the kernel rounds it (fused_add_reference's
    h, without its gradients)."""
    return (x.float() + r.float()).to(x.dtype)


@pytest.mark.cuda
def test_forward_shape_knob(monkeypatch):
    """COURSE_NORM_FORWARD_SHAPES (norm_kernels.cu, for benchmarks), read at each launch: "before"
    runs the shapes before the 32 x 3 warp rows (32 x 4 at hidden 768 in bfloat16 and float16),
    "all" (and unset) the rule of norm.h; float32 at 384 is 32 x 4 under both; the same results;
    any other value fails the launch ("warp3" and "wide", names a timing script once used, among them)."""
    require_cuda()
    inputs = {dtype: make_inputs((2048, n), dtype, "cuda", residual=True)
              for dtype, n in ((torch.bfloat16, 768), (torch.float16, 768), (torch.float32, 384))}
    want = {"before": [32, 4], "all": [32, 3], None: [32, 3]}
    for rule, short in want.items():
        if rule is None:
            monkeypatch.delenv("COURSE_NORM_FORWARD_SHAPES", raising=False)
        else:
            monkeypatch.setenv("COURSE_NORM_FORWARD_SHAPES", rule)
        for dtype, (x, w, b, r) in inputs.items():
            expect = short if dtype != torch.float32 else [32, 4]
            n = x.shape[1]
            for op in NORM_OPS:
                eps = default_eps(op)
                out, (threads, vectors, _, _) = resident_kernel(lambda op=op, eps=eps: run(op, x, w, b, eps, None))
                assert [threads, vectors] == expect, (rule, op, dtype, threads, vectors)
                assert_forward(out, reference(op, x, w, b, eps), dtype, f"{op} {rule} {n}")
            (y, h), (threads, vectors, _, _) = resident_kernel(lambda: fusion.fused_add_rms_norm(x, r, w))
            assert [threads, vectors] == expect, (rule, dtype, threads, vectors)
            assert torch.equal(h, rounded_sum(x, r)), (rule, dtype)
            assert_forward(y, F.rms_norm(h.double(), (n,), w.double(), 1e-6), dtype, f"fused {rule} {n}")
    x, w = inputs[torch.bfloat16][:2]
    for rule in ("warp3", "wide", "wider"):
        monkeypatch.setenv("COURSE_NORM_FORWARD_SHAPES", rule)
        with pytest.raises(RuntimeError):
            fusion.rms_norm(x, w)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=dtype_id)
def test_whole_warp_forward_shapes(dtype, monkeypatch):
    """The forward in the regular shapes of whole warps at 1, 7, 133 and 2048 rows (1 and 7 rows
    of whole vectors: the few-rows shapes; 133: one block more than 132 SMs), every op and
    fused_add_rms_norm against float64, the sum bit for bit; at 7 and 2048 rows also rows that
    start mid-vector (an offset view) and weight or bias None; in bfloat16 at 2048 rows, the shape
    that ran is the one norm_forward_shape names, a whole number of warps."""
    require_cuda()
    # The resident rung's shapes and variants: under COURSE_NORM_FORWARD_RULE=old, which holds every
    # LayerNorm row too (the rows the default streams: test_forward_stream_rule_launches).
    monkeypatch.setenv("COURSE_NORM_FORWARD_RULE", "old")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for rows in (1, 7, 133, 2048):
        for n in WHOLE_WARP_WIDTHS:
            where = f"{rows}x{n}"
            x, w, b, r = make_inputs((rows, n), dtype, "cuda", residual=True)
            for op in NORM_OPS:
                eps = default_eps(op)
                call = lambda op=op, eps=eps: run(op, x, w, b, eps, None)  # noqa: E731
                if dtype == torch.bfloat16 and rows == 2048:
                    out, (threads, vectors, _, _) = resident_kernel(call)
                    assert [threads, vectors] == OPS.norm_forward_shape(x, sms), (op, where)
                    assert threads % 32 == 0, (op, where, threads)
                else:
                    out = call()
                assert_forward(out, reference(op, x, w, b, eps), dtype, f"{op} {where}")
            y, h = fusion.fused_add_rms_norm(x, r, w)
            h_ref = rounded_sum(x, r)
            assert torch.equal(h, h_ref), where
            assert_forward(y, F.rms_norm(h_ref.double(), (n,), w.double(), 1e-6), dtype, f"fused {where}")
            if rows in (7, 2048):
                xo = torch.randn(rows * n + 1, device="cuda").to(dtype)[1:].view(rows, n)  # mid-vector rows
                ro = torch.randn(rows * n + 1, device="cuda").to(dtype)[1:].view(rows, n)
                for op in NORM_OPS:
                    eps = default_eps(op)
                    assert_forward(run(op, xo, w, b, eps, None), reference(op, xo, w, b, eps), dtype,
                                   f"{op} offset {where}")
                y, h = fusion.fused_add_rms_norm(xo, ro, None)
                h_ref = rounded_sum(xo, ro)
                assert torch.equal(h, h_ref), f"offset {where}"
                assert_forward(y, F.rms_norm(h_ref.double(), (n,), None, 1e-6), dtype, f"fused offset None {where}")
                ones, zeros = torch.ones_like(w), torch.zeros_like(b)
                assert_forward(fusion.layer_norm(x, None, None), reference("layer_norm", x, ones, zeros, 1e-5), dtype,
                               f"layer_norm None None {where}")
                assert_forward(fusion.layer_norm(x, w, None), reference("layer_norm", x, w, zeros, 1e-5), dtype,
                               f"layer_norm w None {where}")
                assert_forward(fusion.rms_norm(x, None), reference("rms_norm", x, ones, zeros, 1e-6), dtype,
                               f"rms_norm None {where}")
            del x, r


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_fused_add_backward_launches(dtype):
    """fused_add_rms_norm's backward is rms_norm's launches and nothing after them: at 64 rows one
    kernel (norm_backward_few_rows, dsum added to dx there), at 2048 the resident rows and their
    column sum; no elementwise kernel for the add."""
    require_cuda()
    for rows, n in ((64, 4096), (2048, 4096), (64, 777)):
        x, w, _, r = make_inputs((rows, n), dtype, "cuda", residual=True)
        xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
        y, h = fusion.fused_add_rms_norm(xs, rs, ws)
        dy, dsum = torch.randn_like(y), torch.randn_like(h)
        (gx, _, gw), kernels = launched_kernels(lambda: torch.autograd.grad((y, h), (xs, rs, ws), (dy, dsum)), "")
        where = f"{rows}x{n}"
        _, dh_ref, dw_ref = fused_add_reference(x, r, w, dy, dsum)
        assert_grad(gx, dh_ref, dtype, f"{where} dx")
        assert_grad(gw, dw_ref, dtype, f"{where} dweight")
        ours = [k for k in kernels if "norm_backward" in k or "column_reduce" in k]
        # Nothing else on the GPU: no add, no fill (PyTorch's are its elementwise kernels).
        assert ours and not [k for k in kernels if "elementwise_kernel" in k or "fill" in k.lower()], (where, kernels)
        if rows <= 64:
            assert len(ours) == 1 and "norm_backward_few_rows" in ours[0], (where, kernels)


GRAD_SHAPES = [(4, 7), (2, 3, 5), (3, 1)]


@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=str)
@pytest.mark.parametrize("version", (*VERSIONS["layer_norm"], None), ids=str)
def test_gradcheck(version, shape, device):
    x, w, b, r = (t.requires_grad_() for t in make_inputs(shape, torch.float64, device, residual=True))
    torch.autograd.gradcheck(lambda x, w, b: fusion.layer_norm(x, w, b, version=version), (x, w, b))
    torch.autograd.gradcheck(lambda x, w: fusion.rms_norm(x, w, version=version), (x, w))
    add_version = None if version is None else ("v1" if version == "v1" else "v2")
    torch.autograd.gradcheck(lambda x, r, w: fusion.fused_add_rms_norm(x, r, w, version=add_version), (x, r, w))


# ---------------------------------------------------------------------------------------------
# 4. Empty tensors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (3, 0)], ids=str)
def test_empty(shape, device):
    x, w, b, r = (t.requires_grad_() for t in make_inputs(shape, torch.float32, device, residual=True))
    y = fusion.layer_norm(x, w, b)
    assert y.shape == x.shape
    y2 = fusion.rms_norm(x, w)
    h_out = fusion.fused_add_rms_norm(x, r, w)
    loss = y.sum() + y2.sum() + h_out[0].sum() + h_out[1].sum()
    gx, gw, gb = torch.autograd.grad(loss, (x, w, b))
    assert gx.shape == x.shape and gw.shape == w.shape
    assert bool((gw == 0).all()) and bool((gb == 0).all())  # empty sums


# ---------------------------------------------------------------------------------------------
# 5. Determinism: dweight and dbias bitwise equal run to run
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", (*VERSIONS["layer_norm_backward"], None), ids=str)
def test_backward_is_deterministic(version, device):
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1000, 5123):
            x, w, b, _ = make_inputs((300, n), dtype, device)
            dy = torch.randn(300, n, device=device).to(dtype)
            for op in NORM_OPS:
                first = kernel_grads(op, x, w, b, dy, 1e-5, version)
                for _ in range(3):
                    again = kernel_grads(op, x, w, b, dy, 1e-5, version)
                    for a, c in zip(first, again):
                        assert torch.equal(a, c), (op, n, dtype)


# ---------------------------------------------------------------------------------------------
# 6. VERSIONS, dispatch and misuse
# ---------------------------------------------------------------------------------------------
def test_versions_table_matches_dispatch():
    assert VERSIONS["layer_norm"] == VERSIONS["rms_norm"] == ("v1", "v2", "v3")
    assert VERSIONS["layer_norm_backward"] == VERSIONS["rms_norm_backward"] == ("v1", "v2")
    assert VERSIONS["fused_add_rms_norm"] == ("v1", "v2")
    for op in ("layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward", "fused_add_rms_norm"):
        assert list(VERSIONS[op]) == OPS.versions(op), op


def test_default_choice():
    x = torch.empty(8, 4096, device="meta", dtype=torch.bfloat16)
    assert fusion.norm_default_choice("layer_norm", x) == "v3"
    assert fusion.norm_default_choice("rms_norm", x) == "v3"
    assert fusion.norm_default_choice("layer_norm_backward", x) == "v2"
    assert fusion.norm_default_choice("rms_norm_backward", x) == "v2"
    assert fusion.norm_default_choice("fused_add_rms_norm", x) == "v2"
    with pytest.raises(RuntimeError, match="norm_default_choice: unknown op 'softmax'"):
        fusion.norm_default_choice("softmax", x)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=dtype_id)
def test_forward_variant_rule(dtype):
    """Which resident forward kernel a launch runs (norm.h's forward_params): weight and bias held
    in registers exactly where the grid fits one wave of the kernel that holds them (a warp row
    shape holds 128 / 32 = 4 rows a block, the others one), except in 1024-thread blocks of 4
    vectors; there, prefetched where the grid has at most one block an SM; past that the
    register-capped kernel only for rows of whole vectors in blocks of 129-512 threads whose plain
    kernel keeps fewer than two rows an SM, the plain one everywhere else; past the registers,
    streamed. Rows of at most one block an SM take the few-rows shapes (test_few_rows_forward_
    shape_rule), of 1-2 vectors a thread up to 1024-thread rows of 4."""
    elem = torch.empty((), dtype=dtype).element_size()
    vector = 16 // elem
    sms = 132

    def variant(rows, n, per_sm, held_per_sm):
        return OPS.norm_forward_variant(torch.empty(rows, n, dtype=dtype, device="meta"), sms, per_sm, held_per_sm)

    # Row shapes by their block (norm.h's capacities): a warp row, 128, 256, 512 and 1024 threads.
    warp, block128, block512, block1024 = 32 * vector, 128 * 4 * vector, 512 * 4 * vector, 1024 * 4 * vector
    for n, per_block, cappable in ((warp, 4, False), (block128, 1, False), (256 * 4 * vector, 1, True),
                                   (block512, 1, True), (block1024, 1, False)):
        for per_sm in (1, 2, 3):
            for held_per_sm in (1, 2, 5):
                one_each = sms * per_block  # rows of one block an SM
                wave = held_per_sm * sms * per_block  # rows of the held kernel's wave
                if n == block1024:  # never held: prefetched at one block an SM
                    assert variant(one_each, n, per_sm, held_per_sm) == "prefetch", (n, per_sm)
                    assert variant(1, n, per_sm, held_per_sm) == "prefetch", (n, per_sm)
                    wave = one_each
                else:
                    assert variant(1, n, per_sm, held_per_sm) == "held", (n, per_sm, held_per_sm)
                    assert variant(wave, n, per_sm, held_per_sm) == "held", (n, per_sm, held_per_sm)
                past = variant(wave + 1, n, per_sm, held_per_sm)  # one block more than the wave
                assert past == ("capped" if cappable and per_sm * per_block < 2 else "plain"), (n, per_sm, past)
                # Rows that start mid-vector: never held, prefetched nor capped.
                for rows in (1, wave + 1):
                    assert variant(rows, n - 1, per_sm, held_per_sm) == "plain", (n, rows)
    assert variant(8192, block1024 + vector, 1, 1) == "streamed"
    if dtype == torch.bfloat16:  # hidden 12288: the 512-thread rows; at 8192 tokens one block an SM is capped
        assert variant(8192, 12288, 1, 1) == "capped" and variant(8192, 12288, 2, 1) == "plain"
        assert variant(64, 12288, 1, 1) == "held" and variant(8192, 768, 7, 4) == "plain"
        # 2048 x 768: 512 blocks of 4 rows, one wave where the held kernel keeps 4 blocks an SM.
        assert variant(2048, 768, 7, 4) == "held" and variant(2048, 768, 7, 3) == "plain"
    with pytest.raises(RuntimeError, match="norm_forward_variant: sms must be at least 1"):
        OPS.norm_forward_variant(torch.empty(2, 8, device="meta"), 0, 1, 1)
    with pytest.raises(RuntimeError, match="norm_forward_variant: blocks_per_sm must be at least 1"):
        OPS.norm_forward_variant(torch.empty(2, 8, device="meta"), 132, 0, 1)
    with pytest.raises(RuntimeError, match="norm_forward_variant: held_blocks_per_sm must be at least 1"):
        OPS.norm_forward_variant(torch.empty(2, 8, device="meta"), 132, 1, 0)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=dtype_id)
def test_forward_stream_rule(dtype):
    """Where the forward streams LayerNorm's rows with v1's kernel (norm.h's forward_streams, under
    COURSE_NORM_FORWARD_RULE=new): weight loaded late, more rows than the held rows of every SM, the
    held rows' bytes an SM (blocks an SM x rows a block, the capped kernel's two where it runs, x
    the row's bytes) under 50 KB, and v1's first pass (its blocks an SM x up to 16 KB of a row)
    more than that; never RMSNorm nor fused_add_rms_norm, never the few-rows shapes, never without
    v1's occupancy (the old rule)."""
    elem = torch.empty((), dtype=dtype).element_size()
    vector = 16 // elem
    sms, limit = 132, 50 * 1024

    def variant(rows, n, per_sm, two_pass, op="layer_norm", held_per_sm=1):
        x = torch.empty(rows, n, dtype=dtype, device="meta")
        return OPS.norm_forward_variant(x, sms, per_sm, held_per_sm, two_pass, op)

    many = 64 * sms
    # Rows of one block (192 x 4 in 2-byte dtypes, 1024 x 4 in float32 at 12288 bytes; 384 x 4
    # and 1024 x 4 at 24 KB): the held bytes on either side of the limit, v1's at 6 blocks an SM.
    for row_bytes in (12288, 24576):
        n = row_bytes // elem
        under = limit // row_bytes if limit % row_bytes else limit // row_bytes - 1  # rows an SM under it
        assert variant(many, n, under, 6) == "two_pass", (n, under)
        assert variant(many, n, under + 1, 6) == "plain", (n, under)
        assert variant(many, n, under, 0) == "plain", n  # the old rule
        assert variant(many, n, under, 6, "rms_norm") == "plain", n
        assert variant(many, n, under, 6, "fused_add_rms_norm") == "plain", n
        # v1's first pass: its blocks x min(row, 16 KB) must pass the held bytes.
        step = min(row_bytes, 16384)
        level = -(-under * row_bytes // step)  # the fewest v1 blocks whose pass reaches the held bytes
        expect = "plain" if level * step == under * row_bytes else "two_pass"
        assert variant(many, n, under, level) == expect, (n, level)
        assert variant(many, n, under, level + 1) == "two_pass", (n, level)
        assert variant(many, n, under, level - 1) == "plain", (n, level)
        # Rows that start mid-vector: the same test on their bytes (never held nor capped).
        assert variant(many, n - 1, under, 6) == "two_pass", n
        # The grid: queued past the held rows of every SM, not at them.
        assert variant(under * sms, n, under, 6) == "plain", n
        assert variant(under * sms + 1, n, under, 6) == "two_pass", n
    # A block of one 32 KB row whose plain kernel keeps one an SM runs the capped kernel, two rows
    # an SM: 64 KB, over the limit (one row, 32 KB, would have streamed).
    assert variant(many, 32768 // elem, 1, 6) == "capped"  # 512 x 4 (4 vectors of 16 bytes a thread)
    # Warp rows (4 rows a block of 128 threads, 7 blocks an SM: 28 rows of 512 bytes) are under the
    # limit in bytes, but v1's blocks (at most 8 an SM) hold one short row each.
    assert variant(many, 32 * vector, 7, 8) == "plain"
    # The few-rows shapes (rows <= SMs, whole vectors) and held weight (the grid within the held
    # kernel's wave) come first.
    assert variant(sms, 24576 // elem, 2, 6) in ("held", "prefetch")
    assert variant(5 * sms, 24576 // elem, 2, 6, held_per_sm=5) == "held"
    with pytest.raises(RuntimeError, match="norm_forward_variant: two_pass_blocks_per_sm must be at least 0"):
        variant(many, 1024, 1, -1)
    with pytest.raises(RuntimeError, match="norm_forward_variant: unknown op 'softmax'"):
        variant(many, 1024, 1, 6, "softmax")


def regular_forward_shape(n, vector):
    """The regular forward shape of a row of n elements (norm.h's kForwardShapes): a warp row of 1,
    2, 3 (2-byte dtypes only: vector 8) or 4 vectors a lane up to 128 vectors; past it 4 vectors a
    thread in the fewest threads that hold the row, counted in steps of 32 threads up to 256, of 64
    up to 512, then 1024."""
    vectors = -(-n // vector)
    if vectors <= 128:
        return [32, next(v for v in ((1, 2, 3, 4) if vector == 8 else (1, 2, 4)) if 32 * v >= vectors)]
    threads = -(-vectors // 4)
    step = 32 if threads <= 256 else 64 if threads <= 512 else 1024
    return [-(-threads // step) * step, 4]


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=dtype_id)
def test_forward_shape_rule(dtype):
    """The regular forward shapes (more rows than SMs, or rows not of whole vectors): every row
    length up to the registers' capacity takes a shape that holds it, with fewer idle slots than
    one step of threads x 4 vectors (a warp's up to 256 threads, two warps' up to 512), whole warps
    past a warp row (the block reduction's partials); every shape of the table is reached, each up
    to exactly its capacity; the sweep's hidden sizes take the shapes without padding where the
    row's vectors are a multiple of 128; a row one element past 1024 x 4 vectors streams."""
    elem = torch.empty((), dtype=dtype).element_size()
    vector = 16 // elem
    sms = 132

    def shape(rows, n):
        return OPS.norm_forward_shape(torch.empty(rows, n, dtype=dtype, device="meta"), sms)

    seen = {}
    for vectors in range(1, 4097):
        n = vectors * vector
        got = shape(sms + 1, n)
        assert got == regular_forward_shape(n, vector), (n, got)
        threads, per = got
        idle = threads * per - vectors
        assert 0 <= idle, (n, got)
        if threads > 32:
            assert per == 4 and threads % 32 == 0, (n, got)
            assert idle < 4 * (32 if threads <= 256 else 64 if threads <= 512 else 512), (n, got, idle)
        else:
            # a warp row steps by one vector a lane in 2-byte dtypes, from 2 to 4 in float32
            assert idle < (32 if vector == 8 else 64), (n, got, idle)
        seen[tuple(got)] = max(seen.get(tuple(got), 0), vectors)
        assert shape(1, n - 1) == regular_forward_shape(n - 1, vector), n  # mid-vector rows: the regular shapes
    expected = [(32, 1), (32, 2), (32, 3), (32, 4)] if vector == 8 else [(32, 1), (32, 2), (32, 4)]
    expected += [(t, 4) for t in (64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 1024)]
    assert sorted(seen) == sorted(expected)
    for (threads, per), most in seen.items():
        assert most == threads * per, (threads, per, most)  # every shape filled to its capacity
    assert shape(sms + 1, 4096 * vector + 1) == []
    sweep = {768: [32, 3], 1024: [32, 4], 2560: [96, 4], 3072: [96, 4], 5120: [160, 4], 6144: [192, 4],
             7168: [224, 4], 12288: [384, 4], 777: [32, 4], 4099: [160, 4]} if vector == 8 else \
        {384: [32, 4], 768: [64, 4], 2560: [160, 4], 3072: [192, 4], 5120: [320, 4], 6144: [384, 4], 7168: [448, 4],
         12288: [1024, 4], 4099: [320, 4]}
    for n, want in sweep.items():
        assert shape(2048, n) == want, (n, shape(2048, n))


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=dtype_id)
def test_few_rows_forward_shape_rule(dtype):
    """The row shape a forward launch holds its rows in (norm.h): at most one block an SM (rows <=
    SMs) and rows of whole vectors too long for a warp row take one 16-byte vector a thread, the
    row's vectors rounded up to a power of two (256 threads and up), then 1024-thread rows of 2
    and 4 vectors; any other launch the regular shapes (4 vectors a thread past a warp row, in
    whole warps: test_forward_shape_rule), and past the registers none (streamed)."""
    elem = torch.empty((), dtype=dtype).element_size()
    vector = 16 // elem
    sms = 132

    def shape(rows, n):
        return OPS.norm_forward_shape(torch.empty(rows, n, dtype=dtype, device="meta"), sms)

    def regular(n):
        return regular_forward_shape(n, vector)

    def few(n):
        vectors = n // vector
        threads = 1 << (vectors - 1).bit_length()
        return [threads, 1] if threads <= 1024 else [1024, 1 << (-(-vectors // 1024) - 1).bit_length()]

    for vectors in (129, 130, 255, 256, 257, 320, 512, 513, 1024, 1025, 2048, 2049, 4096):
        n = vectors * vector
        for rows in (1, 7, 64, sms):
            assert shape(rows, n) == few(n), (rows, n)
        assert shape(sms + 1, n) == regular(n), n
        assert shape(1, n - 1) == regular(n - 1), n  # not whole vectors
    for vectors in (1, 7, 96, 128):  # warp rows: never the few-rows shapes
        assert shape(1, vectors * vector) == regular(vectors * vector), vectors
    assert shape(1, 4096 * vector + vector) == []  # streamed
    if dtype == torch.bfloat16:  # the hidden sizes of the 64-token rows
        assert shape(64, 2560) == [512, 1] and shape(64, 4096) == [512, 1] and shape(64, 16384) == [1024, 2]
        assert shape(2048, 2560) == [96, 4] and shape(64, 1024) == [32, 4]
    with pytest.raises(RuntimeError, match="norm_forward_shape: sms must be at least 1"):
        OPS.norm_forward_shape(torch.empty(2, 8, device="meta"), 0)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=dtype_id)
def test_backward_column_pass_rule(dtype):
    """dweight and dbias come from the one launch (column tiles beside the dx blocks) exactly where
    the partial rows (blocks x sums x 4 bytes, written and read back, per column) would move at
    least as many bytes as re-reading x and dy (rows x 2 x elem), or where the column tiles' loads
    cover every row in one step (8 warps x 32 / lanes rows x 2 groups of vectors, 8 of single
    elements): at 64 tokens for both norms in every dtype, hidden 2048 with 4 rows a block
    included; never with a block per SM over 2048 rows; never past 256 rows by the step alone."""
    elem = torch.empty((), dtype=dtype).element_size()
    for op, sums in (("layer_norm", 2), ("rms_norm", 1)):
        for n in (777, 2048, 12288):
            for rows in (1, 37, 64, 65, 128, 129, 256, 257, 2048, 8192):
                for blocks in (1, 16, 64, 132, 512, 528):
                    for sms in (8, 132):
                        x = torch.empty(rows, n, dtype=dtype, device="meta")
                        lanes, cols, _ = OPS.norm_backward_column_tiles(x, sms)
                        step = 8 * (32 // lanes) * (2 if cols > 1 else 8)
                        expected = sums * blocks * 2 * 4 >= rows * 2 * elem or rows <= step
                        assert OPS.norm_backward_column_pass(op, x, blocks, sms) == expected, (op, rows, n, blocks, sms)
                        if rows > 256 and sums * blocks * 2 * 4 < rows * 2 * elem:
                            assert not expected, (op, rows, n, blocks, sms)
        for n, blocks in ((2048, 16), (12288, 64)):  # 64 tokens: 4 rows a block at 2048, one at 12288
            assert OPS.norm_backward_column_pass(op, torch.empty(64, n, dtype=dtype, device="meta"), blocks, 132), op
        a_block_per_sm = torch.empty(2048, 12288, dtype=dtype, device="meta")
        assert not OPS.norm_backward_column_pass(op, a_block_per_sm, 132, 132), op
    with pytest.raises(RuntimeError, match="norm_backward_column_pass: unknown op 'softmax'"):
        OPS.norm_backward_column_pass("softmax", torch.empty(2, 8, device="meta"), 1, 132)
    with pytest.raises(RuntimeError, match="norm_backward_column_pass: blocks must be at least 1"):
        OPS.norm_backward_column_pass("rms_norm", torch.empty(2, 8, device="meta"), 0, 132)
    with pytest.raises(RuntimeError, match="norm_backward_column_pass: sms must be at least 1"):
        OPS.norm_backward_column_pass("rms_norm", torch.empty(2, 8, device="meta"), 1, 0)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=dtype_id)
def test_backward_column_tiles_rule(dtype):
    """The column half of the backward's one launch at few rows (column_pass_tiles in norm.h): a
    16-byte vector a lane where the rows are whole vectors, else one element; tiles of 32 lanes
    while the SMs each get one, else the fewest lanes that still do, never narrower than a 32-byte
    sector of a row; the tiles cover the row, and a tile's columns divide the 256 threads that add
    them (tile_column_totals). Hidden 12288 in bfloat16 on 132 SMs: 192 tiles of 8 lanes."""
    elem = torch.empty((), dtype=dtype).element_size()
    vector = 16 // elem
    for n in (1, 7, 777, 768, 2048, 4099, 12288, 16384):
        for sms in (1, 8, 78, 132, 144):
            lanes, cols, tiles = OPS.norm_backward_column_tiles(torch.empty(64, n, dtype=dtype, device="meta"), sms)
            where = (n, sms, lanes, cols, tiles)
            assert cols == (vector if n % vector == 0 else 1), where
            narrowest = max(1, 32 // (cols * elem))
            assert narrowest <= lanes <= 32 and lanes & (lanes - 1) == 0 and 256 % (lanes * cols) == 0, where
            assert tiles == -(-n // (lanes * cols)), where
            assert tiles >= sms or lanes == narrowest, where    # narrowed until every SM has a tile
            assert lanes == 32 or -(-n // (2 * lanes * cols)) < sms, where  # and no further
    if dtype == torch.bfloat16:
        assert OPS.norm_backward_column_tiles(torch.empty(64, 12288, dtype=dtype, device="meta"), 132) == [8, 8, 192]
    with pytest.raises(RuntimeError, match="norm_backward_column_tiles: sms must be at least 1"):
        OPS.norm_backward_column_tiles(torch.empty(2, 8, device="meta"), 0)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=dtype_id)
def test_backward_column_tiles_stay_in_one_wave(dtype):
    """The launch's cap on the column tiles (max_tiles: what one wave of the kernel holds beside its
    dx blocks): a tile is halved only while the halves fit, so the grid is never a wave and a bit
    where a wider tile keeps it one; without the cap the rule above. LayerNorm at 64 x 4096 in
    bfloat16 on 132 SMs (two blocks an SM, 32 dx blocks: room for 232): 128 tiles of 4 lanes, where
    the uncapped rule's 2-lane tiles are 256."""
    for n in (1, 7, 777, 768, 2048, 4096, 4099, 7168, 8192, 12288, 16384):
        x = torch.empty(64, n, dtype=dtype, device="meta")
        for sms in (1, 78, 132):
            free = OPS.norm_backward_column_tiles(x, sms)
            for room in (1, 40, 68, 200, 232, 10**9):
                lanes, cols, tiles = OPS.norm_backward_column_tiles(x, sms, room)
                where = (n, sms, room, lanes, cols, tiles, free)
                assert cols == free[1] and tiles == -(-n // (lanes * cols)), where
                assert lanes >= free[0], where                       # never narrower than uncapped
                assert tiles <= room or lanes == 32, where           # within the wave, or as wide as a tile goes
                if lanes > free[0]:                                  # stopped early: only the cap stopped it
                    assert -(-n // (lanes // 2 * cols)) > room, where
            assert OPS.norm_backward_column_tiles(x, sms, 10**9) == free
    if dtype == torch.bfloat16:
        x = torch.empty(64, 4096, dtype=dtype, device="meta")
        assert OPS.norm_backward_column_tiles(x, 132) == [2, 8, 256]
        assert OPS.norm_backward_column_tiles(x, 132, 264 - 32) == [4, 8, 128]
    with pytest.raises(RuntimeError, match="norm_backward_column_tiles: max_tiles must be at least 1"):
        OPS.norm_backward_column_tiles(torch.empty(2, 8, device="meta"), 4, 0)


def _f32(*shape, device="cpu", dtype=torch.float32):
    return torch.randn(shape, device=device, dtype=dtype)


MISUSES = {
    "weight wrong length": (lambda d: fusion.layer_norm(_f32(3, 8, device=d), _f32(7, device=d), _f32(8, device=d)),
                            r"layer_norm: weight has shape \[7\] but x's last dim \(the normalized one\) has size 8"),
    "bias wrong length": (lambda d: fusion.layer_norm(_f32(3, 8, device=d), _f32(8, device=d), _f32(9, device=d)),
                          r"layer_norm: bias has shape \[9\]"),
    "weight 2-D": (lambda d: fusion.rms_norm(_f32(3, 8, device=d), _f32(1, 8, device=d)),
                   r"rms_norm: weight has shape \[1, 8\]"),
    "weight dtype": (lambda d: fusion.rms_norm(_f32(3, 8, device=d), _f32(8, device=d, dtype=torch.float16)),
                     r"rms_norm: weight is Half but x is Float"),
    "integer x": (lambda d: fusion.rms_norm(torch.ones(3, 8, dtype=torch.int32, device=d),
                                            torch.ones(8, dtype=torch.int32, device=d)),
                  r"rms_norm: x has dtype Int, which is not supported"),
    "integer x layer_norm": (lambda d: fusion.layer_norm(torch.arange(8, device=d), torch.ones(8, device=d),
                                                         torch.ones(8, device=d)),
                             r"layer_norm: x has dtype Long, which is not supported"),
    "0-d x": (lambda d: fusion.rms_norm(_f32(device=d), _f32(1, device=d)), r"rms_norm: x is a 0-d tensor"),
    "unknown version": (lambda d: fusion.layer_norm(_f32(3, 8, device=d), _f32(8, device=d), _f32(8, device=d),
                                                    version="v4"),
                        r"layer_norm: unknown version 'v4'; expected one of v1, v2, v3"),
    "unknown backward version": (
        lambda d: fusion.rms_norm_backward(_f32(3, 8, device=d), _f32(3, 8, device=d), _f32(8, device=d),
                                           _f32(3, device=d), version="v3"),
        r"rms_norm_backward: unknown version 'v3'; expected one of v1, v2"),
    "fused unknown version": (lambda d: fusion.fused_add_rms_norm(_f32(3, 8, device=d), _f32(3, 8, device=d),
                                                                  _f32(8, device=d), version="v3"),
                              r"fused_add_rms_norm: unknown version 'v3'; expected one of v1, v2"),
    "negative eps": (lambda d: fusion.rms_norm(_f32(3, 8, device=d), _f32(8, device=d), -1e-6),
                     r"rms_norm: eps must be >= 0"),
    "negative eps layer_norm": (lambda d: fusion.layer_norm(_f32(3, 8, device=d), _f32(8, device=d),
                                                            _f32(8, device=d), -1.0),
                                r"layer_norm: eps must be >= 0"),
    "residual shape": (lambda d: fusion.fused_add_rms_norm(_f32(3, 8, device=d), _f32(4, 8, device=d),
                                                           _f32(8, device=d)),
                       r"fused_add_rms_norm: residual has shape \[4, 8\] but x has shape \[3, 8\]"),
    "residual dtype": (lambda d: fusion.fused_add_rms_norm(_f32(3, 8, device=d), _f32(3, 8, device=d).double(),
                                                           _f32(8, device=d)),
                       r"fused_add_rms_norm: residual is Double but x is Float"),
    "backward rstd dtype": (
        lambda d: fusion.layer_norm_backward(_f32(3, 8, device=d), _f32(3, 8, device=d), _f32(8, device=d),
                                             _f32(3, device=d), _f32(3, device=d).double()),
        r"layer_norm_backward: rstd has dtype Double but must be Float"),
    "backward rows": (
        lambda d: fusion.rms_norm_backward(_f32(3, 8, device=d), _f32(3, 8, device=d), _f32(8, device=d),
                                           _f32(4, device=d)),
        r"rms_norm_backward: rstd has 4 elements but x has 3 rows"),
    "backward dy shape": (
        lambda d: fusion.rms_norm_backward(_f32(3, 7, device=d), _f32(3, 8, device=d), _f32(8, device=d),
                                           _f32(3, device=d)),
        r"rms_norm_backward: dy has shape \[3, 7\] but x has shape \[3, 8\]"),
    "backward dsum shape": (
        lambda d: fusion.rms_norm_backward(_f32(3, 8, device=d), _f32(3, 8, device=d), _f32(8, device=d),
                                           _f32(3, device=d), dsum=_f32(2, 8, device=d)),
        r"rms_norm_backward: dsum has shape \[2, 8\] but x has shape \[3, 8\] \(it is added to dx\)"),
    "backward dsum dtype": (
        lambda d: fusion.rms_norm_backward(_f32(3, 8, device=d), _f32(3, 8, device=d), _f32(8, device=d),
                                           _f32(3, device=d), dsum=_f32(3, 8, device=d).double()),
        r"rms_norm_backward: dsum is Double but x is Float"),
}


@pytest.mark.parametrize("misuse", list(MISUSES))
def test_misuse_raises_clear_error(misuse, device):
    call, message = MISUSES[misuse]
    with pytest.raises(RuntimeError, match=message):
        call(device)


@pytest.mark.cuda
def test_mixed_devices_raise():
    require_cuda()
    x = torch.randn(3, 8, device="cuda")
    with pytest.raises(RuntimeError, match=r"layer_norm: weight is on cpu but x is on cuda"):
        fusion.layer_norm(x, torch.ones(8), torch.zeros(8, device="cuda"))
    with pytest.raises(RuntimeError, match=r"fused_add_rms_norm: residual is on cpu but x is on cuda"):
        fusion.fused_add_rms_norm(x, torch.randn(3, 8), torch.ones(8, device="cuda"))


# ---------------------------------------------------------------------------------------------
# 7. opcheck, torch.compile
# ---------------------------------------------------------------------------------------------
def _opcheck_calls(d):
    x, w, b, r = make_inputs((5, 33), torch.float32, d, residual=True)
    xg, wg, bg, rg = (t.clone().requires_grad_() for t in (x, w, b, r))
    _, mean, rstd = fusion.layer_norm_forward(x, w, b)
    _, rms_rstd = fusion.rms_norm_forward(x, w)
    dy = torch.randn_like(x)
    return {
        "layer_norm": (OPS.layer_norm.default, (xg, wg, bg, 1e-5, None)),
        "layer_norm_v1": (OPS.layer_norm.default, (xg, wg, bg, 1e-5, "v1")),
        "rms_norm": (OPS.rms_norm.default, (xg, wg, 1e-6, "v2")),
        "fused_add_rms_norm": (OPS.fused_add_rms_norm.default, (xg, rg, wg, 1e-6, None)),
        "fused_add_rms_norm_v1": (OPS.fused_add_rms_norm.default, (xg, rg, wg, 1e-6, "v1")),
        "layer_norm_forward": (OPS.layer_norm_forward.default, (xg, wg, bg, 1e-5, "v3")),
        "rms_norm_forward": (OPS.rms_norm_forward.default, (xg, wg, 1e-6, None)),
        "fused_add_rms_norm_forward": (OPS.fused_add_rms_norm_forward.default, (xg, rg, wg, 1e-6, None)),
        "layer_norm_backward": (OPS.layer_norm_backward.default, (dy, x, w, mean, rstd, "v1")),
        "rms_norm_backward": (OPS.rms_norm_backward.default, (dy, x, w, rms_rstd, None)),
        "rms_norm_backward_dsum": (OPS.rms_norm_backward.default, (dy, x, w, rms_rstd, None, torch.randn_like(x))),
    }


@pytest.mark.parametrize("op", ["layer_norm", "layer_norm_v1", "rms_norm", "fused_add_rms_norm",
                                "fused_add_rms_norm_v1", "layer_norm_forward", "rms_norm_forward",
                                "fused_add_rms_norm_forward", "layer_norm_backward", "rms_norm_backward",
                                "rms_norm_backward_dsum"])
def test_opcheck(op, device):
    fn, args = _opcheck_calls(device)[op]
    torch.library.opcheck(fn, args)


def test_torch_compile_traces_the_ops(device):
    """Dynamo and AOTAutograd trace through the ops without a graph break (Meta kernels give
    shapes, the Autograd kernels the backward); aot_eager skips codegen to keep this fast."""
    torch._dynamo.reset()

    def f(x, r, w, b):
        y = fusion.layer_norm(x, w, b)
        z, h = fusion.fused_add_rms_norm(y, r, w)
        return (fusion.rms_norm(z * h, w) ** 2).sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x, w, b, r = (t.requires_grad_() for t in make_inputs((3, 7, 65), torch.float32, device, residual=True))
    out = compiled(x, r, w, b)
    grads = torch.autograd.grad(out, (x, r, w, b))
    expected = f(x, r, w, b)
    expected_grads = torch.autograd.grad(expected, (x, r, w, b))
    torch.testing.assert_close(out, expected)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e)


# ---------------------------------------------------------------------------------------------
# 8. CUDA only: every register shape's boundary, graph capture, and the sanitizer's small run
# ---------------------------------------------------------------------------------------------
# Capacities of the row shapes (norm.h): 2-byte forward 256 ... 32768, backward 512 ... 8192;
# float32 half of that forward. One past each boundary takes the next shape or streams.
BOUNDARIES = (255, 256, 257, 512, 513, 1024, 1025, 2048, 4096, 4097, 8192, 8193, 16384, 16385, 32768, 32769)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_every_shape_boundary(dtype):
    require_cuda()
    for n in BOUNDARIES:
        x, w, b, _ = make_inputs((9, n), dtype, "cuda")
        dy = torch.randn(9, n, device="cuda").to(dtype)
        for op in NORM_OPS:
            eps = default_eps(op)
            ref = reference(op, x, w, b, eps)
            for version in VERSIONS[op]:
                assert_forward(run(op, x, w, b, eps, version), ref, dtype, f"{op} {version} n={n}")
            refs = reference_grads(op, x, w, b, dy, eps)
            for version in VERSIONS[op + "_backward"]:
                for name, out, g in zip(("dx", "dw", "db"), kernel_grads(op, x, w, b, dy, eps, version), refs):
                    assert_grad(out, g, dtype, f"{op} backward {version} n={n} {name}")


def check_grads_through_autograd(x, w, b, dy, dtype, where):
    """Every norm's gradients through autograd (the op's backward as a user reaches it) for these
    inputs, against the float64 reference."""
    for op in NORM_OPS:
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = run(op, xs, ws, bs, default_eps(op), None)
        inputs = (xs, ws, bs) if op == "layer_norm" else (xs, ws)
        outs = torch.autograd.grad(y, inputs, dy)
        for name, out, ref in zip(("dx", "dweight", "dbias"), outs, reference_grads(op, x, w, b, dy, default_eps(op))):
            assert_grad(out, ref, dtype, f"{op} {where}{name}")


def check_autograd_grads(shape, dtype):
    """check_grads_through_autograd on fresh CUDA inputs of one shape."""
    x, w, b, _ = make_inputs(shape, dtype, "cuda")
    dy = torch.randn(*shape, device="cuda").to(dtype)
    check_grads_through_autograd(x, w, b, dy, dtype, f"autograd {shape[0]}x{shape[1]} ")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=dtype_id)
def test_backward_column_pass(dtype):
    """The backward's two ways to dweight and dbias, each where backward_column_pass (norm.h) puts
    it: up to 64 tokens (hidden 12288 and 16384: one row a block; the rest: the column tiles'
    loads cover every row in one step) ONE launch, norm_backward_few_rows, writes dx in its first
    blocks and sums the columns in the others, with no column_sum and no second kernel; at 1000
    and 2048 tokens the resident kernel's partial rows and column_sum. Both
    against the float64 reference at irregular shapes: rows that are whole vectors and rows that
    are not (4099, 16001: single elements), one row, fewer rows than a warp's groups, and through
    autograd."""
    require_cuda()
    # 1000 x 777 and x 16001, 2048 x 12288: partial rows (16001 and 12288 from the 1024-thread
    # rows' shared sums, put in column order before they are written; 16001 by single elements).
    for rows, n in ((64, 12288), (64, 16384), (63, 16001), (64, 4099), (1, 777), (5, 5123), (1000, 777),
                    (1000, 16001), (2048, 12288)):
        x, w, b, _ = make_inputs((rows, n), dtype, "cuda")
        dy = torch.randn(rows, n, device="cuda").to(dtype)
        for op in NORM_OPS:
            eps = default_eps(op)
            refs = reference_grads(op, x, w, b, dy, eps)
            where = f"{op} {rows}x{n}"
            if dtype != torch.bfloat16:  # the path (the profiler is slow: one dtype; the rule is the same)
                for name, out, ref in zip(("dx", "dweight", "dbias"), kernel_grads(op, x, w, b, dy, eps, None), refs):
                    assert_grad(out, ref, dtype, f"{where} {name}")
                continue
            outs, kernels = launched_kernels(lambda: kernel_grads(op, x, w, b, dy, eps, None), "")
            for name, out, ref in zip(("dx", "dweight", "dbias"), outs, refs):
                assert_grad(out, ref, dtype, f"{where} {name}")
            few = any("norm_backward_few_rows" in k for k in kernels)
            backward = [k for k in kernels if "norm_backward" in k or "column_reduce" in k]
            if rows <= 64:  # every case here: by the bytes or by the column tiles' one step
                assert few, (where, kernels)
            if few:  # the whole backward is that one launch
                assert len(backward) == 1, (where, kernels)
            if rows >= 1000:
                assert not few and any("column_reduce" in k for k in kernels), (where, kernels)
    check_autograd_grads((64, 12288), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=dtype_id)
def test_backward_column_totals_at_tile_edges(dtype):
    """dweight and dbias where the block-wide adds of a column tile's sums (tile_column_totals in
    course/column_reduce.cuh) meet their edges: tiles of 1 to 32 lanes (hidden 1, 7: one lane;
    777, 4099: single elements; 2048: 2 lanes of whole vectors, 16 groups of threads a column;
    12288: 8 lanes), every warp's rows or only the first warp's (1, 63, 64, 65 rows), and rows
    that end mid-group (2047), on both paths (the column pass at few rows, partial rows and
    column_sum at many: one launch of it for LayerNorm's dweight and dbias together, the second
    slice's sums written to dbias), and through autograd."""
    require_cuda()
    for rows in (1, 63, 64, 65, 2047):
        for n in (1, 7, 777, 2048, 4099, 12288):
            x, w, b, _ = make_inputs((rows, n), dtype, "cuda")
            dy = torch.randn(rows, n, device="cuda").to(dtype)
            for op in NORM_OPS:
                eps = default_eps(op)
                refs = reference_grads(op, x, w, b, dy, eps)
                if rows < 2047 or dtype != torch.bfloat16:
                    outs = kernel_grads(op, x, w, b, dy, eps, None)
                else:  # partial rows at every width here: one column sum (the profiler: here, one dtype; slow)
                    outs, kernels = launched_kernels(lambda: kernel_grads(op, x, w, b, dy, eps, None), "")
                    assert not any("norm_backward_few_rows" in k for k in kernels), (op, n, kernels)
                    assert sum("column_reduce" in k for k in kernels) == 1, (op, n, kernels)
                for name, out, ref in zip(("dx", "dweight", "dbias"), outs, refs):
                    assert_grad(out, ref, dtype, f"{op} {rows}x{n} {name}")
    check_autograd_grads((65, 2048), dtype)


@pytest.mark.cuda
def test_cuda_graph_capture():
    """Forward and backward replay inside a CUDA graph (no host sync, allocations from the
    graph's pool, the current stream honoured)."""
    require_cuda()
    x, w, b, r = make_inputs((64, 1000), torch.bfloat16, "cuda", residual=True)
    dy = torch.randn(64, 1000, device="cuda").to(torch.bfloat16)

    def step():
        y, mean, rstd = fusion.layer_norm_forward(x, w, b)
        dx, dw, db = fusion.layer_norm_backward(dy, x, w, mean, rstd)
        z, h = fusion.fused_add_rms_norm(x, r, w)
        return y, dx, dw, db, z, h

    captured, expected = capture_and_replay(step)
    for a, e in zip(captured, expected):
        assert torch.equal(a, e)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=dtype_id)
def test_few_rows_backward_graph_capture_twice(dtype):
    """The one-launch backward at few rows (norm_backward_few_rows) captured in a CUDA graph twice
    in a row, each replayed: the same bits as the eager call every time (nothing it leaves behind,
    such as a counter or a partial sum, may change the next call), at the rows around a block's
    share (1, 63, 64, 65) and widths of whole vectors and not."""
    require_cuda()
    for rows, n in ((1, 7), (63, 777), (64, 2048), (65, 4099), (64, 12288)):
        x, w, b, _ = make_inputs((rows, n), dtype, "cuda")
        dy = torch.randn(rows, n, device="cuda").to(dtype)
        for op in NORM_OPS:
            eps = default_eps(op)
            if dtype == torch.bfloat16:  # the path (the profiler is slow: one dtype; the rule is the same)
                _, kernels = launched_kernels(lambda: kernel_grads(op, x, w, b, dy, eps, None), "")
                assert any("norm_backward_few_rows" in k for k in kernels), (op, rows, n, kernels)
            refs = reference_grads(op, x, w, b, dy, eps)
            for attempt in range(2):
                captured, expected = capture_and_replay(lambda: kernel_grads(op, x, w, b, dy, eps, None))
                for name, a, e, ref in zip(("dx", "dweight", "dbias"), captured, expected, refs):
                    assert torch.equal(a, e), (op, rows, n, name, attempt)
                    assert_grad(a, ref, dtype, f"{op} {rows}x{n} {name} graph {attempt}")


@pytest.mark.cuda
@pytest.mark.sanitize
def test_sanitizer_small_backward_few_rows():
    """compute-sanitizer's run of the one-launch backward: dx blocks and column blocks side by
    side, single elements and whole vectors, the last column tile hanging over the row's end."""
    require_cuda()
    for dtype in (torch.float32, torch.bfloat16):
        for rows, n in ((1, 7), (3, 777), (64, 2048), (5, 4099)):
            x, w, b, _ = make_inputs((rows, n), dtype, "cuda")
            dy = torch.randn(rows, n, device="cuda").to(dtype)
            for op in NORM_OPS:
                eps = default_eps(op)
                outs = kernel_grads(op, x, w, b, dy, eps, None)
                for name, out, ref in zip(("dx", "dweight", "dbias"), outs, reference_grads(op, x, w, b, dy, eps)):
                    assert_grad(out, ref, dtype, f"{op} {rows}x{n} {name}")


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("version", VERSIONS["layer_norm"])
def test_sanitizer_small_forward(version):
    require_cuda()
    for dtype in (torch.float32, torch.bfloat16):
        # 40000: past the registers in both dtypes (streamed); 2560 and 8200: the few-rows shapes
        # (one and two vectors a thread in bfloat16, a 1024-thread row's padding past the row)
        for n in (1, 33, 1000, 2560, 8200, 40000):
            x, w, b, r = make_inputs((3, n), dtype, "cuda", residual=True)
            for op in NORM_OPS:
                assert_forward(run(op, x, w, b, 1e-5, version), reference(op, x, w, b, 1e-5), dtype)
            fusion.fused_add_rms_norm(x, r, w, version="v1" if version == "v1" else "v2")
        base = torch.randn(3 * 1001 + 1, device="cuda").to(dtype)
        x = base[1:].view(3, 1001)  # misaligned rows
        _, w, b, _ = make_inputs((1, 1001), dtype, "cuda")
        for op in NORM_OPS:
            assert_forward(run(op, x, w, b, 1e-5, version), reference(op, x, w, b, 1e-5), dtype)
        if version == "v3" and dtype == torch.bfloat16:  # 512-thread rows, a block more than SMs: the capped kernel
            rows = torch.cuda.get_device_properties(0).multi_processor_count + 1
            x, w, b, r = make_inputs((rows, 12288), dtype, "cuda", residual=True)
            for op in NORM_OPS:
                assert_forward(run(op, x, w, b, 1e-5, version), reference(op, x, w, b, 1e-5), dtype)
            fusion.fused_add_rms_norm(x, r, w)


@pytest.mark.cuda
@pytest.mark.sanitize
def test_sanitizer_small_whole_warp_forward():
    """compute-sanitizer's run of the regular shapes of whole warps (one block more than the SMs:
    not the few-rows shapes): padding slots past the row's end (2560 and 13000 in bfloat16: 96 x 4
    and 448 x 4), none (5120: 160 x 4), the edge slot of rows not of whole vectors (4099, 777) and
    rows that start mid-vector; every op and fused_add_rms_norm."""
    require_cuda()
    rows = torch.cuda.get_device_properties(0).multi_processor_count + 1
    for dtype in (torch.float32, torch.bfloat16):
        for n in (777, 2560, 4099, 5120, 13000):
            x, w, b, r = make_inputs((rows, n), dtype, "cuda", residual=True)
            xo = torch.randn(rows * n + 1, device="cuda").to(dtype)[1:].view(rows, n)
            for op in NORM_OPS:
                eps = default_eps(op)
                assert_forward(run(op, x, w, b, eps, None), reference(op, x, w, b, eps), dtype, f"{op} {n}")
                assert_forward(run(op, xo, w, b, eps, None), reference(op, xo, w, b, eps), dtype, f"{op} offset {n}")
            y, h = fusion.fused_add_rms_norm(x, r, w)
            h_ref = rounded_sum(x, r)
            assert torch.equal(h, h_ref), n
            assert_forward(y, F.rms_norm(h_ref.double(), (n,), w.double(), 1e-6), dtype, f"fused {n}")


@pytest.mark.cuda
@pytest.mark.sanitize
def test_sanitizer_small_three_vector_forward():
    """compute-sanitizer's run of the 32 x 3 warp rows at one block more than the SMs (768 and 760
    in bfloat16 and float16: every lane's third vector, or the last lanes' past the row) and of
    float32's 32 x 4 at 384 and 376 (no 32 x 3 there); every op and fused_add_rms_norm, and the
    offset views."""
    require_cuda()
    rows = torch.cuda.get_device_properties(0).multi_processor_count + 1
    for dtype, widths in ((torch.bfloat16, (768, 760)), (torch.float16, (768, 760)), (torch.float32, (384, 376))):
        for n in widths:
            x, w, b, r = make_inputs((rows, n), dtype, "cuda", residual=True)
            for op in NORM_OPS:
                eps = default_eps(op)
                assert_forward(run(op, x, w, b, eps, None), reference(op, x, w, b, eps), dtype, f"{op} {n}")
                xo = torch.randn(rows * n + 1, device="cuda").to(dtype)[1:].view(rows, n)
                assert_forward(run(op, xo, w, b, eps, None), reference(op, xo, w, b, eps), dtype, f"{op} offset {n}")
            y, h = fusion.fused_add_rms_norm(x, r, w)
            assert torch.equal(h, rounded_sum(x, r)), n
            assert_forward(y, F.rms_norm(h.double(), (n,), w.double(), 1e-6), dtype, f"fused {n}")


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("version", VERSIONS["layer_norm_backward"])
def test_sanitizer_small_backward(version):
    require_cuda()
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 33, 1000, 9000):  # 9000: past the backward's registers (streamed)
            x, w, b, _ = make_inputs((5, n), dtype, "cuda")
            dy = torch.randn(5, n, device="cuda").to(dtype)
            for op in NORM_OPS:
                refs = reference_grads(op, x, w, b, dy, default_eps(op))
                for out, ref in zip(kernel_grads(op, x, w, b, dy, default_eps(op), version), refs):
                    assert_grad(out, ref, dtype)


@pytest.mark.cuda
@pytest.mark.sanitize
def test_sanitizer_small_fused_add_backward():
    """compute-sanitizer's run of fused_add_rms_norm's backward with dsum read in the kernel: one
    launch at few rows, partial rows past that, single elements (777) and the streamed rows (v1)."""
    require_cuda()
    for dtype in (torch.float32, torch.bfloat16):
        for rows, n in ((1, 7), (3, 777), (65, 2048), (300, 1024)):
            x, w, _, r = make_inputs((rows, n), dtype, "cuda", residual=True)
            dy, dsum = (torch.randn(rows, n, device="cuda").to(dtype) for _ in range(2))
            h, dh_ref, dw_ref = fused_add_reference(x, r, w, dy, dsum)
            _, rstd = fusion.rms_norm_forward(h, w, 1e-6)
            for version in (*VERSIONS["rms_norm_backward"], None):
                dh, dw = fusion.rms_norm_backward(dy, h, w, rstd, version=version, dsum=dsum)
                assert_grad(dh, dh_ref, dtype, f"{rows}x{n} {version} dx")
                assert_grad(dw, dw_ref, dtype, f"{rows}x{n} {version} dweight")


# A tensor where a number goes and the other way round: a TypeError naming the op and the argument.
MISPLACED = {
    "layer_norm(x, w, 1e-5, b)": (lambda x, w: fusion.layer_norm(x, w, 1e-5, w), r"^layer_norm: bias must be a tensor or None, got a float"),
    "rms_norm(x, w, w)": (lambda x, w: fusion.rms_norm(x, w, w), r"^rms_norm: eps must be a number \(float\), got a tensor"),
    "fused_add_rms_norm(x, w, 1e-6)": (lambda x, w: fusion.fused_add_rms_norm(x, w, 1e-6),
                                       r"^fused_add_rms_norm: weight must be a tensor or None, got a float"),
    "rms_norm_backward(x, x, w, 1.0)": (lambda x, w: fusion.rms_norm_backward(x, x, w, 1.0),
                                        r"^rms_norm_backward: rstd must be a tensor, got a float"),
    "norm_default_choice(x, op)": (lambda x, w: fusion.norm_default_choice(x, "rms_norm"),
                                   r"^norm_default_choice: op must be a str, got a tensor"),
}


@pytest.mark.parametrize("call", list(MISPLACED))
def test_misplaced_arguments_raise_type_error(call, device):
    assert_misplaced(*MISPLACED[call], torch.randn(4, 8, device=device), torch.randn(8, device=device))
