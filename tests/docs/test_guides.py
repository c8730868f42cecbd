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


# -- issue #27: every code block of the README runs ---------------------------------------------------
BASH = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
PLACEHOLDER_RUN_ID = "0123456789abcdef0123456789abcdef"  # for PARENT_RUN_ID / RUN_ID in the README


def readme_fedsim_commands() -> list[list[str]]:
    """Every ``fedsim ...`` line of the README's ```bash blocks, as argv without the leading ``fedsim``."""
    import shlex

    lines = [line.strip() for block in BASH.findall((ROOT / "README.md").read_text()) for line in block.splitlines()]
    return [shlex.split(line, comments=True)[1:] for line in lines if line.startswith("fedsim ")]


def test_readme_python_blocks_run(in_tmp, monkeypatch) -> None:
    """Each ```python block of the README runs as written, in a fresh namespace, from an empty directory
    (the API tracks nothing unless asked; were a block to ask, the store would be this directory's)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    blocks = python_blocks(ROOT / "README.md")
    assert blocks, "the README lost its Python API example"
    for i, block in enumerate(blocks):
        namespace: dict = {"__name__": f"readme_block_{i}"}
        exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
    assert not (in_tmp / "fedsim-checkpoints").exists()


def test_readme_fedsim_commands_parse(in_tmp, capsys) -> None:
    """Each ``fedsim`` command of the README's ```bash blocks is valid: a ``run`` resolves its config
    (``--print-config``: no training), the other sub-commands parse their arguments and have --help."""
    from fedsim.cli import build_parser, main

    commands = readme_fedsim_commands()
    assert len(commands) >= 10, commands
    (in_tmp / "path" / "to").mkdir(parents=True)  # the README's `fedsim run path/to/my_experiment.yaml`
    (in_tmp / "path" / "to" / "my_experiment.yaml").write_text((ROOT / "experiments" / "fedavg.yaml").read_text())
    for argv in commands:
        argv = [PLACEHOLDER_RUN_ID if a in ("PARENT_RUN_ID", "RUN_ID") else a for a in argv]
        if argv[0] == "run":
            code = main([*argv, "--print-config"])
            captured = capsys.readouterr()
            assert code == 0 and not captured.err, f"fedsim {' '.join(argv)}: {captured.err}"
            assert "name:" in captured.out
            continue
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"fedsim {' '.join(argv)} does not parse: {capsys.readouterr().err} (exit {exc.code})")
        with pytest.raises(SystemExit) as exit_info:
            main([argv[0], "--help"])
        assert exit_info.value.code == 0 and "usage: fedsim" in capsys.readouterr().out
        if argv == ["list"]:
            assert main(argv) == 0 and capsys.readouterr().out.strip()
