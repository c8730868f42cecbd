"""A continual-RL run's report: the paper's metrics from the return matrices and training curves, and plots.

Inputs (gathered by :meth:`clients.rl_learner.RLLearner.final_report` from the run history):

* ``R`` (T x T) -- mean evaluation return of the *task-aware* policy on task j after task i (the
  policy the method uses for task j: FT-N's / scratch's copy j, CKA-RL's theta_j rebuilt from the
  pool, FT-1's only actor; for j > i the latest policy), ``L`` -- the same with the *latest* policy
  for every j; ``R0`` -- the initial policy's returns (the random-init baseline of Lopez-Paz FWT);
* ``curves`` (T x I) -- the training return per PPO iteration of each task (mean over nodes,
  weighted by finished episodes), ``ref_curves`` / ``ref_final`` -- the from-scratch reference.

Metrics (prefix ``rl/``), with the success threshold thr_j = success_frac x ref_final[j]:

* ``perf`` -- mean over tasks of the success rate of the task-aware policy at the end (CKA-RL Table 1
  PERF; for FT-1 its single final actor, as CompoNet scores FT-1); ``perf_train`` -- PERF *as
  coded*: mean over tasks of the last 10% of each task's training success curve;
* ``final_policy`` -- the latest policy's success averaged over all tasks (Table 3);
* ``fwt`` -- normalised forward transfer (Eq. 9) of the training success curves against the
  reference's, tasks 2..N (CompoNet's ``skip_first``); ``fwt_return`` -- the same on returns / 500,
  a finer reading of the same curves; ``fwt_similar`` / ``fwt_return_similar`` -- the same over the
  *similar* tasks only (a task with the same conflict as the task before it: only its physics
  changed, so fine-tuning the previous policy should help -- FT-N's positive control),
  ``fwt_conflict`` / ``fwt_return_conflict`` over the others (swapped actions / flipped observations
  relative to the previous task);
* ``init_return`` -- mean return over the first 10% of iterations of tasks 2..N (Fig. 4's initial
  reward), ``init_return_ref`` -- the reference's;
* ``cl/...`` -- :func:`fedsim.metrics.continual.continual_report` of the success matrix (forgetting,
  BWT, Lopez-Paz FWT against the initial policy);
* ``memory_params`` / ``memory_max`` -- stored actor parameters after the last task / at most;
* ``perf_return`` / ``perf_return_min`` -- the task-aware policies' final evaluation return, mean and
  worst over tasks, ``task/{j}/final_return`` per task; ``greedy_return`` / ``greedy_return_min`` --
  the same with argmax actions (for ``scratch``: does the budget learn *every* task, the stream's
  validity bar).

Success in the matrices is the share of evaluation episodes reaching the threshold (``*_succ``
metrics logged by ``evaluate_global``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from algorithms.ckarl.evaluation import smooth, success_curve, tail_mean, training_curve
from envs.rl_tasks import MAX_EPISODE_STEPS
from fedsim.metrics.continual import continual_report, normalized_forward_transfer_per_task

__all__ = ["RunCurves", "curve_metrics", "matrix_metrics", "plot_curves", "plot_memory", "similar_tasks"]


@dataclass
class RunCurves:
    curves: np.ndarray  # (T, I) training returns per iteration (NaN: no episode ended)
    ref_curves: np.ndarray | None  # the reference's, same shape
    thresholds: np.ndarray | None  # (T,)
    similar: np.ndarray | None = None  # (T,) bool: task j has the same conflict as task j-1 (see similar_tasks)


def similar_tasks(conflicts: Sequence[str]) -> np.ndarray:
    """Task j (j >= 1) is *similar* when its conflict is the previous task's (only the physics changed)."""
    return np.array([j > 0 and conflicts[j] == conflicts[j - 1] for j in range(len(conflicts))], dtype=bool)


def _mean_head(y: np.ndarray, fraction: float = 0.1) -> float:
    k = max(1, int(round(fraction * y.size)))
    return float(np.mean(y[:k]))


def curve_metrics(c: RunCurves, window: int) -> dict[str, float]:
    """Metrics of the training curves (``perf_train``, ``fwt``, ``fwt_return``, ``init_return`` ...)."""
    T = c.curves.shape[0]
    filled = [training_curve(c.curves[j]) for j in range(T)]
    out: dict[str, float] = {}
    inits = [_mean_head(filled[j]) for j in range(T)]
    out["init_return"] = float(np.mean(inits[1:])) if T > 1 else math.nan
    for j in range(T):
        out[f"task/{j}/init_return"] = inits[j]
        out[f"task/{j}/final_return_train"] = tail_mean(filled[j])
    if c.ref_curves is None or c.thresholds is None:
        return out
    ref_filled = [training_curve(c.ref_curves[j]) for j in range(T)]
    ref_inits = [_mean_head(ref_filled[j]) for j in range(T)]
    out["init_return_ref"] = float(np.mean(ref_inits[1:])) if T > 1 else math.nan
    succ = [success_curve(c.curves[j], c.thresholds[j], window) for j in range(T)]
    ref_succ = [success_curve(c.ref_curves[j], c.thresholds[j], window) for j in range(T)]
    out["perf_train"] = float(np.mean([tail_mean(s) for s in succ]))
    ft = normalized_forward_transfer_per_task(succ, ref_succ)
    unit = [np.clip(smooth(f, window) / MAX_EPISODE_STEPS, 0, 1) for f in filled]
    ref_unit = [np.clip(smooth(f, window) / MAX_EPISODE_STEPS, 0, 1) for f in ref_filled]
    ft_ret = normalized_forward_transfer_per_task(unit, ref_unit)
    out["fwt"] = _nanmean(ft[1:])
    out["fwt_return"] = _nanmean(ft_ret[1:])
    if c.similar is not None:
        later = np.arange(T) >= 1
        for name, mask in (("similar", later & c.similar), ("conflict", later & ~c.similar)):
            if mask.any():
                out[f"fwt_{name}"] = _nanmean(ft[mask])
                out[f"fwt_return_{name}"] = _nanmean(ft_ret[mask])
    for j in range(T):
        out[f"task/{j}/fwt"] = float(ft[j])
        out[f"task/{j}/fwt_return"] = float(ft_ret[j])
    return out


def _nanmean(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else math.nan


def matrix_metrics(R_succ: np.ndarray, L_succ: np.ndarray, R_ret: np.ndarray, L_ret: np.ndarray,
                   baseline_succ: np.ndarray | None, greedy: np.ndarray | None = None) -> dict[str, float]:
    """Metrics of the end-of-task evaluations (``perf``, ``final_policy`` and the continual report);
    ``greedy`` (T,): the final task-aware policies' returns with argmax actions, if evaluated."""
    T = R_ret.shape[0]
    out: dict[str, float] = {}
    if greedy is not None and np.isfinite(greedy).all():
        out.update(greedy_return=float(np.mean(greedy)), greedy_return_min=float(np.min(greedy)))
    out.update(perf_return=float(R_ret[T - 1].mean()), perf_return_min=float(R_ret[T - 1].min()),
               final_policy_return=float(L_ret[T - 1].mean()))
    for j in range(T):
        out[f"task/{j}/final_return"] = float(R_ret[T - 1, j])
    if np.isfinite(R_succ).all():
        out["perf"] = float(R_succ[T - 1].mean())
        out["final_policy"] = float(L_succ[T - 1].mean())
        report = continual_report(R_succ, baseline=baseline_succ)
        out.update({k[len("rl/"):]: v for k, v in report.as_metrics("rl/cl").items()})
        out["final_policy_forgetting"] = continual_report(L_succ).forgetting
    return out


def plot_curves(curves: np.ndarray, ref_curves: np.ndarray | None, thresholds: np.ndarray | None,
                task_names: Sequence[str], steps_per_task: int, window: int, title: str) -> Figure:
    """Training return over the stream (smoothed), the reference per task dashed, thresholds dotted."""
    T, iters = curves.shape
    fig = Figure(figsize=(max(7.0, 1.4 * T), 3.6))
    ax = fig.subplots()
    x = (np.arange(iters) + 1) / iters * steps_per_task
    for j in range(T):
        off = j * steps_per_task
        ax.plot(off + x, smooth(training_curve(curves[j]), window), color="C0", lw=1.4,
                label="method" if j == 0 else None)
        if ref_curves is not None:
            ax.plot(off + x, smooth(training_curve(ref_curves[j]), window), color="0.5", ls="--", lw=1.0,
                    label="from scratch (reference)" if j == 0 else None)
        if thresholds is not None:
            ax.hlines(thresholds[j], off, off + steps_per_task, colors="C3", linestyles=":", lw=1.0,
                      label="success threshold" if j == 0 else None)
        ax.axvline(off, color="0.8", lw=0.8)
        ax.text(off + steps_per_task / 2, 1.01, task_names[j], transform=ax.get_xaxis_transform(), ha="center",
                fontsize=7)
    ax.set_xlabel("environment steps per node")
    ax.set_ylabel(f"episodic return (moving avg, {window} it.)")
    ax.set_ylim(0, MAX_EPISODE_STEPS * 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(title, fontsize=9, pad=14)
    fig.tight_layout()
    return fig


def plot_memory(memory: Sequence[float], pool: Sequence[float] | None, actor_params: int, title: str) -> Figure:
    """Stored actor parameters after each task (in actor sizes), and CKA-RL's pool size."""
    fig = Figure(figsize=(5.0, 3.2))
    ax = fig.subplots()
    tasks = np.arange(1, len(memory) + 1)
    ax.plot(tasks, np.asarray(memory) / actor_params, "o-", label="stored actor parameters / actor size")
    if pool is not None:
        ax.plot(tasks, pool, "s--", label="knowledge vectors in the pool")
    ax.set_xlabel("tasks finished")
    ax.set_xticks(tasks)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
