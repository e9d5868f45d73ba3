"""Triton kernels (installed as `hf_kvcache.kernels`): quantize/pack and fused decode attention over the packed cache."""
