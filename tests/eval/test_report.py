"""Results directories (named from the config, never overwritten), the table and the plot; the README's preset table
and plot, and the figures `hf-kvcache plan` cites, against the result files they come from."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
import torch

from hf_kvcache import cli
from hf_kvcache.eval.figures import load_figures, measured_figures
from hf_kvcache.eval.report import (
    create_results_dir,
    format_table,
    load_results,
    plot_ppl_vs_bytes,
    presets_table,
    readme_blocks,
    render_readme,
    results_dir_name,
    safe_label,
    table_rows,
    write_results,
)
from hf_kvcache.footprint import Measure
from hf_kvcache.planner import load_config, measured


def method(spec, stream=None, paper=None, ratio=None, passkey=None, decode=None):
    """A metrics entry; `paper` is stored under the key runs before the decode protocol used (now "strict");
    `decode`: (nll, delta %, half-width, kl, top-1) of a prefill of 1024."""
    entry = {"spec": spec, "description": f"{spec} method"}
    if stream is not None:
        entry["stream"] = {"ppl": stream}
    if paper is not None:
        entry["paper"] = {"ppl": paper}
    if ratio is not None:
        entry["memory"] = {"ratio": ratio, "bytes_per_token": ratio * 1000}
    if passkey is not None:
        entry["passkey"] = {"accuracy": sum(passkey.values()) / len(passkey), "by_length": passkey}
    if decode is not None:
        nll, delta, half, kl, top1 = decode
        entry["decode"] = {"1024": {"nll": nll, "delta_nll_pct": delta, "delta_interval": {"half_width": half},
                                    "kl": kl, "top1": top1}}
    return entry


@pytest.fixture
def metrics():
    return {
        "model": "tiny",
        "baseline": "none",
        "methods": [
            method("none", 10.0, 10.0, 1.0, {"1024": 1.0, "2048": 1.0}, (2.0, None, None, None, None)),
            method("int4-g32", 10.5, 11.0, 0.3125, {"1024": 1.0, "2048": 0.5}, (2.05, 2.5, 0.31, 0.0412, 0.9)),
            method("int2-g32", 20.0, float("nan"), 0.1875),
        ],
    }


def test_dir_name_from_config():
    when = dt.datetime(2026, 11, 29, 10, 15, 0)
    assert results_dir_name("compare", "smollm2-135m", "ppl1024x4-passkey", when=when) == (
        "compare__smollm2-135m__ppl1024x4-passkey__20261129-101500"
    )
    assert results_dir_name(
        "eval", "m", "ppl128x1", methods=["int4-g32:sink_tokens=4", "int8"], when=when
    ) == ("eval__int4-g32_sink_tokens-4+int8__m__ppl128x1__20261129-101500")
    assert "/" not in safe_label("a/b:c=d,e") and ":" not in safe_label("a/b:c=d,e")


def test_results_dir_is_never_overwritten(tmp_path, metrics):
    first = write_results(tmp_path, "run", metrics, {"n": 1})
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    second = write_results(tmp_path, "run", metrics, {"n": 2})
    third = create_results_dir(tmp_path, "run")
    assert (first.name, second.name, third.name) == ("run", "run-2", "run-3")
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert load_results(second)[1] == {"n": 2}


def test_results_dir_holds_metrics_config_table_plot(tmp_path, metrics):
    path = write_results(tmp_path, "run", metrics, {"methods": ["none"]})
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "metrics.json",
        "ppl_vs_bytes.png",
        "table.md",
    ]
    assert (path / "ppl_vs_bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loaded, _ = load_results(path)
    assert loaded["methods"][2]["paper"]["ppl"] is None  # NaN is not JSON: stored as null
    json.loads((path / "metrics.json").read_text())  # strict JSON
    assert (path / "table.md").read_text().startswith(format_table(table_rows(metrics)) + "\n")


def test_rows_take_deltas_against_the_run_baseline(metrics):
    rows = {r["method"]: r for r in table_rows(metrics)}
    assert rows["none"]["stream_delta_pct"] == 0.0
    assert rows["int4-g32"]["stream_delta_pct"] == pytest.approx(5.0)
    assert rows["int4-g32"]["strict_delta_pct"] == pytest.approx(10.0)  # a run's "paper" is the strict protocol
    assert rows["int2-g32"]["strict_delta_pct"] is None
    assert rows["int2-g32"]["passkey"] is None
    assert rows["int4-g32"]["bytes_ratio"] == 0.3125
    assert rows["none"]["decode"]["1024"]["delta_pct"] == 0.0 and rows["none"]["decode"]["1024"]["top1"] == 1.0
    assert rows["int4-g32"]["decode"]["1024"]["kl"] == 0.0412 and rows["int2-g32"]["decode"] == {}


def test_table_format(metrics):
    table = format_table(table_rows(metrics))
    lines = table.splitlines()
    assert lines[0] == (
        "| method | bytes/token | vs 16-bit | decode 1k: ΔNLL % | KL | top-1 | strict Δ% | stream Δ% | passkey 1k "
        "| passkey 2k |"
    )
    assert lines[3] == "| `int4-g32` | 312 | 0.312x | +2.50 ± 0.31 | 0.0412 | 90.0% | +10.00 | +5.00 | 100% | 50% |"
    assert lines[4] == "| `int2-g32` | 188 | 0.188x | - | - | - | - | +100.00 | - | - |"


def test_rows_of_several_runs_merge_into_one_table_and_plot(tmp_path, metrics):
    other = {**metrics, "model": "other", "methods": metrics["methods"][:2]}
    rows = table_rows(metrics) + table_rows(other)
    table = format_table(rows)
    assert table.splitlines()[0].startswith("| model | method |")
    assert len(table.splitlines()) == 2 + 5
    assert plot_ppl_vs_bytes(rows, tmp_path / "merged.png").stat().st_size > 0


def test_plot_survives_missing_measurements(tmp_path):
    rows = table_rows(
        {"model": "m", "baseline": "none", "methods": [method("none"), method("int8", ratio=0.5)]}
    )
    assert plot_ppl_vs_bytes(rows, tmp_path / "empty.png").exists()


# ------------------------------------------------------------------------------------------------ the README's figures

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def figures():
    """The figures of the README's preset table, read from the files docs/readme_sources.json names."""
    return load_figures(ROOT)


def test_readme_agrees_with_the_result_files(figures):
    """Every figure of the README's marked blocks is what the result files say: rendered in memory, compared."""
    text = (ROOT / "README.md").read_text()
    assert render_readme(text, readme_blocks(figures)) == text, (
        "README.md disagrees with the result files docs/readme_sources.json names: run "
        "`hf-kvcache report --readme README.md`")


def test_the_quantizedcache_table_names_only_what_its_run_measured():
    import copy

    from hf_kvcache.eval.figures import SOURCES, quantizedcache_figures

    sources = json.loads((ROOT / SOURCES).read_text())
    assert set(quantizedcache_figures(sources, ROOT)["figures"]) >= {"hf-quanto-int4", "hf-fp8", "turboquant-4"}
    wrong = copy.deepcopy(sources)
    wrong["quantizedcache"]["rows"].append(["hf-quanto-int3"])
    with pytest.raises(ValueError, match="hf-quanto-int3"):
        quantizedcache_figures(wrong, ROOT)
    wrong = copy.deepcopy(sources)
    wrong["quantizedcache"]["windows"] = 999
    with pytest.raises(ValueError, match="windows"):
        quantizedcache_figures(wrong, ROOT)


def test_readme_opens_with_the_set_up_commands_and_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail to docs/"
    first_block = lines[lines.index("```bash") + 1 : lines.index("```")]
    assert lines.index("```bash") < 5 and [line.split()[:2] for line in first_block[:2]] == [["make", "demo"],
                                                                                            ["make", "test"]]
    for link in ("docs/methods.md", "docs/evaluation.md", "docs/design.md", "BENCHMARKS.md"):
        assert f"]({link})" in "\n".join(lines) and (ROOT / link).is_file(), link


def test_plan_cites_the_same_figures(figures):
    """`hf-kvcache plan` reads hf_kvcache/data/measured.json, which the same command writes from the same files."""
    assert measured() == measured_figures(figures), (
        "hf_kvcache/data/measured.json disagrees with the result files: run `hf-kvcache report --readme README.md`")


def test_presets_read_under_another_spec_store_what_the_preset_stores(figures):
    """A preset read under the spec it had in an older run (`turboquant-4` as `turboquant-4:residual_length=64,
    sink_tokens=1`) stored, in that run, the bytes the preset stores now: the same layout."""
    acc = figures.sources["accuracy"]
    _, config = load_config("smollm2-135m")
    measure = Measure(config, torch.bfloat16)
    for preset, a in figures.accuracy.items():
        if a["spec"] == preset:
            continue
        entry = next(m for m in json.loads((ROOT / a["source"]).read_text())["methods"] if m["spec"] == a["spec"])
        tokens = acc["prefill"] + acc["decode_tokens"]
        assert measure.footprint(preset, tokens).held / tokens == entry["memory"]["bytes_per_token"], preset


def test_blocks_are_replaced_between_their_markers():
    text = ("# x\n<!-- hf-kvcache:table presets -->\nold\n<!-- /hf-kvcache:table -->\nkept\n"
            "<!-- hf-kvcache:plot bytes-vs-dnll -->\n<!-- /hf-kvcache:plot -->\n")
    out = render_readme(text, {"presets": "| a |", "bytes-vs-dnll": "![p](p.png)"})
    assert out == ("# x\n<!-- hf-kvcache:table presets -->\n| a |\n<!-- /hf-kvcache:table -->\nkept\n"
                   "<!-- hf-kvcache:plot bytes-vs-dnll -->\n![p](p.png)\n<!-- /hf-kvcache:plot -->\n")
    assert render_readme(out, {"presets": "| a |", "bytes-vs-dnll": "![p](p.png)"}) == out
    with pytest.raises(ValueError, match="no block bytes-vs-dnll"):
        render_readme(text.split("kept")[0], {"presets": "", "bytes-vs-dnll": ""})
    with pytest.raises(ValueError, match="marks a block 'other'"):
        render_readme(text.replace("presets", "other"), {"presets": "", "bytes-vs-dnll": ""})


def _eval_run(root: Path) -> None:
    run = root / "results" / "run"
    run.mkdir(parents=True)
    (run / "eval.log").write_text(
        "none:  decode 256: nll 2.1981  1.000x bytes\n"
        "int8:  decode 256: nll +0.11% +-0.11 kl 0.0024 top-1 97.4%  0.516x bytes\n"
        "int4-g32:  decode 256: nll +2.55% +-0.65 kl 0.0521 top-1 90.2%  0.312x bytes\n")
    # as `hf-kvcache bench --parts e2e,prefill --attentions sdpa,hf_kvcache --json` writes them
    rows = [{"method": m, "mode": "eager", "attention": a, "batch": b, "context": 4096, "step_ms": 1.0,
             "vs_dynamic": v}
            for m, a, b, v in (("dynamic", "sdpa", 16, 1.0), ("int8", "sdpa", 16, 2.5), ("int8", "hf_kvcache", 16, 2.7),
                               ("int8", "sdpa", 1, 1.1), ("int4-g32", "sdpa", 16, 1.5))]
    prefill = [{"method": m, "batch": 16, "context": 4096, "chunk": c, "prefill_s": 1.0, "vs_dynamic_chunked": v,
                "vs_dynamic": v / 2} for m, c, v in (("dynamic", None, 0.8), ("dynamic", 512, 1.0), ("int8", 512, 0.9))]
    prefill.append({"method": "int4-g32", "batch": 16, "chunk": 512, "oom": True})
    (run / "bench.json").write_text(json.dumps({"env": {"gpu": "GPU X"}, "e2e": {"layers": 2, "new_tokens": 8,
                                                                                "rows": rows},
                                                "prefill": {"rows": prefill}}))
    (root / "docs").mkdir()
    (root / "docs" / "readme_sources.json").write_text(json.dumps({
        "accuracy": {"model": "m", "platform": "GPU X", "dtype": "bfloat16", "attention": "hf_kvcache",
                     "prefill": 256, "windows": 4, "decode_tokens": 8,
                     "files": [{"path": "results/run/eval.log", "presets": ["int8", "int4-g32"]}]},
        "bytes": {"model": "smollm2-135m", "context": 256, "dtype": "bfloat16"},
        "speed": {"platform": "GPU X", "dtype": "bfloat16", "mode": "eager", "attention": "sdpa",
                  "decode": [{"batch": 1, "context": 4096, "path": "results/run/bench.json"},
                             {"batch": 16, "context": 4096, "path": "results/run/bench.json"},
                             {"batch": 64, "context": 4096, "path": "results/run/bench.json"}],
                  "prefill": [{"batch": 16, "context": 4096, "chunk": 512, "path": "results/run/bench.json"}]},
        "plot": "docs/plot.png", "measured": "measured.json"}))
    (root / "README.md").write_text("# r\n<!-- hf-kvcache:table presets -->\n<!-- /hf-kvcache:table -->\n"
                                    "<!-- hf-kvcache:plot bytes-vs-dnll -->\n<!-- /hf-kvcache:plot -->\n")


def test_a_new_bench_file_fills_its_columns(tmp_path):
    """Decode at each batch and prefill in chunks come from the bench JSON the config names; a size the file lacks
    is left out and said so, not filled in."""
    _eval_run(tmp_path)
    figures = load_figures(tmp_path)
    assert figures.presets == ["int8", "int4-g32"] and figures.accuracy["int8"]["top1"] == pytest.approx(0.974)
    assert [(c["what"], c["batch"]) for c in figures.columns] == [("decode", 1), ("decode", 16), ("prefill", 16)]
    assert figures.missing == ["decode at batch 64 x 4k (`results/run/bench.json` has no eager row at that size)"]
    lines = presets_table(figures).splitlines()
    assert lines[0] == ("| preset | bytes vs bf16 | ΔNLL % (P=256) | KL | top-1 | decode, batch 1 x 4k | "
                        "decode, batch 16 x 4k | prefill, batch 16 x 4k |")
    assert lines[2].startswith("| `int8` | 0.") and lines[2].endswith("| +0.11 ± 0.11 | 0.0024 | 97.4% | x1.10 | "
                                                                       "x2.50 | x0.90 |")
    assert lines[3].endswith("| x1.50 | - |")
    assert "GPU X" in presets_table(figures) and "2 decoder layers" in presets_table(figures)
    assert "the caches under attention `sdpa`" in presets_table(figures)


def test_a_decode_part_file_fills_the_decode_columns(tmp_path):
    """`hf-kvcache bench --parts decode` writes its rows under `decode` (steps over caches filled with random K/V):
    they fill the decode columns as `e2e` rows do, and the note says how the step was timed."""
    _eval_run(tmp_path)
    bench = tmp_path / "results" / "run" / "bench.json"
    data = json.loads(bench.read_text())
    data["decode"] = {"layers": 2, "context": 4096, "rows": data.pop("e2e")["rows"]}
    bench.write_text(json.dumps(data))
    figures = load_figures(tmp_path)
    assert [(c["what"], c["batch"]) for c in figures.columns] == [("decode", 1), ("decode", 16), ("prefill", 16)]
    table = presets_table(figures)
    assert table.splitlines()[2].endswith("| x1.10 | x2.50 | x0.90 |")
    assert "continuing a cache filled with random K/V" in table and "None new tokens" not in table


def test_a_batch1_part_file_fills_the_batch_1_column(tmp_path):
    """`--parts batch1` (interleaved rounds at batch 1) fills a batch-1 decode column from its `batch1` rows, and the
    note says the ratio is the median of its rounds."""
    _eval_run(tmp_path)
    rows = [{"method": m, "attention": "sdpa", "batch": 1, "context": 4096, "repeats": 7, "step_ms": 1.0,
             "vs_dynamic": v} for m, v in (("dynamic", 1.0), ("int8", 1.04))]
    (tmp_path / "results" / "run" / "batch1.json").write_text(json.dumps(
        {"env": {"gpu": "GPU X"}, "batch1": {"layers": 2, "context": 4096, "rows": rows}}))
    sources = tmp_path / "docs" / "readme_sources.json"
    config = json.loads(sources.read_text())
    config["speed"]["decode"][0]["path"] = "results/run/batch1.json"
    sources.write_text(json.dumps(config))
    figures = load_figures(tmp_path)
    table = presets_table(figures)
    assert table.splitlines()[2].endswith("| x1.04 | x2.50 | x0.90 |")
    assert "at batch 1 the median of 7 rounds" in table


def test_report_readme_writes_then_checks(tmp_path, capsys):
    _eval_run(tmp_path)
    readme = str(tmp_path / "README.md")
    assert cli.main(["report", "--readme", readme, "--check"]) == 1
    assert "out of date" in capsys.readouterr().out
    assert cli.main(["report", "--readme", readme]) == 0
    assert cli.main(["report", "--readme", readme, "--check"]) == 0
    assert "| `int4-g32` |" in (tmp_path / "README.md").read_text()
    assert (tmp_path / "docs" / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "measured.json").read_text())["speed"]["methods"]["int8"][0]["vs_dynamic"] == 1.1
    assert cli.main(["report", "--readme", readme, str(tmp_path)]) == 2
