"""An evaluation run, as `hf-kvcache eval` and `compare` make it: `EvalConfig` (what a run measures) and `run_eval`,
which loads the model, builds each method's cache, measures every protocol and writes one immutable results
directory (`hf_kvcache.eval.report`). The command line (`hf_kvcache.cli`) parses its arguments into an `EvalConfig`."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

BASELINE = "none"
# The demo's methods: the baseline, FP8 and INT, and one preset of each family that needs no calibration file.
DEFAULT_METHODS = ("none", "fp8-e4m3", "int8", "int4-g32", "int2-g32", "kivi-2", "rotated-4", "turboquant-4")
PROTOCOLS = ("decode", "strict", "stream")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTIONS = ("hf_kvcache", "sdpa", "eager")
BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EvalConfig:
    """Everything a run measures. The defaults are the decode protocol (docs/evaluation.md) at its CPU size (8
    windows, a prefill of 1024 tokens, 64 decoded), so figures compare across runs; `QUICK` shrinks every size for
    tests.

    `protocols`: "decode" (prefill `prefill` tokens, then `decode_tokens` fed one at a time; one result per prefill
    length), "strict" (every K/V quantized before attention, one forward per window of `context` tokens) and
    "stream" (chunks of `chunk` tokens, each attending exactly to itself: an option, never a headline); `windows`
    counts every protocol's windows. `attention`: the model's attention ("hf_kvcache", the fused path: the kernels
    on CUDA, the reference on CPU); `backend` picks kernels or reference (`hf_kvcache.kernels.set_backend`)."""

    methods: tuple[str, ...] = DEFAULT_METHODS
    protocols: tuple[str, ...] = ("decode",)
    prefill: tuple[int, ...] = (1024,)
    decode_tokens: int = 64
    windows: int = 8
    batch_size: int | None = None  # decode windows per batch (None: all of them at once)
    context: int = 1024
    chunk: int = 64
    skip: int = 128
    text: str | None = None  # None: the dev corpus (pydoc_data.topics)
    passkey: bool = True
    passkey_lengths: tuple[int, ...] = (1024, 2048)
    passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    passkey_trials: int = 1
    retrieval: tuple[str, ...] = ()  # tasks of `hf_kvcache.eval.retrieval` (none by default: minutes on a GPU)
    retrieval_lengths: tuple[int, ...] = (2048, 4096, 8192)
    retrieval_samples: int = 50
    retrieval_batch: int = 25
    model: str | None = None  # None: the embedded default
    dtype: str = "auto"
    device: str | None = None
    attention: str = "hf_kvcache"
    backend: str = "auto"
    progress: bool = True


QUICK = {
    "prefill": (96,),
    "decode_tokens": 16,
    "windows": 2,
    "context": 128,
    "chunk": 32,
    "skip": 32,
    "passkey_lengths": (256,),
    "passkey_depths": (0.5,),
    "passkey_trials": 1,
    "retrieval_lengths": (256,),
    "retrieval_samples": 4,
    "retrieval_batch": 4,
}


class UsageError(Exception):
    """A problem with what the user asked for (bad spec, missing file): one line, exit status 2."""


def split_methods(values: list[str]) -> list[str]:
    """Method specs from `--methods` values, comma- or space-separated. A comma also separates a spec's
    overrides (`int4-g32:sink_tokens=4,residual_length=32`): a piece holding `=` but no `:` continues the
    previous spec."""
    specs: list[str] = []
    for value in values:
        for piece in filter(None, (p.strip() for p in value.split(","))):
            if "=" in piece and ":" not in piece and specs and ":" in specs[-1]:
                specs[-1] += "," + piece
            else:
                specs.append(piece)
    return specs


def _torch_dtype(name: str):
    import torch

    return None if name == "auto" else getattr(torch, name)


def _tasks_label(cfg: EvalConfig) -> str:
    parts = []
    if "decode" in cfg.protocols:
        parts.append("decode" + "+".join(str(p) for p in cfg.prefill) + f"x{cfg.windows}")
    parts += [f"{p}{cfg.context}x{cfg.windows}" for p in ("strict", "stream") if p in cfg.protocols]
    if cfg.passkey:
        parts.append("passkey")
    if cfg.retrieval:
        parts.append("retrieval")
    if cfg.text:
        parts.append("text-" + Path(cfg.text).stem)
    return "-".join(parts)


def _describe(spec: str) -> str:
    from ..presets import describe
    from . import compared

    if compared.is_compared(spec):
        return compared.describe(spec)
    try:
        return describe(spec)
    except (ValueError, KeyError) as error:
        raise UsageError(f"bad method spec {spec!r}: {error}") from error


def _factory(spec: str, model):
    from ..patching import unfuse
    from ..presets import make_cache
    from . import compared

    def build():
        return compared.build(spec, model) if compared.is_compared(spec) else make_cache(spec, model)

    try:  # build one now: a spec that cannot be built fails before any measurement, in one line
        build()
    except (ValueError, KeyError, FileNotFoundError, ImportError) as error:
        raise UsageError(f"cannot build cache {spec!r}: {error}") from error
    finally:
        unfuse(model)  # a RotatedCache folds its rotation into the model: each method runs on the model it expects
    return build


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_eval(
    cfg: EvalConfig,
    *,
    command: str = "eval",
    out: str = "results",
    model=None,
    tokenizer=None,
    argv: list[str] | None = None,
) -> tuple[Path, dict]:
    """Measure every method of `cfg` and write a results directory under `out`. Returns `(path, metrics)`.

    `model` and `tokenizer` may be given (tests pass tiny ones); otherwise `load_model(cfg.model, ...)`.
    The baseline `none` is always measured, first, in the same run: every delta is against it, and the decode
    protocol's KL and top-1 against its next-token distributions on the same windows.
    """
    from .. import _compat, kernels, patching
    from . import corpus, memory, passkey, perplexity, report, retrieval

    methods = list(dict.fromkeys(cfg.methods))
    if BASELINE in methods:
        methods.remove(BASELINE)
    methods.insert(0, BASELINE)
    cfg = replace(cfg, methods=tuple(methods))
    unknown = set(cfg.protocols) - set(PROTOCOLS)
    if unknown or not cfg.protocols:
        raise UsageError(f"--protocol takes {', '.join(PROTOCOLS)} (comma-separated), got {','.join(cfg.protocols)!r}")
    descriptions = {spec: _describe(spec) for spec in methods}  # bad specs fail before the model loads

    if cfg.text:
        try:
            text = corpus.load_text(cfg.text)
        except (OSError, ValueError) as error:
            raise UsageError(f"--text: {error}") from error
    else:
        text = corpus.dev_text()

    started = time.perf_counter()
    if model is None:
        from ..models import load_model

        try:
            model, tokenizer = load_model(cfg.model, dtype=_torch_dtype(cfg.dtype), device=cfg.device,
                                          attn_implementation=cfg.attention)
        except (ValueError, ModuleNotFoundError, FileNotFoundError) as error:
            raise UsageError(str(error)) from error
    from ..models import model_name

    name = model_name(model)
    load_seconds = time.perf_counter() - started
    tokens = corpus.tokenize_corpus(tokenizer, text)
    try:
        if "decode" in cfg.protocols:
            for p in cfg.prefill:
                perplexity.decode_windows(tokens.numel(), p, cfg.decode_tokens, cfg.windows)
        if {"strict", "stream"} & set(cfg.protocols):
            perplexity.window_starts(tokens.numel(), cfg.context, cfg.windows)
    except ValueError as error:
        raise UsageError(str(error)) from error

    entries, references = [], {}
    metrics = {"model": name, "baseline": BASELINE, "methods": entries}

    def config(complete: bool) -> dict:
        return {
            "command": command,
            **{k: v for k, v in asdict(cfg).items() if k != "progress"},
            "model_name": name,
            "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "device": str(next(model.parameters()).device),
            "device_name": _device_name(model),
            "attn_implementation": _compat.attn_implementation(model.config),
            "corpus": cfg.text or "pydoc_data.topics (dev corpus)",
            "corpus_tokens": int(tokens.numel()),
            "descriptions": descriptions,
            "complete": complete,  # False while running (and after an interruption): the methods measured so far
            "seconds": {"load": round(load_seconds, 2), "total": round(time.perf_counter() - started, 2)},
            **report.environment(argv),
        }

    with kernels.use_backend(cfg.backend):
        factories = {spec: _factory(spec, model) for spec in methods}
        dir_name = report.results_dir_name(
            command,
            name,
            _tasks_label(cfg),
            methods=None if command == "compare" or len(methods) > 4 else methods[1:],
        )
        path = report.create_results_dir(out, dir_name)
        for spec in methods:
            factory = factories[spec]
            entry = {"spec": spec, "description": descriptions[spec]}
            # Every method on the model it expects: the unfused one, which a RotatedCache's factory fuses again.
            patching.unfuse(model)
            calibrated = getattr(factory(), "calibration", None)
            if calibrated is not None:  # which artifact a calibrated method read: its metadata, in the results
                entry["calibration"] = calibrated.metadata
            if "decode" in cfg.protocols:
                entry["decode"] = {}
                for p in cfg.prefill:
                    result = perplexity.decode_perplexity(
                        model, tokens, factory, prefill=p, decode=cfg.decode_tokens, windows=cfg.windows,
                        batch_size=cfg.batch_size, reference=references.get(p), keep_logprobs=spec == BASELINE,
                        progress=cfg.progress, desc=f"{spec} decode {p}",
                    )
                    if spec == BASELINE:
                        references[p] = result
                    entry["decode"][str(p)] = {k: v for k, v in result.items() if k != "logprobs"}
                # Memory: what one batch's cache held per row and token at the end of the longest prefill's run.
                last = entry["decode"][str(max(cfg.prefill))]
                entry["memory"] = memory.memory_summary(model, last["cache_nbytes"],
                                                        last["cache_rows"] * (max(cfg.prefill) + cfg.decode_tokens))
            common = {"context": cfg.context, "windows": cfg.windows, "skip": cfg.skip, "progress": cfg.progress}
            if "strict" in cfg.protocols:
                entry["strict"] = perplexity.strict_perplexity(model, tokens, factory, desc=f"{spec} strict", **common)
            if "stream" in cfg.protocols:
                entry["stream"] = perplexity.streaming_perplexity(model, tokens, factory, chunk=cfg.chunk,
                                                                  desc=f"{spec} stream", **common)
            if "memory" not in entry:
                entry["memory"] = memory.bytes_per_token(model, factory, tokens, n_tokens=cfg.context,
                                                         chunk=cfg.chunk)
            if cfg.passkey:
                entry["passkey"] = passkey.passkey_grid(
                    model, tokenizer, factory, cfg.passkey_lengths, cfg.passkey_depths, trials=cfg.passkey_trials,
                    progress=cfg.progress, desc=f"{spec} passkey",
                )
            if cfg.retrieval:
                entry["retrieval"] = retrieval.retrieval_grid(
                    model, tokenizer, factory, cfg.retrieval, cfg.retrieval_lengths, cfg.retrieval_samples,
                    batch_size=cfg.retrieval_batch, progress=cfg.progress, desc=f"{spec} retrieval",
                )
            entries.append(entry)
            _log(_summary_line(entry))
            report.fill_results(path, metrics, config(complete=False), plot=False)
    references.clear()
    patching.unfuse(model)  # the model leaves as it came
    report.fill_results(path, metrics, config(complete=True))
    return path, metrics


def _device_name(model) -> str:
    import torch

    device = next(model.parameters()).device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _summary_line(entry: dict) -> str:
    parts = [f"{entry['spec']}:"]
    for p, result in (entry.get("decode") or {}).items():
        if "delta_nll_pct" in result:
            half = result["delta_interval"]["half_width"]
            parts.append(f"decode {p}: nll {result['delta_nll_pct']:+.2f}%" + (f" +-{half:.2f}" if half else "")
                         + f" kl {result['kl']:.4f} top-1 {result['top1']:.1%}")
        else:
            parts.append(f"decode {p}: nll {result['nll']:.4f}")
    for protocol in ("strict", "stream"):
        if protocol in entry:
            parts.append(f"{protocol} ppl {entry[protocol]['ppl']:.3f}")
    parts.append(f"{entry['memory']['ratio']:.3f}x bytes")
    if "passkey" in entry:
        parts.append(f"passkey {entry['passkey']['accuracy']:.0%}")
    if "retrieval" in entry:
        parts.append(f"retrieval {entry['retrieval']['accuracy']:.0%}")
    return "  ".join(parts)
