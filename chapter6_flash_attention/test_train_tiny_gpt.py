"""Tests of train_tiny_gpt.py on the CPU, in seconds: the two attention backends give one model
the same logits and gradients from the same weights, the model is causal, a short training run
gives matching, falling loss curves (and a broken attention does not), the config checks speak
up, and the results file and figure are written."""
import json
import math

import pytest
import torch

import flash_attention
import train_tiny_gpt as T

# Smaller than --quick: 2 blocks (so a block feeds another), a context and batch of no round size.
TINY = dict(layers=2, heads=2, head_dim=16, context=29, batch=3, steps=10, lr=3e-3, warmup_steps=2,
            eval_every=5, eval_batches=2, timing_warmup=2, sample_chars=12)


def tiny_config(**overrides):
    return T.make_config(device="cpu", **{**TINY, **overrides})


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def corpus():
    return T.load_corpus()


@pytest.fixture(scope="module")
def trained(corpus):
    """One short flash-and-sdpa run, shared by the tests that read its curves."""
    config = tiny_config()
    runs, comparison = T.train_both(config, corpus)
    return config, runs, comparison


def models(corpus, config):
    return {b: T.make_model(len(corpus.chars), config, b) for b in ("flash", "sdpa")}


def batch(corpus, config):
    g = torch.Generator().manual_seed(0)
    return T.batch_at(corpus.train, T.sample_offsets(corpus.train, config.batch, config.context, g), config.context)


def test_corpus_is_the_readmes_split_at_the_tail(corpus):
    paths = T.readme_paths()
    assert paths[0] == T.REPO / "README.md"
    chapters = [p.parent.name for p in paths[1:]]
    assert chapters == sorted(chapters) and "chapter6_flash_attention" in chapters
    assert corpus.files == [str(p.relative_to(T.REPO)) for p in paths]
    total = len(corpus.train) + len(corpus.val)
    assert len(corpus.val) == total - int(total * (1 - T.VAL_FRACTION))
    # The vocabulary covers the text and round-trips it.
    text = corpus.decode(corpus.val[:200].tolist())
    assert torch.equal(corpus.encode(text), corpus.val[:200])
    assert paths[0].read_text(encoding="utf-8").startswith(corpus.decode(corpus.train[:100].tolist()))


def test_batches_are_next_character_targets(corpus):
    x, y = T.batch_at(corpus.train, torch.tensor([5, 100]), 7)
    assert torch.equal(x[1], corpus.train[100:107])
    assert torch.equal(y[1], corpus.train[101:108])


def test_same_init_for_both_backends(corpus):
    m = models(corpus, tiny_config())
    a, b = m["flash"].state_dict(), m["sdpa"].state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # The seed matters: another one gives other weights (the equality above is not vacuous).
    other = T.make_model(len(corpus.chars), tiny_config(seed=1), "flash")
    assert not torch.equal(other.tok.weight, m["flash"].tok.weight)


def test_backends_give_same_logits_and_gradients(corpus):
    config = tiny_config()
    m = models(corpus, config)
    x, y = batch(corpus, config)
    out = {}
    for backend, model in m.items():
        logits, loss = model(x, y)
        loss.backward()
        out[backend] = logits, loss, {n: p.grad for n, p in model.named_parameters()}
    # float32 both, the same math summed in different orders: a few ulps of logits ~0.1-1.
    torch.testing.assert_close(out["flash"][0], out["sdpa"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["flash"][1], out["sdpa"][1], rtol=1e-6, atol=1e-6)
    grads_f, grads_s = out["flash"][2], out["sdpa"][2]
    assert grads_f.keys() == grads_s.keys()
    for name in grads_f:
        # Gradients of weights ~0.02 are ~1e-3-1e-1; 1e-4 relative is ~100 float32 ulps of
        # headroom for the backward's longer sums, 1e-7 absolute for entries that cancel near 0.
        torch.testing.assert_close(grads_f[name], grads_s[name], rtol=1e-4, atol=1e-7, msg=name)
    # Attention's own weights got a gradient through each backend: the comparison is not of zeros.
    assert grads_f["blocks.0.attn.qkv.weight"].abs().max() > 1e-6


@pytest.mark.parametrize("backend", ("flash", "sdpa"))
def test_model_is_causal(corpus, backend):
    config = tiny_config()
    model = T.make_model(len(corpus.chars), config, backend)
    x, _ = batch(corpus, config)
    changed = x.clone()
    changed[:, -1] = (changed[:, -1] + 1) % len(corpus.chars)
    with torch.no_grad():
        before, _ = model(x)
        after, _ = model(changed)
    # Earlier positions never see the last token; the last one does.
    torch.testing.assert_close(after[:, :-1], before[:, :-1], rtol=0, atol=1e-6)
    assert (after[:, -1] - before[:, -1]).abs().max() > 1e-4


def test_training_curves_match_and_fall(trained):
    config, runs, comparison = trained
    for backend, run in runs.items():
        losses = run["train_loss"]
        assert len(losses) == config.steps and all(math.isfinite(v) for v in losses), backend
        # From ~ln(vocab) at initialisation the loss must fall measurably, not by noise.
        assert losses[-1] < losses[0] - 0.1, (backend, losses)
        assert [s for s, _ in run["val_loss"]] == [0, 5, 10]
        assert run["val_loss"][-1][1] < run["val_loss"][0][1], backend
        assert run["tokens_per_s"] > 0
    assert comparison["match"], comparison
    assert comparison["max_abs_diff"] <= T.TOLERANCE["float32"]


def test_broken_attention_is_caught(corpus, monkeypatch):
    """The tolerance can fail: flash attention that forgot causal=True lets every position see
    the next character, and over 30 steps the curve leaves SDPA's by well more than the tolerance
    (after 10 it was past the tolerance but, with some versions of the corpus, which is the
    course's own READMEs, not yet by twice it)."""
    config = tiny_config(steps=30, eval_every=10)
    sdpa = T.train(config, "sdpa", corpus)
    monkeypatch.setitem(T.BACKENDS, "flash", lambda q, k, v: flash_attention.attention(q, k, v, causal=False))
    broken = T.train(config, "flash", corpus)
    comparison = T.compare(broken, sdpa, T.TOLERANCE[config.dtype])
    assert not comparison["match"]
    assert comparison["max_abs_diff"] > 2 * T.TOLERANCE[config.dtype]


def test_compare_flags_non_finite_losses():
    good = {"train_loss": [4.0, 3.0], "val_loss": [(0, 4.0), (2, 3.0)]}
    bad = {"train_loss": [4.0, float("nan")], "val_loss": [(0, 4.0), (2, 3.0)]}
    assert T.compare(good, good, 1e-3)["match"]
    assert not T.compare(bad, good, 1e-3)["match"]


def test_lr_schedule():
    config = tiny_config(steps=100, warmup_steps=10, lr=1.0)
    assert T.lr_at(0, config) == pytest.approx(0.1)
    assert T.lr_at(9, config) == pytest.approx(1.0)
    assert T.lr_at(99, config) == pytest.approx(0.1)
    lrs = [T.lr_at(s, config) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


@pytest.mark.parametrize("head_dim", (16, 48, 512))
def test_unsupported_cuda_head_dim_is_refused(head_dim):
    # Checked before the GPU's presence, so this runs on any machine.
    with pytest.raises(ValueError, match=rf"head_dim={head_dim} .*one of \(32, 64, 96, 128, 256\)"):
        T.check_config(T.make_config(device="cuda", head_dim=head_dim))


def test_supported_cuda_head_dims_pass_the_rule():
    for head_dim in T.CUDA_HEAD_DIMS:
        config = T.make_config(device="cuda", head_dim=head_dim, heads=2)
        if torch.cuda.is_available():
            T.check_config(config)
        else:  # the rule passed; only the machine is missing
            with pytest.raises(ValueError, match="no CUDA GPU"):
                T.check_config(config)


def test_cpu_config_checks():
    T.check_config(tiny_config(head_dim=48))  # the CPU reference takes any head_dim
    with pytest.raises(ValueError, match="CPU reference computes float32"):
        T.check_config(tiny_config(dtype="bfloat16"))
    with pytest.raises(ValueError, match="timing_warmup"):
        T.check_config(tiny_config(timing_warmup=10))
    with pytest.raises(ValueError, match="backend"):
        T.CausalSelfAttention(32, 2, "flesh")


def test_command_line_refuses_bad_head_dim(capsys):
    with pytest.raises(SystemExit, match="head_dim=40"):
        T.main(["--quick", "--device", "cuda", "--head-dim", "40"])


def test_generate_is_seeded(corpus, trained):
    config, runs, _ = trained
    a = T.generate(runs["flash"]["model"], corpus, config)
    b = T.generate(runs["flash"]["model"], corpus, config)
    assert a == b and a.startswith("The ") and len(a) == 4 + config.sample_chars


def test_results_file_and_figure(corpus, trained, tmp_path, monkeypatch, capsys):
    config, runs, comparison = trained
    monkeypatch.setattr(T.results, "RESULTS_DIR", tmp_path)
    T.save(config, corpus, runs, comparison, "The sample", wall_s=1.0)
    [path] = tmp_path.glob(f"*/{T.NAME}.json")
    record = json.loads(path.read_text())
    for key in ("chapter", "device", "torch", "commit", "date", "benchmarks"):
        assert key in record, key
    assert record["curves"]["flash"]["train_loss"] == runs["flash"]["train_loss"]
    assert record["curves"]["sdpa"]["train_loss"] == runs["sdpa"]["train_loss"]
    assert {r["variant"] for r in record["benchmarks"]} == {"default", "sdpa"}
    assert record["comparison"]["match"] == comparison["match"]
    assert (path.parent / f"{T.NAME}_loss.png").stat().st_size > 0
    assert "tokens/s" in capsys.readouterr().out
