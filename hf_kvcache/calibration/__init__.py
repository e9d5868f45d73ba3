"""Calibration (installed as `hf_kvcache.calibration`): per-head scales and codebooks written to one artifact file.

`calibrate(model, input_ids)` computes a `Calibration`; `save`/`load` write and read the artifact (validated, no
pickle); `find(config)` returns the one `hf-kvcache calibrate` stored for a model; `export_vllm` writes FP8 scales
under vLLM's names. `python -m hf_kvcache.calibration` is `hf-kvcache calibrate`.
"""

from ..artifact import Calibration, default_path, export_vllm, find, fingerprint, load, save
from .calibrate import calibrate, collect, fit, weighted_kmeans_1d

__all__ = [
    "Calibration", "calibrate", "collect", "default_path", "export_vllm", "find", "fingerprint", "fit", "load",
    "save", "weighted_kmeans_1d",
]
