"""Figures for continual and test-time metrics (matplotlib, no pyplot state).

Every function returns a :class:`matplotlib.figure.Figure`; the caller saves it with :func:`save`
or logs it (``MlflowClient.log_figure``). Figures are built with ``Figure()`` directly, so nothing
is registered with pyplot and nothing needs closing. Style follows :mod:`fedsim.plots` (grid alpha
0.3, small legends, dpi 110 when saved).

* :func:`plot_cycle_accuracy` -- accuracy per cycle, one line per method/series, optional thin
  per-domain lines in the series' colour, optional second panel with a collapse diagnostic
  (distinct predicted classes or marginal entropy per cycle).
* :func:`plot_block_accuracy` -- accuracy per (cycle, domain) block over the whole stream:
  x = block index, domain boundaries as faint dashed lines (streams up to 200 blocks), cycles
  shaded alternately.
* :func:`plot_accuracy_matrix` -- the continual accuracy matrix R (tasks × tasks) as an annotated
  heatmap, NaN cells blank.
* :func:`plot_recorders` / :func:`plot_recorder_blocks` -- the first two, fed from
  :class:`~fedsim.metrics.stream.StreamRecorder` objects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from numpy.typing import ArrayLike

from fedsim.errors import ConfigError
from fedsim.metrics.continual import check_matrix
from fedsim.metrics.stream import StreamRecorder

__all__ = [
    "COLLAPSE_KINDS",
    "plot_accuracy_matrix",
    "plot_block_accuracy",
    "plot_cycle_accuracy",
    "plot_recorder_blocks",
    "plot_recorders",
    "save",
]

COLLAPSE_KINDS = {
    "distinct": "distinct predicted classes",
    "entropy": "marginal entropy (nats)",
    "entropy_norm": "marginal entropy / ln C",
}
MAX_BLOCK_TICKS = 40  # label every block with its domain up to this many blocks
MAX_BOUNDARY_LINES = 200  # beyond this many blocks only the cycle shading marks the structure


def _colors(n: int) -> list:
    cycle = matplotlib.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    return [cycle[i % len(cycle)] for i in range(n)]


def _series(values: ArrayLike, what: str) -> np.ndarray:
    try:
        v = np.array(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a 1-D array of numbers") from None
    if v.size == 0:
        raise ConfigError(f"{what} is empty")
    return v


def _check_series(series: Mapping, what: str) -> None:
    if not isinstance(series, Mapping) or not series:
        raise ConfigError(f"{what} must be a non-empty dict name -> values")


def plot_cycle_accuracy(
    series: Mapping[str, ArrayLike],
    cycles: ArrayLike | None = None,
    per_domain: Mapping[str, Mapping[str, ArrayLike]] | None = None,
    collapse: Mapping[str, ArrayLike] | None = None,
    collapse_label: str = COLLAPSE_KINDS["distinct"],
    title: str | None = None,
) -> Figure:
    """Accuracy per cycle per series; thin per-domain lines; optional collapse panel below.

    ``series``: name -> accuracy per cycle. ``cycles``: x values shared by all series (default
    0..n-1 per series). ``per_domain``: name -> {domain -> accuracy per cycle}. ``collapse``: name
    -> diagnostic per cycle (adds a second axis labelled ``collapse_label``).
    """
    _check_series(series, "series")
    names = list(series)
    colors = dict(zip(names, _colors(len(names))))
    x_shared = None if cycles is None else _series(cycles, "cycles")

    def xs(n: int, what: str) -> np.ndarray:
        if x_shared is None:
            return np.arange(n)
        if x_shared.size != n:
            raise ConfigError(f"{what} has {n} cycles but cycles has {x_shared.size}")
        return x_shared

    fig = Figure(figsize=(8, 6.5 if collapse else 4.5))
    axes = fig.subplots(2 if collapse else 1, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    for name in names:
        y = _series(series[name], f"accuracy of {name!r}")
        ax.plot(xs(y.size, f"accuracy of {name!r}"), y, marker="o", markersize=3, lw=1.8,
                color=colors[name], label=name)
    for name, doms in (per_domain or {}).items():
        if name not in colors:
            raise ConfigError(f"per_domain names series {name!r}, which is not in series {names}")
        for dom, vals in doms.items():
            y = _series(vals, f"per-domain accuracy {name!r}/{dom!r}")
            ax.plot(xs(y.size, f"per-domain accuracy {name!r}/{dom!r}"), y, lw=0.6, alpha=0.35,
                    color=colors[name])
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    if collapse:
        ax2 = axes[1]
        for name, vals in collapse.items():
            if name not in colors:
                raise ConfigError(f"collapse names series {name!r}, which is not in series {names}")
            y = _series(vals, f"collapse diagnostic of {name!r}")
            ax2.plot(xs(y.size, f"collapse diagnostic of {name!r}"), y, marker="o", markersize=3,
                     color=colors[name], label=name)
        ax2.set_ylabel(collapse_label)
        ax2.set_ylim(bottom=0)
    axes[-1].set_xlabel("cycle")
    for a in axes:
        a.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_block_accuracy(
    series: Mapping[str, ArrayLike],
    blocks: Sequence[tuple[int, str]],
    title: str | None = None,
) -> Figure:
    """Accuracy per block (x = block index) for each series; domain boundaries and cycles marked.

    ``blocks``: the (cycle, domain) of every block in stream order, e.g. ``StreamRecorder.blocks``.
    Each boundary between blocks is a faint dashed line (up to :data:`MAX_BOUNDARY_LINES` blocks);
    cycles are shaded alternately.
    """
    _check_series(series, "series")
    blocks = [(int(c), str(d)) for c, d in blocks]
    if not blocks:
        raise ConfigError("blocks is empty: pass the (cycle, domain) of every block in stream order")
    n = len(blocks)
    fig = Figure(figsize=(max(8.0, min(0.25 * n, 24.0)), 4.5))
    ax = fig.subplots()
    # alternate shading per cycle: spans of consecutive blocks with the same cycle
    start, k = 0, 0
    for i in range(1, n + 1):
        if i == n or blocks[i][0] != blocks[start][0]:
            if k % 2 == 1:
                ax.axvspan(start - 0.5, i - 0.5, color="0.5", alpha=0.12, lw=0)
            start, k = i, k + 1
    for i in range(1, n if n <= MAX_BOUNDARY_LINES else 0):
        ax.axvline(i - 0.5, color="0.6", lw=0.5, ls="--", alpha=0.5)
    x = np.arange(n)
    for name, color in zip(series, _colors(len(series))):
        y = _series(series[name], f"block accuracy of {name!r}")
        if y.size != n:
            raise ConfigError(f"series {name!r} has {y.size} blocks but blocks has {n}")
        ax.plot(x, y, marker="o" if n <= MAX_BOUNDARY_LINES else None, markersize=2.5, lw=1.2, color=color,
                label=name)
    if n <= MAX_BLOCK_TICKS:
        ax.set_xticks(x, [f"{c}:{d}" for c, d in blocks], rotation=90, fontsize=7)
    else:
        firsts = [i for i in range(n) if i == 0 or blocks[i][0] != blocks[i - 1][0]]
        ax.set_xticks(firsts, [f"c{blocks[i][0]}" for i in firsts], fontsize=7)
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_ylim(0, 1)
    ax.set_xlabel("block (cycle:domain)" if n <= MAX_BLOCK_TICKS else "block (cycle starts marked)")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def plot_accuracy_matrix(
    R: ArrayLike,
    task_names: Sequence[str] | None = None,
    fmt: str = ".2f",
    vmin: float | None = None,
    vmax: float | None = None,
    title: str | None = None,
) -> Figure:
    """Heatmap of R (row = after training task i, column = evaluated task j), NaN cells blank.

    Colour range defaults to [0, 1] when every value lies there, else to the data range.
    """
    a = check_matrix(R)
    T = a.shape[0]
    names = [str(t) for t in (task_names if task_names is not None else range(T))]
    if len(names) != T:
        raise ConfigError(f"{len(names)} task names for a {T}×{T} matrix")
    finite = a[np.isfinite(a)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if vmin is None and vmax is None and lo >= 0.0 and hi <= 1.0:
        vmin, vmax = 0.0, 1.0
    vmin = lo if vmin is None else vmin
    vmax = hi if vmax is None else vmax
    if vmax <= vmin:
        vmax = vmin + 1.0
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    side = max(3.0, 0.7 * T)
    fig = Figure(figsize=(side + 1.8, side + 0.8))
    ax = fig.subplots()
    im = ax.imshow(np.ma.masked_invalid(a), cmap=cmap, vmin=vmin, vmax=vmax)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    mid = (vmin + vmax) / 2.0
    for i in range(T):
        for j in range(T):
            if np.isfinite(a[i, j]):
                ax.text(j, i, format(a[i, j], fmt), ha="center", va="center", fontsize=8,
                        color="white" if a[i, j] < mid else "black")
    ax.set_xticks(range(T), names, fontsize=8)
    ax.set_yticks(range(T), names, fontsize=8)
    ax.set_xlabel("evaluated task j")
    ax.set_ylabel("after training task i")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def _collapse_values(rec: StreamRecorder, kind: str) -> np.ndarray:
    if kind == "distinct":
        return rec.cycle_distinct().astype(np.float64)
    return rec.cycle_entropy(normalized=(kind == "entropy_norm"))


def plot_recorders(
    recorders: Mapping[str, StreamRecorder],
    collapse: str | None = "distinct",
    per_domain: bool = True,
    title: str | None = None,
) -> Figure:
    """:func:`plot_cycle_accuracy` from recorders; ``collapse`` in :data:`COLLAPSE_KINDS` or None.

    The x axis is the cycle number; every recorder must cover the same cycles.
    """
    _check_series(recorders, "recorders")
    if collapse is not None and collapse not in COLLAPSE_KINDS:
        raise ConfigError(f"unknown collapse diagnostic {collapse!r}; use one of {sorted(COLLAPSE_KINDS)} or None")
    cyc = None
    for name, rec in recorders.items():
        if not isinstance(rec, StreamRecorder) or not rec.cycles:
            raise ConfigError(f"recorder {name!r} must be a StreamRecorder with at least one block")
        if cyc is not None and rec.cycles != cyc:
            raise ConfigError(f"recorder {name!r} covers cycles {rec.cycles}, others {cyc}; plot them separately")
        cyc = rec.cycles
    doms = None
    if per_domain:
        doms = {}
        for name, rec in recorders.items():
            m = rec.cycle_domain_accuracy()
            doms[name] = {d: m[:, j] for j, d in enumerate(rec.domains) if np.isfinite(m[:, j]).any()}
    return plot_cycle_accuracy(
        {name: rec.cycle_accuracy() for name, rec in recorders.items()},
        cycles=cyc,
        per_domain=doms,
        collapse=None if collapse is None else {n: _collapse_values(r, collapse) for n, r in recorders.items()},
        collapse_label=COLLAPSE_KINDS.get(collapse or "distinct", ""),
        title=title,
    )


def plot_recorder_blocks(recorders: Mapping[str, StreamRecorder], title: str | None = None) -> Figure:
    """:func:`plot_block_accuracy` from recorders that cover the same blocks."""
    _check_series(recorders, "recorders")
    blocks = None
    for name, rec in recorders.items():
        if not isinstance(rec, StreamRecorder) or not rec.blocks:
            raise ConfigError(f"recorder {name!r} must be a StreamRecorder with at least one block")
        if blocks is not None and rec.blocks != blocks:
            raise ConfigError(f"recorder {name!r} covers different blocks from the others; plot them separately")
        blocks = rec.blocks
    return plot_block_accuracy({n: r.block_accuracy() for n, r in recorders.items()}, blocks, title=title)


def save(fig: Figure, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` (parent folders created) and return the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=dpi)
    return p
