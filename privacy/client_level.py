"""Client-level DP: Flower's ``DifferentialPrivacyServerSideFixedClipping`` around the strategy.

Each sampled client's model update is clipped to ``privacy.update_clipping_norm`` (C) on the
server, the updates are averaged **uniformly** (the Gaussian mechanism's sensitivity C/m needs equal
weights, so the wrapped FedAvg weighs by a unit key every reply carries), and Gaussian noise of std
σ·C/m is added to the average (McMahan et al., "Learning Differentially Private Recurrent Language
Models", 2018).  One round is one Gaussian-mechanism step at the client level.

Accounting (the ledger charges every client every round, since any client may be sampled):
without amplification by client sampling (sampling rate 1, as Flower's own fixed-clipping
accountant requires; Flower samples m of N clients without replacement, which a Poisson-rate
accountant does not model).  σ is calibrated so that ε ≤ ``privacy.epsilon`` after all rounds.

Only strategies whose replies carry the whole model and that send every client the same model fit
this wrapper (FedAvg, FedProx, FedPhoenix); the LoRA strategies (partial replies) and FedMut
(per-client models) are rejected with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedsim.config import ExperimentConfig
from fedsim.contracts.strategy import MEAN_AGGREGATION, WHOLE_MODEL_UPDATES, declares
from fedsim.contracts.wire import UNIT_WEIGHT
from fedsim.errors import ConfigError
from privacy.accounting import calibrate_noise


@dataclass(frozen=True)
class ClientLevelPlan:
    noise_multiplier: float
    sample_rate: float  # accounting rate: 1 (no amplification by client sampling)
    sampled_per_round: int


def plan_client_level(cfg: ExperimentConfig, sampled_per_round: int) -> ClientLevelPlan:
    p = cfg.privacy
    if p.delta >= 1.0 / cfg.num_clients:
        raise ConfigError(f"privacy.delta={p.delta:g} is not below 1/N = {1 / cfg.num_clients:.3g} for "
                          f"{cfg.num_clients} clients (client-level DP); lower privacy.delta")
    rate = 1.0
    if p.noise_multiplier is not None:
        sigma = float(p.noise_multiplier)
    else:
        assert p.epsilon is not None
        sigma = calibrate_noise(float(p.epsilon), p.delta, rate, cfg.rounds, p.accountant)
    return ClientLevelPlan(sigma, rate, sampled_per_round)


def wrap_client_level(strategy: Any, cfg: ExperimentConfig, sampled_per_round: int) -> Any:
    """Wrap ``strategy`` in Flower's server-side fixed-clipping DP strategy."""
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

    if not isinstance(strategy, FedAvg) or not declares(strategy, WHOLE_MODEL_UPDATES):
        raise ConfigError(f"privacy.level=client needs a strategy that sends one model and receives whole "
                          f"models (fedavg, fedprox, fedphoenix); {cfg.strategy.name!r} does not")
    if not declares(strategy, MEAN_AGGREGATION):
        raise ConfigError(f"privacy.level=client calibrates its noise for the uniform mean of the clipped updates "
                          f"(fedavg, fedprox, fedphoenix); strategy {cfg.strategy.name!r} aggregates otherwise, so "
                          f"the noise would not give the stated epsilon; use privacy.level=sample or "
                          f"strategy.name=fedavg")
    strategy.weighted_by_key = UNIT_WEIGHT
    plan = plan_client_level(cfg, sampled_per_round)
    return DifferentialPrivacyServerSideFixedClipping(strategy, noise_multiplier=plan.noise_multiplier,
                                                      clipping_norm=cfg.privacy.update_clipping_norm,
                                                      num_sampled_clients=sampled_per_round)
