"""Calibration: run the model over text, collect K (before and after RoPE) and V, fit what the caches need.

Collection (`collect`): the text goes through the model in chunks (a fresh cache per chunk, so memory is bounded
by the chunk). Keys before RoPE come from forward hooks on each attention module's `k_norm` (QK-norm models) or
`k_proj` (`hf_kvcache.patching.PreRopeKeys`); keys after RoPE and values come from a recording cache, which sees
exactly what a KV cache stores. Per layer it keeps the per-kv-head max |K| and |V| over every token, and a random
sample of at most `max_samples` token rows of each stream. With `weighting="fisher"` the loss of each chunk is
backpropagated once and every sampled element keeps its squared gradient (the diagonal Fisher information of that
activation).

Fitting (`fit`): per-kv-head FP8 scales (for each format, the candidate with the least weighted error),
per-channel key thresholds at the outlier fraction (quantiles), and for each bit width a NUQ codebook per layer
and stream by weighted 1-D k-means over the normalized inliers. The weight of a normalized
value is its squared gradient times the square of its normalization scale: the codebook works on normalized
values, but the loss sees errors in the activation's own units, and an error e in the normalized domain is an
error e * scale there. KVQuant's appendix derives its weights with that squared scale; its released code
uses the Fisher weights alone. We keep the scale, as the second-order estimate of the loss asks.
`weighting="none"` fits plain k-means, for models where a backward pass costs too much.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from hf_kvcache import _compat
from hf_kvcache.configs import attention_shape
from hf_kvcache.patching import PreRopeKeys, RecordingCache, attention_modules
from hf_kvcache.quant import (
    FP8_FORMATS, dequantize_fp8, fp8_max, normalize_per_channel, normalize_per_token, quantize_fp8,
)

from ..artifact import FORMAT_VERSION, METHOD, Calibration, fingerprint

WEIGHTINGS = ("fisher", "none")


@dataclass
class Activations:
    """What `collect` keeps per layer: per-head amax `(Hkv,)` and samples `(N, Hkv, D)` (with squared gradients
    when weighted) of keys before RoPE (`k_pre`), after RoPE (`k_post`) and values (`v`)."""

    k_amax: list[torch.Tensor]
    v_amax: list[torch.Tensor]
    samples: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    fisher: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    tokens: int = 0


def collect(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    chunk: int = 512,
    max_samples: int = 2048,
    weighting: str = "fisher",
    seed: int = 0,
    progress: bool = True,
) -> Activations:
    """Run `input_ids (1, N)` through `model` in chunks of `chunk` tokens and collect K/V statistics (see the
    module docstring). The model's parameters are left as they were."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting={weighting!r}: choose one of {WEIGHTINGS}")
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"calibration takes one sequence of token ids (1, N), got shape {tuple(input_ids.shape)}")
    weighted = weighting == "fisher"
    attention_modules(model)  # refuses a model whose attention the hooks would not recognize, before any work
    layers, kv_heads, head_dim = attention_shape(model.config)
    n_chunks = math.ceil(input_ids.shape[1] / chunk)
    per_chunk = max(1, math.ceil(max_samples / n_chunks))
    gen = torch.Generator().manual_seed(seed)
    acts = Activations(k_amax=[torch.zeros(kv_heads) for _ in range(layers)],
                       v_amax=[torch.zeros(kv_heads) for _ in range(layers)])
    for name in ("k_pre", "k_post", "v"):
        acts.samples[name] = [[] for _ in range(layers)]
        acts.fisher[name] = [[] for _ in range(layers)]

    hooks = PreRopeKeys(model, retain_grad=weighted)
    saved_grad = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    embed = model.get_input_embeddings()
    device = embed.weight.device
    try:
        bar = tqdm(range(n_chunks), desc="calibrating", unit="chunk", disable=not progress)
        for c in bar:
            ids = input_ids[:, c * chunk : (c + 1) * chunk].to(device)
            t = ids.shape[1]
            if t < 2:
                continue
            hooks.keys.clear()
            cache = RecordingCache(model.config, keep_grad=weighted)
            with torch.set_grad_enabled(weighted):
                emb = embed(ids)
                if weighted:
                    emb = emb.detach().requires_grad_(True)
                kwargs = {_compat.forward_parameters(type(model))[0]: cache, "use_cache": True}
                out = model(inputs_embeds=emb, labels=ids if weighted else None, **kwargs)
                if weighted:
                    out.loss.backward()
            pick = torch.randperm(t, generator=gen)[: min(per_chunk, t)].sort().values
            for i in range(layers):
                k_post, v = cache.seen[i]  # (1, Hkv, T, D)
                k_pre = hooks.keys[i]
                acts.k_amax[i] = torch.maximum(acts.k_amax[i], k_post.detach().abs().amax(dim=(0, 2, 3)).float().cpu())
                acts.v_amax[i] = torch.maximum(acts.v_amax[i], v.detach().abs().amax(dim=(0, 2, 3)).float().cpu())
                for name, x in (("k_pre", k_pre), ("k_post", k_post), ("v", v)):

                    def rows(t, pre=name == "k_pre"):  # (n, Hkv, D) of the picked tokens
                        t = hooks.as_bhtd(t, kv_heads, head_dim) if pre else t  # (1, Hkv, T, D)
                        return t[0, :, pick.to(t.device)].transpose(0, 1)

                    acts.samples[name][i].append(rows(x.detach()).float().cpu())
                    if weighted:
                        if x.grad is None:
                            raise RuntimeError(f"no gradient reached layer {i}'s {name}: the model does not use it")
                        acts.fisher[name][i].append(rows(x.grad).float().pow(2).cpu())
            acts.tokens += t
            del cache, out
    finally:
        hooks.remove()
        for p, g in zip(model.parameters(), saved_grad):
            p.requires_grad_(g)
    for store in (acts.samples, acts.fisher):
        for name in store:
            store[name] = [torch.cat(rows) if rows else torch.empty(0) for rows in store[name]]
    return acts


def weighted_kmeans_1d(x: torch.Tensor, w: torch.Tensor, k: int, iters: int = 60) -> torch.Tensor:
    """Lloyd's k-means on values `x (N,)` with weights `w (N,)` -> `k` sorted centroids. Starts from the weighted
    quantiles; a centroid that loses every point keeps its place."""
    x, w = x.double(), w.double().clamp_min(0)
    if float(w.sum()) <= 0:
        w = torch.ones_like(w)
    order = x.argsort()
    xs, cw = x[order], w[order].cumsum(0)
    targets = (torch.arange(k, dtype=torch.float64) + 0.5) / k * cw[-1]
    c = xs[torch.searchsorted(cw, targets).clamp(max=len(xs) - 1)]
    for _ in range(iters):
        c = c.sort().values
        idx = torch.bucketize(x, (c[1:] + c[:-1]) / 2)
        num = torch.zeros(k, dtype=torch.float64).index_add_(0, idx, w * x)
        den = torch.zeros(k, dtype=torch.float64).index_add_(0, idx, w)
        new = torch.where(den > 0, num / den.clamp_min(1e-300), c)
        if torch.allclose(new, c, atol=1e-9, rtol=0):
            c = new
            break
        c = new
    return c.sort().values.clamp(-1, 1).float()


def _thresholds(x: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel outlier thresholds of samples `x (N, H, D)`: the fraction/2 and 1 - fraction/2 quantiles."""
    if fraction <= 0:
        return x.amin(0), x.amax(0)
    q = torch.tensor([fraction / 2, 1 - fraction / 2], dtype=x.dtype)
    lo, hi = torch.quantile(x, q, dim=0)
    return lo, hi


# Candidate FP8 scales: amax / fp8_max times 2^(j / 8), j = 0..15 (headroom 1 to ~3.7x, 8 steps an octave).
FP8_SCALE_STEPS = 16


def fp8_scale_search(x: torch.Tensor, w: torch.Tensor, amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """Per kv-head FP8 scale `(H,)` for samples `x (N, H, D)` with weights `w (N, H, D)`: among the candidates
    (see `FP8_SCALE_STEPS`), the one with the least weighted squared error after the fp8 round trip (clamping
    included). For a floating-point format a scale only shifts the grid within an octave and moves the ends of
    the range, so this is what there is to fit."""
    top = fp8_max(fmt)
    best, best_err = None, None
    for j in range(FP8_SCALE_STEPS):
        scale = (amax * 2 ** (j / 8) / top).clamp_min(torch.finfo(torch.float32).tiny)  # (H,)
        s = scale[None, :, None]
        err = ((dequantize_fp8(quantize_fp8(x, fmt, s), fmt, s) - x).pow(2) * w).sum(dim=(0, 2))  # (H,)
        if best is None:
            best, best_err = scale.clone(), err
        else:
            better = err < best_err
            best, best_err = torch.where(better, scale, best), torch.where(better, err, best_err)
    return best


def fit(acts: Activations, *, bits=(2, 3, 4), outlier_fraction: float = 0.01, weighted: bool = True,
        progress: bool = True) -> dict[str, torch.Tensor]:
    """The artifact's tensors (see `hf_kvcache/artifact.py`) from collected activations."""
    if not 0 <= outlier_fraction < 0.5:
        raise ValueError(f"outlier_fraction={outlier_fraction!r} must be in [0, 0.5)")
    tensors = {}
    layers = len(acts.k_amax)
    for i in tqdm(range(layers), desc="fitting codebooks", unit="layer", disable=not progress):
        tensors[f"layers.{i}.k_amax"] = acts.k_amax[i]
        tensors[f"layers.{i}.v_amax"] = acts.v_amax[i]
        for stream, name in (("k", "k_post"), ("v", "v")):
            x = acts.samples[name][i]
            w = acts.fisher[name][i] if weighted else torch.ones_like(x)
            amax = acts.k_amax[i] if stream == "k" else acts.v_amax[i]
            for fmt in FP8_FORMATS:
                tensors[f"layers.{i}.{stream}_scale_{fmt}"] = fp8_scale_search(x, w, amax, fmt)
        for name in ("k_pre", "k_post", "v"):
            x = acts.samples[name][i]  # (N, H, D)
            fisher = acts.fisher[name][i] if weighted else torch.ones_like(x)
            if name == "v":
                slots = math.ceil(outlier_fraction * x.shape[-1])
                xn, outlier, lo, hi = normalize_per_token(x, slots)
                scale = (hi - lo) / 2  # (N, H, 1)
            else:
                lo, hi = _thresholds(x, outlier_fraction)
                tensors[f"layers.{i}.{name}.lo"], tensors[f"layers.{i}.{name}.hi"] = lo, hi
                xn, outlier = normalize_per_channel(x, lo, hi)
                scale = ((hi - lo) / 2).expand_as(x)
            weight = (fisher * scale.pow(2)).expand_as(x)
            keep = ~outlier
            for b in bits:
                tensors[f"layers.{i}.{name}.nuq{b}"] = weighted_kmeans_1d(xn[keep], weight[keep], 2**b)
    return tensors


def calibrate(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    text: str = "dev corpus",
    bits=(2, 3, 4),
    outlier_fraction: float = 0.01,
    weighting: str = "fisher",
    chunk: int = 512,
    max_samples: int = 2048,
    progress: bool = True,
) -> Calibration:
    """Everything a model's caches need from calibration (`input_ids (1, N)` of calibration text named `text`):
    FP8 scales, per-channel key thresholds and NUQ codebooks for each of `bits`."""
    bits = sorted({int(b) for b in bits})
    if not bits or any(b not in range(1, 9) for b in bits):
        raise ValueError(f"bits={bits}: choose bit widths from 1 to 8 (KVQuant uses 2, 3 and 4)")
    started = time.time()
    acts = collect(model, input_ids, chunk=chunk, max_samples=max_samples, weighting=weighting, progress=progress)
    tensors = fit(acts, bits=bits, outlier_fraction=outlier_fraction, weighted=weighting == "fisher",
                  progress=progress)
    metadata = {
        "format_version": FORMAT_VERSION,
        "method": METHOD,
        "fingerprint": fingerprint(model.config),
        "bits": bits,
        "outlier_fraction": outlier_fraction,
        "weighting": weighting,
        "text": text,
        "tokens": acts.tokens,
        "samples_per_layer": int(acts.samples["v"][0].shape[0]),
        "seconds": round(time.time() - started, 1),
    }
    return Calibration(metadata=metadata, tensors=tensors)
