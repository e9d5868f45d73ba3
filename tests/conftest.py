from __future__ import annotations

import os

import torch

# Without a GPU the Triton kernels run under Triton's interpreter (read when a kernel is first compiled).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model (SmolLM2-135M), float32 on CPU, loaded once per test session."""
    from hf_kvcache import load_model

    torch.set_num_threads(max(torch.get_num_threads(), 1))
    return load_model(dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def default_model_fused():
    """The default model with `attn_implementation="hf_kvcache"` (shares nothing with `default_model`)."""
    from hf_kvcache import load_model

    return load_model(dtype=torch.float32, device="cpu", attn_implementation="hf_kvcache")
