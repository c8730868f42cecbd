"""Flower's own Message-API strategies, registered for use from experiment YAML."""

from __future__ import annotations

from flwr.serverapp.strategy import FedAvg

from fedsim.registry import STRATEGIES
from strategies.base import StrategyContext


@STRATEGIES.register("fedavg", summary="Flower's FedAvg (McMahan et al., 2017), sample-size weighted")
def build_fedavg(ctx: StrategyContext, params: None) -> FedAvg:
    """``min_*_nodes`` are the intended sample sizes, so round 1 never samples too few nodes."""
    s = ctx.cfg.strategy
    return FedAvg(
        fraction_train=s.fraction_train,
        fraction_evaluate=s.fraction_evaluate,
        min_train_nodes=ctx.train_sample_size,
        min_evaluate_nodes=ctx.evaluate_sample_size,
        min_available_nodes=ctx.num_clients,
    )
