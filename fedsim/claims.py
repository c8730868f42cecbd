"""The verdict of a claim from paired seeds: an interval on the mean difference, then a decision.

Pure functions on numbers (no MLflow, no runs): :mod:`fedsim.reproduce` feeds them each seed's final
metric per configuration.

* :func:`paired_differences` pairs two configurations seed by seed (``d_i = better_i - worse_i``, sign
  flipped when lower is better); seeds present in one only are an error.
* :func:`mean_interval` is a two-sided interval on the mean of ``d``: paired t, or a percentile
  bootstrap with a seeded RNG (the same inputs give the same interval).
* :func:`decide` turns the interval into a verdict. Superiority by margin ``m``: ``holds`` if the
  lower bound is above ``m``, ``fails`` if the upper bound is below ``m``, else ``undecided``.
  Equivalence within ``m``: ``holds`` if the interval lies inside ``(-m, m)``, ``fails`` if it lies
  entirely outside it, else ``undecided``. A failed control makes every claim ``invalid``.
* :func:`no_data` is the verdict of a comparison a seed has no value for (a failed run, a metric a
  run never reached): ``no data``, with the reason; a control without data cannot pass.
* :func:`seeds_to_decide` estimates, for an undecided claim, the number of seeds at which the
  t-interval (observed mean and sd taken as true) would clear the margin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np
from scipy import stats

from fedsim.errors import ConfigError

HOLDS, FAILS, UNDECIDED, INVALID, NO_DATA = "holds", "fails", "undecided", "invalid", "no data"
SUPERIORITY, EQUIVALENCE = "superiority", "equivalence"
INTERVALS = ("t", "bootstrap")
#: seeds_to_decide searches up to this many seeds; beyond it says "more than".
MAX_SEEDS = 10_000


@dataclass(frozen=True)
class Interval:
    """A two-sided interval on the mean paired difference."""

    mean: float
    lo: float
    hi: float
    sd: float
    n: int
    method: str  # "t" or "bootstrap"
    confidence: float

    def text(self, digits: int = 4) -> str:
        """``mean [lo, hi]`` as the table shows it."""
        if math.isnan(self.lo):
            return f"{self.mean:+.{digits}f} [–]"
        if self.sd == 0.0:  # a deterministic quantity: every seed gave the same difference
            return f"{self.mean:+.{digits}f} (exact: the same on all {self.n} seeds)"
        return f"{self.mean:+.{digits}f} [{self.lo:+.{digits}f}, {self.hi:+.{digits}f}]"


@dataclass(frozen=True)
class Verdict:
    """The decision on one claim, with what it rests on."""

    verdict: str  # holds | fails | undecided | invalid
    interval: Interval
    margin: float
    kind: str
    seeds_needed: int | None = None  # undecided: seeds that would decide it (None: cannot say)
    seeds_more_than: bool = False  # True: "more than seeds_needed" (the mean sits on the margin)
    reason: str = ""  # no data: why the comparison could not be made

    def decide_text(self) -> str:
        """What it would take to decide an undecided claim, in words ("" when decided)."""
        if self.verdict != UNDECIDED:
            return ""
        if self.seeds_needed is None:
            return "needs at least 2 seeds to estimate"
        return f"more than {self.seeds_needed} seeds" if self.seeds_more_than else f"about {self.seeds_needed} seeds"


def paired_differences(better: Mapping[int, float], worse: Mapping[int, float], *,
                       higher_is_better: bool = True, what: str = "claim") -> tuple[list[int], np.ndarray]:
    """Seeds and differences ``better_i - worse_i`` (``worse_i - better_i`` when lower is better).

    Both sides must hold the same seeds: an unpaired seed (a run that failed or was not run on one
    side) is an error, since dropping it silently would bias the comparison.
    """
    only = sorted(set(better) ^ set(worse))
    if only:
        raise ConfigError(f"{what}: seeds {only} are on one side only; a paired comparison needs the same seeds "
                          "in both configurations")
    seeds = sorted(better)
    d = np.asarray([better[s] - worse[s] for s in seeds], dtype=float)
    if np.isnan(d).any():
        bad = [s for s, v in zip(seeds, d) if math.isnan(v)]
        raise ConfigError(f"{what}: seeds {bad} have no value of the metric; a paired comparison needs both")
    return seeds, d if higher_is_better else -d


def mean_interval(d: np.ndarray, confidence: float = 0.95, method: str = "t", *, seed: int = 0,
                  resamples: int = 10_000) -> Interval:
    """Two-sided ``confidence`` interval on ``mean(d)``: paired t or percentile bootstrap (seeded)."""
    if not 0.0 < confidence < 1.0:
        raise ConfigError(f"confidence must be in (0, 1), got {confidence}")
    if method not in INTERVALS:
        raise ConfigError(f"interval must be one of {', '.join(INTERVALS)}, got {method!r}")
    d = np.asarray(d, dtype=float)
    n = len(d)
    if n == 0:
        raise ConfigError("no paired seeds to compare")
    mean = float(d.mean())
    sd = float(d.std(ddof=1)) if n > 1 else float("nan")
    if n < 2:
        return Interval(mean, float("nan"), float("nan"), sd, n, method, confidence)
    if method == "t":
        half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
        return Interval(mean, mean - half, mean + half, sd, n, method, confidence)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
    lo, hi = np.quantile(means, [0.5 - confidence / 2, 0.5 + confidence / 2])
    return Interval(mean, float(lo), float(hi), sd, n, method, confidence)


def verdict_of(interval: Interval, margin: float, kind: str = SUPERIORITY) -> str:
    """``holds`` / ``fails`` / ``undecided`` from the interval (see the module doc)."""
    lo, hi = interval.lo, interval.hi
    if math.isnan(lo) or math.isnan(hi):
        return UNDECIDED
    if kind == SUPERIORITY:
        return HOLDS if lo > margin else FAILS if hi < margin else UNDECIDED
    if kind == EQUIVALENCE:
        if -margin < lo and hi < margin:
            return HOLDS
        return FAILS if lo >= margin or hi <= -margin else UNDECIDED
    raise ConfigError(f"claim kind must be {SUPERIORITY} or {EQUIVALENCE}, got {kind!r}")


def seeds_to_decide(mean: float, sd: float, margin: float, confidence: float = 0.95,
                    kind: str = SUPERIORITY, max_seeds: int = MAX_SEEDS) -> tuple[int | None, bool]:
    """``(n, more_than)``: the fewest seeds whose t half-width ``t(n-1) sd / sqrt(n)`` clears the gap.

    The gap is the distance of the observed mean from the margin it must clear (``|mean - m|`` for
    superiority, ``||mean| - m|`` for equivalence). With no gap (the mean sits on the margin) or
    none within ``max_seeds``, ``(max_seeds, True)``: more than that. ``(None, False)`` when the sd is
    unknown (one seed).
    """
    if math.isnan(sd):
        return None, False
    gap = abs(mean - margin) if kind == SUPERIORITY else abs(abs(mean) - margin)
    if gap <= 1e-12:
        return max_seeds, True
    if sd == 0:
        return 2, False
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    n = max(2, math.ceil((z * sd / gap) ** 2))  # the normal approximation: a lower bound for t
    while n <= max_seeds:
        if float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n) < gap:
            return n, False
        n += 1
    return max_seeds, True


def decide(d: np.ndarray, margin: float, *, kind: str = SUPERIORITY, confidence: float = 0.95,
           method: str = "t", seed: int = 0, controls_passed: bool = True) -> Verdict:
    """The verdict of one claim from its paired differences (``invalid`` if a control failed)."""
    interval = mean_interval(d, confidence, method, seed=seed)
    verdict = verdict_of(interval, margin, kind)
    needed, more = (None, False)
    if verdict == UNDECIDED:
        needed, more = seeds_to_decide(interval.mean, interval.sd, margin, confidence, kind)
    if not controls_passed:
        verdict = INVALID
    return Verdict(verdict, interval, margin, kind, needed, more)


def no_data(reason: str, margin: float, *, kind: str = SUPERIORITY, confidence: float = 0.95,
            method: str = "t") -> Verdict:
    """The verdict of a comparison that cannot be made (``reason`` says which seeds lack a value)."""
    nan = float("nan")
    return Verdict(NO_DATA, Interval(nan, nan, nan, nan, 0, method, confidence), margin, kind, reason=reason)
