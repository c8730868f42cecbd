"""Lazy package exports (PEP 562): a package names what it re-exports, and each name's module is
imported on first use, so importing the package itself stays cheap."""

from __future__ import annotations

import importlib
from typing import Any, Callable, MutableMapping


def lazy_getattr(package: str, where: dict[str, str], namespace: MutableMapping[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` importing ``name`` from ``where[name]`` on first use (then cached in
    ``namespace``, the package's ``globals()``)."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        namespace[name] = value
        return value

    return __getattr__
