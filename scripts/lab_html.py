"""Executed HTML copies of the teaching labs (``docs/labs/<lab>.html``), and whether they are current.

Each copy is its notebook (``experiments/labs/<lab>.ipynb``, kept without outputs) run top to bottom
at the lab's full settings (no ``FEDSIM_LAB_QUICK``) in this environment's Python kernel, with a first
cell saying so, exported by nbconvert.  The copy carries the SHA-256 of the notebook's cell sources
(``<meta name="fedsim-lab-sources-sha256">``): ``tests/docs/test_lab_html.py`` fails when a notebook
changed after its copy was made, naming the command that makes it again.

    python scripts/lab_html.py 04_forgetting_and_tta     # execute and export one lab (or several)
    python scripts/lab_html.py --check                   # which copies are stale (exit 1 if any)

Needs nbconvert (``pip install -e '.[labs]'``, which ``make lab`` installs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABS_DIR, HTML_DIR = ROOT / "experiments" / "labs", ROOT / "docs" / "labs"
STAMP = "fedsim-lab-sources-sha256"
_STAMP_RE = re.compile(rf'<meta name="{STAMP}" content="([0-9a-f]{{64}})"/>')


def sources_digest(notebook_path: Path) -> str:
    """SHA-256 of the notebook's cells (type and source, in order): what a reader of the copy sees
    besides the outputs; outputs, ids and metadata do not count."""
    cells = json.loads(notebook_path.read_text(encoding="utf-8"))["cells"]
    sources = [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"]) for c in cells]
    return hashlib.sha256(json.dumps(sources, ensure_ascii=False).encode()).hexdigest()


def stamped_digest(html_path: Path) -> str | None:
    """The digest a copy was made from (None: no stamp, or no copy)."""
    if not html_path.exists():
        return None
    match = _STAMP_RE.search(html_path.read_text(encoding="utf-8", errors="replace"))
    return match.group(1) if match else None


def stale_labs(names: list[str] | None = None) -> list[str]:
    """The labs whose HTML copy is missing, unstamped or made from other notebook sources."""
    return [name for name in (names or lab_names())
            if stamped_digest(HTML_DIR / f"{name}.html") != sources_digest(LABS_DIR / f"{name}.ipynb")]


def lab_names() -> list[str]:
    return sorted(p.stem for p in LABS_DIR.glob("*.ipynb"))


def _machine() -> str:
    return f"a {os.cpu_count() or 1}-core CPU machine"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def make_copy(name: str, timeout_s: int = 3600) -> float:
    """Execute lab ``name`` at full settings and write its stamped HTML copy; returns the seconds it ran."""
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    notebook_path = LABS_DIR / f"{name}.ipynb"
    digest = sources_digest(notebook_path)
    nb = nbformat.read(notebook_path, as_version=4)
    env_quick = os.environ.pop("FEDSIM_LAB_QUICK", None)  # the kernel inherits this environment
    os.environ.setdefault("MPLBACKEND", "Agg")
    start = time.monotonic()
    try:
        NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                       resources={"metadata": {"path": str(LABS_DIR)}}).execute()
    finally:
        if env_quick is not None:
            os.environ["FEDSIM_LAB_QUICK"] = env_quick
    seconds = time.monotonic() - start
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    if errors:
        raise SystemExit(f"lab {name}: a cell raised {errors[0].get('ename')}: {errors[0].get('evalue')}; "
                         f"no copy written")
    note = nbformat.v4.new_markdown_cell(
        f"*Executed copy of [`experiments/labs/{name}.ipynb`](../../experiments/labs/{name}.ipynb) at the lab's "
        f"full settings (not `FEDSIM_LAB_QUICK`), run top to bottom with fedsim's `.venv` on {_machine()} "
        f"({_duration(seconds)}) by `python scripts/lab_html.py {name}`; the notebook itself is kept without "
        f"outputs. Solutions to the exercises: [teacher notes](teacher-notes.md).*")
    nb.cells.insert(0, note)
    body, _ = HTMLExporter().from_notebook_node(nb, resources={"metadata": {"name": f"{name}"}})
    body = body.replace("<head>", f'<head>\n<meta name="{STAMP}" content="{digest}"/>', 1)
    HTML_DIR.mkdir(parents=True, exist_ok=True)
    tmp = HTML_DIR / f".{name}.html.tmp"
    tmp.write_text(body, encoding="utf-8")
    tmp.replace(HTML_DIR / f"{name}.html")  # a copy is whole or not there
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("labs", nargs="*", help="lab names (default: every lab in experiments/labs)")
    ap.add_argument("--check", action="store_true", help="only report stale copies (exit 1 if any)")
    args = ap.parse_args(argv)
    known = lab_names()
    unknown = [n for n in args.labs if n not in known]
    if unknown:
        print(f"lab_html: unknown lab {unknown[0]!r}; choose from {', '.join(known)}", file=sys.stderr)
        return 2
    names = args.labs or known
    if args.check:
        stale = stale_labs(names)
        for name in stale:
            print(f"docs/labs/{name}.html is stale: run python scripts/lab_html.py {name}")
        return 1 if stale else 0
    try:
        import nbconvert  # noqa: F401
    except ImportError:
        print("lab_html: nbconvert is missing; install it with pip install -e '.[labs]' (make lab does)",
              file=sys.stderr)
        return 2
    for name in names:
        print(f"{name}: running at full settings ...", flush=True)
        print(f"{name}: docs/labs/{name}.html written ({_duration(make_copy(name))})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
