"""The linear setting of LoRA-ML (authors' ``linear/learners.py``): data, objectives, trainers, adaptation.

Task t has ``y = (A* + U_t* U_t*ᵀ) x + ε`` with ``x ~ N(0, I_d)``.  Every objective here is the
authors' per-task loss ``L_t(M) = ‖Y_t − M X_t‖_F² / (2 n)`` (their hand-written gradients are those
of half the squared error, divided by the sample count), evaluated from the sufficient statistics
``X Xᵀ/n``, ``Y Xᵀ/n`` and ``‖Y‖²/n`` so a step costs O(d³) whatever n is — the same numbers as
the direct sum over samples (``tests/central/test_peft_meta.py`` checks both the values and the
autograd gradients against the direct and closed-form computations).  Gradients are torch autograd
in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

DTYPE = torch.float64


# -- data ------------------------------------------------------------------------------------------

@dataclass
class Truth:
    """Ground truth: the shared base A* (symmetric) and the per-task factors U_t* (T × d × k)."""

    a_star: Tensor
    u_star: Tensor

    @property
    def targets(self) -> Tensor:
        """A* + U_t* U_t*ᵀ for every task (T × d × d)."""
        return self.a_star + self.u_star @ self.u_star.transpose(-1, -2)


def make_truth(rng: np.random.Generator, d: int, num_tasks: int, k: int) -> Truth:
    """A* = sym(Gaussian), U_t* ~ N(0, 1) (authors' ``run.py``)."""
    a = rng.normal(0.0, 1.0, (d, d))
    u = rng.normal(0.0, 1.0, (num_tasks, d, k))
    return Truth(torch.tensor((a + a.T) / 2, dtype=DTYPE), torch.tensor(u, dtype=DTYPE))


def sample(rng: np.random.Generator, target: Tensor, n: int, noise_std: float) -> tuple[Tensor, Tensor]:
    """n samples of one task: X (d × n) ~ N(0, 1), Y = target X + N(0, noise_std²)."""
    d = target.shape[-1]
    x = torch.tensor(rng.normal(0.0, 1.0, (d, n)), dtype=DTYPE)
    noise = torch.tensor(rng.normal(0.0, noise_std, (d, n)), dtype=DTYPE)
    return x, target @ x + noise


@dataclass
class Stats:
    """Sufficient statistics of T tasks with n samples each: X Xᵀ/n, Y Xᵀ/n (T × d × d), ‖Y‖²/n (T)."""

    sxx: Tensor
    syx: Tensor
    syy: Tensor
    n: int

    @staticmethod
    def of(xs: list[Tensor], ys: list[Tensor]) -> "Stats":
        n = xs[0].shape[1]
        if any(x.shape[1] != n for x in xs):
            raise ValueError("every task must have the same number of samples")
        x, y = torch.stack(xs), torch.stack(ys)
        return Stats(x @ x.transpose(-1, -2) / n, y @ x.transpose(-1, -2) / n, (y * y).sum((-1, -2)) / n, n)

    @property
    def num_tasks(self) -> int:
        return self.sxx.shape[0]

    def pooled(self) -> "Stats":
        """The statistics of all tasks' samples pooled into one data set (equal n per task)."""
        return Stats(self.sxx.mean(0, keepdim=True), self.syx.mean(0, keepdim=True), self.syy.mean(0, keepdim=True),
                     self.n * self.num_tasks)


# -- objectives --------------------------------------------------------------------------------------

def task_losses(m: Tensor, s: Stats) -> Tensor:
    """``L_t(M_t) = ‖Y_t − M_t X_t‖² / (2n)`` per task; ``m`` is d × d (shared) or T × d × d."""
    quad = (m @ s.sxx * m).sum((-1, -2))
    cross = (m * s.syx).sum((-1, -2))
    return 0.5 * (s.syy - 2.0 * cross + quad)


def lora_ml_objective(a: Tensor, u: Tensor, s: Stats) -> Tensor:
    """The LoRA-ML objective ``(1/T) Σ_t L_t(A + U_t U_tᵀ)`` (symmetric per-task adapters)."""
    return task_losses(a + u @ u.transpose(-1, -2), s).mean()


def lora_loss(a: Tensor, u: Tensor, v: Tensor, s: Stats) -> Tensor:
    """The adaptation objective ``L(Â + U Vᵀ)`` of one task (asymmetric LoRA, base frozen)."""
    return task_losses(a + u @ v.transpose(-1, -2), s).mean()


def excess(m: Tensor, target: Tensor) -> float:
    """Population excess risk ``E_x ‖(target − M) x‖² = ‖target − M‖_F²`` for x ~ N(0, I)."""
    return float(((target - m) ** 2).sum())


def _grad(f: Callable[..., Tensor], *xs: Tensor) -> tuple[Tensor, ...]:
    """Autograd gradient of ``f`` at ``xs`` (a tuple, one gradient per argument)."""
    xs = tuple(x.detach().requires_grad_(True) for x in xs)
    return torch.autograd.grad(f(*xs), xs)


# -- retraining ------------------------------------------------------------------------------------

@dataclass
class Trained:
    """A retrained base (and, for LoRA-ML, the task adapters) with its recorded curve."""

    a: Tensor
    u: Tensor | None
    curve: list[tuple[int, float]]  # (outer step, relative error of A against A*) every record_every steps


def train_lora_ml(s: Stats, u0: Tensor, inner_lr: float, outer_lr: float, inner_steps: int, outer_steps: int,
                  a_star: Tensor | None = None, record_every: int = 10) -> Trained:
    """Authors' alternating GD on the LoRA-ML objective: from A = 0, each outer step takes ``inner_steps``
    GD steps on every U_t (all tasks at once), then one GD step on A."""
    a, u = torch.zeros_like(s.sxx[0]), u0.clone()
    curve: list[tuple[int, float]] = []

    def record(step: int) -> None:
        if a_star is not None and step % record_every == 0:
            curve.append((step, relative_error(a, a_star)))

    record(0)
    for step in range(1, outer_steps + 1):
        for _ in range(inner_steps):
            u = u - inner_lr * _grad(lambda w: lora_ml_objective(a, w, s) * s.num_tasks, u)[0]
        a = a - outer_lr * _grad(lambda w: lora_ml_objective(w, u, s), a)[0]
        record(step)
    return Trained(a, u, curve)


def train_retrain(s: Stats, lr: float, steps: int, a_star: Tensor | None = None, record_every: int = 10) -> Trained:
    """Standard retraining: GD on A alone over the pooled data of all tasks."""
    pooled, a = s.pooled(), torch.zeros_like(s.sxx[0])
    curve = [(0, relative_error(a, a_star))] if a_star is not None else []
    for step in range(1, steps + 1):
        a = a - lr * _grad(lambda w: task_losses(w, pooled).mean(), a)[0]
        if a_star is not None and step % record_every == 0:
            curve.append((step, relative_error(a, a_star)))
    return Trained(a, None, curve)


def train_reptile(s: Stats, inner_lr: float, inner_steps: int, outer_lr: float, outer_steps: int,
                  a_star: Tensor | None = None, record_every: int = 10) -> Trained:
    """Reptile on the full model A: per outer step, ``inner_steps`` GD steps on each task from A, then
    ``A ← A + outer_lr · mean_t (A_t − A)`` (all tasks at once)."""
    a = torch.zeros_like(s.sxx[0])
    curve = [(0, relative_error(a, a_star))] if a_star is not None else []
    for step in range(1, outer_steps + 1):
        a_t = a.expand_as(s.sxx).clone()
        for _ in range(inner_steps):
            a_t = a_t - inner_lr * _grad(lambda w: task_losses(w, s).sum(), a_t)[0]
        a = a + outer_lr * (a_t - a).mean(0)
        if a_star is not None and step % record_every == 0:
            curve.append((step, relative_error(a, a_star)))
    return Trained(a, None, curve)


# -- adaptation to a new task ---------------------------------------------------------------------------

@dataclass
class Adapted:
    m: Tensor  # the adapted model Â + U Vᵀ
    curve: list[tuple[int, float]]  # (step, excess risk) every record_every steps, step 0 first
    final_excess: float


def adapt_lora(a: Tensor, s: Stats, u0: Tensor, v0: Tensor, lr: float, steps: int, target: Tensor,
               record_every: int = 10) -> Adapted:
    """Fit a fresh asymmetric LoRA U Vᵀ (rank = u0's columns) on the new task's samples, base frozen,
    by plain GD (authors' ``inner_gradient_asymmetric`` steps); returns the excess-risk curve."""
    a = a.detach()
    u, v = u0.clone(), v0.clone()
    curve = [(0, excess(a + u @ v.T, target))]
    for step in range(1, steps + 1):
        gu, gv = _grad(lambda p, q: lora_loss(a, p, q, s), u, v)
        u, v = u - lr * gu, v - lr * gv
        if step % record_every == 0 or step == steps:
            curve.append((step, excess(a + u @ v.T, target)))
    m = a + u @ v.T
    return Adapted(m, curve, excess(m, target))


# -- recovery up to symmetry ------------------------------------------------------------------------

def relative_error(a: Tensor, a_star: Tensor) -> float:
    """‖A − A*‖_F² / ‖A*‖_F²."""
    return float(((a - a_star) ** 2).sum() / (a_star ** 2).sum())


def recovery_error(a: Tensor, u: Tensor, a_star: Tensor, u_star: Tensor) -> float:
    """Symmetry-invariant relative recovery error of (A, {U_t}) against (A*, {U_t*}):

    ``(‖A − A*‖² + Σ_t ‖U_t U_tᵀ − U_t* U_t*ᵀ‖²) / (‖A*‖² + Σ_t ‖U_t* U_t*ᵀ‖²)``.  It depends on the
    adapters only through U_t U_tᵀ, so it is 0 exactly at (A*, {U_t* Q_t}) for orthogonal Q_t — the
    LoRA-ML objective's only symmetry once T ≥ 3 tasks pin the split between base and adapters.
    """
    p, p_star = u @ u.transpose(-1, -2), u_star @ u_star.transpose(-1, -2)
    num = ((a - a_star) ** 2).sum() + ((p - p_star) ** 2).sum()
    return float(num / ((a_star ** 2).sum() + (p_star ** 2).sum()))
