"""The plugin manifest is the only way in: it lists every built-in registration, and lookups import
only what they need (a config check never imports the centralised track, transformers or Ray)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from fedsim import plugins

ROOT = Path(__file__).resolve().parents[2]

#: Imports every module of the plugin packages, then prints what got registered where (and what failed).
_IMPORT_ALL = """
import importlib, json, pkgutil
from fedsim import plugins
from fedsim.registry import REGISTRIES

failed = {}
def walk(package):
    pkg = importlib.import_module(package)
    yield package
    for info in pkgutil.walk_packages(pkg.__path__, package + ".", onerror=lambda name: None):
        yield info.name

for package in plugins.PLUGIN_PACKAGES:
    for module in walk(package):
        try:
            importlib.import_module(module)
        except ImportError as exc:  # an optional heavy dependency missing (there should be none)
            failed[module] = repr(exc)
found = {r.kind: {e.name: e.module for e in r._entries.values()} for r in REGISTRIES}
print(json.dumps({"found": found, "failed": failed}))
"""


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter at the repository root."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def _loaded(code: str, prefixes: tuple[str, ...]) -> dict[str, object]:
    """Run ``code`` (which sets ``result``) in a fresh interpreter; return ``result`` and the loaded
    modules under ``prefixes``."""
    proc = _python(textwrap.dedent(code) + textwrap.dedent(f"""
        import json, sys
        hits = sorted(m for m in sys.modules if m.split(".")[0] in {prefixes!r})
        print(json.dumps({{"result": result, "modules": hits}}))
    """))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_manifest_lists_every_registration() -> None:
    """Importing every plugin module registers exactly the manifest's names, each where it says."""
    proc = _python(_IMPORT_ALL)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not out["failed"], f"plugin modules failed to import: {out['failed']}"
    expected = {kind: dict(table) for kind, table in plugins.BUILTINS.items()}
    found = {kind: table for kind, table in out["found"].items() if table or kind in expected}
    assert found == expected, "a registration without its line in fedsim/plugins.py (or a stale line)"


def test_manifest_modules_exist() -> None:
    """Every module the manifest names is a real file of a plugin package."""
    for module in plugins.all_modules():
        assert module.startswith(plugins.PLUGIN_PACKAGES), module
        path = ROOT / Path(*module.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), module


def test_print_config_imports_no_heavy_plugin() -> None:
    """Building and validating a federated config imports neither the centralised track nor its libraries."""
    out = _loaded("""
        from fedsim.cli import main
        result = main(["run", "fedavg_digits", "--print-config"])
    """, ("central", "transformers", "ray"))
    assert out == {"result": 0, "modules": []}


def test_unknown_strategy_imports_no_plugin(capsys) -> None:
    """A typo in a component name is reported from the manifest, before any plugin module loads."""
    out = _loaded("""
        from fedsim.cli import main
        result = main(["run", "fedavg_digits", "strategy.name=fedadamx"])
    """, ("clients", "central", "strategies", "transformers", "ray"))
    assert out == {"result": 2, "modules": []}


def test_unknown_strategy_message_lists_manifest_names() -> None:
    proc = _python("""
        from fedsim.cli import main
        raise SystemExit(main(["run", "fedavg_digits", "strategy.name=fedadamx"]))
    """)
    assert proc.returncode == 2
    known = ", ".join(sorted(plugins.BUILTINS["strategy"]))
    assert f"unknown strategy 'fedadamx'; known strategies: {known}" in proc.stderr
    assert "strategys" not in proc.stderr


def test_lookup_imports_only_its_module() -> None:
    """``STRATEGIES.get("fedavg")`` imports the module of ``fedavg``, not the other strategies."""
    out = _loaded("""
        from fedsim.registry import STRATEGIES
        STRATEGIES.get("fedavg")
        result = "fedprox" in STRATEGIES and len(STRATEGIES.names())
    """, ("strategies", "central", "clients"))
    assert out["result"] == len(plugins.BUILTINS["strategy"])
    assert [m for m in out["modules"] if m != "strategies"] == ["strategies.flower_builtin"]
