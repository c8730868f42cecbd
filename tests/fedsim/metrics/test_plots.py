"""Figures: structure (axes, lines, shading, annotations), not pixels."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure

from fedsim.errors import ConfigError
from fedsim.metrics import plots as mp
from fedsim.metrics.stream import StreamRecorder


def _recorder(acc_by_cycle, domains=("a", "b"), n=10, C=3):
    r = StreamRecorder(C, domains=list(domains))
    for c, accs in enumerate(acc_by_cycle):
        for d, a in zip(domains, accs):
            k = int(round(a * n))
            r.record(c, d, np.zeros(n, dtype=int), np.r_[np.zeros(k, int), np.ones(n - k, int)])
    return r


def test_cycle_accuracy_lines_and_collapse_panel():
    series = {"tent": [0.6, 0.5, 0.4], "source": [0.5, 0.5, 0.5]}
    per_domain = {"tent": {"a": [0.7, 0.6, 0.5], "b": [0.5, 0.4, 0.3]}, "source": {"a": [0.5] * 3, "b": [0.5] * 3}}
    fig = mp.plot_cycle_accuracy(series, per_domain=per_domain, collapse={"tent": [3, 2, 1], "source": [3, 3, 3]},
                                 title="cycles")
    assert isinstance(fig, Figure)
    ax, ax2 = fig.axes
    assert len(ax.lines) == 2 + 4 and len(ax2.lines) == 2
    np.testing.assert_allclose(ax.lines[0].get_ydata(), series["tent"])
    assert ax.lines[0].get_color() == ax.lines[2].get_color()  # domain lines share the series colour
    assert ax2.get_ylabel() == "distinct predicted classes"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["tent", "source"]
    one = mp.plot_cycle_accuracy(series, cycles=[1, 2, 3])
    assert len(one.axes) == 1 and len(one.axes[0].lines) == 2
    np.testing.assert_allclose(one.axes[0].lines[0].get_xdata(), [1, 2, 3])


def test_cycle_accuracy_validation():
    with pytest.raises(ConfigError):
        mp.plot_cycle_accuracy({})
    with pytest.raises(ConfigError, match="not in series"):
        mp.plot_cycle_accuracy({"a": [0.1]}, collapse={"b": [1]})
    with pytest.raises(ConfigError, match="cycles"):
        mp.plot_cycle_accuracy({"a": [0.1, 0.2]}, cycles=[0, 1, 2])


def test_block_accuracy_boundaries_and_cycle_shading():
    blocks = [(c, d) for c in range(3) for d in ("a", "b")]
    fig = mp.plot_block_accuracy({"m1": np.linspace(0.9, 0.4, 6), "m2": np.full(6, 0.5)}, blocks)
    ax = fig.axes[0]
    data_lines = [ln for ln in ax.lines if ln.get_label() in ("m1", "m2")]
    assert len(data_lines) == 2
    boundaries = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
    assert len(boundaries) == 5  # between 6 blocks
    assert len(ax.patches) == 1  # cycles 0, 1, 2: only the middle one shaded
    assert [t.get_text() for t in ax.get_xticklabels()][:2] == ["0:a", "0:b"]
    with pytest.raises(ConfigError, match="blocks"):
        mp.plot_block_accuracy({"m": [0.5, 0.5]}, blocks)
    many = [(c, d) for c in range(3) for d in range(70)]  # 210 blocks: shading only, cycle ticks
    ax = mp.plot_block_accuracy({"m": np.full(210, 0.5)}, many).axes[0]
    assert not [ln for ln in ax.lines if ln.get_linestyle() == "--"] and len(ax.patches) == 1
    assert [t.get_text() for t in ax.get_xticklabels()] == ["c0", "c1", "c2"]


def test_accuracy_matrix_heatmap_annotations():
    R = np.array([[0.8, np.nan, np.nan], [0.6, 0.7, np.nan], [0.5, 0.6, 0.9]])
    fig = mp.plot_accuracy_matrix(R, task_names=["t0", "t1", "t2"])
    ax = fig.axes[0]
    texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
    expected = {(i, j): f"{R[i, j]:.2f}" for i in range(3) for j in range(3) if np.isfinite(R[i, j])}
    assert texts == expected  # NaN cells are not annotated
    img = ax.images[0]
    assert img.get_array().mask.sum() == 3
    assert img.get_clim() == (0.0, 1.0)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["t0", "t1", "t2"]
    returns = mp.plot_accuracy_matrix(np.array([[10.0, 3.0], [2.0, 20.0]]), fmt=".0f")
    assert returns.axes[0].images[0].get_clim() == (2.0, 20.0)
    assert sorted(t.get_text() for t in returns.axes[0].texts) == ["10", "2", "20", "3"]


def test_from_recorders():
    recs = {"tent": _recorder([[0.8, 0.6], [0.6, 0.4], [0.3, 0.1]]), "bn": _recorder([[0.5, 0.5]] * 3)}
    fig = mp.plot_recorders(recs, collapse="entropy")
    ax, ax2 = fig.axes
    assert len(ax.lines) == 2 + 4 and len(ax2.lines) == 2
    np.testing.assert_allclose(ax.lines[0].get_ydata(), [0.7, 0.5, 0.2])
    assert ax2.get_ylabel() == mp.COLLAPSE_KINDS["entropy"]
    assert len(mp.plot_recorders(recs, collapse=None, per_domain=False).axes[0].lines) == 2
    blocks = mp.plot_recorder_blocks(recs)
    assert len([ln for ln in blocks.axes[0].lines if ln.get_label() in recs]) == 2
    with pytest.raises(ConfigError, match="collapse"):
        mp.plot_recorders(recs, collapse="gini")
    with pytest.raises(ConfigError, match="cycles"):
        mp.plot_recorders({"a": recs["tent"], "b": _recorder([[0.5, 0.5]])})


def test_save_writes_png(tmp_path):
    fig = mp.plot_accuracy_matrix(np.eye(2))
    out = mp.save(fig, tmp_path / "sub" / "R.png")
    assert out == tmp_path / "sub" / "R.png" and out.stat().st_size > 1000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
