"""A learner's per-round set-up without torch's generic overheads, computing exactly what they compute.

A sequential client of a tiny model spends about a fifth of its call on set-up (issue #29): loading the
received state, switching to training mode, building a fresh optimiser and copying out its reply.  Each
is rebuilt here from its parts:

* :class:`ModelLayout` is what ``state_dict(keep_vars=True)``, ``parameters()`` and ``train()`` find when they
  walk the module tree, found once and kept while the model's structure stays the same
  (:func:`model_layout` checks a fingerprint of everything those walks read, ~4 us).  A client walked the tree
  four times per call (load, training mode, optimiser, reply): ~30 us of a tiny MLP client's ~850 us on
  its own, about twice that inside an engine round, where the caches are colder.
* :func:`load_state` copies each received tensor into the model's own (what ``load_state_dict`` does,
  ``param.copy_(value)`` under ``no_grad``) without its recursive per-module walk.  Models whose loading
  does more than copy (a module overriding ``_load_from_state_dict``, such as BatchNorm, load hooks, extra
  state) and any key or shape mismatch go through ``load_state_dict`` itself, so its errors are torch's own.
* :class:`FreshOptimiser` hands out the same optimiser object every round with its state cleared:
  what a newly built one holds (empty per-parameter state, the configured hyper-parameters), without
  rebuilding param groups and the step wrappers.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn

from fedsim.device import to_host

_layouts: "weakref.WeakKeyDictionary[nn.Module, ModelLayout]" = weakref.WeakKeyDictionary()

_BASE = nn.Module
_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def _fingerprint(modules: list[nn.Module]) -> list[tuple[Any, ...]]:
    """Everything ``state_dict``, ``parameters()`` and ``train()`` read from these modules, as values that compare
    by identity or number (never a tensor's ``__eq__``): per module its type, the names and identities of its
    parameters, children and buffers, its non-persistent buffer names and its state-dict hook counts."""
    out: list[tuple[Any, ...]] = []
    add = out.append
    for m in modules:
        d = m.__dict__
        params, children, buffers, hidden = d["_parameters"], d["_modules"], d["_buffers"], d["_non_persistent_buffers_set"]
        add((type(m), *params, *map(id, params.values()), *children, *map(id, children.values()),
             len(params), len(children)))
        if buffers or hidden:
            add((*buffers, *map(id, buffers.values()), len(buffers), *sorted(hidden)))
        if (d["_state_dict_hooks"] or d["_state_dict_pre_hooks"] or d["_load_state_dict_pre_hooks"]
                or d["_load_state_dict_post_hooks"]):
            add(("hooks", *(len(d[h]) for h in _HOOKS)))
    return out


class ModelLayout:
    """A model's submodules, state-dict entries (the tensors themselves) and parameters, with what its
    modules do beyond torch's generic behaviour.  Built by :func:`model_layout`; valid while its
    :attr:`fingerprint` matches the model's."""

    __slots__ = ("submodules", "fingerprint", "state", "params", "plain_save", "plain_load", "plain_train")

    def __init__(self, model: nn.Module) -> None:
        modules = list(model.modules())
        # the model itself is not held: layouts are kept in a WeakKeyDictionary keyed by the model, which a
        # value referring to its key would keep alive (torch's submodules do not refer to their parent)
        self.submodules = modules[1:]
        self.fingerprint = _fingerprint(modules)
        self.state = model.state_dict(keep_vars=True)  # key -> the model's own Parameter / buffer
        self.params = list(model.parameters())
        # state_dict() is the walk alone: no hook or override changes what it returns
        self.plain_save = all(type(m)._save_to_state_dict is _BASE._save_to_state_dict
                              and type(m).get_extra_state is _BASE.get_extra_state
                              and not m._state_dict_hooks and not m._state_dict_pre_hooks for m in modules)
        # load_state_dict() only copies (BatchNorm, for one, does more)
        self.plain_load = self.plain_save and all(
            type(m)._load_from_state_dict is _BASE._load_from_state_dict
            and not m._load_state_dict_pre_hooks and not m._load_state_dict_post_hooks for m in modules)
        self.plain_train = all(type(m).train is _BASE.train for m in modules)

    def trainable(self) -> list[torch.Tensor]:
        """``[p for p in model.parameters() if p.requires_grad]``."""
        return [p for p in self.params if p.requires_grad]

    def train_mode(self, model: nn.Module) -> None:
        """``model.train()``: nothing to do when every module is in training mode and none overrides ``train``."""
        if not self.plain_train or not model.training or not all(m.training for m in self.submodules):
            model.train()

    def host_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """``{k: to_host(v) for k, v in model.state_dict().items()}``: fresh detached CPU copies."""
        state = self.state if self.plain_save else model.state_dict()
        return {k: to_host(v) for k, v in state.items()}


def model_layout(model: nn.Module, check: bool = True) -> ModelLayout:
    """``model``'s :class:`ModelLayout`: the kept one if its fingerprint still matches (~4 us for a 3-layer MLP),
    else found anew through torch.  ``check=False`` skips the comparison: for a caller that checked it during
    the same call and ran nothing since that could have changed the model's structure."""
    layout = _layouts.get(model)
    if layout is None or (check and _fingerprint([model, *layout.submodules]) != layout.fingerprint):
        layout = _layouts[model] = ModelLayout(model)
    return layout


def load_state(model: nn.Module, arrays: dict[str, torch.Tensor]) -> None:
    """``model.load_state_dict(arrays, strict=True)``, by direct copies where that is all it would do."""
    layout = model_layout(model)
    if layout.plain_load:
        targets = layout.state
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

    def __call__(self, model: nn.Module, params: list[torch.Tensor] | None = None) -> torch.optim.Optimizer:
        """The optimiser over ``params`` (default: the model's trainable parameters, in ``parameters()`` order)."""
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        same = len(params) == len(self._params) and all(a is b for a, b in zip(params, self._params))
        if self._optimiser is None or not same:
            self._optimiser, self._params = self._build(params), params
            return self._optimiser
        self._optimiser.state.clear()  # what a new optimiser holds: no momentum, no Adam moments or step
        return self._optimiser
