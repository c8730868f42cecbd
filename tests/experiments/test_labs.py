"""The teaching labs execute top to bottom (on reduced settings: FEDSIM_LAB_QUICK=1) and end with exercises."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

LABS = sorted((Path(__file__).resolve().parents[2] / "experiments" / "labs").glob("*.ipynb"))


def test_there_are_labs_and_each_explains_and_ends_with_exercises() -> None:
    assert len(LABS) >= 3
    for path in LABS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# Lab")
        assert nb.cells[-1].cell_type == "markdown" and "## Exercises" in nb.cells[-1].source
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{path.name}: clear outputs"


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_lab_runs(path: Path, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDSIM_LAB_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "a lab shows at least one plot"
