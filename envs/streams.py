"""Regime streams: test-time domain streams (TTA) and continual-learning task streams.

**Domain stream** (:class:`DomainStream`): the test-time-adaptation regime of LCoTTA
(ThunderDavid/LCoTTA, built on the benchmark ``mariodoebler/test-time-adaptation``; see
``classification/test_time.py`` and ``datasets/corruptions_datasets.py`` there).  A pool of clean
labelled images is shown as a cycle of domains (corruptions of :mod:`envs.corruptions` at a
severity), repeated ``cycles`` times.  The learner gets unlabeled batches (labels ride along for
scoring only) and no domain boundaries, except the ``reset`` flag in ``reset_each_shift``.  The
benchmark's settings:

* ``continual``: cycle after cycle, every domain of the order in turn, no reset.
* ``reset_each_shift``: the same sequence; ``reset`` is True on the first batch of every
  (cycle, domain) block, where the benchmark calls ``model.reset()``.
* ``gradual``: the benchmark's schedule for CIFAR-10-C/ImageNet-C: every domain is shown at
  severities ``[1, 2, 3, 4, 5, 4, 3, 2, 1]`` in turn, each a full pass over the images, before the
  next domain starts.  Here the ramp peaks at ``cfg.severity`` (5 gives the benchmark's schedule),
  see :func:`gradual_severities`.
* ``mixed`` (the benchmark's ``mixed_domains``): each cycle holds every image under every domain,
  all shuffled together, so consecutive images likely come from different domains.

Segments: the engine runs the stream one segment per federated round.  A segment is one
(cycle, domain) block; in ``gradual`` one (cycle, domain, severity step) block; in ``mixed`` one of
``len(domains)`` equal parts of a cycle.  ``segment(k)`` builds only block k, deterministically.

Randomness (all from :func:`fedsim.seeding.derive_seed`): the block of (cycle, domain, step) draws
its image order and then its corruption noise from ``(seed, cycle, domain index, step)``, so noise
is redrawn every cycle and blocks are independent of which other blocks were built (``mixed``:
the cycle's shuffle comes from ``(seed, cycle)``, the noise of each domain's share of part p from
``(seed, cycle, p, domain index)``).  ``order_seed``
permutes the domain order (the same permutation in every cycle), so each federated client can see
its own order; ``indices`` restricts the pool to a client's images.  Give each client its own
``seed`` too, or two clients with the same seed draw the same noise patterns.

Deliberate deviations from the benchmark:

* The benchmark loads pre-corrupted files, the same noise in every pass; here noise is redrawn
  per (cycle, domain, step), as LCoTTA's lifelong regime needs (research notes, continual.md §2).
* Every domain uses the same images (the pool, or a fixed random subset of ``images_per_domain``),
  like the benchmark's first ``NUM_EX`` images of each corruption, but reshuffled per block (the
  benchmark reads every domain in one fixed order, ``shuffle=False``).
* ``gradual`` peaks at ``cfg.severity`` rather than always 5; ``mixed`` is split into segments.
* Not implemented: the ``correlated`` (label-sorted) and Dirichlet-ordered variants.

LCoTTA's ImageNet-C stream (50 cycles of 15 corruptions at severity 5, batches of 64, continual)
becomes, on MNIST (14 corruptions: frost needs image assets)::

    x, y = mnist01()
    cfg = DomainStreamConfig(list(BENCHMARK_ORDER), cycles=50, severity=5, batch_size=64)
    stream = DomainStream(x, y, cfg, seed=derive_seed(root, "tta", client), normalise=mnist_normalise)
    for batch in stream.segment(round): ...

**Task stream** (:class:`TaskStream`): continual learning with known task boundaries (CKA-RL,
PEFT meta-learning).  A :class:`Task` holds a ``train`` and a ``test`` payload, typed ``Any``:
usually an :class:`~envs.datasets.ArrayDataset`, but an RL environment config fits the same slot,
with anything else in ``info``.  Builders: :func:`split_classes` (class- or task-incremental, as
Avalanche's ``class_incremental_benchmark`` / SplitMNIST), :func:`permuted` (Permuted MNIST) and
:func:`corrupted_tasks` (domain-incremental).

Helpers: :func:`mnist01` / :func:`digits01` give the offline images in [0, 1] for corruption, and
:func:`mnist_normalise` is the standardisation of :func:`envs.datasets.load_mnist`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, overload

import numpy as np

from envs.corruptions import SEVERITIES, check_corruption, corrupt
from envs.datasets import MNIST_MEAN, MNIST_STD, ArrayDataset, _mnist_raw, load_digits
from fedsim.errors import ConfigError
from fedsim.seeding import numpy_rng

SETTINGS: tuple[str, ...] = ("continual", "reset_each_shift", "gradual", "mixed")

#: ``StreamBatch.domain`` / ``domain_index`` of the batches of a ``mixed`` stream.
MIXED = "mixed"

Normalise = Callable[[np.ndarray], np.ndarray]


# ------------------------------------------------------------------------------ offline images


def mnist01() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 offline MNIST images as (5000, 1, 28, 28) float32 in [0, 1], and labels (int64)."""
    raw_x, raw_y = _mnist_raw()
    x = (raw_x / np.float32(255.0)).reshape(-1, 1, 28, 28).astype(np.float32)
    return x, raw_y.copy()


def digits01() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits as (1797, 1, 8, 8) float32 in [0, 1], and labels (int64)."""
    ds = load_digits(None, 0)
    return ds.x, ds.y


def mnist_normalise(x: np.ndarray) -> np.ndarray:
    """MNIST standardisation (mean 0.1307, std 0.3081) of images in [0, 1], as ``load_mnist`` does."""
    return ((np.asarray(x, dtype=np.float32) - np.float32(MNIST_MEAN)) / np.float32(MNIST_STD)).astype(np.float32)


# ------------------------------------------------------------------------------ domain stream


@dataclass
class DomainStreamConfig:
    """A domain stream: ``domains`` (corruption names) at ``severity``, repeated ``cycles`` times.

    ``images_per_domain`` takes a fixed random subset of the pool for every block (None: all).
    """

    domains: list[str]
    cycles: int = 1
    severity: int = 5
    batch_size: int = 64
    setting: str = "continual"
    images_per_domain: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.domains, str) or not isinstance(self.domains, Iterable):
            raise ConfigError(f"stream.domains must be a list of corruption names, got {self.domains!r}")
        self.domains = list(self.domains)
        if not self.domains:
            raise ConfigError("stream.domains is empty: list at least one corruption name")
        for name in self.domains:
            check_corruption(name)
        dupes = sorted({d for d in self.domains if self.domains.count(d) > 1})
        if dupes:
            raise ConfigError(f"stream.domains lists {dupes} more than once: list each domain once")
        if self.setting not in SETTINGS:
            raise ConfigError(f"stream.setting {self.setting!r} is unknown; choose one of: {', '.join(SETTINGS)}")
        _check_int("stream.cycles", self.cycles, 1)
        _check_int("stream.batch_size", self.batch_size, 1)
        if isinstance(self.severity, bool) or self.severity not in SEVERITIES:
            raise ConfigError(f"stream.severity must be one of 1, 2, 3, 4, 5, got {self.severity!r}")
        if self.images_per_domain is not None:
            _check_int("stream.images_per_domain", self.images_per_domain, 1)


def _check_int(key: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(f"{key} must be an integer >= {low}, got {value!r}")


def gradual_severities(peak: int) -> tuple[int, ...]:
    """The gradual setting's per-domain schedule: 1, 2, ..., peak, ..., 2, 1."""
    return tuple(range(1, peak + 1)) + tuple(range(peak - 1, 0, -1))


@dataclass
class StreamBatch:
    """One test batch.  ``x`` is normalised float32, ``y`` (int64) is for scoring only.

    ``domain`` / ``domain_index`` (index into the config's ``domains``) name the batch's domain;
    in a ``mixed`` stream they are ``"mixed"`` / -1 and ``sample_domain`` tells each image's
    domain index.  ``index`` holds the images' rows in the array the stream was built from.
    ``reset`` is True on the first batch of a domain block in ``reset_each_shift`` only.
    """

    x: np.ndarray
    y: np.ndarray
    domain: str
    domain_index: int
    cycle: int
    severity: int
    segment: int
    reset: bool
    sample_domain: np.ndarray
    index: np.ndarray


@dataclass(frozen=True)
class _Block:
    cycle: int
    position: int  # the domain's place in the stream order (or the part of a mixed cycle)
    domain_index: int  # -1 in mixed
    step: int  # severity step (gradual), else 0
    severity: int


class DomainStream:
    """A seeded, reproducible domain stream over a pool of clean images in [0, 1].

    ``images`` (N, C, H, W) in [0, 1] and ``labels`` (N,) form the pool; ``indices`` restricts it
    (a client's rows).  ``normalise`` maps corrupted [0, 1] images to the model's input scale
    (e.g. :func:`mnist_normalise`; None leaves them in [0, 1]).
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        cfg: DomainStreamConfig,
        seed: int,
        order_seed: int | None = None,
        indices: np.ndarray | Sequence[int] | None = None,
        normalise: Normalise | None = None,
    ) -> None:
        images = np.asarray(images)
        labels = np.asarray(labels)
        if images.ndim != 4 or images.shape[1] not in (1, 3):
            raise ConfigError(f"DomainStream needs images of shape (N, C, H, W) with C = 1 or 3, got {images.shape}")
        if labels.shape != (len(images),):
            raise ConfigError(f"DomainStream needs one label per image: images {images.shape}, labels {labels.shape}")
        if not isinstance(cfg, DomainStreamConfig):
            raise ConfigError(f"DomainStream needs a DomainStreamConfig, got {type(cfg).__name__}")
        _check_int("stream seed", seed, 0)
        if order_seed is not None:
            _check_int("stream order_seed", order_seed, 0)
        rows = np.arange(len(images)) if indices is None else np.asarray(indices)
        if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer) or len(rows) == 0:
            raise ConfigError("DomainStream indices must be a non-empty 1-D list of row indices")
        if rows.min() < 0 or rows.max() >= len(images) or len(np.unique(rows)) != len(rows):
            raise ConfigError(f"DomainStream indices must be distinct rows in [0, {len(images)})")
        if cfg.images_per_domain is not None:
            if cfg.images_per_domain > len(rows):
                raise ConfigError(f"stream.images_per_domain ({cfg.images_per_domain}) exceeds the pool "
                                  f"({len(rows)} images): lower it or pass more indices")
            pick = numpy_rng(seed, "domain-stream", "pool").choice(len(rows), cfg.images_per_domain, replace=False)
            rows = rows[np.sort(pick)]
        pool = images[rows].astype(np.float32)
        if pool.min() < -1e-4 or pool.max() > 1 + 1e-4:
            raise ConfigError("DomainStream images must lie in [0, 1] (raw, unnormalised): "
                              "pass mnist01()/digits01() images and normalise= for the model's scale")
        self.cfg = cfg
        self.seed = int(seed)
        self.rows = rows
        self._x = np.clip(pool, 0, 1)
        self._y = labels[rows].astype(np.int64)
        self._normalise = normalise
        n_dom = len(cfg.domains)
        if order_seed is None:
            self.order: tuple[int, ...] = tuple(range(n_dom))
        else:
            self.order = tuple(int(i) for i in numpy_rng(order_seed, "domain-order").permutation(n_dom))
        self._ramp = gradual_severities(cfg.severity) if cfg.setting == "gradual" else (cfg.severity,)

    # -------------------------------------------------------------------------- layout

    @property
    def pool_size(self) -> int:
        """Images per segment (the pool, after ``indices`` and ``images_per_domain``)."""
        return len(self._y)

    @property
    def domain_order(self) -> list[str]:
        """The domain names in stream order (the same in every cycle)."""
        return [self.cfg.domains[i] for i in self.order]

    @property
    def segments_per_cycle(self) -> int:
        return len(self.cfg.domains) * len(self._ramp)

    @property
    def num_segments(self) -> int:
        return self.cfg.cycles * self.segments_per_cycle

    @property
    def batches_per_segment(self) -> int:
        return -(-self.pool_size // self.cfg.batch_size)

    @property
    def num_batches(self) -> int:
        return self.num_segments * self.batches_per_segment

    def _block(self, k: int) -> _Block:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < self.num_segments:
            raise ConfigError(f"segment {k!r} is out of range: the stream has {self.num_segments} segments "
                              f"({self.cfg.cycles} cycles x {self.segments_per_cycle}); "
                              "lower the rounds or raise cycles")
        k = int(k)
        cycle, rest = divmod(k, self.segments_per_cycle)
        if self.cfg.setting == MIXED:
            return _Block(cycle, rest, -1, 0, self.cfg.severity)
        position, step = divmod(rest, len(self._ramp))
        return _Block(cycle, position, self.order[position], step, self._ramp[step])

    def describe(self, k: int) -> tuple[int, str, int]:
        """``(cycle, domain name, severity)`` of segment ``k`` (domain ``"mixed"`` in mixed)."""
        b = self._block(k)
        return b.cycle, (MIXED if b.domain_index < 0 else self.cfg.domains[b.domain_index]), b.severity

    # -------------------------------------------------------------------------- content

    def segment(self, k: int) -> list[StreamBatch]:
        """The batches of segment ``k``, built on demand (O(segment) work, deterministic)."""
        b = self._block(k)
        if self.cfg.setting == MIXED:
            x, order, dom = self._mixed_part(b)
        else:
            rng = numpy_rng(self.seed, "domain-stream", b.cycle, b.domain_index, b.step)
            order = rng.permutation(self.pool_size)
            x = corrupt(self._x[order], self.cfg.domains[b.domain_index], b.severity, rng)
            dom = np.full(len(order), b.domain_index, dtype=np.int64)
        if self._normalise is not None:
            x = np.asarray(self._normalise(x), dtype=np.float32)
        name = MIXED if b.domain_index < 0 else self.cfg.domains[b.domain_index]
        bs = self.cfg.batch_size
        return [
            StreamBatch(
                x=x[i:i + bs], y=self._y[order[i:i + bs]], domain=name, domain_index=b.domain_index,
                cycle=b.cycle, severity=b.severity, segment=int(k),
                reset=self.cfg.setting == "reset_each_shift" and i == 0,
                sample_domain=dom[i:i + bs], index=self.rows[order[i:i + bs]],
            )
            for i in range(0, len(order), bs)
        ]

    def _mixed_part(self, b: _Block) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Part ``b.position`` of a mixed cycle: every (image, domain) pair of the cycle, shuffled."""
        n, n_dom = self.pool_size, len(self.cfg.domains)
        items = numpy_rng(self.seed, "domain-stream", "mixed", b.cycle).permutation(n * n_dom)
        part = items[b.position * n:(b.position + 1) * n]
        dom, order = np.divmod(part, n)
        x = np.empty((len(part), *self._x.shape[1:]), dtype=np.float32)
        for d in np.unique(dom):
            where = np.flatnonzero(dom == d)
            rng = numpy_rng(self.seed, "domain-stream", "mixed", b.cycle, b.position, int(d))
            x[where] = corrupt(self._x[order[where]], self.cfg.domains[d], b.severity, rng)
        return x, order, dom.astype(np.int64)

    def __iter__(self) -> Iterator[StreamBatch]:
        for k in range(self.num_segments):
            yield from self.segment(k)

    def __len__(self) -> int:
        return self.num_batches


# ------------------------------------------------------------------------------- task stream


@dataclass
class Task:
    """One task of a continual-learning stream: ``train`` / ``test`` payloads and ``info``.

    The payloads are usually :class:`~envs.datasets.ArrayDataset`; any object (e.g. an RL
    environment config, ``test=None``) fits, so the learner decides what a task means.
    """

    name: str
    train: Any
    test: Any = None
    info: dict[str, Any] = field(default_factory=dict)


class TaskStream(Sequence[Task]):
    """An ordered sequence of uniquely named tasks with known boundaries."""

    def __init__(self, tasks: Iterable[Task], name: str = "tasks") -> None:
        self.tasks: tuple[Task, ...] = tuple(tasks)
        self.name = name
        if not self.tasks:
            raise ConfigError(f"task stream {name!r} has no tasks: give at least one")
        names = [t.name for t in self.tasks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"task stream {name!r} repeats task names {dupes}: names must be unique")

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tasks]

    def __len__(self) -> int:
        return len(self.tasks)

    @overload
    def __getitem__(self, i: int) -> Task: ...

    @overload
    def __getitem__(self, i: slice) -> TaskStream: ...

    def __getitem__(self, i: int | slice) -> Task | TaskStream:
        if isinstance(i, slice):
            return TaskStream(self.tasks[i], self.name)
        return self.tasks[i]

    def by_name(self, name: str) -> Task:
        for t in self.tasks:
            if t.name == name:
                return t
        raise ConfigError(f"task stream {self.name!r} has no task {name!r}; tasks: {', '.join(self.names)}")

    def __repr__(self) -> str:
        return f"TaskStream({self.name!r}, {self.names})"


def _stratified_split(y: np.ndarray, test_fraction: float, seed: int, tag: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-class seeded split: sorted (train rows, test rows), every class on both sides."""
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    rng = numpy_rng(seed, tag, "split")
    train, test = [], []
    for c in np.unique(y):
        rows = rng.permutation(np.flatnonzero(y == c))
        if len(rows) < 2:
            raise ConfigError(f"class {int(c)} has {len(rows)} example(s): each class needs >= 2 to split train/test")
        n_test = min(len(rows) - 1, max(1, round(test_fraction * len(rows))))
        test.append(rows[:n_test])
        train.append(rows[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def split_classes(
    dataset: ArrayDataset,
    groups: Sequence[Sequence[int]],
    test_fraction: float = 0.2,
    seed: int = 0,
    relabel: bool = False,
) -> TaskStream:
    """Class-split tasks (SplitMNIST style): task t holds the classes ``groups[t]``.

    One stratified train/test split of the whole dataset is shared by all tasks (``info`` holds
    each task's ``train_rows`` / ``test_rows`` into ``dataset``).  ``relabel=False``
    keeps the global labels (class-incremental, ``num_classes`` of the dataset); ``relabel=True``
    maps ``groups[t][j]`` to ``j`` (task-incremental with a head per task).
    """
    groups = [list(g) for g in groups]
    if not groups or any(not g for g in groups):
        raise ConfigError("split_classes groups must be a non-empty list of non-empty class lists")
    flat = [c for g in groups for c in g]
    bad = [c for c in flat if isinstance(c, bool) or not isinstance(c, (int, np.integer))
           or not 0 <= c < dataset.num_classes]
    if bad:
        raise ConfigError(f"split_classes groups name classes {bad} outside [0, {dataset.num_classes})")
    if len(set(flat)) != len(flat):
        raise ConfigError(f"split_classes groups must be disjoint, got {groups}")
    train_rows, test_rows = _stratified_split(dataset.y, test_fraction, seed, "split_classes")
    tasks = []
    for t, g in enumerate(groups):
        lookup = np.full(dataset.num_classes, -1, dtype=np.int64)
        lookup[g] = np.arange(len(g)) if relabel else g
        n_cls = len(g) if relabel else dataset.num_classes
        tr = train_rows[np.isin(dataset.y[train_rows], g)]
        te = test_rows[np.isin(dataset.y[test_rows], g)]
        tasks.append(Task(
            f"{dataset.name}-classes-{'-'.join(str(int(c)) for c in g)}",
            ArrayDataset(dataset.x[tr], lookup[dataset.y[tr]], n_cls, dataset.name),
            ArrayDataset(dataset.x[te], lookup[dataset.y[te]], n_cls, dataset.name),
            {"task": t, "classes": [int(c) for c in g], "relabel": relabel, "train_rows": tr, "test_rows": te},
        ))
    return TaskStream(tasks, f"{dataset.name}-split")


def permute_pixels(x: np.ndarray, permutation: np.ndarray) -> np.ndarray:
    """Reorder pixel positions: (N, C, H, W) by H*W positions (channels kept together), else features.

    ``permute_pixels(permute_pixels(x, p), np.argsort(p))`` gives ``x`` back.
    """
    x = np.asarray(x)
    flat = x.reshape(*x.shape[:2], -1) if x.ndim == 4 else x.reshape(len(x), -1)
    return flat[..., permutation].reshape(x.shape)


def permuted(
    dataset: ArrayDataset,
    n_tasks: int,
    seed: int,
    test_fraction: float = 0.2,
    identity_first: bool = False,
) -> TaskStream:
    """Permuted tasks (Permuted MNIST): task t applies one fixed random pixel permutation.

    All tasks share the same images and train/test split; ``info["permutation"]`` and
    ``info["inverse"]`` hold the permutation of task t.  ``identity_first`` makes task 0 the
    original images.
    """
    _check_int("permuted n_tasks", n_tasks, 1)
    x = dataset.x
    size = int(np.prod(x.shape[2:])) if x.ndim == 4 else int(np.prod(x.shape[1:]))
    train_rows, test_rows = _stratified_split(dataset.y, test_fraction, seed, "permuted")
    tasks = []
    for t in range(n_tasks):
        perm = np.arange(size) if identity_first and t == 0 else numpy_rng(seed, "permuted", t).permutation(size)
        px = permute_pixels(x, perm)
        tasks.append(Task(
            f"{dataset.name}-perm{t}",
            ArrayDataset(px[train_rows], dataset.y[train_rows], dataset.num_classes, dataset.name),
            ArrayDataset(px[test_rows], dataset.y[test_rows], dataset.num_classes, dataset.name),
            {"task": t, "permutation": perm, "inverse": np.argsort(perm),
             "train_rows": train_rows, "test_rows": test_rows},
        ))
    return TaskStream(tasks, f"{dataset.name}-permuted")


def corrupted_tasks(
    dataset01: ArrayDataset,
    corruptions: Sequence[str],
    severity: int = 5,
    seed: int = 0,
    test_fraction: float = 0.2,
    normalise: Normalise | None = None,
) -> TaskStream:
    """Domain-incremental tasks: task t is the whole dataset under ``corruptions[t]``.

    ``dataset01`` holds images in [0, 1] (e.g. ``ArrayDataset(*mnist01(), 10, "mnist")``); all tasks
    share its images and train/test split; noise is drawn per task and split from ``seed``;
    ``normalise`` (e.g. :func:`mnist_normalise`) is applied after corrupting.  ``"none"`` is the
    clean task.
    """
    names = [] if isinstance(corruptions, str) else list(corruptions)
    if not names:
        raise ConfigError(f"corrupted_tasks needs a non-empty list of corruption names, got {corruptions!r}")
    for name in names:
        check_corruption(name, severity)
    train_rows, test_rows = _stratified_split(dataset01.y, test_fraction, seed, "corrupted_tasks")
    tasks = []
    for t, name in enumerate(names):
        parts = []
        for split, rows in (("train", train_rows), ("test", test_rows)):
            x = corrupt(dataset01.x[rows], name, severity, numpy_rng(seed, "corrupted_tasks", t, split))
            if normalise is not None:
                x = np.asarray(normalise(x), dtype=np.float32)
            parts.append(ArrayDataset(x, dataset01.y[rows], dataset01.num_classes, dataset01.name))
        tasks.append(Task(name, parts[0], parts[1], {"task": t, "corruption": name, "severity": severity,
                                                     "train_rows": train_rows, "test_rows": test_rows}))
    return TaskStream(tasks, f"{dataset01.name}-corrupted")
