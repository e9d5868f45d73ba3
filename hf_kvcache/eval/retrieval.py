"""Retrieval with statistical power: generated needle tasks, tens of samples per (task, length) cell, answered by
`model.generate` through the cache as a user runs it (one prefill of the prompt, then greedy decoding).

Tasks (after RULER's needle-in-a-haystack family, generated here from fixed word lists and seeds, no data):
- `multikey`: `keys` needles "One of the special magic numbers for <key> is: <value>." at random depths, each with
  its own key and a 7-digit value; the question asks for one key's number. Success: that number in the answer.
- `multivalue`: one key with `values` numbers at random depths; the question asks for all of them. Score: the share
  of them in the answer.
- `vartrack`: a chain of variable assignments "VAR <X> = <number>." then "VAR <Y> = VAR <X>." ... spread over the
  haystack, with a second chain of another number as a distractor; the question asks which variables hold the first
  number. Score: the share of the chain's variables named in the answer.

A cell's accuracy comes with a 95% interval: Wilson's for binary scores, Student's t over samples for shares.
Samples are batched (left padding through the tokenizer, which `load_model` sets up) with a fresh cache a batch.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .. import _compat
from .passkey import FILLER, _n_tokens

__all__ = ["MAX_NEW_TOKENS", "TASKS", "RetrievalSample", "make_sample", "retrieval_grid", "score", "wilson_interval"]

TASKS = ("multikey", "multivalue", "vartrack")
# Tokens generated per task: a 7-digit number takes 3-4 of the default tokenizer's tokens, so one answer fits 16;
# several numbers or variable names with the words around them need more
MAX_NEW_TOKENS = {"multikey": 16, "multivalue": 64, "vartrack": 48}

_WORDS = (
    "amber", "anchor", "apple", "arrow", "aspen", "badger", "bamboo", "banjo", "beacon", "birch", "bison", "blossom",
    "bronze", "cactus", "canyon", "carbon", "cedar", "cobalt", "comet", "copper", "coral", "crystal", "delta",
    "desert", "dragon", "eagle", "ember", "falcon", "fern", "forest", "glacier", "granite", "harbor", "hazel",
    "helmet", "island", "ivory", "jasper", "juniper", "kettle", "lagoon", "lantern", "lemon", "lotus", "magnet",
    "maple", "marble", "meadow", "meteor", "mirror", "nectar", "nickel", "oasis", "olive", "onyx", "orchid", "otter",
    "pebble", "pepper", "pine", "planet", "quartz", "raven", "river", "saffron", "salmon", "silver", "spruce",
    "summit", "thunder", "tiger", "timber", "topaz", "tulip", "valley", "velvet", "violet", "walnut", "willow",
    "zephyr",
)


@dataclass(frozen=True)
class RetrievalSample:
    """One prompt: `input_ids (L,)` (special tokens included, ending where the answer starts), the `answers` to find
    in the generated text, whether the score is all-or-nothing (`binary`) or the share found, and the needles'
    depths (fractions of the haystack)."""

    task: str
    input_ids: torch.Tensor
    answers: tuple[str, ...]
    binary: bool
    depths: tuple[float, ...]

    @property
    def length(self) -> int:
        return int(self.input_ids.numel())


def _needles(task: str, rng: random.Random, keys: int, values: int, hops: int):
    """(needle sentences, answers, instruction, question, answer prefix, binary) of one sample."""
    number = lambda: str(rng.randint(1_000_000, 9_999_999))  # noqa: E731
    if task == "multikey":
        names = [f"{a}-{b}" for a, b in (rng.sample(_WORDS, 2) for _ in range(keys))]
        while len(set(names)) < keys:
            names = [f"{a}-{b}" for a, b in (rng.sample(_WORDS, 2) for _ in range(keys))]
        numbers = [number() for _ in names]
        asked = rng.randrange(keys)
        sentences = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(names, numbers)]
        return (sentences, (numbers[asked],),
                "Below is a long text with special magic numbers hidden in it, each for a different key. "
                "Memorize them.",
                f"What is the special magic number for {names[asked]}?",
                f"The special magic number for {names[asked]} is", True)
    if task == "multivalue":
        name = "-".join(rng.sample(_WORDS, 2))
        numbers = [number() for _ in range(values)]
        sentences = [f"One of the special magic numbers for {name} is: {v}." for v in numbers]
        return (sentences, tuple(numbers),
                f"Below is a long text with several special magic numbers for {name} hidden in it. Memorize them.",
                f"What are all the special magic numbers for {name}?",
                f"The special magic numbers for {name} are", False)
    if task == "vartrack":
        names = []
        while len(names) < 2 * (hops + 1):  # five capital letters each, as RULER's variables
            name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
            names += [] if name in names else [name]
        chain, other = names[: hops + 1], names[hops + 1 :]
        value, decoy = number(), number()
        sentences = [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        decoys = [f"VAR {other[0]} = {decoy}."] + [f"VAR {b} = VAR {a}." for a, b in zip(other, other[1:])]
        # the two chains interleaved, each in its own order
        merged, i, j = [], 0, 0
        while i < len(sentences) or j < len(decoys):
            if j >= len(decoys) or (i < len(sentences) and rng.random() < 0.5):
                merged.append(sentences[i])
                i += 1
            else:
                merged.append(decoys[j])
                j += 1
        return (merged, tuple(chain),
                "Below is a long text with variable assignments hidden in it. Memorize them and follow the chains.",
                f"Find all variables that are assigned the value {value} in the text above.",
                f"Answer: the variables assigned the value {value} are", False)
    raise ValueError(f"unknown retrieval task {task!r}; choose from {', '.join(TASKS)}")


def make_sample(tokenizer, task: str, length: int, seed: int, *, keys: int = 4, values: int = 4, hops: int = 1,
                chat: bool | None = None) -> RetrievalSample:
    """A `task` prompt of about `length` tokens (within one filler sentence), its needles at sorted random depths
    drawn from `seed` (as are keys and values). `chat=None` uses the chat template when the tokenizer has one."""
    if task not in TASKS:
        raise ValueError(f"unknown retrieval task {task!r}; choose from {', '.join(TASKS)}")
    rng = random.Random(f"retrieval-{task}-{length}-{seed}")
    needles, answers, instruction, question, prefix, binary = _needles(task, rng, keys, values, hops)
    depths = sorted(rng.random() for _ in needles)
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))

    def render(n_sentences: int) -> str:
        sentences = [FILLER[i % len(FILLER)] for i in range(n_sentences)]
        for k, (depth, needle) in enumerate(zip(depths, needles)):  # later needles after earlier ones
            sentences.insert(round(depth * n_sentences) + k, needle)
        user = f"{instruction}\n\n{' '.join(sentences)}\n\n{question}"
        if chat:
            return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                 add_generation_prompt=True) + prefix
        return f"{user}\n{prefix}"

    per_sentence = _n_tokens(tokenizer, " ".join(FILLER * 8)) / (8 * len(FILLER))
    n = max(0, round((length - _n_tokens(tokenizer, render(0))) / per_sentence))
    for _ in range(4):  # BPE merges across sentences make the count only nearly additive
        step = round((length - _n_tokens(tokenizer, render(n))) / per_sentence)
        if step == 0:
            break
        n = max(0, n + step)
    ids = torch.tensor(tokenizer(render(n), add_special_tokens=False)["input_ids"], dtype=torch.long)
    return RetrievalSample(task=task, input_ids=ids, answers=answers, binary=binary, depths=tuple(depths))


def _found(answer: str, target: str) -> bool:
    return re.search(rf"(?<![0-9A-Za-z]){re.escape(target)}(?![0-9A-Za-z])", answer) is not None


def score(sample: RetrievalSample, answer: str) -> float:
    """1/0 for a binary task (the answer holds the target), else the share of the answers it holds."""
    hits = [_found(answer, a) for a in sample.answers]
    if sample.binary:
        return float(all(hits))
    return sum(hits) / len(hits)


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% score interval of a binomial proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def _interval(scores: list[float], binary: bool) -> tuple[float, float]:
    from .perplexity import paired_interval

    n = len(scores)
    if binary:
        return wilson_interval(sum(scores), n)
    got = paired_interval(scores)
    if got["half_width"] is None:
        return (0.0, 1.0)
    return (max(0.0, got["low"]), min(1.0, got["high"]))


@torch.inference_mode()
def _generate(model, tokenizer, cache, samples: list[RetrievalSample], max_new_tokens: int) -> list[str]:
    """Greedy answers of a batch of prompts, left-padded, through `cache`."""
    device = next(model.parameters()).device
    width = max(s.length for s in samples)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, width - s.length :] = s.input_ids
        mask[i, width - s.length :] = 1
    out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=pad, **_compat.cache_kwargs(cache, model))
    return [tokenizer.decode(row[width:], skip_special_tokens=True) for row in out.cpu()]


def retrieval_grid(
    model,
    tokenizer,
    cache_factory: Callable[[], object],
    tasks: Sequence[str] = TASKS,
    lengths: Sequence[int] = (2048, 4096, 8192),
    samples: int = 50,
    *,
    batch_size: int = 25,
    seed: int = 0,
    max_new_tokens: int | None = None,
    progress: bool = True,
    desc: str | None = None,
) -> dict:
    """Accuracy of every (task, length) cell over `samples` generated prompts (seeds 0..samples-1 past `seed`: the
    same prompts for every cache), `batch_size` prompts a `generate` call with a fresh cache each, greedy, up to
    `max_new_tokens` tokens (None: `MAX_NEW_TOKENS` of the task).

    Returns `{"accuracy": mean over cells, "cells": [{"task", "length", "accuracy", "low", "high", "n",
    "mean_tokens", "answers": [generated texts]}], "tasks", "lengths", "samples", "seconds"}`.
    """
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"unknown retrieval task {task!r}; choose from {', '.join(TASKS)}")
    started = time.perf_counter()
    cells = []
    total = len(tasks) * len(lengths) * math.ceil(samples / batch_size)
    with tqdm(total=total, desc=desc or "retrieval", unit="batch", disable=not progress, leave=False) as bar:
        for task in tasks:
            for length in lengths:
                prompts = [make_sample(tokenizer, task, int(length), seed + i) for i in range(samples)]
                answers = []
                for lo in range(0, samples, batch_size):
                    answers += _generate(model, tokenizer, cache_factory(), prompts[lo : lo + batch_size],
                                         max_new_tokens or MAX_NEW_TOKENS[task])
                    bar.update(1)
                scores = [score(s, a) for s, a in zip(prompts, answers)]
                low, high = _interval(scores, prompts[0].binary)
                cells.append({"task": task, "length": int(length), "accuracy": sum(scores) / len(scores),
                              "low": low, "high": high, "n": len(scores),
                              "mean_tokens": sum(p.length for p in prompts) / len(prompts), "answers": answers})
    return {"accuracy": sum(c["accuracy"] for c in cells) / len(cells), "cells": cells, "tasks": list(tasks),
            "lengths": [int(x) for x in lengths], "samples": samples, "seconds": round(time.perf_counter() - started, 3)}
