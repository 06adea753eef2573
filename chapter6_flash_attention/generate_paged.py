"""Chapter 6 end to end, serving half: a small decoder-only model generating text with the chapter's
kernels, next to the same model on F.scaled_dot_product_attention and a contiguous KV cache.

The serving ops pass their tests op by op; this script asks what a server asks: do they generate
the same tokens, and what does the paged cache buy? One model, one set of weights, one list of
requests; two attention backends behind one interface:

- "paged" (the chapter's kernels). A scheduler admits the requests a wave at a time: one batched
  prefix lookup per wave (RadixCache.match_prefix, the GPU kernel on CUDA), a lock on each match
  (RadixCache.lock pins the cached blocks), blocks for the rest from a free list, then a prefill of
  only the uncached suffixes, the wave's requests packed into one batch: their K and V go into the
  pool through reshape_and_cache, and their queries attend to the whole context through
  paged_prefill_attention, which reads the cached prefix from the pool by block id (nothing
  gathered, nothing recomputed) under a causal mask aligned bottom-right (query i of a suffix sees
  the prefix and the suffix keys up to its own position). With --prefill-chunk N the suffixes go
  in chunks of at most N tokens, one batch per round (chunked prefill: each chunk attends to the
  chunks before it through the cache). After the wave's prefill each prompt's whole blocks go
  into the tree (insert); blocks the tree already had, computed twice within one wave, are freed
  and the request points at the tree's. Then all requests decode
  together, one paged_attention call per layer and step over mixed context lengths, each new
  token's K and V written to its slot, a block allocated when a request crosses a block boundary.
- "sdpa" (the reference). Each request's K and V live contiguously in its own row of a
  preallocated (requests, heads_kv, max_len, head_dim) buffer; the prompt runs whole, batch 1,
  through SDPA with is_causal=True and enable_gqa=True; decode is batched with a boolean
  key-padding mask (the lengths differ; a masked key gets weight exactly 0).

- Model (written here): Llama-shaped, random seeded weights: token embedding, RMSNorm, rotary
  position embedding, grouped-query attention (8 query heads over 2 kv heads of 64), SwiGLU MLP,
  a final RMSNorm and an LM head. Initialised so that attention matters (scores of std ~2, an
  attention branch as large as the residual stream: a wrong context changes the tokens) and the
  logits have a std of LOGIT_STD (greedy choices are not near ties; see "Exact match" below).
- Requests: `groups` groups of `per_group`; every prompt starts with `common_blocks` blocks all
  requests share (a system prompt), then `group_blocks` its group shares (few-shot examples),
  then a suffix of its own of random length in [suffix_min, suffix_max] (the last two requests:
  0 tokens, the prompt is the prefix alone, and exactly one block). Requests are interleaved by
  group and admitted `prefill_batch` at a time: the first wave holds the first requests of the
  groups, some group twice (two cold requests computing one prefix: the duplicate path of
  insert), and the later waves find their prefix cached.
- No request ever writes into a shared block. Only whole blocks are shared (RadixCache), a lookup
  is limited to the first len(prompt) - 1 tokens (the last prompt token is always computed: its
  logits pick the first new token), so the prefill writes only at positions past the match, into
  blocks the request owns, and decode writes past the prompt. The scheduler checks every slot
  it writes against the request's own blocks before the write (check_writes): copy-on-write
  (copy_blocks) is never needed by this design, and the check says so at every write.

Exact match. Greedy tokens of the paged run must equal the reference's for every request, and
that is checked in float64 (both backends, CPU or CUDA; every op of the chapter takes it), where
the two differ by rounding only: sums in other orders, ~1e-16 relative, ~1e-14 on logits of std
4. A greedy choice flips only where its top-1 - top-2 margin is smaller than that, and random
weights give no margin a floor: near zero the margins have a density of ~0.9 per logit unit, so
over 64 x 128 = 8192 choices the smallest is ~1e-4, and the expected number of rounding flips is
~8192 x 0.9 x 1e-14 ~ 1e-10 per run. In float32 the same estimate is ~0.04 per run (rounding
~2e-5 on a logit, measured on the CPU at the GPU sizes): rare, but a gate on it would be a coin
that lands wrong once in 25 runs. So the gate is float64, with no allowance: "identical", or
"different" and exit 1. (The comparison still reports the smallest reference margin and the
largest difference of a chosen token's logit, so the run shows how far from a flip it was;
TIE_BOUND remains for a float32 run asked for with --dtypes, where a divergence whose margins are
below it in both runs is reported as a near tie rather than a failure.)
On CUDA a bfloat16 run follows, for throughput; its tokens are compared too, not gated: bf16
keeps 8 mantissa bits (2^-9 ~ 0.2% relative), the two backends round at different points (where
P is rounded for the P V product, the order of the sums, the split-KV merge), so their logits
differ by a few 1e-2 (one bf16 rounding of a logit near 14 is 0.03); a few % of the choices have
a margin that small, so most requests are expected to part somewhere in 128 tokens, and after a
flip the two runs continue from different contexts. The run reports how many tokens agree before
each request's first divergence, and the margins there.

Napkin math, at the GPU sizes (4 layers, dim 512, 8/2 heads x 64, SwiGLU 1408, vocab 4096):
- KV cache per token = 2 (K, V) x layers x heads_kv x head_dim x itemsize = 2 x 4 x 2 x 64 x 4 B
  = 8 KiB in float64 (2 KiB in bf16), 128 KiB (32 KiB) per block of 16 tokens.
- 64 requests with a 256-token prefix (16 blocks: 4 common + 12 per group of 8): without sharing
  64 x 16 = 1024 prefix blocks, with it 4 + 8 x 12 = 100; 924 blocks ~ 29 MiB in bf16 saved.
  The prefill skips 256 tokens for each of the 48 requests admitted after their group's first
  wave (240 for the one whose prompt is the prefix alone): 12272 of ~22k prompt tokens.
- Decode FLOPs per token ~ 2 x parameters = 2 x 13.4M ~ 27 MFLOP (+ 4 x context x 8 x 64 per
  layer of attention): a 64-token step is ~2 GFLOP and reads ~54 MB of weights and ~110 MB of
  bf16 KV cache (64 contexts of ~430 tokens x 2 KiB), ~30 us at 3 TB/s. The ~70 kernel
  launches of a step cost more than that: this model is too small to be memory-bound, so
  tokens/s mostly measure launch overhead (about the same for both backends); the sharing and
  the skipped prefill are the paged cache's gains here.

Timing: CUDA synchronised at the edges of the prefill loop and of the decode loop, after a
warm-up run of a few requests per backend and dtype; wall clock on the CPU. Prefill tokens/s is
prompt tokens served per second (the paged run computes fewer; computed_tokens_per_s says how
many it computed); decode tokens/s counts the tokens the decode steps produce.

    python generate_paged.py            GPU: 64 requests in 8 groups, prefix 256, suffixes
                                        16-200, 128 new tokens; float64 (exact match) then bfloat16
    python generate_paged.py --quick    CPU and CI: 2 layers, dim 64, 4/2 heads x 16, block 8,
                                        6 requests in 2 groups, 8 new tokens, float64 (seconds)
    python generate_paged.py --dtypes float64,float32,bfloat16   any dtypes, the gated one first
    python generate_paged.py --prefill-chunk 64   the suffixes prefilled in chunks of 64 tokens

Writes results/<device-slug>/chapter6_generate.json; --no-save skips it.
"""
import argparse
import contextlib
import dataclasses
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "common")]
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from coursekit import bench, results  # noqa: E402

import flash_attention  # noqa: E402

NAME = "chapter6_generate"
# paged_attention's CUDA kernels are instantiated for these (csrc/serving/serving.h: kPagedHeadDims,
# kPagedBlockSizes); attention's CUDA rungs take both head dims too. The CPU takes any.
CUDA_HEAD_DIMS = (64, 128)
CUDA_BLOCK_SIZES = (16, 32)
LOGIT_STD = 4.0  # the LM head's output std: a few units, as a trained model's logits
# The top-1 - top-2 logit margin below which a divergence counts as a near tie (the module
# docstring): none in float64, the gate; for a float32 run, 50x the largest rounding difference
# of a chosen logit measured (2.1e-5); a wrong context moves logits by O(1).
TIE_BOUND = {"float64": 0.0, "float32": 1e-3}
MATCH_DTYPE = "float64"
ROPE_BASE = 10000.0
RMS_EPS = 1e-5

# The chapter's ops, looked up at every call, so a test can swap a deliberately broken one in.
OPS = {"reshape_and_cache": flash_attention.reshape_and_cache,
       "paged_prefill_attention": flash_attention.paged_prefill_attention,
       "paged_attention": flash_attention.paged_attention}


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    layers: int = 4
    dim: int = 512
    heads: int = 8
    heads_kv: int = 2
    head_dim: int = 64
    hidden: int = 1408         # SwiGLU width: ~8/3 x dim, rounded to a multiple of 64
    vocab: int = 4096
    block_size: int = 16
    groups: int = 8            # prefix groups
    per_group: int = 8         # requests per group
    common_blocks: int = 4     # prompt blocks every request shares
    group_blocks: int = 12     # further prompt blocks each group shares
    suffix_min: int = 16       # each request's own prompt tokens, drawn in [suffix_min, suffix_max]
    suffix_max: int = 200
    new_tokens: int = 128      # generated per request: the first by the prefill, the rest by decode
    prefill_batch: int = 16    # requests admitted per scheduling wave (one prefix lookup each)
    prefill_chunk: int = 0     # suffix tokens per request per prefill round; 0: the whole suffix at once
    warmup_requests: int = 4   # the warm-up run before each timed one: this many requests,
    warmup_tokens: int = 4     # this many new tokens
    seed: int = 0
    device: str = "cuda"
    dtypes: tuple = ("float64", "bfloat16")  # the first is the exact-match run; the others report
    checks: bool = False       # check_tables / check_slots: a device sync per call on CUDA

    @property
    def requests(self):
        return self.groups * self.per_group

    @property
    def prefix_tokens(self):
        return (self.common_blocks + self.group_blocks) * self.block_size


# --quick: two CPU cores, a few seconds. Block size 8 and suffixes 3-13 make partly filled blocks,
# block-aligned prompts and decode crossing block boundaries all happen within 8 new tokens.
QUICK = dict(layers=2, dim=64, heads=4, heads_kv=2, head_dim=16, hidden=176, vocab=256, block_size=8,
             groups=2, per_group=3, common_blocks=1, group_blocks=1, suffix_min=3, suffix_max=13,
             new_tokens=8, prefill_batch=3, warmup_requests=2, warmup_tokens=2)
# --quick on a GPU: the head dim and block size the CUDA kernels take, the rest as small.
QUICK_CUDA = dict(QUICK, dim=128, head_dim=64, hidden=352, block_size=16, suffix_max=29)


def make_config(quick=False, device=None, **overrides):
    """The preset (full or --quick) for the device, with any field overridden (None = keep).
    CUDA runs float64 then bfloat16 with the value checks off (as a server calls the ops); the
    CPU runs float64 (the C++ reference computes float32 and float64) with them on (free there)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    fields = dict(QUICK_CUDA if device == "cuda" else QUICK) if quick else {}
    fields.update(device=device, dtypes=(MATCH_DTYPE, "bfloat16") if device == "cuda" else (MATCH_DTYPE,),
                  checks=device == "cpu")
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return Config(**fields)


def check_config(config):
    """Reject, with a message that says what to change, a config the run would fail on later
    (deep inside an op) or that would not test what it claims."""
    if config.device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {config.device!r}")
    for field in ("layers", "dim", "heads", "heads_kv", "head_dim", "hidden", "block_size", "groups",
                  "per_group", "prefill_batch", "warmup_requests", "warmup_tokens"):
        if getattr(config, field) < 1:
            raise ValueError(f"{field} must be >= 1, got {getattr(config, field)}")
    if config.heads % config.heads_kv:
        raise ValueError(f"heads={config.heads} is not a multiple of heads_kv={config.heads_kv} "
                         "(grouped-query attention: each kv head serves heads / heads_kv query heads)")
    if config.head_dim % 2:
        raise ValueError(f"head_dim={config.head_dim} is odd; rotary embeddings rotate pairs of features")
    if config.vocab < 2:
        raise ValueError(f"vocab must be >= 2, got {config.vocab}")
    if config.common_blocks < 0 or config.group_blocks < 0 or config.common_blocks + config.group_blocks < 1:
        raise ValueError("the shared prefix needs at least one whole block: common_blocks + group_blocks >= 1, "
                         f"got {config.common_blocks} + {config.group_blocks}")
    if not 0 <= config.suffix_min <= config.suffix_max:
        raise ValueError(f"need 0 <= suffix_min <= suffix_max, got {config.suffix_min} and {config.suffix_max}")
    if config.prefill_chunk < 0:
        raise ValueError(f"prefill_chunk must be >= 0 (0: each suffix in one piece), got {config.prefill_chunk}")
    if config.new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (the first comes from the prefill, the rest from decode), "
                         f"got {config.new_tokens}")
    if not config.dtypes or config.dtypes[0] not in TIE_BOUND:
        raise ValueError(f"dtypes must start with {' or '.join(TIE_BOUND)} (the exact-match run), got {config.dtypes}")
    for dtype in config.dtypes:
        if dtype not in ("float64", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {dtype!r} is not one of float64, float32, bfloat16, float16")
        if config.device == "cpu" and dtype not in ("float64", "float32"):
            raise ValueError(f"dtype {dtype} on the CPU: flash_attention's CPU reference computes float32 and "
                             "float64 only; run those there")
    if config.device == "cuda":
        if config.head_dim not in CUDA_HEAD_DIMS:
            raise ValueError(f"head_dim={config.head_dim} is not supported by paged_attention on CUDA; pick one "
                             f"of {CUDA_HEAD_DIMS}")
        if config.block_size not in CUDA_BLOCK_SIZES:
            raise ValueError(f"block_size={config.block_size} is not supported by paged_attention on CUDA; pick "
                             f"one of {CUDA_BLOCK_SIZES}")
        # Last, so that a CPU machine checks (and tests) every rule above for a CUDA config too.
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA GPU is visible; run with --device cpu")


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Request:
    rid: int
    group: int
    prompt: list  # token ids


def make_requests(config):
    """Request i is in group i % groups (interleaved, so each wave mixes groups). Its prompt:
    the common blocks, its group's blocks, then its own suffix. All token ids from one seeded
    generator: the same requests on every machine."""
    g = torch.Generator().manual_seed(config.seed)
    bs = config.block_size

    def draw(n):
        return torch.randint(config.vocab, (n,), generator=g).tolist()

    common = draw(config.common_blocks * bs)
    group_parts = [draw(config.group_blocks * bs) for _ in range(config.groups)]
    lengths = torch.randint(config.suffix_min, config.suffix_max + 1, (config.requests,), generator=g).tolist()
    # Two edge cases at the end, where their group's prefix is cached by then: a prompt that is
    # the shared prefix alone (fully cached and block-aligned: the lookup must stop one token
    # short), and a suffix of exactly one block (a block-aligned prompt whose last block is new).
    if config.requests >= 2 * config.groups:
        lengths[-1], lengths[-2] = 0, bs
    return [Request(i, i % config.groups, common + group_parts[i % config.groups] + draw(lengths[i]))
            for i in range(config.requests)]


def blocks_for(tokens, block_size):
    return -(-tokens // block_size)


def kv_tokens(request, config):
    """Tokens a request has in the cache at the end: its prompt and every new token but the last
    (which is produced, never fed back)."""
    return len(request.prompt) + config.new_tokens - 1


def blocks_without_sharing(requests, config):
    """Blocks a cache without sharing holds at the end: each request its own."""
    return sum(blocks_for(kv_tokens(r, config), config.block_size) for r in requests)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
def wide(x):
    """x in float32 if it is a 16-bit type, else as it is: the norms and the rotation compute in
    at least float32, and in float64 for the float64 run (a float32 step there would round both
    backends' nearly equal values apart by float32's 6e-8, not float64's 1e-16)."""
    return x.float() if x.element_size() < 4 else x


def rms_norm(x, weight):
    xf = wide(x)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)).to(x.dtype) * weight


def rotate(x, cos, sin):
    """Rotary embedding of x (tokens, heads, head_dim) at the positions cos and sin (tokens,
    head_dim / 2) were taken at: feature pairs (i, i + head_dim / 2) turned by position x
    frequency (the "rotate half" layout), computed in at least float32 (wide)."""
    x1, x2 = wide(x).chunk(2, dim=-1)
    cos, sin = cos[:, None].to(x1.dtype), sin[:, None].to(x1.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Decoder:
    """A Llama-shaped decoder, inference only, its weights plain tensors.

    forward(tokens, positions, attend) runs the tokens (n,) at positions (n,) and calls
    attend(layer, q, k, v) for the attention of every layer: q (n, heads, head_dim), k and v
    (n, heads_kv, head_dim), rotary embedding applied; it returns (n, heads, head_dim). That
    callback is the one place the two backends differ: which cache the new k and v go to and
    which keys the queries see are the caller's."""

    def __init__(self, config, device, dtype):
        self.config = config
        c, g = config, torch.Generator().manual_seed(config.seed + 1)

        def normal(*shape, std):
            # Drawn in float32 on the CPU from one generator, then moved: the same weights on
            # any device and, up to the cast, in any dtype.
            return (torch.randn(*shape, generator=g) * std).to(device=device, dtype=dtype)

        qkv_out = (c.heads + 2 * c.heads_kv) * c.head_dim
        self.embed = normal(c.vocab, c.dim, std=1.0)
        self.layers = []
        for _ in range(c.layers):
            wqkv = torch.randn(qkv_out, c.dim, generator=g) / math.sqrt(c.dim)
            # q and k scaled so that q.k / sqrt(head_dim) has std ~2: each query picks a few keys
            # (diffuse attention would average every value away and make the context not matter).
            wqkv[:(c.heads + c.heads_kv) * c.head_dim] *= 2 ** 0.5
            self.layers.append(dict(
                attn_norm=torch.ones(c.dim, device=device, dtype=dtype),
                wqkv=wqkv.to(device=device, dtype=dtype),
                # The attention branch as large as the residual stream it adds to (a few keys'
                # values of std 1 each, averaged): what attends where moves the next token.
                wo=normal(c.dim, c.heads * c.head_dim, std=2.0 / math.sqrt(c.heads * c.head_dim)),
                mlp_norm=torch.ones(c.dim, device=device, dtype=dtype),
                w_gate_up=normal(2 * c.hidden, c.dim, std=1.0 / math.sqrt(c.dim)),
                w_down=normal(c.dim, c.hidden, std=1.0 / math.sqrt(c.hidden)),
            ))
        self.final_norm = torch.ones(c.dim, device=device, dtype=dtype)
        # After the final RMSNorm the features have RMS 1, so logits have std LOGIT_STD.
        self.lm_head = normal(c.vocab, c.dim, std=LOGIT_STD / math.sqrt(c.dim))
        # cos and sin of position x frequency for every position a run can reach (float64 angles).
        # (make_requests may stretch one suffix to a whole block beyond suffix_max.)
        max_pos = c.prefix_tokens + max(c.suffix_max, c.block_size) + c.new_tokens
        freqs = ROPE_BASE ** (-torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * freqs
        self.cos = angles.cos().to(device)
        self.sin = angles.sin().to(device)

    def forward(self, tokens, positions, attend, last_only=False, rows=None):
        """Logits (n, vocab), or (1, vocab) of the last token with last_only, or of the tokens
        `rows` indexes (a prefill needs no more: the last prompt token of each request)."""
        c = self.config
        n = tokens.shape[0]
        cos, sin = self.cos[positions], self.sin[positions]
        x = self.embed[tokens]
        for index, layer in enumerate(self.layers):
            qkv = F.linear(rms_norm(x, layer["attn_norm"]), layer["wqkv"])
            q, k, v = qkv.split([c.heads * c.head_dim, c.heads_kv * c.head_dim, c.heads_kv * c.head_dim], dim=-1)
            q = rotate(q.view(n, c.heads, c.head_dim), cos, sin)
            k = rotate(k.view(n, c.heads_kv, c.head_dim), cos, sin)
            v = v.view(n, c.heads_kv, c.head_dim)  # a strided view of qkv; its last dim is contiguous
            out = attend(index, q, k, v)
            x = x + F.linear(out.reshape(n, c.heads * c.head_dim), layer["wo"])
            gate, up = F.linear(rms_norm(x, layer["mlp_norm"]), layer["w_gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["w_down"])
        if last_only:
            x = x[-1:]
        elif rows is not None:
            x = x[rows]
        return F.linear(rms_norm(x, self.final_norm), self.lm_head)


class Choices:
    """The greedy choices of a run, kept on the device until the end (no sync per step): the
    token, its logit, and its margin over the runner-up."""

    def __init__(self):
        self.tokens, self.top, self.margin = [], [], []

    def add(self, logits):
        top2 = logits.double().topk(2, dim=-1).values  # exact for every dtype: float32 would round float64's
        token = logits.argmax(dim=-1)
        self.tokens.append(token)
        self.top.append(top2[:, 0])
        self.margin.append(top2[:, 0] - top2[:, 1])
        return token

    def stacked(self, columns=False):
        """(requests, new_tokens) host tensors. Prefill adds one row per request (columns=False
        joins those), decode one column per step."""
        join = (lambda xs: torch.cat(xs)[:, None]) if not columns else (lambda xs: torch.stack(xs, dim=1))
        return {name: join(getattr(self, name)).cpu() for name in ("tokens", "top", "margin")}


def to_device(values, dtype, device):
    """A host list (or tensor) as a tensor on `device`. On CUDA through pinned memory and
    non_blocking: the copy is queued behind the kernels already launched instead of waiting for
    them (a copy from pageable memory may sync), so the host runs ahead building the next step."""
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


@contextlib.contextmanager
def exact_float32():
    """float32 matmuls in float32, not TF32 (10 mantissa bits would be rounding ~1e-3), for a
    float32 run: "highest" for the duration, the caller's setting after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# ---------------------------------------------------------------------------------------------
# The paged backend: a block allocator, the radix tree, the scheduler
# ---------------------------------------------------------------------------------------------
class BlockAllocator:
    """A free list of block ids over one pool (every layer's pool has the same blocks: a block id
    names the same rows in all of them). Freeing a free block is an error (a double free would
    hand one block to two owners)."""

    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first
        self.is_free = [True] * num_blocks
        self.peak_used = 0

    @property
    def used(self):
        return self.num_blocks - len(self.free)

    def allocate(self, n):
        if n > len(self.free):
            raise MemoryError(f"block pool exhausted: {n} blocks wanted, {len(self.free)} of {self.num_blocks} free")
        ids = [self.free.pop() for _ in range(n)]
        for i in ids:
            self.is_free[i] = False
        self.peak_used = max(self.peak_used, self.used)
        return ids

    def release(self, ids):
        for i in ids:
            if self.is_free[i]:
                raise RuntimeError(f"block {i} freed twice")
            self.is_free[i] = True
            self.free.append(i)


class PagedKV:
    """One K and one V pool per layer, (num_blocks, block_size, heads_kv, head_dim), contiguous.
    Filled with NaN: a slot read before it is written poisons the output (and the tokens)."""

    def __init__(self, config, num_blocks, device, dtype):
        shape = (num_blocks, config.block_size, config.heads_kv, config.head_dim)
        self.key = [torch.full(shape, float("nan"), device=device, dtype=dtype) for _ in range(config.layers)]
        self.value = [torch.full(shape, float("nan"), device=device, dtype=dtype) for _ in range(config.layers)]


@dataclasses.dataclass
class Sequence:
    request: Request
    table: list = dataclasses.field(default_factory=list)    # block ids, in token order
    private: set = dataclasses.field(default_factory=set)    # the blocks only this request holds
    lock: object = None                                      # its PrefixLock on the tree
    cached: int = 0                                          # prompt tokens the lookup found

    @property
    def prompt(self):
        return self.request.prompt


def check_writes(seq, positions, block_size):
    """The slots of `positions` in seq's table, each checked to lie in a block seq owns alone: a
    write into a block the tree (and so other requests) holds would change their context. The
    design never does it (the module docstring says why); this makes sure, on the host, where
    the check costs no sync."""
    slots = []
    for p in positions:
        block = seq.table[p // block_size]
        if block not in seq.private:
            raise RuntimeError(f"request {seq.request.rid} would write position {p} into block {block}, which "
                               "it shares: copy-on-write (copy_blocks) would be needed first")
        slots.append(block * block_size + p % block_size)
    return slots


def tree_blocks(radix):
    """Every block id the radix tree holds (its flat mirror's block list)."""
    return radix.flat_tree("cpu")[4].tolist()


def audit(seqs, allocator, radix):
    """The ownership invariants, checked while every request is alive: each block is free, held
    by the tree, or private to one request, never two of these; a private block is in its
    owner's table only; every table entry is the owner's or the tree's. Returns counts; raises
    on a violation."""
    tree = tree_blocks(radix)
    tree_set = set(tree)
    if len(tree_set) != len(tree):
        raise RuntimeError("the radix tree holds a block twice")
    free = set(allocator.free)
    owner = {}
    for s in seqs:
        for b in s.private:
            if b in owner:
                raise RuntimeError(f"block {b} is private to requests {owner[b]} and {s.request.rid}")
            owner[b] = s.request.rid
    if owner.keys() & tree_set:
        raise RuntimeError(f"blocks {sorted(owner.keys() & tree_set)} are both private and the tree's")
    if free & (owner.keys() | tree_set):
        raise RuntimeError(f"blocks {sorted(free & (owner.keys() | tree_set))} are free and in use")
    if len(free) + len(owner) + len(tree_set) != allocator.num_blocks:
        raise RuntimeError(f"{allocator.num_blocks - len(free) - len(owner) - len(tree_set)} blocks are "
                           "neither free nor held (a leak)")
    references = {}
    for s in seqs:
        for b in s.table:
            if b not in s.private and b not in tree_set:
                raise RuntimeError(f"request {s.request.rid}'s table names block {b}, neither its own nor the tree's")
            references[b] = references.get(b, 0) + 1
    twice = [b for b, n in references.items() if n > 1 and b not in tree_set]
    if twice:
        raise RuntimeError(f"private blocks {twice} appear in more than one table")
    return {"free": len(free), "private": len(owner), "tree": len(tree_set),
            "shared": sum(1 for b in tree_set if references.get(b, 0) > 1)}


def run_paged(model, requests, config, dtype):
    """Generate config.new_tokens greedy tokens for every request on the chapter's kernels.
    Returns the choices, the timings and the cache's bookkeeping."""
    c, device, bs = config, config.device, config.block_size
    pool_blocks = blocks_without_sharing(requests, c)  # enough even if nothing were shared
    kv = PagedKV(c, pool_blocks, device, dtype)
    allocator = BlockAllocator(pool_blocks)
    radix = flash_attention.RadixCache(bs)
    seqs = [Sequence(r) for r in requests]
    first, prefill_clock = Choices(), bench.Stopwatch(device)
    duplicates = 0

    def prefill(wave):
        """The wave's uncached suffixes, packed into one batch per round: all of each suffix in
        one round, or at most c.prefill_chunk tokens of each per round (chunked prefill). Each
        round writes its tokens' K and V, then attends over the cache: cached prefix, earlier
        chunks and the chunk itself."""
        for s in wave:
            new = allocator.allocate(blocks_for(len(s.prompt), bs) - len(s.table))
            s.table += new
            s.private.update(new)
        done = {s.request.rid: s.cached for s in wave}
        final = {}
        width = max(len(s.table) for s in wave)
        while True:
            part = [s for s in wave if done[s.request.rid] < len(s.prompt)]
            if not part:
                break
            spans = []
            for s in part:
                start = done[s.request.rid]
                end = len(s.prompt) if c.prefill_chunk == 0 else min(len(s.prompt), start + c.prefill_chunk)
                spans.append((start, end))
            positions = [p for start, end in spans for p in range(start, end)]
            slots = to_device([slot for s, (start, end) in zip(part, spans)
                               for slot in check_writes(s, range(start, end), bs)], torch.int64, device)
            offsets = [0]
            for start, end in spans:
                offsets.append(offsets[-1] + end - start)
            tables = to_device([s.table + [-1] * (width - len(s.table)) for s in part], torch.int32, device)
            cu_seqlens_q = to_device(offsets, torch.int32, device)
            context_lens = to_device([end for _, end in spans], torch.int32, device)
            longest = max(end - start for start, end in spans)

            def attend(layer, q, k, v):
                OPS["reshape_and_cache"](k, v, kv.key[layer], kv.value[layer], slots, check_slots=c.checks)
                # Chunk i of a suffix (positions start..end-1) sees positions 0..its own, read from
                # the pool through the table: the causal mask is aligned bottom-right.
                return OPS["paged_prefill_attention"](q, kv.key[layer], kv.value[layer], tables, cu_seqlens_q,
                                                      context_lens, max_seqlen_q=longest, check_tables=c.checks)

            tokens = to_device([t for s, (start, end) in zip(part, spans) for t in s.prompt[start:end]], torch.int64,
                               device)
            # Logits only of the requests whose prompt ends in this round: its last token's row.
            ending = [i for i, (s, (_, end)) in enumerate(zip(part, spans)) if end == len(s.prompt)]
            rows = to_device([offsets[i + 1] - 1 for i in ending], torch.int64, device)
            logits = model.forward(tokens, to_device(positions, torch.int64, device), attend, rows=rows)
            for j, i in enumerate(ending):
                final[part[i].request.rid] = logits[j:j + 1]
            for s, (_, end) in zip(part, spans):
                done[s.request.rid] = end
        first.add(torch.cat([final[s.request.rid] for s in wave]))  # in request order

    def insert(s):
        """The prompt's whole blocks into the tree; the request then reads the tree's copies."""
        nonlocal duplicates
        whole = len(s.prompt) // bs
        if whole == 0:
            return
        had = radix.insert(s.prompt[:whole * bs], s.table[:whole])
        if had < s.cached // bs:
            raise RuntimeError(f"insert found {had} cached blocks, fewer than the {s.cached // bs} locked")
        lock = radix.lock(s.prompt[:whole * bs])
        if lock.num_tokens != whole * bs:
            raise RuntimeError(f"the tree holds {lock.num_tokens} of the {whole * bs} tokens just inserted")
        radix.unlock(s.lock)
        # Blocks the tree had already are our duplicates (a request of the same wave computed
        # them first): freed, the table points at the tree's. The rest the tree adopted.
        freed = [mine for mine, tree in zip(s.table[:whole], lock.block_ids) if mine != tree]
        duplicates += len(freed)
        s.private.difference_update(s.table[:whole])
        allocator.release(freed)
        s.table[:whole] = lock.block_ids
        s.lock = lock

    prefill_clock.start()
    for start in range(0, len(seqs), c.prefill_batch):
        wave = seqs[start:start + c.prefill_batch]
        prompts = [s.prompt for s in wave]
        # One lookup for the wave (the GPU kernel on CUDA), at most len - 1 tokens each: the last
        # prompt token is always computed, its logits give the first new token. One copy back.
        matched_tokens, matched_blocks = radix.match_prefix(prompts, [len(p) - 1 for p in prompts], device=device)
        matched_tokens, matched_blocks = matched_tokens.tolist(), matched_blocks.tolist()
        for s, m, ids in zip(wave, matched_tokens, matched_blocks):
            # Pin what the lookup found; the host tree must agree with the device's lookup.
            s.lock = radix.lock(s.prompt[:len(s.prompt) - 1])
            if s.lock.num_tokens != m or s.lock.block_ids != ids[:m // bs]:
                raise RuntimeError(f"request {s.request.rid}: match_prefix found {m} tokens in blocks "
                                   f"{ids[:m // bs]}, lock {s.lock.num_tokens} in {s.lock.block_ids}")
            s.cached = m
            s.table = list(s.lock.block_ids)
        prefill(wave)
        for s in wave:
            insert(s)
    prefill_clock.stop()

    # Decode: every request one token a step, its K/V written at position lengths[b].
    steps = c.new_tokens - 1
    lengths = [len(s.prompt) for s in seqs]
    max_blocks = max(blocks_for(kv_tokens(s.request, c), bs) for s in seqs)
    tables_host = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    for b, s in enumerate(seqs):
        tables_host[b, :len(s.table)] = torch.tensor(s.table, dtype=torch.int32)
    tables = to_device(tables_host, torch.int32, device)  # on the CPU tables_host itself
    tokens = torch.cat(first.tokens)
    later, decode_clock = Choices(), bench.Stopwatch(device)
    decode_clock.start()
    for _ in range(steps):
        grown = False
        slots = []
        for b, s in enumerate(seqs):
            p = lengths[b]
            if p == len(s.table) * bs:  # crossing into a new block
                [block] = allocator.allocate(1)
                s.table.append(block)
                s.private.add(block)
                tables_host[b, len(s.table) - 1] = block
                grown = True
            slots += check_writes(s, [p], bs)
        if grown:
            tables = to_device(tables_host, torch.int32, device)
        slot_mapping = to_device(slots, torch.int64, device)
        positions = to_device(lengths, torch.int64, device)
        context_lens = to_device([n + 1 for n in lengths], torch.int32, device)

        def attend(layer, q, k, v):
            OPS["reshape_and_cache"](k, v, kv.key[layer], kv.value[layer], slot_mapping, check_slots=c.checks)
            return OPS["paged_attention"](q, kv.key[layer], kv.value[layer], tables, context_lens,
                                          check_tables=c.checks)

        tokens = later.add(model.forward(tokens, positions, attend))
        lengths = [n + 1 for n in lengths]
    decode_clock.stop()

    state = audit(seqs, allocator, radix)
    # The end of every request: its lock released, its own blocks freed; then the tree evicted
    # whole. Every block must be back on the free list.
    for s in seqs:
        radix.unlock(s.lock)
        allocator.release(sorted(s.private))
    allocator.release(radix.evict(radix.num_blocks))
    choices = first.stacked()
    if steps:
        more = later.stacked(columns=True)
        choices = {k: torch.cat([choices[k], more[k]], dim=1) for k in choices}
    prompt_tokens = sum(len(r.prompt) for r in requests)
    skipped = sum(s.cached for s in seqs)
    return {"backend": "paged", "dtype": dtype_name(dtype), "choices": choices,
            "prefill_s": prefill_clock.seconds, "decode_s": decode_clock.seconds, "decode_steps": steps,
            "prompt_tokens": prompt_tokens, "computed_tokens": prompt_tokens - skipped,
            "cache": {"pool_blocks": pool_blocks, "blocks_with_sharing": allocator.peak_used,
                      "blocks_without_sharing": blocks_without_sharing(requests, c),
                      "prefix_tokens_skipped": skipped, "cached_per_request": [s.cached for s in seqs],
                      "duplicate_blocks_freed": duplicates, "at_end": state,
                      "free_after": len(allocator.free), "tree_blocks_after": radix.num_blocks}}


# ---------------------------------------------------------------------------------------------
# The reference: SDPA over a contiguous cache
# ---------------------------------------------------------------------------------------------
def run_sdpa(model, requests, config, dtype):
    """The same generation with F.scaled_dot_product_attention: each request's K and V in its own
    contiguous row of a (requests, heads_kv, max_len, head_dim) buffer per layer, no sharing,
    every prompt computed whole."""
    c, device = config, config.device
    batch = len(requests)
    max_len = max(kv_tokens(r, c) for r in requests)
    shape = (batch, c.heads_kv, max_len, c.head_dim)
    # Zeros, not NaN: a masked key gets weight 0, but 0 x NaN would still be NaN.
    keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.layers)]
    values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.layers)]
    first, prefill_clock = Choices(), bench.Stopwatch(device)

    prefill_clock.start()
    for b, r in enumerate(requests):
        n = len(r.prompt)

        def attend(layer, q, k, v):
            keys[layer][b, :, :n] = k.transpose(0, 1)
            values[layer][b, :, :n] = v.transpose(0, 1)
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[layer][b:b + 1, :, :n],
                                                 values[layer][b:b + 1, :, :n], is_causal=True, enable_gqa=True)
            return out[0].transpose(0, 1)

        tokens = to_device(r.prompt, torch.int64, device)
        first.add(model.forward(tokens, torch.arange(n, device=device), attend, last_only=True))
    prefill_clock.stop()

    steps = c.new_tokens - 1
    lengths = [len(r.prompt) for r in requests]
    rows = torch.arange(batch, device=device)
    tokens = torch.cat(first.tokens)
    later, decode_clock = Choices(), bench.Stopwatch(device)
    decode_clock.start()
    for _ in range(steps):
        width = max(lengths) + 1
        positions = to_device(lengths, torch.int64, device)
        # True where request b has key j: its first lengths[b] + 1 positions, the new one included.
        mask = (torch.arange(width, device=device)[None] <= positions[:, None])[:, None, None]

        def attend(layer, q, k, v):
            keys[layer][rows, :, positions] = k
            values[layer][rows, :, positions] = v
            out = F.scaled_dot_product_attention(q[:, :, None], keys[layer][:, :, :width],
                                                 values[layer][:, :, :width], attn_mask=mask, enable_gqa=True)
            return out[:, :, 0]

        tokens = later.add(model.forward(tokens, positions, attend))
        lengths = [n + 1 for n in lengths]
    decode_clock.stop()
    choices = first.stacked()
    if steps:
        more = later.stacked(columns=True)
        choices = {k: torch.cat([choices[k], more[k]], dim=1) for k in choices}
    prompt_tokens = sum(len(r.prompt) for r in requests)
    return {"backend": "sdpa", "dtype": dtype_name(dtype), "choices": choices, "prefill_s": prefill_clock.seconds,
            "decode_s": decode_clock.seconds, "decode_steps": steps, "prompt_tokens": prompt_tokens,
            "computed_tokens": prompt_tokens}


RUNNERS = {"paged": run_paged, "sdpa": run_sdpa}


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# Comparison, the whole run
# ---------------------------------------------------------------------------------------------
def compare(run, reference, tie_bound=None):
    """Token by token, per request: where the run first leaves the reference (its tokens after
    that follow another context and are not compared), how many tokens agree before, and, over
    the choices both made from the same context, the smallest reference margin and the largest
    difference of the chosen token's logit.

    With a tie_bound (the gated dtype), the verdict: "identical"; "identical but for near ties"
    when every divergence is a choice whose top-1 - top-2 margin was below tie_bound in both runs
    (rounding decided it, not the model); else "different". passed is False only for
    "different". Without one (bf16) the verdict is reported and passed is None."""
    a, b = run["choices"], reference["choices"]
    requests, new = b["tokens"].shape
    diverged_at = []
    for r in range(requests):
        differ = (a["tokens"][r] != b["tokens"][r]).nonzero()
        diverged_at.append(int(differ[0]) if len(differ) else new)
    # Choice t of request r was made from the same context in both runs iff t <= diverged_at[r].
    same_context = torch.arange(new)[None] <= torch.tensor(diverged_at)[:, None]
    diverged = [{"request": r, "at_token": t, "reference_margin": float(b["margin"][r, t]),
                 "run_margin": float(a["margin"][r, t])} for r, t in enumerate(diverged_at) if t < new]
    top_diff = (a["top"] - b["top"]).abs()[same_context]
    out = {"match": not diverged, "requests": requests, "tokens": requests * new,
           "identical_requests": requests - len(diverged), "agreeing_tokens": sum(diverged_at), "diverged": diverged,
           "min_reference_margin": float(b["margin"][same_context].min()),
           "max_top_logit_diff": float(top_diff.max()) if top_diff.numel() else 0.0, "tie_bound": tie_bound}
    if tie_bound is None:
        out["verdict"], out["passed"] = ("identical" if not diverged else "different (not gated)"), None
        return out
    ties = [d for d in diverged if max(d["reference_margin"], d["run_margin"]) < tie_bound]
    out["near_ties"] = int((b["margin"][same_context] < tie_bound).sum())  # choices the rule could excuse
    out["verdict"] = ("identical" if not diverged else
                      "identical but for near ties" if len(ties) == len(diverged) else "different")
    out["passed"] = out["verdict"] != "different"
    return out


def warm_up(model, requests, config, dtype):
    """A short run of each backend (first calls load kernels and pick cuBLAS algorithms)."""
    short = dataclasses.replace(config, new_tokens=config.warmup_tokens)
    for runner in RUNNERS.values():
        runner(model, requests[:config.warmup_requests], short, dtype)


def generate_all(config, backends=("paged", "sdpa"), warmup=True):
    """Every dtype of the config, each backend from the same weights (timed after a warm-up), and
    the paged run compared with the reference: ({dtype: {backend: run}}, {dtype: comparison})."""
    check_config(config)
    requests = make_requests(config)
    runs, comparisons = {}, {}
    with torch.inference_mode(), exact_float32():
        for name in config.dtypes:
            dtype = getattr(torch, name)
            model = Decoder(config, config.device, dtype)
            if warmup:
                warm_up(model, requests, config, dtype)
            runs[name] = {b: RUNNERS[b](model, requests, config, dtype) for b in backends}
            if "paged" in backends and "sdpa" in backends:
                gate = TIE_BOUND[name] if name == config.dtypes[0] else None  # the first dtype only
                comparisons[name] = compare(runs[name]["paged"], runs[name]["sdpa"], gate)
    return runs, comparisons


def kv_bytes_per_block(config, dtype):
    """K and V of one block in every layer: block_size x heads_kv x head_dim x 2 x itemsize x layers."""
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return config.block_size * config.heads_kv * config.head_dim * 2 * itemsize * config.layers


def sharing_summary(config, runs):
    cache = runs[config.dtypes[0]]["paged"]["cache"]
    saved = cache["blocks_without_sharing"] - cache["blocks_with_sharing"]
    return {"blocks_with_sharing": cache["blocks_with_sharing"],
            "blocks_without_sharing": cache["blocks_without_sharing"],
            "blocks_saved": saved, "bytes_saved": {d: saved * kv_bytes_per_block(config, d) for d in config.dtypes},
            "bytes_per_block": {d: kv_bytes_per_block(config, d) for d in config.dtypes},
            "prefix_tokens_skipped": cache["prefix_tokens_skipped"],
            "prompt_tokens": runs[config.dtypes[0]]["paged"]["prompt_tokens"],
            "duplicate_blocks_freed": cache["duplicate_blocks_freed"], "blocks_at_end": cache["at_end"],
            "leaked_blocks": cache["pool_blocks"] - cache["free_after"]}


# ---------------------------------------------------------------------------------------------
# Results: rows, record, table
# ---------------------------------------------------------------------------------------------
def result_rows(runs, config):
    """Two rows per dtype and backend (CONTRIBUTING.md, section 5): prefill and decode. Variant
    "default" is the chapter's ops at version=None, "sdpa" PyTorch's; speedup_vs_torch is
    tokens/s over SDPA's in the same dtype."""
    rows = []
    for dtype, by_backend in runs.items():
        for backend, variant in (("paged", "default"), ("sdpa", "sdpa")):
            if backend not in by_backend:
                continue
            run, ref = by_backend[backend], by_backend.get("sdpa")
            common = {"variant": variant, "backend": backend, "dtype": dtype, "requests": config.requests,
                      "layers": config.layers, "dim": config.dim, "heads": config.heads, "heads_kv": config.heads_kv,
                      "head_dim": config.head_dim, "block_size": config.block_size, "vocab": config.vocab,
                      "prefill_chunk": config.prefill_chunk}
            prefill_rate = run["prompt_tokens"] / run["prefill_s"]
            decode_tokens = config.requests * run["decode_steps"]
            decode_rate = decode_tokens / run["decode_s"]
            rows.append({"op": "generate_prefill", **common, "shape": [config.requests, run["prompt_tokens"]],
                         "prompt_tokens": run["prompt_tokens"], "computed_tokens": run["computed_tokens"],
                         "seconds": run["prefill_s"], "tokens_per_s": prefill_rate,
                         "computed_tokens_per_s": run["computed_tokens"] / run["prefill_s"],
                         "speedup_vs_torch": prefill_rate * ref["prefill_s"] / ref["prompt_tokens"] if ref else None})
            rows.append({"op": "generate_decode", **common, "shape": [config.requests, config.new_tokens],
                         "new_tokens": config.new_tokens, "decode_steps": run["decode_steps"],
                         "tokens": decode_tokens,
                         "seconds": run["decode_s"], "tokens_per_s": decode_rate,
                         "ms_per_step": 1e3 * run["decode_s"] / run["decode_steps"],
                         "speedup_vs_torch": decode_rate * ref["decode_s"] / decode_tokens if ref else None})
    return rows


def make_record_extra(config, runs, comparisons, wall_s):
    return {"config": dataclasses.asdict(config), "sharing": sharing_summary(config, runs),
            "comparison": comparisons, "match_dtype": config.dtypes[0],
            "tokens_sample": {d: runs[d]["paged"]["choices"]["tokens"][:2].tolist() for d in runs},
            "extension": flash_attention.EXTENSION,
            "timing": {"method": "perf_counter around the prefill loop and the decode loop, after a warm-up run of "
                                 f"{config.warmup_requests} requests x {config.warmup_tokens} tokens per backend"
                                 + (", torch.cuda.synchronize at each edge" if config.device == "cuda" else "")},
            "wall_s": wall_s}


def mib(nbytes):
    return nbytes / 2**20


def speedup(row):
    return "-" if row["speedup_vs_torch"] is None else f"{row['speedup_vs_torch']:.2f}"


def print_table(record):
    cfg, share = record["config"], record["sharing"]
    prefix = (cfg["common_blocks"] + cfg["group_blocks"]) * cfg["block_size"]
    print(f"\n{NAME} on {results.label(record)}: {cfg['groups'] * cfg['per_group']} requests in {cfg['groups']} "
          f"groups, shared prefix {prefix} tokens, suffixes {cfg['suffix_min']}-{cfg['suffix_max']}, "
          f"{cfg['new_tokens']} new tokens; {cfg['layers']} layers, dim {cfg['dim']}, "
          f"{cfg['heads']}/{cfg['heads_kv']} "
          f"heads x {cfg['head_dim']}, vocab {cfg['vocab']}, block {cfg['block_size']}"
          + (f", prefill in chunks of {cfg['prefill_chunk']}" if cfg.get("prefill_chunk") else ""))
    print(f"{'dtype':<10}{'backend':<8}{'prefill tok/s':>15}{'x sdpa':>8}{'computed tok/s':>16}"
          f"{'decode tok/s':>14}{'x sdpa':>8}{'ms/step':>9}")
    rows = {(r["dtype"], r["backend"], r["op"]): r for r in record["benchmarks"]}
    for dtype in cfg["dtypes"]:
        for backend in ("paged", "sdpa"):
            pre, dec = rows.get((dtype, backend, "generate_prefill")), rows.get((dtype, backend, "generate_decode"))
            if pre is None:
                continue
            print(f"{dtype:<10}{backend:<8}{pre['tokens_per_s']:>15,.0f}{speedup(pre):>8}"
                  f"{pre['computed_tokens_per_s']:>16,.0f}{dec['tokens_per_s']:>14,.0f}{speedup(dec):>8}"
                  f"{dec['ms_per_step']:>9.2f}")
    saved = ", ".join(f"{mib(share['bytes_saved'][d]):.2f} MiB in {d}" for d in cfg["dtypes"])
    print(f"sharing: {share['blocks_with_sharing']} blocks with it, {share['blocks_without_sharing']} without: "
          f"{share['blocks_saved']} saved ({saved}); the prefill skipped {share['prefix_tokens_skipped']} of "
          f"{share['prompt_tokens']} prompt tokens; {share['duplicate_blocks_freed']} duplicate blocks freed; "
          f"{share['leaked_blocks']} leaked")
    for dtype, cmp in record["comparison"].items():
        line = (f"{dtype}: {cmp['identical_requests']}/{cmp['requests']} requests identical, "
                f"{cmp['agreeing_tokens']}/{cmp['tokens']} tokens agree before a divergence; smallest greedy "
                f"margin {cmp['min_reference_margin']:.3g}, largest chosen-logit difference "
                f"{cmp['max_top_logit_diff']:.2g}")
        if cmp["diverged"]:
            margins = sorted(max(d["reference_margin"], d["run_margin"]) for d in cmp["diverged"])
            line += f"; margins where they diverged {margins[0]:.2g} to {margins[-1]:.2g}"
        gate = ""
        if cmp["passed"] is not None:
            rule = "no allowance" if cmp["tie_bound"] == 0 else f"tie bound {cmp['tie_bound']:g}"
            gate = f" ({rule}): {'PASS' if cmp['passed'] else 'FAIL'}"
        print(f"{line}: {cmp['verdict'].upper()}{gate}")


def save(config, runs, comparisons, wall_s, write=True):
    """The results file through coursekit (results/<device-slug>/), then the table. A failure to
    write is reported, not raised: the comparison, and the exit status, stand anyway."""
    rows, extra = result_rows(runs, config), make_record_extra(config, runs, comparisons, wall_s)
    return results.publish_or_print(NAME, rows, extra, lambda record, out_dir: [], print_table, write)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, 6 requests, 8 new tokens (CPU, CI, smoke runs)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when a GPU is visible")
    for field in ("groups", "per_group", "new_tokens", "layers", "seed", "prefill_batch", "prefill_chunk"):
        p.add_argument(f"--{field.replace('_', '-')}", type=int, help=f"override the preset's {field}")
    p.add_argument("--dtypes", help="comma-separated, the gated exact-match dtype first "
                                    "(default: float64, then bfloat16 on CUDA)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: 1 for --quick on the CPU, else torch's)")
    p.add_argument("--no-save", action="store_true", help="print only; write no results file")
    return p.parse_args(argv)


def main(argv=None):
    started = time.perf_counter()
    args = parse_args(argv)
    config = make_config(args.quick, args.device, groups=args.groups, per_group=args.per_group,
                         new_tokens=args.new_tokens, layers=args.layers, seed=args.seed,
                         prefill_batch=args.prefill_batch, prefill_chunk=args.prefill_chunk)
    if args.dtypes:
        config.dtypes = tuple(args.dtypes.split(","))
    try:
        check_config(config)
    except ValueError as e:
        sys.exit(f"generate_paged.py: {e}")
    # The --quick model's ops are tiny: one thread beats two on a shared 2-core machine.
    threads = args.threads or (1 if config.device == "cpu" and args.quick else None)
    if threads:
        torch.set_num_threads(threads)
    print(f"generating {config.new_tokens} tokens for {config.requests} requests on {config.device} "
          f"({', '.join(config.dtypes)}), paged then sdpa"
          + (f" (torch threads: {torch.get_num_threads()})" if config.device == "cpu" else ""))
    runs, comparisons = generate_all(config)
    wall_s = time.perf_counter() - started
    save(config, runs, comparisons, wall_s, write=not args.no_save)
    cmp = comparisons[config.dtypes[0]]
    if not cmp["passed"]:
        print(f"FAIL: the paged run's {config.dtypes[0]} tokens differ from SDPA's at a clear margin for "
              f"{cmp['requests'] - cmp['identical_requests']} of {cmp['requests']} requests")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
