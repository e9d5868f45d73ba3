"""The accuracy notebook runs top to bottom (quick setting), without a FutureWarning, and draws its figures."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "accuracy_exploration.ipynb"


@pytest.mark.slow
def test_accuracy_notebook_executes_and_draws_every_figure(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_KVCACHE_NOTEBOOK_QUICK", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend returns the figures
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # transformers' deprecations are FutureWarnings (a deprecated cache argument's among them): errors here.
    nb.cells.insert(0, nbformat.v4.new_code_cell('import warnings\nwarnings.simplefilter("error", FutureWarning)'))
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    images = [base64.b64decode(out["data"]["image/png"]) for cell in nb.cells if cell.cell_type == "code"
              for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    assert len(images) == 4, f"{len(images)} figures drawn, expected 4 (outliers, SQNR, perplexity, passkey)"
    assert all(len(png) > 20_000 for png in images)  # a drawn figure, not an empty canvas
