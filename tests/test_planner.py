"""The capacity planner (`hf_kvcache.planner`, `hf-kvcache plan`): planned bytes agree with caches filled for real
(the tokens' bytes exactly, every tensor a cache holds within 5%), the Llama-3-70B example, sliding windows, the
recommendation's rules and the figures it cites, and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from hf_kvcache import PRESETS, cli, make_cache, plan
from hf_kvcache._compat import cache_kwargs
from hf_kvcache.eval.memory import cache_nbytes
from hf_kvcache.footprint import build_cache
from hf_kvcache.configs import attention_shape
from hf_kvcache.patching import unfuse
from hf_kvcache.planner import (
    DEFAULT_MAX_LOSS,
    FP8_ARCHS,
    SHIPPED_MODELS,
    UNQUANTIZED,
    load_config,
    measured,
    parameter_count,
    parse_context,
    parse_memory,
)
from tests.helpers.tiny_models import TINY_CONFIGS, tiny_model

CONTEXT = 4096
# The presets built from a config alone; int4-g128 does not divide the default model's head_dim of 64.
CONFIG_SPECS = [s for s, p in PRESETS.items() if not p.needs_model and s != "int4-g128"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small tensors: on a loaded 2-core machine, waking a second thread costs more than it gives (up to 30x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fill(cache, config, tokens: int, chunk: int = 2048) -> int:
    """Store `tokens` random bf16 K/V in every layer of `cache` (`chunk` at a time, as a prefill in pieces does);
    returns the bytes it then holds."""
    _, kv_heads, head_dim = attention_shape(config)
    gen = torch.Generator().manual_seed(1)
    for idx in range(len(cache.layers)):
        for start in range(0, tokens, chunk):
            shape = (1, kv_heads, min(chunk, tokens - start), head_dim)
            cache.update(torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16(),
                         idx)
    return cache_nbytes(cache)


@pytest.fixture(scope="module")
def default_plan():
    return plan("smollm2-135m", context=CONTEXT, gpu="a100")


@pytest.mark.parametrize("spec", CONFIG_SPECS)
def test_tokens_bytes_match_a_cache_filled_with_4k_tokens(default_plan, spec):
    _, config = load_config("smollm2-135m")
    real = fill(make_cache(spec, config), config, CONTEXT)
    planned = default_plan.row(spec).held_bytes
    # exact to the byte; the issue asks for 1%
    assert planned == real, f"{spec}: planned {planned / CONTEXT:.1f} B/token, filled cache {real / CONTEXT:.1f}"


def walked_bytes(obj) -> int:
    """Every tensor reachable from a cache (containers, modules, and the attributes of hf_kvcache's and transformers'
    cache objects), each storage once and whole: what the cache holds in memory, whatever `nbytes()` says."""
    storages, seen, stack = {}, set(), [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            storages[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        elif isinstance(o, dict):
            stack += list(o.values())
        elif isinstance(o, (list, tuple, set)):
            stack += list(o)
        elif isinstance(o, torch.nn.Module) or type(o).__module__.startswith(("hf_kvcache", "transformers.cache")):
            stack += list(vars(o).values())
    return sum(storages.values())


# Every preset at batch 1 x 1k in bf16, on tiny configs of the default model's head_dim (64; `int4-g128` needs 128):
# 3 layers and 2 kv-heads, so what a cache holds per layer whatever the length (rotations, codebooks, windows, sinks)
# weighs more against its tokens than on the default model's 3 kv-heads.
WALKED = [("llama", s) for s in PRESETS if s != "int4-g128"] + [("qwen3", "int4-g128")]


@pytest.mark.parametrize("tiny,spec", WALKED)
def test_plan_counts_every_tensor_a_cache_holds(tiny, spec):
    """The plan's bytes against every tensor a real cache holds after a 1024-token prompt (one write a layer, as a
    prefill): within 5% for every preset (measured: exact to the byte)."""
    config = TINY_CONFIGS[tiny]()
    cache = build_cache(spec, config)  # the presets that need a model: as the planner builds them, see below
    _, kv_heads, head_dim = attention_shape(config)
    gen = torch.Generator().manual_seed(3)
    for idx in range(config.num_hidden_layers):
        shape = (1, kv_heads, 1024, head_dim)
        cache.update(torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16(), idx)
    walked = walked_bytes(cache)
    planned = plan(config, context=1024, gpu_memory="1GB", methods=[spec]).row(spec)
    assert abs(planned.sequence_bytes / walked - 1) <= 0.05, (
        f"{spec}: planned {planned.sequence_bytes:,} bytes (tokens {planned.held_bytes:,}, spare capacity "
        f"{planned.spare_bytes:,}, fixed {planned.fixed_bytes:,}), the cache holds {walked:,}")


@pytest.mark.parametrize("context", [1024, 8192, 32768])
def test_allocated_bytes_stay_within_10_percent_of_the_plan(context):
    """What a growing cache allocates after a prefill and 32 decode steps, for every preset, one layer of the default
    model's shape: within 10% of the plan's storage (its tokens and the capacity a prefill leaves) at 1k, 8k and 32k
    (the capacity grows by 6.25%, at least 64 tokens)."""
    _, config = load_config("smollm2-135m")
    specs = [s for s in PRESETS if s not in ("none", "int4-g128")]
    planned = plan("smollm2-135m", context=context, methods=specs)
    _, kv_heads, head_dim = attention_shape(config)
    gen = torch.Generator().manual_seed(2)
    for spec in specs:
        layer = build_cache(spec, config).layers[0]
        layer.fused = True
        for n in [context - 32] + [1] * 32:
            x = torch.randn((1, kv_heads, n, head_dim), generator=gen).bfloat16()
            layer.update(x, x)
        row = planned.row(spec)
        ratio = layer.allocated_nbytes() * config.num_hidden_layers / (row.held_bytes + row.spare_bytes)
        assert 0.9 <= ratio <= 1.10, f"{spec}: allocated {ratio:.3f}x the plan at {context} tokens"


@pytest.mark.parametrize("spec", ["kvquant-3", "kvquant-2:outlier_fraction=0.05", "kvquant-4:pre_rope=false",
                                  "rotated-4", "rotated-2:residual_length=32"])
def test_presets_that_need_a_model_match_the_cache_built_on_one(spec):
    """The planner builds them from the config (placeholder calibration and RoPE, no fused rotation); the cache built
    on a model, with its real calibration and rotary embedding, holds the same bytes."""
    model = tiny_model("llama")
    cache = make_cache(spec, model)  # the tiny models' calibrations come from tests/conftest.py
    try:
        real = fill(cache, model.config, CONTEXT)
    finally:
        unfuse(model)
    planned = plan(model, context=CONTEXT, gpu_memory="1GB", methods=[spec]).row(spec).held_bytes
    assert planned == real


def test_llama_3_70b_at_128k_in_16_bits():
    p = plan("llama-3-70b", context="128k", gpu_memory="640GB", methods=["none"])
    row = p.row("none")
    assert p.reference_bytes_per_token == 2 * 2 * 80 * 8 * 128 == 327_680
    assert row.bytes_per_token == 327_680 and row.ratio == 1.0
    assert row.sequence_bytes == 327_680 * 131_072  # 42.9 GB
    text = p.format()
    assert "2 bytes x 2 (K, V) x 80 layers x 8 kv-heads x 128 = 327,680 bytes per token" in text
    assert "| `none` | 327,680 | 1.000x | 42.95 |" in text
    assert p.parameters == 70_553_706_496  # Llama-3.1-70B's published count


def test_sliding_window_layers_stop_growing():
    specs = ["none", "int4-g32", "kivi-2", "kvquant-3"]
    by_context = {c: plan("mistral-7b", context=c, gpu="h100", methods=specs) for c in (2048, 8192, 32768)}
    assert by_context[32768].windows == {4096: 32}
    for spec in specs:
        short, past, far = (by_context[c].row(spec).sequence_bytes for c in (2048, 8192, 32768))
        assert short < past == far, spec
    # transformers' sliding layer keeps the last window - 1 tokens: 2 bytes x (K, V) x 8 kv-heads x 128 of them
    assert by_context[32768].row("none").held_bytes == 32 * 4095 * 2 * 2 * 8 * 128


def test_mixed_layers_from_a_local_config_json(tmp_path):
    config = TINY_CONFIGS["gemma"]()  # layers sliding (16) / full / sliding
    config.save_pretrained(tmp_path)
    p = plan(tmp_path / "config.json", context=1000, gpu_memory="1GB", methods=["none", "int8"])
    assert p.windows == {16: 2, "full": 1}
    # transformers keeps window - 1 tokens in a sliding layer; each token: bf16 (2 bytes) x (K, V) x 2 kv-heads x 64
    assert p.row("none").held_bytes == (2 * 15 + 1000) * 2 * 2 * 2 * 64
    assert p.row("int8").sequence_bytes < p.row("none").sequence_bytes
    assert plan(tmp_path, context=1000, gpu_memory="1GB", methods=["none"]).row("none") == p.row("none")


# ------------------------------------------------------------------------------------------------ recommendation


def _cites_measured(rec) -> None:
    figures = measured()
    assert rec.accuracy == figures["accuracy"]["methods"][rec.spec]
    assert rec.speed == figures["speed"]["methods"].get(rec.spec, [])


def _decode(spec: str) -> float | None:
    points = [p for p in measured()["speed"]["methods"].get(spec, []) if p["what"] == "decode"]
    return max((p["batch"], p["vs_dynamic"]) for p in points)[1] if points else None


def _candidates(p, fp8: bool) -> list[str]:
    """The presets the rules weigh: measured accuracy, quantized, FP8 only where native, none slower than
    DynamicCache."""
    accuracy = measured()["accuracy"]["methods"]
    return [r.spec for r in p.rows if r.spec in accuracy and r.spec not in UNQUANTIZED
            and (fp8 or not r.spec.startswith("fp8")) and (_decode(r.spec) or 1.0) >= 1.0]


def _loss(spec: str) -> float:
    return measured()["accuracy"]["methods"][spec]["decode_delta_pct"]


def test_the_fewest_bytes_within_the_loss_budget_and_the_fastest():
    p = plan("llama-3-8b", context="32k", gpu="h100")
    within = [s for s in _candidates(p, fp8=True) if _loss(s) <= DEFAULT_MAX_LOSS and p.row(s).fits_batch]
    first, *rest = p.recommendations
    assert first.kind == "bytes" and first.spec == min(within, key=lambda s: p.row(s).sequence_bytes)
    timed = [s for s in within if _decode(s) is not None]
    fastest = max(timed, key=_decode)
    assert [(r.spec, r.kind) for r in rest] == ([] if fastest == first.spec else [(fastest, "speed")])
    for rec in p.recommendations:
        _cites_measured(rec)
    text = p.format()
    accuracy = measured()["accuracy"]["methods"][first.spec]
    assert f"ΔNLL {accuracy['decode_delta_pct']:+.2f}%" in text and accuracy["source"] in text
    assert measured()["accuracy"]["platform"] in text and "NVIDIA H200" in text


def test_the_gpu_figures_weigh_the_recommendation():
    """The figures measured on the H200 in bf16 at P=6144 (the README's table): a preset with fewer bytes than FP8 and
    less loss exists, so the plan no longer puts FP8 first as its CPU float32 figure at 1k once had it."""
    p = plan("llama-3-70b", context="128k", gpu="h200", weights_dtype="fp8")
    first = p.recommendations[0]
    assert first.spec != "fp8-e4m3"
    assert p.row(first.spec).ratio < p.row("fp8-e4m3").ratio and _loss(first.spec) <= _loss("fp8-e4m3")
    assert measured()["accuracy"]["methods"][first.spec]["prefill"] == 6144


def test_fp8_only_where_the_gpu_converts_it():
    for gpu in ("a100", "l4", "t4"):
        p = plan("llama-3-8b", context="32k", gpu=gpu, weights_dtype="int4")
        assert p.gpu.arch not in FP8_ARCHS
        assert not any(r.spec.startswith("fp8") for r in p.recommendations), gpu
        assert f"FP8 left out: {p.gpu.arch}" in p.recommendations[0].why


def test_tight_memory_gets_the_most_accurate_preset_that_fits():
    # 24 GB with 16 GB of bf16 weights: nothing within a 0.1% budget (INT8, +0.11%, would not fit a 128k sequence)
    p = plan("llama-3-8b", context="128k", gpu="l4", max_loss=0.1)
    (rec,) = p.recommendations
    fitting = [s for s in _candidates(p, fp8=False) if p.row(s).fits_batch]
    assert rec.kind == "memory" and rec.spec == min(fitting, key=_loss)
    assert "no preset within 0.1% ΔNLL fits batch 1 (FP8 left out: ada): the most accurate that does" in p.format()
    crowded = plan("llama-3-8b", context="128k", gpu="l4", batch=500)
    (rec,) = crowded.recommendations
    assert rec.spec == max(_candidates(crowded, fp8=False), key=lambda s: crowded.row(s).max_sequences)
    assert "no preset fits batch 500" in crowded.format()


def test_unknown_hardware_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = plan("llama-3-8b", context="8k", methods=["none"])
    assert p.gpu is None and p.gpu_memory == 80 * 2**30
    assert not p.recommendations[0].spec.startswith("fp8") and "FP8 left out: no GPU named" in p.recommendations[0].why


# ------------------------------------------------------------------------------------------------ input


def test_contexts_and_memory_parse():
    assert [parse_context(c) for c in ("131072", "128k", "32K", "1.5k", "1M", 4096)] == [
        131072, 131072, 32768, 1536, 2**20, 4096]
    assert parse_memory("80GiB") == parse_memory("80Gi") == 80 * 2**30
    assert parse_memory("80GB") == 80 * 10**9 and parse_memory("141G") == 141 * 10**9
    assert parse_memory("512 MiB") == 2**29


@pytest.mark.parametrize("call,match", [
    (lambda: parse_context("12x"), r"does not parse: write .*128k"),
    (lambda: parse_context("0"), "at least 1 token"),
    (lambda: parse_memory("eighty"), r"does not parse: write .*80GiB"),
    (lambda: parse_memory("80"), r"does not parse: write a number with a unit"),
    (lambda: plan("llama-3-7b"), r"unknown model 'llama-3-7b': give a shipped shape \(smollm2-135m, llama-3-8b"),
    (lambda: plan(methods=["int5"]), "unknown cache spec 'int5'; available: none, fp8-e4m3"),
    (lambda: plan(gpu="h900"), "unknown GPU 'h900'; known: b200, h200, h100"),
    (lambda: plan("llama-3-70b", gpu_memory="80GiB"), r"weights \(141.1 GB.*\) do not fit in the GPU memory \(85.9 GB"),
    (lambda: plan("llama-3-8b", gpu_memory="17GB"), r"weights \(16.1 GB\) and the reserve \(10% = 1.7 GB\) leave no"),
    (lambda: plan(methods=["int4-g128"]), "does not divide this model's head_dim=64"),
    (lambda: plan(methods=["none"], max_loss=-1), "max_loss is a ΔNLL in %"),
])
def test_bad_input_is_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_cli_prints_the_plan_and_reports_errors(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "llama-3-8b", "--context", "8k", "--gpu", "h100", "--methods", "none,int8",
            "--max-loss", "0.2", "--json", str(out)]
    assert cli.main(argv) == 0
    assert "| `int8` |" in capsys.readouterr().out
    assert json.loads(out.read_text())["max_loss"] == 0.2
    assert [r["spec"] for r in json.loads(out.read_text())["rows"]] == ["none", "int8"]
    for argv, message in [(["plan", "--model", "nope"], "unknown model 'nope'"),
                          (["plan", "--context", "12x"], "context '12x' does not parse"),
                          (["plan", "--gpu-memory", "lots"], "memory 'lots' does not parse")]:
        assert cli.main(argv) == 2
        assert f"hf-kvcache: error: {message}" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the default model


@pytest.mark.slow
def test_default_model_matches_its_shipped_shape_and_its_caches(default_model):
    model, _ = default_model
    shipped = SHIPPED_MODELS["smollm2-135m"][1]
    for key, value in shipped.items():
        if key != "rope_parameters":
            assert getattr(model.config, key) == value, key
    assert model.config.rope_parameters["rope_theta"] == shipped["rope_parameters"]["rope_theta"]
    _, config = load_config("smollm2-135m")
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())
    # One cache filled through the real model (float32 K/V) and one built on it (a fused rotation).
    cache = make_cache("kivi-2", model)
    ids = torch.randint(3, 1000, (1, 512), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(cache, model))
    planned = plan(model, context=512, gpu="a100", dtype=torch.float32, methods=["kivi-2"])
    assert planned.row("kivi-2").held_bytes == cache.nbytes()
    cache = make_cache("rotated-4", model)
    try:
        real = fill(cache, model.config, CONTEXT)
    finally:
        unfuse(model)
    assert plan(model, context=CONTEXT, gpu="a100", methods=["rotated-4"]).row("rotated-4").held_bytes == real
