"""Which implementation runs: the Triton kernels or the plain-PyTorch reference (STYLE.md: the reference is
always selectable).

- `"auto"` (default): the kernels on CUDA tensors, the reference on CPU.
- `"torch"`: the reference everywhere.
- `"triton"`: the kernels everywhere; on CPU this needs `TRITON_INTERPRET=1` (Triton's interpreter, how the test
  suite checks the kernels without a GPU).

Set it with `set_backend(...)`, the `use_backend(...)` context manager, or `HF_KVCACHE_BACKEND` in the
environment.

`compiling_only()` (`hf-kvcache bench --parts compiles`): the launchers treat CPU tensors as if they were on the GPU,
with no interpreter, while a stand-in Triton driver compiles each launch for a GPU target without running it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("HF_KVCACHE_BACKEND", "auto")
_compile_only = False


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


def set_backend(name: str) -> None:
    global _backend
    _backend = _check(name)


def get_backend() -> str:
    return _check(_backend)


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    global _backend
    old, _backend = _backend, _check(name)
    try:
        yield
    finally:
        _backend = old


def interpreting() -> bool:
    return not _compile_only and os.environ.get("TRITON_INTERPRET", "0") == "1"


@contextmanager
def compiling_only() -> Iterator[None]:
    """Kernels for every device but under the "torch" backend, none of them interpreted (see the module's text)."""
    global _compile_only
    old, _compile_only = _compile_only, True
    try:
        yield
    finally:
        _compile_only = old


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_kernels(device: torch.device) -> bool:
    """Whether tensors on `device` go through the Triton kernels under the current backend."""
    name = get_backend()
    if name == "torch":
        return False
    if _compile_only:
        return True
    if name == "auto":
        return device.type == "cuda" and triton_available()
    if not triton_available():
        raise RuntimeError("backend 'triton' needs the triton package (pip install triton)")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            "backend 'triton' on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 before starting "
            "Python, or use backend 'auto' (kernels on CUDA, reference on CPU)"
        )
    return True
