"""Σ: the second moment of a conv layer's unfolded input patches, and its square root.

For a conv with kernel k×k over ``C_in`` channels, every output position sees a patch
``x ∈ ℝ^{C_in·k·k}`` (ordered channel-major, like ``weight.reshape(C_out, -1)``); zero padding and the
stride are those of the conv, exactly as ``torch.nn.functional.unfold`` produces them.  The authors'
``Compute_Covariance.py`` averages ``x xᵀ`` over every image and every position (``mean_products``,
the matrix their README calls Σ := E[x xᵀ]); so do we.  Accumulation is in float64.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn


def unfold_patches(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """The input patches of ``conv`` on ``x`` (B, C, H, W) as rows: (B·L, C·kh·kw)."""
    if conv.groups != 1 or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        raise ValueError("only zero-padded, ungrouped convs with numeric padding are supported")
    cols = F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=conv.padding, stride=conv.stride)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1])


class SecondMoment:
    """A running E[x xᵀ] over patch rows (float64 sum and count)."""

    def __init__(self, dim: int) -> None:
        self.total = torch.zeros(dim, dim, dtype=torch.float64)
        self.count = 0

    def add(self, rows: torch.Tensor) -> None:
        rows = rows.to(torch.float64)
        self.total += rows.T @ rows
        self.count += rows.shape[0]

    def value(self) -> torch.Tensor:
        if self.count == 0:
            raise ValueError("no patches were seen")
        return self.total / self.count


def patch_second_moment(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """Σ of ``conv``'s patches on the inputs ``x`` alone (one batch)."""
    acc = SecondMoment(conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1])
    acc.add(unfold_patches(x, conv))
    return acc.value()


@torch.no_grad()
def estimate_sigmas(model: nn.Module, names: list[str], batches: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Σ for each named conv of ``model`` from its inputs while ``model`` (eval mode) sees ``batches``.

    The inputs are those of the *original* model (forward pre-hooks), as in the authors' code.
    """
    modules = dict(model.named_modules())
    convs = {n: modules[n] for n in names}
    accs = {n: SecondMoment(c.in_channels * c.kernel_size[0] * c.kernel_size[1]) for n, c in convs.items()}
    hooks = [conv.register_forward_pre_hook(lambda mod, inp, n=n: accs[n].add(unfold_patches(inp[0], mod)))
             for n, conv in convs.items()]
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            model(batch)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return {n: acc.value() for n, acc in accs.items()}


def floor_psd(sigma: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_f, S): Σ with its eigenvalues raised to at least ``floor``·λ_max, and S = Σ_f^{1/2} (symmetric).

    ‖S D‖_F = ‖Σ_f^{1/2} D‖_F for any D, and equals ‖Lᵀ D‖_F for the authors' Cholesky factor
    Σ_f = L Lᵀ, so the objective does not depend on which square root is used.
    """
    sym = 0.5 * (sigma + sigma.T).to(torch.float64)
    evals, evecs = torch.linalg.eigh(sym)
    top = float(evals.max().clamp_min(0.0))
    lam = evals.clamp_min(max(floor * top, torch.finfo(torch.float64).tiny))
    return (evecs * lam) @ evecs.T, (evecs * lam.sqrt()) @ evecs.T


def effective_rank(sigma: torch.Tensor) -> float:
    """exp(entropy of the normalised eigenvalues) — how many directions Σ really weighs."""
    lam = torch.linalg.eigvalsh(0.5 * (sigma + sigma.T).to(torch.float64)).clamp_min(0.0)
    p = lam / lam.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))
