"""Passkey retrieval: the haystack (length, needle depth, template) and the decode loop through the cache,
on a byte-level tokenizer and a tiny random model (which retrieves nothing: only the mechanics are tested)."""

from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import DynamicCache, PreTrainedTokenizerFast

from hf_kvcache.eval import passkey
from hf_kvcache.eval.passkey import answer_has_key, make_prompt, passkey_grid, passkey_trial
from tests.helpers.tiny_models import tiny_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(chat: bool = True) -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (ids 5..260) plus 5 special tokens: fits the tiny models' vocab of 512,
    builds in milliseconds, needs no files. `chat` gives it a ChatML template like SmolLM2's."""
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=specials[3:],
    )
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


LONGEST_FILLER = max(len(s) + 1 for s in passkey.FILLER)  # in bytes = tokens here, with its space


@pytest.mark.parametrize("length", [400, 1000, 2048])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_prompt_has_about_length_tokens_and_the_needle_at_depth(tokenizer, length, depth):
    prompt = make_prompt(tokenizer, length, depth, 31415)
    assert abs(prompt.length - length) <= LONGEST_FILLER, prompt.length
    needle = passkey.NEEDLE.format(key="31415")
    text = tokenizer.decode(prompt.input_ids[prompt.needle_start :])
    assert text.removeprefix(" ").startswith(needle), text[:80]
    # Depth is a fraction of the haystack, which sits between the instruction and the question.
    full = tokenizer.decode(prompt.input_ids)
    hay_start = full.index(passkey.INSTRUCTION) + len(passkey.INSTRUCTION) + 2
    hay_end = full.index(passkey.QUESTION) - 2
    hay_len = hay_end - hay_start - len(needle) - 1
    measured = (full.index(needle) - hay_start) / hay_len
    assert measured == pytest.approx(depth, abs=LONGEST_FILLER / hay_len + 1e-9)


def test_chat_template_used_when_present_and_answer_opened(tokenizer):
    chat = tokenizer.decode(make_prompt(tokenizer, 300, 0.5, 12345).input_ids)
    assert chat.startswith("<|im_start|>user\n")
    assert chat.endswith("<|im_start|>assistant\n" + passkey.ANSWER_PREFIX)
    plain = byte_tokenizer(chat=False).decode(
        make_prompt(byte_tokenizer(chat=False), 300, 0.5, 12345).input_ids
    )
    assert "<|im_start|>" not in plain
    assert plain.startswith(passkey.INSTRUCTION)
    assert plain.endswith(passkey.QUESTION + "\n" + passkey.ANSWER_PREFIX)


def test_bad_depth_refused(tokenizer):
    with pytest.raises(ValueError, match="depth"):
        make_prompt(tokenizer, 300, 1.5, 12345)


@pytest.mark.parametrize(
    ("answer", "found"),
    [
        (" 58213.", True),
        ("58213", True),
        ("is 58213 and", True),
        ("582130", False),
        ("158213", False),
        ("5 8213", False),
        ("", False),
    ],
)
def test_answer_has_key_as_a_whole_number(answer, found):
    assert answer_has_key(answer, "58213") is found


class CountingCache(DynamicCache):
    """Records, per forward, how many tokens were new and how many were already stored (layer 0)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            self.steps.append((key_states.shape[-2], self.get_seq_length(0)))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def test_prefill_goes_through_the_cache_in_chunks_then_decodes_from_it(model, tokenizer):
    prompt = make_prompt(tokenizer, 300, 0.5, 12345)
    cache = CountingCache(config=model.config)
    result = passkey_trial(model, tokenizer, cache, prompt, chunk=64, max_new_tokens=6)
    n_chunks = math.ceil(prompt.length / 64)
    new, stored = zip(*cache.steps, strict=True)
    assert new == (64,) * (n_chunks - 1) + (prompt.length - 64 * (n_chunks - 1),) + (1,) * 5
    assert stored == tuple(range(0, prompt.length, 64)) + tuple(range(prompt.length, prompt.length + 5))
    assert len(result["answer_ids"]) == 6  # the tiny model has no eos: always max_new_tokens
    assert result["key"] == "12345" and result["success"] is False
    cache = CountingCache(config=model.config)  # by default the prompt in one forward, as generate prefills it
    passkey_trial(model, tokenizer, cache, prompt, max_new_tokens=3)
    assert cache.steps == [(prompt.length, 0), (1, prompt.length), (1, prompt.length + 1)]


def test_decode_loop_matches_generate(model, tokenizer):
    # Chunked prefill + the manual greedy loop give what generate() gives from one prefill forward.
    prompt = make_prompt(tokenizer, 200, 0.2, 12345)
    result = passkey_trial(
        model, tokenizer, DynamicCache(config=model.config), prompt, chunk=48, max_new_tokens=8
    )
    with torch.inference_mode():
        out = model.generate(
            prompt.input_ids[None],
            attention_mask=torch.ones(1, prompt.length, dtype=torch.long),
            do_sample=False,
            max_new_tokens=8,
            pad_token_id=0,
        )
    assert result["answer_ids"] == out[0, prompt.length :].tolist()


def test_grid_is_deterministic_and_complete(model, tokenizer):
    def run():
        return passkey_grid(
            model,
            tokenizer,
            lambda: DynamicCache(config=model.config),
            [150, 250],
            [0.0, 1.0],
            trials=2,
            seed=3,
            chunk=100,
            max_new_tokens=2,
            progress=False,
        )

    first, second = run(), run()
    assert [(c["length"], c["depth"]) for c in first["cells"]] == [
        (150, 0.0),
        (150, 1.0),
        (250, 0.0),
        (250, 1.0),
    ]
    keys = [t["key"] for c in first["cells"] for t in c["trials"]]
    assert keys == [t["key"] for c in second["cells"] for t in c["trials"]]
    assert len(set(keys)) == len(keys) and all(len(k) == 5 for k in keys)
    assert set(first["by_length"]) == {"150", "250"}
    assert 0.0 <= first["accuracy"] <= 1.0 and first["n_trials"] == 2
