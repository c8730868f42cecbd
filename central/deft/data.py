"""Old/new class splits of the offline data sets and few-shot sampling of the new task.

* ``mnist``: the project's offline MNIST (``envs.datasets.load_mnist``: 5,000 real 28×28 images,
  500 per class, standardised).
* ``text``: ``stdlib_docs`` (``envs.text``: Python standard-library docstring paragraphs labelled by
  module family, MiniLM token ids).

Per class a fixed test block (``test_per_class`` rows, chosen by ``split_seed``) is held out; the rest
is the training pool.  The old task is the classes in ``old_classes`` (the whole pool trains the
pretrained model); the new task is the other classes, of which only ``shots`` pool rows per class
(drawn by the run's seed) are seen during adaptation.  Labels are re-indexed 0..k−1 within each task,
in increasing class order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Split:
    """Inputs and task-local labels (0..k−1)."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class Tasks:
    old_train: Split
    old_test: Split
    new_pool: Split
    new_test: Split
    old_classes: tuple[int, ...]
    new_classes: tuple[int, ...]


def class_blocks(y: np.ndarray, test_per_class: int, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Row indices ``(train, test)``: ``test_per_class`` rows of every class held out (seeded)."""
    rng = np.random.default_rng(split_seed)
    train, test = [], []
    for c in np.unique(y):
        rows = rng.permutation(np.flatnonzero(y == c))
        test.append(rows[:test_per_class])
        train.append(rows[test_per_class:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _task(x: np.ndarray, y: np.ndarray, rows: np.ndarray, classes: tuple[int, ...]) -> Split:
    rows = rows[np.isin(y[rows], classes)]
    local = np.searchsorted(np.asarray(classes), y[rows])
    return Split(torch.from_numpy(np.ascontiguousarray(x[rows])), torch.from_numpy(local.astype(np.int64)))


def split_tasks(x: np.ndarray, y: np.ndarray, old_classes: list[int], test_per_class: int, split_seed: int) -> Tasks:
    """The old task (classes ``old_classes``) and the new task (the rest), each with train and test rows."""
    old = tuple(sorted(int(c) for c in old_classes))
    new = tuple(int(c) for c in np.unique(y) if int(c) not in old)
    train, test = class_blocks(y, test_per_class, split_seed)
    return Tasks(_task(x, y, train, old), _task(x, y, test, old), _task(x, y, train, new), _task(x, y, test, new),
                 old, new)


def few_shot(pool: Split, shots: int, rng: np.random.Generator) -> Split:
    """``shots`` rows of every class of ``pool`` (without replacement), in class order."""
    y = pool.y.numpy()
    rows = np.concatenate([np.sort(rng.choice(np.flatnonzero(y == c), size=shots, replace=False))
                           for c in np.unique(y)])
    idx = torch.from_numpy(rows)
    return Split(pool.x[idx], pool.y[idx])


def mnist_arrays() -> tuple[np.ndarray, np.ndarray, int]:
    """The offline MNIST (x float32 (5000, 1, 28, 28), y, rows per class)."""
    from envs.datasets import load_mnist

    data = load_mnist(None, 0)
    return data.x, data.y, int(np.bincount(data.y).min())


def text_arrays(max_len: int, per_class: int, split_seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``stdlib_docs`` token ids (int64 (N, max_len)), family labels, and the smallest class size."""
    from envs.text import StdlibDocsParams, load_stdlib_docs

    data = load_stdlib_docs(StdlibDocsParams(max_len=max_len, per_class=per_class), split_seed)
    return data.x, data.y, int(np.bincount(data.y).min())
