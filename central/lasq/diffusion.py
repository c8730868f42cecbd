"""A small conditional DDPM whose timestep picks the luminance layer (the LASQ forward process).

Training (``Gamma_Diff.Net.forward`` / ``DenoisingDiffusion.train``, in image space here):

* timesteps are drawn antithetically (half ``t``, half ``T − 1 − t``);
* each sample's target is its luminance layer at level ``i = min(⌊t / (T/N)⌋, N − 1)``, i.e. an image
  with ``2^i`` γ-regions (fresh Metropolis draw per call); it is noised as
  ``x_t = √ᾱ_t·x₀ + √(1 − ᾱ_t)·ε`` and the U-Net, fed ``[x_low, x_t]`` and ``t``, predicts ε (MSE);
* the "scc" term: an L1 distance between a DDIM sample from the dark input (with gradients through the
  sampler) and the per-pixel-γ reference image, weighted 0.25.

Sampling is DDIM (η = 0) on ``range(0, T, T // steps)``, starting from pure noise, as the authors'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class DiffusionConfig:
    timesteps: int = 100
    sample_steps: int = 10
    levels: int = 10  # N: the number of luminance layers along the timestep axis
    beta_start: float = 1e-4  # for T = 1000; scaled by 1000 / T (so ᾱ_T ≈ 0 at any T)
    beta_end: float = 0.02
    width: int = 16
    scc_weight: float = 0.25
    prediction: str = "x0"  # "eps" (the authors') or "x0" (the network outputs x₀; ε is derived from it)


def linear_betas(cfg: DiffusionConfig) -> torch.Tensor:
    """The authors' linear β schedule, rescaled by 1000 / T so a short chain still ends in noise."""
    scale = 1000.0 / cfg.timesteps
    betas = np.linspace(cfg.beta_start * scale, cfg.beta_end * scale, cfg.timesteps, dtype=np.float64)
    return torch.from_numpy(np.clip(betas, 0.0, 0.999)).float()


def alpha_bars(betas: torch.Tensor) -> torch.Tensor:
    return torch.cumprod(1.0 - betas, dim=0)


def level_of_timestep(t: torch.Tensor, timesteps: int, levels: int) -> torch.Tensor:
    """Layer index i = min(⌊t / (T // N)⌋, N − 1) (``region_id`` in the authors' code)."""
    seg = max(1, timesteps // levels)
    return torch.clamp(t // seg, max=levels - 1)


def q_sample(x0: torch.Tensor, t: torch.Tensor, abar: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Forward noising x_t = √ᾱ_t·x₀ + √(1 − ᾱ_t)·ε."""
    a = abar[t].view(-1, 1, 1, 1)
    return a.sqrt() * x0 + (1.0 - a).sqrt() * noise


def antithetic_timesteps(batch: int, timesteps: int, generator: torch.Generator) -> torch.Tensor:
    t = torch.randint(0, timesteps, (batch // 2 + 1,), generator=generator)
    return torch.cat([t, timesteps - t - 1])[:batch]


def to_signed(x: torch.Tensor) -> torch.Tensor:
    return 2.0 * x - 1.0


def from_signed(x: torch.Tensor) -> torch.Tensor:
    return ((x + 1.0) / 2.0).clamp(0.0, 1.0)


# -- the network --------------------------------------------------------------------------------------

def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    args = t.float().view(-1, 1) * freqs.view(1, -1)
    return torch.cat([torch.sin(args), torch.cos(args)], dim=1)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, temb: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(min(4, cin), cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = nn.Linear(temb, cout) if temb else None
        self.norm2 = nn.GroupNorm(min(4, cout), cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor | None) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        if self.temb is not None and emb is not None:
            h = h + self.temb(emb)[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class SmallUNet(nn.Module):
    """Two-scale U-Net (widths w, 2w, 4w), optional timestep embedding; input sides must be multiples of 4."""

    def __init__(self, cin: int, cout: int, width: int = 16, time: bool = True) -> None:
        super().__init__()
        w, temb = width, (4 * width if time else 0)
        self.temb_dim = temb
        self.time_mlp = nn.Sequential(nn.Linear(w, temb), nn.SiLU(), nn.Linear(temb, temb)) if time else None
        self.inc = nn.Conv2d(cin, w, 3, padding=1)
        self.d1 = ResBlock(w, w, temb)
        self.down1 = nn.Conv2d(w, 2 * w, 3, stride=2, padding=1)
        self.d2 = ResBlock(2 * w, 2 * w, temb)
        self.down2 = nn.Conv2d(2 * w, 4 * w, 3, stride=2, padding=1)
        self.mid = ResBlock(4 * w, 4 * w, temb)
        self.u2 = ResBlock(6 * w, 2 * w, temb)
        self.u1 = ResBlock(3 * w, w, temb)
        self.out = nn.Sequential(nn.GroupNorm(4, w), nn.SiLU(), nn.Conv2d(w, cout, 3, padding=1))
        self.width = width

    def forward(self, x: torch.Tensor, t: torch.Tensor | None = None) -> torch.Tensor:
        emb = None
        if self.time_mlp is not None:
            emb = self.time_mlp(timestep_embedding(t if t is not None else torch.zeros(x.shape[0]), self.width))
        h1 = self.d1(self.inc(x), emb)
        h2 = self.d2(self.down1(h1), emb)
        h = self.mid(self.down2(h2), emb)
        h = self.u2(torch.cat([F.interpolate(h, scale_factor=2.0, mode="nearest"), h2], 1), emb)
        h = self.u1(torch.cat([F.interpolate(h, scale_factor=2.0, mode="nearest"), h1], 1), emb)
        return self.out(h)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- the diffusion model --------------------------------------------------------------------------------

class LasqDiffusion:
    """The denoiser, its schedule, the training loss and DDIM sampling (inputs/outputs in [0, 1])."""

    def __init__(self, cfg: DiffusionConfig) -> None:
        self.cfg = cfg
        self.net = SmallUNet(6, 3, cfg.width, time=True)
        self.betas = linear_betas(cfg)
        self.abar = alpha_bars(self.betas)

    def schedule(self) -> list[int]:
        skip = max(1, self.cfg.timesteps // self.cfg.sample_steps)
        return list(range(0, self.cfg.timesteps, skip))

    def split(self, out: torch.Tensor, xt: torch.Tensor, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x₀, ε) from the network output at noise level ᾱ_t, for either parametrisation."""
        if self.cfg.prediction == "eps":
            return (xt - out * (1 - at).sqrt()) / at.sqrt(), out
        return out, (xt - at.sqrt() * out) / (1 - at).sqrt()

    def sample(self, x_low: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """DDIM (η = 0) from noise, conditioned on the dark image; differentiable (no ``no_grad`` inside)."""
        cond = to_signed(x_low)
        x = torch.randn(cond.shape, generator=generator)
        seq = self.schedule()
        seq_next = [-1] + seq[:-1]
        abar = torch.cat([torch.ones(1), self.abar])  # index t + 1; t = -1 means ᾱ = 1
        for i, j in zip(reversed(seq), reversed(seq_next)):
            at, an = abar[i + 1], abar[j + 1]
            out = self.net(torch.cat([cond, x], 1), torch.full((x.shape[0],), float(i)))
            x0, eps = self.split(out, x, at)
            x = an.sqrt() * x0 + (1 - an).sqrt() * eps
        return from_signed(x)

    def loss(self, x_low: torch.Tensor, target_for_level: Callable[[torch.Tensor], torch.Tensor],
             reference: torch.Tensor | None, scc_idx: int, generator: torch.Generator
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """Denoising MSE on level-wise targets + scc L1 of a DDIM sample of the first ``scc_idx`` images to
        ``reference`` (skipped when ``reference`` is None or ``scc_idx`` is 0)."""
        B = x_low.shape[0]
        t = antithetic_timesteps(B, self.cfg.timesteps, generator)
        levels = level_of_timestep(t, self.cfg.timesteps, self.cfg.levels)
        x0 = to_signed(target_for_level(levels))
        eps = torch.randn(x0.shape, generator=generator)
        xt = q_sample(x0, t, self.abar, eps)
        pred = self.net(torch.cat([to_signed(x_low), xt], 1), t.float())
        noise_loss = F.mse_loss(pred, eps if self.cfg.prediction == "eps" else x0)
        total, parts = noise_loss, {"noise": float(noise_loss.detach())}
        if self.cfg.scc_weight > 0 and reference is not None and scc_idx > 0:
            scc = F.l1_loss(self.sample(x_low[:scc_idx], generator), reference[:scc_idx])
            total = total + self.cfg.scc_weight * scc
            parts["scc"] = float(scc.detach())
        return total, parts


def pad_to_multiple(x: torch.Tensor, m: int = 4) -> tuple[torch.Tensor, tuple[int, int]]:
    """Reflect-pad H and W up to multiples of ``m`` (the authors pad to 64); returns the original size."""
    H, W = x.shape[-2:]
    ph, pw = (-H) % m, (-W) % m
    return (F.pad(x, (0, pw, 0, ph), mode="reflect") if ph or pw else x), (H, W)
