"""Text for the evaluation: the dev corpus every figure is tuned on, and a user's own file.

The dev corpus is the text of CPython's `pydoc_data.topics` (the help topics of the language reference):
present in every Python installation, so figures reproduce without a download. About 110k tokens with the
default tokenizer. Keep other corpora out of tuning; use them (`--text FILE`) to check a result holds.
"""

from __future__ import annotations

import os

import torch


def dev_text() -> str:
    """The dev corpus: every `pydoc_data.topics` entry in sorted key order, separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip("\n") for key in sorted(topics))


def load_text(path: str | os.PathLike) -> str:
    """A user's corpus (`--text FILE`): the whole file as UTF-8 (undecodable bytes replaced)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text.strip():
        raise ValueError(f"{os.fspath(path)!r} holds no text")
    return text


def tokenize_corpus(tokenizer, text: str) -> torch.Tensor:
    """Token ids `(N,)` int64 of `text`, without special tokens (windows start anywhere in the text)."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)
