"""The registry: lookup errors list known names; params validated against dataclasses; lookups import
only the module the manifest names."""

from __future__ import annotations

import sys
import types

import pytest

from fedsim.errors import ConfigError
from fedsim.registry import DATASETS, ENGINES, LEARNERS, MODELS, PARTITIONERS, STRATEGIES, Registry


def test_builtins_registered() -> None:
    assert {"mnist", "digits", "synthetic"} <= set(DATASETS.names())
    assert {"iid", "dirichlet", "pathological", "shard"} <= set(PARTITIONERS.names())
    assert {"mlp", "cnn"} <= set(MODELS.names())
    assert "supervised" in LEARNERS.names() and "fedavg" in STRATEGIES.names()


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(ConfigError, match="unknown model .resnet.*cnn.*mlp"):
        MODELS.get("resnet")


def test_params_validated_by_key() -> None:
    assert MODELS.params("mlp", {"hidden": [32, 16]}, "model.params").hidden == [32, 16]
    with pytest.raises(ConfigError, match=r"model.params.hiden.*accepts: hidden"):
        MODELS.params("mlp", {"hiden": [3]}, "model.params")
    with pytest.raises(ConfigError, match="model.params.dropout"):
        MODELS.params("mlp", {"dropout": "lots"}, "model.params")
    with pytest.raises(ConfigError, match="takes no params"):
        STRATEGIES.params("fedavg", {"x": 1}, "strategy.params")


# -- the lazy manifest ---------------------------------------------------------------------------
@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """``plugin(registry, {module: source})`` writes plugin modules registering into ``registry`` (as
    ``_fake_reg.REG``); they leave ``sys.modules`` with the test."""
    written: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(registry: Registry, modules: dict[str, str]) -> None:
        monkeypatch.setitem(sys.modules, "_fake_reg", types.SimpleNamespace(REG=registry))
        for module, body in modules.items():
            (tmp_path / f"{module}.py").write_text(f"from _fake_reg import REG\n{body}\n")
            written.append(module)

    yield write
    for module in written:
        sys.modules.pop(module, None)


def test_names_and_membership_import_nothing(plugin) -> None:
    reg: Registry[object] = Registry("thing", modules={"a": "_plug_a", "b": "_plug_b"})
    plugin(reg, {"_plug_a": "REG.register('a')(len)", "_plug_b": "REG.register('b')(abs)"})
    assert reg.names() == ["a", "b"] and "a" in reg and "c" not in reg
    with pytest.raises(ConfigError, match=r"^unknown thing 'c'; known things: a, b$"):
        reg.get("c")
    assert "_plug_a" not in sys.modules and "_plug_b" not in sys.modules


def test_lookup_imports_only_the_module_of_the_name(plugin) -> None:
    reg: Registry[object] = Registry("thing", modules={"a": "_plug_a", "b": "_plug_b"})
    plugin(reg, {"_plug_a": "REG.register('a')(len)", "_plug_b": "REG.register('b')(abs)"})
    assert reg.get("a") is len
    assert "_plug_a" in sys.modules and "_plug_b" not in sys.modules
    assert [e.name for e in reg] == ["a", "b"] and "_plug_b" in sys.modules  # iterating loads them all


def test_already_registered_names_work_without_a_manifest_line() -> None:
    reg: Registry[object] = Registry("thing", modules={})
    reg.register("dummy", summary="a test dummy")(len)
    assert reg.names() == ["dummy"] and "dummy" in reg and reg.entry("dummy").summary == "a test dummy"


def test_manifest_line_that_does_not_register_is_an_error(plugin) -> None:
    reg: Registry[object] = Registry("thing", modules={"a": "_plug_a"})
    plugin(reg, {"_plug_a": "X = 1"})
    with pytest.raises(RuntimeError, match="manifest says thing 'a' is registered by _plug_a"):
        reg.get("a")


def test_registering_a_name_twice_is_an_error() -> None:
    reg: Registry[object] = Registry("thing", modules={})
    reg.register("x")(len)
    reg.register("x")(len)  # the same object again (a re-import) is fine
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("x")(abs)


def test_engines_declare_their_capabilities() -> None:
    assert ENGINES.names() == ["flower", "local", "ray"]
    assert {e.name: e.obj.checkpointing for e in ENGINES} == {"flower": False, "local": True, "ray": True}
    assert ENGINES.checkpointing_names() == ["local", "ray"]
    assert ENGINES.get("flower").preflight is not None and ENGINES.get("local").preflight is None


def test_validated_params_are_memoised_but_each_caller_owns_its_copy() -> None:
    from fedsim.registry import STRATEGIES

    first = STRATEGIES.params("fedprox", {"mu": 0.5}, "strategy.params")
    first.mu = 99.0  # a caller changing its instance
    again = STRATEGIES.params("fedprox", {"mu": 0.5}, "strategy.params")
    assert again.mu == 0.5 and again is not first
    assert STRATEGIES.params("fedprox", {"mu": 0.25}, "strategy.params").mu == 0.25
    with pytest.raises(ConfigError, match="strategy.params"):  # errors are never memoised
        STRATEGIES.params("fedprox", {"mu": "x"}, "strategy.params")
    with pytest.raises(ConfigError, match="strategy.params"):
        STRATEGIES.params("fedprox", {"mu": "x"}, "strategy.params")
