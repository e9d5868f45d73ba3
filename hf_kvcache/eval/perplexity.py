"""Perplexity through a cache, under the protocols of docs/evaluation.md.

- **Decode** (`decode_perplexity`, the default): windows in one batch, a prefill of `prefill` tokens through a fresh
  cache (one forward, as `generate` prefills), then `decode` tokens fed one at a time, teacher-forced, each scored.
  Only the token being fed is exact, as in generation. Against a baseline run on the same windows it also gives
  the mean KL divergence of the next-token distributions, top-1 agreement and an interval over windows.
- **Strict** (`strict_perplexity`, the papers' "fake quantization"): each window in one forward through a fresh
  cache with `cache.quantize_before_attention = True`, so every token, the new ones included, attends to quantized
  K/V (as KVQuant and QuaRot report). A cache without that attribute (transformers' DynamicCache, the baseline)
  just runs the plain forward.
- **Chunked stream** (`streaming_perplexity`, an option, never a headline): each window fed in chunks of `chunk`
  tokens, each chunk attending to the stored past and exactly to itself. A scored token sees up to `chunk - 1`
  exact neighbours, which flatters every cache without an exact window (measured on the default model:
  `turboquant-4` +0.74% with chunks of 64 at 1k, against +2.3-3.1% decoded).

The strict and stream protocols take `windows` windows of `context` tokens spread evenly over the corpus, the first
`skip` targets of each window unscored (they see too little context to say anything about the cache).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .forward import forward_with_cache
from .memory import cache_nbytes

__all__ = [
    "decode_perplexity",
    "decode_windows",
    "forward_with_cache",
    "paired_interval",
    "strict_perplexity",
    "streaming_perplexity",
    "window_starts",
]

# Rows of logits turned into float32 log-probabilities at a time: bounds the float32 copy of (rows, vocab).
_SCORE_ROWS = 256


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
def strict_perplexity(
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

    Returns the same keys as `streaming_perplexity` (protocol "strict", no `chunk`), plus
    `quantize_before_attention`: whether the caches had the attribute (False for the unquantized baseline).
    """
    started = time.perf_counter()
    starts = window_starts(int(tokens.numel()), context, windows)
    device = _model_device(model)
    lo = _first_scored(skip)
    per_window = []
    quantized = False
    for start in tqdm(starts, desc=desc or "strict ppl", unit="window", disable=not progress, leave=False):
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
        "strict",
        per_window,
        started,
        context=context,
        skip=skip,
        n_windows=len(starts),
        quantize_before_attention=quantized,
    )


def decode_windows(n_tokens: int, prefill: int, decode: int, windows: int) -> list[int]:
    """Start offsets of the decode protocol's windows (`prefill + decode + 1` tokens each), spread evenly over the
    corpus like `window_starts`. Windows may overlap when the corpus is short; their scored tokens (the last
    `decode` of each) are distinct as long as the starts differ by at least `decode`."""
    if prefill < 1 or decode < 1:
        raise ValueError(f"the decode protocol needs prefill >= 1 and decode >= 1 tokens, got {prefill}, {decode}")
    return window_starts(n_tokens, prefill + decode + 1, windows)


# Student's t 97.5% quantiles for 1-4 degrees of freedom, where the expansion below is off by more than 0.1%
_T975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764}


def _t_quantile(n: int, p: float = 0.975) -> float:
    """Student's t quantile with n degrees of freedom: the table above at p = 0.975 and n <= 4, else the
    Cornish-Fisher expansion around the normal quantile (within 0.11% of the exact value from n = 5 up)."""
    if p == 0.975 and n in _T975:
        return _T975[n]
    z = math.sqrt(2) * torch.erfinv(torch.tensor(2 * p - 1, dtype=torch.float64)).item()
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / n + g2 / n**2 + g3 / n**3


def paired_interval(differences: list[float], scale: float = 1.0) -> dict:
    """Mean and 95% interval (Student's t over the windows) of per-window paired differences, times `scale`:
    `{"mean", "half_width", "low", "high", "n"}`; half_width is None for a single window."""
    n = len(differences)
    mean = sum(differences) / n
    if n < 2:
        half = None
    else:
        sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
        half = _t_quantile(n - 1) * sd / math.sqrt(n) * scale
    mean *= scale
    return {"mean": mean, "half_width": half, "low": None if half is None else mean - half,
            "high": None if half is None else mean + half, "n": n}


@torch.inference_mode()
def decode_perplexity(
    model,
    tokens: torch.Tensor,
    cache_factory: Callable[[], object],
    *,
    prefill: int = 1024,
    decode: int = 64,
    windows: int = 16,
    batch_size: int | None = None,
    reference: dict | None = None,
    keep_logprobs: bool = False,
    progress: bool = True,
    desc: str | None = None,
) -> dict:
    """The decode protocol: `windows` windows of `tokens (N,)`, `batch_size` of them at a time in one batch (None:
    all), each batch through a fresh `cache_factory()`: a prefill of `prefill` tokens in one forward, then
    `decode` tokens fed one at a time, teacher-forced. Decode step t feeds token `prefill + t` and is scored on
    token `prefill + t + 1`: exactly as `generate` uses the cache, every scored token attends exactly to itself
    and to the stored (quantized) past. The prefill's own last logit attends to exact K/V only and is not scored.

    `reference`: the result of the baseline's call on the same windows with `keep_logprobs=True` (its
    `"logprobs" (W, T, V)` float32, the next-token log-distributions). Given one, the result also holds, against
    it: `delta_nll_pct` (100 x (nll / nll_ref - 1)) with `delta_interval` (a paired t interval over windows, in the
    same points), `kl` (mean over scored positions of KL(ref || this), nats), `top1` (share of positions whose
    argmax equals the reference's) and `top1_interval`.

    Returns `{"protocol": "decode", "nll", "ppl", "tokens", "windows": [{"start", "nll", "tokens", "cache_tokens",
    "cache_nbytes"}], "prefill", "decode", "n_windows", "batch_size", "cache_nbytes" (held by one batch's cache at
    the end), "cache_rows", "seconds", ...}`; with `keep_logprobs`, also `"logprobs"` (a tensor: pop it before
    writing JSON).
    """
    started = time.perf_counter()
    starts = decode_windows(int(tokens.numel()), prefill, decode, windows)
    if reference is not None and reference.get("starts") != starts:
        raise ValueError("the reference was measured on other windows (prefill, decode or windows differ)")
    if reference is not None and "logprobs" not in reference:
        raise ValueError("the reference holds no logprobs: run it with keep_logprobs=True")
    device = _model_device(model)
    batch = len(starts) if batch_size is None else max(1, min(int(batch_size), len(starts)))
    length = prefill + decode + 1
    nll = torch.empty(len(starts), decode, dtype=torch.float64)
    kl = torch.empty(len(starts), decode, dtype=torch.float64) if reference is not None else None
    agree = torch.empty(len(starts), decode, dtype=torch.bool) if reference is not None else None
    kept = [] if keep_logprobs else None
    per_window, held_bytes, cache_rows = [], 0, 0
    n_batches = math.ceil(len(starts) / batch)
    with tqdm(total=n_batches * (decode + 1), desc=desc or "decode ppl", unit="step", disable=not progress,
              leave=False) as bar:
        for lo in range(0, len(starts), batch):
            rows = starts[lo : lo + batch]
            ids = torch.stack([tokens[s : s + length] for s in rows]).to(device)  # (b, P + T + 1)
            cache = cache_factory()
            forward_with_cache(model, ids[:, :prefill], cache, logits_to_keep=1)
            bar.update(1)
            steps, step_nll, step_kl, step_agree = [], [], [], []  # on the device until the batch ends: no sync
            for t in range(decode):
                logits = forward_with_cache(model, ids[:, prefill + t : prefill + t + 1], cache)[:, -1]  # (b, V)
                logp = F.log_softmax(logits.float(), dim=-1)
                step_nll.append(-logp.gather(1, ids[:, prefill + t + 1, None])[:, 0])
                if reference is not None:
                    ref = reference["logprobs"][lo : lo + len(rows), t].to(logp.device)
                    step_kl.append((ref.exp() * (ref - logp)).sum(-1))
                    step_agree.append(ref.argmax(-1) == logp.argmax(-1))
                if kept is not None:
                    steps.append(logp)
                bar.update(1)
            nll[lo : lo + len(rows)] = torch.stack(step_nll, 1).double().cpu()  # (b, T)
            if reference is not None:
                kl[lo : lo + len(rows)] = torch.stack(step_kl, 1).double().cpu()
                agree[lo : lo + len(rows)] = torch.stack(step_agree, 1).cpu()
            if kept is not None:
                kept.append(torch.stack(steps, dim=1))  # (b, T, V)
            held_bytes, cache_rows = cache_nbytes(cache), len(rows)
            for i, start in enumerate(rows):
                per_window.append({"start": start, "nll": nll[lo + i].mean().item(), "tokens": decode,
                                   "cache_tokens": prefill + decode, "cache_nbytes": held_bytes / len(rows)})
            del cache
    result = _summary("decode", per_window, started, prefill=prefill, decode=decode, n_windows=len(starts),
                      batch_size=batch, starts=starts, cache_nbytes=held_bytes, cache_rows=cache_rows)
    if reference is not None:
        base = reference["windows"]
        result["delta_nll_pct"] = 100.0 * (result["nll"] / reference["nll"] - 1.0)
        result["delta_interval"] = paired_interval([w["nll"] - b["nll"] for w, b in zip(per_window, base)],
                                                   scale=100.0 / reference["nll"])
        result["kl"] = kl.mean().item()
        result["kl_interval"] = paired_interval(kl.mean(1).tolist())
        result["top1"] = agree.double().mean().item()
        result["top1_interval"] = paired_interval(agree.double().mean(1).tolist())
    if kept is not None:
        result["logprobs"] = torch.cat(kept)
    return result
