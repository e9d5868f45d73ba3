"""The `hf-kvcache` command: option resolution, one-line errors, and a run end to end (a tiny model for the
fast tests, the default model for the slow one)."""

from __future__ import annotations

import json

import pytest

from hf_kvcache import cli
from hf_kvcache.cli import DEFAULT_METHODS, EvalConfig, UsageError, build_parser, config_from_args, run_eval
from tests.eval.test_passkey import byte_tokenizer
from tests.helpers.tiny_models import tiny_model


def resolve(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_split_methods_keeps_override_commas():
    assert cli.split_methods(["none,int8", "int4-g32:sink_tokens=4,residual_length=32,int2-g32"]) == [
        "none",
        "int8",
        "int4-g32:sink_tokens=4,residual_length=32",
        "int2-g32",
    ]
    assert cli.split_methods(["none", "fp8-e4m3"]) == ["none", "fp8-e4m3"]


def test_compare_is_eval_with_the_defaults():
    assert resolve("compare") == EvalConfig()
    assert resolve("eval") == EvalConfig()
    assert resolve("compare", "--methods", "kivi-4,kivi-2").methods == ("kivi-4", "kivi-2")
    assert EvalConfig().methods == DEFAULT_METHODS
    cfg = EvalConfig()  # the decode protocol (docs/evaluation.md) at its CPU size
    assert (cfg.protocols, cfg.prefill, cfg.decode_tokens, cfg.windows, cfg.attention) == (
        ("decode",), (1024,), 64, 8, "hf_kvcache")
    assert resolve("eval", "--protocol", "decode,paper,stream").protocols == ("decode", "strict", "stream")
    assert resolve("eval", "--prefill", "1024,6144", "--retrieval", "all").prefill == (1024, 6144)
    assert resolve("eval", "--retrieval", "all").retrieval == ("multikey", "multivalue", "vartrack")


def test_explicit_options_override_quick():
    cfg = resolve(
        "eval",
        "--quick",
        "--context",
        "200",
        "--methods",
        "int8",
        "--protocol",
        "stream",
        "--passkey-depths",
        "0,1",
        "--no-progress",
    )
    assert (cfg.context, cfg.windows, cfg.chunk) == (200, cli.QUICK["windows"], cli.QUICK["chunk"])
    assert cfg.methods == ("int8",) and cfg.protocols == ("stream",)
    assert cfg.passkey_depths == (0.0, 1.0) and cfg.progress is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["eval", "--methods", "none,bogus-9"], "bogus-9"),
        (["eval", "--methods", "int4-g32:group_size"], "key=value"),
        (["eval", "--passkey-depths", "0.5,2"], "passkey-depths"),
        (["eval", "--skip", "2000"], "--skip"),
        (["eval", "--text", "/nonexistent/corpus.txt"], "--text"),
        (["eval", "--protocol", "decode,both"], "--protocol"),
        (["eval", "--prefill", "0"], "--prefill"),
        (["eval", "--retrieval", "needle"], "--retrieval"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    # Each of these fails before the model is loaded.
    assert cli.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-kvcache: error:") and message in err and "\n" not in err, err
    assert not any(tmp_path.iterdir())


def tiny_config(**overrides):
    values = dict(
        cli.QUICK,
        methods=("int8", "none", "int2-g32"),
        prefill=(40,),
        decode_tokens=8,
        windows=1,
        context=64,
        chunk=16,
        skip=8,
        passkey_lengths=(120,),
        progress=False,
    )
    return EvalConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), byte_tokenizer()


def test_run_eval_writes_a_results_dir(tmp_path, tiny):
    pytest.importorskip("hf_kvcache.presets")
    model, tokenizer = tiny
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Some words of a small corpus. " * 40)
    cfg = tiny_config(text=str(corpus), protocols=("decode", "strict", "stream"), windows=2)
    path, metrics = run_eval(
        cfg, out=str(tmp_path / "results"), model=model, tokenizer=tokenizer, argv=["hf-kvcache", "eval"]
    )
    assert path.name.startswith("eval__int8+int2-g32__llama__decode40x2-strict64x2-stream64x2-passkey-text-corpus__")
    assert [m["spec"] for m in metrics["methods"]] == ["none", "int8", "int2-g32"]  # baseline first
    for entry in metrics["methods"]:
        assert {"decode", "strict", "stream", "memory", "passkey"} <= set(entry)
        assert entry["stream"]["tokens"] == 2 * (64 - 8) and entry["decode"]["40"]["tokens"] == 2 * 8
        assert "logprobs" not in entry["decode"]["40"]  # the baseline's distributions stay out of the JSON
    int8, int2 = metrics["methods"][1]["decode"]["40"], metrics["methods"][2]["decode"]["40"]
    assert 0 <= int8["kl"] < int2["kl"] and int2["top1"] <= int8["top1"] <= 1
    assert metrics["methods"][0]["memory"]["ratio"] == pytest.approx(2.0)  # float32 DynamicCache
    assert metrics["methods"][2]["memory"]["ratio"] < metrics["methods"][1]["memory"]["ratio"] < 1.0
    assert metrics["methods"][1]["memory"]["n_tokens"] == 2 * (40 + 8)  # the decode protocol's cache: 2 rows
    config = json.loads((path / "config.json").read_text())
    assert config["prefill"] == [40] and config["corpus"] == str(corpus) and config["command"] == "eval"
    assert config["attn_implementation"] == model.config._attn_implementation
    assert set(config["versions"]) >= {"torch", "transformers", "hf_kvcache"}
    table = (path / "table.md").read_text()
    assert "| `int2-g32` |" in table and "decode 40: ΔNLL %" in table and "strict Δ%" in table


def test_run_eval_records_the_calibration_a_method_read(tmp_path, tiny):
    """Calibrated methods (conftest's artifacts for the tiny configs) write the artifact's metadata into the
    results; uncalibrated ones write none."""
    model, tokenizer = tiny
    cfg = tiny_config(methods=("kvquant-3", "fp8-e4m3:scale=calibrated", "int8"), protocols=("strict",),
                      passkey=False)
    _, metrics = run_eval(cfg, out=str(tmp_path), model=model, tokenizer=tokenizer)
    by_spec = {m["spec"]: m for m in metrics["methods"]}
    for spec in ("kvquant-3", "fp8-e4m3:scale=calibrated"):
        meta = by_spec[spec]["calibration"]
        assert meta["fingerprint"]["model_type"] == "llama" and meta["tokens"] == 96
    assert "calibration" not in by_spec["int8"] and "calibration" not in by_spec["none"]


def test_run_eval_runs_each_method_on_the_model_it_expects(tmp_path):
    """A RotatedCache fuses its rotation into the model: the methods around it, the baseline included, must see
    the unfused model (their perplexity equals a run without the rotated method), and the model leaves unfused."""
    from hf_kvcache.patching import current_fusion

    model, tokenizer = tiny_model("llama"), byte_tokenizer()
    cfg = tiny_config(methods=("int8", "rotated-4", "int4-g32"), passkey=False)
    _, with_rotated = run_eval(cfg, out=str(tmp_path), model=model, tokenizer=tokenizer)
    assert current_fusion(model) is None
    _, without = run_eval(tiny_config(methods=("int8", "int4-g32"), passkey=False),
                          out=str(tmp_path), model=model, tokenizer=tokenizer)
    nll = {run: {m["spec"]: m["decode"]["40"]["nll"] for m in metrics["methods"]}
           for run, metrics in (("with", with_rotated), ("without", without))}
    for spec in ("none", "int8", "int4-g32"):
        assert nll["with"][spec] == nll["without"][spec], spec
    assert nll["with"]["rotated-4"] != nll["with"]["int4-g32"]


def test_report_merges_runs_into_one_table_and_figure(tmp_path, tiny, capsys):
    from hf_kvcache.cli import main

    model, tokenizer = tiny
    runs = [run_eval(tiny_config(methods=methods, passkey=False), out=str(tmp_path / "r"),
                     model=model, tokenizer=tokenizer)[0] for methods in (("int8", "int4-g32"), ("int2-g32:sink_tokens=2",))]
    assert main(["report", *map(str, runs), "--out", str(tmp_path / "reports")]) == 0
    (path,) = (tmp_path / "reports").iterdir()
    table = (path / "table.md").read_text()
    assert table.count("| `none` |") == 1  # the baseline once; every delta is per run
    for spec in ("int8", "int4-g32", "int2-g32:sink_tokens=2"):
        assert f"| `{spec}` |" in table
    assert (path / "quality_vs_bytes.png").stat().st_size > 10_000
    assert json.loads((path / "config.json").read_text())["runs"] == [str(r) for r in runs]
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.json" in capsys.readouterr().err


def test_run_eval_memory_without_streaming(tmp_path, tiny):
    pytest.importorskip("hf_kvcache.presets")
    model, tokenizer = tiny
    cfg = tiny_config(methods=("int8",), protocols=("strict",), passkey=False)
    path, metrics = run_eval(cfg, out=str(tmp_path), model=model, tokenizer=tokenizer)
    assert "__strict64x1__" in path.name
    int8 = metrics["methods"][1]
    assert "decode" not in int8 and "passkey" not in int8 and int8["memory"]["n_tokens"] == 64


def test_unbuildable_spec_is_a_usage_error(tmp_path, tiny):
    pytest.importorskip("hf_kvcache.presets")
    model, tokenizer = tiny
    with pytest.raises(UsageError, match="no_such_option"):
        run_eval(
            tiny_config(methods=("int4-g32:no_such_option=1",)),
            out=str(tmp_path),
            model=model,
            tokenizer=tokenizer,
        )
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_eval_quick_on_the_default_model(tmp_path, capsys):
    assert (
        cli.main(["eval", "--quick", "--methods", "none,int4-g32", "--no-progress", "--out", str(tmp_path)])
        == 0
    )
    out = capsys.readouterr().out
    assert "| `none` |" in out and "| `int4-g32` |" in out
    (path,) = tmp_path.iterdir()
    assert path.name.startswith("eval__int4-g32__smollm2-135m__decode96x2-passkey__")
    metrics = json.loads((path / "metrics.json").read_text())
    baseline, int4 = metrics["methods"]
    assert baseline["passkey"]["accuracy"] == 1.0  # the default model finds the key at 256 tokens
    assert 0 < int4["memory"]["ratio"] < 0.5
    result = int4["decode"]["96"]
    assert abs(result["delta_nll_pct"]) < 20 and result["kl"] > 0 and 0.5 < result["top1"] <= 1


@pytest.mark.parametrize(
    "argv,message",
    [(["bench", "--parts", "kernel,speed"], "unknown part"), (["bench", "--batches", "1,x"], "--batches"),
     (["bench", "--prefill-chunk", "0", "--prefill-chunk-all"], "give it a size")]
    + ([] if __import__("torch").cuda.is_available() else [(["bench"], "needs a CUDA device")])
    + ([] if __import__("torch").cuda.device_count() >= 2 else [(["bench", "--multi-gpu"], "at least 2 CUDA GPUs")]),
)
def test_bench_usage_errors_exit_2(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_bench_counts_a_transformers_cache_by_the_bytes_it_holds():
    """DynamicCache: K and V in the model dtype; a tensor subclass is counted through its inner tensors."""
    import torch
    from transformers import DynamicCache

    from hf_kvcache.bench import _dense_cache_bytes, _tensor_bytes

    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    from hf_kvcache import _compat

    model(torch.randint(5, 100, (1, 10)), use_cache=True, **_compat.cache_kwargs(cache, model))
    cfg = model.config
    assert _dense_cache_bytes(cache) == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 10 * cfg.head_dim * 4

    class Packed(torch.Tensor):  # a stand-in for a packed subclass: logical shape (8, 8), 8 bytes inside
        def __tensor_flatten__(self):
            return ["_data"], None

    p = torch.Tensor._make_subclass(Packed, torch.zeros(8, 8))
    p._data = torch.zeros(8, dtype=torch.uint8)
    assert _tensor_bytes(p) == 8


@pytest.mark.slow
def test_calibrate_on_the_default_model_writes_a_loadable_artifact(tmp_path, capsys):
    """`hf-kvcache calibrate` end to end (few tokens): the artifact loads against the model it was made for."""
    from hf_kvcache import calibration
    from hf_kvcache.models import load_model

    out = tmp_path / "cal.safetensors"
    vllm = tmp_path / "vllm.safetensors"
    status = cli.main(["calibrate", "--tokens", "96", "--chunk", "48", "--bits", "2", "--no-progress",
                       "--out", str(out), "--vllm-out", str(vllm)])
    assert status == 0
    model, _ = load_model()
    cal = calibration.load(out, model.config)
    assert cal.metadata["tokens"] == 96 and cal.metadata["bits"] == [2] and vllm.is_file()
    assert "dev corpus" in cal.metadata["text"] and str(out) in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [(["calibrate", "--bits", "2,x"], "--bits"),
                                          (["calibrate", "--chunk", "1"], "--chunk"),
                                          (["calibrate", "--bits", "9"], "bits=")])
def test_calibrate_usage_errors_exit_2(capsys, argv, message):
    assert cli.main(argv + ["--no-progress", "--tokens", "16"]) == 2
    assert message in capsys.readouterr().err


def test_an_interrupted_run_keeps_what_it_measured(tmp_path, tiny, monkeypatch):
    """After each method the results directory holds what was measured so far (`complete: false`)."""
    from hf_kvcache.eval import perplexity

    model, tokenizer = tiny
    real, calls = perplexity.decode_perplexity, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of time")
        return real(*args, **kwargs)

    monkeypatch.setattr(perplexity, "decode_perplexity", failing)
    with pytest.raises(RuntimeError, match="out of time"):
        run_eval(tiny_config(methods=("int8",), passkey=False), out=str(tmp_path), model=model, tokenizer=tokenizer)
    (path,) = tmp_path.iterdir()
    metrics = json.loads((path / "metrics.json").read_text())
    assert [m["spec"] for m in metrics["methods"]] == ["none"]
    assert json.loads((path / "config.json").read_text())["complete"] is False
