"""Per-round records and the observers that receive them (MLflow, progress bar, tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class RoundRecord:
    """What happened in one round. Round 0 holds the evaluation of the initial model."""

    round: int
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. train/loss, eval/accuracy
    seconds: float = 0.0
    clients_ok: int = 0
    clients_failed: int = 0
    failures: list[str] = field(default_factory=list)  # one line per failed client reply
    client_metrics: dict[int, dict[str, float]] = field(default_factory=dict)  # train metrics by partition

    def as_metrics(self) -> dict[str, float]:
        """Everything numeric, under the names logged to MLflow."""
        out = dict(self.metrics)
        if self.round > 0:
            out.update({"round/seconds": self.seconds, "round/clients_ok": float(self.clients_ok),
                        "round/clients_failed": float(self.clients_failed)})
        return out


class RoundObserver(Protocol):
    def on_round(self, record: RoundRecord) -> None: ...


@dataclass
class History:
    """The ordered records of a run; an observer itself."""

    records: list[RoundRecord] = field(default_factory=list)

    def on_round(self, record: RoundRecord) -> None:
        self.records.append(record)

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(r.round, r.as_metrics()[key]) for r in self.records if key in r.as_metrics()]

    def final(self) -> dict[str, float]:
        return self.records[-1].as_metrics() if self.records else {}

    def as_rows(self) -> list[dict[str, float]]:
        """Comparable plain data (used by the determinism tests); seconds excluded."""
        return [{k: v for k, v in {"round": float(r.round), **r.as_metrics()}.items() if k != "round/seconds"}
                for r in self.records]
