"""Split a label vector over clients with Flower Datasets' partitioners.

The four partitioners are registered under :data:`fedsim.registry.PARTITIONERS` as functions
``fn(labels, num_partitions, cfg, seed) -> list[np.ndarray]`` returning, per client, the sorted row
indices into ``labels``.  The partitioning itself is Flower Datasets' (flwr-datasets 0.6.1):

* ``iid``: :class:`IidPartitioner` (contiguous, equal-size shards of the shuffled pool).
* ``dirichlet``: :class:`DirichletPartitioner` (label skew; smaller ``alpha`` = more skew).
* ``pathological``: :class:`PathologicalPartitioner` (each client sees a fixed number of classes).
* ``shard``: :class:`ShardPartitioner` (McMahan et al.'s sorted-by-label shards).

How it works: the labels become a tiny Hugging Face ``datasets.Dataset`` with an ``index``
column, shuffled by a seeded permutation first (as ``FederatedDataset`` does), handed to the
partitioner, and each partition's ``index`` column is read back.  Seeds come from
``derive_seed(seed, "partition")``.

Partitions are disjoint and cover the pool exactly, except for ``shard``: Flower's
ShardPartitioner uses ``num_clients * num_shards_per_partition`` shards of equal size
``N // (num_clients * num_shards_per_partition)`` and drops the rest by design, so
:func:`shard_remainder` (= ``N mod (num_clients * num_shards_per_partition)``) examples go to no
client.  Impossible requests raise a one-line :class:`~fedsim.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from fedsim.config import PartitionConfig
from fedsim.errors import ConfigError
from fedsim.registry import PARTITIONERS
from fedsim.seeding import derive_seed, numpy_rng

LABEL = "label"
INDEX = "index"


def _flower_seed(seed: int) -> int:
    """Flower's partitioners take seeds below 2**32."""
    return derive_seed(seed, "partition") % 2**32


def _check_pool(labels: np.ndarray, num_partitions: int) -> tuple[np.ndarray, int]:
    """Validate the label vector and client count; return them as an int64 array and an int."""
    labels, num_partitions = np.asarray(labels), int(num_partitions)
    if labels.ndim != 1 or (labels.size and not np.issubdtype(labels.dtype, np.integer)):
        raise ValueError(f"labels must be a 1-D integer array, got shape {labels.shape} dtype {labels.dtype}")
    if num_partitions < 1:
        raise ConfigError(f"num_clients must be >= 1, got {num_partitions}")
    if num_partitions > len(labels):
        raise ConfigError(
            f"num_clients={num_partitions} exceeds the {len(labels)} examples in the training pool; "
            "lower num_clients or data.test_fraction"
        )
    return labels.astype(np.int64), num_partitions


def _read_partitions(partitioner: Any, labels: np.ndarray, num_partitions: int, seed: int) -> list[np.ndarray]:
    """Give ``partitioner`` a seeded shuffle of the pool and read back each partition's row indices."""
    from datasets import Dataset

    order = numpy_rng(seed, "partition", "order").permutation(len(labels))
    partitioner.dataset = Dataset.from_dict({LABEL: labels[order], INDEX: order})
    parts = []
    for pid in range(num_partitions):
        rows = partitioner.load_partition(pid).with_format("numpy")[:][INDEX]
        parts.append(np.sort(np.asarray(rows, dtype=np.int64)))
    return parts


def _flower_reason(exc: Exception) -> str:
    """The first sentence of a Flower Datasets error, for a one-line message."""
    text = " ".join(str(exc).split())
    return text.split(" Please")[0].rstrip(". ")


# ----------------------------------------------------------------------------------------- iid


@PARTITIONERS.register("iid", summary="Flower's IidPartitioner: equal-size random partitions")
def iid(labels: np.ndarray, num_partitions: int, cfg: PartitionConfig, seed: int) -> list[np.ndarray]:
    """Equal-size (within one example) uniformly random partitions."""
    from flwr_datasets.partitioner import IidPartitioner

    labels, num_partitions = _check_pool(labels, num_partitions)
    return _read_partitions(IidPartitioner(num_partitions=num_partitions), labels, num_partitions, seed)


# ----------------------------------------------------------------------------------- dirichlet


def _check_dirichlet(n: int, num_partitions: int, cfg: PartitionConfig) -> None:
    m = cfg.min_partition_size
    if cfg.alpha <= 0:
        raise ConfigError(f"data.partition.alpha must be > 0, got {cfg.alpha}")
    if m < 1:
        raise ConfigError(f"data.partition.min_partition_size must be >= 1 (every client needs data), got {m}")
    if m * num_partitions > n:
        raise ConfigError(
            f"data.partition.min_partition_size={m} x {num_partitions} clients needs {m * num_partitions} "
            f"examples but the training pool has {n}; set it to at most {n // num_partitions} or use fewer clients"
        )


@PARTITIONERS.register("dirichlet", summary="Flower's DirichletPartitioner: label skew set by alpha")
def dirichlet(labels: np.ndarray, num_partitions: int, cfg: PartitionConfig, seed: int) -> list[np.ndarray]:
    """Per-class Dirichlet(alpha) proportions, redrawn (up to 10 times) until min_partition_size holds."""
    from flwr_datasets.partitioner import DirichletPartitioner

    labels, num_partitions = _check_pool(labels, num_partitions)
    _check_dirichlet(len(labels), num_partitions, cfg)
    partitioner = DirichletPartitioner(
        num_partitions=num_partitions,
        partition_by=LABEL,
        alpha=float(cfg.alpha),
        min_partition_size=int(cfg.min_partition_size),
        self_balancing=bool(cfg.self_balancing),
        shuffle=False,
        seed=_flower_seed(seed),
    )
    try:
        with warnings.catch_warnings():  # Flower warns on every redraw; the outcome is what matters
            warnings.simplefilter("ignore", UserWarning)
            return _read_partitions(partitioner, labels, num_partitions, seed)
    except ValueError as exc:
        if "attempts" not in str(exc):
            raise ConfigError(f"data.partition: Flower's DirichletPartitioner refused: {_flower_reason(exc)}") from None
        raise ConfigError(
            f"data.partition.min_partition_size={cfg.min_partition_size}: Flower's DirichletPartitioner left some "
            f"client below it in 11 draws (alpha={cfg.alpha}, {num_partitions} clients, {len(labels)} examples); "
            "lower data.partition.min_partition_size, raise data.partition.alpha or use fewer clients"
        ) from None


# -------------------------------------------------------------------------------- pathological


def _pathological_mode(num_classes: int, num_partitions: int, k: int) -> str:
    """Flower's class-assignment mode that gives every class to some client, or a ConfigError.

    With at least as many clients as classes, ``first-deterministic`` gives client ``i`` class
    ``i mod C`` plus ``k - 1`` random others.  With fewer, ``deterministic`` gives client ``i`` the
    classes ``i .. i+k-1 (mod C)``, which covers all classes only when ``num_clients + k - 1 >= C``.
    """
    key = "data.partition.num_classes_per_partition"
    if k < 1:
        raise ConfigError(f"{key} must be >= 1, got {k}")
    if k > num_classes:
        raise ConfigError(f"{key}={k} exceeds the {num_classes} classes in the training pool; use at most {num_classes}")
    if num_partitions >= num_classes:
        return "first-deterministic"
    if num_partitions + k - 1 < num_classes:
        raise ConfigError(
            f"{key}={k} with {num_partitions} clients leaves some of the {num_classes} classes to no client; "
            f"set it to at least {num_classes - num_partitions + 1} or use at least {num_classes} clients"
        )
    return "deterministic"


@PARTITIONERS.register("pathological", summary="Flower's PathologicalPartitioner: k classes per client")
def pathological(labels: np.ndarray, num_partitions: int, cfg: PartitionConfig, seed: int) -> list[np.ndarray]:
    """Each client holds exactly ``num_classes_per_partition`` classes; every class is used."""
    from flwr_datasets.partitioner import PathologicalPartitioner

    labels, num_partitions = _check_pool(labels, num_partitions)
    k = int(cfg.num_classes_per_partition)
    mode = _pathological_mode(len(np.unique(labels)), num_partitions, k)
    partitioner = PathologicalPartitioner(
        num_partitions=num_partitions,
        partition_by=LABEL,
        num_classes_per_partition=k,
        class_assignment_mode=mode,  # type: ignore[arg-type]
        shuffle=False,
        seed=_flower_seed(seed),
    )
    try:
        return _read_partitions(partitioner, labels, num_partitions, seed)
    except ValueError as exc:
        raise ConfigError(
            f"data.partition.num_classes_per_partition={k}: {_flower_reason(exc)}; "
            "lower num_classes_per_partition or num_clients"
        ) from None


# ---------------------------------------------------------------------------------------- shard


def shard_remainder(n: int, num_partitions: int, num_shards_per_partition: int) -> int:
    """How many of ``n`` examples Flower's ShardPartitioner leaves unassigned (by design)."""
    return n % (num_partitions * num_shards_per_partition)


@PARTITIONERS.register("shard", summary="Flower's ShardPartitioner: label-sorted shards per client")
def shard(labels: np.ndarray, num_partitions: int, cfg: PartitionConfig, seed: int) -> list[np.ndarray]:
    """Sort by label, cut equal shards, give each client ``num_shards_per_partition`` random shards.

    :func:`shard_remainder` examples are left unassigned (Flower drops the incomplete remainder).
    """
    from flwr_datasets.partitioner import ShardPartitioner

    labels, num_partitions = _check_pool(labels, num_partitions)
    s = int(cfg.num_shards_per_partition)
    key = "data.partition.num_shards_per_partition"
    if s < 1:
        raise ConfigError(f"{key} must be >= 1, got {s}")
    if s * num_partitions > len(labels):
        raise ConfigError(
            f"{key}={s} x {num_partitions} clients needs at least {s * num_partitions} examples (one per shard) "
            f"but the training pool has {len(labels)}; lower {key} or num_clients"
        )
    partitioner = ShardPartitioner(
        num_partitions=num_partitions,
        partition_by=LABEL,
        num_shards_per_partition=s,
        shuffle=False,
        seed=_flower_seed(seed),
    )
    try:
        with warnings.catch_warnings():  # pyarrow deprecation noise from Flower's dataset.sort
            warnings.simplefilter("ignore", FutureWarning)
            return _read_partitions(partitioner, labels, num_partitions, seed)
    except ValueError as exc:
        raise ConfigError(f"{key}={s}: {_flower_reason(exc)}; lower {key} or num_clients") from None
