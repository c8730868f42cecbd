"""Label-distribution sets: valid distributions, seeded, exact labelled ratios, labelled rows on few nodes."""

from __future__ import annotations

import numpy as np
import pytest

from envs.ldl import (ImageLDLParams, TabularLDLParams, distributions, federated_ldl, image_ldl, labelled_count,
                      split_ldl, tabular_ldl)
from fedsim.errors import ConfigError

SMALL = TabularLDLParams(n_samples=400, n_features=6, n_labels=7, n_clusters=3)


@pytest.fixture(scope="module")
def digits():
    return image_ldl(ImageLDLParams(), seed=0)


def _valid(d: np.ndarray) -> None:
    assert d.dtype == np.float32 and np.isfinite(d).all() and (d > 0).all()
    np.testing.assert_allclose(d.sum(axis=1), 1.0, atol=1e-5)


def test_image_set_is_a_valid_seeded_ldl_set_of_every_image(digits) -> None:
    assert digits.x.shape == (1797, 1, 8, 8) and digits.d.shape == (1797, 10)
    _valid(digits.d)
    again = image_ldl(ImageLDLParams(), seed=0)
    np.testing.assert_array_equal(again.d, digits.d)
    other = image_ldl(ImageLDLParams(), seed=1)
    assert not np.array_equal(other.d, digits.d)
    from envs.datasets import load_digits

    # the teacher is good: the peak label is mostly the digit, yet the other labels carry real mass
    assert (digits.peak == load_digits(None, 0).y).mean() > 0.85
    assert 0.3 < digits.d.max(axis=1).mean() < 0.7


def test_temperature_flattens_and_jitter_is_the_only_noise(digits) -> None:
    flat = image_ldl(ImageLDLParams(temperature=3.0), seed=0)
    assert flat.d.max(axis=1).mean() < digits.d.max(axis=1).mean()
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(5, 4))
    clean = distributions(scores, 1.0, 0.0, np.random.default_rng(1))
    np.testing.assert_allclose(clean, distributions(scores, 1.0, 0.0, np.random.default_rng(2)))
    assert (np.argsort(clean, 1) == np.argsort(scores, 1)).all()  # no jitter: the teacher's order exactly


def test_tabular_set_has_c_labels_and_reproduces() -> None:
    a = tabular_ldl(SMALL, seed=3)
    assert a.x.shape == (400, 6) and a.num_labels == 7
    _valid(a.d)
    np.testing.assert_array_equal(a.d, tabular_ldl(SMALL, seed=3).d)
    assert not np.array_equal(a.d, tabular_ldl(SMALL, seed=4).d)
    np.testing.assert_allclose(a.x.mean(0), 0, atol=1e-5)


@pytest.mark.parametrize("ratio", [0.05, 0.1, 0.2])
def test_labelled_ratio_is_exact_and_split_is_disjoint(digits, ratio) -> None:
    s = split_ldl(digits, ratio, 0.25, seed=0)
    n_train = 1797 - len(s.test)
    assert len(s.test) == round(0.25 * 1797)
    assert len(s.labelled) == labelled_count(n_train, ratio) == round(ratio * n_train)
    everything = np.concatenate([s.test, s.labelled, s.unlabelled])
    assert len(everything) == 1797 and len(np.unique(everything)) == 1797
    again = split_ldl(digits, ratio, 0.25, seed=0)
    np.testing.assert_array_equal(again.labelled, s.labelled)
    # stratified by peak label: every peak label is among the labelled rows
    assert len(np.unique(digits.peak[s.labelled])) == 10


def test_federated_split_puts_labelled_rows_on_few_nodes_only(digits) -> None:
    s = split_ldl(digits, 0.1, 0.25, seed=0)
    nodes = federated_ldl(digits, s, num_clients=6, labelled_clients=2, alpha=0.3, min_unlabelled=10, seed=0)
    assert [len(n.labelled) > 0 for n in nodes] == [True, True, False, False, False, False]
    np.testing.assert_array_equal(np.sort(np.concatenate([n.labelled for n in nodes])), s.labelled)
    np.testing.assert_array_equal(np.sort(np.concatenate([n.unlabelled for n in nodes])), s.unlabelled)
    assert min(len(n.unlabelled) for n in nodes) >= 10
    # non-IID: the nodes' peak-label mixes differ far more than IID shares would
    hist = np.stack([np.bincount(digits.peak[n.unlabelled], minlength=10) / len(n.unlabelled) for n in nodes])
    assert np.abs(hist - hist.mean(0)).max() > 0.2
    (one,) = federated_ldl(digits, s, 1, 2, 0.3, 10, 0)
    np.testing.assert_array_equal(one.labelled, s.labelled)


def test_bad_settings_are_config_errors(digits) -> None:
    with pytest.raises(ConfigError, match="labelled_ratio"):
        split_ldl(digits, 0.0, 0.25, 0)
    with pytest.raises(ConfigError, match="source"):
        image_ldl(ImageLDLParams(source="cifar"))
    with pytest.raises(ConfigError, match="n_labels"):
        tabular_ldl(TabularLDLParams(n_labels=1))
    s = split_ldl(digits, 0.05, 0.25, 0)
    with pytest.raises(ConfigError, match="labelled clients"):
        federated_ldl(digits, s, 200, 100, 0.5, 1, 0)


def test_validation_hold_out_is_disjoint_and_absent_by_default(digits) -> None:
    plain = split_ldl(digits, 0.1, 0.25, seed=0)
    assert len(plain.val) == 0
    s = split_ldl(digits, 0.1, 0.25, seed=0, val_fraction=0.1)
    np.testing.assert_array_equal(s.test, plain.test)  # the test rows do not move
    assert len(s.val) == round(0.1 * (1797 - len(s.test)))
    everything = np.concatenate([s.test, s.val, s.labelled, s.unlabelled])
    assert len(everything) == 1797 and len(np.unique(everything)) == 1797
    with pytest.raises(ConfigError, match="validation_fraction"):
        split_ldl(digits, 0.1, 0.25, seed=0, val_fraction=1.0)
