"""The prefill part: prefill over a packed history as `generate` runs it (a long prompt in chunks, then a chat's next
turn over it), against DynamicCache chunked and unchunked.
"""

from __future__ import annotations

import gc
import time

import torch

from .. import _compat
from ._common import BenchConfig, _make_e2e_cache, _random_model, _set_attention, _StepClock, _sync


def _padded_mask(ids: torch.Tensor, pad: int) -> torch.Tensor:
    """The attention mask of `ids (B, T)` with every other row's first `pad` tokens padding (rows 1, 3, ...)."""
    mask = torch.ones_like(ids)
    mask[1::2, :pad] = 0
    return mask


def _prefill_s(model, cache, ids: torch.Tensor, chunk: int | None, pad: int = 0) -> float:
    """Seconds of `generate`'s prefill of `ids` into `cache` (one new token: its step is the prefill's), in chunks
    of `chunk` tokens when given; every other row left-padded by `pad` tokens."""
    clock = _StepClock(ids.device)
    from transformers import LogitsProcessorList

    _sync(ids.device)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=_padded_mask(ids, pad), max_new_tokens=1, do_sample=False,
                   logits_processor=LogitsProcessorList([clock]), disable_compile=True, prefill_chunk_size=chunk,
                   **_compat.cache_kwargs(cache))
    return clock.times[0] - t0


def _turn_s(model, cache, turn: torch.Tensor, pad: int = 0) -> float:
    """Seconds of one forward of a chat's next turn, `turn (B, T)` tokens, over what `cache` holds (every other row's
    first `pad` tokens padding)."""
    held = int(cache.get_seq_length())
    mask = _padded_mask(torch.empty(turn.shape[0], held + turn.shape[1], dtype=torch.long, device=turn.device), pad)
    _sync(turn.device)
    t0 = time.perf_counter()
    model(input_ids=turn, attention_mask=mask, use_cache=True, logits_to_keep=1, **_compat.cache_kwargs(cache))
    _sync(turn.device)
    return time.perf_counter() - t0


def _prefill_row(model, name: str, ids: torch.Tensor, turn: torch.Tensor, chunk: int | None, pad: int = 0) -> dict:
    """One method's prefill of `ids` in chunks of `chunk` (a fresh cache), then the next turn over it, every other row
    left-padded by `pad` tokens; the peak memory above what was allocated before (the weights and the prompt)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cache, attention = _make_e2e_cache(name, model)
    _set_attention(model, attention)
    prefill_s = _prefill_s(model, cache, ids, chunk, pad)
    turn_s = _turn_s(model, cache, turn, pad)
    peak = (torch.cuda.max_memory_allocated() - base) / 1e9
    return dict(method=name, batch=ids.shape[0], context=ids.shape[1], chunk=chunk, prefill_s=prefill_s,
                turn=turn.shape[1], turn_s=turn_s, peak_gb=peak, pad=pad)


def prefill_part(cfg: BenchConfig, log=print) -> list[dict]:
    """Prefill over a packed history, as `generate` runs it on a Llama-3-8B-shaped model (random bf16 weights,
    `e2e_layers` layers), at each of `prefill_batches`: a prompt of `e2e_context` tokens prefilled in chunks of
    `e2e_prefill_chunk` (each chunk after the first attends to the packed history), then a next turn of
    `prefill_turn` tokens over it (one forward). DynamicCache prefills the prompt both unchunked and chunked; each
    of `decode_methods` chunked, under the model's own attention. Each row is timed after a warm-up prefill of a
    short prompt (the kernels' compiles): the prefill's time, its ratios to DynamicCache chunked and unchunked in the
    same run, the turn's time and its ratio to DynamicCache's, peak memory. With `prefill_pad`, every other row's
    first `prefill_pad` tokens are padding (the same mask for every cache): a left-padded batch."""
    model = _random_model(cfg.e2e_layers)
    chunk = cfg.e2e_prefill_chunk
    rows = []
    for batch in cfg.prefill_batches:
        gen = torch.Generator(device="cuda").manual_seed(batch)
        ids = torch.randint(0, model.config.vocab_size, (batch, cfg.e2e_context), device="cuda", generator=gen)
        turn = torch.randint(0, model.config.vocab_size, (batch, cfg.prefill_turn), device="cuda", generator=gen)
        warm = ids[:, : 2 * chunk + 64] if chunk else ids[:, :4096]
        pad = min(cfg.prefill_pad, ids.shape[1] - 1) if batch > 1 else 0
        warm_pad = min(pad, warm.shape[1] // 2)
        base = {}
        for name, this_chunk in [("dynamic", None), ("dynamic", chunk)] + [(m, chunk) for m in cfg.decode_methods]:
            try:
                _prefill_row(model, name, warm, turn[:, :64], this_chunk, warm_pad)
                r = _prefill_row(model, name, ids, turn, this_chunk, pad)
            except torch.cuda.OutOfMemoryError as error:
                log(f"{name} at batch {batch}: out of memory ({str(error).splitlines()[0]})")
                rows.append(dict(method=name, batch=batch, chunk=this_chunk, oom=True))
                continue
            finally:
                from ..patching import unfuse

                unfuse(model)
            if name == "dynamic":
                base[this_chunk] = r
            unchunked, chunked = base.get(None), base.get(chunk)
            r["vs_dynamic"] = unchunked["prefill_s"] / r["prefill_s"] if unchunked else None
            r["vs_dynamic_chunked"] = chunked["prefill_s"] / r["prefill_s"] if chunked else None
            r["turn_vs_dynamic"] = chunked["turn_s"] / r["turn_s"] if chunked else None
            rows.append(r)

            def ratio(x):
                return "   -  " if x is None else f"x{x:5.2f}"

            padded = f" (pad {pad})" if pad else ""
            log(f"batch {batch:3d}{padded} {name:>14} chunk {str(this_chunk):>5}: prefill {r['prefill_s']:7.3f} s "
                f"{ratio(r['vs_dynamic_chunked'])} DynamicCache chunked, {ratio(r['vs_dynamic'])} unchunked  "
                f"turn of {r['turn']} {r['turn_s'] * 1e3:8.1f} ms {ratio(r['turn_vs_dynamic'])}  "
                f"peak {r['peak_gb']:6.2f} GB")
    cfg.results["prefill"] = dict(context=cfg.e2e_context, layers=cfg.e2e_layers, chunk=chunk,
                                  turn=cfg.prefill_turn, pad=cfg.prefill_pad, rows=rows)
    del model
    return rows
