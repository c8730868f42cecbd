"""Where data comes from: offline datasets, Flower Datasets partitioners, federated client splits.

The dataset modules register the built-in datasets (``mnist``, ``digits``, ``synthetic``, ``cifar10``,
``glue``, ``stdlib_docs``) and :mod:`envs.partition` the partitioners (``iid``, ``dirichlet``,
``pathological``, ``shard``) in :mod:`fedsim.registry` when imported; :data:`fedsim.plugins.BUILTINS`
says which module holds which, so importing this package imports none of them.
The regime streams (:mod:`envs.streams`: test-time domain streams over the corruptions of
:mod:`envs.corruptions`, and continual-learning task streams) are plain classes.

The names below are still importable from the package root (``from envs import dirichlet``); each is
imported from its module on first use.
"""

from __future__ import annotations

from fedsim.lazy import lazy_getattr

_EXPORTS: dict[str, tuple[str, ...]] = {
    "envs.corruptions": ("BENCHMARK_ORDER", "CORRUPTIONS", "corrupt"),
    "envs.datasets": ("ArrayDataset", "SyntheticParams", "load_digits", "load_mnist", "load_synthetic"),
    "envs.federated": ("FederatedData", "as_data_config", "build_federated_data", "clear_federated_cache",
                       "load_dataset", "load_federated_data_cached", "partition_pool", "server_split",
                       "split_client"),
    "envs.partition": ("dirichlet", "iid", "pathological", "shard", "shard_remainder"),
    "envs.plots": ("plot_label_histogram",),
    "envs.streams": ("DomainStream", "DomainStreamConfig", "StreamBatch", "Task", "TaskStream", "corrupted_tasks",
                     "digits01", "mnist01", "mnist_normalise", "permuted", "split_classes"),
    "envs.glue": ("GLUE_TASKS", "GlueParams", "load_glue"),
    "envs.text": ("STDLIB_FAMILIES", "StdlibDocsParams", "load_stdlib_docs", "stdlib_docs_texts"),
}
_WHERE: dict[str, str] = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


__getattr__ = lazy_getattr("envs", _WHERE, globals())
