"""What every layer of the library reads from a model config (`attention_shape`) and the parameter checks the
methods, the patching and the artifact share: every bad parameter gets an error naming it, the allowed values and
what to do. It sits below them all and imports nothing of the package but `_compat`."""

from __future__ import annotations

from ._compat import text_config


def check_choice(name: str, value, allowed, hint: str = "") -> None:
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name}={value!r} is not supported; allowed values: {shown}.{(' ' + hint) if hint else ''}")


def check_nonnegative_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer")


def attention_shape(config) -> tuple[int, int, int]:
    """`(num_layers, num_key_value_heads, head_dim)` from a model config, or a ValueError saying what is missing."""
    cfg = text_config(config)
    try:
        layers = cfg.num_hidden_layers
        heads = cfg.num_attention_heads
    except AttributeError as e:
        raise ValueError(
            f"this config ({type(cfg).__name__}) does not describe a decoder with attention heads "
            "(num_hidden_layers / num_attention_heads missing); pass the model's config, e.g. model.config"
        ) from e
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return layers, kv_heads, head_dim


def check_group_size(group_size: int | None, head_dim: int) -> None:
    """A quantization group along head_dim must divide it."""
    if group_size is not None and head_dim % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide this model's head_dim={head_dim}; choose a group size that "
            f"divides {head_dim} (e.g. {', '.join(str(g) for g in (32, 64, 128) if head_dim % g == 0) or 'None'})"
        )
