"""Continual-learning metrics from an accuracy (success / performance) matrix and training curves.

``R`` is a T×T array: ``R[i, j]`` is the performance on task ``j`` after training task ``i``
(Avalanche's ``AccuracyMatrixPluginMetric`` layout: row = training experience, column = evaluated
experience). NaN marks an entry that was not evaluated; each metric states which entries it needs
and raises a one-line :class:`~fedsim.errors.ConfigError` if one of them is NaN.

Definitions (T tasks, indices from 0):

* average performance ``mean_j R[T-1, j]`` -- Continual World's "performance" (success at the end
  of the sequence, averaged over tasks); Lopez-Paz & Ranzato's ACC.
* running average performance ``A_i = mean_{j<=i} R[i, j]`` -- the average over the tasks seen so
  far after training task ``i`` (Chaudhry et al. 2018's A_k).
* average own performance ``mean_j R[j, j]`` -- CompoNet's / CKA-RL's PERF *as coded*
  (``final_success`` is the end of each task's own training run, not the end of the sequence).
* forgetting ``F_j = R[j, j] - R[T-1, j]`` for ``j < T-1``, averaged (Continual World; Avalanche's
  StreamForgetting).
* max-forgetting ``max_{j<=l<T-1} R[l, j] - R[T-1, j]`` for ``j < T-1``, averaged (Chaudhry et al.,
  "Riemannian Walk", ECCV 2018).
* BWT ``mean_{j<T-1} R[T-1, j] - R[j, j]`` = -forgetting (Lopez-Paz & Ranzato, "Gradient Episodic
  Memory", NeurIPS 2017).
* FWT ``mean_{j>=1} R[j-1, j] - b_j`` with ``b`` the performance of the randomly initialised model
  on every task (Lopez-Paz & Ranzato; Avalanche's ``StreamForwardTransfer``).
* normalised forward transfer ``FT_j = (AUC_j - AUC_ref_j) / (1 - AUC_ref_j)`` from task ``j``'s
  training curve and the curve of the same task trained from scratch (Wołczyk et al., "Continual
  World", NeurIPS 2021, ``results_processing/tables.py::normalized_ft``; CompoNet, Malagon et al.
  ICML 2024, ``experiments/*/process_results.py``; CKA-RL Eq. 9).

Deviations and choices, stated once:

* Forgetting averages over the T-1 tasks that can be forgotten (as Avalanche). Continual World's
  code averages the per-task column over all T tasks, the last one contributing 0, i.e. divides
  the same sum by T: ``forgetting(R, include_last=True)`` reproduces that.
* Max-forgetting takes the max over ``l`` from ``j`` (the row where task ``j`` was learnt) to
  ``T-2``; NaN entries among ``l > j`` are skipped. Chaudhry et al. write the max over all
  ``l < T-1``; entries before task ``j`` was trained are pre-training performance, excluded here.
* Curves: a curve is performance in [0, 1] (success rate or accuracy) at training steps normalised
  to [0, 1]. Default AUC is the trapezoid rule with the curve held constant before its first and
  after its last point, so AUC is the area over exactly [0, 1] and ``1 - AUC_ref`` is the area
  above the reference. ``method="mean"`` gives Continual World's AUC (mean of equally spaced
  evaluation points).
* CompoNet computes ``(area_up - area_down) / (max(x) - trapz(ref))`` where ``area_up``/``down``
  are trapezoids over the *masked* points where the method is above/below the baseline (joining
  non-adjacent points across gaps and dropping crossing segments), and in its Meta-World script
  ``x`` starts after the smoothing window while the normaliser counts from 0. For curves on [0, 1]
  without those artefacts this equals ``(AUC - AUC_ref) / (1 - AUC_ref)``, which is what is
  computed here (exact trapezoid of the difference). CompoNet's Atari curves are success rates
  (smoothed return >= 0.8 x a per-game score, then chunk- and moving-averaged); smoothing and
  thresholding are the caller's job here.
* Continual World averages AUCs over seeds before normalising and includes task 0 in the mean;
  CompoNet/CKA-RL exclude task 0 (``skip_first=True``). Both are per-run here; average curves over
  seeds first to match Continual World.
* ``FT_j`` is NaN when the reference is perfect (``AUC_ref_j = 1``); means skip NaN tasks. A
  metric that is undefined (T = 1, no baseline, no curves) is NaN and left out of
  :meth:`ContinualReport.as_metrics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike

from fedsim.errors import ConfigError

__all__ = [
    "ContinualReport",
    "average_own_performance",
    "average_performance",
    "backward_transfer",
    "check_matrix",
    "continual_report",
    "curve_auc",
    "forgetting",
    "forgetting_per_task",
    "forward_transfer",
    "forward_transfer_per_task",
    "normalized_forward_transfer",
    "normalized_forward_transfer_per_task",
    "running_average_performance",
]

AUC_METHODS = ("trapezoid", "mean")
FORGETTING_KINDS = ("final", "max")


# --------------------------------------------------------------------------- validation


def check_matrix(R: ArrayLike) -> np.ndarray:
    """``R`` as a float64 T×T array (T >= 1) whose entries are finite or NaN."""
    try:
        a = np.array(R, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError("accuracy matrix R must be a T×T array of numbers (NaN for not evaluated)") from None
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] == 0:
        raise ConfigError(f"accuracy matrix R must be square T×T with T >= 1, got shape {a.shape}: "
                          "R[i, j] = performance on task j after training task i")
    if np.isinf(a).any():
        raise ConfigError("accuracy matrix R has infinite entries; use NaN for entries that were not evaluated")
    return a


def _need(a: np.ndarray, rows: np.ndarray, cols: np.ndarray, what: str) -> None:
    bad = np.isnan(a[rows, cols])
    if bad.any():
        k = int(np.argmax(bad))
        raise ConfigError(f"R[{int(rows[k])}, {int(cols[k])}] is NaN but {what} needs it; "
                          "evaluate that task at that point of the sequence")


def _nanmean(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    x = x[~np.isnan(x)]
    return float(x.mean()) if x.size else math.nan


# --------------------------------------------------------------------------- matrix metrics


def average_performance(R: ArrayLike) -> float:
    """Mean of the final row: performance on every task at the end of the sequence."""
    a = check_matrix(R)
    T = a.shape[0]
    _need(a, np.full(T, T - 1), np.arange(T), "average performance (final row)")
    return float(a[T - 1].mean())


def running_average_performance(R: ArrayLike) -> np.ndarray:
    """``A_i = mean_{j<=i} R[i, j]`` for every i: average over the tasks seen after task i."""
    a = check_matrix(R)
    rows, cols = np.tril_indices(a.shape[0])
    _need(a, rows, cols, "running average performance (lower triangle)")
    return np.array([a[i, : i + 1].mean() for i in range(a.shape[0])])


def average_own_performance(R: ArrayLike) -> float:
    """Mean of the diagonal: each task right after its own training (CompoNet/CKA-RL PERF as coded)."""
    a = check_matrix(R)
    idx = np.arange(a.shape[0])
    _need(a, idx, idx, "average own performance (diagonal)")
    return float(np.diag(a).mean())


def forgetting_per_task(R: ArrayLike, kind: str = "final") -> np.ndarray:
    """Per-task forgetting for j < T-1 (length T-1).

    ``kind="final"``: ``R[j, j] - R[T-1, j]`` (Continual World). ``kind="max"``:
    ``max_{j<=l<T-1} R[l, j] - R[T-1, j]`` (Chaudhry et al.); NaN entries with ``l > j`` are skipped.
    """
    if kind not in FORGETTING_KINDS:
        raise ConfigError(f"unknown forgetting kind {kind!r}; use one of {FORGETTING_KINDS}")
    a = check_matrix(R)
    T = a.shape[0]
    j = np.arange(T - 1)
    _need(a, j, j, "forgetting (diagonal)")
    _need(a, np.full(T - 1, T - 1), j, "forgetting (final row)")
    if kind == "final":
        return a[j, j] - a[T - 1, j]
    best = np.array([np.nanmax(a[jj : T - 1, jj]) for jj in j]) if T > 1 else np.empty(0)
    return best - a[T - 1, j]


def forgetting(R: ArrayLike, kind: str = "final", include_last: bool = False) -> float:
    """Mean forgetting over j < T-1 (NaN for T = 1).

    ``include_last=True`` divides by T instead (the last task counted with 0), as Continual World's
    ``calculate_forgetting_individual`` + ``compute_mean_and_ci`` do.
    """
    f = forgetting_per_task(R, kind)
    if f.size == 0:
        return math.nan
    T = f.size + 1
    return float(f.sum() / T) if include_last else float(f.mean())


def backward_transfer(R: ArrayLike) -> float:
    """BWT = ``mean_{j<T-1} R[T-1, j] - R[j, j]`` (Lopez-Paz & Ranzato); NaN for T = 1."""
    f = forgetting_per_task(R, "final")
    return float(-f.mean()) if f.size else math.nan


def _baseline(b: ArrayLike, T: int) -> np.ndarray:
    try:
        v = np.array(b, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ConfigError("baseline must be a vector of T numbers (random-init performance per task)") from None
    if v.shape != (T,) or not np.isfinite(v).all():
        raise ConfigError(f"baseline must be {T} finite numbers (random-init performance on each task), "
                          f"got shape {v.shape}")
    return v


def forward_transfer_per_task(R: ArrayLike, baseline: ArrayLike) -> np.ndarray:
    """``R[j-1, j] - b_j`` for j >= 1 (length T-1): the superdiagonal of R against random init."""
    a = check_matrix(R)
    T = a.shape[0]
    b = _baseline(baseline, T)
    j = np.arange(1, T)
    _need(a, j - 1, j, "forward transfer (superdiagonal: task j before its training)")
    return a[j - 1, j] - b[j]


def forward_transfer(R: ArrayLike, baseline: ArrayLike) -> float:
    """Lopez-Paz & Ranzato's FWT ``mean_{j>=1} R[j-1, j] - b_j``; NaN for T = 1."""
    f = forward_transfer_per_task(R, baseline)
    return float(f.mean()) if f.size else math.nan


# --------------------------------------------------------------------------- curve metrics


def _curve(y: ArrayLike, steps: ArrayLike | None, what: str) -> tuple[np.ndarray, np.ndarray | None]:
    try:
        v = np.array(y, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a 1-D array of numbers") from None
    if v.size == 0 or not np.isfinite(v).all():
        raise ConfigError(f"{what} must be a non-empty array of finite numbers")
    if v.min() < 0.0 or v.max() > 1.0:
        raise ConfigError(f"{what} has values in [{v.min():g}, {v.max():g}] but normalised forward transfer "
                          "needs performance in [0, 1]; convert returns to success rates first")
    if steps is None:
        return v, None
    try:
        s = np.array(steps, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ConfigError(f"steps of {what} must be a 1-D array of numbers") from None
    if s.shape != v.shape:
        raise ConfigError(f"steps of {what} have {s.size} points but the curve has {v.size}")
    if not np.isfinite(s).all() or s.min() < 0.0 or s.max() > 1.0 or (np.diff(s) <= 0).any():
        raise ConfigError(f"steps of {what} must increase strictly within [0, 1]; divide by the steps per task")
    return v, s


def curve_auc(curve: ArrayLike, steps: ArrayLike | None = None, method: str = "trapezoid") -> float:
    """Area under a performance curve on [0, 1].

    ``trapezoid``: trapezoid rule over ``steps`` (default equally spaced on [0, 1]), the curve held
    constant before its first and after its last step. ``mean``: mean of the points (Continual
    World; ``steps`` must be omitted).
    """
    if method not in AUC_METHODS:
        raise ConfigError(f"unknown AUC method {method!r}; use one of {AUC_METHODS}")
    y, s = _curve(curve, steps, "curve")
    if method == "mean":
        if s is not None:
            raise ConfigError("method='mean' averages equally spaced points and takes no steps; "
                              "use method='trapezoid' for uneven steps")
        return float(y.mean())
    if y.size == 1:
        return float(y[0])
    if s is None:
        s = np.linspace(0.0, 1.0, y.size)
    if s[0] > 0.0:
        s, y = np.concatenate([[0.0], s]), np.concatenate([[y[0]], y])
    if s[-1] < 1.0:
        s, y = np.concatenate([s, [1.0]]), np.concatenate([y, [y[-1]]])
    return float(np.sum(np.diff(s) * (y[1:] + y[:-1]) / 2.0))


def _per_task(x: Sequence | None, T: int, what: str) -> list:
    if x is None:
        return [None] * T
    if len(x) != T:
        raise ConfigError(f"{what} has {len(x)} entries but there are {T} tasks")
    return list(x)


def normalized_forward_transfer_per_task(
    curves: Sequence[ArrayLike],
    ref_curves: Sequence[ArrayLike],
    steps: Sequence[ArrayLike | None] | None = None,
    ref_steps: Sequence[ArrayLike | None] | None = None,
    method: str = "trapezoid",
) -> np.ndarray:
    """``FT_j = (AUC_j - AUC_ref_j) / (1 - AUC_ref_j)`` per task (NaN where ``AUC_ref_j = 1``).

    ``curves[j]``: performance during the continual learner's training on task j;
    ``ref_curves[j]``: the same task trained from scratch (the reference / "Baseline").
    """
    T = len(curves)
    if T == 0:
        raise ConfigError("normalised forward transfer needs at least one task curve")
    if len(ref_curves) != T:
        raise ConfigError(f"{T} training curves but {len(ref_curves)} reference curves; give one per task")
    st, rst = _per_task(steps, T, "steps"), _per_task(ref_steps, T, "ref_steps")
    out = np.empty(T)
    for j in range(T):
        auc = curve_auc(curves[j], st[j], method)
        ref = curve_auc(ref_curves[j], rst[j], method)
        out[j] = math.nan if ref >= 1.0 else (auc - ref) / (1.0 - ref)
    return out


def normalized_forward_transfer(
    curves: Sequence[ArrayLike],
    ref_curves: Sequence[ArrayLike],
    steps: Sequence[ArrayLike | None] | None = None,
    ref_steps: Sequence[ArrayLike | None] | None = None,
    method: str = "trapezoid",
    skip_first: bool = False,
) -> float:
    """Mean normalised forward transfer over tasks (``skip_first=True``: without task 0, as CompoNet)."""
    ft = normalized_forward_transfer_per_task(curves, ref_curves, steps, ref_steps, method)
    return _nanmean(ft[1:] if skip_first else ft)


# --------------------------------------------------------------------------- report


@dataclass
class ContinualReport:
    """Every continual metric of one run; NaN = undefined (left out of :meth:`as_metrics`)."""

    num_tasks: int
    avg_perf: float
    avg_own_perf: float
    forgetting: float
    max_forgetting: float
    bwt: float
    fwt: float = math.nan
    normalized_ft: float = math.nan
    running_avg_perf: np.ndarray = field(default_factory=lambda: np.empty(0))
    forgetting_per_task: np.ndarray = field(default_factory=lambda: np.empty(0))
    max_forgetting_per_task: np.ndarray = field(default_factory=lambda: np.empty(0))
    fwt_per_task: np.ndarray = field(default_factory=lambda: np.empty(0))
    normalized_ft_per_task: np.ndarray = field(default_factory=lambda: np.empty(0))

    def as_metrics(self, prefix: str = "cl", per_task: bool = False) -> dict[str, float]:
        """Flat MLflow names (``cl/avg_perf``, ``cl/forgetting``, ``cl/bwt``, ``cl/fwt`` ...).

        ``per_task=True`` adds ``{prefix}/after/{i}/avg_perf`` and ``{prefix}/task/{j}/<metric>``.
        Non-finite values are omitted.
        """
        p = f"{prefix}/" if prefix else ""
        out: dict[str, float] = {f"{p}num_tasks": float(self.num_tasks)}
        for name in ("avg_perf", "avg_own_perf", "forgetting", "max_forgetting", "bwt", "fwt", "normalized_ft"):
            out[f"{p}{name}"] = float(getattr(self, name))
        if per_task:
            for i, v in enumerate(self.running_avg_perf):
                out[f"{p}after/{i}/avg_perf"] = float(v)
            for j, v in enumerate(self.forgetting_per_task):
                out[f"{p}task/{j}/forgetting"] = float(v)
            for j, v in enumerate(self.max_forgetting_per_task):
                out[f"{p}task/{j}/max_forgetting"] = float(v)
            for j, v in enumerate(self.fwt_per_task):
                out[f"{p}task/{j + 1}/fwt"] = float(v)
            for j, v in enumerate(self.normalized_ft_per_task):
                out[f"{p}task/{j}/normalized_ft"] = float(v)
        return {k: v for k, v in out.items() if math.isfinite(v)}


def continual_report(
    R: ArrayLike,
    baseline: ArrayLike | None = None,
    curves: Sequence[ArrayLike] | None = None,
    ref_curves: Sequence[ArrayLike] | None = None,
    steps: Sequence[ArrayLike | None] | None = None,
    ref_steps: Sequence[ArrayLike | None] | None = None,
    auc_method: str = "trapezoid",
    skip_first_ft: bool = False,
) -> ContinualReport:
    """All metrics of ``R``; FWT when ``baseline`` is given, normalised FT when both curve sets are.

    ``R`` needs its diagonal and final row; the superdiagonal only with ``baseline``. The running
    average is NaN after task i when row i is incomplete up to column i.
    """
    a = check_matrix(R)
    T = a.shape[0]
    if (curves is None) != (ref_curves is None):
        raise ConfigError("normalised forward transfer needs both curves and ref_curves (or neither)")
    fwt_t = forward_transfer_per_task(a, baseline) if baseline is not None else np.empty(0)
    nft_t = np.empty(0)
    if curves is not None:
        if len(curves) != T:
            raise ConfigError(f"{len(curves)} training curves for a {T}-task accuracy matrix; give one per task")
        nft_t = normalized_forward_transfer_per_task(curves, ref_curves, steps, ref_steps, auc_method)
    f_t = forgetting_per_task(a, "final")
    fm_t = forgetting_per_task(a, "max")
    return ContinualReport(
        num_tasks=T,
        avg_perf=average_performance(a),
        avg_own_perf=average_own_performance(a),
        forgetting=_nanmean(f_t),
        max_forgetting=_nanmean(fm_t),
        bwt=-_nanmean(f_t),
        fwt=_nanmean(fwt_t),
        normalized_ft=_nanmean(nft_t[1:] if skip_first_ft else nft_t),
        running_avg_perf=np.array([a[i, : i + 1].mean() for i in range(T)]),  # NaN where incomplete
        forgetting_per_task=f_t,
        max_forgetting_per_task=fm_t,
        fwt_per_task=fwt_t,
        normalized_ft_per_task=nft_t,
    )
