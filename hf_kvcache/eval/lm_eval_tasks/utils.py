"""Dataset builders and scoring of hf-kvcache's offline lm-eval tasks (referenced by the YAML files beside it)."""

from __future__ import annotations

import datasets

from hf_kvcache.eval import passkey as _passkey

DEFAULT_LENGTHS = (1024, 2048)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)


def _tokenizer(pretrained=None, tokenizer=None):
    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer
    from hf_kvcache.models import DEFAULT_MODEL, load_model

    return load_model(tokenizer or pretrained or DEFAULT_MODEL)[1]


def passkey_dataset(lengths=DEFAULT_LENGTHS, depths=DEFAULT_DEPTHS, trials: int = 1, seed: int = 0,
                    pretrained=None, tokenizer=None, **_) -> dict[str, datasets.Dataset]:
    """One document a (length, depth, trial): `input` (the prompt as text, the model's chat template applied,
    ending where the answer starts), `key`, `length` (tokens), `depth`."""
    tok = _tokenizer(pretrained, tokenizer)
    rows = []
    for length in lengths:
        for depth in depths:
            for trial in range(int(trials)):
                key = _passkey._key(seed, int(length), float(depth), trial)
                prompt = _passkey.make_prompt(tok, int(length), float(depth), key)
                text = tok.decode(prompt.input_ids, skip_special_tokens=False)
                rows.append({"input": text, "key": key, "length": prompt.length, "depth": float(depth)})
    return {"test": datasets.Dataset.from_list(rows)}


def passkey_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"acc": float(_passkey.answer_has_key(results[0], doc["key"]))}


def ppl_dataset(n_docs: int = 16, min_chars: int = 1500, max_chars: int = 8000, **_) -> dict[str, datasets.Dataset]:
    """`n_docs` topics of the dev corpus (`pydoc_data.topics`, sorted keys, every k-th of those with `min_chars`
    to `max_chars` characters): one document each, `text` and `topic`."""
    from pydoc_data.topics import topics

    keys = [k for k in sorted(topics) if min_chars <= len(topics[k].strip()) <= max_chars]
    step = max(len(keys) // int(n_docs), 1)
    picked = keys[::step][: int(n_docs)]
    return {"test": datasets.Dataset.from_list([{"topic": k, "text": topics[k].strip()} for k in picked])}


def ppl_results(doc: dict, results: list) -> dict:
    (loglikelihood,) = results
    n_words = len(doc["text"].split())
    n_bytes = len(doc["text"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, n_words), "byte_perplexity": (loglikelihood, n_bytes),
            "bits_per_byte": (loglikelihood, n_bytes)}


def topics_dataset(n_docs: int = 100, passage_chars: int = 600, n_choices: int = 4, seed: int = 0,
                   **_) -> dict[str, datasets.Dataset]:
    """Multiple choice from `pydoc_data.topics`: `passage` (the first `passage_chars` characters of a topic, cut at
    a word), `choices` (its name and `n_choices - 1` others, shuffled with `seed`), `label` (the right index)."""
    import random

    from pydoc_data.topics import topics

    keys = [k for k in sorted(topics) if len(topics[k].strip()) >= passage_chars]
    step = max(len(keys) // int(n_docs), 1)
    rows = []
    for i, key in enumerate(keys[::step][: int(n_docs)]):
        rng = random.Random(f"topics-{seed}-{key}")
        choices = [key, *rng.sample([k for k in keys if k != key], int(n_choices) - 1)]
        rng.shuffle(choices)
        text = topics[key].strip()[: int(passage_chars)]
        rows.append({"passage": text.rsplit(" ", 1)[0], "choices": choices, "label": choices.index(key)})
    return {"test": datasets.Dataset.from_list(rows)}
