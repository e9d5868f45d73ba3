"""Reversible looks inside a model: its attention modules, its keys before RoPE, and its rotary embedding.

- `attention_modules(model)`: the attention modules in layer order (those with `k_proj` and `v_proj`).
- `PreRopeKeys(model)`: forward hooks that capture each layer's keys before RoPE (the output of `k_norm` on
  QK-norm models, else of `k_proj`), as a context manager with an explicit `remove()`; the model is unchanged
  once they are removed.
- `layer_ropes(model)`: for each layer, the rotary embedding module and call that produce the cos/sin its
  attention rotates keys with (any `rope_type`: the model's own module computes them), found by one probe
  forward pass with temporary hooks, which also checks that the stored keys are exactly the pre-RoPE keys
  rotated in the rotate-half convention. A model for which that does not hold is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from . import _compat
from .configs import attention_shape


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's attention modules in layer order (modules with `k_proj` and `v_proj` projections); a
    ValueError if they are not one per layer, naming what was found."""
    found = [m for m in model.modules() if isinstance(getattr(m, "k_proj", None), nn.Module)
             and isinstance(getattr(m, "v_proj", None), nn.Module)]
    layers, _, _ = attention_shape(model.config)
    if len(found) != layers:
        raise ValueError(
            f"the pre-RoPE key hook does not recognize this model's attention ({type(model).__name__}): it looks "
            f"for modules with k_proj and v_proj projections, one per layer, and found {len(found)} for {layers} "
            "layers"
        )
    return sorted(found, key=lambda m: getattr(m, "layer_idx", found.index(m)))


class PreRopeKeys:
    """Hooks that keep each layer's keys before RoPE from the last forward pass, as the model made them
    (`keys[i]`; `as_bhtd` puts them in cache layout). With `retain_grad`, their gradients are kept too."""

    def __init__(self, model: nn.Module, retain_grad: bool = False):
        self.keys: dict[int, torch.Tensor] = {}
        self._handles = []
        for i, module in enumerate(attention_modules(model)):
            target = module.k_norm if isinstance(getattr(module, "k_norm", None), nn.Module) else module.k_proj
            self._handles.append(target.register_forward_hook(self._capture(i, retain_grad)))

    def _capture(self, index: int, retain_grad: bool):
        def hook(module, args, output):
            if retain_grad and output.requires_grad:
                output.retain_grad()  # on the tensor the model goes on with, not on a view of it
            self.keys[index] = output

        return hook

    def as_bhtd(self, x: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
        """A captured key tensor (or its gradient) as `(B, Hkv, T, D)`: `k_proj` gives `(B, T, Hkv*D)`; `k_norm`
        runs on `(B, T, Hkv, D)` in some models (Qwen3) and on `(B, Hkv, T, D)` in others (Gemma 3)."""
        if x.dim() == 3:
            return x.view(*x.shape[:2], kv_heads, head_dim).transpose(1, 2)
        if x.shape[1] == kv_heads and x.shape[2] != kv_heads:
            return x
        if x.shape[2] == kv_heads and x.shape[1] != kv_heads:
            return x.transpose(1, 2)
        raise ValueError(f"cannot tell heads from tokens in a captured key of shape {tuple(x.shape)} "
                         f"({kv_heads} kv-heads): use a chunk length other than {kv_heads}")

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> PreRopeKeys:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class RecordingCache(DynamicCache):
    """A DynamicCache that also keeps every K/V it is given (after RoPE, as caches store them)."""

    def __init__(self, config, keep_grad: bool = False):
        super().__init__(config=config)
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.keep_grad = keep_grad

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.keep_grad and key_states.requires_grad:
            key_states.retain_grad()
            value_states.retain_grad()
        self.seen[layer_idx] = (key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE in the rotate-half convention: `x (B, H, T, D)`, `cos`/`sin (B, T, D)`; `inverse` undoes it exactly
    (up to rounding: the rotation is orthogonal)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos - rotate_half(x) * sin if inverse else x * cos + rotate_half(x) * sin


@dataclass
class LayerRope:
    """How one layer's cos/sin are made: `module(x, position_ids, *args, **kwargs)` -> `(cos, sin) (B, T, D)`
    (Gemma 3's shared module takes the layer type as an extra argument)."""

    module: nn.Module
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def cos_sin(self, positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 `(cos, sin) (B, T, D)` at integer `positions (B, T)`, on the positions' device.

        The rotary module runs where its buffers are: in a model split over devices (accelerate's `device_map`)
        it can sit on another device than the layer asking; only the small cos/sin move, never K/V."""
        home = next((b.device for b in self.module.buffers() if b.device.type != "meta"), positions.device)
        probe = torch.zeros(1, 1, head_dim, device=home, dtype=torch.float32)
        cos, sin = self.module(probe, positions.to(home).long(), *self.args, **self.kwargs)
        return cos.float().to(positions.device), sin.float().to(positions.device)

    def frequencies(self, head_dim: int, device: torch.device) -> tuple[torch.Tensor, float] | None:
        """`(inv_freq (D/2,) float32, scale)` such that cos/sin at position p are `cos(p * inv_freq) * scale`
        (both halves), what a kernel needs to apply this RoPE itself; None when no buffer of the module
        reproduces its cos/sin (rope types whose frequencies depend on the sequence length, "dynamic" and
        "longrope", are not offered)."""
        if str(getattr(self.module, "rope_type", "default")) in ("dynamic", "longrope"):
            return None
        positions = torch.tensor([[0, 1, 2, 7, 100, 1000, 4095]], device=device)
        cos, sin = self.cos_sin(positions, head_dim)
        scale = float(cos[0, 0, 0])  # cos(0) * scale
        for name, buf in self.module.named_buffers(recurse=False):
            if not name.endswith("inv_freq") or buf.numel() != head_dim // 2:
                continue
            inv_freq = buf.detach().to(device, torch.float32).reshape(-1)
            angle = positions[0].float()[:, None] * inv_freq[None, :]
            want_cos = torch.cat([angle.cos(), angle.cos()], -1) * scale
            want_sin = torch.cat([angle.sin(), angle.sin()], -1) * scale
            if torch.allclose(cos[0], want_cos, atol=1e-5) and torch.allclose(sin[0], want_sin, atol=1e-5):
                return inv_freq.contiguous(), scale
        return None


def _is_rotary(module: nn.Module) -> bool:
    return any(name.endswith("inv_freq") for name, _ in module.named_buffers(recurse=False))


def layer_ropes(model: nn.Module, tokens: int = 12) -> list[LayerRope]:
    """Each layer's `LayerRope`, from one probe forward pass (temporary hooks, removed before returning).

    Raises a ValueError when the model's attention is not recognized, no rotary module produces a layer's cos/sin,
    or the keys it stores are not its pre-RoPE keys rotated by them in the rotate-half convention (interleaved
    or partial rotary embeddings): KVQuant's pre-RoPE storage could not reproduce them."""
    modules = attention_modules(model)
    _, kv_heads, head_dim = attention_shape(model.config)
    rotaries = [m for m in model.modules() if _is_rotary(m)]
    if not rotaries:
        raise ValueError(f"{type(model).__name__} has no rotary embedding module (a module with an inv_freq "
                         "buffer): pre-RoPE key storage needs one")
    produced: list[tuple[tuple, LayerRope]] = []
    received: dict[int, tuple] = {}
    handles = []

    def on_rotary(module, args, kwargs, output):
        rest = {k: v for k, v in kwargs.items() if k not in ("x", "position_ids")}
        produced.append((output, LayerRope(module, tuple(args[2:]), rest)))

    def on_attention(index):
        def hook(module, args, kwargs):
            pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
            received[index] = pe
        return hook

    for r in rotaries:
        handles.append(r.register_forward_hook(on_rotary, with_kwargs=True))
    for i, m in enumerate(modules):
        handles.append(m.register_forward_pre_hook(on_attention(i), with_kwargs=True))
    param = next(model.parameters())
    device = param.device
    rtol = 1e-4 if param.dtype == torch.float32 else 2e-2  # the model rotated in its own dtype
    ids = torch.arange(tokens, device=device)[None] % _compat.text_config(model.config).vocab_size
    try:
        with PreRopeKeys(model) as pre, torch.no_grad():
            cache = RecordingCache(model.config)
            model(input_ids=ids, use_cache=True, **{_compat.forward_parameters(type(model))[0]: cache})
    finally:
        for h in handles:
            h.remove()
    def same(output: torch.Tensor, got: torch.Tensor) -> bool:
        # The very tensor, or (a model split over devices: accelerate's hooks move it) an identical copy.
        return output is got or (output.shape == got.shape and torch.equal(output.to(got.device), got))

    out = []
    for i in range(len(modules)):
        pe = received.get(i)
        match = [rope for output, rope in produced if pe is not None and same(output[0], pe[0])]
        if not match:
            raise ValueError(
                f"layer {i}'s attention gets cos/sin that no rotary module of {type(model).__name__} produced: "
                "KVQuant's pre-RoPE storage does not recognize this model's position embedding"
            )
        rope = match[0]
        k_pre = pre.as_bhtd(pre.keys[i], kv_heads, head_dim).float()
        k_post = cache.seen[i][0].float()
        cos, sin = rope.cos_sin(torch.arange(tokens, device=k_post.device)[None], head_dim)
        err = (rotate(k_pre, cos, sin) - k_post).abs().max().item()
        if err > rtol * max(k_post.abs().max().item(), 1.0):
            raise ValueError(
                f"layer {i} stores keys that are not its pre-RoPE keys rotated in the rotate-half convention (max "
                f"error {err:.2e}): interleaved or partial rotary embeddings are not supported by pre-RoPE storage; "
                "use pre_rope=False"
            )
        out.append(rope)
    return out


# ---------------------------------------------------------------------------------------- value rotations


@dataclass
class ValueRotation:
    """A rotation folded into a model's value and output projections (`fuse_value_rotation`). `originals` holds
    the weights it replaced (CPU copies), which `unfuse` puts back; `active` turns False then, so that a cache
    built on the fused model refuses to go on."""

    rotation: object  # hf_kvcache.methods.rotated.Rotation
    originals: dict[str, torch.Tensor]
    active: bool = True


_FUSION_ATTR = "_hf_kvcache_value_rotation"
CONFIG_KEY = "hf_kvcache_value_rotation"  # the fused rotation's spec, recorded on the model's config


def _value_path_problem(module: nn.Module) -> str | None:
    if isinstance(getattr(module, "v_norm", None), nn.Module):
        return "it normalizes values between v_proj and the cache (v_norm)"
    for name in ("v_proj", "o_proj"):
        if not isinstance(getattr(module, name, None), nn.Linear):
            return f"it has no linear {name}"
    return None


class _Captured(Exception):
    """Stops a probe forward pass once the attention inputs it needs are recorded."""


def _attention_inputs(model: nn.Module, modules: list[nn.Module], wanted: list[int]) -> dict[int, tuple]:
    """`{i: (args, kwargs)}`: what attention module i receives in one forward of a short probe (the forward stops
    after the last wanted module's inputs are recorded, so a deep model runs a few layers)."""
    seen: dict[int, tuple] = {}
    last = max(wanted)

    def hook_for(i: int):
        def hook(module, args, kwargs):
            seen[i] = (args, dict(kwargs))
            if i == last:
                raise _Captured

        return hook

    handles = [modules[i].register_forward_pre_hook(hook_for(i), with_kwargs=True) for i in wanted]
    param = next(model.parameters())
    ids = torch.arange(3, 19, device=param.device)[None] % _compat.text_config(model.config).vocab_size
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except _Captured:
        pass
    finally:
        for h in handles:
            h.remove()
    return seen


def _as_float32(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.float()
    if isinstance(x, (tuple, list)):
        return type(x)(_as_float32(y) for y in x)
    if isinstance(x, dict):
        return {k: _as_float32(v) for k, v in x.items()}
    return x


def _fold(module: nn.Module, r: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    """Fold `r (D, D)` float64 into `module`'s v_proj (rows per kv-head, bias) and o_proj (columns per query head),
    in float64, stored in each weight's dtype."""
    with torch.no_grad():
        rd = r.to(module.v_proj.weight.device)
        w = module.v_proj.weight.double().view(kv_heads, head_dim, -1)
        module.v_proj.weight.copy_(torch.einsum("de,hdk->hek", rd, w).reshape(module.v_proj.weight.shape))
        if module.v_proj.bias is not None:
            b = module.v_proj.bias.double().view(kv_heads, head_dim)
            module.v_proj.bias.copy_((b @ rd).reshape(-1))
        wo = module.o_proj.weight.double().view(module.o_proj.out_features, -1, head_dim)
        module.o_proj.weight.copy_((wo @ rd).reshape(module.o_proj.weight.shape))


def _check_fold_is_exact(model: nn.Module, modules: list[nn.Module], r: torch.Tensor, kv_heads: int,
                         head_dim: int) -> None:
    """The fold leaves attention outputs unchanged, checked in float32 whatever the model's dtype: for the first
    module of each class (the value path is the class's code), a float32 copy of it runs on the inputs it receives
    in a probe pass, before and after the fold; a relative change past 1e-4 means something between v_proj and the
    cache, or between the attention and o_proj, is not linear per head (ValueError). Checking the model's own
    logits in its dtype says nothing for a 16-bit model: bf16 rounding alone moves the default model's logits by
    1.4% RMS on text against float32, and by 87% on a short probe of low token ids (measured)."""
    import copy

    first: dict[type, int] = {}
    for i, m in enumerate(modules):
        first.setdefault(type(m), i)
    inputs = _attention_inputs(model, modules, sorted(first.values()))
    for i in sorted(first.values()):
        if i not in inputs:
            raise ValueError(f"cannot check the value rotation's fold: attention module {i} of {type(model).__name__} "
                             "did not run in a probe forward pass")
        args, kwargs = (_as_float32(x) for x in inputs[i])
        probe = copy.deepcopy(modules[i]).float()
        with torch.no_grad():
            before = probe(*args, **kwargs)
            before = (before[0] if isinstance(before, tuple) else before).double()
            _fold(probe, r.to(torch.float64), kv_heads, head_dim)
            after = probe(*args, **kwargs)
            after = (after[0] if isinstance(after, tuple) else after).double()
        err = ((after - before).norm() / before.norm().clamp_min(1e-30)).item()
        if not err <= 1e-4:
            raise ValueError(
                f"folding the value rotation into layer {i} of {type(model).__name__} ({type(modules[i]).__name__}) "
                f"changed its attention output in float32 (relative change {err:.2e}): something between v_proj and "
                "the cache, or between the attention and o_proj, is not linear per head; the weights are unchanged"
            )


def fuse_value_rotation(model: nn.Module, rotation) -> ValueRotation:
    """Fold `rotation` (R, `(D, D)` orthogonal, the same for every head) into each layer's values: rows of W_v and
    its bias become `R^T W_v[h]`, `b[h] R`, and the columns of W_o that read query head g become `W_o[:, g] R`,
    so the model's outputs are unchanged while its cached values are `v R`. Computed in float64, stored in the
    weights' dtype (so a bf16 model's outputs move by bf16 rounding, as any bf16 weights would). Records the
    rotation's spec on `model.config` (`hf_kvcache_value_rotation`).

    The same rotation again returns the existing fusion; a different one is refused. A model whose value path
    cannot take the fold (a normalization after v_proj, no linear v_proj/o_proj), or whose attention output changes
    by more than float32 rounding under it (`_check_fold_is_exact`, before any weight is touched), raises a
    ValueError."""
    existing = getattr(model, _FUSION_ATTR, None)
    if existing is not None and existing.active:
        if existing.rotation.spec == rotation.spec:
            return existing
        raise ValueError(
            f"this model is already fused with another value rotation ({existing.rotation.spec}, asked for "
            f"{rotation.spec}): call hf_kvcache.patching.unfuse(model) first"
        )
    modules = attention_modules(model)
    _, kv_heads, head_dim = attention_shape(model.config)
    for i, m in enumerate(modules):
        problem = _value_path_problem(m)
        if problem:
            raise ValueError(f"cannot fold a value rotation into layer {i} of {type(model).__name__}: {problem}; "
                             "folding into W_v would change the model's outputs")
        if any(w.device.type == "meta" for w in (m.v_proj.weight, m.o_proj.weight)):
            raise ValueError(
                f"cannot fold a value rotation into layer {i} of {type(model).__name__}: its v_proj/o_proj weights "
                "are offloaded by accelerate (on the meta device, loaded only while the layer runs), so there is "
                "nothing to rotate in place; load the model without offloading those layers to use RotatedCache"
            )
        if m.v_proj.out_features != kv_heads * head_dim or m.o_proj.in_features % head_dim:
            raise ValueError(f"layer {i}: v_proj/o_proj shapes {tuple(m.v_proj.weight.shape)}/"
                             f"{tuple(m.o_proj.weight.shape)} do not match {kv_heads} kv-heads of head_dim {head_dim}")
    r = rotation.matrix.to(torch.float64)
    _check_fold_is_exact(model, modules, r, kv_heads, head_dim)
    originals = {}
    for i, m in enumerate(modules):
        for name, p in (("v_proj.weight", m.v_proj.weight), ("v_proj.bias", m.v_proj.bias),
                        ("o_proj.weight", m.o_proj.weight)):
            if p is not None:
                originals[f"{i}.{name}"] = p.detach().to("cpu", copy=True)
        _fold(m, r, kv_heads, head_dim)
    fusion = ValueRotation(rotation, originals)
    setattr(model, _FUSION_ATTR, fusion)
    setattr(model.config, CONFIG_KEY, dict(rotation.spec))
    return fusion


def current_fusion(model: nn.Module) -> ValueRotation | None:
    """The active value rotation of `model`, or None."""
    fusion = getattr(model, _FUSION_ATTR, None)
    return fusion if fusion is not None and fusion.active else None


def unfuse(model: nn.Module) -> bool:
    """Put back the weights a value rotation replaced (exactly: the saved originals). Returns whether the model
    was fused. Caches built on the fused model refuse to be updated afterwards."""
    fusion = current_fusion(model)
    if fusion is None:
        return False
    for i, m in enumerate(attention_modules(model)):
        with torch.no_grad():
            for name, p in (("v_proj.weight", m.v_proj.weight), ("v_proj.bias", m.v_proj.bias),
                            ("o_proj.weight", m.o_proj.weight)):
                if p is not None:
                    p.copy_(fusion.originals[f"{i}.{name}"].to(p.device))
    fusion.active = False
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    return True
