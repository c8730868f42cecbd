"""The server side of a run, written once for every engine.

``run_server(grid, spec, observers)`` is the body of the ServerApp: it discovers the nodes, builds
the strategy from the registry and runs the round loop over a :class:`MonitoredGrid`.  The loop is
Flower's own ``Strategy.start`` sequence (configure_train → send → aggregate_train →
configure_evaluate → send → aggregate_evaluate → centralised evaluation), written out here so that a
run can start at any round: that is what resuming from a checkpoint needs.  A round whose
aggregated global model is not finite fails the run (:class:`RunFailedError`, naming the round).
Closing a round evaluates the global model, builds its :class:`RoundRecord`, re-seeds Python's
``random`` (which Flower's node sampling uses) and NumPy's for the next round, saves a checkpoint
(:mod:`fedsim.engine.checkpoint`) when asked, and only then emits the record to the observers
(MLflow): a kill between the two leaves a checkpoint holding a record MLflow may lack, which a
resume logs (``fedsim.runner``), never a logged round that the resume would play and log again.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid

from fedsim import config as C
from fedsim.engine import checkpoint as ckpt
from fedsim.engine.arrays import resident_arrays
from fedsim.engine.cohort_reply import linear_weighting
from fedsim.engine.grid import MonitoredGrid, finite_array
from fedsim.contracts.history import RoundObserver, RoundRecord
from fedsim.engine.runtime import RunSpec, get_learner, torch_threads
from fedsim.engine.system import SystemModel
from fedsim.errors import ConfigError, RunFailedError
from fedsim.heap import frozen_heap
from fedsim.run_lifecycle import raise_if_terminated
from fedsim.registry import STRATEGIES
from fedsim.seeding import derive_seed

log = logging.getLogger("fedsim")


@dataclass
class ServerResult:
    arrays: dict[str, Any]  # final global state dict (torch tensors)
    records: list[RoundRecord] = field(default_factory=list)


def build_strategy(spec: RunSpec) -> Any:
    """The registered strategy of this run (a Flower ``Strategy``)."""
    from fedsim.contracts.strategy import (
        StrategyContext,  # contract type, not a concrete strategy
    )

    cfg = spec.cfg
    ctx = StrategyContext(cfg, cfg.num_clients)
    params = STRATEGIES.params(cfg.strategy.name, cfg.strategy.params, "strategy.params")
    strategy = STRATEGIES.get(cfg.strategy.name)(ctx, params)
    _fast_metric_aggregation(strategy)
    if cfg.privacy.enabled and cfg.privacy.level == "client":
        from privacy.client_level import wrap_client_level

        strategy = wrap_client_level(strategy, cfg, ctx.train_sample_size)
    return strategy


def _fast_metric_aggregation(strategy: Any) -> None:
    """Flower's default metric aggregation, where a strategy uses it, becomes fedsim's identical one-pass
    twin (:func:`fedsim.engine.records.aggregate_metric_records`)."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

    from fedsim.engine.records import aggregate_metric_records

    for attr in ("train_metrics_aggr_fn", "evaluate_metrics_aggr_fn"):
        if getattr(strategy, attr, None) is aggregate_metricrecords:
            setattr(strategy, attr, aggregate_metric_records)


def required_results(spec: RunSpec, strategy: object | None = None) -> int:
    """Fewest training replies a round may have before the run fails: ``strategy.min_train_results``,
    or more when the strategy cannot aggregate fewer (its ``min_replies``, e.g. Bulyan's 4f+3)."""
    from fedsim.contracts.strategy import MIN_REPLIES, StrategyContext

    cfg = spec.cfg
    sample = StrategyContext(cfg, cfg.num_clients).train_sample_size
    if cfg.strategy.min_train_results > sample:
        raise ConfigError(f"strategy.min_train_results={cfg.strategy.min_train_results} exceeds the "
                          f"{sample} clients sampled per round; lower it or raise strategy.fraction_train")
    return max(cfg.strategy.min_train_results, int(getattr(strategy, MIN_REPLIES, 0) or 0))


def _prefixed(prefix: str, metrics: dict[str, float], rename: dict[str, str] | None = None) -> dict[str, float]:
    """Round means of client metrics; namespaced keys (``privacy/...``) stay per client only."""
    rename = rename or {}
    return {f"{prefix}/{rename.get(k, k)}": float(v) for k, v in metrics.items() if "/" not in k}


def seed_round(seed: int, server_round: int) -> None:
    """Seed the global RNGs that Flower's node sampling and DP wrappers use, for ``server_round``."""
    random.seed(derive_seed(seed, "client-sampling", server_round))
    np.random.seed(derive_seed(seed, "server-noise", server_round) % 2**32)


def play_round(strategy: Any, grid: Grid, server_round: int, arrays: ArrayRecord, timeout: float) -> ArrayRecord:
    """One round of Flower's ``Strategy.start`` loop; returns the new global arrays."""
    replies = grid.send_and_receive(strategy.configure_train(server_round, arrays, ConfigRecord(), grid),
                                    timeout=timeout)
    aggregated, _ = strategy.aggregate_train(server_round, replies)
    if aggregated is not None:
        arrays = resident_arrays(aggregated)
    replies = grid.send_and_receive(strategy.configure_evaluate(server_round, arrays, ConfigRecord(), grid),
                                    timeout=timeout)
    strategy.aggregate_evaluate(server_round, replies)
    return arrays


def check_finite(arrays: ArrayRecord, server_round: int) -> None:
    """Fail the run when the aggregated global model holds a NaN or an infinity."""
    bad = [k for k, a in arrays.items() if not finite_array(a)]
    if bad:
        raise RunFailedError(f"round {server_round}: the aggregated global model is not finite ({bad[0]}"
                             f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}); lower client.lr")


def run_server(grid: Grid, spec: RunSpec, observers: list[RoundObserver], *,
               checkpoints: ckpt.CheckpointDir | None = None, resume: ckpt.Checkpoint | None = None) -> ServerResult:
    """Run the rounds of ``spec`` on ``grid``; from ``resume``'s round when given.

    With ``checkpoints`` the server state is saved there after every round; it needs a grid that
    keeps its nodes' contexts on the server side (``grid.contexts``: the local and ray engines).
    """
    cfg = spec.cfg
    strategy = build_strategy(spec)
    learner = get_learner(spec)
    system = SystemModel(cfg.engine.system, cfg.seed, learner.local_work) if cfg.engine.system.enabled else None
    monitored = MonitoredGrid(grid, required_results(spec, strategy), query_timeout=cfg.engine.round_timeout_s,
                              system=system, retries=cfg.engine.retries)
    monitored.combine_key = linear_weighting(strategy)  # FedAvg's mean: one combined training reply per round
    monitored.discover(cfg.num_clients)
    contexts = getattr(grid, "contexts", None)
    if checkpoints is not None and contexts is None:
        raise ConfigError(f"engine {cfg.engine.name!r} keeps no node state on the server, so it cannot checkpoint; "
                          f"use engine.name=local or ray, or set engine.checkpoint=false")
    records: list[RoundRecord] = []

    def save(server_round: int, arrays: ArrayRecord) -> None:
        assert checkpoints is not None
        checkpoints.save(ckpt.Checkpoint(
            round=server_round, config_yaml=spec.config_yaml, arrays=arrays.to_torch_state_dict(),
            strategy_state=ckpt.strategy_state(strategy), node_states=ckpt.node_states(contexts or {}),
            rng=ckpt.rng_states(), records=list(records)))

    close_round = _round_closer(spec, monitored, records, observers, save if checkpoints is not None else None)

    if resume is None:
        with torch_threads(cfg.engine.threads_per_client):
            arrays = ArrayRecord(learner.init_arrays())
        close_round(0, arrays)
        first = 1
    else:
        arrays = ArrayRecord(resume.arrays)
        ckpt.restore_strategy_state(strategy, resume.strategy_state)
        if contexts is not None:
            ckpt.restore_node_states(contexts, resume.node_states)
        records.extend(resume.records)
        ckpt.restore_rng_states(resume.rng)
        first = resume.round + 1

    with frozen_heap():
        for server_round in range(first, cfg.rounds + 1):
            arrays = play_round(strategy, monitored, server_round, arrays, cfg.engine.round_timeout_s)
            check_finite(arrays, server_round)
            close_round(server_round, arrays)
            raise_if_terminated()  # a SIGTERM whose exception the interpreter swallowed (run_lifecycle)
    return ServerResult(arrays.to_torch_state_dict(), records)


def evaluates_at(cfg: C.ExperimentConfig, server_round: int) -> bool:
    """Whether the server evaluates after ``server_round`` (``evaluation.every``; round 0 and the last always)."""
    return server_round % cfg.evaluation.every == 0 or server_round == cfg.rounds


def _round_closer(spec: RunSpec, monitored: MonitoredGrid, records: list[RoundRecord], observers: list[RoundObserver],
                  save: Callable[[int, ArrayRecord], None] | None) -> Callable[[int, ArrayRecord], None]:
    """The end of a round: evaluate, record, seed the next round, checkpoint, then notify the observers."""
    cfg = spec.cfg

    def close_round(server_round: int, arrays: ArrayRecord) -> None:
        tally = monitored.tally
        metrics: dict[str, float] = {}
        metrics.update(_prefixed("train", tally.train_metrics, {"train_loss": "loss"}))
        metrics.update(_prefixed("fed_eval", tally.eval_metrics))
        if cfg.evaluation.server and evaluates_at(cfg, server_round):
            with torch_threads(cfg.engine.threads_per_client):
                # looked up each round: an engine may replace the learner (after an abandoned call)
                evaluated = get_learner(spec).evaluate_global(arrays.to_torch_state_dict())
                metrics.update(_prefixed("eval", evaluated))
                metrics.update({k: float(v) for k, v in evaluated.items() if k.startswith("val/")})  # validation split
        seconds = time.perf_counter() - tally.started if tally.started is not None else 0.0
        record = RoundRecord(server_round, metrics, seconds, tally.train_ok, tally.train_failed + tally.eval_failed,
                             list(tally.failures), dict(tally.client_train_metrics),
                             clients_dropped=tally.dropped, stragglers=tally.stragglers, retries=tally.retried,
                             sim_seconds=tally.sim_seconds if monitored.system is not None and server_round else None)
        for failure in tally.failures:
            log.warning("round %d: client failure: %s", server_round, failure)
        records.append(record)
        seed_round(cfg.seed, server_round + 1)
        if save is not None and server_round > 0:
            save(server_round, arrays)  # before the observers: see the module docstring
        for obs in observers:
            obs.on_round(record)
        monitored.begin_round()

    return close_round
