"""The linear-probe baselines on the same cached token grids (scikit-learn's logistic regression).

A probe reads the flattened token grid (T·D features) of one (backbone, layer), or, for the
concatenated probe, of every layer of every backbone side by side.  Model selection follows the
VTAB-1k protocol: the inverse regularisation C (and, for a single backbone's ``best`` probe, the layer)
is picked on a held-out 20% of the training set, then the probe is refitted on the whole training set
and scored once on the test set.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from central.combo.features import LayerMaps


@dataclass(frozen=True)
class ProbeRecipe:
    cs: tuple[float, ...] = (0.01, 0.1, 1.0)  # inverse L2 strengths tried on the validation split
    val_frac: float = 0.2
    max_iter: int = 300


def flatten(maps: LayerMaps) -> np.ndarray:
    """(N, Σ_l T·D_l): the token grids of the given layers, flattened and side by side."""
    return torch.cat([m.flatten(1) for m in maps], dim=1).numpy()


def fit(x: np.ndarray, y: np.ndarray, c: float, max_iter: int) -> Any:
    """scikit-learn's L2 logistic regression (lbfgs, one BLAS thread; convergence warnings silenced)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    with warnings.catch_warnings(), threadpool_limits(1):
        warnings.simplefilter("ignore", ConvergenceWarning)
        return LogisticRegression(C=c, max_iter=max_iter).fit(x, y)


def accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    with threadpool_limits(1):
        return float((model.predict(x) == y).mean())


def val_split(n: int, frac: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    n_val = max(1, int(round(frac * n)))
    return order[n_val:], order[:n_val]


def select_and_fit(candidates: dict[str, tuple[np.ndarray, np.ndarray]], y_train: np.ndarray, y_test: np.ndarray,
                   recipe: ProbeRecipe, seed: int) -> dict[str, float | str]:
    """Pick (candidate, C) by validation accuracy, refit on all training rows, score on test.

    ``candidates`` maps a label (e.g. a layer) to its (train, test) feature matrices.
    """
    fit_rows, val_rows = val_split(len(y_train), recipe.val_frac, seed)
    best: tuple[float, str, float] | None = None
    for label, (x_tr, _) in candidates.items():
        for c in recipe.cs:
            model = fit(x_tr[fit_rows], y_train[fit_rows], c, recipe.max_iter)
            val = accuracy(model, x_tr[val_rows], y_train[val_rows])
            if best is None or val > best[0]:
                best = (val, label, c)
    assert best is not None
    val, label, c = best
    x_tr, x_te = candidates[label]
    test = accuracy(fit(x_tr, y_train, c, recipe.max_iter), x_te, y_test)
    return {"choice": label, "c": c, "val_acc": val, "test_acc": test}
