"""The contract every TTA method implements (online: predict, then adapt), and state helpers.

Contract after the online TTA benchmark ``mariodoebler/test-time-adaptation``
(``classification/methods/base.py::TTAMethod``): ``configure_model``, ``collect_params``,
``forward_and_adapt(x) -> logits`` and ``reset()``.  The logits are those of the forward pass that
produced the loss, i.e. computed *before* this batch's update (online prediction).  Added here for
federated use: ``state_dict``/``load_state_dict`` of the method's own state (momentum buffers,
EMA of the mean prediction, gradient window, counters, Fisher terms) as a flat
``dict[str, Tensor]`` that fits a Flower ``ArrayRecord``; ``shared_state``/``load_shared_state``
of the norm affine parameters (what a server averages); ``last_info`` diagnostics of the last
batch.  Methods are looked up by name in :data:`~clients.tta.methods.registry.TTA_METHODS` (see
:func:`~clients.tta.methods.registry.build_method`).

Deliberate deviations (all methods): one update per batch (``OPTIM.STEPS = 1`` in every config);
no mixed precision; no single-sample sliding window (a batch of one with BatchNorm is a
ConfigError); BN1d uses batch statistics via ``track_running_stats=False`` like BN2d (see
:mod:`clients.tta.norm`).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Mapping

import torch
from torch import nn

from clients.tta.norm import collect_norm_params, configure_norm, has_batchnorm, load_norm_state, norm_state
from fedsim.errors import ConfigError

StateDict = dict[str, torch.Tensor]


class TTAMethod(ABC):
    """An online TTA method wrapping (and configuring in place) ``model``.

    The model state at construction, after :meth:`configure_model`, is the *source* that
    :meth:`reset` restores.  ``last_info`` (floats) of the entropy methods: ``loss``, ``entropy``
    (batch mean), ``kept_frac``, ``updated`` (0/1); ETA adds ``reliable_frac``; RDumb ``reset``.
    """

    name: ClassVar[str]
    Params: ClassVar[type]
    batch_stats: ClassVar[bool] = True  # BatchNorm normalises with the test batch

    def __init__(self, model: nn.Module, num_classes: int, params: Any = None) -> None:
        params = self.Params() if params is None else params
        if not isinstance(params, self.Params):
            raise ConfigError(f"{self.name} needs {self.Params.__name__}, got {type(params).__name__}")
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ConfigError(f"num_classes must be an integer >= 2, got {num_classes!r}")
        self.model = model
        self.num_classes = num_classes
        self.params = params
        self.validate_params()
        self.configure_model()
        self.param_list, self.param_names = self.collect_params()
        self.optimizer = self.setup_optimizer()
        self._needs_batch = self.batch_stats and has_batchnorm(model)
        self._source_model = copy.deepcopy(model.state_dict())
        self._source_optim = copy.deepcopy(self.optimizer.state_dict()) if self.optimizer else None
        self.last_info: dict[str, float] = {}
        self.init_state()

    # -- the contract -------------------------------------------------------------------------

    def validate_params(self) -> None:
        """Raise ConfigError on bad parameters."""

    def configure_model(self) -> None:
        configure_norm(self.model)

    def collect_params(self) -> tuple[list[nn.Parameter], list[str]]:
        return collect_norm_params(self.model)

    def setup_optimizer(self) -> torch.optim.Optimizer | None:
        return None

    def init_state(self) -> None:
        """(Re)initialise the method's own state (not model, not optimizer)."""

    @abstractmethod
    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of ``x`` (computed before this batch's update), then adapt on ``x``."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_and_adapt(x)

    def reset(self) -> None:
        """Back to the source: model, optimizer and all method state."""
        self._restore_source()
        self.init_state()
        self.last_info = {}

    # -- state --------------------------------------------------------------------------------

    def shared_state(self) -> StateDict:
        """The norm affine parameters (what a federated server averages)."""
        return norm_state(self.model)

    def load_shared_state(self, state: Mapping[str, torch.Tensor]) -> None:
        load_norm_state(self.model, dict(state))

    def state_dict(self) -> StateDict:
        """The method's own state as a flat dict of tensors (momentum buffers, counters, ...)."""
        out: StateDict = {}
        if self.optimizer is not None:
            for n, p in zip(self.param_names, self.param_list):
                buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
                if buf is not None:
                    out[f"momentum.{n}"] = buf.detach().clone()
        out.update(self.extra_state())
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the method's own state; keys absent from ``state`` take their initial value."""
        state = dict(state)
        known = self.state_keys()
        unknown = sorted(k for k in state if k not in known)
        if unknown:
            raise ConfigError(
                f"{self.name} state has unknown keys {unknown[:3]}; pass the dict from state_dict() "
                "of the same method and architecture"
            )
        if self.optimizer is not None:
            self.optimizer.state.clear()
            for n, p in zip(self.param_names, self.param_list):
                buf = state.get(f"momentum.{n}")
                if buf is not None:
                    self.optimizer.state[p] = {"momentum_buffer": _as(buf, p, f"momentum.{n}")}
        self.init_state()
        self.load_extra_state(state)

    def state_keys(self) -> set[str]:
        keys = {f"momentum.{n}" for n in self.param_names} if self.optimizer is not None else set()
        return keys | self.extra_state_keys()

    def extra_state(self) -> StateDict:
        return {}

    def extra_state_keys(self) -> set[str]:
        return set()

    def load_extra_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load what :meth:`extra_state` returned (after :meth:`init_state`)."""

    # -- helpers ------------------------------------------------------------------------------

    def _restore_source(self) -> None:
        self.model.load_state_dict(self._source_model, strict=True)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(self._source_optim))

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.ndim < 2 or x.shape[0] < 1:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ConfigError(f"{self.name}: input must be a batch tensor (N, ...), got {shape}")
        if self._needs_batch and x.shape[0] < 2:
            raise ConfigError(
                f"{self.name}: a batch of 1 cannot give BatchNorm test statistics; use batches of >= 2 "
                "(single-sample TTA with a sliding window is not implemented)"
            )

    def _check_logits(self, out: torch.Tensor) -> None:
        if out.ndim != 2 or out.shape[1] != self.num_classes:
            raise ConfigError(
                f"{self.name}: the model must return (N, {self.num_classes}) logits, got {tuple(out.shape)}"
            )


def _as(value: torch.Tensor, like: torch.Tensor, key: str) -> torch.Tensor:
    """``value`` as a detached copy with the shape, device and dtype of ``like`` (ConfigError on a shape mismatch)."""
    v = torch.as_tensor(value)
    if tuple(v.shape) != tuple(like.shape):
        raise ConfigError(f"state {key!r} has shape {tuple(v.shape)}, expected {tuple(like.shape)}")
    return v.detach().clone().to(device=like.device, dtype=like.dtype)


def _counter(state: Mapping[str, torch.Tensor], key: str) -> int:
    """The integer counter ``state[key]``, 0 when absent."""
    return int(torch.as_tensor(state[key]).item()) if key in state else 0
