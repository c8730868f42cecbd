"""What a strategy builder receives (the experiment and the sample sizes the engine will use), and the
capabilities a strategy class may declare.

A strategy class may set, as a class attribute:

* :data:`WHOLE_MODEL_UPDATES` (``whole_model_updates``, default True for Flower's FedAvg family):
  every client receives the same model and replies with all of it, so server-side client-level DP
  (clip each update, average uniformly, add noise) applies.  The LoRA strategies (partial
  replies), FedMut (per-client models) and CKA-RL set it False.
* :data:`MEAN_AGGREGATION` (``mean_aggregation``, default True): ``aggregate_train`` returns the
  weighted mean of the replies and nothing else, so with unit weights it is the uniform mean whose
  sensitivity (C/m for updates clipped to C) client-level DP's noise is calibrated for.  Robust
  aggregators (median, trimmed mean, Krum, Bulyan), server optimisers (FedAdam, FedAvgM ...) and
  loss-weighted QFedAvg set it False.
* :data:`MIN_REPLIES` (``min_replies``, default 0, an int on the instance): the fewest training
  replies the strategy can aggregate (Krum 2f+3, Bulyan 4f+3).  Flower's robust strategies skip
  aggregation with only a warning below it, keeping the old model; the engine instead fails the
  round like any other shortfall of ``strategy.min_train_results``.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsim.config import ExperimentConfig


WHOLE_MODEL_UPDATES = "whole_model_updates"
MEAN_AGGREGATION = "mean_aggregation"
MIN_REPLIES = "min_replies"


def declares(strategy: object, capability: str, default: bool = True) -> bool:
    """Whether ``strategy`` declares ``capability`` (a class attribute named above)."""
    return bool(getattr(strategy, capability, default))


@dataclass(frozen=True)
class StrategyContext:
    cfg: ExperimentConfig
    num_clients: int

    @property
    def train_sample_size(self) -> int:
        """Clients per training round, computed as Flower's FedAvg does (at least 1)."""
        return max(1, int(self.num_clients * self.cfg.strategy.fraction_train))

    @property
    def evaluate_sample_size(self) -> int:
        if self.cfg.strategy.fraction_evaluate == 0.0:
            return 0
        return max(1, int(self.num_clients * self.cfg.strategy.fraction_evaluate))

    def fedavg_kwargs(self) -> dict[str, float | int]:
        """Sampling arguments of Flower's FedAvg family; ``min_*_nodes`` are the intended sample
        sizes, so round 1 never samples too few nodes while clients register."""
        s = self.cfg.strategy
        return dict(fraction_train=s.fraction_train, fraction_evaluate=s.fraction_evaluate,
                    min_train_nodes=self.train_sample_size, min_evaluate_nodes=self.evaluate_sample_size,
                    min_available_nodes=self.num_clients)
