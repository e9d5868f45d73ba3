"""Perplexity through a cache, under the two protocols of DESIGN.md ("Evaluation protocols").

- **Streaming** (`streaming_perplexity`, the default): each window is fed through a fresh cache in chunks of
  `chunk` tokens. A chunk attends to the stored (possibly quantized) past and exactly to itself, which is
  what generation sees. A single forward over a window would never read the cache at all.
- **Paper** (`paper_perplexity`): each window in one forward through a fresh cache with
  `cache.quantize_before_attention = True`, so every token, the new ones included, attends to quantized
  K/V (as KVQuant and QuaRot report). A cache without that attribute (transformers' DynamicCache, the
  baseline) just runs the plain forward.

Both take the same windows: `windows` windows of `context` tokens spread evenly over the corpus, the first
`skip` targets of each window unscored (they see too little context to say anything about the cache).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .. import _compat
from .memory import cache_nbytes

__all__ = ["forward_with_cache", "paper_perplexity", "streaming_perplexity", "window_starts"]

# Rows of logits turned into float32 log-probabilities at a time: bounds the float32 copy of (rows, vocab).
_SCORE_ROWS = 256


def forward_with_cache(model, input_ids: torch.Tensor, cache, *, logits_to_keep: int = 0) -> torch.Tensor:
    """One forward of `input_ids (B, T)` through `cache` (appended to it); returns logits `(B, T', V)`.

    `logits_to_keep=k > 0` asks for the logits of the last k positions only (T' = k) when the model
    supports it; otherwise T' = T. Callers locate rows from the end, so both cases read the same.
    """
    cache_arg, has_keep = _compat.forward_parameters(type(model))
    kwargs = {cache_arg: cache, "use_cache": True}
    if has_keep and logits_to_keep > 0:
        kwargs["logits_to_keep"] = logits_to_keep
    return model(input_ids=input_ids, **kwargs).logits


def window_starts(n_tokens: int, context: int, windows: int) -> list[int]:
    """Start offsets of `windows` windows of `context` tokens spread evenly over `n_tokens` (first at 0,
    last ending at the corpus end). Deterministic, so every method is scored on the same tokens."""
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens, got {context}")
    if windows < 1:
        raise ValueError(f"windows must be at least 1, got {windows}")
    if n_tokens < context:
        raise ValueError(f"the corpus has {n_tokens} tokens, fewer than one window of context={context}")
    return [int(s) for s in torch.linspace(0, n_tokens - context, windows).round().long().tolist()]


def _first_scored(skip: int) -> int:
    """Position of the first logit scored: it predicts the target at position max(skip, 1)."""
    return max(skip, 1) - 1


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum of -log p(target) over rows of `logits (T, V)` (any dtype), log-softmax in float32 by slices."""
    total = 0.0
    for i in range(0, logits.shape[0], _SCORE_ROWS):
        rows = logits[i : i + _SCORE_ROWS].float()
        total += F.cross_entropy(rows, targets[i : i + _SCORE_ROWS], reduction="sum").item()
    return total


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def _window_record(start: int, nll_sum: float, count: int, cache) -> dict:
    """One window's result: mean NLL over its `count` scored tokens and what the cache held at the end."""
    return {
        "start": start,
        "nll": nll_sum / count,
        "tokens": count,
        "cache_tokens": int(cache.get_seq_length()),
        "cache_nbytes": cache_nbytes(cache),
    }


def _summary(protocol: str, per_window: list[dict], started: float, **config) -> dict:
    total_tokens = sum(w["tokens"] for w in per_window)
    total_nll = sum(w["nll"] * w["tokens"] for w in per_window)
    nll = total_nll / total_tokens
    return {
        "protocol": protocol,
        "nll": nll,
        "ppl": math.exp(nll),
        "tokens": total_tokens,
        "windows": per_window,
        **config,
        "seconds": round(time.perf_counter() - started, 3),
    }


@torch.inference_mode()
def streaming_perplexity(
    model,
    tokens: torch.Tensor,
    cache_factory: Callable[[], object],
    *,
    context: int = 1024,
    chunk: int = 64,
    windows: int = 4,
    skip: int = 128,
    progress: bool = True,
    desc: str | None = None,
) -> dict:
    """Perplexity of `tokens (N,)` fed through a fresh `cache_factory()` per window, `chunk` tokens a step.

    The last logit of a chunk predicts the first token of the next one: every position p of the window
    with skip <= p + 1 < context is scored against token p + 1, whichever chunk p is in. Only the logits
    of scored positions are computed (`logits_to_keep`), and they are scored chunk by chunk, so no
    (context, vocab) tensor ever exists.

    Returns `{"protocol": "stream", "nll", "ppl", "tokens", "windows": [{"start", "nll", "tokens",
    "cache_tokens", "cache_nbytes"}], "context", "chunk", "skip", "n_windows", "seconds"}`; `nll` is the
    mean over all scored tokens (natural log), `cache_nbytes` what the cache held after the whole window.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    started = time.perf_counter()
    starts = window_starts(int(tokens.numel()), context, windows)
    device = _model_device(model)
    first_scored = _first_scored(skip)
    n_chunks = math.ceil(context / chunk)
    per_window = []
    with tqdm(
        total=len(starts) * n_chunks,
        desc=desc or "stream ppl",
        unit="chunk",
        disable=not progress,
        leave=False,
    ) as bar:
        for start in starts:
            window = tokens[start : start + context].to(device)  # (context,)
            cache = cache_factory()
            nll, count = 0.0, 0
            for s in range(0, context, chunk):
                e = min(s + chunk, context)
                lo, hi = max(s, first_scored), min(e, context - 1)  # scored positions [lo, hi) of this chunk
                keep = e - lo if hi > lo else 1
                logits = forward_with_cache(model, window[None, s:e], cache, logits_to_keep=keep)
                if hi > lo:
                    offset = e - logits.shape[1]  # window position of logits[:, 0]
                    nll += _nll_sum(logits[0, lo - offset : hi - offset], window[lo + 1 : hi + 1])
                    count += hi - lo
                bar.update(1)
            per_window.append(_window_record(start, nll, count, cache))
            del cache
    return _summary(
        "stream", per_window, started, context=context, chunk=chunk, skip=skip, n_windows=len(starts)
    )


@torch.inference_mode()
def paper_perplexity(
    model,
    tokens: torch.Tensor,
    cache_factory: Callable[[], object],
    *,
    context: int = 1024,
    windows: int = 4,
    skip: int = 128,
    progress: bool = True,
    desc: str | None = None,
) -> dict:
    """Perplexity of the same windows as `streaming_perplexity`, each in ONE forward through a fresh cache
    with `quantize_before_attention = True` where the cache has that attribute (every token attends to
    quantized K/V). Scores the same targets.

    Returns the same keys as `streaming_perplexity` (protocol "paper", no `chunk`), plus
    `quantize_before_attention`: whether the caches had the attribute (False for the unquantized baseline).
    """
    started = time.perf_counter()
    starts = window_starts(int(tokens.numel()), context, windows)
    device = _model_device(model)
    lo = _first_scored(skip)
    per_window = []
    quantized = False
    for start in tqdm(starts, desc=desc or "paper ppl", unit="window", disable=not progress, leave=False):
        window = tokens[start : start + context].to(device)  # (context,)
        cache = cache_factory()
        if hasattr(cache, "quantize_before_attention"):
            cache.quantize_before_attention = True
            quantized = True
        logits = forward_with_cache(model, window[None], cache, logits_to_keep=context - lo)
        offset = context - logits.shape[1]
        count = context - 1 - lo
        nll = _nll_sum(logits[0, lo - offset : context - 1 - offset], window[lo + 1 :])
        per_window.append(_window_record(start, nll, count, cache))
        del cache, logits
    return _summary(
        "paper",
        per_window,
        started,
        context=context,
        skip=skip,
        n_windows=len(starts),
        quantize_before_attention=quantized,
    )
