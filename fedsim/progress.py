"""Console feedback: the phases before round 1, a rich progress bar per round and a final summary table."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedsim.contracts.history import History, RoundRecord


class RoundProgress:
    """A progress bar over rounds that shows the latest accuracy and client failures.

    Before round 1 the runner reports its phases (loading data, DP calibration, starting the engine,
    ...) through :meth:`on_phase`: each is printed as one line, ``<seconds since started> s  <phase>``,
    and shown as the bar's status, so a slow start says what it is doing.
    """

    def __init__(self, total_rounds: int, label: str, console: Console, started: float | None = None) -> None:
        """``started`` is the ``time.perf_counter()`` the phase times count from (default: now)."""
        self.started = time.perf_counter() if started is None else started
        self.phases: list[str] = []
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console, transient=False,
        )
        self.task = self.progress.add_task(label, total=total_rounds, status="starting")

    def on_phase(self, name: str) -> None:
        """The run entered phase ``name`` (before round 1)."""
        self.phases.append(name)
        self.progress.console.print(f"[dim]{time.perf_counter() - self.started:6.1f} s[/dim]  {escape(name)}",
                                    highlight=False)
        self.progress.update(self.task, status=f"{escape(name)} …")

    def __enter__(self) -> "RoundProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def on_round(self, record: RoundRecord) -> None:
        m = record.metrics
        parts = []
        if "eval/accuracy" in m:
            parts.append(f"acc {m['eval/accuracy']:.3f}")
        elif "fed_eval/accuracy" in m:
            parts.append(f"fed acc {m['fed_eval/accuracy']:.3f}")
        if "train/loss" in m:
            parts.append(f"loss {m['train/loss']:.3f}")
        if record.clients_failed:
            parts.append(f"[red]{record.clients_failed} failed[/red]")
        self.progress.update(self.task, completed=record.round, status="  ".join(parts))


def summary_table(title: str, history: History, extra: dict[str, str]) -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in sorted(history.final().items()):
        table.add_row(key, f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}")
    failed = sum(r.clients_failed for r in history.records)
    table.add_row("client failures (all rounds)", str(failed))
    for key, value in extra.items():
        table.add_row(key, value)
    return table
