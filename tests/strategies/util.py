"""Small shared helpers of the strategy tests: a tiny config, a stub grid, a manual round loop."""

from __future__ import annotations

import random
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord

from fedsim import config as C
from fedsim.seeding import derive_seed

#: digits (8x8 images), a CNN with 8 and 16 filters, 3 local steps: a round takes milliseconds.
TINY = ("model.name=cnn", "model.params={channels: [8, 16], hidden: 16}", "client.local_steps=3",
        "data.partition.name=iid", "strategy.fraction_evaluate=0.0")


def tiny_cfg(strategy: str, *overrides: str, rounds: int = 4, clients: int = 4) -> C.ExperimentConfig:
    cfg = C.load_config("fedavg_digits", [*TINY, f"strategy.name={strategy}", *overrides],
                        {"rounds": rounds, "clients": clients})
    cfg.tracking.enabled = False
    return cfg


class StubGrid:
    """The part of a Grid that ``configure_train`` uses: the canonical node list."""

    def __init__(self, node_ids: list[int]) -> None:
        self.node_ids = list(node_ids)

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


def one_round(strategy: Any, server_round: int, arrays: ArrayRecord, grid: Any, seed: int) -> ArrayRecord:
    """One training round as ``Strategy.start`` runs it, with the engine's seeding of the sampling."""
    random.seed(derive_seed(seed, "client-sampling", server_round))
    replies = grid.send_and_receive(strategy.configure_train(server_round, arrays, ConfigRecord({}), grid))
    new, _ = strategy.aggregate_train(server_round, replies)
    return new


def rows_without(rows: list[dict[str, float]], *prefixes: str) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if not k.startswith(prefixes)} for r in rows]
