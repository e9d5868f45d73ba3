"""RotatedCache: orthogonal (Hadamard) rotations spread the outlier channels of keys and values over all channels,
so that plain uniform codes work (QuaRot, Ashkboos et al., NeurIPS 2024; RotateKV, IJCAI 2025).

- Values: `v' = v R` for every head, folded into the rows of W_v (and its bias) and, undone, into the columns of
  W_o that read each query head: `W_v[h] <- R^T W_v[h]`, `W_o[:, g] <- W_o[:, g] R`. Offline, exact, the same R
  for every head, so GQA/MQA need nothing more (`hf_kvcache.patching.fuse_value_rotation`).
- Keys: `k' = k R` after RoPE, online, when the layer stores them (every place: sink, packed, residual), and
  `q' = q R` inside the attention, so `q' . k' = q . k`; the dense read path returns `k' R^T`.
- R: the normalized Sylvester Hadamard matrix when head_dim is a power of two (applied by a fast Walsh-Hadamard
  transform, in Triton on the GPU); otherwise an exact orthogonal matrix of that size, never zero padding: a
  Paley Hadamard matrix of order q + 1 (q a prime = 3 mod 4) times a Sylvester one when head_dim has that form
  (80 = 20 * 4, 96 = 12 * 8, 192 = 12 * 16, ...), else a random orthogonal matrix from a seeded QR.
- Codes: uniform asymmetric per token, one group per head vector by default, with a clip ratio (the range is
  `[min * r, max * r]`), optional exact sink tokens and a full-precision residual window.

Because other caches would see rotated values on a fused model, `hf-kvcache eval` unfuses the model before every
method that is not a RotatedCache, and `unfuse(model)` restores the original weights exactly.
"""

from __future__ import annotations

import math

import torch

from .. import kernels
from ..cache import LayerPolicy, QuantizedKVCache
from ..quant import fwht
from ..configs import attention_shape, check_choice, check_group_size, check_nonnegative_int
from .int import IntCodec

ROTATED_BITS = (2, 3, 4)
# Clip ratios from a sweep on the default model (README, "RotatedCache"): the best streaming perplexity at each
# width among 1.0 / 0.95 / 0.9 / 0.85 (4 bits), 0.95 .. 0.8 (3 bits) and 0.8 .. 0.5 (2 bits). Lower than QuaRot's
# 0.95 and RotateKV's 0.8: one group per head vector of a small model has a long tail to clip.
DEFAULT_CLIP = {4: 0.9, 3: 0.8, 2: 0.6}


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % p for p in range(2, math.isqrt(q) + 1))


def _paley(order: int) -> torch.Tensor:
    """Paley's construction I: a Hadamard matrix of order q + 1 for a prime q = 3 (mod 4)."""
    q = order - 1
    squares = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0] + [1 if i in squares else -1 for i in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    jacobsthal = chi[(idx[None, :] - idx[:, None]) % q]  # Q[i, j] = chi(j - i), antisymmetric
    s = torch.zeros(order, order, dtype=torch.float64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = jacobsthal
    return s + torch.eye(order, dtype=torch.float64)


def rotation_matrix(head_dim: int, seed: int = 0) -> tuple[torch.Tensor, str]:
    """An exact orthogonal `(head_dim, head_dim)` float64 matrix and what it is: `"hadamard"` (Sylvester, a
    power of two), `"hadamard-paley{m}"` (Paley of order m times Sylvester) or `"random-orthogonal"` (seeded QR)."""
    if head_dim < 2:
        raise ValueError(f"head_dim={head_dim} has no rotation to spread outliers over")
    if not head_dim & (head_dim - 1):
        return _sylvester(head_dim) / math.sqrt(head_dim), "hadamard"
    pow2 = head_dim & -head_dim
    m = head_dim // pow2
    for order in sorted({m, 2 * m, 4 * m} - {1, 2}):  # try m, then move factors of two into the Paley part
        if head_dim % order == 0 and order % 4 == 0 and _is_prime(order - 1) and (order - 1) % 4 == 3:
            h = torch.kron(_paley(order), _sylvester(head_dim // order))
            return h / math.sqrt(head_dim), f"hadamard-paley{order}"
    return random_orthogonal(head_dim, seed), "random-orthogonal"


def random_orthogonal(head_dim: int, seed: int) -> torch.Tensor:
    """A `(head_dim, head_dim)` float64 orthogonal matrix drawn uniformly (Haar) from a seeded Gaussian's QR."""
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]


class Rotation:
    """`R (D, D)` orthogonal, applied to the last axis: `apply(x) = x R`, `apply(x, inverse=True) = x R^T`, in
    float32, returned in x's dtype. The Sylvester Hadamard matrix goes through a fast Walsh-Hadamard transform
    (the Triton kernel where the kernels run, `quant.fwht` otherwise); other matrices through a product."""

    def __init__(self, head_dim: int, seed: int = 0):
        self.head_dim, self.seed = head_dim, seed
        self.matrix, self.kind = rotation_matrix(head_dim, seed)
        self._on: dict[torch.device, torch.Tensor] = {}

    @property
    def spec(self) -> dict:
        """What identifies this rotation (recorded on a fused model's config)."""
        return {"kind": self.kind, "head_dim": self.head_dim, "seed": self.seed if self.kind == "random-orthogonal" else 0}

    def apply(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        if self.kind == "hadamard":  # symmetric: its own inverse
            if kernels.use_kernels(x.device) and kernels.head_dim_ok(self.head_dim):
                return kernels.ops.hadamard(x)
            return fwht(x).to(x.dtype)
        if x.device not in self._on:
            self._on[x.device] = self.matrix.to(device=x.device, dtype=torch.float32)
        r = self._on[x.device]
        return kernels.ops.rotate_rows(x, r.T if inverse else r).to(x.dtype)


class RotatedCache(QuantizedKVCache):
    """Uniform K/V codes behind Hadamard rotations. Build it with `RotatedCache.from_model(model, bits=4)` (or
    `make_cache("rotated-4", model)`), which folds the value rotation into the model's weights once.

    Args:
        config: the model's config.
        bits: 4, 3 or 2.
        fusion: the `hf_kvcache.patching.ValueRotation` that `from_model` made (its rotation rotates the keys).
        group_size: 32, 64, 128 or None (default: one group per head vector).
        clip_ratio: range `[min * r, max * r]` of each group (default 0.9 at 4 bits, 0.8 at 3, 0.6 at 2).
        sink_tokens: first tokens kept in the model dtype (default 0).
        residual_length: most recent tokens kept in the model dtype (default 0).
        max_cache_len: the capacity pinned: storage for this many tokens allocated up front, and `generate`
            compiles the decode step (`torch.compile`, CUDA graphs); None (default): a capacity that grows as tokens
            come (on CUDA its eager decode steps replay CUDA graphs).
    """

    def __init__(
        self,
        config,
        bits: int = 4,
        *,
        max_cache_len: int | None = None,
        fusion=None,
        group_size: int | None = None,
        clip_ratio: float | None = None,
        sink_tokens: int = 0,
        residual_length: int = 0,
    ):
        from ..patching import ValueRotation

        check_choice("bits", bits, ROTATED_BITS)
        check_choice("group_size", group_size, (32, 64, 128, None), "None means one group per head vector.")
        check_nonnegative_int("sink_tokens", sink_tokens)
        check_nonnegative_int("residual_length", residual_length)
        if not isinstance(fusion, ValueRotation):
            raise ValueError(
                "a RotatedCache needs the model's weights fused with its value rotation: build it with "
                "RotatedCache.from_model(model, bits=...) or make_cache('rotated-4', model)"
            )
        _, _, head_dim = attention_shape(config)
        check_group_size(group_size, head_dim)
        clip_ratio = DEFAULT_CLIP[bits] if clip_ratio is None else float(clip_ratio)
        if not 0 < clip_ratio <= 1:
            raise ValueError(f"clip_ratio={clip_ratio!r} must be in (0, 1] (QuaRot uses 0.95)")
        self.bits, self.group_size, self.clip_ratio, self.fusion = bits, group_size, clip_ratio, fusion
        rotation = fusion.rotation

        def policy(layer_idx: int) -> LayerPolicy:
            return LayerPolicy(
                key_codec=IntCodec(bits, group_size, False, clip_ratio),
                value_codec=IntCodec(bits, group_size, False, clip_ratio),
                sink_tokens=sink_tokens,
                key_residual_length=residual_length,
                value_residual_length=residual_length,
                key_rotation=rotation,
            )

        super().__init__(config, policy, max_cache_len=max_cache_len)

    @classmethod
    def from_model(cls, model, bits: int = 4, *, seed: int = 0, **kwargs) -> RotatedCache:
        """Fold the value rotation into `model`'s weights (or reuse the one already there, if it is the same; a
        different one is refused) and build the cache. `seed` picks the random orthogonal matrix of a head_dim
        with no Hadamard construction here."""
        from ..patching import fuse_value_rotation

        _, _, head_dim = attention_shape(model.config)
        return cls(model.config, bits, fusion=fuse_value_rotation(model, Rotation(head_dim, seed)), **kwargs)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not self.fusion.active:
            raise RuntimeError(
                "the model was unfused after this RotatedCache was built: its values would no longer be rotated. "
                "Build a new cache with RotatedCache.from_model(model, ...) (which fuses again)"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
