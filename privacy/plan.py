"""Per-client DP-SGD plan: sampling rate, steps per round, and the noise multiplier σ.

σ is calibrated per client so that the client's ε stays ≤ ``privacy.epsilon`` for the whole run
under the assumption that it takes part in every round (steps = rounds × steps per round).  A
client's sampling rate depends on its dataset size, so σ differs between clients; the ledger
records each client's own σ.  The FedSVD authors fold the client-sampling fraction into the rate;
that is not a sound bound (a client takes part in whole rounds, and Flower samples clients without
replacement), so it is not offered: the rate is the loader's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsim.config import ExperimentConfig
from fedsim.contracts.learner import local_steps
from fedsim.errors import ConfigError
from privacy.accounting import calibrate_noise, poisson_sample_rate


@dataclass(frozen=True)
class ClientPrivacyPlan:
    num_examples: int
    loader_rate: float  # Opacus' Poisson rate of the client's loader, 1/⌈n/B⌉
    accounting_rate: float  # the rate the ledger accounts with (the loader's: no client-sampling amplification)
    steps_per_round: int
    total_steps: int
    noise_multiplier: float


def plan_client(partition_id: int, num_examples: int, cfg: ExperimentConfig) -> ClientPrivacyPlan:
    p = cfg.privacy
    if num_examples < 1:
        raise ConfigError(f"privacy: client {partition_id} has no training examples; use fewer clients")
    if p.delta >= 1.0 / num_examples:
        raise ConfigError(f"privacy.delta={p.delta:g} is not below 1/n = {1 / num_examples:.3g} for client "
                          f"{partition_id} ({num_examples} examples); lower privacy.delta")
    loader_rate = poisson_sample_rate(num_examples, cfg.client.batch_size)
    rate = loader_rate
    per_round = local_steps(num_examples, cfg)
    total = cfg.rounds * per_round
    if p.noise_multiplier is not None:
        sigma = float(p.noise_multiplier)
    else:
        assert p.epsilon is not None
        sigma = calibrate_noise(float(p.epsilon), p.delta, rate, total, p.accountant)
    return ClientPrivacyPlan(num_examples, loader_rate, rate, per_round, total, sigma)
