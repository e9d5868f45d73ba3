"""Prefill over a packed history (`hf_kvcache/prefill.py`): a chunk of many query tokens reads what the layer held
before it from a workspace, dequantized once, through flash attention, and itself causally; against the reference
attention over the same stored codes, for every kernel format. On CPU the gathers run under Triton's interpreter on
small shapes (conftest.py sets TRITON_INTERPRET=1); on CUDA the same tests run compiled, and `cuda` tests hold the
path to the reference at the shapes users run."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache import kernels, prefill
from tests.helpers.methods import KERNEL_METHODS
from tests.kernels import test_nuq
from tests.kernels.test_decode import DEVICE, ROUNDING_BOUND, _compare

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not kernels.interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)

# every kernel format with every place in use (sinks, residual windows, KIVI's flushes), and TurboQuant's layouts
CASES = [(spec, hard) for spec, _, hard in KERNEL_METHODS] + [
    ("turboquant-4", {}),
    ("turboquant-2.5", {"sink_tokens": 2, "residual_length": 7, "rotation": "hadamard"}),
    ("turboquant-3.5", {"key_bits": 3.5, "value_bits": 2.5, "split": 0}),
]
IDS = [spec for spec, _ in CASES[:-3]] + ["turboquant-4", "turboquant-2.5-sink-window", "turboquant-3.5-split0"]


@pytest.fixture
def workspace_path(monkeypatch):
    """Counts the chunks that went through the workspace."""
    calls = []
    original = prefill.prefill_attention
    monkeypatch.setattr(prefill, "prefill_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.mark.parametrize("spec,kwargs", CASES, ids=IDS)
def test_a_chunk_over_a_packed_history_matches_the_reference(spec, kwargs, workspace_path):
    _compare(spec, kwargs, steps=(70, 1, 40))  # 40 tokens x 2 query heads per kv-head: past `min_rows`
    assert workspace_path == [1]


def test_kvquant_chunk_reads_its_history_through_the_reference_codecs(workspace_path):
    test_nuq._compare("llama", steps=(100, 40))
    assert workspace_path == [1]


def test_a_few_query_rows_stay_with_the_decode_kernel(workspace_path):
    """Assisted decoding's handful of tokens: the decode kernel reads the packed bytes once for all of them."""
    _compare("int4-g32", {}, steps=(70, 7), heads=2, kv_heads=2)
    assert workspace_path == []


def test_pieces_of_the_history_merge_by_their_log_sum_exps(workspace_path, monkeypatch):
    """A workspace smaller than the history: pieces in turn, merged."""
    monkeypatch.setattr(prefill, "_MIN_PIECE", 16)
    monkeypatch.setitem(prefill.PREFILL, "workspace_bytes", 2 * 2 * 2 * 64 * 4 * 16)  # 16 tokens a piece
    _compare("kivi-2", {"residual_length": 32, "sink_tokens": 3}, steps=(70, 1, 40))
    _compare("turboquant-2.5", {"sink_tokens": 2, "residual_length": 7}, steps=(70, 1, 40))
    assert workspace_path == [1, 1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk", [2, 7, 128, 2048])
@pytest.mark.parametrize("spec", ["fp8-e4m3", "int8", "int4-g128", "int4-g32", "kivi-4", "kivi-2", "turboquant-4",
                                  "turboquant-3.5", "turboquant-3", "turboquant-2.75", "turboquant-2.5"])
def test_chunks_over_a_long_history_on_cuda(spec, chunk):
    """Llama-3-8B's heads (32 query, 8 kv, head_dim 128) in bf16, a chunk over 4k held tokens, at the bound the decode
    kernel's CUDA tests hold at users' shapes: a relative error over the whole output. (Element by element within
    0.02, `turboquant-2.75`'s 2048-token chunk missed by 5 of its 16.8M outputs on the H100 on 2026-12-05, one query
    row of one head at 0.036: flash attention's bf16 probabilities, as bf16 SDPA rounds them over any cache.)"""
    _compare(spec, {}, batch=2, heads=32, kv_heads=8, head_dim=128, steps=(4096, chunk), dtype=torch.bfloat16,
             relative=ROUNDING_BOUND.get(spec, 0.01))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk", [2, 7, 128, 2048])
def test_kvquant_chunks_over_a_long_history_on_cuda(chunk):
    """KVQuant's 4 bits (pre-RoPE keys, calibrated codebooks, outliers) on the tiny llama in bf16: a chunk over 4k
    held tokens."""
    test_nuq._compare("llama", bits=4, steps=(4096, chunk), dtype=torch.bfloat16)


def _left_padded(pads: list[int], tq: int, held: int, capacity: int | None = None) -> torch.Tensor:
    """A left-padded batch's chunk mask as transformers builds it: `(B, 1, Tq, capacity)`, True = attend."""
    col = torch.arange(capacity or held)
    t = torch.arange(tq)
    return (col >= torch.tensor(pads)[:, None, None, None]) & (col <= held - tq + t[:, None])


@pytest.mark.parametrize("spec,kwargs", [("int4-g32", {"sink_tokens": 3, "residual_length": 16}),
                                         ("turboquant-2.5", {"sink_tokens": 2, "residual_length": 7})],
                         ids=["places", "codebook"])
def test_a_left_padded_chunk_reads_each_row_from_its_first_token(spec, kwargs, workspace_path):
    """Rows padded by 0, 2 (inside the sinks), 50 (inside the history) and 90 tokens (past the history, into the
    chunk: its first query rows attend to nothing and give 0, as the reference does)."""
    pads, tq, held = [0, 2, 50, 90], 40, 111
    mask = _left_padded(pads, tq, held)
    assert prefill.left_padding(mask, tq, held) == pads
    _compare(spec, kwargs, batch=4, steps=(70, 1, tq), mask=mask)
    assert workspace_path == [1]


def test_a_left_padded_kvquant_chunk_reads_each_row_from_its_first_token(workspace_path):
    """KVQuant's history comes through its reference codecs, piece by piece in position order."""
    test_nuq._compare("llama", steps=(100, 40), mask=_left_padded([5, 110], 40, 140))
    assert workspace_path == [1]


def test_other_masks_stay_with_the_decode_kernel(workspace_path):
    """A mask that is not a left-padded causal one (a hole in the history, a key past the chunk's own position, a
    pinned capacity's column past the held tokens) is read by the decode kernel."""
    tq, held = 40, 111
    hole = _left_padded([0, 3], tq, held)
    hole[1, :, :, 60] = False
    ahead = _left_padded([0, 3], tq, held)
    ahead[0, :, 5, held - 1] = True
    past = _left_padded([0, 3], tq, held, capacity=128)
    past[1, :, -1, 120] = True
    for mask in (hole, ahead, past):
        assert prefill.left_padding(mask, tq, held) is None
    assert prefill.left_padding(_left_padded([4], tq, held, capacity=128), tq, held) == [4]
    _compare("int4-g32", {}, steps=(70, 1, tq), mask=hole)
    assert workspace_path == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", ["fp8-e4m3", "int4-g32", "kivi-2", "turboquant-4", "turboquant-2.5"])
def test_left_padded_chunks_over_a_long_history_on_cuda(spec, workspace_path):
    """A left-padded batch's chunk of 2048 over 4k held tokens at Llama-3-8B's heads in bf16: rows padded by 0, 1500
    and 5000 tokens (the last one's first query rows attend to nothing)."""
    pads, tq, held = [0, 1500, 5000], 2048, 4096 + 2048
    _compare(spec, {}, batch=3, heads=32, kv_heads=8, head_dim=128, steps=(4096, tq), dtype=torch.bfloat16,
             mask=_left_padded(pads, tq, held))
    assert workspace_path == [1]
