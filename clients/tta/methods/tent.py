"""Tent, the SGD base of every gradient method, with its params and their checks.

* ``tent`` — entropy minimisation on the norm affine parameters (Wang et al., ICLR 2021;
  benchmark ``tent.py``), SGD momentum 0.9, Nesterov (benchmark ``conf.py`` defaults).

Scaled default for a small model (norm-affine dimension ~10²–10³, C ≈ 10): ``lr`` 1e-2 for
every SGD method (authors: 1.5e-4 R50 / 5e-4 ViT for LCoTTA, 2.5e-4 for Tent/ETA on ImageNet;
on a digits BN-MLP with D = 192, 1e-3 barely moved the model away from BN-1 in 560 batches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from clients.tta.methods.base import TTAMethod
from clients.tta.methods.entropy import softmax_entropy
from fedsim.errors import ConfigError


@dataclass
class TentParams:
    lr: float = 1e-2
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 0.0


def _check_sgd(p: TentParams) -> None:
    if not (isinstance(p.lr, (int, float)) and p.lr > 0 and math.isfinite(p.lr)):
        raise ConfigError(f"lr must be a positive number, got {p.lr!r}")
    if not 0.0 <= p.momentum < 1.0:
        raise ConfigError(f"momentum must be in [0, 1), got {p.momentum!r}")
    if p.nesterov and p.momentum == 0:
        raise ConfigError("nesterov needs momentum > 0; set nesterov: false or momentum: 0.9")
    if p.weight_decay < 0:
        raise ConfigError(f"weight_decay must be >= 0, got {p.weight_decay!r}")


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
