"""Evaluating policies and turning training curves into the paper's metrics.

* :func:`evaluate_returns` -- the returns of ``episodes`` episodes of a policy on a task: one
  episode on each copy of a vector env reset from ``seed``, actions sampled from the policy on a
  generator seeded by ``seed`` (CleanRL's evaluation samples too; ``greedy`` takes the argmax).
  The same seed for every policy evaluated on a task: comparisons are paired.
* :class:`EvalCache` -- the same (policy, task) is evaluated once per run (FT-N's stored copies and
  CKA-RL's untouched task policies are re-evaluated at every task end otherwise).
* :func:`training_curve` / :func:`success_curve` -- CompoNet's ``process_results.py`` protocol (as
  CKA-RL reuses it): per-iteration mean episodic return (iterations without a finished episode carry
  the last value), a trailing moving average, and success = smoothed return >= threshold, the
  threshold being ``success_frac`` (0.8, as the code's thresholds ~ 0.8 x the mean return) times
  the from-scratch reference's final return on that task.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from algorithms.ckarl.ppo import MLP, sample_actions
from envs.rl_tasks import CartPoleTask, MAX_EPISODE_STEPS, make_vec_env
from fedsim.seeding import derive_seed

__all__ = ["EvalCache", "evaluate_returns", "success_curve", "tail_mean", "training_curve"]


def evaluate_returns(mlp: MLP, flat: Tensor, task: CartPoleTask, episodes: int, seed: int,
                     greedy: bool = False) -> np.ndarray:
    """Returns of one episode on each of ``episodes`` copies of ``task`` under the actor ``flat``."""
    envs = make_vec_env(task, episodes)
    obs, _ = envs.reset(seed=seed)
    generator = torch.Generator().manual_seed(derive_seed(seed, "actions"))
    returns = np.zeros(episodes)
    running = np.ones(episodes, dtype=bool)
    with torch.no_grad():
        layers = [t.detach() for t in mlp.tensors(flat.detach())]
        for _ in range(MAX_EPISODE_STEPS + 1):
            logits = MLP.forward_tensors(layers, torch.from_numpy(obs.astype(np.float32)))
            action = logits.argmax(-1) if greedy else sample_actions(logits, generator)
            obs, reward, term, trunc, _ = envs.step(action.numpy())
            returns += reward * running
            running &= ~np.logical_or(term, trunc)
            if not running.any():
                break
    envs.close()
    return returns


class EvalCache:
    """Evaluation returns per (task index, actor parameters): each pair is evaluated once."""

    def __init__(self) -> None:
        self._values: dict[tuple[int, str], np.ndarray] = {}

    def returns(self, mlp: MLP, flat: Tensor, task_index: int, task: CartPoleTask, episodes: int, seed: int,
                greedy: bool) -> np.ndarray:
        key = (task_index, hashlib.sha1(flat.detach().contiguous().numpy().tobytes()).hexdigest())
        if key not in self._values:
            self._values[key] = evaluate_returns(mlp, flat, task, episodes, seed, greedy)
        return self._values[key].copy()


def training_curve(per_iteration: Sequence[float]) -> np.ndarray:
    """Per-iteration mean returns with gaps (NaN) filled by the last value (the first value backwards)."""
    y = np.asarray(per_iteration, dtype=np.float64).copy()
    finite = np.flatnonzero(np.isfinite(y))
    if finite.size == 0:
        return np.zeros_like(y)
    y[: finite[0]] = y[finite[0]]
    for i in range(finite[0] + 1, y.size):
        if not np.isfinite(y[i]):
            y[i] = y[i - 1]
    return y


def smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over ``window`` points (fewer at the start)."""
    c = np.cumsum(np.concatenate([[0.0], y]))
    idx = np.arange(1, y.size + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def success_curve(per_iteration: Sequence[float], threshold: float, window: int) -> np.ndarray:
    """1 where the smoothed return reaches ``threshold``, else 0."""
    return (smooth(training_curve(per_iteration), window) >= threshold).astype(np.float64)


def tail_mean(y: np.ndarray, fraction: float = 0.1) -> float:
    """Mean of the last ``fraction`` of a curve (at least one point): CompoNet's ``final_success``."""
    k = max(1, int(round(fraction * y.size)))
    return float(np.mean(y[-k:]))
