"""One forward of tokens through a cache, as every evaluation feeds text (perplexity, passkey, memory,
lm-eval), in a module of its own: those modules import it without importing each other."""

from __future__ import annotations

import torch

from .. import _compat

__all__ = ["forward_with_cache"]


def forward_with_cache(model, input_ids: torch.Tensor, cache, *, logits_to_keep: int = 0) -> torch.Tensor:
    """One forward of `input_ids (B, T)` through `cache` (appended to it); returns logits `(B, T', V)`.

    `logits_to_keep=k > 0` asks for the logits of the last k positions only (T' = k) when the model
    supports it; otherwise T' = T. Callers locate rows from the end, so both cases read the same.
    """
    cache_arg, has_keep = _compat.forward_parameters(type(model))
    kwargs = {cache_arg: cache, "use_cache": True}
    if has_keep and logits_to_keep > 0:
        kwargs["logits_to_keep"] = logits_to_keep
    return model(input_ids=input_ids, **kwargs).logits
