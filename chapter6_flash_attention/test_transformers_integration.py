"""Tests for flash_attention.integrations.transformers: Hugging Face models run on the chapter's
attention against the same models (the same weights) on transformers' own attention.

The models are tiny and random (nothing is downloaded): a Llama-style decoder of 2 layers, 4
query heads and 2 KV heads (grouped-query), a Mistral one with a sliding window and a Gemma 2 one
with a sliding window on every other layer and softcapped scores. Their weights are drawn 10x
larger than transformers' default (initializer_range 0.2): at the default, attention outputs are
so small beside the residual stream that a wrong mask would hardly move the logits; at 0.2 a
causal mask dropped moves them by O(1) (checked when these tests were written, by running with
causal=False).

Skipped as a whole without transformers (tools/ensure_env.py's test group installs it).
"""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flash_attention  # noqa: E402
from flash_attention.integrations import transformers as course_hf  # noqa: E402

NAME = course_hf.register()
LAYERS = 2
DTYPES = {"cpu": (torch.float64, torch.float32), "cuda": (torch.float64, torch.float32, torch.bfloat16)}
# Against the same model on SDPA (or eager) in the same dtype: the two attentions differ only in
# the order they sum in, a few ulps of each layer's output, which 2 layers and the output
# projection carry to the logits (measured on the CPU: below 1e-13 in float64 and 1e-5 in
# float32 for logits of magnitude ~6). A wrong mask, head mapping or scale moves them by O(1).
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
# transformers' eager attention (the only one that computes Gemma 2's softcap) takes its softmax in
# float32 whatever the model's dtype: a float64 model on it is float32-exact in its attention
# probabilities, ~1e-6 on these logits (measured: 2e-6), so it is held to float32's bound.
EAGER_TOL = TOL[torch.float32]


@pytest.fixture(autouse=True)
def _threads(one_thread):
    """Models this small run faster on one thread (conftest.py's one_thread)."""


class Spy:
    """Counts the calls that reach the chapter's ops (so a test cannot pass on transformers' own
    attention by mistake) and records the query lengths attention() saw."""

    def __init__(self, monkeypatch):
        self.attention, self.varlen, self.seqlen_q = 0, 0, []
        attention, varlen = flash_attention.attention, flash_attention.attention_varlen

        def spy_attention(q, *args, **kwargs):
            self.attention += 1
            self.seqlen_q.append(q.shape[2])
            return attention(q, *args, **kwargs)

        def spy_varlen(*args, **kwargs):
            self.varlen += 1
            return varlen(*args, **kwargs)

        monkeypatch.setattr(flash_attention, "attention", spy_attention)
        monkeypatch.setattr(flash_attention, "attention_varlen", spy_varlen)


def tiny_config(kind, device):
    # head_dim 16 on the CPU (the reference takes any); 32 on CUDA, the smallest of its head dims.
    hidden = 64 if device == "cpu" else 128
    common = dict(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=4)
    if kind == "gemma2":
        # Layer 0 slides over 4 keys, layer 1 is global; a softcap of 2 on scores of magnitude ~1-5
        # changes every row's softmax.
        return transformers.Gemma2Config(**common, head_dim=hidden // 4, sliding_window=4, attn_logit_softcapping=2.0,
                                         query_pre_attn_scalar=hidden // 4, final_logit_softcapping=None,
                                         layer_types=["sliding_attention", "full_attention"])
    raise ValueError(kind)


def model_pair(kind, device, dtype, reference="sdpa"):
    """(transformers' attention, the chapter's) with the same random weights. Each model gets its
    own copy of the config: a model records its attention implementation in its config, and two
    models sharing one would both run the second's."""
    config = tiny_config(kind, device)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference,
                                                        dtype=dtype).to(device).eval()
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=NAME,
                                                         dtype=dtype).to(device).eval()
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == NAME and ref.config._attn_implementation == reference
    return ref, ours


def batch(device, padded, batch_size=3, seqlen=11):
    """Token ids and an attention mask; padded: left padding of 4 and 1 tokens on two sequences (the
    ids under the padding stay random: a model that looked at them would show it)."""
    ids = torch.randint(3, 128, (batch_size, seqlen), device=device)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :4] = 0
        mask[2, :1] = 0
    return ids, mask


def run(model, ids, mask, padded):
    labels = ids.masked_fill(mask == 0, -100)  # no loss on the padding
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask if padded else None, labels=labels)
    out.loss.backward()
    return out.logits, out.loss, {n: p.grad for n, p in model.named_parameters()}


def assert_same_model_outputs(ref, ours, ids, mask, padded, tol):
    logits_ref, loss_ref, grads_ref = run(ref, ids, mask, padded)
    logits, loss, grads = run(ours, ids, mask, padded)
    real = mask.bool()  # the padded positions' outputs are nobody's: SDPA and we fill them differently
    torch.testing.assert_close(logits[real], logits_ref[real], rtol=tol, atol=tol)
    torch.testing.assert_close(loss, loss_ref, rtol=tol, atol=tol)
    for name, g in grads_ref.items():
        # Relative to the largest gradient of the tensor: some entries are sums that cancel.
        torch.testing.assert_close(grads[name], g, rtol=tol, atol=tol * float(g.abs().max()), msg=name)


def test_register_adds_both_functions():
    assert NAME == "course_attention"
    assert transformers.AttentionInterface._global_mapping[NAME] is course_hf.attention_forward
    assert transformers.masking_utils.AttentionMaskInterface._global_mapping[NAME] is course_hf.padding_mask
    with pytest.raises(ValueError, match="contains 'flash'"):
        course_hf.register("course_flash")


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_llama_logits_loss_and_gradients(device, dtype, padded, monkeypatch):
    ref, ours = model_pair("llama", device, dtype)
    ids, mask = batch(device, padded)
    spy = Spy(monkeypatch)
    if padded and device == "cuda":
        # The padded path is attention_varlen, whose CUDA kernels are tensor-core ones (16-bit: the
        # bfloat16 test below): its refusal for float32 and float64, not a silent fallback.
        with pytest.raises(RuntimeError, match=r"attention_varlen_forward: on CUDA the packed \(varlen\) layout runs "
                                               r"on versions 'tuned', 'split_kv' and 'persistent' alone \(float16 and bfloat16"):
            run(ours, ids, mask, padded)
        return
    assert_same_model_outputs(ref, ours, ids, mask, padded, TOL[dtype])
    # Every layer ran the chapter's op: attention() without padding, attention_varlen() with it.
    assert (spy.attention, spy.varlen) == ((0, LAYERS) if padded else (LAYERS, 0))


@pytest.mark.cuda
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_llama_bfloat16_on_cuda(padded, monkeypatch):
    """16-bit on the tensor-core rungs, forward and backward: the logits no farther from the float64
    model's than SDPA's bfloat16 are, give or take a factor 2 (a bound that scales with bfloat16's
    own rounding instead of a typed number); the loss within the same bound of the float64 model's.
    Left-padded, every layer runs attention_varlen on CUDA ("split_kv", backward "mma_dqpass"), and
    only the real tokens' logits are compared (the padded positions' are nobody's)."""
    from coursekit.pytest_plugin import require_cuda
    require_cuda()
    ref, ours = model_pair("llama", "cuda", torch.bfloat16)
    exact = copy.deepcopy(ref).to(torch.float64)
    ids, mask = batch("cuda", padded=padded)
    spy = Spy(monkeypatch)
    logits_ref, loss_ref, _ = run(ref, ids, mask, padded)
    logits, loss, grads = run(ours, ids, mask, padded)
    logits_exact, loss_exact, _ = run(exact, ids, mask, padded)
    real = mask.bool()
    err_ref = (logits_ref.double() - logits_exact)[real].abs().max()
    err = (logits.double() - logits_exact)[real].abs().max()
    assert err <= 2 * err_ref + 1e-2, (err, err_ref)
    assert abs(loss.double() - loss_exact) <= 2 * abs(loss_ref.double() - loss_exact) + 1e-2, (loss, loss_exact)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert (spy.attention, spy.varlen) == ((0, LAYERS) if padded else (LAYERS, 0))


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_greedy_generate_with_kv_cache(device, padded, monkeypatch):
    """Token for token the same greedy continuation as SDPA. After the prefill each step attends one
    new query to every cached key: the bottom-right causal mask needs no mask for that."""
    # float64 (the CPU reference and CUDA's scalar rungs take it): no argmax can tie within rounding.
    ref, ours = model_pair("llama", device, torch.float64)
    ids, mask = batch(device, padded)
    new = 8
    kwargs = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True)
    spy = Spy(monkeypatch)
    if padded and device == "cuda":
        # float64 (above): the packed layout's CUDA rungs are 16-bit ones, so its refusal.
        with pytest.raises(RuntimeError, match=r"attention_varlen_forward: on CUDA the packed \(varlen\) layout runs "
                                               r"on versions 'tuned', 'split_kv' and 'persistent' alone \(float16 and bfloat16"):
            ours.generate(ids, **kwargs)
        return
    with torch.no_grad():
        expected = ref.generate(ids, **kwargs)
        got = ours.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    if padded:
        assert spy.varlen == LAYERS * new  # the prefill and every decode step, through the padding
    else:
        # A prefill of the whole prompt, then one query per step against the cache.
        assert spy.seqlen_q == [ids.shape[1]] * LAYERS + [1] * (LAYERS * (new - 1))


def test_static_cache_without_a_mask(device, monkeypatch):
    """A StaticCache hands every layer all of its max_cache_len slots, the empty ones included, and
    without an attention_mask transformers' causal mask hides them by position. The bottom-right
    mask would align the newest query with the last, empty, slot: the mask function must cut the
    keys to those that exist (and then the plain call runs, on CUDA too)."""
    ref, ours = model_pair("llama", device, torch.float64)
    ids, _ = batch(device, padded=False)
    spy = Spy(monkeypatch)
    # The argument is past_key_values in transformers 5.17 and cache in later 5.x (5.24 warns on the old name).
    arg = "cache" if "cache" in inspect.signature(ours.forward).parameters else "past_key_values"
    logits = []
    for model in (ref, ours):
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():  # a prompt of 7 tokens, then 4 more against the cache
            logits.append([model(input_ids=chunk, use_cache=True, **{arg: cache}).logits
                           for chunk in (ids[:, :7], ids[:, 7:])])
    for got, expected in zip(logits[1], logits[0]):
        torch.testing.assert_close(got, expected, rtol=TOL[torch.float64], atol=TOL[torch.float64])
    assert (spy.attention, spy.varlen) == (2 * LAYERS, 0)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_sliding_window_and_softcap(kind, padded, monkeypatch):
    """Mistral's sliding_window against SDPA, Gemma 2's window and attn_logit_softcapping against
    transformers' eager attention (the one that computes the softcap), on the CPU: forward, loss,
    gradients, and a greedy generation whose cache outgrows the window. With padding the reference
    is each sequence alone, unpadded: eager attention fills a left-padded Gemma 2 batch with NaN (a
    padded row that sees no key gives NaN values that 0 x NaN carries into the real rows)."""
    reference = "sdpa" if kind == "mistral" else "eager"
    ref, ours = model_pair(kind, "cpu", torch.float64, reference=reference)
    tol = TOL[torch.float64] if reference == "sdpa" else EAGER_TOL
    ids, mask = batch("cpu", padded)
    spy = Spy(monkeypatch)
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    if not padded:
        assert_same_model_outputs(ref, ours, ids, mask, padded, tol)
        assert spy.attention == LAYERS
        with torch.no_grad():
            assert torch.equal(ours.generate(ids, attention_mask=mask, **kwargs),
                               ref.generate(ids, attention_mask=mask, **kwargs))
        return
    with torch.no_grad():
        # Positions counted over the real tokens, as generate() counts them: the rotary embedding is
        # computed in float32, so shifted positions would differ by float32 roundings.
        logits = ours(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        assert spy.varlen == LAYERS
        generated = ours.generate(ids, attention_mask=mask, **kwargs)[:, ids.shape[1]:]
        for b in range(ids.shape[0]):
            alone = ids[b][mask[b].bool()][None]
            torch.testing.assert_close(logits[b][mask[b].bool()], ref(input_ids=alone).logits[0], rtol=tol, atol=tol)
            assert torch.equal(generated[b], ref.generate(alone, **kwargs)[0, alone.shape[1]:])


def test_prefill_after_a_cached_prefix_with_padding():
    """attention_forward alone: 3 new queries against 7 keys (4 cached), padding on either side of
    the real tokens, against an explicit float64 softmax over the keys each query may see: the real
    keys at positions up to its own. Padded query rows are zeros."""
    batch_size, heads, heads_kv, q_len, kv_len, d = 3, 4, 2, 3, 7, 16
    q = torch.randn(batch_size, heads, q_len, d, dtype=torch.float64)
    k, v = (torch.randn(batch_size, heads_kv, kv_len, d, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(batch_size, kv_len, dtype=torch.bool)
    mask[0, :2] = False     # left padding
    mask[1, -1] = False     # right padding, inside the new queries
    mask[2, 3] = False      # a hole in the cached prefix
    module = torch.nn.Module()
    module.is_causal = True
    out, weights = course_hf.attention_forward(module, q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == (batch_size, q_len, heads, d)
    pos_q = torch.arange(kv_len - q_len, kv_len)[:, None]
    pos_k = torch.arange(kv_len)[None, :]
    for b in range(batch_size):
        visible = (pos_k <= pos_q) & mask[b][None, :]
        kb, vb = (t[b].repeat_interleave(heads // heads_kv, 0) for t in (k, v))
        scores = (q[b] @ kb.transpose(-1, -2) * 0.3).masked_fill(~visible, float("-inf"))
        expected = (scores.softmax(-1) @ vb).transpose(0, 1)  # (q_len, heads, d)
        real = mask[b, -q_len:]
        torch.testing.assert_close(out[b][real], expected[real], rtol=1e-12, atol=1e-12)
        assert (out[b][~real] == 0).all()


# ---------------------------------------------------------------------------------------------
# What the integration refuses, with the reason in the message
# ---------------------------------------------------------------------------------------------
def test_refuses_dropout_and_attention_weights():
    config = tiny_config("llama", "cpu")
    config.attention_dropout = 0.1
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=NAME).train()
    ids, _ = batch("cpu", padded=False)
    with pytest.raises(NotImplementedError, match="dropout=0.1"):
        model(input_ids=ids)
    model.eval()  # no dropout in eval mode: runs
    model(input_ids=ids)
    with pytest.raises(NotImplementedError, match="output_attentions"):
        model(input_ids=ids, output_attentions=True)


def test_refuses_masks_it_does_not_compute():
    _, ours = model_pair("llama", "cpu", torch.float64)
    ids, _ = batch("cpu", padded=False)
    # A 4-D mask is handed to the layers as it is: it could say anything.
    with pytest.raises(NotImplementedError, match="4-D attention mask"):
        ours(input_ids=ids, attention_mask=torch.ones(3, 1, 11, 11, dtype=torch.bool))
    # Two sequences packed in one row (positions restart at 0): a block-diagonal mask.
    packed = torch.cat([torch.arange(5), torch.arange(6)])[None]
    with pytest.raises(NotImplementedError, match="packed sequences"):
        # (Looked for only without a cache: a training forward.)
        ours(input_ids=ids[:1], position_ids=packed, use_cache=False)
    # The same with a sliding window: evaluated, and not the window alone.
    _, mistral = model_pair("mistral", "cpu", torch.float64)
    with pytest.raises(NotImplementedError, match="packed sequences"):
        mistral(input_ids=ids[:1], position_ids=packed, use_cache=False)


def test_refuses_a_window_over_padding_between_tokens():
    q, k, v = (torch.randn(2, 2, 6, 16, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 2] = False  # a hole: a window of positions is not a window of tokens there
    module = torch.nn.Module()
    module.is_causal = True
    with pytest.raises(NotImplementedError, match="sliding window over a batch with padding between"):
        course_hf.attention_forward(module, q, k, v, mask, sliding_window=3)
    mask[1, :3] = False  # left padding: the same window either way, so it runs
    course_hf.attention_forward(module, q, k, v, mask, sliding_window=3)
