"""The README's quickstart, as a user copies it: it runs on the installed transformers (the latest pin and 5.17) on
the embedded default model, and raises no deprecation warning (transformers 5.24+ deprecate `past_key_values=`)."""

from __future__ import annotations

import re
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
