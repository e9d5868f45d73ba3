"""TurboQuantCache: a random rotation, then one fixed optimal scalar codebook per coordinate; no calibration
(Zandieh, Daliri, Hadian, Mirrokni, "TurboQuant: Online Vector Quantization with Near-optimal Distortion Rate",
arXiv 2504.19874).

- Rotation: each key (after RoPE) and each value vector `x (D,)` is rotated by a seeded random orthogonal transform
  (`RandomRotation`): by default the paper's, `x Q` with Q uniform on the orthogonal group (QR of a seeded Gaussian
  matrix); or the randomized Hadamard transform `(x * s) R` (random signs, then the exact orthogonal matrix of
  `RotatedCache`: Walsh-Hadamard for a power of two, Paley-Hadamard or seeded orthogonal otherwise, never zero
  padding), once or twice. Seeds differ per layer and between keys and values.
- Law: the unit vector `u = y / |y|` of a uniformly rotated vector is uniform on the sphere S^(D-1), each coordinate
  following one known law, density proportional to `(1 - t^2)^((D - 3) / 2)` on [-1, 1] (close to N(0, 1/D)).
  `lloyd_max_codebook(D, b)` computes the b-bit Lloyd-Max quantizer of that law in float64 on a fine grid, once per
  (D, b): no data, no calibration file.
- Codes: each coordinate of u is coded to its nearest centroid (codes in sign-magnitude order, `signed_order`;
  3-bit codes stored as a 2-bit plane then a 1-bit plane, `pack_codes`: the layouts the fused kernel reads, see
  `hf_kvcache.kernels.layout.CodebookFormat`); one fp16 length per vector is kept, either the
  norm `|y|` (the paper, `scale="norm"`) or the least-squares length of the coded direction `<y, c> / |c|^2`
  (`scale="lsq"`, the default: the same bytes, a smaller error). The decoded vector is that length times
  `c[codes]`, rotated back.
- Fractional widths (the paper's 2.5 and 3.5 bits): by default the paper's outlier split, made online: the half of
  the channels with most energy in the prefill (per sequence and kv-head) at b + 1 bits and the other half at b,
  each rotated and coded apart with its own length (`SplitTurboCodec`); `split=0` keeps one rotation and gives the
  extra bit to a fixed half of the rotated channels (after a random rotation no channel is special).
- `key_qjl=True` (the paper's inner-product quantizer, keys only, with `scale="norm"`): a (b - 1)-bit codebook plus
  a 1-bit QJL sketch of the residual `r = u - c[codes]`, `sign(S r)` with `S` a seeded Gaussian matrix, and `|r|`;
  the key decodes to `|y| (c[codes] + |r| sqrt(pi / 2) / D * S^T sign(S r))`, so that `q . k_hat` is the paper's
  unbiased estimate.

Bytes per token and kv-head: `D * b / 8` of codes and 2 of length, 4 with a split (`key_qjl`: `D / 8` of signs
and 2 of residual norm more, the codebook one bit narrower).

The fused attention (`hf_kvcache.kernels.turbo`) reads the codes where they lie: the codec's rotation (and the split's
channel order) is the format's `frame` F, orthogonal, so `q . k = (q F) . (k F)`; the kernel gets the query rotated
once per step, scores against `length * codebook[code]` part by part, and its output is rotated back by F^T, eager
and compiled alike. On the kernels' backend the codes are written by a pack kernel
(`kernels.ops.pack_turbo`) after the rotation, which PyTorch applies as the reference does. QJL keys have no kernel
(the reference path reads and writes them).
"""

from __future__ import annotations

import functools
import math

import torch

from .. import kernels
from ..cache import Codec, LayerPolicy, QuantizedKVCache
from ..kernels.layout import CodebookFormat, CodebookPart
from ..quant import pack_bits, unpack_bits
from ..configs import attention_shape, check_choice, check_nonnegative_int
from .rotated import Rotation, random_orthogonal

TURBOQUANT_BITS = (2, 2.5, 3, 3.5, 4)
_GRID = 1 << 14  # cells of [-1, 1] on which the law is integrated (a coordinate's spread is ~700 cells at D=128)


@functools.lru_cache(maxsize=None)
def coordinate_law(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(t, w)` float64: cell centres of [-1, 1] and their probabilities under the law of one coordinate of a uniform
    unit vector of R^head_dim, density proportional to `(1 - t^2)^((head_dim - 3) / 2)`."""
    if head_dim < 2:
        raise ValueError(f"head_dim={head_dim}: a rotated coordinate law needs head_dim >= 2")
    edges = torch.linspace(-1.0, 1.0, _GRID + 1, dtype=torch.float64)
    t = (edges[1:] + edges[:-1]) / 2
    logw = (head_dim - 3) / 2 * torch.log1p(-t * t)
    w = torch.exp(logw - logw.max())
    return t, w / w.sum()


@functools.lru_cache(maxsize=None)
def lloyd_max_codebook(head_dim: int, bits: int) -> torch.Tensor:
    """The `bits`-bit Lloyd-Max codebook `(2^bits,)` float32, ascending, of one rotated coordinate of a unit vector
    of R^head_dim (`coordinate_law`): centroids that are the conditional means of their cells, cells bounded by
    the midpoints of neighbouring centroids; iterated from the law's quantiles until the centroids move < 1e-12."""
    if bits < 1 or bits > 8:
        raise ValueError(f"a Lloyd-Max codebook has 1 to 8 bits, got {bits}")
    t, w = coordinate_law(head_dim)
    k = 1 << bits
    cdf = torch.cumsum(w, 0)
    c = t[torch.searchsorted(cdf, (torch.arange(k, dtype=torch.float64) + 0.5) / k).clamp(max=t.numel() - 1)]
    for _ in range(2000):
        cell = torch.bucketize(t, (c[1:] + c[:-1]) / 2)
        mass = torch.zeros(k, dtype=torch.float64).index_add_(0, cell, w)
        moment = torch.zeros(k, dtype=torch.float64).index_add_(0, cell, w * t)
        new = torch.where(mass > 0, moment / mass.clamp_min(1e-300), c)
        done = (new - c).abs().max() < 1e-12
        c = new
        if done:
            break
    c = (c - c.flip(0)) / 2  # the law is symmetric: so is its quantizer, exactly
    return c.float()


def codebook_distortion(head_dim: int, bits: int) -> float:
    """`E|u - Q(u)|^2` of a uniform unit vector of R^head_dim coded coordinate-wise by `lloyd_max_codebook`: head_dim
    times the per-coordinate mean squared error under the law (the paper's D_mse, 0.36 / 0.117 / 0.03 / 0.009 at
    1 to 4 bits)."""
    t, w = coordinate_law(head_dim)
    c = lloyd_max_codebook(head_dim, bits).double()
    q = c[torch.bucketize(t, (c[1:] + c[:-1]) / 2)]
    return float(head_dim * (w * (t - q) ** 2).sum())


def channel_split(head_dim: int, bits: float) -> list[tuple[int, int, int]]:
    """`[(first channel, end, bits)]`: one part at an integer width, or for b + 0.5 bits the first half of the
    channels at b + 1 bits and the rest at b."""
    if float(bits).is_integer():
        return [(0, head_dim, int(bits))]
    low = int(math.floor(bits))
    return [(0, head_dim // 2, low + 1), (head_dim // 2, head_dim, low)]


def signed_order(book: torch.Tensor) -> torch.Tensor:
    """A symmetric ascending codebook `(2^b,)` in sign-magnitude order: code j < 2^(b-1) is `-m_j`, code
    2^(b-1) + j is `+m_j`, `m` the ascending magnitudes. The fused kernel then looks a 4-bit code up in a table of 8
    magnitudes and takes the sign from the code's top bit (`kernels.turbo`)."""
    mag = book[book.numel() // 2:]
    return torch.cat([-mag, mag])


def _to_code(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Index into the ascending codebook -> code into `signed_order` (and back: the map is its own inverse)."""
    half = 1 << (bits - 1)
    return torch.where(idx < half, half - 1 - idx, idx)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`(..., W)` codes -> bytes: `quant.pack_bits` for 1, 2 and 4 bits; 3-bit codes as two planes, the low two
    bits (`pack_bits(c & 3, 2)`, W / 4 bytes) then the top bit (`pack_bits(c >> 2, 1)`, W / 8 bytes): the same
    3W / 8 bytes, but no code straddles a byte, which the kernel's 32-bit words need."""
    if bits != 3:
        return pack_bits(codes, bits)
    return torch.cat([pack_bits(codes & 3, 2), pack_bits(codes >> 2, 1)], -1)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: bytes `(..., W * bits / 8)` -> `(..., W)` uint8 codes."""
    if bits != 3:
        return unpack_bits(packed, bits)
    w = packed.shape[-1] * 8 // 3
    return unpack_bits(packed[..., : w // 4], 2) | (unpack_bits(packed[..., w // 4 :], 1) << 2)


ROTATIONS = ("hadamard", "hadamard2", "dense")
SCALES = ("norm", "lsq")  # what the per-vector fp16 scale is: the vector's norm (the paper) or the least-squares fit


class RandomRotation:
    """A seeded random orthogonal transform on the last axis, in float32; `apply(x, inverse=True)` undoes it.

    - `"hadamard"`: `x -> (x * s) R`, `s (D,)` random signs, `R` the exact orthogonal `Rotation` of `RotatedCache`
      (a fast Walsh-Hadamard transform for a power of two);
    - `"hadamard2"`: that twice with independent signs, `((x * s1) R * s2) R`: one round maps a vector with a few
      large channels to one of nearly equal magnitudes everywhere, the second spreads those like Gaussians;
    - `"dense"`: `x -> x Q` with Q from the QR of a seeded Gaussian matrix, the paper's rotation (uniform on the
      orthogonal group), a D x D product.
    """

    def __init__(self, head_dim: int, seed: int, kind: str = "hadamard"):
        check_choice("rotation", kind, ROTATIONS)
        self.kind = kind
        if kind == "dense":
            self.matrix = random_orthogonal(head_dim, seed).float()
            self.signs = torch.ones(0, head_dim)
        else:
            self.rotation = Rotation(head_dim, seed)
            rounds = 2 if kind == "hadamard2" else 1
            gen = torch.Generator().manual_seed(seed)
            self.signs = torch.randint(0, 2, (rounds, head_dim), generator=gen).float() * 2 - 1
        self.matrix_cpu = self._transform(torch.eye(head_dim), self._params(), inverse=False)  # F (D, D)
        # per device: (the parameters, F), moved together by the first `apply` there (an eager write, the prefill's:
        # a compiled step then finds the F the kernels read instead of building it)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _params(self) -> torch.Tensor:
        return self.matrix if self.kind == "dense" else self.signs

    def _get(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on:
            self._on[device] = (self._params().to(device), self.matrix_cpu.to(device))
        return self._on[device]

    def frame(self, device: torch.device) -> torch.Tensor:
        """The transform as a matrix `F (D, D)` float32, `apply(x) = x F`."""
        return self._get(device)[1]

    def held_tensors(self) -> list[torch.Tensor]:
        """What `apply` and `frame` moved to devices (the parameters and F of each)."""
        return [t for pair in self._on.values() for t in pair]

    def apply(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return self._transform(x, self._get(x.device)[0], inverse)

    def _transform(self, x: torch.Tensor, t: torch.Tensor, inverse: bool) -> torch.Tensor:
        if self.kind == "dense":  # (a Triton product on the kernels' path: `rotate_rows` says why)
            return kernels.ops.rotate_rows(x, t.T if inverse else t)
        x = x.float()
        if inverse:
            for s in t.flip(0):
                x = self.rotation.apply(x, inverse=True) * s
            return x
        for s in t:
            x = self.rotation.apply(x * s)
        return x


class TurboCodec(Codec):
    """One stream coded as TurboQuant: rotate, code each coordinate of the unit vector, keep one length.

    Fields (B, H, T, ...): `codes` (integer widths) or `codes_hi` / `codes_lo` (the two halves of a fractional
    width), packed little-endian (`quant.pack_bits`); `norm (.., 1) fp16`, the length (`scale`); with `qjl`: `signs (.., D/8) uint8`
    (the residual's sketch, one bit per row of S) and `rnorm (.., 1) fp16`.
    """

    def __init__(self, head_dim: int, bits: float, seed: int, qjl: bool = False, rotation: str = "dense",
                 scale: str = "lsq"):
        super().__init__()
        check_choice("scale", scale, SCALES)
        self.head_dim, self.bits, self.qjl, self.scale = head_dim, bits, qjl, scale
        self.rotation = RandomRotation(head_dim, seed, rotation)
        self.parts = channel_split(head_dim, bits - 1 if qjl else bits)
        self.books = [lloyd_max_codebook(head_dim, b) for _, _, b in self.parts]  # ascending: encode's cells
        self.code_books = [signed_order(book) for book in self.books]  # indexed by code: decode's and the kernel's
        if qjl:
            gen = torch.Generator().manual_seed(seed + (1 << 20))
            self.sketch = torch.randn(head_dim, head_dim, generator=gen)  # S: rows are the sketch's directions
        self._on: dict[torch.device, list[torch.Tensor]] = {}

    def _tables(self, device: torch.device) -> list[torch.Tensor]:
        """Per part `(codebook in code order (signed_order), midpoints of the ascending one)` on `device`, then S
        when `qjl`."""
        if device not in self._on:
            out = []
            for book, code_book in zip(self.books, self.code_books):
                book = book.to(device)
                out += [code_book.to(device), (book[1:] + book[:-1]) / 2]
            if self.qjl:
                out.append(self.sketch.to(device))
            self._on[device] = out
        return self._on[device]

    def constants_nbytes(self) -> int:
        held = [*self.rotation.held_tensors(), *(t for tables in self._on.values() for t in tables)]
        return sum(t.numel() * t.element_size() for t in held)

    @staticmethod
    def _names(n_parts: int) -> list[str]:
        return ["codes"] if n_parts == 1 else ["codes_hi", "codes_lo"]

    def _kernel(self, x: torch.Tensor) -> bool:
        """Whether the pack kernel codes `x` (`kernels.ops.pack_turbo`; QJL's sketch has none)."""
        return (not self.qjl and kernels.use_kernels(x.device)
                and all(kernels.head_dim_ok(hi - lo) for lo, hi, _ in self.parts))

    def encode(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if self._kernel(x):
            b, h, t, _ = x.shape
            out = {name: torch.empty((b, h, t, (hi - lo) * bits // 8), dtype=torch.uint8, device=x.device)
                   for (lo, hi, bits), name in zip(self.parts, self._names(len(self.parts)))}
            out["norm"] = torch.empty((b, h, t, 1), dtype=torch.float16, device=x.device)
            self.encode_into(x, valid, out)
            return out
        tables = self._tables(x.device)
        y = self.rotation.apply(x)
        norm = y.norm(dim=-1, keepdim=True)
        u = y / norm.clamp_min(torch.finfo(torch.float32).tiny)  # a zero vector stays zero: no division by zero
        fields = {}
        coded = torch.empty_like(u) if self.qjl or self.scale == "lsq" else None
        for i, ((lo, hi, b), name) in enumerate(zip(self.parts, self._names(len(self.parts)))):
            book, mids = tables[2 * i], tables[2 * i + 1]
            code = _to_code(torch.bucketize(u[..., lo:hi].contiguous(), mids), b)
            fields[name] = pack_codes(code.to(torch.uint8), b)
            if coded is not None:
                coded[..., lo:hi] = book[code]
        if self.scale == "lsq":
            # the length that fits the coded direction best: argmin_a |y - a c| = <y, c> / |c|^2
            norm = norm * (u * coded).sum(-1, keepdim=True) / (coded * coded).sum(-1, keepdim=True).clamp_min(1e-30)
        fields["norm"] = _fp16(norm)
        if self.qjl:
            r = u - coded
            fields["signs"] = pack_bits((r @ tables[-1].T >= 0).to(torch.uint8), 1)
            fields["rnorm"] = _fp16(r.norm(dim=-1, keepdim=True))
        return fields

    def encode_into(self, x: torch.Tensor, valid: torch.Tensor | None, out: dict[str, torch.Tensor]) -> None:
        if not self._kernel(x):
            super().encode_into(x, valid, out)
            return
        tables = self._tables(x.device)
        n = len(self.parts)
        kernels.ops.pack_turbo(self.rotation.apply(x), [out[name] for name in self._names(n)], out["norm"],
                               [bits for _, _, bits in self.parts], tables[1:2 * n:2], tables[0:2 * n:2],
                               self.scale == "lsq")

    def decode(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        norm = fields["norm"]
        tables = self._tables(norm.device)
        parts = []
        for i, ((lo, hi, b), name) in enumerate(zip(self.parts, self._names(len(self.parts)))):
            parts.append(tables[2 * i][unpack_codes(fields[name], b).long()])
        u = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
        if self.qjl:
            z = unpack_bits(fields["signs"], 1).float() * 2 - 1
            u = u + fields["rnorm"].float() * (math.sqrt(math.pi / 2) / self.head_dim) * (z @ tables[-1])
        return self.rotation.apply(u * norm.float(), inverse=True).to(dtype)

    def format_parts(self, prefix: str = "", start: int = 0) -> tuple[CodebookPart, ...]:
        """The parts as the kernels read them (fields named with `prefix`, channels from `start` in the frame)."""
        names = self._names(len(self.parts))
        return tuple(CodebookPart(prefix + name, prefix + "norm", b, start + lo, hi - lo, book)
                     for (lo, hi, b), name, book in zip(self.parts, names, self.code_books))

    def frame(self, device: torch.device) -> tuple[torch.Tensor, None]:
        """`(R (D, D) float32, None)`: stored vectors are `x R`, one rotation for every sequence and kv-head."""
        return self.rotation.frame(device), None

    def packed_format(self) -> CodebookFormat | None:
        if self.qjl:  # the sketch's correction has no kernel: the reference reads QJL keys
            return None
        if not hasattr(self, "_format"):  # built once: the kernel's launcher caches its tables by codebook
            self._format = CodebookFormat(self.format_parts(), frame=self.frame)
        return self._format


class SplitTurboCodec(Codec):
    """TurboQuant on two groups of channels split by energy (`split=high`, the paper's outlier split made online):
    per sequence and kv-head, the `high` channels of most energy in the first tokens stored (the prefill; `observe`)
    and the others, each group rotated and coded by its own `TurboCodec` with its own length (2 bytes more a
    vector). Channels of large magnitude (this model family's key outliers) then no longer set the length against
    which the small ones are coded. A fractional width gives the high half the extra bit. Fields: the two codecs'
    fields, prefixed `hi_` and `lo_`. State: `perm (B, H, D) uint8`, the channel order (energy descending)."""

    def __init__(self, head_dim: int, bits: float, seed: int, qjl: bool = False, rotation: str = "dense",
                 scale: str = "lsq", high: int | None = None):
        super().__init__()
        whole = float(bits).is_integer()
        b_hi, b_lo = (int(bits), int(bits)) if whole else (math.floor(bits) + 1, math.floor(bits))  # extra bit: high
        self.high = head_dim // 2 if high is None else high
        self.halves = {"hi_": TurboCodec(self.high, b_hi, seed, qjl, rotation, scale),
                       "lo_": TurboCodec(head_dim - self.high, b_lo, seed + 7919, qjl, rotation, scale)}
        self.head_dim = head_dim
        self._blocks: dict[torch.device, torch.Tensor] = {}  # R per device

    def constants_nbytes(self) -> int:
        blocks = sum(t.numel() * t.element_size() for t in self._blocks.values())
        return blocks + sum(codec.constants_nbytes() for codec in self.halves.values())

    @property
    def observing(self) -> bool:
        return "perm" not in self.state

    def observe(self, x: torch.Tensor, valid: torch.Tensor | None) -> None:
        energy = x.float().square()
        if valid is not None:
            energy = energy * valid[:, None, :, None]
        order = energy.sum(2).argsort(-1, descending=True)  # (B, H, D)
        self.state["perm"] = order.to(torch.uint8 if self.head_dim <= 256 else torch.int16)  # 1 byte a channel

    def encode(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        fields = {}
        for (prefix, codec), part in zip(self.halves.items(), self._halves_of(x, valid)):
            fields.update({prefix + k: v for k, v in codec.encode(part).items()})
        return fields

    def encode_into(self, x: torch.Tensor, valid: torch.Tensor | None, out: dict[str, torch.Tensor]) -> None:
        for (prefix, codec), part in zip(self.halves.items(), self._halves_of(x, valid)):
            codec.encode_into(part, None, {k[len(prefix):]: v for k, v in out.items() if k.startswith(prefix)})

    def _halves_of(self, x: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`x (B, H, T, D)` in the channel order `perm` (observed first if not yet) -> its high-energy and low-energy
        channels."""
        if self.observing:
            self.observe(x, valid)
        self.frame(x.device)  # R on this device, made in eager code (the prefill): a compiled step only reads it
        perm = self.state["perm"].to(x.device).long()[:, :, None, :].expand(-1, -1, x.shape[2], -1)
        xs = torch.gather(x, -1, perm)
        return xs[..., : self.high], xs[..., self.high:]

    def decode(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        parts = [codec.decode({k[len(prefix):]: v for k, v in fields.items() if k.startswith(prefix)}, torch.float32)
                 for prefix, codec in self.halves.items()]
        xs = torch.cat(parts, -1)
        perm = self.state["perm"].to(xs.device).long()[:, :, None, :].expand(-1, -1, xs.shape[2], -1)
        return torch.empty_like(xs).scatter_(-1, perm, xs).to(dtype)

    def frame(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(R, order)`: stored vectors are `x[..., order] R` with `R = blockdiag(R_hi, R_lo) (D, D)` float32 and
        `order (B, H, D)` uint8 the state `perm` (None while nothing is observed: the identity order)."""
        if device not in self._blocks:  # (the prefill's encode puts it there, eagerly)
            self._blocks[device] = torch.block_diag(
                *(codec.rotation.frame(device) for codec in self.halves.values()))
        return self._blocks[device], self.state.get("perm")

    def packed_format(self) -> CodebookFormat | None:
        if any(codec.qjl for codec in self.halves.values()):
            return None
        if not hasattr(self, "_format"):
            parts = self.halves["hi_"].format_parts("hi_") + self.halves["lo_"].format_parts("lo_", self.high)
            self._format = CodebookFormat(parts, frame=self.frame)
        return self._format


def _fp16(x: torch.Tensor) -> torch.Tensor:
    """float -> fp16, clamped to its finite range (a norm never overflows into inf)."""
    return x.clamp(max=torch.finfo(torch.float16).max).to(torch.float16)


class TurboQuantCache(QuantizedKVCache):
    """TurboQuant KV cache (spec `turboquant-4`, `-3.5`, `-3`, `-2.5`): no calibration, no change to the model.

    Args:
        config: the model's config (`model.config`).
        bits: 4, 3.5, 3, 2.5 or 2 bits per channel (norms not counted: 2 bytes per token and kv-head more).
        key_qjl: keys by the paper's inner-product quantizer, a (bits - 1)-bit codebook plus a 1-bit QJL sketch of
            the residual (default False: the plain codebook, which measured better for attention, see the README);
            needs `scale="norm"`.
        value_qjl: refused (QJL is an estimator of inner products; values are not read by inner products).
        rotation: `"dense"` (default, the paper's uniform random rotation), `"hadamard"` (random signs, then the
            Walsh-Hadamard transform) or `"hadamard2"` (that twice): `RandomRotation`.
        scale: the per-vector fp16 length, `"lsq"` (default, least squares on the coded direction) or `"norm"` (the
            vector's norm, the paper).
        split: channels of most energy in the prefill coded apart with their own length (`SplitTurboCodec`), 0 for
            none; default head_dim / 2 at fractional widths (whose extra bit goes to that half) and 0 at whole ones,
            as measured (README). `split=0` at a fractional width gives the extra bit to a fixed half instead.
        seed: seeds of the rotations (and QJL's matrix); layer i uses seed + 2i for keys and + 1 for values.
        sink_tokens: first tokens kept in the model dtype (default 0).
        residual_length: most recent tokens kept in the model dtype (default 0).
        key_bits, value_bits: the keys' and the values' widths when they differ from `bits` (each one of the
            widths above; the presets `turboquant-3.5` and `-3` give the keys half a bit more than the values).
        max_cache_len: the capacity pinned (compiled decode); None (default): a capacity that grows.
    """

    def __init__(
        self,
        config,
        bits: float = 4,
        *,
        max_cache_len: int | None = None,
        key_qjl: bool = False,
        value_qjl: bool = False,
        seed: int = 0,
        rotation: str = "dense",
        scale: str = "lsq",
        split: int | None = None,
        sink_tokens: int = 0,
        residual_length: int = 0,
        key_bits: float | None = None,
        value_bits: float | None = None,
    ):
        check_choice("bits", bits, TURBOQUANT_BITS, "Fractional widths code half the rotated channels at one bit more.")
        key_bits = bits if key_bits is None else key_bits
        value_bits = bits if value_bits is None else value_bits
        for name, width in (("key_bits", key_bits), ("value_bits", value_bits)):
            check_choice(name, width, TURBOQUANT_BITS, "Fractional widths code half the channels at one bit more.")
        check_nonnegative_int("sink_tokens", sink_tokens)
        check_nonnegative_int("residual_length", residual_length)
        check_nonnegative_int("seed", seed)
        if value_qjl:
            raise ValueError(
                "value_qjl=True is not supported: QJL's sketch is an unbiased estimator of inner products, which "
                "is how keys are read (q . k); values are averaged by the attention weights, where it only adds "
                "variance. Use key_qjl=True for keys, and the plain codebook for values"
            )
        if key_qjl and scale == "lsq":
            raise ValueError("scale='lsq' refits the norm to the coded direction, which QJL's residual sketch of "
                             "the keys assumes unscaled: use key_qjl=True with scale='norm'")
        if key_qjl and key_bits - 1 < 1:
            raise ValueError(f"key_qjl=True with key width {key_bits} leaves {key_bits - 1} bits for the codebook; "
                             "use bits (or key_bits) >= 2")
        _, _, head_dim = attention_shape(config)
        if head_dim < 16 or head_dim % 16:
            raise ValueError(
                f"TurboQuantCache needs a head_dim that is a multiple of 16 (its codes are packed 8 per run in each "
                f"half of the channels), got head_dim={head_dim}; use rotated-N or int4-g32 for this model"
            )
        check_choice("rotation", rotation, ROTATIONS)
        check_choice("scale", scale, SCALES)
        # `bits` is the mean width of the two streams (what the preset's name says), whichever set them
        self.bits, self.key_qjl, self.seed, self.rotation = (key_bits + value_bits) / 2, bool(key_qjl), seed, rotation
        self.key_bits, self.value_bits = key_bits, value_bits

        def split_for(width: float) -> int:
            """The channels a stream of this width codes apart (`split`, or its measured default)."""
            chosen = split
            if chosen is None:  # measured: the energy split wins at fractional widths and loses at whole ones (README)
                chosen = 0 if float(width).is_integer() else head_dim // 2
            check_nonnegative_int("split", chosen)
            fractional = not float(width).is_integer()
            if chosen and (chosen % 8 or chosen >= head_dim or (fractional and chosen != head_dim // 2)):
                raise ValueError(f"split={chosen} must be a multiple of 8 below head_dim={head_dim} (and head_dim / 2 "
                                 f"= {head_dim // 2} for a fractional width, whose extra bit goes to that half)")
            return chosen

        self.key_split, self.value_split = split_for(key_bits), split_for(value_bits)

        def codec(b: float, high: int, seed: int, qjl: bool = False) -> Codec:
            if high:
                return SplitTurboCodec(head_dim, b, seed, qjl, rotation, scale, high=high)
            return TurboCodec(head_dim, b, seed, qjl, rotation, scale)

        def policy(layer_idx: int) -> LayerPolicy:
            return LayerPolicy(
                key_codec=codec(key_bits, self.key_split, seed + 2 * layer_idx, self.key_qjl),
                value_codec=codec(value_bits, self.value_split, seed + 2 * layer_idx + 1),
                sink_tokens=sink_tokens,
                key_residual_length=residual_length,
                value_residual_length=residual_length,
            )

        super().__init__(config, policy, max_cache_len=max_cache_len)
