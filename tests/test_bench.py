"""The end-to-end benchmark's row (`hf_kvcache.bench.e2e_row`: `generate` as users call it) on a tiny model on
the CPU: the figures it reports exist and are consistent. Speed itself is measured on the GPU, never here."""

from __future__ import annotations

import pytest

from hf_kvcache.bench import _e2e_line, e2e_row
from tests.helpers.tiny_models import tiny_input_ids, tiny_model


@pytest.mark.parametrize("name,compiled,chunk,chunk_all", [("dynamic", False, None, False),
                                                           ("int4-g32", False, 16, False), ("static", True, 16, False),
                                                           ("kivi-2", True, None, False), ("fp8-e4m3", False, 16, True)])
def test_e2e_row_reports_a_generate_call_as_users_make_it(name, compiled, chunk, chunk_all):
    model = tiny_model("llama", "sdpa")
    ids = tiny_input_ids(model, batch=2, length=40)
    forwards = []
    model.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    row = e2e_row(model, name, ids, 5, compiled, chunk, chunk_all)
    if not compiled:  # two timed calls (chunked with chunk_all), and the chunked call otherwise
        prefill = -(-40 // chunk) if chunk_all else 1
        extra = 0 if chunk is None or chunk_all else -(-40 // chunk) + 4
        assert len(forwards) == 2 * (prefill + 4) + extra
    assert row["mode"] == ("compiled" if compiled else "eager") and (row["batch"], row["context"]) == (2, 40)
    assert 0 < row["prefill_s"] < row["second_call_s"] and row["first_call_s"] > 0
    assert 0 < row["step_ms"] * 1e-3 < row["second_call_s"]  # the median of the call's step gaps: one of them
    assert row["cache_gb"] > 0 and row["recompiles"] == 0
    assert row["peak_gb"] is None and row["chunked_peak_gb"] is None  # CUDA only
    assert (row["host_us_per_layer"] is None) == compiled
    assert compiled or row["host_us_per_layer"] > 0


def test_a_row_without_dynamic_cache_says_so():
    """A batch where DynamicCache ran out of memory has no baseline: its rows say so, not a ratio to another row."""
    row = dict(method="fp8-e4m3", mode="eager", batch=64, step_ms=12.75, vs_dynamic=None, first_call_s=51.9,
               second_call_s=47.8, recompiles=0, peak_gb=None, chunked_peak_gb=50.1, cache_gb=34.4,
               host_us_per_layer=29.0)
    assert "(DynamicCache did not run)" in _e2e_line(row) and "x1.00" not in _e2e_line(row)
    assert "x1.34 DynamicCache" in _e2e_line(dict(row, vs_dynamic=1.34))


def test_the_compile_census_finds_each_kernel_variant_once_and_none_for_another_prompt():
    """`hf-kvcache bench --parts compiles` without a GPU: Triton compiles for sm_90 what a first `generate` of
    `turboquant-3` launches (its three bit widths, a prompt in chunks, decode steps at every alignment, two next
    turns), each kernel once per variant it needs: the pack kernel once per bit width, not once more per class of the
    write's length (12 variants at the 8B heads before the storage padded its fields), and a fresh cache with a
    prompt of another length, or one so short that nothing is packed yet, compiles nothing more."""
    from hf_kvcache.bench.compiles import _census_in_fresh_process

    found = _census_in_fresh_process("turboquant-3", 64, 90)
    calls = found["calls"]
    assert found["warm_up"] is None
    assert [(c["call"], c["error"]) for c in calls] == [("prompt", None), ("turn", None), ("turn", None),
                                                         ("prompt", None), ("prompt", None)]
    every = [x for c in calls for x in c["compiles"]]
    assert every and not [x for x in every if x["error"]]
    packs = [x["variant"] for x in every if x["kernel"] == "_pack_turbo"]
    assert sorted(v["BA"] for v in packs) == ["constexpr:2", "constexpr:3", "constexpr:4"]
    assert {"_turbo_attn", "_combine", "_gather_codebook"} <= {x["kernel"] for x in every}
    assert calls[-1]["compiles"] == calls[-2]["compiles"] == []


def test_every_kernel_family_compiles_for_every_nvidia_architecture_from_turing_on():
    """Without a GPU: each kernel family's launches of a prompt in chunks and its decode steps (FP8 E4M3 and E5M2,
    grouped integers, KIVI, KVQuant, TurboQuant's split) compile for sm_75, 80, 86, 89, 100 and 120, Turing (T4) to
    Blackwell (RTX 50xx); sm_90 is the census tests' above. FP8 before sm_89 converts by its bits: the hardware
    conversions failed to compile for sm_75-86 (Triton 3.9, 2026-12-06), where a T4 or A100 user's cache would have
    stopped at its first write. An instruction a target lacks fails here, in CI, rather than on that user's GPU. One
    fresh process an architecture, two at a time (about 75 s each on one core of the CI's kind)."""
    from concurrent.futures import ThreadPoolExecutor

    from hf_kvcache.bench.compiles import ARCHS, FAMILIES, _fresh_process

    archs = [arch for arch in ARCHS if arch != 90]
    with ThreadPoolExecutor(2) as pool:
        found = dict(zip(archs, pool.map(lambda arch: _fresh_process("archs", ",".join(FAMILIES), arch), archs)))
    assert all(set(failed) == set(FAMILIES) for failed in found.values())
    bad = {arch: {spec: errors for spec, errors in failed.items() if errors} for arch, failed in found.items()}
    assert not any(bad.values()), bad


def test_warm_up_compiles_every_variant_the_calls_launch():
    """`hf_kvcache.warm_up` (its compiles on a pool of threads, for sm_90 here): after it, a prompt in chunks with
    decode steps, two next turns, a fresh cache, and one whose short prompt leaves KIVI's packed values empty for its
    decode steps (on the H100 on 2026-12-05 those compiled two more variants, their pointers' dtypes the dummies')
    compile nothing more."""
    from hf_kvcache.bench.compiles import _census_in_fresh_process

    found = _census_in_fresh_process("kivi-2", 64, 90, warm=True)
    assert found["warm_up"]["kernels"] >= 6 and found["warm_up"]["seconds"] > 0
    assert [(c["call"], c["error"], c["compiles"]) for c in found["calls"]] == [
        ("prompt", None, []), ("turn", None, []), ("turn", None, []), ("prompt", None, []), ("prompt", None, [])]


def test_tiles_built_from_codes_reach_the_products_as_16_bit_operands():
    """The tiles of `int4-g32` (grouped fp16 planes) and `turboquant-3` (looked-up codebook tiles) go through
    `tiles.opaque`: compiled for sm_90, every product's operands take the 16-bit layout (kWidth 2, read by
    ldmatrix) where Triton, following the loads, views and joins back to the codes, gave them the 8-bit one (kWidth
    4) and ptxas copied each fragment into place before every mma. Triton 3.6: 42.8 -> 32.7 and 60.5 -> 48.1
    instructions a held token (on the H100 at batch 16 x 32k, 472.4 -> 414.0 and 547.6 -> 506.7 us a layer); Triton
    3.9 no longer halves the width at a join (`turboquant-3` is 48.2 without the copy) but still follows the bytes
    (`int4-g32` 42.3)."""
    from hf_kvcache.bench import BenchConfig, sass_part

    rows = sass_part(BenchConfig(parts=("sass",), methods=("int4-g32", "turboquant-3")), log=lambda line: None)
    for row, kernel, most in zip(rows, ("_attn_fwd", "_turbo_attn"), (37, 52)):
        assert row["kernel"] == kernel and row["k_widths"] == [2], row["method"]
        assert row["opcodes"].get("LDSM", 0) > 0 and row["instructions_per_token"] < most, row["method"]


def test_the_tile_loop_is_the_longest_backward_branch():
    """`bench.sass.tile_loop` on hand-written machine code: the longest span from a backward branch's target to the
    branch, predicates dropped; a forward branch is no loop."""
    from hf_kvcache.bench.sass import opcode_counts, tile_loop

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   BRA 0x40 ;
        /*0020*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0030*/              @!P0 IMAD.MOV.U32 R2, RZ, RZ, R3 ;
        /*0040*/               @P1 BRA 0x20 ;
        /*0050*/                   LDS.64 R2, [R3] ;
        /*0060*/                   BRA 0x50 ;
        /*0070*/                   EXIT ;
    """
    loop = tile_loop(sass)
    assert loop == ["HMMA.16816.F32 R4, R8, R12, R4", "IMAD.MOV.U32 R2, RZ, RZ, R3", "BRA 0x20"]
    assert opcode_counts(loop) == {"HMMA": 1, "IMAD": 1, "BRA": 1}
    assert tile_loop("/*0000*/ EXIT ;") == []


def test_the_sass_part_counts_a_decode_kernel_for_sm90_without_a_gpu():
    """`hf-kvcache bench --parts sass` on the CPU: fp8-e4m3's decode body compiled for sm_90, its tile loop found,
    its products on tensor cores, its bytes a token those of fp8 keys and values (2 x 128 bytes and their share of
    the per-head scales)."""
    from hf_kvcache.bench import BenchConfig, sass_part

    lines = []
    (row,) = sass_part(BenchConfig(parts=("sass",), methods=("fp8-e4m3",)), log=lines.append)
    assert row["kernel"] == "_attn_fwd" and row["opcodes"].get("HMMA", 0) > 0
    assert 256 <= row["bytes_per_token"] < 257 and row["of_fp8_issue"] == 1.0
    assert 5 < row["instructions_per_token"] < 200 and "fp8-e4m3" in lines[0]
