"""The privacy ledger: per client, what DP-SGD actually ran and the ε it has spent so far.

Clients report, with each training reply, the steps they took, their sampling rate and σ (metrics
``privacy/steps``, ``privacy/sample_rate``, ``privacy/noise_multiplier``).  The server-side
:class:`PrivacyLedger` adds them up and recomputes each client's ε with Opacus' accountant from
the totals, so the logged ε is the accountant's figure for the ledger's steps, rate and σ.  It is a
round observer: it adds ``privacy/epsilon_max`` and ``privacy/epsilon_mean`` (over all clients;
a client that never trained has spent ε = 0) to each round's metrics.
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass
from pathlib import Path

from fedsim.contracts.history import RoundRecord
from privacy.accounting import epsilon_for

STEPS = "privacy/steps"
SAMPLE_RATE = "privacy/sample_rate"
NOISE = "privacy/noise_multiplier"
CLIENT_EPSILON = "privacy/epsilon"
COLUMNS = ("client", "rounds", "steps", "sample_rate", "noise_multiplier", "delta", "epsilon")


@dataclass
class ClientEntry:
    client: int
    rounds: int = 0
    steps: int = 0
    sample_rate: float = 0.0
    noise_multiplier: float = 0.0
    delta: float = 0.0
    epsilon: float = 0.0


class PrivacyLedger:
    """Server-side per-client ledger; an observer of rounds."""

    def __init__(self, num_clients: int, delta: float, accountant: str,
                 charge_every_round: dict[int, tuple[int, float, float]] | None = None) -> None:
        """``charge_every_round`` maps client -> (steps, rate, σ) charged each round whether or not
        the client was sampled: the accounting that amplification by client sampling assumes."""
        self.delta = delta
        self.accountant = accountant
        self.charge_every_round = charge_every_round
        self.entries = {k: ClientEntry(k, delta=delta) for k in range(num_clients)}

    def record(self, client: int, steps: int, sample_rate: float, noise_multiplier: float) -> ClientEntry:
        e = self.entries[client]
        if e.rounds and (e.sample_rate, e.noise_multiplier) != (sample_rate, noise_multiplier):
            raise ValueError(f"client {client} changed its sampling rate or σ mid-run; the ledger assumes both fixed")
        e.rounds += 1
        e.steps += steps
        e.sample_rate, e.noise_multiplier = sample_rate, noise_multiplier
        e.epsilon = epsilon_for(noise_multiplier, sample_rate, e.steps, self.delta, self.accountant)
        return e

    def on_round(self, record: RoundRecord) -> None:
        if self.charge_every_round is not None and record.round > 0:
            for client, (steps, rate, sigma) in sorted(self.charge_every_round.items()):
                self.record(client, steps, rate, sigma)
        else:
            for client, metrics in sorted(record.client_metrics.items()):
                if STEPS in metrics:
                    self.record(client, int(metrics[STEPS]), float(metrics[SAMPLE_RATE]), float(metrics[NOISE]))
        if record.round > 0:
            eps = [e.epsilon for e in self.entries.values()]
            record.metrics["privacy/epsilon_max"] = max(eps)
            record.metrics["privacy/epsilon_mean"] = sum(eps) / len(eps)

    def write_csv(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            for entry in self.entries.values():
                writer.writerow(asdict(entry))
        return path
