"""The TTA methods by name: :data:`TTA_METHODS`, typed params from a mapping, and building a method."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from torch import nn

from clients.tta.methods.base import TTAMethod
from clients.tta.methods.eata import ETA
from clients.tta.methods.lcotta import LCoTTA
from clients.tta.methods.rdumb import RDumb
from clients.tta.methods.source import BNAdapt, Source
from clients.tta.methods.tent import Tent
from fedsim.errors import ConfigError

#: Method name -> class; the class's ``Params`` dataclass holds its parameters.
TTA_METHODS: dict[str, type[TTAMethod]] = {
    cls.name: cls for cls in (Source, BNAdapt, Tent, ETA, RDumb, LCoTTA)
}


def make_params(name: str, values: Mapping[str, Any] | None = None) -> Any:
    """The typed params of method ``name`` from a mapping (unknown keys are a ConfigError)."""
    cls = _lookup(name)
    values = dict(values or {})
    fields = {f.name for f in dataclasses.fields(cls.Params)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(
            f"tta method {name!r} has no parameter {unknown[0]!r}; it accepts: {', '.join(sorted(fields)) or 'none'}"
        )
    return cls.Params(**values)


def build_method(name: str, model: nn.Module, num_classes: int, params: Any = None) -> TTAMethod:
    """Wrap ``model`` (configured in place) in the TTA method ``name``; ``params`` a mapping or dataclass."""
    cls = _lookup(name)
    if params is None or isinstance(params, Mapping):
        params = make_params(name, params)
    return cls(model, num_classes, params)


def _lookup(name: str) -> type[TTAMethod]:
    try:
        return TTA_METHODS[name]
    except KeyError:
        raise ConfigError(f"unknown tta method {name!r}; known: {', '.join(sorted(TTA_METHODS))}") from None
