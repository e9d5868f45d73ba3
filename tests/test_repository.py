"""The repository's root shadows no installed package.

Python puts the working directory first on `sys.path` for `python -c`, `python -m` and a notebook started there,
so a top-level folder or module of the repository named like an installed distribution's top-level package
replaces that package for everything run from the root. A top-level `kernels/` did: transformers 5.25's
`transformers.integrations.hub_kernels` runs `from kernels import CUDAProperties` (HuggingFace's `kernels`
package), which then found our Triton kernels instead. They live in `hf_kvcache/kernels/` now.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OWN_DISTRIBUTION = "hf-kvcache"

# Run from the root: import what transformers imports, then name every module that came from the repository.
_IMPORT_FROM_ROOT = """
import json, sys
from pathlib import Path
import {module}
root = Path.cwd().resolve()
environment = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix)]  # a .venv inside the root is not ours
found = {{}}
for name, mod in list(sys.modules.items()):
    path = getattr(mod, "__file__", None)
    if not path or not Path(path).is_absolute():  # torch.ops' __file__ is "_ops.py": no file
        continue
    path = Path(path).resolve()
    if path.is_relative_to(root) and not any(path.is_relative_to(env) for env in environment):
        found[name] = str(path)
print(json.dumps(found))
"""


def importable_names(root: Path) -> dict[str, Path]:
    """`{top-level import name: entry}` of a folder's entries: folders (regular or namespace packages) and Python
    modules (`.py`, extension modules). Hidden entries (`.venv`, `.ci`) and non-identifiers are never imported."""
    names = {}
    for entry in root.iterdir():
        if entry.is_dir():
            name = entry.name
        elif entry.suffix in (".py", ".so", ".pyd"):
            name = entry.name.split(".")[0]
        else:
            continue
        if name.isidentifier():
            names[name] = entry
    return names


def test_no_top_level_entry_is_named_like_an_installed_package():
    """Every top-level name any installed distribution provides (`importlib.metadata.packages_distributions()`)
    against the root's folders and modules. A folder without `__init__.py` counts too: it joins (or, as a
    regular package next to an installed namespace package, takes over) the installed package."""
    installed = importlib.metadata.packages_distributions()
    assert "transformers" in installed and "torch" in installed  # the lookup sees this environment
    clashes = {
        name: (str(entry.relative_to(ROOT)), installed[name])
        for name, entry in importable_names(ROOT).items()
        if name in installed and set(installed[name]) != {OWN_DISTRIBUTION}
    }
    assert not clashes, (
        f"run from the repository's root, these entries shadow installed packages {clashes} (entry, distributions): "
        "move them under hf_kvcache/ (see docs/design.md, 'The repository')"
    )


def test_the_check_sees_a_shadowing_folder(tmp_path):
    """The walk above finds a package folder, a namespace folder and a module named like installed packages."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "transformers").mkdir()
    (tmp_path / "torch.py").write_text("")
    (tmp_path / ".venv").mkdir()
    (tmp_path / "README.md").write_text("")
    assert set(importable_names(tmp_path)) == {"kernels", "transformers", "torch"}


@pytest.mark.smoke
def test_transformers_hub_kernels_imports_from_the_repository_root():
    """`python -c "import transformers.integrations.hub_kernels"` from the root works and loads nothing from the
    repository. On 5.25 that module imports HuggingFace's `kernels` package unconditionally; 5.17's imports it only
    where `kernels` is installed (`is_kernels_available`), but the module exists on both, so both run this."""
    module = "transformers.integrations.hub_kernels"
    assert importlib.util.find_spec(module) is not None, f"{module} is gone: check what transformers imports now"
    run = subprocess.run([sys.executable, "-c", _IMPORT_FROM_ROOT.format(module=module)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"`import {module}` from {ROOT} failed:\n{run.stderr[-3000:]}"
    from_repository = json.loads(run.stdout.strip().splitlines()[-1])
    assert not from_repository, f"importing {module} from the root loaded these from the repository: {from_repository}"


def _documents_named(source: str) -> list[tuple[int, str]]:
    """`(line, name)` of every document (`.md`, `.ipynb`) or repository path of a module (a folder, a slash, a `.py`
    name) that a comment or docstring of Python `source` names."""
    import io
    import re
    import tokenize

    named = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.(?:md|ipynb)|(?:[\w.-]+/)+[\w-]+\.py)\b")
    found, previous = [], tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        docstring = tok.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT,
                                                                 tokenize.DEDENT)
        if tok.type == tokenize.COMMENT or docstring:
            found += [(tok.start[0] + tok.string[: m.start()].count("\n"), m.group(1))
                      for m in named.finditer(tok.string)]
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type
    return found


def test_no_docstring_or_comment_names_a_file_the_repository_lacks():
    """Docstrings and comments point readers to documents and modules of this repository only: fourteen named the
    design and style guides that live outside it. A name is found from the root, from the file's own
    folder, or as the tail of a tracked path (`kernels/decode.py`)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    paths = set(tracked)
    missing = []
    for file in tracked:
        if not file.endswith(".py"):
            continue
        for line, name in _documents_named((ROOT / file).read_text()):
            here = str(Path(file).parent / name)
            if not (name in paths or here in paths or any(p.endswith("/" + name) for p in paths)):
                missing.append(f"{file}:{line}: {name}")
    assert not missing, missing


def test_the_document_check_reads_comments_and_docstrings_only():
    source = '"""See DESIGN.md."""\nx = "NOTES.md"  # and docs/gone.md\ndef f():\n    """tests/x/y.py"""\n'
    assert _documents_named(source) == [(1, "DESIGN.md"), (2, "docs/gone.md"), (4, "tests/x/y.py")]
