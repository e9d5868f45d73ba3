"""The figures the README's preset table and `hf-kvcache plan` cite, read from the result files that one small config
names (`docs/readme_sources.json`), so that no figure is typed by hand.

The config (paths relative to the repository's root, the folder holding README.md):

    {"accuracy": {"model", "platform", "dtype", "attention", "prefill", "windows", "decode_tokens",
                  "files": [{"path": metrics.json or an eval log, "presets": [spec, ...] or {preset: spec in the run}}]},
     "bytes": {"model": a shipped shape of the planner, "context": tokens, "dtype"},
     "speed": {"platform", "dtype", "mode": "eager", ("attention": the methods' rows' `attention`, e.g. "sdpa"),
               "decode": [{"batch", "context", "path": bench JSON}, ...],
               "prefill": [{"batch", "context", "chunk", "path": bench JSON}, ...]},
     "plot": path of the figure, "measured": path of hf_kvcache/data/measured.json}

- accuracy: the decode protocol's ΔNLL (± the 95% interval over windows), KL and top-1 of each preset, from a results
  directory's `metrics.json` (its `config.json` must say the platform, dtype, prefill and windows the config says) or
  from the lines `hf-kvcache eval` prints per method (`fp8-e4m3:  decode 6144: nll +0.47% +-0.28 kl 0.0134 top-1
  94.5%`), for a run whose metrics.json was not kept. A preset may be read under the spec it had in the run
  (`"turboquant-4": "turboquant-4:residual_length=64,sink_tokens=1"`: the preset since then).
- bytes: the planner's, every tensor one sequence's cache holds (`hf_kvcache.footprint`).
- speed: `hf-kvcache bench --parts e2e --json` files: `e2e.rows` (`method`, `mode`, `batch`, `context`, `vs_dynamic`:
  DynamicCache's step / the cache's, measured in the same run) for decode, or `--parts decode`'s `decode.rows` (the
  same fields, `generate` continuing caches filled with random K/V) or `--parts batch1`'s `batch1.rows` (the same,
  at batch 1, medians of rounds interleaved with DynamicCache's), and a `prefill.rows` section (`method`,
  `batch`, `context`, `chunk`, `prefill_s`, `vs_dynamic_chunked`, `vs_dynamic`) for prefill. A file without the
  point asked for leaves it unmeasured; nothing is filled in.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..footprint import Measure
from ..models import load_config
from ..presets import PRESETS

__all__ = ["SOURCES", "Figures", "accuracy_figures", "load_figures", "measured_figures", "speed_figures"]

SOURCES = Path("docs") / "readme_sources.json"  # relative to the repository's root
# One line of `hf-kvcache eval` per method (cli._summary_line); a spec may hold colons itself.
_EVAL_LINE = re.compile(
    r"^(?P<spec>\S+):\s+decode (?P<prefill>\d+): nll (?P<delta>[+-]\d+\.\d+)%(?: \+-(?P<half>\d+\.\d+))? "
    r"kl (?P<kl>\d+\.\d+) top-1 (?P<top1>\d+\.\d+)%"
)


@dataclass
class Figures:
    """Everything the README's table, its plot and measured.json show, with where each figure comes from.

    `accuracy[preset]`: `{"delta_pct", "half_width", "kl", "top1", "spec", "source"}`; `bytes[preset]`: ratio against
    a bf16 cache; `speed[preset]`: points `{"what": "decode" | "prefill", "batch", "context", ("chunk"),
    "vs_dynamic", ("vs_dynamic_chunked"), "source"}`; `missing`: one line per speed column a source lacks."""

    sources: dict
    accuracy: dict[str, dict]
    bytes: dict[str, float]
    speed: dict[str, list[dict]]
    columns: list[dict] = field(default_factory=list)  # the speed columns present, in order
    missing: list[str] = field(default_factory=list)
    compared: dict = field(default_factory=dict)  # `quantizedcache_figures`, where the sources name the comparison

    @property
    def presets(self) -> list[str]:
        """The presets with an accuracy figure, in the order of `PRESETS`."""
        return [p for p in PRESETS if p in self.accuracy]


def _read_json(root: Path, path: str) -> dict:
    file = root / path
    if not file.is_file():
        raise FileNotFoundError(f"{path}: named in {SOURCES} but not found under {root}")
    return json.loads(file.read_text())


def _presets(entry: dict) -> dict[str, str]:
    presets = entry["presets"]
    return {p: p for p in presets} if isinstance(presets, list) else dict(presets)


def _check_run(root: Path, path: str, acc: dict) -> None:
    """The run's config.json says what the sources config says it measured (platform, dtype, prefill, windows)."""
    config = _read_json(root, str(Path(path).parent / "config.json"))
    said = {"device_name": acc["platform"], "model_dtype": acc["dtype"], "windows": acc["windows"],
            "decode_tokens": acc["decode_tokens"], "attn_implementation": acc["attention"]}
    wrong = {k: (config.get(k), v) for k, v in said.items() if config.get(k) != v}
    if acc["prefill"] not in config.get("prefill", []):
        wrong["prefill"] = (config.get("prefill"), acc["prefill"])
    if wrong:
        raise ValueError(f"{path}: its config.json differs from {SOURCES} (run, config): {wrong}")


def _from_metrics(root: Path, path: str, acc: dict) -> dict[str, dict]:
    """The decode-protocol figures of every method a results directory's metrics.json holds (see `report`)."""
    _check_run(root, path, acc)
    out = {}
    for entry in _read_json(root, path)["methods"]:
        result = (entry.get("decode") or {}).get(str(acc["prefill"])) or {}
        if result.get("delta_nll_pct") is not None:
            out[entry["spec"]] = {"delta_pct": result["delta_nll_pct"], "kl": result["kl"], "top1": result["top1"],
                                  "half_width": (result.get("delta_interval") or {}).get("half_width")}
    return out


def _from_log(root: Path, path: str, acc: dict) -> dict[str, dict]:
    file = root / path
    if not file.is_file():
        raise FileNotFoundError(f"{path}: named in {SOURCES} but not found under {root}")
    out = {}
    for line in file.read_text().splitlines():
        m = _EVAL_LINE.match(line)
        if m and int(m["prefill"]) == acc["prefill"]:
            out[m["spec"]] = {"delta_pct": float(m["delta"]), "half_width": float(m["half"]) if m["half"] else None,
                              "kl": float(m["kl"]), "top1": float(m["top1"]) / 100}
    return out


def accuracy_figures(sources: dict, root: Path) -> dict[str, dict]:
    """`{preset: {"delta_pct", "half_width", "kl", "top1", "spec", "source"}}` from the accuracy files."""
    acc = sources["accuracy"]
    out = {}
    for entry in acc["files"]:
        path = entry["path"]
        found = (_from_metrics if path.endswith(".json") else _from_log)(root, path, acc)
        for preset, spec in _presets(entry).items():
            if spec not in found:
                raise ValueError(f"{path} has no decode-protocol figure at P={acc['prefill']} for {spec!r}")
            out[preset] = {**found[spec], "spec": spec, "source": path}
    return out


def _decode_section(bench: dict) -> tuple[str, dict]:
    """The section a decode column reads: `e2e` (`generate` over its own prompt), else `decode` (`--parts decode`:
    `generate` continuing a cache filled with random K/V, which times every preset in a fraction of the time), else
    `batch1` (`--parts batch1`: the same steps at batch 1, the median of rounds interleaved with DynamicCache's)."""
    for name in ("e2e", "decode", "batch1"):
        if bench.get(name):
            return name, bench[name]
    return "e2e", {}


def _bench_rows(bench: dict, what: str) -> list[dict]:
    """A section's rows; a prefill run's rows over a left-padded batch (`--prefill-pad`) are not the table's."""
    rows = (_decode_section(bench)[1] if what == "decode" else bench.get("prefill") or {}).get("rows", [])
    return [r for r in rows if not r.get("pad")]


def speed_figures(sources: dict, root: Path) -> tuple[dict[str, list[dict]], list[dict], list[str]]:
    """`({preset: [point]}, columns present, lines on the columns missing)` from the bench JSON files. A column is
    present when its file holds its section (decode: `e2e.rows`, or `decode.rows`, in `mode`; prefill: `prefill.rows`);
    a preset missing from a present column is unmeasured there."""
    speed = sources["speed"]
    attention = speed.get("attention")  # the methods' rows of a bench run under several attentions: which one
    points: dict[str, list[dict]] = {}
    columns, missing = [], []
    for what in ("decode", "prefill"):
        for col in speed.get(what, []):
            bench = _read_json(root, col["path"])
            gpu = bench.get("env", {}).get("gpu")
            if gpu != speed["platform"]:
                raise ValueError(f"{col['path']}: measured on {gpu!r}, {SOURCES} says {speed['platform']!r}")
            rows = [r for r in _bench_rows(bench, what) if (r.get("batch"), r.get("context")) ==
                    (col["batch"], col["context"]) and r.get("mode", speed["mode"]) == speed["mode"]
                    and (what == "decode" or r.get("chunk") == col["chunk"])
                    and (r["method"] == "dynamic" or r.get("attention", attention) == attention)]
            label = f"{what} at batch {col['batch']} x {col['context'] // 1024}k"
            if not rows:
                lacks = f"no {speed['mode']} row at that size" if what == "decode" else "no `prefill` section"
                missing.append(f"{label} (`{col['path']}` has {lacks})")
                continue
            section, e2e = _decode_section(bench)
            columns.append({**col, "what": what, "layers": e2e.get("layers"), "new_tokens": e2e.get("new_tokens"),
                            "section": section if what == "decode" else "prefill",
                            "date": bench.get("env", {}).get("date"),
                            **({"repeats": rows[0].get("repeats")} if section == "batch1" else {})})
            seen = set()
            for r in rows:
                if r["method"] in seen:
                    raise ValueError(f"{col['path']}: two {what} rows of {r['method']!r} at batch {col['batch']} x "
                                     f"{col['context']}; name a file with one a size, or a narrower column")
                seen.add(r["method"])
                ratio = r.get("vs_dynamic_chunked" if what == "prefill" else "vs_dynamic")
                if ratio is None:  # a call that ran out of memory (its own or DynamicCache's): no ratio to show
                    continue
                point = {"what": what, "batch": col["batch"], "context": col["context"],
                         "vs_dynamic": r.get("vs_dynamic"), "source": col["path"]}
                if what == "prefill":
                    point.update(chunk=col["chunk"], vs_dynamic_chunked=ratio)
                points.setdefault(r["method"], []).append(point)
    return points, columns, missing


def quantizedcache_figures(sources: dict, root: Path) -> dict:
    """The comparison with transformers' `QuantizedCache` (`sources["quantizedcache"]`): `{"figures": {spec:
    {"delta_pct", "half_width", "kl", "top1", "bytes"}}, "command": the run's, "speed": {spec: [point]}, "columns":
    the speed columns present}`, every figure from one eval run (bytes: what the cache held at the end of the decode
    protocol, against a 16-bit cache) and the speed from the bench files its `speed` names, if any."""
    qc = sources["quantizedcache"]
    _check_run(root, qc["path"], qc)
    found = {}
    for entry in _read_json(root, qc["path"])["methods"]:
        result = (entry.get("decode") or {}).get(str(qc["prefill"])) or {}
        if result.get("delta_nll_pct") is not None:
            found[entry["spec"]] = {"delta_pct": result["delta_nll_pct"], "kl": result["kl"], "top1": result["top1"],
                                    "half_width": (result.get("delta_interval") or {}).get("half_width"),
                                    "bytes": entry["memory"]["ratio"]}
    lacking = [spec for row in qc["rows"] for spec in row if spec not in found]
    if lacking:
        raise ValueError(f"{qc['path']} has no decode-protocol figure at P={qc['prefill']} for {lacking}")
    argv = _read_json(root, str(Path(qc["path"]).parent / "config.json"))["command_line"]
    out = {"figures": found, "command": " ".join(["hf-kvcache", *argv[1:]]), "speed": {}, "columns": []}
    if qc.get("speed"):
        out["speed"], out["columns"], missing = speed_figures({"speed": qc["speed"]}, root)
        if missing:
            raise ValueError("the QuantizedCache comparison's speed files lack: " + "; ".join(missing))
    return out


def _bytes(sources: dict, presets: list[str]) -> dict[str, float]:
    """Every tensor one sequence's cache holds at the context, against a bf16 cache (the planner's bytes)."""
    b = sources["bytes"]
    _, config = load_config(b["model"])
    measure = Measure(config, getattr(torch, b["dtype"]))
    sixteen_bit = measure.footprint("none", b["context"]).total * 2 // measure.dtype.itemsize
    return {p: measure.footprint(p, b["context"]).total / sixteen_bit for p in presets}


def load_figures(root: str | os.PathLike = ".", sources: str | os.PathLike | None = None) -> Figures:
    """Every figure the README's table shows, read from the files `sources` (default `docs/readme_sources.json`
    under `root`) names."""
    root = Path(root)
    config = json.loads(Path(sources or root / SOURCES).read_text())
    accuracy = accuracy_figures(config, root)
    speed, columns, missing = speed_figures(config, root)
    figures = Figures(config, accuracy, {}, speed, columns, missing)
    figures.bytes = _bytes(config, figures.presets)
    if "quantizedcache" in config:
        figures.compared = quantizedcache_figures(config, root)
    return figures


def measured_figures(figures: Figures) -> dict:
    """What `hf_kvcache/data/measured.json` holds (`hf_kvcache.planner.measured`): the same figures as the README."""
    acc, speed = figures.sources["accuracy"], figures.sources["speed"]
    return {
        "about": (f"Written by `hf-kvcache report --readme README.md` from the result files {SOURCES} names, which "
                  "the README's preset table shows too; `hf-kvcache plan` cites these figures. Do not edit."),
        "accuracy": {
            "model": acc["model"],
            "platform": f"{acc['platform']}, {acc['dtype']}, attention {acc['attention']}",
            "protocol": (f"decode protocol: a prefill of {acc['prefill']} tokens, {acc['decode_tokens']} decoded, "
                         f"{acc['windows']} windows, against the 16-bit cache"),
            "methods": {
                p: {"decode_delta_pct": a["delta_pct"], "delta_half_width": a["half_width"], "kl": a["kl"],
                    "top1": a["top1"], "prefill": acc["prefill"], "source": a["source"]}
                for p, a in figures.accuracy.items() if p in figures.presets
            },
        },
        "speed": {
            "gpu": speed["platform"],
            "protocol": (f"generate on an {speed['platform']}, {speed['dtype']}, {speed['mode']}, against "
                         "DynamicCache in the same run"),
            "methods": {p: figures.speed[p] for p in figures.presets if p in figures.speed},
        },
    }
