"""Which implementation runs: the Triton kernels or the plain-PyTorch reference (the reference is always
selectable: a kernel accelerates it, never replaces it as the statement of the math).

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
import warnings
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


# Whether triton imports, found once. A module global and not `functools.lru_cache`: `use_kernels` runs inside compiled
# decode steps, and dynamo traces a global read where it warned on tracing through the cache (H100, 2026-12-07).
_triton: bool | None = None


def triton_available() -> bool:
    global _triton
    if _triton is None:
        try:
            import triton  # noqa: F401
        except ImportError:
            _triton = False
        else:
            _triton = True
    return _triton


# The oldest NVIDIA architecture the kernels are built and checked for (Turing: T4, RTX 20xx): `mma` with fp16
# operands and `ldmatrix` start there, and every kernel compiles for it (`hf-kvcache bench --parts compiles`).
MIN_ARCH = 75
# The first with FP8 conversions in hardware (Ada: L4, RTX 40xx; then Hopper): before it the kernels convert FP8 by
# integer operations on its bits (`launch.fp8_native`).
FP8_ARCH = 89


def target_arch(device: torch.device) -> int | None:
    """The CUDA architecture the kernels compile for on `device` (90 for sm_90), or None where nothing compiles for a
    GPU (the interpreter, the CPU). Under `compiling_only`, the stand-in driver's target."""
    if _compile_only:
        import triton

        return int(triton.runtime.driver.active.get_current_target().arch)
    if device.type != "cuda" or interpreting():
        return None
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def use_kernels(device: torch.device) -> bool:
    """Whether tensors on `device` go through the Triton kernels under the current backend."""
    name = get_backend()
    if name == "torch":
        return False
    if _compile_only:
        return True
    if name == "auto":
        return _on_gpu(device) and triton_available() and _served(device)
    if not triton_available():
        raise RuntimeError("backend 'triton' needs the triton package (pip install triton)")
    if _on_gpu(device) and not interpreting() and (problem := device_problem(device)):
        raise RuntimeError(f"backend 'triton': {problem}; use backend 'auto' or 'torch' (the PyTorch reference)")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            "backend 'triton' on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 before starting "
            "Python, or use backend 'auto' (kernels on CUDA, reference on CPU)"
        )
    return True


def _on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def device_problem(device: torch.device) -> str | None:
    """Why the kernels cannot serve CUDA `device`, or None where they can: a ROCm build of torch (which reports AMD GPUs
    as `cuda`; the kernels carry NVIDIA PTX) or an NVIDIA GPU older than Turing (sm_75)."""
    if torch.version.hip is not None:
        return f"{_name(device)} is an AMD GPU (torch built for ROCm {torch.version.hip}); the kernels carry NVIDIA PTX"
    arch = target_arch(device)
    if arch is not None and arch < MIN_ARCH:
        return (f"{_name(device)} is sm_{arch}; the kernels need NVIDIA Turing (sm_{MIN_ARCH}) or newer "
                "(T4, RTX 20xx and later)")
    return None


def _name(device: torch.device) -> str:
    try:
        return f"{device} ({torch.cuda.get_device_name(device)})"
    except (RuntimeError, AssertionError, AttributeError):  # no CUDA runtime (a test that fakes the device)
        return str(device)


# whether the kernels serve a device, decided (and warned of) once a device: `use_kernels` runs at every layer step
_served_on: dict[torch.device, bool] = {}


def _served(device: torch.device) -> bool:
    """Whether the kernels serve `device` (see `device_problem`); where they cannot, a warning, once, says that its
    packed caches are read by the reference."""
    served = _served_on.get(device)
    if served is None:
        problem = device_problem(device)
        if problem:
            warnings.warn(f"hf_kvcache: {problem}. Packed caches on it are read by the PyTorch reference, which "
                          "dequantizes each layer's history at every step: the memory saving holds, the speed does "
                          "not.", RuntimeWarning, stacklevel=3)
        served = _served_on[device] = problem is None
    return served
