"""Where data comes from: offline datasets, Flower Datasets partitioners, federated client splits.

Importing this package registers the built-in datasets (``mnist``, ``digits``, ``synthetic``,
``stdlib_docs``) and partitioners (``iid``, ``dirichlet``, ``pathological``, ``shard``) in :mod:`fedsim.registry`.
The regime streams (:mod:`envs.streams`: test-time domain streams over the corruptions of
:mod:`envs.corruptions`, and continual-learning task streams) are plain classes.
"""

from envs.corruptions import BENCHMARK_ORDER, CORRUPTIONS, corrupt
from envs.datasets import ArrayDataset, SyntheticParams, load_digits, load_mnist, load_synthetic
from envs.federated import (
    FederatedData,
    as_data_config,
    build_federated_data,
    clear_federated_cache,
    load_dataset,
    load_federated_data_cached,
    partition_pool,
    server_split,
    split_client,
)
from envs.partition import dirichlet, iid, pathological, shard, shard_remainder
from envs.plots import plot_label_histogram
from envs.streams import (
    DomainStream,
    DomainStreamConfig,
    StreamBatch,
    Task,
    TaskStream,
    corrupted_tasks,
    digits01,
    mnist01,
    mnist_normalise,
    permuted,
    split_classes,
)
from envs.glue import GLUE_TASKS, GlueParams, load_glue  # noqa: F401 (registers "glue")
from envs.text import STDLIB_FAMILIES, StdlibDocsParams, load_stdlib_docs, stdlib_docs_texts

__all__ = [
    "ArrayDataset",
    "BENCHMARK_ORDER",
    "CORRUPTIONS",
    "DomainStream",
    "DomainStreamConfig",
    "StreamBatch",
    "Task",
    "TaskStream",
    "corrupt",
    "corrupted_tasks",
    "digits01",
    "mnist01",
    "mnist_normalise",
    "permuted",
    "split_classes",
    "STDLIB_FAMILIES",
    "StdlibDocsParams",
    "FederatedData",
    "SyntheticParams",
    "as_data_config",
    "build_federated_data",
    "clear_federated_cache",
    "dirichlet",
    "iid",
    "load_dataset",
    "load_digits",
    "load_federated_data_cached",
    "load_mnist",
    "load_stdlib_docs",
    "load_synthetic",
    "partition_pool",
    "pathological",
    "plot_label_histogram",
    "server_split",
    "shard",
    "shard_remainder",
    "split_client",
    "stdlib_docs_texts",
]
