"""What one sequence's KV cache holds, measured on the real cache layouts (`hf-kvcache plan`'s bytes).

For a spec and a config, `Footprint.measure(spec, context)` gives three parts, each counted from tensors:

- `held`: what the layers' tokens take, `nbytes()` (codes, scales, zeros, exact windows, sinks, codec state). Random
  K/V `(1, Hkv, n, D)` are stored in one layer of each distinct kind (full attention, or sliding with its window;
  every method gives all layers of a kind the same layout).
  - full attention: past its windows a layer's storage repeats every P tokens (P: the least common multiple of its
    codecs' block sizes and of its block-flushed residual lengths, from its `LayerPolicy`), each period adding the
    same bytes. Bytes at the context = bytes at a size congruent to the context modulo P, plus the periods in
    between times one period's bytes (checked to repeat over two steps). Exact, not fitted.
  - sliding window: a prefill up to the window, then one-token decode steps (up to the context, at most
    `_DECODE_STEPS`); the most the layer holds on that path (its window plus the margin kept for rollbacks).
- `spare`: the capacity a prompt of `context` tokens, prefilled in one forward, leaves unfilled (`allocated_nbytes()
  - nbytes()`: the capacity is what the prompt needs plus 64 tokens, in multiples of 64, and each place keeps a spare
  row). It depends on the context modulo a few hundred tokens only, so it is measured on a prefill congruent to it.
  Decoding past the prompt grows the capacity by 6.25% steps, which this does not count.
- `fixed`: every other tensor the cache holds, whatever its length: rotations, codebooks, calibration tables, ring
  indices, lengths (`tensor_bytes` of the whole cache, each storage once, less its layers' storage), as a cache
  whose every layer took one write holds them (what a codec makes at its first use included).

No weights are needed: presets that need a model are built from the config alone, honestly because their storage
depends on shapes and settings only: `kvquant-*` with a calibration of the config's shapes holding placeholder ranges
and codebooks and a RoPE of angle zero (the position field is stored either way), `rotated-*` with a rotation
recorded but fused into no weights (so the fusion's copies of the original weights, which the model's `unfuse`
needs, are not counted: they are the model's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from . import _compat
from .cache import _MIN_GROW, _SLIDING_CROP_MARGIN, QuantizedKVLayer
from .kernels import use_backend
from .configs import attention_shape
from .methods.kvquant import KVQUANT_BITS, KVQuantCache
from .methods.rotated import RotatedCache, Rotation
from .patching import LayerRope, ValueRotation
from .presets import PRESETS, make_cache, parse_spec

__all__ = ["Footprint", "Measure", "build_cache", "tensor_bytes"]

# One-token decode steps simulated on a sliding-window layer past its window: QuantizedKVLayer trims its window in
# bulk every `_SLIDING_CROP_MARGIN` tokens, so four margins show its whole cycle twice.
_DECODE_STEPS = 4 * _SLIDING_CROP_MARGIN
_STEP = 128  # tokens between the sizes a full-attention layer is measured at (rounded up to its period)
# Storage rounds a place's rows up to a multiple of at most this many (`storage._capacity`): with the capacity's
# multiples of `_MIN_GROW` tokens, the spare capacity repeats every lcm(64, P, 16 x block) tokens.
_ROW_ALIGN = 16
_WALKED_MODULES = ("hf_kvcache", "transformers.cache_utils")  # objects whose attributes `tensor_bytes` follows
# (config JSON, dtype, spec, context) -> Footprint: a plan measures every preset, and a process often plans again
_FOOTPRINTS: dict[tuple, Footprint] = {}


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def layer_nbytes(layer) -> int:
    """Bytes one cache layer holds: `layer.nbytes()` of an hf-kvcache layer, else its K and V tensors
    (`layer.keys`, `layer.values`) and, for transformers' `QuantizedCache`, its quantized states (a backend's
    tensors, followed into their parts: a quanto tensor's packed codes, scales and shifts)."""
    if callable(getattr(layer, "nbytes", None)):
        return int(layer.nbytes())
    held = _tensor_bytes(getattr(layer, "keys", None)) + _tensor_bytes(getattr(layer, "values", None))
    quantized = [getattr(layer, name, None) for name in ("_quantized_keys", "_quantized_values")]
    return held + sum(_storages(quantized).values())


def cache_nbytes(cache) -> int:
    """Bytes a cache holds: `cache.nbytes()` where the cache reports it (every hf-kvcache cache: codes,
    scales, zeros, residual, sinks), else `layer_nbytes` of each layer."""
    if callable(getattr(cache, "nbytes", None)):
        return int(cache.nbytes())
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return sum(layer_nbytes(layer) for layer in layers)
    raise TypeError(f"cannot measure a {type(cache).__name__}: it has neither nbytes() nor layers")


def _storages(obj, skip: tuple = ()) -> dict[int, int]:
    """`{storage address: bytes}` of every tensor reachable from `obj`, not entering the objects in `skip`."""
    storages: dict[int, int] = {}
    seen: set[int] = {id(o) for o in skip}
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor) and hasattr(o, "__tensor_flatten__"):  # a wrapper subclass: its parts
            stack.extend(getattr(o, name) for name in o.__tensor_flatten__()[0])
        elif isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, nn.Module) or type(o).__module__.startswith(_WALKED_MODULES):
            stack.extend(vars(o).values() if hasattr(o, "__dict__") else ())
            stack.extend(getattr(o, name) for name in getattr(type(o), "__slots__", ()) if hasattr(o, name))
    return storages


def tensor_bytes(obj) -> int:
    """Bytes of every tensor reachable from `obj` (a cache, a layer), each storage counted once, whole (a view
    counts the storage it views). Follows containers, modules (parameters, buffers, attributes) and the attributes
    of objects defined in hf_kvcache or transformers' cache module; nothing else (a config holds no tensor)."""
    return sum(_storages(obj).values())


def _own_bytes(cache, layer) -> int:
    """Bytes of the tensors only `layer` holds in `cache` (reachable from it and from nothing else of the cache)."""
    outside = _storages(cache, skip=(layer,))
    return sum(n for ptr, n in _storages(layer).items() if ptr not in outside)


def _storage_bytes(layer) -> int:
    """Bytes a layer's storage allocates: `allocated_nbytes()` of an hf-kvcache layer (its filled and unfilled
    capacity), the K and V tensors of a transformers one."""
    return layer.allocated_nbytes() if isinstance(layer, QuantizedKVLayer) else layer_nbytes(layer)


# ------------------------------------------------------------------------------------------------ building


class _ZeroAngleRotary(nn.Module):
    """A rotary embedding whose angle is always zero (cos 1, sin 0): `(x, position_ids (B, T)) -> (cos, sin) (B, T,
    D)`. RoPE's angles change the values a pre-RoPE key cache stores, not its layout."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*position_ids.shape, x.shape[-1])
        return torch.ones(shape, device=x.device), torch.zeros(shape, device=x.device)


def _layout_calibration(config):
    """A calibration of `config`'s shapes holding what `KVQuantCache` reads, with placeholder values: per-channel key
    ranges `(Hkv, D)` of [-1, 1] and uniform codebooks `(2^b,)` for every bit width. The layout of KVQuant's storage
    (codes, outlier slots, fp16 ranges, positions) depends on the shapes only."""
    from .artifact import Calibration, fingerprint

    layers, kv_heads, head_dim = attention_shape(config)
    lo, hi = -torch.ones(kv_heads, head_dim), torch.ones(kv_heads, head_dim)
    books = {bits: torch.linspace(-1, 1, 2**bits) for bits in KVQUANT_BITS}
    tensors = {}
    for i in range(layers):
        for place in ("k_pre", "k_post"):
            tensors[f"layers.{i}.{place}.lo"], tensors[f"layers.{i}.{place}.hi"] = lo.clone(), hi.clone()
        for bits, book in books.items():
            for place in ("k_pre", "k_post", "v"):
                tensors[f"layers.{i}.{place}.nuq{bits}"] = book.clone()
    return Calibration({"fingerprint": fingerprint(config), "bits": list(KVQUANT_BITS)}, tensors)


def build_cache(spec: str, config):
    """The cache `spec` names, built on `config` alone (see the module docstring for the presets that need a
    model)."""
    name, overrides = parse_spec(spec)
    preset = PRESETS[name]
    if not preset.needs_model:
        return make_cache(spec, config)
    kwargs = {**preset.kwargs, **overrides}
    layers, _, head_dim = attention_shape(config)
    builder = getattr(preset.build, "__self__", None)  # the presets that need a model build through `from_model`
    try:
        if builder is KVQuantCache:
            ropes = [LayerRope(_ZeroAngleRotary())] * layers if kwargs.get("pre_rope", True) else None
            kwargs.setdefault("calibration", _layout_calibration(config))
            return KVQuantCache(config, ropes=ropes, **kwargs)
        if builder is RotatedCache:
            fusion = ValueRotation(Rotation(head_dim, kwargs.pop("seed", 0)), originals={})
            return RotatedCache(config, fusion=fusion, **kwargs)
    except TypeError as error:
        raise ValueError(f"spec {spec!r}: {error}") from error
    raise ValueError(f"spec {spec!r} needs the model's weights to build; the planner cannot build it from a config")


def _period(layer) -> tuple[int, int]:
    """`(P, start)`: past `start` tokens a full-attention layer's storage repeats every P tokens, each period adding
    the same bytes. A FIFO residual holds between R and R + block - 1 tokens once R have passed; a block-flushed one
    cycles through R from the first token. A transformers layer adds the same bytes every token."""
    if not isinstance(layer, QuantizedKVLayer):
        return 1, 0
    p = layer.policy
    periods = [p.key_codec.block_size, p.value_codec.block_size]
    for flush, residual in ((p.key_flush, p.key_residual_length), (p.value_flush, p.value_residual_length)):
        if flush == "block":
            periods.append(residual)
    return math.lcm(*periods), p.sink_tokens + max(p.key_residual_length, p.value_residual_length)


# ------------------------------------------------------------------------------------------------ measuring


@dataclass(frozen=True)
class Footprint:
    """Bytes one sequence's cache holds (batch 1): `held` by its tokens (`nbytes()`), `spare` capacity a one-forward
    prefill of the context leaves, and `fixed` tensors held whatever the length. `total` is every tensor."""

    held: int
    spare: int
    fixed: int

    @property
    def total(self) -> int:
        return self.held + self.spare + self.fixed


class Measure:
    """Stores random K/V `(1, Hkv, n, D)` in fresh caches of one config and reads what they hold."""

    def __init__(self, config, dtype: torch.dtype):
        self.config = config
        self.dtype = dtype
        _, self.kv_heads, self.head_dim = attention_shape(config)
        groups: dict[int | None, list[int]] = {}
        for idx, spec in enumerate(_compat.layer_specs(config)):
            if spec.kind != "dummy":  # a layer reading another layer's K/V holds nothing
                groups.setdefault(spec.sliding_window, []).append(idx)
        # (representative layer, layers of its kind, sliding window or None)
        self.kinds = [(indices[0], len(indices), window) for window, indices in groups.items()]
        self.second = {indices[0]: indices[1] for indices in groups.values() if len(indices) > 1}
        self.generator = torch.Generator().manual_seed(0)

    def _feed(self, layer, n: int) -> None:
        shape = (1, self.kv_heads, n, self.head_dim)
        k = torch.randn(shape, generator=self.generator).to(self.dtype)
        v = torch.randn(shape, generator=self.generator).to(self.dtype)
        layer.update(k, v)

    def _fresh(self, spec: str, index: int):
        return _fused(build_cache(spec, self.config)).layers[index]

    def _full(self, spec: str, index: int, context: int) -> tuple[int, int]:
        """`(held, spare)` of a full-attention layer holding `context` tokens."""
        layer = self._fresh(spec, index)
        period, start = _period(layer)
        step = period * -(-_STEP // period)
        first = start + period + (context - start - period) % period  # past every window, = context (mod P)
        if context <= first + 2 * step:
            self._feed(layer, context)
            return layer_nbytes(layer), _storage_bytes(layer) - layer_nbytes(layer)
        sizes = []
        for n in (first, step, step):  # the final layout of a full layer does not depend on how tokens arrived
            self._feed(layer, n)
            sizes.append(layer_nbytes(layer))
        periods_per_step = step // period
        grown = sizes[1] - sizes[0]
        if sizes[2] - sizes[1] != grown or grown % periods_per_step:
            raise RuntimeError(
                f"{spec}: the storage does not repeat every {period} tokens (bytes {sizes} at {first}, "
                f"+{step}, +{step} tokens); the planner cannot extrapolate it"
            )
        return sizes[0] + (context - first) // period * (grown // periods_per_step), self._spare(spec, index, context)

    def _spare(self, spec: str, index: int, context: int) -> int:
        """The capacity a one-forward prefill of `context` tokens leaves unfilled, measured on a prefill congruent to
        it modulo the spare's period (past every window)."""
        layer = self._fresh(spec, index)
        if not isinstance(layer, QuantizedKVLayer):
            return 0  # a transformers layer holds its tokens' K/V and nothing more
        period, start = _period(layer)
        p = layer.policy
        blocks = max(p.key_codec.block_size, p.value_codec.block_size)
        cycle = math.lcm(_MIN_GROW, period, _ROW_ALIGN * blocks)
        n = start + period + (context - start - period) % cycle
        self._feed(layer, n)
        return _storage_bytes(layer) - layer_nbytes(layer)

    def _sliding(self, spec: str, index: int, context: int, window: int) -> tuple[int, int]:
        """`(held, spare)` of a sliding-window layer at the most it holds while decoding past its window."""
        layer = self._fresh(spec, index)
        prefill = min(context, window)
        self._feed(layer, prefill)
        most = (layer_nbytes(layer), _storage_bytes(layer))
        for _ in range(min(context - prefill, _DECODE_STEPS)):
            self._feed(layer, 1)
            most = max(most, (layer_nbytes(layer), _storage_bytes(layer)), key=lambda m: m[1])
        return most[0], most[1] - most[0]

    def _fixed(self, spec: str) -> int:
        """Bytes of the tensors a whole cache holds beyond its layers' storage. Writing to every layer of a deep
        model takes seconds (KIVI's key-range search), so one layer of each kind is written to (past its windows:
        every codec has made what it makes at its first use) and the others are counted as it: total = every tensor
        of the cache, less the written layers' storage, plus, for each other layer of the kind, what the written
        layer holds alone beyond its storage less what an unwritten one holds alone."""
        cache = _fused(build_cache(spec, self.config))
        written = []
        for index, count, _ in self.kinds:
            layer = cache.layers[index]
            if isinstance(layer, QuantizedKVLayer):
                period, start = _period(layer)
                self._feed(layer, start + period)
                written.append((index, count))
        fixed = tensor_bytes(cache) - sum(_storage_bytes(cache.layers[i]) for i, _ in written)
        for index, count in written:
            if count > 1:
                layer, other = cache.layers[index], cache.layers[self.second[index]]
                own = _own_bytes(cache, layer) - _storage_bytes(layer)
                fixed += (count - 1) * (own - _own_bytes(cache, other))
        return fixed

    def footprint(self, spec: str, context: int) -> Footprint:
        """What one sequence of `context` tokens takes in the cache `spec` names, every layer included."""
        key = (self.config.to_json_string(use_diff=False), str(self.dtype), spec, context)
        if key not in _FOOTPRINTS:
            _FOOTPRINTS[key] = self._measure(spec, context)
        return _FOOTPRINTS[key]

    def _measure(self, spec: str, context: int) -> Footprint:
        threads = torch.get_num_threads()
        # The tensors are small (one layer, a few hundred tokens): waking other threads costs more than it gives,
        # up to 30x on a loaded machine (measured on 2 shared cores).
        torch.set_num_threads(1)
        try:
            with use_backend("torch"):  # the kernels write the same fields as the reference: same bytes, no GPU
                held = spare = 0
                for index, count, window in self.kinds:
                    h, s = (self._full(spec, index, context) if window is None
                            else self._sliding(spec, index, context, window))
                    held, spare = held + count * h, spare + count * s
                return Footprint(held, spare, self._fixed(spec))
        finally:
            torch.set_num_threads(threads)


def _fused(cache):
    """`cache` with its layers on the fused path: `update()` returns handles, so only storage is built (no dense
    K/V)."""
    for layer in cache.layers:
        if isinstance(layer, QuantizedKVLayer):
            layer.fused = True
    return cache
