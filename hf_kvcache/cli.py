"""The `hf-kvcache` command.

    hf-kvcache compare            the demo: every basic method on the default model, one table, one plot
    hf-kvcache eval --methods ... any methods, protocols and sizes (compare is eval with its defaults)
    hf-kvcache calibrate          FP8 scales, key thresholds and NUQ codebooks of a model, in one artifact file
    hf-kvcache bench              GPU benchmarks (kernels, end to end, capacity)
    hf-kvcache lm-eval ARGS       lm-eval's command line with the `hf-kvcache` model and the offline tasks
    hf-kvcache report DIR...      results directories merged into one table and one quality-vs-bytes figure
    hf-kvcache report --readme README.md   the README's preset table and plot, from the result files
    hf-kvcache plan               capacity: bytes per token and sequences that fit per method, and a recommendation
    hf-kvcache serve [MODEL]      OpenAI-style completions and chat over continuous batching with packed pages

Both write an immutable results directory under `--out` (see `hf_kvcache.eval.report`) and print the
table. A bad method spec is reported in one line with exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .eval.runner import (  # noqa: F401  (the run's names, re-exported: `from hf_kvcache.cli import run_eval`)
    ATTENTIONS, BACKENDS, BASELINE, DEFAULT_METHODS, DTYPES, PROTOCOLS, QUICK, EvalConfig, UsageError, run_eval,
    split_methods,
)

__all__ = ["BASELINE", "DEFAULT_METHODS", "EvalConfig", "main", "run_eval", "split_methods"]

def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="the embedded default 'smollm2-135m' (default), a local HF model directory or .gguf file",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="model dtype (auto: float32 on CPU, bfloat16 on CUDA)"
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    parser.add_argument(
        "--attention", choices=ATTENTIONS, default=None,
        help="the model's attention (default hf_kvcache: the fused read of the packed cache, the Triton kernels on "
        "CUDA and the PyTorch reference on CPU; sdpa and eager: the model's own, whose calls on CUDA a packed cache "
        "routes to the same kernels, and which read it dequantized on CPU)",
    )
    parser.add_argument(
        "--backend", choices=BACKENDS, default=None,
        help="kernels or the PyTorch reference for packing and attention (default auto: kernels on CUDA)",
    )
    parser.add_argument(
        "--out", default="results", help="parent folder of the results directory (default: results/)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's choice, one per core)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, for a smoke test (minutes -> seconds)"
    )
    parser.add_argument("--no-passkey", action="store_true", help="skip passkey retrieval")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_eval_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        metavar="SPEC",
        help=f"method specs, comma- or space-separated (default: {','.join(DEFAULT_METHODS)}); "
        "the baseline 'none' is always added",
    )
    parser.add_argument(
        "--protocol",
        default=None,
        metavar="P,P",
        help="perplexity protocols, comma-separated: decode (the default: a prefill through the cache, then tokens "
        "decoded one at a time, as generate does), strict (every K/V quantized before attention; 'paper' is its old "
        "name) and stream (chunks that attend exactly to themselves: flatters every cache without an exact window)",
    )
    parser.add_argument("--prefill", default=None, metavar="P,P",
                        help="decode protocol: prefill lengths in tokens, one result each (default 1024)")
    parser.add_argument("--decode-tokens", type=int, default=None,
                        help="decode protocol: tokens decoded and scored after the prefill (default 64)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="decode protocol: windows per batch (default: all in one)")
    parser.add_argument("--context", type=int, default=None,
                        help="strict and stream protocols: tokens per window (default 1024)")
    parser.add_argument(
        "--chunk", type=int, default=None, help="stream protocol: tokens per forward (default 64)"
    )
    parser.add_argument(
        "--windows", type=int, default=None, help="windows spread over the corpus, every protocol (default 8)"
    )
    parser.add_argument(
        "--skip", type=int, default=None,
        help="strict and stream protocols: unscored tokens at the start of each window (default 128)",
    )
    parser.add_argument(
        "--text", default=None, metavar="FILE", help="a UTF-8 text file instead of the dev corpus"
    )
    parser.add_argument(
        "--passkey-lengths",
        default=None,
        metavar="L,L",
        help="passkey context lengths in tokens (default 1024,2048)",
    )
    parser.add_argument(
        "--passkey-depths",
        default=None,
        metavar="D,D",
        help="needle depths, fractions of the context (default 0.1,0.5,0.9)",
    )
    parser.add_argument(
        "--passkey-trials", type=int, default=None, help="keys per (length, depth) (default 1)"
    )
    parser.add_argument(
        "--retrieval", default=None, metavar="T,T",
        help="generated retrieval tasks, comma-separated: multikey, multivalue, vartrack, or all (default: none)",
    )
    parser.add_argument("--retrieval-lengths", default=None, metavar="L,L",
                        help="retrieval prompt lengths in tokens (default 2048,4096,8192)")
    parser.add_argument("--retrieval-samples", type=int, default=None,
                        help="prompts per (task, length) (default 50)")
    parser.add_argument("--retrieval-batch", type=int, default=None,
                        help="retrieval prompts per generate call (default 25)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-kvcache", description="KV-cache quantization for HF transformers"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    compare = sub.add_parser(
        "compare",
        help="the demo: a preset of every method that needs no calibration on the default model, one table and plot",
        description="Decode-protocol perplexity (KL and top-1 against the 16-bit cache), passkey retrieval and "
        "bytes per token of " + ", ".join(DEFAULT_METHODS) + " in one run (the options of `eval` change what it "
        "measures, e.g. --methods kivi-4,kivi-2).",
    )
    _add_common(compare)
    _add_eval_options(compare)
    evaluate = sub.add_parser("eval", help="evaluate any methods: perplexity, passkey, memory")
    _add_common(evaluate)
    _add_eval_options(evaluate)
    cal = sub.add_parser(
        "calibrate",
        help="calibrate a model: per-head FP8 scales, key thresholds and NUQ codebooks in one artifact",
        description="Runs the model over calibration text (default: the middle of the dev corpus, disjoint from "
        "the evaluation windows of up to ~10k tokens) and writes one .safetensors artifact. By default it is stored "
        "in the user cache folder under the model's fingerprint, where calibrated caches find it.",
    )
    cal.add_argument("--model", default=None, help="the embedded default (default), a local HF model directory or .gguf")
    cal.add_argument("--text", default=None, metavar="FILE", help="calibration text (default: the dev corpus)")
    cal.add_argument("--tokens", type=int, default=16384, help="calibration tokens (default 16384)")
    cal.add_argument("--bits", default="2,3,4", help="NUQ codebook bit widths (default 2,3,4)")
    cal.add_argument("--outlier-fraction", type=float, default=0.01, help="share of outliers kept exact (default 0.01)")
    cal.add_argument("--weighting", choices=("fisher", "none"), default="fisher",
                     help="k-means weights: squared gradients of the loss (default) or none (no backward pass)")
    cal.add_argument("--chunk", type=int, default=512, help="tokens per forward pass (default 512)")
    cal.add_argument("--out", default=None, metavar="PATH", help="artifact path (default: the user cache folder)")
    cal.add_argument("--vllm-out", default=None, metavar="PATH", help="also write FP8 scales under vLLM's names")
    cal.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    cal.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    cal.add_argument("--no-progress", action="store_true", help="no progress bars")
    rep = sub.add_parser(
        "report", help="merge results directories into one table and figure, or render the README's figures",
        description="With DIRs: their methods in one table and one quality-vs-bytes figure, in a new results "
        "directory. With --readme: the README's preset table and plot, and the figures `hf-kvcache plan` cites "
        "(hf_kvcache/data/measured.json), rendered from the result files docs/readme_sources.json names.",
    )
    rep.add_argument("dirs", nargs="*", metavar="DIR", help="results directories written by eval/compare")
    rep.add_argument("--readme", default=None, metavar="PATH",
                     help="rewrite the marked blocks of this README (e.g. README.md) from the result files")
    rep.add_argument("--sources", default=None, metavar="PATH",
                     help="which result file feeds which figure (default: docs/readme_sources.json beside the README)")
    rep.add_argument("--check", action="store_true",
                     help="with --readme: write nothing, exit 1 if the README or measured.json disagree with the files")
    rep.add_argument("--out", default="results", help="parent folder of the report's directory (default: results/)")
    rep.add_argument("--protocol", choices=("decode", "strict", "stream"), default="decode",
                     help="the figure's quality axis (default decode: each run's longest prefill, else strict, else stream)")
    _add_plan_parser(sub)
    from .serve import add_parser as add_serve_parser

    add_serve_parser(sub)
    sub.add_parser(
        "lm-eval", add_help=False,
        help="lm-eval's own command line, with the `hf-kvcache` model type and the offline tasks "
        "(e.g. hf-kvcache lm-eval --model hf-kvcache --model_args kv_cache=kivi-2 --tasks hf_kvcache_passkey)",
    )
    bench = sub.add_parser(
        "bench",
        help="GPU benchmarks: decode-attention kernels, end-to-end generate, capacity",
        description="Decode attention against bf16 SDPA (flash, GQA); model.generate as users call it, each method "
        "eager and compiled, against DynamicCache and transformers' StaticCache compiled; the batch that fits a memory "
        "budget. Needs a CUDA GPU.",
    )
    bench.add_argument(
        "--parts", default=None,
        help="kernel, e2e, capacity (the default three), decode (steps over filled caches), batch1 (eager steps at "
        "batch 1 in --repeats interleaved rounds: medians and spread), prefill (chunked prefill "
        "and a next turn over a packed history), sweep (launch parameters), multi_gpu (see --multi-gpu), compiles "
        "(the Triton compiles of a first generate call, for --compile-arch; needs no GPU), first_call (a first "
        "generate on an empty Triton cache against the second, with and without warm_up), sass (each method's "
        "decode kernel compiled for --compile-arch: its instructions and bytes a held token; needs no GPU) and "
        "serving (--serving-requests through continuous batching in --serving-budget-gb of pages, packed against bf16) "
        "and pages (bytes a token slot of --serving-methods on the 8B shape; needs no GPU)"
    )
    bench.add_argument("--methods", default=None,
                       help="cache specs of the kernel part (default: the README's front presets and INT2, "
                       "bench.KERNEL_SPECS)")
    bench.add_argument("--batches", default="1,16,64", help="kernel grid batches")
    bench.add_argument("--contexts", default="4096,32768", help="kernel grid contexts in tokens")
    bench.add_argument("--e2e-batch", type=int, default=16)
    bench.add_argument("--e2e-context", type=int, default=32768)
    bench.add_argument("--e2e-layers", type=int, default=8, help="decoder layers of the 8B-shaped model")
    bench.add_argument("--new-tokens", type=int, default=64, help="decoded tokens per end-to-end generate call")
    bench.add_argument("--prefill-chunk", type=int, default=2048,
                       help="prefill_chunk_size of the end-to-end part's chunked call (0: none)")
    bench.add_argument("--prefill-chunk-all", action="store_true",
                       help="the end-to-end part's timed calls prefill in chunks of --prefill-chunk too (a batch "
                       "whose unchunked prefill runs out of memory, e.g. 64 x 32k); their peak is the chunked peak")
    bench.add_argument("--e2e-modes", default="eager,compiled",
                       help="forms of each method in the end-to-end part: eager (no max_cache_len), compiled "
                       "(max_cache_len, generate's compile; adds transformers' StaticCache compiled as a baseline)")
    bench.add_argument("--budget-gb", type=float, default=80.0, help="KV memory budget of the capacity part")
    bench.add_argument(
        "--multi-gpu", action="store_true",
        help="the multi-GPU part only (unless --parts names others too): a Llama-3-8B-shaped model on one GPU and "
        "split over every visible GPU as device_map='auto' splits it; decode tokens/s at --e2e-batch x --e2e-context "
        "and the largest batch that runs there, for DynamicCache and each method",
    )
    bench.add_argument("--multi-gpu-layers", type=int, default=32, help="decoder layers of the multi-GPU model")
    bench.add_argument("--decode-batches", default="1,16,64",
                       help="batches of the end-to-end and decode-step tables (parts e2e and decode)")
    bench.add_argument("--decode-methods", default=None,
                       help="cache specs of the end-to-end and decode-step tables, each eager and compiled "
                       "(default: bench.BenchConfig)")
    bench.add_argument("--attentions", default="sdpa",
                       help="the attention the methods' rows of the e2e and decode parts run under: sdpa (the model "
                       "as loaded, no attention argument), eager, hf_kvcache; several run each")
    bench.add_argument("--repeats", type=int, default=7, help="interleaved rounds of the batch1 part")
    bench.add_argument("--prefill-batches", default="1,16", help="batches of the prefill part")
    bench.add_argument("--turn-tokens", type=int, default=2048,
                       help="tokens of the next turn the prefill part times over the prefilled history")
    bench.add_argument("--prefill-pad", type=int, default=0,
                       help="left padding of every other row of the prefill part's batch, in tokens (a batch of "
                            "prompts of unequal lengths; every cache, DynamicCache's too, gets the same mask)")
    bench.add_argument("--compile-arch", type=int, default=90,
                       help="the CUDA architecture the compiles and sass parts compile for (default 90: Hopper)")
    bench.add_argument("--warm-up", action="store_true",
                       help="the compiles part runs hf_kvcache.warm_up (parallel compiles) before the calls")
    bench.add_argument("--serving-requests", type=int, default=128, help="requests of the serving part")
    bench.add_argument("--serving-prompt", default="1024,4096", help="shortest,longest prompt tokens (serving)")
    bench.add_argument("--serving-new-tokens", type=int, default=128, help="new tokens a request (serving)")
    bench.add_argument("--serving-budget-gb", type=float, default=2.0, help="pages' memory of the serving part")
    bench.add_argument("--serving-methods", default="fp8-e4m3,turboquant-4,kivi-2", help="specs of the serving part")
    bench.add_argument("--json", default=None, metavar="PATH", help="also write every figure to this JSON file")
    return parser


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as error:
        raise UsageError(f"{flag}: expected comma-separated integers, got {text!r}") from error


def _float_list(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as error:
        raise UsageError(f"{flag}: expected comma-separated numbers, got {text!r}") from error


def _protocols(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys("strict" if p == "paper" else p for p in (x.strip() for x in text.split(",")) if p))
    bad = [p for p in names if p not in PROTOCOLS]
    if bad or not names:
        raise UsageError(f"--protocol takes {', '.join(PROTOCOLS)} (comma-separated), got {text!r}")
    return names


def _retrieval_tasks(text: str) -> tuple[str, ...]:
    from .eval.retrieval import TASKS

    names = TASKS if text.strip() == "all" else tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in TASKS]
    if bad:
        raise UsageError(f"--retrieval takes {', '.join(TASKS)} or all, got {text!r}")
    return names


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """The resolved config: explicit options over `--quick` over the defaults."""
    values: dict = dict(QUICK) if args.quick else {}
    values.update(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        passkey=not args.no_passkey,
        progress=not args.no_progress,
    )
    if args.methods is not None:
        values["methods"] = tuple(split_methods(args.methods))
    if args.protocol is not None:
        values["protocols"] = _protocols(args.protocol)
    for name in ("context", "chunk", "windows", "skip", "text", "decode_tokens", "batch_size", "attention", "backend",
                 "retrieval_samples", "retrieval_batch"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    for name in ("prefill", "passkey_lengths", "retrieval_lengths"):
        if getattr(args, name) is not None:
            values[name] = _int_list(getattr(args, name), "--" + name.replace("_", "-"))
    if args.passkey_depths is not None:
        values["passkey_depths"] = _float_list(args.passkey_depths, "--passkey-depths")
    if args.passkey_trials is not None:
        values["passkey_trials"] = args.passkey_trials
    if args.retrieval is not None:
        values["retrieval"] = _retrieval_tasks(args.retrieval)
    cfg = EvalConfig(**values)
    for name in ("context", "chunk", "windows", "decode_tokens", "retrieval_samples", "retrieval_batch"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    if cfg.batch_size is not None and cfg.batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {cfg.batch_size}")
    if not cfg.prefill or any(p < 1 for p in cfg.prefill):
        raise UsageError(f"--prefill takes positive token counts, got {cfg.prefill}")
    if not 0 <= cfg.skip < cfg.context:
        raise UsageError(f"--skip must be in [0, context), got {cfg.skip}")
    if cfg.passkey and not (cfg.passkey_lengths and cfg.passkey_depths):
        raise UsageError("passkey needs at least one length and one depth (or pass --no-passkey)")
    if any(not 0 <= d <= 1 for d in cfg.passkey_depths):
        raise UsageError(f"--passkey-depths are fractions in [0, 1], got {cfg.passkey_depths}")
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-kvcache`; returns the exit status (0 ok, 2 usage error)."""
    raw = sys.argv[1:] if argv is None else list(argv)
    if raw[:1] == ["lm-eval"]:  # everything after it is lm-eval's own command line
        from .eval import lm_eval

        return lm_eval.cli(raw[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    full_argv = ["hf-kvcache", *(sys.argv[1:] if argv is None else argv)]
    if args.command == "bench":
        return _bench(args)
    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "serve":
        from .serve import main as serve

        return serve(args)
    if args.command == "report":
        return _report(args, full_argv)
    try:
        cfg = config_from_args(args)
        if args.threads is not None:
            if args.threads < 1:
                raise UsageError(f"--threads must be positive, got {args.threads}")
            import torch

            torch.set_num_threads(args.threads)
        if args.command in ("compare", "eval"):
            path, metrics = run_eval(cfg, command=args.command, out=args.out, argv=full_argv)
    except UsageError as error:
        print(f"hf-kvcache: error: {error}", file=sys.stderr)
        return 2
    from .eval.report import TABLE_NOTE, format_table, table_rows

    print(format_table(table_rows(metrics)))
    print(f"\n{TABLE_NOTE}\nresults: {path}")
    return 0


def calibration_ids(tokenizer, text: str | None, tokens: int):
    """`(1, tokens)` token ids to calibrate on, and a name for them: from the middle of the text (for the dev
    corpus, disjoint from the evaluation windows, which start at its beginning and spread evenly), or the whole
    text when it is shorter."""
    from .eval.corpus import dev_text, load_text, tokenize_corpus

    ids = tokenize_corpus(tokenizer, dev_text() if text is None else load_text(text))
    if tokens < 2:
        raise UsageError(f"--tokens must be at least 2, got {tokens}")
    start = max(0, (len(ids) - tokens) // 2)
    part = ids[start : start + tokens]
    name = "dev corpus (pydoc_data.topics)" if text is None else str(text)
    return part[None], f"{name}, tokens {start}..{start + len(part)} of {len(ids)}"


def _report(args: argparse.Namespace, argv: list[str]) -> int:
    from .eval import report

    if args.readme is not None:
        return _report_readme(args)
    if not args.dirs:
        print("hf-kvcache: error: give results directories, or --readme README.md", file=sys.stderr)
        return 2
    missing = [d for d in args.dirs if not (Path(d) / "metrics.json").is_file()]
    if missing:
        print(f"hf-kvcache: error: not a results directory (no metrics.json): {', '.join(missing)}", file=sys.stderr)
        return 2
    path = report.write_report(args.dirs, args.out, protocol=args.protocol, argv=argv)
    print((path / "table.md").read_text())
    print(f"report: {path}")
    return 0


def _report_readme(args: argparse.Namespace) -> int:
    from .eval import report

    if args.dirs:
        print("hf-kvcache: error: --readme renders from the files the sources name: give no DIR", file=sys.stderr)
        return 2
    try:
        changed = report.update_readme(args.readme, args.sources, check=args.check)
    except (OSError, ValueError, KeyError) as error:
        print(f"hf-kvcache: error: {error}", file=sys.stderr)
        return 2
    if args.check:
        for path in changed:
            print(f"out of date: {path} (run hf-kvcache report --readme {args.readme})")
        return 1 if changed else 0
    for path in changed:
        print(f"written: {path}")
    return 0


def _add_plan_parser(sub) -> None:
    from .planner import DEFAULT_MAX_LOSS, DEFAULT_RESERVE, GPUS, SHIPPED_MODELS, WEIGHT_BYTES

    plan = sub.add_parser(
        "plan",
        help="capacity: bytes per token, KV GB per sequence and sequences that fit per method, and a recommendation",
        description="Counts every tensor each method's cache holds on the model's config (no weights needed), its "
        "layout extrapolated exactly to the context; fits sequences next to the weights in the GPU's memory and "
        "recommends a preset: the fewest bytes within --max-loss ΔNLL, and the fastest, citing the accuracy and "
        "speed this project measured on a GPU.",
    )
    plan.add_argument("--model", default=None, help=f"a shipped shape ({', '.join(SHIPPED_MODELS)}; default "
                      "smollm2-135m), a local config.json or a local model directory")
    plan.add_argument("--context", default=None, help="tokens per sequence: 131072, 128k, 32K (default: the "
                      "model's max_position_embeddings)")
    plan.add_argument("--gpu-memory", default=None, help="80GiB, 80GB, 141G (default: the GPU's)")
    plan.add_argument("--gpu", default=None, help=f"{'|'.join(GPUS)} (default: the visible CUDA device)")
    plan.add_argument("--batch", type=int, default=1, help="concurrent sequences wanted (default 1)")
    plan.add_argument("--weights-dtype", default="bf16", choices=tuple(WEIGHT_BYTES), help="default bf16")
    plan.add_argument("--reserve", type=float, default=DEFAULT_RESERVE,
                      help=f"share of GPU memory kept for activations and the runtime (default {DEFAULT_RESERVE})")
    plan.add_argument("--methods", nargs="+", default=None, metavar="SPEC", help="cache specs (default: every preset)")
    plan.add_argument("--max-loss", type=float, default=DEFAULT_MAX_LOSS, metavar="PCT",
                      help="the ΔNLL (%%) on the measured decode protocol a recommended preset may cost "
                      f"(default {DEFAULT_MAX_LOSS})")
    plan.add_argument("--json", default=None, metavar="PATH", help="also write the plan as JSON to this file")


def _plan(args: argparse.Namespace) -> int:
    import json

    from .planner import plan

    try:
        result = plan(args.model, context=args.context, gpu_memory=args.gpu_memory, gpu=args.gpu, batch=args.batch,
                      weights_dtype=args.weights_dtype, reserve=args.reserve, max_loss=args.max_loss,
                      methods=None if args.methods is None else split_methods(args.methods))
    except ValueError as error:
        print(f"hf-kvcache: error: {error}", file=sys.stderr)
        return 2
    print(result.format())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    import torch

    from . import calibration
    from .models import load_model

    try:
        bits = _int_list(args.bits, "--bits")
        if args.threads is not None:
            if args.threads < 1:
                raise UsageError(f"--threads must be positive, got {args.threads}")
            torch.set_num_threads(args.threads)
        if args.chunk < 2:
            raise UsageError(f"--chunk must be at least 2 tokens, got {args.chunk}")
        model, tokenizer = load_model(args.model, device=args.device, dtype=torch.float32)
        ids, text = calibration_ids(tokenizer, args.text, args.tokens)
        cal = calibration.calibrate(model, ids, text=text, bits=bits, outlier_fraction=args.outlier_fraction,
                                    weighting=args.weighting, chunk=args.chunk, progress=not args.no_progress)
    except (UsageError, ValueError) as error:
        print(f"hf-kvcache: error: {error}", file=sys.stderr)
        return 2
    path = calibration.save(cal, args.out or calibration.default_path(model.config))
    print(f"calibration of {cal.metadata['tokens']} tokens ({text}) in {cal.metadata['seconds']} s: {path}")
    if args.vllm_out:
        print(f"vLLM FP8 scales: {calibration.export_vllm(cal, args.vllm_out)}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import json

    import torch

    from .bench import CPU_PARTS, BenchConfig, run

    try:
        if args.parts is None:
            parts = ("multi_gpu",) if args.multi_gpu else ("kernel", "e2e", "capacity")
        else:
            parts = tuple(p for p in args.parts.split(",") if p) + (("multi_gpu",) if args.multi_gpu else ())
        known = ("kernel", "e2e", "decode", "batch1", "prefill", "capacity", "sweep", "multi_gpu", "compiles",
                 "first_call", "sass", "serving", "pages")
        unknown = set(parts) - set(known)
        if unknown:
            raise UsageError(f"--parts: unknown part(s) {sorted(unknown)}; choose from {', '.join(known)}")
        if "multi_gpu" in parts and torch.cuda.device_count() < 2:
            raise UsageError(f"--multi-gpu needs at least 2 CUDA GPUs, {torch.cuda.device_count()} visible")
        cfg = BenchConfig(
            parts=parts,
            batches=_int_list(args.batches, "--batches"),
            contexts=_int_list(args.contexts, "--contexts"),
            e2e_batch=args.e2e_batch,
            e2e_context=args.e2e_context,
            e2e_layers=args.e2e_layers,
            e2e_new_tokens=args.new_tokens,
            e2e_prefill_chunk=args.prefill_chunk or None,
            e2e_chunk_all=args.prefill_chunk_all,
            capacity_budget_gb=args.budget_gb,
            multi_gpu_layers=args.multi_gpu_layers,
            decode_batches=_int_list(args.decode_batches, "--decode-batches"),
            e2e_modes=tuple(m for m in args.e2e_modes.split(",") if m),
            attentions=tuple(a for a in args.attentions.split(",") if a),
            prefill_batches=_int_list(args.prefill_batches, "--prefill-batches"),
            prefill_turn=args.turn_tokens,
            prefill_pad=args.prefill_pad,
            compile_arch=args.compile_arch,
            compile_warm_up=args.warm_up,
            repeats=args.repeats,
            serving_requests=args.serving_requests,
            serving_prompt=_int_list(args.serving_prompt, "--serving-prompt"),
            serving_new_tokens=args.serving_new_tokens,
            serving_budget_gb=args.serving_budget_gb,
            serving_methods=tuple(split_methods([args.serving_methods])),
        )
        if len(cfg.serving_prompt) != 2:
            raise UsageError(f"--serving-prompt: shortest,longest (got {args.serving_prompt!r})")
        if not cfg.attentions or set(cfg.attentions) - {"sdpa", "eager", "hf_kvcache"}:
            raise UsageError(f"--attentions: choose from sdpa, eager, hf_kvcache (got {args.attentions!r})")
        if not cfg.e2e_modes or set(cfg.e2e_modes) - {"eager", "compiled"}:
            raise UsageError(f"--e2e-modes: choose from eager, compiled (got {args.e2e_modes!r})")
        if args.new_tokens < 3 or args.prefill_chunk < 0:
            raise UsageError(f"--new-tokens must be at least 3 (got {args.new_tokens}) and --prefill-chunk at least "
                             f"0 (got {args.prefill_chunk})")
        if args.prefill_chunk_all and not args.prefill_chunk:
            raise UsageError("--prefill-chunk-all chunks every call by --prefill-chunk: give it a size (not 0)")
        if args.decode_methods is not None:
            cfg.decode_methods = tuple(split_methods([args.decode_methods]))
        if args.methods is not None:
            cfg.methods = tuple(split_methods([args.methods]))
        if not torch.cuda.is_available() and set(parts) - set(CPU_PARTS):
            raise UsageError("bench measures GPU speed and needs a CUDA device (none is visible); only --parts "
                             "compiles, sass and pages run without one")
    except UsageError as error:
        print(f"hf-kvcache: error: {error}", file=sys.stderr)
        return 2
    results = run(cfg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

