"""Turn a registered dataset into federated client data: server test split, partitions, client splits.

:func:`build_federated_data` does, deterministically for a given root seed:

1. load ``data.name`` through :data:`fedsim.registry.DATASETS` (params validated as ``data.params``);
2. hold out a stratified server test split of ``data.test_fraction``
   (seed ``derive_seed(seed, "server_split")``);
3. partition the remaining pool over the clients with ``data.partition.name`` (Flower Datasets'
   partitioners, see :mod:`envs.partition`);
4. split each client's partition into train/test by ``data.client_test_fraction`` with a seeded
   permutation (seed ``derive_seed(seed, "client_split", partition_id)``).

:func:`load_federated_data_cached` memoises the result per process, because every engine worker
asks for the same data.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from envs.datasets import ArrayDataset
from fedsim.config import DataConfig, PartitionConfig
from fedsim.errors import ConfigError
from fedsim.registry import DATASETS, PARTITIONERS
from fedsim.seeding import derive_seed, numpy_rng


@dataclass
class FederatedData:
    """A server test split plus per-client train/test datasets.

    The ``*_index`` fields hold the row indices into the source dataset each split was taken from
    (provenance; all splits are disjoint).  ``unassigned`` counts pool examples the partitioner gave
    to no client (only Flower's shard partitioner does that, by design).
    """

    name: str
    server_test: ArrayDataset
    train: list[ArrayDataset]
    test: list[ArrayDataset]
    num_classes: int
    input_shape: tuple[int, ...]
    server_test_index: np.ndarray
    train_index: list[np.ndarray]
    test_index: list[np.ndarray]
    unassigned: int = 0
    server_val: ArrayDataset | None = None  # held out of the training pool (evaluation.validation_fraction)
    server_val_index: np.ndarray | None = None

    @property
    def num_clients(self) -> int:
        return len(self.train)

    def _check_id(self, partition_id: int) -> int:
        if not 0 <= partition_id < self.num_clients:
            raise IndexError(f"partition_id {partition_id} out of range: there are {self.num_clients} clients")
        return int(partition_id)

    def client_train(self, partition_id: int, server_round: int = 0) -> ArrayDataset:
        """The training data of client ``partition_id`` in ``server_round``.

        ``server_round`` is reserved for task and domain streams whose data changes over rounds; a
        static dataset like this one returns the same data in every round.
        """
        if server_round < 0:
            raise ValueError(f"server_round must be >= 0, got {server_round}")
        return self.train[self._check_id(partition_id)]

    def client_test(self, partition_id: int) -> ArrayDataset:
        """The local evaluation data of client ``partition_id`` (may be empty)."""
        return self.test[self._check_id(partition_id)]

    def label_histogram(self) -> np.ndarray:
        """Counts of each class per client over its train + test data, shape (num_clients, num_classes)."""
        rows = [
            np.bincount(np.concatenate([tr.y, te.y]), minlength=self.num_classes)
            for tr, te in zip(self.train, self.test)
        ]
        return np.stack(rows).astype(np.int64) if rows else np.zeros((0, self.num_classes), dtype=np.int64)

    def summary(self) -> dict[str, Any]:
        """Sizes of every split, as plain Python values."""
        train_sizes = [len(d) for d in self.train]
        test_sizes = [len(d) for d in self.test]
        return {
            "dataset": self.name,
            "num_clients": self.num_clients,
            "num_classes": self.num_classes,
            "input_shape": list(self.input_shape),
            "server_test": len(self.server_test),
            "client_train_total": sum(train_sizes),
            "client_test_total": sum(test_sizes),
            "client_train_min": min(train_sizes),
            "client_train_max": max(train_sizes),
            "client_train_mean": sum(train_sizes) / len(train_sizes),
            "unassigned": self.unassigned,
            "client_train_sizes": train_sizes,
            "client_test_sizes": test_sizes,
        }


def as_data_config(cfg: DataConfig | DictConfig | Mapping[str, Any]) -> DataConfig:
    """Accept a typed :class:`DataConfig`, a DictConfig or a plain mapping; return it typed."""
    if isinstance(cfg, DataConfig):
        return cfg
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), cfg))  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"data: {str(exc).splitlines()[0]}") from None


def load_dataset(cfg: DataConfig, seed: int) -> ArrayDataset:
    """Load ``cfg.name`` through the dataset registry with its validated ``cfg.params``."""
    try:
        loader = DATASETS.get(cfg.name)
    except ConfigError as exc:
        raise ConfigError(f"data.name: {exc}") from None
    params = DATASETS.params(cfg.name, cfg.params, "data.params")
    return loader(params, seed)


def _stratified_holdout(indices: np.ndarray, y: np.ndarray, fraction: float, seed: int, stream: str,
                        key: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Stratified ``(held_out, rest)`` of ``indices`` (labels ``y[indices]``), both sorted.

    ``stream`` names the seed stream; ``key`` and ``what`` name the config key and the split in errors.
    """
    from sklearn.model_selection import train_test_split

    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"{key} must be in (0, 1), got {fraction}")
    try:
        rest, held = train_test_split(indices, test_size=fraction, stratify=y[indices],
                                      random_state=derive_seed(seed, stream) % 2**32)
    except ValueError as exc:
        raise ConfigError(
            f"{key}={fraction}: cannot hold out a stratified {what} of "
            f"{len(indices)} examples ({' '.join(str(exc).split())}); change {key}"
        ) from None
    return np.sort(held), np.sort(rest)


def server_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified ``(server_test_index, pool_index)``, both sorted."""
    return _stratified_holdout(np.arange(len(y)), y, test_fraction, seed, "server_split",
                               "data.test_fraction", "server test split")


def validation_split(y: np.ndarray, pool_idx: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified ``(validation_index, remaining_pool_index)`` carved out of ``pool_idx``, both sorted."""
    return _stratified_holdout(pool_idx, y, fraction, seed, "validation_split",
                               "evaluation.validation_fraction", "validation split")


def partition_pool(labels: np.ndarray, num_clients: int, cfg: PartitionConfig, seed: int) -> list[np.ndarray]:
    """Indices into ``labels`` for each client, from the configured partitioner; none may be empty."""
    try:
        fn = PARTITIONERS.get(cfg.name)
    except ConfigError as exc:
        raise ConfigError(f"data.partition.name: {exc}") from None
    parts = fn(labels, num_clients, cfg, seed)
    for pid, part in enumerate(parts):
        if len(part) == 0:
            raise ConfigError(
                f"data.partition.name={cfg.name!r} gave client {pid} no examples; use fewer clients "
                "or a less skewed partition"
            )
    return parts


def split_client(indices: np.ndarray, test_fraction: float, seed: int, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded ``(train, test)`` split of one client's indices, both sorted.

    A client keeps at least one training example; with ``test_fraction > 0`` and at least two
    examples it also gets at least one test example.
    """
    n = len(indices)
    n_test = 0
    if test_fraction > 0 and n >= 2:
        n_test = min(max(int(round(n * test_fraction)), 1), n - 1)
    perm = numpy_rng(seed, "client_split", partition_id).permutation(np.asarray(indices, dtype=np.int64))
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def build_federated_data(cfg: DataConfig | DictConfig | Mapping[str, Any], num_clients: int, seed: int,
                         validation_fraction: float = 0.0) -> FederatedData:
    """Load, hold out the server test split, partition and split per client (see module doc).

    ``validation_fraction > 0`` first carves a stratified server validation split out of the pool
    (seed ``derive_seed(seed, "validation_split")``); 0 leaves every split as without it.
    """
    cfg = as_data_config(cfg)
    if not 0.0 <= cfg.client_test_fraction < 1.0:
        raise ConfigError(f"data.client_test_fraction must be in [0, 1), got {cfg.client_test_fraction}")
    source = load_dataset(cfg, seed)
    fixed = getattr(source, "test_index", None)  # a predefined test split (e.g. GLUE's dev set)
    if fixed is not None:
        test_idx, pool_idx = np.asarray(fixed, dtype=np.int64), np.setdiff1d(np.arange(len(source)), fixed)
    else:
        test_idx, pool_idx = server_split(source.y, cfg.test_fraction, seed)
    val_idx = None
    if validation_fraction:
        val_idx, pool_idx = validation_split(source.y, pool_idx, validation_fraction, seed)
    parts = partition_pool(source.y[pool_idx], num_clients, cfg.partition, seed)
    splits = [split_client(pool_idx[part], cfg.client_test_fraction, seed, pid) for pid, part in enumerate(parts)]
    return FederatedData(
        name=source.name,
        server_test=source.subset(test_idx),
        train=[source.subset(tr) for tr, _ in splits],
        test=[source.subset(te) for _, te in splits],
        num_classes=source.num_classes,
        input_shape=source.input_shape,
        server_test_index=test_idx,
        train_index=[tr for tr, _ in splits],
        test_index=[te for _, te in splits],
        unassigned=len(pool_idx) - sum(len(p) for p in parts),
        server_val=None if val_idx is None else source.subset(val_idx),
        server_val_index=val_idx,
    )


def _config_key(cfg: DataConfig | DictConfig | Mapping[str, Any]) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(as_data_config(cfg)))


@functools.lru_cache(maxsize=4)
def _build_from_yaml(cfg_yaml: str, num_clients: int, seed: int, validation_fraction: float = 0.0) -> FederatedData:
    return build_federated_data(OmegaConf.create(cfg_yaml), num_clients, seed, validation_fraction)


def load_federated_data_cached(
    cfg: DataConfig | DictConfig | Mapping[str, Any], num_clients: int, seed: int, validation_fraction: float = 0.0
) -> FederatedData:
    """:func:`build_federated_data`, memoised per process on (config YAML, num_clients, seed).

    The returned object is shared between callers: treat it as read-only.
    """
    return _build_from_yaml(_config_key(cfg), int(num_clients), int(seed), float(validation_fraction))


def clear_federated_cache() -> None:
    """Forget every memoised :class:`FederatedData` of this process."""
    _build_from_yaml.cache_clear()
