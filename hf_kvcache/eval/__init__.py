"""Evaluation: decode-protocol (the default), strict and chunked-stream perplexity, retrieval, memory, and the results
report.

Every function takes a `cache_factory: Callable[[], transformers.Cache]` that returns a fresh cache, so the
evaluation never needs to know which method it measures; the CLI builds factories from spec strings.
"""

from .corpus import dev_text, load_text, tokenize_corpus
from .memory import bytes_per_token, cache_nbytes, reference_bytes_per_token
from .passkey import passkey_grid
from .perplexity import decode_perplexity, strict_perplexity, streaming_perplexity

__all__ = [
    "bytes_per_token",
    "cache_nbytes",
    "decode_perplexity",
    "dev_text",
    "load_text",
    "passkey_grid",
    "reference_bytes_per_token",
    "strict_perplexity",
    "streaming_perplexity",
    "tokenize_corpus",
]
