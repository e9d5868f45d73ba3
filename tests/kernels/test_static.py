"""The storage's kernels (lengths read from the device, places of fixed capacity, the ring window) and the
operators torch.compile calls, under Triton's interpreter on CPU: greedy tokens through the kernels, eager and
traced (`fullgraph=True`, dynamo's eager backend, so the operators run as Inductor would call them), equal the
plain-PyTorch reference's; and incomplete KIVI blocks are skipped by the pack kernel."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.configuration_utils import CompileConfig

from hf_kvcache import _compat, kernels, make_cache
from tests.helpers.methods import STATIC_METHODS as METHODS, TURBOQUANT_KERNEL
from tests.helpers.tiny_models import left_padded_batch, tiny_model

# Each kernel and operator once: FP8 (sinks + a FIFO ring), KIVI (the block flush and its pack flag, per-token INT
# values in a ring, sinks), KVQuant's NUQ kernel (pre-RoPE keys, outlier slots, a sink), RotatedCache (the
# Hadamard operator in front of per-token INT groups) and TurboQuant's kernels (`TURBOQUANT_KERNEL`). `exact`
# shares FP8's path; on CUDA every method runs.
CASES = [m for m in METHODS if m[0] in ("fp8-e4m3", "kivi-2", "kvquant-3", "rotated-4")] + [TURBOQUANT_KERNEL]


@pytest.mark.parametrize("spec,easy,hard", CASES, ids=[c[0] for c in CASES])
def test_static_kernels_eager_and_traced_equal_the_reference(spec, easy, hard):
    if not kernels.interpreting():
        pytest.skip("the interpreter run; on CUDA, tests/test_pinned_capacity.py compares compiled and eager")
    model = tiny_model("llama", "hf_kvcache")
    # 33 tokens, then 5 steps: KIVI's first window (3 sinks + 32) closes at a decode step, through the pack flag
    ids, mask = left_padded_batch(model, lengths=(33, 7))

    def greedy(backend: str, **kwargs):
        with kernels.use_backend(backend):
            cache = make_cache(spec, model, **hard, max_cache_len=88)
            return model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, **kwargs,
                                  **_compat.cache_kwargs(cache))

    reference = greedy("torch", disable_compile=True)
    assert torch.equal(greedy("triton", disable_compile=True), reference)
    torch._dynamo.reset()
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True
    assert torch.equal(greedy("triton", compile_config=config), reference)


def test_pack_kernel_skips_incomplete_blocks():
    if not kernels.interpreting():
        pytest.skip("interpreter only")
    from hf_kvcache.methods.kivi import PerChannelKeyCodec

    codec = PerChannelKeyCodec(2, 16, range_search=(0.0, 0.05, 0.1, 0.15, 0.2))
    x = torch.randn(1, 2, 48, 64)
    with kernels.use_backend("triton"):
        full = codec.encode(x)
        part = codec.encode(x, complete=torch.tensor([True, False, True]))
    for name in full:
        assert torch.equal(part[name][:, :, [0, 2]], full[name][:, :, [0, 2]])
        assert not part[name][:, :, 1].float().abs().sum()
