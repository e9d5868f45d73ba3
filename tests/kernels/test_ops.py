"""`hf_kvcache.kernels.ops`, the launchers in one namespace: it re-exports the launcher modules' own objects, so that
what the package, the benchmark and the tests reach through it is what the launchers use."""

from __future__ import annotations

from hf_kvcache import kernels
from hf_kvcache.kernels import (backend, decode_launch, dispatch, hadamard_launch, launch, nuq_launch, ops,
                                pack_launch, turbo_launch)


def test_tuning_is_the_dict_the_launchers_read():
    """The benchmark's sweep and the tests set entries of `ops.TUNING`: every launcher module reads that very dict."""
    for module in (launch, decode_launch, nuq_launch, turbo_launch):
        assert module.TUNING is ops.TUNING, module.__name__


def test_the_facade_names_the_launchers_themselves():
    assert ops.backend is backend  # tests patch `ops.backend.interpreting`, which the launchers call
    assert ops.decode_attention is dispatch.decode_attention is kernels.decode_attention
    assert ops.static_decode_attention is dispatch.static_decode_attention and ops.supports is dispatch.supports
    assert ops.packed_attention is decode_launch.packed_attention
    assert ops.nuq_attention is nuq_launch.nuq_attention and ops.pack_nuq is nuq_launch.pack_nuq
    assert ops.turbo_attention is turbo_launch.turbo_attention
    assert ops.hadamard is hadamard_launch.hadamard
    for name in ("pack_per_token", "pack_per_channel", "pack_fp8", "pack_turbo"):
        assert getattr(ops, name) is getattr(pack_launch, name)
    assert all(hasattr(ops, name) for name in ops.__all__)
