"""Tests for chapter 6's attention: the CPU reference (forward, lse, backward), its C++ autograd,
the Meta kernels under torch.compile and opcheck, the sdpa drop-in, every documented misuse, and
(marked cuda, skipped without a GPU) every CUDA rung against the same float64 reference.

The reference is written here in plain PyTorch in float64: scores, an explicit bottom-right
causal mask, an explicit softmax (not SDPA), and autograd through it for the gradients. SDPA is
the second witness, in float32, where its semantics match ours.

Run against the installed extension (pip install .) or the JIT build (COURSE_EXT_ROUTE=jit);
the header line says which one was loaded.
"""
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import flash_attention
from coursekit.pytest_plugin import capture_and_replay, dtype_id, poison_allocator, ptx_kernels, require_cuda

OPS = torch.ops.flash_attention
CPU_DTYPES = (torch.float32, torch.float64)

# Forward tolerances (rtol, atol) against the float64 reference of the same inputs. float32
# computes in float32: scores are dot products of up to 128 terms of magnitude ~1, exp() and
# the division each add an ulp or so, and the output is a convex combination of v rows, so
# its error is a few float32 ulps of |v| ~ 1-4 (1.2e-7 each): 2e-5 leaves a wide margin while a
# wrong mask, head or scale errs by O(0.1). float64 is the same computation in double.
FORWARD_TOL = {torch.float32: (1e-5, 2e-5), torch.float64: (1e-10, 1e-10)}
# Gradients, relative to the largest reference gradient of the tensor: dk and dv are sums over
# up to 8 query heads x 129 rows in the accumulation type, so a few ulps times the term count.
GRAD_TOL = {torch.float32: 2e-5, torch.float64: 1e-10}


# ---------------------------------------------------------------------------------------------
# Inputs and the reference
# ---------------------------------------------------------------------------------------------
def make_qkv(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype=torch.float32, device="cpu",
             requires_grad=False):
    q = torch.randn(batch, heads, seqlen_q, head_dim, dtype=torch.float64)
    k = torch.randn(batch, heads_kv, seqlen_k, head_dim, dtype=torch.float64)
    v = torch.randn(batch, heads_kv, seqlen_k, head_dim, dtype=torch.float64) * 2 + 0.5
    return tuple(t.to(dtype).to(device).requires_grad_(requires_grad) for t in (q, k, v))


def causal_mask(seqlen_q, seqlen_k, device="cpu"):
    """True where key j is visible to row i: j <= i + seqlen_k - seqlen_q (bottom-right)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + seqlen_k - seqlen_q


def visible_mask(seqlen_q, seqlen_k, causal, window=(-1, -1)):
    """True where key j is visible to row i: the causal mask, and the window (left, right):
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, -1 unbounded, causal
    being right = 0. Written from the definition, not from the extension's code."""
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    diag = seqlen_k - seqlen_q
    left, right = window
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if causal:
        visible &= causal_mask(seqlen_q, seqlen_k)
    if left >= 0:
        visible &= j >= i + diag - left
    if right >= 0:
        visible &= j <= i + diag + right
    return visible


def reference(q, k, v, causal, scale=None, window=(-1, -1), softcap=0.0):
    """(out, lse) in float64, differentiable in q, k, v. Rows with no visible key give out 0,
    lse -inf and zero gradient: their scores are replaced by a constant before the softmax, so
    nothing flows back through them (a softmax of all -inf would give NaN and NaN gradients).
    softcap > 0 caps the scaled scores to softcap * tanh(s / softcap) first (autograd gives the
    backward its derivative)."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = scale * q @ k.transpose(-1, -2)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    visible = visible_mask(q.shape[2], k.shape[2], causal, window).to(scores.device)  # a GPU reference too
    masked = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(masked, dim=-1)
    empty = ~visible.any(dim=-1)[:, None]
    probs = torch.softmax(masked.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return probs @ v, lse


def assert_forward(out, ref, dtype, what=""):
    rtol, atol = FORWARD_TOL[dtype]
    assert out.dtype == dtype and out.shape == ref.shape, (what, out.dtype, out.shape)
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_grad(out, ref, dtype, what=""):
    assert out.dtype == dtype and out.shape == ref.shape, (what, out.dtype, out.shape, ref.shape)
    scale = max(ref.abs().max().item(), 1.0) if ref.numel() else 1.0
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=GRAD_TOL[dtype] * scale,
                               msg=lambda m: f"{what}: {m}")


def lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# (batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim): every seqlen around the 128 a tile will
# hold, 1, a prime, seqlen_q on either side of seqlen_k, the three head dims, GQA 4:1 and 8:1.
SHAPES = [
    (2, 2, 2, 1, 1, 32),
    (1, 3, 3, 17, 17, 64),
    (1, 2, 2, 127, 127, 32),
    (1, 2, 2, 128, 128, 64),
    (1, 1, 1, 129, 129, 128),
    (2, 2, 2, 17, 129, 32),     # seqlen_q < seqlen_k: the decode-like case
    (1, 2, 2, 129, 17, 64),     # seqlen_q > seqlen_k: causal rows 0..111 see no key
    (1, 8, 2, 33, 47, 32),      # GQA 4:1
    (2, 8, 1, 47, 33, 64),      # multi-query attention, 8:1
    (1, 2, 2, 1, 128, 128),     # one query row against a long cache
]
GRAD_SHAPES = [SHAPES[i] for i in (0, 1, 4, 5, 6, 7, 8)]


def shape_id(shape):
    return "b{}h{}kv{}q{}k{}d{}".format(*shape)


# ---------------------------------------------------------------------------------------------
# 1. Forward and lse against the float64 reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_forward_matches_reference(shape, causal, dtype):
    q, k, v = make_qkv(*shape, dtype=dtype)
    ref, ref_lse = reference(q, k, v, causal)
    poison_allocator(ref.to(dtype))
    out, lse = flash_attention.attention(q, k, v, causal=causal, return_lse=True)
    assert_forward(out, ref, dtype, "out")
    assert lse.dtype == lse_dtype(dtype) and lse.shape == shape[:2] + (shape[3],)
    # lse is -inf exactly where no key is visible, and finite elsewhere
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    finite = ref_lse.isfinite()
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=FORWARD_TOL[dtype][0],
                               atol=FORWARD_TOL[dtype][1])


@pytest.mark.parametrize("scale", (0.05, 1.0, 3.0))
def test_scale_is_used(scale):
    q, k, v = make_qkv(1, 2, 2, 19, 23, 32, dtype=torch.float64)
    out = flash_attention.attention(q, k, v, scale=scale)
    assert_forward(out, reference(q, k, v, False, scale)[0], torch.float64, f"scale {scale}")


# ---------------------------------------------------------------------------------------------
# 2. Against F.scaled_dot_product_attention (float32)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", [SHAPES[i] for i in (1, 3, 5, 6, 7, 8)], ids=shape_id)
def test_matches_torch_sdpa(shape, causal):
    q, k, v = make_qkv(*shape)
    # SDPA's is_causal is top-left aligned; an explicit boolean mask states our bottom-right one.
    mask = causal_mask(shape[3], shape[4]) if causal else None
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=shape[1] != shape[2])
    torch.testing.assert_close(flash_attention.attention(q, k, v, causal=causal), expected, rtol=1e-5, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# 3. Strided views are read in place
# ---------------------------------------------------------------------------------------------
def strided_qkv(dtype, requires_grad=False):
    """q from a (batch, seqlen, heads, head_dim) projection, k a head_dim slice of a wider
    tensor starting one element off, v one kv head expanded (head stride 0) over two."""
    b, h, s, d = 2, 4, 37, 32
    bases = (torch.randn(b, s, h, d, dtype=dtype), torch.randn(b, 2, s, d + 9, dtype=dtype),
             torch.randn(b, 1, s, d, dtype=dtype))
    bq, bk, bv = (t.requires_grad_(requires_grad) for t in bases)
    q, k, v = bq.transpose(1, 2), bk[..., 1:d + 1], bv.expand(b, 2, s, d)
    assert not q.is_contiguous() and not k.is_contiguous() and v.stride(1) == 0
    return q, k, v


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_strided_views(causal, dtype):
    q, k, v = strided_qkv(dtype)
    out, lse = flash_attention.attention(q, k, v, causal=causal, return_lse=True)
    # The reference walks the same elements in the same order whatever the strides: bitwise.
    out_c, lse_c = flash_attention.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal,
                                             return_lse=True)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    assert_forward(out, reference(q, k, v, causal)[0], dtype, "strided")


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_strided_view_gradients(causal):
    q, k, v = strided_qkv(torch.float64, requires_grad=True)
    grads = torch.autograd.grad(flash_attention.attention(q, k, v, causal=causal).sin().sum(), (q, k, v))
    expected = torch.autograd.grad(reference(q, k, v, causal)[0].sin().sum(), (q, k, v))
    for name, g, e in zip("qkv", grads, expected):
        assert_grad(g, e, torch.float64, f"d{name}")


# ---------------------------------------------------------------------------------------------
# 4. Gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=shape_id)
def test_backward_matches_reference(shape, causal, dtype):
    q, k, v = make_qkv(*shape, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(shape[0], shape[1], shape[3], shape[5], dtype=torch.float64)
    out = flash_attention.attention(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(dtype))
    # float64 leaves of the same values: the reference's gradients must not round to float32
    leaves = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
    expected = torch.autograd.grad(reference(*leaves, causal)[0], leaves, grad_out)
    for name, g, e in zip("qkv", grads, expected):
        assert_grad(g, e, dtype, f"d{name}")


@pytest.mark.parametrize("shape,causal", [
    ((1, 2, 2, 5, 5, 4), False),
    ((1, 2, 2, 5, 5, 4), True),
    ((2, 1, 1, 3, 6, 3), True),     # seqlen_q < seqlen_k
    ((1, 2, 2, 6, 3, 3), True),     # seqlen_q > seqlen_k: three rows see no key
    ((1, 4, 2, 4, 6, 3), True),     # GQA
    ((1, 4, 1, 5, 4, 2), False),    # multi-query
], ids=lambda x: shape_id(x) if isinstance(x, tuple) else ("causal" if x else "full"))
def test_gradcheck(shape, causal):
    q, k, v = make_qkv(*shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: flash_attention.attention(a, b, c, causal=causal), (q, k, v))


def test_lse_is_not_differentiable():
    q, k, v = make_qkv(1, 2, 2, 4, 4, 8, requires_grad=True)
    out, lse = flash_attention.attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad


def test_sum_of_output_backward():
    """out.sum() hands the backward an expanded gradient (every stride 0); it must still work."""
    q, k, v = make_qkv(1, 2, 2, 9, 9, 16, dtype=torch.float64, requires_grad=True)
    grads = torch.autograd.grad(flash_attention.attention(q, k, v, causal=True).sum(), (q, k, v))
    expected = torch.autograd.grad(reference(q, k, v, True)[0].sum(), (q, k, v))
    for g, e in zip(grads, expected):
        assert_grad(g, e, torch.float64)


# ---------------------------------------------------------------------------------------------
# 5. Rows that see no key, and empty tensors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
def test_rows_without_visible_keys(dtype):
    """causal, seqlen_q 7 > seqlen_k 3: rows 0-3 see no key. out 0, lse -inf, no gradient, no
    NaN anywhere; SDPA's CPU kernels also give 0 for such a fully masked row."""
    q, k, v = make_qkv(1, 2, 2, 7, 3, 8, dtype=dtype, requires_grad=True)
    out, lse = flash_attention.attention(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :, :4] == 0) and torch.all(lse[:, :, :4] == -math.inf)
    assert torch.all(out[:, :, 4:] != 0) and torch.all(lse[:, :, 4:].isfinite())
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(7, 3))
    torch.testing.assert_close(out, expected, **({} if dtype == torch.float64 else dict(rtol=1e-5, atol=2e-5)))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.all(dq[:, :, :4] == 0)
    assert not any(g.isnan().any() for g in (dq, dk, dv))


def test_no_keys_at_all():
    """seqlen_k == 0: every row's softmax is empty (SDPA returns zeros too)."""
    q, k, v = make_qkv(2, 2, 2, 5, 0, 8, requires_grad=True)
    out, lse = flash_attention.attention(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.all(lse == -math.inf)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("shape", [(0, 2, 2, 5, 5, 8), (1, 2, 2, 0, 5, 8), (2, 0, 1, 4, 4, 8)], ids=shape_id)
def test_empty(shape):
    q, k, v = make_qkv(*shape, requires_grad=True)
    out, lse = flash_attention.attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    # keys no query row reads receive no gradient: zeros, not uninitialized memory
    assert dq.shape == q.shape and torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


# ---------------------------------------------------------------------------------------------
# 6. opcheck and torch.compile
# ---------------------------------------------------------------------------------------------
def _opcheck_calls():
    q, k, v = make_qkv(2, 4, 2, 9, 12, 16, requires_grad=True)
    out, lse = flash_attention.attention_forward(q.detach(), k.detach(), v.detach(), 0.25, True)
    grad_out = torch.randn_like(out)
    return {
        "forward": (OPS.attention_forward.default, (q, k, v, 0.25, False, None)),
        "forward_causal": (OPS.attention_forward.default, (q, k, v, 0.25, True, None)),
        "backward": (OPS.attention_backward.default, (grad_out, q.detach(), k.detach(), v.detach(), out, lse,
                                                      0.25, True, None)),
    }


@pytest.mark.parametrize("call", ["forward", "forward_causal", "backward"])
def test_opcheck(call):
    fn, args = _opcheck_calls()[call]
    torch.library.opcheck(fn, args)


def test_torch_compile_traces_forward_and_backward():
    """Dynamo and AOTAutograd trace through both ops without a graph break (the Meta kernels
    give shapes, the Autograd kernel the backward); aot_eager skips codegen to stay fast."""
    torch._dynamo.reset()

    def block(x, wq, k, v):
        q = (x @ wq).unflatten(-1, (4, 16)).transpose(1, 2)  # (b, s, h*d) -> (b, h, s, d), a view
        return flash_attention.attention(q, k, v, causal=True).square().sum()

    x = torch.randn(2, 11, 32, requires_grad=True)
    wq = torch.randn(32, 64, requires_grad=True)
    _, k, v = make_qkv(2, 4, 2, 11, 11, 16, requires_grad=True)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out = compiled(x, wq, k, v)
    grads = torch.autograd.grad(out, (x, wq, k, v))
    expected = block(x, wq, k, v)
    expected_grads = torch.autograd.grad(expected, (x, wq, k, v))
    torch.testing.assert_close(out, expected)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e)


# ---------------------------------------------------------------------------------------------
# 7. The sdpa drop-in
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(is_causal=True),
    dict(scale=0.3),
    dict(is_causal=True, enable_gqa=True, heads_kv=2),
    dict(enable_gqa=True),  # enable_gqa with equal heads is allowed and changes nothing
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_sdpa_drop_in(kwargs):
    kwargs = dict(kwargs)
    heads_kv = kwargs.pop("heads_kv", 4)
    q, k, v = make_qkv(2, 4, heads_kv, 21, 21, 32, requires_grad=True)
    out = flash_attention.sdpa(q, k, v, **kwargs)
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-5)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_sdpa_rectangular_without_causal():
    q, k, v = make_qkv(1, 2, 2, 5, 9, 32)
    torch.testing.assert_close(flash_attention.sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v),
                               rtol=1e-5, atol=2e-5)


SDPA_ERRORS = {
    "attn_mask": (lambda q, k, v: flash_attention.sdpa(q, k, v, attn_mask=torch.ones(5, 5, dtype=torch.bool)),
                  NotImplementedError, r"sdpa: attn_mask is not supported"),
    "dropout": (lambda q, k, v: flash_attention.sdpa(q, k, v, dropout_p=0.1),
                NotImplementedError, r"sdpa: dropout_p=0.1 is not supported"),
    "causal rectangular": (lambda q, k, v: flash_attention.sdpa(q, k[:, :, :3], v[:, :, :3], is_causal=True),
                           NotImplementedError, r"sdpa: is_causal=True with seqlen_q=5 != seqlen_k=3"),
    "3-D": (lambda q, k, v: flash_attention.sdpa(q[0], k[0], v[0]),
            NotImplementedError, r"sdpa: query has shape \(4, 5, 8\); only 4-D inputs"),
    "gqa without enable_gqa": (lambda q, k, v: flash_attention.sdpa(q, k[:, :2], v[:, :2]),
                               RuntimeError, r"sdpa: query has 4 heads but key has 2; pass enable_gqa=True"),
}


@pytest.mark.parametrize("case", list(SDPA_ERRORS))
def test_sdpa_unsupported_arguments_raise(case):
    call, error, message = SDPA_ERRORS[case]
    q, k, v = make_qkv(1, 4, 4, 5, 5, 8)
    with pytest.raises(error, match=message):
        call(q, k, v)


# ---------------------------------------------------------------------------------------------
# 8. VERSIONS and misuse
# ---------------------------------------------------------------------------------------------
def test_versions_table_matches_dispatch():
    assert set(flash_attention.VERSIONS) == {"attention_forward", "attention_backward", "paged_attention",
                                             "paged_prefill_attention"}
    for op, rungs in flash_attention.VERSIONS.items():
        assert list(rungs) == OPS.versions(op), op
    with pytest.raises(RuntimeError, match=r"versions: unknown op 'softmax'"):
        OPS.versions("softmax")


@pytest.mark.parametrize("sms", [1, 46, 108, 132])
def test_backward_grids_follow_the_sm_count(sms):
    """The tensor-core backward's grid-stride kernels (D = rowsum(dO * O), the atomic rung's dQ)
    take their grid from the GPU's SM count (attention.h's grid_stride_blocks, through the op of
    the same name), so any machine can hold the rule to a T4's 46, an A100's 108 and an H100's
    132: one block per `per_block` items up to 8 blocks per SM, never fewer than one."""
    most = 8 * sms
    for work, per_block in [(0, 8), (1, 8), (8 * most - 1, 8), (8 * most, 8), (8 * most + 1, 8),
                            (2**31, 1024), (7, 1)]:
        want = max(1, min(-(-work // per_block), most))
        assert OPS.grid_stride_blocks(work, per_block, sms) == want, (work, per_block, sms)
    # 2^24 rows of D, a warp (8 per 256-thread block) each: every SM gets its 8 blocks.
    assert OPS.grid_stride_blocks(2**24, 8, sms) == most
    with pytest.raises(RuntimeError, match=r"grid_stride_blocks: per_block and sms must be >= 1"):
        OPS.grid_stride_blocks(10, 8, 0)


def tile_order(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal, l2_bytes=50 * 2**20, window=(-1, -1),
               softcap=0.0):
    """The persistent rung's tile order: (batch, head, query tile) rows, in the order drawn."""
    return OPS.hopper_tile_order(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal, l2_bytes,
                                 list(window), softcap)


def tile_cost(order, seqlen_q, seqlen_k, head_dim, causal):
    """Each tile's key tiles (128 keys, 64 at head_dim 256) plus one for its prologue and epilogue:
    what a block spends on it, in units of one key tile."""
    last_row = torch.clamp((order[:, 2] + 1) * 128, max=seqlen_q) - 1
    keys = torch.full_like(last_row, seqlen_k)
    if causal:
        keys = torch.clamp(last_row + seqlen_k - seqlen_q + 1, min=0, max=seqlen_k)
    block_n = 64 if head_dim == 256 else 128
    return -(-keys // block_n) + 1


def block_work(cost, blocks, dynamic):
    """Each block's total cost when `blocks` blocks take the tiles in order: dynamic, the kernel's
    way (block c starts with tile c, then whichever block is free first draws the next), or static
    (block c takes tiles c, c + blocks, c + 2 blocks, ...)."""
    import heapq
    blocks = min(blocks, len(cost))
    if not dynamic:
        return torch.zeros(blocks, dtype=torch.long).index_add_(0, torch.arange(len(cost)) % blocks, cost)
    free = [(int(c), b) for b, c in enumerate(cost[:blocks])]
    heapq.heapify(free)
    for c in cost[blocks:].tolist():
        t, b = heapq.heappop(free)
        heapq.heappush(free, (t + c, b))
    return torch.tensor(sorted(t for t, _ in free))


# (batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim): the timing shapes, GQA, a partial last
# tile, decode-like and causal rows that see no key, fewer tiles than blocks, one tile, none.
SCHEDULE_SHAPES = [(2, 16, 16, 8192, 8192, 128), (8, 16, 16, 2048, 2048, 64), (4, 32, 8, 4096, 4096, 128),
                   (16, 16, 16, 512, 512, 64), (2, 8, 8, 8192, 8192, 256), (3, 6, 2, 1000, 1000, 256),
                   (2, 4, 1, 129, 4097, 64), (2, 4, 4, 4097, 129, 128), (1, 1, 1, 1, 1, 64), (2, 4, 2, 0, 5, 64)]


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", SCHEDULE_SHAPES, ids=shape_id)
def test_persistent_schedule_covers_every_tile_once(shape, causal):
    """The persistent rung's tile order (csrc/hopper/tile_schedule.h, through the hopper_tile_order
    op, which decodes each index as the kernel does): every (batch, head, query tile) exactly once,
    and, causal, longest first inside each L2 section (a run of the order whose keys never grow
    covers whole heads: every query tile of each of its (batch, head) pairs)."""
    b, h, hk, sq, sk, d = shape
    order = tile_order(b, h, hk, sq, sk, d, causal)
    q_tiles = -(-sq // 128)
    assert order.shape == (b * h * q_tiles, 3)
    ids = (order[:, 0] * h + order[:, 1]) * q_tiles + order[:, 2]
    assert torch.equal(ids.sort().values, torch.arange(b * h * q_tiles)), "a tile missing or taken twice"
    if not causal or len(order) == 0:
        return
    cost = tile_cost(order, sq, sk, d, causal)
    cuts = [0] + (torch.nonzero(torch.diff(cost) > 0).flatten() + 1).tolist() + [len(cost)]
    for lo, hi in zip(cuts, cuts[1:]):
        pairs = (order[lo:hi, 0] * h + order[lo:hi, 1]).unique()
        assert len(pairs) * q_tiles == hi - lo, f"tiles {lo}..{hi}: the keys grew inside a section"


@pytest.mark.parametrize("shape", SCHEDULE_SHAPES[:5], ids=shape_id)
def test_persistent_schedule_balances_the_blocks(shape):
    """Causal, on 132 blocks (an H100's or H200's SMs): drawing the next tile from a counter, in
    this order, leaves the busiest block within 5% of the average block's work plus one of the
    shortest tiles (the order's last, which no block can split); the static assignment the kernel
    does not use falls further behind at b2 h16 s8192 (tile_schedule.h: why the counter)."""
    b, h, hk, sq, sk, d = shape
    cost = tile_cost(tile_order(b, h, hk, sq, sk, d, True), sq, sk, d, True)
    work = block_work(cost, 132, dynamic=True)
    mean = cost.sum().item() / len(work)
    assert work.max().item() <= 1.05 * mean + cost.min().item(), (work.max().item(), mean)
    if shape == SCHEDULE_SHAPES[0]:
        assert block_work(cost, 132, dynamic=False).max().item() > 1.1 * work.max().item()


def test_persistent_schedule_keeps_kv_heads_together():
    """GQA: an L2 section holds whole groups of query heads that share a K/V head, as many K/V heads
    as half the L2 holds (K and V of one head: 2 x seqlen_k x head_dim x 2 bytes), the narrower
    section first; with an L2 too small for one head's K and V, a section is one group."""
    b, h, hk, s, d = 4, 32, 8, 4096, 128
    l2 = 50 * 2**20
    group, q_tiles = h // hk, s // 128
    kv_heads_fit = (l2 // 2) // (2 * s * d * 2)  # 12 of the 32 (batch, K/V head) pairs
    order = tile_order(b, h, hk, s, s, d, True, l2)
    first = (b * hk) % kv_heads_fit  # 8: the narrower section
    pairs, q_tile, start = [], [], 0
    for width in [first] + [kv_heads_fit] * ((b * hk) // kv_heads_fit):  # in K/V heads
        section = torch.arange(start, start + width * group)  # its (batch, head) pairs
        pairs.append(section.repeat(q_tiles))  # the pair is the inner index ...
        q_tile.append(torch.arange(q_tiles - 1, -1, -1).repeat_interleave(len(section)))  # longest first
        start += width * group
    assert torch.equal(order[:, 0] * h + order[:, 1], torch.cat(pairs))
    assert torch.equal(order[:, 2], torch.cat(q_tile))
    small = tile_order(b, h, hk, s, s, d, False, 2**20)
    small_kv = small[:, 0] * hk + small[:, 1] // group
    assert torch.equal(small_kv, torch.arange(b * hk).repeat_interleave(group * q_tiles))
    with pytest.raises(RuntimeError, match=r"hopper_tile_order: needs .*heads a whole multiple of heads_kv"):
        tile_order(1, 6, 4, 128, 128, 64, False)


def window_tile_cost(q_tile, seqlen_q, seqlen_k, causal, window):
    """With a window: each query tile's key tiles (128 keys) from the one holding the first key any of
    its rows sees to the one holding the last (none where no row sees a key), plus one for its
    prologue and epilogue; from the mask rule itself (the module docstring's), not the kernel's."""
    left, right = window[0], 0 if causal else window[1]
    first_row = q_tile * 128
    last_row = torch.clamp(first_row + 128, max=seqlen_q) - 1
    diag = seqlen_k - seqlen_q
    lo = torch.clamp(first_row + diag - left, min=0) if left >= 0 else torch.zeros_like(first_row)
    hi = torch.clamp(last_row + diag + right, max=seqlen_k - 1) if right >= 0 else torch.full_like(last_row,
                                                                                                    seqlen_k - 1)
    tiles = torch.where(lo <= hi, hi // 128 - lo // 128 + 1, torch.zeros_like(lo))
    return tiles + 1


# (batch, heads, heads_kv, seqlen_q, seqlen_k, causal, window): the benchmark's sliding window,
# a window both ways (a rise, a level and a fall), a left window over fewer query rows than keys
# and more, a right-only window that leaves rows without keys, one wider than the sequence.
WINDOW_SCHEDULES = [(1, 16, 16, 32768, 32768, True, (4095, 0)), (2, 8, 2, 4000, 4000, False, (300, 700)),
                    (2, 4, 4, 1000, 3000, False, (200, -1)), (2, 4, 4, 3000, 1000, False, (200, 5)),
                    (3, 4, 2, 2500, 2500, False, (-1, 129)), (1, 2, 2, 700, 700, True, (5000, 0))]


@pytest.mark.parametrize("shape", WINDOW_SCHEDULES, ids=str)
def test_persistent_window_schedule(shape):
    """With a window (the kWindowSoftcap instantiation, tile_schedule.h): every tile exactly once,
    the L2 sections as without one (whole heads per section), and inside a section the query tiles
    longest window walk first, within one key tile (the slopes of the walk are taken alternately,
    one tile shorter per step on either side); on 132 blocks drawing from the counter, where there are
    at least three tiles a block, the busiest within 5% of the average plus one shortest tile."""
    b, h, hk, sq, sk, causal, window = shape
    order = tile_order(b, h, hk, sq, sk, 128, causal, window=window)
    q_tiles = -(-sq // 128)
    ids = (order[:, 0] * h + order[:, 1]) * q_tiles + order[:, 2]
    assert torch.equal(ids.sort().values, torch.arange(b * h * q_tiles)), "a tile missing or taken twice"
    cost = window_tile_cost(order[:, 2], sq, sk, causal, window)
    per_tile = window_tile_cost(torch.arange(q_tiles), sq, sk, causal, window)
    assert per_tile.max() - per_tile.min() > 1, "every walk alike: the order cannot be tested here"
    # The first L2 section: its pairs take rank 0 (one query tile) side by side, then rank 1, ...
    width = int((order[:, 2] != order[0, 2]).nonzero()[0]) if (order[:, 2] != order[0, 2]).any() else len(order)
    section = order[:width * q_tiles]
    assert (section[:, 0] * h + section[:, 1]).unique().numel() == width, "a section with part of a head"
    ranks = section[::width, 2]
    assert torch.equal(ranks.sort().values, torch.arange(q_tiles)), "a rank that is not one query tile"
    walks = window_tile_cost(ranks, sq, sk, causal, window)
    assert walks[0] == per_tile.max(), "the longest walk does not come first"
    later = torch.flip(torch.cummax(torch.flip(walks, [0]), 0).values, [0])  # the longest walk from here on
    assert torch.all(later <= walks + 1), f"a later walk longer by more than a tile: {walks.tolist()}"
    if len(cost) < 3 * 132:
        return  # a tile or two per block: nothing to balance (one long tile is most of a block's work)
    work = block_work(cost, 132, dynamic=True)
    mean = cost.sum().item() / len(work)
    assert work.max().item() <= 1.05 * mean + cost.min().item(), (work.max().item(), mean)


def test_persistent_window_schedule_without_window_is_unchanged():
    """A softcap alone takes the window's decode (the same instantiation), and its order is the plain
    one's longest first where that has one (causal), level walks in any order otherwise; a plain
    causal call's right bound changes nothing (causal is right = 0)."""
    for causal in (False, True):
        capped = tile_order(2, 4, 2, 1000, 1000, 64, causal, softcap=30.0)
        plain = tile_order(2, 4, 2, 1000, 1000, 64, causal)
        assert torch.equal(capped[:, :2], plain[:, :2])
        if causal:
            assert torch.equal(capped, plain)
    assert torch.equal(tile_order(2, 4, 2, 1000, 1000, 64, True, window=(-1, 9)),
                       tile_order(2, 4, 2, 1000, 1000, 64, True))


# Query lengths of packed batches: the benchmark's, empty sequences, one token, lengths around the
# 128-row tile, one sequence, none, a max_seqlen_q longer than any sequence.
VARLEN_SCHEDULES = [([128, 8192, 256, 4096, 512, 2048, 1024, 3072, 384, 1536, 640, 2560, 768, 5120, 896, 1792], 16,
                     8192), ([1, 17, 128, 0, 129, 4097, 0], 4, 4097), ([300], 2, 300), ([0, 0], 3, 64), ([], 2, 10),
                    ([5, 130, 129], 1, 1000)]


@pytest.mark.parametrize("lengths,heads,max_q", VARLEN_SCHEDULES, ids=lambda x: str(x)[:20])
def test_persistent_varlen_schedule(lengths, heads, max_q):
    """The persistent rung's packed order (tile_schedule.h, through hopper_varlen_tile_order, which
    decodes each index with the kernel's functions): every (sequence, head, query tile) of the
    sequences' own tiles exactly once and nothing past a sequence's end (no block draws an empty
    item), query tiles from the top down (causal: longest first over sequences of any length), the
    sequences of a rank longest first and a sequence's heads side by side (GQA groups together)."""
    order = OPS.hopper_varlen_tile_order(lengths, heads, max_q)
    tiles = [-(-n // 128) for n in lengths]
    want = sorted((b, h, t) for b, n in enumerate(tiles) for h in range(heads) for t in range(n))
    assert sorted(map(tuple, order.tolist())) == want, "a tile missing, taken twice, or past a sequence's end"
    if len(order) == 0:
        return
    q_tile = order[:, 2]
    assert torch.all(torch.diff(q_tile) <= 0), "query tiles not from the top down"
    for t in q_tile.unique().tolist():
        rows = order[q_tile == t]
        seqs = rows[::heads, 0].tolist()
        assert torch.equal(rows[:, 0], torch.tensor(seqs).repeat_interleave(heads)), "a sequence's heads apart"
        assert torch.equal(rows[:, 1], torch.arange(heads).repeat(len(seqs)))
        assert seqs == sorted(seqs, key=lambda b: (-tiles[b], b)), "a rank's sequences not longest first"


def test_persistent_varlen_schedule_balances_the_blocks():
    """The benchmark's 16 sequences, 16 heads, causal, on 132 blocks drawing from the counter in the
    packed order: the busiest block within 5% of the average plus one of the shortest tiles, as the
    padded order on its shapes (test_persistent_schedule_balances_the_blocks)."""
    lengths, heads, max_q = VARLEN_SCHEDULES[0]
    order = OPS.hopper_varlen_tile_order(lengths, heads, max_q)
    cost = order[:, 2] + 1 + 1  # a causal tile's key tiles (its index + 1) plus its prologue and epilogue
    work = block_work(cost, 132, dynamic=True)
    mean = cost.sum().item() / len(work)
    assert work.max().item() <= 1.05 * mean + cost.min().item(), (work.max().item(), mean)


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(shape, dtype=dtype, device=device)


MISUSES = {
    "q 3-D": (lambda: flash_attention.attention(_t(2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8)),
              r"attention_forward: q has shape \[2, 5, 8\] \(3 dims\); it must have 4: \(batch, heads, seqlen, head_dim\)"),
    "k 5-D": (lambda: flash_attention.attention(_t(1, 2, 5, 8), _t(1, 1, 2, 5, 8), _t(1, 2, 5, 8)),
              r"attention_forward: k has shape \[1, 1, 2, 5, 8\] \(5 dims\)"),
    "dtype mix": (lambda: flash_attention.attention(_t(1, 2, 5, 8), _t(1, 2, 5, 8, dtype=torch.float64),
                                                    _t(1, 2, 5, 8)),
                  r"attention_forward: k is Double but q is Float \(no implicit type promotion\)"),
    "float16 on cpu": (lambda: flash_attention.attention(*(_t(1, 2, 5, 8, dtype=torch.float16) for _ in range(3))),
                       r"attention_forward: q has dtype Half, which is not supported \(supported: Float, Double\)"),
    "integer q": (lambda: flash_attention.attention(*(torch.ones(1, 2, 5, 8, dtype=torch.int32) for _ in range(3)),
                                                    scale=1.0),
                  r"attention_forward: q has dtype Int, which is not supported"),
    "device mix": (lambda: flash_attention.attention(_t(1, 2, 5, 8), _t(1, 2, 5, 8, device="meta"), _t(1, 2, 5, 8)),
                   r"attention_forward: k is on meta but q is on cpu"),
    "heads not a multiple": (lambda: flash_attention.attention(_t(1, 6, 5, 8), _t(1, 4, 5, 8), _t(1, 4, 5, 8)),
                             r"attention_forward: q has 6 heads and k and v have 4; the query heads must be a whole "
                             r"multiple of the kv heads"),
    "more kv heads than q heads": (lambda: flash_attention.attention(_t(1, 2, 5, 8), _t(1, 4, 5, 8), _t(1, 4, 5, 8)),
                                   r"attention_forward: q has 2 heads and k and v have 4"),
    "k/v seqlen mismatch": (lambda: flash_attention.attention(_t(1, 2, 5, 8), _t(1, 2, 6, 8), _t(1, 2, 7, 8)),
                            r"attention_forward: k has shape \[1, 2, 6, 8\] but v has shape \[1, 2, 7, 8\]"),
    "batch mismatch": (lambda: flash_attention.attention(_t(2, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8)),
                       r"attention_forward: q has batch 2 but k has batch 1"),
    "head_dim mismatch": (lambda: flash_attention.attention(_t(1, 2, 5, 8), _t(1, 2, 5, 4), _t(1, 2, 5, 4)),
                          r"attention_forward: q has head_dim 8 but k and v have head_dim 4"),
    "head_dim 0": (lambda: flash_attention.attention(_t(1, 2, 5, 0), _t(1, 2, 5, 0), _t(1, 2, 5, 0)),
                   r"attention_forward: head_dim is 0"),
    "last dim strided": (lambda: flash_attention.attention(_t(1, 2, 8, 5).transpose(-1, -2), _t(1, 2, 5, 8),
                                                           _t(1, 2, 5, 8)),
                         r"attention_forward: q's last dim \(head_dim\) is not contiguous \(stride 5\)"),
    "unknown version": (lambda: flash_attention.attention(_t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8),
                                                          version="v1"),
                        r"attention_forward: unknown version 'v1'; expected one of naive, tiled, mma, pipelined, tuned, split_kv, wgmma, warp_specialized, pingpong, persistent \(or None"),
    "backward lse dtype": (lambda: flash_attention.attention_backward(
        _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8),
        _t(1, 2, 5, dtype=torch.float64), 0.5),
        r"attention_backward: lse has dtype Double but must be Float for q of dtype Float"),
    "backward lse shape": (lambda: flash_attention.attention_backward(
        _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 4), 0.5),
        r"attention_backward: lse has shape \[1, 2, 4\] but must be \(batch, heads, seqlen_q\)"),
    "backward out shape": (lambda: flash_attention.attention_backward(
        _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 4, 8), _t(1, 2, 5), 0.5),
        r"attention_backward: out has shape \[1, 2, 4, 8\] and grad_out \[1, 2, 5, 8\]; both must have q's shape"),
    "backward unknown version": (lambda: flash_attention.attention_backward(
        _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5), 0.5,
        version="v2"),
        r"attention_backward: unknown version 'v2'; expected one of naive, mma, mma_dqpass, wgmma \(or None"),
}


@pytest.mark.parametrize("misuse", list(MISUSES))
def test_misuse_raises_clear_error(misuse):
    call, message = MISUSES[misuse]
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("version", flash_attention.VERSIONS["attention_forward"])
def test_cpu_accepts_every_version_name(version):
    """version= names a CUDA rung; on the CPU every name runs the reference (a typo still fails:
    the misuse cases above)."""
    q, k, v = make_qkv(1, 2, 2, 7, 9, 8, dtype=torch.float64)
    out, lse = flash_attention.attention(q, k, v, causal=True, return_lse=True, version=version)
    assert_forward(out, reference(q, k, v, True)[0], torch.float64, version)
    go = torch.randn_like(out)
    for bwd in flash_attention.VERSIONS["attention_backward"]:
        grads = flash_attention.attention_backward(go, q, k, v, out, lse, 0.3, True, version=bwd)
        assert all(torch.equal(g, e) for g, e in
                   zip(grads, flash_attention.attention_backward(go, q, k, v, out, lse, 0.3, True))), bwd


def test_any_head_dim_on_cpu():
    """The CUDA head-dim list binds CUDA only: the reference takes any head_dim."""
    q, k, v = make_qkv(1, 2, 2, 7, 9, 5, dtype=torch.float64)
    assert_forward(flash_attention.attention(q, k, v, causal=True), reference(q, k, v, True)[0], torch.float64)


def test_dispatch_rule_on_any_gpu():
    """version=None's rule (csrc/attention/attention_ops.cpp), asked with made-up devices on this
    machine: part 3's rungs on a Hopper with the sm_90a kernels built, split_kv where the grid is too
    small for the GPU's SM count, the tensor-core rungs from sm_80, tiled below or for 32-bit."""
    rule = flash_attention.dispatch_rule
    hopper = dict(cuda=True, capability=(9, 0), sms=132, hopper_built=True)
    big = (4, 16, 1024, 128)
    assert rule("attention_forward", big, dtype=torch.bfloat16, **hopper) == "pingpong"
    assert rule("attention_forward", big[:3] + (64,), dtype=torch.float16, **hopper) == "persistent"
    # the persistent grid where the walks over the keys are short: at head_dim 128 at most 512 keys
    # when they are even, 4096 when uneven (causal: the shortest at most half the longest); at 64,
    # where both rungs run the same consumers, 4096 and 8192; ping-pong's plain grid with its
    # intra-warpgroup overlap for longer walks
    for s_q, s_k, causal, want in ((512, 512, False, "persistent"), (1024, 1024, False, "pingpong"), (4096, 4096, True, "persistent"),
                                   (4097, 4097, True, "pingpong"), (8192, 8192, True, "pingpong"),
                                   (16384, 16384, True, "pingpong"), (1024, 4096, True, "pingpong"),
                                   (2049, 4096, True, "persistent"), (4096, 1024, True, "persistent")):
        assert rule("attention_forward", (2, 16, s_q, 128), (2, 16, s_k, 128), dtype=torch.bfloat16,
                    causal=causal, **hopper) == want, (s_q, s_k, causal)
    # one key past the bound (a batch of 4: at 2 x 16 heads 160 blocks would split the keys instead)
    assert rule("attention_forward", (4, 16, 513, 128), dtype=torch.bfloat16, **hopper) == "pingpong"
    for s_q, s_k, causal, want in ((4096, 4096, False, "persistent"), (4097, 4097, False, "pingpong"),
                                   (8192, 8192, True, "persistent"), (8193, 8193, True, "pingpong"),
                                   (2048, 8192, True, "pingpong"), (4097, 8192, True, "persistent")):
        assert rule("attention_forward", (2, 16, s_q, 64), (2, 16, s_k, 64), dtype=torch.float16,
                    causal=causal, **hopper) == want, (s_q, s_k, causal)
    assert rule("attention_forward", big[:3] + (256,), dtype=torch.bfloat16, **hopper) == "warp_specialized"
    assert rule("attention_forward", big[:3] + (96,), dtype=torch.bfloat16, **hopper) == "split_kv"
    assert rule("attention_forward", big, dtype=torch.bfloat16, scale=-0.1, **hopper) == "split_kv"
    assert rule("attention_forward", big, dtype=torch.bfloat16, **{**hopper, "hopper_built": False}) == "split_kv"
    assert rule("attention_forward", big, dtype=torch.float32, **hopper) == "tiled"
    # a few query rows against many keys: the split rung, Hopper or not
    assert rule("attention_forward", (1, 4, 1, 128), (1, 4, 8192, 128), dtype=torch.bfloat16, **hopper) == "split_kv"
    assert rule("attention_forward", big, dtype=torch.bfloat16, cuda=True, capability=(8, 0), sms=108) == "split_kv"
    assert rule("attention_forward", big, dtype=torch.bfloat16, cuda=True, capability=(7, 5), sms=40) == "tiled"
    assert rule("attention_forward", big, dtype=torch.bfloat16, cuda=False) == "tiled"
    # the SM count decides: 2 x 16 heads x 2 query tiles = 64 blocks fill 80% of 40 SMs' two slots
    # each, not of 132's, where the Hopper rung gives way to splitting the keys
    mid = (2, 16, 256, 128)
    assert rule("attention_forward", mid, dtype=torch.bfloat16, **{**hopper, "sms": 40}) == "persistent"
    assert rule("attention_forward", mid, dtype=torch.bfloat16, **hopper) == "split_kv"
    # the backward: part 3's rung on a Hopper with it built, at its head dims; the deterministic
    # dQ pass where torch.use_deterministic_algorithms(True) asks for the same bits every run
    assert rule("attention_backward", big, dtype=torch.bfloat16, **hopper) == "wgmma"
    assert rule("attention_backward", big[:3] + (64,), dtype=torch.float16, causal=True, **hopper) == "wgmma"
    assert rule("attention_backward", big, dtype=torch.bfloat16, deterministic=True, **hopper) == "mma_dqpass"
    assert rule("attention_backward", big[:3] + (96,), dtype=torch.bfloat16, **hopper) == "mma_dqpass"
    assert rule("attention_backward", big, dtype=torch.bfloat16, **{**hopper, "hopper_built": False}) == "mma_dqpass"
    assert rule("attention_backward", big, dtype=torch.bfloat16, **{**hopper, "capability": (9, 1)}) == "mma_dqpass"
    assert rule("attention_backward", big, dtype=torch.bfloat16, cuda=True, capability=(8, 0), sms=108) == "mma_dqpass"
    assert rule("attention_backward", big[:3] + (256,), dtype=torch.bfloat16, **hopper) == "naive"
    assert rule("attention_backward", big, dtype=torch.float64, **hopper) == "naive"
    assert rule("attention_backward", big, dtype=torch.bfloat16, cuda=True, capability=(7, 5), sms=40) == "naive"


def test_meta_tensors_give_shapes():
    q, k, v = (torch.empty(2, 8, 33, 48, device="meta", dtype=torch.bfloat16) for _ in range(3))
    out, lse = flash_attention.attention(q, k[:, :2], v[:, :2], return_lse=True)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.device.type == "meta"
    assert lse.shape == (2, 8, 33) and lse.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# 9. CUDA: every rung against the float64 reference
# ---------------------------------------------------------------------------------------------
# The ladders as the extension reports them (test_versions_table_matches_dispatch holds VERSIONS
# to it), so a new rung is tested here the day it is added.
FORWARD_VERSIONS = flash_attention.VERSIONS["attention_forward"]
BACKWARD_VERSIONS = flash_attention.VERSIONS["attention_backward"]
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# The tensor-core rungs take the 16-bit types only, on sm_80 and newer (mma.sync m16n8k16 in
# bfloat16 and cp.async); the glue refuses anything else with a message (tested below).
TENSOR_CORE_VERSIONS = ("mma", "pipelined", "tuned", "split_kv")
# Part 3's rungs: sm_90a kernels, in builds whose arch list had 9.0, on compute capability 9.0 only,
# at head_dim 64, 128 and 256 (test_cuda_hopper_refusals holds the refusals elsewhere).
HOPPER_VERSIONS = ("wgmma", "warp_specialized", "pingpong", "persistent")
HOPPER_HEAD_DIMS = (64, 128, 256)
HALF_DTYPES = (torch.float16, torch.bfloat16)
# Part 3's backward rung: the same build and GPU, head_dim 64 and 128 (dK and dV of 64 keys in
# registers); dQ by float32 atomics, like "mma".
HOPPER_BACKWARD_VERSIONS = ("wgmma",)
HOPPER_BACKWARD_HEAD_DIMS = (64, 128)
TENSOR_CORE_BACKWARD = ("mma", "mma_dqpass") + HOPPER_BACKWARD_VERSIONS
DQ_ATOMIC_BACKWARD = ("mma", "wgmma")  # dQ's last bits vary from run to run


def hopper_runs():
    return torch.cuda.get_device_capability() == (9, 0) and flash_attention.hopper_kernels_built()


def takes(version, dtype, head_dim):
    """Whether forward rung `version` runs dtype at head_dim on this GPU (call after require_cuda)."""
    if version in HOPPER_VERSIONS:
        return dtype in HALF_DTYPES and head_dim in HOPPER_HEAD_DIMS and hopper_runs()
    if version not in TENSOR_CORE_VERSIONS:
        return True
    return dtype in HALF_DTYPES and torch.cuda.get_device_capability()[0] >= 8


def forward_versions(dtype, head_dim):
    return [v for v in FORWARD_VERSIONS if takes(v, dtype, head_dim)]


def skip_unless_takes(version, dtype, head_dim):
    if not takes(version, dtype, head_dim):
        pytest.skip(f"{version} does not take {dtype_id(dtype)} at head_dim {head_dim} on this GPU "
                    "(test_cuda_tensor_core_refusals, test_cuda_hopper_refusals)")


def takes_backward(version, dtype, head_dim):
    """Whether backward rung `version` runs dtype at head_dim (the tensor-core ones: <= 128; part 3's
    "wgmma": 64 and 128 on a Hopper with the sm_90a kernels built)."""
    if version in HOPPER_BACKWARD_VERSIONS:
        return dtype in HALF_DTYPES and head_dim in HOPPER_BACKWARD_HEAD_DIMS and hopper_runs()
    return version not in ("mma", "mma_dqpass") or (takes("mma", dtype, head_dim) and head_dim <= 128)


def rounding_bounds(q, k, v, grad_out, causal, window=(-1, -1), softcap=0.0):
    """What rounding P and dS to the input type before their products can cost each gradient
    (the tensor-core backward does, as FlashAttention 2 does): u * the same products taken over
    absolute values, twice for dQ and dK (dS carries P's rounding and its own). float64 on the
    CPU; dk and dv summed over each kv head's query heads, as the gradients are. With a softcap
    that bfloat16 computes with tanh.approx.f32 (softcap.cuh), P also carries that tanh's error
    (TANH_APPROX_ERROR * softcap, relative), and dS's factor 1 - tanh^2 twice it, absolute."""
    q, k, v, go = (t.detach().cpu().double() for t in (q, k, v, grad_out))
    u = UNIT_ROUNDOFF[grad_out.dtype]
    approx = tanh_approx_error(grad_out.dtype, softcap)
    scale = 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out, lse = reference(q, k, v, causal, window=window, softcap=softcap)
    visible = visible_mask(q.shape[2], k.shape[2], causal, window)
    finite = lse.isfinite()[..., None]
    scores = scale * q @ kr.transpose(-1, -2)
    dcap = torch.ones(())
    if softcap > 0:
        t = torch.tanh(scores / softcap)
        scores, dcap = softcap * t, 1 - t * t
    p = torch.where(visible & finite, torch.exp(scores - lse.nan_to_num(neginf=0)[..., None]), torch.zeros(()))
    ds_uncapped = p * (go @ vr.transpose(-1, -2) - (go * out).sum(-1, keepdim=True))
    # u + approx relative in P and so in dS, and the derivative's own error, 2 t dt: 2 * 2^-11 absolute
    derivative = 2 * TANH_APPROX_ERROR if approx else 0.0
    ds = ds_uncapped.abs() * (dcap * (1 + approx / u) + derivative / u)
    p = p * (1 + approx / u)

    def per_kv_head(t):  # (b, heads, s, d) -> (b, heads_kv, s, d), summed over the group
        return t.unflatten(1, (k.shape[1], group)).sum(2)
    return (2 * u * scale * ds.abs() @ kr.abs(),
            per_kv_head(2 * u * scale * ds.abs().transpose(-1, -2) @ q.abs()),
            per_kv_head(u * p.transpose(-1, -2) @ go.abs()))

# CUDA forward tolerances (rtol, atol) against the float64 reference of the same (already
# rounded) inputs. Every rung computes in float32 (float64 for float64) and rounds once, at the
# store of O. So for the 16-bit types the rounding of O dominates: half an ulp, 2^-11 relative
# for float16 and 2^-8 for bfloat16; rtol at twice that (eps), with atol for outputs near 0,
# where the float32 sums of up to 1000 terms of |p v| <= 8 leave ~1e-6. float32 itself: exp,
# the running rescales of the tiled rung and sums over 1000 keys, each a few float32 ulps:
# 2e-5 / 5e-5 is a few times that and far below what a wrong mask or head costs (O(0.1)).
CUDA_FORWARD_TOL = {torch.float32: (2e-5, 5e-5), torch.float16: (2 ** -10, 1e-4),
                    torch.bfloat16: (2 ** -7, 1e-3), torch.float64: (1e-10, 1e-10)}
# The tensor-core rungs also round P to the input type before P V (the mma takes 16-bit
# operands; FlashAttention 2 and SDPA's flash backend do the same): each p_j carries a relative
# error of at most u (2^-11 float16, 2^-8 bfloat16), so o = sum p_j v_j / l moves by at most
# u * max |v_j|. That bound, added to atol, is what the tensor-core rungs are held to.
UNIT_ROUNDOFF = {torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8}
# bfloat16 with softcap <= 8 takes tanh.approx.f32 (softcap.cuh): an error of about 2^-11 (the PTX
# ISA's bound), so about 2^-11 softcap in a capped score and relatively in its p; the same
# u * max |v| argument bounds what that moves o by. Every other softcap computes tanh to float32
# ulps.
TANH_APPROX_ERROR = 2 ** -11


def tanh_approx_error(dtype, softcap):
    return TANH_APPROX_ERROR * softcap if dtype == torch.bfloat16 and 0 < softcap <= 8 else 0.0


def forward_tol(dtype, version, v, softcap=0.0):
    rtol, atol = CUDA_FORWARD_TOL[dtype]
    if version in TENSOR_CORE_VERSIONS + HOPPER_VERSIONS or (version is None and dtype in HALF_DTYPES):
        atol += (UNIT_ROUNDOFF[dtype] + tanh_approx_error(dtype, softcap)) * v.detach().abs().max().item()
    return rtol, atol


# lse is float32 for every non-float64 dtype, from the same rounded inputs: float32 error only.
CUDA_LSE_TOL = {torch.float32: (1e-5, 5e-5), torch.float16: (1e-5, 5e-5), torch.bfloat16: (1e-5, 5e-5),
                torch.float64: (1e-10, 1e-10)}
# Gradients, relative to the largest reference gradient of the tensor (assert_grad's rule). The
# 16-bit grads are rounded once at the store (half an ulp: 2^-12 / 2^-9 of the max at most), but
# the backward also reads the forward's O rounded to 16 bits (D = rowsum(dO * O)), an error of
# that order in every dS: four ulps of the max covers both. float32: sums over up to 1000 rows
# and 4 heads of a kv head.
CUDA_GRAD_TOL = {torch.float32: 1e-4, torch.float16: 2 ** -9, torch.bfloat16: 2 ** -6, torch.float64: 1e-10}

# (heads, heads_kv, seqlen_q, seqlen_k): 1, 17, 127/128/129 around every tile size (8 ... 64),
# 1000 (many tiles, a partial last one), seqlen_q < seqlen_k (decode-like) and > (causal rows
# that see no key), and GQA 2:1, 4:1 and multi-query spread over them.
CUDA_SHAPES = [
    (2, 2, 1, 1),
    (2, 1, 17, 17),
    (4, 2, 127, 127),
    (2, 2, 128, 128),
    (4, 1, 129, 129),
    (2, 2, 1000, 1000),
    (4, 2, 17, 129),
    (2, 1, 129, 17),
    (2, 2, 1, 1000),
    (4, 4, 1000, 33),
]
CUDA_HEAD_DIMS = (32, 64, 128)


def cuda_inputs(heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, batch=2, requires_grad=False):
    return make_qkv(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype=dtype, device="cuda",
                    requires_grad=requires_grad)


def cpu_reference(q, k, v, causal, scale=None, **features):
    """The float64 reference, on the CPU, of exactly the values the kernel read."""
    return reference(q.detach().cpu().double(), k.detach().cpu().double(), v.detach().cpu().double(), causal, scale,
                     **features)


def check_cuda_forward(q, k, v, causal, version, what, ref=None, **features):
    """features: window= and softcap=, passed to the call and the reference alike. ref: the
    reference's (out, lse) when the caller has it already (several rungs on one input)."""
    dtype = q.dtype
    ref, ref_lse = cpu_reference(q, k, v, causal, **features) if ref is None else ref
    # NaN blocks of the outputs' sizes left in the caching allocator: any element a kernel does
    # not write stays NaN and fails below.
    poison_allocator(torch.empty(q.shape, dtype=dtype, device="cuda"))
    poison_allocator(torch.empty(q.shape[:3], dtype=lse_dtype(dtype), device="cuda"))
    out, lse = flash_attention.attention(q, k, v, causal=causal, return_lse=True, version=version, **features)
    assert out.device.type == "cuda" and lse.dtype == lse_dtype(dtype), what
    rtol, atol = forward_tol(dtype, version, v, features.get("softcap", 0.0))
    assert out.dtype == dtype and out.shape == ref.shape, what
    torch.testing.assert_close(out.cpu().double(), ref, rtol=rtol, atol=atol, msg=lambda m: f"{what} out: {m}")
    lse = lse.cpu()
    assert torch.equal(lse.isneginf(), ref_lse.isneginf()), f"{what}: lse is -inf exactly where no key is visible"
    finite = ref_lse.isfinite()
    rtol, atol = CUDA_LSE_TOL[dtype]
    # a log-sum-exp moves by at most the largest error of its terms: tanh.approx's, where it is used
    atol += tanh_approx_error(dtype, features.get("softcap", 0.0))
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=rtol, atol=atol,
                               msg=lambda m: f"{what} lse: {m}")
    # the rows that see no key: exactly 0 (out[~finite] is (rows, head_dim))
    assert torch.all(out.cpu()[~finite] == 0), f"{what}: a row without keys is not 0"


def backward_reference(q, k, v, causal, grad_out, tensor_core, **features):
    """The float64 reference's (dq, dk, dv) for grad_out, and the rounding bounds a tensor-core
    backward is allowed on top of CUDA_GRAD_TOL (zeros for the scalar rungs)."""
    leaves = tuple(t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    expected = torch.autograd.grad(reference(*leaves, causal, **features)[0], leaves, grad_out.cpu().double())
    bounds = rounding_bounds(q, k, v, grad_out, causal, **features) if tensor_core else (0.0, 0.0, 0.0)
    return expected, bounds


def check_cuda_backward(q, k, v, causal, version, what, grad_out=None, ref=None, **features):
    """ref: backward_reference's answer for this grad_out when the caller has it already."""
    dtype = q.dtype
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = flash_attention.attention_forward(q, k, v, scale, causal, **features)
    if grad_out is None:
        grad_out = torch.randn_like(out, dtype=torch.float64).to(dtype)
    for t in (q, k, v):
        poison_allocator(t)
    dq, dk, dv = flash_attention.attention_backward(grad_out, q, k, v, out, lse, scale, causal, version=version,
                                                    **features)
    tensor_core = version in TENSOR_CORE_BACKWARD or (version is None and takes_backward("mma", dtype, q.shape[-1]))
    expected, bounds = backward_reference(q, k, v, causal, grad_out, tensor_core, **features) if ref is None else ref
    assert all(g.dtype == dtype for g in (dq, dk, dv)), what
    check_backward_grads((dq, dk, dv), expected, bounds, what)


def check_backward_grads(grads, expected, bounds, what):
    """dq, dk, dv within CUDA_GRAD_TOL of the largest expected gradient plus the rounding bounds
    (backward_reference's answer), and no NaN (a poisoned output element nobody wrote)."""
    for name, g, e, bound in zip("qkv", grads, expected, bounds):
        assert g.shape == e.shape, (what, name)
        scale_ = max(e.abs().max().item(), 1.0) if e.numel() else 1.0
        error = (g.cpu().double() - e).abs()
        allowed = CUDA_GRAD_TOL[g.dtype] * scale_ + bound
        assert not g.isnan().any() and torch.all(error <= allowed), \
            f"{what} d{name}: max error {error.max().item():.3g}, worst excess {(error - allowed).max().item():.3g}"


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", CUDA_HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", FORWARD_VERSIONS)
def test_cuda_forward_matches_reference(version, dtype, causal, head_dim):
    require_cuda()
    skip_unless_takes(version, dtype, head_dim)
    for heads, heads_kv, seqlen_q, seqlen_k in CUDA_SHAPES:
        q, k, v = cuda_inputs(heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype)
        check_cuda_forward(q, k, v, causal, version,
                           f"{version} {dtype_id(dtype)} h{heads}/{heads_kv} s{seqlen_q}x{seqlen_k} d{head_dim}")


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", (96, 256))
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", FORWARD_VERSIONS)
def test_cuda_forward_other_head_dims(version, dtype, head_dim):
    """The rest of kCudaHeadDims: their own tile shapes (and, for float64 at 256, 64 threads)."""
    require_cuda()
    skip_unless_takes(version, dtype, head_dim)
    for heads, heads_kv, seqlen_q, seqlen_k in [(2, 1, 129, 129), (2, 2, 17, 300), (2, 2, 300, 17)]:
        for causal in (False, True):
            q, k, v = cuda_inputs(heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype)
            check_cuda_forward(q, k, v, causal, version, f"{version} {dtype_id(dtype)} s{seqlen_q}x{seqlen_k} "
                                                         f"d{head_dim} causal={causal}")


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", CUDA_HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("version", BACKWARD_VERSIONS)
def test_cuda_backward_matches_reference(version, dtype, causal, head_dim):
    require_cuda()
    if not takes_backward(version, dtype, head_dim):
        pytest.skip(f"{version} does not take {dtype_id(dtype)} at head_dim {head_dim} on this GPU")
    for heads, heads_kv, seqlen_q, seqlen_k in CUDA_SHAPES:
        q, k, v = cuda_inputs(heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype)
        check_cuda_backward(q, k, v, causal, version,
                            f"{version} {dtype_id(dtype)} h{heads}/{heads_kv} s{seqlen_q}x{seqlen_k} d{head_dim}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=dtype_id)
def test_cuda_backward_other_head_dims(dtype):
    require_cuda()
    for version in BACKWARD_VERSIONS:
        for head_dim in (96, 256):
            if not takes_backward(version, dtype, head_dim):
                continue
            q, k, v = cuda_inputs(4, 2, 65, 40, head_dim, dtype)
            check_cuda_backward(q, k, v, True, version, f"{version} {dtype_id(dtype)} d{head_dim}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_cuda_strided_views(causal, dtype):
    """Strided q/k/v are read in place by every rung: the same bits as contiguous copies (the
    kernels sum in an order the strides do not change), and the reference's values."""
    require_cuda()
    b, h, s, d = 2, 4, 37, 32
    bq = torch.randn(b, s, h, d, device="cuda").to(dtype)
    bk = torch.randn(b, 2, s, d + 9, device="cuda").to(dtype)
    bv = torch.randn(b, 1, s, d, device="cuda").to(dtype)
    q, k, v = bq.transpose(1, 2), bk[..., 1:d + 1], bv.expand(b, 2, s, d)
    assert not q.is_contiguous() and not k.is_contiguous() and v.stride(1) == 0
    for version in forward_versions(dtype, d):
        out, lse = flash_attention.attention(q, k, v, causal=causal, return_lse=True, version=version)
        out_c, lse_c = flash_attention.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal,
                                                 return_lse=True, version=version)
        assert torch.equal(out, out_c) and torch.equal(lse, lse_c), version
        rtol, atol = forward_tol(dtype, version, v)
        torch.testing.assert_close(out.cpu().double(), cpu_reference(q, k, v, causal)[0], rtol=rtol, atol=atol)
    go = torch.randn(b, h, s, d, device="cuda").to(dtype)
    for version in [v for v in BACKWARD_VERSIONS if takes_backward(v, dtype, d)]:
        out, lse = flash_attention.attention_forward(q, k, v, 0.2, causal)
        grads = flash_attention.attention_backward(go.transpose(1, 2).contiguous().transpose(1, 2), q, k, v, out,
                                                   lse, 0.2, causal, version=version)
        grads_c = flash_attention.attention_backward(go, q.contiguous(), k.contiguous(), v.contiguous(), out, lse,
                                                     0.2, causal, version=version)
        for name, g, gc in zip("qkv", grads, grads_c):
            if version in DQ_ATOMIC_BACKWARD and name == "q":  # dQ's atomics: the last bits vary from run to run
                torch.testing.assert_close(g, gc, rtol=2 ** -7, atol=1e-3)
            else:
                assert torch.equal(g, gc), (version, name)


@pytest.mark.cuda
@pytest.mark.parametrize("version", [v for v in FORWARD_VERSIONS if v not in TENSOR_CORE_VERSIONS + HOPPER_VERSIONS])
@pytest.mark.parametrize("shape,causal", [
    ((1, 2, 2, 5, 5, 32), False),
    ((1, 2, 2, 5, 5, 32), True),
    ((2, 1, 1, 3, 6, 32), True),     # seqlen_q < seqlen_k
    ((1, 2, 2, 6, 3, 32), True),     # seqlen_q > seqlen_k: three rows see no key
    ((1, 4, 2, 4, 6, 32), True),     # GQA
    ((1, 4, 1, 5, 4, 32), False),    # multi-query
], ids=lambda x: shape_id(x) if isinstance(x, tuple) else ("causal" if x else "full"))
def test_cuda_gradcheck(shape, causal, version):
    """float64 on the GPU: the scalar rungs take it, so gradcheck checks the CUDA backward
    against finite differences of the CUDA forward (each forward rung in turn)."""
    require_cuda()
    q, k, v = make_qkv(*shape, dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b, c: flash_attention.attention(a, b, c, causal=causal, version=version), (q, k, v))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=dtype_id)
def test_cuda_rows_without_visible_keys(dtype):
    """causal, seqlen_q 70 > seqlen_k 3: rows 0-66 see no key; O 0, lse -inf, no gradient, no
    NaN, in every rung (the tiled rung's whole first tiles see nothing)."""
    require_cuda()
    q, k, v = make_qkv(1, 2, 2, 70, 3, 32, dtype=dtype, device="cuda")
    for version in forward_versions(dtype, 32):
        out, lse = flash_attention.attention(q, k, v, causal=True, return_lse=True, version=version)
        assert torch.all(out[:, :, :67] == 0) and torch.all(lse[:, :, :67] == -math.inf), version
        assert torch.all(lse[:, :, 67:].isfinite()), version
    out, lse = flash_attention.attention_forward(q, k, v, 0.2, True)
    for version in [v for v in BACKWARD_VERSIONS if takes_backward(v, dtype, 32)]:
        dq, dk, dv = flash_attention.attention_backward(torch.randn_like(out), q, k, v, out, lse, 0.2, True,
                                                        version=version)
        assert torch.all(dq[:, :, :67] == 0) and not any(g.isnan().any() for g in (dq, dk, dv)), version


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_cuda_no_keys_and_empty(dtype):
    require_cuda()
    for version in forward_versions(dtype, 32):
        q, k, v = make_qkv(2, 2, 2, 5, 0, 32, dtype=dtype, device="cuda")
        out, lse = flash_attention.attention(q, k, v, return_lse=True, version=version)
        assert torch.equal(out, torch.zeros_like(out)) and torch.all(lse == -math.inf), version
    for shape in [(0, 2, 2, 5, 5, 32), (1, 2, 2, 0, 5, 32), (2, 0, 1, 4, 4, 32), (2, 2, 2, 5, 0, 32)]:
        q, k, v = make_qkv(*shape, dtype=dtype, device="cuda", requires_grad=True)
        for version in forward_versions(dtype, 32):
            out = flash_attention.attention(q, k, v, version=version)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
            assert out.shape == q.shape and dq.shape == q.shape
            # keys no query row reads receive no gradient: zeros, not uninitialized memory
            if shape[3] == 0 or shape[1] == 0:
                assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_cuda_default_dispatch(dtype):
    """version=None (csrc/attention/attention_ops.cpp): the tuned tensor-core forward where it runs
    (16-bit on sm_80+; on Hopper part 3's rung, test_cuda_hopper_default_dispatch), split along
    the keys when the grid is small and the keys many, else the tiled one; never the naive three."""
    require_cuda()
    from coursekit.pytest_plugin import launched_kernels
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, dtype=dtype, device="cuda")
    _, names = launched_kernels(lambda: flash_attention.attention(q, k, v), "flash_attention")
    wanted = "flash_fwd_kernel" if takes("tuned", dtype, 64) else "forward_tiled_kernel"
    if takes("persistent", dtype, 64):  # Hopper: part 3's rung (test_cuda_hopper_default_dispatch)
        wanted = "flash_fwd_hopper_persistent_kernel"
    assert any(wanted in n for n in names) and not any("scores_kernel" in n for n in names), names
    if wanted == "flash_fwd_kernel":
        # kTuned, demangled; 64 keys are one tile: nothing to split, no combine
        assert any("FwdTraits<64, (flash_attention::MmaForward)2>" in n for n in names), names
        assert not any("split_combine_kernel" in n for n in names), names
    if wanted != "forward_tiled_kernel":
        # one query tile of 4 heads against 8192 keys: 4 blocks for 132 SMs, so the keys are split
        q, k, v = make_qkv(1, 4, 4, 1, 8192, 64, dtype=dtype, device="cuda")
        _, names = launched_kernels(lambda: flash_attention.attention(q, k, v), "flash_attention")
        assert any("FwdTraits<64, (flash_attention::MmaForward)3>" in n for n in names), names  # kSplitKv
        assert any("split_combine_kernel" in n for n in names), names


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_split_kv_long_keys(dtype, head_dim):
    """Rung "split_kv" where it splits most: a few query rows against thousands of keys (decoding,
    a prompt chunk against its cache), causal or not, GQA, a partial last key tile, and a causal
    case whose early splits see keys that its later rows' splits do not. Against the reference,
    and against "tuned", which computes the same rows without splitting."""
    require_cuda()
    skip_unless_takes("split_kv", dtype, head_dim)
    for heads, heads_kv, seqlen_q, seqlen_k in [(4, 1, 1, 5001), (8, 2, 77, 4099), (2, 2, 300, 2000)]:
        for causal in (False, True):
            q, k, v = cuda_inputs(heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, batch=1)
            what = f"split_kv {dtype_id(dtype)} h{heads}/{heads_kv} s{seqlen_q}x{seqlen_k} d{head_dim} causal={causal}"
            check_cuda_forward(q, k, v, causal, "split_kv", what)
            split = flash_attention.attention(q, k, v, causal=causal, return_lse=True, version="split_kv")
            whole = flash_attention.attention(q, k, v, causal=causal, return_lse=True, version="tuned")
            # the same exponentials, merged across splits in float32 instead of across tiles
            torch.testing.assert_close(split[1], whole[1], rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} lse: {m}")
            torch.testing.assert_close(split[0].float(), whole[0].float(), **dict(zip(("rtol", "atol"),
                                       forward_tol(dtype, "split_kv", v))), msg=lambda m: f"{what}: {m}")


@pytest.mark.cuda
def test_cuda_deterministic_backward():
    """mma_dqpass has one writer per dQ element: the same bits run after run, and version=None
    takes it when torch.use_deterministic_algorithms(True) asks for that."""
    require_cuda()
    if not takes_backward("mma_dqpass", torch.bfloat16, 64):
        pytest.skip("the tensor-core backward needs sm_80")
    from coursekit.pytest_plugin import launched_kernels
    q, k, v = make_qkv(2, 4, 2, 300, 300, 64, dtype=torch.bfloat16, device="cuda")
    out, lse = flash_attention.attention_forward(q, k, v, 0.125, True)
    go = torch.randn_like(out)
    first = flash_attention.attention_backward(go, q, k, v, out, lse, 0.125, True, version="mma_dqpass")
    for _ in range(3):
        again = flash_attention.attention_backward(go, q, k, v, out, lse, 0.125, True, version="mma_dqpass")
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        _, names = launched_kernels(lambda: flash_attention.attention_backward(go, q, k, v, out, lse, 0.125, True),
                                    "flash_attention")
    finally:
        torch.use_deterministic_algorithms(was)
    assert any("flash_bwd_dq_kernel" in n for n in names), names


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=dtype_id)
@pytest.mark.parametrize("version", TENSOR_CORE_VERSIONS)
def test_cuda_tensor_core_refusals(version, dtype):
    """The tensor-core rungs refuse what they cannot run, naming the rung, the dtype and the way out."""
    require_cuda()
    q, k, v = make_qkv(1, 2, 2, 16, 16, 64, dtype=dtype, device="cuda")
    with pytest.raises(RuntimeError, match=rf"attention_forward: version '{version}' runs on tensor cores and "
                                           r"takes float16 and bfloat16; q is (Float|Double) \(float32 and float64 "
                                           r"run on versions 'naive' and 'tiled'\)"):
        flash_attention.attention(q, k, v, version=version)


@pytest.mark.cuda
@pytest.mark.parametrize("call", ["forward_naive", "forward_tiled", "forward_tuned", "forward_default", "backward"])
def test_cuda_opcheck(call):
    require_cuda()
    q, k, v = make_qkv(2, 4, 2, 9, 12, 32, device="cuda", requires_grad=True)
    out, lse = flash_attention.attention_forward(q.detach(), k.detach(), v.detach(), 0.25, True)
    version = {"forward_naive": "naive", "forward_tiled": "tiled"}.get(call)
    if call == "forward_tuned":  # the last tensor-core rung, in its dtype
        q = q.detach().to(torch.bfloat16).requires_grad_()
        k, v = (t.detach().to(torch.bfloat16).requires_grad_() for t in (k, v))
        version = "tuned"
    if call == "backward":
        torch.library.opcheck(OPS.attention_backward.default,
                              (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, 0.25, True, None))
    else:
        torch.library.opcheck(OPS.attention_forward.default, (q, k, v, 0.25, True, version))


@pytest.mark.cuda
def test_cuda_graph_capture():
    """Every rung replays inside a CUDA graph: no host sync, the naive rungs' workspaces taken
    from the graph's pool through the caching allocator, the current stream honoured. 600 keys
    for 8 query tiles: "split_kv" splits them, so its partials' workspace is captured too."""
    require_cuda()
    q, k, v = make_qkv(2, 4, 2, 100, 600, 64, dtype=torch.bfloat16, device="cuda")
    grad_out = torch.randn(2, 4, 100, 64, device="cuda").to(torch.bfloat16)

    def step():
        results = []
        for version in forward_versions(torch.bfloat16, 64):
            results += flash_attention.attention_forward(q, k, v, 0.125, True, version=version)
        out, lse = results[-2], results[-1]
        for version in [v for v in BACKWARD_VERSIONS if takes_backward(v, torch.bfloat16, 64)]:
            results += [(version, g) for g in
                        flash_attention.attention_backward(grad_out, q, k, v, out, lse, 0.125, True, version=version)]
        return results

    captured, expected = capture_and_replay(step)
    for a, e in zip(captured, expected):
        if isinstance(a, tuple):  # a backward's gradient
            (version, a), (_, e) = a, e
            if version in DQ_ATOMIC_BACKWARD:  # dQ sums through atomics, in whatever order the blocks arrive
                torch.testing.assert_close(a, e, rtol=2 ** -7, atol=1e-3)
                continue
        assert torch.equal(a, e)


@pytest.mark.cuda
def test_cuda_head_dim_list():
    require_cuda()
    q, k, v = make_qkv(1, 2, 2, 16, 16, 48, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match=r"attention_forward: head_dim 48 is not supported on CUDA "
                                           r"\(supported: 32, 64, 96, 128, 256\)"):
        flash_attention.attention(q, k, v)


@pytest.mark.cuda
def test_cuda_device_mix():
    require_cuda()
    q, k, v = make_qkv(1, 2, 2, 16, 16, 64)
    with pytest.raises(RuntimeError, match=r"attention_forward: k is on cuda:0 but q is on cpu"):
        flash_attention.attention(q, k.cuda(), v)


# ---------------------------------------------------------------------------------------------
# 10. The sanitizer's small run (compute-sanitizer runs `pytest -m sanitize` under each tool)
# ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("version", FORWARD_VERSIONS)
def test_sanitizer_small_forward(version):
    """Partial tiles at both ends, rows that see no key, GQA, the smallest and largest head
    dims (the largest tiles and the 64-thread float64 shape), one strided view; 5 rows against
    600 keys make "split_kv" split (and its combine run)."""
    require_cuda()
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        # 32, 96, 256 for part 1's rungs; part 3's take 64 and 256 of these
        for head_dim in (32, 64, 96, 256) if version in HOPPER_VERSIONS else (32, 96, 256):
            if not takes(version, dtype, head_dim):
                continue
            for seqlen_q, seqlen_k in ((1, 1), (17, 33), (70, 17), (5, 600)):
                q, k, v = make_qkv(1, 4, 2, seqlen_q, seqlen_k, head_dim, dtype=dtype, device="cuda")
                check_cuda_forward(q, k, v, True, version, f"{version} {dtype_id(dtype)} d{head_dim}")
    d = 64 if version in HOPPER_VERSIONS else 32
    dtype = torch.bfloat16 if version in TENSOR_CORE_VERSIONS + HOPPER_VERSIONS else torch.float32
    if not takes(version, dtype, d):
        return
    base = torch.randn(1, 33, 2, d + 1, device="cuda").to(dtype)
    q = base[..., 1:].transpose(1, 2)  # misaligned by one element, seq stride 2 (d + 1)
    check_cuda_forward(q, q, q, False, version, f"{version} strided")


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_sanitizer_persistent_walk(causal):
    """The persistent rung over more tiles than a GPU has SMs (3 x 48 heads x 3 query tiles = 432),
    so that each block walks several: the barriers' phases, Q's halves and the turns carried from
    one tile to the next, GQA 3:1, causal rows that see no key (seqlen_q - seqlen_k > 128), d = 64
    (the ping-pong consumers) and 256 (warp_specialized's)."""
    require_cuda()
    for head_dim in (64, 256):
        if not takes("persistent", torch.bfloat16, head_dim):
            continue
        q, k, v = make_qkv(3, 48, 16, 300, 150, head_dim, dtype=torch.bfloat16, device="cuda")
        check_cuda_forward(q, k, v, causal, "persistent", f"persistent walk d{head_dim}")


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("version", BACKWARD_VERSIONS)
def test_sanitizer_small_backward(version):
    require_cuda()
    for dtype in (torch.float32, torch.bfloat16):
        if not takes_backward(version, dtype, 32):
            continue
        for seqlen_q, seqlen_k in ((1, 1), (17, 33), (40, 17), (70, 130)):
            q, k, v = make_qkv(1, 4, 2, seqlen_q, seqlen_k, 32, dtype=dtype, device="cuda")
            check_cuda_backward(q, k, v, True, version, f"{version} {dtype_id(dtype)}")


# ---------------------------------------------------------------------------------------------
# 11. Part 3: the Hopper rungs (TMA, mbarriers, wgmma, warp specialization)
# ---------------------------------------------------------------------------------------------
def skip_unless_hopper():
    require_cuda()
    if not hopper_runs():
        pytest.skip("part 3's rungs need a Hopper GPU (compute capability 9.0) and a build whose arch list had 9.0")


# FLASH_ATTENTION_HOPPER_OVERLAP (flash_fwd_hopper.h, read by the launcher at each call): 1 makes
# rungs "pingpong" and "persistent" (padded, no window or softcap) at d = 64 and 128 run FlashAttention
# 3's intra-warpgroup overlap in their turns instead of the joint schedule, 0 neither; unset, the
# measured default: "pingpong" overlaps, "persistent" does not. Elsewhere it does nothing. The rung
# tests run with it off and on (the fixture), since the bench times both schedules
# (test_cuda_hopper_overlap_matches_joint compares the two, test_cuda_hopper_overlap_default holds
# the default).
HOPPER_OVERLAP_KNOB = "FLASH_ATTENTION_HOPPER_OVERLAP"


@pytest.fixture(params=("joint", "overlap"))
def hopper_schedule(request, monkeypatch):
    """Rung "pingpong"'s schedule for the test's calls: the knob set to 0 or 1."""
    monkeypatch.setenv(HOPPER_OVERLAP_KNOB, "1" if request.param == "overlap" else "0")
    return request.param


# CUDA_SHAPES and 4097, a tile past 4096, in the square, decode-like and wide cases.
HOPPER_SHAPES = CUDA_SHAPES + [(2, 1, 4097, 4097), (4, 2, 129, 4097), (2, 2, 4097, 129)]


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", HOPPER_HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_hopper_forward(dtype, causal, head_dim, hopper_schedule):
    """Every Hopper rung against the float64 reference, at lengths around the 128-row and
    64/128-key tiles, 4097, seqlen_q != seqlen_k both ways, GQA and multi-query (the rungs share a
    reference per input: the 4097-long ones cost seconds each on the CPU)."""
    skip_unless_hopper()
    for heads, heads_kv, seqlen_q, seqlen_k in HOPPER_SHAPES:
        q, k, v = cuda_inputs(heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype,
                              batch=1 if max(seqlen_q, seqlen_k) > 1000 else 2)
        ref, ref_lse = cpu_reference(q, k, v, causal)
        for version in HOPPER_VERSIONS:
            what = f"{version} {dtype_id(dtype)} h{heads}/{heads_kv} s{seqlen_q}x{seqlen_k} d{head_dim}"
            poison_allocator(torch.empty(q.shape, dtype=dtype, device="cuda"))
            out, lse = flash_attention.attention(q, k, v, causal=causal, return_lse=True, version=version)
            rtol, atol = forward_tol(dtype, version, v)
            torch.testing.assert_close(out.cpu().double(), ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
            finite = ref_lse.isfinite()
            assert torch.equal(lse.cpu().isneginf(), ref_lse.isneginf()), what
            torch.testing.assert_close(lse.cpu().double()[finite], ref_lse[finite], rtol=1e-5, atol=5e-5,
                                       msg=lambda m: f"{what} lse: {m}")


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_hopper_error_within_twice_sdpa_flash(dtype, causal, head_dim, hopper_schedule):
    """The rungs' error against float64 (root mean square over the output) is at most twice what
    SDPA's flash backend makes on the same inputs: P rounded to 16 bits before P V, as there, and
    the approximate exp2 (ex2.approx, 2 ulp of float32) invisible at that scale."""
    skip_unless_hopper()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = cuda_inputs(8, 8, 1000, 1000, head_dim, dtype)
    ref = cpu_reference(q, k, v, causal)[0]

    def rms(out):
        return (out.cpu().double() - ref).pow(2).mean().sqrt().item()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = rms(F.scaled_dot_product_attention(q, k, v, is_causal=causal))  # square: same mask
    for version in HOPPER_VERSIONS:
        ours = rms(flash_attention.attention(q, k, v, causal=causal, version=version))
        assert ours <= 2 * flash, f"{version}: rms error {ours:.3g} against sdpa_flash's {flash:.3g}"


@pytest.mark.cuda
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_cuda_hopper_strided_views(causal, hopper_schedule):
    """q from a (b, s, h, d) projection and k with padded rows are read by the tensor maps in
    place; v expanded over the kv heads (stride 0, which a tensor map cannot describe) is copied
    first. Same bits as contiguous copies, and the reference's values."""
    skip_unless_hopper()
    b, h, s, d = 2, 4, 300, 64
    q = torch.randn(b, s, h, d, device="cuda").to(torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, 2, s, d + 16, device="cuda").to(torch.bfloat16)[..., 8:d + 8]
    v = torch.randn(b, 1, s, d, device="cuda").to(torch.bfloat16).expand(b, 2, s, d)
    ref = cpu_reference(q, k, v, causal)[0]
    for version in HOPPER_VERSIONS:
        out = flash_attention.attention(q, k, v, causal=causal, version=version)
        assert torch.equal(out, flash_attention.attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                                          causal=causal, version=version)), version
        rtol, atol = forward_tol(torch.bfloat16, version, v)
        torch.testing.assert_close(out.cpu().double(), ref, rtol=rtol, atol=atol)


# The overlap schedule's boundaries (kOverlap, flash_fwd_hopper_kernel.cuh): 1 to 6 key tiles of 128
# (its steps run two at a time, then one: both parities of the last tile, a partial last tile and an
# exact one), the masked loop starting at tile 1, 2 or later (causal rows past the diagonal,
# seqlen_q != seqlen_k both ways), GQA, and a query tile with fewer keys than the block's other rows.
HOPPER_OVERLAP_SHAPES = [(2, 1, 100, 100), (2, 2, 256, 256), (4, 2, 300, 300), (2, 1, 384, 512), (2, 2, 129, 520),
                         (4, 1, 700, 700), (2, 2, 640, 257), (2, 1, 1, 650)]


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_hopper_overlap_matches_joint(dtype, causal, head_dim, monkeypatch):
    """FLASH_ATTENTION_HOPPER_OVERLAP=1 runs the overlap kernel (the profiler's names) and 0 the
    joint one, and the two give the same bits: the overlap moves where O's rescale and each P V
    run, not the arithmetic (O <- O * corr of tile i - 1, then += P V of tile i - 1, in both), so a
    wrong P buffer, stage parity or rescale shows here as a difference, on NaN-poisoned outputs;
    and both within the reference's bound. Rung "persistent"'s overlap consumers: the same bits
    again (test_cuda_hopper_persistent_matches_its_consumers walks many tiles a block)."""
    skip_unless_hopper()
    from coursekit.pytest_plugin import launched_kernels
    for heads, heads_kv, seqlen_q, seqlen_k in HOPPER_OVERLAP_SHAPES:
        q, k, v = cuda_inputs(heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype)
        what = f"{dtype_id(dtype)} h{heads}/{heads_kv} s{seqlen_q}x{seqlen_k} d{head_dim}"
        got = {}
        for knob in ("0", "1"):
            monkeypatch.setenv(HOPPER_OVERLAP_KNOB, knob)
            poison_allocator(torch.empty(q.shape, dtype=dtype, device="cuda"))
            poison_allocator(torch.empty(q.shape[:3], dtype=torch.float32, device="cuda"))
            got[knob], names = launched_kernels(lambda: flash_attention.attention(
                q, k, v, causal=causal, return_lse=True, version="pingpong"), "flash_attention")
            overlap = [n for n in names if f"HopperFwdOverlapTraits<{head_dim}>" in n]
            assert len(overlap) == (knob == "1") and len(names) == 1, f"{what} knob {knob}: {names}"
        (out, lse), (out1, lse1) = got["0"], got["1"]
        assert torch.equal(out1, out), f"{what}: the overlap's out differs from the joint schedule's"
        assert torch.equal(lse1, lse), f"{what}: the overlap's lse differs from the joint schedule's"
        out2, names = launched_kernels(lambda: flash_attention.attention(
            q, k, v, causal=causal, return_lse=True, version="persistent"), "flash_attention")
        assert any("PersistentOverlap" in n for n in names), f"{what} persistent: {names}"
        assert torch.equal(out2[0], out) and torch.equal(out2[1], lse), f"{what}: persistent's overlap differs"
        check_cuda_forward(q, k, v, causal, "pingpong", f"overlap {what}")


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", (64, 128))
def test_cuda_hopper_overlap_default(head_dim, monkeypatch):
    """With the knob unset (and at any value but 0 or 1), rung "pingpong" runs the overlap kernel,
    and "persistent" the overlap one at d = 64 and the joint one at d = 128 (flash_fwd_hopper.h's
    hopper_forward_overlap: what the overlap rows measured), judged by the launched kernels' names."""
    skip_unless_hopper()
    from coursekit.pytest_plugin import launched_kernels
    q, k, v = cuda_inputs(2, 1, 300, 300, head_dim, torch.bfloat16)
    for knob in (None, "auto"):
        if knob is None:
            monkeypatch.delenv(HOPPER_OVERLAP_KNOB, raising=False)
        else:
            monkeypatch.setenv(HOPPER_OVERLAP_KNOB, knob)
        _, names = launched_kernels(lambda: flash_attention.attention(q, k, v, version="pingpong"), "flash_attention")
        assert [n for n in names if f"HopperFwdOverlapTraits<{head_dim}>" in n] == names and len(names) == 1, \
            f"pingpong, knob {knob}: {names}"
        _, names = launched_kernels(lambda: flash_attention.attention(q, k, v, version="persistent"), "flash_attention")
        overlapped = any(f"HopperFwdPersistentOverlapTraits<{head_dim}>" in n for n in names)
        assert any("persistent" in n for n in names) and overlapped == (head_dim == 64), \
            f"persistent, knob {knob}: {names}"


@pytest.mark.cuda
def test_cuda_hopper_overlap_knob_elsewhere_does_nothing(monkeypatch):
    """The knob reaches rungs "pingpong" and "persistent" at d = 64 and 128 alone: at d = 256 (two
    stages, which the overlap cannot run on), on the other rungs, with a window and in the packed
    layout the same kernels run with it set."""
    skip_unless_hopper()
    from coursekit.pytest_plugin import launched_kernels
    monkeypatch.setenv(HOPPER_OVERLAP_KNOB, "1")

    def names_of(call):
        return launched_kernels(call, "flash_attention")[1]
    for head_dim, version in ((256, "pingpong"), (256, "persistent"), (128, "warp_specialized"), (64, "wgmma")):
        q, k, v = make_qkv(2, 4, 4, 300, 300, head_dim, dtype=torch.bfloat16, device="cuda")
        names = names_of(lambda: flash_attention.attention(q, k, v, causal=True, version=version))
        assert names and not any("Overlap" in n for n in names), f"{version} d{head_dim}: {names}"
    q, k, v = make_qkv(2, 4, 4, 300, 300, 128, dtype=torch.bfloat16, device="cuda")
    names = names_of(lambda: flash_attention.attention(q, k, v, causal=True, window=(64, 0), version="persistent"))
    assert names and not any("Overlap" in n for n in names), f"window: {names}"
    lens = [128, 300, 77]
    q, k, v, cu_q, cu_k = varlen_cuda_inputs(lens, lens, 4, 4, 128, torch.bfloat16)
    names = names_of(lambda: flash_attention.attention_varlen(q, k, v, cu_q, cu_k, 300, 300, causal=True,
                                                              version="persistent"))
    assert names and not any("Overlap" in n for n in names), f"packed: {names}"


@pytest.mark.cuda
def test_cuda_hopper_overlap_sass():
    """Where ptxas put the waits in the loaded library's overlap kernels (wgmma_sass.py; NOTES.md,
    "The bf16 forward with the intra-warpgroup overlap"): a WARPGROUP.DEPBAR.LE gsb0, 0x1 before
    each softmax, no other wgmma wait among its exponentials, and no write to a P V's A registers
    before the 0x0 wait that ends it. The joint kernels, with no 0x1 wait, fail the same check."""
    skip_unless_hopper()
    import wgmma_sass
    overlap = sass_functions("OverlapTraits")
    # pingpong's and persistent's, bf16 and fp16, d = 64 and 128
    assert len(overlap) == 8, [name for name, _ in overlap]
    for name, body in overlap:
        insts = wgmma_sass.instructions(body)
        placement = wgmma_sass.depbar_placement(insts)
        writes, seen = wgmma_sass.a_register_writes(insts)
        assert placement["waits_1"] >= 2 and not placement["bad"], (name, placement)
        assert seen > 0 and not writes, (name, writes[:5])
    joint = sass_functions("HopperForwardE2EEE")  # rung "pingpong"'s traits, mangled
    assert joint and all(wgmma_sass.depbar_placement(wgmma_sass.instructions(body))["waits_1"] == 0
                         for _, body in joint)


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_sanitizer_hopper_overlap(causal, monkeypatch):
    """The overlap schedule under the sanitizer: 300 keys (two full tiles and a partial third, the
    last tile even) and 420 (four, the last odd), one key (no step), GQA, d = 64 and 128."""
    skip_unless_hopper()
    monkeypatch.setenv(HOPPER_OVERLAP_KNOB, "1")
    for head_dim in (64, 128):
        for seqlen_q, seqlen_k in ((300, 300), (200, 420), (130, 1)):
            q, k, v = make_qkv(1, 4, 2, seqlen_q, seqlen_k, head_dim, dtype=torch.bfloat16, device="cuda")
            check_cuda_forward(q, k, v, causal, "pingpong", f"overlap s{seqlen_q}x{seqlen_k} d{head_dim}")


# (batch, heads, heads_kv, seqlen_q, seqlen_k): several tiles per block on any GPU of up to 132 SMs
# (4 x 16 x 17 = 1088 tiles), GQA 4:1 with a partial last tile, causal rows that see no key in
# the middle of a block's walk (seqlen_q - seqlen_k > 128), one key, and none (no tile loads
# anything: the blocks only hand out work items and store zeros).
PERSISTENT_WALKS = [(4, 16, 16, 2049, 2049), (2, 32, 8, 1000, 1000), (3, 24, 6, 700, 300), (2, 64, 16, 129, 1),
                    (2, 4, 2, 300, 0)]


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", HOPPER_HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_hopper_persistent_matches_its_consumers(dtype, causal, head_dim, hopper_schedule):
    """The persistent rung runs the consumers of "pingpong" (d = 64, 128) or "warp_specialized"
    (d = 256) over many tiles per block: the same bits as theirs, tile by tile, whatever order the
    blocks drew the tiles in (so every carried barrier phase, Q half and ping-pong turn lined up),
    on NaN-poisoned outputs, and a second call the same bits again."""
    skip_unless_hopper()
    consumers = "pingpong" if head_dim <= 128 else "warp_specialized"
    for batch, heads, heads_kv, seqlen_q, seqlen_k in PERSISTENT_WALKS:
        q, k, v = make_qkv(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype=dtype, device="cuda")
        what = f"{dtype_id(dtype)} b{batch} h{heads}/{heads_kv} s{seqlen_q}x{seqlen_k} d{head_dim}"
        want, want_lse = flash_attention.attention(q, k, v, causal=causal, return_lse=True, version=consumers)
        for _ in range(2):
            poison_allocator(torch.empty(q.shape, dtype=dtype, device="cuda"))
            poison_allocator(torch.empty(q.shape[:3], dtype=torch.float32, device="cuda"))
            out, lse = flash_attention.attention(q, k, v, causal=causal, return_lse=True, version="persistent")
            assert torch.equal(out, want), f"{what}: out differs from {consumers}'s"
            assert torch.equal(lse, want_lse), f"{what}: lse differs from {consumers}'s"


# (batch, heads, heads_kv, seqlen): many short work items per block (2048 to 5120 items, 15 to 39
# per block on 132 SMs), each walking 2 to 5 key tiles, so that at every item boundary the producer
# has the next item's first K/V stage in the ring, and its Q on the way, before the consumers are
# done with this one's; GQA 4:1 and 8:1, and a partial last tile both ways (129, 513).
PERSISTENT_SHORT_WALKS = [(64, 16, 4, 129), (64, 16, 16, 256), (64, 16, 2, 513)]


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_hopper_persistent_short_items(dtype, causal, head_dim, hopper_schedule):
    """The persistent rung where items are short and many: the producer issues an item's first K/V
    stage before its Q and prefetches the next item's into L2 while the consumers are on the last
    one. Against a float64 reference (on the GPU, 8 sequences at a time: the scores of 64 at 513
    keys are 2 GB) and the same bits as "pingpong", its consumers, on NaN-poisoned outputs."""
    skip_unless_hopper()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, heads, heads_kv, seqlen in PERSISTENT_SHORT_WALKS:
        q, k, v = (torch.randn(batch, h, seqlen, head_dim, device="cuda", dtype=torch.float64, generator=gen)
                   .to(dtype) for h in (heads, heads_kv, heads_kv))
        what = f"{dtype_id(dtype)} b{batch} h{heads}/{heads_kv} s{seqlen} d{head_dim}"
        poison_allocator(torch.empty(q.shape, dtype=dtype, device="cuda"))
        poison_allocator(torch.empty(q.shape[:3], dtype=torch.float32, device="cuda"))
        out, lse = flash_attention.attention(q, k, v, causal=causal, return_lse=True, version="persistent")
        want, want_lse = flash_attention.attention(q, k, v, causal=causal, return_lse=True, version="pingpong")
        assert torch.equal(out, want), f"{what}: out differs from pingpong's"
        assert torch.equal(lse, want_lse), f"{what}: lse differs from pingpong's"
        rtol, atol = forward_tol(dtype, "persistent", v)
        for b0 in range(0, batch, 8):
            part = slice(b0, b0 + 8)
            ref, ref_lse = reference(q[part], k[part], v[part], causal)
            torch.testing.assert_close(out[part].double(), ref, rtol=rtol, atol=atol,
                                       msg=lambda m: f"{what} sequences {b0}..: {m}")
            finite = ref_lse.isfinite()
            assert torch.equal(lse[part].isneginf(), ref_lse.isneginf()), what
            torch.testing.assert_close(lse[part].double()[finite], ref_lse[finite], rtol=1e-5, atol=5e-5,
                                       msg=lambda m: f"{what} lse, sequences {b0}..: {m}")


@pytest.mark.cuda
def test_cuda_hopper_persistent_grid_and_graph(hopper_schedule):
    """The persistent kernel is what runs (one launch, the tile counter's clear beside it), and it
    replays from a CUDA graph: the counter is cleared by a captured memset before each replay, so
    the second replay walks every tile again rather than finding the counter at its end."""
    skip_unless_hopper()
    from coursekit.pytest_plugin import launched_kernels
    q, k, v = make_qkv(4, 16, 4, 1000, 1000, 128, dtype=torch.bfloat16, device="cuda")
    names = launched_kernels(lambda: flash_attention.attention(q, k, v, causal=True, version="persistent"),
                             "flash_attention")[1]
    assert sum("flash_fwd_hopper_persistent_kernel" in n for n in names) == 1, names
    want = flash_attention.attention(q, k, v, causal=True, version="pingpong")
    captured, expected = capture_and_replay(lambda: flash_attention.attention(q, k, v, causal=True,
                                                                              version="persistent"))
    assert torch.equal(captured, want) and torch.equal(expected, want)
    # Without the clear, a replay would find the counter past the end: each block would compute the
    # tile it starts with (its own index) and stop, leaving the NaNs below in every other tile.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention.attention(q, k, v, causal=True, version="persistent")
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.cuda
def test_cuda_hopper_default_dispatch(monkeypatch):
    """version=None on Hopper: "persistent" at head_dim 64 and 128, "warp_specialized" at 256
    (csrc/attention/attention_ops.cpp); "split_kv" where the keys would be split, where the scale
    is not positive, and at head dims the Hopper rungs do not take."""
    skip_unless_hopper()
    monkeypatch.setenv(HOPPER_OVERLAP_KNOB, "0")  # the names below are the joint traits'
    from coursekit.pytest_plugin import launched_kernels

    def kernels(q, k, v, **kwargs):
        return launched_kernels(lambda: flash_attention.attention(q, k, v, **kwargs), "flash_attention")[1]
    # 4 x 16 heads x 8 query tiles: 512 blocks, enough that nothing is split
    for head_dim, rung in ((64, 2), (128, 2), (256, 1)):  # HopperForward: 1 warp-specialized, 2 ping-pong
        q, k, v = make_qkv(4, 16, 16, 1024, 1024, head_dim, dtype=torch.bfloat16, device="cuda")
        names = kernels(q, k, v, causal=True)
        # the persistent grid at 64 and 128 (its kernel runs ping-pong's consumers; the profiler's
        # name is cut inside its traits), the plain grid of warp specialization at 256
        if head_dim <= 128:
            assert any(f"flash_fwd_hopper_persistent_kernel<__nv_bfloat16, flash_attention::HopperFwdTraits<{head_dim},"
                       in n for n in names), names
        else:
            assert any(f"HopperFwdTraits<{head_dim}, (flash_attention::HopperForward){rung}>" in n for n in names), names
        names = kernels(q, k, v, scale=-0.1)
        assert any("flash_fwd_kernel" in n for n in names) and not any("hopper" in n for n in names), names
    q, k, v = make_qkv(1, 4, 4, 1, 8192, 64, dtype=torch.bfloat16, device="cuda")
    assert any("split_combine_kernel" in n for n in kernels(q, k, v))
    q, k, v = make_qkv(4, 16, 16, 1024, 1024, 96, dtype=torch.bfloat16, device="cuda")
    assert not any("hopper" in n for n in kernels(q, k, v))


@pytest.mark.cuda
@pytest.mark.parametrize("version", HOPPER_VERSIONS)
def test_cuda_hopper_refusals(version):
    """Each Hopper rung refuses, by name and with the way out, what it cannot run: another dtype,
    a build without its kernels, another GPU, another head dim, a scale that is not positive."""
    require_cuda()
    q, k, v = make_qkv(1, 2, 2, 16, 16, 64, dtype=torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match=rf"attention_forward: version '{version}' runs on tensor cores and "
                                           r"takes float16 and bfloat16; q is Float"):
        flash_attention.attention(q, k, v, version=version)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    if not flash_attention.hopper_kernels_built():
        with pytest.raises(RuntimeError, match=rf"version '{version}' is a Hopper kernel \(sm_90a\), and this build "
                                               r"of flash_attention has none.*use version='tuned'"):
            flash_attention.attention(q, k, v, version=version)
        return
    if torch.cuda.get_device_capability() != (9, 0):
        with pytest.raises(RuntimeError, match=rf"version '{version}' needs a Hopper GPU, compute capability 9.0 "
                                               r".*this GPU is \d+\.\d+: use version='tuned'"):
            flash_attention.attention(q, k, v, version=version)
        return
    q96, k96, v96 = make_qkv(1, 2, 2, 16, 16, 96, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match=rf"version '{version}' takes head_dim 64, 128 or 256 .*head_dim is 96"):
        flash_attention.attention(q96, k96, v96, version=version)
    with pytest.raises(RuntimeError, match=rf"version '{version}' takes scale > 0 .*scale is -0\.5"):
        flash_attention.attention(q, k, v, scale=-0.5, version=version)


@pytest.mark.cuda
def test_cuda_hopper_opcheck_and_compile(monkeypatch):
    """The Hopper rung through the dispatcher's contract (opcheck) and inside torch.compile with
    the default dispatch, which picks it."""
    skip_unless_hopper()
    monkeypatch.setenv(HOPPER_OVERLAP_KNOB, "0")  # the default ("persistent") runs the joint schedule
    q, k, v = make_qkv(2, 4, 2, 129, 200, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    torch.library.opcheck(OPS.attention_forward.default, (q, k, v, 0.125, True, "pingpong"))
    compiled = torch.compile(lambda a, b, c: flash_attention.attention(a, b, c, causal=True), backend="aot_eager",
                             fullgraph=True)
    expected = flash_attention.attention(q, k, v, causal=True, version="pingpong")
    assert torch.equal(compiled(q, k, v), expected)


def sass_functions(name_part):
    """[(mangled name, SASS)] of the loaded library's kernels whose name holds `name_part`, from
    cuobjdump; skips where the toolkit's cuobjdump or the library's path is missing."""
    import shutil
    import subprocess
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump (CUDA toolkit) is not on PATH")
    library = flash_attention.EXTENSION.get("so_path")
    if library is None:
        pytest.skip(f"the library was loaded by route {flash_attention.EXTENSION['route']}, without a path")
    sass = subprocess.run([cuobjdump, "-sass", library], capture_output=True, text=True, check=True).stdout
    chunks = sass.split("Function : ")[1:]
    return [(chunk.split("\n")[0], chunk) for chunk in chunks if name_part in chunk.split("\n")[0]]


# A generic load or store (LD.E / ST.E in the SASS; global ones are LDG / STG, shared ones LDS / STS).
# The Hopper kernels touch memory only through TMA, wgmma's descriptors and shared-memory pointers,
# so one of these means the compiler lost a pointer's address space (a pointer rebuilt from an
# integer does) and reaches shared memory through the generic path, which waits on the long
# scoreboard as global memory does.
GENERIC_ACCESS = re.compile(r"\b(?:LD|ST)\.E\b")


@pytest.mark.cuda
def test_cuda_hopper_sass_has_hgmma():
    """The Hopper rungs really run on the warpgroup tensor-core instructions: in the loaded
    library's SASS every flash_fwd_hopper_kernel holds HGMMA (wgmma on 16-bit inputs; QGMMA, its
    8-bit form, in the FP8 kernels) and UTMALDG (TMA) and no HMMA (mma.sync, the Ampere path); and
    none reaches shared memory by a generic load or store (see GENERIC_ACCESS)."""
    skip_unless_hopper()
    kernels = sass_functions("flash_fwd_hopper_")
    assert len(kernels) >= 24, f"{len(kernels)} Hopper kernels in the SASS (4 rungs x 2 dtypes x 3 head dims)"
    for name, body in kernels:
        wgmma = "QGMMA" if "fp8" in name else "HGMMA"
        assert wgmma in body and "UTMALDG" in body and "HMMA" not in body, name
        assert not GENERIC_ACCESS.search(body), (name, GENERIC_ACCESS.findall(body)[:4])


@pytest.mark.cuda
def test_cuda_hopper_forward_stores_o_16_bytes():
    """The 16-bit forward kernels store O 16 bytes a lane (HopperFwdConfig's kOStoreBytes): a thread's
    two rows of head_dim / 8 words gathered across the quad, head_dim / 16 STG.E.128 in all, and
    no 4- or 8-byte store left but the two of lse. 4-byte stores, as wgmma's accumulator holds O,
    cost the persistent rung 10-14% of its time at 512 keys on an H200 (NOTES.md, "The forward's
    epilogue"). The FP8 kernels have their own epilogue and are left out."""
    import re
    skip_unless_hopper()
    kernels = [(name, body) for name, body in sass_functions("flash_fwd_hopper_") if "fp8" not in name.lower()]
    assert len(kernels) >= 24, f"{len(kernels)} 16-bit Hopper forward kernels in the SASS"
    for name, body in kernels:
        head_dim = int(re.search(r"TraitsILi(\d+)", name).group(1))
        counts = tuple(len(re.findall(pattern, body)) for pattern in (r"STG\.E\.128\b", r"STG\.E\.64\b",
                                                                       r"STG\.E(?![.\w])"))
        assert counts == (head_dim // 16, 0, 2), (name, head_dim, "STG.E.128, STG.E.64, STG.E:", counts)


# The Hopper backward ("wgmma"): a block per 128 keys walking query tiles of 64 rows (d = 128) or 128
# (d = 64). Lengths 1, 17, 129 and 1000 around both tiles (a partial last key tile, a partial last
# query tile), seqlen_q != seqlen_k both ways (causal rows that see no key; a causal walk that
# starts mid-sequence), GQA 4:1 (dK and dV summed over four query heads in one block's walk) and
# 2:1, multi-query.
HOPPER_BACKWARD_SHAPES = [(2, 2, 1, 1), (2, 1, 17, 17), (4, 1, 129, 129), (4, 2, 1000, 1000), (4, 1, 17, 129),
                          (2, 1, 129, 17), (4, 4, 1, 1000), (8, 2, 1000, 33), (4, 1, 300, 1000)]


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", HOPPER_BACKWARD_HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_hopper_backward(dtype, causal, head_dim):
    """dQ, dK and dV of backward rung "wgmma" against the float64 reference, within what rounding
    P and dS to 16 bits allows (rounding_bounds, as for "mma"), on NaN-poisoned outputs."""
    skip_unless_hopper()
    for heads, heads_kv, seqlen_q, seqlen_k in HOPPER_BACKWARD_SHAPES:
        q, k, v = cuda_inputs(heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype)
        check_cuda_backward(q, k, v, causal, "wgmma",
                            f"wgmma {dtype_id(dtype)} h{heads}/{heads_kv} s{seqlen_q}x{seqlen_k} d{head_dim}")


@pytest.mark.cuda
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_hopper_backward_long(dtype, causal):
    """4097 queries and keys (33 key tiles, 65 query tiles, one row and one key past a whole
    tile), and GQA 4:1 with 129 query rows against 4097 keys, head_dim 128: the long walks. The
    float64 reference runs on the GPU here (on the CPU it would take minutes), and "wgmma" is held
    to at most twice the error of "mma_dqpass" (the same rounding of P and dS) plus CUDA_GRAD_TOL."""
    skip_unless_hopper()
    for batch, heads, heads_kv, seqlen_q, seqlen_k in ((1, 1, 1, 4097, 4097), (1, 4, 1, 129, 4097)):
        q, k, v = make_qkv(batch, heads, heads_kv, seqlen_q, seqlen_k, 128, dtype=dtype, device="cuda")
        what = f"wgmma {dtype_id(dtype)} h{heads}/{heads_kv} s{seqlen_q}x{seqlen_k} d128"
        scale = 1 / math.sqrt(128)
        out, lse = flash_attention.attention_forward(q, k, v, scale, causal)
        go = torch.randn_like(out)
        leaves = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
        expected = torch.autograd.grad(reference(*leaves, causal)[0], leaves, go.double())
        ours = flash_attention.attention_backward(go, q, k, v, out, lse, scale, causal, version="wgmma")
        theirs = flash_attention.attention_backward(go, q, k, v, out, lse, scale, causal, version="mma_dqpass")
        check_against_dqpass(ours, theirs, expected, what, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", HOPPER_BACKWARD_HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_hopper_backward_many_query_tiles(dtype, causal, head_dim):
    """1000 query rows (16 tiles of 64 at d = 128, 8 of 128 at d = 64, the last partial) of 8 heads
    against 3000 keys in 2 kv heads (GQA 4:1, 24 key tiles, the last partial): each block walks 64
    steps (32 at d = 64), so the dQ buffers between the consumers and the writer (two at d = 128,
    one at d = 64) wrap 32 times, and 24 blocks of a kv head add into every tile's float32 sums.
    The float64 reference runs on the GPU; "wgmma" is held to at most twice the error of
    "mma_dqpass" (the same rounding of P and dS) plus CUDA_GRAD_TOL, as in the long test."""
    skip_unless_hopper()
    q, k, v = make_qkv(1, 8, 2, 1000, 3000, head_dim, dtype=dtype, device="cuda")
    what = f"wgmma {dtype_id(dtype)} h8/2 s1000x3000 d{head_dim}"
    scale = 1 / math.sqrt(head_dim)
    out, lse = flash_attention.attention_forward(q, k, v, scale, causal)
    go = torch.randn_like(out)
    leaves = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
    expected = torch.autograd.grad(reference(*leaves, causal)[0], leaves, go.double())
    for t in (q, k, v):
        poison_allocator(t)
    ours = flash_attention.attention_backward(go, q, k, v, out, lse, scale, causal, version="wgmma")
    theirs = flash_attention.attention_backward(go, q, k, v, out, lse, scale, causal, version="mma_dqpass")
    check_against_dqpass(ours, theirs, expected, what, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_cuda_hopper_backward_views_and_determinism(causal):
    """q from a (b, s, h, d) projection and k with padded rows are read by the tensor maps in
    place; v expanded over the kv heads (stride 0) is copied first. dK and dV have one writer each:
    the same bits as on contiguous copies and as a second call; dQ (float32 sums added in any order) within a few
    ulps of them."""
    skip_unless_hopper()
    b, h, s, d = 2, 4, 300, 64
    q = torch.randn(b, s, h, d, device="cuda").to(torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, 2, s, d + 16, device="cuda").to(torch.bfloat16)[..., 8:d + 8]
    v = torch.randn(b, 1, s, d, device="cuda").to(torch.bfloat16).expand(b, 2, s, d)
    go = torch.randn(b, s, h, d, device="cuda").to(torch.bfloat16).transpose(1, 2)
    out, lse = flash_attention.attention_forward(q, k, v, 0.125, causal)
    grads = flash_attention.attention_backward(go, q, k, v, out, lse, 0.125, causal, version="wgmma")
    contiguous = flash_attention.attention_backward(go.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                                    out, lse, 0.125, causal, version="wgmma")
    again = flash_attention.attention_backward(go, q, k, v, out, lse, 0.125, causal, version="wgmma")
    for name, g, gc, ga in zip("qkv", grads, contiguous, again):
        if name == "q":
            torch.testing.assert_close(g, gc, rtol=2 ** -7, atol=1e-3)
            torch.testing.assert_close(g, ga, rtol=2 ** -7, atol=1e-3)
        else:
            assert torch.equal(g, gc) and torch.equal(g, ga), name
    check_cuda_backward(q, k, v, causal, "wgmma", "wgmma views", grad_out=go)


@pytest.mark.cuda
def test_cuda_hopper_backward_empty():
    """No query rows (seqlen_q 0, or no query heads): no key is seen, dK and dV are zeros (written by
    the launcher's own small kernel: the main kernel's query maps would describe an empty tensor).
    No keys: dQ is zeros (its float32 sums were never added to), dK and dV empty."""
    skip_unless_hopper()
    for shape in [(1, 2, 2, 0, 5, 64), (2, 0, 1, 4, 4, 128), (1, 2, 2, 5, 0, 64), (0, 2, 2, 5, 5, 64)]:
        q, k, v = make_qkv(*shape, dtype=torch.bfloat16, device="cuda")
        out, lse = flash_attention.attention_forward(q, k, v, 0.125, False)
        poison_allocator(torch.empty(k.shape, dtype=k.dtype, device="cuda"))
        dq, dk, dv = flash_attention.attention_backward(torch.randn_like(out), q, k, v, out, lse, 0.125, False,
                                                        version="wgmma")
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape, shape
        for g in (dq, dk, dv):
            assert torch.equal(g, torch.zeros_like(g)), shape


@pytest.mark.cuda
def test_cuda_hopper_backward_launches(monkeypatch):
    """What "wgmma" launches: the statistics kernel, the main kernel on its head dim's traits, dQ's
    conversion; no part 1 backward kernel. version=None runs the same kernels (backward_rule), and
    "mma_dqpass"'s under torch.use_deterministic_algorithms(True). The side kernels are the default
    ones whatever the environment says (FLASH_ATTENTION_BWD_SIDE unset)."""
    skip_unless_hopper()
    monkeypatch.delenv("FLASH_ATTENTION_BWD_SIDE", raising=False)
    from coursekit.pytest_plugin import launched_kernels
    for head_dim in HOPPER_BACKWARD_HEAD_DIMS:
        q, k, v = make_qkv(2, 4, 2, 200, 300, head_dim, dtype=torch.float16, device="cuda")
        out, lse = flash_attention.attention_forward(q, k, v, 0.125, True)
        go = torch.randn_like(out)
        names = launched_kernels(lambda: flash_attention.attention_backward(go, q, k, v, out, lse, 0.125, True,
                                                                            version="wgmma"), "flash_attention")[1]
        assert any(f"HopperBwdTraits<{head_dim}>" in n for n in names), names
        assert any("bwd_hopper_rows_kernel" in n for n in names) and any("bwd_hopper_dq_kernel" in n for n in names)
        assert not any("flash_bwd_kernel" in n for n in names), names
        names = launched_kernels(lambda: flash_attention.attention_backward(go, q, k, v, out, lse, 0.125, True),
                                 "flash_attention")[1]
        assert any(f"HopperBwdTraits<{head_dim}>" in n for n in names), names
        was = torch.are_deterministic_algorithms_enabled()
        try:
            torch.use_deterministic_algorithms(True)
            names = launched_kernels(lambda: flash_attention.attention_backward(go, q, k, v, out, lse, 0.125, True),
                                     "flash_attention")[1]
        finally:
            torch.use_deterministic_algorithms(was)
        assert not any("hopper" in n for n in names) and any("flash_bwd_dq_kernel" in n for n in names), names


# The backward's side kernels (flash_bwd_hopper_dispatch.cu): the statistics kernel, which also
# zeroes dQ's float32 sums (the workspace comes from at::empty), and dQ's conversion. The knob
# FLASH_ATTENTION_BWD_SIDE (read at every call, flash_bwd_hopper.h's HopperBwdSide) picks "new" (the
# default: 16-byte accesses where the views allow), "elementwise" (the same kernels, element by
# element whatever the views: dq is always contiguous, so only this reaches dQ's fallback) or
# "old" (the kernels before, on a zeroed workspace), so that one GPU run times them side by side.
BWD_SIDE_KNOB = "FLASH_ATTENTION_BWD_SIDE"
BWD_SIDES = ("new", "elementwise", "old")


def side_kernel_vectors(names):
    """The kVec argument of each new side kernel in the launched `names`: {"rows": bool, "dq": bool}
    (absent for a kernel that did not run)."""
    found = {}
    for name in names:
        m = re.search(r"bwd_hopper_(rows|dq)_kernel<[^<>]*, (true|false)>", name)
        if m:
            found[m.group(1)] = m.group(2) == "true"
    return found


def poison_hopper_workspace(q):
    """A NaN block the size of "wgmma"'s workspace (flash_bwd_hopper.h: every padded statistics
    row's d sums, lse2 and D, float32) left in the allocator: sums the statistics kernel failed to
    zero then show up as NaN in dQ."""
    b, h, s, d = q.shape
    rows = b * h * ((s + 127) // 128 * 128)
    poison_allocator(torch.empty(rows * (d + 2), dtype=torch.float32, device=q.device))


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", HOPPER_BACKWARD_HEAD_DIMS)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_hopper_backward_side_kernels(dtype, head_dim, monkeypatch):
    """Each side kernel candidate against the float64 reference, on NaN-poisoned outputs and
    workspace: query lengths 1, 127 and 129 (a partial 64-row tile of dQ's sums and of the
    statistics' 128-row padding), causal and full, GQA 2:1; dO from a (b, s, h, d) projection (a
    strided view of 16-byte rows: the vector path) and O both contiguous and at an odd element offset
    with a row stride of d + 3 (no 16-byte load lands: the statistics kernel's element-wise path,
    which the launched kernel's kVec says was taken)."""
    skip_unless_hopper()
    from coursekit.pytest_plugin import launched_kernels
    b, h, h_kv = 2, 4, 2
    scale = 1 / math.sqrt(head_dim)
    for causal, seqlen_q, seqlen_k in ((False, 1, 70), (True, 127, 127), (False, 129, 200), (True, 129, 300)):
        q, k, v = cuda_inputs(h, h_kv, seqlen_q, seqlen_k, head_dim, dtype, batch=b)
        out, lse = flash_attention.attention_forward(q, k, v, scale, causal)
        go = torch.randn(b, seqlen_q, h, head_dim, dtype=torch.float64).to(dtype).cuda().transpose(1, 2)
        wide = torch.full((b, h, seqlen_q, head_dim + 3), float("nan"), dtype=dtype, device="cuda")
        out_odd = wide[..., 1:head_dim + 1]
        out_odd.copy_(out)
        ref = backward_reference(q, k, v, causal, go, True)
        for side, o, vectors in (("new", out, dict(rows=True, dq=True)), ("new", out_odd, dict(rows=False, dq=True)),
                                 ("elementwise", out, dict(rows=False, dq=False)), ("old", out, dict())):
            monkeypatch.setenv(BWD_SIDE_KNOB, side)
            what = (f"side={side} {dtype_id(dtype)} d{head_dim} s{seqlen_q}x{seqlen_k} causal={causal} "
                    f"out {'odd' if o is out_odd else 'contiguous'}")
            for t in (q, k, v):
                poison_allocator(t)
            poison_hopper_workspace(q)
            grads, names = launched_kernels(
                lambda: flash_attention.attention_backward(go, q, k, v, o, lse, scale, causal, version="wgmma"),
                "flash_attention")
            assert side_kernel_vectors(names) == vectors, (what, names)
            old_ran = [any(f"bwd_hopper_{kernel}" in n for n in names) for kernel in ("rows_warp", "dq_scattered")]
            assert old_ran == [side == "old"] * 2, (what, names)
            check_backward_grads(grads, *ref, what)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", HOPPER_BACKWARD_HEAD_DIMS)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_varlen_hopper_backward_side_kernels(dtype, head_dim, causal, monkeypatch):
    """The packed layout through each side kernel candidate: sequences empty on the query side, on
    the key side and both, lengths 1, 63, 65 and 129 around the 64-row tiles of dQ's sums and the
    128-row tiles of the statistics, GQA 2:1, against the float64 reference of each sequence."""
    skip_unless_hopper()
    lens_q, lens_k = [1, 0, 65, 129, 0, 63], [40, 7, 0, 129, 0, 200]
    q, k, v, cu_q, cu_k = varlen_cuda_inputs(lens_q, lens_k, 4, 2, head_dim, dtype)
    for side in BWD_SIDES:
        monkeypatch.setenv(BWD_SIDE_KNOB, side)
        check_cuda_varlen_backward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), ("wgmma",),
                                   f"side={side} packed {dtype_id(dtype)} d{head_dim}", causal=causal)


@pytest.mark.cuda
def test_cuda_hopper_backward_side_knob_refused(monkeypatch):
    """Another value of FLASH_ATTENTION_BWD_SIDE is refused by name, with the values it takes."""
    skip_unless_hopper()
    q, k, v = cuda_inputs(2, 2, 17, 17, 64, torch.bfloat16)
    out, lse = flash_attention.attention_forward(q, k, v, 0.125, False)
    monkeypatch.setenv(BWD_SIDE_KNOB, "fast")
    with pytest.raises(RuntimeError, match=r"FLASH_ATTENTION_BWD_SIDE is 'fast'; expected new, elementwise or old"):
        flash_attention.attention_backward(torch.randn_like(out), q, k, v, out, lse, 0.125, False, version="wgmma")


@pytest.mark.cuda
def test_cuda_hopper_backward_refusals():
    """Backward rung "wgmma" refuses, by name and with the way out, what it cannot run: another
    dtype, a build without its kernels, another GPU, another head dim, a window or a softcap in the
    packed layout."""
    require_cuda()

    def backward(q, k, v, **features):
        out, lse = torch.zeros_like(q), torch.zeros(q.shape[:3], device="cuda", dtype=lse_dtype(q.dtype))
        return flash_attention.attention_backward(torch.randn_like(out), q, k, v, out, lse, 0.125, False,
                                                  version="wgmma", **features)
    q, k, v = make_qkv(1, 2, 2, 16, 16, 64, dtype=torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match=r"attention_backward: version 'wgmma' runs on tensor cores and takes "
                                           r"float16 and bfloat16; q is Float"):
        backward(q, k, v)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    if not flash_attention.hopper_kernels_built():
        with pytest.raises(RuntimeError, match=r"version 'wgmma' is a Hopper kernel \(sm_90a\), and this build "
                                               r"of flash_attention has none.*use version='mma_dqpass'"):
            backward(q, k, v)
        return
    if torch.cuda.get_device_capability() != (9, 0):
        with pytest.raises(RuntimeError, match=r"version 'wgmma' needs a Hopper GPU, compute capability 9.0 "
                                               r".*this GPU is \d+\.\d+: use version='mma_dqpass'"):
            backward(q, k, v)
        return
    for head_dim in (32, 96, 256):
        qd, kd, vd = make_qkv(1, 2, 2, 16, 16, head_dim, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(RuntimeError, match=rf"version 'wgmma' takes head_dim 64, 128 .*head_dim is {head_dim}"):
            backward(qd, kd, vd)
        with pytest.raises(RuntimeError, match=rf"version 'wgmma' takes head_dim 64, 128 .*head_dim is {head_dim}"):
            backward(qd, kd, vd, window=(8, 0))
    packed = torch.randn(50, 2, 64, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0, 20, 50], dtype=torch.int32, device="cuda")
    out, lse = OPS.attention_varlen_forward(packed, packed, packed, cu, cu, 30, 30, 0.125, False, [4, 0], 0.0)
    with pytest.raises(RuntimeError, match=r"attention_varlen_backward: version 'wgmma' takes no window or softcap "
                                           r"in the packed \(varlen\) layout; versions 'mma' and 'mma_dqpass'"):
        OPS.attention_varlen_backward(out, packed, packed, packed, out, lse, cu, cu, 30, 30, 0.125, False, [4, 0],
                                      0.0, "wgmma")


@pytest.mark.cuda
def test_cuda_hopper_backward_sass():
    """The backward's main kernel (each instantiation) runs on wgmma (HGMMA) and TMA (UTMALDG), not
    mma.sync (HMMA), and adds dQ into its float32 sums with the copy engine's bulk reduction
    (UBLKRED), no float atomic from registers (RED or ATOM ... ADD.F32) left; no generic load or
    store (GENERIC_ACCESS: its statistics and dS once went that way, behind an integer-rounded
    shared-memory pointer); and its wgmmas pipelined, not each waited for alone."""
    import re
    skip_unless_hopper()
    kernels = sass_functions("flash_bwd_hopper_kernel")
    assert len(kernels) == 12, \
        f"{len(kernels)} Hopper backward kernels in the SASS (2 dtypes x 2 head dims x plain, window, packed)"
    for name, body in kernels:
        assert "HGMMA" in body and "UTMALDG" in body and "HMMA" not in body, name
        assert "UBLKRED" in body and not re.search(r"\b(?:REDG?|ATOMG?)\.\S*ADD\.F32", body), name
        assert not GENERIC_ACCESS.search(body), (name, GENERIC_ACCESS.findall(body)[:4])
        # wgmma groups in flight together: where ptxas cannot prove an accumulator is not read
        # before its group's wait (warning C7514), it waits after every HGMMA, and the SASS then has
        # as many WARPGROUP.DEPBAR as HGMMA (the window/softcap kernels did, 64 of each at d = 128).
        hgmma, depbar = body.count("HGMMA"), body.count("WARPGROUP.DEPBAR")
        assert depbar <= hgmma // 4, (name, f"{depbar} waits for {hgmma} HGMMA: the wgmmas are serialized")


@pytest.mark.cuda
def test_cuda_hopper_backward_side_sass():
    """The side kernels' vector path moves 16 bytes an instruction: the statistics kernel loads O
    and dO with LDG.E.128 (and zeroes dQ's sums with STG.E.128 on both paths), dQ's conversion reads
    its tile with LDS.128 and writes dq with STG.E.128; the element-wise path has no 128-bit access
    to O, dO or dq. 8 of each kernel (2 dtypes x padded or packed x vector or not), and no register
    spilled to local memory on the padded paths (ptxas -v, sm_90a: the packed ones spill 4-8 bytes,
    their bisection over cu_seqlens)."""
    import re
    skip_unless_hopper()
    for kernel in ("bwd_hopper_rows_kernel", "bwd_hopper_dq_kernel"):
        found = sass_functions(kernel)
        assert len(found) == 8, (kernel, [name for name, _ in found])
        for name, body in found:
            packed, vec = (flag == "1" for flag in re.search(r"_kernelI\w*?Lb([01])ELb([01])EE", name).groups())
            counts = tuple(body.count(op) for op in ("LDG.E.128", "STG.E.128", "LDS.128"))
            if kernel == "bwd_hopper_rows_kernel":
                assert counts == ((2 if vec else 0), 2, 0), (name, counts)
            else:
                assert counts == (4, (2 if vec else 0), 2), (name, counts)
            assert packed or "STL" not in body, name


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("head_dim", HOPPER_BACKWARD_HEAD_DIMS)
def test_sanitizer_hopper_backward(head_dim):
    """The Hopper backward under the sanitizer: partial tiles at both ends, rows that see no key,
    GQA 2:1, several steps per block (the ring's phases wrap), both dtypes."""
    require_cuda()
    for dtype in HALF_DTYPES:
        if not takes_backward("wgmma", dtype, head_dim):
            continue
        for seqlen_q, seqlen_k in ((1, 1), (17, 33), (70, 17), (200, 130)):
            q, k, v = make_qkv(1, 4, 2, seqlen_q, seqlen_k, head_dim, dtype=dtype, device="cuda")
            check_cuda_backward(q, k, v, True, "wgmma", f"wgmma {dtype_id(dtype)} d{head_dim} s{seqlen_q}x{seqlen_k}")


# ---------------------------------------------------------------------------------------------
# 12. Local attention and softcapping: window=(left, right) and softcap= (FlashAttention 2's API)
# ---------------------------------------------------------------------------------------------
# Every test of this section has "window_softcap" in its name: `pytest -k window_softcap` runs it.
# The windows: one key (0, 0), one back, one tile's worth around every tile size (127, 128, 129
# keys to the left), wider than any sequence here, left-only, right-only, and both sides.
WINDOWS = [(0, 0), (1, 0), (127, 0), (128, 0), (129, 0), (1000, 1000), (5, -1), (-1, 3), (3, 7)]
# square, seqlen_q < seqlen_k with GQA 2:1, seqlen_q > seqlen_k multi-query (rows above the diagonal
# see no key when the window or the mask bounds the right)
WINDOW_SHAPES = [(1, 2, 2, 150, 150, 16), (1, 4, 2, 40, 170, 8), (1, 2, 1, 170, 40, 8)]


def window_id(window):
    return "w{}_{}".format(*window).replace("-1", "x")


def large_scores(q, k, factor=4.0):
    """q and k scaled so that scores reach several times a softcap of 30 (|scale q . k| ~ 16 x
    a unit normal): where the cap bites hardest."""
    return (q * factor).detach().requires_grad_(q.requires_grad), (k * factor).detach().requires_grad_(k.requires_grad)


def assert_lse(lse, ref_lse, dtype, what=""):
    assert torch.equal(lse.isneginf(), ref_lse.isneginf()), f"{what}: lse is -inf exactly where no key is visible"
    finite = ref_lse.isfinite()
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=FORWARD_TOL[dtype][0],
                               atol=FORWARD_TOL[dtype][1], msg=lambda m: f"{what} lse: {m}")


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("window", WINDOWS, ids=window_id)
def test_window_softcap_forward_matches_reference(window, causal, dtype):
    for shape in WINDOW_SHAPES:
        q, k, v = make_qkv(*shape, dtype=dtype)
        out, lse = flash_attention.attention(q, k, v, causal=causal, window=window, return_lse=True)
        ref, ref_lse = reference(q, k, v, causal, window=window)
        assert_forward(out, ref, dtype, f"{shape_id(shape)} {window}")
        assert_lse(lse, ref_lse, dtype, f"{shape_id(shape)} {window}")
        assert torch.all(out[~ref_lse.isfinite()] == 0)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("window", [(-1, -1), (20, 3)], ids=window_id)
def test_window_softcap_large_scores(window, causal, dtype):
    """softcap 30 against scores far beyond it: the reference's and the op's agree, and they are
    not what the uncapped scores give (the cap is really applied)."""
    for shape in WINDOW_SHAPES:
        q, k = large_scores(*make_qkv(*shape, dtype=dtype)[:2])
        v = make_qkv(*shape, dtype=dtype)[2]
        out, lse = flash_attention.attention(q, k, v, causal=causal, window=window, softcap=30.0, return_lse=True)
        ref, ref_lse = reference(q, k, v, causal, window=window, softcap=30.0)
        assert_forward(out, ref, dtype, f"{shape_id(shape)} {window}")
        assert_lse(lse, ref_lse, dtype, f"{shape_id(shape)} {window}")
        uncapped = reference(q, k, v, causal, window=window)[0]
        assert (uncapped - ref).abs().max() > 0.1, "the cap changes nothing at these scores: the test cannot fail"


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("softcap", (0.0, 30.0), ids=("nocap", "cap30"))
@pytest.mark.parametrize("window", [(0, 0), (1, 0), (5, -1), (-1, 3), (3, 7)], ids=window_id)
def test_window_softcap_backward_matches_reference(window, softcap, dtype):
    for shape in WINDOW_SHAPES[1:]:
        for causal in (False, True):
            q, k, v = make_qkv(*shape, dtype=dtype, requires_grad=True)
            if softcap:
                q, k = large_scores(q, k, 2.0)
            out = flash_attention.attention(q, k, v, causal=causal, window=window, softcap=softcap)
            grad_out = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
            leaves = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
            ref = reference(*leaves, causal, window=window, softcap=softcap)[0]
            expected = torch.autograd.grad(ref, leaves, grad_out.double())
            for name, g, e in zip("qkv", grads, expected):
                assert_grad(g, e, dtype, f"d{name} {shape_id(shape)} {window} causal={causal}")


@pytest.mark.parametrize("shape,causal,window,softcap", [
    ((1, 2, 1, 6, 9, 4), False, (2, 1), 1.5),
    ((1, 2, 2, 7, 5, 4), True, (1, -1), 0.8),    # seqlen_q > seqlen_k: rows 0-1 see no key
    ((1, 1, 1, 5, 8, 4), False, (-1, 0), 0.0),
])
def test_window_softcap_gradcheck(shape, causal, window, softcap):
    """Finite differences of the CPU forward against its backward, with a cap small enough for
    tanh to bend (scores ~1) and windows cutting every row."""
    q, k, v = make_qkv(*shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b, c: flash_attention.attention(a, b, c, causal=causal, window=window, softcap=softcap), (q, k, v))


def test_window_softcap_defaults_and_causal():
    """The defaults are the call without them, bit for bit; causal is the window's right = 0
    (FlashAttention 2's rule), so a right bound given with causal=True changes nothing."""
    q, k, v = make_qkv(1, 2, 2, 30, 41, 16)
    for causal in (False, True):
        assert torch.equal(flash_attention.attention(q, k, v, causal=causal),
                           flash_attention.attention(q, k, v, causal=causal, window=(-1, -1), softcap=0.0))
    assert torch.equal(flash_attention.attention(q, k, v, causal=True),
                       flash_attention.attention(q, k, v, causal=True, window=(-1, 5)))
    assert torch.equal(flash_attention.attention(q, k, v, causal=True, window=(3, 5)),
                       flash_attention.attention(q, k, v, window=(3, 0)))


@pytest.mark.parametrize("softcap", (0.0, 30.0), ids=("nocap", "cap30"))
def test_window_softcap_rows_without_keys(softcap):
    """seqlen_q 10 > seqlen_k 4 with window (-1, 0): row i sees keys j <= i - 6, so rows 0-5 see
    none: O 0, lse -inf, and no gradient (no NaN) through them."""
    q, k, v = make_qkv(1, 2, 2, 10, 4, 8, dtype=torch.float64, requires_grad=True)
    out, lse = flash_attention.attention(q, k, v, window=(-1, 0), softcap=softcap, return_lse=True)
    assert torch.all(out[:, :, :6] == 0) and torch.all(lse[:, :, :6] == -math.inf)
    assert torch.all(lse[:, :, 6:].isfinite())
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.all(dq[:, :, :6] == 0) and not any(g.isnan().any() for g in (dq, dk, dv))


WINDOW_SOFTCAP_MISUSES = {
    "window below -1": (lambda: flash_attention.attention(_t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8),
                                                          window=(-2, 0)),
                        r"attention_forward: window must be \(left, right\) with each >= 0 or -1, got \(-2, 0\)"),
    "window right below -1": (lambda: flash_attention.attention(_t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8),
                                                                window=(4, -3)),
                              r"attention_forward: window must be \(left, right\) with each >= 0 or -1, got \(4, -3\)"),
    "window of three": (lambda: flash_attention.attention(_t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8),
                                                          window=(1, 2, 3)),
                        r"attention_forward: window must be \(left, right\) with each >= 0 or -1, got \(1, 2, 3\)"),
    "negative softcap": (lambda: flash_attention.attention(_t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8),
                                                           softcap=-1.0),
                         r"attention_forward: softcap must be >= 0 and finite \(0: no cap\), got -1"),
    "nan softcap": (lambda: flash_attention.attention(_t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8),
                                                      softcap=math.nan),
                    r"attention_forward: softcap must be >= 0 and finite \(0: no cap\), got nan"),
    "infinite softcap": (lambda: flash_attention.attention(_t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8),
                                                           softcap=math.inf),
                         r"attention_forward: softcap must be >= 0 and finite \(0: no cap\), got inf"),
    "backward window": (lambda: flash_attention.attention_backward(
        _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5), 0.5,
        window=(0, -5)),
        r"attention_backward: window must be \(left, right\) with each >= 0 or -1, got \(0, -5\)"),
    "backward softcap": (lambda: flash_attention.attention_backward(
        _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5), 0.5,
        softcap=-0.5),
        r"attention_backward: softcap must be >= 0 and finite \(0: no cap\), got -0.5"),
    "rule window": (lambda: flash_attention.dispatch_rule("attention_forward", (1, 2, 5, 8), dtype=torch.float16,
                                                          cuda=True, window=(-7, 0)),
                    r"forward_rule: window must be \(left, right\) with each >= 0 or -1, got \(-7, 0\)"),
}


@pytest.mark.parametrize("misuse", list(WINDOW_SOFTCAP_MISUSES))
def test_window_softcap_misuse_raises_clear_error(misuse):
    call, message = WINDOW_SOFTCAP_MISUSES[misuse]
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("call", ["forward", "backward"])
def test_window_softcap_opcheck(call):
    q, k, v = make_qkv(2, 4, 2, 9, 12, 16, requires_grad=True)
    window, softcap = [3, 1], 2.5
    if call == "forward":
        torch.library.opcheck(OPS.attention_forward.default, (q, k, v, 0.25, True, None, window, softcap))
    else:
        out, lse = flash_attention.attention_forward(q.detach(), k.detach(), v.detach(), 0.25, False,
                                                     window=window, softcap=softcap)
        torch.library.opcheck(OPS.attention_backward.default, (torch.randn_like(out), q.detach(), k.detach(),
                                                               v.detach(), out, lse, 0.25, False, None, window,
                                                               softcap))


def test_window_softcap_torch_compile():
    torch._dynamo.reset()

    def block(q, k, v):
        return flash_attention.attention(q, k, v, causal=True, window=(4, 0), softcap=3.0).square().sum()

    q, k, v = make_qkv(2, 4, 2, 11, 11, 16, requires_grad=True)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v))
    expected = block(q, k, v)
    for g, e in zip(grads, torch.autograd.grad(expected, (q, k, v))):
        torch.testing.assert_close(g, e)
    torch.testing.assert_close(out, expected)


def test_window_softcap_dispatch_rule():
    """version=None with a window or a softcap runs the rungs that compute them: on a Hopper "persistent"
    (its kWindowSoftcap instantiation) at head_dim 64 and 128, for long full rows too (where a plain
    call would take "pingpong"), and "split_kv" at 256, without the sm_90a kernels, or where the
    grid is small enough to split the keys (as for a plain call); a plain causal call, whatever right
    bound it carries, keeps the plain rule. Off sm_80 and for 32-bit it stays "tiled", which refuses
    them (test_cuda_window_softcap_refusals); the backward keeps part 3's rung, its kWindowSoftcap
    instantiation (P from the forward's lse of the capped scores), at its head dims, and leaves it
    for "mma_dqpass" under deterministic algorithms and elsewhere. The packed layout with a window
    runs on "split_kv" forward and "mma_dqpass" backward (test_cuda_hopper_window_refusals)."""
    rule = flash_attention.dispatch_rule
    hopper = dict(cuda=True, capability=(9, 0), sms=132, hopper_built=True)
    big = (4, 16, 1024, 128)
    assert rule("attention_forward", big, dtype=torch.bfloat16, **hopper) == "pingpong"  # plain: 1024 full keys
    assert rule("attention_forward", big, dtype=torch.bfloat16, window=(256, 0), **hopper) == "persistent"
    assert rule("attention_forward", big, dtype=torch.float16, window=(-1, 0), **hopper) == "persistent"
    assert rule("attention_forward", big, dtype=torch.bfloat16, softcap=30.0, **hopper) == "persistent"
    assert rule("attention_forward", big, dtype=torch.bfloat16, causal=True, window=(-1, 7), **hopper) == "persistent"
    assert rule("attention_forward", big, dtype=torch.bfloat16, causal=True, window=(64, 7), **hopper) == "persistent"
    long_full = (2, 16, 8192, 64)
    assert rule("attention_forward", long_full, dtype=torch.bfloat16, **hopper) == "pingpong"
    assert rule("attention_forward", long_full, dtype=torch.bfloat16, window=(4095, 0), **hopper) == "persistent"
    assert rule("attention_forward", long_full, dtype=torch.bfloat16, softcap=50.0, **hopper) == "persistent"
    assert rule("attention_forward", (4, 16, 1024, 256), dtype=torch.bfloat16, **hopper) == "warp_specialized"
    assert rule("attention_forward", (4, 16, 1024, 256), dtype=torch.bfloat16, window=(256, 0),
                **hopper) == "split_kv"
    assert rule("attention_forward", (4, 16, 1024, 96), dtype=torch.bfloat16, softcap=30.0, **hopper) == "split_kv"
    assert rule("attention_forward", big, dtype=torch.bfloat16, window=(256, 0), cuda=True, capability=(9, 0),
                sms=132, hopper_built=False) == "split_kv"
    assert rule("attention_forward", big, dtype=torch.bfloat16, window=(256, 0), scale=-0.1, **hopper) == "split_kv"
    decode = (1, 2, 1, 128), (1, 2, 8192, 128)  # one query row, few heads: the grid splits the keys
    assert rule("attention_forward", decode[0], decode[1], dtype=torch.bfloat16, causal=True, **hopper) == "split_kv"
    assert rule("attention_forward", decode[0], decode[1], dtype=torch.bfloat16, window=(256, 0),
                **hopper) == "split_kv"
    assert rule("attention_varlen_forward", (4096, 16, 128), dtype=torch.bfloat16, batch=4, max_seqlen_q=1024,
                window=(256, 0), **hopper) == "split_kv"
    assert rule("attention_forward", big, dtype=torch.float16, window=(8, 8), cuda=True, capability=(8, 0),
                sms=108) == "split_kv"
    assert rule("attention_forward", big, dtype=torch.float32, window=(8, 8), **hopper) == "tiled"
    assert rule("attention_forward", big, dtype=torch.bfloat16, softcap=5.0, cuda=True, capability=(7, 5),
                sms=40) == "tiled"
    assert rule("attention_backward", big, dtype=torch.bfloat16, **hopper) == "wgmma"
    assert rule("attention_backward", big, dtype=torch.bfloat16, causal=True, window=(-1, 7), **hopper) == "wgmma"
    for features in (dict(window=(256, 0)), dict(softcap=30.0), dict(causal=True, window=(4095, 0), softcap=50.0)):
        for d, dtype in ((64, torch.float16), (128, torch.bfloat16)):
            assert rule("attention_backward", big[:3] + (d,), dtype=dtype, **features, **hopper) == "wgmma", features
        assert rule("attention_backward", big, dtype=torch.bfloat16, deterministic=True, **features,
                    **hopper) == "mma_dqpass", features
        assert rule("attention_backward", big[:3] + (96,), dtype=torch.bfloat16, **features,
                    **hopper) == "mma_dqpass", features
        assert rule("attention_backward", big, dtype=torch.bfloat16, **features, **dict(hopper, hopper_built=False)) \
            == "mma_dqpass", features
        assert rule("attention_backward", big, dtype=torch.bfloat16, **features, cuda=True, capability=(8, 0),
                    sms=108) == "mma_dqpass", features
        assert rule("attention_varlen_backward", (4096, 16, 128), dtype=torch.bfloat16, batch=4, max_seqlen_q=1024,
                    **features, **hopper) == "mma_dqpass", features


# CUDA: (heads, heads_kv, seqlen_q, seqlen_k, window, causal, softcap), every window of WINDOWS (with
# 127-129 around the 64- and 128-key tiles and the 64- and 128-row query tiles), GQA and multi-query,
# seqlen_q on either side of seqlen_k, a grid small enough for "split_kv" to split, decoding, and the
# softcap alone, at 30 (tanh from the exponential) and 5 (bfloat16's tanh.approx).
WINDOW_SOFTCAP_CASES = [
    (4, 2, 129, 129, (0, 0), False, 0.0),
    (2, 2, 129, 129, (1, 0), True, 0.0),
    (4, 1, 200, 200, (127, 0), False, 0.0),
    (2, 2, 200, 200, (128, 0), True, 0.0),
    (2, 2, 200, 200, (129, 0), False, 30.0),
    (2, 2, 65, 65, (1000, 1000), False, 0.0),    # wider than the sequence
    (2, 1, 70, 300, (16, -1), False, 0.0),       # left only, seqlen_q < seqlen_k
    (2, 2, 300, 70, (-1, 5), False, 0.0),        # right only, seqlen_q > seqlen_k: rows 0-224 see no key
    (4, 2, 33, 700, (100, 20), False, 30.0),     # few rows, many keys: "split_kv" splits
    (2, 2, 1, 1000, (200, 0), True, 30.0),       # decoding with a sliding window
    (2, 2, 150, 150, (-1, -1), False, 30.0),     # the softcap alone
    (2, 2, 150, 150, (40, 40), True, 5.0),       # both, bfloat16's tanh.approx
]
WINDOW_SOFTCAP_FORWARD = ("tuned", "split_kv")
WINDOW_SOFTCAP_BACKWARD = ("mma", "mma_dqpass")


def window_softcap_inputs(heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, softcap, requires_grad=False):
    q, k, v = cuda_inputs(heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype)
    if softcap:
        q, k = large_scores(q, k)
    return tuple(t.detach().requires_grad_(requires_grad) for t in (q, k, v))


def case_id(case):
    heads, heads_kv, seqlen_q, seqlen_k, window, causal, softcap = case
    return f"h{heads}/{heads_kv} s{seqlen_q}x{seqlen_k} {window} causal={causal} softcap={softcap}"


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", (32, 64, 96, 128, 256))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_window_softcap_forward(dtype, head_dim):
    """Each rung that takes a window and a softcap ("tuned", "split_kv") against the float64
    reference, computed once per input for both (version=None: test_cuda_window_softcap_default)."""
    require_cuda()
    skip_unless_takes("tuned", dtype, head_dim)
    for case in WINDOW_SOFTCAP_CASES:
        heads, heads_kv, seqlen_q, seqlen_k, window, causal, softcap = case
        q, k, v = window_softcap_inputs(heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, softcap)
        ref = cpu_reference(q, k, v, causal, window=window, softcap=softcap)
        for version in WINDOW_SOFTCAP_FORWARD:
            check_cuda_forward(q, k, v, causal, version, f"{version} {dtype_id(dtype)} d{head_dim} {case_id(case)}",
                               ref=ref, window=window, softcap=softcap)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", (32, 64, 96, 128))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_window_softcap_backward(dtype, head_dim):
    """dQ, dK and dV of each backward rung that takes a window and a softcap ("mma", "mma_dqpass":
    dS times the cap's derivative) against the float64 reference's autograd, computed once per
    input and output gradient for both."""
    require_cuda()
    if not takes_backward("mma", dtype, head_dim):
        pytest.skip(f"the tensor-core backward does not take {dtype_id(dtype)} at head_dim {head_dim} on this GPU")
    for case in WINDOW_SOFTCAP_CASES:
        heads, heads_kv, seqlen_q, seqlen_k, window, causal, softcap = case
        q, k, v = window_softcap_inputs(heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, softcap)
        grad_out = torch.randn(q.shape, dtype=torch.float64).to(dtype).cuda()
        ref = backward_reference(q, k, v, causal, grad_out, True, window=window, softcap=softcap)
        for version in WINDOW_SOFTCAP_BACKWARD:
            check_cuda_backward(q, k, v, causal, version, f"{version} {dtype_id(dtype)} d{head_dim} {case_id(case)}",
                                grad_out=grad_out, ref=ref, window=window, softcap=softcap)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", (64, 128))
def test_cuda_window_softcap_default(head_dim):
    """version=None, forward and backward, through attention()'s autograd: on a grid this small (the
    keys split) it runs the tensor-core kernel of rung "split_kv", on a Hopper too, and the
    gradients of a sliding-window, softcapped causal call match the reference's; split_kv and tuned
    agree on a grid that splits."""
    require_cuda()
    if not takes_backward("mma_dqpass", torch.bfloat16, head_dim):
        pytest.skip("the tensor-core rungs need sm_80")
    from coursekit.pytest_plugin import launched_kernels
    q, k, v = window_softcap_inputs(2, 1, 33, 900, head_dim, torch.bfloat16, 30.0, requires_grad=True)
    assert flash_attention.default_choice("attention_forward", q, k, causal=True, window=(256, 0),
                                          softcap=30.0) == "split_kv"
    _, names = launched_kernels(lambda: flash_attention.attention(q, k, v, causal=True, window=(256, 0), softcap=30.0),
                                "flash_attention")
    assert any("flash_fwd_kernel" in n for n in names) and not any("hopper" in n for n in names), names
    for case in WINDOW_SOFTCAP_CASES[::3]:
        heads, heads_kv, seqlen_q, seqlen_k, window, causal, softcap = case
        qc, kc, vc = window_softcap_inputs(heads, heads_kv, seqlen_q, seqlen_k, head_dim, torch.bfloat16, softcap)
        check_cuda_forward(qc, kc, vc, causal, None, f"default d{head_dim} {case_id(case)}", window=window,
                           softcap=softcap)
        check_cuda_backward(qc, kc, vc, causal, None, f"default d{head_dim} {case_id(case)}", window=window,
                            softcap=softcap)
    out = flash_attention.attention(q, k, v, causal=True, window=(256, 0), softcap=30.0)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    leaves = tuple(t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    expected = torch.autograd.grad(reference(*leaves, True, window=(256, 0), softcap=30.0)[0], leaves,
                                   grad_out.cpu().double())
    bounds = rounding_bounds(q, k, v, grad_out, True, window=(256, 0), softcap=30.0)
    for name, g, e, bound in zip("qkv", grads, expected, bounds):
        error = (g.cpu().double() - e).abs()
        allowed = CUDA_GRAD_TOL[torch.bfloat16] * max(e.abs().max().item(), 1.0) + bound
        assert torch.all(error <= allowed), f"d{name}: max error {error.max().item():.3g}"
    split = flash_attention.attention(q, k, v, causal=True, window=(256, 0), softcap=30.0, version="split_kv",
                                      return_lse=True)
    whole = flash_attention.attention(q, k, v, causal=True, window=(256, 0), softcap=30.0, version="tuned",
                                      return_lse=True)
    torch.testing.assert_close(split[1], whole[1], rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_cuda_window_softcap_instantiation():
    """A call with a window or a softcap runs the kWindowSoftcap instantiation of the kernels that
    take them (flash_fwd_kernel.cuh, flash_bwd_kernel.cuh); a call with neither, causal and a
    causal window's right bound included (causal is right = 0), runs the plain one, whose code is
    the kernels' as it was before they existed."""
    require_cuda()
    if not takes_backward("mma_dqpass", torch.bfloat16, 64):
        pytest.skip("the tensor-core rungs need sm_80")
    import re
    from coursekit.pytest_plugin import launched_kernels
    # A few rows against many keys: split_kv splits this grid.
    q, k, v = make_qkv(1, 4, 4, 3, 4096, 64, dtype=torch.bfloat16, device="cuda")
    go = torch.randn_like(q)
    cases = (({}, False), ({"causal": True}, False), ({"causal": True, "window": (-1, 64)}, False),
             ({"window": (-1, 64)}, True), ({"window": (100, -1)}, True), ({"softcap": 5.0}, True))
    for features, featured in cases:
        causal = features.get("causal", False)
        kw = {"window": features.get("window", (-1, -1)), "softcap": features.get("softcap", 0.0)}

        def every_rung():  # both forward rungs and both backward rungs that take a window and softcap
            for version in WINDOW_SOFTCAP_FORWARD:
                out, lse = flash_attention.attention_forward(q, k, v, 0.125, causal, version=version, **kw)
            for version in WINDOW_SOFTCAP_BACKWARD:
                flash_attention.attention_backward(go, q, k, v, out, lse, 0.125, causal, version=version, **kw)
        names = launched_kernels(every_rung, "flash_attention")[1]
        for kernel in ("flash_fwd_kernel", "flash_bwd_kernel", "flash_bwd_dq_kernel"):
            # The kWindowSoftcap argument of each launch of `kernel` (the next to last: kVarlen is last).
            found = [re.search(rf"{kernel}<.*, (true|false), (?:true|false)>", n) for n in names]
            assert {m.group(1) == "true" for m in found if m} == {featured}, (kernel, features, names)


@pytest.mark.cuda
@pytest.mark.parametrize("version", [v for v in FORWARD_VERSIONS
                                     if v not in WINDOW_SOFTCAP_FORWARD + ("persistent",)])  # persistent: below
def test_cuda_window_softcap_refusals(version):
    """The rungs that do not compute a window or a softcap refuse them by name, with the way out,
    before any other check of theirs; so does version=None where it has no rung for them."""
    require_cuda()
    q, k, v = make_qkv(1, 2, 2, 16, 16, 64, dtype=torch.bfloat16, device="cuda")
    message = (rf"attention_forward: version '{version}' takes no window or softcap; versions 'tuned', "
               r"'split_kv' and 'persistent' compute them")
    for features in (dict(window=(8, 0)), dict(softcap=30.0), dict(causal=False, window=(-1, 0))):
        with pytest.raises(RuntimeError, match=message):
            flash_attention.attention(q, k, v, version=version, **features)
    # a plain causal call passes whatever right bound it carries (causal is right = 0)
    if takes(version, torch.bfloat16, 64):
        flash_attention.attention(q, k, v, causal=True, window=(-1, 3), version=version)
    # the refusal comes before any work: any out and lse of the right shapes will do
    out, lse = torch.zeros_like(q), torch.zeros(q.shape[:3], device="cuda")
    with pytest.raises(RuntimeError, match=r"attention_backward: version 'naive' takes no window or softcap; "
                                           r"versions 'mma' and 'mma_dqpass' compute them"):
        flash_attention.attention_backward(torch.randn_like(out), q, k, v, out, lse, 0.125, False, window=(8, 0),
                                           version="naive")
    q32, k32, v32 = (t.float() for t in (q, k, v))
    with pytest.raises(RuntimeError, match=r"attention_forward: version 'tiled' takes no window or softcap"):
        flash_attention.attention(q32, k32, v32, softcap=30.0)


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("version", WINDOW_SOFTCAP_FORWARD)
def test_sanitizer_window_softcap_forward(version):
    """Partial tiles, a window's edges inside and across tiles, rows without keys, GQA, a split
    grid (5 rows against 600 keys), the smallest and the 64-key-tile head dims."""
    require_cuda()
    skip_unless_takes(version, torch.bfloat16, 32)
    for head_dim in (32, 96):
        for seqlen_q, seqlen_k, window, causal, softcap in ((17, 33, (3, 2), False, 0.0), (70, 17, (-1, 1), False, 5.0),
                                                            (5, 600, (100, 0), True, 30.0)):
            q, k, v = window_softcap_inputs(4, 2, seqlen_q, seqlen_k, head_dim, torch.bfloat16, softcap)
            check_cuda_forward(q, k, v, causal, version, f"{version} d{head_dim} s{seqlen_q}x{seqlen_k} {window}",
                               window=window, softcap=softcap)


@pytest.mark.cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("version", WINDOW_SOFTCAP_BACKWARD)
def test_sanitizer_window_softcap_backward(version):
    require_cuda()
    if not takes_backward(version, torch.bfloat16, 32):
        pytest.skip("the tensor-core backward needs sm_80")
    for seqlen_q, seqlen_k, window, causal, softcap in ((17, 33, (3, 2), False, 0.0), (70, 17, (-1, 1), False, 5.0),
                                                        (40, 130, (20, 0), True, 30.0)):
        q, k, v = window_softcap_inputs(4, 2, seqlen_q, seqlen_k, 32, torch.bfloat16, softcap)
        check_cuda_backward(q, k, v, causal, version, f"{version} s{seqlen_q}x{seqlen_k} {window}",
                            window=window, softcap=softcap)


# The Hopper forward with a window or a softcap: rung "persistent"'s kWindowSoftcap instantiation
# (head_dim 64 and 128, padded layout). (batch, heads, heads_kv, seqlen_q, seqlen_k, window, causal,
# softcap): lengths off the 128-row and 128-key tiles, seqlen_q on either side of seqlen_k, GQA and
# multi-query, windows inside one tile, across several, one-sided, the benchmark's (4095, 0) over
# more query tiles than it spans (a rise, then level walks), causal with a window, the softcap
# alone and with a window at 30 and 50 (tanh from the exponential) and 5 (bfloat16's tanh.approx).
HOPPER_WINDOW_CASES = [
    (2, 4, 2, 300, 300, (0, 0), False, 0.0),
    (2, 4, 4, 333, 517, (17, 5), False, 0.0),
    (2, 4, 1, 517, 333, (-1, 33), False, 0.0),     # seqlen_q > seqlen_k: rows 0-150 see no key
    (1, 2, 2, 4300, 4300, (4095, 0), False, 0.0),
    (2, 4, 2, 700, 1000, (129, 7), True, 0.0),     # causal: right = 0
    (2, 4, 4, 383, 383, (-1, -1), False, 30.0),
    (2, 4, 2, 383, 250, (-1, -1), True, 50.0),     # causal rows without keys, capped
    (2, 4, 2, 640, 700, (100, 20), False, 30.0),
    (2, 8, 2, 1000, 1000, (256, 0), True, 50.0),
    (2, 4, 4, 129, 129, (40, 40), True, 5.0),
]


def hopper_window_case_id(case):
    batch, heads, heads_kv, seqlen_q, seqlen_k, window, causal, softcap = case
    return f"b{batch} h{heads}/{heads_kv} s{seqlen_q}x{seqlen_k} {window} causal={causal} softcap={softcap}"


def hopper_window_inputs(case, head_dim, dtype, requires_grad=False):
    batch, heads, heads_kv, seqlen_q, seqlen_k, window, causal, softcap = case
    q, k, v = make_qkv(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype=dtype, device="cuda")
    if softcap:
        q, k = large_scores(q, k)
    return tuple(t.detach().requires_grad_(requires_grad) for t in (q, k, v))


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_hopper_window_softcap_forward(dtype, head_dim):
    """"persistent" with a window or a softcap against the float64 reference (out and lse, rows
    without keys exactly 0 and -inf, on NaN-poisoned outputs) and against part 1's "split_kv" on the
    same call: the same lse (of the capped scores, what the backward rebuilds P from) to float32
    rounding, the same out to the 16-bit rounding of P either side."""
    skip_unless_hopper()
    for case in HOPPER_WINDOW_CASES:
        batch, heads, heads_kv, seqlen_q, seqlen_k, window, causal, softcap = case
        what = f"persistent {dtype_id(dtype)} d{head_dim} {hopper_window_case_id(case)}"
        q, k, v = hopper_window_inputs(case, head_dim, dtype)
        ref = cpu_reference(q, k, v, causal, window=window, softcap=softcap)
        check_cuda_forward(q, k, v, causal, "persistent", what, ref=ref, window=window, softcap=softcap)
        out, lse = flash_attention.attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                             version="persistent", return_lse=True)
        part1, part1_lse = flash_attention.attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                                     version="split_kv", return_lse=True)
        assert torch.equal(lse.isneginf(), part1_lse.isneginf()), f"{what}: -inf rows differ from split_kv's"
        finite = part1_lse.isfinite()
        rtol, atol = CUDA_LSE_TOL[dtype]
        atol += 2 * tanh_approx_error(dtype, softcap)
        torch.testing.assert_close(lse[finite], part1_lse[finite], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what} lse vs split_kv: {m}")
        rtol, atol = forward_tol(dtype, "persistent", v, softcap)
        torch.testing.assert_close(out.double(), part1.double(), rtol=2 * rtol, atol=2 * atol,
                                   msg=lambda m: f"{what} out vs split_kv: {m}")


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_hopper_window_softcap_default(dtype, head_dim):
    """version=None on a Hopper: where the grid fills the GPU unsplit, the forward runs the persistent
    kernel's kWindowSoftcap instantiation (a call with neither runs the plain one), the backward
    "wgmma"'s kWindowSoftcap instantiation from its lse, and the gradients through attention()'s
    autograd match the float64 reference's; a grid small enough to split the keys runs "split_kv",
    as a plain call would."""
    skip_unless_hopper()
    import re
    from coursekit.pytest_plugin import launched_kernels
    # 128 items (no split) of 500 keys: the plain calls' rung is "persistent" too at both head dims
    # (persistent_bounds: 512 keys at d = 128), so each call's instantiation shows in its kernel name.
    q, k, v = make_qkv(4, 8, 2, 500, 500, head_dim, dtype=dtype, device="cuda")
    for features, featured in (({}, False), ({"window": (17, 5)}, True), ({"softcap": 30.0}, True),
                               ({"causal": True, "window": (-1, 9)}, False)):
        causal = features.get("causal", False)
        kw = {"window": features.get("window", (-1, -1)), "softcap": features.get("softcap", 0.0)}
        assert flash_attention.default_choice("attention_forward", q, k, causal=causal, **kw) == "persistent"
        names = launched_kernels(lambda: flash_attention.attention(q, k, v, causal=causal, **kw),
                                 "flash_attention")[1]
        found = [re.search(r"flash_fwd_hopper_persistent_kernel<.*, (?:true|false), (true|false)>", n) for n in names]
        assert {m.group(1) == "true" for m in found if m} == {featured}, (features, names)
    ran = set()
    for case in HOPPER_WINDOW_CASES[::2]:
        batch, heads, heads_kv, seqlen_q, seqlen_k, window, causal, softcap = case
        what = f"default {dtype_id(dtype)} d{head_dim} {hopper_window_case_id(case)}"
        qc, kc, vc = hopper_window_inputs(case, head_dim, dtype)
        choice = flash_attention.default_choice("attention_forward", qc, kc, causal=causal, window=window,
                                                softcap=softcap)
        assert choice in ("persistent", "split_kv"), what
        ran.add(choice)
        assert flash_attention.default_choice("attention_backward", qc, kc, causal=causal, window=window,
                                              softcap=softcap) == "wgmma", what
        check_cuda_backward(qc, kc, vc, causal, None, what, window=window, softcap=softcap)
    assert "persistent" in ran, "no case ran the persistent forward: the backward from its lse is untested"
    # attention()'s autograd: the persistent forward's out and lse into wgmma.
    case = HOPPER_WINDOW_CASES[8]  # a window and a softcap over a grid that does not split
    batch, heads, heads_kv, seqlen_q, seqlen_k, window, causal, softcap = case
    q, k, v = hopper_window_inputs(case, head_dim, dtype, requires_grad=True)
    assert flash_attention.default_choice("attention_forward", q, k, causal=causal, window=window,
                                          softcap=softcap) == "persistent"
    out = flash_attention.attention(q, k, v, causal=causal, window=window, softcap=softcap)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    expected, bounds = backward_reference(q, k, v, causal, grad_out, True, window=window, softcap=softcap)
    for name, g, e, bound in zip("qkv", grads, expected, bounds):
        error = (g.cpu().double() - e).abs()
        allowed = CUDA_GRAD_TOL[dtype] * max(e.abs().max().item(), 1.0) + bound
        assert torch.all(error <= allowed), f"autograd d{name}: max error {error.max().item():.3g}"


@pytest.mark.cuda
def test_cuda_hopper_window_refusals():
    """"persistent" takes a window or a softcap at head_dim 64 and 128 in the padded layout; at 256,
    and in the packed layout, it refuses them by name with the way out, and version=None runs
    "split_kv" there."""
    skip_unless_hopper()
    q, k, v = make_qkv(1, 2, 2, 100, 100, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match=r"attention_forward: version 'persistent' takes a window or softcap at "
                                           r"head_dim 64, 128; head_dim is 256: use version='split_kv'"):
        flash_attention.attention(q, k, v, window=(8, 0), version="persistent")
    assert flash_attention.default_choice("attention_forward", q, k, window=(8, 0)) == "split_kv"
    check_cuda_forward(q, k, v, False, None, "default d256 window", window=(8, 0))
    packed = torch.randn(50, 2, 64, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0, 20, 50], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=r"version 'persistent' takes no window or softcap in the packed"):
        flash_attention.attention_varlen(packed, packed, packed, cu, cu, 30, 30, window=(4, 0), version="persistent")


@pytest.mark.cuda
@pytest.mark.sanitize
def test_sanitizer_hopper_window():
    """The persistent kWindowSoftcap walk under the sanitizer: partial tiles, a window's edges inside
    and across tiles, rows without keys, an item with no key tile, GQA, both consumer warpgroups, a
    walk over more items than SMs (2 x 48 heads x 3 query tiles), with and without a softcap."""
    skip_unless_hopper()
    for seqlen_q, seqlen_k, window, causal, softcap in ((300, 150, (20, 3), False, 0.0),
                                                        (257, 300, (-1, 1), True, 30.0)):
        q, k, v = make_qkv(2, 48, 16, seqlen_q, seqlen_k, 64, dtype=torch.bfloat16, device="cuda")
        check_cuda_forward(q, k, v, causal, "persistent", f"persistent s{seqlen_q}x{seqlen_k} {window}",
                           window=window, softcap=softcap)


def check_against_dqpass(grads, theirs, expected, what, dtype):
    """Each gradient of `grads` (a rung under test) within twice the error of "mma_dqpass"'s
    (`theirs`, the same rounding of P and dS) of the float64 `expected`, plus CUDA_GRAD_TOL."""
    for name, g, h, e in zip("qkv", grads, theirs, expected):
        assert g.dtype == dtype and g.shape == e.shape, (what, name)
        e = e.to(g.device)
        error = (g.double() - e).abs().max().item() if e.numel() else 0.0
        known = (h.double() - e).abs().max().item() if e.numel() else 0.0
        allowed = 2 * known + CUDA_GRAD_TOL[dtype] * (max(e.abs().max().item(), 1.0) if e.numel() else 1.0)
        assert not g.isnan().any() and error <= allowed, \
            f"{what} d{name}: max error {error:.3g}, mma_dqpass's {known:.3g}, allowed {allowed:.3g}"


# The Hopper backward with a window or a softcap: rung "wgmma"'s kWindowSoftcap instantiation, on
# HOPPER_WINDOW_CASES (windows (0, 0), (17, 5), (-1, 33), (4095, 0) over 4300 rows, causal with a
# window, the softcap at 30 and 50 with and without a window and at 5, GQA 2:1 and 4:1).
@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_hopper_window_softcap_backward(dtype, head_dim):
    """dQ, dK and dV of "wgmma" with a window or a softcap against the float64 reference (run on the
    GPU: 4300 rows would take minutes on the CPU), within twice "mma_dqpass"'s error plus
    CUDA_GRAD_TOL, on NaN-poisoned outputs."""
    skip_unless_hopper()
    for case in HOPPER_WINDOW_CASES:
        batch, heads, heads_kv, seqlen_q, seqlen_k, window, causal, softcap = case
        what = f"wgmma {dtype_id(dtype)} d{head_dim} {hopper_window_case_id(case)}"
        q, k, v = hopper_window_inputs(case, head_dim, dtype)
        scale = 1 / math.sqrt(head_dim)
        kw = dict(window=window, softcap=softcap)
        out, lse = flash_attention.attention_forward(q, k, v, scale, causal, **kw)
        go = torch.randn_like(out)
        leaves = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
        expected = torch.autograd.grad(reference(*leaves, causal, **kw)[0], leaves, go.double())
        for t in (q, k, v):
            poison_allocator(t)
        ours = flash_attention.attention_backward(go, q, k, v, out, lse, scale, causal, version="wgmma", **kw)
        theirs = flash_attention.attention_backward(go, q, k, v, out, lse, scale, causal, version="mma_dqpass", **kw)
        check_against_dqpass(ours, theirs, expected, what, dtype)


@pytest.mark.cuda
def test_cuda_hopper_window_softcap_backward_launches():
    """A window or a softcap runs the kWindowSoftcap instantiation of "wgmma"'s main kernel (named or
    version=None), a plain call the plain one."""
    skip_unless_hopper()
    import re
    from coursekit.pytest_plugin import launched_kernels
    q, k, v = make_qkv(1, 4, 2, 300, 300, 64, dtype=torch.bfloat16, device="cuda")
    for features, featured in (({}, False), ({"window": (17, 5)}, True), ({"softcap": 30.0}, True)):
        out, lse = flash_attention.attention_forward(q, k, v, 0.125, False, **features)
        go = torch.randn_like(out)
        for version in ("wgmma", None):
            names = launched_kernels(lambda: flash_attention.attention_backward(go, q, k, v, out, lse, 0.125, False,
                                                                                version=version, **features),
                                     "flash_attention")[1]
            found = [re.search(r"flash_bwd_hopper_kernel<.*HopperBwdTraits<64>, (true|false), false>", n)
                     for n in names]
            assert {m.group(1) == "true" for m in found if m} == {featured}, (features, version, names)


@pytest.mark.cuda
@pytest.mark.sanitize
def test_sanitizer_hopper_window_backward():
    """"wgmma"'s kWindowSoftcap walk under the sanitizer: partial tiles, a window's edges inside and
    across tiles, rows without keys, a key block no row sees, GQA 2:1, with and without a softcap."""
    skip_unless_hopper()
    for seqlen_q, seqlen_k, window, causal, softcap in ((70, 300, (20, 3), False, 0.0),
                                                        (200, 130, (-1, 1), True, 30.0)):
        q, k, v = make_qkv(1, 4, 2, seqlen_q, seqlen_k, 64, dtype=torch.bfloat16, device="cuda")
        check_cuda_backward(q, k, v, causal, "wgmma", f"wgmma s{seqlen_q}x{seqlen_k} {window}", window=window,
                            softcap=softcap)


# The softcap's tanh (csrc/attention/softcap.cuh): tanh.approx for bfloat16 at softcap <= 8, else
# from the exponential with the reciprocal on the special-function unit (kRcp). The tests above run
# both through the kernels; these hold each mode's helper to its instructions, every float32
# argument to its bound on the GPU, and kRcp's kernels to the reference at scores far past the cap.
# (A reciprocal on the FMA pipe was a second mode until it was measured slower and taken out: the
# chapter's NOTES.md, "The softcap's tanh".)
SOFTCAP_CHECK = Path(__file__).parent / "experiments" / "softcap_tanh_check.cu"


def test_window_softcap_tanh_instructions(tmp_path):
    """The capped score of each mode, as experiments/softcap_tanh_check.cu's cap_scores kernel makes it
    (softcap_score, the kernels' helper), compiles to the instructions its mode names: kRcp to
    ex2.approx and div.approx (MUFU.RCP); kApprox to tanh.approx alone. No mode is left over."""
    kernels = ptx_kernels(SOFTCAP_CHECK, tmp_path)
    mode = {"1": "approx", "2": "rcp"}  # SoftcapTanh's values, as the mangled names carry them
    found = {}
    for name, body in kernels.items():
        m = re.search(r"cap_scores.*SoftcapTanhE(\d)E", name)
        if m:
            found[mode[m.group(1)]] = {op: len(re.findall(re.escape(op), body))
                                       for op in ("ex2.approx", "rcp.", "div.", "tanh.approx")}
    assert set(found) == {"approx", "rcp"}, list(kernels)
    assert found["rcp"]["ex2.approx"] == 1 and found["rcp"]["rcp."] + found["rcp"]["div."] == 1, found["rcp"]
    assert found["approx"]["tanh.approx"] == 1 and found["approx"]["ex2.approx"] == 0, found["approx"]


@pytest.mark.cuda
def test_cuda_softcap_tanh_every_float(tmp_path):
    """experiments/softcap_tanh_check.cu on this GPU: every float32 argument of each mode's helpers
    against tanh in float64 (kRcp within 2^-21, tanh.approx within 2^-10), the NaNs to NaN, and
    kRcp's +-inf and NaN exactly."""
    require_cuda()
    import shutil
    import subprocess
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    major, minor = torch.cuda.get_device_capability()
    exe = tmp_path / "softcap_tanh_check"
    subprocess.run([nvcc, "-std=c++17", f"-arch=sm_{major}{minor}", "-o", str(exe), str(SOFTCAP_CHECK)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    print(run.stdout)
    assert run.returncode == 0 and "all within their bounds" in run.stdout, run.stdout + run.stderr
    checked = [line for line in run.stdout.splitlines() if "max |error|" in line]
    assert len(checked) == 4 and all(line.endswith(" ok") for line in checked), run.stdout
    assert "rcp special values (+-inf to +-1 exactly, NaN to NaN): ok" in run.stdout, run.stdout


@pytest.mark.cuda
def test_cuda_window_softcap_tanh_rcp():
    """kRcp's kernels (softcaps above 8), forward and backward, bfloat16 and float16, d64 and d128,
    against the float64 reference at scores far past the cap, on every rung that takes a softcap
    here (part 3's on a Hopper)."""
    require_cuda()
    if not takes_backward("mma_dqpass", torch.bfloat16, 64):
        pytest.skip("the tensor-core rungs need sm_80")
    hopper = hopper_runs()
    forward = WINDOW_SOFTCAP_FORWARD + (("persistent",) if hopper else ())
    backward = WINDOW_SOFTCAP_BACKWARD + (("wgmma",) if hopper else ())
    for dtype in HALF_DTYPES:
        for head_dim in (64, 128):
            for case in ((2, 2, 150, 150, (-1, -1), False, 30.0), (2, 1, 200, 170, (-1, -1), True, 50.0)):
                heads, heads_kv, seqlen_q, seqlen_k, window, causal, softcap = case
                what = f"rcp {dtype_id(dtype)} d{head_dim} {case_id(case)}"
                q, k, v = window_softcap_inputs(heads, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, softcap)
                ref = cpu_reference(q, k, v, causal, window=window, softcap=softcap)
                for version in forward:
                    check_cuda_forward(q, k, v, causal, version, f"{version} {what}", ref=ref, window=window,
                                       softcap=softcap)
                grad_out = torch.randn(q.shape, dtype=torch.float64).to(dtype).cuda()
                bref = backward_reference(q, k, v, causal, grad_out, True, window=window, softcap=softcap)
                for version in backward:
                    check_cuda_backward(q, k, v, causal, version, f"{version} {what}", grad_out=grad_out, ref=bref,
                                        window=window, softcap=softcap)


# ---------------------------------------------------------------------------------------------
# 13. attention_varlen: sequences of different lengths packed along one token dim
# ---------------------------------------------------------------------------------------------
# (lengths of q, lengths of k) per sequence: equal, q shorter (a chunk against its cache) and
# longer, one token, an empty query (its keys get zero gradients) and an empty key set (its rows
# see nothing).
VARLEN_BATCHES = [
    ([5, 17, 1, 30], [5, 17, 1, 30]),
    ([3, 0, 9, 12], [20, 4, 9, 0]),
]


def varlen_inputs(lens_q, lens_k, heads, heads_kv, head_dim, dtype=torch.float64, requires_grad=False):
    q = torch.randn(sum(lens_q), heads, head_dim, dtype=torch.float64).to(dtype)
    k = torch.randn(sum(lens_k), heads_kv, head_dim, dtype=torch.float64).to(dtype)
    v = (torch.randn(sum(lens_k), heads_kv, head_dim, dtype=torch.float64) * 2 + 0.5).to(dtype)
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v)) + (cu_q, cu_k)


def varlen_reference(q, k, v, cu_q, cu_k, causal, **features):
    """The dense float64 reference of each sequence alone, packed back: (out, lse (heads, total_q))."""
    outs, lses = [], []
    for b in range(cu_q.numel() - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        out, lse = reference(*(t[s].transpose(0, 1).unsqueeze(0) for t, s in ((q, qs), (k, ks), (v, ks))), causal,
                             1.0 / math.sqrt(q.shape[-1]), **features)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("features", [dict(), dict(causal=True), dict(window=(4, 2)),
                                      dict(causal=True, window=(6, -1), softcap=3.0)],
                         ids=("full", "causal", "window", "causal_window_softcap"))
@pytest.mark.parametrize("batch", range(len(VARLEN_BATCHES)))
def test_varlen_matches_reference(batch, features, dtype):
    lens_q, lens_k = VARLEN_BATCHES[batch]
    features = dict(features)
    causal = features.pop("causal", False)
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, 4, 2, 16, dtype, requires_grad=True)
    out, lse = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                return_lse=True, **features)
    leaves = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = varlen_reference(*leaves, cu_q, cu_k, causal, **features)
    assert_forward(out, ref, dtype, "out")
    assert lse.shape == (4, sum(lens_q)) and lse.dtype == lse_dtype(dtype)
    assert_lse(lse, ref_lse, dtype, "lse")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    expected = torch.autograd.grad(ref, leaves, grad_out.double())
    for name, g, e in zip("qkv", grads, expected):
        assert_grad(g, e, dtype, f"d{name}")


def test_varlen_sequences_do_not_see_each_other():
    """Changing one sequence's keys changes no other sequence's output: the packing is not a batch
    of one long sequence (which is what a missing offset would compute)."""
    q, k, v, cu_q, cu_k = varlen_inputs([6, 7], [8, 5], 2, 2, 8)
    before = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, 7, 8)
    k2 = k.clone()
    k2[8:] += 1.0
    after = flash_attention.attention_varlen(q, k2, v, cu_q, cu_k, 7, 8)
    assert torch.equal(before[:6], after[:6]) and not torch.equal(before[6:], after[6:])


def test_varlen_gradcheck():
    q, k, v, cu_q, cu_k = varlen_inputs([3, 0, 4], [5, 2, 3], 2, 1, 4, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b, c: flash_attention.attention_varlen(a, b, c, cu_q, cu_k, 4, 5, causal=True, window=(2, -1),
                                                         softcap=1.5), (q, k, v))


def test_varlen_opcheck_and_compile():
    q, k, v, cu_q, cu_k = varlen_inputs([3, 5], [4, 6], 4, 2, 8, torch.float32, requires_grad=True)
    torch.library.opcheck(OPS.attention_varlen_forward.default, (q, k, v, cu_q, cu_k, 5, 6, 0.3, True, [2, -1], 2.0))
    out, lse = OPS.attention_varlen_forward(q.detach(), k.detach(), v.detach(), cu_q, cu_k, 5, 6, 0.3)
    torch.library.opcheck(OPS.attention_varlen_backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k, 5, 6, 0.3))
    torch._dynamo.reset()

    def block(q, k, v):
        return flash_attention.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, causal=True).square().sum()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for g, e in zip(grads, torch.autograd.grad(block(q, k, v), (q, k, v))):
        torch.testing.assert_close(g, e)


def _varlen(q_total=5, k_total=5, cu_q=(0, 2, 5), cu_k=(0, 3, 5), max_q=3, max_k=3, dtype=torch.float32,
            cu_dtype=torch.int32, **kwargs):
    return lambda: flash_attention.attention_varlen(
        _t(q_total, 2, 8, dtype=dtype), _t(k_total, 2, 8, dtype=dtype), _t(k_total, 2, 8, dtype=dtype),
        torch.tensor(cu_q, dtype=cu_dtype), torch.tensor(cu_k, dtype=cu_dtype), max_q, max_k, **kwargs)


VARLEN_MISUSES = {
    "4-D q": (lambda: flash_attention.attention_varlen(_t(1, 5, 2, 8), _t(5, 2, 8), _t(5, 2, 8),
                                                       torch.tensor([0, 5], dtype=torch.int32),
                                                       torch.tensor([0, 5], dtype=torch.int32), 5, 5),
              r"attention_varlen_forward: q has shape \[1, 5, 2, 8\] \(4 dims\); it must have 3: "
              r"\(total_tokens, heads, head_dim\)"),
    "int64 cu_seqlens": (_varlen(cu_dtype=torch.int64),
                         r"attention_varlen_forward: cu_seqlens_q has dtype Long but must be Int \(int32"),
    "cu_seqlens lengths differ": (_varlen(cu_k=(0, 5)),
                                  r"attention_varlen_forward: cu_seqlens_q has 3 entries but cu_seqlens_k has 2"),
    "cu_seqlens not from 0": (_varlen(cu_q=(1, 2, 5)),
                              r"attention_varlen_forward: cu_seqlens_q\[0\] is 1; it must be 0"),
    "cu_seqlens decreasing": (_varlen(cu_k=(0, 3, 2)), r"attention_varlen_forward: cu_seqlens_k decreases at 2 "
                                                       r"\(3 then 2\)"),
    "cu_seqlens short of the total": (_varlen(cu_q=(0, 2, 4)), r"attention_varlen_forward: cu_seqlens_q ends at 4 "
                                                                r"but the packed tensor has 5 tokens"),
    "longer than max_seqlen": (_varlen(max_k=2), r"attention_varlen_forward: sequence 0 has 3 tokens \(cu_seqlens_k\) "
                                                 r"but max_seqlen_k is 2"),
    "negative max_seqlen": (_varlen(max_q=-1), r"attention_varlen_forward: max_seqlen_q and max_seqlen_k must be >= 0"),
    "float16 on cpu": (_varlen(dtype=torch.float16), r"attention_varlen_forward: q has dtype Half, which is not "
                                                     r"supported \(supported: Float, Double\)"),
    "bad window": (_varlen(window=(-3, 0)), r"attention_varlen_forward: window must be \(left, right\) with each >= 0 "
                                            r"or -1, got \(-3, 0\)"),
}


@pytest.mark.parametrize("misuse", list(VARLEN_MISUSES))
def test_varlen_misuse_raises_clear_error(misuse):
    call, message = VARLEN_MISUSES[misuse]
    with pytest.raises(RuntimeError, match=message):
        call()


def test_varlen_cpu_accepts_every_version_name():
    """version= names a CUDA rung; on the CPU every name of the forward's ladder runs the reference,
    and a typo still fails."""
    q, k, v, cu_q, cu_k = varlen_inputs([3, 5], [4, 6], 2, 1, 8)
    expected = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, causal=True)
    for version in FORWARD_VERSIONS:
        out = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, causal=True, version=version)
        assert torch.equal(out, expected), version
    out, lse = OPS.attention_varlen_forward(q, k, v, cu_q, cu_k, 5, 6, 0.3)
    for version in BACKWARD_VERSIONS:
        OPS.attention_varlen_backward(torch.ones_like(out), q, k, v, out, lse, cu_q, cu_k, 5, 6, 0.3, False, [-1, -1],
                                      0.0, version)
    with pytest.raises(RuntimeError, match=r"attention_varlen_forward: unknown version 'v1'; expected one of naive"):
        flash_attention.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, version="v1")
    with pytest.raises(RuntimeError, match=r"attention_varlen_backward: unknown version 'v1'; expected one of naive"):
        OPS.attention_varlen_backward(out, q, k, v, out, lse, cu_q, cu_k, 5, 6, 0.3, False, [-1, -1], 0.0, "v1")


def test_varlen_dispatch_rule_on_any_gpu():
    """version=None for the packed layout (attention_ops.cpp's varlen rules), asked with made-up
    devices: forward, on a Hopper GPU with the sm_90a kernels "persistent" at head_dim 64 and 128
    without a window or softcap where the grid over the max lengths fills the GPU unsplit (the
    benchmark's 16 sequences up to 8192), "split_kv" where it would split (a few query rows against
    long keys) and everywhere else the tensor-core rungs run; backward, on a Hopper GPU with the sm_90a
    kernels "wgmma" at head_dim 64 and 128 without a window or softcap and not under deterministic
    algorithms, "mma_dqpass" everywhere else the tensor-core rungs run; no rung elsewhere."""
    rule = flash_attention.dispatch_rule
    prefill = dict(batch=16, max_seqlen_q=8192, max_seqlen_k=8192, causal=True)  # the benchmark's batch
    decode = dict(batch=8, max_seqlen_q=1, max_seqlen_k=4000)
    hopper = dict(cuda=True, capability=(9, 0), sms=132, hopper_built=True)
    for d in (64, 128):
        for dtype in HALF_DTYPES:
            assert rule("attention_varlen_forward", (33024, 16, d), dtype=dtype, **prefill, **hopper) == "persistent"
            assert rule("attention_varlen_forward", (33024, 16, d), dtype=dtype, **dict(prefill, causal=False),
                        **hopper) == "persistent"
        assert rule("attention_varlen_forward", (8, 16, d), (30000, 16, d), dtype=torch.bfloat16, **decode,
                    **hopper) == "split_kv"
        for off in (dict(window=(256, -1)), dict(softcap=30.0), dict(scale=-0.1)):
            assert rule("attention_varlen_forward", (33024, 16, d), dtype=torch.bfloat16, **prefill, **off,
                        **hopper) == "split_kv", off
    for d in (32, 96, 256):
        assert rule("attention_varlen_forward", (33024, 16, d), dtype=torch.bfloat16, **prefill, **hopper) == "split_kv"
    for other in (dict(hopper, hopper_built=False), dict(hopper, capability=(8, 0)), dict(hopper, capability=(9, 1))):
        assert rule("attention_varlen_forward", (33024, 16, 128), dtype=torch.bfloat16, **prefill, **other) == \
            "split_kv", other
        assert rule("attention_varlen_backward", (33024, 16, 128), dtype=torch.bfloat16, **prefill, **other) == \
            "mma_dqpass", other
    for capability in ((8, 0), (8, 9), (9, 0)):
        gpu = dict(cuda=True, capability=capability, sms=132, hopper_built=capability == (9, 0))
        for d in (32, 64, 128, 256):
            # one sequence of 1000 tokens in 8 heads: 64 tiles, fewer than the SMs, so split_kv splits
            assert rule("attention_varlen_forward", (1000, 8, d), dtype=torch.bfloat16, **gpu) == "split_kv"
        # three tokens: too few keys to split, so on a Hopper GPU the persistent rung, as padded
        assert rule("attention_varlen_forward", (3, 8, 64), dtype=torch.float16, **gpu) == \
            ("persistent" if capability == (9, 0) else "split_kv")
        for d in (64, 128):
            for dtype in HALF_DTYPES:
                assert rule("attention_varlen_backward", (1000, 8, d), dtype=dtype, **prefill, **gpu) == \
                    ("wgmma" if capability == (9, 0) else "mma_dqpass")
                assert rule("attention_varlen_backward", (1000, 8, d), dtype=dtype, deterministic=True, **prefill,
                            **gpu) == "mma_dqpass"
                for off in (dict(window=(256, -1)), dict(softcap=30.0)):
                    assert rule("attention_varlen_backward", (1000, 8, d), dtype=dtype, **prefill, **off,
                                **gpu) == "mma_dqpass", off
        for d in (32, 96):
            assert rule("attention_varlen_backward", (1000, 8, d), dtype=torch.bfloat16, **gpu) == "mma_dqpass"
        assert rule("attention_varlen_backward", (1000, 8, 256), dtype=torch.bfloat16, **gpu) is None
        assert rule("attention_varlen_forward", (1000, 8, 64), dtype=torch.float32, **gpu) is None
        assert rule("attention_varlen_backward", (1000, 8, 64), dtype=torch.float64, **gpu) is None
    assert rule("attention_varlen_forward", (1000, 8, 64), dtype=torch.bfloat16, cuda=True, capability=(7, 5)) is None
    assert rule("attention_varlen_forward", (1000, 8, 64), dtype=torch.bfloat16, cuda=False) is None
    with pytest.raises(RuntimeError, match=r"varlen_rule: unknown op 'softmax'"):
        OPS.varlen_rule("softmax", 1, 8, 8, 64, 64, 64, 0.125, False, True, True, 9)


# CUDA: the packed layout on rungs "tuned" and "split_kv" (forward) and "mma", "mma_dqpass"
# (backward). (lengths of
# q, lengths of k): every length around the 64- and 128-row tiles, one token, a sequence of 4097
# (many tiles, a partial last one), empty sequences on either side, q shorter (a chunk against its
# cache) and longer than k. The long sequence is its own test (its float64 reference is the cost).
VARLEN_CUDA_BATCHES = [
    ([1, 17, 128, 0, 129, 300], [1, 17, 128, 9, 129, 300]),
    ([17, 129, 3, 64, 65], [300, 64, 0, 127, 65]),
]
VARLEN_CUDA_LONG = ([1, 4097, 17, 128, 0, 129], [1, 4097, 17, 128, 33, 129])
VARLEN_FEATURES = {"full": dict(), "causal": dict(causal=True),
                   "window_softcap": dict(causal=True, window=(40, -1), softcap=5.0)}


def varlen_cuda_inputs(lens_q, lens_k, heads, heads_kv, head_dim, dtype, softcap=0.0):
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, heads, heads_kv, head_dim, dtype)
    if softcap:  # scores large enough for the cap to bite (section 12)
        q, k = q * 2.0, k * 2.0
    return tuple(t.cuda() for t in (q, k, v, cu_q, cu_k))


def check_cuda_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, what, version=None, causal=False, **features):
    """The packed call against the float64 reference of each sequence alone, with the padded tensor-core
    rungs' tolerances; NaN-poisoned outputs catch a row no block wrote."""
    dtype = q.dtype
    ref, ref_lse = varlen_reference(*(t.cpu().double() for t in (q, k, v)), cu_q.cpu(), cu_k.cpu(), causal,
                                    **features)
    poison_allocator(torch.empty(q.shape, dtype=dtype, device="cuda"))
    poison_allocator(torch.empty(q.shape[1], q.shape[0], device="cuda"))
    out, lse = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, version=version,
                                                return_lse=True, **features)
    softcap = features.get("softcap", 0.0)
    rtol, atol = forward_tol(dtype, "tuned", v, softcap)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]), what
    torch.testing.assert_close(out.cpu().double(), ref, rtol=rtol, atol=atol, msg=lambda m: f"{what} out: {m}")
    lse = lse.cpu()
    assert torch.equal(lse.isneginf(), ref_lse.isneginf()), f"{what}: lse is -inf exactly where no key is visible"
    finite = ref_lse.isfinite()
    rtol, atol = CUDA_LSE_TOL[dtype]
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=rtol,
                               atol=atol + tanh_approx_error(dtype, softcap), msg=lambda m: f"{what} lse: {m}")
    assert torch.all(out.cpu().transpose(0, 1)[~finite] == 0), f"{what}: a row without keys is not 0"
    return out


def check_cuda_varlen_backward(q, k, v, cu_q, cu_k, max_q, max_k, versions, what, causal=False, **features):
    """dq, dk, dv of each backward rung against the float64 reference's autograd, with the padded
    rungs' tolerance: CUDA_GRAD_TOL of the largest gradient plus the rounding bounds of a
    tensor-core backward (rounding_bounds), worked out per sequence."""
    dtype = q.dtype
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = OPS.attention_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal,
                                            list(features.get("window", (-1, -1))), features.get("softcap", 0.0))
    grad_out = torch.randn(q.shape, dtype=torch.float64).to(dtype).cuda()
    leaves = tuple(t.cpu().double().requires_grad_() for t in (q, k, v))
    expected = torch.autograd.grad(varlen_reference(*leaves, cu_q.cpu(), cu_k.cpu(), causal, **features)[0], leaves,
                                   grad_out.cpu().double())
    bounds = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b] == cq[b + 1] or ck[b] == ck[b + 1]:
            continue  # no scores: nothing rounded
        seq = [t[s].transpose(0, 1).unsqueeze(0) for t, s in ((q, qs), (k, ks), (v, ks), (grad_out, qs))]
        for bound, part, s in zip(bounds, rounding_bounds(*seq, causal, **features), (qs, ks, ks)):
            bound[s] = part[0].transpose(0, 1)
    for version in versions:
        for t in (q, k, v):
            poison_allocator(t)
        grads = OPS.attention_varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal,
                                              list(features.get("window", (-1, -1))), features.get("softcap", 0.0),
                                              version)
        for name, g, e, bound in zip("qkv", grads, expected, bounds):
            assert g.dtype == dtype and g.shape == e.shape, (what, version, name)
            error = (g.cpu().double() - e).abs()
            allowed = CUDA_GRAD_TOL[dtype] * max(e.abs().max().item(), 1.0) + bound
            assert not g.isnan().any() and torch.all(error <= allowed), \
                f"{what} {version} d{name}: max error {error.max().item():.3g}, worst excess " \
                f"{(error - allowed).max().item():.3g}"


def skip_unless_varlen_runs(head_dim=64, backward=False):
    require_cuda()
    if flash_attention.default_choice("attention_varlen_backward" if backward else "attention_varlen_forward",
                                      torch.empty(1, 2, head_dim, dtype=torch.bfloat16, device="cuda")) is None:
        pytest.skip(f"the packed layout's tensor-core rungs do not run at head_dim {head_dim} on this GPU")


@pytest.mark.cuda
@pytest.mark.parametrize("features", list(VARLEN_FEATURES))
@pytest.mark.parametrize("head_dim", (32, 64, 96, 128, 256))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_varlen_forward(dtype, head_dim, features):
    """Both packed forward rungs on each packed batch, GQA 2:1, max_seqlen the longest sequence's and
    37 more (the extra tiles of the grid return at once). These grids are small: version=None's
    "split_kv" splits them, "tuned" does not."""
    skip_unless_varlen_runs(head_dim)
    for lens_q, lens_k in VARLEN_CUDA_BATCHES:
        kw = dict(VARLEN_FEATURES[features])
        q, k, v, cu_q, cu_k = varlen_cuda_inputs(lens_q, lens_k, 4, 2, head_dim, dtype, kw.get("softcap", 0.0))
        for version, extra in ((None, 0), ("tuned", 0), (None, 37)):
            check_cuda_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q) + extra, max(lens_k) + extra,
                                      f"{version} {dtype_id(dtype)} d{head_dim} {features} {lens_q}x{lens_k} +{extra}",
                                      version=version, **kw)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_varlen_split_kv_splits(dtype):
    """A few query rows per sequence against long, different key lengths (decoding a batch of
    requests, a chunk against its cache): version=None is "split_kv", which cuts the keys (the
    combine kernel runs) and matches the reference; "tuned", the same kernel unsplit, agrees."""
    skip_unless_varlen_runs(128)
    from coursekit.pytest_plugin import launched_kernels
    lens_q, lens_k = [1, 1, 3, 0, 17], [3000, 1, 900, 20, 2000]
    q, k, v, cu_q, cu_k = varlen_cuda_inputs(lens_q, lens_k, 8, 2, 128, dtype)
    assert flash_attention.default_choice("attention_varlen_forward", q, k, batch=5, max_seqlen_q=17,
                                          max_seqlen_k=3000) == "split_kv"
    for causal in (False, True):
        split = check_cuda_varlen_forward(q, k, v, cu_q, cu_k, 17, 3000, f"split {dtype_id(dtype)} causal={causal}",
                                          causal=causal)
        _, names = launched_kernels(lambda: flash_attention.attention_varlen(q, k, v, cu_q, cu_k, 17, 3000,
                                                                             causal=causal), "flash_attention")
        assert any("split_combine" in n for n in names), names
        whole = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, 17, 3000, causal=causal, version="tuned")
        torch.testing.assert_close(split, whole, rtol=CUDA_FORWARD_TOL[dtype][0], atol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("features", list(VARLEN_FEATURES))
@pytest.mark.parametrize("head_dim", (32, 64, 96, 128))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_varlen_backward(dtype, head_dim, features):
    """Both backward rungs on each packed batch (multi-query for one, GQA 2:1 for the other), against
    the reference's autograd."""
    skip_unless_varlen_runs(head_dim, backward=True)
    for (lens_q, lens_k), heads_kv in zip(VARLEN_CUDA_BATCHES, (1, 2)):
        kw = dict(VARLEN_FEATURES[features])
        q, k, v, cu_q, cu_k = varlen_cuda_inputs(lens_q, lens_k, 4, heads_kv, head_dim, dtype, kw.get("softcap", 0.0))
        check_cuda_varlen_backward(q, k, v, cu_q, cu_k, max(lens_q) + 5, max(lens_k), ("mma", "mma_dqpass"),
                                   f"{dtype_id(dtype)} d{head_dim} {features} {lens_q}x{lens_k}", **kw)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim,dtype,causal", [(128, torch.bfloat16, True), (64, torch.float16, False)],
                         ids=("d128-bf16-causal", "d64-fp16-full"))
def test_cuda_varlen_long_sequence(head_dim, dtype, causal):
    """A sequence of 4097 tokens among short ones: 33 query tiles and 65 key tiles of its own beside
    sequences of one tile or none, forward and both backward rungs."""
    skip_unless_varlen_runs(head_dim, backward=True)
    lens_q, lens_k = VARLEN_CUDA_LONG
    q, k, v, cu_q, cu_k = varlen_cuda_inputs(lens_q, lens_k, 2, 1, head_dim, dtype)
    what = f"long {dtype_id(dtype)} d{head_dim} causal={causal}"
    check_cuda_varlen_forward(q, k, v, cu_q, cu_k, 4097, 4097, what, causal=causal)
    check_cuda_varlen_backward(q, k, v, cu_q, cu_k, 4097, 4097, ("mma", "mma_dqpass"), what, causal=causal)


@pytest.mark.cuda
@pytest.mark.parametrize("features", list(VARLEN_FEATURES))
@pytest.mark.parametrize("seqlen_q,seqlen_k,version", [(200, 200, "tuned"), (5, 900, "split_kv")],
                         ids=("tuned", "split_kv"))
def test_cuda_varlen_matches_the_padded_kernels(seqlen_q, seqlen_k, version, features):
    """Sequences of one length packed are the padded batch: the same kernels' code on the same values
    (and, for "split_kv", the same split count: the rule reads the same sizes), so the same bits,
    forward and backward ("mma_dqpass"; lse as the padded forward's)."""
    skip_unless_varlen_runs(64, backward=True)
    kw = dict(VARLEN_FEATURES[features])
    batch, heads, heads_kv, d = 3, 4, 2, 64
    q, k, v = make_qkv(batch, heads, heads_kv, seqlen_q, seqlen_k, d, dtype=torch.bfloat16, device="cuda")
    go = torch.randn_like(q)
    out, lse = flash_attention.attention_forward(q, k, v, 0.125, version=version, **kw)
    grads = flash_attention.attention_backward(go, q, k, v, out, lse, 0.125, version="mma_dqpass", **kw)

    def pack(t):  # (batch, heads, seqlen, d) -> (batch * seqlen, heads, d)
        return t.transpose(1, 2).flatten(0, 1)
    cu_q, cu_k = (torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device="cuda") for n in (seqlen_q, seqlen_k))
    causal, window, softcap = kw.get("causal", False), list(kw.get("window", (-1, -1))), kw.get("softcap", 0.0)
    p_out, p_lse = OPS.attention_varlen_forward(pack(q), pack(k), pack(v), cu_q, cu_k, seqlen_q, seqlen_k, 0.125,
                                                causal, window, softcap, version)
    assert torch.equal(p_out, pack(out)) and torch.equal(p_lse, lse.transpose(0, 1).flatten(1, 2))
    p_grads = OPS.attention_varlen_backward(pack(go), pack(q), pack(k), pack(v), p_out, p_lse, cu_q, cu_k, seqlen_q,
                                            seqlen_k, 0.125, causal, window, softcap, "mma_dqpass")
    for name, g, e in zip("qkv", p_grads, grads):
        assert torch.equal(g, pack(e)), name


# The packed layout on part 3's rung "persistent" (Hopper only): its tensor maps over the packed
# tensors, the schedule kernel's order of the sequences' own tiles (tile_schedule.h).
def skip_unless_persistent_varlen():
    require_cuda()
    if not hopper_runs():
        pytest.skip("rung 'persistent' needs a Hopper GPU (compute capability 9.0) and a build whose arch list had 9.0")


# (lengths of q, lengths of k): 1, 17, 128, 129 and 4097 tokens mixed with empty sequences on either
# side, a sequence whose keys outnumber its queries (a chunk against its cache) and one the other way.
VARLEN_PERSISTENT_BATCHES = [
    ([1, 17, 128, 0, 129, 4097, 300], [1, 17, 128, 9, 129, 4097, 300]),
    ([17, 129, 3, 64, 65, 0], [300, 64, 0, 127, 65, 0]),
]


@pytest.mark.cuda
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_varlen_persistent(dtype, head_dim, causal):
    """Rung "persistent" packed, GQA (2:1 on the long batch, 4:1 on the other), against the float64
    reference of each sequence alone; the same bits with max_seqlen 200 past the longest sequence
    (the schedule's items are the sequences' own tiles either way: a larger max only widens the
    index space); and each sequence with keys bit for bit as the padded persistent rung on that
    sequence alone (out and lse): the rows of the next sequence that a partial tile reads are masked
    as keys and not stored as rows (the kernel's comment)."""
    skip_unless_persistent_varlen()
    for (lens_q, lens_k), (heads, heads_kv) in zip(VARLEN_PERSISTENT_BATCHES, ((2, 1), (8, 2))):
        q, k, v, cu_q, cu_k = varlen_cuda_inputs(lens_q, lens_k, heads, heads_kv, head_dim, dtype)
        what = f"persistent {dtype_id(dtype)} d{head_dim} causal={causal} {lens_q}x{lens_k}"
        max_q, max_k = max(lens_q), max(lens_k)
        out = check_cuda_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, what, version="persistent", causal=causal)
        out, lse = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                                    version="persistent", return_lse=True)
        wide, wide_lse = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, max_q + 200, max_k + 200,
                                                          causal=causal, version="persistent", return_lse=True)
        assert torch.equal(wide, out) and torch.equal(wide_lse, lse), f"{what}: max_seqlen + 200 changed the bits"
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for b in range(len(lens_q)):
            if lens_q[b] == 0 or lens_k[b] == 0:
                continue  # nothing to compare bitwise (the reference above holds these rows)
            one = [t[s].transpose(0, 1).unsqueeze(0) for t, s in
                   ((q, slice(cq[b], cq[b + 1])), (k, slice(ck[b], ck[b + 1])), (v, slice(ck[b], ck[b + 1])))]
            o1, l1 = flash_attention.attention_forward(*one, 1 / math.sqrt(head_dim), causal, version="persistent")
            assert torch.equal(out[cq[b]:cq[b + 1]], o1[0].transpose(0, 1)), f"{what} sequence {b}: out"
            assert torch.equal(lse[:, cq[b]:cq[b + 1]], l1[0]), f"{what} sequence {b}: lse"


@pytest.mark.cuda
def test_cuda_varlen_persistent_dispatch():
    """version=None on the benchmark's kind of batch (sequences of 128 to 8192 tokens, causal, d128)
    is "persistent", and it is what runs: the schedule kernel, then the persistent kernel; the
    result matches rung "split_kv"'s within the rungs' rounding. Where the grid over the max lengths would split (a few query rows against long keys),
    "split_kv"."""
    skip_unless_persistent_varlen()
    from coursekit.pytest_plugin import launched_kernels
    lens = [128, 2048, 256, 1024, 640, 3000]
    q, k, v, cu_q, cu_k = varlen_cuda_inputs(lens, lens, 8, 8, 128, torch.bfloat16)
    assert flash_attention.default_choice("attention_varlen_forward", q, scale=1 / math.sqrt(128), causal=True,
                                          batch=len(lens), max_seqlen_q=3000, max_seqlen_k=3000) == "persistent"
    out, names = launched_kernels(lambda: flash_attention.attention_varlen(q, k, v, cu_q, cu_k, 3000, 3000,
                                                                           causal=True), "flash_attention")
    # the profiler cuts the persistent kernel's name inside its traits, before kVarlen: the schedule
    # kernel, which only the packed path launches, tells the two apart
    assert any("hopper_varlen_schedule_kernel" in n for n in names), names
    assert any("flash_fwd_hopper_persistent_kernel" in n for n in names), names
    split = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, 3000, 3000, causal=True, version="split_kv")
    # two kernels, each rounding its float32 result to bfloat16 once: up to one unit of bfloat16 (2^-8
    # relative, 2^-9 absolute near 0.5) apart each way
    torch.testing.assert_close(out, split, rtol=CUDA_FORWARD_TOL[torch.bfloat16][0], atol=2 ** -8)
    qd, kd, vd, cqd, ckd = varlen_cuda_inputs([1, 3, 2], [3000, 900, 2000], 8, 2, 128, torch.bfloat16)
    assert flash_attention.default_choice("attention_varlen_forward", qd, kd, batch=3, max_seqlen_q=3,
                                          max_seqlen_k=3000) == "split_kv"


@pytest.mark.cuda
def test_cuda_varlen_persistent_misuse():
    """Rung "persistent" refuses the packed calls it does not compute, naming the way out: head_dim
    256 and 32, a window or softcap, float32."""
    skip_unless_persistent_varlen()
    call = flash_attention.attention_varlen
    cases = []
    for d, message in ((256, r"version 'persistent' takes the packed \(varlen\) layout at head_dim 64, 128"),
                       (32, r"version 'persistent' takes head_dim 64, 128 or 256")):
        q, k, v, cu_q, cu_k = varlen_cuda_inputs([3, 4], [3, 4], 2, 2, d, torch.bfloat16)
        cases.append((lambda q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k: call(q, k, v, cu_q, cu_k, 4, 4, version="persistent"),
                      message))
    q, k, v, cu_q, cu_k = varlen_cuda_inputs([3, 4], [3, 4], 2, 2, 64, torch.bfloat16)
    cases += [
        (lambda: call(q, k, v, cu_q, cu_k, 4, 4, causal=True, window=(2, -1), version="persistent"),
         r"version 'persistent' takes no window or softcap in the packed \(varlen\) layout; versions 'tuned' and "
         r"'split_kv' compute them"),
        (lambda: call(q, k, v, cu_q, cu_k, 4, 4, softcap=5.0, version="persistent"),
         r"version 'persistent' takes no window or softcap"),
        (lambda: call(q.float(), k.float(), v.float(), cu_q, cu_k, 4, 4, version="persistent"),
         r"attention_varlen_forward: on CUDA the packed \(varlen\) layout runs on versions"),
    ]
    for fn, message in cases:
        with pytest.raises(RuntimeError, match=message):
            fn()


@pytest.mark.cuda
@pytest.mark.sanitize
def test_sanitizer_varlen_persistent():
    """Rung "persistent" packed under compute-sanitizer: partial tiles whose copies read the next
    sequence's rows and, at the end of the tensor, past it (zero-filled), empty sequences on both
    sides, a max_seqlen past every sequence, GQA, both head dims, causal and full; and a decreasing
    cu_seqlens (an empty sequence, varlen.cuh's rule): nothing read or written outside the tensors."""
    skip_unless_persistent_varlen()
    lens_q, lens_k = [1, 17, 0, 70, 129, 5], [33, 17, 4, 0, 130, 70]
    for head_dim in (64, 128):
        for causal in (False, True):
            q, k, v, cu_q, cu_k = varlen_cuda_inputs(lens_q, lens_k, 4, 2, head_dim, torch.bfloat16)
            check_cuda_varlen_forward(q, k, v, cu_q, cu_k, 200, 300, f"sanitize persistent d{head_dim} causal={causal}",
                                      version="persistent", causal=causal)
    q, k, v, cu_q, cu_k = varlen_cuda_inputs([5, 9], [5, 9], 2, 1, 64, torch.bfloat16)
    bad = torch.tensor([0, 5, 3, 14], dtype=torch.int32, device="cuda")
    out = flash_attention.attention_varlen(q, k, v, bad, bad, 11, 11, causal=True, version="persistent")
    good = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, causal=True, version="persistent")
    assert torch.equal(out[:3], good[:3])


# The packed layout on the Hopper backward ("wgmma"'s kVarlen instantiation): the persistent
# forward's batches (1, 17, 128, 129 and 4097 tokens mixed with empty sequences on either side, keys
# outnumbering queries and the other way) and the long one beside short ones.
VARLEN_HOPPER_BACKWARD_BATCHES = VARLEN_PERSISTENT_BATCHES + [VARLEN_CUDA_LONG]


@pytest.mark.cuda
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_cuda_varlen_hopper_backward(dtype, head_dim, causal):
    """"wgmma" packed, GQA 2:1, 4:1 and multi-query, against the float64 reference of each sequence
    alone (on the GPU), within twice "mma_dqpass"'s error plus CUDA_GRAD_TOL, on NaN-poisoned
    outputs (a row or key no block wrote); version=None runs it; and dK and dV (one writer each) the
    same bits with max_seqlen 200 past the longest (the extra key tiles return at once, and the
    statistics' packed rows do not depend on it)."""
    skip_unless_hopper()
    for (lens_q, lens_k), (heads, heads_kv) in zip(VARLEN_HOPPER_BACKWARD_BATCHES, ((2, 1), (8, 2), (4, 1))):
        q, k, v, cu_q, cu_k = varlen_cuda_inputs(lens_q, lens_k, heads, heads_kv, head_dim, dtype)
        what = f"wgmma packed {dtype_id(dtype)} d{head_dim} causal={causal} {lens_q}x{lens_k}"
        max_q, max_k = max(lens_q), max(lens_k)
        scale = 1 / math.sqrt(head_dim)
        out, lse = OPS.attention_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
        go = torch.randn_like(out)
        leaves = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
        expected = torch.autograd.grad(varlen_reference(*leaves, cu_q.cpu(), cu_k.cpu(), causal)[0], leaves,
                                       go.double())
        assert flash_attention.default_choice("attention_varlen_backward", q, k, batch=len(lens_q),
                                              max_seqlen_q=max_q, max_seqlen_k=max_k) == "wgmma", what

        def backward(version, extra=0):
            for t in (q, k, v):
                poison_allocator(t)
            return OPS.attention_varlen_backward(go, q, k, v, out, lse, cu_q, cu_k, max_q + extra, max_k + extra,
                                                 scale, causal, [-1, -1], 0.0, version)
        ours = backward("wgmma")
        check_against_dqpass(ours, backward("mma_dqpass"), expected, what, dtype)
        check_against_dqpass(backward(None), backward("mma_dqpass"), expected, f"{what} default", dtype)
        wide = backward("wgmma", 200)
        assert torch.equal(wide[1], ours[1]) and torch.equal(wide[2], ours[2]), f"{what}: max_seqlen + 200"


@pytest.mark.cuda
def test_cuda_varlen_hopper_backward_empty():
    """Packed with no query token (dK and dV zeros, from the launcher's small kernel over every key
    token), sequences all empty on the query side but one, and no key token (dQ zeros)."""
    skip_unless_hopper()
    for lens_q, lens_k in (([0, 0], [5, 70]), ([0, 3, 0], [9, 0, 200])):
        q, k, v, cu_q, cu_k = varlen_cuda_inputs(lens_q, lens_k, 2, 1, 64, torch.bfloat16)
        out, lse = OPS.attention_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), 0.125, True)
        go = torch.randn_like(out)
        for t in (q, k, v):
            poison_allocator(t)
        ours = OPS.attention_varlen_backward(go, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k), 0.125,
                                             True, [-1, -1], 0.0, "wgmma")
        theirs = OPS.attention_varlen_backward(go, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k), 0.125,
                                               True, [-1, -1], 0.0, "mma_dqpass")
        for name, g, h in zip("qkv", ours, theirs):
            torch.testing.assert_close(g, h, rtol=2 ** -7, atol=1e-3, msg=lambda m: f"{lens_q}x{lens_k} d{name}: {m}")
    # No key token at all, though max_seqlen_k says 7: every row sees nothing (out 0, lse -inf), dQ 0.
    q, k, v, cu_q, cu_k = varlen_cuda_inputs([3, 5], [0, 0], 2, 1, 64, torch.bfloat16)
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, device="cuda")
    poison_allocator(q)
    dq, dk, dv = OPS.attention_varlen_backward(torch.randn_like(out), q, k, v, out, lse, cu_q, cu_k, 5, 7, 0.125,
                                               False, [-1, -1], 0.0, "wgmma")
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.numel() == 0 and dv.numel() == 0


@pytest.mark.cuda
@pytest.mark.sanitize
def test_sanitizer_varlen_hopper_backward():
    """"wgmma" packed under compute-sanitizer: partial tiles whose copies read the next sequence's
    rows and, at the end of the tensor, past it (zero-filled), empty sequences on both sides, a
    max_seqlen past every sequence, GQA 2:1, causal and full: nothing read or written outside the
    tensors and the workspace, no shared-memory race."""
    skip_unless_hopper()
    lens_q, lens_k = [1, 17, 0, 70, 129, 5], [33, 17, 4, 0, 130, 70]
    for causal in (False, True):
        q, k, v, cu_q, cu_k = varlen_cuda_inputs(lens_q, lens_k, 4, 2, 64, torch.bfloat16)
        check_cuda_varlen_backward(q, k, v, cu_q, cu_k, 200, 300, ("wgmma",), f"sanitize wgmma causal={causal}",
                                   causal=causal)


@pytest.mark.cuda
def test_cuda_varlen_graph_capture_and_compile():
    """No host sync and no host read of cu_seqlens: forward and the packed backward rungs ("wgmma" on
    a Hopper too) replay inside a CUDA graph; torch.compile(fullgraph=True) traces the packed call, forward and backward, through
    the Meta kernels on CUDA tensors; opcheck holds the registration (schema, fake kernels, autograd)."""
    skip_unless_varlen_runs(64, backward=True)
    lens = [17, 0, 129, 64]
    q, k, v, cu_q, cu_k = varlen_cuda_inputs(lens, lens, 4, 2, 64, torch.bfloat16)
    go = torch.randn_like(q)

    def step():
        out, lse = OPS.attention_varlen_forward(q, k, v, cu_q, cu_k, 129, 129, 0.125, True)
        results = [out, lse]
        for version in ("mma", "mma_dqpass") + (("wgmma",) if hopper_runs() else ()):
            results += [(version, g) for g in OPS.attention_varlen_backward(
                go, q, k, v, out, lse, cu_q, cu_k, 129, 129, 0.125, True, [-1, -1], 0.0, version)]
        return results

    captured, expected = capture_and_replay(step)
    for a, e in zip(captured, expected):
        if isinstance(a, tuple):
            (version, a), (_, e) = a, e
            if version in DQ_ATOMIC_BACKWARD:  # dQ sums in whatever order the blocks' adds arrive
                torch.testing.assert_close(a, e, rtol=2 ** -7, atol=1e-3)
                continue
        assert torch.equal(a, e)

    torch._dynamo.reset()
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))

    def block(q, k, v):
        return flash_attention.attention_varlen(q, k, v, cu_q, cu_k, 129, 129, causal=True).float().square().sum()
    # aot_eager: Dynamo and AOTAutograd trace the call (fake CUDA tensors through the Meta kernels)
    # without a graph break; inductor's codegen would add nothing about the op, which it never compiles.
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    grads = torch.autograd.grad(compiled(*leaves), leaves)
    for g, e in zip(grads, torch.autograd.grad(block(*leaves), leaves)):
        torch.testing.assert_close(g, e, rtol=2 ** -7, atol=1e-3)
    torch.library.opcheck(OPS.attention_varlen_forward.default,
                          (*leaves, cu_q, cu_k, 129, 129, 0.125, True, [40, -1], 5.0, None))
    out, lse = OPS.attention_varlen_forward(q, k, v, cu_q, cu_k, 129, 129, 0.125, True)
    torch.library.opcheck(OPS.attention_varlen_backward.default,
                          (go, q, k, v, out, lse, cu_q, cu_k, 129, 129, 0.125, True, [-1, -1], 0.0, None))


@pytest.mark.cuda
def test_cuda_varlen_misuse():
    """Every refusal names the op and the way out: cu_seqlens on the wrong device or of the wrong
    dtype, a rung without the packed layout (named, or version=None's where none runs), max lengths
    the tokens cannot fit, head_dim. (Unsorted or overlong lengths are the CPU's to check: CUDA never
    reads cu_seqlens on the host, see attention_ops.cpp.)"""
    skip_unless_varlen_runs(64, backward=True)
    q, k, v, cu_q, cu_k = varlen_cuda_inputs([3, 4], [3, 4], 2, 2, 64, torch.bfloat16)
    call = flash_attention.attention_varlen
    cases = [
        (lambda: call(q, k, v, cu_q.cpu(), cu_k, 4, 4),
         r"attention_varlen_forward: cu_seqlens_q is on cpu but q is on cuda"),
        (lambda: call(q, k, v, cu_q, cu_k.long(), 4, 4),
         r"attention_varlen_forward: cu_seqlens_k has dtype Long but must be Int"),
        (lambda: call(q, k, v, cu_q, cu_k, 4, 4, version="pipelined"),
         r"attention_varlen_forward: version 'pipelined' does not take the packed \(varlen\) layout; versions 'tuned', "
         r"'split_kv' and 'persistent' take it"),
        (lambda: call(q, k, v, cu_q, cu_k, 4, 4, version="pingpong"),
         r"attention_varlen_forward: version 'pingpong' does not take the packed \(varlen\) layout"),
        (lambda: call(q.float(), k.float(), v.float(), cu_q, cu_k, 4, 4),
         r"attention_varlen_forward: on CUDA the packed \(varlen\) layout runs on versions 'tuned', 'split_kv' and "
         r"'persistent' alone \(float16 and bfloat16.*q is Float"),
        (lambda: call(q.double(), k.double(), v.double(), cu_q, cu_k, 4, 4, version="tuned"),
         r"attention_varlen_forward: on CUDA the packed \(varlen\) layout runs on versions 'tuned', 'split_kv' and "
         r"'persistent' alone .*q is Double"),
        (lambda: call(q, k, v, cu_q, cu_k, 3, 4),
         r"attention_varlen_forward: 2 sequences of at most max_seqlen_q = 3 and max_seqlen_k = 4 tokens cannot hold "
         r"7 query and 7 key tokens"),
        (lambda: call(q[..., :48], k[..., :48], v[..., :48], cu_q, cu_k, 4, 4),
         r"attention_varlen_forward: head_dim 48 is not supported on CUDA"),
    ]
    out, lse = OPS.attention_varlen_forward(q, k, v, cu_q, cu_k, 4, 4, 0.125)
    backward = OPS.attention_varlen_backward
    cases += [
        (lambda: backward(out, q, k, v, out, lse, cu_q, cu_k, 4, 4, 0.125, False, [-1, -1], 0.0, "naive"),
         r"attention_varlen_backward: version 'naive' does not take the packed \(varlen\) layout; versions 'mma', "
         r"'mma_dqpass' and 'wgmma' take it"),
    ]
    q256, k256, v256, _, _ = varlen_cuda_inputs([3, 4], [3, 4], 2, 2, 256, torch.bfloat16)
    o256, l256 = OPS.attention_varlen_forward(q256, k256, v256, cu_q, cu_k, 4, 4, 0.0625)
    cases += [
        (lambda: backward(o256, q256, k256, v256, o256, l256, cu_q, cu_k, 4, 4, 0.0625),
         r"attention_varlen_backward: on CUDA the packed \(varlen\) layout's backward runs on versions 'mma', "
         r"'mma_dqpass' and 'wgmma' alone .*head_dim 32, 64, 96, 128"),
    ]
    for fn, message in cases:
        with pytest.raises(RuntimeError, match=message):
            fn()


@pytest.mark.cuda
@pytest.mark.sanitize
def test_sanitizer_varlen():
    """The packed layout's small run: partial tiles, empty sequences on both sides, a max_seqlen past
    every sequence, GQA, window and softcap, forward and both backward rungs at the smallest head dim
    and at 96 (padded rows, no swizzle)."""
    skip_unless_varlen_runs(32, backward=True)
    lens_q, lens_k = [1, 17, 0, 70, 5], [33, 17, 4, 0, 130]
    for head_dim in (32, 96):
        for kw in VARLEN_FEATURES.values():
            q, k, v, cu_q, cu_k = varlen_cuda_inputs(lens_q, lens_k, 4, 2, head_dim, torch.bfloat16,
                                                     kw.get("softcap", 0.0))
            what = f"sanitize d{head_dim} {kw}"
            check_cuda_varlen_forward(q, k, v, cu_q, cu_k, 80, 140, what, **kw)
            check_cuda_varlen_backward(q, k, v, cu_q, cu_k, 80, 140, ("mma", "mma_dqpass"), what, **kw)
    # A decreasing cu_seqlens, which CUDA never reads on the host: the decreasing pair is an empty
    # sequence (varlen.cuh), so nothing is read or written outside the tensors (memcheck's part), and
    # the sequences around it are computed as they would be alone.
    q, k, v, cu_q, cu_k = varlen_cuda_inputs([5, 9], [5, 9], 2, 1, 32, torch.bfloat16)
    bad = torch.tensor([0, 5, 3, 14], dtype=torch.int32, device="cuda")
    out = flash_attention.attention_varlen(q, k, v, bad, bad, 11, 11, causal=True)
    good = flash_attention.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, causal=True)
    assert torch.equal(out[:3], good[:3])
