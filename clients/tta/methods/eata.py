"""ETA/EATA: filtered, re-weighted entropy minimisation, with its params and their checks.

* ``eata`` — ETA/EATA (Niu et al., ICML 2022; benchmark ``eata.py``): reliability filter
  H < E0 = e0_margin·ln C, redundancy filter |cos(m, pᵢ)| < d_margin against the EMA m of the kept
  samples' mean softmax (0.9/0.1), weights 1/exp(H − E0); optional Fisher anti-forgetting term.
  The maths is in :mod:`clients.tta.methods.entropy`.

Per method (ETA and the methods built on it, RDumb and LCoTTA):

* Scaled defaults for a small model (C ≈ 10): ``d_margin`` 0.4, the benchmark's CIFAR-10
  EATA/RDumb value (LCoTTA hard-codes the ImageNet 0.05,
  which with 10 classes filters almost every sample, since the cosine of two probability vectors
  rarely drops below 0.05); E0 = 0.4·ln C (LCoTTA hard-codes 0.4·ln 1000 = 2.763).  A confident
  prediction against a balanced EMA has |cos| ≈ 1/√C, so ``d_margin`` must be well above 1/√C
  (0.32 for C = 10) or the redundancy filter drops almost every sample.
* Batches where no sample passes the filters: ``eata``/``rdumb`` skip backward and step, as the
  benchmark's ``perform_update``; ``lcotta`` does what ``Subspace_plus`` does — it backpropagates
  the empty mean (NaN loss, all-zero gradient), snapshots that zero gradient if a snapshot is due,
  and takes the SGD step, which moves the parameters by momentum alone.  ``on_empty`` switches
  either behaviour.  ``last_info["loss"]`` is 0.0 on such a batch (the code's loss is NaN).
* EATA's Fisher term (``fisher_alpha`` > 0) needs :meth:`ETA.compute_fisher` on source batches
  first, computed as the benchmark: squared gradients of the cross-entropy with the model's own
  argmax labels, summed over batches and divided by their number.  LCoTTA's own ``eata.py``
  hard-codes ``fisher_alpha = 0`` (ETA), which is our default.  The Fisher terms are derived from
  the source, so ``reset()`` keeps them (as the benchmark), and so does ``load_state_dict`` of a
  state without them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
import torch.nn.functional as F

from clients.tta.methods.base import StateDict, _as
from clients.tta.methods.entropy import eta_loss, eta_select, softmax_entropy
from clients.tta.methods.tent import Tent, TentParams, _check_sgd
from fedsim.errors import ConfigError


@dataclass
class EATAParams(TentParams):
    e0_margin: float = 0.4  # E0 = e0_margin · ln(num_classes)
    d_margin: float = 0.4  # redundancy filter: keep |cos(m, p_i)| < d_margin
    ema_momentum: float = 0.9  # m ← 0.9·m + 0.1·mean(p_kept)
    fisher_alpha: float = 0.0  # > 0: EATA's anti-forgetting term (call compute_fisher first)
    on_empty: str = "skip"  # no sample kept: "skip" the step (benchmark) or "step" (zero gradient)


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
