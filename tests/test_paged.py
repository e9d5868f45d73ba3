"""Packed pages under transformers' continuous batching (`hf_kvcache.paged`): every preset and the method matrix's
hard overrides through `generate_batch` against the same cache through `generate` one request at a time, pages and
per-request state freed, prefix sharing, cancellation, sizing by packed bytes, and the errors. On a transformers
without the allocator seam (the oldest supported) the opt-in says which version it needs."""

from __future__ import annotations

import time

import pytest
import torch
import transformers
from transformers import GenerationConfig

from hf_kvcache import PRESETS, _compat, make_cache
from tests.helpers.methods import METHODS
from tests.helpers.tiny_models import FIRST_TOKEN_ID, tiny_model

try:
    _compat.continuous_batching_parts()
    HAS_SEAM = True
except ImportError:
    HAS_SEAM = False

needs_seam = pytest.mark.skipif(not HAS_SEAM, reason=f"transformers {transformers.__version__} has no allocator "
                                "seam: test_old_transformers_is_told_the_version covers it")

# Every preset but the baseline (transformers' own pages) and KVQuant (refused: test_kvquant_is_refused).
PRESET_SPECS = [s for s in PRESETS if s != "none" and not s.startswith("kvquant")]
HARD = [pytest.param(spec, hard, id=f"{spec}-hard") for spec, _, hard in METHODS if not spec.startswith("kvquant")]
PAGE = 32  # a multiple of KIVI's 32-token key blocks
NEW = 10
# Where a greedy token may part from `generate`'s: the reference's top-2 logits this close. Batched projections differ
# from one request's in their last bits, which can move a value across a code's rounding boundary (int4: a step of
# range / 15); on the default model int4-g32 parted once at a gap of 0.021. The lossless codec must not part at all.
NEAR_TIE = 0.05


def _prompts(count: int = 16, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 90, (count,), generator=g).tolist()
    return [torch.randint(FIRST_TOKEN_ID, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture
def allocators(monkeypatch):
    """Every `PackedPageAllocator` built while the test runs."""
    from hf_kvcache import paged

    built = []
    init = paged.PackedPageAllocator.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(paged.PackedPageAllocator, "__init__", record)
    return built


def _config(kv_cache, **kwargs):
    from hf_kvcache import PackedBatchingConfig

    return PackedBatchingConfig(kv_cache, **{"page_size": PAGE, "num_blocks": 64, "max_batch_tokens": 1024, **kwargs})


def _greedy(new: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)  # EOS off


def _generate_batch(model, prompts, cfg, new=NEW):
    out = model.generate_batch(prompts, generation_config=_greedy(new), continuous_batching_config=cfg,
                               progress_bar=False)
    return [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]


def _check_against_generate(model, prompts, got, make, new=NEW, near_tie=NEAR_TIE):
    """Each request's tokens equal `generate`'s with a fresh cache from `make()`, or part where that run's top-2
    logits are within `near_tie` (after which the two continue from different text)."""
    for prompt, tokens in zip(prompts, got):
        ref = model.generate(torch.tensor([prompt]), generation_config=_greedy(new), output_scores=True, return_dict_in_generate=True, **_compat.cache_kwargs(make(), model))
        expected = ref.sequences[0, len(prompt):].tolist()
        if tokens == expected:
            continue
        step = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
        top = ref.scores[step][0].float().topk(2).values
        gap = float(top[0] - top[1])
        assert gap < near_tie, f"parted at step {step} with a top-2 gap of {gap:.4f}: {tokens} vs {expected}"


def _check_freed(built):
    assert built, "no packed allocator was built"
    for allocator in built:
        assert allocator.block_table == {} and allocator.held_requests() == []


@needs_seam
@pytest.mark.parametrize("spec", PRESET_SPECS)
def test_every_preset_matches_generate(spec, allocators):
    model = tiny_model("qwen3")  # head_dim 128: every preset's groups fit
    prompts = _prompts()
    kv_cache = make_cache(spec, model) if PRESETS[spec].needs_model else spec
    got = _generate_batch(model, prompts, _config(kv_cache))
    _check_against_generate(model, prompts, got, lambda: make_cache(spec, model))
    _check_freed(allocators)


@needs_seam
@pytest.mark.parametrize("spec, hard", HARD)
def test_every_place_matches_generate(spec, hard, allocators):
    """The matrix's hard overrides: sinks, windows and per-sequence state in use, on a model of GQA and biases."""
    model = tiny_model("qwen2")
    prompts = _prompts(seed=1)
    got = _generate_batch(model, prompts, _config(make_cache(spec, model, **hard)))
    _check_against_generate(model, prompts, got, lambda: make_cache(spec, model, **hard))
    _check_freed(allocators)


@needs_seam
@pytest.mark.slow
def test_default_model_lossless_and_turboquant(default_model, allocators):
    """The default model: the lossless codec gives transformers' own continuous batching's tokens exactly, and
    `turboquant-4` what `generate` gives with it."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model, tok = default_model
    words = [f"Question {i}: what does the {w} do in Python?" * (1 + i % 4)
             for i, w in enumerate("list dict set tuple str bytes int float zip map sorted open print len any all"
                                   .split())]
    prompts = [tok(w)["input_ids"] for w in words]
    plain = ContinuousBatchingConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=1024, use_cuda_graph=False,
                                     auto_switch_to_flash=False)
    assert _generate_batch(model, prompts, _config("exact"), new=8) == _generate_batch(model, prompts, plain, new=8)
    got = _generate_batch(model, prompts, _config("turboquant-4"), new=8)
    # a third of them through `generate` (the tiny models check every request of every preset)
    _check_against_generate(model, prompts[::3], got[::3], lambda: make_cache("turboquant-4", model), new=8)
    _check_freed(allocators)


@needs_seam
def test_pages_hold_the_packed_bytes():
    """Sizing counts the packed bytes: a token slot of `fp8-e4m3` is half a bf16 one, of `exact` the same, and a
    KIVI key block spreads over its tokens' slots."""
    from hf_kvcache.paged import _allocator_for

    model = tiny_model("llama")
    config = model.config
    heads, dim = config.num_key_value_heads, config.head_dim
    built = {}
    for spec in ("exact", "fp8-e4m3", "int4-g32", "kivi-2"):
        built[spec] = _allocator_for(_config(spec), config, "full_attention", None, index=0, layer_indices=[0, 1, 2],
                                     num_key_value_heads=heads, cache_dtype=torch.bfloat16, page_size=PAGE,
                                     allow_block_sharing=True)
    bf16 = 2 * heads * dim * 2
    assert built["exact"].slot_bytes == bf16
    assert built["fp8-e4m3"].slot_bytes == bf16 // 2
    # int4 in groups of 32: D/2 bytes of codes plus a 16-bit scale and zero per group, keys and values alike
    assert built["int4-g32"].slot_bytes == 2 * heads * (dim // 2 + (dim // 32) * 4)
    assert built["kivi-2"].slot_bytes < built["int4-g32"].slot_bytes
    assert built["exact"].bytes_per_block == bf16 * PAGE * 3
    # Prefix sharing where the pages are all a request stores: stateless int codes, not FP8's per-request scale.
    assert built["int4-g32"].supports_block_sharing and not built["fp8-e4m3"].supports_block_sharing


@needs_seam
def test_prefix_sharing_and_cancel_leave_no_page(allocators):
    """Prompts that share two pages of prefix (`int4-g32`, whose pages are all it stores, so transformers shares
    them) match `generate`; a request cancelled mid-way frees its pages and state."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(FIRST_TOKEN_ID, 512, (2 * PAGE + 5,), generator=g).tolist()
    prompts = [prefix + torch.randint(FIRST_TOKEN_ID, 512, (n,), generator=g).tolist() for n in (4, 9, 17, 30)]
    got = [_generate_batch(model, [p], _config("int4-g32"))[0] for p in prompts]  # one at a time: later ones match
    _check_against_generate(model, prompts, got, lambda: make_cache("int4-g32", model))
    _check_freed(allocators)

    allocators.clear()
    manager = model.init_continuous_batching(generation_config=_greedy(200), continuous_batching_config=_config("kivi-2"))
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=m) for p, m in zip(prompts, (200, 4, 200, 4))]
        deadline = time.monotonic() + 60
        while not any(a.held_requests() for a in allocators) and time.monotonic() < deadline:
            time.sleep(0.01)
        manager.cancel_request(ids[0])
        manager.cancel_request(ids[2])
        for rid in (ids[1], ids[3]):
            assert len(manager.get_result(request_id=rid, timeout=60).generated_tokens) == 4
        deadline = time.monotonic() + 60
        while any(a.held_requests() or a.block_table for a in allocators) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        manager.stop(block=True)
    _check_freed(allocators)


@needs_seam
@pytest.mark.parametrize("spec", ["kivi-2", "exact"])  # windows and state; shared pages
def test_requests_that_do_not_fit_are_reset_and_match(spec, allocators, monkeypatch):
    """Pages for fewer tokens than the requests need: transformers resets some (frees their pages, queues them again
    with what they generated as prompt); their state goes and comes back with them, and the tokens still match."""
    from hf_kvcache import paged

    resets = []
    free = paged.PackedPageAllocator.free_blocks
    monkeypatch.setattr(paged.PackedPageAllocator, "free_blocks",
                        lambda self, rid, no_cache=False: (resets.append(rid) if no_cache else None,
                                                           free(self, rid, no_cache)))
    model = tiny_model("qwen3")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(FIRST_TOKEN_ID, 512, (40,), generator=g).tolist() for _ in range(8)]
    from hf_kvcache import PackedBatchingConfig

    cfg = PackedBatchingConfig(spec, page_size=PAGE, num_blocks=12, max_batch_tokens=256)
    got = _generate_batch(model, prompts, cfg, new=60)
    assert resets, "no request was reset: the pages held them all"
    _check_against_generate(model, prompts, got, lambda: make_cache(spec, model), new=60)
    _check_freed(allocators)


@needs_seam
def test_forked_requests_copy_pages_and_state(allocators):
    """Several return sequences fork a request after its prompt (pages copied as bytes, the state with them): with
    top-1 sampling every child generates its parent's tokens, which are `generate`'s."""
    model = tiny_model("qwen3")
    prompts = _prompts(4, seed=5)
    gc = GenerationConfig(max_new_tokens=NEW, do_sample=True, top_k=1, eos_token_id=-1, pad_token_id=0,
                          num_return_sequences=2)
    out = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=_config("kivi-2"),
                               progress_bar=False)
    got = [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    assert [out[f"req_{i}__child#0"].generated_tokens for i in range(len(prompts))] == got
    _check_against_generate(model, prompts, got, lambda: make_cache("kivi-2", model))
    _check_freed(allocators)


@needs_seam
def test_bad_configs_are_refused():
    from hf_kvcache import PackedBatchingConfig

    with pytest.raises(ValueError, match="unknown cache spec"):
        PackedBatchingConfig("int5")
    with pytest.raises(ValueError, match="needs the model itself"):
        PackedBatchingConfig("rotated-4")
    with pytest.raises(ValueError, match="use_cuda_graph"):
        PackedBatchingConfig("fp8-e4m3", use_cuda_graph=True)
    with pytest.raises(ValueError, match="offloaded"):
        PackedBatchingConfig("fp8-e4m3", cpu_offload_space=1.0)
    with pytest.raises(ValueError, match="page_size=16 must be a multiple"):
        _generate_batch(tiny_model("llama"), _prompts(2), PackedBatchingConfig("kivi-2", page_size=16, num_blocks=64,
                                                                               max_batch_tokens=1024))


@needs_seam
def test_kvquant_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="kvquant"):
        _generate_batch(model, _prompts(2), _config(make_cache("kvquant-4", model)))


@pytest.mark.smoke
@pytest.mark.skipif(HAS_SEAM, reason="this transformers has the seam (the other tests here run)")
def test_old_transformers_is_told_the_version():
    import hf_kvcache

    with pytest.raises(ImportError, match=f"transformers >= {_compat.PAGED_MIN_VERSION}"):
        hf_kvcache.PackedBatchingConfig("fp8-e4m3")


@needs_seam
@pytest.mark.slow
def test_server_answers_concurrent_requests(default_model):
    """`hf-kvcache serve`'s server on 127.0.0.1 with the default model and a packed cache: concurrent completions and
    chat requests over real HTTP get answers; a streamed answer's chunks make the same text as the whole one (greedy);
    a bad request gets a 400 that says why; the server stops."""
    import json
    import threading
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from hf_kvcache.serve import Server

    model, tok = default_model
    server = Server(model, tok, "kivi-2", name="smollm2", port=0, max_tokens=6, page_size=PAGE, num_blocks=64,
                    max_batch_tokens=512).start()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.address

    def post(path, body):
        request = urllib.request.Request(f"http://{host}:{port}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    try:
        bodies = [("/v1/completions", {"prompt": f"Python's {w} function", "max_tokens": 5})
                  for w in ("len", "zip", "map", "sorted")]
        bodies += [("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Name a {w}."}]})
                   for w in ("colour", "fruit")]
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: post(*b), bodies))
        for (path, _), answer in zip(bodies, answers):
            choice = answer["choices"][0]
            text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
            assert isinstance(text, str) and answer["usage"]["completion_tokens"] >= 1
            assert answer["usage"]["completion_tokens"] <= (5 if path == "/v1/completions" else 6)
        request = urllib.request.Request(f"http://{host}:{port}/v1/chat/completions", headers={
            "Content-Type": "application/json"}, data=json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                                                  "max_tokens": 4, "stream": True}).encode())
        with urllib.request.urlopen(request, timeout=120) as response:
            events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) >= 3
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert streamed == post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 4})["choices"][0]["message"]["content"]
        with pytest.raises(urllib.error.HTTPError) as bad:
            post("/v1/completions", {"prompt": "x", "max_tokens": 0})
        assert bad.value.code == 400 and "max_tokens" in json.loads(bad.value.read())["error"]["message"]
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=10) as response:
            assert json.loads(response.read())["kv_cache"] == "kivi-2"
    finally:
        server.stop()
    thread.join(10)
    assert not thread.is_alive()


@needs_seam
def test_serving_bench_counts_what_it_ran():
    """The bench's serving part on the CPU (its figures are the GPU's, BENCHMARKS.md): in the same budget the packed
    format's pages hold the bytes ratio more tokens, every request makes its tokens, and the lifespans count the
    requests held at once."""
    from hf_kvcache.bench.serving import block_bytes, format_rows, serve_workload, workload

    model = tiny_model("llama")
    prompts = workload(12, 20, 60, vocab=512)
    budget = 24 * block_bytes("none", model, PAGE)
    rows = [serve_workload(model, spec, prompts, 4, budget, page_size=PAGE, max_batch_tokens=256)
            for spec in ("none", "fp8-e4m3")]
    base, fp8 = rows
    assert base["tokens_held"] == 24 * PAGE
    assert fp8["tokens_held"] == budget // block_bytes("fp8-e4m3", model, PAGE) * PAGE > 3 * base["tokens_held"]
    for r in rows:
        assert r["generated"] == 12 * 4 and 1 <= r["most_running"] <= 12 and r["tokens_per_s"] > 0
        assert 0 < r["ttft_s_median"] <= r["ttft_s_p90"] and 0 < r["tpot_ms_median"] <= r["tpot_ms_p90"]
    assert len(format_rows(rows)) == 4


@needs_seam
@pytest.mark.parametrize("spec, hard, tiny", [
    ("fp8-e4m3", METHODS[0][2], "qwen2"),  # sinks and a FIFO window, per-request scale
    ("kivi-2", {}, "qwen3"),  # KIVI's key blocks flushed by windows, values in a FIFO window (head_dim 128)
])  # TurboQuant's kernel (35 s under the interpreter) reads a length a row in tests/kernels/test_static.py, and packed
#     pages through it on CUDA in test_cuda_bf16_matches_generate
def test_fused_decode_reads_the_pages_as_the_reference(spec, hard, tiny, monkeypatch):
    """The decode rows of a batch read through the fused kernels in one launch, and a chunk of prompt over a history in
    its own (Triton's interpreter here; on CUDA the same launches): each request's packed slots gathered from its
    pages, its sinks and window from its lane, a length per row. Greedy tokens equal the reference read's, and the
    kernels served every row they were given, chunks (40 tokens a batch) among them."""
    from hf_kvcache import kernels, paged

    if not kernels.interpreting():
        pytest.skip("the interpreter run; on CUDA, test_cuda_bf16_matches_generate reads through the kernels")
    served = []  # (rows, new tokens a row, rows the kernels read) of each fused read
    fused = paged.PackedPageAllocator._attend_fused

    def recorded(self, handle, group, *args):
        done = fused(self, handle, group, *args)
        served.append((len(group.rows), group.q, len(done)))
        return done

    monkeypatch.setattr(paged.PackedPageAllocator, "_attend_fused", recorded)
    model = tiny_model(tiny)
    prompts = _prompts(3, seed=6)
    with kernels.use_backend("torch"):
        reference = _generate_batch(model, prompts, _config(make_cache(spec, model, **hard), max_batch_tokens=40), new=4)
    assert not served
    with kernels.use_backend("triton"):
        got = _generate_batch(model, prompts, _config(make_cache(spec, model, **hard), max_batch_tokens=40), new=4)
    assert got == reference
    assert served and all(rows == done for rows, _, done in served), f"rows not read by the kernels: {served}"
    assert any(q > 1 for _, q, _ in served), "no chunk over a history came to the kernels"


@needs_seam
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", ["fp8-e4m3", "int4-g32", "kivi-2", "turboquant-4", "turboquant-3"])
def test_cuda_bf16_matches_generate(spec, allocators):
    """On CUDA in bf16, packed pages (decode rows through the fused kernels over the pages, prefill chunks by the
    reference) against `generate` through the fused kernels: the same tokens, or parting at a bf16 near tie."""
    model = tiny_model("qwen3").to("cuda", torch.bfloat16)
    prompts = _prompts(seed=2)
    got = _generate_batch(model, prompts, _config(spec))
    _check_against_generate(model, prompts, got, lambda: make_cache(spec, model), near_tie=0.25)
    _check_freed(allocators)
