"""`results/` stays small and honest: every run directory holds its data and `COMMAND.md` (the commands that made it,
the date, the commit), no script (one-off scripts live in git history: `git show <commit>:results/<run>/<script>`),
and `results/README.md` indexes it, saying truly which files cite it. BENCHMARKS.md (what holds now, at most 400
lines) names only run directories that exist."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _runs() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir() if p.is_dir())


def test_every_run_directory_has_its_command_file():
    missing = [run for run in _runs() if not (RESULTS / run / "COMMAND.md").is_file()]
    assert not missing, f"run directories without COMMAND.md (the commands, date and commit of the run): {missing}"


def test_results_hold_no_script():
    scripts = sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.suffix in (".py", ".sh"))
    assert not scripts, (f"scripts under results/: {scripts}; name them in the run's COMMAND.md and leave them to git "
                         "history (a job a current command does is written as that command)")


def test_the_index_lists_every_run_directory():
    indexed = re.findall(r"^\| `([^`]+)` \|", (RESULTS / "README.md").read_text(), flags=re.M)
    runs = _runs()
    assert len(indexed) == len(set(indexed)), "results/README.md lists a run twice"
    missing, gone = sorted(set(runs) - set(indexed)), sorted(set(indexed) - set(runs))
    assert not missing, f"runs missing from results/README.md's index: {missing}"
    assert not gone, f"results/README.md lists runs that are gone: {gone}"


# ---------------------------------------------------------------------- the index's "cited by" column, BENCHMARKS.md

ROOT = RESULTS.parent
BENCHMARKS = ROOT / "BENCHMARKS.md"
# The files whose naming of a run the index's "cited by" column records (only where the file holds the run's full
# directory name); README.md, docs/readme_sources.json (the README's figures come from those runs) and BENCHMARKS.md
# must be recorded whenever they name a run.
CITERS = ("README.md", "docs/readme_sources.json", "docs/methods.md", "hf_kvcache/data/measured.json", "BENCHMARKS.md")
MUST_BE_RECORDED = ("README.md", "docs/readme_sources.json", "BENCHMARKS.md")
# A run directory's name: what `hf-kvcache eval` / `compare` / `report` / `lm-eval` and the GPU runs write.
RUN_NAME = r"(?:bench|eval|compare|report|lm-eval|tests)__[\w.+-]+"


def _names(text: str, run: str) -> bool:
    """Whether `text` names `run` by its full directory name (not a longer name it begins, nor a tail of it)."""
    return re.search(rf"(?<![\w.+-]){re.escape(run)}(?![\w+-])", text) is not None


def _cited_by() -> dict[str, list[str]]:
    """Each indexed run's "cited by" cell (the table's last column), split into the files it names; [] for "-"."""
    cells = {}
    for run, cell in re.findall(r"^\| `([^`]+)` \|.*\| ([^|]*?) \|$", (RESULTS / "README.md").read_text(), flags=re.M):
        cells[run] = [] if cell.strip() == "-" else [f.strip() for f in cell.split(",")]
    return cells


def test_the_index_says_which_files_cite_each_run_and_they_do():
    cited = _cited_by()
    assert sorted(cited) == _runs(), "results/README.md's index rows do not parse as | `run` | ... | cited by |"
    unknown = {run: files for run, files in cited.items() if set(files) - set(CITERS)}
    assert not unknown, (f"'cited by' names files other than {CITERS} (or is not a comma-separated list, or '-'): "
                         f"{unknown}")
    texts = {f: (ROOT / f).read_text() for f in CITERS}
    false = sorted(f"{run}: {f}" for run, files in cited.items() for f in files if not _names(texts[f], run))
    assert not false, f"results/README.md says these files cite a run whose directory name they do not contain: {false}"
    for f in MUST_BE_RECORDED:
        unrecorded = sorted(run for run in _runs() if _names(texts[f], run) and f not in cited[run])
        assert not unrecorded, f"{f} names these runs, but results/README.md's 'cited by' does not say so: {unrecorded}"


def test_benchmarks_stays_within_400_lines():
    lines = BENCHMARKS.read_text().splitlines()
    assert len(lines) <= 400, (f"BENCHMARKS.md has {len(lines)} lines: it says what holds now; the dated history is "
                               "in git (`git log -p BENCHMARKS.md`)")


def test_every_run_directory_benchmarks_names_exists():
    """Every `results/<dir>` and every bare run name (`bench__...`, `eval__...`) BENCHMARKS.md writes is a run directory
    under results/ (a glob such as `bench__h100__*` names none; a file inside a run, `results/<run>/x.json`, names
    its run)."""
    named = set()
    for token in re.findall(r"[\w.+*/-]+", BENCHMARKS.read_text()):
        if "/" in token:
            if "results/" not in token:
                continue
            name = token.split("results/", 1)[1].split("/")[0].rstrip(".")
            if name and name != "README.md":
                named.add(name)
        elif re.fullmatch(RUN_NAME, token.rstrip(".")) and "*" not in token:
            named.add(token.rstrip("."))
    assert named, "BENCHMARKS.md names no run directory: each figure names the run that measured it"
    missing = sorted(name for name in named if not (RESULTS / name).is_dir())
    assert not missing, f"BENCHMARKS.md names run directories that results/ does not hold: {missing}"
