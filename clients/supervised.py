"""Supervised classification learner: a registered model trained with SGD/Adam on a client's split.

Local work is ``client.local_epochs`` passes over the client's training data, or exactly
``client.local_steps`` optimiser steps when set (as FedSVD counts local work).  A fresh optimiser is
built every round, as in FedAvg.  Batches are drawn from a generator seeded by (root seed, round,
partition), so every engine draws the same batches.

Models that declare ``federated_keys`` (LoRA adapters over a frozen pretrained encoder) exchange
only those keys: the server's initial state holds them (with the wrapped base weights), clients
load whatever subset the strategy sends and reply with the parameters they trained.  The round
config keys ``lora-train-A`` / ``lora-train-B`` (sent by the LoRA strategies) choose which factors
train; the classifier head trains when the model's ``train_head`` param says so.

With ``privacy.enabled`` local training is Opacus DP-SGD (:mod:`privacy.dp_sgd`) with the client's
own calibrated σ (:mod:`privacy.plan`); the reply carries the steps, rate and σ for the server's
privacy ledger, and a client whose next round would exceed its budget refuses to train (a counted
client failure, logged with the reason).  DP-SGD clips per-sample gradients of the cross-entropy
only; under DP, FedProx's proximal gradient (which depends on no example) is added to the
privatised gradient before each step (DP-FedProx, :meth:`SupervisedLearner._proximal_after_noise`).

Two hooks let server-side algorithms shape local training through the round config alone:

* model transforms named under ``"transform"`` (see :mod:`fedsim.contracts.transforms`, e.g. FedPhoenix's
  filter reset) are applied to the received global model before the optimiser is built;
* when the config carries ``"proximal-mu"`` (as Flower's ``FedProx`` sends it), the local objective
  adds FedProx's proximal term ``(mu/2) * ||w - w_global||^2`` over the trainable parameters, with
  ``w_global`` the model as received (before any transform).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from fedsim.contracts.learner import EvalResult, Learner, NodeContext, StateDict, TrainResult
from fedsim.contracts.learner import local_steps as num_local_steps
from fedsim.contracts.transforms import apply_transforms
from fedsim.contracts.wire import LORA_TRAIN_A, LORA_TRAIN_B, PROXIMAL_MU, TRANSFORM_KEY
from clients.model_state import FreshOptimiser, load_state, model_layout
from envs.federated import FederatedData, load_federated_data_cached
from envs.plots import plot_label_histogram
from fedsim.config import ExperimentConfig
from fedsim.device import resolve_device, to_host
from fedsim.errors import ConfigError
from fedsim.models import build_model
from fedsim.registry import LEARNERS
from fedsim.seeding import derive_seed, seed_torch
from privacy.facade import DP_STATE, PrivacyBudgetExhausted, PrivateTrainer  # noqa: F401  (re-exported)
from privacy.plan import ClientPrivacyPlan

log = logging.getLogger("fedsim")

@dataclass
class SupervisedParams:
    grad_clip: float | None = None  # clip the gradient norm at each step (None = off)


def make_optimizer(model: nn.Module, cfg: ExperimentConfig) -> torch.optim.Optimizer:
    """The client's optimiser over the model's trainable parameters."""
    return optimizer_for([p for p in model.parameters() if p.requires_grad], cfg)


def optimizer_for(params: list[torch.Tensor], cfg: ExperimentConfig) -> torch.optim.Optimizer:
    """``client.optimizer`` (SGD or Adam) with the client's settings over ``params``: the one optimiser
    step of the sequential learner and of the vectorised cohort (:mod:`clients.vectorised`)."""
    c = cfg.client
    if c.optimizer == "adam":
        return torch.optim.Adam(params, lr=c.lr, weight_decay=c.weight_decay)
    return torch.optim.SGD(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay)


def make_dp_compatible(model: nn.Module) -> nn.Module:
    """Opacus' ``ModuleValidator.fix``: e.g. BatchNorm (which mixes examples) becomes GroupNorm.

    Every replacement is logged, since it changes the model the user asked for.
    """
    from opacus.validators import ModuleValidator

    before = {name: type(m).__name__ for name, m in model.named_modules()}
    if not ModuleValidator.validate(model, strict=False):
        return model
    fixed = ModuleValidator.fix(model)
    after = {name: type(m).__name__ for name, m in fixed.named_modules()}
    for name, kind in after.items():
        if name in before and before[name] != kind:
            log.warning("DP-SGD: replaced %s (%s) by %s to make the model Opacus-compatible", name, before[name], kind)
    return fixed


def proximal_term(model: nn.Module, anchor: list[torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's ``(mu/2) * sum_p ||p - anchor_p||^2`` over the trainable parameters, in order."""
    params = [p for p in model.parameters() if p.requires_grad]
    return (mu / 2) * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor, strict=True))


def iterate_batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless stream of shuffled index batches (a new permutation each epoch)."""
    while True:
        perm = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            yield perm[start : start + batch_size]


@torch.no_grad()
def evaluate_model(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> dict[str, float]:
    """Mean cross-entropy and accuracy of ``model`` on (x, y)."""
    if len(y) == 0:
        return {"loss": float("nan"), "accuracy": float("nan")}
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        logits = model(xb)
        loss_sum += float(nn.functional.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(1) == yb).sum())
    return {"loss": loss_sum / len(y), "accuracy": correct / len(y)}


@LEARNERS.register("supervised", params=SupervisedParams, summary="supervised classifier (cross-entropy)")
class SupervisedLearner(Learner):
    """Cross-entropy training of a registered model on labelled arrays from ``envs``."""

    supports_dp = True
    supports_device = True  # model, optimiser state and client data live on engine.device
    privacy_unit = "one training example of one client (a row of its training split)"
    validation_split = True

    def __init__(self, cfg: ExperimentConfig, params: SupervisedParams) -> None:
        super().__init__(cfg, params)
        self._data: FederatedData | None = None
        self._model: nn.Module | None = None
        self._anchor: list[torch.Tensor] | None = None  # w_global for the proximal term
        self.dp = PrivateTrainer(cfg)  # sample-level DP-SGD (privacy/facade.py)
        self.device = resolve_device(cfg.engine.device)  # engine.device (fedsim/device.py)
        self._on_device: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}  # id(split) -> (split, x, y)
        self._fresh_optimiser = FreshOptimiser(lambda params: optimizer_for(params, self.cfg))  # non-DP rounds

    # -- resident state ---------------------------------------------------------------------
    @property
    def data(self) -> FederatedData:
        if self._data is None:
            self._data = load_federated_data_cached(self.cfg.data, self.cfg.num_clients, self.cfg.seed,
                                                    self.cfg.evaluation.validation_fraction)
        return self._data

    @property
    def model(self) -> nn.Module:
        if self._model is None:
            self._model = self._build_model()
        return self._model

    def _build_model(self) -> nn.Module:
        model = build_model(self.cfg.model.name, self.cfg.model.params, self.data.input_shape, self.data.num_classes)
        if self.sample_level_dp:
            model = make_dp_compatible(model)
        return model.to(self.device)

    def _load(self, arrays: StateDict) -> nn.Module:
        model = self.model
        if hasattr(model, "federated_keys"):  # adapters: the strategy sends a subset of the keys
            unknown = set(arrays) - set(model.state_dict())
            if unknown:
                raise KeyError(f"arrays carry keys the model does not have: {sorted(unknown)[:3]}")
            model.load_state_dict(arrays, strict=False)
        else:
            load_state(model, arrays)  # load_state_dict(strict=True), without its per-module walk
        return model

    def _tensors(self, ds: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A split's (x, y) on the learner's device (on a GPU, copied there once and kept)."""
        x, y = ds.to_tensors()
        if self.device.type == "cpu":
            return x, y
        held = self._on_device.get(id(ds))
        if held is None or held[0] is not ds:
            held = self._on_device[id(ds)] = (ds, x.to(self.device), y.to(self.device))
        return held[1], held[2]

    def _set_trainable(self, model: nn.Module, ctx: NodeContext) -> None:
        if hasattr(model, "set_trainable"):
            a, b, head = self._trainable_flags(model, ctx)
            model.set_trainable(A=a, B=b, head=head)

    @staticmethod
    def _trainable_flags(model: nn.Module, ctx: NodeContext) -> tuple[bool, bool, bool]:
        """Which of an adapter model's LoRA ``A``, ``B`` and head this round trains (the strategy's round config
        over the model's defaults)."""
        mp = model.params
        return (bool(ctx.config.get(LORA_TRAIN_A, mp.train_A)), bool(ctx.config.get(LORA_TRAIN_B, True)),
                bool(mp.train_head))

    def _client_draws(self, model: nn.Module, ctx: NodeContext) -> contextlib.AbstractContextManager[Any]:
        """Adapter models off the CPU draw dropout masks as LoRA cohorts do (:func:`clients.lora_cohort.client_draws`)."""
        if not hasattr(model, "federated_keys"):
            return contextlib.nullcontext()
        from clients.lora_cohort import client_draws

        return client_draws(model, ctx)

    @staticmethod
    def _reply_arrays(model: nn.Module) -> StateDict:
        """Everything for plain models; only what was trained for adapter models (fresh host copies)."""
        if not hasattr(model, "federated_keys"):
            return model_layout(model).host_state(model)
        state = model.state_dict()
        return {k: to_host(state[k]) for k in model.trainable_keys()}

    # -- privacy --------------------------------------------------------------------------------
    def privacy_plan(self, partition_id: int) -> ClientPrivacyPlan:
        return self.dp.plan(partition_id, len(self.data.client_train(partition_id).y))

    @property
    def sample_level_dp(self) -> bool:
        return self.cfg.privacy.enabled and self.cfg.privacy.level == "sample"

    # -- cohort training (engine.vectorise): one vmapped step for many clients, clients.vectorised --
    def cohort_refusal(self, ctxs: list[NodeContext], auto: bool) -> str | None:
        if hasattr(self.model, "federated_keys"):  # adapters on a frozen base: clients.lora_cohort
            from clients.lora_cohort import lora_cohort_refusal

            return lora_cohort_refusal(self, ctxs, auto)
        from clients.vectorised import auto_vectorise, vectorise_unsupported

        return (auto_vectorise if auto else vectorise_unsupported)(self, ctxs)

    def train_cohort(self, arrays_list: list[StateDict], ctxs: list[NodeContext], chunk: int) -> list[TrainResult]:
        if hasattr(self.model, "federated_keys"):
            from clients.lora_cohort import train_lora_cohort

            return train_lora_cohort(self, arrays_list, ctxs, chunk)
        from clients.vectorised import train_cohort

        return train_cohort(self, arrays_list, ctxs, chunk)

    def seed_streams(self) -> tuple[str, ...]:
        return ("torch", "dp-batches", "dp-noise") if self.sample_level_dp else ("torch", "batches")

    def local_work(self, partition_id: int) -> float:
        if self.sample_level_dp:
            return float(self.privacy_plan(partition_id).steps_per_round)
        return float(num_local_steps(len(self.data.client_train(partition_id).y), self.cfg))

    def preflight(self) -> None:
        if not self.sample_level_dp:
            return
        for pid in range(self.cfg.num_clients):
            self.privacy_plan(pid)

    def _train_private(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, ctx: NodeContext,
                       optimizer: torch.optim.Optimizer) -> tuple[float, int, dict[str, float]]:
        out = self.dp.train_round(model, optimizer, (x, y), ctx, num_examples=len(y),
                                  after_noise=self._proximal_after_noise(model, ctx))
        return out.mean_loss, out.steps, out.metrics

    def _proximal_after_noise(self, model: nn.Module, ctx: NodeContext) -> Callable[[], None] | None:
        """DP-FedProx: FedProx's proximal gradient ``mu (w - w_global)`` added to the privatised gradient.

        It depends on no example, so adding it after clipping and noising is post-processing: the
        ledger is unchanged, and it is not clipped with the data's gradients (as it would be in the loss).
        """
        if self._anchor is None:
            return None
        mu = float(ctx.config[PROXIMAL_MU])
        params = [p for p in model.parameters() if p.requires_grad]

        @torch.no_grad()
        def add_proximal_gradient() -> None:
            for p, w0 in zip(params, self._anchor or []):
                if p.grad is not None:
                    p.grad.add_(p - w0, alpha=mu)

        return add_proximal_gradient

    # -- Learner API --------------------------------------------------------------------------
    def init_arrays(self) -> StateDict:
        seed_torch(derive_seed(self.cfg.seed, "model-init"))
        model = self._build_model()
        state = model.state_dict()
        keys = model.federated_keys(include_base=True) if hasattr(model, "federated_keys") else list(state)
        return {k: to_host(state[k]) for k in keys}

    def train(self, arrays: StateDict, ctx: NodeContext) -> TrainResult:
        x, y = self._tensors(self.data.client_train(ctx.partition_id, ctx.server_round))
        model = self._load(arrays)
        self._set_trainable(model, ctx)
        self._anchor = ([p.detach().clone() for p in model.parameters() if p.requires_grad]
                        if PROXIMAL_MU in ctx.config else None)
        transformed = apply_transforms(model, ctx.config)
        # _load's load_state checked the model's layout: look again only where something since may have changed it
        checked = type(self)._load is SupervisedLearner._load and not hasattr(model, "federated_keys")
        layout = model_layout(model, check=not checked or TRANSFORM_KEY in ctx.config)
        layout.train_mode(model)
        seed_torch(ctx.seed("torch"))  # dropout and any other global-RNG use
        # a fresh optimiser each round, as in FedAvg (Opacus wraps the DP one, so that one is built anew;
        # the plain one is reused with its state cleared, which is what a new one holds)
        if self.sample_level_dp:
            with self._client_draws(model, ctx):
                mean_loss, steps, extra = self._train_private(model, x, y, ctx, make_optimizer(model, self.cfg))
        else:
            optimizer = self._fresh_optimiser(model, layout.trainable())
            with self._client_draws(model, ctx):
                mean_loss = self._train_plain(model, x, y, ctx, optimizer)
            steps, extra = num_local_steps(len(y), self.cfg), {}
        self._anchor = None
        metrics = {"train_loss": mean_loss, "local_steps": float(steps), **transformed, **extra}
        return TrainResult(self._reply_arrays(model), num_examples=len(y), metrics=metrics, owned=True)

    def _train_plain(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, ctx: NodeContext,
                     optimizer: torch.optim.Optimizer) -> float:
        batches = iterate_batches(len(y), self.cfg.client.batch_size, torch.Generator().manual_seed(ctx.seed("batches")))
        steps = num_local_steps(len(y), self.cfg)
        loss_sum = 0.0
        for _ in range(steps):
            idx = next(batches)
            optimizer.zero_grad(set_to_none=True)
            loss = self.loss(model, x[idx], y[idx], ctx)
            loss.backward()
            if self.params.grad_clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), self.params.grad_clip)
            optimizer.step()
            loss_sum += float(loss.detach())
        return loss_sum / steps

    def loss(self, model: nn.Module, xb: torch.Tensor, yb: torch.Tensor, ctx: NodeContext) -> torch.Tensor:
        """The local objective: cross-entropy, plus FedProx's proximal term when the round asks."""
        loss = nn.functional.cross_entropy(model(xb), yb)
        if self._anchor is not None:
            loss = loss + proximal_term(model, self._anchor, float(ctx.config[PROXIMAL_MU]))
        return loss

    def evaluate(self, arrays: StateDict, ctx: NodeContext) -> EvalResult:
        x, y = self._tensors(self.data.client_test(ctx.partition_id))
        metrics = evaluate_model(self._load(arrays), x, y, self.cfg.evaluation.batch_size)
        return EvalResult(num_examples=len(y), metrics=metrics)

    def evaluate_global(self, arrays: StateDict) -> dict[str, float]:
        x, y = self._tensors(self.data.server_test)
        metrics = evaluate_model(self._load(arrays), x, y, self.cfg.evaluation.batch_size)
        if self.data.server_val is not None:  # evaluation.validation_fraction > 0: what tuning selects on
            xv, yv = self._tensors(self.data.server_val)
            metrics.update({f"val/{k}": v for k, v in evaluate_model(self._load(arrays), xv, yv,
                                                                     self.cfg.evaluation.batch_size).items()})
        return metrics

    def setup_artifacts(self, out_dir: Path) -> list[Path]:
        hist = self.data.label_histogram()
        return [plot_label_histogram(hist, out_dir / "label_histogram.png",
                                     title=f"{self.cfg.data.name}: labels per client ({self._partition_label()})")]

    def _partition_label(self) -> str:
        """The partitioner and the parameters the user set (``dirichlet, alpha=0.3``), for plot titles."""
        p = self.cfg.data.partition
        fields = [f"{k}={v}" for k, v in vars(p).items() if k != "name" and v is not None and not isinstance(v, list)]
        return ", ".join([p.name, *fields])

    def setup_summary(self) -> dict[str, Any]:
        return {f"data.size.{k}": v for k, v in self.data.summary().items()}
