"""The server side of federated CKA-RL (NeurIPS 2025, OpenReview ``QRlVickNdN``) and its baselines.

FedAvg over the keys the nodes train in the current task (CKA-RL: the knowledge vector v_k, the
mixing logits beta_k, the critic; the baselines: actor and critic), weighted by environment steps.
Everything else stays global and changes only here: theta_base after task 1, the knowledge-vector
pool and its bookkeeping, the stored per-task copies.  After a task's last round the server pushes
the averaged v_k into the pool and runs Adaptive Knowledge Merging (the most cosine-similar pair
averaged once |V| > K_max) -- on the server, because merging the nodes' pools separately and then
averaging them is not the merge of the averaged pool.  The step itself is
:func:`algorithms.ckarl.node.server_update`, the same function the centralised loop
(:func:`algorithms.ckarl.node.run_stream`) calls, so one node through this strategy reproduces the
centralised run exactly.

The strategy reads the learner's ``client.params`` (the stream length, rounds per task, K_max and
merge options) and serves only the ``ckarl`` learner.  Cross-round state: the global arrays of the
round in flight (``self.current``, an ``ArrayRecord``, so checkpoints save and restore it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from algorithms.ckarl.agent import Method
from algorithms.ckarl.config import RLParams, build_method
from algorithms.ckarl.node import server_update
from fedsim.errors import ConfigError
from fedsim.registry import LEARNERS, STRATEGIES
from fedsim.contracts.strategy import StrategyContext

log = logging.getLogger("fedsim")


class CKARLStrategy(FedAvg):
    """FedAvg of the task's trainable keys, then the server's continual step (see the module docstring)."""

    whole_model_updates = False  # fedsim.contracts.strategy.WHOLE_MODEL_UPDATES

    def __init__(self, *, method: Method, params: RLParams, **fedavg_kwargs) -> None:
        super().__init__(**fedavg_kwargs)
        self.method = method
        self.rl_params = params
        self.current: ArrayRecord | None = None

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.current = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        averaged, metrics = super().aggregate_train(server_round, replies)
        if averaged is None or self.current is None:
            log.warning("ckarl: no training reply in round %d, so the global model (and any end-of-task step) "
                        "is skipped this round", server_round)
            return averaged, metrics
        new = server_update(self.method, self.rl_params, self.current.to_torch_state_dict(),
                            averaged.to_torch_state_dict(), server_round)
        return ArrayRecord(new), metrics


@STRATEGIES.register("ckarl", params=None, summary="CKA-RL server: FedAvg of v_k / beta_k (or the baselines' "
                                                   "actor) + knowledge-pool push and merging on the server")
def build_ckarl(ctx: StrategyContext, params: None) -> CKARLStrategy:
    cfg = ctx.cfg
    if cfg.client.learner != "ckarl":
        raise ConfigError(f"strategy ckarl serves the ckarl learner, got client.learner={cfg.client.learner!r}; "
                          f"use strategy.name=fedavg")
    p: RLParams = LEARNERS.params("ckarl", cfg.client.params, "client.params")
    p.validate()
    return CKARLStrategy(method=build_method(p, cfg.seed), params=p, **ctx.fedavg_kwargs())
