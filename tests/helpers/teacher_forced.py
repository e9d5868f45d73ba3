"""Teacher-forced loss of DynamicCache's own greedy continuation, fed back token by token through a cache (each
token attends to the stored, quantized past), relative to DynamicCache's. Exact token equality is too strict
where two logits nearly tie; this measures what the cache costs on the text the model itself prefers.

Used by tests/test_generate.py; run as a script for ablations on the default model (float32, CPU):

    python -m tests.helpers.teacher_forced fp8-e4m3 fp8-e4m3:sink_tokens=4 int8
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from hf_kvcache import _compat, make_cache

WRITTEN_PROMPTS = [
    "The history of the Roman Empire begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "In a small village at the foot of the mountains, there lived",
    "Photosynthesis is the process by which plants",
    "The best way to learn a new language is",
    "Once upon a time, a young engineer",
    "Quantum computers differ from classical computers because",
    "Here is a recipe for a simple tomato soup:",
    "The French Revolution was caused by",
    "To install the package, run the following command:",
    "Dear hiring manager, I am writing to apply for",
    "The theory of evolution by natural selection",
    "SELECT name, age FROM users WHERE",
    "The main causes of climate change are",
    "A haiku about the ocean:",
    "In machine learning, overfitting happens when",
]


def topic_openings(count: int, words: int = 25) -> list[str]:
    """The first words of every tenth pydoc topic (the dev text), in sorted order."""
    import pydoc_data.topics

    names = sorted(pydoc_data.topics.topics)[::10][:count]
    return [" ".join(pydoc_data.topics.topics[name].split()[:words]) for name in names]


def default_prompts() -> list[str]:
    """24 prompts: the 16 written above and 8 pydoc topic openings."""
    return WRITTEN_PROMPTS + topic_openings(8)


@dataclass
class Continuation:
    """DynamicCache's greedy continuation of a left-padded batch, and what feeding it back needs."""

    sequences: torch.Tensor  # (rows, prompt + new): prompt ids then the continuation
    prompt_length: int
    mask: torch.Tensor  # attention mask over `sequences`
    positions: torch.Tensor  # position ids as generate numbers a left-padded row
    logits: torch.Tensor  # (rows, new, vocab): DynamicCache's own teacher-forced logits

    @property
    def targets(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_length:]


def greedy_continuation(model, tok, prompts: list[str], new_tokens: int) -> Continuation:
    batch = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(
        **batch, max_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
        **_compat.cache_kwargs(DynamicCache(config=model.config)),
    )
    n0 = batch.input_ids.shape[1]
    new = out.sequences.shape[1] - n0
    mask = torch.cat([batch.attention_mask, torch.ones(len(prompts), new, dtype=torch.long)], 1)
    # generate's own logits are DynamicCache's teacher-forced ones: the same inputs, positions and cache.
    return Continuation(out.sequences, n0, mask, (mask.cumsum(-1) - 1).clamp(min=0), torch.stack(out.logits, 1))


def teacher_forced_logits(model, cont: Continuation, cache) -> torch.Tensor:
    """The prompt in one prefill, then each continuation token in its own step through `cache`."""
    seq, n0 = cont.sequences, cont.prompt_length
    steps = [(0, n0)] + [(t, t + 1) for t in range(n0, seq.shape[1] - 1)]
    with torch.inference_mode():
        return torch.cat([
            model(
                input_ids=seq[:, a:b], attention_mask=cont.mask[:, :b], position_ids=cont.positions[:, a:b],
                **_compat.cache_kwargs(cache),
            ).logits[:, -1:]
            for a, b in steps
        ], 1)


def loss(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean cross-entropy over every row and token (rows have equal lengths: pooled)."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).item()


def main(argv: list[str] | None = None) -> None:
    from hf_kvcache import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("specs", nargs="+", help="cache specs, e.g. fp8-e4m3 int8 fp8-e4m3:sink_tokens=4")
    parser.add_argument("--prompts", type=int, default=24, help="the first N of the 24 default prompts")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (CI has 2 cores)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(dtype=torch.float32, device="cpu")
    cont = greedy_continuation(model, tok, default_prompts()[: args.prompts], args.new_tokens)
    base = loss(cont.logits, cont.targets)
    print(f"DynamicCache {base:.4f} ({len(cont.sequences)} prompts x {cont.targets.shape[1]} tokens)", flush=True)
    for spec in args.specs:
        start = time.perf_counter()
        logits = teacher_forced_logits(model, cont, make_cache(spec, model))
        rows = torch.tensor([
            loss(logits[i : i + 1], cont.targets[i : i + 1]) / loss(cont.logits[i : i + 1], cont.targets[i : i + 1]) - 1
            for i in range(len(cont.sequences))
        ])
        print(
            f"{spec:40s} pooled {loss(logits, cont.targets) / base - 1:+.2%}   per-row mean {rows.mean():+.2%} "
            f"(standard error {rows.std() / len(rows) ** 0.5:.2%})   {time.perf_counter() - start:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
