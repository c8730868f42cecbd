"""Split a label vector over clients with Flower Datasets' partitioners.

Every partitioner is registered under :data:`fedsim.registry.PARTITIONERS` as a function
``fn(labels, num_partitions, cfg, seed) -> list[np.ndarray]`` returning, per client, the sorted row
indices into ``labels``.  The partitioning itself is Flower Datasets' (flwr-datasets 0.6.1):

==================  ==============================  ==================================================
name                Flower Datasets class           parameters (``data.partition.*``, default)
==================  ==============================  ==================================================
``iid``             IidPartitioner                  none: equal sizes (within one example)
``dirichlet``       DirichletPartitioner            ``alpha`` (0.5), ``min_partition_size`` (10),
                                                    ``self_balancing`` (false)
``inner_dirichlet`` InnerDirichletPartitioner       ``alpha`` (0.5); the client sizes: ``size_law``
                                                    (equal | linear | square | exponential, default
                                                    equal) or an explicit ``partition_sizes`` list
                                                    summing to the pool
``pathological``    PathologicalPartitioner         ``num_classes_per_partition`` (2)
``shard``           ShardPartitioner                ``num_shards_per_partition`` (2)
``linear``          LinearPartitioner               none: client ``i`` gets a share ∝ ``i + 1``
``square``          SquarePartitioner               none: share ∝ ``(i + 1)**2``
``exponential``     ExponentialPartitioner          none: share ∝ ``e**(i + 1)``
``size``            SizePartitioner                 ``partition_sizes`` (required, one per client)
``distribution``    DistributionPartitioner         ``distribution_array`` (required),
                                                    ``num_classes_per_partition`` (2),
                                                    ``preassigned_num_samples_per_label`` (0),
                                                    ``rescale`` (true)
==================  ==============================  ==================================================

Each function declares (:data:`USES`) the :class:`~fedsim.config.PartitionConfig` fields it reads
and its default for each (None: required); a field left None takes that default.  The config check
(:func:`fedsim.config.validate_partition`) rejects a set field that the chosen partitioner does not
use, from the import-cheap copy :data:`fedsim.config.PARTITION_PARAMS` (a test keeps the two equal).

Sizes (linear, square, exponential, and ``size_law`` for inner_dirichlet) follow Flower's
``IdToSizeFncPartitioner``: client ``i`` (0-based) gets ``floor(n * f(i + 1) / sum_j f(j + 1))``
examples and the last client also gets what the floors leave (:func:`law_sizes`).

Left out, because they do not split a labelled pool into N clients: ``NaturalIdPartitioner`` and
``GroupedNaturalIdPartitioner`` (they need a natural-id column, e.g. a writer id, which fedsim's
datasets do not carry), ``ContinuousPartitioner`` (it sorts by a real-valued feature, not a class
label), ``VerticalEvenPartitioner`` and ``VerticalSizePartitioner`` (they split columns, i.e.
features, not rows), and the bases ``Partitioner`` and ``IdToSizeFncPartitioner`` (the latter takes a
Python function; its instances linear, square and exponential are registered).

How it works: the labels become a tiny Hugging Face ``datasets.Dataset`` with an ``index``
column, shuffled by a seeded permutation first (as ``FederatedDataset`` does), handed to the
partitioner, and each partition's ``index`` column is read back.  Seeds come from
``derive_seed(seed, "partition")``.

Partitions are disjoint and cover the pool exactly, except: ``shard`` (Flower's ShardPartitioner
uses ``num_clients * num_shards_per_partition`` shards of equal size
``N // (num_clients * num_shards_per_partition)`` and drops the rest by design, so
:func:`shard_remainder` (= ``N mod (num_clients * num_shards_per_partition)``) examples go to no
client); ``size`` with ``partition_sizes`` summing to less than the pool (the rest go to no client);
and ``distribution`` with ``rescale: false`` (only the array's counts are dealt out).  Impossible
requests raise a one-line :class:`~fedsim.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np

from fedsim.config import PartitionConfig
from fedsim.errors import ConfigError
from fedsim.registry import PARTITIONERS
from fedsim.seeding import derive_seed, numpy_rng

LABEL = "label"
INDEX = "index"

#: Per registered partitioner, the PartitionConfig fields it reads and its default for each (None: required).
USES: dict[str, dict[str, Any]] = {}


def _partitioner(name: str, summary: str, **defaults: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` under ``name`` and record the fields it uses (with their defaults)."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        USES[name] = dict(defaults)
        return PARTITIONERS.register(name, summary=summary)(fn)

    return deco


def _param(cfg: PartitionConfig, name: str, key: str) -> Any:
    """``cfg.key``, or partitioner ``name``'s default for it when None; a missing required one is an error."""
    value = getattr(cfg, key)
    if value is None:
        value = USES[name][key]
    if value is None:
        raise ConfigError(f"data.partition.{key}: partitioner {name!r} needs it (it has no default); set it")
    return value


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


@_partitioner("iid", "Flower's IidPartitioner: equal-size random partitions")
def iid(labels: np.ndarray, num_partitions: int, cfg: PartitionConfig, seed: int) -> list[np.ndarray]:
    """Equal-size (within one example) uniformly random partitions."""
    from flwr_datasets.partitioner import IidPartitioner

    labels, num_partitions = _check_pool(labels, num_partitions)
    return _read_partitions(IidPartitioner(num_partitions=num_partitions), labels, num_partitions, seed)


# ----------------------------------------------------------------------------------- dirichlet


def _check_dirichlet(n: int, num_partitions: int, alpha: float, m: int) -> None:
    if alpha <= 0:
        raise ConfigError(f"data.partition.alpha must be > 0, got {alpha}")
    if m < 1:
        raise ConfigError(f"data.partition.min_partition_size must be >= 1 (every client needs data), got {m}")
    if m * num_partitions > n:
        raise ConfigError(
            f"data.partition.min_partition_size={m} x {num_partitions} clients needs {m * num_partitions} "
            f"examples but the training pool has {n}; set it to at most {n // num_partitions} or use fewer clients"
        )


@_partitioner("dirichlet", "Flower's DirichletPartitioner: label skew set by alpha",
              alpha=0.5, min_partition_size=10, self_balancing=False)
def dirichlet(labels: np.ndarray, num_partitions: int, cfg: PartitionConfig, seed: int) -> list[np.ndarray]:
    """Per-class Dirichlet(alpha) proportions, redrawn (up to 10 times) until min_partition_size holds."""
    from flwr_datasets.partitioner import DirichletPartitioner

    labels, num_partitions = _check_pool(labels, num_partitions)
    alpha, m = float(_param(cfg, "dirichlet", "alpha")), int(_param(cfg, "dirichlet", "min_partition_size"))
    _check_dirichlet(len(labels), num_partitions, alpha, m)
    partitioner = DirichletPartitioner(
        num_partitions=num_partitions,
        partition_by=LABEL,
        alpha=alpha,
        min_partition_size=m,
        self_balancing=bool(_param(cfg, "dirichlet", "self_balancing")),
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
            f"data.partition.min_partition_size={m}: Flower's DirichletPartitioner left some "
            f"client below it in 11 draws (alpha={alpha}, {num_partitions} clients, {len(labels)} examples); "
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


@_partitioner("pathological", "Flower's PathologicalPartitioner: k classes per client", num_classes_per_partition=2)
def pathological(labels: np.ndarray, num_partitions: int, cfg: PartitionConfig, seed: int) -> list[np.ndarray]:
    """Each client holds exactly ``num_classes_per_partition`` classes; every class is used."""
    from flwr_datasets.partitioner import PathologicalPartitioner

    labels, num_partitions = _check_pool(labels, num_partitions)
    k = int(_param(cfg, "pathological", "num_classes_per_partition"))
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


@_partitioner("shard", "Flower's ShardPartitioner: label-sorted shards per client", num_shards_per_partition=2)
def shard(labels: np.ndarray, num_partitions: int, cfg: PartitionConfig, seed: int) -> list[np.ndarray]:
    """Sort by label, cut equal shards, give each client ``num_shards_per_partition`` random shards.

    :func:`shard_remainder` examples are left unassigned (Flower drops the incomplete remainder).
    """
    from flwr_datasets.partitioner import ShardPartitioner

    labels, num_partitions = _check_pool(labels, num_partitions)
    s = int(_param(cfg, "shard", "num_shards_per_partition"))
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


# ------------------------------------------------------------------- sizes set by the client id

_LAWS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "linear": lambda x: x,
    "square": np.square,
    "exponential": np.exp,
}


def law_sizes(law: str, n: int, num_partitions: int) -> np.ndarray:
    """Client sizes of ``n`` examples under ``law`` (equal | linear | square | exponential).

    ``equal`` is IidPartitioner's ``np.array_split``; the others are Flower's IdToSizeFncPartitioner:
    ``floor(n * f(i + 1) / sum_j f(j + 1))`` for client ``i``, plus the floors' remainder to the last.
    """
    if law == "equal":
        return np.array([len(a) for a in np.array_split(np.arange(n), num_partitions)], dtype=np.int64)
    with np.errstate(over="ignore", invalid="ignore"):
        units = _LAWS[law](np.linspace(start=1, stop=num_partitions, num=num_partitions))
        fractions = units / units.sum()
    if not np.all(np.isfinite(fractions)):
        raise ConfigError(f"num_clients={num_partitions}: e**{num_partitions} overflows the exponential size law; "
                          "use fewer clients or another partitioner")
    sizes = np.array(fractions * n, dtype=np.int64)
    sizes[-1] += n - sizes.sum()
    return sizes


def _check_law(law: str, key: str, n: int, num_partitions: int) -> np.ndarray:
    sizes = law_sizes(law, n, num_partitions)
    if sizes.min() < 1:
        raise ConfigError(
            f"{key}={law}: with {num_partitions} clients and {n} examples the smallest client "
            f"gets no data (sizes from {sizes.min()} to {sizes.max()}); use fewer clients or another "
            + ("size law" if key.endswith("size_law") else "partitioner")
        )
    return sizes


def _by_size_law(name: str, cls_name: str) -> Callable[..., list[np.ndarray]]:
    """The partitioner function for Flower's ``cls_name`` (linear, square or exponential sizes)."""
    def split(labels: np.ndarray, num_partitions: int, cfg: PartitionConfig, seed: int) -> list[np.ndarray]:
        import flwr_datasets.partitioner as fp

        labels, num_partitions = _check_pool(labels, num_partitions)
        _check_law(name, "data.partition.name", len(labels), num_partitions)
        partitioner = getattr(fp, cls_name)(num_partitions=num_partitions)
        try:
            return _read_partitions(partitioner, labels, num_partitions, seed)
        except ValueError as exc:  # pragma: no cover - _check_law catches what Flower refuses
            raise ConfigError(f"data.partition.name={name}: {_flower_reason(exc)}; use fewer clients") from None

    split.__name__ = split.__qualname__ = name
    split.__doc__ = f"Flower's {cls_name}: client sizes by the {name} law of the client id, random examples."
    return split


linear = _partitioner("linear", "Flower's LinearPartitioner: client i gets a share ∝ i+1")(
    _by_size_law("linear", "LinearPartitioner"))
square = _partitioner("square", "Flower's SquarePartitioner: client i gets a share ∝ (i+1)^2")(
    _by_size_law("square", "SquarePartitioner"))
exponential = _partitioner("exponential", "Flower's ExponentialPartitioner: client i gets a share ∝ e^(i+1)")(
    _by_size_law("exponential", "ExponentialPartitioner"))


def _check_sizes(sizes: Any, n: int, num_partitions: int, *, exact: bool) -> list[int]:
    key = "data.partition.partition_sizes"
    sizes = [int(v) for v in sizes]
    if len(sizes) != num_partitions:
        raise ConfigError(f"{key}: {len(sizes)} sizes for num_clients={num_partitions}; give one size per client")
    if min(sizes) < 1:
        raise ConfigError(f"{key}: every size must be >= 1 (every client needs data), got {min(sizes)}")
    total = sum(sizes)
    if total > n or (exact and total != n):
        need = "sum to" if exact else "sum to at most"
        raise ConfigError(f"{key}: the sizes sum to {total} but must {need} the {n} examples of the training "
                          f"pool; change the sizes" + ("" if exact else " or lower data.test_fraction"))
    return sizes


@_partitioner("size", "Flower's SizePartitioner: explicit client sizes (partition_sizes)", partition_sizes=None)
def size(labels: np.ndarray, num_partitions: int, cfg: PartitionConfig, seed: int) -> list[np.ndarray]:
    """Client ``i`` gets ``partition_sizes[i]`` random examples; a sum below the pool leaves the rest to no client."""
    from flwr_datasets.partitioner import SizePartitioner

    labels, num_partitions = _check_pool(labels, num_partitions)
    sizes = _check_sizes(_param(cfg, "size", "partition_sizes"), len(labels), num_partitions, exact=False)
    with warnings.catch_warnings():  # Flower warns when the sizes sum to less than the pool: documented
        warnings.simplefilter("ignore", UserWarning)
        return _read_partitions(SizePartitioner(partition_sizes=sizes), labels, num_partitions, seed)


# ----------------------------------------------------------------------------- inner dirichlet


@_partitioner("inner_dirichlet", "Flower's InnerDirichletPartitioner: set client sizes, Dirichlet label mix",
              alpha=0.5, partition_sizes=None, size_law="equal")
def inner_dirichlet(labels: np.ndarray, num_partitions: int, cfg: PartitionConfig, seed: int) -> list[np.ndarray]:
    """Client sizes from ``size_law`` or ``partition_sizes`` (summing to the pool); labels drawn per client from
    Dirichlet(alpha) class proportions (a class that runs out is dropped and the rest renormalised)."""
    from flwr_datasets.partitioner import InnerDirichletPartitioner

    labels, num_partitions = _check_pool(labels, num_partitions)
    alpha = float(_param(cfg, "inner_dirichlet", "alpha"))
    if alpha <= 0:
        raise ConfigError(f"data.partition.alpha must be > 0, got {alpha}")
    if cfg.partition_sizes is not None and cfg.size_law is not None:
        raise ConfigError("data.partition.size_law: set either partition_sizes or size_law, not both")
    if cfg.partition_sizes is not None:
        sizes = _check_sizes(cfg.partition_sizes, len(labels), num_partitions, exact=True)
    else:
        law = _param(cfg, "inner_dirichlet", "size_law")
        if law not in ("equal", *_LAWS):
            raise ConfigError(f"data.partition.size_law must be one of equal, {', '.join(_LAWS)}, got {law!r}")
        sizes = _check_law(law, "data.partition.size_law", len(labels), num_partitions).tolist()
    partitioner = InnerDirichletPartitioner(
        partition_sizes=[int(v) for v in sizes],
        partition_by=LABEL,
        alpha=alpha,
        shuffle=False,
        seed=_flower_seed(seed),
    )
    try:
        return _read_partitions(partitioner, labels, num_partitions, seed)
    except ValueError as exc:  # pragma: no cover - the checks above catch what Flower refuses
        raise ConfigError(f"data.partition: Flower's InnerDirichletPartitioner refused: {_flower_reason(exc)}") from None


# -------------------------------------------------------------------------------- distribution


@_partitioner("distribution", "Flower's DistributionPartitioner: a per-class distribution array over buckets",
              distribution_array=None, num_classes_per_partition=2, preassigned_num_samples_per_label=0,
              rescale=True)
def distribution(labels: np.ndarray, num_partitions: int, cfg: PartitionConfig, seed: int) -> list[np.ndarray]:
    """Client ``i`` holds classes ``i .. i+k-1 (mod C)``; class ``c``'s examples are dealt to its ``k*N/C``
    clients in the proportions (``rescale: true``) or counts (``rescale: false``) of row ``c`` of
    ``distribution_array``, after ``preassigned_num_samples_per_label`` each (with ``rescale``)."""
    from flwr_datasets.partitioner import DistributionPartitioner

    labels, num_partitions = _check_pool(labels, num_partitions)
    key = "data.partition.distribution_array"
    arr = np.asarray(_param(cfg, "distribution", "distribution_array"), dtype=float)
    k = int(_param(cfg, "distribution", "num_classes_per_partition"))
    pre = int(_param(cfg, "distribution", "preassigned_num_samples_per_label"))
    rescale = bool(_param(cfg, "distribution", "rescale"))
    c = len(np.unique(labels))
    if k < 1 or k > c:
        raise ConfigError(f"data.partition.num_classes_per_partition={k} must be in [1, {c}] (the classes in "
                          f"the training pool)")
    if num_partitions % c:
        raise ConfigError(f"num_clients={num_partitions}: partitioner 'distribution' needs a multiple of the "
                          f"{c} classes in the training pool; use {c * max(1, round(num_partitions / c))} clients")
    cols = k * num_partitions // c
    if arr.ndim != 2 or arr.shape != (c, cols):
        raise ConfigError(f"{key}: shape {arr.shape} but {c} classes x {k} classes per client x {num_partitions} "
                          f"clients need {c} rows of {cols} values (classes x num_classes_per_partition * "
                          f"num_clients / classes)")
    if not np.all(np.isfinite(arr)) or arr.min() < 0 or (rescale and np.any(arr.sum(axis=1) <= 0)):
        raise ConfigError(f"{key}: values must be finite and >= 0" + (", each row summing to > 0" if rescale else ""))
    partitioner = DistributionPartitioner(
        distribution_array=arr if rescale else np.floor(arr).astype(np.int64),
        num_partitions=num_partitions,
        num_unique_labels_per_partition=k,
        partition_by=LABEL,
        preassigned_num_samples_per_label=pre,
        rescale=rescale,
        shuffle=False,
        seed=_flower_seed(seed),
    )
    try:
        return _read_partitions(partitioner, labels, num_partitions, seed)
    except ValueError as exc:
        what = "preassigned_num_samples_per_label" if "preassigned" in str(exc) else "distribution_array"
        raise ConfigError(f"data.partition.{what}: Flower's DistributionPartitioner refused: {_flower_reason(exc)}; "
                          f"lower it") from None
