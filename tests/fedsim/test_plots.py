"""The learning-curve plot every run logs: a long run with many series draws without layout warnings."""

from __future__ import annotations

import warnings

from fedsim.contracts.history import History, RoundRecord
from fedsim.plots import plot_learning_curves


def test_a_long_run_with_many_series_plots_without_a_layout_warning(tmp_path) -> None:
    keys = [f"tta/cycle/{i}/accuracy" for i in range(130)] + ["train/loss", "eval/loss"]  # a 50-cycle TTA run
    history = History([RoundRecord(r, {k: 0.5 + 0.001 * r for k in keys}) for r in range(700)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tight_layout's "not applied" warning was raised here
        path = plot_learning_curves(history, tmp_path / "curves.png", "a long title " * 12)
    assert path.stat().st_size > 0
