"""Per-round records and the observers that receive them (MLflow, progress bar, tests)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


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
    clients_dropped: int = 0  # unavailable (simulated system model)
    stragglers: int = 0  # past the simulated round deadline
    retries: int = 0  # messages resent after a failure
    sim_seconds: float | None = None  # simulated round length (with engine.system)

    def as_metrics(self) -> dict[str, float]:
        """Everything numeric, under the names logged to MLflow."""
        out = dict(self.metrics)
        if self.round > 0:
            out.update({"round/seconds": self.seconds, "round/clients_ok": float(self.clients_ok),
                        "round/clients_failed": float(self.clients_failed)})
            if self.retries:
                out["round/retries"] = float(self.retries)
            if self.sim_seconds is not None:
                out.update({"round/sim_seconds": self.sim_seconds, "round/clients_dropped": float(self.clients_dropped),
                            "round/stragglers": float(self.stragglers)})
        return out

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> "RoundRecord":
        data = dict(data)
        data["client_metrics"] = {int(k): v for k, v in data.get("client_metrics", {}).items()}
        return RoundRecord(**data)


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
