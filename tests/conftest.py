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


@pytest.fixture(scope="session", autouse=True)
def tiny_calibrations(tmp_path_factory):
    """Calibration artifacts for every tiny model config (a few dozen tokens each, under a session folder set as
    `$HF_KVCACHE_CALIBRATION`), so that calibrated specs (`kvquant-3`, ...) build on them like on a calibrated
    model. The user's own calibration folder is never read or written by the tests."""
    from hf_kvcache import calibration
    from tests.helpers.tiny_models import TINY_CONFIGS, tiny_input_ids, tiny_model

    folder = tmp_path_factory.mktemp("calibration")
    saved = os.environ.get("HF_KVCACHE_CALIBRATION")
    os.environ["HF_KVCACHE_CALIBRATION"] = str(folder)
    for name in TINY_CONFIGS:
        model = tiny_model(name)
        ids = tiny_input_ids(model, batch=1, length=96, seed=7)
        cal = calibration.calibrate(model, ids, chunk=48, max_samples=96, progress=False)
        calibration.save(cal, calibration.default_path(model.config))
    yield folder
    if saved is None:
        os.environ.pop("HF_KVCACHE_CALIBRATION", None)
    else:
        os.environ["HF_KVCACHE_CALIBRATION"] = saved
