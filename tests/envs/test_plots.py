"""The label-histogram plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from envs.plots import MAX_BARS, plot_label_histogram

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _hist(clients: int, classes: int = 10) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 50, size=(clients, classes))


@pytest.mark.parametrize("clients", [10, MAX_BARS + 30])
def test_plot_writes_a_non_empty_png(tmp_path: Path, clients: int) -> None:
    out = plot_label_histogram(_hist(clients), tmp_path / "sub" / "hist.png", title="test")
    assert out == tmp_path / "sub" / "hist.png"
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 5_000
    pixels = imread(out)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 400
    assert pixels[..., :3].std() > 0.05  # something was drawn, not a blank canvas


def test_bar_chart_grows_with_clients(tmp_path: Path) -> None:
    small = imread(plot_label_histogram(_hist(5), tmp_path / "a.png"))
    big = imread(plot_label_histogram(_hist(40), tmp_path / "b.png"))
    assert big.shape[0] > small.shape[0]


def test_plot_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        plot_label_histogram(np.zeros(5), tmp_path / "x.png")
    with pytest.raises(ValueError):
        plot_label_histogram(_hist(3, 4), tmp_path / "x.png", class_names=["a", "b"])
