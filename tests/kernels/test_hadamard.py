"""The Walsh-Hadamard kernel against `quant.fwht`, and RotatedCache's kernel path (rotated query, rotated stored
keys) against the dense path. CPU: Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py)."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache import _compat, kernels, make_cache
from hf_kvcache.kernels import hadamard_launch, ops
from hf_kvcache.quant import fwht
from tests.helpers.tiny_models import left_padded_batch, tiny_model
from tests.kernels.test_decode import DEVICE

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not kernels.interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_kernel_equals_the_reference(d):
    x = torch.randn(3, 2, 37, d, generator=torch.Generator().manual_seed(d)).to(DEVICE)
    torch.testing.assert_close(ops.hadamard(x), fwht(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.hadamard(ops.hadamard(x)), x, atol=1e-5, rtol=1e-5)


def test_kernel_refuses_other_lengths():
    with pytest.raises(ValueError, match="power-of-two"):
        ops.hadamard(torch.randn(2, 96))


@pytest.mark.parametrize("spec", ["rotated-4", "rotated-2:group_size=32,sink_tokens=2"])
def test_greedy_generation_through_the_kernels_equals_the_dense_path(spec):
    outs = {}
    for attn, backend in (("sdpa", "torch"), ("hf_kvcache", "triton")):
        model = tiny_model("llama", attn_implementation=attn).to(DEVICE)
        ids, mask = left_padded_batch(model, lengths=(30, 12))
        cache = make_cache(spec, model)
        with kernels.use_backend(backend):
            outs[attn] = model.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=12,
                                        do_sample=False, **_compat.cache_kwargs(cache))
    assert torch.equal(outs["sdpa"], outs["hf_kvcache"])


@pytest.mark.parametrize("d", [16, 64, 256])
def test_rows_times_is_the_float32_product(d, monkeypatch):
    """`ops.rows_times` (the rotations of a captured step, without cuBLAS) against `x.float() @ m`, bf16 rows and a
    transposed matrix included, in both column blocks (a few rows and many: the kernel's, which a compiled step takes,
    not the cuBLAS product that many rows outside a capture take on CUDA)."""
    monkeypatch.setitem(kernels.ops.TUNING, "rows_cublas", False)
    g = torch.Generator().manual_seed(d)
    m = torch.linalg.qr(torch.randn(d, d, generator=g))[0].to(DEVICE)
    x = torch.randn(2, 3, 21, d, generator=g).to(DEVICE)
    many = torch.randn(hadamard_launch._FEW_ROWS + 3, d, generator=g).to(DEVICE)
    with kernels.use_backend("triton"):
        torch.testing.assert_close(ops.rows_times(x, m), x @ m, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ops.rows_times(many, m), many @ m, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ops.rows_times(x.bfloat16(), m.T), x.bfloat16().float() @ m.T, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="power-of-two"):
            ops.rows_times(torch.randn(2, 96, device=DEVICE), torch.eye(96, device=DEVICE))
