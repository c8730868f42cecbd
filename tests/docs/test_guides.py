"""The "adding a ..." guides in docs/ run: each page's one ```python block is executed as written,
so a guide that drifts from the code fails here.  Also: the README stays a short user guide whose
relative links (and those of docs/) point at files and headings that exist."""

from __future__ import annotations

import re
import sys
import time
import types
from pathlib import Path

import pytest

from fedsim import registry

ROOT = Path(__file__).resolve().parents[2]
GUIDES = ["adding-a-strategy.md", "adding-a-learner.md", "adding-a-dataset.md", "adding-a-centralised-method.md"]
GUIDE_MODULE = "docs_guide_"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

pytestmark = pytest.mark.usefixtures("one_thread")


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


@pytest.fixture
def clean_registries():
    """The guides register toy components; remove them afterwards so a guide can run again (built-in
    components that the run imported stay registered: their modules are imported once)."""
    yield
    for r in registry.REGISTRIES:
        for name in [n for n, e in r._entries.items() if e.module.startswith(GUIDE_MODULE)]:
            del r._entries[name]


@pytest.mark.parametrize("name", GUIDES)
def test_guide_example_runs(name: str, in_tmp, clean_registries) -> None:
    page = ROOT / "docs" / name
    blocks = python_blocks(page)
    assert len(blocks) == 1, f"{name}: expected exactly one ```python block (the worked example), got {len(blocks)}"
    module = types.ModuleType(f"{GUIDE_MODULE}{name[:-3].replace('-', '_')}")  # a real module: dataclasses need one
    module.__file__ = str(page)
    sys.modules[module.__name__] = module
    start = time.perf_counter()
    try:
        exec(compile(blocks[0], str(page), "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    assert time.perf_counter() - start < 30, f"{name}: the worked example should take seconds"


def test_readme_is_a_short_guide_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    make = (ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        assert re.search(rf"^make {target}\s+#", readme, re.M), f"README lost `make {target}`"
        assert re.search(rf"^{target}:", make, re.M)
    assert "fedsim run fedsvd --eps 3" in readme and "fedsim run fedsvd --eps 3" in make


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # links inside code are not links
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.relative_to(ROOT)}: broken link {target}"
        if anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", dest.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page.relative_to(ROOT)}: no heading for #{anchor} in {path}"
