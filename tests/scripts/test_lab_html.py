"""scripts/lab_html.py: the executed HTML copies of the labs (docs/labs) are made from the current notebooks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.script_modules import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lab_html():
    return load_script("scripts/lab_html.py")


def test_every_lab_has_a_copy_made_from_its_current_notebook(lab_html, capsys) -> None:
    assert lab_html.lab_names() == sorted(p.stem for p in (ROOT / "experiments" / "labs").glob("*.ipynb"))
    code = lab_html.main(["--check"])
    assert code == 0, capsys.readouterr().out  # "docs/labs/X.html is stale: run python scripts/lab_html.py X"


def test_a_changed_cell_makes_a_copy_stale_and_outputs_do_not(lab_html, tmp_path, monkeypatch, capsys) -> None:
    name = "04_forgetting_and_tta"
    labs, html = tmp_path / "labs", tmp_path / "html"
    labs.mkdir(), html.mkdir()
    shutil.copy(lab_html.LABS_DIR / f"{name}.ipynb", labs)
    shutil.copy(lab_html.HTML_DIR / f"{name}.html", html)
    monkeypatch.setattr(lab_html, "LABS_DIR", labs)
    monkeypatch.setattr(lab_html, "HTML_DIR", html)
    assert lab_html.stale_labs() == []
    notebook = labs / f"{name}.ipynb"
    nb = json.loads(notebook.read_text())
    nb["cells"][1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["ran\n"]}]
    nb["cells"][1]["execution_count"], nb["metadata"]["extra"] = 1, True
    notebook.write_text(json.dumps(nb))
    assert lab_html.stale_labs() == []  # outputs, counts and metadata are not what a copy shows of the notebook
    nb["cells"][-1]["source"][-1] += " (edited)"
    notebook.write_text(json.dumps(nb))
    assert lab_html.stale_labs() == [name]
    assert lab_html.main(["--check"]) == 1
    assert capsys.readouterr().out == f"docs/labs/{name}.html is stale: run python scripts/lab_html.py {name}\n"
    (html / f"{name}.html").unlink()
    assert lab_html.stale_labs() == [name]  # no copy at all


def test_an_unknown_lab_is_one_line(lab_html, capsys) -> None:
    assert lab_html.main(["05_nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lab_html: unknown lab '05_nope'; choose from 01_fedavg_heterogeneity")
