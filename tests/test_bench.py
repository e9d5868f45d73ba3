"""The end-to-end benchmark's row (`hf_kvcache.bench.e2e_row`: `generate` as users call it) on a tiny model on
the CPU: the figures it reports exist and are consistent. Speed itself is measured on the GPU, never here."""

from __future__ import annotations

import pytest

from hf_kvcache.bench import e2e_row
from tests.helpers.tiny_models import tiny_input_ids, tiny_model


@pytest.mark.parametrize("name,compiled,chunk", [("dynamic", False, None), ("int4-g32", False, 16),
                                                 ("static", True, 16), ("kivi-2", True, None)])
def test_e2e_row_reports_a_generate_call_as_users_make_it(name, compiled, chunk):
    model = tiny_model("llama", "sdpa")
    ids = tiny_input_ids(model, batch=2, length=40)
    row = e2e_row(model, name, ids, 5, compiled, chunk)
    assert row["mode"] == ("compiled" if compiled else "eager") and (row["batch"], row["context"]) == (2, 40)
    assert 0 < row["prefill_s"] < row["second_call_s"] and row["first_call_s"] > 0
    assert 0 < row["step_ms"] * 1e-3 * 4 < row["second_call_s"]  # 5 forwards: a step, 4 times over, fits in the call
    assert row["cache_gb"] > 0 and row["recompiles"] == 0
    assert row["peak_gb"] is None and row["chunked_peak_gb"] is None  # CUDA only
    assert (row["host_us_per_layer"] is None) == compiled
    assert compiled or row["host_us_per_layer"] > 0
