"""Chapter 6 end to end: a tiny GPT whose attention is flash_attention.attention, trained on the
course's own text, next to the same model on F.scaled_dot_product_attention.

The kernels pass their tests op by op; this script asks the question a user asks: does a model
train the same with them? Both runs start from the same weights (one seeded initialisation), see
the same batches (one seeded sampler) and differ only in the attention call, so their loss
curves should agree step for step up to rounding. The script prints both curves' end points,
tokens/s for each backend, the largest per-step loss difference, and a few characters the flash
model writes; it exits 1 if the curves part by more than the tolerance (see TOLERANCE).

- Corpus: the repository's README.md files (the top-level one, then chapter*/README.md in
  sorted order), character level, nothing downloaded; the last 10% is the validation split.
- Model (written here): token and learned position embeddings, pre-LayerNorm blocks (causal
  self-attention with one fused qkv Linear, GELU MLP), a final LayerNorm, an LM head tied to the
  token embedding. CausalSelfAttention's `backend` picks the one call that differs.
- Precision: bf16 autocast on CUDA (the tensor-core kernels' dtype; master weights stay
  float32), float32 on the CPU (the chapter's C++ reference computes float32 only).
- Timing: tokens/s over the training steps after the first few (allocator and kernel caches
  warm), evaluation excluded; CUDA synchronised at the clock's edges, wall clock on the CPU.

    python train_tiny_gpt.py            GPU: 4 layers x 4 heads x 64, context 256, batch 32,
                                        1000 steps per backend, bf16 autocast
    python train_tiny_gpt.py --quick    CPU and CI: 2 layers x 2 heads x 32, context 64,
                                        batch 8, 30 steps per backend, float32 (seconds)

Writes results/<device-slug>/chapter6_tiny_gpt.json (both loss curves, tokens/s, the
comparison) and chapter6_tiny_gpt_loss.png beside it; --no-save skips both.
"""
import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "common")]
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from coursekit import bench, results  # noqa: E402

import flash_attention  # noqa: E402

NAME = "chapter6_tiny_gpt"
CUDA_HEAD_DIMS = (32, 64, 96, 128, 256)  # the head dims the CUDA kernels are instantiated for
VAL_FRACTION = 0.1

# The largest |loss_flash - loss_sdpa| at any step (train and val) that still counts as the same
# curve, per compute dtype. Why these numbers:
# - float32 (the CPU): both backends compute the same math, summed in different orders, so the
#   first losses agree to ~1e-7 (a few float32 ulps of a loss ~4). Training amplifies that: AdamW
#   divides each gradient by its own running RMS, so a parameter whose gradient is near zero can
#   take a different lr-sized step from a rounding-level difference, and the runs drift apart the
#   longer they train. Over the --quick run (30 steps) the drift measured ~1e-6, while each defect
#   tried in its place moved the curve by 1.7e-2 to 1.7e-1 within those steps: attention without
#   the causal mask, a softmax scale 1.25x or 2x off, dq dropped from the backward, no attention
#   at all. 1e-3 sits well between the two, ~1000x above the drift and >10x below the smallest
#   defect. It is a bound for short runs: thousands of float32 steps may drift further.
# - bfloat16 (CUDA autocast): each attention output is rounded to 8 mantissa bits (relative
#   2^-9 ~ 0.2%) and the two kernels round at different points (the P V product's operands, the
#   final rescale), so the gradients differ by ~1e-3 relative from the first step and the runs
#   decorrelate over hundreds of steps much as two float32 runs do over thousands. They keep the
#   same batches, so the batch-to-batch noise of the loss (a few 1e-2 at 8k tokens a batch) is
#   shared and cancels; what remains is the weights' drift, expected ~1e-2 of a loss near 1-2.
#   0.05 leaves headroom over that; the defects above grow apart from the right curve with every
#   step (0.02-0.17 after only 30 CPU steps; a model that sees the next character heads for a
#   loss near 0). This bound was reasoned before the first GPU run; the H100 run's difference
#   (comparison.max_abs_diff in results/<gpu>/chapter6_tiny_gpt.json, quoted in the README)
#   came out within it, at about half of it, over 1000 steps. Subtle defects (a slightly wrong
#   scale) are test_attention.py's to catch, op by op; this check is about training end to end.
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.05}


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    layers: int = 4
    heads: int = 4
    head_dim: int = 64
    context: int = 256
    batch: int = 32
    steps: int = 1000
    lr: float = 1e-3
    warmup_steps: int = 100      # linear lr warm-up, then cosine decay to lr / 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 20
    timing_warmup: int = 10      # steps left out of tokens/s (first calls allocate and warm caches)
    seed: int = 1337
    device: str = "cuda"
    dtype: str = "bfloat16"      # the autocast dtype on CUDA; "float32" runs without autocast
    sample_chars: int = 300

    @property
    def dim(self):
        return self.heads * self.head_dim


# --quick: small enough for two CPU cores in seconds, still long enough for the loss to fall.
QUICK = dict(layers=2, heads=2, head_dim=32, context=64, batch=8, steps=30, lr=3e-3, warmup_steps=3,
             eval_every=10, eval_batches=4, timing_warmup=5, sample_chars=80)


def make_config(quick=False, device=None, **overrides):
    """The preset (full or --quick) for the device, with any field overridden. The dtype follows
    the device unless given: bf16 on CUDA, float32 on the CPU."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    fields = {**(QUICK if quick else {}), "device": device,
              "dtype": "bfloat16" if device == "cuda" else "float32"}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return Config(**fields)


def check_config(config):
    """Reject, with a message that says what to change, a config the run would fail on later
    (deep inside an op) or that would not measure what it claims."""
    if config.device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {config.device!r}")
    if config.dtype not in TOLERANCE:
        raise ValueError(f"dtype must be one of {sorted(TOLERANCE)}, got {config.dtype!r}")
    if config.device == "cpu" and config.dtype != "float32":
        raise ValueError(f"dtype={config.dtype} on the CPU: flash_attention's CPU reference computes "
                         "float32 and float64 only; use float32 (the default there)")
    if config.device == "cuda" and config.head_dim not in CUDA_HEAD_DIMS:
        raise ValueError(f"head_dim={config.head_dim} is not supported by flash_attention on CUDA; "
                         f"pick one of {CUDA_HEAD_DIMS}")
    for field in ("layers", "heads", "head_dim", "batch", "steps", "eval_every", "eval_batches"):
        if getattr(config, field) < 1:
            raise ValueError(f"{field} must be >= 1, got {getattr(config, field)}")
    if config.context < 2:
        raise ValueError(f"context must be >= 2, got {config.context}")
    if not 0 <= config.timing_warmup < config.steps:
        raise ValueError(f"timing_warmup={config.timing_warmup} must be in [0, steps={config.steps}): "
                         "tokens/s needs at least one timed step")
    # Last, so that a CPU machine checks (and tests) every rule above for a CUDA config too.
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is visible; run with --device cpu")


# ---------------------------------------------------------------------------------------------
# The corpus: the course's READMEs, one character a token
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Corpus:
    files: list
    chars: list          # the vocabulary: every character of the text, sorted
    train: torch.Tensor  # int64 token ids
    val: torch.Tensor

    def encode(self, text):
        index = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([index[c] for c in text], dtype=torch.long)

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)


def readme_paths(repo=REPO):
    """The top-level README, then every chapter's, in sorted order: a fixed text on every machine."""
    return [repo / "README.md"] + sorted(repo.glob("chapter*/README.md"))


def load_corpus(repo=REPO, val_fraction=VAL_FRACTION):
    paths = readme_paths(repo)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"corpus files missing: {missing}")
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in paths)
    chars = sorted(set(text))
    corpus = Corpus([str(p.relative_to(repo)) for p in paths], chars, None, None)
    data = corpus.encode(text)
    # The tail, not a random sample, is held out: random windows would overlap the training text.
    cut = int(len(data) * (1 - val_fraction))
    corpus.train, corpus.val = data[:cut], data[cut:]
    return corpus


def batch_at(data, offsets, context):
    """Inputs and next-character targets of the windows starting at `offsets`."""
    window = data[offsets[:, None].to(data.device) + torch.arange(context + 1, device=data.device)]
    return window[:, :-1], window[:, 1:]


def sample_offsets(data, batch, context, generator):
    return torch.randint(len(data) - context, (batch,), generator=generator)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
def flash_causal(q, k, v):
    return flash_attention.attention(q, k, v, causal=True)


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# Looked up at every call, so a test can swap a deliberately broken attention in.
BACKENDS = {"flash": flash_causal, "sdpa": sdpa_causal}


def autocast_dtype(x):
    """The dtype autocast computes in on x's device, or None when autocast is off."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads, backend):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        self.heads, self.backend = heads, backend
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        # (b, s, 3 * h * d) -> three (b, h, s, d) views, no copies: the kernel reads any strides
        # whose last dim is contiguous.
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        # Autocast converts the inputs of the ops it knows; a custom op is not one of them, so a
        # float32 q would reach the kernel as float32. Cast to the compute dtype here, for both
        # backends alike (a no-op when the qkv Linear already ran in it).
        dtype = autocast_dtype(x)
        if dtype is not None:
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        y = BACKENDS[self.backend](q, k, v)
        return self.proj(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, dim, heads, backend):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, backend)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab, config, backend):
        super().__init__()
        dim = config.dim
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(config.context, dim)
        self.blocks = nn.ModuleList(Block(dim, config.heads, backend) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one matrix reads and writes characters
        init_weights(self, config)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def init_weights(model, config):
    """Every parameter drawn from one seeded generator (GPT-2's scheme: N(0, 0.02), the residual
    projections shrunk by sqrt(2 * layers) so the residual stream's variance does not grow with
    depth), so two models built from one config are equal to the bit, whatever the global RNG."""
    g = torch.Generator().manual_seed(config.seed)
    residual = {id(b.attn.proj) for b in model.blocks} | {id(b.mlp[2]) for b in model.blocks}
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not model.head:  # head is tok's matrix
            std = 0.02 / math.sqrt(2 * config.layers) if id(module) in residual else 0.02
            nn.init.normal_(module.weight, 0.0, std, generator=g)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, 0.02, generator=g)


def make_model(vocab, config, backend):
    # Built on the CPU, where the seeded generator draws, then moved: the same weights on any device.
    return TinyGPT(vocab, config, backend).to(config.device)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
def lr_at(step, config):
    """Linear warm-up to config.lr, then cosine decay to lr / 10 at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - 1 - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, config):
    # Decay the matrices (embeddings included), not biases and LayerNorm gains: the usual split.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))


def autocast(config):
    return torch.autocast(config.device, dtype=getattr(torch, config.dtype), enabled=config.dtype != "float32")


@torch.no_grad()
def evaluate(model, batches, config):
    model.eval()
    with autocast(config):
        losses = [model(x, y)[1] for x, y in batches]
    model.train()
    return torch.stack(losses).mean().item()


def train(config, backend, corpus):
    """Train one model; returns its per-step training losses, (step, val loss) pairs, tokens/s and
    the model. The batches come from a generator seeded by config.seed alone, so every backend
    sees the same ones in the same order."""
    check_config(config)
    if len(corpus.val) <= config.context:
        raise ValueError(f"context={config.context} is longer than the validation text ({len(corpus.val)} characters)")
    model = make_model(len(corpus.chars), config, backend)
    optimizer = make_optimizer(model, config)
    train_data, val_data = corpus.train.to(config.device), corpus.val.to(config.device)
    batches = torch.Generator().manual_seed(config.seed)
    val_gen = torch.Generator().manual_seed(config.seed + 1)
    val_batches = [batch_at(val_data, sample_offsets(val_data, config.batch, config.context, val_gen), config.context)
                   for _ in range(config.eval_batches)]
    losses, val_losses, clock = [], [(0, evaluate(model, val_batches, config))], bench.Stopwatch(config.device)
    for step in range(config.steps):
        if step == config.timing_warmup:
            clock.start()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        x, y = batch_at(train_data, sample_offsets(train_data, config.batch, config.context, batches), config.context)
        with autocast(config):
            _, loss = model(x, y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # Kept on the device: a .item() here would make every step wait for the GPU.
        losses.append(loss.detach())
        done = step + 1
        if done % config.eval_every == 0 or done == config.steps:
            clock.stop()  # evaluation is not training throughput
            val_losses.append((done, evaluate(model, val_batches, config)))
            if done < config.steps and done > config.timing_warmup:
                clock.start()
    timed_steps = config.steps - config.timing_warmup
    tokens_per_s = timed_steps * config.batch * config.context / clock.seconds
    return {"backend": backend, "train_loss": torch.stack(losses).float().tolist(), "val_loss": val_losses,
            "tokens_per_s": tokens_per_s, "ms_per_step": 1e3 * clock.seconds / timed_steps,
            "timed_steps": timed_steps, "model": model}


def compare(run, reference, tolerance):
    """How far run's loss curves are from reference's, step by step (train) and at each
    evaluation (val). Non-finite losses never match."""
    a = torch.tensor(run["train_loss"], dtype=torch.float64)
    b = torch.tensor(reference["train_loss"], dtype=torch.float64)
    diff = (a - b).abs()
    val_a = torch.tensor([v for _, v in run["val_loss"]], dtype=torch.float64)
    val_b = torch.tensor([v for _, v in reference["val_loss"]], dtype=torch.float64)
    val_diff = (val_a - val_b).abs()
    finite = bool(torch.isfinite(diff).all() and torch.isfinite(val_diff).all())
    worst = int(diff.argmax()) if finite else -1
    out = {"max_abs_diff": float(diff.max()) if finite else math.inf, "at_step": worst,
           "max_rel_diff": float((diff / b.abs()).max()) if finite else math.inf,
           "mean_abs_diff": float(diff.mean()) if finite else math.inf,
           "val_max_abs_diff": float(val_diff.max()) if finite else math.inf,
           "tolerance": tolerance}
    out["match"] = finite and out["max_abs_diff"] <= tolerance and out["val_max_abs_diff"] <= tolerance
    return out


def train_both(config, corpus):
    """Flash, then SDPA, from the same weights on the same batches: ({backend: run}, comparison)."""
    runs = {backend: train(config, backend, corpus) for backend in ("flash", "sdpa")}
    return runs, compare(runs["flash"], runs["sdpa"], TOLERANCE[config.dtype])


@torch.no_grad()
def generate(model, corpus, config, prompt="The ", temperature=0.8):
    """config.sample_chars characters after prompt, sampled with a seeded generator on the CPU
    (the same draws on any device): a glance at what the model learned."""
    if not all(c in corpus.chars for c in prompt):
        prompt = corpus.decode(corpus.val[:4].tolist())
    g = torch.Generator().manual_seed(config.seed)
    idx = corpus.encode(prompt).to(config.device)[None]
    model.eval()
    for _ in range(config.sample_chars):
        with autocast(config):
            logits, _ = model(idx[:, -config.context:])
        probs = F.softmax(logits[0, -1].float().cpu() / temperature, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g).to(config.device)[None]], dim=1)
    model.train()
    return corpus.decode(idx[0].tolist())


# ---------------------------------------------------------------------------------------------
# Results: rows, record, figure, table
# ---------------------------------------------------------------------------------------------
def result_rows(runs, config):
    """One row per backend (CONTRIBUTING.md, section 5): variant "default" is flash_attention's
    version=None dispatch, "sdpa" PyTorch's own; speedup_vs_torch is tokens/s over SDPA's."""
    rows = []
    # The rungs version=None ran for the model's attention call (batch, heads, context, head_dim) in
    # the compute dtype: which kernels a result is about, read off the same rule the op dispatches on.
    q_like = torch.empty(config.batch, config.heads, config.context, config.head_dim,
                         dtype=getattr(torch, config.dtype), device=config.device)
    dispatch = {"forward": flash_attention.default_choice("attention_forward", q_like, causal=True),
                "backward": flash_attention.default_choice("attention_backward", q_like, causal=True)}
    for backend, variant in (("flash", "default"), ("sdpa", "sdpa")):
        run = runs[backend]
        rows.append({"op": "tiny_gpt_train", "variant": variant, "backend": backend, "dtype": config.dtype,
                     "shape": [config.batch, config.context], "batch": config.batch, "context": config.context,
                     "layers": config.layers, "heads": config.heads, "head_dim": config.head_dim,
                     "steps": config.steps, "timed_steps": run["timed_steps"],
                     "ms_per_step": run["ms_per_step"], "tokens_per_s": run["tokens_per_s"],
                     "speedup_vs_torch": run["tokens_per_s"] / runs["sdpa"]["tokens_per_s"],
                     "final_train_loss": run["train_loss"][-1], "final_val_loss": run["val_loss"][-1][1],
                     **({"dispatch": dispatch} if backend == "flash" else {})})
    return rows


def make_figures(record, out_dir):
    """Both loss curves, and their per-step difference against the tolerance. Skipped, with a
    note, where matplotlib is missing: the JSON is the result, the figure a view of it."""
    try:
        import matplotlib.pyplot as plt
        from coursekit import plots
    except ImportError as e:
        print(f"no figure: {e}")
        return []
    curves, cmp = record["curves"], record["comparison"]
    fig, (ax, ax_diff) = plt.subplots(1, 2, figsize=(12, 4.5))
    for backend, color in (("flash", "tab:blue"), ("sdpa", "black")):
        c = curves[backend]
        ax.plot(range(len(c["train_loss"])), c["train_loss"], color=color, lw=1,
                linestyle="-" if backend == "flash" else "--", label=f"{backend} train")
        steps, vals = zip(*c["val_loss"])
        ax.plot(steps, vals, color=color, marker="o", ms=4, linestyle=":", label=f"{backend} val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title(f"tiny GPT, {record['config']['dtype']}: {results.label(record)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    diff = [abs(a - b) for a, b in zip(curves["flash"]["train_loss"], curves["sdpa"]["train_loss"])]
    # Exactly equal steps have no place on a log axis; they are drawn at the axis floor instead.
    floor = min([d for d in diff if d > 0] or [1e-12]) / 2
    ax_diff.plot(range(len(diff)), [max(d, floor) for d in diff], color="tab:blue", lw=1)
    ax_diff.axhline(cmp["tolerance"], color="tab:red", linestyle=":", label=f"tolerance {cmp['tolerance']:g}")
    ax_diff.set_yscale("log")
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel("|loss_flash - loss_sdpa|")
    ax_diff.set_title(f"per-step train loss difference (max {cmp['max_abs_diff']:.2e})", fontsize=9)
    ax_diff.grid(alpha=0.3)
    ax_diff.legend(fontsize=8)
    return [plots.save(fig, out_dir / f"{NAME}_loss.png")]


def print_table(record):
    cfg, cmp = record["config"], record["comparison"]
    print(f"\n{NAME} on {results.label(record)}: {cfg['layers']} layers x {cfg['heads']} heads x "
          f"{cfg['head_dim']}, context {cfg['context']}, batch {cfg['batch']}, {cfg['dtype']}, "
          f"{record['corpus']['train_chars']} training characters, vocabulary {record['corpus']['vocab']}")
    print(f"{'backend':<9}{'steps':>6}{'train loss':>12}{'val loss':>10}{'tokens/s':>12}{'ms/step':>9}")
    for r in record["benchmarks"]:
        print(f"{r['backend']:<9}{r['steps']:>6}{r['final_train_loss']:>12.4f}{r['final_val_loss']:>10.4f}"
              f"{r['tokens_per_s']:>12,.0f}{r['ms_per_step']:>9.2f}")
    for r in record["benchmarks"]:
        if "dispatch" in r:
            print(f"flash_attention's version=None ran forward {r['dispatch']['forward']!r}, "
                  f"backward {r['dispatch']['backward']!r}")
    verdict = "match" if cmp["match"] else "DO NOT MATCH"
    print(f"max |loss_flash - loss_sdpa| = {cmp['max_abs_diff']:.2e} at step {cmp['at_step']} "
          f"(relative {cmp['max_rel_diff']:.1e}; val {cmp['val_max_abs_diff']:.2e}); "
          f"tolerance {cmp['tolerance']:g} ({cfg['dtype']}): curves {verdict}")
    print(f"flash model writes (seeded sampling, temperature 0.8):\n  {record['sample']!r}")


def make_record_extra(config, corpus, runs, comparison, sample, wall_s):
    return {"config": dataclasses.asdict(config), "comparison": comparison, "sample": sample,
            "corpus": {"files": corpus.files, "vocab": len(corpus.chars), "train_chars": len(corpus.train),
                       "val_chars": len(corpus.val)},
            "curves": {b: {"train_loss": r["train_loss"], "val_loss": r["val_loss"]} for b, r in runs.items()},
            "extension": flash_attention.EXTENSION,
            "timing": {"method": "perf_counter around the training steps after timing_warmup, evaluation excluded"
                       + (", torch.cuda.synchronize at each edge" if config.device == "cuda" else ""),
                       "timing_warmup": config.timing_warmup},
            "wall_s": wall_s}


def save(config, corpus, runs, comparison, sample, wall_s, write=True):
    """The results file and figure through coursekit (results/<device-slug>/), then the table. A
    failure to write is reported, not raised: the comparison, and the exit status, stand anyway."""
    rows, extra = result_rows(runs, config), make_record_extra(config, corpus, runs, comparison, sample, wall_s)
    return results.publish_or_print(NAME, rows, extra, make_figures, print_table, write)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model and 30 steps (CPU, CI, smoke runs)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when a GPU is visible")
    p.add_argument("--dtype", choices=sorted(TOLERANCE), help="default: bfloat16 on cuda, float32 on cpu")
    for field in ("steps", "layers", "heads", "head_dim", "context", "batch", "seed"):
        p.add_argument(f"--{field.replace('_', '-')}", type=int, help=f"override the preset's {field}")
    p.add_argument("--lr", type=float, help="override the preset's peak learning rate")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: 1 for --quick on the CPU, else torch's)")
    p.add_argument("--no-save", action="store_true", help="print only; write no results file or figure")
    return p.parse_args(argv)


def main(argv=None):
    started = time.perf_counter()
    args = parse_args(argv)
    config = make_config(args.quick, args.device, dtype=args.dtype, steps=args.steps, layers=args.layers,
                         heads=args.heads, head_dim=args.head_dim, context=args.context, batch=args.batch,
                         seed=args.seed, lr=args.lr)
    if args.steps is not None:  # keep the evaluation cadence and timing inside a shortened run
        config.eval_every = min(config.eval_every, config.steps)
        config.timing_warmup = min(config.timing_warmup, config.steps // 2)
        config.warmup_steps = min(config.warmup_steps, max(1, config.steps // 10))
    try:
        check_config(config)
    except ValueError as e:
        sys.exit(f"train_tiny_gpt.py: {e}")
    # The --quick model's ops are tiny (8 x 64 tokens of 64 features): on a 2-core machine shared
    # with other work, torch's second thread cost more in synchronisation than it saved (13-20 ms a
    # step with one thread, 60-740 ms with two, same losses), so the quick CPU run takes one.
    threads = args.threads or (1 if config.device == "cpu" and args.quick else None)
    if threads:
        torch.set_num_threads(threads)
    corpus = load_corpus()
    print(f"corpus: {len(corpus.files)} READMEs, {len(corpus.train) + len(corpus.val):,} characters, "
          f"vocabulary {len(corpus.chars)}; training flash then sdpa, {config.steps} steps each on {config.device}"
          + (f" (torch threads: {torch.get_num_threads()})" if config.device == "cpu" else ""))
    runs, comparison = train_both(config, corpus)
    sample = generate(runs["flash"]["model"], corpus, config)
    wall_s = time.perf_counter() - started
    save(config, corpus, runs, comparison, sample, wall_s, write=not args.no_save)
    if not comparison["match"]:
        print(f"FAIL: the flash and sdpa loss curves differ by more than {comparison['tolerance']:g}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
