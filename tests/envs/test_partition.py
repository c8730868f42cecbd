"""Flower Datasets partitioners behind the PARTITIONERS registry."""

from __future__ import annotations

import numpy as np
import pytest

from envs.partition import shard_remainder
from fedsim.config import PartitionConfig
from fedsim.errors import ConfigError
from fedsim.registry import PARTITIONERS

NAMES = ["iid", "dirichlet", "pathological", "shard"]


def _labels(n: int = 2000, classes: int = 10, seed: int = 0) -> np.ndarray:
    """Balanced labels (n / classes each) in random order."""
    return np.random.default_rng(seed).permutation(np.arange(n) % classes)


def _split(name: str, labels: np.ndarray, clients: int, seed: int = 0, **cfg) -> list[np.ndarray]:
    return PARTITIONERS.get(name)(labels, clients, PartitionConfig(name=name, **cfg), seed)


def _tv_to_global(labels: np.ndarray, parts: list[np.ndarray], classes: int) -> float:
    """Mean total-variation distance between each client's label distribution and the pool's."""
    glob = np.bincount(labels, minlength=classes) / len(labels)
    dists = [np.bincount(labels[p], minlength=classes) / len(p) for p in parts]
    return float(np.mean([0.5 * np.abs(d - glob).sum() for d in dists]))


def test_all_four_registered() -> None:
    assert set(NAMES) <= set(PARTITIONERS.names())


@pytest.mark.parametrize("name", ["iid", "dirichlet", "pathological"])
@pytest.mark.parametrize("clients", [7, 30])
def test_partitions_are_disjoint_and_cover_the_pool(name: str, clients: int) -> None:
    labels = _labels(2003)
    parts = _split(name, labels, clients, min_partition_size=5, num_classes_per_partition=4)
    assert len(parts) == clients
    assert all(len(p) > 0 and np.all(np.diff(p) > 0) for p in parts)  # non-empty, sorted, no repeats
    joined = np.concatenate(parts)
    assert len(joined) == len(labels) and len(np.unique(joined)) == len(labels)
    assert joined.min() == 0 and joined.max() == len(labels) - 1


@pytest.mark.parametrize("clients, shards", [(10, 2), (7, 3)])
def test_shard_drops_only_the_stated_remainder(clients: int, shards: int) -> None:
    labels = _labels(2003)
    parts = _split("shard", labels, clients, num_shards_per_partition=shards)
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined)  # disjoint
    assert set(joined.tolist()) <= set(range(len(labels)))  # a subset of the pool
    dropped = len(labels) - len(joined)
    assert dropped == shard_remainder(len(labels), clients, shards) < clients * shards
    size = len(labels) // (clients * shards)
    assert [len(p) for p in parts] == [shards * size] * clients
    # shards are cut from label-sorted data: a shard no bigger than a class spans at most 2 classes
    assert all(len(np.unique(labels[p])) <= 2 * shards for p in parts)


def test_iid_sizes_are_equal_within_one() -> None:
    sizes = [len(p) for p in _split("iid", _labels(2003), 10)]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("clients", [10, 25, 6])
def test_pathological_gives_each_client_k_classes(clients: int) -> None:
    labels = _labels(2000)
    parts = _split("pathological", labels, clients, num_classes_per_partition=5)
    assert all(len(np.unique(labels[p])) == 5 for p in parts)


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_partitions_other_seed_different(name: str) -> None:
    labels = _labels(1500)
    a = _split(name, labels, 10, seed=3)
    b = _split(name, labels, 10, seed=3)
    c = _split(name, labels, 10, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_dirichlet_small_alpha_is_more_skewed() -> None:
    labels = _labels(3000)
    skewed = _tv_to_global(labels, _split("dirichlet", labels, 10, alpha=0.1, min_partition_size=5), 10)
    flat = _tv_to_global(labels, _split("dirichlet", labels, 10, alpha=100.0, min_partition_size=5), 10)
    iid = _tv_to_global(labels, _split("iid", labels, 10), 10)
    assert skewed > 0.5 and flat < 0.1 and iid < 0.1
    assert skewed > flat + 0.4


def test_dirichlet_respects_min_partition_size() -> None:
    parts = _split("dirichlet", _labels(2000), 20, alpha=0.3, min_partition_size=30)
    assert min(len(p) for p in parts) >= 30


@pytest.mark.parametrize("name", NAMES)
def test_more_clients_than_examples(name: str) -> None:
    with pytest.raises(ConfigError, match="num_clients=11 exceeds the 10 examples"):
        _split(name, _labels(10), 11, min_partition_size=1, num_classes_per_partition=1, num_shards_per_partition=1)


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"min_partition_size": 300}, r"data\.partition\.min_partition_size=300 x 10 clients needs 3000"),
        ({"min_partition_size": 0}, r"data\.partition\.min_partition_size must be >= 1"),
        ({"alpha": 0.0}, r"data\.partition\.alpha"),
    ],
)
def test_dirichlet_impossible_requests(cfg: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _split("dirichlet", _labels(2000), 10, **cfg)


def test_dirichlet_retry_failure_becomes_config_error() -> None:
    # possible on paper (20 x 90 <= 2000) but with alpha=0.01 each class lands on ~one client
    with pytest.raises(ConfigError, match=r"data\.partition\.min_partition_size=90: .*11 draws") as info:
        _split("dirichlet", _labels(2000), 20, alpha=0.01, min_partition_size=90)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "clients, k, message",
    [
        (10, 11, r"num_classes_per_partition=11 exceeds the 10 classes"),
        (10, 0, r"num_classes_per_partition must be >= 1"),
        (4, 2, r"num_classes_per_partition=2 with 4 clients leaves some of the 10 classes"),
    ],
)
def test_pathological_impossible_requests(clients: int, k: int, message: str) -> None:
    with pytest.raises(ConfigError, match=r"data\.partition\." + message):
        _split("pathological", _labels(2000), clients, num_classes_per_partition=k)


def test_pathological_class_too_rare_for_its_clients() -> None:
    labels = np.concatenate([_labels(100, classes=3), [3]])  # class 3 has one example
    with pytest.raises(ConfigError, match=r"data\.partition\.num_classes_per_partition=4: Label: 3"):
        _split("pathological", labels, 4, num_classes_per_partition=4)


def test_shard_impossible_request() -> None:
    with pytest.raises(ConfigError, match=r"data\.partition\.num_shards_per_partition=5 x 10 clients"):
        _split("shard", _labels(40), 10, num_shards_per_partition=5)


def test_unknown_partitioner_lists_known() -> None:
    with pytest.raises(ConfigError, match="dirichlet"):
        PARTITIONERS.get("nope")


@pytest.mark.parametrize("clients, k", [(10, 1), (12, 1), (5, 6)])
def test_pathological_uses_every_class(clients: int, k: int) -> None:
    labels = _labels(2000)
    parts = _split("pathological", labels, clients, num_classes_per_partition=k)
    assert sum(len(p) for p in parts) == len(labels)
    assert set(np.concatenate([np.unique(labels[p]) for p in parts]).tolist()) == set(range(10))
