"""build_federated_data: server split, partitions, client splits, caching."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from envs.datasets import load_digits
from envs.federated import (
    FederatedData,
    build_federated_data,
    load_federated_data_cached,
    split_client,
)
from fedsim.config import DataConfig, PartitionConfig
from fedsim.errors import ConfigError


def _digits_cfg(**partition) -> DataConfig:
    return DataConfig(name="digits", test_fraction=0.2, client_test_fraction=0.25,
                      partition=PartitionConfig(**{"name": "dirichlet", "alpha": 0.5, "min_partition_size": 10,
                                                   **partition}))


@pytest.fixture(scope="module")
def digits_fd() -> FederatedData:
    return build_federated_data(_digits_cfg(), 8, seed=5)


def _all_indices(fd: FederatedData) -> np.ndarray:
    return np.concatenate([fd.server_test_index, *fd.train_index, *fd.test_index])


def test_splits_are_disjoint_and_cover_the_dataset(digits_fd: FederatedData) -> None:
    idx = _all_indices(digits_fd)
    assert len(idx) == 1797 and len(np.unique(idx)) == 1797
    assert digits_fd.unassigned == 0


def test_split_data_matches_its_indices(digits_fd: FederatedData) -> None:
    source = load_digits(None, 0)
    np.testing.assert_array_equal(digits_fd.server_test.x, source.x[digits_fd.server_test_index])
    for pid in range(digits_fd.num_clients):
        np.testing.assert_array_equal(digits_fd.client_train(pid).y, source.y[digits_fd.train_index[pid]])
        np.testing.assert_array_equal(digits_fd.client_test(pid).x, source.x[digits_fd.test_index[pid]])


def test_server_split_is_stratified(digits_fd: FederatedData) -> None:
    full = np.bincount(load_digits(None, 0).y, minlength=10)
    held = np.bincount(digits_fd.server_test.y, minlength=10)
    assert held.sum() == pytest.approx(0.2 * 1797, abs=1)
    assert np.all(np.abs(held - 0.2 * full) <= 1.0)


def test_shapes_and_counts(digits_fd: FederatedData) -> None:
    fd = digits_fd
    assert fd.num_clients == 8 and fd.num_classes == 10 and fd.input_shape == (1, 8, 8)
    s = fd.summary()
    assert s["server_test"] + s["client_train_total"] + s["client_test_total"] == 1797
    assert s["client_train_sizes"] == [len(fd.client_train(p)) for p in range(8)]
    assert s["client_train_min"] >= 1 and s["dataset"] == "digits"


def test_client_test_fraction_is_applied(digits_fd: FederatedData) -> None:
    for pid in range(digits_fd.num_clients):
        n_train, n_test = len(digits_fd.client_train(pid)), len(digits_fd.client_test(pid))
        assert abs(n_test - 0.25 * (n_train + n_test)) <= 1


def test_label_histogram_rows_are_client_sizes(digits_fd: FederatedData) -> None:
    hist = digits_fd.label_histogram()
    assert hist.shape == (8, 10)
    sizes = [len(digits_fd.client_train(p)) + len(digits_fd.client_test(p)) for p in range(8)]
    assert hist.sum(axis=1).tolist() == sizes
    expected0 = np.bincount(np.concatenate([digits_fd.train[0].y, digits_fd.test[0].y]), minlength=10)
    np.testing.assert_array_equal(hist[0], expected0)


def test_round_argument_is_ignored_for_static_data(digits_fd: FederatedData) -> None:
    assert digits_fd.client_train(3, server_round=7) is digits_fd.client_train(3)
    with pytest.raises(IndexError):
        digits_fd.client_train(8)


def test_same_seed_same_data_other_seed_different(digits_fd: FederatedData) -> None:
    again = build_federated_data(_digits_cfg(), 8, seed=5)
    other = build_federated_data(_digits_cfg(), 8, seed=6)
    np.testing.assert_array_equal(again.server_test_index, digits_fd.server_test_index)
    for a, b in zip(again.train_index, digits_fd.train_index):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(again.client_train(2).x, digits_fd.client_train(2).x)
    assert not np.array_equal(other.server_test_index, digits_fd.server_test_index)
    assert not all(np.array_equal(a, b) for a, b in zip(other.train_index, digits_fd.train_index))


def test_no_client_test_split() -> None:
    fd = build_federated_data(DataConfig(name="digits", client_test_fraction=0.0,
                                         partition=PartitionConfig(name="iid")), 5, 0)
    assert fd.summary()["client_test_total"] == 0
    assert all(len(fd.client_test(p)) == 0 for p in range(5))


def test_shard_reports_unassigned_examples() -> None:
    fd = build_federated_data(DataConfig(name="digits", partition=PartitionConfig(name="shard")), 10, 0)
    pool = 1797 - len(fd.server_test)
    assert fd.unassigned == pool % 20 and fd.unassigned > 0
    assert len(_all_indices(fd)) == 1797 - fd.unassigned


@pytest.mark.parametrize(
    "n, fraction, expected",
    [(1, 0.2, (1, 0)), (2, 0.2, (1, 1)), (3, 0.9, (1, 2)), (10, 0.2, (8, 2)), (5, 0.0, (5, 0))],
)
def test_split_client_sizes(n: int, fraction: float, expected: tuple[int, int]) -> None:
    indices = np.arange(100, 100 + n)
    train, test = split_client(indices, fraction, seed=0, partition_id=0)
    assert (len(train), len(test)) == expected
    assert sorted(np.concatenate([train, test]).tolist()) == indices.tolist()


def test_split_client_is_seeded() -> None:
    idx = np.arange(50)
    a = split_client(idx, 0.3, seed=1, partition_id=2)
    b = split_client(idx, 0.3, seed=1, partition_id=2)
    c = split_client(idx, 0.3, seed=1, partition_id=3)
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[1], c[1])


def test_mnist_default_config_builds() -> None:
    fd = build_federated_data(DataConfig(), 10, 0)
    assert fd.input_shape == (1, 28, 28) and len(fd.server_test) == 1000
    assert np.bincount(fd.server_test.y).tolist() == [100] * 10
    assert fd.summary()["client_train_total"] + fd.summary()["client_test_total"] == 4000


def test_cached_loader_returns_the_same_object() -> None:
    a = load_federated_data_cached(_digits_cfg(), 4, 0)
    b = load_federated_data_cached(OmegaConf.structured(_digits_cfg()), 4, 0)
    c = load_federated_data_cached(_digits_cfg(), 4, 1)
    d = load_federated_data_cached(_digits_cfg(alpha=5.0), 4, 0)
    assert a is b and a is not c and a is not d
    assert a.summary()["num_clients"] == 4


@pytest.mark.parametrize(
    "cfg, clients, message",
    [
        (DataConfig(name="imagenet"), 4, r"data\.name: unknown dataset 'imagenet'"),
        (DataConfig(name="digits", partition=PartitionConfig(name="zipf")), 4, r"data\.partition\.name"),
        (DataConfig(name="synthetic", params={"n_featurez": 3}), 4, r"data\.params\.n_featurez"),
        (DataConfig(name="digits", test_fraction=0.001), 4, r"data\.test_fraction=0\.001"),
        (DataConfig(name="digits", test_fraction=1.5), 4, r"data\.test_fraction must be in"),
        (DataConfig(name="digits", client_test_fraction=1.0), 4, r"data\.client_test_fraction"),
        (DataConfig(name="digits", partition=PartitionConfig(name="iid")), 2000, r"num_clients=2000 exceeds"),
        (DataConfig(name="digits", partition=PartitionConfig(min_partition_size=100)), 20,
         r"data\.partition\.min_partition_size=100"),
    ],
)
def test_bad_configs_raise_one_line_config_errors(cfg: DataConfig, clients: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        build_federated_data(cfg, clients, 0)
    assert "\n" not in str(info.value)
