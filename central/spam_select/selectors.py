"""The χ² selectors: Benjamini–Hochberg on exact p-values, the √(2 log d)-scale support-recovery
threshold, their adaptive versions over a dyadic grid of truncation levels, and the metrics.

Every selector maps per-variable block energies (reps, d, levels) to a boolean (reps, d) mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from central.spam_select.sequence import Energies, chi2_pvalue, chi2_stat, stat_threshold


def at_level(en: Energies, m: int) -> np.ndarray:
    """Σ_{k≤m} y² (reps, d) at one of the simulated truncation levels."""
    idx = np.nonzero(en.levels == m)[0]
    if idx.size == 0:
        raise ValueError(f"truncation level {m} was not simulated (levels {en.levels.tolist()})")
    return en.energy[..., idx[0]]


def benjamini_hochberg(pvalues: np.ndarray, q: float) -> np.ndarray:
    """The BH step-up rejections along the last axis (scipy's adjusted p-values ≤ q)."""
    return stats.false_discovery_control(pvalues, axis=-1, method="bh") <= q


def grid_pvalues(en: Energies, grid: list[int], eps: float) -> np.ndarray:
    """Exact χ²_m p-values (reps, d, |grid|) at each truncation level of the grid."""
    return np.stack([chi2_pvalue(at_level(en, m), m, eps) for m in grid], axis=-1)


def adaptive_pvalue(pvalues_grid: np.ndarray) -> np.ndarray:
    """Bonferroni over the grid: min_m p_j(m)·|grid|, capped at 1 — a valid (super-uniform) null
    p-value whatever the dependence between levels; log|grid| ≈ log log K is the price in x."""
    return np.minimum(1.0, pvalues_grid.min(axis=-1) * pvalues_grid.shape[-1])


def bh_fixed(en: Energies, m: int, eps: float, q: float) -> np.ndarray:
    """(i) Multiple testing at truncation m: BH at level q on the exact χ²_m p-values."""
    return benjamini_hochberg(chi2_pvalue(at_level(en, m), m, eps), q)


def bh_adaptive(en: Energies, grid: list[int], eps: float, q: float) -> np.ndarray:
    """(iii) Adaptive multiple testing: BH at level q on the Bonferroni-over-grid p-values."""
    return benjamini_hochberg(adaptive_pvalue(grid_pvalues(en, grid, eps)), q)


def recovery_alpha(d: int, delta: float) -> float:
    """The per-variable level d^{-(1+δ)} of the support-recovery threshold (family-wise error ≤ d^{-δ})."""
    return float(d) ** -(1.0 + delta)


def sr_fixed(en: Energies, m: int, eps: float, d: int, delta: float) -> np.ndarray:
    """(ii) Support recovery at truncation m: T_j(m) > τ_m(d^{-(1+δ)}), where τ_m is the exact χ²_m
    quantile in T units, τ_m → √(2(1+δ) log d) as m → ∞ (see :func:`stat_threshold`)."""
    return chi2_stat(at_level(en, m), m, eps) > stat_threshold(m, recovery_alpha(d, delta))


def sr_adaptive(en: Energies, grid: list[int], eps: float, d: int, delta: float) -> np.ndarray:
    """(iii) Adaptive support recovery: max_m [T_j(m) − τ_m(d^{-(1+δ)}/|grid|)] > 0 (Bonferroni
    over the grid, so the family-wise error stays ≤ d^{-δ})."""
    alpha = recovery_alpha(d, delta) / len(grid)
    margins = [chi2_stat(at_level(en, m), m, eps) - stat_threshold(m, alpha) for m in grid]
    return np.max(np.stack(margins, axis=-1), axis=-1) > 0


# -- metrics ---------------------------------------------------------------------------------------

@dataclass
class SelectionMetrics:
    """Means over repetitions (``*_se``: their standard errors).

    FDR = E[#false selections / max(#selections, 1)]; FNR = E[#missed actives / s] (the missed-signal
    proportion, 1 − power, as in Rabinovich–Ramdas–Jordan–Wainwright; 0 when s = 0);
    risk = FDR + FNR; exact = P(Ŝ = S); hamming = E|Ŝ Δ S|.
    """

    fdr: float
    fnr: float
    exact: float
    hamming: float
    fdr_se: float
    exact_se: float

    @property
    def risk(self) -> float:
        return self.fdr + self.fnr


def selection_metrics(selected: np.ndarray, s: int) -> SelectionMetrics:
    """Metrics of (reps, d) selections when the active set is the first s variables."""
    false = selected[:, s:].sum(axis=1)
    true = selected[:, :s].sum(axis=1)
    fdp = false / np.maximum(false + true, 1)
    fnp = (s - true) / s if s > 0 else np.zeros_like(fdp, dtype=float)
    exact = (false == 0) & (true == s)
    reps = selected.shape[0]
    return SelectionMetrics(float(fdp.mean()), float(np.mean(fnp)), float(exact.mean()),
                            float((false + s - true).mean()), float(fdp.std(ddof=1) / math.sqrt(reps)) if reps > 1
                            else 0.0, float(exact.std(ddof=1) / math.sqrt(reps)) if reps > 1 else 0.0)
