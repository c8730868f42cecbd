"""The gradient window and subspace projector of LCoTTA (pure functions, no model).

Reference: Duan et al., "Lifelong Test-Time Adaptation via Online Learning in Tracked
Low-Dimensional Subspace", NeurIPS 2025 (https://openreview.net/forum?id=NFvAa2hNzH); code
ThunderDavid/LCoTTA ``classification/methods/subspace_plus.py``: ``moving_W`` is a FIFO list of
flattened gradient snapshots (capacity ``W_NUM``); ``W - mean(W)`` is fitted with
``sklearn.decomposition.PCA(n_components=r)``; ``P = pca.components_`` (r × D, orthonormal rows)
and the gradient is replaced by ``Pᵀ (P g)`` (``P_SGD``).

Deliberate deviations:

* PCA is an exact ``torch.linalg.svd`` in float64 (P returned in the input dtype) instead of
  sklearn's ``PCA``, whose ``svd_solver="auto"`` picks the *randomized* solver for the authors'
  window (100 × D, D ≫ 500, r < 80): same subspace up to that solver's approximation error.
  Component signs are not flipped (``svd_flip``): irrelevant for ``PᵀP``.
* As in sklearn, a window of exactly r snapshots has a centred rank ≤ r − 1, so its r-th
  component is an arbitrary unit direction orthogonal to the others (explained variance ≈ 0).
"""

from __future__ import annotations

from collections import deque

import torch

from fedsim.errors import ConfigError


def principal_subspace(window: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-r principal components of the rows of ``window`` (n × D), sklearn-PCA semantics.

    Rows are centred; returns ``P`` (r × D, orthonormal rows, sorted by variance) and the
    explained-variance ratios (r,) = σᵢ² / Σⱼ σⱼ² (zeros when the window has no variance).
    """
    if window.ndim != 2:
        raise ConfigError(f"gradient window must be a 2-D (n × D) tensor, got shape {tuple(window.shape)}")
    n, d = window.shape
    if not 1 <= r <= min(n, d):
        raise ConfigError(f"rank r={r} must be in [1, min(n={n} snapshots, D={d})]; lower the rank")
    w = window.detach().to(torch.float64)
    w = w - w.mean(dim=0, keepdim=True)
    _, s, vh = torch.linalg.svd(w, full_matrices=False)
    var = s.square()
    total = var.sum()
    ratio = var[:r] / total if total > 0 else torch.zeros(r, dtype=torch.float64)
    return vh[:r].to(window.dtype), ratio.to(window.dtype)


def project(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Orthogonal projection ``Pᵀ (P g)`` of a flat vector ``g`` (D,) onto the row space of P (r × D)."""
    return p.t() @ (p @ g)


class GradientWindow:
    """FIFO window of at most ``capacity`` flattened gradient snapshots of length ``dim``.

    Rows are kept oldest first.  ``version`` increases on every change so callers may cache the
    subspace of an unchanged window.
    """

    def __init__(self, capacity: int, dim: int) -> None:
        if capacity < 1:
            raise ConfigError(f"gradient window capacity must be >= 1, got {capacity}")
        if dim < 1:
            raise ConfigError(f"gradient dimension must be >= 1, got {dim}")
        self.capacity = capacity
        self.dim = dim
        self._rows: deque[torch.Tensor] = deque()
        self.version = 0

    def __len__(self) -> int:
        return len(self._rows)

    def append(self, g: torch.Tensor) -> None:
        """Add a snapshot (detached copy); the oldest is dropped beyond ``capacity``."""
        if g.ndim != 1 or g.numel() != self.dim:
            raise ConfigError(f"gradient snapshot must be a flat vector of length {self.dim}, got {tuple(g.shape)}")
        self._rows.append(g.detach().clone())
        if len(self._rows) > self.capacity:
            self._rows.popleft()
        self.version += 1

    def clear(self) -> None:
        self._rows.clear()
        self.version += 1

    def matrix(self) -> torch.Tensor:
        """The snapshots as an (n × D) tensor, oldest first (an empty (0 × D) tensor if none)."""
        if not self._rows:
            return torch.zeros(0, self.dim)
        return torch.stack(list(self._rows))

    def load_matrix(self, rows: torch.Tensor) -> None:
        """Replace the content by the rows of ``rows`` (n × D, oldest first)."""
        if rows.ndim != 2 or rows.shape[1] != self.dim or rows.shape[0] > self.capacity:
            raise ConfigError(
                f"gradient window must be (n ≤ {self.capacity}) × {self.dim}, got {tuple(rows.shape)}"
            )
        self._rows = deque(r.detach().clone() for r in rows)
        self.version += 1

    def principal_subspace(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-r principal subspace of the centred window; see :func:`principal_subspace`."""
        return principal_subspace(self.matrix(), r)
