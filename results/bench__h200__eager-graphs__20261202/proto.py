"""Prototype for issue 28 (GPU run 1): the static form's eager decode step (pack of the new token, attention, combine)
replayed from one CUDA graph per layer, captured lazily after one eager step; inputs copied into fixed buffers.
Measures, on the bench's 8-layer Llama-3-8B-shaped model (random bf16 weights) at batch 1 and 16 x 32k: the host
time of one eager layer step (`bench._host_us_per_layer`), `generate`'s median step (a logits-processor clock, two
calls, each with a fresh cache) against DynamicCache eager, and whether the graphed steps give the eager static
steps' greedy tokens. Monkeypatches `hf_kvcache.static` only: nothing here is the library's final form."""
import sys, time
import torch
from transformers import DynamicCache, LogitsProcessorList
from hf_kvcache import _compat, bench, kernels, make_cache
from hf_kvcache import attention as att, static as st
from hf_kvcache.cache import KVHandle

torch.backends.cuda.enable_cudnn_sdp(False)
Layer = st.StaticQuantizedKVLayer
orig_update, orig_attention = Layer.update, att.static_attention
STATE = {"graphs": True, "pool": None, "side": None, "captures": 0, "capture_s": 0.0}


def get_mask_sizes(self, q):  # what the dynamic form gives: no mask at all without padding
    if torch.compiler.is_compiling():
        return self.max_cache_len, 0
    held = self._host_held() if self.is_initialized else 0
    return held + q, 0


Layer.get_mask_sizes = get_mask_sizes


def update(self, k, v, *args, **kwargs):
    if (not STATE["graphs"] or torch.compiler.is_compiling() or k.shape[2] != 1 or not self.fused
            or not k.is_cuda or not self.is_initialized):
        return orig_update(self, k, v, *args, **kwargs)
    held = self._host_held()
    assert held + 1 <= self.max_cache_len
    self._host_length = held + 1
    if getattr(self, "_k_in", None) is None:
        self._k_in, self._v_in, self._graph = torch.empty_like(k), torch.empty_like(v), None
    self._k_in.copy_(k)
    self._v_in.copy_(v)
    return KVHandle(self, "keys", self._k_in), KVHandle(self, "values", self._v_in)


def _step(layer):
    p = layer.length + torch.arange(1, device=layer.device)
    layer._streams["keys"].write(layer._k_in, p, layer.pad_lengths)
    layer._streams["values"].write(layer._v_in, p, layer.pad_lengths)
    layer.length.add_(1)
    keys, values = layer.key_stream.kernel_view(), layer.value_stream.kernel_view()
    return kernels.ops.static_decode_attention(layer._q_in, keys, values, layer._k_in, layer._v_in,
                                               layer.static_layout(), exact_new=True, attention_mask=layer._mask_in,
                                               scaling=layer._scaling)


def static_attention(query, key, value, mask, scaling, softcap=None, s_aux=None):
    layer = key.layer
    if key.new is not getattr(layer, "_k_in", None):
        return orig_attention(query, key, value, mask, scaling, softcap, s_aux)
    assert softcap is None and s_aux is None
    if layer._graph is None:
        layer._q_in, layer._scaling = query.contiguous().clone(), scaling
        layer._mask_in = None
        if mask is not None:
            STATE["masks"] = STATE.get("masks", 0) + 1
            layer._mask_in = torch.zeros((*mask.shape[:3], layer.max_cache_len), dtype=mask.dtype, device=mask.device)
            layer._mask_in[..., : mask.shape[-1]].copy_(mask)
        out = _step(layer)  # the real step, eager (compiles the kernels)
        t0 = time.perf_counter()
        if STATE["pool"] is None:
            STATE["pool"], STATE["side"] = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        g, side = torch.cuda.CUDAGraph(), STATE["side"]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            g.capture_begin(pool=STATE["pool"])
            layer._out = _step(layer)
            g.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        layer._graph = g
        STATE["captures"] += 1
        STATE["capture_s"] += time.perf_counter() - t0
        return out
    layer._q_in.copy_(query)
    if mask is not None:
        layer._mask_in[..., : mask.shape[-1]].copy_(mask)
    layer._graph.replay()
    return layer._out


Layer.update, att.static_attention = update, static_attention


def gen_once(model, ids, spec, n):
    torch.cuda.synchronize()
    STATE["pool"] = None  # a pool lives while a graph of it does: one per cache
    if spec == "dynamic":
        cache, attn = DynamicCache(config=model.config), "sdpa"
    else:
        cache, attn = make_cache(spec, model, max_cache_len=ids.shape[1] + n + 256), "hf_kvcache"
    bench._set_attention(model, attn)
    clock = bench._StepClock(ids.device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, logits_processor=LogitsProcessorList([clock]), disable_compile=True,
                         **_compat.cache_kwargs(cache))
    torch.cuda.synchronize()
    gaps = sorted(b - a for a, b in zip(clock.times[1:], clock.times[2:]))
    return dict(out=out, cache=cache, call_s=time.perf_counter() - t0, step_ms=gaps[len(gaps) // 2] * 1e3,
                prefill_s=clock.times[0] - t0)


def main():
    specs = sys.argv[1].split(",")
    batches = [int(b) for b in sys.argv[2].split(",")]
    s, n = 32768, 64
    model = bench._random_model(8)
    lines = []
    for batch in batches:
        ids = torch.randint(0, model.config.vocab_size, (batch, s), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(batch))
        base = None
        for spec in ["dynamic"] + specs:
            for graphs in ([True] if spec == "dynamic" else [True, False]):
                STATE["graphs"], STATE["captures"], STATE["capture_s"] = graphs, 0, 0.0
                first = gen_once(model, ids, spec, n)
                del first["cache"]
                caps, cap_s = STATE["captures"], STATE["capture_s"]
                second = gen_once(model, ids, spec, n)
                host = bench._host_us_per_layer(model, second["cache"], batch)
                base = base or second["step_ms"]
                same = ""
                if spec != "dynamic" and graphs:
                    ref_tokens = second["out"]
                elif spec != "dynamic":
                    same = f" tokens equal the graphed run's: {torch.equal(ref_tokens, second['out'])}"
                line = (f"batch {batch:3d} {spec:>15} {'graphs' if graphs else 'eager':>6}: step {second['step_ms']:7.2f} ms "
                        f"x{base / second['step_ms']:.2f} DynamicCache  host {host:5.0f} us/layer  first call "
                        f"{first['call_s']:6.1f} s second {second['call_s']:6.1f} s  prefill {second['prefill_s']:5.2f} s"
                        f"  captures {caps} in {cap_s * 1e3:.0f} ms masks {STATE.get('masks', 0)}{same}")
                print(line, flush=True)
                lines.append(line)
                del second
                torch.cuda.empty_cache()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
