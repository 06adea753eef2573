"""Bridges from other libraries to the chapter's attention: transformers.register() makes a Hugging
Face model run on flash_attention.attention (and attention_varlen for padded batches)."""
