"""GPU run 2: where a compiled decode step spends its time (profiler top kernels, host gaps), fp32 eager==compiled."""
import time, sys, torch, gc
from torch.profiler import ProfilerActivity, profile
from hf_kvcache import make_cache, _compat, bench
from tests.helpers.tiny_models import tiny_model, left_padded_batch
from tests.helpers.methods import METHODS

torch.backends.cuda.enable_cudnn_sdp(False)
# 1) fp32 tiny llama: eager == compiled
for spec, easy, hard in METHODS:
    if spec.startswith(("kvquant", "fp8-e5m2", "int2", "int4")):
        continue
    model = tiny_model("llama", "hf_kvcache").to("cuda", torch.float32)
    ids, mask = left_padded_batch(model, lengths=(40, 11)); ids, mask = ids.cuda(), mask.cuda()
    torch._dynamo.reset()
    gen = lambda c, **kw: model.generate(ids, attention_mask=mask, max_new_tokens=200, min_new_tokens=200, do_sample=False, **kw, **_compat.cache_kwargs(c))
    dyn = gen(make_cache(spec, model, **hard))
    eager = gen(make_cache(spec, model, **hard, max_cache_len=300), disable_compile=True)
    comp = gen(make_cache(spec, model, **hard, max_cache_len=300))
    first = lambda a, b: int((a != b).any(0).nonzero()[0]) if not torch.equal(a, b) else -1
    print(f"fp32 {spec:10s} eager==compiled {torch.equal(eager, comp)} (first diff {first(eager, comp)}) static==dynamic {torch.equal(eager, dyn)} (first diff {first(eager, dyn)})", flush=True)

# 2) profile compiled steps at batch 16 x 32k
model = bench._random_model(8)
for name, compiled, batch in [("kivi-2", True, 16), ("kivi-2", False, 16), ("fp8-e4m3", True, 16), ("exact", True, 16), ("fp8-e4m3", True, 1)]:
    torch._dynamo.reset()
    if hasattr(model, "_compiled_call"):
        del model._compiled_call
    gc.collect(); torch.cuda.empty_cache()
    cache, attn = bench._decode_cache(name, model, 32768, compiled)
    bench._set_attention(model, attn)
    bench._fill(cache, model, batch, 32768)
    bench._generate_from(model, cache, batch, 4, compiled)
    # the compiled forward alone, in a loop (no generate): wall per call
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t = bench._generate_from(model, cache, batch, 16, compiled)
    print(f"\n==== {name} {'compiled' if compiled else 'eager'} batch {batch}: generate 16 steps {t*1e3/16:.2f} ms/step")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=70))
    del cache
