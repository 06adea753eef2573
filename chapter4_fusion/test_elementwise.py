"""Tests for chapter 4's elementwise family: fused_bias_scale_relu (and its backward ladder),
bias_gelu, bias_silu, swiglu and linear_activation; every rung x dtype x irregular shape, CPU and
CUDA.

The references are plain PyTorch in float64 on the inputs as given (already rounded to their
dtype). Every comparison is element by element against a bound derived from what the kernels
round, written next to each bound with its reason: the fused rungs compute in float32 (float64
for float64) and round once to the dtype; the unfused rungs (v1, "unfused") round each
intermediate to the dtype, as eager does, which the bounds allow for too.

Inputs of the ReLU ops keep |x * scale + bias| >= 0.25 (bias_inputs): then no rounding of any
rung can flip the sign of an element, and the masks and gradients are exact functions of the
reference's signs.

Run against the installed extension (pip install .) or the JIT build (COURSE_EXT_ROUTE=jit);
the header line says which one was loaded.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import fusion
from coursekit.pytest_plugin import (DTYPES, assert_misplaced, assert_within, capture_and_replay, dtype_id, floor,
                                     launched_kernels, offset_copy, poison_allocator, replayed_outputs, require_cuda,
                                     shape_id)
from fusion import _elementwise

EW_VERSIONS = _elementwise.VERSIONS
SCALE = 0.75  # not a power of two: x * scale rounds
LOW_PRECISION = (torch.float16, torch.bfloat16, torch.float32)
GELU_APPROX = {"gelu": "none", "gelu_tanh": "tanh"}


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def eps(dtype):
    """One rounding to the dtype errs by at most eps * |value| (half an ulp, with a margin)."""
    return torch.finfo(dtype).eps


def eps_acc(dtype):
    """The compute dtype's eps: float32 for every dtype but float64."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def bias_inputs(shape, dtype, device, scale=SCALE, margin=0.25):
    """x and bias with |x * scale + bias| >= margin everywhere. The rounding of x and bias to
    bfloat16 moves x * scale + bias by < 0.03 (|x| < 16: a half-ulp of 0.03 times 0.75, plus the
    bias's 0.008), and v1's rounded intermediates by < 0.05 more: no sign can flip."""
    n = shape[-1]
    bias = torch.randn(n, dtype=torch.float64, device=device)
    z = torch.randn(shape, dtype=torch.float64, device=device)
    z = z + margin * z.sign()
    return ((z - bias) / scale).to(dtype), bias.to(dtype)


def rows_of(t):
    return t.reshape(-1, t.shape[-1]) if t.dim() > 0 else t


def column_sum_bound(g64, dtype, rows):
    """A sum over `rows` terms, in the compute dtype, in any grouping: depth * eps_acc * sum|g|
    with depth <= 2 log2(rows) + 8 for every order the kernels use (a row loop per thread, then a
    column reduction of the partials), plus the output's rounding, plus one rounding of every
    term to the dtype (v1 writes g in the dtype before summing it)."""
    g_rows = rows_of(g64)
    total = g_rows.sum(0)
    mag = g_rows.abs().sum(0)
    return eps(dtype) * total.abs() + (eps(dtype) + (2 * math.log2(rows + 1) + 8) * eps_acc(dtype)) * mag + floor(dtype)


def unpack_mask(mask, n):
    """The mask's bits as bools [rows, words * 32]: bit c % 32 of word c / 32 of row r, the words
    little-endian (as on x86 and every CUDA GPU)."""
    rows, words = mask.shape
    as_bytes = mask.contiguous().view(torch.uint8).reshape(rows, words * 4)
    shifts = torch.arange(8, device=mask.device, dtype=torch.uint8)
    return ((as_bytes.unsqueeze(-1) >> shifts) & 1).reshape(rows, words * 32).bool()


# ---------------------------------------------------------------------------------------------
# Plain-PyTorch references (float64)
# ---------------------------------------------------------------------------------------------
def reference_act(z, activation):
    if activation == "relu":
        return torch.relu(z)
    if activation == "silu":
        return F.silu(z)
    return F.gelu(z, approximate=GELU_APPROX[activation])


def reference_bias_act(x, bias, activation, scale=1.0):
    return reference_act(x.double() * scale + bias.double(), activation)


def reference_swiglu(x):
    a, b = x.double().chunk(2, dim=-1)
    return F.silu(a) * b


def reference_linear(x, weight, bias, activation):
    return reference_act(x.double() @ weight.double().T + bias.double(), activation)


def act_bound(x, bias, scale, ref, dtype):
    """Forward of act(x * scale + bias): one rounding of the output (eps |ref|); the compute
    dtype's error in z and in the activation's exp/erf/tanh (8 eps_acc of |ref| and of |z|'s
    parts); and for the unfused rungs two more roundings to the dtype (x * scale, then + bias),
    each <= eps (|x scale| + |bias|), carried through act' <= 1.13: 4 eps of that covers them."""
    e, a = eps(dtype), eps_acc(dtype)
    parts = (x.double() * scale).abs() + bias.double().abs()
    return (e + 8 * a) * ref.abs() + (4 * e + 8 * a) * parts + floor(dtype)


# ---------------------------------------------------------------------------------------------
# 1. The VERSIONS table and the public API
# ---------------------------------------------------------------------------------------------
def test_versions_table_matches_dispatch():
    assert set(EW_VERSIONS) == {"fused_bias_scale_relu", "fused_bias_scale_relu_backward", "bias_gelu", "bias_silu",
                                "swiglu", "linear_activation"}
    for op, rungs in EW_VERSIONS.items():
        assert list(rungs) == torch.ops.fusion.versions(op), op
        assert fusion.VERSIONS[op] == rungs, op
    assert set(_elementwise.__all__) == {"fused_bias_scale_relu", "fused_bias_scale_relu_backward",
                                         "fused_bias_scale_relu_saved", "saved_bytes", "bias_gelu", "bias_silu",
                                         "swiglu", "linear_activation", "elementwise_default_choice",
                                         "SAVE_CHOICES", "ACTIVATIONS"}
    for name in _elementwise.__all__:
        assert getattr(fusion, name) is getattr(_elementwise, name)
        if callable(getattr(fusion, name)):
            assert getattr(fusion, name).__doc__, name
    assert fusion.SAVE_CHOICES == ("y", "x", "mask")
    assert fusion.ACTIVATIONS == ("relu", "gelu", "gelu_tanh", "silu")


# ---------------------------------------------------------------------------------------------
# 2. Forward: every rung x dtype x shape
# ---------------------------------------------------------------------------------------------
# Last dims 1 and 3 (the scalar path: not a whole 16-byte vector), 8 (one or two vectors per row,
# many rows per block), 1000 (whole vectors in every dtype), 5123 (a prime: scalar), 65536 (a
# row longer than a column tile); no rows; 1-D and 4-D.
SHAPES = [(7, 1), (5, 3), (257, 8), (33, 1000), (3, 5123), (2, 65536), (0, 1000), (1000,), (2, 3, 5, 96)]
BIAS_OPS = ("relu", "gelu", "gelu_tanh", "silu")


def run_bias_op(activation, x, bias, version):
    if activation == "relu":
        return fusion.fused_bias_scale_relu(x, bias, SCALE, version=version)
    if activation == "silu":
        return fusion.bias_silu(x, bias, version=version)
    return fusion.bias_gelu(x, bias, GELU_APPROX[activation], version=version)


def ladder_of(activation):
    return EW_VERSIONS["fused_bias_scale_relu" if activation == "relu" else
                       "bias_silu" if activation == "silu" else "bias_gelu"]


BIAS_PARAMS = [pytest.param(act, v, id=f"{act}-{v}") for act in BIAS_OPS for v in (*ladder_of(act), None)]


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("activation,version", BIAS_PARAMS)
def test_bias_activation_matches_reference(activation, version, dtype, shape, device):
    scale = SCALE if activation == "relu" else 1.0
    x, bias = bias_inputs(shape, dtype, device, scale)
    ref = reference_bias_act(x, bias, activation, scale)
    poison_allocator(x)
    out = run_bias_op(activation, x, bias, version)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device and out.is_contiguous()
    assert_within(out, ref, act_bound(x, bias, scale, ref, dtype), f"{activation} {version}")


SWIGLU_SHAPES = [(7, 2), (5, 6), (257, 16), (33, 2000), (3, 10246), (2, 65536), (0, 1000), (1000,), (2, 3, 5, 96)]


@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", (*EW_VERSIONS["swiglu"], None), ids=str)
def test_swiglu_matches_reference(version, dtype, shape, device):
    x = torch.randn(shape, device=device).to(dtype)
    ref = reference_swiglu(x)
    poison_allocator(ref.to(dtype))
    out = fusion.swiglu(x, version=version)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype and out.is_contiguous()
    assert_within(out, ref, swiglu_bound(x, ref, dtype), f"swiglu {version}")


LINEAR_SHAPES = [((7, 1), 1), ((33, 64), 1000), ((3, 31), 5123), ((2, 3, 17), 96), ((0, 16), 8), ((16,), 40),
                 ((5, 0), 24)]


def linear_bound(x, weight, bias, ref, dtype):
    """The GEMM of a k-term dot product: k eps_acc of sum |x||w| for the accumulation, plus 4 eps
    of it for the 16-bit GEMM's rounding of h (and cuBLAS's reduced-precision reductions), then
    the epilogue's roundings as in act_bound (act' <= 1.13)."""
    e, a = eps(dtype), eps_acc(dtype)
    k = x.shape[-1]
    dot = x.double().abs() @ weight.double().abs().T
    return (e + 8 * a) * ref.abs() + (4 * e + (k + 8) * a) * dot + (4 * e + 8 * a) * bias.double().abs() + floor(dtype)


@pytest.mark.parametrize("case", LINEAR_SHAPES, ids=lambda c: f"{shape_id(c[0])}-out{c[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", (*EW_VERSIONS["linear_activation"], None), ids=str)
@pytest.mark.parametrize("activation", BIAS_OPS)
def test_linear_activation_matches_reference(activation, version, dtype, case, device):
    shape, out_features = case
    x = torch.randn(shape, device=device).to(dtype)
    weight = (torch.randn(out_features, shape[-1], device=device) / math.sqrt(max(shape[-1], 1))).to(dtype)
    bias = torch.randn(out_features, device=device).to(dtype)
    ref = reference_linear(x, weight, bias, activation)
    out = fusion.linear_activation(x, weight, bias, activation, version=version)
    assert out.shape == (*shape[:-1], out_features) and out.dtype == dtype
    assert_within(out, ref, linear_bound(x, weight, bias, ref, dtype), f"linear {activation} {version}")


# ---------------------------------------------------------------------------------------------
# 3. Views: offsets (misaligned by one element), transposes, strided biases
# ---------------------------------------------------------------------------------------------
def make_view(name, shape, dtype, device):
    """x of `shape` seen through the view, and a strided bias (every other element of a buffer)."""
    rows, n = shape
    x, bias = bias_inputs((rows * 2 + 1, n), dtype, device)
    if name == "offset_by_one":
        flat = torch.cat([x.reshape(-1)[:1], x.reshape(-1)])
        view = flat[1:1 + rows * n].view(rows, n)
    elif name == "transposed":
        view = x[:rows].t().contiguous().t()
    else:
        view = x[: 2 * rows: 2]
    strided_bias = torch.stack([bias, bias], -1).reshape(-1)[::2]
    assert not strided_bias.is_contiguous() or n == 1
    return view, strided_bias


@pytest.mark.parametrize("view", ("offset_by_one", "transposed", "every_other_row"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=dtype_id)
@pytest.mark.parametrize("activation", BIAS_OPS)
def test_views(activation, dtype, view, device):
    for shape in ((9, 1000), (5, 64)):
        x, bias = make_view(view, shape, dtype, device)
        scale = SCALE if activation == "relu" else 1.0
        ref = reference_bias_act(x, bias, activation, scale)
        for version in (*ladder_of(activation), None):
            out = run_bias_op(activation, x, bias, version)
            assert_within(out, ref, act_bound(x, bias, scale, ref, dtype), f"{view} {activation} {version}")
    x = torch.randn(9 * 64 + 1, device=device).to(dtype)[1:].view(9, 64)  # misaligned swiglu input
    for version in (*EW_VERSIONS["swiglu"], None):
        ref = reference_swiglu(x)
        assert_within(fusion.swiglu(x, version=version), ref, swiglu_bound(x, ref, dtype), "swiglu view")


# ---------------------------------------------------------------------------------------------
# 4. fused_bias_scale_relu's saved state and backward ladder
# ---------------------------------------------------------------------------------------------
MASK_SHAPES = [(7, 1), (5, 3), (257, 8), (4, 33), (33, 1000), (3, 5123), (2, 3, 5, 96), (1000,)]


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", (*EW_VERSIONS["fused_bias_scale_relu"], None), ids=str)
def test_mask_holds_the_signs(version, dtype, shape, device):
    """The forward's mask: [rows, ceil(n / 32)] int32 words, bit c % 32 of word c / 32 set exactly
    where x * scale + bias > 0, and the padding bits of each row's last word zero."""
    x, bias = bias_inputs(shape, dtype, device)
    n = shape[-1]
    rows = x.numel() // n
    # All ones in the block the mask is most likely carved from: unwritten words show as set bits.
    block = torch.full((rows, (n + 31) // 32), -1, dtype=torch.int32, device=device)
    del block
    y, mask = torch.ops.fusion.fused_bias_scale_relu_forward(x, bias, SCALE, "mask", version)
    assert mask.dtype == torch.int32 and mask.shape == (rows, (n + 31) // 32)
    bits = unpack_mask(mask, n)
    positive = (x.double() * SCALE + bias.double() > 0).reshape(rows, n)
    assert torch.equal(bits[:, :n], positive)
    assert not bits[:, n:].any(), "padding bits set"
    ref = reference_bias_act(x, bias, "relu", SCALE)
    assert_within(y, ref, act_bound(x, bias, SCALE, ref, dtype), "forward with mask")
    for save in ("y", "x"):
        y2, empty = torch.ops.fusion.fused_bias_scale_relu_forward(x, bias, SCALE, save, version)
        assert empty.numel() == 0
        assert torch.equal(y2, y)


def saved_for(save, x, bias, version=None):
    y, mask = torch.ops.fusion.fused_bias_scale_relu_forward(x, bias, SCALE, save, version)
    return {"y": y, "x": x, "mask": mask}[save]


@pytest.mark.parametrize("shape", [(7, 1), (33, 1000), (2, 3, 5, 96), (1000,), (0, 40)], ids=shape_id)
def test_saved_helpers(shape, device):
    """fused_bias_scale_relu_saved returns what the forward keeps; saved_bytes its size."""
    x, bias = bias_inputs(shape, torch.bfloat16, device)
    y, mask = torch.ops.fusion.fused_bias_scale_relu_forward(x, bias, SCALE, "mask")
    for save, expected in (("y", y), ("x", x), ("mask", mask)):
        saved = fusion.fused_bias_scale_relu_saved(x, bias, SCALE, save)
        assert torch.equal(saved, expected), save
        assert fusion.saved_bytes(x, save) == saved.numel() * saved.element_size(), save
    with pytest.raises(ValueError, match="saved_bytes: unknown save 'z'"):
        fusion.saved_bytes(x, "z")
    with pytest.raises(RuntimeError, match="fused_bias_scale_relu: unknown save 'z'"):
        fusion.fused_bias_scale_relu_saved(x, bias, SCALE, "z")


def bsr_backward_reference(dy, x, bias, scale=SCALE):
    """dx = dy * (z > 0) * scale, and g = dy * (z > 0), whose column sum is dbias."""
    g = dy.double() * (x.double() * scale + bias.double() > 0)
    return g * scale, g


BACKWARD_SHAPES = [(7, 1), (5, 3), (257, 8), (33, 1000), (3, 5123), (2, 65536), (0, 1000), (1000,), (2, 3, 5, 96)]


@pytest.mark.parametrize("shape", BACKWARD_SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("save", ("y", "x", "mask"))
@pytest.mark.parametrize("version", (*EW_VERSIONS["fused_bias_scale_relu_backward"], None), ids=str)
def test_bsr_backward_matches_reference(version, save, dtype, shape, device):
    x, bias = bias_inputs(shape, dtype, device)
    dy = torch.randn(shape, device=device).to(dtype)
    saved = saved_for(save, x, bias)
    dx_ref, g = bsr_backward_reference(dy, x, bias)
    poison_allocator(dx_ref.to(dtype))
    dx, dbias = fusion.fused_bias_scale_relu_backward(dy, saved, bias, SCALE, save, version)
    assert dx.shape == x.shape and dx.dtype == dtype and dbias.shape == bias.shape and dbias.dtype == dtype
    # dx: one rounding (v1: two, g then g * scale).
    assert_within(dx, dx_ref, 2 * eps(dtype) * dx_ref.abs() + floor(dtype), f"dx {save} {version}")
    rows = x.numel() // shape[-1]
    assert_within(dbias, rows_of(g).sum(0), column_sum_bound(g, dtype, rows), f"dbias {save} {version}")


# ---------------------------------------------------------------------------------------------
# 5. Gradients through autograd: low precision against float64, and gradcheck
# ---------------------------------------------------------------------------------------------
GRAD_SHAPES = [(33, 1000), (3, 5123), (2, 3, 5, 96), (257, 8)]


@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
@pytest.mark.parametrize("save", ("y", "x", "mask"))
def test_bsr_low_precision_gradients(save, dtype, shape, device):
    x, bias = bias_inputs(shape, dtype, device)
    x.requires_grad_()
    bias.requires_grad_()
    dy = torch.randn(shape, device=device).to(dtype)
    fusion.fused_bias_scale_relu(x, bias, SCALE, save=save).backward(dy)
    dx_ref, g = bsr_backward_reference(dy, x.detach(), bias.detach())
    assert_within(x.grad, dx_ref, 2 * eps(dtype) * dx_ref.abs() + floor(dtype), f"dx save={save}")
    rows = x.numel() // shape[-1]
    assert_within(bias.grad, rows_of(g).sum(0), column_sum_bound(g, dtype, rows), f"dbias save={save}")


def act_grad_bounds(dy, z, dx_ref, dtype, rows):
    """dx = dy * act'(z): one rounding, plus act' computed in the compute dtype from z (which is
    off by eps_acc |z|; |act''| <= 1 for gelu and silu): 16 eps_acc |dy| (1 + |z|). dbias adds
    that per-term error to the column sum's."""
    term = 16 * eps_acc(dtype) * dy.double().abs() * (1 + z.abs())
    dx_bound = eps(dtype) * dx_ref.abs() + term + floor(dtype)
    db_bound = column_sum_bound(dx_ref, dtype, rows) + rows_of(term).sum(0)
    return dx_bound, db_bound


@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
@pytest.mark.parametrize("activation", ("gelu", "gelu_tanh", "silu"))
def test_bias_activation_low_precision_gradients(activation, dtype, shape, device):
    x = torch.randn(shape, device=device).to(dtype).requires_grad_()
    bias = torch.randn(shape[-1], device=device).to(dtype).requires_grad_()
    dy = torch.randn(shape, device=device).to(dtype)
    run_bias_op(activation, x, bias, None).backward(dy)
    x64 = x.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_()
    reference_act(x64 + b64, activation).backward(dy.double())
    rows = x.numel() // shape[-1]
    dx_bound, db_bound = act_grad_bounds(dy, (x64 + b64).detach(), x64.grad, dtype, rows)
    assert_within(x.grad, x64.grad, dx_bound, f"{activation} dx")
    assert_within(bias.grad, b64.grad, db_bound, f"{activation} dbias")


@pytest.mark.parametrize("shape", [(33, 2000), (3, 10246), (2, 3, 5, 96)], ids=shape_id)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
def test_swiglu_low_precision_gradients(dtype, shape, device):
    x = torch.randn(shape, device=device).to(dtype).requires_grad_()
    dy = torch.randn((*shape[:-1], shape[-1] // 2), device=device).to(dtype)
    fusion.swiglu(x).backward(dy)
    x64, bound = swiglu_grad_reference(x, dy)
    assert_within(x.grad, x64.grad, bound, "swiglu dx")


def swiglu_bound(x, ref, dtype):
    """swiglu's forward: one rounding of the output, plus v1's rounding of silu(a) to the dtype
    before the product (eps |silu(a) b| = eps |ref|), plus the compute dtype's exp and products.
    Where silu(a) is below the dtype's smallest normal (a < ~-14 in float16: silu(a) ~ a e^a)
    that rounding is no longer relative but one subnormal step (float16) or a flush to zero
    (FTZ, the others), at most floor(dtype) however small silu(a) is; the product carries it as
    floor |b|. The output's own rounding is the plain floor."""
    b = x.double().chunk(2, dim=-1)[1]
    return (2 * eps(dtype) + 16 * eps_acc(dtype)) * ref.abs() + floor(dtype) * (1 + b.abs())


def swiglu_grad_reference(x, dy):
    """x in float64 with its gradient from float64 autograd, and the bound on dx: da = dy b
    silu'(a), db = dy silu(a), one rounding each, plus the compute dtype's error in silu and silu'
    (|silu''| <= 0.5): 16 eps_acc |dy| (1 + |a|) (1 + |b|)."""
    x64 = x.detach().double().requires_grad_()
    reference_swiglu(x64).backward(dy.double())
    a, b = x64.detach().chunk(2, -1)
    term = 16 * eps_acc(x.dtype) * torch.cat([dy.double().abs() * (1 + a.abs()) * (1 + b.abs())] * 2, -1)
    return x64, eps(x.dtype) * x64.grad.abs() + term + floor(x.dtype)


def swiglu_rows(rows, width, dtype, device, offset=0):
    """A contiguous [rows, width] tensor `offset` elements past the start of its allocation (which
    is 16-byte aligned): offset 1 puts every 16-byte vector of it off a boundary."""
    return torch.randn(rows * width + offset, device=device).to(dtype)[offset:].view(rows, width)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=dtype_id)
def test_swiglu_grid_rule(dtype):
    """v2's grid (forward and backward), asked for a meta tensor on GPUs of 1 to 170 SMs: one
    thread per whole 16-byte vector of the [rows, half] output; blocks of 256 threads while that
    gives every SM two blocks, else the widest of 128 and 64 that does, else 64, and never fewer
    than two warps; so from 64 x 2 SMs x 2 blocks vectors on, every SM has two blocks, however
    few the rows."""
    vector = 16 // torch.empty((), dtype=dtype).element_size()
    for sms in (1, 46, 132, 170):
        for rows in (1, 63, 64, 65, 2047, 2048, 8192):
            for half in (1, 7, 768, 777, 2048, 4099, 8192):
                kernel, threads, blocks, vectors = torch.ops.fusion.swiglu_grid(
                    torch.empty(rows, 2 * half, dtype=dtype, device="meta"), sms)
                where = (sms, rows, half)
                assert kernel == 0, where  # the forward is always the flat walk
                assert vectors == rows * half // vector, where
                assert threads in (64, 128, 256) and blocks == max(1, -(-vectors // threads)), where
                wide_enough = [t for t in (256, 128, 64) if -(-vectors // t) >= 2 * sms]
                assert threads == (wide_enough[0] if wide_enough else 64), where
                if vectors >= 64 * 2 * sms:
                    assert blocks >= 2 * sms, where
    # Nothing to launch: still one block (the launcher returns before it for an empty output).
    assert torch.ops.fusion.swiglu_grid(torch.empty(0, 8, device="meta"), 132) == [0, 64, 1, 0]
    with pytest.raises(RuntimeError, match="swiglu_grid: sms must be at least 1"):
        torch.ops.fusion.swiglu_grid(torch.empty(4, 8, device="meta"), 0)
    with pytest.raises(RuntimeError, match=r"swiglu_grid: the last dim of x \(shape \[4, 7\]\) is odd"):
        torch.ops.fusion.swiglu_grid(torch.empty(4, 7, device="meta"), 132)


def swiglu_kernel_kind(name):
    """A launched swiglu kernel's kind from its demangled name: the flat walk's plain or shifted
    instance (its third template argument, kShifted; the fourth, kUniform, is the forward's form),
    or the backward's column tiles."""
    if "swiglu_backward_tile_kernel" in name:
        return "tiles"
    assert "swiglu_flat_kernel" in name, name
    arguments = template_of(name, "swiglu_flat_kernel<")[len("swiglu_flat_kernel<"):-1].split(", ")
    return "flat shifted" if arguments[2] == "true" else "flat plain"


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
def test_swiglu_backward_choice(dtype):
    """The backward's kernel, asked through swiglu_grid(backward=True) for x at element offsets
    0 to 8 into its allocation (meta tensors: the storage offset; CPU tensors: the pointer): the
    flat walk (0, with the forward's grid) exactly where every row of x starts on a 16-byte
    boundary (half * element size a multiple of 16 and x's first element on one), else the
    column tiles of single elements (1). The forward's choice never depends on it."""
    size = torch.empty((), dtype=dtype).element_size()
    for device in ("meta", "cpu"):
        for half in (1, 7, 8, 777, 1024, 4099, 8192):
            for offset in range(9):
                x = torch.empty(3 * 2 * half + offset, dtype=dtype, device=device)[offset:].view(3, 2 * half)
                where = (device, half, offset)
                flat = half * size % 16 == 0 and offset * size % 16 == 0
                forward = torch.ops.fusion.swiglu_grid(x, 132)
                backward = torch.ops.fusion.swiglu_grid(x, 132, backward=True)
                assert forward[0] == 0, where
                assert backward == (forward if flat else [1, 0, 0, 0]), (where, forward, backward)
    # A strided x is copied first (contiguous, freshly allocated): its rows' alignment is the copy's.
    x = torch.empty(4, 2 * 1024 + 1, dtype=dtype, device="meta")[:, 1:]
    assert torch.ops.fusion.swiglu_grid(x, 132, backward=True)[0] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("half", (1, 7, 777, 4099, 8192))
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
def test_swiglu_flat_edges(dtype, half):
    """v2's flat kernel at the edges of its walk, forward and backward, against float64: 1 to 2047
    rows (one block of 64 threads to many of 256, and a row's last vector in every position);
    half 1 and 7, shorter than a vector (every vector straddles rows: single elements); 777 and
    4099 (rows at every distance from a 16-byte boundary: shifted loads, one straddling vector a
    row); 8192 (whole vectors). x and dy start on a 16-byte boundary or one element past it (the
    first vectors' shifted reads must stay inside x; dy's first elements are single ones; dy
    one off with x on one: the backward's shifted flat walk). The forward's plain kernel runs
    exactly where half is whole vectors and every pointer aligned; the backward's flat kernel
    exactly where x's rows start on 16-byte boundaries, else its column tiles. Outputs are
    poisoned first: an element the walk skipped shows as NaN."""
    require_cuda()
    vector = 16 // torch.empty((), dtype=dtype).element_size()
    for rows in (1, 63, 64, 65, 2047):
        for offset in (0, 1):
            where = (rows, half, offset)
            x = swiglu_rows(rows, 2 * half, dtype, "cuda", offset)
            ref = reference_swiglu(x)
            for version in (*EW_VERSIONS["swiglu"], None):
                poison_allocator(ref.to(dtype))
                assert_within(fusion.swiglu(x, version=version), ref, swiglu_bound(x, ref, dtype), f"{version} {where}")
            # dy one element off with x on a boundary: the backward's shifted flat walk (x one
            # element off takes the tiles, whatever dy's alignment).
            dy_offsets = (0, 1) if offset == 0 else (1,)
            dys = [swiglu_rows(rows, half, dtype, "cuda", o) for o in dy_offsets]
            if rows == 65:  # which kernels ran (one profiler session per half, dtype and x offset)
                _, kernels = launched_kernels(lambda: [fusion.swiglu(x)] + [OPS.swiglu_backward(dy, x) for dy in dys],
                                              "swiglu_")
                kernels = [k for k in kernels if "_kernel" in k]  # not the ops' own events (fusion::swiglu_backward)
                flat_rows = half % vector == 0 and offset == 0  # every row of x on a 16-byte boundary
                expected = ["flat plain" if flat_rows else "flat shifted"]  # the forward
                expected += [("flat plain" if o == 0 else "flat shifted") if flat_rows else "tiles" for o in dy_offsets]
                assert [swiglu_kernel_kind(k) for k in kernels] == expected, (where, kernels)
            for dy_offset, dy in zip(dy_offsets, dys):
                where = (rows, half, offset, dy_offset)
                x64, bound = swiglu_grad_reference(x, dy)
                poison_allocator(x64.grad.to(dtype))
                assert_within(OPS.swiglu_backward(dy, x), x64.grad, bound, f"backward {where}")
                xg = x.detach().requires_grad_()  # a view of a tensor without grad: a leaf, still misaligned
                fusion.swiglu(xg).backward(dy)
                assert_within(xg.grad, x64.grad, bound, f"autograd {where}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
def test_swiglu_forward_realigned_edges(dtype):
    """The forward's realigned loads (course::load16_realigned) at their edges, against float64:
    x 0 to 7 elements past a 16-byte boundary (every distance a vector can start at, in every
    dtype); rows 1, 7, 63, 64, 65 and 8193 (one row to more than a wave, a last vector in every
    position); half L (the shortest row of whole vectors), L + 1, 2 L - 1, 777 and 4099 (odd: a
    row's straddling vector then keeps 1 to L - 1 of its elements in the row, every count in
    turn; the rest are the next row's, from the extra realigned load at b + half). x ends at its
    allocation's end (the last rows' vectors must stay inside x: single elements there) and y is
    poisoned first: an element no path wrote shows as NaN."""
    require_cuda()
    vector = 16 // torch.empty((), dtype=dtype).element_size()
    for half in (vector, vector + 1, 2 * vector - 1, 777, 4099):
        for rows in (1, 7, 63, 64, 65, 8193):
            if rows == 8193 and half < 777:
                continue  # the short rows' straddles are already every vector or two at 65 rows
            for offset in range(8):
                where = (rows, half, offset)
                x = swiglu_rows(rows, 2 * half, dtype, "cuda", offset)
                ref = reference_swiglu(x)
                for version in ("v2", None):
                    poison_allocator(ref.to(dtype))
                    assert_within(fusion.swiglu(x, version=version), ref, swiglu_bound(x, ref, dtype),
                                  f"{version} {where}")


@pytest.mark.parametrize("activation", BIAS_OPS)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
def test_linear_low_precision_gradients(dtype, activation, device):
    k, out_features = 48, 72
    x = torch.randn(5, 7, k, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(out_features, k, device=device) / math.sqrt(k)).to(dtype).requires_grad_()
    bias = torch.randn(out_features, device=device).to(dtype).requires_grad_()
    dy = torch.randn(5, 7, out_features, device=device).to(dtype)
    if activation == "relu":
        # The 16-bit GEMM's z may land on the other side of relu's kink from the exact z where
        # |z| is within its rounding error (~1e-3 of 2500 elements): dy is zeroed there, so the
        # gradients do not depend on which side either computation took.
        z = x.detach().double() @ weight.detach().double().T + bias.detach().double()
        dy = torch.where(z.abs() < 0.05, torch.zeros_like(dy), dy)
    fusion.linear_activation(x, weight, bias, activation).backward(dy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    reference_linear(x64, w64, b64, activation).backward(dy.double())
    # dz is rounded once to the dtype (and z, kept in the dtype, was rounded once: act' moves by
    # at most |act''| eps |z|); the GEMMs then add their own k-term accumulation. A bound of
    # (8 eps + (k + 8) eps_acc) over the products of magnitudes covers both.
    e, a = eps(dtype), eps_acc(dtype)
    z64 = x64.detach() @ w64.detach().T + b64.detach()
    dz_mag = dy.double().abs() * (1 + z64.abs())
    rows = 35
    assert_within(x.grad, x64.grad, (8 * e + (out_features + 8) * a) * (dz_mag @ w64.detach().abs()) + floor(dtype),
                  "linear dx")
    assert_within(weight.grad, w64.grad,
                  (8 * e + (rows + 8) * a) * (rows_of(dz_mag).T @ rows_of(x64.detach()).abs()) + floor(dtype),
                  "linear dweight")
    assert_within(bias.grad, b64.grad, (8 * e + (2 * math.log2(rows + 1) + 8) * a) * rows_of(dz_mag).sum(0)
                  + floor(dtype), "linear dbias")


def gradcheck(fn, *inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("save", ("y", "x", "mask"))
@pytest.mark.parametrize("version", (*EW_VERSIONS["fused_bias_scale_relu"], None), ids=str)
def test_bsr_gradcheck(version, save, device):
    for shape in ((4, 37), (2, 3, 40)):
        x, bias = bias_inputs(shape, torch.float64, device)
        gradcheck(lambda a, b: fusion.fused_bias_scale_relu(a, b, SCALE, save=save, version=version),
                  x.requires_grad_(), bias.requires_grad_())


@pytest.mark.parametrize("activation", ("gelu", "gelu_tanh", "silu"))
def test_bias_activation_gradcheck(activation, device):
    for version in (*ladder_of(activation), None):
        x = torch.randn(4, 37, dtype=torch.float64, device=device, requires_grad=True)
        bias = torch.randn(37, dtype=torch.float64, device=device, requires_grad=True)
        gradcheck(lambda a, b: run_bias_op(activation, a, b, version), x, bias)


def test_swiglu_gradcheck(device):
    for version in (*EW_VERSIONS["swiglu"], None):
        x = torch.randn(3, 5, 2 * 17, dtype=torch.float64, device=device, requires_grad=True)
        gradcheck(lambda a: fusion.swiglu(a, version=version), x)


@pytest.mark.parametrize("activation", BIAS_OPS)
def test_linear_gradcheck(activation, device):
    for version in (*EW_VERSIONS["linear_activation"], None):
        x = torch.randn(2, 3, 11, dtype=torch.float64, device=device, requires_grad=True)
        weight = torch.randn(13, 11, dtype=torch.float64, device=device, requires_grad=True)
        bias = torch.randn(13, dtype=torch.float64, device=device, requires_grad=True)
        gradcheck(lambda a, w, b: fusion.linear_activation(a, w, b, activation, version=version), x, weight, bias)


# ---------------------------------------------------------------------------------------------
# 6. Determinism: bitwise equal bias gradients run to run
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_bias_gradients_are_deterministic(dtype, device):
    """Per-slot partial sums and a column reduction in a fixed order, no float atomics: the
    same bits every run. Enough rows that the GPU kernels sweep several times per slot."""
    rows = 20011 if device == "cuda" else 1031
    x, bias = bias_inputs((rows, 1000), dtype, device)
    dy = torch.randn(rows, 1000, device=device).to(dtype)
    for version in EW_VERSIONS["fused_bias_scale_relu_backward"]:
        for save in ("y", "x", "mask"):
            saved = saved_for(save, x, bias)
            first = fusion.fused_bias_scale_relu_backward(dy, saved, bias, SCALE, save, version)
            for _ in range(2):
                again = fusion.fused_bias_scale_relu_backward(dy, saved, bias, SCALE, save, version)
                assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1]), (version, save)
    for activation in ("gelu", "silu"):
        first = torch.ops.fusion.bias_activation_backward(dy, x, bias, activation)
        for _ in range(2):
            again = torch.ops.fusion.bias_activation_backward(dy, x, bias, activation)
            assert torch.equal(again[1], first[1]) and torch.equal(again[0], first[0]), activation
    z = x.reshape(rows, 1000)
    xin = torch.randn(rows, 24, device=device).to(dtype)
    weight = torch.randn(1000, 24, device=device).to(dtype)
    first = torch.ops.fusion.linear_activation_backward(dy, z, xin, weight, "gelu_tanh")
    for _ in range(2):
        again = torch.ops.fusion.linear_activation_backward(dy, z, xin, weight, "gelu_tanh")
        assert torch.equal(again[2], first[2])


# The bias gradient's tiling (course::grad_tiling): every shape of the sweep (common/coursekit/
# shapes.py) and odd ones, on GPUs of several SM counts.
GRAD_TOKENS = (1, 63, 64, 65, 2048, 8192)
GRAD_HIDDEN = (1, 8, 9, 17, 768, 777, 1026, 1024, 3072, 4099, 5120, 12288, 16384)


def row_phases(hidden, elem):
    """Rows after which a row again starts at row 0's offset within a 16-byte vector."""
    return next(p for p in (1, 2, 4, 8, 16) if p * hidden * elem % 16 == 0)


# The bench-only variants of the backward (course::grad_variant, bias_act.h): read from the
# environment by the launcher and by bias_grad_tiling.
FINISH_KNOB, ODD_KNOB = "COURSE_BIAS_GRAD_FINISH", "COURSE_BIAS_GRAD_ODD"
GRAD_VARIANTS = {"default": {}, "span": {ODD_KNOB: "span"}, "serial_finish": {FINISH_KNOB: "serial"},
                 "single_elements": {ODD_KNOB: "single"}}


def set_grad_variant(monkeypatch, variant):
    """The environment of one of GRAD_VARIANTS (the other knob unset)."""
    for knob in (FINISH_KNOB, ODD_KNOB):
        monkeypatch.delenv(knob, raising=False)
    for knob, value in GRAD_VARIANTS[variant].items():
        monkeypatch.setenv(knob, value)


def check_grad_tiling(t, tokens, hidden, elem, sms, blocks, lanes, in_flight, phases_expected):
    """course::grad_tiling's rule, for one answer t = bias_grad_tiling(x, sms, blocks) of a tokens x
    hidden gradient moved `lanes` elements a pack, in_flight rows a step."""
    tx, ty, column_tiles, row_tiles, phases, finishes = t
    packs = -(-hidden // lanes)
    where = (sms, blocks, tokens, hidden, lanes)
    assert phases == phases_expected, where
    steps = -(-tokens // (ty * in_flight))  # row tiles if every thread takes one step
    assert tx * ty == 256 and tx & (tx - 1) == 0 and ty % phases == 0, where
    assert column_tiles == -(-packs // tx) and (tx == 1 or tx // 2 < packs), where
    assert 1 <= row_tiles <= steps, where
    wave = min(blocks, 4) * sms  # the occupancy lowers the wave, never raises it past 4 an SM
    # One wave: the row tiles that fit beside the column tiles (at least one), no more than give
    # every thread one step, then the fewest with as many steps a thread.
    per_thread = -(-steps // min(steps, max(1, wave // column_tiles)))
    assert row_tiles == -(-steps // per_thread), where
    assert column_tiles * row_tiles <= max(wave, column_tiles), where
    if tokens <= 64:  # one kernel a call: no partial rows, no counters, no memset
        assert row_tiles == 1 and not finishes, where
    if tx * lanes * elem > 64:  # wider than the narrow tile: few idle lanes
        assert (column_tiles * tx - packs) * 8 <= packs, where
    # Partial rows are added in the kernel (one launch) where a counter serves every column tile
    # and the last block of each adds at most 32 partials a thread (its lanes share a column from
    # 8 columns up; below, one thread adds a column alone).
    width = tx * lanes
    per_thread = row_tiles * width / 256 if width >= 8 else row_tiles
    in_kernel = row_tiles > 1 and column_tiles <= 4096 and per_thread <= 32
    assert finishes == in_kernel, where


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=dtype_id)
def test_bias_grad_tiling_rule(dtype, monkeypatch):
    """Up to 64 tokens every hidden size is one row tile (the kernel writes dbias itself: one
    launch), rows that start mid-vector included; more rows fill one wave of the blocks the SMs
    hold (blocks_per_sm, the launched kernel's occupancy: 4 by default, 3 for GELU-erf's span
    kernel; a higher occupancy counts as 4) and no more, with the fewest row tiles that give each thread as many steps, or give
    every thread one step when there are fewer; wide tiles leave at most an eighth of
    their lanes idle; the tiles cover every column. Rows of whole vectors take 16-byte packs, two
    rows in flight a thread; other rows of at least two vectors take them too (the span kernel),
    one row in flight, in tiles whose rows are a multiple of the phases (each thread meets one
    phase of rows); shorter rows single elements, eight in flight. Partial rows are added in the
    kernel (finishes) where a counter serves each column tile and its last block adds at most 32
    partials a thread. Asked for a meta tensor on GPUs of 1 to 170 SMs, with the bench-only
    variants unset."""
    set_grad_variant(monkeypatch, "default")
    elem = torch.empty((), dtype=dtype).element_size()
    vector = 16 // elem
    for sms, blocks in ((1, 4), (46, 4), (132, 4), (132, 3), (170, 4), (170, 3), (132, 8)):
        for tokens in GRAD_TOKENS:
            for hidden in GRAD_HIDDEN:
                x = torch.empty(tokens, hidden, dtype=dtype, device="meta")
                t = torch.ops.fusion.bias_grad_tiling(x, sms, blocks)
                phased = hidden % vector != 0 and hidden >= 2 * vector
                lanes = vector if hidden % vector == 0 or phased else 1
                in_flight = 1 if phased else 2 if lanes > 1 else 8
                check_grad_tiling(t, tokens, hidden, elem, sms, blocks, lanes, in_flight,
                                  row_phases(hidden, elem) if phased else 1)
    # The sweep's odd and narrow rows at 2048 tokens, where the second launch cost most, on an
    # H100's SMs: one launch.
    for dtype_, hidden in ((torch.bfloat16, 777), (torch.bfloat16, 4099), (torch.float32, 777)):
        if dtype_ == dtype:
            x = torch.empty(2048, hidden, dtype=dtype, device="meta")
            for blocks in (3, 4):
                t = torch.ops.fusion.bias_grad_tiling(x, 132, blocks)
                assert t[3] > 1 and t[5] == 1, (hidden, blocks, t)
    with pytest.raises(RuntimeError, match="bias_grad_tiling: sms must be at least 1"):
        torch.ops.fusion.bias_grad_tiling(torch.empty(4, 8, device="meta"), 0)
    with pytest.raises(RuntimeError, match="bias_grad_tiling: blocks_per_sm must be 1 to 32"):
        torch.ops.fusion.bias_grad_tiling(torch.empty(4, 8, device="meta"), 132, 0)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=dtype_id)
def test_bias_grad_variants_rule(dtype, monkeypatch):
    """The bench-only variants, as bias_grad_tiling reports them (the tiling the launcher takes
    under them): COURSE_BIAS_GRAD_ODD=single moves rows that start mid-vector as single elements
    (one phase, eight rows in flight: the rule of single elements), and changes nothing else;
    "span", "auto", COURSE_BIAS_GRAD_FINISH ("serial" or "batched", which changes only how the
    kernel adds the partial rows) and an empty value give the default's tiling (the span
    kernel's, where rows start mid-vector); a value that names no variant is an error naming both
    knobs."""
    elem = torch.empty((), dtype=dtype).element_size()
    vector = 16 // elem
    moved = 0
    for sms, blocks in ((132, 3), (132, 4), (170, 4)):
        for tokens in GRAD_TOKENS:
            for hidden in GRAD_HIDDEN:
                x = torch.empty(tokens, hidden, dtype=dtype, device="meta")
                answers = {}
                for variant, env in (("default", {}), ("span", {ODD_KNOB: "span"}), ("empty", {ODD_KNOB: ""}),
                                     ("auto", {ODD_KNOB: "auto"}),
                                     ("serial", {FINISH_KNOB: "serial"}), ("batched", {FINISH_KNOB: "batched"}),
                                     ("single", {ODD_KNOB: "single"}),
                                     ("single_serial", {ODD_KNOB: "single", FINISH_KNOB: "serial"})):
                    for knob in (FINISH_KNOB, ODD_KNOB):
                        monkeypatch.delenv(knob, raising=False)
                    for knob, value in env.items():
                        monkeypatch.setenv(knob, value)
                    answers[variant] = torch.ops.fusion.bias_grad_tiling(x, sms, blocks)
                where = (sms, blocks, tokens, hidden)
                same = ("span", "empty", "auto", "serial", "batched")
                assert all(answers[v] == answers["default"] for v in same), where
                assert answers["single_serial"] == answers["single"], where
                phased = hidden % vector != 0 and hidden >= 2 * vector
                if phased:
                    check_grad_tiling(answers["single"], tokens, hidden, elem, sms, blocks, 1, 8, 1)
                    moved += answers["single"] != answers["default"]
                else:
                    assert answers["single"] == answers["default"], where
    assert moved > 0, "no shape here moves to single elements under COURSE_BIAS_GRAD_ODD=single"
    x = torch.empty(4, 8, device="meta")
    for knob, value in ((ODD_KNOB, "spam"), (FINISH_KNOB, "Serial")):
        set_grad_variant(monkeypatch, "default")
        monkeypatch.setenv(knob, value)
        with pytest.raises(RuntimeError, match="bias_grad_tiling: COURSE_BIAS_GRAD_FINISH must be batched or serial "
                                               "and COURSE_BIAS_GRAD_ODD auto, span or single"):
            torch.ops.fusion.bias_grad_tiling(x, 132)


def test_bias_grad_odd_rows_rule(monkeypatch):
    """Which kernel takes rows that start mid-vector (course::odd_rows_take_single, asked through
    bias_grad_odd_rows with the blocks an SM each kernel holds): the one that holds more, both
    counted at most at 4 an SM (the grid's most); at equal occupancy, the span kernel where the
    backward reads the mask beside dy, single elements where it reads y or x (as measured: the
    bytes in flight do not decide it). So GELU-erf's span kernel at 3 blocks an SM against its
    single elements' 4 goes single, ReLU through y at 4 and 4 single, through the mask span.
    COURSE_BIAS_GRAD_ODD=span or single forces one whatever the occupancy; "auto" and an empty
    value are the rule; another value is an error naming the knob."""
    def rule(save, span, single):
        span, single = min(max(span, 1), 4), min(max(single, 1), 4)
        if span != single:
            return "single" if single > span else "span"
        return "span" if save == "mask" else "single"

    monkeypatch.delenv(ODD_KNOB, raising=False)
    ask = torch.ops.fusion.bias_grad_odd_rows
    assert (ask("x", 3, 4), ask("y", 4, 4), ask("mask", 4, 4)) == ("single", "single", "span")
    assert {ask(save, span, single) for save in ("x", "y", "mask") for span, single in ((2, 4), (3, 4))} == {"single"}
    assert {ask(save, span, single) for save in ("x", "y", "mask") for span, single in ((4, 3), (8, 2))} == {"span"}
    for value in (None, "", "auto", "span", "single"):
        if value is None:
            monkeypatch.delenv(ODD_KNOB, raising=False)
        else:
            monkeypatch.setenv(ODD_KNOB, value)
        for save in ("y", "x", "mask"):
            for span in range(1, 9):
                for single in range(1, 9):
                    expected = value if value in ("span", "single") else rule(save, span, single)
                    assert ask(save, span, single) == expected, (value, save, span, single)
    monkeypatch.setenv(ODD_KNOB, "Single")
    with pytest.raises(RuntimeError, match="bias_grad_odd_rows: COURSE_BIAS_GRAD_ODD must be auto, span or single"):
        ask("y", 4, 4)
    monkeypatch.delenv(ODD_KNOB)
    with pytest.raises(RuntimeError, match="bias_grad_odd_rows: blocks an SM must be 1 to 32"):
        ask("y", 0, 4)
    with pytest.raises(RuntimeError, match="save"):
        ask("z", 4, 4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_bias_gradient_tiles_at_their_boundaries(dtype):
    """The fused backward at one row tile (dbias written by the kernel: no column_sum launched)
    and just past it (partial rows added by the kernel's last blocks, or by course::column_sum:
    bias_grad_tiling's finishes), at hidden sizes of whole
    vectors, of rows that start mid-vector (the span kernel: 4099 and 777 in every dtype, one
    row tile at 64 tokens and partial rows at 2048, and 9 and 17 where they are at least two
    vectors: a span's two ends and the row's last pack with at most one whole vector between), of
    single elements and of a row narrower than a tile; through every saved kind, and through
    chapter 4's autograd at the sweep's 64 x 3072 and, rows that start mid-vector, 64 and 2048 x
    4099."""
    require_cuda()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for tokens in GRAD_TOKENS[:-1]:
        for hidden in (8, 9, 17, 768, 777, 3072, 4099):
            shape = (tokens, hidden)
            x, bias = bias_inputs(shape, dtype, "cuda")
            dy = torch.randn(shape, device="cuda").to(dtype)
            dx_ref, g = bsr_backward_reference(dy, x, bias)
            for save in ("y", "x", "mask"):
                saved = saved_for(save, x, bias)
                dx, dbias = fusion.fused_bias_scale_relu_backward(dy, saved, bias, SCALE, save, None)
                where = f"{shape} save={save}"
                assert_within(dx, dx_ref, 2 * eps(dtype) * dx_ref.abs() + floor(dtype), f"dx {where}")
                assert_within(dbias, g.sum(0), column_sum_bound(g, dtype, tokens), f"dbias {where}")
            # The launches (under the profiler, once a shape): column_sum only past one row tile.
            mask = saved_for("mask", x, bias)
            _, kernels = launched_kernels(lambda: fusion.fused_bias_scale_relu_backward(dy, mask, bias, SCALE, "mask"),
                                          "course")
            phases = torch.ops.fusion.bias_grad_tiling(x, sms)[4]
            # The grid is sized to the launched kernel's occupancy, which this test does not see:
            # the launches are checked where every occupancy of 2 to 8 blocks an SM agrees on
            # partial rows (all but a few at 65 tokens, where the tile's width turns on it).
            partial = {torch.ops.fusion.bias_grad_tiling(x, sms, b)[3] > 1 for b in range(2, 9)}
            # The kernel that ran: the span kernel exactly where the rule says the rows start
            # mid-vector, the tile kernel elsewhere.
            backward = [k for k in kernels if "act_backward_" in k]
            assert backward and all(("act_backward_span_kernel" in k) == (phases > 1) for k in backward), (
                shape, phases, backward)
            # column_sum's launch only where partial rows are left to it: not where the kernel's
            # last blocks add them (finishes).
            second = {t[3] > 1 and not t[5] for t in (torch.ops.fusion.bias_grad_tiling(x, sms, b) for b in range(2, 9))}
            if len(second) == 1:
                assert any("column_reduce" in k for k in kernels) in second, (shape, second, kernels)
    if dtype != torch.float64:
        for shape in ((64, 3072), (64, 4099), (2048, 4099)):
            x, bias = bias_inputs(shape, dtype, "cuda")
            x.requires_grad_()
            bias.requires_grad_()
            dy = torch.randn(shape, device="cuda").to(dtype)
            fusion.fused_bias_scale_relu(x, bias, SCALE, save="y").backward(dy)
            dx_ref, g = bsr_backward_reference(dy, x.detach(), bias.detach())
            assert_within(x.grad, dx_ref, 2 * eps(dtype) * dx_ref.abs() + floor(dtype), f"dx autograd {shape}")
            assert_within(bias.grad, g.sum(0), column_sum_bound(g, dtype, shape[0]), f"dbias autograd {shape}")


def check_activation_grads(activation, shape, dtype):
    """A bias-activation op's dx and dbias through autograd at one CUDA shape, against float64
    within the bounds act_grad_bounds gives for the dtype and row count. Returns the inputs and dy."""
    x = torch.randn(shape, device="cuda").to(dtype).requires_grad_()
    bias = torch.randn(shape[-1], device="cuda").to(dtype).requires_grad_()
    dy = torch.randn(shape, device="cuda").to(dtype)
    run_bias_op(activation, x, bias, None).backward(dy)
    x64 = x.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_()
    reference_act(x64 + b64, activation).backward(dy.double())
    dx_bound, db_bound = act_grad_bounds(dy, (x64 + b64).detach(), x64.grad, dtype, shape[0])
    assert_within(x.grad, x64.grad, dx_bound, f"{activation} dx {shape}")
    assert_within(bias.grad, b64.grad, db_bound, f"{activation} dbias {shape}")
    return x, bias, dy


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
@pytest.mark.parametrize("activation", ("gelu", "silu"))
def test_smooth_activation_gradients_at_odd_widths(activation, dtype, monkeypatch):
    """bias_gelu's and bias_silu's backward where rows start mid-vector, on each kernel that can
    take them (COURSE_BIAS_GRAD_ODD: the span kernel, which recomputes z from x and the bias, read
    element by element at a span's ends; single elements; and the launcher's own pick): one row
    tile at 64 tokens, partial rows at 2048, hidden 777 and 4099, against float64."""
    require_cuda()
    for odd in ("span", "single", "auto"):
        monkeypatch.setenv(ODD_KNOB, odd)
        for shape in ((64, 777), (64, 4099), (2048, 777), (2048, 4099)):
            check_activation_grads(activation, shape, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=dtype_id)
def test_gelu_gradient_grid_in_one_wave(dtype, monkeypatch):
    """The fused backward's grid is one wave of the launched kernel's occupancy (3 blocks an SM for
    GELU-erf's span kernel where its 80 registers allow no more): row counts whose row tiles, rounded
    down to that wave, leave some threads a step more than others (2047, 2048 and 2049 tokens of
    hidden 777 and 4099, rows that start mid-vector; 2049 x 3072, whole vectors), and a row so wide
    that its column tiles alone pass the wave (70 x 200003: one row tile, a column tile a block),
    against float64. The span kernel named (COURSE_BIAS_GRAD_ODD=span), so that bias_grad_tiling
    reports the tiling launched (single elements' grid: test_bias_gradient_variants_at_their_boundaries)."""
    require_cuda()
    monkeypatch.setenv(ODD_KNOB, "span")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(2047, 777), (2048, 4099), (2049, 4099), (2049, 3072), (70, 200003)]
    wide = torch.empty(shapes[-1], dtype=dtype, device="meta")
    assert all(torch.ops.fusion.bias_grad_tiling(wide, sms, b)[2] > b * sms for b in (3, 4)), "the wide case"
    for shape in shapes:
        x, bias, dy = check_activation_grads("gelu", shape, dtype)
        # What ran (the backward op itself, under the profiler): the span kernel exactly where
        # rows start mid-vector, and column_sum's kernel exactly where the rule at every occupancy
        # of 2 to 8 blocks an SM leaves partial rows.
        _, kernels = launched_kernels(
            lambda: torch.ops.fusion.bias_activation_backward(dy, x.detach(), bias.detach(), "gelu"), "course")
        tilings = [torch.ops.fusion.bias_grad_tiling(x, sms, b) for b in range(2, 9)]
        phases = tilings[0][4]
        backward = [k for k in kernels if "act_backward_" in k]
        assert backward and all(("act_backward_span_kernel" in k) == (phases > 1) for k in backward), (shape, kernels)
        second = {t[3] > 1 and not t[5] for t in tilings}  # partial rows left to column_sum
        assert len(second) == 1 and any("column_reduce" in k for k in kernels) in second, (shape, second, kernels)


FINISH_SHAPES = ((65, 4099), (2047, 1), (2047, 7), (2047, 777), (2048, 4099), (2047, 12288), (8192, 777))


@pytest.mark.cuda
def test_bias_gradient_finish_on_two_streams_at_once(monkeypatch):
    """The in-kernel finish's counters are each call's own: backward calls running at the same
    time on two streams, each on shapes whose partial rows the kernel adds itself, give the bits
    each gives alone. (Counters shared by every launch would count the other call's blocks: a
    block would add partial rows not yet written, or no block would see its tile complete.) Rows
    that start mid-vector on the span kernel (COURSE_BIAS_GRAD_ODD=span: the tiling
    bias_grad_tiling reports)."""
    require_cuda()
    monkeypatch.setenv(ODD_KNOB, "span")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = []
    for shape in FINISH_SHAPES:
        xr, br = bias_inputs(shape, torch.bfloat16, "cuda")
        y = fusion.fused_bias_scale_relu(xr, br, SCALE)
        if not all(t[5] for t in (torch.ops.fusion.bias_grad_tiling(y, sms, b) for b in range(2, 9))):
            continue  # column_sum adds this one's partial rows: no counters
        dy = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        alone = fusion.fused_bias_scale_relu_backward(dy, y, br, SCALE, "y", None)
        cases.append((dy, y, br, alone))
    assert len(cases) >= 2, "fewer than two shapes here finish their bias gradient in the kernel"
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in cases]
    for _ in range(20):
        outs = [None] * len(cases)
        for i, (stream, (dy, y, br, _)) in enumerate(zip(streams, cases)):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                outs[i] = fusion.fused_bias_scale_relu_backward(dy, y, br, SCALE, "y", None)
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for out, (_, _, _, alone) in zip(outs, cases):
            assert all(torch.equal(a, b) for a, b in zip(out, alone))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=dtype_id)
def test_bias_gradient_finished_in_kernel(dtype, monkeypatch):
    """Partial rows added by the backward kernel's last block of each column tile (an atomic
    counter a column tile, the call's own, zeroed on its stream before the kernel): ReLU (saved
    y) and GELU-erf (saved x) against float64 at rows 65 to 8192 and hidden 1, 7, 777, 4099 and 12288; the same bits on a
    second eager run (whichever block comes last, the sum's order is fixed); no column_sum launch
    where bias_grad_tiling says the kernel finishes; and a CUDA graph of both backwards replayed
    twice equals the eager run bitwise (the graph's memset zeroes the counters for every replay).
    Rows that start mid-vector on the span kernel (COURSE_BIAS_GRAD_ODD=span: the tiling
    bias_grad_tiling reports)."""
    require_cuda()
    monkeypatch.setenv(ODD_KNOB, "span")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    finished = 0
    for shape in FINISH_SHAPES:
        x, bias, dy = check_activation_grads("gelu", shape, dtype)
        x, bias = x.detach(), bias.detach()
        xr, br = bias_inputs(shape, dtype, "cuda")  # ReLU's inputs: z kept off zero
        y = fusion.fused_bias_scale_relu(xr, br, SCALE)
        dx_ref, g = bsr_backward_reference(dy, xr, br)

        def step():
            dx_r, db_r = fusion.fused_bias_scale_relu_backward(dy, y, br, SCALE, "y", None)
            dx_g, db_g = torch.ops.fusion.bias_activation_backward(dy, x, bias, "gelu")
            return dx_r, db_r, dx_g, db_g

        eager = step()
        assert_within(eager[0], dx_ref, 2 * eps(dtype) * dx_ref.abs() + floor(dtype), f"dx {shape}")
        assert_within(eager[1], g.sum(0), column_sum_bound(g, dtype, shape[0]), f"dbias {shape}")
        again = step()
        assert all(torch.equal(a, b) for a, b in zip(eager, again)), shape
        tilings = [torch.ops.fusion.bias_grad_tiling(x, sms, b) for b in range(2, 9)]
        second = {t[3] > 1 and not t[5] for t in tilings}
        if len(second) == 1:
            _, kernels = launched_kernels(step, "course")
            assert any("column_reduce" in k for k in kernels) in second, (shape, second, kernels)
        finished += all(t[5] for t in tilings)
        replays = replayed_outputs(step, 2)
        for replay, captured in enumerate(replays):
            assert all(torch.equal(c, e) for c, e in zip(captured, eager)), (shape, replay)
    assert finished >= 2, "no shape here finishes its bias gradient in the kernel"


def finish_limit_widths(tokens, dtype, sms):
    """Two adjacent hidden sizes at `tokens` rows, the first whose partial rows the kernel adds
    itself at every occupancy of 2 to 8 blocks an SM, the next whose partial rows it leaves to
    column_sum at every one: where the finish's count of partials a thread passes its limit
    (bias_grad_tiling's finishes, on this GPU's SMs). None if no such pair lies below 20000."""
    def finishes(hidden):
        x = torch.empty(tokens, hidden, dtype=dtype, device="meta")
        return {torch.ops.fusion.bias_grad_tiling(x, sms, b)[5] for b in range(2, 9)}
    before = finishes(8)
    for hidden in range(9, 20000):
        now = finishes(hidden)
        if before == {1} and now == {0}:
            return hidden - 1, hidden
        before = now
    return None


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_bias_gradient_variants_at_their_boundaries(dtype, monkeypatch):
    """Each bench-only variant of the fused backward (GRAD_VARIANTS: the default; the span kernel
    forced for rows that start mid-vector; the in-kernel
    finish's serial form, a fence in every thread and one partial row at a time; rows that start
    mid-vector on single elements) at 1, 63, 64, 65 and 2048 tokens of hidden 7, 777 and 4099 and
    of the two widths either side of where the finish's partial rows pass its limit
    (finish_limit_widths): fused_bias_scale_relu's backward through every saved kind and
    GELU-erf's against float64, x and the bias also as views one element into their storage
    (single elements: the tile kernel); the kernel that ran is the span kernel exactly where the
    variant's tiling has phases (where the variant names the kernel); the serial and the batched finish give the same bits (the same
    sums in the same order, whichever block adds them); and a CUDA graph of the backwards at 2048
    tokens replayed twice gives the eager bits under every variant."""
    require_cuda()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    limit = finish_limit_widths(2048, dtype, sms)
    assert limit is not None, f"no width below 20000 where the finish gives way to column_sum on {sms} SMs"
    widths = (7, 777, 4099, *limit)
    results = {}
    for variant in GRAD_VARIANTS:
        set_grad_variant(monkeypatch, variant)
        torch.manual_seed(11)  # the same inputs for every variant
        for tokens in (1, 63, 64, 65, 2048):
            for hidden in widths:
                for offset in (0, 1):
                    shape = (tokens, hidden)
                    x0, b0 = bias_inputs(shape, dtype, "cuda")
                    x, bias = offset_copy(x0, offset), offset_copy(b0, offset)
                    dy = torch.randn(shape, device="cuda").to(dtype)
                    where = f"{variant} {shape} offset {offset}"
                    dx_ref, g = bsr_backward_reference(dy, x, bias)
                    dbiases = []  # the finish adds dbias alone: dx is each element's own
                    for save in ("y", "x", "mask"):
                        saved = saved_for(save, x, bias)
                        dx, dbias = fusion.fused_bias_scale_relu_backward(dy, saved, bias, SCALE, save, None)
                        assert_within(dx, dx_ref, 2 * eps(dtype) * dx_ref.abs() + floor(dtype), f"dx {where} {save}")
                        assert_within(dbias, g.sum(0), column_sum_bound(g, dtype, tokens), f"dbias {where} {save}")
                        dbiases.append(dbias)
                    xg = torch.randn(shape, device="cuda").to(dtype)
                    x64 = xg.detach().double().requires_grad_()
                    b64 = bias.detach().double().requires_grad_()
                    reference_act(x64 + b64, "gelu").backward(dy.double())
                    dx, dbias = torch.ops.fusion.bias_activation_backward(dy, xg, bias, "gelu")
                    dx_bound, db_bound = act_grad_bounds(dy, (x64 + b64).detach(), x64.grad, dtype, tokens)
                    assert_within(dx, x64.grad, dx_bound, f"gelu dx {where}")
                    assert_within(dbias, b64.grad, db_bound, f"gelu dbias {where}")
                    results[variant, shape, offset] = dbiases + [dbias]
                    if offset == 0 and tokens == 2048 and variant != "default":
                        # The kernel that ran: the span kernel exactly where this variant's
                        # tiling has phases (rows that start mid-vector moved as 16-byte packs).
                        # (Where the variant leaves the odd-width kernel to the rule, as the
                        # default and the serial finish do, it picks by both kernels' occupancy,
                        # which this test does not see: test_bias_grad_odd_rows_rule.)
                        if ODD_KNOB in GRAD_VARIANTS[variant]:
                            _, kernels = launched_kernels(
                                lambda: torch.ops.fusion.bias_activation_backward(dy, xg, bias, "gelu"), "course")
                            phases = torch.ops.fusion.bias_grad_tiling(xg, sms)[4]
                            backward = [k for k in kernels if "act_backward_" in k]
                            assert backward and all(("act_backward_span_kernel" in k) == (phases > 1) for k in backward), (
                                where, phases, backward)
                        y = saved_for("y", x, bias)

                        def step():
                            return (*fusion.fused_bias_scale_relu_backward(dy, y, bias, SCALE, "y", None),
                                    *torch.ops.fusion.bias_activation_backward(dy, xg, bias, "gelu"))

                        eager = step()
                        for replay, captured in enumerate(replayed_outputs(step, 2)):
                            assert all(torch.equal(c, e) for c, e in zip(captured, eager)), (where, replay)
    for key, dbiases in results.items():
        if key[0] == "serial_finish":
            batched = results[("default", *key[1:])]
            assert all(torch.equal(a, b) for a, b in zip(dbiases, batched)), key


# ---------------------------------------------------------------------------------------------
# 7. Empty tensors
# ---------------------------------------------------------------------------------------------
def test_empty_tensors(device):
    for shape in ((0, 1000), (3, 0), (2, 0, 7)):
        x = torch.randn(shape, device=device, requires_grad=True)
        bias = torch.randn(shape[-1], device=device, requires_grad=True)
        for activation in BIAS_OPS:
            for version in (*ladder_of(activation), None):
                y = run_bias_op(activation, x, bias, version)
                assert y.shape == x.shape
            run_bias_op(activation, x, bias, None).sum().backward()
            assert x.grad.shape == x.shape and torch.equal(bias.grad, torch.zeros_like(bias))
            x.grad = bias.grad = None
        dx, dbias = fusion.fused_bias_scale_relu_backward(x.detach(), x.detach(), bias.detach(), SCALE, "x")
        assert dx.shape == x.shape and torch.equal(dbias, torch.zeros_like(bias))
        mask = torch.ops.fusion.fused_bias_scale_relu_forward(x.detach(), bias.detach(), SCALE, "mask")[1]
        assert mask.shape == (math.prod(shape[:-1]), (shape[-1] + 31) // 32)
    x = torch.randn(0, 6, device=device, requires_grad=True)
    assert fusion.swiglu(x).shape == (0, 3)
    fusion.swiglu(x).sum().backward()
    assert x.grad.shape == (0, 6)
    weight = torch.randn(5, 6, device=device, requires_grad=True)
    bias = torch.randn(5, device=device, requires_grad=True)
    out = fusion.linear_activation(x, weight, bias, "silu")
    assert out.shape == (0, 5)
    out.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(bias.grad, torch.zeros_like(bias))


# ---------------------------------------------------------------------------------------------
# 8. Misuse
# ---------------------------------------------------------------------------------------------
def _t(*shape, device, dtype=torch.float32):
    return torch.randn(shape, device=device).to(dtype)


MISUSES = {
    "bias wrong length": (lambda d: fusion.fused_bias_scale_relu(_t(3, 4, device=d), _t(5, device=d), 1.0),
                          r"fused_bias_scale_relu: bias has shape \[5\] but x has shape \[3, 4\]"),
    "bias 2-D": (lambda d: fusion.bias_gelu(_t(3, 4, device=d), _t(1, 4, device=d)),
                 r"bias_gelu: bias has shape \[1, 4\] but x has shape \[3, 4\]"),
    "bias wrong dtype": (lambda d: fusion.bias_silu(_t(3, 4, device=d), _t(4, device=d, dtype=torch.float16)),
                         r"bias_silu: x is Float but bias is Half"),
    "bias on another device": (lambda d: fusion.fused_bias_scale_relu(_t(3, 4, device=d), _t(4, device="meta"), 1.0),
                               r"fused_bias_scale_relu: x is on \w+(:\d)? but bias is on meta"),
    "integer x": (lambda d: fusion.fused_bias_scale_relu(torch.ones(3, 4, dtype=torch.int32, device=d),
                                                         torch.ones(4, dtype=torch.int32, device=d), 1.0),
                  r"fused_bias_scale_relu: x has dtype Int, which is not supported"),
    "integer swiglu": (lambda d: fusion.swiglu(torch.ones(3, 4, dtype=torch.int64, device=d)),
                       r"swiglu: x has dtype Long, which is not supported"),
    "0-d x": (lambda d: fusion.bias_silu(torch.tensor(1.0, device=d), _t(1, device=d)),
              r"bias_silu: x is 0-d"),
    "unknown save": (lambda d: fusion.fused_bias_scale_relu(_t(3, 4, device=d), _t(4, device=d), 1.0, save="z"),
                     r"fused_bias_scale_relu: unknown save 'z'; expected one of y, x, mask"),
    "unknown version": (lambda d: fusion.fused_bias_scale_relu(_t(3, 4, device=d), _t(4, device=d), 1.0,
                                                               version="v4"),
                        r"fused_bias_scale_relu: unknown version 'v4'; expected one of v1, v2, v3"),
    "unknown backward version": (lambda d: fusion.fused_bias_scale_relu_backward(
        _t(3, 4, device=d), _t(3, 4, device=d), _t(4, device=d), 1.0, "x", "v3"),
        r"fused_bias_scale_relu_backward: unknown version 'v3'; expected one of v1, v2"),
    "backward mask of the wrong shape": (lambda d: fusion.fused_bias_scale_relu_backward(
        _t(3, 40, device=d), torch.zeros(3, 1, dtype=torch.int32, device=d), _t(40, device=d), 1.0, "mask"),
        r"fused_bias_scale_relu_backward: the mask has shape \[3, 1\]"),
    "backward mask not int32": (lambda d: fusion.fused_bias_scale_relu_backward(
        _t(3, 4, device=d), _t(3, 1, device=d), _t(4, device=d), 1.0, "mask"),
        r"fused_bias_scale_relu_backward: with save='mask', saved is the int32 mask"),
    "backward saved of the wrong shape": (lambda d: fusion.fused_bias_scale_relu_backward(
        _t(3, 4, device=d), _t(4, 3, device=d), _t(4, device=d), 1.0, "y"),
        r"fused_bias_scale_relu_backward: grad has shape \[3, 4\] but saved has shape \[4, 3\]"),
    "unknown approximate": (lambda d: fusion.bias_gelu(_t(3, 4, device=d), _t(4, device=d), "erf"),
                            r"bias_gelu: unknown approximate 'erf'; expected one of none, tanh"),
    "unknown activation version": (lambda d: fusion.bias_gelu(_t(3, 4, device=d), _t(4, device=d), version="v3"),
                                   r"bias_gelu: unknown version 'v3'; expected one of v1, v2"),
    "swiglu odd": (lambda d: fusion.swiglu(_t(3, 5, device=d)),
                   r"swiglu: the last dim of x \(shape \[3, 5\]\) is odd"),
    "swiglu unknown version": (lambda d: fusion.swiglu(_t(3, 4, device=d), version="fused"),
                               r"swiglu: unknown version 'fused'"),
    "linear unknown activation": (lambda d: fusion.linear_activation(_t(3, 4, device=d), _t(5, 4, device=d),
                                                                     _t(5, device=d), "tanh"),
                                  r"linear_activation: unknown activation 'tanh'; expected one of relu, gelu, "
                                  r"gelu_tanh, silu"),
    "linear unknown version": (lambda d: fusion.linear_activation(_t(3, 4, device=d), _t(5, 4, device=d),
                                                                  _t(5, device=d), "relu", version="v2"),
                               r"linear_activation: unknown version 'v2'; expected one of unfused, fused_epilogue"),
    "linear weight shape": (lambda d: fusion.linear_activation(_t(3, 4, device=d), _t(4, 5, device=d),
                                                               _t(4, device=d), "relu"),
                            r"linear_activation: weight has shape \[4, 5\] but x has shape \[3, 4\]"),
    "linear bias length": (lambda d: fusion.linear_activation(_t(3, 4, device=d), _t(5, 4, device=d),
                                                              _t(4, device=d), "relu"),
                           r"linear_activation: bias has shape \[4\] but weight has shape \[5, 4\]"),
    "linear bias dtype": (lambda d: fusion.linear_activation(_t(3, 4, device=d), _t(5, 4, device=d),
                                                             _t(5, device=d, dtype=torch.float64), "relu"),
                          r"linear_activation: x is Float but bias is Double"),
    "linear weight on another device": (lambda d: fusion.linear_activation(_t(3, 4, device=d), _t(5, 4, device="meta"),
                                                                           _t(5, device=d), "relu"),
                                        r"linear_activation: x is on \w+(:\d)? but weight is on meta"),
    "default_choice unknown op": (lambda d: fusion.elementwise_default_choice("bias_tanh", _t(3, 4, device=d)),
                                  r"elementwise_default_choice: unknown op 'bias_tanh'"),
}


@pytest.mark.parametrize("misuse", list(MISUSES))
def test_misuse_raises_clear_error(misuse, device):
    call, message = MISUSES[misuse]
    with pytest.raises(RuntimeError, match=message):
        call(device)


@pytest.mark.cuda
def test_mixed_cpu_and_cuda_raise():
    require_cuda()
    with pytest.raises(RuntimeError, match=r"fused_bias_scale_relu: x is on cuda:\d but bias is on cpu"):
        fusion.fused_bias_scale_relu(torch.randn(3, 4, device="cuda"), torch.randn(4), 1.0)
    with pytest.raises(RuntimeError, match=r"bias_gelu: x is on cpu but bias is on cuda:\d"):
        fusion.bias_gelu(torch.randn(3, 4), torch.randn(4, device="cuda"))
    with pytest.raises(RuntimeError, match=r"linear_activation: x is on cuda:\d but bias is on cpu"):
        fusion.linear_activation(torch.randn(3, 4, device="cuda"), torch.randn(5, 4, device="cuda"),
                                 torch.randn(5), "relu")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=dtype_id)
@pytest.mark.parametrize("save", ("y", "x", "mask"))
def test_relu_gradient_passes_at_nan(save, dtype, device):
    """At a NaN input relu's gradient passes through, as torch's threshold_backward lets it
    (the rule is "x <= 0 gives 0", and NaN <= 0 is false): dx is dy * scale there, not 0, and
    dbias counts it. Where relu is flat an infinite dy gives 0, not inf * 0 = NaN."""
    x, bias = bias_inputs((4, 96), dtype, device)  # no sign can flip between eager and fused
    x[0, 3] = float("nan")
    x[2, 50] = -16.0
    bias[50] = 0.0
    xg, bg = x.clone().requires_grad_(), bias.clone().requires_grad_()
    dy = torch.randn(4, 96, dtype=dtype, device=device)
    dy[2, 50] = float("inf")
    fusion.fused_bias_scale_relu(xg, bg, SCALE, save=save).backward(dy)
    xr, br = x.clone().requires_grad_(), bias.clone().requires_grad_()
    torch.relu(xr * SCALE + br).backward(dy)
    assert xg.grad[0, 3] == dy[0, 3] * SCALE and xr.grad[0, 3] == xg.grad[0, 3]
    assert xg.grad[2, 50] == 0 and xr.grad[2, 50] == 0
    torch.testing.assert_close(xg.grad, xr.grad, equal_nan=True)
    torch.testing.assert_close(bg.grad.double(), br.grad.double(), equal_nan=True, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_linear_activation_bias_may_be_none(dtype, device):
    """bias=None as F.linear takes it; x's and weight's gradients flow."""
    x = torch.randn(33, 64, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(40, 64, dtype=dtype, device=device, requires_grad=True)
    out = fusion.linear_activation(x, w, None, "gelu")
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ref = F.gelu(F.linear(x64, w64))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.double(), ref.detach(), rtol=tol, atol=tol)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol * 8)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=tol, atol=tol * 8)


# The edges of the fused kernels' paths: row counts around the narrow tile's 64 rows and around
# 256 (one thread a row of a tile, one row tile, then several), widths of one element, of less than
# a vector, that start rows mid-vector (777, 4099: the span kernel, and the forward's bias read in
# aligned windows) and a wide one.
EDGE_ROWS = (1, 7, 63, 64, 65, 255, 257)
EDGE_WIDTHS = (1, 7, 777, 4099, 16384)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=dtype_id)
def test_bias_ops_at_edge_rows_and_widths(dtype):
    """fused_bias_scale_relu (mask and y saved) and bias_gelu, forward and both gradients through
    autograd, against float64 at every edge row count and width: the flat forward with the bias in
    aligned windows or single elements where a vector wraps into the next row, the backward's tile
    and span kernels with their sums added in shared memory (rows padded against bank
    conflicts), one row tile up to 64 rows and partial rows past it."""
    require_cuda()
    for rows in EDGE_ROWS:
        for hidden in EDGE_WIDTHS:
            shape = (rows, hidden)
            x, bias = bias_inputs(shape, dtype, "cuda")
            ref = reference_bias_act(x, bias, "relu", SCALE)
            out = fusion.fused_bias_scale_relu(x, bias, SCALE)
            assert_within(out, ref, act_bound(x, bias, SCALE, ref, dtype), f"relu forward {shape}")
            dy = torch.randn(shape, device="cuda").to(dtype)
            dx_ref, g = bsr_backward_reference(dy, x, bias)
            for save in ("mask", "y"):
                xg, bg = x.clone().requires_grad_(), bias.clone().requires_grad_()
                fusion.fused_bias_scale_relu(xg, bg, SCALE, save=save).backward(dy)
                assert_within(xg.grad, dx_ref, 2 * eps(dtype) * dx_ref.abs() + floor(dtype), f"dx {save} {shape}")
                assert_within(bg.grad, g.sum(0), column_sum_bound(g, dtype, rows), f"dbias {save} {shape}")
            check_activation_grads("gelu", shape, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=dtype_id)
def test_bias_ops_on_offset_views(dtype):
    """Operands that do not start on a 16-byte boundary: x a view one element into its storage
    (the flat forward's head; the backward's single elements or phases), the bias a view one
    element in (the forward gathers it element by element instead of in aligned windows), and
    both; forward and gradients of ReLU and GELU against float64."""
    require_cuda()
    for rows, hidden in ((1, 7), (63, 777), (64, 4099), (65, 4099), (257, 777), (64, 16384)):
        for x_off, b_off in ((1, 0), (0, 1), (1, 1), (3, 5)):
            shape = (rows, hidden)
            where = (shape, x_off, b_off)
            x0, b0 = bias_inputs(shape, dtype, "cuda")
            x = torch.empty(rows * hidden + x_off, dtype=dtype, device="cuda")[x_off:].view(shape)
            x.copy_(x0)
            bias = torch.empty(hidden + b_off, dtype=dtype, device="cuda")[b_off:]
            bias.copy_(b0)
            for activation in ("relu", "gelu"):
                scale = SCALE if activation == "relu" else 1.0
                ref = reference_bias_act(x, bias, activation, scale)
                out = run_bias_op(activation, x, bias, None)
                assert_within(out, ref, act_bound(x, bias, scale, ref, dtype), f"{activation} forward {where}")
            dy = torch.randn(shape, device="cuda").to(dtype)
            dx_ref, g = bsr_backward_reference(dy, x, bias)
            xg, bg = x.detach().requires_grad_(), bias.detach().requires_grad_()
            fusion.fused_bias_scale_relu(xg, bg, SCALE, save="x").backward(dy)
            assert_within(xg.grad, dx_ref, 2 * eps(dtype) * dx_ref.abs() + floor(dtype), f"dx {where}")
            assert_within(bg.grad, g.sum(0), column_sum_bound(g, dtype, rows), f"dbias {where}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_bias_ops_under_a_cuda_graph(dtype):
    """Forward and backward of ReLU and GELU captured in one CUDA graph at few rows and odd widths
    (one row tile; the forward's windows) and at rows past a row tile (partial rows, the finish's
    counters zeroed in the graph): every replay equals the eager run bitwise."""
    require_cuda()
    for shape in ((64, 4099), (7, 777), (65, 4099), (257, 16384), (2048, 777)):
        x, bias = bias_inputs(shape, dtype, "cuda")
        dy = torch.randn(shape, device="cuda").to(dtype)

        def step():
            xg, bg = x.detach().requires_grad_(), bias.detach().requires_grad_()
            y = fusion.fused_bias_scale_relu(xg, bg, SCALE)
            dx, db = torch.autograd.grad(y, (xg, bg), dy)
            xh, bh = x.detach().requires_grad_(), bias.detach().requires_grad_()
            h = fusion.bias_gelu(xh, bh, "none")
            dxh, dbh = torch.autograd.grad(h, (xh, bh), dy)
            return y.detach(), dx, db, h.detach(), dxh, dbh

        eager = step()
        replays = replayed_outputs(step, 2)
        for replay, captured in enumerate(replays):
            assert all(torch.equal(c, e) for c, e in zip(captured, eager)), (shape, replay)


# The kernel each name of bias_forward_kernel launches ("tiles": the column tiles' kernel).
FORWARD_KERNELS = {"tiles": "course::bias_act_tile_kernel<", "flat": "course::bias_act_flat_kernel<"}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=dtype_id)
def test_flat_kernel_runs_where_it_applies(dtype):
    """v3 (version=None) launches the flat kernel wherever the operands' vectors pair up: rows of
    whole vectors that fill the tiles (hidden 1024, 4096) as well as those that would leave a
    tile's lanes idle (768) or are not whole vectors (4099); the tiles' single elements for a mask
    on rows that are not whole 32-bit words; the column tiles for GELU-erf (four rows in flight)
    on rows that fill them. A mask is written only when a gradient is needed."""
    require_cuda()
    for shape, mask, expected in (((64, 768), False, "bias_act_flat_kernel"), ((33, 4099), False, "bias_act_flat_kernel"),
                                  ((64, 768), True, "bias_act_flat_kernel"), ((33, 4099), True, "bias_act_tile_kernel"),
                                  ((64, 4096), False, "bias_act_flat_kernel"), ((64, 1024), True, "bias_act_flat_kernel")):
        x, bias = bias_inputs(shape, dtype, "cuda")
        x.requires_grad_(mask)  # the mask is written only when a gradient is needed
        _, kernels = launched_kernels(lambda: fusion.fused_bias_scale_relu(x, bias, SCALE), "course")
        assert any(expected in k for k in kernels), (shape, mask, kernels)
    # GELU-erf: the tiles only where their grid fills a wave of this GPU (bias_forward_kernel),
    # not at 64 tokens, where four rows a thread left a few dozen blocks.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape, expected in (((64, 4096), "flat"), ((64, 768), "flat"), ((8192, 1024), "tiles")):
        x, bias = bias_inputs(shape, dtype, "cuda")
        assert torch.ops.fusion.bias_forward_kernel(x, "gelu", sms) == expected, (shape, sms)
        _, kernels = launched_kernels(lambda: fusion.bias_gelu(x, bias, "none"), "course")
        assert any(FORWARD_KERNELS[expected] in k for k in kernels), (shape, "gelu", kernels)


FORWARD_TOKENS = (1, 63, 64, 65, 2047, 2048, 8192)
FORWARD_HIDDEN = (1, 7, 768, 777, 1024, 2048, 4096, 4099, 12288)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=dtype_id)
def test_bias_forward_kernel_rule(dtype):
    """The fused forward's kernel (course::launch_bias_act) asked without a GPU: the column tiles
    only for GELU-erf (four rows in flight a thread), on rows of whole vectors that fill every
    tile, and only where the tiles' grid (column tiles by rows over four rows a thread, up to
    65535 row tiles) fills 4 blocks on every SM; the flat kernel everywhere else. Meta tensors,
    GPUs of 1 to 170 SMs."""
    vector = 16 // torch.empty((), dtype=dtype).element_size()
    for sms in (1, 46, 132, 170):
        for tokens in FORWARD_TOKENS:
            for hidden in FORWARD_HIDDEN:
                x = torch.empty(tokens, hidden, dtype=dtype, device="meta")
                packs = hidden // vector
                tx = 1
                while tx < 256 and tx < packs:
                    tx *= 2
                blocks = -(-packs // tx) * min(-(-tokens // (256 // tx * 4)), 65535)
                tiles = hidden % vector == 0 and packs % tx == 0 and blocks >= 4 * sms
                where = (sms, tokens, hidden)
                assert torch.ops.fusion.bias_forward_kernel(x, "gelu", sms) == ("tiles" if tiles else "flat"), where
                for activation in ("relu", "gelu_tanh", "silu"):
                    assert torch.ops.fusion.bias_forward_kernel(x, activation, sms) == "flat", (activation, where)
    # The sweep's few-token rows on an H100's 132 SMs: flat at 64 and 2048 tokens up to hidden
    # 2048, tiles where the rows fill the GPU.
    for shape, expected in (((64, 4096), "flat"), ((64, 12288), "flat"), ((2048, 1024), "flat"),
                            ((2048, 2048), "flat" if dtype != torch.float32 else "tiles"), ((8192, 4096), "tiles")):
        x = torch.empty(shape, dtype=dtype, device="meta")
        assert torch.ops.fusion.bias_forward_kernel(x, "gelu", 132) == expected, shape
    with pytest.raises(RuntimeError, match="bias_forward_kernel: sms must be at least 1"):
        torch.ops.fusion.bias_forward_kernel(torch.empty(4, 8, device="meta"), "gelu", 0)
    with pytest.raises(RuntimeError, match="bias_forward_kernel: unknown activation"):
        torch.ops.fusion.bias_forward_kernel(torch.empty(4, 8, device="meta"), "tanh", 132)


def test_flat_column_divmod():
    """The flat forward's column (course::FastDivmod: n's magic number, a multiply-high, an add and a
    shift) is i // n and i % n for every 32-bit index: at each row length from 1 to 4099 and at
    powers of two, odd lengths and the largest ones, for the indices at a multiple of n and either
    side of it, at 2^31 and at the top of the range, and at random. Bad input is refused."""
    gen = torch.Generator().manual_seed(0)
    top = 2**32 - 1
    lengths = list(range(1, 4100)) + [2**k + d for k in range(12, 32) for d in (-1, 0, 1)] + [top - 1, top, 50257, 151936]
    for n in lengths:
        multiples = [m * n for m in (1, 2, top // n - 1, top // n) if 0 <= m * n <= top]
        near = {0, 1, n - 1, 2**31 - 1, 2**31, top - 1, top} | {v + d for v in multiples for d in (-1, 0, 1)}
        index = torch.tensor(sorted(v for v in near if 0 <= v <= top), dtype=torch.int64)
        index = torch.cat([index, torch.randint(0, 2**32, (64,), generator=gen, dtype=torch.int64)])
        got = torch.ops.fusion.flat_column_divmod(index, n)
        assert torch.equal(got, torch.stack([index // n, index % n], dim=1)), n
    with pytest.raises(RuntimeError, match="flat_column_divmod: n must be 1 to 2"):
        torch.ops.fusion.flat_column_divmod(torch.zeros(1, dtype=torch.int64), 0)
    with pytest.raises(RuntimeError, match="flat_column_divmod: indices must be 0 to 2"):
        torch.ops.fusion.flat_column_divmod(torch.tensor([2**32]), 7)


# The flat forward's form on rows that start mid-vector (course::flat_uniform, bias_act.h): the
# uniform one (edge elements on a warp of their own, every lane's loads issued before any use)
# where the grid is one wave or less of it, 5 blocks of 256 an SM; COURSE_FORWARD_ODD forces either.
FORM_TOKENS = (1, 7, 64, 65, 255, 2048, 8192)
FORM_WIDTHS = (1, 7, 768, 777, 4096, 4099, 8198, 16387)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=dtype_id)
def test_flat_forward_form_rule(dtype, monkeypatch):
    """flat_forward_form asked without a GPU (meta tensors, GPUs of 1 to 170 SMs): "vectors" where
    every row is whole 16-byte vectors from an aligned start, else "uniform" where the walk's
    vectors fill at most 5 blocks of 256 threads an SM, "branch" past that; for a bias op's x and
    for swiglu's (whose walk is y's half-width rows). COURSE_FORWARD_ODD forces a form and an
    unknown value raises."""
    monkeypatch.delenv("COURSE_FORWARD_ODD", raising=False)
    vector = 16 // torch.empty((), dtype=dtype).element_size()
    for sms in (1, 46, 132, 170):
        for tokens in FORM_TOKENS:
            for width in FORM_WIDTHS:
                x = torch.empty(tokens, width, dtype=dtype, device="meta")
                for swiglu in (False, True):
                    n = width // 2 if swiglu else width
                    blocks = -(-(tokens * n // vector) // 256)
                    expected = "vectors" if n % vector == 0 else "uniform" if blocks <= 5 * sms else "branch"
                    assert OPS.flat_forward_form(x, sms, swiglu) == expected, (sms, tokens, width, swiglu)
    # The sweep's rows on an H100's 132 SMs: the few-token odd rows uniform, 2048 tokens not.
    for shape, expected in (((64, 4099), "uniform"), ((1, 4099), "uniform"), ((64, 777), "uniform"),
                            ((2048, 4099), "branch"), ((64, 4096), "vectors")):
        assert OPS.flat_forward_form(torch.empty(shape, dtype=dtype, device="meta"), 132) == expected, shape
    # x one element past a boundary: rows of whole vectors that start mid-vector.
    x = torch.empty(64 * 4096 + 1, dtype=dtype, device="meta")[1:].view(64, 4096)
    assert OPS.flat_forward_form(x, 132) == "uniform"
    odd, wide = torch.empty(64, 4099, dtype=dtype, device="meta"), torch.empty(2048, 4099, dtype=dtype, device="meta")
    for value, few, many in (("", "uniform", "branch"), ("auto", "uniform", "branch"), ("branch", "branch", "branch"),
                             ("uniform", "uniform", "uniform")):
        monkeypatch.setenv("COURSE_FORWARD_ODD", value)
        assert (OPS.flat_forward_form(odd, 132), OPS.flat_forward_form(wide, 132)) == (few, many), value
    monkeypatch.setenv("COURSE_FORWARD_ODD", "sometimes")
    with pytest.raises(RuntimeError, match="flat_forward_form: COURSE_FORWARD_ODD must be auto, branch or uniform"):
        OPS.flat_forward_form(odd, 132)
    monkeypatch.delenv("COURSE_FORWARD_ODD")
    with pytest.raises(RuntimeError, match="flat_forward_form: sms must be at least 1"):
        OPS.flat_forward_form(odd, 0)


def template_of(name, start):
    """The template part of a demangled kernel name, from `start` to its matching '>' (the
    argument list after it, and the namespace before, may hold brackets of their own)."""
    i = name.index(start) + len(start)
    depth = 1
    while depth:
        depth += {"<": 1, ">": -1}.get(name[i], 0)
        i += 1
    return name[name.index(start):i]


FORM_ROWS = (1, 7, 63, 64, 65, 255)
FORM_CUDA_WIDTHS = (1, 7, 777, 4099, 8198)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
def test_flat_forward_odd_forms(dtype, monkeypatch):
    """The flat forward's two forms (COURSE_FORWARD_ODD branch and uniform, and the rule's auto)
    give the same bits and match float64: fused_bias_scale_relu and bias_gelu (the flat bias
    kernel) and swiglu (x twice the width) at rows 1 to 255 by widths 1, 7 (shorter than a
    vector), 777, 4099 (rows at every distance from a boundary, a vector that wraps into the next
    row, the bias row's partial last vector) and 8198, with x (and swiglu's x) one element off a
    boundary (edge elements before the first vector) and the bias one element off (its single
    loads). Outputs poisoned first: an element no path wrote shows as NaN. At 64 x 4099 the
    uniform form's kernels are the ones launched (their last template argument)."""
    require_cuda()
    for rows in FORM_ROWS:
        for width in FORM_CUDA_WIDTHS:
            for x_offset, bias_offset in ((0, 0), (1, 0), (0, 1)):
                where = (rows, width, x_offset, bias_offset)
                x, bias = bias_inputs((rows, width), dtype, "cuda")
                x, bias = offset_copy(x, x_offset), offset_copy(bias, bias_offset)
                xs = swiglu_rows(rows, 2 * width, dtype, "cuda", x_offset)
                calls = {"relu": (lambda: fusion.fused_bias_scale_relu(x, bias, SCALE),
                                  reference_bias_act(x, bias, "relu", SCALE), SCALE),
                         "gelu": (lambda: fusion.bias_gelu(x, bias, "none"), reference_bias_act(x, bias, "gelu"), 1.0),
                         "swiglu": (lambda: fusion.swiglu(xs), reference_swiglu(xs), None)}
                for op, (call, ref, scale) in calls.items():
                    bound = swiglu_bound(xs, ref, dtype) if op == "swiglu" else act_bound(x, bias, scale, ref, dtype)
                    outs = {}
                    for form in ("branch", "uniform", "auto"):
                        monkeypatch.setenv("COURSE_FORWARD_ODD", form)
                        poison_allocator(ref.to(dtype))
                        outs[form] = call()
                        assert_within(outs[form], ref, bound, f"{op} {form} {where}")
                    assert torch.equal(outs["branch"], outs["uniform"]), (op, where)
                    assert torch.equal(outs["auto"], outs["uniform"]), (op, where)
    x, bias = bias_inputs((64, 4099), dtype, "cuda")
    xs = swiglu_rows(64, 2 * 4099, dtype, "cuda")
    for form, last in (("uniform", "true>"), ("branch", "false>")):
        monkeypatch.setenv("COURSE_FORWARD_ODD", form)
        _, kernels = launched_kernels(lambda: (fusion.fused_bias_scale_relu(x, bias, SCALE), fusion.swiglu(xs)),
                                      "flat_kernel")
        kernels = {template_of(k, "flat_kernel<") for k in kernels}  # the bias kernel's and swiglu's
        assert len(kernels) == 2 and all(k.endswith(last) for k in kernels), (form, kernels)
    monkeypatch.delenv("COURSE_FORWARD_ODD")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
def test_flat_forward_uniform_under_graphs(dtype):
    """The uniform form captured into a CUDA graph and replayed gives the eager call's bits: 1 x
    4099 (edge elements past the last vector's warp), 64 x 4099 and 65 x 777 (wrapping vectors),
    bias_gelu, fused_bias_scale_relu and swiglu."""
    require_cuda()
    for rows, width in ((1, 4099), (64, 4099), (65, 777)):
        x, bias = bias_inputs((rows, width), dtype, "cuda")
        xs = swiglu_rows(rows, 2 * width, dtype, "cuda")

        def step():
            return (fusion.bias_gelu(x, bias, "none"), fusion.fused_bias_scale_relu(x, bias, SCALE),
                    fusion.swiglu(xs))

        captured, expected = capture_and_replay(step)
        assert all(torch.equal(c, e) for c, e in zip(captured, expected)), (rows, width)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=dtype_id)
def test_bias_gelu_forward_at_the_wave_edges(dtype):
    """bias_gelu's forward runs the kernel bias_forward_kernel names for this GPU, and matches
    float64, at rows 1, 63, 64, 65 and 2047 and hidden 1, 7, 777, 4099 and 12288 (a single
    element, rows shorter than a vector, rows that start mid-vector, whole vectors)."""
    require_cuda()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for tokens in (1, 63, 64, 65, 2047):
        for hidden in (1, 7, 777, 4099, 12288):
            x, bias = bias_inputs((tokens, hidden), dtype, "cuda", scale=1.0)
            expected = torch.ops.fusion.bias_forward_kernel(x, "gelu", sms)
            y, kernels = launched_kernels(lambda: fusion.bias_gelu(x, bias, "none"), "course")
            assert any(FORWARD_KERNELS[expected] in k for k in kernels), (tokens, hidden, expected, kernels)
            ref = reference_bias_act(x, bias, "gelu")
            assert_within(y, ref, act_bound(x, bias, 1.0, ref, dtype), f"gelu {tokens}x{hidden}")


# ---------------------------------------------------------------------------------------------
# 9. version=None, opcheck, torch.compile
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_default_choice_names_the_rung_that_runs(dtype, device):
    """default_choice names a rung; version=None must run exactly that rung: bitwise equal."""
    for shape in ((64, 1000), (5, 5123), (3, 2, 8)):
        x, bias = bias_inputs(shape, dtype, device)
        for op in ("fused_bias_scale_relu", "bias_gelu", "bias_silu"):
            choice = fusion.elementwise_default_choice(op, x)
            assert choice in EW_VERSIONS[op]
            assert fusion.elementwise_default_choice(op, x.to("meta")) == choice
            act = {"fused_bias_scale_relu": "relu", "bias_gelu": "gelu", "bias_silu": "silu"}[op]
            assert torch.equal(run_bias_op(act, x, bias, None), run_bias_op(act, x, bias, choice)), (op, shape)
        choice = fusion.elementwise_default_choice("fused_bias_scale_relu_backward", x)
        assert choice in EW_VERSIONS["fused_bias_scale_relu_backward"]
        mask = saved_for("mask", x, bias)
        assert all(torch.equal(a, b) for a, b in zip(
            fusion.fused_bias_scale_relu_backward(x, mask, bias, SCALE, "mask", None),
            fusion.fused_bias_scale_relu_backward(x, mask, bias, SCALE, "mask", choice)))
        choice = fusion.elementwise_default_choice("swiglu", x)
        assert choice in EW_VERSIONS["swiglu"]
        if shape[-1] % 2 == 0:
            assert torch.equal(fusion.swiglu(x), fusion.swiglu(x, version=choice))
        choice = fusion.elementwise_default_choice("linear_activation", x)
        assert choice in EW_VERSIONS["linear_activation"]


OPS = torch.ops.fusion


def _opcheck_calls(device):
    x, bias = bias_inputs((9, 40), torch.float32, device)
    y, mask = OPS.fused_bias_scale_relu_forward(x, bias, SCALE, "mask")
    dy = torch.randn(9, 40, device=device)
    weight = torch.randn(24, 40, device=device)
    xr, br, wr = (t.clone().requires_grad_() for t in (x, bias, weight))
    return {
        "bsr_mask": (OPS.fused_bias_scale_relu.default, (xr, br, SCALE), {"save": "mask"}),
        "bsr_y_v1": (OPS.fused_bias_scale_relu.default, (xr, br, SCALE), {"save": "y", "version": "v1"}),
        "bsr_x_v2": (OPS.fused_bias_scale_relu.default, (xr, br, SCALE), {"save": "x", "version": "v2"}),
        "bsr_forward": (OPS.fused_bias_scale_relu_forward.default, (x, bias, SCALE, "mask", "v3"), {}),
        "bsr_backward_mask": (OPS.fused_bias_scale_relu_backward.default, (dy, mask, bias, SCALE, "mask", "v2"), {}),
        "bsr_backward_y_v1": (OPS.fused_bias_scale_relu_backward.default, (dy, y, bias, SCALE, "y", "v1"), {}),
        "bias_gelu": (OPS.bias_gelu.default, (xr, br, "tanh"), {}),
        "bias_silu_v1": (OPS.bias_silu.default, (xr, br), {"version": "v1"}),
        "bias_activation_backward": (OPS.bias_activation_backward.default, (dy, x, bias, "gelu"), {}),
        "swiglu": (OPS.swiglu.default, (xr,), {}),
        "swiglu_backward": (OPS.swiglu_backward.default, (dy[:, :20], x), {}),
        "linear_activation": (OPS.linear_activation.default, (xr, wr, torch.randn(24, device=device,
                                                                                   requires_grad=True), "silu"), {}),
        "linear_activation_forward": (OPS.linear_activation_forward.default,
                                      (x, weight, torch.randn(24, device=device), "relu", "unfused"), {}),
        "linear_activation_backward": (OPS.linear_activation_backward.default,
                                       (torch.randn(9, 24, device=device), torch.randn(9, 24, device=device), x,
                                        weight, "gelu"), {}),
    }


OPCHECK_NAMES = list(_opcheck_calls("cpu"))


@pytest.mark.parametrize("name", OPCHECK_NAMES)
def test_opcheck(name, device):
    fn, args, kwargs = _opcheck_calls(device)[name]
    torch.library.opcheck(fn, args, kwargs)


def test_torch_compile_traces_the_ops(device):
    """Dynamo and AOTAutograd trace through every public op without a graph break (Meta kernels
    for shapes, Autograd kernels for the backward); aot_eager skips codegen to keep it fast. The
    same kernels run either way; only the order in which the backward adds the gradients of x's
    several uses may differ, hence assert_close's float32 defaults for those."""
    torch._dynamo.reset()

    def f(x, bias, weight, b2):
        h = fusion.fused_bias_scale_relu(x, bias, SCALE)
        h = fusion.bias_gelu(h, bias, "tanh") + fusion.bias_silu(x, bias, version="v1")
        h = fusion.swiglu(torch.cat([h, x], -1))
        return fusion.linear_activation(h, weight, b2, "gelu").sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x, bias = bias_inputs((6, 40), torch.float32, device)
    weight = torch.randn(16, 40, device=device)
    b2 = torch.randn(16, device=device)
    inputs = [t.requires_grad_() for t in (x, bias, weight, b2)]
    out = compiled(*inputs)
    grads = torch.autograd.grad(out, inputs)
    expected = f(*inputs)
    expected_grads = torch.autograd.grad(expected, inputs)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e)


# ---------------------------------------------------------------------------------------------
# 10. CUDA only: graph capture, long sweeps, the sanitizer's small run
# ---------------------------------------------------------------------------------------------
def _every_op(x, bias, dy, mask, weight, b2):
    outs = []
    for version in EW_VERSIONS["fused_bias_scale_relu"]:
        outs += list(OPS.fused_bias_scale_relu_forward(x, bias, SCALE, "mask", version))
    for version in EW_VERSIONS["fused_bias_scale_relu_backward"]:
        for save, saved in (("mask", mask), ("x", x)):
            outs += list(fusion.fused_bias_scale_relu_backward(dy, saved, bias, SCALE, save, version))
    for version in EW_VERSIONS["bias_gelu"]:
        outs += [fusion.bias_gelu(x, bias, version=version), fusion.bias_silu(x, bias, version=version),
                 fusion.swiglu(x, version=version)]
    outs += list(OPS.bias_activation_backward(dy, x, bias, "silu"))
    outs.append(OPS.swiglu_backward(dy[:, : x.shape[1] // 2], x))
    for version in EW_VERSIONS["linear_activation"]:
        outs += list(OPS.linear_activation_forward(x, weight, b2, "gelu", version))
        outs.append(fusion.linear_activation(x, weight, b2, "relu", version=version))
    outs += list(OPS.linear_activation_backward(dy[:, :24], dy[:, 24:48], x, weight, "silu"))
    return outs


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_cuda_graph_capture(dtype):
    """Every op is capturable: no host synchronization, no allocation outside the graph's pool,
    everything on the current stream. The replay must equal an eager run bitwise."""
    require_cuda()
    x, bias = bias_inputs((300, 1000), dtype, "cuda")
    dy = torch.randn(300, 1000, device="cuda").to(dtype)
    mask = saved_for("mask", x, bias)
    weight = torch.randn(24, 1000, device="cuda").to(dtype)
    b2 = torch.randn(24, device="cuda").to(dtype)
    args = (x, bias, dy, mask, weight, b2)
    captured, expected = capture_and_replay(lambda: _every_op(*args))
    for i, (c, e) in enumerate(zip(captured, expected)):
        assert torch.equal(c, e), i


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=dtype_id)
@pytest.mark.parametrize("shape", [(70001, 64), (4099, 3), (9, 131072)], ids=shape_id)
def test_long_sweeps(shape, dtype):
    """More rows than a grid holds (every thread sweeps many rows, and the backward's slots are
    capped), and rows longer than a column tile: forward, mask and backward of every rung."""
    require_cuda()
    x, bias = bias_inputs(shape, dtype, "cuda")
    ref = reference_bias_act(x, bias, "relu", SCALE)
    positive = (x.double() * SCALE + bias.double() > 0)
    dy = torch.randn(shape, device="cuda").to(dtype)
    dx_ref, g = bsr_backward_reference(dy, x, bias)
    for version in EW_VERSIONS["fused_bias_scale_relu"]:
        y, mask = OPS.fused_bias_scale_relu_forward(x, bias, SCALE, "mask", version)
        assert_within(y, ref, act_bound(x, bias, SCALE, ref, dtype), f"forward {version}")
        bits = unpack_mask(mask, shape[-1])
        assert torch.equal(bits[:, : shape[-1]], positive) and not bits[:, shape[-1]:].any(), version
    for version in EW_VERSIONS["fused_bias_scale_relu_backward"]:
        for save in ("y", "x", "mask"):
            dx, dbias = fusion.fused_bias_scale_relu_backward(dy, saved_for(save, x, bias), bias, SCALE, save, version)
            assert_within(dx, dx_ref, 2 * eps(dtype) * dx_ref.abs() + floor(dtype), f"dx {version} {save}")
            assert_within(dbias, g.sum(0), column_sum_bound(g, dtype, shape[0]), f"dbias {version} {save}")


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=dtype_id)
def test_sanitizer_swiglu_flat(dtype):
    """swiglu's flat kernel (and the backward's tiles) under compute-sanitizer: the realigned loads
    of rows at every distance from a 16-byte boundary (the forward's straddling vectors' extra
    load at b + half among them), with x on one or 1 or 7 elements past it and dy on one or one
    element past it (the vectors around the first and last elements must not be read past x; dy
    one off with x on one is the backward's shifted flat walk), and rows shorter than a vector."""
    require_cuda()
    for rows, half in ((1, 1), (3, 7), (5, 9), (65, 777), (2, 4099), (3, 64)):
        for offset, dy_offset in ((0, 0), (0, 1), (1, 1), (7, 1)):
            x = swiglu_rows(rows, 2 * half, dtype, "cuda", offset)
            ref = reference_swiglu(x)
            assert_within(fusion.swiglu(x), ref, swiglu_bound(x, ref, dtype), f"forward {(rows, half, offset)}")
            dy = swiglu_rows(rows, half, dtype, "cuda", dy_offset)
            x64, bound = swiglu_grad_reference(x, dy)
            assert_within(OPS.swiglu_backward(dy, x), x64.grad, bound, f"backward {(rows, half, offset, dy_offset)}")


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=dtype_id)
def test_sanitizer_small(dtype):
    """The small run the GPU pass puts under compute-sanitizer: every rung of every op on small,
    irregular, aligned and misaligned shapes, each checked against its reference."""
    require_cuda()
    for shape in ((3, 1), (5, 33), (17, 64), (4, 1000)):
        x, bias = bias_inputs(shape, dtype, "cuda")
        views = [(x, bias)]
        flat = torch.cat([x.reshape(-1)[:1], x.reshape(-1)])
        views.append((flat[1:1 + x.numel()].view(shape), bias))  # misaligned by one element
        for xv, b in views:
            ref = reference_bias_act(xv, b, "relu", SCALE)
            dy = torch.randn(shape, device="cuda").to(dtype)
            dx_ref, g = bsr_backward_reference(dy, xv, b)
            for version in EW_VERSIONS["fused_bias_scale_relu"]:
                y, mask = OPS.fused_bias_scale_relu_forward(xv, b, SCALE, "mask", version)
                assert_within(y, ref, act_bound(xv, b, SCALE, ref, dtype), f"forward {version}")
                for bversion in EW_VERSIONS["fused_bias_scale_relu_backward"]:
                    for save, saved in (("mask", mask), ("y", y), ("x", xv)):
                        dx, dbias = fusion.fused_bias_scale_relu_backward(dy, saved, b, SCALE, save, bversion)
                        assert_within(dx, dx_ref, 2 * eps(dtype) * dx_ref.abs() + floor(dtype), "dx")
                        assert_within(dbias, g.sum(0), column_sum_bound(g, dtype, shape[0]), "dbias")
            for activation in ("gelu", "gelu_tanh", "silu"):
                ref = reference_bias_act(xv, b, activation)
                for version in ladder_of(activation):
                    assert_within(run_bias_op(activation, xv, b, version), ref, act_bound(xv, b, 1.0, ref, dtype),
                                  f"{activation} {version}")
            if shape[-1] % 2 == 0:
                ref = reference_swiglu(xv)
                for version in EW_VERSIONS["swiglu"]:
                    assert_within(fusion.swiglu(xv, version=version), ref, swiglu_bound(xv, ref, dtype), "swiglu")
            weight = torch.randn(7, shape[-1], device="cuda").to(dtype)
            b2 = torch.randn(7, device="cuda").to(dtype)
            ref = reference_linear(xv, weight, b2, "silu")
            for version in EW_VERSIONS["linear_activation"]:
                assert_within(fusion.linear_activation(xv, weight, b2, "silu", version=version), ref,
                              linear_bound(xv, weight, b2, ref, dtype), f"linear {version}")


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_sanitizer_gelu_grid(dtype):
    """Under compute-sanitizer: GELU-erf's backward on a grid sized to its kernel's occupancy, at
    rows that start mid-vector with partial rows and a last step that only some threads take
    (400 x 4099, 300 x 777) and on whole vectors (130 x 3000), against float64; and ReLU's
    backward from each saved kind at the same shapes. Their partial rows are added by the last
    block of each column tile (bias_grad_tiling's finishes), which reads the other blocks' rows."""
    require_cuda()
    for shape in ((400, 4099), (300, 777), (130, 3000)):
        check_activation_grads("gelu", shape, dtype)
        x, bias = bias_inputs(shape, dtype, "cuda")
        dy = torch.randn(shape, device="cuda").to(dtype)
        dx_ref, g = bsr_backward_reference(dy, x, bias)
        for save in ("y", "x", "mask"):
            dx, dbias = fusion.fused_bias_scale_relu_backward(dy, saved_for(save, x, bias), bias, SCALE, save, None)
            assert_within(dx, dx_ref, 2 * eps(dtype) * dx_ref.abs() + floor(dtype), f"dx {shape} {save}")
            assert_within(dbias, g.sum(0), column_sum_bound(g, dtype, shape[0]), f"dbias {shape} {save}")


# A tensor where a number goes and the other way round: a TypeError naming the op and the argument.
MISPLACED = {
    "fused_bias_scale_relu(x, 2.0, bias)": (lambda x, b: fusion.fused_bias_scale_relu(x, 2.0, b),
                                            r"^fused_bias_scale_relu: bias must be a tensor, got a float"),
    "fused_bias_scale_relu(x, bias, x)": (lambda x, b: fusion.fused_bias_scale_relu(x, b, x),
                                          r"^fused_bias_scale_relu: scale must be a number \(float\), got a tensor "
                                          r"of dtype float32 and shape \[4, 8\]"),
    "fused_bias_scale_relu_backward(x, x, b, b)": (lambda x, b: fusion.fused_bias_scale_relu_backward(x, x, b, b),
                                                   r"^fused_bias_scale_relu_backward: scale must be a number"),
    "bias_gelu(x, 1.0)": (lambda x, b: fusion.bias_gelu(x, 1.0), r"^bias_gelu: bias must be a tensor, got a float"),
    "bias_silu(x, 0.5)": (lambda x, b: fusion.bias_silu(x, 0.5), r"^bias_silu: bias must be a tensor, got a float"),
    "swiglu([x])": (lambda x, b: fusion.swiglu([x]), r"^swiglu: x must be a tensor, got a list"),
    "linear_activation(x, x, b, x)": (lambda x, b: fusion.linear_activation(x, x, b, x),
                                      r"^linear_activation: activation must be a str, got a tensor"),
    "default_choice(x, op)": (lambda x, b: fusion.default_choice(x, "swiglu"), r"^default_choice: op must be a str, got a tensor"),
}


@pytest.mark.parametrize("call", list(MISPLACED))
def test_misplaced_arguments_raise_type_error(call, device):
    assert_misplaced(*MISPLACED[call], torch.randn(4, 8, device=device), torch.randn(8, device=device))
