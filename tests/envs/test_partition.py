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


# ------------------------------------------------------------------ issue #27: the other partitioners

ALL = ["iid", "dirichlet", "inner_dirichlet", "pathological", "shard", "linear", "square", "exponential", "size",
       "distribution"]
EVEN = {"size": {"partition_sizes": [200] * 10}, "distribution": {"distribution_array": np.ones((10, 2)).tolist()}}


def test_every_partitioner_is_registered() -> None:
    from envs.partition import USES

    assert set(ALL) == set(USES) and set(ALL) <= set(PARTITIONERS.names())


@pytest.mark.parametrize("name", ["inner_dirichlet", "linear", "square", "size", "distribution"])
def test_new_partitions_are_disjoint_and_cover_the_pool(name: str) -> None:
    labels = _labels(2000)
    parts = _split(name, labels, 10, **EVEN.get(name, {}))
    assert len(parts) == 10 and all(len(p) > 0 and np.all(np.diff(p) > 0) for p in parts)
    joined = np.concatenate(parts)
    assert np.array_equal(np.sort(joined), np.arange(len(labels)))


@pytest.mark.parametrize("name", ALL[5:])
def test_new_same_seed_same_partitions_other_seed_different(name: str) -> None:
    labels, clients = _labels(1500), 5 if name == "exponential" else 10
    cfg = {"size": {"partition_sizes": [150] * 10}, "distribution": EVEN["distribution"]}.get(name, {})
    a, b, c = (_split(name, labels, clients, seed=s, **cfg) for s in (3, 3, 4))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_inner_dirichlet_same_seed_same_partitions_other_seed_different() -> None:
    labels = _labels(1500)
    a, b, c = (_split("inner_dirichlet", labels, 10, seed=s) for s in (3, 3, 4))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("law, f", [("linear", lambda x: x), ("square", np.square), ("exponential", np.exp)])
@pytest.mark.parametrize("n, clients", [(2003, 7), (1000, 5)])
def test_size_laws_follow_flowers_definition(law: str, f, n: int, clients: int) -> None:
    """Client i gets floor(n * f(i+1) / sum f), the last one also the floors' remainder: Flower's own sizes."""
    from datasets import Dataset
    import flwr_datasets.partitioner as fp

    from envs.partition import law_sizes

    units = f(np.arange(1, clients + 1, dtype=float))
    expected = np.floor(n * units / units.sum()).astype(int)
    expected[-1] += n - expected.sum()
    sizes = [len(p) for p in _split(law, _labels(n), clients)]
    assert sizes == expected.tolist() == law_sizes(law, n, clients).tolist()
    flower = getattr(fp, f"{law.capitalize()}Partitioner")(num_partitions=clients)
    flower.dataset = Dataset.from_dict({"label": _labels(n)})
    assert sizes == [flower.load_partition(i).num_rows for i in range(clients)]
    assert sizes == sorted(sizes)  # growing with the client id


def test_exponential_with_too_many_clients_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"data\.partition\.name=exponential: with 10 clients .* gets no data") as e:
        _split("exponential", _labels(2000), 10)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("law", ["equal", "linear", "square"])
def test_inner_dirichlet_sizes_follow_the_size_law(law: str) -> None:
    from envs.partition import law_sizes

    parts = _split("inner_dirichlet", _labels(2003), 10, size_law=law)
    assert [len(p) for p in parts] == law_sizes(law, 2003, 10).tolist()


def test_inner_dirichlet_explicit_sizes_and_skew() -> None:
    labels = _labels(2000)
    sizes = [100, 300] * 5
    assert [len(p) for p in _split("inner_dirichlet", labels, 10, partition_sizes=sizes)] == sizes
    skewed = _tv_to_global(labels, _split("inner_dirichlet", labels, 10, alpha=0.1), 10)
    flat = _tv_to_global(labels, _split("inner_dirichlet", labels, 10, alpha=100.0), 10)
    assert skewed > flat + 0.3


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"partition_sizes": [100] * 10}, r"partition_sizes: the sizes sum to 1000 but must sum to the 2000 examples"),
        ({"partition_sizes": [200] * 9}, r"partition_sizes: 9 sizes for num_clients=10"),
        ({"alpha": 0.0}, r"data\.partition\.alpha must be > 0"),
        ({"size_law": "exponential"}, r"data\.partition\.size_law=exponential: with 10 clients"),
    ],
)
def test_inner_dirichlet_impossible_requests(cfg: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _split("inner_dirichlet", _labels(2000), 10, **cfg)


def test_size_takes_the_given_sizes_and_leaves_the_rest() -> None:
    labels = _labels(2000)
    sizes = [50, 100, 150, 200, 250]
    parts = _split("size", labels, 5, partition_sizes=sizes)
    assert [len(p) for p in parts] == sizes
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined) == 750 and joined.max() < len(labels)


@pytest.mark.parametrize(
    "sizes, message",
    [
        ([1500, 600], r"partition_sizes: the sizes sum to 2100 but must sum to at most the 2000 examples"),
        ([100], r"partition_sizes: 1 sizes for num_clients=2"),
        ([100, 0], r"every size must be >= 1"),
        (None, r"data\.partition\.partition_sizes: partitioner 'size' needs it"),
    ],
)
def test_size_impossible_requests(sizes, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _split("size", _labels(2000), 2, partition_sizes=sizes)


def test_distribution_gives_each_client_k_consecutive_classes() -> None:
    labels = _labels(2000)
    parts = _split("distribution", labels, 20, num_classes_per_partition=3,
                   distribution_array=np.arange(1, 61, dtype=float).reshape(10, 6).tolist())
    for pid, p in enumerate(parts):
        assert set(np.unique(labels[p]).tolist()) == {(pid + j) % 10 for j in range(3)}
    assert len(np.concatenate(parts)) == len(labels)  # rescale: every example is dealt out


def test_distribution_without_rescale_deals_the_counts() -> None:
    labels = _labels(2000)
    parts = _split("distribution", labels, 10, rescale=False, distribution_array=[[30, 50]] * 10)
    # client i holds classes i, i+1: the 30 of class i+1's first bucket, the 50 of class i's second
    assert [len(p) for p in parts] == [60] + [80] * 8 + [100]
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == 800 and np.array_equal(np.bincount(labels[joined]), [80] * 10)


@pytest.mark.parametrize(
    "clients, cfg, message",
    [
        (7, {"distribution_array": [[1.0]] * 10}, r"num_clients=7: partitioner 'distribution' needs a multiple of the 10"),
        (10, {"distribution_array": [[1.0]] * 10}, r"distribution_array: shape \(10, 1\) .* 10 rows of 2 values"),
        (10, {"distribution_array": [[1.0, -1.0]] * 10}, r"distribution_array: values must be finite and >= 0"),
        (10, {"distribution_array": [[1.0, 1.0]] * 10, "preassigned_num_samples_per_label": 150},
         r"data\.partition\.preassigned_num_samples_per_label: Flower's DistributionPartitioner refused"),
        (10, {}, r"data\.partition\.distribution_array: partitioner 'distribution' needs it"),
    ],
)
def test_distribution_impossible_requests(clients: int, cfg: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        _split("distribution", _labels(2000), clients, **cfg)
    assert "\n" not in str(e.value)
