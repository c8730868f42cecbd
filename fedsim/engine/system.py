"""Simulated system heterogeneity: client speeds, availability and a round deadline.

Real federations have slow devices and devices that vanish.  With ``engine.system.enabled`` every
client gets a fixed, seeded speed factor ``s_k ~ LogNormal(0, speed_sigma)`` (median 1), and a round
of local work takes ``work_k * seconds_per_step / s_k + latency_s`` *simulated* seconds, where
``work_k`` is the learner's :meth:`~fedsim.contracts.learner.Learner.local_work` (its local optimiser steps).
Each sampled client is unavailable in a round with probability ``dropout`` (a seeded draw per round
and client).  With ``deadline_s`` set, replies that would arrive after the deadline are stragglers:
the strategy never sees them, and since the outcome is known before training they are not computed
at all.  A round lasts ``max`` over the replies that arrive, or the whole deadline when a client
straggles or vanishes (the server cannot tell which);
``round/sim_seconds`` is logged beside the wall-clock ``round/seconds``.

The model is deterministic given the root seed, so every engine drops exactly the same clients, and
the tests can ask :meth:`SystemModel.plan` which ones those are.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

from fedsim.config import SystemConfig
from fedsim.seeding import derive_seed


@dataclass
class RoundPlan:
    """Who, among a round's sampled clients, replies in time (partition ids)."""

    in_time: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)  # unavailable this round
    stragglers: list[int] = field(default_factory=list)  # would miss the deadline
    durations: dict[int, float] = field(default_factory=dict)  # simulated seconds of each available client
    sim_seconds: float = 0.0  # simulated length of the round


class SystemModel:
    """Seeded per-client speed and availability; ``plan`` decides a round's outcome."""

    def __init__(self, cfg: SystemConfig, root_seed: int, local_work: Callable[[int], float]) -> None:
        self.cfg = cfg
        self.root_seed = root_seed
        self.local_work = local_work
        self._speeds: dict[int, float] = {}

    def speed(self, partition_id: int) -> float:
        """The client's fixed speed factor (1 = median device)."""
        if partition_id not in self._speeds:
            rng = random.Random(derive_seed(self.root_seed, "system-speed", partition_id))
            self._speeds[partition_id] = math.exp(rng.gauss(0.0, self.cfg.speed_sigma)) if self.cfg.speed_sigma else 1.0
        return self._speeds[partition_id]

    def available(self, partition_id: int, server_round: int) -> bool:
        if self.cfg.dropout <= 0:
            return True
        rng = random.Random(derive_seed(self.root_seed, "system-dropout", server_round, partition_id))
        return rng.random() >= self.cfg.dropout

    def duration(self, partition_id: int) -> float:
        """Simulated seconds of one round of local work (training plus latency)."""
        return self.local_work(partition_id) * self.cfg.seconds_per_step / self.speed(partition_id) + self.cfg.latency_s

    def plan(self, partition_ids: list[int], server_round: int) -> RoundPlan:
        plan = RoundPlan()
        deadline = self.cfg.deadline_s
        for pid in partition_ids:
            if not self.available(pid, server_round):
                plan.dropped.append(pid)
                continue
            plan.durations[pid] = d = self.duration(pid)
            (plan.stragglers if deadline is not None and d > deadline else plan.in_time).append(pid)
        arrived = [plan.durations[p] for p in plan.in_time]
        # the server cannot tell a vanished client from a slow one: it waits until the deadline for either
        waited = deadline is not None and (plan.stragglers or plan.dropped)
        plan.sim_seconds = float(deadline) if waited else max(arrived, default=0.0)  # type: ignore[arg-type]
        return plan
