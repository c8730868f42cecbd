"""Model transforms: what a learner applies to the received global model before local training.

A strategy asks for a transform by name in the round's ``ConfigRecord``: the key
:data:`~fedsim.contracts.wire.TRANSFORM_KEY` names one transform (or a list of them, applied in
order) and the transform reads its own parameters from other keys of the same record.  Transforms
are pure functions of (model, config): all their randomness comes from a seed carried in the
config, so a transform is reproduced exactly in every engine and process.  Each returns a few
numbers describing what it did, which the learner adds to its training metrics.

An algorithm registers its transform with :func:`register_transform` in its own module
(``algorithms.<name>``); :func:`apply_transforms` imports a built-in transform's module on first
use (:data:`BUILTIN_MODULES`), so the learner never imports the algorithm that asks for it.  The
one transform so far is FedPhoenix's stochastic filter reset (:mod:`algorithms.fedphoenix`).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

from torch import nn

from fedsim.contracts.wire import PHOENIX, TRANSFORM_KEY

TransformFn = Callable[[nn.Module, Mapping[str, Any]], dict[str, float]]
TRANSFORMS: dict[str, TransformFn] = {}
#: Where each built-in transform is registered (imported on first use).
BUILTIN_MODULES: dict[str, str] = {PHOENIX: "algorithms.fedphoenix"}


def register_transform(name: str) -> Callable[[TransformFn], TransformFn]:
    def deco(fn: TransformFn) -> TransformFn:
        if name in TRANSFORMS and TRANSFORMS[name] is not fn:
            raise ValueError(f"transform {name!r} is registered twice")
        TRANSFORMS[name] = fn
        return fn

    return deco


def transform(name: str) -> TransformFn:
    """The transform registered as ``name`` (importing its built-in module on first use)."""
    if name not in TRANSFORMS and name in BUILTIN_MODULES:
        importlib.import_module(BUILTIN_MODULES[name])
    if name not in TRANSFORMS:
        known = ", ".join(sorted(set(TRANSFORMS) | set(BUILTIN_MODULES)))
        raise ValueError(f"unknown model transform {name!r}; known: {known}")
    return TRANSFORMS[name]


def apply_transforms(model: nn.Module, config: Mapping[str, Any]) -> dict[str, float]:
    """Apply the transforms the round config names (none if it has no ``"transform"`` key)."""
    names = config.get(TRANSFORM_KEY)
    if not names:
        return {}
    metrics: dict[str, float] = {}
    for name in [names] if isinstance(names, str) else list(names):
        metrics.update(transform(name)(model, config))
    return metrics
