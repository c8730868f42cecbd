"""Pan-sharpening baselines on (B, C, H, W) tensors: Brovey, Gram-Schmidt (GS), a PNN-style CNN.

* **Brovey**: ``out_b = MS_b · PAN / I`` with ``I = mean_b MS_b`` — the band ratios (hence the
  spectral angles) of the upsampled MS are kept and the band mean becomes PAN.
* **Gram-Schmidt** (mode "mean", as in the Vivone et al. toolbox): ``I = mean_b MS_b``; PAN is
  histogram-matched to I (``P' = (PAN − μ_P)·σ_I/σ_P + μ_I``, per image); each band gets the
  detail ``g_b (P' − I)`` with ``g_b = cov(MS_b, I)/var(I)``.  Since mean_b g_b = 1, the band mean
  of the output equals P'.
* **PNN** (Masi et al. 2016): conv 9×9 (5→64) – ReLU – conv 5×5 (64→32) – ReLU – conv 5×5 (32→4)
  on the stacked upsampled MS and PAN, 80,420 parameters.  Deviations: the output is added to the
  upsampled MS (residual learning, as in PNN+ / PanNet, so it trains in a few hundred CPU steps),
  its inputs are mapped from [0, 1] to [−1, 1] and its last layer starts at zero (without these
  it stayed at the bicubic output for the first hundreds of Adam steps in our trials), and 'same'
  replicate padding keeps the image size.

Brovey and GS outputs are not clipped here; the runner clips every method's output to [0, 1]
before scoring.
"""

from __future__ import annotations

import torch
from torch import nn

EPS = 1e-6


def brovey(ms_up: torch.Tensor, pan: torch.Tensor) -> torch.Tensor:
    """Brovey transform: MS_b · PAN / mean_b(MS)."""
    intensity = ms_up.mean(dim=1, keepdim=True)
    return ms_up * pan / (intensity + EPS)


def gram_schmidt(ms_up: torch.Tensor, pan: torch.Tensor) -> torch.Tensor:
    """GS (mode "mean"): MS_b + g_b (P' − I), per image statistics."""
    intensity = ms_up.mean(dim=1, keepdim=True)
    dims = (1, 2, 3)
    mu_i, sd_i = intensity.mean(dim=dims, keepdim=True), intensity.std(dim=dims, keepdim=True)
    mu_p, sd_p = pan.mean(dim=dims, keepdim=True), pan.std(dim=dims, keepdim=True)
    matched = (pan - mu_p) * sd_i / (sd_p + EPS) + mu_i
    ic = intensity - mu_i
    mc = ms_up - ms_up.mean(dim=(2, 3), keepdim=True)
    gains = (mc * ic).mean(dim=(2, 3), keepdim=True) / ((ic * ic).mean(dim=(2, 3), keepdim=True) + EPS)
    return ms_up + gains * (matched - intensity)


class PNN(nn.Module):
    """A 3-layer PNN-style pan-sharpening CNN (residual on the upsampled MS)."""

    def __init__(self, bands: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(bands + 1, 64, 9, padding=4, padding_mode="replicate"), nn.ReLU(),
            nn.Conv2d(64, 32, 5, padding=2, padding_mode="replicate"), nn.ReLU(),
            nn.Conv2d(32, bands, 5, padding=2, padding_mode="replicate"))
        nn.init.zeros_(self.net[-1].weight)       # the residual starts at zero: output = upsampled MS
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, ms_up: torch.Tensor, pan: torch.Tensor) -> torch.Tensor:
        return ms_up + self.net(torch.cat([ms_up, pan], dim=1) * 2.0 - 1.0)


def pnn_params(bands: int = 4) -> int:
    """Weights + biases of :class:`PNN`."""
    return (bands + 1) * 64 * 81 + 64 + 64 * 32 * 25 + 32 + 32 * bands * 25 + bands


def pnn_ops_per_pixel(bands: int = 4) -> int:
    """Multiply-adds per output pixel of :class:`PNN` (convolutions only)."""
    return (bands + 1) * 64 * 81 + 64 * 32 * 25 + 32 * bands * 25
