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

User code outside the package comes in two ways (issue #27, ``docs/adding-a-strategy.md#your-own-code``):

* an **import-path name** ``module.path:attr`` (e.g. ``strategy.name: mypkg.strategies:build``): the
  first lookup imports ``module.path``, checks that ``attr`` is callable the way this kind's objects
  are called (:attr:`Registry.call`) and registers it under the full name; its params dataclass is
  ``attr.params`` or the annotation of its ``params`` argument, if either is a dataclass;
* a **plugin module** (``plugins: [mypkg.reg]`` / ``--plugin mypkg.reg``) imported by
  :func:`import_plugins` before any name is looked up, whose ``@STRATEGIES.register(...)`` add names.

Either fails with a one-line :class:`ConfigError` (module not importable, no such attribute, not
callable, wrong signature, an exception while importing) before anything runs.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import os
import sys
import traceback
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, Mapping, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedsim import plugins
from fedsim.errors import ConfigError

T = TypeVar("T")

_validated: dict[tuple[Any, ...], Any] = {}  # (name, params class, repr(values)) -> a typed params instance


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

    def __init__(self, kind: str, modules: Mapping[str, str] | None = None, *, plural: str | None = None,
                 key: str = "", call: tuple[str, ...] | None = None, returns: str = "",
                 params_arg: int | None = None) -> None:
        """``modules`` (``name -> module``) defaults to the manifest's table for ``kind``; ``plural`` is
        the kind's plural in messages (default: ``kind`` + "s", e.g. "strategy" needs "strategies").

        For import-path names: ``key`` is the config key that names this kind (``strategy.name``),
        ``call`` the positional arguments its objects are called with (None: any callable), ``returns``
        what the call gives (for the expected signature in errors) and ``params_arg`` the index in
        ``call`` of the typed params, whose dataclass annotation declares them."""
        self.kind = kind
        self.plural = plural or f"{kind}s"
        self.key = key or kind
        self.call = call
        self.returns = returns
        self.params_arg = params_arg
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
        """The entry of ``name``, importing the module the manifest names for it if need be (or, for an
        import-path name ``module:attr``, importing ``module`` and checking ``attr``)."""
        if name not in self._entries and is_import_path(name) and name not in self._modules:
            self._resolve(name)
        if name not in self._entries:
            self.require(name)
            importlib.import_module(self._modules[name])
            if name not in self._entries:
                raise RuntimeError(f"the plugin manifest says {self.kind} {name!r} is registered by "
                                   f"{self._modules[name]}, but importing it did not register it")
        return self._entries[name]

    def require(self, name: str) -> None:
        """Raise the unknown-name :class:`ConfigError` unless ``name`` is known; imports nothing, except
        for an import-path name ``module:attr``, which is resolved now (its errors are raised)."""
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
        # memoised on the values' repr (OmegaConf's merge costs ~1 ms and a run validates the same params
        # several times); each caller gets its own copy, and errors are never memoised
        key = (name, entry.params, repr(values))
        known = _validated.get(key)
        if known is not None:
            return copy.deepcopy(known)
        try:
            merged = OmegaConf.merge(OmegaConf.structured(entry.params), values)
            typed = OmegaConf.to_object(merged)
            if len(_validated) >= 1024:
                _validated.clear()
            _validated[key] = copy.deepcopy(typed)
            return typed
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or ""
            fields = ", ".join(f.name for f in dataclasses.fields(entry.params))
            msg = str(exc).splitlines()[0]
            raise ConfigError(
                f"{where}.{key}: {msg} ({self.kind} {name!r} accepts: {fields})" if key
                else f"{where}: {msg} ({self.kind} {name!r} accepts: {fields})"
            ) from None

    def names(self) -> list[str]:
        """Every known name: the manifest's and those already registered (import-path names aside); imports nothing."""
        return sorted(set(self._modules) | {n for n in self._entries if not is_import_path(n)})

    def load(self) -> None:
        """Import every built-in module of this registry."""
        for module in sorted(set(self._modules.values())):
            importlib.import_module(module)

    def __iter__(self) -> Iterator[Entry[T]]:
        """All entries (with summaries), sorted by name; imports this registry's modules only."""
        self.load()
        return iter(sorted(self._entries.values(), key=lambda e: e.name))

    def __contains__(self, name: object) -> bool:
        """Known; an import-path name is resolved on the spot, and a bad one raises its :class:`ConfigError`."""
        if name in self._modules or name in self._entries:
            return True
        if isinstance(name, str) and is_import_path(name):
            self._resolve(name)
            return True
        return False

    # -- import-path names ------------------------------------------------------------------------
    def expected(self, attr: str = "build") -> str:
        """The signature this kind's objects are called with, for messages."""
        args = "..." if self.call is None else ", ".join(self.call)
        return f"{attr}({args})" + (f" -> {self.returns}" if self.returns else "")

    def _resolve(self, name: str) -> None:
        """Import ``module`` of ``module:attr``, check ``attr`` and register it under ``name``."""
        module_name, _, attr = name.partition(":")
        where = f"{self.key}={name!r}"
        if not all(part.isidentifier() for part in [*module_name.split("."), *attr.split(".")]):
            raise ConfigError(f"{where}: not an import path; use dotted Python names, module.path:attr "
                              f"(e.g. mypkg.strategies:build)")
        module = import_user_module(module_name, where)
        obj: Any = module
        for part in attr.split("."):
            if not hasattr(obj, part):
                public = sorted(n for n, v in vars(module).items()
                                if not n.startswith("_") and callable(v) and getattr(v, "__module__", "") == module_name)
                has = f"; it defines: {', '.join(public[:12])}" if public else ""
                raise ConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}{has}")
            obj = getattr(obj, part)
        obj, params = self._check_import(obj, name, attr, where)
        self._add(name, obj, params, _first_line(obj), getattr(obj, "__module__", "") or module_name)

    def _check_import(self, obj: Any, name: str, attr: str, where: str) -> tuple[Any, type | None]:
        """``(object to register, params dataclass)`` of an import-path name, or a one-line ConfigError."""
        short = attr.rsplit(".", 1)[-1]
        if not callable(obj):
            raise ConfigError(f"{where}: {attr!r} is a {type(obj).__name__}, not callable; a {self.kind} "
                              f"is {self.expected(short)}")
        _check_signature(obj, self.call, where, f"a {self.kind} is {self.expected(short)}")
        return obj, _params_dataclass(obj, self.params_arg)


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

    def _check_import(self, obj: Any, name: str, attr: str, where: str) -> tuple[Any, type | None]:
        """An :class:`Engine` as is, else a run function (its ``checkpointing`` / ``preflight``
        attributes, if any, are the engine's capabilities)."""
        if isinstance(obj, Engine):
            return obj, None
        run, _ = super()._check_import(obj, name, attr, where)
        return Engine(run, bool(getattr(run, "checkpointing", False)), getattr(run, "preflight", None)), None

    def checkpointing_names(self) -> list[str]:
        """The engines that checkpoint (imports every engine module)."""
        return [e.name for e in self if e.obj.checkpointing]


def _first_line(obj: Any) -> str:
    return (getattr(obj, "__doc__", None) or "").strip().split("\n")[0]


def is_import_path(name: str) -> bool:
    """``module.path:attr`` (both parts non-empty): a name that is resolved by importing it."""
    module, sep, attr = name.partition(":")
    return bool(sep and module.strip() and attr.strip())


def _on_path() -> None:
    """The working directory is importable, as with ``python -m`` (the ``fedsim`` script lacks it);
    appended, so it never shadows an installed package."""
    cwd = os.getcwd()
    if not any(p in ("", ".") or os.path.abspath(p) == cwd for p in sys.path if isinstance(p, str)):
        sys.path.append(cwd)


def import_user_module(module_name: str, where: str) -> types.ModuleType:
    """Import a user's module; any failure is a one-line :class:`ConfigError` that starts with ``where``."""
    _on_path()
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(f"{missing}.")):
            raise ConfigError(f"{where}: cannot import module {module_name!r} ({_one_line(exc)}); check the path "
                              f"and that the package is installed or on PYTHONPATH") from None
        raise ConfigError(f"{where}: importing module {module_name!r} raised {_describe(exc)}") from None
    except (Exception, SystemExit) as exc:  # the user's module failed at import time: one line, no traceback
        raise ConfigError(f"{where}: importing module {module_name!r} raised {_describe(exc)}") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def _describe(exc: BaseException) -> str:
    """``Type: message (at file:line)``, the line being the innermost frame of the user's code."""
    at = ""
    if isinstance(exc, SyntaxError) and exc.filename:
        at = f" (at {exc.filename}:{exc.lineno})"
        msg = exc.msg
    else:
        msg = _one_line(exc)
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
        if frames:
            at = f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return f"{type(exc).__name__}{': ' + msg if msg else ''}{at}"


def _check_signature(obj: Any, call: tuple[str, ...] | None, where: str, expected: str) -> None:
    """``obj`` accepts ``len(call)`` positional arguments (unknowable signatures pass)."""
    if call is None:
        return
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    try:
        sig.bind(*call)
    except TypeError:
        name = getattr(obj, "__name__", type(obj).__name__)
        raise ConfigError(f"{where}: {name}{sig} has the wrong signature; {expected}") from None


def _params_dataclass(obj: Any, params_arg: int | None) -> type | None:
    """``obj.params`` if it is a dataclass type, else the dataclass annotating its params argument."""
    declared = getattr(obj, "params", None)
    if isinstance(declared, type) and dataclasses.is_dataclass(declared):
        return declared
    if params_arg is None:
        return None
    try:
        sig = inspect.signature(obj)
        positional = [p for p in sig.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if params_arg >= len(positional):
            return None
        param = positional[params_arg]
        target = obj.__init__ if isinstance(obj, type) else obj
        hint = typing.get_type_hints(target).get(param.name, param.annotation)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: no typed params
        return None
    for candidate in (hint, *typing.get_args(hint)):  # Params, Optional[Params], Params | None
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


#: Modules :func:`import_plugins` has imported in this process.
_PLUGINS: set[str] = set()


def import_plugins(modules: Any, where: str = "plugins") -> None:
    """Import each plugin module (``plugins:`` of the config, ``--plugin``) so that its
    ``@REGISTRY.register(...)`` decorators add their names; each once per process."""
    for module in modules or ():
        if module in _PLUGINS:
            continue
        if not isinstance(module, str) or not all(part.isidentifier() for part in module.strip().split(".")):
            raise ConfigError(f"{where}: {module!r} is not a module name; give an importable module such as "
                              f"mypkg.plugins (no ':attr')")
        import_user_module(module.strip(), f"{where}: {module!r}")
        _PLUGINS.add(module)


STRATEGIES: Registry[Any] = Registry("strategy", plural="strategies", key="strategy.name", call=("ctx", "params"),
                                     returns="a Flower Strategy", params_arg=1)
LEARNERS: Registry[Any] = Registry("learner", plural="learners", key="client.learner", call=("cfg", "params"),
                                   returns="a fedsim.contracts.learner.Learner", params_arg=1)
DATASETS: Registry[Any] = Registry("dataset", plural="datasets", key="data.name", call=("params", "seed"),
                                   returns="an ArrayDataset", params_arg=0)
MODELS: Registry[Any] = Registry("model", plural="models", key="model.name",
                                 call=("params", "input_shape", "num_classes"), returns="a torch nn.Module",
                                 params_arg=0)
PARTITIONERS: Registry[Any] = Registry("partitioner", plural="partitioners", key="data.partition.name",
                                       call=("labels", "num_clients", "cfg", "seed"),
                                       returns="one index array per client")
CENTRAL: Registry[Any] = Registry("centralised method", plural="centralised methods", key="method", call=("ctx",),
                                  returns="a dict of metrics")
ENGINES: EngineRegistry = EngineRegistry("engine", plural="engines", key="engine.name", call=("spec", "observers"),
                                         returns="a ServerResult")

#: Every registry, for listings and the manifest test.
REGISTRIES: tuple[Registry[Any], ...] = (STRATEGIES, LEARNERS, DATASETS, MODELS, PARTITIONERS, CENTRAL, ENGINES)


def load_builtins() -> None:
    """Import every built-in component module (heavy: the centralised track too); for listings and tests."""
    for module in plugins.all_modules():
        importlib.import_module(module)
