"""QuantizedFP8Cache: K/V stored as FP8 (E4M3 or E5M2) bytes with a per-kv-head scale.

Scale modes:
- `none`: scale 1.0 (the raw cast, clamped);
- `dynamic` (default): per sequence and kv-head, `amax * headroom / fp8_max` of the tokens the layer holds when
  it first packs (the prompt, and the residual window if any; never the sinks), then frozen: stored bytes are
  never rescaled, and a later value beyond the frozen range is clamped to the format's maximum (never NaN).
  The headroom (default 2) keeps later, larger tokens in range; E4M3's normal range spans 2^15, so it costs no
  precision on small values;
- `calibrated`: per-layer, per-kv-head scales computed offline: the artifact of `hf-kvcache calibrate` (found
  by the model's fingerprint, or `calibration=PATH`), whose fitted scales are used (or `amax * headroom /
  fp8_max` when `headroom` is given), or explicit `scales={"k_scale": (L, Hkv), "v_scale": (L, Hkv)}` tensors,
  used as given.

One byte per element plus a negligible per-head scale: 0.5 of a 16-bit cache.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..cache import Codec, LayerPolicy, QuantizedKVCache
from ..kernels.layout import PackedFormat
from ..quant import FP8_FORMATS, dequantize_fp8, fp8_max, fp8_scale, quantize_fp8
from ..configs import attention_shape, check_choice, check_nonnegative_int

SCALE_MODES = ("none", "dynamic", "calibrated")


class FP8Codec(Codec):
    """Per-token FP8 bytes: field `codes (B, H, T, D) uint8`; the scale lives in `state["scale"] (B, H, 1, 1)`
    (dynamic) or in the codec (`(1, H, 1, 1)` calibrated, 1.0 none)."""

    def __init__(self, fmt: str, scale_mode: str, scale: torch.Tensor | None = None, headroom: float = 2.0):
        super().__init__()
        self.fmt, self.scale_mode, self.headroom = fmt, scale_mode, headroom
        self.fixed_scale = None if scale is None else scale.float().reshape(1, -1, 1, 1)
        self._unit: torch.Tensor | None = None  # scale 1 as the kernels take it (scale="none")

    def _scale(self, x: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> torch.Tensor | float:
        if self.scale_mode == "none":
            return 1.0
        if self.scale_mode == "calibrated":
            if x is not None and self.fixed_scale.device != x.device:
                self.fixed_scale = self.fixed_scale.to(x.device)  # once, not a host copy every step
            return self.fixed_scale
        if "scale" not in self.state:
            scale = fp8_scale(x, self.fmt, dims=(2, 3), headroom=self.headroom)
            if valid is not None:
                # Left padding must not set a row's range; a row with no text yet keeps the padded amax.
                text = fp8_scale(x * valid[:, None, :, None], self.fmt, dims=(2, 3), headroom=self.headroom)
                scale = torch.where(valid.any(1).view(-1, 1, 1, 1), text, scale)
            self.state["scale"] = scale
        return self.state["scale"]

    @property
    def observing(self) -> bool:
        return self.scale_mode == "dynamic" and "scale" not in self.state

    def observe(self, x: torch.Tensor, valid: torch.Tensor | None) -> None:
        self._scale(x, valid)

    def _check_heads(self, x: torch.Tensor) -> None:
        if self.fixed_scale is not None and self.fixed_scale.shape[1] != x.shape[1]:
            raise ValueError(
                f"calibrated FP8 scales have {self.fixed_scale.shape[1]} kv-heads but the model stores {x.shape[1]}; "
                "the calibration was made for another model"
            )

    def _kernel(self, x: torch.Tensor) -> bool:
        return kernels.use_kernels(x.device) and kernels.head_dim_ok(x.shape[-1])

    def encode(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if self._kernel(x):
            out = {"codes": torch.empty(x.shape, dtype=torch.uint8, device=x.device)}
            self.encode_into(x, valid, out)
            return out
        self._check_heads(x)
        return {"codes": quantize_fp8(x, self.fmt, self._scale(x, valid))}

    def encode_into(self, x: torch.Tensor, valid: torch.Tensor | None, out: dict[str, torch.Tensor]) -> None:
        if not self._kernel(x):
            super().encode_into(x, valid, out)
            return
        self._check_heads(x)
        self._scale(x, valid)  # sets the dynamic scale on the first tokens
        kernels.ops.pack_fp8(x, out["codes"], self._head_scale(x.device), self.fmt, fp8_max(self.fmt))

    def _head_scale(self, device: torch.device | None = None) -> torch.Tensor | None:
        """The scale as the kernels take it, `(B or 1, H)` float32; None while a dynamic scale is not set yet."""
        if self.scale_mode == "calibrated":
            return self.fixed_scale.reshape(1, -1)
        if self.scale_mode == "dynamic":
            scale = self.state.get("scale")
            return None if scale is None else scale.reshape(scale.shape[:2])
        if device is not None and self._unit is None:
            self._unit = torch.ones(1, 1, device=device)  # made once, not every step
        return self._unit

    def packed_format(self) -> PackedFormat:
        return PackedFormat(kind=f"fp8-{self.fmt}", scale=self._head_scale())

    def decode(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes = fields["codes"]
        scale = self._scale()
        if isinstance(scale, torch.Tensor):
            scale = scale.to(codes.device)
        return dequantize_fp8(codes, self.fmt, scale, dtype)


def _calibrated_scales(scales, num_layers: int, kv_heads: int, fmt: str, headroom: float | None
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer `(k_scale (Hkv,), v_scale (Hkv,))` from a mapping of `(L, Hkv)` tensors or a calibration object."""
    if scales is None:
        raise ValueError(
            "scale='calibrated' needs per-head scales: pass scales={'k_scale': (layers, kv_heads), 'v_scale': ...} "
            "tensors (or a calibration artifact), or use scale='dynamic', which needs no calibration"
        )
    if hasattr(scales, "fp8_scales"):
        return [tuple(t.float() for t in scales.fp8_scales(i, fmt, headroom)) for i in range(num_layers)]
    out = []
    for name in ("k_scale", "v_scale"):
        t = torch.as_tensor(scales[name]).float()
        if t.shape != (num_layers, kv_heads):
            raise ValueError(
                f"calibrated {name} has shape {tuple(t.shape)} but this model needs ({num_layers}, {kv_heads}) "
                "(layers, kv-heads); the calibration was made for another model"
            )
        if not torch.isfinite(t).all() or (t <= 0).any():
            raise ValueError(f"calibrated {name} must be finite and positive")
        out.append(t)
    return [(out[0][i], out[1][i]) for i in range(num_layers)]


class QuantizedFP8Cache(QuantizedKVCache):
    """FP8 KV cache.

    Args:
        config: the model's config (`model.config`).
        fmt: "e4m3" (default: 3 mantissa bits, max 448) or "e5m2" (2 mantissa bits, max 57344).
        scale: "dynamic" (default), "none" (or None) or "calibrated" (a calibration artifact, or `scales`).
        scales: explicit calibrated per-layer per-kv-head scales, see the module docstring.
        calibration: for `scale="calibrated"`, a `Calibration` or the path of an artifact; default: the one
            `hf-kvcache calibrate` stored for this model.
        headroom: how far beyond the observed amax the range reaches: the first tokens' amax for dynamic
            scales (default 2); for an artifact, None (default) takes its fitted scales, and a number gives
            `amax * headroom / fp8_max`.
        sink_tokens, residual_length: tokens kept in the model dtype at the start / end (default 0).
        max_cache_len: the capacity pinned: storage for this many tokens allocated up front, and `generate`
            compiles the decode step (`torch.compile`, CUDA graphs); None (default): a capacity that grows as tokens
            come (on CUDA its eager decode steps replay CUDA graphs).
    """

    def __init__(
        self,
        config,
        fmt: str = "e4m3",
        scale: str = "dynamic",
        *,
        max_cache_len: int | None = None,
        scales=None,
        calibration=None,
        headroom: float | None = None,
        sink_tokens: int = 0,
        residual_length: int = 0,
    ):
        check_choice("fmt", fmt, tuple(FP8_FORMATS))
        scale = "none" if scale is None else scale  # `fp8-e4m3:scale=none` parses to None
        check_choice("scale", scale, SCALE_MODES, "'calibrated' needs scales from a calibration.")
        check_nonnegative_int("sink_tokens", sink_tokens)
        check_nonnegative_int("residual_length", residual_length)
        if headroom is not None and not headroom >= 1.0:
            raise ValueError(f"headroom={headroom!r} must be >= 1")
        num_layers, kv_heads, _ = attention_shape(config)
        per_layer = None
        if scale == "calibrated":
            if scales is None:
                from ..artifact import find

                scales = find(config, calibration)
            per_layer = _calibrated_scales(scales, num_layers, kv_heads, fmt, headroom)
        self.fmt, self.scale_mode = fmt, scale
        self.calibration = scales if hasattr(scales, "metadata") else None  # the artifact read, if any

        def policy(layer_idx: int) -> LayerPolicy:
            k, v = per_layer[layer_idx] if per_layer is not None else (None, None)
            return LayerPolicy(
                key_codec=FP8Codec(fmt, scale, k, 2.0 if headroom is None else headroom),
                value_codec=FP8Codec(fmt, scale, v, 2.0 if headroom is None else headroom),
                sink_tokens=sink_tokens,
                key_residual_length=residual_length,
                value_residual_length=residual_length,
            )

        super().__init__(config, policy, max_cache_len=max_cache_len)
