"""Run a Hugging Face transformers model on the chapter's attention.

    from flash_attention.integrations import transformers as course_hf
    course_hf.register()                      # once per process; the name is "course_attention"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="course_attention")

register() adds two functions to transformers' registries under one name, as its FlashAttention 2
integration does: attention_forward, the attention every layer calls (AttentionInterface), and
padding_mask, which builds the attention_mask the model hands those layers (AttentionMaskInterface).
A name without a mask function of its own would get no mask at all from transformers' mask
builders, padding included, so registering both is what keeps a padded batch correct.

What each call computes:

- no padding: flash_attention.attention(q, k, v, causal=True, scale=...) on the (batch, heads,
  seqlen, head_dim) views the layer made, K and V with their own (fewer) heads: grouped-query
  attention needs no copies. The causal mask is aligned bottom-right, so a decode step (one query
  against the past and itself) and a prefill after a cached prefix need no mask either. A static
  cache's empty slots are cut off first (the mask function marks where the keys end);
- a padding mask (a 2-D attention_mask with zeros in the batch, left or right padding): the real
  tokens are gathered into the packed layout, attention_varlen runs with cu_seqlens, and the output
  is scattered back with zeros on the padded rows (FlashAttention 2's unpad, varlen, pad). On CUDA
  that runs on the packed layout's tensor-core rungs (float16 and bfloat16, compute capability 8.0
  or newer); float32 and float64 get attention_varlen's refusal there;
- sliding_window (Mistral, Gemma 2) becomes window=(sliding_window - 1, 0), and softcap (Gemma 2's
  attn_logit_softcapping) softcap=.

Everything else is refused with an error naming it, never approximated: dropout > 0, attention
weights (output_attentions), attention sinks (s_aux), position biases, a 4-D mask, packed
sequences, masks other than causal or a causal sliding window (prefix-LM, chunked, bidirectional
image tokens), and a sliding window over padding that is not on one side.
"""
import torch
import torch.nn.functional as F

try:
    import transformers
    from transformers import masking_utils
except ImportError as e:  # the chapter itself never needs transformers; this module alone does
    raise ImportError("flash_attention.integrations.transformers needs the transformers library "
                      "(pip install 'transformers>=5.17,<6')") from e

import flash_attention

__all__ = ["register", "attention_forward", "padding_mask", "NAME"]

NAME = "course_attention"
_WHO = "flash_attention.integrations.transformers"


def register(name=NAME):
    """Register the chapter's attention with transformers under `name`; then
    `attn_implementation=name` (in from_pretrained, from_config, or model.set_attn_implementation)
    runs a model on it. Returns the name.

    The name must not contain "flash": transformers takes any such name for a FlashAttention build
    of its own (flash_attn or a Hub kernel) and tries to import it when the model is made."""
    if "flash" in name:
        raise ValueError(f"{_WHO}.register: name={name!r} contains 'flash', which transformers reserves for "
                         "its own FlashAttention kernels (it would try to import one by that name); pick "
                         f"another, e.g. the default {NAME!r}")
    transformers.AttentionInterface.register(name, attention_forward)
    masking_utils.AttentionMaskInterface.register(name, padding_mask)
    return name


def _refuse(what):
    raise NotImplementedError(f"{_WHO}: {what}; use attn_implementation='sdpa' for this model or call")


def _check_pattern(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, use_vmap, config, device):
    """Refuse, where the mask is built, any pattern attention_forward would not compute: it sees only
    the padding mask and the layer's own causal flag and sliding window."""
    if mask_function is masking_utils.causal_mask_function:
        return  # the common case, known without evaluating anything
    if mask_function is masking_utils.bidirectional_mask_function:
        return  # an encoder's full attention: its layers call with is_causal=False
    if use_vmap:
        # Set by the mask builders when a model adds its own or_mask_function / and_mask_function
        # (bidirectional image tokens, prefix-LM): not index arithmetic we could compare against.
        _refuse("the model adds its own mask function to the causal mask (or_mask_function or "
                "and_mask_function); only causal attention, with or without a sliding window, is computed here")
    window = getattr(config, "sliding_window", None)
    if window is not None:
        # Packed sequences, blocks and chunks are and/or-combinations of index functions too. Evaluate
        # this one on the whole (batch, q, kv) grid, as transformers' sdpa mask does, and accept it only
        # if it is exactly the config's causal sliding window, the one pattern the layers' own
        # sliding_window argument describes.
        b = torch.arange(batch_size, device=device)[:, None, None, None]
        h = torch.zeros(1, dtype=torch.long, device=device)[None, :, None, None]
        q = (torch.arange(q_length, device=device) + q_offset)[None, None, :, None]
        kv = (torch.arange(kv_length, device=device) + kv_offset)[None, None, None, :]
        got, want = torch.broadcast_tensors(mask_function(b, h, q, kv),
                                            masking_utils.sliding_window_causal_mask_function(window)(b, h, q, kv))
        if torch.equal(got, want):
            return
    _refuse("the model's mask is not plain causal or a causal sliding window (packed sequences, chunked "
            "attention, blockwise or bidirectional overlays)")


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                 use_vmap=False, config=None, device=None, **kwargs):
    """The mask function registered beside attention_forward (AttentionMaskInterface): transformers'
    mask builders (create_causal_mask, create_sliding_window_causal_mask) call it once per forward
    for the mask every layer then receives. Like masking_utils.flash_attention_mask it returns the
    2-D padding mask, (batch, kv_length) with True on real tokens, or None where nothing is padded:
    the pattern itself (causal, the window) is the attention call's. So a pattern the call would
    not compute is refused here, where it is still known."""
    device = device if device is not None else "cpu"
    _check_pattern(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, use_vmap, config, device)
    if mask_function is not masking_utils.bidirectional_mask_function:
        # Keys at or after the position past the newest query are a static cache's empty slots:
        # transformers' causal masks hide them by position, but a bottom-right mask aligns the last
        # query with the last key, so they must be cut off. A mask shorter than kv_length says so
        # (attention_forward keeps that many keys).
        present = int(q_offset) + q_length - int(kv_offset)
        if attention_mask is None and present < kv_length:
            return torch.ones(batch_size, present, dtype=torch.bool, device=device)
    if attention_mask is not None:
        # The last kv_length positions: a sliding-window cache holds only the newest keys. A shorter
        # mask than kv_length means a static cache's unused slots, which attention_forward cuts off.
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            attention_mask = None
    return attention_mask


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, **kwargs):
    """transformers' attention signature: query (batch, heads, seqlen_q, head_dim), key and value
    (batch, heads_kv, seqlen_k, head_dim) as the layer made them (after its KV cache's update);
    returns (output of (batch, seqlen_q, heads, head_dim), None: no attention weights)."""
    if dropout:
        _refuse(f"dropout={dropout} (attention dropout is not computed; call model.eval() or set the "
                "config's attention_dropout to 0)")
    if kwargs.get("output_attentions"):
        _refuse("output_attentions=True (the attention weights are never materialised)")
    for name in ("s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            _refuse(f"{name} (attention sinks and position biases are not computed)")
    if any(kwargs.get(name) is not None for name in ("cu_seq_lens_q", "cu_seq_lens_k")):
        _refuse("packed sequences given as cu_seq_lens_q / cu_seq_lens_k")
    if value.shape[-1] != query.shape[-1]:
        _refuse(f"a value head_dim ({value.shape[-1]}) other than the query's ({query.shape[-1]})")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = (-1, -1)
    if sliding_window is not None and sliding_window > 0:  # Gemma 2 passes None on its global layers
        if not causal:
            _refuse("a sliding window without a causal mask")
        # transformers' window of w keys, kv > q - w, is FlashAttention's left bound w - 1 (the row's
        # own key and w - 1 before it); causal=True makes the right bound 0.
        window = (sliding_window - 1, 0)
    softcap = float(softcap) if softcap else 0.0
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            _refuse(f"a {attention_mask.dim()}-D attention mask (only the 2-D padding mask that this integration's "
                    "mask function builds maps to attention_varlen; an arbitrary mask is not computed)")
        attention_mask = attention_mask.bool()
        if attention_mask.shape[1] < key.shape[2]:
            # A static cache: the slots after the mask's length hold nothing yet.
            key, value = key[:, :, :attention_mask.shape[1]], value[:, :, :attention_mask.shape[1]]
        if bool(attention_mask.all()):
            attention_mask = None  # no padding among the keys that exist: the plain call, CUDA included
    if attention_mask is None:
        out = flash_attention.attention(query, key, value, causal=causal, scale=scaling, window=window, softcap=softcap)
        # (batch, heads, seqlen, head_dim) to the layout the layer's output projection reads.
        return out.transpose(1, 2).contiguous(), None
    return _padded(query, key, value, attention_mask, causal, scaling, window, softcap), None


def _padded(query, key, value, mask, causal, scale, window, softcap):
    """FlashAttention 2's unpad, varlen, pad: the real tokens of each sequence packed along one dim,
    attention_varlen over them, the output scattered back to (batch, seqlen_q, heads, head_dim)."""
    batch, heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    if mask.shape[0] != batch or mask.shape[1] != kv_len or q_len > kv_len:
        _refuse(f"a padding mask of shape {tuple(mask.shape)} for {batch} sequences of {q_len} queries and "
                f"{kv_len} keys (it must be (batch, seqlen_k), the queries being the last seqlen_q keys' tokens)")
    # The queries are the newest q_len tokens of each sequence, so their padding is the mask's last
    # q_len columns. Packed, query i of a sequence with n_q real queries and n_k real keys sees the
    # real keys j <= i + n_k - n_q: exactly attention_varlen's bottom-right causal mask, wherever the
    # padding sits, since every real key before the queries comes before all of them.
    mask_q = mask[:, -q_len:]
    if window != (-1, -1):
        # A window counts positions; packed, it counts real tokens. The two agree only where each
        # sequence's real tokens are contiguous (all padding on the left, or all on the right).
        runs = mask[:, :1].int() + (mask[:, 1:] & ~mask[:, :-1]).sum(1, keepdim=True)
        if bool((runs > 1).any()):
            _refuse("a sliding window over a batch with padding between real tokens")
    lens_q, lens_k = mask_q.sum(1, dtype=torch.int32), mask.sum(1, dtype=torch.int32)
    cu_q = F.pad(lens_q.cumsum(0, dtype=torch.int32), (1, 0))
    cu_k = F.pad(lens_k.cumsum(0, dtype=torch.int32), (1, 0))
    rows_q = mask_q.flatten().nonzero().flatten()
    rows_k = mask.flatten().nonzero().flatten()

    def packed(t, rows):  # (batch, h, s, d) -> the real tokens' rows of (batch * s, h, d)
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]).index_select(0, rows)

    out = flash_attention.attention_varlen(packed(query, rows_q), packed(key, rows_k), packed(value, rows_k),
                                           cu_q, cu_k, int(lens_q.max()), int(lens_k.max()), causal=causal,
                                           scale=scale, window=window, softcap=softcap)
    # Padded query rows get zeros (no key is theirs); index_copy out of place keeps autograd's path.
    full = out.new_zeros(batch * q_len, heads, head_dim).index_copy(0, rows_q, out)
    return full.view(batch, q_len, heads, head_dim)
