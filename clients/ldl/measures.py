"""The six standard LDL measures and rank correlations between label distributions (numpy).

Definitions as in Geng's LDL survey (X. Geng, "Label Distribution Learning", IEEE TKDE 28(7), 2016,
Table 2), for a true distribution ``d`` and a prediction ``p`` over C labels, averaged over
instances:

=============  ======================================================  =====
Chebyshev      max_j |d_j − p_j|                                       ↓
Clark          sqrt( Σ_j (d_j − p_j)² / (d_j + p_j)² )                 ↓
Canberra       Σ_j |d_j − p_j| / (d_j + p_j)                           ↓
KL             Σ_j d_j ln(d_j / p_j)                                   ↓
Cosine         Σ_j d_j p_j / (‖d‖ ‖p‖)                                 ↑
Intersection   Σ_j min(d_j, p_j)                                       ↑
=============  ======================================================  =====

Zero handling (stated, since the survey leaves it implicit): a Clark or Canberra term with
``d_j + p_j = 0`` is 0 (the 0/0 of two labels both without mass); KL uses ``0 · ln 0 = 0`` and
reads a prediction below ``EPS = 1e-12`` as ``EPS`` (a finite, very large penalty instead of ∞).

Rank correlations (the RankMatch diagnostics): per instance, Spearman's ρ and Kendall's τ-b between
the C values of ``d`` and ``p`` — scipy.stats' definitions (average ranks for ties, τ-b's tie
correction), computed for all rows at once: ρ is Pearson's correlation of ``scipy.stats.rankdata``
ranks, τ-b is ``Σ s_d s_p / sqrt(Σ s_d² · Σ s_p²)`` over the label pairs with ``s = sign`` of the
pair differences.  A row constant in ``d`` or ``p`` has no correlation (NaN) and is left out of the
mean.
"""

from __future__ import annotations

import numpy as np
from scipy.special import rel_entr
from scipy.stats import rankdata

EPS = 1e-12
#: Measure -> True when larger is better.
HIGHER_IS_BETTER = {"chebyshev": False, "clark": False, "canberra": False, "kl": False, "cosine": True,
                    "intersection": True}
MEASURES = tuple(HIGHER_IS_BETTER)
RANKS = ("spearman", "kendall")


def _pair(d: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, p = np.atleast_2d(np.asarray(d, dtype=np.float64)), np.atleast_2d(np.asarray(p, dtype=np.float64))
    if d.shape != p.shape:
        raise ValueError(f"distributions must have one shape, got {d.shape} and {p.shape}")
    return d, p


def _ratio_terms(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den with 0/0 = 0."""
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def per_instance(d: np.ndarray, p: np.ndarray) -> dict[str, np.ndarray]:
    """Each measure for each instance (rows of ``d`` and ``p``)."""
    d, p = _pair(d, p)
    diff, total = np.abs(d - p), d + p
    norms = np.linalg.norm(d, axis=1) * np.linalg.norm(p, axis=1)
    return {
        "chebyshev": diff.max(axis=1),
        "clark": np.sqrt(_ratio_terms(diff**2, total**2).sum(axis=1)),
        "canberra": _ratio_terms(diff, total).sum(axis=1),
        "kl": rel_entr(d, np.maximum(p, EPS)).sum(axis=1),
        "cosine": np.divide((d * p).sum(axis=1), norms, out=np.zeros(len(d)), where=norms > 0),
        "intersection": np.minimum(d, p).sum(axis=1),
    }


def spearman_rows(d: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Spearman's ρ per row (NaN for a constant row)."""
    d, p = _pair(d, p)
    rd, rp = rankdata(d, axis=1), rankdata(p, axis=1)
    rd -= rd.mean(axis=1, keepdims=True)
    rp -= rp.mean(axis=1, keepdims=True)
    den = np.sqrt((rd**2).sum(axis=1) * (rp**2).sum(axis=1))
    return np.divide((rd * rp).sum(axis=1), den, out=np.full(len(d), np.nan), where=den > 0)


def kendall_rows(d: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Kendall's τ-b per row (NaN for a constant row)."""
    d, p = _pair(d, p)
    i, j = np.triu_indices(d.shape[1], k=1)
    sd, sp = np.sign(d[:, i] - d[:, j]), np.sign(p[:, i] - p[:, j])
    den = np.sqrt((sd**2).sum(axis=1) * (sp**2).sum(axis=1))
    return np.divide((sd * sp).sum(axis=1), den, out=np.full(len(d), np.nan), where=den > 0)


def ldl_measures(d: np.ndarray, p: np.ndarray, ranks: bool = True) -> dict[str, float]:
    """Instance means of the six measures (and of Spearman / Kendall, NaN rows left out)."""
    out = {k: float(v.mean()) for k, v in per_instance(d, p).items()}
    if ranks:
        for name, fn in (("spearman", spearman_rows), ("kendall", kendall_rows)):
            v = fn(d, p)
            out[name] = float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
    return out
