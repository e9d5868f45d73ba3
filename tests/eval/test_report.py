"""Results directories (named from the config, never overwritten), the table and the plot."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from hf_kvcache.eval.report import (
    create_results_dir,
    format_table,
    load_results,
    plot_ppl_vs_bytes,
    results_dir_name,
    safe_label,
    table_rows,
    write_results,
)


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
