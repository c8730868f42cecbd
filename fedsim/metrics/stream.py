"""Test-time / domain-stream metrics: online accuracy per (cycle, domain) block and collapse diagnostics.

A domain stream visits domains in order and repeats the sequence for several *cycles* (LCoTTA's
lifelong setting: 15 ImageNet-C corruptions × 50 cycles; the ``continual`` setting of
``mariodoebler/test-time-adaptation``, which reports the error per domain and per repeat). A
:class:`StreamRecorder` keeps, per block ``(cycle, domain)``, three sums: examples ``n``, correct
predictions and the histogram of predicted classes. Everything else is computed from those sums:

* accuracy per block / cycle / domain (over cycles) / overall, always ``sum(correct) / sum(n)``,
  i.e. weighted by examples. Online accuracy means the caller records the predictions made
  *before* adapting on the batch (as the TTA benchmarks do); the recorder does not know.
* error rate ``1 - accuracy``.
* collapse diagnostics: entropy ``H(p) = -sum_k p_k ln p_k`` of the marginal prediction
  distribution ``p = hist / n`` (natural log; also normalised by ``ln C``: 1 = uniform
  predictions, 0 = one class), and the number of distinct predicted classes.
* degradation over cycles: ``accuracy_drop`` = accuracy of the first cycle minus the last (> 0 means
  worse at the end) and ``accuracy_slope`` = least-squares slope of per-cycle accuracy against the
  cycle number (< 0 means degrading).

Because only sums are kept, recorders merge exactly: per-client recorders summed into one give the
same numbers as one recorder fed every batch. :meth:`StreamRecorder.to_metrics` encodes the counts
as a flat ``dict[str, float]`` (a Flower client's metrics) and :meth:`StreamRecorder.from_metrics`
rebuilds them. Server side, *sum* the clients' counts (``merge_recorders(from_metrics(m) ...)``);
a sample-weighted mean of these keys, Flower's default metric aggregation, is wrong for them.

Choices: domains are names (``str``; ints are converted) without ``/``; cycles are integers >= 0;
block order is (cycle, domain order), domain order being the order given at construction or first
seen. Empty blocks do not exist (a zero-length batch records nothing); a metric with no data is
NaN. ``predictions`` may be class indices (1-D) or scores (2-D, arg-max taken).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from fedsim.errors import ConfigError

__all__ = [
    "BlockCounts",
    "StreamRecorder",
    "distinct_classes",
    "least_squares_slope",
    "marginal_entropy",
    "merge_recorders",
]


# --------------------------------------------------------------------------- pure functions


def marginal_entropy(hist: ArrayLike, normalized: bool = False) -> float:
    """Entropy (nats) of the predicted-class histogram; ``normalized`` divides by ``ln C``. NaN if empty."""
    h = np.asarray(hist, dtype=np.float64).reshape(-1)
    total = h.sum()
    if total <= 0:
        return math.nan
    p = h[h > 0] / total
    H = float(-(p * np.log(p)).sum()) + 0.0  # + 0.0 turns -0.0 into 0.0
    if normalized:
        if h.size < 2:
            raise ConfigError("normalised entropy needs at least 2 classes")
        return H / math.log(h.size)
    return H


def distinct_classes(hist: ArrayLike) -> int:
    """Number of classes predicted at least once."""
    return int((np.asarray(hist) > 0).sum())


def least_squares_slope(values: ArrayLike, x: ArrayLike | None = None) -> float:
    """Slope of the least-squares line through ``(x, values)`` (x = 0..n-1 by default); NaN if < 2 points."""
    y = np.asarray(values, dtype=np.float64).reshape(-1)
    xs = np.arange(y.size, dtype=np.float64) if x is None else np.asarray(x, dtype=np.float64).reshape(-1)
    if xs.shape != y.shape:
        raise ConfigError(f"slope needs as many x as values, got {xs.size} and {y.size}")
    keep = ~np.isnan(y)
    xs, y = xs[keep], y[keep]
    if y.size < 2:
        return math.nan
    dx = xs - xs.mean()
    den = float((dx * dx).sum())
    if den == 0.0:
        return math.nan
    return float((dx * (y - y.mean())).sum() / den)


# --------------------------------------------------------------------------- counts


@dataclass
class BlockCounts:
    """Sums for one block: examples, correct predictions, predicted-class histogram."""

    n: int = 0
    correct: int = 0
    hist: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else math.nan

    def entropy(self, normalized: bool = False) -> float:
        return marginal_entropy(self.hist, normalized)

    @property
    def distinct(self) -> int:
        return distinct_classes(self.hist)

    def __add__(self, other: "BlockCounts") -> "BlockCounts":
        return BlockCounts(self.n + other.n, self.correct + other.correct, self.hist + other.hist)


def _domain(d: Any) -> str:
    name = str(d)
    if not name or "/" in name:
        raise ConfigError(f"domain name {name!r} must be non-empty and contain no '/'")
    return name


def _cycle(c: Any) -> int:
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0:
        raise ConfigError(f"cycle must be an integer >= 0, got {c!r}")
    return int(c)


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, without importing torch
        x = x.detach().cpu().numpy()
    return np.asarray(x)


class StreamRecorder:
    """Per-(cycle, domain) counts of a test-time stream; mergeable and serialisable to flat metrics."""

    def __init__(self, num_classes: int, domains: Sequence[Any] | None = None) -> None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 2:
            raise ConfigError(f"num_classes must be an integer >= 2, got {num_classes!r}")
        self.num_classes = int(num_classes)
        self._domains: list[str] = []
        for d in domains or ():
            name = _domain(d)
            if name in self._domains:
                raise ConfigError(f"domain {name!r} listed twice")
            self._domains.append(name)
        self._blocks: dict[tuple[int, str], BlockCounts] = {}

    # ---------------------------------------------------------------- recording

    def record(self, cycle: int, domain: Any, predictions: ArrayLike, labels: ArrayLike) -> None:
        """Add one batch: predicted classes (or scores, arg-max taken) and true labels."""
        pred, lab = _to_numpy(predictions), _to_numpy(labels).reshape(-1)
        if pred.ndim == 2:
            if pred.shape[1] != self.num_classes:
                raise ConfigError(f"scores have {pred.shape[1]} columns but the recorder has "
                                  f"{self.num_classes} classes")
            pred = pred.argmax(axis=1)
        pred = pred.reshape(-1)
        if pred.size != lab.size:
            raise ConfigError(f"{pred.size} predictions but {lab.size} labels in one batch")
        if pred.size == 0:
            return
        for what, v in (("prediction", pred), ("label", lab)):
            if not np.issubdtype(v.dtype, np.integer):
                raise ConfigError(f"{what}s must be integer classes in [0, {self.num_classes}), got dtype {v.dtype}")
            if v.min() < 0 or v.max() >= self.num_classes:
                raise ConfigError(f"{what}s must be integer classes in [0, {self.num_classes}), "
                                  f"got range [{v.min()}, {v.max()}]")
        hist = np.bincount(pred.astype(np.int64), minlength=self.num_classes)
        self.add_counts(cycle, domain, int(pred.size), int((pred == lab).sum()), hist)

    def add_counts(self, cycle: int, domain: Any, n: int, correct: int, hist: ArrayLike) -> None:
        """Add pre-aggregated counts to a block (``sum(hist) == n``, ``0 <= correct <= n``)."""
        c, d = _cycle(cycle), _domain(domain)
        h = np.asarray(hist)
        if h.shape != (self.num_classes,):
            raise ConfigError(f"histogram of block ({c}, {d}) has shape {h.shape}, expected ({self.num_classes},)")
        if not np.all(np.isfinite(h)) or np.any(h < 0) or np.any(h != np.round(h)):
            raise ConfigError(f"histogram of block ({c}, {d}) must hold non-negative integer counts")
        h = h.astype(np.int64)
        n, correct = _count(n, f"n of block ({c}, {d})"), _count(correct, f"correct of block ({c}, {d})")
        if int(h.sum()) != n or correct > n:
            raise ConfigError(f"block ({c}, {d}): histogram sums to {int(h.sum())}, n = {n}, correct = {correct}; "
                              "need sum(hist) == n and correct <= n")
        if n == 0:
            return
        if d not in self._domains:
            self._domains.append(d)
        key = (c, d)
        self._blocks[key] = self._blocks.get(key, BlockCounts(0, 0, np.zeros(self.num_classes, np.int64))) + \
            BlockCounts(n, correct, h)

    # ---------------------------------------------------------------- structure

    @property
    def domains(self) -> list[str]:
        """Domain names in stream order (given at construction, then first seen)."""
        return list(self._domains)

    @property
    def cycles(self) -> list[int]:
        return sorted({c for c, _ in self._blocks})

    @property
    def blocks(self) -> list[tuple[int, str]]:
        """Recorded blocks in stream order: by cycle, then domain order."""
        order = {d: i for i, d in enumerate(self._domains)}
        return sorted(self._blocks, key=lambda k: (k[0], order[k[1]]))

    def block(self, cycle: int, domain: Any) -> BlockCounts:
        key = (_cycle(cycle), _domain(domain))
        if key not in self._blocks:
            raise ConfigError(f"no records for block (cycle {key[0]}, domain {key[1]!r})")
        return self._blocks[key]

    def _sum(self, keys: Iterable[tuple[int, str]]) -> BlockCounts:
        total = BlockCounts(0, 0, np.zeros(self.num_classes, np.int64))
        for k in keys:
            total = total + self._blocks[k]
        return total

    def cycle_counts(self, cycle: int) -> BlockCounts:
        return self._sum(k for k in self._blocks if k[0] == cycle)

    def domain_counts(self, domain: Any) -> BlockCounts:
        d = _domain(domain)
        return self._sum(k for k in self._blocks if k[1] == d)

    def total(self) -> BlockCounts:
        return self._sum(self._blocks)

    # ---------------------------------------------------------------- metrics

    def accuracy(self) -> float:
        """Overall (online) accuracy, weighted by examples."""
        return self.total().accuracy

    def error_rate(self) -> float:
        return 1.0 - self.accuracy()

    def block_accuracy(self) -> np.ndarray:
        return np.array([self._blocks[k].accuracy for k in self.blocks])

    def block_entropy(self, normalized: bool = False) -> np.ndarray:
        return np.array([self._blocks[k].entropy(normalized) for k in self.blocks])

    def block_distinct(self) -> np.ndarray:
        return np.array([self._blocks[k].distinct for k in self.blocks], dtype=np.int64)

    def cycle_accuracy(self) -> np.ndarray:
        return np.array([self.cycle_counts(c).accuracy for c in self.cycles])

    def cycle_entropy(self, normalized: bool = False) -> np.ndarray:
        return np.array([self.cycle_counts(c).entropy(normalized) for c in self.cycles])

    def cycle_distinct(self) -> np.ndarray:
        return np.array([self.cycle_counts(c).distinct for c in self.cycles], dtype=np.int64)

    def domain_accuracy(self) -> dict[str, float]:
        """Accuracy per domain over all cycles."""
        return {d: self.domain_counts(d).accuracy for d in self._domains if any(k[1] == d for k in self._blocks)}

    def cycle_domain_accuracy(self) -> np.ndarray:
        """(cycles × domains) accuracy, NaN where a block was not recorded."""
        cyc = self.cycles
        out = np.full((len(cyc), len(self._domains)), np.nan)
        for i, c in enumerate(cyc):
            for j, d in enumerate(self._domains):
                if (c, d) in self._blocks:
                    out[i, j] = self._blocks[(c, d)].accuracy
        return out

    def accuracy_drop(self) -> float:
        """Accuracy of the first cycle minus that of the last (> 0: degraded); NaN with < 2 cycles."""
        acc = self.cycle_accuracy()
        return float(acc[0] - acc[-1]) if acc.size >= 2 else math.nan

    def accuracy_slope(self) -> float:
        """Least-squares slope of per-cycle accuracy against the cycle number (< 0: degrading)."""
        return least_squares_slope(self.cycle_accuracy(), self.cycles)

    # ---------------------------------------------------------------- tables and summaries

    def rows(self) -> list[dict[str, Any]]:
        """One row per block in stream order."""
        out = []
        for c, d in self.blocks:
            b = self._blocks[(c, d)]
            out.append({"cycle": c, "domain": d, "n": b.n, "correct": b.correct, "accuracy": b.accuracy,
                        "entropy": b.entropy(), "entropy_norm": b.entropy(True), "distinct": b.distinct})
        return out

    def summary_metrics(self, prefix: str = "tta") -> dict[str, float]:
        """Flat MLflow metrics: overall, per cycle, per domain, degradation (NaN values omitted)."""
        p = f"{prefix}/" if prefix else ""
        tot = self.total()
        out = {f"{p}accuracy": tot.accuracy, f"{p}error": 1.0 - tot.accuracy, f"{p}n": float(tot.n),
               f"{p}entropy": tot.entropy(), f"{p}entropy_norm": tot.entropy(True),
               f"{p}distinct": float(tot.distinct),
               f"{p}acc_drop": self.accuracy_drop(), f"{p}acc_slope": self.accuracy_slope()}
        for c in self.cycles:
            b = self.cycle_counts(c)
            out[f"{p}cycle/{c}/accuracy"] = b.accuracy
            out[f"{p}cycle/{c}/entropy"] = b.entropy()
            out[f"{p}cycle/{c}/entropy_norm"] = b.entropy(True)
            out[f"{p}cycle/{c}/distinct"] = float(b.distinct)
        for d, a in self.domain_accuracy().items():
            out[f"{p}domain/{d}/accuracy"] = a
        return {k: float(v) for k, v in out.items() if math.isfinite(v)}

    # ---------------------------------------------------------------- merge and transport

    def merge(self, other: "StreamRecorder") -> "StreamRecorder":
        """A new recorder holding the sums of both (domain order: self's, then other's new ones)."""
        if not isinstance(other, StreamRecorder):
            raise ConfigError(f"can only merge StreamRecorders, got {type(other).__name__}")
        if other.num_classes != self.num_classes:
            raise ConfigError(f"cannot merge recorders with {self.num_classes} and {other.num_classes} classes")
        out = StreamRecorder(self.num_classes, self._domains + [d for d in other._domains if d not in self._domains])
        for src in (self, other):
            for (c, d), b in src._blocks.items():
                out.add_counts(c, d, b.n, b.correct, b.hist)
        return out

    __add__ = merge

    def to_metrics(self, prefix: str = "stream") -> dict[str, float]:
        """Flat counts: ``{prefix}/{cycle}/{domain}/n``, ``.../correct``, ``.../hist/{k}`` for k < C."""
        _check_prefix(prefix)
        out: dict[str, float] = {}
        for c, d in self.blocks:
            b = self._blocks[(c, d)]
            base = f"{prefix}/{c}/{d}"
            out[f"{base}/n"] = float(b.n)
            out[f"{base}/correct"] = float(b.correct)
            for k, v in enumerate(b.hist):
                out[f"{base}/hist/{k}"] = float(v)
        return out

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any], prefix: str = "stream", num_classes: int | None = None,
                     domains: Sequence[Any] | None = None) -> "StreamRecorder":
        """Rebuild from :meth:`to_metrics` output; keys not under ``prefix/`` are ignored.

        ``num_classes`` defaults to the histogram length found; ``domains`` fixes the domain order
        (default: order of first appearance in ``metrics``).
        """
        _check_prefix(prefix)
        head = prefix + "/"
        parts: dict[tuple[int, str], dict[str, Any]] = {}
        order: list[str] = []
        for key, value in metrics.items():
            if not key.startswith(head):
                continue
            bits = key[len(head):].split("/")
            ok = (len(bits) == 3 and bits[2] in ("n", "correct")) or (len(bits) == 4 and bits[2] == "hist")
            if not ok or not bits[0].isdigit() or (len(bits) == 4 and not bits[3].isdigit()):
                raise ConfigError(f"malformed stream-count key {key!r}; expected "
                                  f"{head}<cycle>/<domain>/(n|correct|hist/<k>)")
            c, d = int(bits[0]), bits[1]
            if d not in order:
                order.append(d)
            slot = parts.setdefault((c, d), {"hist": {}})
            if bits[2] == "hist":
                slot["hist"][int(bits[3])] = value
            else:
                slot[bits[2]] = value
        sizes = {max(s["hist"]) + 1 for s in parts.values() if s["hist"]}
        C = num_classes if num_classes is not None else (max(sizes) if sizes else 2)
        given = [_domain(x) for x in domains or []]
        rec = cls(C, given + [d for d in order if d not in given])
        for (c, d), s in parts.items():
            if "n" not in s or "correct" not in s or sorted(s["hist"]) != list(range(C)):
                raise ConfigError(f"stream counts for block ({c}, {d}) under {prefix!r} are incomplete: need n, "
                                  f"correct and exactly hist/0..{C - 1}")
            rec.add_counts(c, d, s["n"], s["correct"], np.array([s["hist"][k] for k in range(C)]))
        return rec


def _count(v: Any, what: str) -> int:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a non-negative integer count, got {v!r}") from None
    if not math.isfinite(f) or f < 0 or f != round(f):
        raise ConfigError(f"{what} must be a non-negative integer count, got {v!r}")
    return int(round(f))


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not prefix or prefix.startswith("/") or prefix.endswith("/"):
        raise ConfigError(f"stream-count prefix {prefix!r} must be a non-empty name without leading/trailing '/'")


def merge_recorders(recorders: Iterable[StreamRecorder]) -> StreamRecorder:
    """Sum of several recorders (e.g. one per federated client)."""
    it = iter(recorders)
    try:
        out = next(it)
    except StopIteration:
        raise ConfigError("merge_recorders needs at least one recorder") from None
    out = out.merge(StreamRecorder(out.num_classes))
    for r in it:
        out = out.merge(r)
    return out
