"""Tiny random-weight decoder-only models for tests: built from configs, no hub access, deterministic.

Every model is float32, in eval mode, 3 layers, hidden size 128, vocab 512, 2048 positions, and builds in
a few tens of milliseconds. Weights are drawn from a fixed seed inside `torch.random.fork_rng`, so building a
model neither depends on nor disturbs the caller's RNG. `initializer_range` is 0.1 rather than the usual
0.02 so that attention is not almost uniform: a quantized cache must then change the logits measurably.

| name    | class              | q/kv heads | head_dim | what it exercises                             |
|---------|--------------------|------------|----------|-----------------------------------------------|
| llama   | LlamaForCausalLM   | 4 / 2      | 64       | GQA, the plain case                           |
| qwen2   | Qwen2ForCausalLM   | 4 / 2      | 32       | q/k/v bias drawn N(0, 0.5), not zero-init     |
| qwen3   | Qwen3ForCausalLM   | 4 / 2      | 128      | QK-norm, head_dim 128                         |
| mistral | MistralForCausalLM | 4 / 2      | 64       | sliding_window=32 on every layer              |
| gemma   | Gemma3ForCausalLM  | 4 / 2      | 64       | layers sliding(16) / full / sliding           |
| mqa     | LlamaForCausalLM   | 4 / 1      | 64       | a single kv head                              |

Which layers transformers treats as sliding (`transformers.cache_utils.get_layer_types_and_kwargs`, which is
what `DynamicCache(config=...)` and therefore `generate()` use; identical on 5.17 and 5.24):

- llama, mqa: no `layer_types` attribute, `sliding_window` absent -> all `full_attention`.
- qwen2, qwen3: `layer_types` is set by the config (`use_sliding_window=False` clears `sliding_window`) ->
  all `full_attention`.
- mistral: no `layer_types` attribute (MistralConfig warns if given one); `sliding_window=32` is not None,
  so every layer is inferred `sliding_attention` -> `DynamicSlidingWindowLayer(sliding_window=32)` on all
  3 layers, which keeps only the last 31 tokens once more than 32 have passed.
- gemma: explicit `layer_types = [sliding_attention, full_attention, sliding_attention]`, sliding_window 16
  -> `DynamicSlidingWindowLayer` (keeps 15 tokens), `DynamicLayer`, `DynamicSlidingWindowLayer`.

Gemma3 (text) rather than Gemma2: transformers 5.24 refuses `sdpa` for Gemma2 (`_supports_sdpa = False`,
because of its attention-logit softcapping) while 5.17 accepted it; Gemma3 has no softcapping and runs
with `sdpa` and `eager` on both versions.

Differences between transformers 5.17 and 5.24 that matter for these configs:

- `get_layer_types_and_kwargs` returns one kwargs dict shared by all layers on 5.17 and a list of per-layer
  dicts on 5.24 (5.24 reads `config.per_layer_config`, for heterogeneous configs). Layer types are the same.
- `generate()` returns the cache as `out.past_key_values` on 5.17 and `out.cache` on 5.24 (where the old name
  warns); `cache_of(out)` below reads either.
- Gemma2 with `sdpa`: accepted on 5.17, refused on 5.24 (see above).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

SEED = 0
VOCAB_SIZE = 512
PAD_ID = 0
# Token ids used in inputs start here: 0 is padding, 1 and 2 are bos/eos in some configs.
FIRST_TOKEN_ID = 3

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    initializer_range=0.1,
    pad_token_id=PAD_ID,
    bos_token_id=1,
    # No eos: greedy generation always produces exactly max_new_tokens, whatever the random weights say.
    eos_token_id=None,
    tie_word_embeddings=False,
)


def _llama() -> PretrainedConfig:
    return LlamaConfig(**_COMMON, head_dim=64)


def _qwen2() -> PretrainedConfig:
    return Qwen2Config(**_COMMON)  # head_dim = 128 / 4 = 32; Qwen2 always has q/k/v bias


def _qwen3() -> PretrainedConfig:
    return Qwen3Config(**_COMMON, head_dim=128)


def _mistral() -> PretrainedConfig:
    return MistralConfig(**_COMMON, head_dim=64, sliding_window=32)


def _gemma() -> PretrainedConfig:
    return Gemma3TextConfig(
        **_COMMON,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )


def _mqa() -> PretrainedConfig:
    return LlamaConfig(**{**_COMMON, "num_key_value_heads": 1}, head_dim=64)


TINY_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma": _gemma,
    "mqa": _mqa,
}
# Names of the configs whose cache has sliding-window layers (see the module docstring).
SLIDING_CONFIGS = ("mistral", "gemma")


def tiny_model(name: str, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A fresh tiny model (float32, eval mode, same weights on every call for the same `name`).

    Built anew each call rather than cached: tests may patch a model (hooks, fused weights), and building
    costs a few tens of milliseconds.
    """
    if name not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny model {name!r}; choose from {sorted(TINY_CONFIGS)}")
    config = TINY_CONFIGS[name]()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=torch.float32
        )
        if name == "qwen2":
            # The zero init would make the bias a no-op; real Qwen2 keys carry large per-channel offsets.
            with torch.no_grad():
                for layer in model.model.layers:
                    for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                        proj.bias.normal_(0.0, 0.5)
    return model.eval()


def _vocab(model: torch.nn.Module) -> int:
    return model.config.get_text_config(decoder=True).vocab_size


def tiny_input_ids(model: torch.nn.Module, batch: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    """Random token ids `(batch, length)` int64, never padding or bos/eos ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_TOKEN_ID, _vocab(model), (batch, length), generator=g)


def left_padded_batch(
    model: torch.nn.Module, lengths: tuple[int, ...] = (24, 9), pad_id: int = PAD_ID, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch: `input_ids (B, max(lengths))` int64 with `pad_id` before each row's tokens, and
    `attention_mask (B, max(lengths))` int64 (1 on tokens, 0 on padding). Row `i` holds `lengths[i]`
    tokens."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for i, n in enumerate(lengths):
        input_ids[i, width - n :] = torch.randint(FIRST_TOKEN_ID, _vocab(model), (n,), generator=g)
        attention_mask[i, width - n :] = 1
    return input_ids, attention_mask


def cache_of(generate_output) -> object:
    """The cache a `generate(..., return_dict_in_generate=True)` output holds (`cache` on transformers 5.24,
    `past_key_values` on 5.17)."""
    cache = getattr(generate_output, "cache", None)
    return cache if cache is not None else generate_output.past_key_values
