"""Text prompts to token ids, the Hugging Face way: the tokenizer's own special tokens included.

A checkpoint whose tokenizer adds a bos token (a post-processor, `add_bos_token` true in
tokenizer_config.json; the embedded model's does) gets it in front of every text prompt, so
`generate(text)` equals `generate(bos + ids)` and nobody has to add it by hand.
"""
from __future__ import annotations


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Ids of `text` with the tokenizer's special tokens: a transformers tokenizer's encode()
    or a `tokenizers.Tokenizer`'s encode().ids."""
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer; pass token ids instead")
    out = tokenizer.encode(text)
    return list(out.ids) if hasattr(out, "ids") else list(out)
