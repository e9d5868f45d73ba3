"""`results/` stays small and honest: every run directory holds its data and `COMMAND.md` (the commands that made it,
the date, the commit), no script (one-off scripts live in git history: `git show <commit>:results/<run>/<script>`),
and `results/README.md` indexes it."""

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
