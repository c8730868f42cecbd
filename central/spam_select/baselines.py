"""Baselines: the group-lasso SpAM in the sequence model (the estimation-optimal approach).

In the orthonormal sequence model, SpAM's group lasso with truncation m,

    θ̂ = argmin_θ ½ Σ_j ‖y_{j,≤m} − θ_{j,≤m}‖² + λ Σ_j ‖θ_{j,≤m}‖    (θ_{j,>m} = 0),

separates over variables and is solved exactly by group soft-thresholding,
θ̂_j = (1 − λ/‖y_{j,≤m}‖)₊ y_{j,≤m}; variable j is selected iff ‖y_{j,≤m}‖ > λ.
Two tunings: the universal λ = ε(√m + √(2 log d)) with the estimation-optimal truncation
m = (2βL²/ε²)^{1/(2β+1)} (``glasso``), and (m, λ) minimising the estimation risk E‖θ̂ − θ‖²
(``glasso_risk``, tuned with the true θ: the best any estimation-driven tuning can do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from central.spam_select.selectors import at_level
from central.spam_select.sequence import Energies


def group_soft_threshold(y: np.ndarray, lam: float) -> np.ndarray:
    """The exact group-lasso solution for (..., d, m) blocks: (1 − λ/‖y_j‖)₊ y_j."""
    norms = np.linalg.norm(y, axis=-1, keepdims=True)
    scale = np.clip(1.0 - lam / np.maximum(norms, 1e-300), 0.0, None)
    return scale * y


def group_lasso_objective(theta: np.ndarray, y: np.ndarray, lam: float) -> float:
    """½‖y − θ‖² + λ Σ_j ‖θ_j‖ for (d, m) arrays."""
    return float(0.5 * ((y - theta) ** 2).sum() + lam * np.linalg.norm(theta, axis=-1).sum())


def universal_lambda(m: int, eps: float, d: int) -> float:
    """λ = ε(√m + √(2 log d)): every null block is zeroed with high probability."""
    return eps * (math.sqrt(m) + math.sqrt(2 * math.log(d)))


def glasso_select(en: Energies, m: int, lam: float | np.ndarray) -> np.ndarray:
    """Group-lasso selection ‖y_{j,≤m}‖ > λ on (reps, d) energies."""
    return np.sqrt(at_level(en, m)) > lam


def estimation_risk(en: Energies, m: int, lams: np.ndarray, theta_sq: np.ndarray) -> np.ndarray:
    """Mean over repetitions of Σ_j ‖θ̂_j − θ_j‖² for each λ in ``lams``, at truncation m.

    ‖θ̂_j − θ_j‖² = a²E − 2aC + ‖θ_j‖² with a = (1 − λ/√E)₊, E = Σ_{k≤m} y², C = Σ_{k≤m} yθ
    (θ̂_{j,>m} = 0, so the tail Σ_{k>m} θ² is in ‖θ_j‖²).  On null rows (C = 0, θ = 0) this is
    (√E − λ)₊², summed for all λ at once from the sorted norms."""
    idx = int(np.nonzero(en.levels == m)[0][0])
    energy, cross = en.energy[..., idx], en.cross[..., idx]
    reps = energy.shape[0]
    active = theta_sq > 0
    lams = np.asarray(lams, dtype=float)
    # active rows: direct, (reps, s, |λ|)
    e_act, c_act = energy[:, active, None], cross[:, active, None]
    a = np.clip(1.0 - lams / np.sqrt(np.maximum(e_act, 1e-300)), 0.0, None)
    risk_act = (a * a * e_act - 2 * a * c_act).sum(axis=(0, 1)) / reps
    # null rows: Σ_{v > λ} (v − λ)² = Σv² − 2λΣv + #·λ² over the norms above λ
    v = np.sort(np.sqrt(energy[:, ~active]).ravel())
    above = v.size - np.searchsorted(v, lams, side="right")
    sum_v = np.concatenate([np.cumsum(v[::-1])[::-1], [0.0]])
    sum_v2 = np.concatenate([np.cumsum((v * v)[::-1])[::-1], [0.0]])
    start = v.size - above
    risk_null = (sum_v2[start] - 2 * lams * sum_v[start] + above * lams**2) / reps
    return risk_act + risk_null + float(theta_sq.sum())


@dataclass
class RiskTuning:
    """The estimation-risk-optimal (m, λ) and its risk next to the universal tuning's."""

    m: int
    lam: float
    risk: float
    universal_risk: float


def tune_for_risk(en: Energies, ms: list[int], eps: float, d: int, theta: np.ndarray, m_universal: int,
                  offsets: np.ndarray | None = None) -> RiskTuning:
    """Minimise the mean estimation risk over truncations ``ms`` and λ = ε(√m + t√(2 log d)),
    t ∈ ``offsets`` (default −0.6..2 in steps of 0.1; t = 1 is the universal λ)."""
    offsets = np.round(np.arange(-0.6, 2.0001, 0.1), 10) if offsets is None else offsets
    theta_sq = (theta**2).sum(axis=1)
    best = RiskTuning(ms[0], 0.0, math.inf, math.inf)
    for m in ms:
        lams = np.clip(eps * (math.sqrt(m) + offsets * math.sqrt(2 * math.log(d))), 0.0, None)
        risks = estimation_risk(en, m, lams, theta_sq)
        i = int(np.argmin(risks))
        if risks[i] < best.risk:
            best = RiskTuning(m, float(lams[i]), float(risks[i]), best.universal_risk)
    universal = estimation_risk(en, m_universal, np.array([universal_lambda(m_universal, eps, d)]), theta_sq)[0]
    best.universal_risk = float(universal)
    return best
