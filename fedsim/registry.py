"""One registry for every named component (strategies, learners, datasets, models, partitioners, engines).

Components register themselves when their module is imported::

    from fedsim.registry import STRATEGIES

    @STRATEGIES.register("fedavg", params=FedAvgParams)
    def build_fedavg(ctx, params): ...

The core never imports a concrete component.  The manifest :data:`fedsim.plugins.BUILTINS` says which
module registers each built-in name: a lookup imports that one module, and the known names (for
``in``, :meth:`Registry.names` and the unknown-name error) come from the manifest without importing
anything.  A component registered by code already imported (a test's dummy) is found as well.
A component may declare a ``params`` dataclass; :meth:`Registry.params` validates the YAML's
``params`` mapping against it, so unknown keys and wrong types are errors that name the key.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, Mapping, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedsim import plugins
from fedsim.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    """A registered component: the object, its params dataclass (or None), a one-line summary and the
    module that defines it."""

    name: str
    obj: T
    params: type | None
    summary: str
    module: str = ""


class Registry(Generic[T]):
    """A named table of components of one kind, filled lazily from the manifest."""

    def __init__(self, kind: str, modules: Mapping[str, str] | None = None, *, plural: str | None = None) -> None:
        """``modules`` (``name -> module``) defaults to the manifest's table for ``kind``; ``plural`` is
        the kind's plural in messages (default: ``kind`` + "s", e.g. "strategy" needs "strategies")."""
        self.kind = kind
        self.plural = plural or f"{kind}s"
        self._entries: dict[str, Entry[T]] = {}
        self._modules: Mapping[str, str] = plugins.modules(kind) if modules is None else modules

    def register(self, name: str, *, params: type | None = None, summary: str = "") -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name``; ``params`` is its typed params dataclass."""
        if params is not None and not dataclasses.is_dataclass(params):
            raise TypeError(f"params for {self.kind} {name!r} must be a dataclass, got {params!r}")

        def deco(obj: T) -> T:
            self._add(name, obj, params, summary or _first_line(obj), getattr(obj, "__module__", ""))
            return obj

        return deco

    def _add(self, name: str, obj: T, params: type | None, summary: str, module: str) -> None:
        old = self._entries.get(name)
        if old is not None and old.obj is not obj and old.obj != obj:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = Entry(name, obj, params, summary, module)

    def entry(self, name: str) -> Entry[T]:
        """The entry of ``name``, importing the module the manifest names for it if need be."""
        if name not in self._entries:
            self.require(name)
            importlib.import_module(self._modules[name])
            if name not in self._entries:
                raise RuntimeError(f"the plugin manifest says {self.kind} {name!r} is registered by "
                                   f"{self._modules[name]}, but importing it did not register it")
        return self._entries[name]

    def require(self, name: str) -> None:
        """Raise the unknown-name :class:`ConfigError` unless ``name`` is known; imports nothing."""
        if name not in self:
            known = ", ".join(self.names()) or "none"
            raise ConfigError(f"unknown {self.kind} {name!r}; known {self.plural}: {known}")

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
        """Every known name: the manifest's and those already registered; imports nothing."""
        return sorted(set(self._modules) | set(self._entries))

    def load(self) -> None:
        """Import every built-in module of this registry."""
        for module in sorted(set(self._modules.values())):
            importlib.import_module(module)

    def __iter__(self) -> Iterator[Entry[T]]:
        """All entries (with summaries), sorted by name; imports this registry's modules only."""
        self.load()
        return iter(sorted(self._entries.values(), key=lambda e: e.name))

    def __contains__(self, name: object) -> bool:
        return name in self._modules or name in self._entries


@dataclass(frozen=True)
class Engine:
    """A registered engine: its run function and what it can do."""

    run: Callable[..., Any]
    #: The server keeps the node states, so runs on this engine checkpoint and resume.
    checkpointing: bool = False
    #: Checks run before anything starts (resources, backend config); called with the RunSpec.
    preflight: Callable[[Any], Any] | None = None


class EngineRegistry(Registry[Engine]):
    """The engines; an entry's object is an :class:`Engine` carrying the engine's capabilities."""

    def register(self, name: str, *, params: type | None = None, summary: str = "",  # type: ignore[override]
                 checkpointing: bool = False,
                 preflight: Callable[[Any], Any] | None = None) -> Callable[[Callable[..., Any]], Any]:
        """Decorator registering an engine's run function; it is returned unchanged."""
        if params is not None:
            raise TypeError(f"engine {name!r}: engines take no params dataclass")

        def deco(run: Callable[..., Any]) -> Callable[..., Any]:
            self._add(name, Engine(run, checkpointing, preflight), None, summary or _first_line(run),
                      getattr(run, "__module__", ""))
            return run

        return deco

    def checkpointing_names(self) -> list[str]:
        """The engines that checkpoint (imports every engine module)."""
        return [e.name for e in self if e.obj.checkpointing]


def _first_line(obj: Any) -> str:
    return (getattr(obj, "__doc__", None) or "").strip().split("\n")[0]


STRATEGIES: Registry[Any] = Registry("strategy", plural="strategies")
LEARNERS: Registry[Any] = Registry("learner", plural="learners")
DATASETS: Registry[Any] = Registry("dataset", plural="datasets")
MODELS: Registry[Any] = Registry("model", plural="models")
PARTITIONERS: Registry[Any] = Registry("partitioner", plural="partitioners")
CENTRAL: Registry[Any] = Registry("centralised method", plural="centralised methods")
ENGINES: EngineRegistry = EngineRegistry("engine", plural="engines")

#: Every registry, for listings and the manifest test.
REGISTRIES: tuple[Registry[Any], ...] = (STRATEGIES, LEARNERS, DATASETS, MODELS, PARTITIONERS, CENTRAL, ENGINES)


def load_builtins() -> None:
    """Import every built-in component module (heavy: the centralised track too); for listings and tests."""
    for module in plugins.all_modules():
        importlib.import_module(module)
