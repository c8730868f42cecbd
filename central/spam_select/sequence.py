"""The Gaussian sequence-space SpAM: scenarios, least-favourable signals, sampling, χ² statistics, rates.

Variable j = 1..d has coefficients θ_{j1..jK} in an orthonormal basis (e.g. cosines on [0, 1]);
one observes ``y_{jk} = θ_{jk} + ε ξ_{jk}`` with ε = σ/√n and ξ i.i.d. N(0, 1).  The first s
variables are active (the selectors are permutation-equivariant, so where the support sits does
not matter).  Active components lie in the Sobolev ellipsoid ``Σ_k k^{2β} θ_{jk}² ≤ L²``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

PROFILES = ("flat", "decay")


@dataclass(frozen=True)
class Scenario:
    """One (n, d, s, β) setting with the shared noise level σ, Sobolev radius L and basis size K."""

    n: int
    d: int
    s: int
    beta: float
    sigma: float = 1.0
    radius: float = 1.0
    K: int = 64

    @property
    def eps(self) -> float:
        """The noise level σ/√n of one coefficient."""
        return self.sigma / math.sqrt(self.n)

    @property
    def label(self) -> str:
        return f"n={self.n},d={self.d},s={self.s},β={self.beta:g}"


# -- signals ---------------------------------------------------------------------------------------

def flat_width(rho: float, beta: float, radius: float, K: int) -> int:
    """The widest flat profile of norm ρ in the Sobolev ball: the largest M ≤ K with
    (ρ²/M)·Σ_{k≤M} k^{2β} ≤ L² (1 when even M = 1 leaves the ball, i.e. ρ > L)."""
    k = np.arange(1, K + 1, dtype=float)
    energy = rho**2 * np.cumsum(k ** (2 * beta)) / k  # Sobolev energy of the flat profile of width M = k
    inside = np.nonzero(energy <= radius**2 * (1 + 1e-12))[0]
    return int(inside[-1] + 1) if inside.size else 1


def profile(rho: float, scn: Scenario, shape: str = "flat") -> np.ndarray:
    """The (unsigned) coefficient profile of one active component, with ‖θ_j‖₂ = ρ.

    ``flat``: equal coefficients on k ≤ M(ρ) (the least-favourable shape: as spread out as the
    Sobolev ball allows, so the smoothness decides how many coefficients a test must add up);
    ``decay``: θ_k ∝ k^{-(β+1)} (a smooth function whose energy sits at low frequencies).
    """
    k = np.arange(1, scn.K + 1, dtype=float)
    if shape == "flat":
        theta = (k <= flat_width(rho, scn.beta, scn.radius, scn.K)).astype(float)
    elif shape == "decay":
        theta = k ** -(scn.beta + 1.0)
    else:
        raise ValueError(f"unknown profile {shape!r}; known: {PROFILES}")
    return rho * theta / np.linalg.norm(theta)


def make_theta(rho: float, scn: Scenario, rng: np.random.Generator, shape: str = "flat") -> np.ndarray:
    """The (d, K) coefficient matrix: s active rows with the profile and random signs, the rest 0."""
    theta = np.zeros((scn.d, scn.K))
    signs = rng.choice(np.array([-1.0, 1.0]), size=(scn.s, scn.K))
    theta[: scn.s] = signs * profile(rho, scn, shape)
    return theta


def sobolev_energy(theta: np.ndarray, beta: float) -> np.ndarray:
    """Σ_k k^{2β} θ_{jk}² per row (≤ L² inside the ball)."""
    k = np.arange(1, theta.shape[-1] + 1, dtype=float)
    return (theta**2 * k ** (2 * beta)).sum(-1)


# -- sampling --------------------------------------------------------------------------------------

@dataclass
class Energies:
    """Per repetition and variable, at each truncation level m: E = Σ_{k≤m} y² and C = Σ_{k≤m} y·θ.

    ``levels`` are the truncation levels (increasing); arrays are (reps, d, len(levels)); ``cross`` is
    zero on inactive rows (θ = 0 there).
    """

    levels: np.ndarray
    energy: np.ndarray
    cross: np.ndarray


def simulate(theta: np.ndarray, eps: float, reps: int, levels: list[int], rng: np.random.Generator,
             chunk: int = 25) -> Energies:
    """Draw ``reps`` independent copies of y = θ + ε ξ and keep the truncated block energies."""
    d, K = theta.shape
    levels_arr = np.asarray(sorted(set(int(m) for m in levels)))
    if levels_arr[0] < 1 or levels_arr[-1] > K:
        raise ValueError(f"truncation levels must lie in [1, {K}], got {levels_arr.tolist()}")
    starts = np.concatenate([[0], levels_arr[:-1]])
    active = np.nonzero(np.any(theta != 0, axis=1))[0]
    energy = np.empty((reps, d, len(levels_arr)))
    cross = np.zeros((reps, d, len(levels_arr)))
    th32 = theta.astype(np.float32)
    for lo in range(0, reps, chunk):
        hi = min(reps, lo + chunk)
        y = rng.standard_normal((hi - lo, d, K), dtype=np.float32)
        y *= np.float32(eps)
        y += th32
        blocks = np.add.reduceat(y * y, starts, axis=-1, dtype=np.float64)
        energy[lo:hi] = np.cumsum(blocks, axis=-1)
        if active.size:
            prod = y[:, active] * th32[active]
            cross[lo:hi, active] = np.cumsum(np.add.reduceat(prod, starts, axis=-1, dtype=np.float64), axis=-1)
    return Energies(levels_arr, energy, cross)


# -- statistics ------------------------------------------------------------------------------------

def chi2_stat(energy: np.ndarray, m: int | np.ndarray, eps: float) -> np.ndarray:
    """The centred and scaled χ² statistic T_j(m) = (Σ_{k≤m} y_{jk}²/ε² − m)/√(2m).

    Under the null (θ_j = 0) Σ y²/ε² ~ χ²_m, so T_j(m) has mean 0 and variance 1 exactly.
    """
    m = np.asarray(m, dtype=float)
    return (energy / eps**2 - m) / np.sqrt(2 * m)


def chi2_pvalue(energy: np.ndarray, m: int | np.ndarray, eps: float) -> np.ndarray:
    """The exact null p-value P(χ²_m ≥ Σ_{k≤m} y²/ε²)."""
    return stats.chi2.sf(energy / eps**2, np.asarray(m, dtype=float))


def stat_threshold(m: int | np.ndarray, alpha: float | np.ndarray) -> np.ndarray:
    """τ_m(α): the exact upper-α quantile of T_j(m) under the null, (χ²_{m,1−α} − m)/√(2m).

    Laurent–Massart: χ²_{m,1−α} ≤ m + 2√(m x) + 2x with x = log(1/α), so τ_m(α) ≤ √(2x) + √2·x/√m,
    which tends to the Gaussian √(2 log(1/α)) as m → ∞ (the √(2 log d) scale at α = d^{-(1+δ)}).
    """
    m = np.asarray(m, dtype=float)
    return (stats.chi2.isf(alpha, m) - m) / np.sqrt(2 * m)


# -- rates -------------------------------------------------------------------------------------

def minimax_rate(scn: Scenario, x: float) -> float:
    """The minimax separation rate ρ*(x) in closed form: the signal unit of every curve and transition.

        ρ*(x)² = L^{2/(4β+1)} (ε² √x)^{4β/(4β+1)} + ε² x,      ε² = σ²/n,

    with both constants fixed once at 1.  x = log d for support recovery and log(d/s) for FDR + FNR
    (:func:`support_recovery_rate`, :func:`multiple_testing_rate`).  Derivation (the standard χ²
    balance of the sparse nonparametric selection literature, Ingster–Stepanova, Butucea–Stepanova):
    a component of norm ρ in the Sobolev(β, L) ball keeps ≳ ρ²/2 of its energy in its first
    m ≍ (L/ρ)^{1/β} coefficients, and a sum of m squared noisy coefficients separates it from d
    nulls once ρ² ≳ ε²(√(m x) + x); substituting m and solving gives the two terms.  The formula
    reads only (n, d, s, β, σ, L): not the selectors' thresholds τ_m, their level d^{-(1+δ)}, the
    truncation K or the discrete width of the simulated signals (tests check this), so a collapse
    of the transitions in these units is measured, not built in.
    """
    eps2 = scn.eps**2
    return math.sqrt(scn.radius ** (2 / (4 * scn.beta + 1)) * (eps2 * math.sqrt(x)) ** (4 * scn.beta / (4 * scn.beta + 1))
                     + eps2 * x)


def recovery_x(scn: Scenario) -> float:
    """x of support recovery: log d (the d − s nulls drive the wrong-recovery probability; the
    alternative side's log s ≤ log d is of the same order and left out of the unit)."""
    return math.log(scn.d)


def testing_x(scn: Scenario) -> float:
    """x of multiple testing (FDR + FNR): log(d/s) (log d when s = 0)."""
    return math.log(scn.d / scn.s) if scn.s > 0 else math.log(scn.d)


def support_recovery_rate(scn: Scenario) -> float:
    """The unit of the exact-recovery curves: :func:`minimax_rate` at x = log d."""
    return minimax_rate(scn, recovery_x(scn))


def multiple_testing_rate(scn: Scenario) -> float:
    """The unit of the FDR + FNR curves: :func:`minimax_rate` at x = log(d/s)."""
    return minimax_rate(scn, testing_x(scn))


def chi2_bound_rate(scn: Scenario, x: float) -> float:
    """The norm at which the χ² statistic over the natural width M(ρ) of a least-favourable signal
    clears the Laurent–Massart null deviation at level e^{-x}:

        ρ²/ε² = 2√(M(ρ)·x) + 2x        (M(ρ) = :func:`flat_width`).

    This is the bound the χ² selectors threshold on, so it is **not** the signal unit (it was, and a
    collapse in it was partly built in); it only sets the truncation of the oracle that knows β
    (:func:`oracle_width`).  With M(ρ) ≈ (L²(2β+1)/ρ²)^{1/(2β)} it is :func:`minimax_rate` up to
    constants (measured: 1.37-1.41 × it in the spec's scenarios).
    """
    def gap(log_rho: float) -> float:
        rho = math.exp(log_rho)
        width = flat_width(rho, scn.beta, scn.radius, scn.K)
        return rho**2 / scn.eps**2 - (2 * math.sqrt(width * x) + 2 * x)

    lo, hi = math.log(scn.eps * 1e-3), math.log(scn.eps * 1e3 + 10 * scn.radius)
    for _ in range(200):  # gap is increasing in ρ (M(ρ) is non-increasing)
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return math.exp(hi)


def oracle_width(scn: Scenario, x: float) -> int:
    """The truncation an oracle that knows β uses: the width M(ρ) of a least-favourable signal at the
    χ² bound :func:`chi2_bound_rate` (a property of that selector, not of the unit)."""
    return flat_width(chi2_bound_rate(scn, x), scn.beta, scn.radius, scn.K)


def estimation_width(scn: Scenario) -> int:
    """The estimation-optimal truncation for Sobolev(β, L): argmin_m m ε² + L² m^{-2β} = (2βL²/ε²)^{1/(2β+1)}."""
    m = (2 * scn.beta * scn.radius**2 / scn.eps**2) ** (1 / (2 * scn.beta + 1))
    return int(min(scn.K, max(1, round(m))))


def dyadic_grid(K: int) -> list[int]:
    """1, 2, 4, ... up to K (K itself included)."""
    grid = [2**i for i in range(int(math.log2(K)) + 1) if 2**i <= K]
    return grid if grid[-1] == K else [*grid, K]
