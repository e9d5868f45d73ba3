"""`hf_kvcache.warm_up` on the CPU: what it refuses and what it leaves alone. That it compiles every variant a first
call launches is checked for sm_90 without a GPU (`tests/test_bench.py`, through the compiles part) and on the GPU
(`tests/test_cuda.py`)."""

from __future__ import annotations

import pytest

from hf_kvcache import _compat, make_cache, warm_up
from tests.helpers.tiny_models import tiny_input_ids, tiny_model


def test_warm_up_refuses_a_cache_that_holds_tokens():
    model = tiny_model("llama", "sdpa")
    cache = make_cache("int4-g32", model)
    model(tiny_input_ids(model, batch=1, length=12), use_cache=True, **_compat.cache_kwargs(cache))
    with pytest.raises(ValueError, match="holds nothing yet"):
        warm_up(model, cache)
    with pytest.raises(ValueError, match="batch_size"):
        warm_up(model, "int4-g32", batch_size=0)


def test_warm_up_on_the_cpu_compiles_nothing_and_leaves_the_cache_empty():
    """On the CPU the kernels do not run (the reference does): nothing to compile, and the cache passed stays as it
    was (a copy is warmed, never the cache itself)."""
    model = tiny_model("llama", "sdpa")
    cache = make_cache("kivi-2", model)
    assert warm_up(model, cache, batch_size=2, prefill_chunk_size=8) == {"kernels": 0, "seconds": 0.0}
    assert cache.get_seq_length() == 0 and not any(getattr(layer, "held_tokens", 0) for layer in cache.layers)
