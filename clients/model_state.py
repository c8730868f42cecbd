"""A learner's per-round set-up without torch's generic overheads, computing exactly what they compute.

A sequential client of a tiny model spends about a fifth of its call on set-up (issue #29): loading the
received state and building a fresh optimiser.  Both are rebuilt here from their parts:

* :func:`load_state` copies each received tensor into the model's own (what ``load_state_dict`` does,
  ``param.copy_(value)`` under ``no_grad``) without its recursive per-module walk: 40 → 16 µs for a
  three-layer MLP.  Models whose loading does more than copy (a module overriding
  ``_load_from_state_dict``, such as BatchNorm, load hooks, extra state) and any key or shape
  mismatch go through ``load_state_dict`` itself, so its errors are torch's own.
* :class:`FreshOptimiser` hands out the same optimiser object every round with its state cleared:
  what a newly built one holds (empty per-parameter state, the configured hyper-parameters), without
  rebuilding param groups and the step wrappers.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

_plain: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def _loads_by_copying(model: nn.Module) -> bool:
    """Whether ``model.load_state_dict`` would do nothing but copy tensors (checked once per model)."""
    known = _plain.get(model)
    if known is None:
        base_load, base_extra = nn.Module._load_from_state_dict, nn.Module.get_extra_state
        known = all(type(m)._load_from_state_dict is base_load and type(m).get_extra_state is base_extra
                    and not m._load_state_dict_pre_hooks and not m._load_state_dict_post_hooks
                    and not m._state_dict_hooks and not m._state_dict_pre_hooks for m in model.modules())
        _plain[model] = known
    return known


def load_state(model: nn.Module, arrays: dict[str, torch.Tensor]) -> None:
    """``model.load_state_dict(arrays, strict=True)``, by direct copies where that is all it would do."""
    if _loads_by_copying(model):
        targets = model.state_dict(keep_vars=True)
        if len(targets) == len(arrays) and all(
                k in arrays and isinstance(arrays[k], torch.Tensor) and arrays[k].shape == t.shape
                for k, t in targets.items()):
            with torch.no_grad():
                for k, t in targets.items():
                    t.copy_(arrays[k])
            return
    model.load_state_dict(arrays, strict=True)  # anything else, errors included: torch's own path


class FreshOptimiser:
    """One optimiser per (model, trainable parameters), handed out each round with its state cleared.

    ``build(params)`` makes the optimiser; it is rebuilt when the model or its trainable parameters
    change (a transform freezing a layer, a new model after a hang), and only ever built once otherwise.
    """

    def __init__(self, build: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        self._build = build
        self._optimiser: torch.optim.Optimizer | None = None
        self._params: list[torch.Tensor] = []  # the tensors it was built over (compared by identity)

    def __call__(self, model: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        same = len(params) == len(self._params) and all(a is b for a, b in zip(params, self._params))
        if self._optimiser is None or not same:
            self._optimiser, self._params = self._build(params), params
            return self._optimiser
        self._optimiser.state.clear()  # what a new optimiser holds: no momentum, no Adam moments or step
        return self._optimiser
