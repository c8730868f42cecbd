"""The centralised track's contract: what a registered method gets (:class:`CentralContext`) and returns.

A method is a function registered in :data:`fedsim.registry.CENTRAL` with a typed params dataclass::

    @dataclass
    class WatermarkParams:
        tokens: list[int] = field(default_factory=lambda: [25, 50, 100])

    @CENTRAL.register("watermark", params=WatermarkParams, summary="HeavyWater/SimplexWater ...")
    def run_watermark(ctx: CentralContext) -> dict[str, float]:
        ...                                  # ctx.params is a WatermarkParams
        ctx.log_metrics({"tpr/simplex": 0.93}, step=100)
        ctx.log_table(rows, "tpr_vs_tokens")  # CSV + Markdown artifacts
        ctx.log_figure(fig, "tpr_vs_tokens")  # plots/tpr_vs_tokens.png
        return {"tpr_at_1pct_fpr/simplex": 0.93}   # the headline metrics

and an experiment file ``experiments/<name>.yaml`` with a top-level ``method:`` key, its ``params``
and a ``seed``.  ``fedsim run <name>`` runs it through :func:`fedsim.central_runner.run_central` (one MLflow run: the
config as params and ``config.yaml``, every logged metric, tables and plots, the headline metrics,
``FINISHED``/``FAILED``/``KILLED`` like the federated runs); ``fedsim reproduce <name>`` runs a
claim spec whose ``experiment`` is a centralised one (grid over ``params.*`` keys × seeds) as one
MLflow parent run with nested children, exactly as for federated experiments.

Randomness comes from ``ctx.seed(stream)`` / ``ctx.generator(stream)`` / ``ctx.rng(stream)``, derived
from the root seed, so the same seed gives the same metrics.  Shared kits (LM, image, metrics) live
in ``central/lm``, ``central/image``, ... and are imported by the methods, never copied.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsim import config as C
from fedsim.contracts.history import History, RoundRecord
from fedsim.seeding import derive_seed


@dataclass
class CentralSummary:
    """The outcome of a centralised run (``history`` has one record per logged step)."""

    metrics: dict[str, float]
    history: History
    wall_seconds: float
    run_id: str | None
    tracking_uri: str | None
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


class _Progress:
    """A rich progress bar (or nothing, when quiet); ``advance`` moves it on."""

    def __init__(self, total: int, description: str, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), transient=True)
            self._task = self._bar.add_task(description, total=total)

    def __enter__(self) -> "_Progress":
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)


class CentralContext:
    """What a centralised method gets: typed params, seeds, and the MLflow logging helpers."""

    def __init__(self, cfg: C.CentralConfig, params: Any, recorder: Any, artifact_dir: Path, show_progress: bool) -> None:
        self.cfg = cfg
        self.params = params
        self._recorder = recorder
        self.artifact_dir = artifact_dir
        self.show_progress = show_progress
        self.history = History()
        self.tables: dict[str, list[dict[str, Any]]] = {}
        self._by_step: dict[int, RoundRecord] = {}

    # -- randomness ------------------------------------------------------------------------------
    def seed(self, *stream: str | int) -> int:
        return derive_seed(self.cfg.seed, self.cfg.method, *stream)

    def generator(self, *stream: str | int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed(*stream))

    def rng(self, *stream: str | int) -> np.random.Generator:
        return np.random.default_rng(self.seed(*stream))

    # -- logging -----------------------------------------------------------------------------------
    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        record = self._by_step.get(step)
        if record is None:
            record = self._by_step[step] = RoundRecord(step)
            self.history.records.append(record)
            self.history.records.sort(key=lambda r: r.round)
        record.metrics.update(metrics)
        if self._recorder is not None:
            self._recorder.log_metrics(metrics, step=step)

    def log_params(self, params: dict[str, Any]) -> None:
        if self._recorder is not None:
            self._recorder.log_params(params)

    def log_artifact(self, path: Path, subdir: str | None = None) -> None:
        if self._recorder is not None:
            self._recorder.log_artifact(path, subdir)

    def log_figure(self, fig: Any, name: str) -> Path:
        """Save a matplotlib figure as ``plots/<name>.png`` (and close it)."""
        import matplotlib.pyplot as plt

        path = self.artifact_dir / f"{name}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        self.log_artifact(path, "plots")
        return path

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        """Log rows as ``tables/<name>.csv`` and ``tables/<name>.md``."""
        self.tables[name] = rows
        if not rows:
            return
        cols = list(dict.fromkeys(k for row in rows for k in row))
        with (self.artifact_dir / f"{name}.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=cols)
            writer.writeheader()
            writer.writerows(rows)
        md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        md += ["| " + " | ".join(_fmt(row.get(c, "")) for c in cols) + " |" for row in rows]
        (self.artifact_dir / f"{name}.md").write_text("\n".join(md) + "\n")
        self.log_artifact(self.artifact_dir / f"{name}.csv", "tables")
        self.log_artifact(self.artifact_dir / f"{name}.md", "tables")

    def progress(self, total: int, description: str) -> _Progress:
        return _Progress(total, description, self.show_progress)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
