"""FlashAttention, forward and backward, on Ampere's and Hopper's tensor cores, and decode attention over a paged KV cache.

Chapter 6 of the course. Layout (batch, heads, seqlen, head_dim), as
torch.nn.functional.scaled_dot_product_attention; q, k and v may be any strided views whose last
dim is contiguous (q taken from a (batch, seqlen, heads, head_dim) projection by transpose(1, 2)
is read in place, not copied). Grouped-query attention: k and v may have fewer heads than q, a
whole divisor of them; query head h reads kv head h // (heads // heads_kv).

causal=True masks key j from query row i unless j <= i + seqlen_k - seqlen_q: the mask is
aligned to the bottom-right corner (FlashAttention 2's convention; the last query row sees every
key, as in decoding with a KV cache). For seqlen_q == seqlen_k that is the usual lower triangle.
A row that sees no key (causal with seqlen_q > seqlen_k) returns zeros, lse -inf, and passes no
gradient, as SDPA's CPU kernels do for a fully masked row.

Local attention and softcapping, FlashAttention 2's API: window=(left, right) keeps key j for
row i only when i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (the same
bottom-right alignment; -1 leaves a side unbounded; causal=True is right = 0, whatever the window
says), and softcap > 0 replaces each scaled score s by softcap * tanh(s / softcap) before the
softmax. The CPU reference computes both; on CUDA the forward rungs "tuned", "split_kv" and (on a
Hopper GPU, head_dim 64 and 128, padded layout) "persistent", and the backward rungs "mma",
"mma_dqpass" and (on a Hopper GPU, head_dim 64 and 128, padded layout) "wgmma" do (version=None
picks "persistent" where it applies, else "split_kv", and "wgmma" where it applies, else
"mma_dqpass"; the backward recomputes P from the forward's lse of the capped scores), and every
other rung refuses them. On "persistent" a query tile walks only the key tiles its rows' windows
reach, and on "wgmma" a key tile only the query tiles that see it.

attention_varlen takes sequences of different lengths packed along one token dim, (total_tokens,
heads, head_dim), with int32 cumulative lengths cu_seqlens_q and cu_seqlens_k (FlashAttention 2's
varlen API), forward and backward: the CPU reference, and on CUDA the forward rungs "tuned",
"split_kv" and (on a Hopper GPU, head_dim 64 and 128, no window or softcap) "persistent", and the
backward rungs "mma", "mma_dqpass" and (on a Hopper GPU, head_dim 64 and 128, no window or softcap)
"wgmma" (version=None picks "persistent" where it applies and the grid over the max lengths fills
the GPU, else "split_kv", and "wgmma" where it applies, else "mma_dqpass"; every other rung refuses
the packed layout). max_seqlen_q and max_seqlen_k are host
ints that size the CUDA grid, so the op never reads cu_seqlens on the host (no sync: CUDA graphs
and torch.compile work); on CUDA the lengths are trusted, on the CPU every value is checked.

What exists now: the C++ reference on the CPU (float32 computed in float32, float64 in
float64), its C++ autograd, the Meta kernels that let torch.compile trace both passes, and the
CUDA rungs (head_dim 32, 64, 96, 128 or 256):

- forward "naive": S = scale q k^T materialised in a float32 workspace, a row softmax, P v
  (float32, float16, bfloat16, float64; 16-bit computed in float32);
- forward "tiled": FlashAttention 1's online softmax over K/V tiles in shared memory, O(seqlen)
  memory, scalar FMA (the same four dtypes);
- forward "mma": FlashAttention 2 on tensor cores (mma.sync m16n8k16, ldmatrix), each warp
  owning 16 query rows, S and P in registers (float16 and bfloat16, sm_80 and newer);
- forward "pipelined": "mma" with cp.async double-buffered K/V tiles, a swizzled shared-memory
  layout, exp2 and masks only on the tiles that need them;
- forward "tuned": "pipelined" with FlashAttention 2's tile shapes: each warp owns 32 query rows
  (two m16 tiles), so each K and V fragment read from shared memory feeds two mma instructions;
- forward "split_kv": "tuned" with the keys cut into ranges when batch x heads x query tiles
  cannot fill the GPU (flash-decoding): each range writes a float32 partial output and its lse,
  and a combine kernel merges them;
- forward "wgmma" (part 3, Hopper only: compute capability 9.0, head_dim 64, 128 or 256, scale > 0):
  Q, K and V tiles brought by the tensor memory accelerator (TMA) into a shared-memory ring that
  completes on mbarriers, S = Q K^T and O += P V by wgmma (warpgroup products read from shared
  memory; P from registers);
- forward "warp_specialized": "wgmma" with a producer warpgroup that only issues the copies and
  two consumer warpgroups that only compute, registers moved to them with setmaxnreg;
- forward "pingpong": each consumer warpgroup issues one tile's P V and the next tile's Q K^T
  together, in turns with the other, so one's softmax runs while the other's products keep the
  tensor cores busy; a third shared-memory stage where it fits;
- forward "persistent": the same consumers ("pingpong"'s at head_dim 64 and 128,
  "warp_specialized"'s at 256) in a grid of one block per SM slot, each walking a schedule
  of query tiles (longest first when causal or windowed, the heads that share K and V together):
  the producer loads the next tile's Q and first K/V while the consumers finish a tile and store its
  output; with a window or a softcap (head_dim 64 and 128) a second instantiation walks only the
  window's key tiles and caps the scores;
- attention_fp8 (part 3, Hopper only; head_dim 64 or 128): the forward on e4m3 q, k and V^T with
  per-tensor descale factors, "pingpong"'s schedule on FP8 wgmma, bfloat16 out; quantize_fp8 makes
  its inputs (any device; CPU reference and CUDA kernels agree bit for bit), and rotate_qk the
  optional random-sign Hadamard rotation of q and k before it (same scores, outliers spread out);
- backward "naive": P recomputed from lse into a workspace, then dV, dS, dQ, dK one kernel each;
- backward "mma": FlashAttention 2's backward on tensor cores: a block per key tile sums dK and
  dV in registers, dQ through float32 atomics (float16 and bfloat16, sm_80+, head_dim <= 128);
- backward "mma_dqpass": the same dK and dV, and dQ from a second pass over the keys instead of
  atomics: the same bits on every run;
- backward "wgmma": the "mma" split on Hopper's machinery (sm_90a, head_dim 64 and 128): a
  producer warp streams Q and dO through an mbarrier ring by TMA, two consumer warpgroups of 64
  keys compute S^T, dP^T, dV and dK with wgmma (P^T and dS^T from registers), and dQ = dS K reads
  dS^T back from shared memory and adds into float32 sums by the copy engine's bulk reductions;
  window and softcap (padded) and the packed layout each in an instantiation of their own.

version=None runs, for 16-bit inputs: on a Hopper GPU, at head_dim 64 and 128, "persistent" where the
walks over the keys are short (at most 512 keys at head_dim 128 and 4096 at 64, or 4096 and 8192
when they are uneven: causal) and
"pingpong" (with FlashAttention 3's intra-warpgroup overlap) for longer ones, "warp_specialized" at 256, and "persistent" for any call with a window or a softcap (head_dim
64 and 128), unless
the grid is small enough to split the keys; otherwise "split_kv"
(sm_80+; it splits only when the grid would leave SMs idle, and is "tuned" otherwise); float32 and
float64 run "tiled". The backward runs "wgmma" on a Hopper GPU (head_dim 64 and 128; in the packed
layout without a window or softcap), else "mma_dqpass" where it can, else "naive"; with
torch.use_deterministic_algorithms(True) it keeps to "mma_dqpass", whose bits do not change from
run to run (csrc/attention/attention_ops.cpp says which measurements pick these). On the CPU every version
name runs the reference.
"""
import math
from pathlib import Path

try:  # installed: setup.py ships the shared loader inside the package
    from ._loader import load_extension
except ImportError:  # the course checkout: the loader's one home, common/coursekit
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "common"))
    from coursekit.loader import load_extension

# How the ops library was loaded: route (installed, jit or preloaded) and where from.
EXTENSION = load_extension("flash_attention", "flash_attention", __file__)

import torch  # noqa: E402

# The serving half of the chapter: the paged KV cache, decode attention over it, the prefix tree.
from .paged import copy_blocks, paged_attention, paged_prefill_attention, reshape_and_cache  # noqa: E402
from .radix import RadixCache  # noqa: E402

__all__ = ["attention", "attention_varlen", "sdpa", "attention_forward", "attention_backward", "hopper_kernels_built",
           "default_choice", "dispatch_rule", "quantize_fp8", "attention_fp8", "hadamard_rotation", "rotate_qk",
           "reshape_and_cache", "copy_blocks", "paged_attention", "paged_prefill_attention", "RadixCache",
           "VERSIONS", "EXTENSION"]

# Each op's ladder of kernel versions; test_attention.py holds it against the extension's
# tables (the `versions` op).
VERSIONS = {
    "attention_forward": ("naive", "tiled", "mma", "pipelined", "tuned", "split_kv", "wgmma", "warp_specialized",
                          "pingpong", "persistent"),
    "attention_backward": ("naive", "mma", "mma_dqpass", "wgmma"),
    "paged_attention": ("per_head", "per_kv_head", "split_kv"),
    "paged_prefill_attention": ("decode_rows", "mma", "persistent"),
}


def hopper_kernels_built():
    """Whether this build of the extension holds the Hopper rungs (its TORCH_CUDA_ARCH_LIST had
    9.0, compiled as sm_90a). They run only on a GPU of compute capability 9.0."""
    return torch.ops.flash_attention.hopper_kernels_built()


def dispatch_rule(op, q_shape, k_shape=None, *, dtype, cuda, capability=(0, 0), sms=0, hopper_built=False,
                  scale=None, causal=False, window=(-1, -1), softcap=0.0, deterministic=False, max_seqlen_q=0,
                  max_seqlen_k=0, batch=1, block_size=16):
    """The rung version=None runs for inputs of these shapes and dtype on a device described by the
    rest: the extension's own rule (csrc/attention/attention_ops.cpp), asked with any facts, so
    that a GPU other than this machine's (or a recorded one) can be asked about here.
    deterministic: whether torch.use_deterministic_algorithms(True) is on (the backward then keeps
    to a rung that gives the same bits on every run). For the packed ops (attention_varlen_forward,
    attention_varlen_backward; q_shape (total, heads, head_dim), k_shape k's) batch is the number of
    sequences and max_seqlen_q, max_seqlen_k the call's (0: the totals), which the forward's rule
    reads as the padded rule reads a batch (the lengths themselves never: they stay on the device);
    None where no rung takes the packed layout (the CPU runs the reference, CUDA refuses the call).
    paged_prefill_attention's q_shape is (total_q, heads, head_dim), max_seqlen_q its argument
    of that name (0: total_q) and block_size the cache's; csrc/serving/serving.h has its rule."""
    half = dtype in (torch.float16, torch.bfloat16)
    if op in ("attention_varlen_forward", "attention_varlen_backward"):
        total_q, h, d = q_shape
        total_k, h_kv, _ = q_shape if k_shape is None else k_shape
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        return torch.ops.flash_attention.varlen_rule(
            op, batch, h, h_kv, max_seqlen_q if max_seqlen_q > 0 else total_q,
            max_seqlen_k if max_seqlen_k > 0 else total_k, d, scale, causal, cuda, half, capability[0], capability[1],
            sms, hopper_built, list(window), softcap, deterministic) or None
    if op == "paged_prefill_attention":
        bound = max_seqlen_q if max_seqlen_q > 0 else q_shape[0]
        d = q_shape[2]
        if scale is None:
            scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
        return torch.ops.flash_attention.paged_prefill_rule(cuda, half, capability[0], capability[1], hopper_built, d,
                                                            block_size, scale, bound)
    b, h, s_q, d = q_shape
    _, h_kv, s_k, _ = q_shape if k_shape is None else k_shape
    if op == "attention_forward":
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        return torch.ops.flash_attention.forward_rule(b, h, h_kv, s_q, s_k, d, scale, causal, cuda, half,
                                                      capability[0], capability[1], sms, hopper_built,
                                                      list(window), softcap)
    if op == "attention_backward":
        return torch.ops.flash_attention.backward_rule(d, cuda, half, capability[0], capability[1], hopper_built,
                                                       causal, list(window), softcap, deterministic)
    raise ValueError(f"dispatch_rule: unknown op {op!r} (attention_forward, attention_backward, "
                     "attention_varlen_forward, attention_varlen_backward or paged_prefill_attention)")


def default_choice(op, q, k=None, *, scale=None, causal=False, window=(-1, -1), softcap=0.0, max_seqlen_q=0,
                   max_seqlen_k=0, batch=1, block_size=16):
    """The rung version=None runs for q (and k: q's shape when not given) on q's device: what the
    benchmark records as a default row's dispatch. The packed ops: batch (the sequence count) and the
    max lengths as passed to attention_varlen (dispatch_rule); paged_prefill_attention: the cache's
    block_size."""
    cuda = q.device.type == "cuda"
    props = torch.cuda.get_device_properties(q.device) if cuda else None
    return dispatch_rule(op, tuple(q.shape), None if k is None else tuple(k.shape), dtype=q.dtype, cuda=cuda,
                         capability=(props.major, props.minor) if cuda else (0, 0),
                         sms=props.multi_processor_count if cuda else 0,
                         hopper_built=cuda and hopper_kernels_built(), scale=scale, causal=causal, window=window,
                         softcap=softcap, deterministic=torch.are_deterministic_algorithms_enabled(),
                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, batch=batch,
                         block_size=block_size)


def _default_scale(q):
    # head_dim 0 and a wrong rank are the op's to reject, with its message, not Python's
    # ZeroDivisionError or IndexError.
    if q.dim() != 4 or q.shape[-1] == 0:
        return 1.0
    return 1.0 / math.sqrt(q.shape[-1])


def attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0, version=None, return_lse=False):
    """softmax(softcap(scale * q k^T) [causal and window masks]) v, differentiable in q, k and v.

    q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads_kv, seqlen_k, head_dim), with
    heads a multiple of heads_kv. scale defaults to 1 / sqrt(head_dim). Returns out, shaped and
    typed like q (contiguous); with return_lse=True also lse, (batch, heads, seqlen_q), the
    natural-log sum of exp(scale * q k^T) over each row's visible keys, in float32 (float64 for
    float64 inputs). lse is not differentiable.

    window=(left, right): local attention, each side a bound >= 0 or -1 (unbounded); softcap > 0:
    scores capped to softcap * tanh(score / softcap). The module docstring has the rule.
    """
    if scale is None:
        scale = _default_scale(q)
    out, lse = torch.ops.flash_attention.attention_forward(q, k, v, scale, causal, version, list(window), softcap)
    return (out, lse) if return_lse else out


def attention_forward(q, k, v, scale, causal=False, *, window=(-1, -1), softcap=0.0, version=None):
    """The forward op alone: (out, lse), as attention(..., return_lse=True) with an explicit
    scale. Differentiable in q, k and v through out."""
    return torch.ops.flash_attention.attention_forward(q, k, v, scale, causal, version, list(window), softcap)


def attention_backward(grad_out, q, k, v, out, lse, scale, causal=False, *, window=(-1, -1), softcap=0.0,
                       version=None):
    """The backward op alone: (dq, dk, dv) from the forward's out and lse (and the forward's window
    and softcap)."""
    return torch.ops.flash_attention.attention_backward(grad_out, q, k, v, out, lse, scale, causal, version,
                                                        list(window), softcap)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
                     window=(-1, -1), softcap=0.0, version=None, return_lse=False):
    """attention() over sequences of different lengths packed along one token dim (FlashAttention
    2's varlen API), differentiable in q, k and v.

    q: (total_q, heads, head_dim); k, v: (total_k, heads_kv, head_dim). Sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q against rows cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k
    and v (cu_seqlens_*: int32, batch + 1 entries from 0 to the total), with its own bottom-right
    causal mask and window; max_seqlen_q and max_seqlen_k bound the lengths (host ints: on CUDA
    they size the grid, and the lengths themselves are read by the kernels, not checked; the CPU
    checks them). Returns out, shaped like q; with return_lse=True also lse, (heads, total_q).
    version: a forward rung that takes the packed layout on CUDA ("tuned", "split_kv", "persistent";
    the backward runs version=None's, "mma_dqpass"); on the CPU any name runs the reference.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.dim() == 3 and q.shape[-1] > 0 else 1.0
    out, lse = torch.ops.flash_attention.attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                  max_seqlen_k, scale, causal, list(window), softcap,
                                                                  version)
    return (out, lse) if return_lse else out


def quantize_fp8(x, *, transpose=False):
    """x (float32, float16 or bfloat16) to torch.float8_e4m3fn with one scale for the whole tensor:
    (x8, descale), x ~ descale * x8.to(float32), descale a 1-element float32 tensor on x's device.
    The scale is 448 / max|x| (448: e4m3's largest finite value), so nothing saturates; x must be
    finite.

    transpose=True takes v, (batch, heads_kv, seqlen, head_dim), and writes V^T, (batch, heads_kv,
    head_dim, seqlen), the layout attention_fp8 reads (8-bit wgmma takes both operands of P V with
    the keys contiguous); its rows of keys are padded to 16 bytes in memory (a view of the first
    seqlen columns). The CPU reference and the CUDA kernels give the same bytes.
    """
    return torch.ops.flash_attention.quantize_fp8(x, transpose)


def attention_fp8(q8, k8, v8t, descale_q, descale_k, descale_v, *, causal=False, scale=None, return_lse=False):
    """softmax(scale * q k^T [causal mask]) v for e4m3 inputs, forward only, out in bfloat16.

    q8: (batch, heads, seqlen_q, head_dim), k8: (batch, heads_kv, seqlen_k, head_dim), v8t: V
    transposed, (batch, heads_kv, head_dim, seqlen_k), all torch.float8_e4m3fn; descale_*: the
    1-element float32 factors (q = descale_q * q8, ...), as quantize_fp8 returns them, >= 0, on
    the inputs' device. scale defaults to 1 / sqrt(head_dim); causal is the bottom-right mask of
    attention(). Defined as the float64 attention of the dequantized inputs (the CPU path computes
    exactly that); on CUDA, a Hopper kernel (compute capability 9.0, head_dim 64 or 128, scale > 0)
    that computes S in float32 from exact e4m3 products and rounds 256 P to e4m3 for P V.
    Returns out, with return_lse=True also lse (float32).
    """
    if scale is None:
        scale = _default_scale(q8)
    out, lse = torch.ops.flash_attention.attention_fp8(q8, k8, v8t, descale_q, descale_k, descale_v, scale, causal)
    return (out, lse) if return_lse else out


def hadamard_rotation(head_dim, *, seed=0, device=None, dtype=torch.float32):
    """R = diag(s) H / sqrt(head_dim): H the Sylvester Hadamard matrix (entries +-1), s random signs
    drawn from `seed`. R is orthogonal (R R^T = I), so (q R)(k R)^T = q k^T: rotating q and k by the
    same R leaves every score as it was. What it changes is how each vector's energy is spread over
    the channels: a channel with outliers (a few channels of q and k often run ten times larger than
    the rest) is mixed into all of them, so a per-tensor e4m3 scale set by max|x| no longer crushes
    the ordinary channels toward e4m3's subnormals ("incoherent processing", QuIP#, FlashAttention 3).
    head_dim must be a power of two (64 and 128, what attention_fp8 takes, are)."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"hadamard_rotation: head_dim must be a power of two, got {head_dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim,), generator=g, dtype=torch.float64) * 2 - 1
    return (signs[:, None] * h / math.sqrt(head_dim)).to(device=device, dtype=dtype)


def rotate_qk(q, k, *, seed=0):
    """(q R, k R) in float32 with R = hadamard_rotation(head_dim, seed=seed): the same scores, spread
    over the channels, ready for quantize_fp8 (v is not rotated: P V needs v as it is)."""
    r = hadamard_rotation(q.shape[-1], seed=seed, device=q.device)
    return q.float() @ r, k.float() @ r


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """A drop-in for torch.nn.functional.scaled_dot_product_attention in the cases this chapter
    computes; any other raises NotImplementedError (a RuntimeError) naming the argument:

    - attn_mask must be None (masks other than causal are not computed here);
    - dropout_p must be 0;
    - is_causal=True needs seqlen_q == seqlen_k: SDPA aligns its causal mask to the top-left
      corner and this chapter to the bottom-right, and the two agree only on square masks;
    - 4-D inputs only, (batch, heads, seqlen, head_dim);
    - fewer kv heads than query heads needs enable_gqa=True, as in SDPA (a RuntimeError).
    """
    if attn_mask is not None:
        raise NotImplementedError("sdpa: attn_mask is not supported; only is_causal=True masking is "
                                  "(use F.scaled_dot_product_attention for arbitrary masks)")
    if dropout_p != 0.0:
        raise NotImplementedError(f"sdpa: dropout_p={dropout_p} is not supported; only dropout_p=0.0 is")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise NotImplementedError(f"sdpa: {name} has shape {tuple(t.shape)}; only 4-D inputs "
                                      "(batch, heads, seqlen, head_dim) are supported")
    if is_causal and query.shape[-2] != key.shape[-2]:
        raise NotImplementedError(
            f"sdpa: is_causal=True with seqlen_q={query.shape[-2]} != seqlen_k={key.shape[-2]} is not "
            "supported: SDPA's causal mask is aligned top-left and this chapter's bottom-right; call "
            "flash_attention.attention(..., causal=True) for the bottom-right mask")
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise RuntimeError(f"sdpa: query has {query.shape[1]} heads but key has {key.shape[1]}; pass "
                           "enable_gqa=True for grouped-query attention")
    return attention(query, key, value, causal=is_causal, scale=scale)
