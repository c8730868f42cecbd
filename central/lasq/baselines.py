"""Baselines: one global gamma, the per-pixel initial gamma γ₀, and a supervised U-Net on paired data."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from central.lasq.diffusion import SmallUNet, from_signed, pad_to_multiple, to_signed
from central.lasq.gamma import GammaConfig, apply_gamma, base_luminance, global_gamma, initial_gamma


def enhance_global_gamma(x: torch.Tensor, cfg: GammaConfig) -> torch.Tensor:
    """x^γ with one γ per image: the γ₀ formula at the image's mean intensity (LASQ's 1-region level, no MCMC)."""
    g = global_gamma(x, cfg.gamma_base).clamp(cfg.gamma_min, cfg.gamma_max)
    return apply_gamma(x, g)


def enhance_pixel_gamma(x: torch.Tensor, cfg: GammaConfig) -> torch.Tensor:
    """x^γ₀ with the per-pixel initial map (no Metropolis, no layers, no filtering, no diffusion)."""
    g = initial_gamma(base_luminance(x, cfg.sigmas), cfg.gamma_base).clamp(cfg.gamma_min, cfg.gamma_max)
    return apply_gamma(x, g)


class Supervised:
    """The same small U-Net (no timestep), trained with L1 on (dark, clean) pairs of the training range."""

    def __init__(self, width: int) -> None:
        self.net = SmallUNet(3, 3, width, time=False)

    def loss(self, x_low: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
        return F.l1_loss(self.predict(x_low), clean)

    def predict(self, x_low: torch.Tensor) -> torch.Tensor:
        return from_signed(self.net(to_signed(x_low)))

    @torch.no_grad()
    def enhance(self, x_low: torch.Tensor) -> torch.Tensor:
        padded, (H, W) = pad_to_multiple(x_low, 4)
        return self.predict(padded)[..., :H, :W]


def train_loop(params: list[torch.nn.Parameter], step_loss: Callable[[int], tuple[torch.Tensor, dict[str, float]]],
               steps: int, lr: float, on_step: Callable[[int, dict[str, float]], None]) -> None:
    """Adam (β₁ = 0.5 as the authors' config) with a cosine decay to 0; ``step_loss(i)`` returns (loss, parts)."""
    opt = torch.optim.Adam(params, lr=lr, betas=(0.5, 0.999))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + np.cos(np.pi * min(i, steps) / steps)))
    for i in range(steps):
        loss, parts = step_loss(i)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        on_step(i, parts)
