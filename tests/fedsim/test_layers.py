"""The import layering of ../shared/DESIGN.md, checked on the source: no module imports a layer above
its own, a strategy never imports a learner (nor a learner a strategy), and the core reaches plugins
only by name through the registry.

Every ``import``/``from ... import`` in the tree counts, at module level or inside a function, so a
lazy import cannot hide an upward edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fedsim", "algorithms", "privacy", "clients", "strategies", "envs", "central")

#: fedsim modules that wire the parts together and run them (the top layer).  Everything else in
#: fedsim/ (config, errors, seeding, registry, contracts, kernels, metrics, ...) is the kernel, the
#: bottom layer, and fedsim/models is a plugin package like envs/.
WIRING = ("fedsim.engine", "fedsim.runner", "fedsim.cli", "fedsim.__main__", "fedsim.api", "fedsim.reproduce",
          "fedsim.sweep", "fedsim.compare", "fedsim.tracking", "fedsim.store", "fedsim.run_lifecycle",
          "fedsim.central_runner", "fedsim.plots", "fedsim.progress", "fedsim.claims", "fedsim.claim_protocol",
          "fedsim.export", "fedsim.run_app")

#: Which layers each layer may import (besides itself).  The kernel imports nothing of ours above it;
#: the wiring reaches clients/, strategies/, envs/, models and central/ only through the registry.
ALLOWED: dict[str, set[str]] = {
    "kernel": set(),
    "privacy": {"kernel"},
    "envs": {"kernel"},
    "models": {"kernel", "envs"},
    "algorithms": {"kernel", "envs", "models"},
    "clients": {"kernel", "privacy", "envs", "models", "algorithms"},
    "strategies": {"kernel", "privacy", "envs", "models", "algorithms"},
    "central": {"kernel", "envs", "models"},
    "wiring": {"kernel", "privacy"},
}


def layer_of(module: str) -> str:
    top = module.split(".")[0]
    if top != "fedsim":
        return top
    if module == "fedsim":  # the package's face re-exports the Python API
        return "wiring"
    if module == "fedsim.models" or module.startswith("fedsim.models."):
        return "models"
    if any(module == w or module.startswith(w + ".") for w in WIRING):
        return "wiring"
    return "kernel"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every absolute import of one of our packages in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module in PACKAGES:  # "from fedsim import config": the submodules are imported
                names = [f"{node.module}.{a.name}" for a in node.names]
            out += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return [(line, m) for line, m in out if m.split(".")[0] in PACKAGES]


def violations() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            src = module_name(path)
            mine = layer_of(src)
            for line, target in imports_of(path):
                theirs = layer_of(target)
                if theirs != mine and theirs not in ALLOWED[mine]:
                    found.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {target} ({theirs})")
    return found


def test_no_module_imports_a_layer_it_must_not() -> None:
    assert violations() == []


@pytest.mark.parametrize("module, layer", [
    ("fedsim.config", "kernel"), ("fedsim.contracts.wire", "kernel"), ("fedsim.registry", "kernel"),
    ("fedsim.engine.server", "wiring"), ("fedsim.runner", "wiring"), ("fedsim.models.vision", "models"),
    ("clients.supervised", "clients"), ("algorithms.fedphoenix", "algorithms"),
])
def test_layer_of(module: str, layer: str) -> None:
    assert layer_of(module) == layer


def test_the_check_sees_an_upward_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker fails on a function-level import of a learner by a strategy, and of a plugin by the core."""
    for pkg, text in {"strategies": "def f():\n    from clients.supervised import SupervisedLearner\n",
                      "fedsim": "import strategies.lora\n"}.items():
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "bad.py").write_text(text)
    for pkg in set(PACKAGES) - {"strategies", "fedsim"}:
        (tmp_path / pkg).mkdir()
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    assert violations() == ["fedsim/bad.py:1 (kernel) imports strategies.lora (strategies)",
                            "strategies/bad.py:2 (strategies) imports clients.supervised (clients)"]
