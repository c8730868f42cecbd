"""The Pan-LUT network: PGLUT (5-D, spectral) → SDLUT ×4 rotations (4-D, spatial) → AOLUT (5-D, output).

Tensors are (B, C, H, W) in [0, 1].  With ``ms_up`` the bicubic-upsampled 4-band MS and ``pan`` the
PAN band:

1. **PGLUT** — one 5-D LUT indexed by (MS₁…MS₄, PAN) → 4 spectrally adjusted bands (identity init:
   output b = MS_b).
2. **SDLUT** — the 4 adjusted bands and PAN (5 channels) pass through four spatial-details stages,
   0°, 90°, 180°, 270°, applied *sequentially*.  Stage k rotates the image by k·90°, replaces every
   pixel of channel c by the 4-D LUT of channel c indexed by its 2×2 neighbourhood (pixel, right,
   below, below-right; replicate padding at the border), rotates back and clamps to [0, 1].  Each
   stage has its own per-channel tables (identity init: the pixel itself), so together they see
   all four diagonal directions.
3. **AOLUT** — one 5-D LUT indexed by the 5 refined channels → the 4 output bands (identity init on
   the 4 bands), clamped to [0, 1].

Parameters: 4·d_pg⁵ + 4·5·d_sd⁴ + 4·d_ao⁵ (603,612 for d = 9, 9, 9).

Every lookup goes through ``PanLUT.lookup``: the fused gather :func:`central.panlut.lut.interpolate`
(default, training and inference), or the reference :func:`central.panlut.lut.interpolate_lerp`
(``PanLUT(..., lookup=interpolate_lerp)``; tests and ``benchmarks/panlut_lookup.py``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from central.panlut.lut import curvature, identity_tables, interpolate, lut_ops_per_pixel, lut_params

BANDS = 4           # multispectral bands (R, G, B, NIR)
CHANNELS = BANDS + 1  # + PAN
ROTATIONS = (0, 1, 2, 3)  # multiples of 90°
Lookup = Callable[[torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]


def _pointwise(tables: torch.Tensor, x: torch.Tensor, lookup: Lookup = interpolate) -> torch.Tensor:
    """A single (G = 1) LUT applied per pixel: x (B, n, H, W) → (B, C_out, H, W)."""
    b, n, h, w = x.shape
    flat = x.permute(1, 0, 2, 3).reshape(n, 1, b * h * w)
    out = lookup(tables, [flat[k] for k in range(n)])[0]          # (B·H·W, C_out)
    return out.reshape(b, h, w, -1).permute(0, 3, 1, 2)


def neighbourhood(x: torch.Tensor) -> list[torch.Tensor]:
    """The 2×2 neighbourhood planes (pixel, right, below, below-right) of x (B, C, H, W), replicate-padded."""
    h, w = x.shape[-2:]
    p = F.pad(x, (0, 1, 0, 1), mode="replicate")
    return [p[..., :h, :w], p[..., :h, 1:], p[..., 1:, :w], p[..., 1:, 1:]]


def sd_stage(tables: torch.Tensor, x: torch.Tensor, rotation: int, lookup: Lookup = interpolate) -> torch.Tensor:
    """One spatial-details stage: per-channel 4-D LUT over 2×2 neighbourhoods at ``rotation``·90°, clamped."""
    r = torch.rot90(x, rotation, dims=(-2, -1)) if rotation else x
    b, c, h, w = r.shape
    planes = [q.permute(1, 0, 2, 3).reshape(c, b * h * w) for q in neighbourhood(r)]
    out = lookup(tables, planes)[..., 0]                                # (C, B·H·W)
    out = out.reshape(c, b, h, w).permute(1, 0, 2, 3)
    if rotation:
        out = torch.rot90(out, -rotation, dims=(-2, -1))
    return out.clamp(0.0, 1.0)


class PanLUT(nn.Module):
    """PGLUT → SDLUT(0°, 90°, 180°, 270°) → AOLUT, all identity-initialised."""

    def __init__(self, pg_dim: int = 9, sd_dim: int = 9, ao_dim: int = 9, lookup: Lookup = interpolate) -> None:
        super().__init__()
        self.lookup = lookup
        self.pg = nn.Parameter(identity_tables(1, CHANNELS, pg_dim, range(BANDS)))
        self.sd = nn.ParameterList([nn.Parameter(identity_tables(CHANNELS, 4, sd_dim, [0])) for _ in ROTATIONS])
        self.ao = nn.Parameter(identity_tables(1, CHANNELS, ao_dim, range(BANDS)))

    def curvature(self) -> torch.Tensor:
        """Σ over the LUTs of their mean squared second differences (the smoothness regulariser)."""
        return curvature(self.pg) + sum(curvature(t) for t in self.sd) + curvature(self.ao)

    def forward(self, ms_up: torch.Tensor, pan: torch.Tensor) -> torch.Tensor:
        y = _pointwise(self.pg, torch.cat([ms_up, pan], dim=1), self.lookup)
        z = torch.cat([y, pan], dim=1)
        for rotation, tables in zip(ROTATIONS, self.sd):
            z = sd_stage(tables, z, rotation, self.lookup)
        return _pointwise(self.ao, z, self.lookup).clamp(0.0, 1.0)


def panlut_params(pg_dim: int, sd_dim: int, ao_dim: int) -> int:
    """4·d_pg⁵ + 4·5·d_sd⁴ + 4·d_ao⁵."""
    return (lut_params(1, BANDS, CHANNELS, pg_dim) + len(ROTATIONS) * lut_params(CHANNELS, 1, 4, sd_dim)
            + lut_params(1, BANDS, CHANNELS, ao_dim))


def panlut_ops_per_pixel() -> int:
    """Multiply-adds per output pixel (independent of the LUT sizes)."""
    return 2 * lut_ops_per_pixel(BANDS, CHANNELS) + len(ROTATIONS) * CHANNELS * lut_ops_per_pixel(1, 4)
