"""The server side of a run, written once for every engine.

``run_server(grid, spec, observers)`` is the body of the ServerApp: it discovers the nodes, builds
the strategy from the registry, and runs Flower's own ``Strategy.start`` round loop over a
:class:`MonitoredGrid`.  The centralised-evaluation callback that ``start`` calls after every round
closes the round: it evaluates the global model, emits a :class:`RoundRecord` to the observers and
re-seeds Python's ``random`` (which Flower's node sampling uses) for the next round.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid

from fedsim.engine.grid import MonitoredGrid
from fedsim.engine.history import RoundObserver, RoundRecord
from fedsim.engine.runtime import RunSpec, get_learner, torch_threads
from fedsim.errors import ConfigError
from fedsim.registry import STRATEGIES
from fedsim.seeding import derive_seed

log = logging.getLogger("fedsim")


@dataclass
class ServerResult:
    arrays: dict[str, Any]  # final global state dict (torch tensors)
    records: list[RoundRecord] = field(default_factory=list)


def build_strategy(spec: RunSpec) -> Any:
    """The registered strategy of this run (a Flower ``Strategy``)."""
    from strategies.base import (
        StrategyContext,  # contract type, not a concrete strategy
    )

    cfg = spec.cfg
    ctx = StrategyContext(cfg, cfg.num_clients)
    params = STRATEGIES.params(cfg.strategy.name, cfg.strategy.params, "strategy.params")
    strategy = STRATEGIES.get(cfg.strategy.name)(ctx, params)
    if cfg.privacy.enabled and cfg.privacy.level == "client":
        from privacy.client_level import wrap_client_level

        strategy = wrap_client_level(strategy, cfg, ctx.train_sample_size)
    return strategy


def required_results(spec: RunSpec) -> int:
    """Fewest training replies a round may have before the run fails."""
    from strategies.base import StrategyContext

    cfg = spec.cfg
    sample = StrategyContext(cfg, cfg.num_clients).train_sample_size
    if cfg.strategy.min_train_results > sample:
        raise ConfigError(f"strategy.min_train_results={cfg.strategy.min_train_results} exceeds the "
                          f"{sample} clients sampled per round; lower it or raise strategy.fraction_train")
    return cfg.strategy.min_train_results


def _prefixed(prefix: str, metrics: dict[str, float], rename: dict[str, str] | None = None) -> dict[str, float]:
    """Round means of client metrics; namespaced keys (``privacy/...``) stay per client only."""
    rename = rename or {}
    return {f"{prefix}/{rename.get(k, k)}": float(v) for k, v in metrics.items() if "/" not in k}


def run_server(grid: Grid, spec: RunSpec, observers: list[RoundObserver]) -> ServerResult:
    cfg = spec.cfg
    strategy = build_strategy(spec)
    monitored = MonitoredGrid(grid, required_results(spec), query_timeout=cfg.engine.round_timeout_s)
    monitored.discover(cfg.num_clients)
    learner = get_learner(spec)
    with torch_threads(cfg.engine.threads_per_client):
        initial = learner.init_arrays()
    records: list[RoundRecord] = []

    def close_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        tally = monitored.tally
        metrics: dict[str, float] = {}
        metrics.update(_prefixed("train", tally.train_metrics, {"train_loss": "loss"}))
        metrics.update(_prefixed("fed_eval", tally.eval_metrics))
        server_metrics: dict[str, float] = {}
        if cfg.evaluation.server:
            with torch_threads(cfg.engine.threads_per_client):
                server_metrics = learner.evaluate_global(arrays.to_torch_state_dict())
            metrics.update(_prefixed("eval", server_metrics))
        seconds = time.perf_counter() - tally.started if tally.started is not None else 0.0
        record = RoundRecord(server_round, metrics, seconds, tally.train_ok, tally.train_failed + tally.eval_failed,
                             list(tally.failures), dict(tally.client_train_metrics))
        for failure in tally.failures:
            log.warning("round %d: client failure: %s", server_round, failure)
        records.append(record)
        for obs in observers:
            obs.on_round(record)
        random.seed(derive_seed(cfg.seed, "client-sampling", server_round + 1))
        np.random.seed(derive_seed(cfg.seed, "server-noise", server_round + 1) % 2**32)  # Flower's DP wrappers
        monitored.begin_round()
        return MetricRecord(server_metrics) if server_metrics else None

    result = strategy.start(
        grid=monitored,
        initial_arrays=ArrayRecord(initial),
        num_rounds=cfg.rounds,
        timeout=cfg.engine.round_timeout_s,
        train_config=ConfigRecord({}),
        evaluate_config=ConfigRecord({}),
        evaluate_fn=close_round,
    )
    final = result.arrays if result.arrays is not None and len(result.arrays) else ArrayRecord(initial)
    return ServerResult(final.to_torch_state_dict(), records)
