"""Results directories, the comparison table and the perplexity-vs-memory plot.

A run writes one immutable directory under `--out`, named from its config
(`compare__smollm2-135m__ppl1024x4-passkey__20261129-101500`; a clash gets a `-2`, `-3`... suffix, so a
rerun never overwrites), holding

    metrics.json      what was measured, per method (see `METRICS` below)
    config.json       the resolved config: specs, sizes, model, versions, date, command line
    table.md          `format_table(table_rows(metrics))`
    ppl_vs_bytes.png  `plot_ppl_vs_bytes(table_rows(metrics), path)`

`hf-kvcache report --readme README.md` renders the README's preset table and plot, and the figures `hf-kvcache plan`
cites, from the result files `docs/readme_sources.json` names (`update_readme`, `hf_kvcache.eval.figures`).

The table and plot functions take rows, not directories, so a report over several runs can concatenate
`table_rows(load_results(d)[0])` of each and reuse them. Deltas are always taken against the baseline of
the same run (`metrics["baseline"]`), never across runs.

METRICS: `{"model": str, "baseline": spec, "methods": [{"spec", "description", "memory": memory_summary,
"decode": {str(prefill): decode_perplexity result}, "strict": strict_perplexity result, "stream":
streaming_perplexity result, "passkey": passkey_grid result, "retrieval": retrieval_grid result}]}`; a method lacks
the keys of what was not run. Runs made before the decode protocol hold "paper" for what is now "strict".
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path

from .figures import load_figures, measured_figures

__all__ = [
    "TABLE_NOTE",
    "create_results_dir",
    "environment",
    "fill_results",
    "format_table",
    "headline",
    "load_results",
    "plot_ppl_vs_bytes",
    "plot_quality_vs_bytes",
    "presets_table",
    "readme_blocks",
    "render_readme",
    "report_rows",
    "results_dir_name",
    "safe_label",
    "table_rows",
    "update_readme",
    "write_report",
    "write_results",
]


TABLE_NOTE = (
    "vs 16-bit: bytes the cache holds per token / (2 bytes x K,V x layers x kv_heads x head_dim); "
    "the baseline `none` keeps the model dtype, so a float32 model's reads 2.000x. "
    "decode P: a prefill of P tokens through the cache, then tokens decoded one at a time (teacher-forced), as "
    "generate uses the cache; ΔNLL: change of their mean NLL against `none` on the same windows, ± the 95% interval "
    "over windows; KL: mean KL(none || method) of the next-token distributions, nats; top-1: share of positions "
    "where the method's most likely token is `none`'s. strict: every K/V quantized before attention; stream: chunks "
    "that attend exactly to themselves (flatters every cache without an exact window). Their Δ% is of perplexity."
)


def safe_label(text: str) -> str:
    """`text` made safe as one part of a directory name:
    `int4-g32:sink_tokens=4` -> `int4-g32_sink_tokens-4`."""
    label = re.sub(r"[^A-Za-z0-9.+-]+", "_", text.replace("=", "-")).strip("._")
    return label[:80] or "x"


def results_dir_name(
    command: str, model: str, tasks: str, methods: list[str] | None = None, when: _dt.datetime | None = None
) -> str:
    """`command[__methods]__model__tasks__YYYYmmdd-HHMMSS`; `methods` joined by `+` when given."""
    stamp = (when or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    parts = [command]
    if methods:
        parts.append("+".join(safe_label(m) for m in methods))
    parts += [safe_label(model), safe_label(tasks), stamp]
    return "__".join(parts)


def create_results_dir(out: str | os.PathLike, name: str) -> Path:
    """Create `out/name` (or `out/name-2`, `-3`, ... if taken) and return it. Creation is the atomic
    `mkdir`, so two runs started in the same second still get two directories."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = out / (name if n == 1 else f"{name}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"no free results directory name for {name!r} under {out}")


def environment(argv: list[str] | None = None) -> dict:
    """Versions of torch / transformers / hf_kvcache, the date and the command line, for config.json."""
    import torch
    import transformers

    from .. import __version__

    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command_line": list(sys.argv if argv is None else argv),
        "versions": {
            "hf_kvcache": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        },
        "torch_threads": torch.get_num_threads(),
    }


def _finite(value):
    """JSON-safe: NaN and infinities become None (strict JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(_finite(data), indent=2, allow_nan=False) + "\n")


def write_results(out: str | os.PathLike, name: str, metrics: dict, config: dict) -> Path:
    """Write a new results directory (see the module docstring) and return its path."""
    path = create_results_dir(out, name)
    fill_results(path, metrics, config)
    return path


def fill_results(path: Path, metrics: dict, config: dict, *, plot: bool = True) -> None:
    """(Re)write the files of a results directory this run created: a long run saves what it measured after each
    method (`plot=False`), so that an interruption keeps it."""
    _write_json(path / "metrics.json", metrics)
    _write_json(path / "config.json", config)
    rows = table_rows(metrics)
    (path / "table.md").write_text(format_table(rows) + "\n\n" + TABLE_NOTE + "\n")
    if plot:
        plot_ppl_vs_bytes(rows, path / "ppl_vs_bytes.png", title=f"{metrics.get('model', '')}")


def load_results(path: str | os.PathLike) -> tuple[dict, dict]:
    """`(metrics, config)` of a results directory."""
    path = Path(path)
    return json.loads((path / "metrics.json").read_text()), json.loads((path / "config.json").read_text())


def _delta_pct(value, base):
    if value is None or base is None or not math.isfinite(value) or not math.isfinite(base) or base == 0:
        return None
    return 100.0 * (value - base) / base


def table_rows(metrics: dict) -> list[dict]:
    """One row per method: `{"model", "method", "description", "bytes_per_token", "bytes_ratio", "decode": {P:
    {"nll", "delta_pct", "half_width", "kl", "top1"}}, "strict_ppl", "strict_delta_pct", "stream_ppl",
    "stream_delta_pct", "passkey", "passkey_by_length", "retrieval": {(task, length): accuracy}}` (None or empty
    where not measured); deltas in % against the run's own baseline."""
    methods = metrics.get("methods", [])
    baseline = next((m for m in methods if m["spec"] == metrics.get("baseline")), None)

    def ppl(entry, protocol):
        result = (entry or {}).get(protocol)
        if result is None and protocol == "strict":
            result = (entry or {}).get("paper")  # runs made before the decode protocol
        return None if result is None else result.get("ppl")

    rows = []
    for entry in methods:
        memory, passkey = entry.get("memory") or {}, entry.get("passkey") or {}
        row = {
            "model": metrics.get("model"),
            "method": entry["spec"],
            "description": entry.get("description", ""),
            "bytes_per_token": memory.get("bytes_per_token"),
            "bytes_ratio": memory.get("ratio"),
            "passkey": passkey.get("accuracy"),
            "passkey_by_length": passkey.get("by_length", {}),
            "decode": {},
            "retrieval": {(c["task"], str(c["length"])): c["accuracy"]
                          for c in (entry.get("retrieval") or {}).get("cells", [])},
        }
        for p, result in (entry.get("decode") or {}).items():
            interval = result.get("delta_interval") or {}
            row["decode"][p] = {
                "nll": result.get("nll"),
                "delta_pct": 0.0 if entry is baseline else result.get("delta_nll_pct"),
                "half_width": interval.get("half_width"),
                "kl": 0.0 if entry is baseline else result.get("kl"),
                "top1": 1.0 if entry is baseline else result.get("top1"),
            }
        for protocol in ("strict", "stream"):
            row[f"{protocol}_ppl"] = ppl(entry, protocol)
            row[f"{protocol}_delta_pct"] = _delta_pct(row[f"{protocol}_ppl"], ppl(baseline, protocol))
        rows.append(row)
    return rows


def _length_label(length: str) -> str:
    n = int(length)
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _fmt(value, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec) + suffix


def _delta_cell(cell: dict | None) -> str:
    if not cell or cell.get("delta_pct") is None:
        return "-"
    half = cell.get("half_width")
    return f"{cell['delta_pct']:+.2f}" + (f" ± {half:.2f}" if half else "")


def format_table(rows: list[dict], *, with_model: bool | None = None) -> str:
    """A markdown table of `rows` (from `table_rows`, possibly of several runs): bytes, then for each decode
    prefill length present its ΔNLL (± interval), KL and top-1, then the strict and stream protocols' perplexity
    change and passkey and retrieval accuracy where measured. A model column appears when the rows span models."""
    if with_model is None:
        with_model = len({r.get("model") for r in rows}) > 1
    prefills = sorted({p for r in rows for p in r.get("decode", {})}, key=int)
    protocols = [p for p in ("strict", "stream") if any(r.get(f"{p}_ppl") is not None for r in rows)]
    lengths = sorted({L for r in rows for L in r.get("passkey_by_length", {})}, key=int)
    cells = sorted({c for r in rows for c in r.get("retrieval", {})}, key=lambda c: (c[0], int(c[1])))
    header = (["model"] if with_model else []) + ["method", "bytes/token", "vs 16-bit"]
    for p in prefills:
        header += [f"decode {_length_label(p)}: ΔNLL %", "KL", "top-1"]
    header += [f"{p} Δ%" for p in protocols]
    header += [f"passkey {_length_label(L)}" for L in lengths]
    header += [f"{task} {_length_label(L)}" for task, L in cells]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        line = ([str(r.get("model") or "-")] if with_model else []) + [
            f"`{r['method']}`", _fmt(r.get("bytes_per_token"), ".0f"), _fmt(r.get("bytes_ratio"), ".3f", "x")]
        for p in prefills:
            cell = r.get("decode", {}).get(p)
            line += [_delta_cell(cell), _fmt((cell or {}).get("kl"), ".4f"), _fmt((cell or {}).get("top1"), ".1%")]
        line += [_fmt(r.get(f"{p}_delta_pct"), "+.2f") for p in protocols]
        line += [_fmt(r.get("passkey_by_length", {}).get(L), ".0%") for L in lengths]
        line += [_fmt(r.get("retrieval", {}).get(c), ".0%") for c in cells]
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def headline(row: dict) -> tuple[str, float | None]:
    """(protocol label, quality change in %) that figures plot for a row: the decode protocol at its longest prefill
    when measured, else strict, else stream."""
    if row.get("decode"):
        p = max(row["decode"], key=int)
        return f"decode {_length_label(p)} ΔNLL", row["decode"][p].get("delta_pct")
    for protocol in ("strict", "stream"):
        if row.get(f"{protocol}_delta_pct") is not None:
            return f"{protocol} perplexity Δ", row[f"{protocol}_delta_pct"]
    return "", None


def _finish(fig, ax, path, ylabel: str, title: str, legend_loc: str) -> None:
    """The axes both figures share (symlog perplexity change against bytes per token), then save."""
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("bytes per token / 16-bit cache")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc=legend_loc)
    fig.tight_layout()
    fig.savefig(path)


def plot_ppl_vs_bytes(rows: list[dict], path: str | os.PathLike, *, title: str = "") -> Path:
    """Scatter of the quality change (%) against bytes per token / 16-bit cache, one labelled point per method:
    the decode protocol's ΔNLL at the longest prefill (filled), the strict protocol's perplexity change (hollow).
    The y axis is symlog, since fp8 moves the loss by hundredths of a percent and int2 by tens."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.0), dpi=120)
    try:
        ax.axhline(0.0, color="0.6", lw=0.8)
        ax.axvline(1.0, color="0.6", lw=0.8, ls="--", label="16-bit cache")
        plotted = set()
        for r in rows:
            x = r.get("bytes_ratio")
            if x is None:
                continue
            label, y = headline(r)
            points = [(label, y, "C0")]
            if r.get("decode") and r.get("strict_delta_pct") is not None:
                points.append(("strict perplexity Δ", r["strict_delta_pct"], "none"))
            for name, value, face in points:
                if value is None:
                    continue
                ax.scatter([x], [value], s=42, facecolors=face, edgecolors="C0", zorder=3,
                           label=None if name in plotted else name)
                plotted.add(name)
            if y is not None:
                many = len({q.get("model") for q in rows}) > 1
                ax.annotate(f"{r['method']} ({r['model']})" if many and r.get("model") else r["method"], (x, y),
                            textcoords="offset points", xytext=(5, 5), fontsize=8)
        _finish(fig, ax, path, "change vs the unquantized baseline `none` (%)",
                f"quality vs KV-cache memory {('- ' + title) if title else ''}".strip(), "best")
    finally:
        plt.close(fig)
    return Path(path)


def _family(spec: str) -> str:
    """A method's family for the report's lines: the preset's name without its width (`int4-g32` -> `int`,
    `rotated-3` -> `rotated`, `kvquant-2` -> `kvquant`, `fp8-e4m3` -> `fp8`)."""
    name = spec.split(":", 1)[0]
    return "fp8" if name.startswith("fp8") else re.match(r"[a-z]+", name).group(0)


def report_rows(dirs: list[str | os.PathLike]) -> list[dict]:
    """`table_rows` of every results directory in `dirs`, in order, each row with its `run` (the directory's
    name); the baseline `none` is kept once (the first run's), since every delta is already per run."""
    rows, seen_baseline = [], False
    for d in dirs:
        metrics, _ = load_results(d)
        for row in table_rows(metrics):
            if row["method"] == metrics.get("baseline"):
                if seen_baseline:
                    continue
                seen_baseline = True
            rows.append({**row, "run": Path(d).name})
    return rows


def plot_quality_vs_bytes(rows: list[dict], path: str | os.PathLike, *, protocol: str = "decode",
                          title: str = "") -> Path:
    """One line per method family (the presets without overrides, joined in order of bytes: `int4-g64`,
    `int4-g32`, ... or `rotated-4`, `-3`, `-2`), the quality change (%, symlog: `protocol` "decode" plots each
    row's `headline`, "strict" or "stream" that protocol's perplexity change) against bytes per token / 16-bit
    cache; specs with overrides are unlabelled hollow markers (the table names them)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.0, 5.5), dpi=120)
    try:
        ax.axhline(0.0, color="0.6", lw=0.8)
        families: dict[str, list[tuple[float, float, str, float]]] = {}
        extras = []
        for r in rows:
            x = r.get("bytes_ratio")
            y = headline(r)[1] if protocol == "decode" else r.get(f"{protocol}_delta_pct")
            if x is None or y is None or r["method"] == "none":
                continue
            cells = r.get("decode") or {}
            half = (cells[max(cells, key=int)].get("half_width") if protocol == "decode" and cells else None) or 0.0
            (extras if ":" in r["method"] else families.setdefault(_family(r["method"]), [])).append(
                (x, y, r["method"], half))
        for i, (family, points) in enumerate(sorted(families.items())):
            points.sort()
            color = f"C{i % 10}"
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            ax.plot(xs, ys, "-o", color=color, ms=5, label=family)
            if any(p[3] for p in points):  # the 95% interval over windows
                ax.errorbar(xs, ys, yerr=[p[3] for p in points], fmt="none", ecolor=color, elinewidth=0.8, capsize=2)
            for x, y, name, _ in points:
                ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
        if extras:  # ablations and variants: unlabelled here (they would crowd the lines), named in the table
            ax.scatter([e[0] for e in extras], [e[1] for e in extras], s=30, facecolors="none", edgecolors="0.4",
                       zorder=3, label="specs with overrides (see the table)")
        ylabel = "decode ΔNLL (longest prefill)" if protocol == "decode" else f"{protocol} perplexity change"
        _finish(fig, ax, path, f"{ylabel} vs `none` of the same run (%)",
                f"quality vs KV-cache memory {('- ' + title) if title else ''}".strip(), "upper right")
    finally:
        plt.close(fig)
    return Path(path)


def write_report(dirs: list[str | os.PathLike], out: str | os.PathLike, *, protocol: str = "decode",
                 argv: list[str] | None = None) -> Path:
    """Merge results directories into a new one (`report__<n>runs__<date>`): `table.md` (every run's methods,
    deltas against each run's own baseline, and the list of runs), `quality_vs_bytes.png`
    (`plot_quality_vs_bytes`) and `config.json` (the runs, the command line, versions)."""
    if not dirs:
        raise ValueError("give at least one results directory")
    rows = report_rows(dirs)
    models = sorted({str(r.get("model")) for r in rows})
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = create_results_dir(out, f"report__{len(dirs)}runs__{safe_label('+'.join(models))}__{stamp}")
    sources = "\n".join(f"- `{Path(d).name}`" for d in dirs)
    (path / "table.md").write_text(f"{format_table(rows)}\n\n{TABLE_NOTE}\n\nRuns:\n{sources}\n")
    plot_quality_vs_bytes(rows, path / "quality_vs_bytes.png", protocol=protocol, title=", ".join(models))
    _write_json(path / "config.json", {"command": "report", "runs": [str(d) for d in dirs], "protocol": protocol,
                                       **environment(argv)})
    return path


# ------------------------------------------------------------------------------------------------ the README's figures

# A block the README leaves to `update_readme`: `<!-- hf-kvcache:table presets -->` ... `<!-- /hf-kvcache:table -->`
# (likewise `plot`); everything between the markers is rewritten.
_BLOCK = re.compile(r"(<!-- hf-kvcache:(?P<kind>table|plot) (?P<name>[\w-]+) -->\n)(?P<body>.*?)"
                    r"(<!-- /hf-kvcache:(?P=kind) -->)", re.DOTALL)


def _files(paths: dict[str, list[str]]) -> str:
    return "; ".join(f"`{path}` ({', '.join(presets)})" for path, presets in paths.items())


def _speed_cell(points: list[dict], column: dict) -> str:
    for p in points:
        if p["what"] == column["what"] and (p["batch"], p["context"]) == (column["batch"], column["context"]):
            return f"x{p['vs_dynamic_chunked' if p['what'] == 'prefill' else 'vs_dynamic']:.2f}"
    return "-"


def _column_label(column: dict) -> str:
    size = f"batch {column['batch']} x {_length_label(str(column['context']))}"
    return f"decode, {size}" if column["what"] == "decode" else f"prefill, {size}"


def presets_table(figures) -> str:
    """The README's preset table (`figures`: `hf_kvcache.eval.figures.load_figures`), then what each column is, where
    it was measured and from which file."""
    acc, speed, size = figures.sources["accuracy"], figures.sources["speed"], figures.sources["bytes"]
    header = ["preset", "bytes vs bf16", f"ΔNLL % (P={acc['prefill']})", "KL", "top-1",
              *(_column_label(c) for c in figures.columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for p in figures.presets:
        a = figures.accuracy[p]
        cell = {"delta_pct": a["delta_pct"], "half_width": a["half_width"]}
        lines.append("| " + " | ".join([
            f"`{p}`", f"{figures.bytes[p]:.3f}x", _delta_cell(cell), f"{a['kl']:.4f}", f"{a['top1']:.1%}",
            *(_speed_cell(figures.speed.get(p, []), c) for c in figures.columns)]) + " |")
    by_file: dict[str, list[str]] = {}
    for p in figures.presets:
        spec = figures.accuracy[p]["spec"]
        by_file.setdefault(figures.accuracy[p]["source"], []).append(f"`{p}`" + ("" if spec == p else f" as `{spec}`"))
    speed_files: dict[str, list[str]] = {}
    for c in figures.columns:
        speed_files.setdefault(c["path"], []).append(_column_label(c))
    e2e = next((c for c in figures.columns if c.get("layers")), None)
    model = (f"{e2e['layers']} decoder layers of the Llama-3-8B shape with random weights, "
             + (f"{e2e['new_tokens']} new tokens, " if e2e.get("new_tokens") else "") if e2e else "")
    # `--parts decode` times steps over caches filled with random K/V, `--parts e2e` the median step after a prompt
    step = ("the step of `generate` continuing a cache filled with random K/V to the context (`hf-kvcache bench "
            "--parts decode`: a 40-token call less an 8-token one, over 32 steps)"
            if any(c.get("section") == "decode" for c in figures.columns) else "the median step")
    rounds = next((c for c in figures.columns if c.get("section") == "batch1"), None)
    if rounds:  # `--parts batch1`: the same steps, interleaved
        step += (f"; at batch 1 the median of {rounds.get('repeats')} rounds that time every cache in turn, "
                 "DynamicCache's among them (`--parts batch1`)")
    notes = [
        (f"**Accuracy**: the decode protocol ([docs/evaluation.md](docs/evaluation.md)): a prefill of {acc['prefill']} "
         f"tokens through the cache, then {acc['decode_tokens']} tokens decoded one at a time, on {acc['windows']} "
         f"windows of the dev corpus; {acc['model']} on an {acc['platform']} in {acc['dtype']}, attention "
         f"`{acc['attention']}` (the fused kernels). ΔNLL: change of the decoded tokens' mean NLL against the 16-bit "
         "cache on the same windows, ± the 95% interval over windows; KL: mean KL(16-bit || cache) of the next-token "
         f"distributions, nats; top-1: agreement of the most likely token. From {_files(by_file)}."),
        (f"**Bytes**: every tensor one sequence's cache holds after a {size['context']}-token prompt (its tokens, the "
         "capacity left unfilled, rotations and codebooks), against a bf16 cache: `hf-kvcache plan --model "
         f"{size['model']} --context {size['context']}` ({size['dtype']}, computed, not measured on a GPU)."),
    ]
    if figures.columns:
        notes.append(
            f"**Speed**: `model.generate` as users call it on an {speed['platform']} in {speed['dtype']}: {model}"
            f"a 32k-token context, {speed['mode']} (no `max_cache_len`)"
            + (f", the caches under attention `{speed['attention']}`" if speed.get("attention") else "")
            + (" (the model as loaded, no attention argument)" if speed.get("attention") == "sdpa" else "")
            + "; DynamicCache's time divided by the cache's, "
            f"measured in the same run (x2.00: twice as fast); decode: {step}; prefill: the prompt in chunks "
            f"(`prefill_chunk_size`) against DynamicCache chunked alike. From {_files(speed_files)}.")
    if figures.missing:
        notes.append("Not measured yet: " + "; ".join(figures.missing) + ".")
    return "\n".join(lines) + "\n\n" + "\n\n".join(notes)


def quantizedcache_table(figures) -> str:
    """The README's comparison with transformers' `QuantizedCache`: its backends beside the presets of about their
    bytes, every figure from the one run `docs/readme_sources.json` names (`quantizedcache`)."""
    from .compared import is_compared

    qc, found, columns = figures.sources["quantizedcache"], figures.compared["figures"], figures.compared["columns"]
    header = ["cache", "bytes vs bf16", f"ΔNLL % (P={qc['prefill']})", "KL", "top-1",
              *(_column_label(c) for c in columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for spec in (spec for row in qc["rows"] for spec in row):
        a = found[spec]
        lines.append("| " + " | ".join([
            f"`{spec}`" + (" (transformers)" if is_compared(spec) else ""), f"{a['bytes']:.3f}x",
            _delta_cell({"delta_pct": a["delta_pct"], "half_width": a["half_width"]}), f"{a['kl']:.4f}",
            f"{a['top1']:.1%}", *(_speed_cell(figures.compared["speed"].get(spec, []), c) for c in columns)]) + " |")
    where = ("the CPU (the presets through the PyTorch reference, which reads the bytes the kernels read)"
             if qc["platform"] == "cpu" else f"an {qc['platform']}")
    notes = [f"One run of the decode protocol (the glossary): a prefill of {qc['prefill']} tokens, "
             f"{qc['decode_tokens']} decoded, {qc['windows']} windows of the dev corpus; {qc['model']} on "
             f"{where} in {qc['dtype']}: `{figures.compared['command']}`. Bytes: what each cache holds at "
             "the end, against a 16-bit cache (transformers' caches: their quantized tensors, codes, scales and "
             f"shifts, and the 16-bit residual; the presets: `nbytes()`). From `{qc['path']}`."]
    if columns:
        notes.append(f"Speed: DynamicCache's decode step divided by the cache's, in the same run, on an "
                     f"{qc['speed']['platform']} in {qc['speed']['dtype']}; from "
                     + ", ".join(sorted({f"`{c['path']}`" for c in columns})) + ".")
    else:
        notes.append("Speed: not measured on a GPU yet (`scripts/gpu_next.sh C` runs it).")
    return "\n".join(lines) + "\n\n" + " ".join(notes)


def figure_rows(figures) -> list[dict]:
    """The presets as `table_rows` gives them (bytes ratio, the decode cell at the config's prefill), for the plot."""
    prefill = str(figures.sources["accuracy"]["prefill"])
    return [{"method": p, "model": figures.sources["accuracy"]["model"], "bytes_ratio": figures.bytes[p],
             "decode": {prefill: figures.accuracy[p]}} for p in figures.presets]


def readme_blocks(figures) -> dict[str, str]:
    """`{block name: markdown}` of every block the README leaves to `update_readme`."""
    acc = figures.sources["accuracy"]
    plot = figures.sources["plot"]
    blocks = {
        "presets": presets_table(figures),
        "bytes-vs-dnll": (
            f"![ΔNLL against bytes per token, every preset]({plot})\n\n"
            f"ΔNLL (decode protocol, P={acc['prefill']}, {acc['windows']} windows, ± the 95% interval) against the "
            f"bytes of every tensor the cache holds at {figures.sources['bytes']['context']} tokens; "
            f"{acc['model']}, {acc['platform']}, {acc['dtype']}, the fused kernels; the table's files."),
    }
    if figures.compared:
        blocks["quantizedcache"] = quantizedcache_table(figures)
    return blocks


def render_readme(text: str, blocks: dict[str, str]) -> str:
    """`text` with every marked block's body replaced by `blocks[name]` (a ValueError for an unknown block, or for a
    block of `blocks` the text lacks)."""
    found = set()

    def body(m: re.Match) -> str:
        name = m["name"]
        if name not in blocks:
            raise ValueError(f"the README marks a block {name!r}; known blocks: {', '.join(blocks)}")
        found.add(name)
        return f"{m.group(1)}{blocks[name]}\n{m.group(5)}"

    out = _BLOCK.sub(body, text)
    if set(blocks) - found:
        raise ValueError(f"the README has no block {', '.join(sorted(set(blocks) - found))} (markers like "
                         "`<!-- hf-kvcache:table presets -->` ... `<!-- /hf-kvcache:table -->`)")
    return out


def update_readme(readme: str | os.PathLike, sources: str | os.PathLike | None = None, *,
                  check: bool = False) -> list[Path]:
    """Render the README's blocks, its plot and `hf_kvcache/data/measured.json` from the result files `sources`
    names (default `docs/readme_sources.json` beside the README). Returns the files that changed; with `check`,
    writes nothing and returns the text files that would change (the plot is not compared: its pixels depend on the
    matplotlib version)."""
    readme = Path(readme)
    root = readme.resolve().parent
    figures = load_figures(root, sources)
    texts = {readme: render_readme(readme.read_text(), readme_blocks(figures)),
             root / figures.sources["measured"]: json.dumps(measured_figures(figures), indent=1) + "\n"}
    changed = [path for path, text in texts.items() if not path.is_file() or path.read_text() != text]
    if check:
        return changed
    for path in changed:
        path.write_text(texts[path])
    plot, acc = root / figures.sources["plot"], figures.sources["accuracy"]
    with tempfile.TemporaryDirectory() as tmp:
        image = plot_quality_vs_bytes(figure_rows(figures), Path(tmp) / plot.name,
                                      title=f"decode P={acc['prefill']}, {acc['platform']} {acc['dtype']}").read_bytes()
    if not plot.is_file() or plot.read_bytes() != image:
        plot.write_bytes(image)
        changed.append(plot)
    return changed
