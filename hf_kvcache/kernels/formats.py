"""What reads each packed format: one `FormatReader` a format class of `layout.py`, registered in `READERS`.

A reader declares, in one place, everything the dispatchers ask of a format: whether its kernel can read a layer and
why not (`supports`), its eager launcher (`attention`), its operator call under torch.compile (`traced`) and how a
chunk of prompt reads the layer's history (`history`, a read of `hf_kvcache.prefill`). `dispatch.py` and
`hf_kvcache.prefill` look a layer's reader up by its keys' format class and never test a format's class themselves.

Adding a format with a kernel of its own: its codec (the method's module) returns the new format class from
`packed_format()`; its kernel (`X.py`) and launcher (`X_launch.py`, with `attention` and `supports`); its operator in
`library.py`; then one line in `READERS` below (docs/design.md, "The repository", lists the steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import library
from .decode_launch import packed_attention, supports_packed
from .layout import CodebookFormat, NUQFormat, PackedFormat
from .nuq_launch import nuq_attention, supports_nuq
from .turbo_launch import supports_codebook, turbo_attention


@dataclass(frozen=True)
class FormatReader:
    """The kernels of one format class (see the module's text). `supports(keys, values, query, static)` -> None or
    why not (after the checks every format shares); `attention` and `traced` take `dispatch.decode_attention`'s and
    `dispatch.static_decode_attention`'s arguments; `history`: "places" (dequantized into a workspace by
    `workspace_launch.gather_places`), "codebook" (by `gather_codebook`, in the codec's frame) or "reference" (by the
    layer's reference codecs)."""

    method: str  # the methods that store it, for messages
    supports: Callable
    attention: Callable
    traced: Callable
    history: str


READERS: dict[type, FormatReader] = {
    PackedFormat: FormatReader("FP8, INT and KIVI", supports_packed, packed_attention, library.traced_packed,
                               "places"),
    NUQFormat: FormatReader("KVQuant", supports_nuq, nuq_attention, library.traced_nuq, "reference"),
    CodebookFormat: FormatReader("TurboQuant", supports_codebook, turbo_attention, library.traced_codebook,
                                 "codebook"),
}


def reader_of(fmt) -> FormatReader:
    """The reader of format `fmt` (a `layout.py` format); a class with none registered is a defect, said plainly."""
    found = READERS.get(type(fmt))
    if found is None:
        raise TypeError(f"no kernel reads {type(fmt).__name__}: register a FormatReader for it in "
                        "hf_kvcache.kernels.formats.READERS")
    return found
