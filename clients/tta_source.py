"""Source models of the test-time regimes: a registered model trained on the clean offline images.

The source is what every test-time method starts from (and what ``reset`` returns to): the
experiment's ``model`` (e.g. the small CNN with BatchNorm, or its LayerNorm variant) trained with
Adam on the clean training split of ``mnist`` or ``digits``, cached on disk by a hash of everything
that defines it (:mod:`fedsim.cache`), so a claim check trains it once per seed.

The split is fixed (``split_seed``, not the run seed): the last ``test_images`` rows of a seeded
permutation are the clean pool the test streams corrupt; the rest train the source.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from envs.streams import digits01, mnist01, mnist_normalise
from fedsim.cache import cache_dir, cached_state, key_of
from fedsim.errors import ConfigError
from fedsim.models import build_model
from fedsim.seeding import numpy_rng, seed_torch

#: Datasets a test stream can be built from: images in [0, 1] and the model's input scaling.
SOURCES: dict[str, tuple[Callable[[], tuple[np.ndarray, np.ndarray]], Callable[[np.ndarray], np.ndarray] | None]] = {
    "mnist": (mnist01, mnist_normalise),
    "digits": (digits01, None),
}
CACHE_VERSION = "tta-source-v1"


@dataclass(frozen=True)
class SourceRecipe:
    """Everything that defines a trained source model (its cache key)."""

    dataset: str = "mnist"
    model: str = "cnn"
    model_params: dict[str, Any] = field(default_factory=dict)
    epochs: int = 3
    lr: float = 1e-3
    batch_size: int = 64
    test_images: int = 1000
    split_seed: int = 0
    seed: int = 0


@dataclass
class SourceData:
    """Clean images in [0, 1], labels, the train/test split and the model's input scaling."""

    images: np.ndarray
    labels: np.ndarray
    train_rows: np.ndarray
    test_rows: np.ndarray
    normalise: Callable[[np.ndarray], np.ndarray] | None
    num_classes: int = 10

    def scaled(self, rows: np.ndarray) -> torch.Tensor:
        x = self.images[rows]
        return torch.from_numpy(np.ascontiguousarray(self.normalise(x) if self.normalise else x, dtype=np.float32))


@functools.lru_cache(maxsize=4)
def source_data(dataset: str, test_images: int, split_seed: int) -> SourceData:
    """The clean images of ``dataset`` with the fixed source/test split."""
    if dataset not in SOURCES:
        raise ConfigError(f"test streams are built from {sorted(SOURCES)}, got data.name={dataset!r}")
    load, normalise = SOURCES[dataset]
    images, labels = load()
    if not 1 <= test_images < len(labels) - 10:
        raise ConfigError(f"client.params.test_images must be in [1, {len(labels) - 11}] for {dataset} "
                          f"({len(labels)} images), got {test_images}")
    perm = numpy_rng(split_seed, "tta-source-split").permutation(len(labels))
    return SourceData(images, labels, np.sort(perm[:-test_images]), np.sort(perm[-test_images:]), normalise,
                      int(labels.max()) + 1)


def _train(recipe: SourceRecipe, data: SourceData) -> dict[str, torch.Tensor]:
    seed_torch(recipe.seed)
    model = build_model(recipe.model, dict(recipe.model_params), data.images.shape[1:], data.num_classes)
    x, y = data.scaled(data.train_rows), torch.from_numpy(data.labels[data.train_rows])
    opt = torch.optim.Adam(model.parameters(), lr=recipe.lr)
    gen = torch.Generator().manual_seed(recipe.seed)
    model.train()
    for _ in range(recipe.epochs):
        perm = torch.randperm(len(y), generator=gen)
        for start in range(0, len(y), recipe.batch_size):
            idx = perm[start:start + recipe.batch_size]
            if len(idx) < 2:  # BatchNorm needs two examples
                continue
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.state_dict()


_MODELS: dict[str, nn.Module] = {}


def source_model(recipe: SourceRecipe) -> tuple[nn.Module, bool]:
    """A fresh copy of the trained source model (eval mode) and whether it came from the disk cache."""
    key = key_of(asdict(recipe), CACHE_VERSION)
    cached = True
    if key not in _MODELS:
        data = source_data(recipe.dataset, recipe.test_images, recipe.split_seed)
        state, cached = cached_state(cache_dir() / "tta" / f"source-{key}.pt", lambda: _train(recipe, data))
        model = build_model(recipe.model, dict(recipe.model_params), data.images.shape[1:], data.num_classes)
        model.load_state_dict(state)
        _MODELS[key] = model.eval()
    return copy.deepcopy(_MODELS[key]), cached


@torch.no_grad()
def clean_accuracy(model: nn.Module, data: SourceData, batch_size: int, rows: np.ndarray | None = None) -> float:
    """Accuracy of ``model`` (as configured: eval or batch statistics) on clean ``rows`` (default: the test pool)."""
    rows = data.test_rows if rows is None else rows
    x, y = data.scaled(rows), torch.from_numpy(data.labels[rows])
    correct = 0
    for start in range(0, len(y), batch_size):
        correct += int((model(x[start:start + batch_size]).argmax(1) == y[start:start + batch_size]).sum())
    return correct / len(y)
