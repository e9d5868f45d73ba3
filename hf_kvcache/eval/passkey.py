"""Passkey retrieval: a number hidden at depth d of a synthetic haystack of about L tokens, read back by
greedy decoding through the cache.

The prompt is prefilled through the cache in one forward, as `generate` prefills it, then the answer is decoded
token by token from the same cache: every answer token attends to the stored (quantized) prompt, and only to
itself exactly. (`chunk=` prefills in chunks instead, each attending exactly to itself: the older, flattering
protocol.)

The haystack is made here from a few fixed filler sentences (no external data, same text every run). With
the model's chat template (when it has one) the instruction, haystack and question go in one user turn and
the assistant turn is opened with "The pass key is", so the tiny default model answers with the number
rather than a description of what a pass key is.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .forward import forward_with_cache

__all__ = ["PasskeyPrompt", "answer_has_key", "make_prompt", "passkey_grid", "passkey_trial"]

FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
# Wording measured on the default model (SmolLM2-135M-Instruct, 16-bit cache, 1 key per cell, depths
# 0/0.25/0.5/0.75/1): 100% at 1k, 2k and 4k tokens, 60% at 8k. The common "There is a pass key hidden
# inside a lot of irrelevant text ... What is the pass key?" fails at depth 0.1 of 2k: the model answers
# that a pass key is "a magical item"; saying it is a five-digit number fixes that.
INSTRUCTION = (
    "Below is a long text with a pass key (a five-digit number) hidden in it. Memorize the pass key."
)
QUESTION = "What is the pass key (the five-digit number)?"
ANSWER_PREFIX = "The pass key is"


@dataclass(frozen=True)
class PasskeyPrompt:
    """One passkey prompt: `input_ids (L,)` int64 (special tokens included, ready to feed), the `key`
    (5 digits), the requested `depth` and `needle_start`, the index of the needle's first token."""

    input_ids: torch.Tensor
    key: str
    depth: float
    needle_start: int

    @property
    def length(self) -> int:
        return int(self.input_ids.numel())


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _token_at(tokenizer, text: str, char: int) -> int:
    """Index of the token of `text` that holds character `char` (or the space before it)."""
    try:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except NotImplementedError:  # slow tokenizers: count the tokens before it
        return _n_tokens(tokenizer, text[:char].rstrip(" "))
    return next(i for i, (_, end) in enumerate(offsets) if end > char)


def _render(tokenizer, haystack: str, chat: bool) -> str:
    user = f"{INSTRUCTION}\n\n{haystack}\n\n{QUESTION}"
    if chat:
        messages = [{"role": "user", "content": user}]
        return (
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            + ANSWER_PREFIX
        )
    return f"{user}\n{ANSWER_PREFIX}"


def make_prompt(
    tokenizer, length: int, depth: float, key: str | int, *, chat: bool | None = None
) -> PasskeyPrompt:
    """A prompt of about `length` tokens (within one filler sentence) with the needle after a fraction
    `depth` (0..1) of the haystack's sentences. `chat=None` uses the chat template when the tokenizer
    has one."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth is a fraction of the context, 0..1; got {depth}")
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    key = str(key)
    needle = NEEDLE.format(key=key)

    def text_for(n_sentences: int) -> tuple[str, int]:
        sentences = [FILLER[i % len(FILLER)] for i in range(n_sentences)]
        cut = round(depth * n_sentences)
        before, after = " ".join(sentences[:cut]), " ".join(sentences[cut:])
        haystack = " ".join(part for part in (before, needle, after) if part)
        text = _render(tokenizer, haystack, chat)
        return text, text.index(needle)

    # Tokens per filler sentence measured once, then a few corrections: BPE merges across sentence
    # boundaries make the count only nearly additive.
    per_sentence = _n_tokens(tokenizer, " ".join(FILLER * 8)) / (8 * len(FILLER))
    n = max(0, round((length - _n_tokens(tokenizer, text_for(0)[0])) / per_sentence))
    for _ in range(4):
        text, _ = text_for(n)
        error = length - _n_tokens(tokenizer, text)
        step = round(error / per_sentence)
        if step == 0:
            break
        n = max(0, n + step)
    text, needle_char = text_for(n)
    input_ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    needle_start = _token_at(tokenizer, text, needle_char)
    return PasskeyPrompt(input_ids=input_ids, key=key, depth=depth, needle_start=needle_start)


def _stop_ids(tokenizer, model) -> set[int]:
    ids = set()
    for source in (
        tokenizer.eos_token_id,
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(source)
    return ids


@torch.inference_mode()
def passkey_trial(
    model, tokenizer, cache, prompt: PasskeyPrompt, *, chunk: int | None = None, max_new_tokens: int = 8
) -> dict:
    """Prefill `prompt` through `cache` (in one forward, or in chunks of `chunk` tokens), then greedy-decode up to
    `max_new_tokens` tokens from the same cache (stopping at eos). Success: the key appears in the answer
    as a whole number. Returns `{"length", "depth", "needle_start", "key", "answer", "answer_ids",
    "success"}`."""
    device = next(model.parameters()).device
    ids = prompt.input_ids.to(device)[None]  # (1, L)
    step = chunk or ids.shape[1]
    for s in range(0, ids.shape[1], step):
        logits = forward_with_cache(model, ids[:, s : s + step], cache, logits_to_keep=1)
    stop = _stop_ids(tokenizer, model)
    generated = []
    next_id = logits[:, -1].argmax(dim=-1, keepdim=True)  # (1, 1)
    for _ in range(max_new_tokens):
        generated.append(int(next_id))
        if int(next_id) in stop or len(generated) == max_new_tokens:
            break
        logits = forward_with_cache(model, next_id, cache, logits_to_keep=1)
        next_id = logits[:, -1].argmax(dim=-1, keepdim=True)
    answer = tokenizer.decode(generated, skip_special_tokens=True)
    return {
        "length": prompt.length,
        "depth": prompt.depth,
        "needle_start": prompt.needle_start,
        "key": prompt.key,
        "answer": answer,
        "answer_ids": generated,
        "success": answer_has_key(answer, prompt.key),
    }


def answer_has_key(answer: str, key: str) -> bool:
    """The key appears in the answer as a whole number ("58213." yes, "582130" or "5 8213" no)."""
    return re.search(rf"(?<!\d){re.escape(key)}(?!\d)", answer) is not None


def _key(seed: int, length: int, depth: float, trial: int) -> str:
    # A string seed is hashed deterministically (not by PYTHONHASHSEED): same keys in every run.
    return str(random.Random(f"passkey-{seed}-{length}-{depth}-{trial}").randint(10000, 99999))


def passkey_grid(
    model,
    tokenizer,
    cache_factory: Callable[[], object],
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int = 1,
    seed: int = 0,
    *,
    chunk: int | None = None,
    max_new_tokens: int = 8,
    progress: bool = True,
    desc: str | None = None,
) -> dict:
    """Passkey accuracy over a lengths x depths grid, `trials` keys per cell, a fresh cache per trial.

    Returns `{"accuracy": overall, "by_length": {str(L): acc}, "cells": [{"length", "depth",
    "accuracy", "trials": [passkey_trial(...) results]}], "lengths", "depths", "n_trials", "chunk",
    "max_new_tokens", "seconds"}` (lists rather than float-keyed maps, so it stays valid JSON).
    """
    started = time.perf_counter()
    cells = []
    total = len(lengths) * len(depths) * trials
    with tqdm(total=total, desc=desc or "passkey", unit="trial", disable=not progress, leave=False) as bar:
        for length in lengths:
            for depth in depths:
                results = []
                for trial in range(trials):
                    prompt = make_prompt(tokenizer, length, depth, _key(seed, length, depth, trial))
                    results.append(
                        passkey_trial(
                            model,
                            tokenizer,
                            cache_factory(),
                            prompt,
                            chunk=chunk,
                            max_new_tokens=max_new_tokens,
                        )
                    )
                    bar.update(1)
                cells.append(
                    {
                        "length": int(length),
                        "depth": float(depth),
                        "accuracy": sum(r["success"] for r in results) / len(results),
                        "trials": results,
                    }
                )
    by_length = {}
    for length in lengths:
        mine = [c["accuracy"] for c in cells if c["length"] == length]
        by_length[str(length)] = sum(mine) / len(mine)
    return {
        "accuracy": sum(c["accuracy"] for c in cells) / len(cells),
        "by_length": by_length,
        "cells": cells,
        "lengths": [int(x) for x in lengths],
        "depths": [float(x) for x in depths],
        "n_trials": trials,
        "chunk": chunk,
        "max_new_tokens": max_new_tokens,
        "seconds": round(time.perf_counter() - started, 3),
    }
