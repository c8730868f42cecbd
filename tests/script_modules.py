"""Import a repository script (``scripts/*.py``, ``benchmarks/*.py``: not packages) as a module in a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str, *, register: bool = False) -> ModuleType:
    """The module of ``ROOT / relative_path``, executed afresh; ``register=True`` keeps one copy in
    ``sys.modules`` under its stem (needed to ship its functions to Ray workers by value)."""
    path = ROOT / relative_path
    if register and path.stem in sys.modules:
        return sys.modules[path.stem]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
