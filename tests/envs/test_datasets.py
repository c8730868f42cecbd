"""The offline dataset loaders and ArrayDataset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from envs.datasets import MNIST_MEAN, MNIST_STD, ArrayDataset, SyntheticParams, load_synthetic
from fedsim.errors import ConfigError
from fedsim.registry import DATASETS


def _load(name: str, params: dict | None = None, seed: int = 0) -> ArrayDataset:
    return DATASETS.get(name)(DATASETS.params(name, params, "data.params"), seed)


def test_registered_names() -> None:
    assert {"mnist", "digits", "synthetic"} <= set(DATASETS.names())


def test_mnist_is_real_balanced_and_standardised() -> None:
    ds = _load("mnist")
    assert ds.x.shape == (5000, 1, 28, 28) and ds.x.dtype == np.float32
    assert ds.y.dtype == np.int64 and ds.num_classes == 10 and ds.input_shape == (1, 28, 28)
    assert np.bincount(ds.y).tolist() == [500] * 10
    pixels = ds.x * MNIST_STD + MNIST_MEAN  # undo the standardisation: back in [0, 1]
    assert pixels.min() == pytest.approx(0.0, abs=1e-5) and pixels.max() == pytest.approx(1.0, abs=1e-5)
    assert ds.x.min() == pytest.approx(-MNIST_MEAN / MNIST_STD, abs=1e-5)
    # real digits, not noise: about 19 % of MNIST pixels are ink, the mean image is near 0.13
    assert 0.08 < pixels.mean() < 0.2
    assert 0.1 < (pixels > 0.5).mean() < 0.3


def test_mnist_loader_returns_fresh_arrays() -> None:
    a, b = _load("mnist"), _load("mnist")
    a.x[0] = 123.0
    assert not np.shares_memory(a.x, b.x) and b.x[0].max() < 10


def test_digits_shape_and_range() -> None:
    ds = _load("digits")
    assert ds.x.shape == (1797, 1, 8, 8) and ds.num_classes == 10
    assert ds.x.min() == 0.0 and ds.x.max() == 1.0
    assert set(np.unique(ds.y)) == set(range(10))


def test_synthetic_shape_standardised_and_seeded() -> None:
    ds = _load("synthetic", {"n_samples": 600, "n_features": 8, "n_informative": 4, "n_classes": 3})
    assert ds.x.shape == (600, 8) and ds.input_shape == (8,) and ds.num_classes == 3
    np.testing.assert_allclose(ds.x.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(ds.x.std(axis=0), 1.0, atol=1e-4)
    assert set(np.unique(ds.y)) == {0, 1, 2}
    same = load_synthetic(SyntheticParams(n_samples=600, n_features=8, n_informative=4, n_classes=3), 0)
    other = load_synthetic(SyntheticParams(n_samples=600, n_features=8, n_informative=4, n_classes=3), 1)
    np.testing.assert_array_equal(ds.x, same.x)
    assert not np.array_equal(ds.x, other.x)


def test_synthetic_defaults() -> None:
    ds = load_synthetic(None, 0)
    assert ds.x.shape == (2000, 20) and ds.num_classes == 4


@pytest.mark.parametrize(
    "params, key",
    [
        ({"n_informative": 30}, "data.params.n_informative"),
        ({"n_classes": 1}, "data.params.n_classes"),
        ({"n_classes": 10, "n_informative": 3}, "data.params.n_informative"),
        ({"n_samples": 5}, "data.params.n_samples"),
        ({"class_sep": 0.0}, "data.params.class_sep"),
        ({"bogus": 1}, "data.params.bogus"),
        ({"n_samples": "many"}, "data.params.n_samples"),
    ],
)
def test_synthetic_bad_params_name_the_key(params: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _load("synthetic", params)


def test_mnist_takes_no_params() -> None:
    with pytest.raises(ConfigError, match="data.params"):
        _load("mnist", {"n_samples": 10})


def test_array_dataset_subset_and_tensors() -> None:
    ds = ArrayDataset(np.arange(12, dtype=np.float64).reshape(6, 2), [0, 1, 2, 0, 1, 2], 3, "toy")
    assert ds.x.dtype == np.float32 and ds.y.dtype == np.int64 and len(ds) == 6
    sub = ds.subset([4, 1])
    np.testing.assert_array_equal(sub.y, [1, 1])
    np.testing.assert_array_equal(sub.x, [[8, 9], [2, 3]])
    assert sub.num_classes == 3 and sub.name == "toy"
    x, y = sub.to_tensors()
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and tuple(x.shape) == (2, 2)


def test_array_dataset_rejects_inconsistent_arrays() -> None:
    with pytest.raises(ValueError):
        ArrayDataset(np.zeros((3, 2)), np.zeros(4), 2, "bad")
    with pytest.raises(ValueError):
        ArrayDataset(np.zeros((3, 2)), np.array([0, 1, 2]), 2, "bad")
