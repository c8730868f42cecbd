"""Weak and strong augmentations for the LDL sets (torch, seeded by a ``torch.Generator``).

FixMatch-style SSL needs two strengths of augmentation: a *weak* one whose predictions become
pseudo-labels, and a *strong* one the student must match.  The RankMatch notes name Cutout among the
strong augmentations; everything else here is this reconstruction's choice, scaled to tiny inputs
(:class:`AugmentParams`; noise levels are fractions of the data's std).

Images (N, 1, H, W) — the digits' 8x8 and MNIST's 28x28 (``background`` is the value of an empty
pixel: 0 for digits, the standardised zero for MNIST; geometry moves ``x − background``):

* weak: Gaussian noise (``weak_noise``) after a random translation by up to ``shift`` whole pixels
  (default 0; ``-1`` = ``max(1, round(H/8))``, FixMatch's 12.5 %);
* strong: a random affine map (rotation up to ``rotation`` degrees, default 0; scale 0.9–1.1 and a
  translation up to twice the weak one when ``rotation`` or ``shift`` is on), Cutout of one square
  of side ``round(cutout · H)`` (default 0.25: 2 px on 8x8) filled with the background, and noise
  (``strong_noise``).

Tabular (N, D) features: weak = Gaussian noise (``weak_noise`` × each feature's std); strong =
noise (``strong_noise``) and each feature replaced by its mean with probability ``drop``
(feature-level Cutout, as in VIME / SCARF-style corruption; off by default).

The defaults are deliberately mild and keep the geometry: consistency methods train
``f(strong(x)) ≈ q(x)``, which only helps when the true distribution of ``x`` hardly changes under
the augmentation.  The synthetic sets' truths come from teachers on raw pixels / features
(:mod:`envs.ldl`), which are not shift- or rotation-invariant; measured at 5 % labels on one seed,
FixMatch-style consistency with one-pixel weak shifts, 20° rotations and 3x3 Cutout (digits) or
20 % masked features (tabular) fell well below supervised KL (tabular KL 0.30 vs 0.12).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class AugmentParams:
    """Augmentation strengths (``client.params.augment``)."""

    weak_noise: float = 0.05  # std of the weak view's noise, x the data's std
    strong_noise: float = 0.15  # std of the strong view's noise, x the data's std
    shift: int = 0  # images: weak translation in whole pixels (-1 = max(1, round(H/8))); strong: twice it
    rotation: float = 0.0  # images, strong: largest rotation in degrees
    cutout: float = 0.25  # images, strong: Cutout square side as a fraction of the height (0 = off)
    drop: float = 0.0  # tabular, strong: probability that a feature is replaced by its mean

    def check(self, where: str = "client.params.augment") -> None:
        from fedsim.errors import ConfigError

        ok = (min(self.weak_noise, self.strong_noise, self.rotation, self.cutout, self.drop) >= 0
              and self.shift >= -1 and self.cutout <= 1 and self.drop <= 1)
        if not ok:
            raise ConfigError(f"{where}: noise, rotation, cutout and drop must be >= 0 (cutout and drop <= 1) and "
                              f"shift >= -1, got {self}")


def _uniform(n: int, low: float, high: float, gen: torch.Generator) -> torch.Tensor:
    return low + (high - low) * torch.rand(n, generator=gen)


@dataclass
class ImageAugment:
    """Weak / strong augmentation of (N, 1, H, W) images."""

    height: int
    width: int
    background: float
    std: float
    params: AugmentParams = field(default_factory=AugmentParams)

    @property
    def shift(self) -> int:
        return self.params.shift if self.params.shift >= 0 else max(1, round(self.height / 8))

    def _affine(self, x: torch.Tensor, angle: torch.Tensor, scale: torch.Tensor, tx: torch.Tensor,
                ty: torch.Tensor) -> torch.Tensor:
        cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
        # affine_grid maps output to input coordinates in [-1, 1]; a shift of k pixels is 2k / size
        theta = torch.stack([torch.stack([cos, -sin, -2 * tx / self.width], 1),
                             torch.stack([sin, cos, -2 * ty / self.height], 1)], 1)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return F.grid_sample(x - self.background, grid, mode="bilinear", padding_mode="zeros",
                             align_corners=False) + self.background

    def weak(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        n, s = len(x), self.shift
        out = x
        if s > 0:
            tx = torch.randint(-s, s + 1, (n,), generator=gen).float()
            ty = torch.randint(-s, s + 1, (n,), generator=gen).float()
            out = self._affine(x, torch.zeros(n), torch.ones(n), tx, ty)
        return out + self.params.weak_noise * self.std * torch.randn(x.shape, generator=gen)

    def strong(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        n, s = len(x), 2 * self.shift
        out = x
        if self.params.rotation > 0 or s > 0:
            angle = _uniform(n, -math.radians(self.params.rotation), math.radians(self.params.rotation), gen)
            scale = _uniform(n, 0.9, 1.1, gen)
            tx, ty = _uniform(n, -s, s, gen), _uniform(n, -s, s, gen)
            out = self._affine(x, angle, scale, tx, ty)
        side = round(self.params.cutout * self.height)
        if side < 1:
            return out + self.params.strong_noise * self.std * torch.randn(x.shape, generator=gen)
        top = torch.randint(0, self.height - side + 1, (n,), generator=gen)
        left = torch.randint(0, self.width - side + 1, (n,), generator=gen)
        rows, cols = torch.arange(self.height), torch.arange(self.width)
        in_rows = (rows[None] >= top[:, None]) & (rows[None] < top[:, None] + side)
        in_cols = (cols[None] >= left[:, None]) & (cols[None] < left[:, None] + side)
        box = (in_rows[:, :, None] & in_cols[:, None, :])[:, None]
        out = torch.where(box, torch.full_like(out, self.background), out)
        return out + self.params.strong_noise * self.std * torch.randn(x.shape, generator=gen)


@dataclass
class TabularAugment:
    """Weak / strong augmentation of (N, D) features."""

    mean: torch.Tensor
    std: torch.Tensor
    params: AugmentParams = field(default_factory=AugmentParams)

    def weak(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        return x + self.params.weak_noise * self.std * torch.randn(x.shape, generator=gen)

    def strong(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        noisy = x + self.params.strong_noise * self.std * torch.randn(x.shape, generator=gen)
        if self.params.drop <= 0:
            return noisy
        drop = torch.rand(x.shape, generator=gen) < self.params.drop
        return torch.where(drop, self.mean.expand_as(x), noisy)


Augment = ImageAugment | TabularAugment


def augment_for(x: np.ndarray, params: AugmentParams | None = None) -> Augment:
    """The augmentation for a data set's instances (images if (N, 1, H, W), else tabular)."""
    p = params or AugmentParams()
    if x.ndim == 4:
        return ImageAugment(int(x.shape[2]), int(x.shape[3]), float(x.min()), float(x.std()), p)
    flat = torch.from_numpy(np.ascontiguousarray(x.reshape(len(x), -1), dtype=np.float32))
    return TabularAugment(flat.mean(0), flat.std(0), p)
