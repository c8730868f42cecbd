"""One registry for every named component (strategies, learners, datasets, models, partitioners).

Components register themselves when their package is imported::

    from fedsim.registry import STRATEGIES

    @STRATEGIES.register("fedavg", params=FedAvgParams)
    def build_fedavg(ctx, params): ...

The core never imports a concrete component: :func:`load_plugins` imports the component packages by
name, and the engine looks components up by the keys an experiment YAML gives.  A component may
declare a ``params`` dataclass; :meth:`Registry.params` validates the YAML's ``params`` mapping
against it, so unknown keys and wrong types are errors that name the key.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, Mapping, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedsim.errors import ConfigError

T = TypeVar("T")

#: Packages whose import registers the built-in components (imported by name, never directly).
PLUGIN_PACKAGES: tuple[str, ...] = ("envs", "fedsim.models", "clients", "privacy", "strategies", "central")


@dataclass(frozen=True)
class Entry(Generic[T]):
    """A registered component: the object, its params dataclass (or None) and a one-line summary."""

    name: str
    obj: T
    params: type | None
    summary: str


class Registry(Generic[T]):
    """A named table of components of one kind."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, *, params: type | None = None, summary: str = "") -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name``; ``params`` is its typed params dataclass."""
        if params is not None and not dataclasses.is_dataclass(params):
            raise TypeError(f"params for {self.kind} {name!r} must be a dataclass, got {params!r}")

        def deco(obj: T) -> T:
            if name in self._entries and self._entries[name].obj is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            doc = summary or (getattr(obj, "__doc__", None) or "").strip().split("\n")[0]
            self._entries[name] = Entry(name, obj, params, doc)
            return obj

        return deco

    def entry(self, name: str) -> Entry[T]:
        load_plugins()
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "none"
            raise ConfigError(f"unknown {self.kind} {name!r}; known {self.kind}s: {known}") from None

    def get(self, name: str) -> T:
        return self.entry(name).obj

    def params(self, name: str, values: Mapping[str, Any] | None, where: str) -> Any:
        """Validate ``values`` against the params dataclass of ``name``; return a typed instance.

        ``where`` is the config path of the mapping (e.g. ``"model.params"``) used in errors.
        """
        entry = self.entry(name)
        values = dict(values or {})
        if entry.params is None:
            if values:
                raise ConfigError(f"{where}: {self.kind} {name!r} takes no params, got {sorted(values)}")
            return None
        try:
            merged = OmegaConf.merge(OmegaConf.structured(entry.params), values)
            return OmegaConf.to_object(merged)
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or ""
            fields = ", ".join(f.name for f in dataclasses.fields(entry.params))
            msg = str(exc).splitlines()[0]
            raise ConfigError(
                f"{where}.{key}: {msg} ({self.kind} {name!r} accepts: {fields})" if key
                else f"{where}: {msg} ({self.kind} {name!r} accepts: {fields})"
            ) from None

    def names(self) -> list[str]:
        load_plugins()
        return sorted(self._entries)

    def __iter__(self) -> Iterator[Entry[T]]:
        load_plugins()
        return iter(sorted(self._entries.values(), key=lambda e: e.name))

    def __contains__(self, name: object) -> bool:
        load_plugins()
        return name in self._entries


STRATEGIES: Registry[Any] = Registry("strategy")
LEARNERS: Registry[Any] = Registry("learner")
DATASETS: Registry[Any] = Registry("dataset")
MODELS: Registry[Any] = Registry("model")
PARTITIONERS: Registry[Any] = Registry("partitioner")
CENTRAL: Registry[Any] = Registry("centralised method")

_loaded = False


def load_plugins() -> None:
    """Import the built-in component packages once so that they register themselves."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for pkg in PLUGIN_PACKAGES:
        importlib.import_module(pkg)
