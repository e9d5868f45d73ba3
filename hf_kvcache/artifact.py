"""The calibration artifact: one `.safetensors` file per calibration of a model (README.md,
"Calibration"). Tensors, per layer `i` (Hkv = kv-heads, D = head_dim, b = bits):

- `layers.{i}.k_amax`, `layers.{i}.v_amax` `(Hkv,)`: the largest |K| (after RoPE, as caches store it) and |V|
  per kv-head over the calibration text.
- `layers.{i}.k_scale_e4m3`, `.v_scale_e4m3`, `.k_scale_e5m2`, `.v_scale_e5m2` `(Hkv,)`: fitted FP8 scales, the
  candidate between amax/fp8_max and ~3.7x that with the least weighted round-trip error on the samples.
- `layers.{i}.k_pre.lo`, `.hi` `(Hkv, D)`: per-channel key thresholds before RoPE at the outlier fraction (the
  fraction/2 and 1 - fraction/2 quantiles); `layers.{i}.k_post.lo`, `.hi`: the same after RoPE (the ablation).
- `layers.{i}.k_pre.nuq{b}`, `layers.{i}.k_post.nuq{b}`, `layers.{i}.v.nuq{b}` `(2^b,)`: NUQ codebooks, sorted
  centroids in [-1, 1] of the normalized keys (per channel) and values (per token), for each calibrated b.

The JSON metadata in the safetensors header (key `hf_kvcache`) holds the format version, the method, the bit
widths, the outlier fraction, the k-means weighting, the calibration text and token count and the model
fingerprint. Loading validates all of it and never unpickles anything.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import _compat
from .configs import attention_shape
from .quant import FP8_FORMATS, fp8_max

FORMAT_VERSION = 1
METHOD = "hf-kvcache-calibration"
METADATA_KEY = "hf_kvcache"
CHECKSUM_KEY = "hf_kvcache_sha256"  # beside the metadata in the safetensors header: sha256 of the tensors
RECALIBRATE = "run `hf-kvcache calibrate` for this model (or pass calibration=PATH to a matching artifact)"


def fingerprint(config) -> dict:
    """What a calibration depends on in a model: type, layers, kv-heads, head_dim and rope parameters."""
    cfg = _compat.text_config(getattr(config, "config", config))
    layers, kv_heads, head_dim = attention_shape(cfg)
    return {
        "model_type": cfg.model_type,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope": json.loads(json.dumps(getattr(cfg, "rope_parameters", None) or {}, sort_keys=True, default=str)),
    }


def fingerprint_differences(want: dict, have: dict) -> list[str]:
    """Human-readable differences between two fingerprints (empty when they match)."""
    out = []
    for key in sorted(set(want) | set(have)):
        if want.get(key) != have.get(key):
            out.append(f"{key}: artifact {have.get(key)!r}, model {want.get(key)!r}")
    return out


def default_path(config) -> Path:
    """Where `hf-kvcache calibrate` stores a model's artifact and where caches look for it, keyed by the model's
    fingerprint: in `$HF_KVCACHE_CALIBRATION` if set, else in `calibration/` of the user cache folder
    (`hf_kvcache.models.cache_root()`)."""
    from .models import cache_root

    fp = fingerprint(config)
    digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    folder = os.environ.get("HF_KVCACHE_CALIBRATION")
    folder = Path(folder).expanduser() if folder else cache_root() / "calibration"
    return folder / f"{fp['model_type']}-{digest}.safetensors"


@dataclass
class Calibration:
    """A loaded (or freshly computed) calibration: `metadata` (see the module docstring) and `tensors`."""

    metadata: dict
    tensors: dict[str, torch.Tensor] = field(repr=False)

    @property
    def num_layers(self) -> int:
        return self.metadata["fingerprint"]["num_hidden_layers"]

    @property
    def bits(self) -> list[int]:
        return list(self.metadata["bits"])

    def check(self, config) -> None:
        """Raise a ValueError naming every difference if this calibration was made for another model."""
        diff = fingerprint_differences(fingerprint(config), self.metadata["fingerprint"])
        if diff:
            raise ValueError("the calibration was made for another model (" + "; ".join(diff) + "); " + RECALIBRATE)

    def fp8_scales(self, layer: int, fmt: str = "e4m3", headroom: float | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-kv-head FP8 scales of layer `layer`: `(k_scale (Hkv,), v_scale (Hkv,))`, the fitted ones, or
        `amax * headroom / fp8_max` when a headroom is given."""
        if headroom is None:
            return tuple(self.tensors[f"layers.{layer}.{s}_scale_{fmt}"].float() for s in ("k", "v"))
        top = fp8_max(fmt)
        k, v = (self.tensors[f"layers.{layer}.{s}_amax"].float() for s in ("k", "v"))
        tiny = torch.finfo(torch.float32).tiny
        return (k * headroom / top).clamp_min(tiny), (v * headroom / top).clamp_min(tiny)

    def key_range(self, layer: int, pre_rope: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel key thresholds `(lo (Hkv, D), hi (Hkv, D))` at the calibrated outlier fraction."""
        place = "k_pre" if pre_rope else "k_post"
        return self.tensors[f"layers.{layer}.{place}.lo"], self.tensors[f"layers.{layer}.{place}.hi"]

    def codebook(self, layer: int, stream: str, bits: int, pre_rope: bool = True) -> torch.Tensor:
        """The NUQ codebook `(2^bits,)` of `stream` ("keys" or "values") in layer `layer`."""
        if bits not in self.bits:
            raise ValueError(
                f"this calibration has codebooks for {self.bits} bits, not {bits}; "
                f"rerun `hf-kvcache calibrate --bits {bits}`"
            )
        place = ("k_pre" if pre_rope else "k_post") if stream == "keys" else "v"
        return self.tensors[f"layers.{layer}.{place}.nuq{bits}"]


def _required(meta: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor an artifact with this metadata must hold, with its shape."""
    fp = meta["fingerprint"]
    h, d = fp["num_key_value_heads"], fp["head_dim"]
    out = {}
    for i in range(fp["num_hidden_layers"]):
        out[f"layers.{i}.k_amax"] = out[f"layers.{i}.v_amax"] = (h,)
        for fmt in FP8_FORMATS:
            out[f"layers.{i}.k_scale_{fmt}"] = out[f"layers.{i}.v_scale_{fmt}"] = (h,)
        for place in ("k_pre", "k_post"):
            out[f"layers.{i}.{place}.lo"] = out[f"layers.{i}.{place}.hi"] = (h, d)
        for b in meta["bits"]:
            for place in ("k_pre", "k_post", "v"):
                out[f"layers.{i}.{place}.nuq{b}"] = (2**b,)
    return out


# Bounds on what an artifact's metadata may declare: an untrusted file must not make the loader loop over a billion
# layers or promise tensors of absurd shapes before anything is compared with the model.
_SIZE_LIMITS = {"num_hidden_layers": 4096, "num_key_value_heads": 4096, "head_dim": 4096}


def _check_sizes(meta: dict) -> None:
    fp, bits = meta["fingerprint"], meta["bits"]
    if not isinstance(fp, dict):
        raise ValueError(f"calibration fingerprint is {type(fp).__name__}, not a mapping; {RECALIBRATE}")
    for key, limit in _SIZE_LIMITS.items():
        value = fp.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
            raise ValueError(f"calibration fingerprint {key}={value!r} is not an integer in 1..{limit}; {RECALIBRATE}")
    if not isinstance(bits, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in bits):
        raise ValueError(f"calibration bit widths {bits!r} are not a list of integers; {RECALIBRATE}")


def validate(cal: Calibration) -> None:
    """Raise a ValueError saying what is wrong with a calibration's metadata or tensors."""
    meta = cal.metadata
    if not isinstance(meta, dict):
        raise ValueError(f"calibration metadata is {type(meta).__name__}, not a mapping; {RECALIBRATE}")
    if meta.get("method") != METHOD:
        raise ValueError(f"not an hf-kvcache calibration (method {meta.get('method')!r}); {RECALIBRATE}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"calibration format version {meta.get('format_version')!r}, this hf-kvcache reads {FORMAT_VERSION}; "
            + RECALIBRATE
        )
    for key in ("fingerprint", "bits", "outlier_fraction", "weighting", "text", "tokens"):
        if key not in meta:
            raise ValueError(f"calibration metadata misses {key!r}; {RECALIBRATE}")
    _check_sizes(meta)
    bad_bits = [b for b in meta["bits"] if b not in (1, 2, 3, 4, 5, 6, 7, 8)]
    if bad_bits:
        raise ValueError(f"calibration bit widths {bad_bits} are not in 1..8; {RECALIBRATE}")
    if len(set(meta["bits"])) != len(meta["bits"]):
        raise ValueError(f"calibration bit widths {meta['bits']} repeat; {RECALIBRATE}")
    required = _required(meta)
    unexpected = sorted(set(cal.tensors) - set(required))
    if unexpected:  # tensors its metadata does not declare: the metadata was changed, or another tool wrote it
        raise ValueError(f"calibration holds tensors its metadata does not declare ({', '.join(unexpected[:3])}"
                         f"{', ...' if len(unexpected) > 3 else ''}); {RECALIBRATE}")
    for name, shape in required.items():
        t = cal.tensors.get(name)
        if t is None:
            raise ValueError(
                f"calibration misses tensor {name!r} (truncated or written by another tool); {RECALIBRATE}"
            )
        if tuple(t.shape) != shape:
            raise ValueError(
                f"calibration tensor {name!r} has shape {tuple(t.shape)}, expected {shape}; {RECALIBRATE}"
            )
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"calibration tensor {name!r} holds NaN or inf; {RECALIBRATE}")
        if ".nuq" in name and t.numel() > 1 and not bool((t[1:] >= t[:-1]).all()):
            raise ValueError(f"calibration codebook {name!r} is not sorted; {RECALIBRATE}")


def _checksum(metadata: str, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the metadata's JSON text and every tensor's name, dtype, shape and bytes, in name order: stored
    in the header, so a file changed after it was written (a flipped byte anywhere) is refused instead of loaded."""
    h = hashlib.sha256(metadata.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save(cal: Calibration, path: str | os.PathLike) -> Path:
    """Write `cal` to `path` (a `.safetensors` file; written to a temporary name and renamed, so a reader never
    sees half a file), with a checksum of its tensors in the metadata. Returns the path."""
    validate(cal)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in cal.tensors.items()}
    text = json.dumps(cal.metadata, sort_keys=True)
    save_file(tensors, str(tmp), metadata={METADATA_KEY: text, CHECKSUM_KEY: _checksum(text, tensors)})
    os.replace(tmp, path)
    return path


def load(path: str | os.PathLike, config=None) -> Calibration:
    """Read and validate an artifact; with `config` (or a model), also check that it was made for that model."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no calibration at {path}; {RECALIBRATE}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            raw, stored = header.get(METADATA_KEY), header.get(CHECKSUM_KEY)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable safetensors file (corrupt or truncated: {e}); {RECALIBRATE}") from e
    if raw is None:
        raise ValueError(f"{path} has no hf-kvcache metadata: not a calibration artifact; {RECALIBRATE}")
    try:
        metadata = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: the calibration metadata is not valid JSON ({e}); {RECALIBRATE}") from e
    cal = Calibration(metadata=metadata, tensors=tensors)
    validate(cal)
    if stored is not None and stored != _checksum(raw, tensors):  # artifacts written before the checksum have none
        raise ValueError(f"{path}: the tensors do not match the checksum written with them (changed or damaged "
                         f"after it was saved); {RECALIBRATE}")
    if config is not None:
        cal.check(config)
    return cal


def find(config, calibration: str | os.PathLike | Calibration | None = None) -> Calibration:
    """The calibration a cache should use: `calibration` itself, the file it names, or the artifact that
    `hf-kvcache calibrate` stored for this model; always checked against the model."""
    if isinstance(calibration, Calibration):
        calibration.check(config)
        return calibration
    path = Path(calibration) if calibration is not None else default_path(config)
    if not path.is_file():
        where = "at " + str(path) if calibration is not None else f"for this model (looked for {path})"
        raise FileNotFoundError(f"no calibration {where}; {RECALIBRATE}")
    return load(path, config)


def export_vllm(cal: Calibration, path: str | os.PathLike, fmt: str = "e4m3", headroom: float | None = None) -> Path:
    """FP8 KV scales under the tensor names vLLM loads: `model.layers.{i}.self_attn.k_scale` / `.v_scale`, one
    float32 scalar per layer (vLLM's per-tensor scales: the largest of the layer's per-head scales)."""
    tensors = {}
    for i in range(cal.num_layers):
        k, v = cal.fp8_scales(i, fmt, headroom)
        tensors[f"model.layers.{i}.self_attn.k_scale"] = k.max().reshape(())
        tensors[f"model.layers.{i}.self_attn.v_scale"] = v.max().reshape(())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt", "kv_cache_dtype": f"fp8_{fmt}"})
    return path
