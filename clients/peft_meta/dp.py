"""DP-SGD helpers of the ``lora_meta`` learner: the loss that tallies train diagnostics, and the
context of one task's own DP-SGD run (reptile)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedsim.contracts.learner import NodeContext
from fedsim.seeding import derive_seed


class Tally:
    """The DP loss ``loss(module, (x, y, slot))``: mean cross-entropy over the batch's examples, each
    through its task's adapter slot (a 0-slot model ignores it); counts accuracy and loss on the side
    (train diagnostics, released without DP like every learner's train loss: ``privacy/release.py``)."""

    def __init__(self) -> None:
        self.correct, self.seen, self.rounds = 0, 0, []  # type: ignore[var-annotated]

    def loss_fn(self, module: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y, slot = batch
        logits = module(x, slot)
        with torch.no_grad():
            self.correct += int((logits.argmax(1) == y).sum())
            self.seen += len(y)
        return F.cross_entropy(logits, y, reduction="sum") / max(len(y), 1)  # 0 on an empty Poisson batch

    def add_round(self, mean_loss: float) -> None:
        self.rounds.append(mean_loss)

    @property
    def loss(self) -> float:
        return float(np.mean(self.rounds)) if self.rounds else math.nan

    @property
    def acc(self) -> float:
        return self.correct / self.seen if self.seen else 0.0


@dataclass
class TaskContext(NodeContext):
    """A node's context for one task's DP-SGD run (reptile): its own seeds and a scratch state."""

    task: int = 0

    def seed(self, stream: str) -> int:
        return derive_seed(self.root_seed, stream, self.server_round, self.partition_id, "task", self.task)
