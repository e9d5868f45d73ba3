"""Generation to a model's full 8k context with every cache, with memory that grows as bytes per token predict.

The prediction is made before the long run, from two short fills of a fresh cache (512 and 1024 tokens,
`hf_kvcache.eval.memory.bytes_per_token`): the bytes per token are the slope between them, and what does not
grow with the sequence (sliding-window layers, residual windows, sinks, codec state, spare rows) is the 1024-token
fill's own figure carried forward, so `predicted(n) = measured(1024) + slope * (n - 1024)`. Held bytes
(`nbytes()`) are checked against the held prediction, allocated bytes (`allocated_nbytes()`, spare rows included)
against the allocated one, both within 10% at 2k, 4k and 8k. Every check point is a multiple of 128 tokens, like
the short fills, so KIVI's block-flushed window is in the same phase at each (a window of 128 float32 tokens is
worth 5 times as many packed ones: comparing a full window with an empty one would measure the window, not the
growth).

CPU: a 2-layer model of the Gemma-3 kind (a sliding layer of window 16 and a full one) with 8192 positions, on
the dense path, prefilled in chunks (a first one of 1024 tokens, as a prompt would be, then 64 at a time), then
`generate` to exactly 8192 tokens. CUDA: a model of the default model's shape (SmolLM2-135M, random bf16
weights) on the fused path, where `torch.cuda.memory_allocated()` itself is what must grow as predicted.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

from hf_kvcache import _compat, calibration, make_cache
from hf_kvcache.eval.memory import bytes_per_token
from hf_kvcache.eval.perplexity import forward_with_cache
from tests.helpers.checks import assert_cache_finite
from tests.helpers.methods import METHODS
from tests.helpers.tiny_models import FIRST_TOKEN_ID, PAD_ID, SEED

CONTEXT = 8192
CHECKS = (2048, 4096, CONTEXT)
NEW_TOKENS = 96  # generated at the end, through `generate`, to reach exactly CONTEXT
TOLERANCE = 0.10
IDS = [m[0] for m in METHODS]


def _build(config, dtype=torch.float32, device="cpu", attn_implementation="sdpa"):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model.to(device).eval()


def _tokens(vocab: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(FIRST_TOKEN_ID, vocab, (CONTEXT,), generator=g).to(device)


def _calibrate(model, tokens) -> None:
    """A tiny calibration artifact for this model (KVQuant needs one), in the session's calibration folder."""
    cal = calibration.calibrate(model, tokens[None, :96], chunk=48, max_samples=96, progress=False)
    calibration.save(cal, calibration.default_path(model.config))


def _prediction(model, spec, tokens):
    """`(held(n), allocated(n), bytes per token)` predicted from fresh caches filled with 512 and 1024 tokens."""
    made = []

    def factory():
        made.append(make_cache(spec, model))
        return made[-1]

    held = {n: bytes_per_token(model, factory, tokens, n_tokens=n)["nbytes"] for n in (512, 1024)}
    allocated = made[-1].allocated_nbytes()
    slope = (held[1024] - held[512]) / 512
    return (lambda n: held[1024] + slope * (n - 1024)), (lambda n: allocated + slope * (n - 1024)), slope


def _within(measured: float, predicted: float) -> bool:
    return abs(measured / predicted - 1) <= TOLERANCE


def _fill_to_full_context(model, cache, tokens, chunks, on_check) -> torch.Tensor:
    """Prefill `tokens` in `chunks`, calling `on_check(n)` when the cache holds n in CHECKS; then `generate` to
    CONTEXT tokens and feed the last one, so the cache ends holding the full context. Returns the sequence."""
    prefill = CONTEXT - NEW_TOKENS - 1  # generate feeds the last prompt token itself
    ids = tokens[None]
    pos = 0
    with torch.inference_mode():
        for size in chunks:
            size = min(size, prefill - pos)
            if size <= 0:
                break
            forward_with_cache(model, ids[:, pos : pos + size], cache, logits_to_keep=1)
            pos += size
            if pos in CHECKS:
                on_check(pos)
    assert pos == prefill
    out = model.generate(
        ids[:, : prefill + 1], max_new_tokens=NEW_TOKENS, do_sample=False, **_compat.cache_kwargs(cache)
    )
    assert out.shape == (1, CONTEXT) and cache.get_seq_length() == CONTEXT - 1
    with torch.inference_mode():  # the last generated token, at position 8191: the context is full
        forward_with_cache(model, out[:, -1:], cache, logits_to_keep=1)
    assert cache.get_seq_length() == CONTEXT
    on_check(CONTEXT)
    return out


# ---------------------------------------------------------------------------------------------------------- CPU
@pytest.fixture(scope="module")
def model_8k(tiny_calibrations):
    """2 layers (sliding window 16, then full attention), 2 query heads on 1 kv head of 64, 8192 positions."""
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=CONTEXT,
        initializer_range=0.1, pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False,
    )
    model = _build(config)
    tokens = _tokens(config.vocab_size, "cpu")
    _calibrate(model, tokens)
    return model, tokens


@pytest.mark.parametrize("spec,easy,hard", METHODS, ids=IDS)
def test_full_context_memory_grows_as_bytes_per_token_predict(spec, easy, hard, model_8k):
    model, tokens = model_8k
    held_at, allocated_at, slope = _prediction(model, spec, tokens)
    cache = make_cache(spec, model)
    sliding = cache.layers[0]
    seen, report = {}, []

    def check(n):
        held, allocated = cache.nbytes(), cache.allocated_nbytes()
        seen[n] = sliding.allocated_nbytes()
        report.append(f"{n}: held {held} (predicted {held_at(n):.0f}), allocated {allocated} "
                      f"(predicted {allocated_at(n):.0f})")
        assert _within(held, held_at(n)) and _within(allocated, allocated_at(n)), (
            f"{spec}, {slope:.1f} bytes/token:\n" + "\n".join(report))

    _fill_to_full_context(model, cache, tokens, [1024] + [64] * CONTEXT, check)
    # The sliding layer stopped growing: it holds its window (plus the rollback margin), and gave back the
    # capacity of the first 1024-token chunk.
    assert sliding.is_sliding and sliding.held_tokens <= sliding.sliding_window - 1 + 2 * 64
    assert seen[CONTEXT] <= seen[2048] * 1.25, seen
    assert_cache_finite(cache)


# --------------------------------------------------------------------------------------------------------- CUDA
@pytest.fixture(scope="module")
def default_shape_model_cuda(tiny_calibrations):
    """SmolLM2-135M's shape (30 layers, hidden 576, 9 query / 3 kv heads of 64, 8192 positions), random bf16
    weights, on the GPU, with the fused attention."""
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=CONTEXT, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02, pad_token_id=PAD_ID, bos_token_id=1,
        eos_token_id=None,
    )
    model = _build(config, dtype=torch.bfloat16, device="cuda", attn_implementation="hf_kvcache")
    tokens = _tokens(config.vocab_size, "cuda")
    _calibrate(model, tokens)
    return model, tokens


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec,easy,hard", METHODS, ids=IDS)
def test_full_context_cuda_memory_grows_as_bytes_per_token_predict(spec, easy, hard, default_shape_model_cuda):
    """GPU memory in use after the cache is built and before any token, then at 2k, 4k and 8k tokens (prefill in
    chunks of 512, the rest generated): its growth is the cache, within 10% of the prediction.

    Measured as the bytes tensors asked the allocator for (`requested_bytes`); `memory_allocated()` is reported
    beside it. On the H200 (with `memory_allocated()`) the growth matched the cache's own allocated bytes within
    0.2% at 2k and 4k for every method, but at 8k, after `generate`, FP8 and INT8 showed ~10 MB more than their
    cache's 100 MB. The likely cause is the allocator's rounding (a tensor over 1 MB is given a whole cached block
    when less than 1 MB would be left over, and these caches' 60 storage tensors are a few MB each at 8k), which
    `requested_bytes` leaves out; not yet confirmed on the GPU."""
    model, tokens = default_shape_model_cuda
    _, allocated_at, slope = _prediction(model, spec, tokens)
    cache = make_cache(spec, model)
    torch.cuda.synchronize()

    def in_use():
        return torch.cuda.memory_stats()["requested_bytes.all.current"], torch.cuda.memory_allocated()

    base = in_use()
    report = []

    def check(n):
        torch.cuda.synchronize()
        requested, allocated = (now - then for now, then in zip(in_use(), base))
        report.append(f"{n}: requested grew {requested}, memory_allocated {allocated} (predicted "
                      f"{allocated_at(n):.0f}; the cache reports {cache.allocated_nbytes()} allocated, "
                      f"{cache.nbytes()} held)")
        assert _within(requested, allocated_at(n)), f"{spec}, {slope:.1f} bytes/token:\n" + "\n".join(report)

    _fill_to_full_context(model, cache, tokens, [512] * CONTEXT, check)
    assert_cache_finite(cache)
