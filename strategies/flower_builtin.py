"""Flower's own Message-API strategies, registered for use from experiment YAML."""

from __future__ import annotations

from flwr.serverapp.strategy import FedAvg

from fedsim.registry import STRATEGIES
from fedsim.contracts.strategy import StrategyContext


@STRATEGIES.register("fedavg", summary="Flower's FedAvg (McMahan et al., 2017), sample-size weighted")
def build_fedavg(ctx: StrategyContext, params: None) -> FedAvg:
    return FedAvg(**ctx.fedavg_kwargs())
