"""Calibration (installed as `hf_kvcache.calibration`): per-head scales and codebooks written to one artifact file."""
