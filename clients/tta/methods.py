"""Test-time adaptation methods as plain-PyTorch plug-ins (online: predict, then adapt).

Contract after the online TTA benchmark ``mariodoebler/test-time-adaptation``
(``classification/methods/base.py::TTAMethod``): ``configure_model``, ``collect_params``,
``forward_and_adapt(x) -> logits`` and ``reset()``.  The logits are those of the forward pass that
produced the loss, i.e. computed *before* this batch's update (online prediction).  Added here for
federated use: ``state_dict``/``load_state_dict`` of the method's own state (momentum buffers,
EMA of the mean prediction, gradient window, counters, Fisher terms) as a flat
``dict[str, Tensor]`` that fits a Flower ``ArrayRecord``; ``shared_state``/``load_shared_state``
of the norm affine parameters (what a server averages); ``last_info`` diagnostics of the last
batch.  Methods are looked up by name in :data:`TTA_METHODS` (see :func:`build_method`).

* ``source`` — no adaptation, eval mode (benchmark ``source.py``).
* ``bn_adapt`` — BN-1: test-batch statistics, no gradient (benchmark ``norm.py::BNTest``).
* ``tent`` — entropy minimisation on the norm affine parameters (Wang et al., ICLR 2021;
  benchmark ``tent.py``), SGD momentum 0.9, Nesterov (benchmark ``conf.py`` defaults).
* ``eata`` — ETA/EATA (Niu et al., ICML 2022; benchmark ``eata.py``): reliability filter
  H < E0 = e0_margin·ln C, redundancy filter |cos(m, pᵢ)| < d_margin against the EMA m of the kept
  samples' mean softmax (0.9/0.1), weights 1/exp(H − E0); optional Fisher anti-forgetting term.
* ``rdumb`` — RDumb (Press et al., NeurIPS 2023): the benchmark's ``reset_after_num_updates``
  (``base.py``) on top of ETA (``cfgs/*/rdumb.yaml``: ``ADAPTATION: eata``, ``FISHER_ALPHA: 0``,
  ``RESET_AFTER_NUM_UPDATES: 1000``); ``base="tent"`` resets Tent instead.
* ``lcotta`` — LCoTTA (Duan et al., NeurIPS 2025, https://openreview.net/forum?id=NFvAa2hNzH) as
  coded in ThunderDavid/LCoTTA ``classification/methods/subspace_plus.py::Subspace_plus``: the ETA
  loss; at batch t > 0 with t % s == 0 the raw flattened gradient joins a FIFO window (capacity
  K); once the window holds ≥ r snapshots the gradient is replaced by Pᵀ(P g), P the top-r
  principal components of the centred window (``P_SGD``), then one SGD step.

Deliberate deviations (all methods): one update per batch (``OPTIM.STEPS = 1`` in every config);
no mixed precision; no single-sample sliding window (a batch of one with BatchNorm is a
ConfigError); BN1d uses batch statistics via ``track_running_stats=False`` like BN2d (see
:mod:`clients.tta.norm`).

Per method:

* Scaled defaults for a small model (norm-affine dimension ~10²–10³, C ≈ 10): ``lr`` 1e-2 for
  every SGD method (authors: 1.5e-4 R50 / 5e-4 ViT for LCoTTA, 2.5e-4 for Tent/ETA on ImageNet;
  on a digits BN-MLP with D = 192, 1e-3 barely moved the model away from BN-1 in 560 batches);
  ``d_margin`` 0.4, the benchmark's CIFAR-10 EATA/RDumb value (LCoTTA hard-codes the ImageNet 0.05,
  which with 10 classes filters almost every sample, since the cosine of two probability vectors
  rarely drops below 0.05); E0 = 0.4·ln C (LCoTTA hard-codes 0.4·ln 1000 = 2.763).  A confident
  prediction against a balanced EMA has |cos| ≈ 1/√C, so ``d_margin`` must be well above 1/√C
  (0.32 for C = 10) or the redundancy filter drops almost every sample.
  LCoTTA: K = 100, r = 5, s = 5 (authors: K = 100, r = 25/50, s = 50/100), so projection starts at
  batch index t = r·s = 25.  Against the authors' R50 ImageNet-C setting (issue #30; D ≈ 53k BN
  affine parameters, 78 batches per domain, 58,500 steps), in relative terms: s = 5 is 0.6–0.8 of a
  domain block (authors 0.64); the window spans K·s = 500 batches ≈ 4.5–6 cycles (authors 5,000 ≈
  4.3 cycles); projection starts after 1–4 % of the stream (authors 2 %); but r = 5 keeps 5 % of
  the window's ≤ 99 directions where the authors keep 25 % (r = 25 of 100), i.e. a much narrower
  subspace (with D = 96 here the window spans almost the whole parameter space, so r/K, not r/D,
  is the comparable ratio); and the authors give ETA a higher lr than LCoTTA (5e-4 vs 1.5e-4 R50,
  7.5e-4 vs 5e-4 ViT, ``cfgs/*/imagenet_c/{eta,subspace_plus}.yaml``) where the defaults here use
  one lr for both.  ``experiments/reproduce/lcotta_quick.yaml`` therefore tunes r ∈ {5, 25} and lr
  for LCoTTA and lr for EATA on a validation stream (:mod:`clients.tta_learner`).
  The paper's own sensitivity analysis (r ∈ {10, 25, 50, 100}, window length, interval, lr) is
  not available here (only its ranges, research notes ``continual.md`` §2).
* Batches where no sample passes the filters: ``eata``/``rdumb`` skip backward and step, as the
  benchmark's ``perform_update``; ``lcotta`` does what ``Subspace_plus`` does — it backpropagates
  the empty mean (NaN loss, all-zero gradient), snapshots that zero gradient if a snapshot is due,
  and takes the SGD step, which moves the parameters by momentum alone.  ``on_empty`` switches
  either behaviour.  ``last_info["loss"]`` is 0.0 on such a batch (the code's loss is NaN).
* LCoTTA: the code appends a ``None`` placeholder at batch 0 and drops it at the first snapshot;
  this only matters for r = 1 (where the code crashes) and is not reproduced.  The code's
  copy/restore of model and optimizer state around the PCA is a no-op and omitted.  The subspace
  is recomputed only when the window changed (the code refits every batch on the same window:
  same result).  PCA via ``torch.linalg.svd`` (see :mod:`clients.tta.subspace`).  ``reset()``
  also clears the window and the batch counter (the code never resets).
* EATA's Fisher term (``fisher_alpha`` > 0) needs :meth:`ETA.compute_fisher` on source batches
  first, computed as the benchmark: squared gradients of the cross-entropy with the model's own
  argmax labels, summed over batches and divided by their number.  LCoTTA's own ``eata.py``
  hard-codes ``fisher_alpha = 0`` (ETA), which is our default.  The Fisher terms are derived from
  the source, so ``reset()`` keeps them (as the benchmark), and so does ``load_state_dict`` of a
  state without them.
* RDumb counts ``forward_and_adapt`` calls (the benchmark's ``performed_updates``, which also
  counts ETA's skipped steps); the periodic reset restores model, optimizer and EMA but not that
  counter; ``reset()`` zeroes it too.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from clients.tta.norm import (
    collect_norm_params,
    configure_norm,
    has_batchnorm,
    load_norm_state,
    norm_state,
    use_batch_stats,
)
from clients.tta.subspace import GradientWindow, principal_subspace, project
from fedsim.errors import ConfigError

StateDict = dict[str, torch.Tensor]


# --------------------------------------------------------------------------------------- params


@dataclass
class SourceParams:
    """``source`` takes no parameters."""


@dataclass
class BNAdaptParams:
    """``bn_adapt`` takes no parameters."""


@dataclass
class TentParams:
    lr: float = 1e-2
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 0.0


@dataclass
class EATAParams(TentParams):
    e0_margin: float = 0.4  # E0 = e0_margin · ln(num_classes)
    d_margin: float = 0.4  # redundancy filter: keep |cos(m, p_i)| < d_margin
    ema_momentum: float = 0.9  # m ← 0.9·m + 0.1·mean(p_kept)
    fisher_alpha: float = 0.0  # > 0: EATA's anti-forgetting term (call compute_fisher first)
    on_empty: str = "skip"  # no sample kept: "skip" the step (benchmark) or "step" (zero gradient)


@dataclass
class RDumbParams(EATAParams):
    reset_after_num_updates: int = 1000
    base: str = "eata"  # the method that is reset: "eata" (benchmark's RDumb) or "tent"


@dataclass
class LCoTTAParams(EATAParams):
    window: int = 100  # K, snapshots kept (SUBSPACE.W_NUM)
    rank: int = 5  # r, principal components (SUBSPACE.N_COMPONENTS)
    snapshot_every: int = 5  # s, snapshot at batch t > 0 with t % s == 0 (SUBSPACE.BATCH_STEP)
    project: bool = True  # False: the window is tracked but never used (== eata)
    on_empty: str = "step"  # Subspace_plus always backpropagates and steps


# ------------------------------------------------------------------------------------ functions


def softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-sample Shannon entropy of softmax(logits) (benchmark ``utils/losses.py::Entropy``)."""
    return -(logits.softmax(1) * logits.log_softmax(1)).sum(1)


def update_ema_probs(ema: torch.Tensor | None, probs: torch.Tensor, momentum: float) -> torch.Tensor | None:
    """EATA's moving average of the mean prediction of the kept samples (``update_model_probs``)."""
    with torch.no_grad():
        if probs.shape[0] == 0:
            return ema
        if ema is None:
            return probs.mean(0)
        return momentum * ema + (1 - momentum) * probs.mean(0)


def eta_select(
    logits: torch.Tensor,
    entropy: torch.Tensor,
    e_margin: float,
    d_margin: float,
    ema: torch.Tensor | None,
    momentum: float,
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """ETA's two filters: (indices kept, number passing the reliability filter, updated EMA).

    The redundancy filter applies only once an EMA exists (not on the first batch with kept
    samples), exactly as the code.
    """
    ids1 = torch.where(entropy < e_margin)[0]
    probs1 = logits[ids1].softmax(1)
    if ema is not None:
        cos = F.cosine_similarity(ema.unsqueeze(0), probs1, dim=1)
        ids2 = torch.where(torch.abs(cos) < d_margin)[0]
        keep = ids1[ids2]
        new_ema = update_ema_probs(ema, probs1[ids2], momentum)
    else:
        keep = ids1
        new_ema = update_ema_probs(ema, probs1, momentum)
    return keep, int(ids1.numel()), new_ema


def eta_loss(entropy: torch.Tensor, keep: torch.Tensor, e_margin: float) -> torch.Tensor:
    """Mean of Hᵢ·exp(E0 − Hᵢ) over kept samples, weights detached (NaN when none is kept)."""
    h = entropy[keep]
    coeff = 1 / torch.exp(h.clone().detach() - e_margin)
    return h.mul(coeff).mean(0)


def _check_sgd(p: TentParams) -> None:
    if not (isinstance(p.lr, (int, float)) and p.lr > 0 and math.isfinite(p.lr)):
        raise ConfigError(f"lr must be a positive number, got {p.lr!r}")
    if not 0.0 <= p.momentum < 1.0:
        raise ConfigError(f"momentum must be in [0, 1), got {p.momentum!r}")
    if p.nesterov and p.momentum == 0:
        raise ConfigError("nesterov needs momentum > 0; set nesterov: false or momentum: 0.9")
    if p.weight_decay < 0:
        raise ConfigError(f"weight_decay must be >= 0, got {p.weight_decay!r}")


def _check_eata(p: EATAParams) -> None:
    _check_sgd(p)
    if not p.e0_margin > 0:
        raise ConfigError(f"e0_margin must be > 0 (E0 = e0_margin·ln C), got {p.e0_margin!r}")
    if not p.d_margin > 0:
        raise ConfigError(f"d_margin must be > 0 (cosine threshold, 0.05 ImageNet / 0.4 CIFAR-10), got {p.d_margin!r}")
    if not 0.0 <= p.ema_momentum < 1.0:
        raise ConfigError(f"ema_momentum must be in [0, 1), got {p.ema_momentum!r}")
    if p.fisher_alpha < 0:
        raise ConfigError(f"fisher_alpha must be >= 0, got {p.fisher_alpha!r}")
    if p.on_empty not in ("skip", "step"):
        raise ConfigError(f"on_empty must be 'skip' or 'step', got {p.on_empty!r}")


# ---------------------------------------------------------------------------------------- base


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
    v = torch.as_tensor(value)
    if tuple(v.shape) != tuple(like.shape):
        raise ConfigError(f"state {key!r} has shape {tuple(v.shape)}, expected {tuple(like.shape)}")
    return v.detach().clone().to(device=like.device, dtype=like.dtype)


def _counter(state: Mapping[str, torch.Tensor], key: str) -> int:
    return int(torch.as_tensor(state[key]).item()) if key in state else 0


# ------------------------------------------------------------------------------------- methods


class Source(TTAMethod):
    """No adaptation: the source model in eval mode."""

    name = "source"
    Params = SourceParams
    batch_stats = False

    def configure_model(self) -> None:
        self.model.eval()
        self.model.requires_grad_(False)

    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        with torch.no_grad():
            out = self.model(x)
        self._check_logits(out)
        self.last_info = {}
        return out


class BNAdapt(Source):
    """BN-1: BatchNorm normalises with the test batch's statistics; no gradient."""

    name = "bn_adapt"
    Params = BNAdaptParams
    batch_stats = True

    def configure_model(self) -> None:
        super().configure_model()
        use_batch_stats(self.model)


class Tent(TTAMethod):
    """Tent: minimise the mean prediction entropy over the norm affine parameters."""

    name = "tent"
    Params = TentParams

    def validate_params(self) -> None:
        _check_sgd(self.params)

    def setup_optimizer(self) -> torch.optim.Optimizer:
        if not self.param_list:
            raise ConfigError(
                f"{self.name}: the model has no BatchNorm/LayerNorm/GroupNorm affine parameters to adapt"
            )
        p = self.params
        return torch.optim.SGD(
            self.param_list, lr=p.lr, momentum=p.momentum, dampening=0.0,
            weight_decay=p.weight_decay, nesterov=p.nesterov,
        )

    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        with torch.enable_grad():
            out = self.model(x)
            self._check_logits(out)
            info = self.adapt(out)
        self.optimizer.zero_grad()
        self.last_info = info
        return out.detach()

    def adapt(self, out: torch.Tensor) -> dict[str, float]:
        """Loss, backward and step on this batch's logits; returns the diagnostics."""
        ent = softmax_entropy(out)
        loss = ent.mean(0)
        loss.backward()
        self.optimizer.step()
        return {"loss": float(loss.detach()), "entropy": float(ent.detach().mean()), "kept_frac": 1.0,
                "updated": 1.0}

    def flat_grad(self) -> torch.Tensor:
        """The gradient of the adapted parameters as one flat vector (zeros where None)."""
        return torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
            for p in self.param_list
        ])

    def set_flat_grad(self, g: torch.Tensor) -> None:
        i = 0
        for p in self.param_list:
            n = p.numel()
            p.grad = g[i:i + n].reshape(p.shape).clone()
            i += n


class ETA(Tent):
    """ETA/EATA: filtered (reliable, non-redundant) and re-weighted entropy minimisation."""

    name = "eata"
    Params = EATAParams

    def validate_params(self) -> None:
        _check_eata(self.params)

    @property
    def e_margin(self) -> float:
        return self.params.e0_margin * math.log(self.num_classes)

    def init_state(self) -> None:
        self.ema_probs: torch.Tensor | None = None
        if not hasattr(self, "fisher"):
            self.fisher: dict[str, torch.Tensor] | None = None
            self.fisher_anchor: dict[str, torch.Tensor] | None = None

    def compute_fisher(self, source_batches: Iterable[torch.Tensor]) -> None:
        """EATA's diagonal Fisher of the norm affine parameters on (unlabelled) source batches.

        Squared gradients of CE(model(x), argmax model(x)) per batch, averaged over the batches;
        the anchor is the current (source) parameter value.
        """
        total: list[torch.Tensor] | None = None
        count = 0
        self.optimizer.zero_grad()
        with torch.enable_grad():
            for x in source_batches:
                self._check_input(x)
                out = self.model(x)
                F.cross_entropy(out, out.argmax(1)).backward()
                sq = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach() ** 2 for p in self.param_list]
                total = sq if total is None else [a + b for a, b in zip(total, sq)]
                count += 1
                self.optimizer.zero_grad()
        if total is None:
            raise ConfigError("compute_fisher needs at least one source batch")
        self.fisher = {n: t / count for n, t in zip(self.param_names, total)}
        self.fisher_anchor = {n: p.detach().clone() for n, p in zip(self.param_names, self.param_list)}

    def adapt(self, out: torch.Tensor) -> dict[str, float]:
        p = self.params
        ent = softmax_entropy(out)
        keep, n_reliable, self.ema_probs = eta_select(
            out, ent, self.e_margin, p.d_margin, self.ema_probs, p.ema_momentum
        )
        loss = eta_loss(ent, keep, self.e_margin)
        if p.fisher_alpha > 0:
            if self.fisher is None:
                raise ConfigError(f"{self.name}: fisher_alpha > 0 needs compute_fisher(source_batches) first")
            for n, q in zip(self.param_names, self.param_list):
                loss = loss + p.fisher_alpha * (self.fisher[n] * (q - self.fisher_anchor[n]) ** 2).sum()
        n = out.shape[0]
        kept = int(keep.numel())
        info = {
            "loss": float(loss.detach()) if kept else 0.0,
            "entropy": float(ent.detach().mean()),
            "reliable_frac": n_reliable / n,
            "kept_frac": kept / n,
            "updated": 0.0,
        }
        if kept == 0 and p.on_empty == "skip":
            return info
        loss.backward()
        self.step(info)
        info["updated"] = 1.0
        return info

    def step(self, info: dict[str, float]) -> None:
        """Turn the accumulated gradient into an update (ETA: a plain SGD step)."""
        self.optimizer.step()

    # -- state --------------------------------------------------------------------------------

    def extra_state(self) -> StateDict:
        out: StateDict = {}
        if self.ema_probs is not None:
            out["ema_probs"] = self.ema_probs.detach().clone()
        if self.fisher is not None:
            for n in self.param_names:
                out[f"fisher.{n}"] = self.fisher[n].clone()
                out[f"fisher_anchor.{n}"] = self.fisher_anchor[n].clone()
        return out

    def extra_state_keys(self) -> set[str]:
        keys = {"ema_probs"}
        for n in self.param_names:
            keys |= {f"fisher.{n}", f"fisher_anchor.{n}"}
        return keys

    def load_extra_state(self, state: Mapping[str, torch.Tensor]) -> None:
        if "ema_probs" in state:
            v = torch.as_tensor(state["ema_probs"])
            if tuple(v.shape) != (self.num_classes,):
                raise ConfigError(f"state 'ema_probs' has shape {tuple(v.shape)}, expected ({self.num_classes},)")
            self.ema_probs = v.detach().clone().to(self.param_list[0].device)
        if any(f"fisher.{n}" in state for n in self.param_names):
            self.fisher = {n: _as(state[f"fisher.{n}"], q, f"fisher.{n}")
                           for n, q in zip(self.param_names, self.param_list)}
            self.fisher_anchor = {n: _as(state[f"fisher_anchor.{n}"], q, f"fisher_anchor.{n}")
                                  for n, q in zip(self.param_names, self.param_list)}


class RDumb(ETA):
    """RDumb: ETA (or Tent) reset to the source model every ``reset_after_num_updates`` batches."""

    name = "rdumb"
    Params = RDumbParams

    def validate_params(self) -> None:
        _check_eata(self.params)
        n = self.params.reset_after_num_updates
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"reset_after_num_updates must be an integer >= 1, got {n!r}")
        if self.params.base not in ("eata", "tent"):
            raise ConfigError(f"rdumb base must be 'eata' or 'tent', got {self.params.base!r}")

    def init_state(self) -> None:
        super().init_state()
        self.performed_updates = 0

    def adapt(self, out: torch.Tensor) -> dict[str, float]:
        info = Tent.adapt(self, out) if self.params.base == "tent" else super().adapt(out)
        self.performed_updates += 1
        info["reset"] = 0.0
        if self.performed_updates % self.params.reset_after_num_updates == 0:
            self.optimizer.zero_grad()
            self._restore_source()
            self.ema_probs = None
            info["reset"] = 1.0
        return info

    def extra_state(self) -> StateDict:
        out = super().extra_state()
        out["performed_updates"] = torch.tensor(self.performed_updates, dtype=torch.int64)
        return out

    def extra_state_keys(self) -> set[str]:
        return super().extra_state_keys() | {"performed_updates"}

    def load_extra_state(self, state: Mapping[str, torch.Tensor]) -> None:
        super().load_extra_state(state)
        self.performed_updates = _counter(state, "performed_updates")


class LCoTTA(ETA):
    """LCoTTA (``Subspace_plus``): ETA with the update projected onto a tracked gradient subspace.

    ``last_info`` adds ``window`` (snapshots held), ``projected`` (0/1), and once the window holds
    ≥ r snapshots ``explained_var`` (top-r explained-variance ratio of the window, also with
    ``project=False``) and, when projected, ``kept_grad_frac`` = ‖PᵀPg‖/‖g‖.
    """

    name = "lcotta"
    Params = LCoTTAParams

    def validate_params(self) -> None:
        _check_eata(self.params)
        p = self.params
        for key in ("window", "rank", "snapshot_every"):
            v = getattr(p, key)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"lcotta {key} must be an integer >= 1, got {v!r}")
        if p.rank > p.window:
            raise ConfigError(
                f"lcotta rank r={p.rank} exceeds the window K={p.window}: the projection would never start; "
                "use rank <= window"
            )

    def init_state(self) -> None:
        super().init_state()
        dim = sum(q.numel() for q in self.param_list)
        if self.params.rank > dim:
            raise ConfigError(
                f"lcotta rank r={self.params.rank} exceeds the norm-affine dimension D={dim}; use rank <= {dim}"
            )
        self.window = GradientWindow(self.params.window, dim)
        self.batch_num = 0
        self._cache: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def adapt(self, out: torch.Tensor) -> dict[str, float]:
        info = super().adapt(out)
        self.batch_num += 1
        info["window"] = float(len(self.window))
        info.setdefault("projected", 0.0)
        return info

    def subspace(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(P, explained-variance ratios) of the current window, cached per window version."""
        if self._cache is None or self._cache[0] != self.window.version:
            p, evr = principal_subspace(self.window.matrix(), self.params.rank)
            self._cache = (self.window.version, p, evr)
        return self._cache[1], self._cache[2]

    def step(self, info: dict[str, float]) -> None:
        p = self.params
        t = self.batch_num
        g = self.flat_grad()
        if t > 0 and t % p.snapshot_every == 0:
            self.window.append(g)
        if len(self.window) >= p.rank:
            proj, evr = self.subspace()
            info["explained_var"] = float(evr.sum())
            if p.project:
                gp = project(g, proj.to(g.device))
                self.set_flat_grad(gp)
                gn = float(g.norm())
                info["projected"] = 1.0
                info["kept_grad_frac"] = float(gp.norm()) / gn if gn > 0 else 0.0
        self.optimizer.step()

    def extra_state(self) -> StateDict:
        out = super().extra_state()
        out["window"] = self.window.matrix()
        out["batch_num"] = torch.tensor(self.batch_num, dtype=torch.int64)
        return out

    def extra_state_keys(self) -> set[str]:
        return super().extra_state_keys() | {"window", "batch_num"}

    def load_extra_state(self, state: Mapping[str, torch.Tensor]) -> None:
        super().load_extra_state(state)
        if "window" in state:
            device = self.param_list[0].device
            self.window.load_matrix(torch.as_tensor(state["window"]).to(device=device, dtype=self.param_list[0].dtype))
        self.batch_num = _counter(state, "batch_num")


# ------------------------------------------------------------------------------------ registry

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
